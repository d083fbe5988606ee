//! A test stand-in for Cilium's socket load balancer (kube-proxy replacement's
//! `bpf/bpf_sock.c`), for the tests that show where Weir's eBPF capture stands beneath
//! it: this library holds the map names and `#[repr(C)]` layouts the kernel programs
//! (`src/kernel/`, built for the bpf target by `tests/build.rs`) and the tests
//! (`weir_tests::socket_lb`) share. The layouts follow Cilium's `bpf/lib/lb.h` in shape
//! (a service entry per frontend with its backend slots, backends by id, reverse-NAT
//! entries by socket cookie), not byte for byte: nothing outside these tests reads them.
//!
//! Addresses and ports are kept as the kernel's `bpf_sock_addr` holds them: network
//! byte order in memory (`u32::from_ne_bytes(ip.octets())`, `port.to_be()`).
#![no_std]

/// Map names in the object.
pub mod map {
    /// Cilium's `cilium_lb4_services_v2`: frontend (and backend slot) → service entry.
    pub const SERVICES4: &str = "SERVICES4";
    pub const SERVICES6: &str = "SERVICES6";
    /// Cilium's `cilium_lb4_backends_v3`: backend id → address and port.
    pub const BACKENDS4: &str = "BACKENDS4";
    pub const BACKENDS6: &str = "BACKENDS6";
    /// Cilium's `cilium_lb4_reverse_sk` / `cilium_lb6_reverse_sk`.
    pub const REVERSE_SK4: &str = "REVERSE_SK4";
    pub const REVERSE_SK6: &str = "REVERSE_SK6";
    /// The node's own addresses and other nodes' (Cilium's ipcache entries with the
    /// `HOST_ID` and remote-node identities: all its wildcard lookups ask of it).
    pub const NODE_ADDRS4: &str = "NODE_ADDRS4";
    pub const NODE_ADDRS6: &str = "NODE_ADDRS6";
    /// One [`LbConfig`](super::LbConfig) at index 0.
    pub const CONFIG: &str = "CONFIG";
    /// Per-CPU `u64` counters, indexed by [`counter`](super::counter).
    pub const COUNTERS: &str = "COUNTERS";
}

/// Program names (the kernel hook each attaches to is in its name).
pub mod prog {
    pub const CONNECT4: &str = "lb_connect4";
    pub const CONNECT6: &str = "lb_connect6";
    pub const SENDMSG4: &str = "lb_sendmsg4";
    pub const SENDMSG6: &str = "lb_sendmsg6";
    pub const RECVMSG4: &str = "lb_recvmsg4";
    pub const RECVMSG6: &str = "lb_recvmsg6";
    pub const GETPEERNAME4: &str = "lb_getpeername4";
    pub const GETPEERNAME6: &str = "lb_getpeername6";
}

/// Service flags (Cilium's `SVC_FLAG_*`, only those the socket hooks test).
pub mod flags {
    pub const NODEPORT: u32 = 1;
    pub const HOSTPORT: u32 = 2;
    /// A hostPort published on a loopback address: answered only for loopback.
    pub const LOOPBACK: u32 = 4;
}

/// What a [`map::NODE_ADDRS4`] entry says an address is (Cilium's identities).
pub mod node {
    pub const HOST: u32 = 1;
    pub const REMOTE_NODE: u32 = 2;
}

/// Counter slots.
pub mod counter {
    /// A connect or send translated from a frontend to a backend.
    pub const FORWARD: u32 = 0;
    /// A socket outside the host's namespace left alone (`hostNamespaceOnly`).
    pub const NOT_HOST_NAMESPACE: u32 = 1;
    /// A received datagram's source translated back to the frontend.
    pub const REVERSE_RECVMSG: u32 = 2;
    /// A getpeername() answered with the frontend.
    pub const REVERSE_PEER: u32 = 3;
    pub const COUNT: u32 = 4;
    pub const NAMES: [&str; COUNT as usize] =
        ["forward", "not_host_namespace", "reverse_recvmsg", "reverse_peer"];
}

/// The load balancer's settings: the ones Cilium compiles into `bpf_sock.o`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbConfig {
    /// The host's network namespace (Cilium's `HOST_NETNS_COOKIE`); 0: the kernel's
    /// initial namespace, `get_netns_cookie(NULL)`.
    pub host_netns_cookie: u64,
    /// Non-zero: `socketLB.hostNamespaceOnly` (`ENABLE_SOCKET_LB_HOST_ONLY`).
    pub host_namespace_only: u32,
    /// The NodePort range (`NODEPORT_PORT_MIN`, `NODEPORT_PORT_MAX`), host order.
    pub nodeport_min: u16,
    pub nodeport_max: u16,
}

/// A frontend, or one of its backend slots (slot 0: the service entry itself).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Service4Key {
    pub address: u32,
    pub dport: u16,
    pub backend_slot: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Service6Key {
    pub address: [u32; 4],
    pub dport: u16,
    pub backend_slot: u16,
}

/// Slot 0: `count` backends and the service's flags; slot n: its backend's id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    pub backend_id: u32,
    pub count: u16,
    pub rev_nat_index: u16,
    pub flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backend4 {
    pub address: u32,
    pub port: u16,
    pub pad: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backend6 {
    pub address: [u32; 4],
    pub port: u16,
    pub pad: u16,
}

/// Cilium's `ipv4_revnat_tuple`: the socket and the backend it was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RevNat4Key {
    pub cookie: u64,
    pub address: u32,
    pub port: u16,
    pub pad: u16,
}

/// Cilium's `ipv4_revnat_entry`: the frontend the socket addressed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RevNat4 {
    pub address: u32,
    pub port: u16,
    pub rev_nat_index: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RevNat6Key {
    pub cookie: u64,
    pub address: [u32; 4],
    pub port: u16,
    pub pad: [u16; 3],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RevNat6 {
    pub address: [u32; 4],
    pub port: u16,
    pub rev_nat_index: u16,
}

// Layout guards: a field added on one side changes these sizes for both.
const _: () = {
    assert!(core::mem::size_of::<LbConfig>() == 16);
    assert!(core::mem::size_of::<Service4Key>() == 8);
    assert!(core::mem::size_of::<Service6Key>() == 20);
    assert!(core::mem::size_of::<ServiceValue>() == 12);
    assert!(core::mem::size_of::<Backend4>() == 8);
    assert!(core::mem::size_of::<Backend6>() == 20);
    assert!(core::mem::size_of::<RevNat4Key>() == 16);
    assert!(core::mem::size_of::<RevNat4>() == 8);
    assert!(core::mem::size_of::<RevNat6Key>() == 32);
    assert!(core::mem::size_of::<RevNat6>() == 20);
};

#[cfg(feature = "user")]
mod pod {
    // SAFETY: plain #[repr(C)] data; every padding byte is an explicit field.
    unsafe impl aya::Pod for super::LbConfig {}
    unsafe impl aya::Pod for super::Service4Key {}
    unsafe impl aya::Pod for super::Service6Key {}
    unsafe impl aya::Pod for super::ServiceValue {}
    unsafe impl aya::Pod for super::Backend4 {}
    unsafe impl aya::Pod for super::Backend6 {}
    unsafe impl aya::Pod for super::RevNat4Key {}
    unsafe impl aya::Pod for super::RevNat4 {}
    unsafe impl aya::Pod for super::RevNat6Key {}
    unsafe impl aya::Pod for super::RevNat6 {}
}
