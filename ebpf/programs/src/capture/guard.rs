//! `cgroup_skb/ingress`, the inbound guard: capture's second line, at the socket. A
//! packet for one of the app's listeners on a captured inbound port that came in from
//! outside the pod (any interface but loopback) went around the inbound classifier (an
//! address the pod was not registered with, a secondary interface the classifier is
//! not on): it is dropped, and counted. What Envoy hands the app comes over loopback;
//! what the classifier assigned lands on Envoy's own listener (15006), whose port is
//! never a captured one. Every other packet passes at the first check that says so,
//! most at the first two (loopback, or not for a listening socket).
//!
//! For an ambient pod the guard also does what Istio's connmark does: ztunnel's
//! deliveries to the app are marked so their replies route back to ztunnel, and the
//! host's probe address (kubelet) is let through.

use aya_ebpf::{
    bindings::__sk_buff,
    helpers::{bpf_get_socket_cookie, bpf_sk_fullsock},
    macros::cgroup_skb,
    programs::SkBuffContext,
};
use weir_ebpf_common::{
    capture::counter,
    inbound::{InboundConfig, ambient},
};

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
            if field!(skb, mark) & ambient::MARK_MASK == ambient::ZTUNNEL_MARK {
                mark_ztunnel_delivery(skb);
            }
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
        // An ambient pod's kubelet probes come from the host's probe address, around
        // ztunnel by design (Istio's in-pod rules pass them too).
        if ports.is_ambient() && from_probe_source(&ctx, ports) {
            return PASS;
        }
        if let Some(cfg) = POD_CONFIG.get(&netns) {
            maps::count(cfg, netns, counter::INBOUND_BYPASS_REFUSED);
        }
    }
    DROP
}

/// ztunnel (its sockets marked 0x539) delivers a connection to an ambient pod's app
/// over loopback, from the client's own address: the packet is marked 0x111, which
/// the app's accepted socket takes (`tcp_fwmark_accept`, set in an ambient pod's
/// namespace at registration), so its replies follow the in-pod rule `fwmark
/// 0x111/0xfff lookup 100` back to ztunnel instead of out of the pod, as Istio's
/// connmark does. Every listening socket that is not ztunnel's own (marked 0x539
/// itself) gets it, guarded or not: an accepted socket must never inherit ztunnel's
/// mark, which would let the app's later connects pass as ztunnel's. Elsewhere
/// (`tcp_fwmark_accept` off, the kernel's default) an accepted socket takes its
/// listener's mark and this changes nothing.
#[inline(always)]
unsafe fn mark_ztunnel_delivery(skb: *mut __sk_buff) {
    unsafe {
        let sk = (*skb).__bindgen_anon_2.sk;
        if sk.is_null() {
            return;
        }
        let full = bpf_sk_fullsock(sk);
        if full.is_null()
            || field!(full, state) != TCP_LISTEN
            || field!(full, mark) & ambient::MARK_MASK == ambient::ZTUNNEL_MARK
        {
            return;
        }
        let mark = field!(skb, mark);
        core::ptr::write_volatile(
            core::ptr::addr_of_mut!((*skb).mark),
            (mark & !ambient::MARK_MASK) | ambient::REPLY_MARK,
        );
    }
}

/// Whether the packet's source is the host's probe address of the pod's config.
#[inline(always)]
fn from_probe_source(ctx: &SkBuffContext, ports: &InboundConfig) -> bool {
    const ETH_P_IP: u32 = 0x0800;
    const ETH_P_IPV6: u32 = 0x86dd;
    let protocol = u32::from(u16::from_be(unsafe { field!(ctx.skb.skb, protocol) } as u16));
    if protocol == ETH_P_IP {
        ctx.load::<[u8; 4]>(12).is_ok_and(|src| ports.from_probe_source4(src))
    } else if protocol == ETH_P_IPV6 {
        ctx.load::<[u8; 16]>(8).is_ok_and(|src| ports.from_probe_source6(src))
    } else {
        false
    }
}
