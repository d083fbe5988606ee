//! The inbound object: a tc ingress classifier on a pod's interface. A new TCP
//! connection (SYN) to a captured port is assigned to Envoy's inbound listener with
//! `bpf_sk_assign`; the accepted socket's local address stays the original destination
//! (as with TPROXY, but needing no policy routing, marks or IP_TRANSPARENT).
//! `weir_inbound` serves every pod on a node (config by the frame's destination MAC
//! and IP address); `weir_in_pod` is a copy for one interface with its own
//! `INBOUND_CONFIG`.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{TC_ACT_OK, bpf_sock_tuple},
    helpers::{bpf_sk_assign, bpf_sk_release, bpf_skc_lookup_tcp},
    macros::{classifier, map},
    maps::{Array, HashMap, PerCpuArray, PerCpuHashMap},
    programs::TcContext,
};
use weir_ebpf_common::inbound::{InboundConfig, InboundCounters, InboundKey, InboundPod, MAX_PODS, counter};

/// BPF_F_NO_PREALLOC: entries are allocated as pods register.
const NO_PREALLOC: u32 = 1;

#[map]
static INBOUND_PODS: HashMap<InboundKey, InboundPod> = HashMap::with_max_entries(MAX_PODS, NO_PREALLOC);
#[map]
static INBOUND_CONFIG: Array<InboundConfig> = Array::with_max_entries(1, 0);
#[map]
static INBOUND_COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);
#[map]
static INBOUND_POD_COUNTERS: PerCpuHashMap<u64, InboundCounters> =
    PerCpuHashMap::with_max_entries(MAX_PODS, NO_PREALLOC);

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const TCP_LISTEN: u32 = 10;
/// BPF_F_CURRENT_NETNS
const CURRENT_NETNS: u64 = u64::MAX;

/// Counts a decision in the program's totals and, when the pod has them, its own slots.
fn count(pod: Option<*mut InboundCounters>, slot: u32) {
    if let Some(v) = INBOUND_COUNTERS.get_ptr_mut(slot) {
        unsafe { *v += 1 };
    }
    if let Some(p) = pod
        && let Some(v) = unsafe { (*p).slots.get_mut(slot as usize) }
    {
        *v += 1;
    }
}

/// The per-node classifier: the pod's config by the frame's destination, its counters
/// by the pod's netns cookie.
#[classifier]
pub fn weir_inbound(ctx: TcContext) -> i32 {
    let _ = try_inbound(&ctx, |key| {
        // SAFETY: a hash lookup; the value is only read.
        let pod = unsafe { INBOUND_PODS.get(key) }?;
        Some((&pod.config, INBOUND_POD_COUNTERS.get_ptr_mut(&pod.netns)))
    });
    TC_ACT_OK
}

/// The copy for one interface: its own config (its totals are its one pod's).
#[classifier]
pub fn weir_in_pod(ctx: TcContext) -> i32 {
    let _ = try_inbound(&ctx, |_| INBOUND_CONFIG.get(0).map(|c| (c, None)));
    TC_ACT_OK
}

#[inline(always)]
fn try_inbound<'a>(
    ctx: &TcContext,
    config: impl FnOnce(&InboundKey) -> Option<(&'a InboundConfig, Option<*mut InboundCounters>)>,
) -> Option<()> {
    let proto: u16 = u16::from_be(ctx.load(12).ok()?);
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let mut key = InboundKey { mac: ctx.load(0).ok()?, _pad: [0; 2], addr: [0; 16] };
    let (tcp_off, size) = match proto {
        ETH_P_IP => {
            let vihl: u8 = ctx.load(ETH_HLEN).ok()?;
            if ctx.load::<u8>(ETH_HLEN + 9).ok()? != IPPROTO_TCP {
                return None;
            }
            let t = unsafe { &mut tuple.__bindgen_anon_1.ipv4 };
            t.saddr = ctx.load(ETH_HLEN + 12).ok()?;
            t.daddr = ctx.load(ETH_HLEN + 16).ok()?;
            let daddr: [u8; 4] = ctx.load(ETH_HLEN + 16).ok()?;
            (key.addr[0], key.addr[1], key.addr[2], key.addr[3]) = (daddr[0], daddr[1], daddr[2], daddr[3]);
            (ETH_HLEN + usize::from(vihl & 0x0f) * 4, core::mem::size_of_val(t))
        }
        ETH_P_IPV6 => {
            // Extension headers are not followed: TCP must be the next header.
            if ctx.load::<u8>(ETH_HLEN + 6).ok()? != IPPROTO_TCP {
                return None;
            }
            let t = unsafe { &mut tuple.__bindgen_anon_1.ipv6 };
            t.saddr = ctx.load(ETH_HLEN + 8).ok()?;
            t.daddr = ctx.load(ETH_HLEN + 24).ok()?;
            key.addr = ctx.load(ETH_HLEN + 24).ok()?;
            (ETH_HLEN + 40, core::mem::size_of_val(t))
        }
        _ => return None,
    };
    let flags: u8 = ctx.load(tcp_off + 13).ok()?;
    // SYN without ACK: a new connection. Later segments find the accepted socket.
    if flags & 0x12 != 0x02 {
        return None;
    }
    let sport: u16 = ctx.load(tcp_off).ok()?;
    let dport: u16 = ctx.load(tcp_off + 2).ok()?;
    let (cfg, pod) = config(&key)?;
    if !cfg.captures(u16::from_be(dport)) {
        count(pod, counter::NOT_CAPTURED);
        return None;
    }
    let listen_port = cfg.capture_port.to_be();
    unsafe {
        if proto == ETH_P_IP {
            tuple.__bindgen_anon_1.ipv4.sport = sport;
            tuple.__bindgen_anon_1.ipv4.dport = listen_port;
        } else {
            tuple.__bindgen_anon_1.ipv6.sport = sport;
            tuple.__bindgen_anon_1.ipv6.dport = listen_port;
        }
        let sk = bpf_skc_lookup_tcp(ctx.skb.skb.cast(), &mut tuple, size as u32, CURRENT_NETNS, 0);
        if sk.is_null() {
            count(pod, counter::NO_LISTENER);
            return None;
        }
        if (*sk).state != TCP_LISTEN {
            bpf_sk_release(sk.cast());
            count(pod, counter::NO_LISTENER);
            return None;
        }
        let ret = bpf_sk_assign(ctx.skb.skb.cast(), sk.cast(), 0);
        bpf_sk_release(sk.cast());
        count(pod, if ret == 0 { counter::ASSIGNED } else { counter::ASSIGN_FAILED });
    }
    Some(())
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
