//! `cgroup_skb/ingress`, the inbound guard: capture's second line, at the socket. A
//! packet for one of the app's listeners on a captured inbound port that came in from
//! outside the pod (any interface but loopback) went around the inbound classifier (an
//! address the pod was not registered with, a secondary interface the classifier is
//! not on): it is dropped, and counted. What Envoy hands the app comes over loopback;
//! what the classifier assigned lands on Envoy's own listener (15006), whose port is
//! never a captured one. Every other packet passes at the first check that says so,
//! most at the first two (loopback, or not for a listening socket).

use aya_ebpf::{
    bindings::__sk_buff,
    helpers::{bpf_get_socket_cookie, bpf_sk_fullsock},
    macros::cgroup_skb,
    programs::SkBuffContext,
};
use weir_ebpf_common::capture::counter;

use crate::{
    maps::{self, INBOUND_PORTS, LISTENERS, POD_CONFIG},
    net::field,
};

const LOOPBACK_IFINDEX: u32 = 1;
const TCP_LISTEN: u32 = 10;
const PASS: i32 = 1;
const DROP: i32 = 0;

#[cgroup_skb(ingress)]
pub fn weir_inbound_guard(ctx: SkBuffContext) -> i32 {
    let skb: *mut __sk_buff = ctx.skb.skb;
    unsafe {
        if field!(skb, ingress_ifindex) == LOOPBACK_IFINDEX {
            return PASS;
        }
        let sk = (*skb).__bindgen_anon_2.sk;
        if sk.is_null() {
            return PASS;
        }
        let full = bpf_sk_fullsock(sk);
        if full.is_null() || field!(full, state) != TCP_LISTEN {
            return PASS;
        }
        let cookie = bpf_get_socket_cookie(skb.cast());
        let Some(netns) = LISTENERS.get(&cookie) else { return PASS };
        let netns = *netns;
        let Some(ports) = INBOUND_PORTS.get(&netns) else { return PASS };
        // The listener's own port (host order).
        if !ports.captures(field!(full, src_port) as u16) {
            return PASS;
        }
        if let Some(cfg) = POD_CONFIG.get(&netns) {
            maps::count(cfg, netns, counter::INBOUND_BYPASS_REFUSED);
        }
    }
    DROP
}
