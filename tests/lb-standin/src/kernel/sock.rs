//! The socket a hook runs for: its cookie, namespace and protocol, read once from the
//! context, and the accessors for the context's address fields.

use aya_ebpf::{
    EbpfContext as _,
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie},
    programs::SockAddrContext,
};
use weir_lb_standin::LbConfig;

pub const ALLOW: i32 = 1;
pub const DENY: i32 = 0;
pub const EHOSTUNREACH: i32 = 113;
pub const ENOMEM: i32 = 12;
const IPPROTO_TCP: u32 = 6;
const IPPROTO_UDP: u32 = 17;
const IPPROTO_UDPLITE: u32 = 136;

/// Loads one context field at its own offset (the verifier refuses derived pointers
/// into the context).
macro_rules! field {
    ($ptr:expr, $($f:tt)+) => {
        unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*$ptr).$($f)+)) }
    };
}

/// What the translations need to know of the calling socket.
#[derive(Clone, Copy)]
pub struct Sock {
    /// `sock_local_cookie()`: the socket's cookie.
    pub cookie: u64,
    /// `ctx_in_hostns()`: the socket is in the host's network namespace.
    pub in_hostns: bool,
    pub protocol: u32,
}

impl Sock {
    #[inline(always)]
    pub fn of(ctx: &SockAddrContext, cfg: &LbConfig) -> Self {
        let own = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
        let host = match cfg.host_netns_cookie {
            0 => unsafe { bpf_get_netns_cookie(core::ptr::null_mut()) },
            c => c,
        };
        let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        Self { cookie, in_hostns: own == host, protocol: field!(ctx.sock_addr, protocol) }
    }

    /// `sock_proto_enabled()`: TCP, UDP and UDP-Lite.
    #[inline(always)]
    pub fn proto_enabled(&self) -> bool {
        matches!(self.protocol, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_UDPLITE)
    }

    /// `sock_select_slot()`: a random backend per TCP connection, one per UDP socket.
    #[inline(always)]
    pub fn select_slot(&self) -> u64 {
        if self.protocol == IPPROTO_TCP { u64::from(unsafe { bpf_get_prandom_u32() }) } else { self.cookie }
    }
}

/// The context's destination (or, in recvmsg and getpeername, its peer).
#[inline(always)]
pub fn addr4(sa: *mut bpf_sock_addr) -> (u32, u16) {
    (field!(sa, user_ip4), field!(sa, user_port) as u16)
}

#[inline(always)]
pub fn addr6(sa: *mut bpf_sock_addr) -> ([u32; 4], u16) {
    (
        [field!(sa, user_ip6[0]), field!(sa, user_ip6[1]), field!(sa, user_ip6[2]), field!(sa, user_ip6[3])],
        field!(sa, user_port) as u16,
    )
}

#[inline(always)]
pub fn set4(sa: *mut bpf_sock_addr, address: u32, port: u16) {
    unsafe {
        (*sa).user_ip4 = address;
        (*sa).user_port = u32::from(port);
    }
}

#[inline(always)]
pub fn set6(sa: *mut bpf_sock_addr, address: &[u32; 4], port: u16) {
    unsafe {
        (*sa).user_ip6[0] = address[0];
        (*sa).user_ip6[1] = address[1];
        (*sa).user_ip6[2] = address[2];
        (*sa).user_ip6[3] = address[3];
        (*sa).user_port = u32::from(port);
    }
}

/// `::ffff:a.b.c.d` → `a.b.c.d` (Cilium's `is_v4_in_v6`).
#[inline(always)]
pub fn mapped_v4(addr: &[u32; 4]) -> Option<u32> {
    (addr[0] == 0 && addr[1] == 0 && addr[2] == u32::from_ne_bytes([0, 0, 0xff, 0xff])).then_some(addr[3])
}

/// Cilium's `build_v4_in_v6`.
#[inline(always)]
pub fn v4_in_v6(v4: u32) -> [u32; 4] {
    [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff]), v4]
}
