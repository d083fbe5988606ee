//! Weir's agent: traffic capture (eBPF or iptables/nftables) and the sidecar duties of
//! Istio's pilot-agent (xDS relay, SDS, Envoy lifecycle, status server, DNS proxy).
//! `main.rs` only parses the command line and calls into the modules here.

pub mod accept;
pub mod app;
pub mod atomic_file;
pub mod build_info;
pub mod capture_cmd;
pub mod capture_explain;
pub mod cli;
pub mod config;
pub mod controlplane;
pub mod demo;
pub mod dns;
pub mod ebpf;
pub mod envoy;
pub mod executable;
pub mod exit;
pub mod footprint;
pub mod gotemplate;
pub mod health;
pub mod http1;
pub mod identity;
pub mod istio_iptables;
pub mod local_cmd;
pub mod logs;
pub mod metrics;
pub mod node;
pub mod privileges;
pub mod sandbox;
pub mod services;
pub mod standalone;
pub mod status;
pub mod sts;
pub mod tls;
pub mod wasm;
pub mod xds;

/// An error and its sources on one line: `outer: inner: innermost`.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        // Some errors repeat their source in their own message: say it once.
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
