//! Address helpers shared by the hooks: loopback tests, LPM lookups keyed by the pod's
//! netns cookie, and the kernel context accessors aya does not wrap.

use aya_ebpf::{
    helpers::{bpf_get_current_uid_gid, bpf_get_netns_cookie, bpf_get_socket_cookie},
    maps::{LpmTrie, lpm_trie::Key},
};
use weir_ebpf_common::capture::{CidrV4, CidrV6, KEY_PREFIX_BITS, PairKey, PodConfig};

/// Loads one field of a kernel context or socket struct at its own offset. The
/// verifier rejects derived pointers into these structs, which LLVM otherwise makes
/// when it reads neighbouring fields through a shared base, e.g.
///   r4 = r6; r4 += 28; r4 = *(u32 *)(r4 +0)
///   -> "dereference of modified ctx ptr R4 off=28 disallowed"
///   r5 = r1; r5 += 52 -> "R5 pointer arithmetic on sock prohibited"
macro_rules! field {
    ($ptr:expr, $($f:tt)+) => {
        core::ptr::read_volatile(core::ptr::addr_of!((*$ptr).$($f)+))
    };
}
pub(crate) use field;

pub const AF_INET: u16 = 2;
pub const AF_INET6: u16 = 10;
pub const SOCK_STREAM: u32 = 1;
pub const SOCK_DGRAM: u32 = 2;
/// Verdict that lets a cgroup hook's syscall proceed.
pub const ALLOW: i32 = 1;
/// A cgroup hook's refusal: the call fails with EPERM.
pub const DENY: i32 = 0;

/// 127.0.0.1 as `user_ip4` stores it (network byte order in memory).
pub const LOOPBACK4: u32 = u32::from_ne_bytes([127, 0, 0, 1]);

#[inline(always)]
pub fn netns_cookie(ctx: *mut core::ffi::c_void) -> u64 {
    unsafe { bpf_get_netns_cookie(ctx) }
}

#[inline(always)]
pub fn socket_cookie(ctx: *mut core::ffi::c_void) -> u64 {
    unsafe { bpf_get_socket_cookie(ctx) }
}

/// (uid, gid) of the current task.
#[inline(always)]
pub fn uid_gid() -> (u32, u32) {
    let v = bpf_get_current_uid_gid();
    (v as u32, (v >> 32) as u32)
}

/// `addr` as it sits in a context (network order in memory).
#[inline(always)]
pub fn is_loopback4(addr: u32) -> bool {
    addr.to_ne_bytes()[0] == 127
}

#[inline(always)]
pub fn is_loopback6(addr: &[u32; 4]) -> bool {
    addr[0] == 0 && addr[1] == 0 && addr[2] == 0 && addr[3] == u32::from_ne_bytes([0, 0, 0, 1])
}

/// The IPv4 address the connecting socket is bound to (0 when unbound). Envoy's
/// inbound passthrough binds 127.0.0.6.
#[inline(always)]
pub fn bound_src4(sa: *mut aya_ebpf::bindings::bpf_sock_addr) -> u32 {
    let sk = unsafe { field!(sa, __bindgen_anon_1.sk) };
    if sk.is_null() {
        return 0;
    }
    unsafe { field!(sk, src_ip4) }
}

/// The IPv6 address the connecting socket is bound to (`::` when unbound); `::6` for
/// Envoy's inbound passthrough.
#[inline(always)]
pub fn bound_src6(sa: *mut aya_ebpf::bindings::bpf_sock_addr) -> [u32; 4] {
    let sk = unsafe { field!(sa, __bindgen_anon_1.sk) };
    if sk.is_null() {
        return [0; 4];
    }
    unsafe {
        [field!(sk, src_ip6[0]), field!(sk, src_ip6[1]), field!(sk, src_ip6[2]), field!(sk, src_ip6[3])]
    }
}

/// The connecting socket's mark (`SO_MARK`; 0 when there is no socket).
#[inline(always)]
pub fn sock_mark(sa: *mut aya_ebpf::bindings::bpf_sock_addr) -> u32 {
    let sk = unsafe { field!(sa, __bindgen_anon_1.sk) };
    if sk.is_null() {
        return 0;
    }
    unsafe { field!(sk, mark) }
}

/// Whether the calling socket is the pod's proxy by its mark (ztunnel's, in an
/// ambient pod): counted as the proxy's and left alone.
#[inline(always)]
pub fn proxy_marked(sa: *mut aya_ebpf::bindings::bpf_sock_addr, cfg: &PodConfig) -> bool {
    cfg.proxy_mark_mask != 0 && cfg.is_proxy_mark(sock_mark(sa))
}

/// A pair key whose addresses are both IPv4-mapped, as the IPv4 key of the same
/// connection: ztunnel's dual-stack listeners accept an IPv4 app's connection on an
/// IPv6 socket, and the app's end was recorded as IPv4.
#[inline(always)]
pub fn unmapped_pair(key: PairKey) -> PairKey {
    if key.family != u32::from(AF_INET6) {
        return key;
    }
    match (mapped_v4(&key.local_addr), mapped_v4(&key.remote_addr)) {
        (Some(l), Some(r)) => {
            PairKey { local_addr: [l, 0, 0, 0], remote_addr: [r, 0, 0, 0], family: u32::from(AF_INET), ..key }
        }
        _ => key,
    }
}

/// `::ffff:a.b.c.d`: the IPv4 address, if `addr` is IPv4-mapped.
#[inline(always)]
pub fn mapped_v4(addr: &[u32; 4]) -> Option<u32> {
    (addr[0] == 0 && addr[1] == 0 && addr[2] == u32::from_ne_bytes([0, 0, 0xff, 0xff])).then_some(addr[3])
}

/// The value stored for `addr` in a per-pod IPv4 trie (the entries of the generation
/// the pod's config names), if any prefix matches.
#[inline(always)]
pub fn lookup_v4(trie: &LpmTrie<CidrV4, u8>, cfg: &PodConfig, netns: u64, addr: u32) -> Option<u8> {
    let data = CidrV4 {
        netns: netns.to_be_bytes(),
        generation: cfg.generation.to_be_bytes(),
        addr: addr.to_ne_bytes(),
    };
    trie.get(&Key::new(KEY_PREFIX_BITS + 32, data)).copied()
}

#[inline(always)]
pub fn lookup_v6(trie: &LpmTrie<CidrV6, u8>, cfg: &PodConfig, netns: u64, addr: &[u32; 4]) -> Option<u8> {
    let mut bytes = [0u8; 16];
    let mut i = 0;
    while i < 4 {
        let w = addr[i].to_ne_bytes();
        bytes[i * 4] = w[0];
        bytes[i * 4 + 1] = w[1];
        bytes[i * 4 + 2] = w[2];
        bytes[i * 4 + 3] = w[3];
        i += 1;
    }
    let data = CidrV6 { netns: netns.to_be_bytes(), generation: cfg.generation.to_be_bytes(), addr: bytes };
    trie.get(&Key::new(KEY_PREFIX_BITS + 128, data)).copied()
}

/// The value a trie holds for the pod's own addresses (as opposed to `-x` entries).
pub const OWN_POD_ADDRESS: u8 = 2;
