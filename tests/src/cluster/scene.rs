//! The rig's standing scene: three nodes with Weir's DaemonSet, istiod, ztunnel on every
//! node, and workloads of every kind calling each other across the nodes all the time
//! (sidecar to sidecar through both Envoys, ambient to ambient over HBONE, sidecar to
//! ambient and back, plain pods into the mesh). The events a platform team puts a node
//! agent through (`scene/events.rs`) run one after another under that traffic; each is
//! judged here on its own window of the pods' logs: no bypass, no failed request between
//! pods the event did not touch, every call answered, every pod Ready as its kubelet
//! reports it, and nothing of Weir's left on a node that nothing needs.

pub mod events;
pub mod script;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{
    rig::Cluster,
    workloads::{Capture, Kind, Sidecar, Workload, ready},
};

/// The DaemonSet's image as `scripts/image` builds it, and the same sources stamped as
/// the next version (`weir-cni:next`): a roll between them changes the program set.
pub const DEV_IMAGE: &str = "localhost/weir-cni:dev";
pub const NEXT_IMAGE: &str = "localhost/weir-cni:next";

/// How long a pod may take to be Ready on this 2-core machine with everything running.
pub const READY: Duration = Duration::from_secs(180);

/// The standing workloads: every capture (istio-init, the CNI plugin) with every sidecar
/// placement (native, classic), ambient pods and plain pods, spread over the nodes so
/// that every kind of call crosses a node.
const STANDING: &[(&str, u8, Kind)] = &[
    ("s1", 1, Kind::Sidecar(Capture::InitContainer, Sidecar::Native)),
    ("a1", 1, Kind::Ambient),
    ("p1", 1, Kind::Plain),
    ("s2", 2, Kind::Sidecar(Capture::Cni, Sidecar::Native)),
    ("a2", 2, Kind::Ambient),
    ("c2", 2, Kind::Sidecar(Capture::InitContainer, Sidecar::Classic)),
    ("s3", 3, Kind::Sidecar(Capture::Cni, Sidecar::Classic)),
    ("a3", 3, Kind::Ambient),
    ("p3", 3, Kind::Plain),
];

/// Who calls whom, all the time.
const CALLS: &[(&str, &str)] = &[
    // sidecar → sidecar (mutual TLS through both Envoys), node 1 → 2 → 3 → 1
    ("s1", "s2"),
    ("s2", "s3"),
    ("s3", "s1"),
    ("c2", "s1"),
    // ambient → ambient (HBONE between the nodes' ztunnels)
    ("a1", "a2"),
    ("a2", "a3"),
    ("a3", "a1"),
    // sidecar → ambient, ambient → sidecar
    ("s1", "a3"),
    ("s2", "a1"),
    ("a1", "s2"),
    ("a3", "c2"),
    // plain pods into the mesh (PERMISSIVE)
    ("p1", "a2"),
    ("p1", "s3"),
    ("p3", "s1"),
];

/// A line a step at a time, with the time since the scene began.
pub struct Progress {
    started: Instant,
}

impl Progress {
    pub fn step(&self, what: &str) {
        eprintln!("[rig {:>7.1} s] {what}", self.started.elapsed().as_secs_f64());
    }
}

/// One call of the scene: `client` asks `server` at `path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub client: String,
    pub server: String,
    pub path: String,
}

/// The scene.
pub struct Scene {
    pub cluster: Cluster,
    pub istiod: IpAddr,
    /// The workloads that run now.
    pub workloads: Vec<Workload>,
    /// Workloads that ran and were deleted (their logs are still read).
    pub gone: Vec<Workload>,
    pub calls: Vec<Call>,
    /// Every address a workload has had, and whose it was.
    owners: BTreeMap<IpAddr, String>,
    /// The image the DaemonSet runs on each node.
    pub daemonset: BTreeMap<u8, String>,
    /// Which node agent's DaemonSet runs Weir.
    pub agent: NodeAgent,
    pub progress: Progress,
}

/// What a window of the scene's traffic must show.
#[derive(Debug, Default)]
pub struct Touched {
    /// Workloads the event took down, moved or made: their failed requests (either end)
    /// are not counted, their bypasses are.
    pub pods: BTreeSet<String>,
}

impl Touched {
    pub fn none() -> Self {
        Self::default()
    }

    pub fn pods<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        Self { pods: names.into_iter().map(String::from).collect() }
    }
}

/// The DaemonSet that runs Weir on the nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeAgent {
    /// Weir's own (`agent/deploy/weir-cni.yaml`: eBPF node capture, three containers).
    Weir,
    /// Istio's istio-cni chart with Weir's image (`super::chart`).
    IstioChart(super::chart::Profile),
}

