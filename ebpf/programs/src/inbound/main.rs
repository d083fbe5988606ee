//! The inbound object: a tc ingress classifier on a pod's interface. A new TCP
//! connection (SYN) to a captured port is assigned to Envoy's inbound listener with
//! `bpf_sk_assign`; the accepted socket's local address stays the original destination
//! (as with TPROXY, but needing no policy routing, marks or IP_TRANSPARENT).
//! `weir_inbound` serves every pod on a node (config by the frame's destination MAC
//! and IP address); `weir_in_pod` is a copy for one interface with its own
//! `INBOUND_CONFIG`.
//!
//! Capture fails closed. For a packet to a pod address with inbound capture:
//! - a SYN to a captured port that cannot be assigned (nothing listens on 15006, or
//!   the kernel refuses the assignment) is dropped, where Istio's REDIRECT would
//!   refuse it: the client retries its SYN and connects once Envoy listens;
//! - a packet that is, or may be, TCP but cannot be read is dropped: IPv4 and IPv6
//!   fragments (reassembly happens after this hook, where nothing would send the
//!   connection to Envoy), IPv6 extension headers beyond [`MAX_EXT_HEADERS`], a TCP
//!   header cut short, IPsec (ESP, AH in IPv4, IPComp) and tunnels (IP in IP, IPv6
//!   in IP, GRE), whose inner packet the stack sees only after this hook, on another
//!   device;
//! - frames with more than [`MAX_VLAN_TAGS`] VLAN tags are dropped; up to that many are
//!   read through (a tag the kernel did not take off already).
//! Every other packet (other hosts' addresses, UDP, ICMP, later TCP segments, which
//! find their socket) passes.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{BPF_ANY, TC_ACT_OK, TC_ACT_SHOT, bpf_sock_tuple},
    helpers::{bpf_map_delete_elem, bpf_map_update_elem, bpf_sk_assign, bpf_sk_release, bpf_skc_lookup_tcp},
    macros::{classifier, map, sk_lookup},
    maps::{Array, HashMap, PerCpuArray, PerCpuHashMap, SockHash},
    programs::{SkLookupContext, TcContext},
};
use weir_ebpf_common::inbound::{
    InboundConfig, InboundCounters, InboundKey, InboundPod, MAX_ADDRESS_ENTRIES, MAX_PODS, MAX_REOPENING,
    ReopenKey, counter,
};

/// BPF_F_NO_PREALLOC: entries are allocated as pods register.
const NO_PREALLOC: u32 = 1;

#[map]
static INBOUND_PODS: HashMap<InboundKey, InboundPod> =
    HashMap::with_max_entries(MAX_ADDRESS_ENTRIES, NO_PREALLOC);
#[map]
static INBOUND_CONFIG: Array<InboundConfig> = Array::with_max_entries(1, 0);
#[map]
static INBOUND_COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);
#[map]
static INBOUND_POD_COUNTERS: PerCpuHashMap<u64, InboundCounters> =
    PerCpuHashMap::with_max_entries(MAX_PODS, NO_PREALLOC);

/// `REOPENING[4-tuple]`: Envoy's inbound listener for a new connection whose 4-tuple
/// the pod's previous connection still holds in TIME_WAIT. The classifier cannot assign
/// such a SYN to the listener (the kernel drops a connection request that duplicates a
/// TIME_WAIT socket); it lets the SYN find the TIME_WAIT socket, which the kernel
/// reopens by looking up a listener, and [`weir_in_reopen`] answers that lookup from
/// here. As iptables' REDIRECT to 15006 reopens it.
#[map]
static INBOUND_REOPENING: SockHash<ReopenKey> = SockHash::with_max_entries(MAX_REOPENING, 0);

const ETH_P_IP: u16 = 0x0800;
const IPPROTO_TCP: u32 = 6;
const AF_INET: u32 = 2;
const TCP_TIME_WAIT: u32 = 6;
/// sk_lookup verdicts.
const SK_PASS: u32 = 1;
const ETH_P_IPV6: u16 = 0x86dd;
/// VLAN tags read through before a frame counts as unreadable.
const MAX_VLAN_TAGS: usize = 2;
const TCP_LISTEN: u32 = 10;
/// BPF_F_CURRENT_NETNS
const CURRENT_NETNS: u64 = u64::MAX;
/// IPv6 extension headers walked before the packet counts as unreadable.
const MAX_EXT_HEADERS: usize = 8;

