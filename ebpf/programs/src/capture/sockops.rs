//! `sockops`: when a connection is established, move a redirected connection's
//! original destination from its socket cookie to its 4-tuple (which is all Envoy's
//! getsockopt can see), and register local socket pairs for sk_msg. Envoy's ends of
//! connections (accepted on its capture ports) are watched until they close, when the
//! original destination Envoy did not ask for goes.

use aya_ebpf::{EbpfContext as _, macros::sock_ops, programs::SockOpsContext};
use weir_ebpf_common::capture::{MAX_GUARDED_LISTENERS_PER_POD, PairKey, counter, flags};

use crate::{
    maps::{
        self, INBOUND_PORTS, LISTENER_COUNTS, LISTENERS, ORIG_BY_COOKIE, ORIG_BY_PAIR, POD_CONFIG, SOCK_PAIRS,
    },
    net::{self, AF_INET, AF_INET6, field},
};

const ACTIVE_ESTABLISHED_CB: u32 = 4;
const PASSIVE_ESTABLISHED_CB: u32 = 5;
const STATE_CB: u32 = 10;
const TCP_LISTEN_CB: u32 = 11;
/// BPF_SOCK_OPS_STATE_CB_FLAG: call back on this socket's state changes.
const STATE_CB_FLAG: i32 = 1 << 2;
const TCP_CLOSE: u32 = 7;
/// BPF_NOEXIST
const NO_EXIST: u64 = 1;

#[sock_ops]
pub fn weir_sockops(ctx: SockOpsContext) -> u32 {
    let op = unsafe { field!(ctx.ops, op) };
    if op == ACTIVE_ESTABLISHED_CB || op == PASSIVE_ESTABLISHED_CB {
        established(&ctx, op == ACTIVE_ESTABLISHED_CB);
    } else if op == TCP_LISTEN_CB {
        listening(&ctx);
    } else if op == STATE_CB && ctx.arg(1) == TCP_CLOSE {
        // Envoy's end closed: the app's end's original destination is not needed.
        let netns = net::netns_cookie(ctx.as_ptr());
        if let Some(key) = pair(&ctx, netns) {
            let _ = ORIG_BY_PAIR.remove(&key.peer());
        }
    }
    0
}

/// This end of the connection, as a [`PairKey`].
#[inline(always)]
fn pair(ctx: &SockOpsContext, netns: u64) -> Option<PairKey> {
    let ops = ctx.ops;
    unsafe {
        let family = field!(ops, family) as u16;
        let (local, remote) = match family {
            AF_INET => ([field!(ops, local_ip4), 0, 0, 0], [field!(ops, remote_ip4), 0, 0, 0]),
            AF_INET6 => (
                [
                    field!(ops, local_ip6[0]),
                    field!(ops, local_ip6[1]),
                    field!(ops, local_ip6[2]),
                    field!(ops, local_ip6[3]),
                ],
                [
                    field!(ops, remote_ip6[0]),
                    field!(ops, remote_ip6[1]),
                    field!(ops, remote_ip6[2]),
                    field!(ops, remote_ip6[3]),
                ],
            ),
            _ => return None,
        };
        Some(net::unmapped_pair(PairKey {
            netns,
            local_addr: local,
            remote_addr: remote,
            local_port: field!(ops, local_port) as u16,
            // remote_port holds the network-order port in its upper 16 bits.
            remote_port: u16::from_be((field!(ops, remote_port) >> 16) as u16),
            family: u32::from(family),
        }))
    }
}

#[inline(always)]
fn established(ctx: &SockOpsContext, active: bool) {
    let netns = net::netns_cookie(ctx.as_ptr());
    let Some(cfg) = (unsafe { POD_CONFIG.get(&netns) }) else { return };
    let Some(key) = pair(ctx, netns) else { return };
    if !active && (key.local_port == cfg.outbound_port || key.local_port == cfg.inbound_port) {
        // Keep whatever callbacks another sockops program on the socket asked for.
        let _ = ctx.set_cb_flags(ctx.cb_flags() as i32 | STATE_CB_FLAG);
    }
    if active {
        let cookie = net::socket_cookie(ctx.as_ptr());
        if let Some(orig) = unsafe { ORIG_BY_COOKIE.get(&cookie) } {
            let orig = *orig;
            // Only a connection the connect hook sent to the proxy's own port over
            // loopback carries an original destination.
            if is_local(&key) && (key.remote_port == cfg.outbound_port || key.remote_port == cfg.inbound_port)
            {
                let _ = ORIG_BY_PAIR.insert(&key, &orig, 0);
            }
            let _ = ORIG_BY_COOKIE.remove(&cookie);
        }
    }
    if cfg.has(flags::ACCELERATE) && is_local(&key) {
        let mut key = key;
        let r = SOCK_PAIRS.update(&mut key, unsafe { &mut *ctx.ops }, NO_EXIST);
        if r.is_ok() {
            maps::count(cfg, netns, counter::PAIRS_REGISTERED);
        }
        if maps::log_enabled() {
            aya_log_ebpf::info!(
                ctx,
                "sockops: {} {:i}:{} -> {:i}:{} registered={}",
                if active { 1 } else { 0 },
                u32::from_be(key.local_addr[0]),
                key.local_port,
                u32::from_be(key.remote_addr[0]),
                key.remote_port,
                if r.is_ok() { 1 } else { 0 }
            );
        }
    }
}

/// A socket of a pod with inbound capture starts listening: the inbound guard watches
/// it when its port is a captured one (up to [`MAX_GUARDED_LISTENERS_PER_POD`] per
/// pod; the guard checks the port again when a packet comes).
#[inline(always)]
fn listening(ctx: &SockOpsContext) {
    let netns = net::netns_cookie(ctx.as_ptr());
    let Some(ports) = (unsafe { INBOUND_PORTS.get(&netns) }) else { return };
    // Only listeners the guard would act on: a captured inbound port, and not Envoy's
    // outbound listener (Envoy's others, 15006, 15008 and the excluded 15021/15090,
    // are never captured ports). Envoy's one socket per worker must not use up the
    // pod's share.
    let port = unsafe { field!(ctx.ops, local_port) } as u16;
    if !ports.captures(port) || unsafe { POD_CONFIG.get(&netns) }.is_some_and(|c| c.outbound_port == port) {
        return;
    }
    let Some(count) = LISTENER_COUNTS.get_ptr_mut(&netns) else { return };
    // SAFETY: a map value of this pod; racing listens may pass the limit by a few.
    if unsafe { core::ptr::read_volatile(count) } >= u64::from(MAX_GUARDED_LISTENERS_PER_POD) {
        if let Some(cfg) = unsafe { POD_CONFIG.get(&netns) } {
            maps::count(cfg, netns, counter::LISTENERS_UNGUARDED);
        }
        return;
    }
    let cookie = net::socket_cookie(ctx.as_ptr());
    if LISTENERS.insert(&cookie, &netns, NO_EXIST).is_ok() {
        // SAFETY: an atomic add on this pod's map value.
        unsafe { maps::atomic_add(count, 1) };
    }
}

/// Both ends on this host: the peer is a loopback address.
#[inline(always)]
fn is_local(key: &PairKey) -> bool {
    match key.family as u16 {
        AF_INET => net::is_loopback4(key.remote_addr[0]),
        _ => {
            net::is_loopback6(&key.remote_addr)
                || net::mapped_v4(&key.remote_addr).is_some_and(net::is_loopback4)
        }
    }
}
