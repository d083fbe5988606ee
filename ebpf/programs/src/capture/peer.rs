//! `cgroup/getpeername4` and `getpeername6`: an app's `getpeername()` on a socket the
//! connect hook sent to Envoy returns the address the app connected to, as it does
//! under an iptables REDIRECT (which rewrites packets, not the socket), instead of
//! Envoy's loopback listener. The address is the one `connect` recorded for the
//! socket's cookie (`PEER_BY_COOKIE`), kept while the socket lives; a socket the hook
//! did not redirect is left alone. A socket load balancer's own getpeername hook at an
//! ancestor cgroup (Cilium's) runs after this one and finds nothing of its own to
//! restore: its connect hook saw Envoy's address, not a service.

use aya_ebpf::{EbpfContext as _, macros::cgroup_sock_addr, programs::SockAddrContext};
use weir_ebpf_common::capture::OrigDst;

use crate::{
    maps::PEER_BY_COOKIE,
    net::{self, AF_INET, AF_INET6, ALLOW},
};

#[inline(always)]
fn recorded(ctx: &SockAddrContext) -> Option<OrigDst> {
    unsafe { PEER_BY_COOKIE.get(&net::socket_cookie(ctx.as_ptr())) }.copied()
}

#[cgroup_sock_addr(getpeername4)]
pub fn weir_getpeername4(ctx: SockAddrContext) -> i32 {
    if let Some(orig) = recorded(&ctx).filter(|o| o.family == AF_INET) {
        let sa = ctx.sock_addr;
        unsafe {
            (*sa).user_ip4 = orig.addr[0];
            (*sa).user_port = u32::from(orig.port);
        }
    }
    ALLOW
}

/// An IPv6 socket's peer: an IPv6 destination as recorded, an IPv4 one (a dual-stack
/// socket's connect to `::ffff:a.b.c.d`, recorded as IPv4) as its mapped form again.
#[cgroup_sock_addr(getpeername6)]
pub fn weir_getpeername6(ctx: SockAddrContext) -> i32 {
    if let Some(orig) = recorded(&ctx) {
        let addr = match orig.family {
            AF_INET6 => orig.addr,
            AF_INET => [0, 0, 0x0000_ffffu32.to_be(), orig.addr[0]],
            _ => return ALLOW,
        };
        let sa = ctx.sock_addr;
        unsafe {
            (*sa).user_ip6[0] = addr[0];
            (*sa).user_ip6[1] = addr[1];
            (*sa).user_ip6[2] = addr[2];
            (*sa).user_ip6[3] = addr[3];
            (*sa).user_port = u32::from(orig.port);
        }
    }
    ALLOW
}