/// IP protocol numbers (IPv4's protocol, IPv6's next header).
mod proto {
    pub const HOPOPTS: u8 = 0;
    pub const IPIP: u8 = 4;
    pub const TCP: u8 = 6;
    pub const IPV6: u8 = 41;
    pub const GRE: u8 = 47;
    pub const ROUTING: u8 = 43;
    pub const FRAGMENT: u8 = 44;
    pub const ESP: u8 = 50;
    pub const AH: u8 = 51;
    pub const DSTOPTS: u8 = 60;
    pub const IPCOMP: u8 = 108;
}

/// What the classifier does with a packet.
enum Verdict {
    Pass,
    /// Dropped (and counted).
    Refuse,
}

/// Counts a decision in the program's totals and, when the pod has them, its own slots.
#[inline(always)]
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
    classify(&ctx, |key| {
        // SAFETY: a hash lookup; the value is only read.
        let pod = unsafe { INBOUND_PODS.get(key) }?;
        Some((&pod.config, INBOUND_POD_COUNTERS.get_ptr_mut(&pod.netns)))
    })
}

/// The copy for one interface: its own config (its totals are its one pod's).
#[classifier]
pub fn weir_in_pod(ctx: TcContext) -> i32 {
    classify(&ctx, |_| INBOUND_CONFIG.get(0).map(|c| (c, None)))
}

#[inline(always)]
fn classify<'a>(
    ctx: &TcContext,
    config: impl FnOnce(&InboundKey) -> Option<(&'a InboundConfig, Option<*mut InboundCounters>)>,
) -> i32 {
    match try_inbound(ctx, config) {
        Some(Verdict::Refuse) => TC_ACT_SHOT,
        _ => TC_ACT_OK,
    }
}

/// Where the TCP header starts, or why there is none to read.
enum Transport {
    /// TCP at this offset.
    Tcp(usize),
    /// Not TCP: pass.
    Other,
    /// Possibly TCP, unreadable: refuse.
    Unreadable,
}

/// 802.1Q, 802.1ad (QinQ), and the older QinQ ethertype.
#[inline(always)]
fn is_vlan(ethertype: u16) -> bool {
    matches!(ethertype, 0x8100 | 0x88a8 | 0x9100)
}

/// Where the network header starts (after the Ethernet header and up to
/// [`MAX_VLAN_TAGS`] tags) and its ethertype; `None`: more tags than that, or cut short.
#[inline(always)]
fn network_header(ctx: &TcContext) -> Option<(usize, u16)> {
    let mut off = 12;
    let mut ethertype = u16::from_be(ctx.load(off).ok()?);
    for _ in 0..MAX_VLAN_TAGS {
        if !is_vlan(ethertype) {
            break;
        }
        off += 4;
        ethertype = u16::from_be(ctx.load(off).ok()?);
    }
    (!is_vlan(ethertype)).then_some((off + 2, ethertype))
}

/// An IPv4 packet's transport: TCP unless fragmented, nothing to read for IPsec and
/// tunnels.
#[inline(always)]
fn transport_v4(ctx: &TcContext, l3: usize) -> Transport {
    let Ok(vihl) = ctx.load::<u8>(l3) else { return Transport::Unreadable };
    let Ok(protocol) = ctx.load::<u8>(l3 + 9) else { return Transport::Unreadable };
    let Ok(frag) = ctx.load::<u16>(l3 + 6) else { return Transport::Unreadable };
    // More fragments (0x2000) or an offset (0x1fff): reassembled after this hook.
    let fragment = u16::from_be(frag) & 0x3fff != 0;
    let ihl = usize::from(vihl & 0x0f) * 4;
    match protocol {
        proto::TCP if fragment || ihl < 20 => Transport::Unreadable,
        proto::TCP => Transport::Tcp(l3 + ihl),
        proto::ESP | proto::AH | proto::IPCOMP | proto::IPIP | proto::IPV6 | proto::GRE => {
            Transport::Unreadable
        }
        _ => Transport::Other,
    }
}