impl NodeAgent {
    /// The agent's pod on node `index`: namespace and name.
    pub fn pod(self, index: u8) -> (&'static str, String) {
        match self {
            Self::Weir => ("kube-system", format!("weir-cni-node-{index}")),
            Self::IstioChart(_) => (super::chart::NAMESPACE, super::chart::pod_name(index)),
        }
    }
}

impl Scene {
    /// Brings the scene up: the cluster, the DaemonSet at [`DEV_IMAGE`] on every node,
    /// istiod, ztunnels, the standing workloads, their calls answered.
    pub fn up(test: &str) -> anyhow::Result<Self> {
        Self::up_with(test, NodeAgent::Weir)
    }

    /// [`Scene::up`] with `agent`'s DaemonSet running Weir.
    pub fn up_with(test: &str, agent: NodeAgent) -> anyhow::Result<Self> {
        let progress = Progress { started: Instant::now() };
        progress
            .step("three nodes: network and mount namespaces, a containerd each, images imported, kubelets");
        let cluster = Cluster::new(test, 3)?;
        match agent {
            NodeAgent::Weir => {
                progress.step("Weir's DaemonSet (weir-cni:dev) on every node");
                cluster.apply_daemonset(DEV_IMAGE)?;
            }
            NodeAgent::IstioChart(profile) => {
                progress.step(&format!(
                    "Istio's istio-cni chart ({profile:?} profile) with weir-cni:dev on every node"
                ));
                cluster.apply_istio_cni_chart(DEV_IMAGE, profile, &[1, 2, 3])?;
            }
        }
        let daemonset: BTreeMap<u8, String> = (1..=3).map(|i| (i, DEV_IMAGE.to_string())).collect();
        for i in 1..=3 {
            let (ns, name) = agent.pod(i);
            cluster.wait_pod(ns, &name, READY, "Ready", ready)?;
        }
        progress.step("istiod (the test control plane) on node-1");
        let istiod = cluster.start_istiod(1, "permissive")?;
        progress.step("ztunnel on every node");
        cluster.start_ztunnels(istiod)?;
        let mut scene = Self {
            cluster,
            istiod,
            workloads: Vec::new(),
            gone: Vec::new(),
            calls: CALLS
                .iter()
                .map(|(c, s)| Call { client: c.to_string(), server: s.to_string(), path: "/".into() })
                .collect(),
            owners: BTreeMap::new(),
            daemonset,
            agent,
            progress,
        };
        scene.progress.step(&format!(
            "{} workloads: sidecars (istio-init and CNI, native and classic), ambient, plain",
            STANDING.len()
        ));
        for (name, node, kind) in STANDING {
            let w = scene.start(name, *node, kind.clone())?;
            scene.workloads.push(w);
        }
        scene.wait_all_ready()?;
        scene.sync()?;
        scene.settle()?;
        Ok(scene)
    }

    /// Starts workload `name` of `kind` on `node` (not yet Ready).
    pub fn start(&self, name: &str, node: u8, kind: Kind) -> anyhow::Result<Workload> {
        match kind {
            Kind::Sidecar(capture, sidecar) => self.cluster.sidecar_pod(
                "hello-readiness.yaml.injected",
                name,
                node,
                capture,
                sidecar,
                self.istiod,
            ),
            Kind::Ambient => self.cluster.app_pod(name, node, true),
            Kind::Plain => self.cluster.app_pod(name, node, false),
        }
    }

    /// Every workload, the DaemonSet's pods, ztunnels and istiod Ready as their kubelets
    /// report them; the workloads' addresses read again.
    pub fn wait_all_ready(&mut self) -> anyhow::Result<()> {
        for i in 1..=3u8 {
            for (ns, name) in [self.agent.pod(i), ("istio-system", format!("ztunnel-{i}"))] {
                self.cluster.wait_pod(ns, &name, READY, "Ready", ready)?;
            }
        }
        self.cluster.wait_pod("istio-system", "istiod", READY, "Ready", ready)?;
        for w in &mut self.workloads {
            self.cluster.wait_ready(w, READY)?;
            if let Some(ip) = w.ip {
                self.owners.insert(ip, w.name.clone());
            }
        }
        Ok(())
    }

    /// What the cluster's controllers would make of the workloads' addresses now:
    /// istiod's workloads (ambient) and services (sidecar servers), and each client's
    /// targets (the calls whose server has an address).
    pub fn sync(&self) -> anyhow::Result<()> {
        let ambient: Vec<&Workload> = self.workloads.iter().filter(|w| w.kind == Kind::Ambient).collect();
        self.cluster.set_ambient_workloads(&ambient)?;
        let servers: Vec<&Workload> =
            self.workloads.iter().filter(|w| matches!(w.kind, Kind::Sidecar(..))).collect();
        self.cluster.set_mesh_services(&servers, "permissive")?;
        self.sync_targets()
    }

