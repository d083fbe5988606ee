//! weir-bench: Weir's benchmarks, each measured against its floor in the same run, printed
//! as one table (markdown with --markdown). Needs root; builds sandbox pods like the tests.
//!
//!   weir-bench capture [--runs N] [--duration SECS] [--connections N] [--markdown]
//!       requests/s and p50/p99 through a real Envoy for: no capture (the app calls
//!       Envoy directly: the floor), iptables REDIRECT, nftables, eBPF, eBPF + sk_msg;
//!       new connections/s; raw TCP throughput (iperf3) app -> Envoy -> server.
//!
//!   weir-bench xds [--runs N] [--markdown]
//!       push -> ACK latency (p50/p99 of small pushes, one 10 000-cluster push) with a
//!       real Envoy through the Weir relay (SotW, Delta) vs Envoy talking to the control
//!       plane directly (the floor); the agent's CPU time and peak RSS.
//!
//!   weir-bench sidecar [--runs N] [--duration SECS] [--markdown]
//!       `weir proxy sidecar` with a real Envoy: start → ready against Envoy alone
//!       (the floor); agent and Envoy RSS and CPU idle and at 1 000 requests/s.
//!
//!   weir-bench cni [--runs N] [--markdown]
//!       CNI ADD latency (p50/p99) of bridge + host-local + weir-cni per backend
//!       (iptables, nftables, eBPF) against the same chain without weir-cni.
//!
//!   weir-bench sds [--runs N] [--markdown]
//!       workload certificate issuance (key + CSR + CreateCertificate + chain checks)
//!       for ECDSA P-256 and RSA 2048 vs the CA round trip alone (the floor).
use std::process::ExitCode;

#[path = "../bench/capture.rs"]
mod capture;
#[path = "../bench/cni.rs"]
mod cni;
#[path = "../bench/report.rs"]
mod report;
#[path = "../bench/sds.rs"]
mod sds;
#[path = "../bench/sidecar.rs"]
mod sidecar;
#[path = "../bench/xds.rs"]
mod xds;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    let value = |name: &str, default: u64| -> u64 {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let opts = report::Options {
        runs: value("--runs", 3) as usize,
        duration_secs: value("--duration", 5),
        connections: value("--connections", 16) as u32,
        markdown: flag("--markdown"),
    };
    let result = match args.first().map(String::as_str) {
        Some("capture") => capture::run(&opts),
        Some("xds") => xds::run(&opts),
        Some("sds") => sds::run(&opts),
        Some("sidecar") => sidecar::run(&opts),
        Some("cni") => cni::run(&opts),
        _ => Err(anyhow::anyhow!(
            "usage: weir-bench capture [--runs N] [--duration SECS] [--connections N] [--markdown]\n       weir-bench xds [--runs N] [--markdown]\n       weir-bench sds [--runs N] [--markdown]\n       weir-bench sidecar [--runs N] [--duration SECS] [--markdown]\n       weir-bench cni [--runs N] [--markdown]"
        )),
    };
    match result {
        Ok(table) => {
            println!("{table}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("weir-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
