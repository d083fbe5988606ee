//! weir-bench: Weir's benchmarks, each measured against its floor in the same run, printed
//! as one table (markdown with --markdown). Needs root; builds sandbox pods like the tests.
//!
//!   weir-bench capture [--runs N] [--duration SECS] [--connections N] [--markdown]
//!       requests/s and p50/p99 through a real Envoy for: no capture (the app calls
//!       Envoy directly: the floor), iptables REDIRECT, nftables, eBPF, eBPF + sk_msg;
//!       new connections/s; raw TCP throughput (iperf3) app -> Envoy -> server.
//!
//!   weir-bench datapath [--runs N] [--markdown]
//!       capture's own cost, without Envoy: an acceptor on 15001 that reads
//!       SO_ORIGINAL_DST, the same client load per mode (new connections, request/
//!       response with 1 and 16 in flight, bulk), CPU per connection and per round trip
//!       from the pod's cgroup; the floor connects to the acceptor directly.
//!
//!   weir-bench xds [--runs N] [--markdown]
//!       push -> ACK latency (p50/p99 of small pushes, one 10 000-cluster push) with a
//!       real Envoy through the Weir relay (SotW, Delta) vs Envoy talking to the control
//!       plane directly (the floor); the agent's CPU time and peak RSS.
//!
//!   weir-bench sidecar [--runs N] [--duration SECS] [--markdown]
//!       `weir proxy sidecar` with a real Envoy: start → ready against Envoy alone
//!       (the floor); agent and Envoy RSS and CPU idle and at 1 000 requests/s;
//!       the agent's idle RSS by part (from /proc/<pid>/smaps).
//!
//!   weir-bench cni [--runs N] [--markdown]
//!       CNI ADD latency (p50/p99) of bridge + host-local + weir-cni per backend
//!       (iptables, nftables, eBPF) against the same chain without weir-cni.
//!
//!   weir-bench ambient [--runs N] [--markdown]
//!       ambient enrollment: CNI ADD of an ambient pod until ztunnel's ack (the plugin,
//!       `weir cni ambient`, the rig's stand-in ztunnel), p50/p99 over 50 pods, against
//!       the same in-pod rules applied raw plus one SEQPACKET round trip; a row with
//!       Weir's eBPF capture for the ambient pods (WEIR_AMBIENT_CAPTURE=ebpf).
//!
//!   weir-bench ambient-datapath [--runs N] [--markdown]
//!       connections through the real ztunnel between two ambient pods, captured by
//!       the in-pod rules or by eBPF: rate, latency and CPU per connection, against two
//!       plain pods.
//!
//!   weir-bench scaling [--runs N] [--markdown]
//!       per-pod cost as the node fills: CNI ADD and eBPF registration p50/p99 with 1,
//!       50, 100 and 250 pods captured, 20 ADDs at once, the node agent's peak RSS.
//!
//!   weir-bench pods [--runs N] [--markdown]
//!       pods through the real runtime (the node rig: containerd driven through CRI):
//!       RunPodSandbox and pod-Ready p50/p99 for ambient and injected sidecar pods on a
//!       node with Weir against a node without, one at a time and 20 at once; the
//!       node agent's RSS and CPU with 100 pods (needs scripts/image's images).
//!
//!   weir-bench rules [--runs N] [--markdown]
//!       applying and removing the injector's rule set: iptables-restore, one nft
//!       transaction, eBPF attach + register, against an empty iptables-restore.
//!
//!   weir-bench all [--runs N] [--duration SECS] [--markdown]
//!       every benchmark above, one after another, under a header naming the
//!       machine, kernel and commit.
//!
//!   weir-bench sds [--runs N] [--markdown]
//!       workload certificate issuance (key + CSR + CreateCertificate + chain checks)
//!       for ECDSA P-256 and RSA 2048 vs the CA round trip alone (the floor).
//!
//!   weir-bench setup [--runs N] [--markdown]
//!       whole-process setup as kubelet sees istio-init: `pilot-agent istio-iptables`
//!       exec to exit against `iptables-restore` / `nft -f` of the same text.
//!
//!   weir-bench <xds|sidecar|cni|setup> --against-bin PATH [--against-label TEXT]
//!       [--this-label TEXT] [--runs N] [--markdown]
//!       the benchmark with this checkout's `weir` and another build's (PATH) in turn,
//!       round by round, and one table comparing them (scripts/bench --against REV
//!       builds PATH from a git revision).
use std::{path::PathBuf, process::ExitCode};