    /// Each client's targets: the calls whose server has an address.
    pub fn sync_targets(&self) -> anyhow::Result<()> {
        for w in self.workloads.iter().chain(&self.gone) {
            let targets: Vec<String> = self
                .calls
                .iter()
                .filter(|c| c.client == w.name)
                .filter_map(|c| {
                    let server = self.workloads.iter().find(|s| s.name == c.server)?;
                    let addr = server.addr()?;
                    Some(if c.path == "/" { addr.to_string() } else { format!("{addr}{}", c.path) })
                })
                .collect();
            self.cluster.set_targets(&w.name, &targets)?;
        }
        Ok(())
    }

    /// Waits until every call has been answered since now (istiod pushed what [`sync`]
    /// wrote, every proxy has it).
    ///
    /// [`sync`]: Self::sync
    pub fn settle(&self) -> anyhow::Result<()> {
        let since = crate::busynode::now_ms();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let t = self.traffic(since);
            let unanswered = self.unanswered(&t, &Touched::none());
            if unanswered.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                let kept = self.keep_logs("calls not answered", since);
                bail!(
                    "calls not answered within 90 s of the scene's change: {unanswered:?}; failures {:?}, the first of each: {:?} (every log line since: {kept})",
                    t.failures,
                    t.failure_lines.values().collect::<Vec<_>>()
                );
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    fn traffic(&self, since: u128) -> super::workloads::Traffic {
        let all: Vec<&Workload> = self.workloads.iter().chain(&self.gone).collect();
        self.cluster.traffic(&all, since)
    }

    /// The calls between untouched running workloads that had no answer in `t`.
    fn unanswered(&self, t: &super::workloads::Traffic, touched: &Touched) -> Vec<String> {
        let running = |n: &str| self.workloads.iter().any(|w| w.name == n);
        self.calls
            .iter()
            .filter(|c| running(&c.client) && running(&c.server))
            .filter(|c| !touched.pods.contains(&c.client) && !touched.pods.contains(&c.server))
            .filter(|c| {
                !t.answered.iter().any(|((client, target), n)| {
                    *client == c.client && *n > 0 && self.owner(target) == c.server
                })
            })
            .map(|c| format!("{} → {}{}", c.client, c.server, c.path))
            .collect()
    }

    /// The workload whose address `target` (`ip:port[/path]`) is or was.
    fn owner(&self, target: &str) -> String {
        let host = target.split('/').next().unwrap_or_default();
        host.parse::<std::net::SocketAddr>()
            .ok()
            .and_then(|a| self.owners.get(&a.ip()).cloned())
            .unwrap_or_else(|| format!("?{target}"))
    }

    /// Judges the window since `since` (ms) of event `event`: no bypass anywhere, no
    /// failed request between workloads it did not touch, every call between those
    /// answered, every pod Ready, nothing of Weir's left that nothing needs. Prints the
    /// window's numbers.
    pub fn judge(&mut self, event: &str, since: u128, touched: &Touched) -> anyhow::Result<()> {
        self.wait_all_ready().with_context(|| format!("{event}: readiness"))?;
        let t = self.traffic(since);
        let mut problems: Vec<String> = Vec::new();
        problems.extend(t.bypasses.iter().map(|b| format!("bypass: {b}")));
        let mut excused = 0;
        for ((client, target), n) in &t.failures {
            let server = self.owner(target);
            if touched.pods.contains(client) || touched.pods.contains(&server) {
                excused += n;
            } else {
                let first =
                    t.failure_lines.get(&(client.clone(), target.clone())).cloned().unwrap_or_default();
                problems.push(format!(
                    "{n} failed request(s) {client} → {server} ({target}); the first: {first}"
                ));
            }
        }
        problems.extend(self.unanswered(&t, touched).into_iter().map(|c| format!("no answer: {c}")));
        let probes = self.failed_probes(since, touched);
        let failed_probes = probes.len();
        problems.extend(probes);
        problems.extend(self.leftovers());
        let plain_direct = t.plain.get("network").copied().unwrap_or(0);
        if t.plain.contains_key("proxy") {
            problems.push(format!("the check saw a plain pod's connection as proxied: {:?}", t.plain));
        }
        self.progress.step(&format!(
            "{event}: {} requests answered, {} failed to or from pods it touched, {} bypasses, {failed_probes} failed probes, {plain_direct} plain pods' requests seen direct, {} problem(s)",
            t.ok,
            excused,
            t.bypasses.len(),
            problems.len()
        ));
        if !problems.is_empty() {
            let kept = self.keep_logs(event, since);
            bail!("{event}:\n  {}\n  (every log line of the window: {kept})", problems.join("\n  "));
        }
        Ok(())
    }

    /// The kubelet's failed probes since `since` (ms) of the standing workloads the event
    /// did not touch: each a problem.
    fn failed_probes(&self, since: u128, touched: &Touched) -> Vec<String> {
        let mut out = Vec::new();
        for n in &self.cluster.nodes {
            let log = std::fs::read_to_string(n.node.dir.join("kubelet/kubelet.log")).unwrap_or_default();
            for line in log.lines() {
                let Some((ms, rest)) = line.split_once(' ') else { continue };
                let (Ok(ms), Some(what)) =
                    (ms.parse::<u128>(), rest.strip_prefix(super::kubelet::PROBE_FAILED))
                else {
                    continue;
                };
                let pod = what.split_whitespace().next().unwrap_or_default();
                let Some((namespace, name)) = pod.split_once('/') else { continue };
                let standing = self
                    .workloads
                    .iter()
                    .any(|w| w.namespace == namespace && w.name == name && !touched.pods.contains(&w.name));
                if ms >= since && standing {
                    out.push(format!("failed probe on {} at {ms}:{what}", n.node.name));
                }
            }
        }
        out
    }

    /// Writes every container's and kubelet's log lines since `since` (ms) on every
    /// node, in time order, to `target/rig-failures/<event>.log` (the rig's own folder
    /// goes with it); returns where, or why not.
    pub fn keep_logs(&self, event: &str, since: u128) -> String {
        let slug: String = event.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
        let dir = crate::tools::workspace().join("target/rig-failures");
        let path = dir.join(format!("{slug}.log"));
        let from = std::time::UNIX_EPOCH + Duration::from_millis(since as u64);
        let from = humantime_rfc3339(from);
        let mut lines: Vec<String> = Vec::new();
        for n in &self.cluster.nodes {
            let node = &n.node.name;
            for pod in std::fs::read_dir(n.node.dir.join("log/pods")).into_iter().flatten().flatten() {
                let pod_name = pod.file_name().to_string_lossy().split('_').nth(1).unwrap_or("?").to_string();
                for c in std::fs::read_dir(pod.path()).into_iter().flatten().flatten() {
                    let container = c.file_name().to_string_lossy().into_owned();
                    for f in std::fs::read_dir(c.path()).into_iter().flatten().flatten() {
                        for l in std::fs::read_to_string(f.path()).unwrap_or_default().lines() {
                            // CRI log lines start with an RFC 3339 time (UTC here).
                            if l.get(..23).is_some_and(|t| t >= from.as_str()) {
                                lines.push(format!(
                                    "{} {node} {pod_name}/{container} {}",
                                    &l[..30.min(l.len())],
                                    l.get(31..).unwrap_or("")
                                ));
                            }
                        }
                    }
                }
            }
            let kubelet = std::fs::read_to_string(n.node.dir.join("kubelet/kubelet.log")).unwrap_or_default();
            for l in kubelet.lines() {
                if let Some((ms, rest)) = l.split_once(' ')
                    && let Ok(ms) = ms.parse::<u128>()
                    && ms >= since
                {
                    let at = humantime_rfc3339(std::time::UNIX_EPOCH + Duration::from_millis(ms as u64));
                    lines.push(format!("{at} {node} kubelet {rest}"));
                }
            }
        }
        lines.sort();
        // Each node's network as it is now, and where the kubelets put each pod.
        for n in &self.cluster.nodes {
            let script = "ip -br addr; ip route; ip neigh; bridge link; ls /var/lib/cni/networks/*/; \
                          for ns in $(ip netns list | cut -d' ' -f1); do echo \"netns $ns: $(ip -n $ns -br addr | tr '\n' ' ')\"; done";
            let out = n.node.run("sh", &["-c", script]).unwrap_or_else(|e| e.to_string());
            lines.push(format!("=== {} now:\n{out}", n.node.name));
        }
        for w in &self.workloads {
            let view = self.cluster.pod_view(&w.namespace, &w.name);
            lines.push(format!(
                "=== {} on node-{}: address {:?}, sandbox {:?}",
                w.name,
                w.node,
                w.ip,
                view.map(|v| (v.sandbox, v.ip, v.sandbox_calls))
            ));
        }
        let written = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, lines.join("\n")));
        match written {
            Ok(()) => path.display().to_string(),
            Err(e) => format!("not written to {}: {e}", path.display()),
        }
    }

    /// What Weir put on each node that nothing needs any more: a pod capture whose
    /// pod's namespace is gone, a capture that is not live, a retired program set no pod
    /// is registered with, a program set on bpffs that no capture uses.
    pub fn leftovers(&self) -> Vec<String> {
        let mut found = Vec::new();
        for n in &self.cluster.nodes {
            let node = &n.node;
            let out = node
                .command(&crate::tools::weir().display().to_string())
                .args(["capture", "status", "--json"])
                .output();
            let records: Vec<serde_json::Value> = match out {
                Ok(o) => match serde_json::from_slice(&o.stdout) {
                    Ok(v) => v,
                    Err(e) => {
                        found.push(format!(
                            "{}: weir capture status gave no JSON ({e}): {}",
                            node.name,
                            String::from_utf8_lossy(&o.stderr)
                        ));
                        continue;
                    }
                },
                Err(e) => {
                    found.push(format!("{}: weir capture status: {e}", node.name));
                    continue;
                }
            };
            let mut sets_in_use = BTreeSet::new();
            for r in &records {
                let pod = r["pod"].as_str().unwrap_or_default();
                if r["live"] != true {
                    found.push(format!("{}: capture {pod} is not live: {}", node.name, r["faults"]));
                }
                if let Some(set) = r["program_set"].as_str() {
                    sets_in_use.insert(set.to_string());
                }
                let pod_capture = r["netns_cookie"].as_u64().unwrap_or(0) != 0;
                if pod_capture {
                    let netns = r["netns"].as_str().unwrap_or_default();
                    // /var/run is a link to /run: through /proc/<pid>/root it would
                    // resolve in this process's root, not the node's.
                    let on_node = match netns.strip_prefix("/var/run/") {
                        Some(rest) => format!("/run/{rest}"),
                        None => netns.to_string(),
                    };
                    if netns.is_empty() || !node.host_path(&on_node).exists() {
                        found.push(format!(
                            "{}: capture {pod} of a pod whose namespace {netns:?} is gone",
                            node.name
                        ));
                    }
                } else if pod.contains("-set-") && r["registered_pods"].as_u64() == Some(0) {
                    found.push(format!("{}: retired capture {pod} with no pod registered", node.name));
                }
            }
            let sets = node.host_path("/sys/fs/bpf/weir/programs");
            for e in std::fs::read_dir(&sets).into_iter().flatten().flatten() {
                let key = e.file_name().to_string_lossy().into_owned();
                if !sets_in_use.contains(&key) {
                    found.push(format!("{}: program set {key} pinned with no capture using it", node.name));
                }
            }
        }
        found
    }

    /// Checks that `client` → `server` crossed the nodes as HBONE: the server's node's
    /// ztunnel logged taking it in on 15008 from the client's workload, for the
    /// server's port.
    pub fn assert_hbone(&self, client: &str, server: &str) -> anyhow::Result<()> {
        let s = self.workload(server)?;
        let addr = s.addr().context("the server's address")?;
        let log = self.cluster.container_log("istio-system", &format!("ztunnel-{}", s.node), "istio-proxy");
        let (from, to) = (format!("src.workload=\"{client}\""), format!("dst.hbone_addr={addr}"));
        if !log.iter().any(|l| l.contains(&from) && l.contains(&to) && l.contains("direction=\"inbound\"")) {
            bail!(
                "no HBONE connection from {client} to {server} in ztunnel-{}'s log: {:?}",
                s.node,
                log.iter().rev().take(10).collect::<Vec<_>>()
            );
        }
        Ok(())
    }

    /// The workload named `name`.
    pub fn workload(&self, name: &str) -> anyhow::Result<&Workload> {
        self.workloads.iter().find(|w| w.name == name).with_context(|| format!("no workload {name}"))
    }
}

/// `t` as RFC 3339 UTC with milliseconds (`2026-11-28T23:53:40.940`), as CRI log lines
/// begin.
fn humantime_rfc3339(t: std::time::SystemTime) -> String {
    let ms = t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
    let (secs, ms) = ((ms / 1000) as i64, ms % 1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    #[test]
    fn times_read_as_cri_log_lines_begin() {
        let at =
            |ms: u64| super::humantime_rfc3339(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms));
        assert_eq!(at(1_795_912_846_812), "2026-11-29T00:40:46.812");
        assert_eq!(at(0), "1970-01-01T00:00:00.000");
        assert_eq!(at(951_782_400_000), "2000-02-29T00:00:00.000");
    }
}
