//! Weir's agent: traffic capture (eBPF or iptables/nftables) and the sidecar duties of
//! Istio's pilot-agent (xDS relay, SDS, Envoy lifecycle, status server, DNS proxy). The
//! crate by job, each a folder:
//!
//! - `cmd`: every command, its arguments and its run (`weir`, `pilot-agent`,
//!   `weir-init`, `weir cni ...`); `main.rs` and `bin/` only hand it the command line.
//! - `sidecar`: the sidecar agent beside Envoy (`pilot-agent proxy`): configuration,
//!   Envoy's bootstrap and process, xDS relay, certificates and SDS, DNS proxy, status
//!   server; standalone mode and its embedded control plane.
//! - `capture`: capture in user space: the eBPF programs per pod and per node, and why
//!   a pod gets the capture it gets (the rules themselves: the `weir_iptables` crate).
//! - `node`: what runs once per node: the CNI plugin, the node agent for sidecar and
//!   ambient pods, ZDS for ztunnel.
//! - `sandbox`: pods made on this host for the demo and the tests (namespaces,
//!   cgroups), and reaping what they leave.
//! - `support`: plumbing every job uses and that imports none of them (HTTP/1, TLS,
//!   atomic files, logs, exit codes, privileges, runtimes, shutdown, supervised tasks).
//!
//! Imports between these run one way: `cmd` uses every job; `node` and `sandbox` use
//! `capture` (the plugin registers pods with it, the reaper removes what it pinned);
//! every job uses `support`, and `support` none (`agent/tests/structure.rs` checks that
//! no modules import each other in a circle, at any level).

pub mod capture;
pub mod cmd;
pub mod node;
pub mod sandbox;
pub mod sidecar;
pub mod support;

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