#[path = "../bench/ab.rs"]
mod ab;
#[path = "../bench/ambient.rs"]
mod ambient;
#[path = "../bench/ambient_datapath.rs"]
mod ambient_datapath;
#[path = "../bench/capture.rs"]
mod capture;
#[path = "../bench/cni.rs"]
mod cni;
#[path = "../bench/datapath.rs"]
mod datapath;
#[path = "../bench/pods.rs"]
mod pods;
#[path = "../bench/report.rs"]
mod report;
#[path = "../bench/rules.rs"]
mod rules;
#[path = "../bench/scaling.rs"]
mod scaling;
#[path = "../bench/sds.rs"]
mod sds;
#[path = "../bench/setup.rs"]
mod setup;
#[path = "../bench/sidecar.rs"]
mod sidecar;
#[path = "../bench/smaps.rs"]
mod smaps;
#[path = "../bench/xds.rs"]
mod xds;

/// Every benchmark, each against its floor, under one header.
fn all(opts: &report::Options) -> anyhow::Result<String> {
    let sh = |cmd: &str, args: &[&str]| {
        std::process::Command::new(cmd)
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let mut out = format!(
        "Machine: {cores} cores, {cpu}; Linux {}; commit {}; {} runs per figure.\n\n",
        sh("uname", &["-r"]),
        sh("git", &["rev-parse", "--short", "HEAD"]),
        opts.runs
    );
    let mut all = Vec::new();
    let mut details = String::new();
    for (name, bench) in BENCHES {
        eprintln!("[bench all] {name}");
        match bench(opts) {
            Ok(tables) => {
                details.push_str(&render(&tables, opts.markdown));
                all.extend(tables);
            }
            Err(e) => details.push_str(&format!("{name}: failed: {e:#}\n")),
        }
        details.push('\n');
    }
    out.push_str(&report::headline(&all, opts.markdown));
    out.push('\n');
    out.push_str(&details);
    Ok(out)
}

/// Every benchmark by name, in the order `all` runs them.
const BENCHES: [(&str, ab::Bench); 12] = [
    ("datapath", datapath::tables),
    ("capture", capture::tables),
    ("rules", rules::tables),
    ("setup", setup::tables),
    ("xds", xds::tables),
    ("sds", sds::tables),
    ("sidecar", sidecar::tables),
    ("cni", cni::tables),
    ("ambient", ambient::tables),
    ("ambient-datapath", ambient_datapath::tables),
    ("scaling", scaling::tables),
    ("pods", pods::tables),
];

const USAGE: &str = "usage: weir-bench <datapath|capture|rules|setup|xds|sds|sidecar|cni|ambient|ambient-datapath|scaling|pods|all> [--runs N] \
                     [--duration SECS] [--connections N] [--markdown]\n       weir-bench <xds|sidecar|cni|setup> \
                     --against-bin PATH [--against-label TEXT] [--this-label TEXT] [--runs N] [--markdown]";

/// The first three fields of /proc/loadavg.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

fn render(tables: &[report::Table], markdown: bool) -> String {
    tables.iter().map(|t| t.render(markdown)).collect::<Vec<_>>().join("\n")
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    let text = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let value =
        |name: &str, default: u64| -> u64 { text(name).and_then(|v| v.parse().ok()).unwrap_or(default) };
    let opts = report::Options {
        runs: value("--runs", 3) as usize,
        duration_secs: value("--duration", 5),
        connections: value("--connections", 16) as u32,
        markdown: flag("--markdown"),
        ab_rounds: None,
    };
    let load_before = load_average();
    let name = args.first().map(String::as_str).unwrap_or_default();
    let bench = BENCHES.iter().find(|(n, _)| *n == name).map(|(_, b)| *b);
    let result = match (name, bench, text("--against-bin")) {
        ("all", _, None) => all(&opts),
        (_, Some(bench), None) => bench(&opts).map(|t| render(&t, opts.markdown)),
        (_, Some(bench), Some(other)) if ab::SWAPPABLE.contains(&name) => {
            let this = ab::Build {
                label: text("--this-label").unwrap_or_else(|| "this checkout".into()),
                weir: None,
            };
            let other = ab::Build {
                label: text("--against-label").unwrap_or_else(|| other.clone()),
                weir: Some(PathBuf::from(other)),
            };
            match other.weir.as_deref().map(|p| p.is_file()) {
                Some(true) => Ok(ab::compare(name, bench, &opts, &this, &other)),
                _ => Err(anyhow::anyhow!(
                    "--against-bin {}: not a file (another build's weir binary)",
                    other.label
                )),
            }
        }
        (_, _, Some(_)) => Err(anyhow::anyhow!(
            "--against compares builds of the `weir` binary, which only {} run; {name:?} measures Weir's \
             library inside weir-bench (or is not a benchmark), so both sides would run this checkout's code",
            ab::SWAPPABLE.join(", ")
        )),
        _ => Err(anyhow::anyhow!("{USAGE}")),
    };
    match result {
        Ok(table) => {
            println!("{table}");
            // The machine is shared: what else ran beside the benchmark is part of its figures.
            println!(
                "Load average (1, 5, 15 min) at the start: {load_before}; at the end: {}.",
                load_average()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("weir-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
