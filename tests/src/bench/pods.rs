//! `weir-bench pods`: pods through the real runtime. Two nodes of the node rig
//! (`weir_tests::cluster`: a containerd each, driven through CRI by the kubelet
//! stand-in), alike but for Weir: node-1 runs Weir's DaemonSet (the `weir-cni:dev`
//! image, eBPF capture, chained after the primary CNI) and ztunnel; node-2 runs the
//! primary CNI alone (bridge + host-local), the floor. istiod runs on node-2.
//!
//! Per pod: how long RunPodSandbox took until the runtime returned the sandbox (the
//! whole CNI chain; the kubelet's first call to its answer, refusals and retries
//! included), and how long from the pod's creation until every container was Ready as
//! the kubelet reports it. Pods one at a time (the two nodes in turn) and 20 created
//! at once on one node; an ambient pod, an injected sidecar pod with istio-init (which
//! both nodes can run) and one with the CNI plugin (node-1 only: without Weir its
//! istio-validation fails). Then the node agent's memory and CPU while 100 ambient pods
//! are made, run and go on its node.

use std::{
    net::IpAddr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use weir_tests::cluster::{
    rig::Cluster,
    scene::DEV_IMAGE,
    workloads::{Capture, Sidecar, ready},
};

use crate::report::{Options, Row, Samples, Table};

/// The node with Weir, and the node without it.
const WITH: u8 = 1;
const WITHOUT: u8 = 2;
/// Pods made one after another per case and run (their p50 and p99 are the figures).
const ONE_BY_ONE: usize = 8;
const AT_ONCE: usize = 20;
const FULL_NODE: usize = 100;
/// How long one pod may take to be Ready; 20 at once, and 100.
const READY: Duration = Duration::from_secs(180);
const READY_MANY: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PodKind {
    Ambient,
    /// Not in the mesh (no ambient label, no sidecar): where Weir runs, its plugin's
    /// ADD still reads the pod and its namespace, and hands nothing to the agent.
    Plain,
    /// Injected with istio-init (init-container capture): runs on either node.
    SidecarInit,
    /// Injected for the CNI plugin (istio-validation): needs Weir on the node.
    SidecarCni,
}

impl PodKind {
    fn label(self) -> &'static str {
        match self {
            Self::Ambient => "ambient pod",
            Self::Plain => "pod outside the mesh",
            Self::SidecarInit => "sidecar pod, istio-init",
            Self::SidecarCni => "sidecar pod, CNI (istio-validation)",
        }
    }
}

/// What one pod took, ms.
#[derive(Debug, Clone, Copy)]
struct Took {
    sandbox: f64,
    ready: f64,
}

struct Bench {
    cluster: Cluster,
    istiod: IpAddr,
    next: usize,
}

impl Bench {
    fn up() -> anyhow::Result<Self> {
        eprintln!(
            "[bench pods] two nodes; Weir's DaemonSet and ztunnel on node-{WITH}, the primary CNI alone on node-{WITHOUT}"
        );
        let cluster = Cluster::new("bench-pods", 2)?;
        cluster.apply_daemonset_on(DEV_IMAGE, &[WITH])?;
        cluster.wait_pod("kube-system", &format!("weir-cni-node-{WITH}"), READY, "Ready", ready)?;
        let istiod = cluster.start_istiod(WITHOUT, "permissive")?;
        cluster.start_ztunnels_on(istiod, &[WITH])?;
        Ok(Self { cluster, istiod, next: 0 })
    }

    /// Creates a pod of `kind` on `node`; returns its name.
    fn create(&mut self, kind: PodKind, node: u8) -> anyhow::Result<String> {
        self.next += 1;
        let name = format!("bench-{}-{}", self.next, node);
        match kind {
            PodKind::Ambient | PodKind::Plain => {
                self.cluster.app_pod(&name, node, kind == PodKind::Ambient)?
            }
            PodKind::SidecarInit | PodKind::SidecarCni => {
                let capture = if kind == PodKind::SidecarCni { Capture::Cni } else { Capture::InitContainer };
                self.cluster.sidecar_pod(
                    "hello-readiness.yaml.injected",
                    &name,
                    node,
                    capture,
                    Sidecar::Native,
                    self.istiod,
                )?
            }
        };
        Ok(name)
    }

