//! DNS to the agent: a connect or UDP send to port 53 of one of the pod's resolv.conf
//! servers (or any server, with capture-all) by a non-proxy process goes to the agent's
//! listener on loopback; `recvmsg` makes the agent's replies appear to come from the
//! server the app addressed.

use aya_ebpf::{EbpfContext as _, macros::cgroup_sock_addr, programs::SockAddrContext};
use weir_ebpf_common::{
    capture::{OrigDst, PodConfig, counter},
    policy,
};

use crate::{
    maps::{self, DNS_BY_COOKIE, DNS_V4, DNS_V6, POD_CONFIG},
    net::{self, AF_INET, AF_INET6, ALLOW, LOOPBACK4, SOCK_DGRAM, field},
};

/// Redirects an IPv4 DNS connect or send; true if it did.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn redirect_v4(
    ctx: &SockAddrContext,
    cfg: &PodConfig,
    netns: u64,
    uid: u32,
    gid: u32,
    dst: u32,
    port: u16,
    tcp: bool,
) -> bool {
    if !policy::dns(cfg, uid, gid, port, || net::lookup_v4(&DNS_V4, cfg, netns, dst).is_some()) {
        return false;
    }
    if !tcp {
        let orig = OrigDst { addr: [dst, 0, 0, 0], port: port.to_be(), family: AF_INET };
        if DNS_BY_COOKIE.insert(&net::socket_cookie(ctx.as_ptr()), &orig, 0).is_err() {
            return false;
        }
    }
    let sa = ctx.sock_addr;
    unsafe {
        (*sa).user_ip4 = LOOPBACK4;
        (*sa).user_port = u32::from(cfg.dns_port.to_be());
    }
    maps::count(cfg, netns, counter::DNS_REDIRECTED);
    true
}

/// Redirects an IPv6 (or IPv4-mapped) DNS connect or send; true if it did.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn redirect_v6(
    ctx: &SockAddrContext,
    cfg: &PodConfig,
    netns: u64,
    uid: u32,
    gid: u32,
    dst: &[u32; 4],
    mapped: Option<u32>,
    port: u16,
    tcp: bool,
) -> bool {
    let server = || match mapped {
        Some(v4) => net::lookup_v4(&DNS_V4, cfg, netns, v4).is_some(),
        None => net::lookup_v6(&DNS_V6, cfg, netns, dst).is_some(),
    };
    if !policy::dns(cfg, uid, gid, port, server) {
        return false;
    }
    if !tcp {
        let orig = OrigDst { addr: *dst, port: port.to_be(), family: AF_INET6 };
        if DNS_BY_COOKIE.insert(&net::socket_cookie(ctx.as_ptr()), &orig, 0).is_err() {
            return false;
        }
    }
    let agent = match mapped {
        Some(_) => [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff]), LOOPBACK4],
        None => [0, 0, 0, u32::from_ne_bytes([0, 0, 0, 1])],
    };
    let sa = ctx.sock_addr;
    unsafe {
        (*sa).user_ip6[0] = agent[0];
        (*sa).user_ip6[1] = agent[1];
        (*sa).user_ip6[2] = agent[2];
        (*sa).user_ip6[3] = agent[3];
        (*sa).user_port = u32::from(cfg.dns_port.to_be());
    }
    maps::count(cfg, netns, counter::DNS_REDIRECTED);
    true
}

#[cgroup_sock_addr(sendmsg4)]
pub fn weir_sendmsg4(ctx: SockAddrContext) -> i32 {
    let netns = net::netns_cookie(ctx.as_ptr());
    if let Some(cfg) = unsafe { POD_CONFIG.get(&netns) } {
        let sa = ctx.sock_addr;
        let (dst, port, ty) =
            unsafe { (field!(sa, user_ip4), u16::from_be(field!(sa, user_port) as u16), field!(sa, type_)) };
        if ty == SOCK_DGRAM && !net::proxy_marked(sa, cfg) {
            let (uid, gid) = net::uid_gid();
            redirect_v4(&ctx, cfg, netns, uid, gid, dst, port, false);
        }
    }
    ALLOW
}

#[cgroup_sock_addr(sendmsg6)]
pub fn weir_sendmsg6(ctx: SockAddrContext) -> i32 {
    let netns = net::netns_cookie(ctx.as_ptr());
    if let Some(cfg) = unsafe { POD_CONFIG.get(&netns) } {
        let sa = ctx.sock_addr;
        let (dst, port, ty) = unsafe {
            (
                [
                    field!(sa, user_ip6[0]),
                    field!(sa, user_ip6[1]),
                    field!(sa, user_ip6[2]),
                    field!(sa, user_ip6[3]),
                ],
                u16::from_be(field!(sa, user_port) as u16),
                field!(sa, type_),
            )
        };
        if ty == SOCK_DGRAM && !net::proxy_marked(sa, cfg) {
            let (uid, gid) = net::uid_gid();
            redirect_v6(&ctx, cfg, netns, uid, gid, &dst, net::mapped_v4(&dst), port, false);
        }
    }
    ALLOW
}

#[cgroup_sock_addr(recvmsg4)]
pub fn weir_recvmsg4(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    let (src, port) = unsafe { (field!(sa, user_ip4), field!(sa, user_port) as u16) };
    if src == LOOPBACK4 {
        if let Some(orig) = unsafe { DNS_BY_COOKIE.get(&net::socket_cookie(ctx.as_ptr())) } {
            let netns = net::netns_cookie(ctx.as_ptr());
            let cfg = unsafe { POD_CONFIG.get(&netns) };
            if let Some(cfg) = cfg.filter(|c| c.dns_port.to_be() == port && orig.family == AF_INET) {
                unsafe {
                    (*sa).user_ip4 = orig.addr[0];
                    (*sa).user_port = u32::from(orig.port);
                }
                maps::count(cfg, netns, counter::DNS_RESTORED);
            }
        }
    }
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn weir_recvmsg6(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    let (src, port) = unsafe {
        (
            [
                field!(sa, user_ip6[0]),
                field!(sa, user_ip6[1]),
                field!(sa, user_ip6[2]),
                field!(sa, user_ip6[3]),
            ],
            field!(sa, user_port) as u16,
        )
    };
    let from_agent = net::is_loopback6(&src) || net::mapped_v4(&src) == Some(LOOPBACK4);
    if from_agent {
        if let Some(orig) = unsafe { DNS_BY_COOKIE.get(&net::socket_cookie(ctx.as_ptr())) } {
            let netns = net::netns_cookie(ctx.as_ptr());
            let cfg = unsafe { POD_CONFIG.get(&netns) };
            if let Some(cfg) = cfg.filter(|c| c.dns_port.to_be() == port && orig.family == AF_INET6) {
                unsafe {
                    (*sa).user_ip6[0] = orig.addr[0];
                    (*sa).user_ip6[1] = orig.addr[1];
                    (*sa).user_ip6[2] = orig.addr[2];
                    (*sa).user_ip6[3] = orig.addr[3];
                    (*sa).user_port = u32::from(orig.port);
                }
                maps::count(cfg, netns, counter::DNS_RESTORED);
            }
        }
    }
    ALLOW
}
