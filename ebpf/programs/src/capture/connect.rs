//! `cgroup/connect4` and `connect6`: a TCP connect to a captured destination is
//! rewritten to Envoy's outbound port on loopback, and the original destination is
//! recorded by socket cookie (for Envoy's `SO_ORIGINAL_DST`, and for the app's own
//! `getpeername()`: `peer.rs`). DNS connects (TCP or UDP, port 53) go to the agent.

use aya_ebpf::{EbpfContext as _, macros::cgroup_sock_addr, programs::SockAddrContext};
use aya_log_ebpf::info;
use weir_ebpf_common::{
    capture::{OrigDst, PodConfig, counter},
    policy::{self, DstClass, Reason, Verdict},
};

use crate::{
    dns,
    maps::{
        self, EXCLUDE_V4, EXCLUDE_V6, INCLUDE_V4, INCLUDE_V6, ORIG_BY_COOKIE, PEER_BY_COOKIE, POD_CONFIG,
    },
    net::{self, AF_INET, AF_INET6, ALLOW, DENY, LOOPBACK4, OWN_POD_ADDRESS, SOCK_STREAM, field},
};

#[inline(always)]
fn class(found: Option<u8>) -> DstClass {
    match found {
        None => DstClass::Other,
        Some(OWN_POD_ADDRESS) => DstClass::OwnPod,
        Some(_) => DstClass::Excluded,
    }
}

/// Whether an IPv6 connect to `dst` stays in the pod: a loopback destination (`::1`,
/// `::6`, 127/8 mapped) or one of the pod's own addresses.
#[inline(always)]
fn stays_in_pod6(cfg: &PodConfig, netns: u64, dst: &[u32; 4], mapped: Option<u32>) -> bool {
    match mapped {
        Some(v4) => {
            policy::loopback4(v4) != policy::Loopback::No
                || matches!(class(net::lookup_v4(&EXCLUDE_V4, cfg, netns, v4)), DstClass::OwnPod)
        }
        None => {
            policy::loopback6(dst) != policy::Loopback::No
                || matches!(class(net::lookup_v6(&EXCLUDE_V6, cfg, netns, dst)), DstClass::OwnPod)
        }
    }
}

/// Counts a redirect by where it goes: Envoy's outbound or (the proxy calling its own
/// pod) inbound listener.
#[inline(always)]
fn redirected(cfg: &PodConfig, to: u16) -> u32 {
    if to == cfg.inbound_port { counter::REDIRECTED_INBOUND } else { counter::REDIRECTED }
}

/// A connect starts over: an original destination an earlier connect of this socket
/// recorded (one the kernel then failed, e.g. EADDRNOTAVAIL) must not be taken for
/// this one's, which may not be redirected at all.
#[inline(always)]
fn forget_original_destination(ctx: &SockAddrContext) {
    let cookie = net::socket_cookie(ctx.as_ptr());
    let _ = ORIG_BY_COOKIE.remove(&cookie);
    let _ = PEER_BY_COOKIE.remove(&cookie);
}

#[cgroup_sock_addr(connect4)]
pub fn weir_connect4(ctx: SockAddrContext) -> i32 {
    connect4(&ctx)
}

#[inline(always)]
fn connect4(ctx: &SockAddrContext) -> i32 {
    let netns = net::netns_cookie(ctx.as_ptr());
    let Some(cfg) = (unsafe { POD_CONFIG.get(&netns) }) else { return ALLOW };
    let sa = ctx.sock_addr;
    let (dst, port_be, sock_type) =
        unsafe { (field!(sa, user_ip4), field!(sa, user_port) as u16, field!(sa, type_)) };
    let port = u16::from_be(port_be);
    if sock_type == SOCK_STREAM {
        forget_original_destination(ctx);
    }
    // ztunnel's own sockets in an ambient pod (marked 0x539), as Istio's in-pod rules
    // return them first.
    if net::proxy_marked(sa, cfg) {
        maps::count(cfg, netns, Reason::Proxy.counter());
        return ALLOW;
    }
    let (uid, gid) = net::uid_gid();
    // Istio's first rule: Envoy's inbound passthrough (bound to 127.0.0.6) is left alone.
    if sock_type == SOCK_STREAM && policy::from_inbound_passthrough(net::bound_src4(sa)) {
        maps::count(cfg, netns, Reason::InboundPassthrough.counter());
        return ALLOW;
    }
    if dns::redirect_v4(ctx, cfg, netns, uid, gid, dst, port, sock_type == SOCK_STREAM) {
        return ALLOW;
    }
    if sock_type != SOCK_STREAM {
        return ALLOW;
    }
    let verdict = policy::outbound_tcp(
        cfg,
        uid,
        gid,
        port,
        policy::loopback4(dst),
        || class(net::lookup_v4(&EXCLUDE_V4, cfg, netns, dst)),
        || net::lookup_v4(&INCLUDE_V4, cfg, netns, dst).is_some(),
    );
    match verdict {
        Verdict::Pass(reason) => maps::count(cfg, netns, reason.counter()),
        Verdict::Redirect(to) => {
            let orig = OrigDst { addr: [dst, 0, 0, 0], port: port_be, family: AF_INET };
            let cookie = net::socket_cookie(ctx.as_ptr());
            // getpeername's answer is best effort (an LRU map): only the original
            // destination Envoy needs refuses the connect when it cannot be kept.
            let _ = PEER_BY_COOKIE.insert(&cookie, &orig, 0);
            if ORIG_BY_COOKIE.insert(&cookie, &orig, 0).is_err() {
                // Envoy could not learn where this connection was going: refused
                // (EPERM), as a full conntrack table drops it, never sent around Envoy.
                maps::count(cfg, netns, counter::REDIRECT_FAILED);
                return DENY;
            }
            unsafe {
                (*sa).user_ip4 = LOOPBACK4;
                (*sa).user_port = u32::from(to.to_be());
            }
            maps::count(cfg, netns, redirected(cfg, to));
            if maps::log_enabled() {
                info!(ctx, "connect4 {:i}:{} -> 127.0.0.1:{}", u32::from_be(dst), port, to);
            }
        }
    }
    ALLOW
}

