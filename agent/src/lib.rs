//! Weir's agent: traffic capture (eBPF or iptables/nftables) and the sidecar duties of
//! Istio's pilot-agent (xDS relay, SDS, Envoy lifecycle, status server, DNS proxy).
//! `main.rs` only parses the command line and calls into the modules here.

pub mod build_info;
pub mod cli;
pub mod demo;
pub mod ebpf;
pub mod exit;
pub mod istio_iptables;
pub mod privileges;
pub mod sandbox;
