//! `weir-bench scaling`: how a pod's cost grows with the node. With 1, 50, 100 and 250
//! pods already captured by the node's eBPF capture, the next pod's CNI ADD (the whole
//! chain: bridge + host-local + weir-cni) and its eBPF registration alone (the call
//! ADD makes, in process); then 20 ADDs at once, as the kubelet starts sandboxes in
//! parallel; and the node agent's memory while it serves 250 pods (its `/metrics`
//! scraped, which reads every pod's counters). The floor of each figure is the same
//! figure on a node with one pod, in the same run.

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::{Value, json};
use weir_agent::sandbox::{Cgroup, NetNs, unique_name};
use weir_tests::{
    cni::{Attachment, CniRuntime, TestApiServer, conflist, pod_object, run_in, write_kubeconfig},
    envoy::tempfile_dir::Dir,
};

use crate::report::{Options, Row, Samples, Table};

const TOKEN: &str = "bench-token";
const POPULATIONS: [usize; 4] = [1, 50, 100, 250];
/// Pods timed at each population (each ADD followed by its DEL, not timed).
const TIMED: usize = 30;
const PARALLEL: usize = 20;

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn p50_p99(mut ms: Vec<f64>) -> (f64, f64) {
    ms.sort_by(f64::total_cmp);
    (percentile(&ms, 0.5), percentile(&ms, 0.99))
}

/// A node with its eBPF node capture, the test API server and the chain (its
/// namespace is the caller's, which the runtime borrows).
struct Node {
    api: TestApiServer,
    _run_dir: Dir,
    _ipam: Dir,
    cgroup: Cgroup,
    capture: String,
    list: Value,
    /// The chain without weir-cni: the primary CNI alone.
    primary: Value,
    pods: Vec<(NetNs, Attachment, Value)>,
}

impl Node {
    fn new(ns: &NetNs) -> anyhow::Result<Self> {
        run_in(ns, None, Command::new("ip"), &["link", "set", "lo", "up"]);
        let api = TestApiServer::start(ns, TOKEN, None)?;
        let run_dir = Dir::new("bench-scale-run")?;
        write_kubeconfig(run_dir.path(), &api.kubeconfig(TOKEN, None))?;
        let ipam = Dir::new("bench-scale-ipam")?;
        let cgroup = Cgroup::create(&unique_name("bench-scale"))?;
        let capture = unique_name("bench-scale-capture");
        weir_agent::node::cni::node_capture::attach_node(&capture, cgroup.path())?;
        let weir = json!({"cni_agent_run_dir": run_dir.path(), "capture_mode": "ebpf", "ebpf_node_capture": capture});
        let list = conflist("10.90.0.0/16", ipam.path(), weir);
        let mut primary = list.clone();
        primary["plugins"].as_array_mut().expect("a conflist's plugins").pop();
        Ok(Self { api, _run_dir: run_dir, _ipam: ipam, cgroup, capture, list, primary, pods: Vec::new() })
    }

    /// The primary CNI's ADD alone (bridge + host-local) of a fresh pod on this node,
    /// ms; DEL'd at once (not timed).
    fn add_primary(&mut self, rt: &CniRuntime<'_>, name: &str) -> anyhow::Result<f64> {
        let pod = NetNs::create(&unique_name(name))?;
        let a = Attachment::pod(&format!("c-{name}"), pod.path(), "bench", name);
        let started = Instant::now();
        let result = rt.add(&self.primary, &a).map_err(|e| anyhow::anyhow!("{e}"))?;
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        rt.del(&self.primary, &a, Some(&result)).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(ms)
    }

    fn add(&mut self, rt: &CniRuntime<'_>, name: &str) -> anyhow::Result<f64> {
        self.api.set_pod(pod_object("bench", name, true, &[], &[]));
        let pod = NetNs::create(&unique_name(name))?;
        let a = Attachment::pod(&format!("c-{name}"), pod.path(), "bench", name);
        let started = Instant::now();
        let result = rt.add(&self.list, &a).map_err(|e| anyhow::anyhow!("{e}"))?;
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        self.pods.push((pod, a, result));
        Ok(ms)
    }