/// An IPv6 packet's transport, after walking up to [`MAX_EXT_HEADERS`] extension
/// headers.
#[inline(always)]
fn transport_v6(ctx: &TcContext, l3: usize) -> Transport {
    let Ok(mut next) = ctx.load::<u8>(l3 + 6) else { return Transport::Unreadable };
    let mut off = l3 + 40;
    for _ in 0..MAX_EXT_HEADERS {
        let len = match next {
            proto::TCP => return Transport::Tcp(off),
            proto::HOPOPTS | proto::ROUTING | proto::DSTOPTS => match ctx.load::<u8>(off + 1) {
                Ok(n) => (usize::from(n) + 1) * 8,
                Err(_) => return Transport::Unreadable,
            },
            proto::AH => match ctx.load::<u8>(off + 1) {
                Ok(n) => (usize::from(n) + 2) * 4,
                Err(_) => return Transport::Unreadable,
            },
            proto::FRAGMENT => {
                let Ok(frag) = ctx.load::<u16>(off + 2) else { return Transport::Unreadable };
                // Offset (upper 13 bits) or more fragments (bit 0): a real fragment.
                // An atomic fragment (neither) is read through.
                if u16::from_be(frag) & 0xfff9 != 0 {
                    return match ctx.load::<u8>(off) {
                        Ok(n) if !may_hide_tcp(n) => Transport::Other,
                        _ => Transport::Unreadable,
                    };
                }
                8
            }
            proto::ESP | proto::IPCOMP | proto::IPIP | proto::IPV6 | proto::GRE => {
                return Transport::Unreadable;
            }
            _ => return Transport::Other,
        };
        let Ok(n) = ctx.load::<u8>(off) else { return Transport::Unreadable };
        next = n;
        off += len;
    }
    match next {
        proto::TCP => Transport::Tcp(off),
        n if may_hide_tcp(n) => Transport::Unreadable,
        _ => Transport::Other,
    }
}

/// Whether a next header is TCP or may lead to it (an extension header, IPsec, a
/// tunnel).
#[inline(always)]
fn may_hide_tcp(next: u8) -> bool {
    matches!(
        next,
        proto::TCP
            | proto::HOPOPTS
            | proto::ROUTING
            | proto::DSTOPTS
            | proto::AH
            | proto::FRAGMENT
            | proto::ESP
            | proto::IPCOMP
            | proto::IPIP
            | proto::IPV6
            | proto::GRE
    )
}

/// The TCP flags and ports at `off`, if the header is there.
#[inline(always)]
fn tcp_header(ctx: &TcContext, off: usize) -> Option<(u8, u16, u16)> {
    Some((ctx.load::<u8>(off + 13).ok()?, ctx.load::<u16>(off).ok()?, ctx.load::<u16>(off + 2).ok()?))
}

#[inline(always)]
fn try_inbound<'a>(
    ctx: &TcContext,
    config: impl FnOnce(&InboundKey) -> Option<(&'a InboundConfig, Option<*mut InboundCounters>)>,
) -> Option<Verdict> {
    let Some((l3, ethertype)) = network_header(ctx) else {
        // Tags stacked deeper than we read: whatever is inside, it may be TCP to a pod.
        return Some(refuse(None, counter::UNPARSEABLE));
    };
    let transport = match ethertype {
        ETH_P_IP => transport_v4(ctx, l3),
        ETH_P_IPV6 => transport_v6(ctx, l3),
        _ => return None,
    };
    // The fast path, before any map lookup: not TCP, or a segment of a connection
    // (not a SYN), which finds its socket.
    let tcp = match transport {
        Transport::Other => return None,
        Transport::Tcp(off) => match tcp_header(ctx, off) {
            Some((flags, _, _)) if flags & 0x12 != 0x02 => return None,
            header => header,
        },
        Transport::Unreadable => None,
    };
    // A SYN, or a packet that cannot be read: what the destination pod asks for.
    let mut buffer = core::mem::MaybeUninit::<bpf_sock_tuple>::uninit();
    let (tuple, size, key) = syn_lookup(ctx, ethertype, l3, &mut buffer)?;
    let (cfg, pod) = config(&key)?;
    // SYN without ACK (checked above): a new connection.
    let Some((_, sport, dport)) = tcp else { return Some(refuse(pod, counter::UNPARSEABLE)) };
    // An ambient pod's kubelet probes (SNATed on the host to Istio's probe address) are
    // not ztunnel's: they reach the app, as Istio's in-pod rules let them.
    let from_probe = if ethertype == ETH_P_IP {
        cfg.from_probe_source4(unsafe { tuple.__bindgen_anon_1.ipv4.saddr }.to_ne_bytes())
    } else {
        cfg.from_probe_source6(bytes16(unsafe { tuple.__bindgen_anon_1.ipv6.saddr }))
    };
    if from_probe || !cfg.captures(u16::from_be(dport)) {
        count(pod, counter::NOT_CAPTURED);
        return Some(Verdict::Pass);
    }
    let listen_port = cfg.capture_port.to_be();
    unsafe {
        set_ports(tuple, ethertype, sport, dport);
        // The pod's previous connection of this 4-tuple in TIME_WAIT (it closed first):
        // the listener lookup of the kernel's reopen is answered by `weir_in_reopen`.
        let reopening = in_time_wait(ctx, tuple, size);
        let reopen_key = reopen_key(tuple, ethertype);
        set_ports(tuple, ethertype, sport, listen_port);
        let sk = bpf_skc_lookup_tcp(ctx.skb.skb.cast(), &raw mut *tuple, size as u32, CURRENT_NETNS, 0);
        if sk.is_null() {
            return Some(refuse(pod, counter::NO_LISTENER));
        }
        if (*sk).state != TCP_LISTEN {
            bpf_sk_release(sk.cast());
            return Some(refuse(pod, counter::NO_LISTENER));
        }
        if reopening {
            // Unassigned: the SYN goes to the TIME_WAIT socket, whose reopen asks for a
            // listener; a map that cannot take the entry refuses the connection.
            let ret = bpf_map_update_elem(
                core::ptr::addr_of!(INBOUND_REOPENING).cast_mut().cast(),
                core::ptr::addr_of!(reopen_key).cast(),
                sk.cast_const().cast(),
                u64::from(BPF_ANY),
            );
            bpf_sk_release(sk.cast());
            if ret != 0 {
                return Some(refuse(pod, counter::ASSIGN_FAILED));
            }
            count(pod, counter::ASSIGNED);
            return Some(Verdict::Pass);
        }
        let ret = bpf_sk_assign(ctx.skb.skb.cast(), sk.cast(), 0);
        bpf_sk_release(sk.cast());
        if ret != 0 {
            return Some(refuse(pod, counter::ASSIGN_FAILED));
        }
    }
    count(pod, counter::ASSIGNED);
    Some(Verdict::Pass)
}

