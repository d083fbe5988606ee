//! The events of the node rig, each something a platform team does to a node or that
//! happens to one, made the way it happens on a node (the DaemonSet controller's
//! rolling update, a runtime restart, a crash, a reboot, a deletion, a burst of pods),
//! under the scene's traffic. Each returns the window mark and what it touched for
//! [`Scene::judge`].

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{Call, READY, Scene, Touched};
use crate::{
    busynode::now_ms,
    cluster::workloads::{Capture, Kind, Sidecar, ready},
};

/// How long the node agent's pod is held back after a reboot while the node's other
/// pods start: long enough for every sandbox's CNI ADD to have been tried and retried.
const HELD_AFTER_REBOOT: Duration = Duration::from_secs(20);

impl Scene {
    /// The DaemonSet's pod on `node` replaced by one running `image`, as its
    /// RollingUpdate (maxUnavailable 1) does it: the old pod deleted with the manifest's
    /// grace period and gone, then the new one created and Ready; its node capture then
    /// runs the image's program set.
    pub fn roll_node(&mut self, node: u8, image: &str) -> anyhow::Result<()> {
        let name = format!("weir-cni-node-{node}");
        let pod = self.cluster.daemonset_pod(node, image)?;
        let grace = pod["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
        self.cluster.delete_pod("kube-system", &name, Duration::from_secs(grace));
        self.cluster.wait_gone("kube-system", &name, Duration::from_secs(grace + 30))?;
        self.cluster.create_pod(pod, node);
        self.cluster.wait_pod("kube-system", &name, READY, "Ready", ready)?;
        self.daemonset.insert(node, image.to_string());
        // Ready says the containers run (the DaemonSet has no readiness probe yet); the
        // install container attaches the node capture a moment later.
        let want = set_key_prefix(image);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let sets = self.node_capture_sets(node)?;
            if sets.iter().any(|s| s.starts_with(&want) && s[want.len()..].len() == 12) {
                return Ok(());
            }
            if Instant::now() > deadline {
                let install = self.cluster.container_log("kube-system", &name, "install");
                bail!(
                    "node-{node}: the node capture runs {sets:?} 60 s after the roll to {image}, not a {want}… set; install says: {:?}",
                    install.iter().rev().take(15).rev().collect::<Vec<_>>()
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Istio's chart rolled on `node` away from Weir's image and back, as its
    /// RollingUpdate (maxUnavailable 1) does it: Weir's pod deleted with the chart's
    /// grace period and gone (the DaemonSet stays, so Weir leaves the node for the next
    /// agent); Istio's node agent on the node for `gap` (played by the test:
    /// [`IstioNodeAgent`], its side of ztunnel's socket, snapshotting the pods it adopted
    /// from Weir), then stopping as it stops, leaving its installer's chain entry; then
    /// Weir's pod created again and Ready: it adopts the node from Istio. Throughout,
    /// ztunnel's own state is sampled: every pod it held before the swap must stay `Up`
    /// in every sample (ztunnel never without a pod it had), and every ambient pod of the
    /// scene on the node must be among them. Returns the number of samples.
    ///
    /// [`IstioNodeAgent`]: crate::cluster::istio_agent::IstioNodeAgent
    pub fn swap_chart_node(&mut self, node: u8, gap: Duration) -> anyhow::Result<usize> {
        use crate::cluster::{chart, istio_agent::IstioNodeAgent, ztunnel_state};
        let super::NodeAgent::IstioChart(profile) = self.agent else {
            bail!("the scene runs Weir's own DaemonSet, not Istio's chart")
        };
        let name = chart::pod_name(node);
        let image = self.daemonset.get(&node).cloned().unwrap_or_else(|| super::DEV_IMAGE.to_string());
        let pod = self.cluster.istio_cni_pod(node, &image, profile)?;
        let grace = pod["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
        let ztunnel = ztunnel_state::ztunnel_pid(&self.cluster, node)?;
        let had = self.ztunnel_holds_the_nodes_ambient_pods(node, ztunnel)?;
        let watch = ztunnel_state::Watch::start(ztunnel, Duration::from_millis(200));

        self.cluster.delete_pod(chart::NAMESPACE, &name, Duration::from_secs(grace));
        self.cluster.wait_gone(chart::NAMESPACE, &name, Duration::from_secs(grace + 30))?;
        let socket = self.cluster.node(node).folder("/run/ztunnel/ztunnel.sock");
        let istio = IstioNodeAgent::start(&socket, self.istio_agents_cache(&had)?)?;
        istio
            .wait_snapshot(Duration::from_secs(30))
            .with_context(|| format!("node-{node}: Istio's agent"))?;
        std::thread::sleep(gap);
        let conflist = self.cluster.node(node).folder("/etc/cni/net.d/10-primary.conflist");
        chart::put_chain_entry(&conflist, chart::istio_installer_entry(profile)?)?;
        let told = istio.log();
        istio.stop();

        self.cluster.create_pod(pod, node);
        self.cluster.wait_pod(chart::NAMESPACE, &name, READY, "Ready", ready)?;
        std::thread::sleep(Duration::from_secs(3));
        let samples =
            watch.finish(&had).with_context(|| format!("node-{node}: Istio's agent was told {told:?}"))?;
        self.progress.step(&format!(
            "node-{node}: ztunnel kept its {} pod(s) Up in {samples} samples through Weir → Istio's agent ({} snapshot entries acked) → Weir",
            had.len(),
            told.iter().filter(|l| l.starts_with("Add ") && l.ends_with(": ack")).count()
        ));
        Ok(samples)
    }

    /// The uids ztunnel on `node` holds `Up`, checked to include every ambient pod of
    /// the scene on that node.
    fn ztunnel_holds_the_nodes_ambient_pods(
        &self,
        node: u8,
        ztunnel: u32,
    ) -> anyhow::Result<BTreeSet<String>> {
        let state = crate::cluster::ztunnel_state::read(ztunnel)?;
        let had: BTreeSet<String> =
            state.iter().filter(|(_, s)| *s == "Up").map(|(u, _)| u.clone()).collect();
        for w in self.workloads.iter().filter(|w| w.kind == Kind::Ambient && w.node == node) {
            let uid = self.uid_of(&w.namespace, &w.name)?;
            if !had.contains(&uid) {
                bail!(
                    "node-{node}: ztunnel does not hold {}/{} ({uid}) before the swap: {state:?}",
                    w.namespace,
                    w.name
                );
            }
        }
        Ok(had)
    }

    fn uid_of(&self, namespace: &str, name: &str) -> anyhow::Result<String> {
        let pod =
            self.cluster.api.pod(namespace, name).with_context(|| format!("no pod {namespace}/{name}"))?;
        pod["metadata"]["uid"]
            .as_str()
            .map(String::from)
            .with_context(|| format!("{namespace}/{name} has no uid"))
    }

    /// What Istio's agent's pod cache holds after adopting the node: each pod ztunnel
    /// holds, with its netns (opened through one of its containers' processes).
    fn istio_agents_cache(
        &self,
        uids: &BTreeSet<String>,
    ) -> anyhow::Result<Vec<crate::cluster::istio_agent::CachedPod>> {
        let mut cache = Vec::new();
        for pod in self.cluster.api.pods() {
            let Some(uid) = pod["metadata"]["uid"].as_str().filter(|u| uids.contains(*u)) else { continue };
            let (namespace, name) = (
                pod["metadata"]["namespace"].as_str().unwrap_or_default().to_string(),
                pod["metadata"]["name"].as_str().unwrap_or_default().to_string(),
            );
            let pid = self.cluster.container_pid(&namespace, &name, None)?;
            let netns = std::fs::File::open(format!("/proc/{pid}/ns/net"))
                .with_context(|| format!("{namespace}/{name}'s netns (pid {pid})"))?;
            let service_account = pod["spec"]["serviceAccountName"].as_str().unwrap_or("default").to_string();
            cache.push(crate::cluster::istio_agent::CachedPod {
                uid: uid.to_string(),
                name,
                namespace,
                service_account,
                netns: netns.into(),
            });
        }
        if cache.len() != uids.len() {
            bail!("Istio's agent's cache has {} of the {} pods ztunnel holds", cache.len(), uids.len());
        }
        Ok(cache)
    }

    /// The program sets the node's node capture records name (not retired ones).
    pub fn node_capture_sets(&self, node: u8) -> anyhow::Result<Vec<String>> {
        let n = self.cluster.node(node);
        let out = n
            .command(&crate::tools::weir().display().to_string())
            .args(["capture", "status", "--json"])
            .output()?;
        let records: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).with_context(|| {
            format!("weir capture status on {}: {}", n.name, String::from_utf8_lossy(&out.stderr))
        })?;
        Ok(records
            .iter()
            .filter(|r| r["netns_cookie"].as_u64() == Some(0))
            .filter(|r| !r["pod"].as_str().unwrap_or_default().contains("-set-"))
            .filter_map(|r| r["program_set"].as_str().map(String::from))
            .collect())
    }

    /// containerd on `node` stopped (SIGTERM) and started again; its containers keep
    /// running (their shims are their own processes) and the kubelet goes on.
    pub fn restart_containerd(&mut self, node: u8) -> anyhow::Result<()> {
        let n = &mut self.cluster.nodes[usize::from(node - 1)].node;
        n.containerd.restart().with_context(|| format!("restart containerd on node-{node}"))
    }

    /// Every container of the node agent's pod on `node` killed (SIGKILL, as a crash or
    /// the OOM killer would); its kubelet starts them again by `restartPolicy`.
    pub fn kill_agent(&mut self, node: u8) -> anyhow::Result<()> {
        let name = format!("weir-cni-node-{node}");
        let view = self.cluster.pod_view("kube-system", &name).context("the agent's pod")?;
        let n = self.cluster.node(node);
        let before: u32 = view.containers.iter().map(|c| c.restarts).sum();
        for c in view.containers.iter().filter(|c| !c.id.is_empty() && c.exited.is_none()) {
            let out = n.containerd.ctr().args(["tasks", "kill", "--signal", "SIGKILL", &c.id]).output()?;
            if !out.status.success() {
                bail!("kill {} of {name}: {}", c.name, String::from_utf8_lossy(&out.stderr));
            }
        }
        let restarted = crate::control_plane::eventually(READY, || {
            let v = self.cluster.pod_view("kube-system", &name)?;
            (v.containers.iter().map(|c| c.restarts).sum::<u32>() > before && v.ready()).then_some(())
        });
        restarted.with_context(|| format!("{name}: not restarted and Ready within {READY:?}"))
    }

    /// A reboot of `node`: its kubelet stopped, every container and sandbox of the node
    /// killed, its /run folders, bpffs and network state cleared, containerd started
    /// with no state, the kubelet started again; it recreates the node's pods. The node
    /// agent's pod is held back for [`HELD_AFTER_REBOOT`] (so every other pod's sandbox
    /// comes first, as it may on a node: istio/istio#60882): meanwhile no meshed pod
    /// whose capture the agent makes may run its app, and its sandbox must have been
    /// refused by the plugin, which stays chained on the node. Returns what the
    /// workloads' kubelet reported while held, for the record.
    pub fn reboot(&mut self, node: u8) -> anyhow::Result<()> {
        let agent = format!("kube-system/weir-cni-node-{node}");
        self.cluster.held.lock().unwrap_or_else(|p| p.into_inner()).insert(agent.clone());
        let i = usize::from(node - 1);
        self.cluster.nodes[i].kubelet = None;
        let rebooted = self.cluster.nodes[i].node.reboot();
        let started = rebooted.and_then(|()| self.cluster.start_kubelet(i));
        let checked = started.and_then(|()| self.uncaptured_while_held(node));
        self.cluster.held.lock().unwrap_or_else(|p| p.into_inner()).remove(&agent);
        checked
    }

    /// While the agent is held: the node's pods whose capture needs the agent (CNI
    /// sidecars, ambient) never run a container past their sandbox, and the runtime
    /// reports the plugin's refusal; the node's plain pods are refused too (the
    /// plugin's kubeconfig is the agent's to write again). All start once it runs.
    fn uncaptured_while_held(&self, node: u8) -> anyhow::Result<()> {
        let needs_agent: Vec<&str> = self
            .workloads
            .iter()
            .filter(|w| w.node == node)
            .filter(|w| matches!(w.kind, Kind::Ambient | Kind::Sidecar(Capture::Cni, _)))
            .map(|w| w.name.as_str())
            .collect();
        let plain: Vec<&str> = self
            .workloads
            .iter()
            .filter(|w| w.node == node && w.kind == Kind::Plain)
            .map(|w| w.name.as_str())
            .collect();
        let until = Instant::now() + HELD_AFTER_REBOOT;
        let mut refused: BTreeSet<String> = BTreeSet::new();
        let mut plain_refused: BTreeSet<String> = BTreeSet::new();
        while Instant::now() < until {
            for name in &plain {
                let Some(view) = self.cluster.pod_view("default", name) else { continue };
                if view.waiting.as_deref().is_some_and(|w| w.contains("weir-cni") && w.contains("kubeconfig"))
                {
                    plain_refused.insert(name.to_string());
                }
            }
            for name in &needs_agent {
                let Some(view) = self.cluster.pod_view("default", name) else { continue };
                if let Some(c) = view.containers.iter().find(|c| !c.id.is_empty()) {
                    bail!(
                        "node-{node} rebooted, its agent not started: {name}'s container {} started (sandbox {}): an uncaptured app",
                        c.name,
                        view.sandbox
                    );
                }
                if view.waiting.as_deref().is_some_and(|w| w.contains("weir")) {
                    refused.insert(name.to_string());
                }
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let not_refused: Vec<&&str> = needs_agent.iter().filter(|n| !refused.contains(**n)).collect();
        if !not_refused.is_empty() {
            bail!(
                "node-{node}: no refusal by Weir's plugin was reported for {not_refused:?} while its agent was held"
            );
        }
        // A plain pod: the plugin cannot tell it from a meshed one without its
        // kubeconfig, which the agent writes under /var/run/istio-cni (cleared by the
        // reboot, as Istio's is): refused too, naming it, until the agent runs.
        let plain_not_refused: Vec<&&str> = plain.iter().filter(|n| !plain_refused.contains(**n)).collect();
        if !plain_not_refused.is_empty() {
            bail!(
                "node-{node}: no refusal naming the plugin's kubeconfig was reported for the plain pods {plain_not_refused:?} while the agent was held"
            );
        }
        self.progress.step(&format!(
            "node-{node}: for {HELD_AFTER_REBOOT:?} without its agent, {} pods needing capture refused by the plugin, none ran; {} plain pods refused until its kubeconfig is back",
            needs_agent.len(),
            plain.len()
        ));
        Ok(())
    }

    /// Deletes workload `name` while its connections are open, as endpoints and the
    /// kubelet do it: a request of `via` that takes 2 s (`/slow`) in flight to it, then
    /// the pod deleted (its grace period) and taken out of every client's targets at
    /// once. Its own client goes on for its drain time after SIGTERM, through its
    /// proxy. Every request of and to it must be answered: the drain happens through
    /// its proxy. Returns the deletion's time (ms).
    pub fn delete_draining(&mut self, name: &str, via: &str) -> anyhow::Result<u128> {
        let server = self.workload(name)?.clone();
        self.calls.push(Call { client: via.into(), server: name.into(), path: "/slow".into() });
        self.sync()?;
        let mark = now_ms();
        let in_flight = crate::control_plane::eventually(Duration::from_secs(30), || {
            self.cluster
                .container_log("default", name, &server.app)
                .iter()
                .any(|l| {
                    l.split_once(' ').is_some_and(|(ms, rest)| {
                        ms.parse::<u128>().is_ok_and(|ms| ms >= mark)
                            && rest.starts_with("request ")
                            && rest.contains(&format!("client={via} "))
                            && rest.contains("path=/slow")
                    })
                })
                .then_some(())
        });
        in_flight.with_context(|| format!("no /slow request of {via} reached {name}"))?;
        let deleted = now_ms();
        self.cluster.delete_pod("default", name, Duration::from_secs(30));
        self.workloads.retain(|w| w.name != name);
        self.gone.push(server);
        self.calls.retain(|c| c.server != name);
        // The endpoints controller takes the pod out of its Service; no client asks for
        // it any more. (The rig's services are one per server: the pod's goes once it
        // is gone, as a Service emptied of its last endpoint would be.)
        self.sync_targets()?;
        // The slow request in flight at the deletion is answered after it: its outcome,
        // the client's next line about it.
        let outcome = crate::control_plane::eventually(Duration::from_secs(20), || {
            self.cluster.container_log("default", via, "client").into_iter().find(|l| {
                l.split_once(' ').is_some_and(|(ms, rest)| {
                    ms.parse::<u128>().is_ok_and(|ms| ms > deleted) && rest.contains("/slow ")
                })
            })
        });
        self.cluster.wait_gone("default", name, Duration::from_secs(60))?;
        self.sync()?;
        match outcome {
            Some(line) if line.split_once(' ').is_some_and(|(_, rest)| rest.starts_with("ok ")) => {}
            Some(line) => bail!("{via}'s /slow request in flight to {name} when it was deleted: {line}"),
            None => {
                bail!("{via}'s /slow request in flight to {name} when it was deleted: no outcome within 20 s")
            }
        }
        // Its own client went on after SIGTERM, through its proxy.
        let client = self.cluster.container_log("default", name, "client");
        let terminating = client
            .iter()
            .filter_map(|l| l.split_once(' '))
            .find(|(ms, rest)| {
                rest.starts_with("terminating") && ms.parse::<u128>().is_ok_and(|ms| ms >= deleted)
            })
            .and_then(|(ms, _)| ms.parse::<u128>().ok())
            .with_context(|| format!("{name}'s client logged no SIGTERM"))?;
        let after: Vec<&str> = client
            .iter()
            .filter_map(|l| l.split_once(' '))
            .filter(|(ms, _)| ms.parse::<u128>().is_ok_and(|ms| ms > terminating))
            .map(|(_, rest)| rest)
            .filter(|rest| rest.starts_with("ok ") || rest.starts_with("fail "))
            .collect();
        if !after.iter().any(|l| l.starts_with("ok ")) || after.iter().any(|l| l.starts_with("fail ")) {
            bail!("{name}'s requests while it drained: {after:?}");
        }
        self.progress.step(&format!(
            "{name} deleted: {via}'s request in flight answered, {} requests of its own answered while it drained",
            after.len()
        ));
        Ok(deleted)
    }

    /// `count` pods created at once on `node` (the kubelet runs their sandboxes in
    /// parallel): two in three ambient, the rest CNI-captured native sidecars, each
    /// calling a standing pod of its kind on another node. Returns their names once
    /// all are Ready and synced.
    pub fn start_many(&mut self, node: u8, count: usize) -> anyhow::Result<Vec<String>> {
        let mut names = Vec::new();
        for k in 0..count {
            let (name, kind, target) = if k % 3 == 2 {
                (format!("burst-s{k:02}"), Kind::Sidecar(Capture::Cni, Sidecar::Native), "s1")
            } else {
                (format!("burst-a{k:02}"), Kind::Ambient, "a1")
            };
            self.calls.push(Call { client: name.clone(), server: target.into(), path: "/".into() });
            let w = self.start(&name, node, kind)?;
            self.workloads.push(w);
            names.push(name);
        }
        self.wait_all_ready()?;
        self.sync()?;
        Ok(names)
    }

    /// Deletes workloads `names` at once; waits until they are gone.
    pub fn delete_all(&mut self, names: &[String]) -> anyhow::Result<()> {
        for name in names {
            self.cluster.delete_pod("default", name, Duration::from_secs(30));
        }
        let (gone, stay): (Vec<_>, Vec<_>) = self.workloads.drain(..).partition(|w| names.contains(&w.name));
        self.workloads = stay;
        self.gone.extend(gone);
        self.calls.retain(|c| !names.contains(&c.client) && !names.contains(&c.server));
        self.sync()?;
        for name in names {
            self.cluster.wait_gone("default", name, Duration::from_secs(90))?;
        }
        Ok(())
    }

    /// The pods on `node` (for [`Touched`]).
    pub fn pods_on(&self, node: u8) -> Touched {
        Touched::pods(self.workloads.iter().filter(|w| w.node == node).map(|w| w.name.as_str()))
    }
}

/// The start of the program set key a weir-cni image's build has (`version_key`: the
/// version with dots as underscores, a dash, then 12 hex digits).
fn set_key_prefix(image: &str) -> String {
    let version = weir_agent::support::build_info::BUILD_INFO.version.replace('.', "_");
    if image == super::NEXT_IMAGE { format!("{version}-next-") } else { format!("{version}-") }
}