    fn del_last(&mut self, rt: &CniRuntime<'_>) -> anyhow::Result<()> {
        if let Some((_pod, a, result)) = self.pods.pop() {
            rt.del(&self.list, &a, Some(&result)).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = weir_agent::node::cni::node_capture::detach_node(&self.capture);
    }
}

/// The eBPF registration alone (what ADD calls) of a fresh pod namespace, ms.
fn register_once(node: &Node, i: usize) -> anyhow::Result<f64> {
    let pod = NetNs::create(&unique_name(&format!("bench-reg-{i}")))?;
    run_in(
        &pod,
        None,
        Command::new("ip"),
        &["addr", "add", &format!("10.91.{}.{}/32", i / 250, 1 + i % 250), "dev", "lo"],
    );
    let cfg = weir_agent::node::cni::pod::capture_config(
        &weir_agent::node::cni::pod::PodInfo {
            namespace: "bench".into(),
            name: format!("r{i}"),
            ..Default::default()
        },
        false,
    )?;
    let id = format!("reg-{i}");
    let who = weir_agent::node::cni::ebpf::PodIdentity { name: format!("bench/r{i}"), uid: String::new() };
    let started = Instant::now();
    let facts = weir_agent::node::cni::ebpf::read_facts(pod.path())?;
    weir_agent::node::cni::ebpf::register(&node.capture, &id, pod.path(), "lo", &cfg, &who, &facts)?;
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    weir_agent::node::cni::ebpf::unregister(&node.capture, &id)?;
    Ok(ms)
}

/// One run: every population in turn on one node; per population (ADD p50, ADD p99,
/// registration p50, registration p99, the primary CNI's ADD p50, ADD p50 less it), then the parallel ADDs' (p50, p99) at the
/// largest, and the agent's RSS (MiB) at 1 pod and at the largest.
struct Run {
    by_population: Vec<[f64; 6]>,
    parallel: (f64, f64),
    rss: (f64, f64),
}

fn run_once() -> anyhow::Result<Run> {
    let ns = NetNs::create(&unique_name("bench-scale-node"))?;
    let mut node = Node::new(&ns)?;
    let rt = CniRuntime::new(&ns)?;
    let mut by_population = Vec::new();
    let mut rss = (f64::NAN, f64::NAN);
    for (k, &population) in POPULATIONS.iter().enumerate() {
        while node.pods.len() < population.saturating_sub(1) {
            let n = node.pods.len();
            node.add(&rt, &format!("bg{n}"))?;
        }
        let (mut add, mut reg, mut primary) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..TIMED {
            add.push(node.add(&rt, &format!("t{k}-{i}"))?);
            node.del_last(&rt)?;
            primary.push(node.add_primary(&rt, &format!("b{k}-{i}"))?);
            reg.push(register_once(&node, k * TIMED + i)?);
        }
        let (a50, a99) = p50_p99(add);
        let (r50, r99) = p50_p99(reg);
        let (b50, _) = p50_p99(primary);
        by_population.push([a50, a99, r50, r99, b50, a50 - b50]);
        if population == 1 || population == *POPULATIONS.last().expect("populations") {
            let mb = agent_rss(&node, &ns)?;
            if population == 1 {
                rss.0 = mb;
            } else {
                rss.1 = mb;
            }
        }
    }
    // 20 ADDs at once at the largest population.
    let names: Vec<String> = (0..PARALLEL).map(|i| format!("par{i}")).collect();
    for n in &names {
        node.api.set_pod(pod_object("bench", n, true, &[], &[]));
    }
    let spaces: Vec<NetNs> =
        names.iter().map(|n| NetNs::create(&unique_name(n))).collect::<Result<_, _>>()?;
    let list = node.list.clone();
    let ms: Vec<anyhow::Result<(f64, Attachment, Value)>> = std::thread::scope(|s| {
        let handles: Vec<_> = names
            .iter()
            .zip(&spaces)
            .map(|(n, ns)| {
                let (rt, list) = (&rt, &list);
                s.spawn(move || {
                    let a = Attachment::pod(&format!("c-{n}"), ns.path(), "bench", n);
                    let started = Instant::now();
                    let r = rt.add(list, &a).map_err(|e| anyhow::anyhow!("{e}"))?;
                    Ok((started.elapsed().as_secs_f64() * 1000.0, a, r))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    let mut times = Vec::new();
    for r in ms {
        let (t, a, result) = r?;
        times.push(t);
        rt.del(&list, &a, Some(&result)).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let parallel = p50_p99(times);
    while !node.pods.is_empty() {
        node.del_last(&rt)?;
    }
    Ok(Run { by_population, parallel, rss })
}

/// The node agent (`weir cni install` watching, with its monitoring port) started on
/// this node, scraped once; its peak RSS in MiB.
fn agent_rss(node: &Node, ns: &NetNs) -> anyhow::Result<f64> {
    let host = Dir::new("bench-scale-host")?;
    for d in ["net.d", "bin", "run"] {
        std::fs::create_dir_all(host.path().join(d))?;
    }
    std::fs::write(
        host.path().join("net.d/10.conflist"),
        r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"ptp"}]}"#,
    )?;
    let kubeconfig = host.path().join("kubeconfig");
    std::fs::write(&kubeconfig, node.api.kubeconfig(TOKEN, None))?;
    let port = 15914 + (std::process::id() % 1000) as u16;
    let mut agent = weir_tests::tools::weir_command();
    agent
        .args([
            "cni",
            "install",
            "--interval",
            "1s",
            "--ebpf-name",
            &node.capture,
            "--monitoring-port",
            &port.to_string(),
        ])
        .arg("--ebpf-cgroup")
        .arg(node.cgroup.path())
        .arg("--cni-net-dir")
        .arg(host.path().join("net.d"))
        .arg("--cni-bin-dir")
        .arg(host.path().join("bin"))
        .arg("--run-dir")
        .arg(host.path().join("run"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .env("WEIR_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = weir_agent::sandbox::process::spawn(
        &mut agent,
        weir_tests::Placement { netns: Some(ns), ..Default::default() },
    )?;
    std::thread::sleep(Duration::from_secs(2));
    let metrics = Command::new("nsenter")
        .args([
            "-t",
            &child.pid().to_string(),
            "-n",
            "curl",
            "-s",
            &format!("http://127.0.0.1:{port}/metrics"),
        ])
        .output()?;
    let text = String::from_utf8_lossy(&metrics.stdout);
    anyhow::ensure!(text.contains("weir_capture_pods"), "the agent's /metrics did not answer: {text}");
    std::thread::sleep(Duration::from_secs(2));
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.pid()))?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM"))?;
    child.signal(libc::SIGTERM)?;
    let _ = child.wait_timeout(Duration::from_secs(10));
    Ok(kb / 1024.0)
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    let _bpffs = weir_tests::BpffsUse::acquire()?;
    let mut runs = Vec::new();
    for run in 0..opts.runs {
        eprintln!("[bench scaling] run {}/{}", run + 1, opts.runs);
        match run_once() {
            Ok(r) => runs.push(r),
            Err(e) => eprintln!("[bench scaling] run failed: {e:#}"),
        }
    }
    anyhow::ensure!(!runs.is_empty(), "every run failed");
    let samples = |f: &dyn Fn(&Run) -> f64| Samples(runs.iter().map(f).collect());
    let mut rows: Vec<Row> = POPULATIONS
        .iter()
        .enumerate()
        .map(|(k, population)| Row {
            name: format!("{population} pod{} on the node", if *population == 1 { "" } else { "s" }),
            metrics: (0..6).map(|m| samples(&|r: &Run| r.by_population[k][m])).collect(),
        })
        .collect();
    rows.push(Row {
        name: format!("{PARALLEL} ADDs at once, {} pods on the node", POPULATIONS[3]),
        metrics: vec![
            samples(&|r| r.parallel.0),
            samples(&|r| r.parallel.1),
            Samples::default(),
            Samples::default(),
            Samples::default(),
            Samples::default(),
        ],
    });
    let growth = Table {
        title: "Per-pod cost as the node fills (eBPF capture)".into(),
        columns: vec![
            ("CNI ADD p50", "ms", false),
            ("CNI ADD p99", "ms", false),
            ("registration p50", "ms", false),
            ("registration p99", "ms", false),
            ("bridge + host-local alone p50", "ms", false),
            ("ADD p50 less the primary's", "ms", false),
        ],
        rows,
        notes: vec![format!(
            "The floor is the first row: the same figures on a node with one pod. Per population, {TIMED} pods are \
             added (the whole chain, every plugin exec'd as a runtime does; each DEL'd, not timed) and {TIMED} \
             registrations timed alone (`cni::ebpf::register` in process: its cookie, config, lists and inbound keys \
             written in one switch, the record saved). The parallel row starts {PARALLEL} ADDs together on threads \
             of the runtime: their latency includes waiting for the program set's lock. The primary CNI alone \
             (bridge + host-local, {TIMED} ADDs on the same node at the same population) shows what of the ADD's \
             growth is the bridge's and host-local's; the last column is what remains, weir-cni's part. Median \
             [min–max] of {} runs.",
            runs.len()
        )],
    };
    let memory = Table {
        title: "Node agent memory with its pods".into(),
        columns: vec![("peak RSS", "MiB", false)],
        rows: vec![
            Row { name: "weir cni install, 1 pod on the node".into(), metrics: vec![samples(&|r| r.rss.0)] },
            Row {
                name: format!("weir cni install, {} pods on the node", POPULATIONS[3]),
                metrics: vec![samples(&|r| r.rss.1)],
            },
        ],
        notes: vec![
            "VmHWM of the node agent after two seconds of watching and one scrape of its /metrics (which reads \
             every pod's counters and every map's fill level)."
                .into(),
        ],
    };
    Ok(vec![growth, memory])
}
