//! The stand-in's maps (names and layouts in the library, `weir_lb_standin`) and its
//! settings and counters.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
};
use weir_lb_standin::{
    Backend4, Backend6, LbConfig, RevNat4, RevNat4Key, RevNat6, RevNat6Key, Service4Key, Service6Key,
    ServiceValue, counter,
};

const SERVICES: u32 = 256;
const NODE_ADDRESSES: u32 = 64;
/// Cilium's `LB4_REVERSE_NAT_SK_MAP_SIZE` is sized by the node; the tests need few.
const REVERSE_ENTRIES: u32 = 4096;

#[map]
pub static SERVICES4: HashMap<Service4Key, ServiceValue> = HashMap::with_max_entries(SERVICES, 0);
#[map]
pub static SERVICES6: HashMap<Service6Key, ServiceValue> = HashMap::with_max_entries(SERVICES, 0);
#[map]
pub static BACKENDS4: HashMap<u32, Backend4> = HashMap::with_max_entries(SERVICES, 0);
#[map]
pub static BACKENDS6: HashMap<u32, Backend6> = HashMap::with_max_entries(SERVICES, 0);
#[map]
pub static REVERSE_SK4: LruHashMap<RevNat4Key, RevNat4> = LruHashMap::with_max_entries(REVERSE_ENTRIES, 0);
#[map]
pub static REVERSE_SK6: LruHashMap<RevNat6Key, RevNat6> = LruHashMap::with_max_entries(REVERSE_ENTRIES, 0);
#[map]
pub static NODE_ADDRS4: HashMap<u32, u32> = HashMap::with_max_entries(NODE_ADDRESSES, 0);
#[map]
pub static NODE_ADDRS6: HashMap<[u32; 4], u32> = HashMap::with_max_entries(NODE_ADDRESSES, 0);
#[map]
pub static CONFIG: Array<LbConfig> = Array::with_max_entries(1, 0);
#[map]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

/// The settings the tests wrote (all zero, i.e. every feature off, until they do).
#[inline(always)]
pub fn config() -> LbConfig {
    CONFIG.get(0).copied().unwrap_or_default()
}

#[inline(always)]
pub fn count(slot: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(slot) {
        // Per-CPU value: no other CPU writes it.
        unsafe { *c += 1 };
    }
}