/// The SYN's lookup tuple (its addresses; `set_ports` writes the ports), the size of its
/// family's part, and the key of the pod it is for (the interface's MAC and the
/// destination address). Nothing is zeroed as a whole here: LLVM makes that a call to
/// `memset`, and these programs make no BPF-to-BPF calls (ARCHITECTURE.md, "No calls
/// between functions"). Each family writes the part of the tuple the lookups are
/// given, and nothing reads the rest; the key is built from whole words.
#[inline(always)]
fn syn_lookup<'b>(
    ctx: &TcContext,
    ethertype: u16,
    l3: usize,
    buffer: &'b mut core::mem::MaybeUninit<bpf_sock_tuple>,
) -> Option<(&'b mut bpf_sock_tuple, usize, InboundKey)> {
    // SAFETY: a reference into the buffer, never read as a whole: `bpf_sock_tuple` is
    // a union of the two families' parts, which may hold uninitialized bytes.
    let tuple: &mut bpf_sock_tuple = unsafe { &mut *buffer.as_mut_ptr() };
    let mac: [u8; 6] = ctx.load(0).ok()?;
    let mac_word = u64::from_ne_bytes([mac[0], mac[1], mac[2], mac[3], mac[4], mac[5], 0, 0]);
    let (size, addr_words) = if ethertype == ETH_P_IP {
        let t = unsafe { &mut tuple.__bindgen_anon_1.ipv4 };
        t.saddr = ctx.load(l3 + 12).ok()?;
        t.daddr = ctx.load(l3 + 16).ok()?;
        // The key's address: the destination's four bytes first, the rest of the 16
        // zero (`InboundKey`).
        let d = t.daddr.to_ne_bytes();
        (core::mem::size_of_val(t), [u64::from_ne_bytes([d[0], d[1], d[2], d[3], 0, 0, 0, 0]), 0])
    } else {
        let t = unsafe { &mut tuple.__bindgen_anon_1.ipv6 };
        t.saddr = ctx.load(l3 + 8).ok()?;
        t.daddr = ctx.load(l3 + 24).ok()?;
        let d = bytes16(t.daddr);
        let word = |i: usize| {
            u64::from_ne_bytes([d[i], d[i + 1], d[i + 2], d[i + 3], d[i + 4], d[i + 5], d[i + 6], d[i + 7]])
        };
        (core::mem::size_of_val(t), [word(0), word(8)])
    };
    // SAFETY: `InboundKey` is 24 bytes of `u8` arrays (mac, pad, address): any bytes.
    let key: InboundKey = unsafe { core::mem::transmute([mac_word, addr_words[0], addr_words[1]]) };
    Some((tuple, size, key))
}

/// An IPv6 address as the tuple holds it (four words, network order in memory) as its
/// 16 bytes.
#[inline(always)]
fn bytes16(words: [u32; 4]) -> [u8; 16] {
    let [a, b, c, d] = words.map(u32::to_ne_bytes);
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2], d[3]]
}

