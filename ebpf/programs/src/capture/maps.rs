//! The capture object's maps; names and value types come from `weir_ebpf_common`.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuHashMap, SockHash},
};
use weir_ebpf_common::{
    capture::{
        CidrV4, CidrV6, MAX_CIDRS, MAX_LISTENERS, MAX_PEER_ADDRESSES, MAX_PODS, MAX_TRACKED_CONNECTIONS,
        OrigDst, PairKey, PodConfig, PodCounters, control, flags,
    },
    inbound::InboundConfig,
};

/// BPF_F_NO_PREALLOC: required for LPM tries; for `POD_CONFIG`, an entry replaced or
/// removed is freed only after every program reading it is done (a preallocated
/// element is reused at once, and a reader could see another pod's config).
const NO_PREALLOC: u32 = 1;

#[map]
pub static POD_CONFIG: HashMap<u64, PodConfig> = HashMap::with_max_entries(MAX_PODS, NO_PREALLOC);

/// Destinations never captured (`-x`), and the pod's own addresses (value 2).
#[map]
pub static EXCLUDE_V4: LpmTrie<CidrV4, u8> = LpmTrie::with_max_entries(MAX_CIDRS, NO_PREALLOC);
#[map]
pub static EXCLUDE_V6: LpmTrie<CidrV6, u8> = LpmTrie::with_max_entries(MAX_CIDRS, NO_PREALLOC);
/// Destinations captured (`-i` without the wildcard).
#[map]
pub static INCLUDE_V4: LpmTrie<CidrV4, u8> = LpmTrie::with_max_entries(MAX_CIDRS, NO_PREALLOC);
#[map]
pub static INCLUDE_V6: LpmTrie<CidrV6, u8> = LpmTrie::with_max_entries(MAX_CIDRS, NO_PREALLOC);
/// The pod's resolv.conf servers.
#[map]
pub static DNS_V4: LpmTrie<CidrV4, u8> = LpmTrie::with_max_entries(MAX_CIDRS, NO_PREALLOC);
#[map]
pub static DNS_V6: LpmTrie<CidrV6, u8> = LpmTrie::with_max_entries(MAX_CIDRS, NO_PREALLOC);

/// Original destination by socket cookie, from connect until the connection is up.
#[map]
pub static ORIG_BY_COOKIE: LruHashMap<u64, OrigDst> =
    LruHashMap::with_max_entries(MAX_TRACKED_CONNECTIONS, 0);
/// The address a redirected socket connected to, while the socket lives: what its
/// `getpeername()` returns (`peer.rs`).
#[map]
pub static PEER_BY_COOKIE: LruHashMap<u64, OrigDst> = LruHashMap::with_max_entries(MAX_PEER_ADDRESSES, 0);
/// Original destination by the app side's 4-tuple, until Envoy asks for it.
#[map]
pub static ORIG_BY_PAIR: LruHashMap<PairKey, OrigDst> =
    LruHashMap::with_max_entries(MAX_TRACKED_CONNECTIONS, 0);
/// The DNS server a UDP socket addressed, so replies appear to come from it.
#[map]
pub static DNS_BY_COOKIE: LruHashMap<u64, OrigDst> = LruHashMap::with_max_entries(MAX_TRACKED_CONNECTIONS, 0);
/// Local socket pairs whose data sk_msg passes directly.
#[map]
pub static SOCK_PAIRS: SockHash<PairKey> = SockHash::with_max_entries(MAX_TRACKED_CONNECTIONS, 0);
/// Senders that already sent through the stack before their peer was registered:
/// they keep using it, so a stream is never split across two paths (reordering).
#[map]
pub static NO_REDIRECT: LruHashMap<PairKey, u8> = LruHashMap::with_max_entries(MAX_TRACKED_CONNECTIONS, 0);

/// Each pod's decision counters, per CPU; the agent adds a pod's entry when it
/// registers the pod (allocated then, not for every possible pod).
#[map]
pub static POD_COUNTERS: PerCpuHashMap<u64, PodCounters> =
    PerCpuHashMap::with_max_entries(MAX_PODS, NO_PREALLOC);
#[map]
pub static CONTROL: Array<u32> = Array::with_max_entries(control::COUNT, 0);

/// The inbound ports of each pod with inbound capture (as its classifier has them), by
/// netns cookie: what the inbound guard checks a listener's port against.
#[map]
pub static INBOUND_PORTS: HashMap<u64, InboundConfig> = HashMap::with_max_entries(MAX_PODS, NO_PREALLOC);
/// Listening sockets of pods with inbound capture (socket cookie → netns cookie),
/// marked when they listen, gone when they close.
#[map]
pub static LISTENERS: HashMap<u64, u64> = HashMap::with_max_entries(MAX_LISTENERS, NO_PREALLOC);
/// How many listeners each pod has in `LISTENERS` (its entry is made at registration).
#[map]
pub static LISTENER_COUNTS: HashMap<u64, u64> = HashMap::with_max_entries(MAX_PODS, NO_PREALLOC);

/// Adds `n` to the u64 at `p` atomically (wrapping: `u64::MAX` takes one away): the
/// BPF target has no `AtomicU64::fetch_add`, the kernel's atomic add (XADD) is what
/// this compiles to, its result unused.
///
/// # Safety
/// `p` points at a live map value.
#[inline(always)]
pub unsafe fn atomic_add(p: *mut u64, n: u64) {
    unsafe { core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(p, n) };
}

/// Adds one to a pod's counter slot.
#[inline(always)]
pub fn count(cfg: &PodConfig, netns: u64, slot: u32) {
    if !cfg.has(flags::NO_COUNTERS) {
        add(netns, slot, 1);
    }
}

/// Adds `n` to a pod's counter slot (no-op for a pod without counters).
#[inline(always)]
pub fn add(netns: u64, slot: u32, n: u64) {
    if slot >= weir_ebpf_common::capture::counter::COUNT {
        return;
    }
    if let Some(c) = POD_COUNTERS.get_ptr_mut(&netns) {
        // Per-CPU value: no other CPU writes it.
        unsafe { (*c).slots[slot as usize] += n };
    }
}

/// Whether aya-log records are wanted (`weir capture log on`).
#[inline(always)]
pub fn log_enabled() -> bool {
    CONTROL.get(control::LOG).is_some_and(|v| *v != 0)
}