    /// Waits until every pod of `names` (created at `created`) is Ready; what each took.
    fn wait_ready(&self, names: &[String], created: Instant, limit: Duration) -> anyhow::Result<Vec<Took>> {
        let mut took: Vec<Option<Took>> = vec![None; names.len()];
        let deadline = created + limit;
        while took.iter().any(Option::is_none) {
            for (i, name) in names.iter().enumerate() {
                if took[i].is_some() {
                    continue;
                }
                let Some(view) = self.cluster.pod_view("default", name) else { continue };
                if view.ready() {
                    let sandbox = view.sandbox_ms.context("a Ready pod with no sandbox time")?;
                    took[i] = Some(Took { sandbox, ready: created.elapsed().as_secs_f64() * 1000.0 });
                }
            }
            if Instant::now() > deadline {
                let late: Vec<String> = names
                    .iter()
                    .zip(&took)
                    .filter(|(_, t)| t.is_none())
                    .map(|(n, _)| {
                        let v = self.cluster.pod_view("default", n);
                        format!("{n}: {:?}", v.and_then(|v| v.waiting))
                    })
                    .collect();
                bail!("not Ready within {limit:?}: {late:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(took.into_iter().flatten().collect())
    }

    /// Deletes `names` and waits until they are gone.
    fn delete(&self, names: &[String]) -> anyhow::Result<()> {
        for n in names {
            self.cluster.delete_pod("default", n, Duration::from_secs(5));
        }
        for n in names {
            self.cluster.wait_gone("default", n, Duration::from_secs(120))?;
        }
        Ok(())
    }

    /// `count` pods of `kind` created at once on `node`: what each took, the time until
    /// the last was Ready (ms), and the CPU used meanwhile. Deleted afterwards.
    fn batch(&mut self, kind: PodKind, node: u8, count: usize) -> anyhow::Result<(Vec<Took>, f64, CpuUsed)> {
        let mut names = Vec::new();
        let before = self.cpu_now()?;
        let created = Instant::now();
        for _ in 0..count {
            names.push(self.create(kind, node)?);
        }
        let limit = if count > 1 { READY_MANY } else { READY };
        let took = self.wait_ready(&names, created, limit);
        let all = created.elapsed().as_secs_f64() * 1000.0;
        let used = self.cpu_now()?.since(&before);
        self.delete(&names)?;
        Ok((took?, all, used))
    }

    /// CPU time used so far (s): the machine's, and the mesh's own pods' (Weir's node
    /// agent and ztunnel on the node with Weir; istiod).
    fn cpu_now(&self) -> anyhow::Result<CpuUsed> {
        Ok(CpuUsed {
            machine: machine_busy_seconds()?,
            agent: self.pod_usage("kube-system", &format!("weir-cni-node-{WITH}"), WITH)?.1,
            ztunnel: self.pod_usage("istio-system", &format!("ztunnel-{WITH}"), WITH)?.1,
            istiod: self.pod_usage("istio-system", "istiod", WITHOUT)?.1,
        })
    }

    /// The node agent's containers on `node`: the summed VmRSS of their processes (MiB)
    /// and their CPU time (cgroup `cpu.stat` usage, s).
    fn agent_usage(&self, node: u8) -> anyhow::Result<(f64, f64)> {
        self.pod_usage("kube-system", &format!("weir-cni-node-{node}"), node)
    }

    /// Pod `namespace/name`'s running containers on `node`: the summed VmRSS of their
    /// processes (MiB) and their CPU time (cgroup `cpu.stat` usage, s).
    fn pod_usage(&self, namespace: &str, name: &str, node: u8) -> anyhow::Result<(f64, f64)> {
        let view =
            self.cluster.pod_view(namespace, name).with_context(|| format!("pod {namespace}/{name}"))?;
        let kubepods = self.cluster.node(node).kubepods.path().to_path_buf();
        let (mut rss_kb, mut cpu_us) = (0.0, 0.0);
        for c in view.containers.iter().filter(|c| !c.id.is_empty() && c.exited.is_none()) {
            let cgroup = find_dir(&kubepods, &c.id)
                .with_context(|| format!("the cgroup of container {} ({})", c.name, c.id))?;
            let stat = std::fs::read_to_string(cgroup.join("cpu.stat"))?;
            cpu_us += stat
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .context("cpu.stat without usage_usec")?;
            for pid in std::fs::read_to_string(cgroup.join("cgroup.procs"))?.lines() {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
                rss_kb += status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
                    .unwrap_or(0.0);
            }
        }
        Ok((rss_kb / 1024.0, cpu_us / 1e6))
    }
}

/// CPU time (s) used by the whole machine and by the mesh's own pods.
#[derive(Debug, Clone, Copy, Default)]
struct CpuUsed {
    machine: f64,
    agent: f64,
    ztunnel: f64,
    istiod: f64,
}

impl CpuUsed {
    fn since(&self, before: &CpuUsed) -> CpuUsed {
        CpuUsed {
            machine: self.machine - before.machine,
            agent: self.agent - before.agent,
            ztunnel: self.ztunnel - before.ztunnel,
            istiod: self.istiod - before.istiod,
        }
    }
}

/// Every CPU's busy time so far (s): `/proc/stat`'s first line less idle and iowait,
/// in clock ticks of 10 ms (`USER_HZ`, 100 on Linux).
fn machine_busy_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat").context("read /proc/stat")?;
    let fields: Vec<f64> = stat
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("cpu "))
        .context("/proc/stat without its cpu line")?
        .split_whitespace()
        .map(|v| v.parse::<f64>().context("a /proc/stat cpu field"))
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(
        fields.len() >= 5,
        "/proc/stat's cpu line has {} fields, expected at least 5",
        fields.len()
    );
    // user nice system idle iowait irq softirq steal (guest times are in user already)
    let busy: f64 =
        fields.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, v)| v).sum();
    Ok(busy / 100.0)
}