/// Whether `tuple` (the SYN's own, ports set; `size` its family's part) is a socket of
/// this namespace in TIME_WAIT.
#[inline(always)]
fn in_time_wait(ctx: &TcContext, tuple: &mut bpf_sock_tuple, size: usize) -> bool {
    // SAFETY: the lookup gets a tuple of `size` bytes; a socket it returns is read once
    // and released before returning.
    unsafe {
        let previous = bpf_skc_lookup_tcp(ctx.skb.skb.cast(), tuple, size as u32, CURRENT_NETNS, 0);
        if previous.is_null() {
            return false;
        }
        let time_wait = (*previous).state == TCP_TIME_WAIT;
        bpf_sk_release(previous.cast());
        time_wait
    }
}

/// The reopen map's key for `tuple` (the SYN's own, ports set) of its family.
#[inline(always)]
fn reopen_key(tuple: &bpf_sock_tuple, ethertype: u16) -> ReopenKey {
    // SAFETY: the union's member is the one `ethertype` filled in.
    unsafe {
        if ethertype == ETH_P_IP {
            let t = &tuple.__bindgen_anon_1.ipv4;
            ReopenKey::v4(t.saddr, t.sport, t.daddr, u16::from_be(t.dport))
        } else {
            let t = &tuple.__bindgen_anon_1.ipv6;
            ReopenKey::v6(t.saddr, t.sport, t.daddr, u16::from_be(t.dport))
        }
    }
}

/// Fills in a lookup tuple's ports (network order) for its family.
#[inline(always)]
fn set_ports(tuple: &mut bpf_sock_tuple, ethertype: u16, sport: u16, dport: u16) {
    // Writing a union's field is safe (reading one is not).
    if ethertype == ETH_P_IP {
        tuple.__bindgen_anon_1.ipv4.sport = sport;
        tuple.__bindgen_anon_1.ipv4.dport = dport;
    } else {
        tuple.__bindgen_anon_1.ipv6.sport = sport;
        tuple.__bindgen_anon_1.ipv6.dport = dport;
    }
}

/// The pod namespace's socket lookup hook: a listener lookup for a 4-tuple the
/// classifier let through to its TIME_WAIT socket gets Envoy's inbound listener; every
/// other lookup goes on as the kernel would make it.
#[sk_lookup]
pub fn weir_in_reopen(ctx: SkLookupContext) -> u32 {
    let l = ctx.lookup;
    // Each field read on its own, at its own offset from the context: the verifier
    // refuses a load through a context pointer moved first (as a copy of an array
    // would be compiled).
    // SAFETY: the context is the kernel's bpf_sk_lookup for this call.
    let field = |f: *const u32| unsafe { core::ptr::read_volatile(f) };
    let (protocol, family) =
        unsafe { (field(core::ptr::addr_of!((*l).protocol)), field(core::ptr::addr_of!((*l).family))) };
    if protocol != IPPROTO_TCP {
        return SK_PASS;
    }
    // SAFETY: as above.
    let (local_port, remote_port) = unsafe {
        (
            field(core::ptr::addr_of!((*l).local_port)) as u16,
            core::ptr::read_volatile(core::ptr::addr_of!((*l).remote_port)),
        )
    };
    let key = if family == AF_INET {
        // SAFETY: as above.
        let (remote, local) = unsafe {
            (field(core::ptr::addr_of!((*l).remote_ip4)), field(core::ptr::addr_of!((*l).local_ip4)))
        };
        ReopenKey::v4(remote, remote_port, local, local_port)
    } else {
        // SAFETY: as above.
        let (remote, local) = unsafe {
            (
                [
                    field(core::ptr::addr_of!((*l).remote_ip6[0])),
                    field(core::ptr::addr_of!((*l).remote_ip6[1])),
                    field(core::ptr::addr_of!((*l).remote_ip6[2])),
                    field(core::ptr::addr_of!((*l).remote_ip6[3])),
                ],
                [
                    field(core::ptr::addr_of!((*l).local_ip6[0])),
                    field(core::ptr::addr_of!((*l).local_ip6[1])),
                    field(core::ptr::addr_of!((*l).local_ip6[2])),
                    field(core::ptr::addr_of!((*l).local_ip6[3])),
                ],
            )
        };
        ReopenKey::v6(remote, remote_port, local, local_port)
    };
    if INBOUND_REOPENING.redirect_sk_lookup(&ctx, key, 0).is_ok() {
        // SAFETY: a delete from this program's own map.
        unsafe {
            bpf_map_delete_elem(
                core::ptr::addr_of!(INBOUND_REOPENING).cast_mut().cast(),
                core::ptr::addr_of!(key).cast(),
            )
        };
    }
    SK_PASS
}

#[inline(always)]
fn refuse(pod: Option<*mut InboundCounters>, slot: u32) -> Verdict {
    count(pod, slot);
    Verdict::Refuse
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
