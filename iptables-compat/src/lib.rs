//! weir-iptables: Istio's capture rules (ISTIO_INBOUND, ISTIO_REDIRECT,
//! ISTIO_IN_REDIRECT, ISTIO_OUTPUT, ...) as a pure plan from a capture config, rendered
//! for iptables-restore and native nftables, then applied, verified and cleaned in one
//! transaction per family. TPROXY's policy routes go over netlink (`netlink`).

pub mod netlink;