/// The directory named `name` under `root`, at any depth.
fn find_dir(root: &Path, name: &str) -> Option<std::path::PathBuf> {
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                if e.file_name().to_string_lossy() == name {
                    return Some(e.path());
                }
                stack.push(e.path());
            }
        }
    }
    None
}

fn percentile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[((v.len() - 1) as f64 * q).round() as usize] }
}

/// A case's figures per run: sandbox p50, p99, ready p50, p99 (and for a batch, the
/// time until the last pod was Ready).
#[derive(Default)]
struct Figures {
    sandbox_p50: Samples,
    sandbox_p99: Samples,
    ready_p50: Samples,
    ready_p99: Samples,
    all_ready: Samples,
    machine_cpu: Samples,
    mesh_cpu: Samples,
    agent_cpu: Samples,
}

impl Figures {
    /// A batch's CPU: the machine's, ztunnel's and istiod's, the node agent's (the last
    /// two only where Weir ran: elsewhere the mesh is idle).
    fn push_cpu(&mut self, used: CpuUsed, with_weir: bool) {
        self.machine_cpu.0.push(used.machine);
        if with_weir {
            self.mesh_cpu.0.push(used.ztunnel + used.istiod);
            self.agent_cpu.0.push(used.agent);
        }
    }

    fn push(&mut self, took: &[Took], all: Option<f64>) {
        let s: Vec<f64> = took.iter().map(|t| t.sandbox).collect();
        let r: Vec<f64> = took.iter().map(|t| t.ready).collect();
        self.sandbox_p50.0.push(percentile(s.clone(), 0.5));
        self.sandbox_p99.0.push(percentile(s, 0.99));
        self.ready_p50.0.push(percentile(r.clone(), 0.5));
        self.ready_p99.0.push(percentile(r, 0.99));
        if let Some(all) = all {
            self.all_ready.0.push(all);
        }
    }

    fn failed(&mut self, batch: bool) {
        for s in [&mut self.sandbox_p50, &mut self.sandbox_p99, &mut self.ready_p50, &mut self.ready_p99] {
            s.0.push(f64::NAN);
        }
        if batch {
            for s in [&mut self.all_ready, &mut self.machine_cpu, &mut self.mesh_cpu, &mut self.agent_cpu] {
                s.0.push(f64::NAN);
            }
        }
    }

    fn row(&self, name: String, batch: bool) -> Row {
        let mut metrics = vec![
            self.sandbox_p50.clone(),
            self.sandbox_p99.clone(),
            self.ready_p50.clone(),
            self.ready_p99.clone(),
        ];
        if batch {
            metrics.extend([
                self.all_ready.clone(),
                self.machine_cpu.clone(),
                self.mesh_cpu.clone(),
                self.agent_cpu.clone(),
            ]);
        }
        Row { name, metrics }
    }
}

/// The cases: a kind on a node; the first of each table is its floor.
const ONE_BY_ONE_CASES: [(PodKind, u8); 5] = [
    (PodKind::Ambient, WITHOUT),
    (PodKind::Ambient, WITH),
    (PodKind::SidecarInit, WITHOUT),
    (PodKind::SidecarInit, WITH),
    (PodKind::SidecarCni, WITH),
];
const AT_ONCE_CASES: [(PodKind, u8); 5] = [
    (PodKind::Ambient, WITHOUT),
    (PodKind::Plain, WITH),
    (PodKind::Ambient, WITH),
    (PodKind::SidecarInit, WITHOUT),
    (PodKind::SidecarCni, WITH),
];

