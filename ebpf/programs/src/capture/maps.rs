//! The capture object's maps; names and value types come from `weir_ebpf_common`.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, SockHash},
};
use weir_ebpf_common::capture::{
    CidrV4, CidrV6, MAX_CIDRS, MAX_PODS, MAX_TRACKED_CONNECTIONS, OrigDst, PairKey, PodConfig, control,
    counter,
};

/// BPF_F_NO_PREALLOC, required for LPM tries.
const NO_PREALLOC: u32 = 1;

#[map]
pub static POD_CONFIG: HashMap<u64, PodConfig> = HashMap::with_max_entries(MAX_PODS, 0);

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

#[map]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);
#[map]
pub static CONTROL: Array<u32> = Array::with_max_entries(control::COUNT, 0);

/// Adds one to a counter slot.
#[inline(always)]
pub fn count(slot: u32) {
    add(slot, 1);
}

#[inline(always)]
pub fn add(slot: u32, n: u64) {
    if let Some(v) = COUNTERS.get_ptr_mut(slot) {
        // Per-CPU slot: no other CPU writes it.
        unsafe { *v += n };
    }
}

/// Whether aya-log records are wanted (`weir capture log on`).
#[inline(always)]
pub fn log_enabled() -> bool {
    CONTROL.get(control::LOG).is_some_and(|v| *v != 0)
}
