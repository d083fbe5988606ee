//! Backend to frontend, as `bpf/bpf_sock.c`'s `__sock4_xlate_rev` and
//! `__sock6_xlate_rev` do it for `cil_sock4_recvmsg`/`cil_sock6_recvmsg` (a UDP reply's
//! source) and `cil_sock4_getpeername`/`cil_sock6_getpeername` (attached when Cilium's
//! socket-LB peer option is on): the entry the forward translation recorded under the
//! socket's cookie and the backend gives the frontend back, while that service still
//! exists with the same reverse-NAT index and has backends (a stale entry is deleted).
//! There is no `hostNamespaceOnly` test here, as in Cilium: a socket the forward side
//! left alone has no entry. `::ffff:a.b.c.d` goes through the IPv4 map
//! (`sock6_xlate_rev_v4_in_v6`).

use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use weir_lb_standin::{LbConfig, RevNat4Key, RevNat6Key, counter};

use crate::{
    lookup,
    maps::{self, REVERSE_SK4, REVERSE_SK6},
    sock::{self, ALLOW, Sock},
};

#[inline(always)]
fn rev4(cfg: &LbConfig, s: &Sock, address: u32, port: u16) -> Option<(u32, u16)> {
    let key = RevNat4Key { cookie: s.cookie, address, port, pad: 0 };
    let entry = unsafe { REVERSE_SK4.get(&key) }.copied()?;
    let live = lookup::lookup4(cfg, entry.address, entry.port, s.in_hostns)
        .is_some_and(|f| f.service.rev_nat_index == entry.rev_nat_index && f.service.count != 0);
    if !live {
        let _ = REVERSE_SK4.remove(&key);
        return None;
    }
    Some((entry.address, entry.port))
}

#[inline(always)]
fn rev6(cfg: &LbConfig, s: &Sock, address: [u32; 4], port: u16) -> Option<([u32; 4], u16)> {
    let key = RevNat6Key { cookie: s.cookie, address, port, pad: [0; 3] };
    let Some(entry) = unsafe { REVERSE_SK6.get(&key) }.copied() else {
        let v4 = sock::mapped_v4(&address)?;
        return rev4(cfg, s, v4, port).map(|(a, p)| (sock::v4_in_v6(a), p));
    };
    let live = lookup::lookup6(cfg, entry.address, entry.port, s.in_hostns)
        .is_some_and(|f| f.service.rev_nat_index == entry.rev_nat_index && f.service.count != 0);
    if !live {
        let _ = REVERSE_SK6.remove(&key);
        return None;
    }
    Some((entry.address, entry.port))
}

#[inline(always)]
fn reverse4(ctx: &SockAddrContext, slot: u32) -> i32 {
    let cfg = maps::config();
    let s = Sock::of(ctx, &cfg);
    let (address, port) = sock::addr4(ctx.sock_addr);
    if let Some((frontend, fport)) = rev4(&cfg, &s, address, port) {
        sock::set4(ctx.sock_addr, frontend, fport);
        maps::count(slot);
    }
    ALLOW
}

#[inline(always)]
fn reverse6(ctx: &SockAddrContext, slot: u32) -> i32 {
    let cfg = maps::config();
    let s = Sock::of(ctx, &cfg);
    let (address, port) = sock::addr6(ctx.sock_addr);
    if let Some((frontend, fport)) = rev6(&cfg, &s, address, port) {
        sock::set6(ctx.sock_addr, &frontend, fport);
        maps::count(slot);
    }
    ALLOW
}

/// `cil_sock4_recvmsg`.
#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx, counter::REVERSE_RECVMSG)
}

/// `cil_sock6_recvmsg`.
#[cgroup_sock_addr(recvmsg6)]
pub fn lb_recvmsg6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx, counter::REVERSE_RECVMSG)
}

/// `cil_sock4_getpeername`.
#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx, counter::REVERSE_PEER)
}

/// `cil_sock6_getpeername`.
#[cgroup_sock_addr(getpeername6)]
pub fn lb_getpeername6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx, counter::REVERSE_PEER)
}