fn case_name(kind: PodKind, node: u8) -> String {
    let weir = if node == WITH { "with Weir" } else { "without Weir (primary CNI alone)" };
    format!("{}, {weir}", kind.label())
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    let mut bench = Bench::up()?;
    let mut one: Vec<Figures> = ONE_BY_ONE_CASES.iter().map(|_| Figures::default()).collect();
    let mut many: Vec<Figures> = AT_ONCE_CASES.iter().map(|_| Figures::default()).collect();
    for run in 0..opts.runs {
        // One pod at a time, the cases in turn (each case's pods spread over the run).
        let mut took: Vec<Vec<Took>> = vec![Vec::new(); ONE_BY_ONE_CASES.len()];
        let mut failed = vec![false; ONE_BY_ONE_CASES.len()];
        for k in 0..ONE_BY_ONE {
            eprintln!(
                "[bench pods] run {}/{}: one at a time, round {}/{ONE_BY_ONE}",
                run + 1,
                opts.runs,
                k + 1
            );
            for (i, (kind, node)) in ONE_BY_ONE_CASES.iter().enumerate() {
                match bench.batch(*kind, *node, 1) {
                    Ok((t, _, _)) => took[i].extend(t),
                    Err(e) => {
                        eprintln!("[bench pods] {}: {e:#}", case_name(*kind, *node));
                        failed[i] = true;
                    }
                }
            }
        }
        for (i, f) in one.iter_mut().enumerate() {
            if failed[i] { f.failed(false) } else { f.push(&took[i], None) }
        }
        for (i, (kind, node)) in AT_ONCE_CASES.iter().enumerate() {
            eprintln!(
                "[bench pods] run {}/{}: {AT_ONCE} at once, {}",
                run + 1,
                opts.runs,
                case_name(*kind, *node)
            );
            match bench.batch(*kind, *node, AT_ONCE) {
                Ok((t, all, used)) => {
                    many[i].push(&t, Some(all));
                    many[i].push_cpu(used, *node == WITH);
                }
                Err(e) => {
                    eprintln!("[bench pods] {}: {e:#}", case_name(*kind, *node));
                    many[i].failed(true);
                }
            }
        }
    }

    // The node agent with 100 ambient pods: its usage before, while they are made, once
    // all run (30 s), and while they go.
    eprintln!("[bench pods] the node agent with {FULL_NODE} ambient pods");
    let idle = Duration::from_secs(30);
    let (rss0, cpu0) = bench.agent_usage(WITH)?;
    std::thread::sleep(idle);
    let (_, cpu1) = bench.agent_usage(WITH)?;
    let mut names = Vec::new();
    let created = Instant::now();
    for _ in 0..FULL_NODE {
        names.push(bench.create(PodKind::Ambient, WITH)?);
    }
    let full = bench.wait_ready(&names, created, READY_MANY);
    let ramp = created.elapsed().as_secs_f64();
    let (_, cpu2) = bench.agent_usage(WITH)?;
    std::thread::sleep(idle);
    let (rss3, cpu3) = bench.agent_usage(WITH)?;
    let gone = Instant::now();
    bench.delete(&names)?;
    let (_, cpu4) = bench.agent_usage(WITH)?;
    full?;
    let percent = |cpu: f64, secs: f64| cpu / secs * 100.0;
    let rows_agent = vec![
        Row {
            name: "no pods on the node (30 s)".into(),
            metrics: vec![
                Samples(vec![rss0]),
                Samples(vec![percent(cpu1 - cpu0, idle.as_secs_f64())]),
                Samples(vec![cpu1 - cpu0]),
            ],
        },
        Row {
            name: format!("{FULL_NODE} ambient pods made at once ({ramp:.0} s until all Ready)"),
            metrics: vec![
                Samples::default(),
                Samples(vec![percent(cpu2 - cpu1, ramp)]),
                Samples(vec![cpu2 - cpu1]),
            ],
        },
        Row {
            name: format!("{FULL_NODE} ambient pods running (30 s)"),
            metrics: vec![
                Samples(vec![rss3]),
                Samples(vec![percent(cpu3 - cpu2, idle.as_secs_f64())]),
                Samples(vec![cpu3 - cpu2]),
            ],
        },
        Row {
            name: format!(
                "{FULL_NODE} ambient pods deleted ({:.0} s until all gone)",
                gone.elapsed().as_secs_f64()
            ),
            metrics: vec![
                Samples::default(),
                Samples(vec![percent(cpu4 - cpu3, gone.elapsed().as_secs_f64())]),
                Samples(vec![cpu4 - cpu3]),
            ],
        },
    ];

    let columns = vec![
        ("sandbox p50", "ms", false),
        ("sandbox p99", "ms", false),
        ("pod Ready p50", "ms", false),
        ("pod Ready p99", "ms", false),
    ];
    let granularity = "The kubelet stand-in looks for new pods every 300 ms and probes readiness every second (the \
                       injector's and the rig's probes), so `pod Ready` moves in steps of up to a second: it shows \
                       whether Weir delays a pod by seconds, not by milliseconds. `sandbox` is timed inside the \
                       kubelet around RunPodSandbox and has no such step."
        .to_string();
    let ambient_sidecar = |cases: &[(PodKind, u8)], figures: &[Figures], kinds: &[PodKind], batch: bool| {
        cases
            .iter()
            .zip(figures)
            .filter(|((k, _), _)| kinds.contains(k))
            .map(|((k, n), f)| f.row(case_name(*k, *n), batch))
            .collect::<Vec<Row>>()
    };
    let mut batch_columns = columns.clone();
    batch_columns.extend([
        ("all Ready", "ms", false),
        ("machine CPU", "core-s", false),
        ("ztunnel + istiod CPU", "core-s", false),
        ("node agent CPU", "core-s", false),
    ]);
    let summary = opts.summary();
    Ok(vec![
        Table {
            title: "Pods one at a time: ambient".into(),
            columns: columns.clone(),
            rows: ambient_sidecar(&ONE_BY_ONE_CASES, &one, &[PodKind::Ambient], false),
            notes: vec![
                format!(
                    "The floor is the same pod on the node without Weir (its ambient label means nothing there). \
                     Per run {ONE_BY_ONE} pods per row, one at a time, the rows in turn; each deleted and gone \
                     before the next. p50/p99 per run; {summary}"
                ),
                granularity.clone(),
            ],
        },
        Table {
            title: "Pods one at a time: injected sidecar pods".into(),
            columns: columns.clone(),
            rows: ambient_sidecar(&ONE_BY_ONE_CASES, &one, &[PodKind::SidecarInit, PodKind::SidecarCni], false),
            notes: vec![
                format!(
                    "The floor is the istio-init pod on the node without Weir, the way a sidecar pod is captured \
                     without a CNI plugin. The CNI pod runs only where Weir is (its istio-validation checks the \
                     capture Weir made). {summary}"
                ),
                granularity.clone(),
            ],
        },
        Table {
            title: format!("{AT_ONCE} pods created at once on one node"),
            columns: batch_columns,
            rows: AT_ONCE_CASES.iter().zip(&many).map(|((k, n), f)| f.row(case_name(*k, *n), true)).collect(),
            notes: vec![
                format!(
                    "The floor is {AT_ONCE} ambient-labelled pods on the node without Weir. The kubelet starts \
                     their sandboxes in parallel; `sandbox` includes waiting in containerd and in the CNI chain. \
                     The pod outside the mesh and the ambient pod with Weir compare with the first row (the \
                     first is Weir's plugin alone: it reads the pod and its namespace and hands nothing on); \
                     the sidecar pod with Weir compares with the row above it. CPU: from the first pod's creation until \
                     the last was Ready, the machine's busy time (every CPU, `/proc/stat`), and that of the \
                     mesh's own pods (ztunnel on the node and istiod; Weir's node agent), which work only for \
                     pods on the node with Weir. {summary}"
                ),
                granularity,
            ],
        },
        Table {
            title: format!("The node agent (weir-cni DaemonSet pod) with {FULL_NODE} ambient pods"),
            columns: vec![("RSS", "MiB", false), ("CPU", "% of a core", false), ("CPU time", "s", false)],
            rows: rows_agent,
            notes: vec![
                "RSS: the summed VmRSS of the pod's containers' processes (install, repair, ambient) at the end of \
                 the window; CPU: their cgroups' usage over the window. One measurement; the floor is the agent \
                 with no pods on its node."
                    .into(),
            ],
        },
    ])
}
