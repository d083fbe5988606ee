//! Ambient mode's fixed values, as ztunnel and Istio's node agent have them: the marks
//! ztunnel sets and restores, the in-pod route's table and rule priority, ztunnel's
//! ports, and the names of the node's probe sets. Every plan and apply step of the
//! folder reads them here; this module depends on nothing.

/// The mark ztunnel puts on its own packets (must match ztunnel's inpod config).
pub const INPOD_MARK: u32 = 1337;
pub const INPOD_MASK: u32 = 0xfff;
/// The connection mark for connections ztunnel accepted, restored on replies.
pub const INPOD_TPROXY_MARK: u32 = 0x111;
pub const INPOD_TPROXY_MASK: u32 = 0xfff;
pub const INPOD_RESTORE_MASK: u32 = 0xffff_ffff;
/// The routing table the in-pod fwmark rule looks up (`local default dev lo`).
pub const ROUTE_TABLE_INBOUND: u32 = 100;
/// The in-pod rule's priority.
pub const INPOD_RULE_PRIORITY: u32 = 32764;

pub const ZTUNNEL_OUTBOUND_PORT: u16 = 15001;
pub const ZTUNNEL_INBOUND_PLAINTEXT_PORT: u16 = 15006;
/// HBONE: arrives at ztunnel directly, never redirected.
pub const ZTUNNEL_INBOUND_PORT: u16 = 15008;
pub const ZTUNNEL_DNS_PORT: u16 = 15053;

/// The node's sets of ambient pod addresses that kubelet probes (ipsets for iptables,
/// sets in `istio-ambient-nat` for nftables).
pub const PROBE_SET_V4: &str = "istio-inpod-probes-v4";
pub const PROBE_SET_V6: &str = "istio-inpod-probes-v6";