#[cgroup_sock_addr(connect6)]
pub fn weir_connect6(ctx: SockAddrContext) -> i32 {
    connect6(&ctx)
}

#[inline(always)]
fn connect6(ctx: &SockAddrContext) -> i32 {
    let netns = net::netns_cookie(ctx.as_ptr());
    let Some(cfg) = (unsafe { POD_CONFIG.get(&netns) }) else { return ALLOW };
    let sa = ctx.sock_addr;
    let (dst, port_be, sock_type) = unsafe {
        (
            [
                field!(sa, user_ip6[0]),
                field!(sa, user_ip6[1]),
                field!(sa, user_ip6[2]),
                field!(sa, user_ip6[3]),
            ],
            field!(sa, user_port) as u16,
            field!(sa, type_),
        )
    };
    let port = u16::from_be(port_be);
    if sock_type == SOCK_STREAM {
        forget_original_destination(ctx);
    }
    if net::proxy_marked(sa, cfg) {
        maps::count(cfg, netns, Reason::Proxy.counter());
        return ALLOW;
    }
    let (uid, gid) = net::uid_gid();
    // A dual-stack socket connecting to ::ffff:a.b.c.d is IPv4 traffic.
    let mapped = net::mapped_v4(&dst);
    // Istio's `-o lo -s ::6 -j RETURN`: only what stays in the pod (loopback, or the
    // pod's own address); `::6` is no loopback address, so a socket bound to it with
    // IPV6_FREEBIND could otherwise reach anywhere around Envoy.
    if sock_type == SOCK_STREAM
        && policy::from_inbound_passthrough6(&net::bound_src6(sa))
        && stays_in_pod6(cfg, netns, &dst, mapped)
    {
        maps::count(cfg, netns, Reason::InboundPassthrough.counter());
        return ALLOW;
    }
    if dns::redirect_v6(ctx, cfg, netns, uid, gid, &dst, mapped, port, sock_type == SOCK_STREAM) {
        return ALLOW;
    }
    if sock_type != SOCK_STREAM {
        return ALLOW;
    }
    let verdict = match mapped {
        Some(v4) => policy::outbound_tcp(
            cfg,
            uid,
            gid,
            port,
            policy::loopback4(v4),
            || class(net::lookup_v4(&EXCLUDE_V4, cfg, netns, v4)),
            || net::lookup_v4(&INCLUDE_V4, cfg, netns, v4).is_some(),
        ),
        None => policy::outbound_tcp(
            cfg,
            uid,
            gid,
            port,
            policy::loopback6(&dst),
            || class(net::lookup_v6(&EXCLUDE_V6, cfg, netns, &dst)),
            || net::lookup_v6(&INCLUDE_V6, cfg, netns, &dst).is_some(),
        ),
    };
    match verdict {
        Verdict::Pass(reason) => maps::count(cfg, netns, reason.counter()),
        Verdict::Redirect(to) => {
            let orig = match mapped {
                Some(v4) => OrigDst { addr: [v4, 0, 0, 0], port: port_be, family: AF_INET },
                None => OrigDst { addr: dst, port: port_be, family: AF_INET6 },
            };
            let cookie = net::socket_cookie(ctx.as_ptr());
            // getpeername's answer is best effort (an LRU map): only the original
            // destination Envoy needs refuses the connect when it cannot be kept.
            let _ = PEER_BY_COOKIE.insert(&cookie, &orig, 0);
            if ORIG_BY_COOKIE.insert(&cookie, &orig, 0).is_err() {
                // Envoy could not learn where this connection was going: refused
                // (EPERM), as a full conntrack table drops it, never sent around Envoy.
                maps::count(cfg, netns, counter::REDIRECT_FAILED);
                return DENY;
            }
            let loopback = match mapped {
                Some(_) => [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff]), LOOPBACK4],
                None => [0, 0, 0, u32::from_ne_bytes([0, 0, 0, 1])],
            };
            unsafe {
                (*sa).user_ip6[0] = loopback[0];
                (*sa).user_ip6[1] = loopback[1];
                (*sa).user_ip6[2] = loopback[2];
                (*sa).user_ip6[3] = loopback[3];
                (*sa).user_port = u32::from(to.to_be());
            }
            maps::count(cfg, netns, redirected(cfg, to));
            if maps::log_enabled() {
                info!(ctx, "connect6 port {} -> [::1]:{}", port, to);
            }
        }
    }
    ALLOW
}
