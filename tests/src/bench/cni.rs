//! `weir-bench cni`: what chaining Weir costs a pod's start. CNI ADD latency of the
//! whole chain (reference `bridge` + `host-local`, then `weir-cni` with each backend)
//! against the floor of the same chain without Weir, measured by the rig's CNI
//! runtime in a node namespace, the pod fetched from the test Kubernetes API server.
//! A second table says where weir-cni's own time goes, from the phases the plugin
//! reports (`weir_agent::node::cni::phases`) and the runtime's spawn and reap, against
//! the primary plugin's (bridge's, with the host-local it runs) whole process.

use std::time::Instant;

use serde_json::{Value, json};
use weir_agent::sandbox::{Cgroup, NetNs, unique_name};
use weir_tests::{
    cni::{
        Attachment, CniRuntime, PluginRun, TestApiServer, conflist, node_agent_command, pod_object, run_in,
        write_kubeconfig,
    },
    envoy::tempfile_dir::Dir,
};

use crate::report::{Options, Row, Samples, Table};

/// ADDs per run.
const PODS: usize = 40;
const TOKEN: &str = "bench-token";

#[derive(Clone, Copy)]
enum Chain {
    BridgeOnly,
    Weir(&'static str),
}

impl Chain {
    fn name(self) -> String {
        match self {
            Chain::BridgeOnly => "bridge + host-local alone (floor)".into(),
            Chain::Weir(mode) => format!("bridge + host-local + weir-cni ({mode})"),
        }
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

/// The phase table's columns after the whole process: the runtime's spawn to the
/// plugin's `main`, the plugin's own phases (`phases::mark` names), and its last mark
/// to the runtime's reap.
const PHASES: [(&str, &str); 11] = [
    ("exec→exit", "whole process"),
    ("exec + start-up", "spawn → main"),
    ("logs", "logs"),
    ("config", "config"),
    ("api", "API GET"),
    ("netns", "namespace"),
    ("plan", "plan"),
    ("ancestors", "ancestor check"),
    ("capture", "capture"),
    ("result", "result"),
    ("exit", "exit"),
];

/// One plugin run's figures in `PHASES` order, ms (NaN where the plugin reported none).
fn phases_of(run: &PluginRun) -> [f64; PHASES.len()] {
    let mut out = [f64::NAN; PHASES.len()];
    out[0] = (run.exited_ns - run.spawned_ns) as f64 / 1e6;
    let report = run.stderr.lines().find_map(weir_agent::node::cni::phases::parse);
    if let Some((main_ns, phases)) = report {
        out[1] = main_ns.saturating_sub(run.spawned_ns) as f64 / 1e6;
        let mut last = main_ns;
        for (phase, us) in phases {
            last += (us * 1000.0) as u64;
            if let Some(i) = PHASES.iter().position(|(p, _)| *p == phase) {
                out[i] = us / 1000.0;
            }
        }
        out[PHASES.len() - 1] = run.exited_ns.saturating_sub(last) as f64 / 1e6;
    }
    out
}

/// The node agent's part of the eBPF row, done as a node does it: `weir cni install
/// --once --ebpf-cgroup` of the build under test attaches its node program set to a
/// cgroup made for the run, and `weir cni uninstall --detach-running-pods` takes it
/// away. Its own process, so the harness that spawns the plugins (as a runtime would)
/// carries no eBPF loader's memory: a runtime forks the plugin, and a fork costs in
/// proportion to the parent's mapped memory, which would otherwise count against the
/// eBPF row alone (about 13 MB more, 0.5–0.8 ms more per spawn, when the harness
/// attached the set itself). With `--against`, each build attaches its own programs.
struct NodeAgent {
    name: String,
    cgroup: Cgroup,
    host: Dir,
    kubeconfig: std::path::PathBuf,
}

impl NodeAgent {
    fn attach(kubeconfig: &std::path::Path) -> anyhow::Result<Self> {
        let host = Dir::new("bench-cni-host")?;
        std::fs::create_dir_all(host.path().join("net.d"))?;
        std::fs::write(
            host.path().join("net.d/10-k8s.conflist"),
            r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge"}]}"#,
        )?;
        let agent = Self {
            name: unique_name("bench-cni-ebpf"),
            cgroup: Cgroup::create(&unique_name("bench-cni"))?,
            host,
            kubeconfig: kubeconfig.to_path_buf(),
        };
        agent.run("install")?;
        Ok(agent)
    }

    fn run(&self, verb: &str) -> anyhow::Result<()> {
        let mut cmd =
            node_agent_command(verb, self.host.path(), self.cgroup.path(), &self.name, &self.kubeconfig);
        cmd.arg("--once").arg("--binary").arg(weir_tests::tools::weir_cni());
        if verb == "uninstall" {
            cmd.arg("--detach-running-pods");
        }
        let out = cmd.output()?;
        anyhow::ensure!(
            out.status.success(),
            "weir cni {verb} --ebpf-cgroup (the node capture) failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        if let Err(e) = self.run("uninstall") {
            eprintln!("[bench cni] {e:#}");
        }
    }
}

/// One run of a chain: ADD p50 and p99 (ms) of `PODS` sequential ADDs, and the median
/// of each phase of the chain's last plugin (weir-cni; the floor's: bridge).
struct RunFigures {
    p50: f64,
    p99: f64,
    phases: [f64; PHASES.len()],
}

fn run_once(chain: Chain) -> anyhow::Result<RunFigures> {
    let node = NetNs::create(&unique_name("bench-cni-node"))?;
    run_in(&node, None, std::process::Command::new("ip"), &["link", "set", "lo", "up"]);
    let api = TestApiServer::start(&node, TOKEN, None)?;
    for i in 0..PODS {
        api.set_pod(pod_object("bench", &format!("p{i}"), true, &[], &[]));
    }
    let run_dir = Dir::new("bench-cni-run")?;
    let kubeconfig = write_kubeconfig(run_dir.path(), &api.kubeconfig(TOKEN, None))?;
    let ipam = Dir::new("bench-cni-ipam")?;
    let mut node_agent = None;
    let mut weir = json!({"cni_agent_run_dir": run_dir.path()});
    match chain {
        Chain::Weir("ebpf") => {
            let agent = NodeAgent::attach(&kubeconfig)?;
            weir["capture_mode"] = json!("ebpf");
            weir["ebpf_node_capture"] = json!(agent.name);
            node_agent = Some(agent);
        }
        Chain::Weir(mode) => weir["capture_mode"] = json!(mode),
        Chain::BridgeOnly => {}
    }
    let mut list: Value = conflist("10.88.0.0/24", ipam.path(), weir);
    if matches!(chain, Chain::BridgeOnly) {
        list["plugins"].as_array_mut().expect("plugins").pop();
    }
    let mut rt = CniRuntime::new(&node)?;
    rt.env.push((weir_agent::node::cni::phases::ENV.into(), "1".into()));
    let mut ms = Vec::with_capacity(PODS);
    let mut phases = vec![Vec::with_capacity(PODS); PHASES.len()];
    let result = (|| -> anyhow::Result<()> {
        for i in 0..PODS {
            let pod = NetNs::create(&unique_name(&format!("bench-p{i}")))?;
            let a = Attachment::pod(&format!("c-p{i}"), pod.path(), "bench", &format!("p{i}"));
            let started = Instant::now();
            let (result, runs) = rt.add_traced(&list, &a).map_err(|e| anyhow::anyhow!("{e}"))?;
            ms.push(started.elapsed().as_secs_f64() * 1000.0);
            if let Some(last) = runs.last() {
                for (column, value) in phases.iter_mut().zip(phases_of(last)) {
                    column.push(value);
                }
            }
            rt.del(&list, &a, Some(&result)).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        Ok(())
    })();
    drop(node_agent);
    result?;
    ms.sort_by(f64::total_cmp);
    let mut figures = RunFigures {
        p50: percentile(&ms, 0.5),
        p99: percentile(&ms, 0.99),
        phases: [f64::NAN; PHASES.len()],
    };
    for (slot, column) in figures.phases.iter_mut().zip(phases) {
        *slot = median(column);
    }
    Ok(figures)
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    // The eBPF rows pin; a bpffs mounted for them is unmounted afterwards.
    let _bpffs = weir_tests::BpffsUse::acquire()?;
    let chains = [Chain::BridgeOnly, Chain::Weir("iptables"), Chain::Weir("nftables"), Chain::Weir("ebpf")];
    let mut adds = vec![(Samples::default(), Samples::default()); chains.len()];
    let mut phases = vec![vec![Samples::default(); PHASES.len()]; chains.len()];
    // Run by run, every chain in turn, so load from elsewhere falls on all of them.
    for run in 0..opts.runs {
        for (i, chain) in chains.iter().enumerate() {
            eprintln!("[bench cni] {} run {}/{}", chain.name(), run + 1, opts.runs);
            let figures = run_once(*chain).unwrap_or_else(|e| {
                eprintln!("[bench cni] {} failed: {e:#}", chain.name());
                RunFigures { p50: f64::NAN, p99: f64::NAN, phases: [f64::NAN; PHASES.len()] }
            });
            adds[i].0.0.push(figures.p50);
            adds[i].1.0.push(figures.p99);
            let reported = if matches!(chain, Chain::BridgeOnly) { 1 } else { PHASES.len() };
            for ((column, value), (phase, _)) in
                phases[i].iter_mut().zip(figures.phases).zip(PHASES).take(reported)
            {
                // Only the eBPF row has an ancestor check: the others show none, not a failure.
                if phase != "ancestors" || matches!(chain, Chain::Weir("ebpf")) {
                    column.0.push(value);
                }
            }
        }
    }
    let rows = chains.iter().zip(adds).map(|(c, (p50, p99))| Row { name: c.name(), metrics: vec![p50, p99] });
    let table = Table {
        title: "CNI ADD latency (whole chain, per pod)".into(),
        columns: vec![("ADD p50", "ms", false), ("ADD p99", "ms", false)],
        rows: rows.collect(),
        notes: vec![format!(
            "{PODS} pods per run, one ADD at a time (each followed by its DEL, not timed), every plugin exec'd as a \
             runtime does; weir-cni fetches the pod from the test Kubernetes API server over loopback HTTP. The eBPF \
             row registers pods with a node capture attached once before the run by the build's own `weir cni \
             install --once --ebpf-cgroup`, in its own process as a node agent would (which loads the node program \
             set, inbound classifier included): per pod, its cookie and config in the pinned maps and the pinned \
             classifier attached to its interface. Runs take turns chain by chain. {}",
            opts.summary()
        )],
    };
    let phase_rows = chains.iter().zip(phases).map(|(c, metrics)| Row {
        name: match c {
            Chain::BridgeOnly => "bridge (with the host-local it runs), the primary plugin (floor)".into(),
            Chain::Weir(mode) => format!("weir-cni ({mode})"),
        },
        metrics,
    });
    let phase_table = Table {
        title: "CNI ADD: where the chained plugin's time goes (per ADD, ms)".into(),
        columns: PHASES.iter().map(|(_, label)| (*label, "ms", false)).collect(),
        rows: phase_rows.collect(),
        notes: vec![format!(
            "Median over the run's {PODS} ADDs, then median [min–max] over runs. Whole process: the runtime's spawn \
             (into the node namespace) to its reap. spawn → main: fork, exec, the dynamic loader and Rust's start-up, \
             up to the plugin's first mark; then the plugin's own phases ({}=1): logs (stdin read, log level, \
             tracing set up), config (the network configuration and CNI_* parsed), API GET (kubeconfig read, the \
             pod fetched), namespace (what is left of reading the pod's addresses inside its namespace, which \
             overlaps the API GET), plan (the namespace's owner checked, the capture planned), ancestor check (eBPF only: \
             what the node capture cgroup's ancestors attach, read with BPF_PROG_QUERY per hook and cgroup, and \
             judged; `capture::ebpf::ancestors`), capture (iptables-restore, nft -f, or the eBPF registration), result (logged and written \
             out); exit: the last mark to the reap. {}",
            weir_agent::node::cni::phases::ENV,
            opts.summary()
        )],
    };
    Ok(vec![table, phase_table])
}
