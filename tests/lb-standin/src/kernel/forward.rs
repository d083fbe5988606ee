//! Frontend to backend, as `bpf/bpf_sock.c`'s `__sock4_xlate_fwd` and
//! `__sock6_xlate_fwd` do it for `cil_sock4_connect`/`cil_sock6_connect` (TCP and
//! connected UDP) and `cil_sock4_sendmsg`/`cil_sock6_sendmsg` (each UDP datagram): look
//! the destination up as a service, pick a backend slot, record the reverse-NAT entry
//! under the socket's cookie and the backend (`sock4_update_revnat`, for recvmsg and
//! getpeername), rewrite the destination. With `hostNamespaceOnly`
//! (`is_defined(ENABLE_SOCKET_LB_HOST_ONLY) && !in_hostns`) a socket outside the host's
//! namespace is left alone. An IPv6 socket's `::ffff:a.b.c.d` destination is looked up
//! as IPv4 (`sock6_xlate_v4_in_v6`). Only a service without backends (EHOSTUNREACH) and
//! a full reverse-NAT map (ENOMEM) refuse the call, as Cilium's hooks do.

use aya_ebpf::{helpers::bpf_set_retval, macros::cgroup_sock_addr, programs::SockAddrContext};
use weir_lb_standin::{LbConfig, RevNat4, RevNat4Key, RevNat6, RevNat6Key, counter};

use crate::{
    lookup,
    maps::{self, BACKENDS4, BACKENDS6, REVERSE_SK4, REVERSE_SK6},
    sock::{self, ALLOW, DENY, EHOSTUNREACH, ENOMEM, Sock},
};

/// What a forward translation decided.
enum Forward<A> {
    /// Not a service (or not for this socket): the call goes on unchanged.
    Pass,
    /// To this backend address and port.
    To(A, u16),
    /// The call fails with this errno.
    Refuse(i32),
}

#[inline(always)]
fn xlate4(cfg: &LbConfig, s: &Sock, address: u32, dport: u16, udp_only: bool) -> Forward<u32> {
    if cfg.host_namespace_only != 0 && !s.in_hostns {
        maps::count(counter::NOT_HOST_NAMESPACE);
        return Forward::Pass;
    }
    if !udp_only && !s.proto_enabled() {
        return Forward::Pass;
    }
    let Some(found) = lookup::lookup4(cfg, address, dport, s.in_hostns) else { return Forward::Pass };
    let count = found.service.count;
    if count == 0 {
        return Forward::Refuse(EHOSTUNREACH);
    }
    if lookup::skip4(&found.service, address) {
        return Forward::Pass;
    }
    let slot = (s.select_slot() % u64::from(count)) as u16 + 1;
    let Some(id) = lookup::slot4(&found, slot) else { return Forward::Refuse(EHOSTUNREACH) };
    let Some(backend) = (unsafe { BACKENDS4.get(&id) }).copied() else {
        return Forward::Refuse(EHOSTUNREACH);
    };
    let key = RevNat4Key { cookie: s.cookie, address: backend.address, port: backend.port, pad: 0 };
    let entry = RevNat4 { address, port: dport, rev_nat_index: found.service.rev_nat_index };
    if REVERSE_SK4.insert(&key, &entry, 0).is_err() {
        return Forward::Refuse(ENOMEM);
    }
    maps::count(counter::FORWARD);
    Forward::To(backend.address, backend.port)
}

#[inline(always)]
fn xlate6(cfg: &LbConfig, s: &Sock, address: [u32; 4], dport: u16, udp_only: bool) -> Forward<[u32; 4]> {
    if cfg.host_namespace_only != 0 && !s.in_hostns {
        maps::count(counter::NOT_HOST_NAMESPACE);
        return Forward::Pass;
    }
    if !udp_only && !s.proto_enabled() {
        return Forward::Pass;
    }
    let Some(found) = lookup::lookup6(cfg, address, dport, s.in_hostns) else {
        return match sock::mapped_v4(&address) {
            Some(v4) => match xlate4(cfg, s, v4, dport, udp_only) {
                Forward::To(b, port) => Forward::To(sock::v4_in_v6(b), port),
                Forward::Pass => Forward::Pass,
                Forward::Refuse(e) => Forward::Refuse(e),
            },
            None => Forward::Pass,
        };
    };
    let count = found.service.count;
    if count == 0 {
        return Forward::Refuse(EHOSTUNREACH);
    }
    if lookup::skip6(&found.service, &address) {
        return Forward::Pass;
    }
    let slot = (s.select_slot() % u64::from(count)) as u16 + 1;
    let Some(id) = lookup::slot6(&found, slot) else { return Forward::Refuse(EHOSTUNREACH) };
    let Some(backend) = (unsafe { BACKENDS6.get(&id) }).copied() else {
        return Forward::Refuse(EHOSTUNREACH);
    };
    let key = RevNat6Key { cookie: s.cookie, address: backend.address, port: backend.port, pad: [0; 3] };
    let entry = RevNat6 { address, port: dport, rev_nat_index: found.service.rev_nat_index };
    if REVERSE_SK6.insert(&key, &entry, 0).is_err() {
        return Forward::Refuse(ENOMEM);
    }
    maps::count(counter::FORWARD);
    Forward::To(backend.address, backend.port)
}

#[inline(always)]
fn forward4(ctx: &SockAddrContext, udp_only: bool) -> i32 {
    let cfg = maps::config();
    let s = Sock::of(ctx, &cfg);
    let (address, dport) = sock::addr4(ctx.sock_addr);
    match xlate4(&cfg, &s, address, dport, udp_only) {
        Forward::Pass => ALLOW,
        Forward::To(backend, port) => {
            sock::set4(ctx.sock_addr, backend, port);
            ALLOW
        }
        Forward::Refuse(errno) => {
            // `try_set_retval`: the syscall fails with this errno rather than EPERM.
            unsafe { bpf_set_retval(-errno) };
            DENY
        }
    }
}

#[inline(always)]
fn forward6(ctx: &SockAddrContext, udp_only: bool) -> i32 {
    let cfg = maps::config();
    let s = Sock::of(ctx, &cfg);
    let (address, dport) = sock::addr6(ctx.sock_addr);
    match xlate6(&cfg, &s, address, dport, udp_only) {
        Forward::Pass => ALLOW,
        Forward::To(backend, port) => {
            sock::set6(ctx.sock_addr, &backend, port);
            ALLOW
        }
        Forward::Refuse(errno) => {
            unsafe { bpf_set_retval(-errno) };
            DENY
        }
    }
}

/// `cil_sock4_connect` (its health-check branch aside).
#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    forward4(&ctx, false)
}

/// `cil_sock6_connect`.
#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    forward6(&ctx, false)
}

/// `cil_sock4_sendmsg`.
#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    forward4(&ctx, true)
}

/// `cil_sock6_sendmsg`.
#[cgroup_sock_addr(sendmsg6)]
pub fn lb_sendmsg6(ctx: SockAddrContext) -> i32 {
    forward6(&ctx, true)
}
