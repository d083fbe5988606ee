//! `cgroup/sock_release`: a socket's connection-tracking entries keyed by its cookie go
//! with it. A connect that never completed (nothing listening on 15001 yet, the app
//! giving up) leaves its original destination under its cookie, and a UDP socket that
//! sent DNS to the agent leaves the server it addressed; without this, those entries
//! would stay until the node-wide LRU maps evicted them, and one pod's connect storm
//! would evict other pods' connections in flight. A redirected socket's connected-to
//! address (`PEER_BY_COOKIE`, for getpeername) lives exactly as long as the socket. (The entries keyed by a connection's
//! 4-tuple go when Envoy asks for them, or when Envoy's end closes: `sockops`.) A
//! listener the inbound guard watched leaves `LISTENERS`, and its pod's count drops.

use aya_ebpf::{EbpfContext as _, macros::cgroup_sock, programs::SockContext};

use crate::{
    maps::{DNS_BY_COOKIE, LISTENER_COUNTS, LISTENERS, ORIG_BY_COOKIE, PEER_BY_COOKIE},
    net::{self, ALLOW},
};

#[cgroup_sock(sock_release)]
pub fn weir_sock_release(ctx: SockContext) -> i32 {
    let cookie = net::socket_cookie(ctx.as_ptr());
    let _ = ORIG_BY_COOKIE.remove(&cookie);
    let _ = PEER_BY_COOKIE.remove(&cookie);
    let _ = DNS_BY_COOKIE.remove(&cookie);
    if let Some(netns) = unsafe { LISTENERS.get(&cookie) } {
        let netns = *netns;
        if LISTENERS.remove(&cookie).is_ok()
            && let Some(count) = LISTENER_COUNTS.get_ptr_mut(&netns)
        {
            // SAFETY: this pod's map value. Never below zero: a pod registered again
            // starts from zero while listeners of its earlier registration still close.
            if unsafe { core::ptr::read_volatile(count) } > 0 {
                unsafe { crate::maps::atomic_add(count, u64::MAX) };
            }
        }
    }
    ALLOW
}
