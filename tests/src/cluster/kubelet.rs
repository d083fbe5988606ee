//! The kubelet stand-in: one per node, it runs the API stand-in's pods bound to its
//! node as kubelet does, through CRI only. Per pod: the sandbox (retried while the CNI
//! chain refuses it, as kubelet retries), its IP written to the pod's status, the
//! volumes laid out (`inject::volumes`: emptyDir, ConfigMap, Secret, projected token
//! and `ca.crt`, downward API; hostPath checked or made on the node as its `type`
//! says), init containers in order (a native sidecar, `restartPolicy: Always`, started
//! and past its startup probe before the next), then the containers; startup,
//! readiness and liveness probes (HTTP, TCP, gRPC from the node's network namespace,
//! exec through CRI) with the results in the pod's status; restarts by
//! `restartPolicy` with a back-off; and deletion with the grace period (preStop, then
//! SIGTERM, SIGKILL after the grace; native sidecars after the app containers, in
//! reverse order), then the sandbox stopped and removed and the pod deleted.

pub mod spec;

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use weir_proto::cri::ContainerState;

use self::spec::{NodeFacts, VolumeMountOnNode};
use crate::{
    cri::Cri,
    inject::{
        env::PodStatus,
        manifest::{Container, Manifest, Probe},
        volumes::{PodVolumes, VolumeSources},
    },
    kube_api::KubeApi,
};

/// What pods of any namespace may read, besides their own spec: ConfigMaps and Secrets
/// by namespace and name, and the token every service account gets (the API stand-in
/// checks one).
/// Objects by namespace and name, each its keys and values.
pub type Store = Mutex<BTreeMap<(String, String), BTreeMap<String, String>>>;

#[derive(Default)]
pub struct Objects {
    pub config_maps: Store,
    pub secrets: Store,
    pub token: Mutex<String>,
}

impl Objects {
    fn sources(&self, namespace: &str) -> VolumeSources {
        let pick = |m: &Store| {
            m.lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .filter(|((ns, _), _)| ns == namespace || ns == "*")
                .map(|((_, name), data)| (name.clone(), data.clone()))
                .collect()
        };
        VolumeSources {
            config_maps: pick(&self.config_maps),
            secrets: pick(&self.secrets),
            token: self.token.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            csi: BTreeMap::new(),
        }
    }
}

/// The node as the kubelet reaches it.
#[derive(Clone)]
pub struct NodeAccess {
    pub facts: NodeFacts,
    pub ip: IpAddr,
    /// `/proc/<holder>/root`: the node's paths from the machine.
    pub root: PathBuf,
    /// The node's mount namespace (tmpfs volumes are mounted there).
    pub mount_ns: PathBuf,
    /// The node's network namespace (probes come from it).
    pub netns: PathBuf,
    /// Where pods' folders go on the machine.
    pub pods_dir: PathBuf,
    /// Environment every container gets (the `kubernetes` Service's variables).
    pub service_env: Vec<(String, String)>,
}

/// One container as the kubelet runs it.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ContainerView {
    pub name: String,
    pub id: String,
    pub init: bool,
    pub sidecar: bool,
    pub restarts: u32,
    pub started: bool,
    pub ready: bool,
    pub exited: Option<i32>,
}

/// A pod as the kubelet runs it (for tests and the status it writes).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PodView {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub sandbox: String,
    pub ip: Option<IpAddr>,
    pub phase: String,
    pub containers: Vec<ContainerView>,
    /// Why the sandbox or a container could not start (last error).
    pub waiting: Option<String>,
    /// How long RunPodSandbox took until the runtime returned a sandbox, ms (from the
    /// first call: refused calls and the pauses between them included), and how many
    /// calls that was.
    pub sandbox_ms: Option<f64>,
    pub sandbox_calls: u32,
}

impl PodView {
    pub fn ready(&self) -> bool {
        self.phase == "Running" && self.containers.iter().filter(|c| !c.init || c.sidecar).all(|c| c.ready)
    }
}

/// Pods (`namespace/name`) a kubelet does not start yet: a test holds one back to
/// make the order kubelet may happen to take (an app pod's sandbox before the node
/// agent's pod) the order it does take.
pub type Held = Arc<Mutex<std::collections::BTreeSet<String>>>;

struct Shared {
    node: NodeAccess,
    api: Arc<KubeApi>,
    objects: Arc<Objects>,
    held: Held,
    pods: Mutex<BTreeMap<String, PodView>>,
}

/// A running kubelet stand-in; dropping it stops it (its pods keep running).
pub struct Kubelet {
    shared: Arc<Shared>,
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Kubelet {
    /// Starts the kubelet of `node`, talking to the runtime at `socket`.
    pub fn start(
        node: NodeAccess,
        socket: &Path,
        api: Arc<KubeApi>,
        objects: Arc<Objects>,
        held: Held,
    ) -> anyhow::Result<Self> {
        let shared = Arc::new(Shared { node, api, objects, held, pods: Mutex::default() });
        let stop = CancellationToken::new();
        let (s, st, socket) = (shared.clone(), stop.clone(), socket.to_path_buf());
        let netns = shared.node.netns.clone();
        let thread = std::thread::Builder::new().name(format!("kubelet-{}", shared.node.facts.name)).spawn(
            move || {
                // Every thread of this kubelet is in the node's network namespace: its
                // probes come from the node, as kubelet's do.
                let enter = move || {
                    if let Ok(f) = std::fs::File::open(&netns) {
                        let _ = nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET);
                    }
                };
                enter();
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .on_thread_start(enter)
                    .enable_all()
                    .build()
                    .expect("kubelet runtime");
                runtime.block_on(async move {
                    let cri = match Cri::connect(&socket).await {
                        Ok(c) => c,
                        Err(e) => return s.log(&format!("no runtime: {e:#}")),
                    };
                    sync_loop(s, cri, st).await;
                });
                runtime.shutdown_timeout(Duration::from_secs(5));
            },
        )?;
        Ok(Self { shared, stop, thread: Some(thread) })
    }

    /// The pods this kubelet runs, as it sees them.
    pub fn pods(&self) -> Vec<PodView> {
        self.shared.pods.lock().unwrap_or_else(|p| p.into_inner()).values().cloned().collect()
    }

    /// Pod `namespace/name`, as this kubelet sees it.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<PodView> {
        self.pods().into_iter().find(|p| p.namespace == namespace && p.name == name)
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Every 300 ms: a worker for each pod bound to this node that has none (unless held);
/// every 5 s, the sandboxes no worker owns that are no longer ready (left by a reboot or
/// a runtime restart) stopped and removed, as kubelet's garbage collection does: the
/// runtime then runs their CNI DEL.
async fn sync_loop(shared: Arc<Shared>, cri: Cri, stop: CancellationToken) {
    let mut workers: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
    let mut ended: HashMap<String, Instant> = HashMap::new();
    let mut collected: Option<Instant> = None;
    loop {
        if collected.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
            collected = Some(Instant::now());
            collect_sandboxes(&shared, &cri).await;
        }
        for (uid, w) in &workers {
            if w.is_finished() {
                ended.insert(uid.clone(), Instant::now());
            }
        }
        workers.retain(|_, w| !w.is_finished());
        // A pod whose worker failed is started again after a pause, as kubelet's
        // back-off does.
        ended.retain(|_, at| at.elapsed() < Duration::from_secs(3));
        for pod in shared.api.pods() {
            if pod["spec"]["nodeName"].as_str() != Some(shared.node.facts.name.as_str()) {
                continue;
            }
            let uid = pod["metadata"]["uid"].as_str().unwrap_or_default().to_string();
            let key = format!(
                "{}/{}",
                pod["metadata"]["namespace"].as_str().unwrap_or("default"),
                pod["metadata"]["name"].as_str().unwrap_or_default()
            );
            if shared.held.lock().unwrap_or_else(|p| p.into_inner()).contains(&key) {
                continue;
            }
            if uid.is_empty()
                || workers.contains_key(&uid)
                || ended.contains_key(&uid)
                || pod["status"]["phase"] == "Succeeded"
            {
                continue;
            }
            let (s, c, st) = (shared.clone(), cri.clone(), stop.clone());
            let (ns, name) = (
                pod["metadata"]["namespace"].as_str().unwrap_or("default").to_string(),
                pod["metadata"]["name"].as_str().unwrap_or_default().to_string(),
            );
            let new = {
                let mut pods = shared.pods.lock().unwrap_or_else(|p| p.into_inner());
                let new = !pods.contains_key(&uid);
                pods.entry(uid.clone()).or_insert_with(|| PodView {
                    namespace: ns.clone(),
                    name: name.clone(),
                    uid: uid.clone(),
                    phase: "Pending".into(),
                    ..Default::default()
                });
                new
            };
            // A pod this kubelet has not run yet (a new one, or every pod after the
            // node's reboot): its status says so before anything runs, never what a
            // sandbox before the reboot had.
            if new {
                shared.write_status(&uid);
            }
            workers.insert(
                uid.clone(),
                tokio::spawn(async move {
                    if let Err(e) = run_pod(&s, &c, &ns, &name, &uid, &st).await {
                        s.log(&format!("{ns}/{name}: pod worker ended: {e:#}"));
                        s.view(&uid, |v| v.waiting = Some(format!("{e:#}")));
                    }
                }),
            );
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(Duration::from_millis(300)) => {}
        }
    }
    for (_, w) in workers {
        w.abort();
    }
}

/// Stops and removes each sandbox that is not ready and that no pod's worker runs.
async fn collect_sandboxes(shared: &Shared, cri: &Cri) {
    let Ok(sandboxes) = cri.list_pod_sandbox().await else { return };
    let owned: std::collections::BTreeSet<String> =
        shared.pods.lock().unwrap_or_else(|p| p.into_inner()).values().map(|v| v.sandbox.clone()).collect();
    for s in sandboxes {
        if s.state == weir_proto::cri::PodSandboxState::SandboxReady as i32 || owned.contains(&s.id) {
            continue;
        }
        let name = s.metadata.as_ref().map(|m| format!("{}/{}", m.namespace, m.name)).unwrap_or_default();
        let stopped = cri.stop_pod_sandbox(&s.id).await;
        let removed = cri.remove_pod_sandbox(&s.id).await;
        shared.log(&format!("collected sandbox {} of {name}: stop {stopped:?}, remove {removed:?}", s.id));
    }
}

impl Shared {
    /// A line in the node's kubelet.log.
    fn log(&self, line: &str) {
        use std::io::Write as _;
        if let Ok(mut f) =
            std::fs::OpenOptions::new().create(true).append(true).open(self.node.pods_dir.join("kubelet.log"))
        {
            let _ = writeln!(f, "{} {line}", crate::busynode::now_ms());
        }
    }

    fn view(&self, uid: &str, f: impl FnOnce(&mut PodView)) {
        let mut pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = pods.get_mut(uid) {
            f(v);
        }
    }

    /// Writes the pod's status from its view (kubelet's status manager).
    fn write_status(&self, uid: &str) {
        let Some(v) = self.pods.lock().unwrap_or_else(|p| p.into_inner()).get(uid).cloned() else { return };
        let status = |c: &ContainerView| {
            let state = match (c.exited, c.started || !c.id.is_empty()) {
                (Some(code), _) => json!({"terminated": {"exitCode": code}}),
                (None, true) => json!({"running": {}}),
                (None, false) => json!({"waiting": {"reason": "ContainerCreating"}}),
            };
            json!({"name": c.name, "ready": c.ready, "started": c.started, "restartCount": c.restarts, "containerID": format!("containerd://{}", c.id), "state": state})
        };
        let ready = v.ready();
        let condition =
            |kind: &str, ok: bool| json!({"type": kind, "status": if ok { "True" } else { "False" }});
        let initialized = v.containers.iter().filter(|c| c.init && !c.sidecar).all(|c| c.exited == Some(0))
            && v.containers.iter().filter(|c| c.sidecar).all(|c| c.started);
        let host_ip = self.node.ip.to_string();
        self.api.try_update_pod(&v.namespace, &v.name, |pod| {
            let s = &mut pod["status"];
            s["phase"] = json!(v.phase);
            s["hostIP"] = json!(host_ip);
            if let Some(ip) = v.ip {
                s["podIP"] = json!(ip.to_string());
                s["podIPs"] = json!([{"ip": ip.to_string()}]);
            }
            s["initContainerStatuses"] =
                json!(v.containers.iter().filter(|c| c.init).map(status).collect::<Vec<_>>());
            s["containerStatuses"] =
                json!(v.containers.iter().filter(|c| !c.init).map(status).collect::<Vec<_>>());
            s["conditions"] = json!([
                condition("PodScheduled", true),
                condition("Initialized", initialized),
                condition("ContainersReady", ready),
                condition("Ready", ready),
            ]);
        });
    }
}

/// The pod's spec as the typed model reads it.
fn manifest(pod: &Value) -> anyhow::Result<Manifest> {
    let yaml = serde_yaml_ng::to_string(pod)?;
    Manifest::parse("api", &yaml)
}

/// Checks (or makes) a hostPath volume on the node as its `type` says.
fn host_path(node: &NodeAccess, path: &str, kind: &str) -> anyhow::Result<()> {
    let on_node = node.root.join(path.trim_start_matches('/'));
    let meta = std::fs::metadata(&on_node);
    use std::os::unix::fs::FileTypeExt as _;
    let ok = match kind {
        "" => true,
        "DirectoryOrCreate" => {
            if meta.is_err() {
                std::fs::create_dir_all(&on_node)?;
            }
            std::fs::metadata(&on_node).is_ok_and(|m| m.is_dir())
        }
        "FileOrCreate" => {
            if meta.is_err() {
                std::fs::File::create(&on_node)?;
            }
            std::fs::metadata(&on_node).is_ok_and(|m| m.is_file())
        }
        "Directory" => meta.as_ref().is_ok_and(|m| m.is_dir()),
        "File" => meta.as_ref().is_ok_and(|m| m.is_file()),
        "Socket" => meta.as_ref().is_ok_and(|m| m.file_type().is_socket()),
        "CharDevice" => meta.as_ref().is_ok_and(|m| m.file_type().is_char_device()),
        "BlockDevice" => meta.as_ref().is_ok_and(|m| m.file_type().is_block_device()),
        other => bail!("hostPath type {other:?} is not one Kubernetes has"),
    };
    if !ok {
        bail!("hostPath {path} is not a {kind} on the node");
    }
    Ok(())
}

/// A running pod's containers, its volumes and sandbox.
struct PodRun {
    m: Manifest,
    uid: String,
    sandbox: String,
    sandbox_config: weir_proto::cri::PodSandboxConfig,
    status: PodStatus,
    volumes: PodVolumes,
    hosts: Option<PathBuf>,
    /// Containers' ids, attempts and probe state, by name.
    containers: BTreeMap<String, Running>,
}

#[derive(Default)]
struct Running {
    id: String,
    attempt: u32,
    started_at: Option<Instant>,
    started: bool,
    ready: bool,
    exited: Option<i32>,
    backoff_until: Option<Instant>,
    probes: BTreeMap<&'static str, ProbeState>,
}

/// Where a running probe leaves its result: passed, or why it failed.
type ProbeSlot = Arc<Mutex<Option<Result<(), String>>>>;

#[derive(Default, Clone)]
struct ProbeState {
    last: Option<Instant>,
    successes: u64,
    failures: u64,
    running: Option<ProbeSlot>,
}

/// The life of one pod on this node.
async fn run_pod(
    shared: &Arc<Shared>,
    cri: &Cri,
    ns: &str,
    name: &str,
    uid: &str,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let pod = shared.api.pod(ns, name).context("the pod is gone")?;
    let m = manifest(&pod)?;
    let node = &shared.node;
    std::fs::create_dir_all(spec::log_directory(&node.facts, &m, uid)).or_else(|_| {
        std::fs::create_dir_all(
            node.root.join(spec::log_directory(&node.facts, &m, uid).trim_start_matches('/')),
        )
    })?;
    for v in &m.spec.volumes {
        if let Some(h) = &v.host_path {
            host_path(node, &h.path, &h.kind).with_context(|| format!("volume {}", v.name))?;
        }
    }
    // The sandbox: retried while the runtime (the CNI chain) refuses it.
    let sandbox_config = spec::sandbox(&node.facts, &m, uid, 0);
    let mut backoff = Duration::from_millis(500);
    let first_call = Instant::now();
    let sandbox = loop {
        if deleting(shared, ns, name) || stop.is_cancelled() {
            shared.api.delete_pod(ns, name);
            return Ok(());
        }
        shared.view(uid, |v| v.sandbox_calls += 1);
        match cri.run_pod_sandbox(sandbox_config.clone()).await {
            Ok(id) => {
                let ms = first_call.elapsed().as_secs_f64() * 1000.0;
                shared.view(uid, |v| v.sandbox_ms = Some(ms));
                break id;
            }
            Err(e) => {
                shared.view(uid, |v| v.waiting = Some(format!("{e:#}")));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    };
    match with_sandbox(shared, cri, ns, name, uid, stop, m, sandbox.clone(), sandbox_config).await {
        Ok(()) => Ok(()),
        Err(e) => {
            // Nothing half made stays: the next worker starts the pod anew.
            let _ = cri.stop_pod_sandbox(&sandbox).await;
            let _ = cri.remove_pod_sandbox(&sandbox).await;
            Err(e)
        }
    }
}

/// The rest of a pod's life once its sandbox runs.
#[allow(clippy::too_many_arguments, reason = "one pod's worker, split at its sandbox")]
async fn with_sandbox(
    shared: &Arc<Shared>,
    cri: &Cri,
    ns: &str,
    name: &str,
    uid: &str,
    stop: &CancellationToken,
    m: Manifest,
    sandbox: String,
    sandbox_config: weir_proto::cri::PodSandboxConfig,
) -> anyhow::Result<()> {
    let node = &shared.node;
    let status = cri.pod_sandbox_status(&sandbox).await?;
    let ip: IpAddr = if m.spec.host_network {
        node.ip
    } else {
        status
            .network
            .as_ref()
            .map(|n| n.ip.as_str())
            .unwrap_or_default()
            .parse()
            .context("the sandbox's IP")?
    };
    shared.view(uid, |v| {
        v.sandbox = sandbox.clone();
        v.ip = Some(ip);
        v.waiting = None;
    });
    shared.write_status(uid);
    let pod_status = PodStatus {
        pod_ips: vec![ip],
        host_ip: node.ip,
        node_name: node.facts.name.clone(),
        node_cpu: crate::inject::manifest::Scalar("2".into()),
        node_memory: crate::inject::manifest::Scalar("8Gi".into()),
    };
    let sources = shared.objects.sources(ns);
    let volumes = PodVolumes::create(&m, &pod_status, &sources).context("the pod's volumes")?;
    let hosts = (!m.spec.host_network).then(|| volumes.root().join("etc-hosts"));
    if let Some(path) = &hosts {
        let aliases: Vec<(IpAddr, String)> = m
            .spec
            .host_aliases
            .iter()
            .flat_map(|a| a.hostnames.iter().filter_map(|h| Some((a.ip.parse().ok()?, h.clone()))))
            .collect();
        let aliases: Vec<(IpAddr, &str)> = aliases.iter().map(|(ip, h)| (*ip, h.as_str())).collect();
        std::fs::write(path, crate::inject::volumes::hosts_file(ip, m.name(), &aliases))?;
    }
    for v in &m.spec.volumes {
        if let Some(options) = volumes.tmpfs_options(&v.name) {
            let dir = volumes.root().join("tmpfs").join(&v.name);
            std::fs::create_dir_all(&dir)?;
            let out = std::process::Command::new("nsenter")
                .arg(format!("--mount={}", node.mount_ns.display()))
                .args(["--", "mount", "-t", "tmpfs", "-o", options, "tmpfs"])
                .arg(&dir)
                .output()?;
            if !out.status.success() {
                bail!("mount the tmpfs of volume {}: {}", v.name, String::from_utf8_lossy(&out.stderr));
            }
        }
    }
    let mut run = PodRun {
        m,
        uid: uid.to_string(),
        sandbox,
        sandbox_config,
        status: pod_status,
        volumes,
        hosts,
        containers: BTreeMap::new(),
    };
    shared.view(uid, |v| {
        v.containers = run
            .m
            .spec
            .init_containers
            .iter()
            .map(|c| ContainerView {
                name: c.name.clone(),
                init: true,
                sidecar: c.is_sidecar(),
                ..Default::default()
            })
            .chain(
                run.m
                    .spec
                    .containers
                    .iter()
                    .map(|c| ContainerView { name: c.name.clone(), ..Default::default() }),
            )
            .collect();
    });
    let result = lifecycle(shared, cri, &mut run, stop).await;
    if result.is_err() && !deleting(shared, ns, name) && !stop.is_cancelled() {
        terminate(shared, cri, &mut run).await;
        return result;
    }
    if stop.is_cancelled() && !deleting(shared, ns, name) {
        // The kubelet stops (a restart, a reboot): containers stay as they are.
        return result;
    }
    terminate(shared, cri, &mut run).await;
    shared.pods.lock().unwrap_or_else(|p| p.into_inner()).remove(uid);
    shared.api.delete_pod(ns, name);
    result
}

/// Whether the pod was deleted (gone from the API, or given a deletion timestamp).
fn deleting(shared: &Shared, ns: &str, name: &str) -> bool {
    shared.api.pod(ns, name).is_none_or(|p| !p["metadata"]["deletionTimestamp"].is_null())
}

/// Init containers in order, then the containers; then probes and restarts until the
/// pod is deleted or the kubelet stops.
async fn lifecycle(
    shared: &Arc<Shared>,
    cri: &Cri,
    run: &mut PodRun,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let (ns, name) = (run.m.namespace().to_string(), run.m.name().to_string());
    let policy = run.m.spec.restart_policy.clone().unwrap_or_else(|| "Always".into());
    for c in run.m.spec.init_containers.clone() {
        let mut backoff = Duration::from_secs(1);
        loop {
            if deleting(shared, &ns, &name) || stop.is_cancelled() {
                return Ok(());
            }
            start_container(shared, cri, run, &c, true).await?;
            if c.is_sidecar() {
                // Started, and past its startup probe (if any), before the next one.
                wait_started(shared, cri, run, &c, stop).await?;
                break;
            }
            let code = wait_exit(cri, run, &c, stop).await?;
            if code == Some(0) {
                break;
            }
            if policy == "Never" {
                shared.view(&run.uid, |v| v.phase = "Failed".into());
                shared.write_status(&run.uid);
                bail!("init container {} failed ({code:?}) and the pod's restartPolicy is Never", c.name);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
    }
    for c in run.m.spec.containers.clone() {
        start_container(shared, cri, run, &c, false).await?;
    }
    shared.view(&run.uid, |v| v.phase = "Running".into());
    shared.write_status(&run.uid);
    loop {
        if deleting(shared, &ns, &name) || stop.is_cancelled() {
            return Ok(());
        }
        tick(shared, cri, run, &policy).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The container's env: `envFrom`, `env`, and the `kubernetes` Service's variables.
fn env_of(shared: &Shared, run: &PodRun, c: &Container) -> anyhow::Result<BTreeMap<String, String>> {
    let sources = shared.objects.sources(run.m.namespace());
    let mut env: BTreeMap<String, String> = shared.node.service_env.iter().cloned().collect();
    env.extend(crate::inject::env::container_env_with(
        &run.m,
        &run.status,
        c,
        Some((&sources.config_maps, &sources.secrets)),
    )?);
    Ok(env)
}

/// The container's mounts on the node.
fn mounts_of(run: &PodRun, c: &Container) -> anyhow::Result<Vec<VolumeMountOnNode>> {
    let mut out = Vec::new();
    for vm in &c.volume_mounts {
        let dir = match run.volumes.host_dir(&vm.name) {
            Some(d) => d.to_path_buf(),
            None if run.volumes.tmpfs_options(&vm.name).is_some() => {
                run.volumes.root().join("tmpfs").join(&vm.name)
            }
            None => bail!("container {}: no volume {}", c.name, vm.name),
        };
        let dir = match &vm.sub_path {
            Some(sub) if !sub.is_empty() => dir.join(sub),
            _ => dir,
        };
        out.push(VolumeMountOnNode {
            container_path: vm.mount_path.clone(),
            host_path: dir.display().to_string(),
            read_only: vm.read_only,
            propagation: vm.mount_propagation.clone(),
        });
    }
    if let Some(hosts) = &run.hosts
        && !c.volume_mounts.iter().any(|v| v.mount_path == "/etc/hosts")
    {
        out.push(VolumeMountOnNode {
            container_path: "/etc/hosts".into(),
            host_path: hosts.display().to_string(),
            read_only: false,
            propagation: None,
        });
    }
    Ok(out)
}

/// Creates and starts `c` (its next attempt).
async fn start_container(
    shared: &Arc<Shared>,
    cri: &Cri,
    run: &mut PodRun,
    c: &Container,
    init: bool,
) -> anyhow::Result<()> {
    let attempt = run.containers.get(&c.name).map(|r| r.attempt + 1).unwrap_or(0);
    if let Some(old) = run.containers.get(&c.name).filter(|r| !r.id.is_empty()) {
        let _ = cri.remove_container(&old.id).await;
    }
    let env = env_of(shared, run, c)?;
    let mounts = mounts_of(run, c)?;
    let config = spec::container(&run.m, c, &run.uid, attempt, &env, &mounts);
    let id = cri
        .create_container(&run.sandbox, config, run.sandbox_config.clone())
        .await
        .with_context(|| format!("create container {}", c.name))?;
    cri.start_container(&id).await.with_context(|| format!("start container {}", c.name))?;
    run.containers.insert(
        c.name.clone(),
        Running { id: id.clone(), attempt, started_at: Some(Instant::now()), ..Default::default() },
    );
    let no_startup = c.startup_probe.is_none();
    shared.view(&run.uid, |v| {
        if let Some(cv) = v.containers.iter_mut().find(|cv| cv.name == c.name) {
            cv.id = id;
            cv.restarts = attempt;
            cv.exited = None;
            cv.started = no_startup;
            cv.ready = no_startup && c.readiness_probe.is_none() && (!init || c.is_sidecar());
        }
    });
    if let Some(r) = run.containers.get_mut(&c.name) {
        r.started = no_startup;
        r.ready = no_startup && c.readiness_probe.is_none();
    }
    shared.write_status(&run.uid);
    Ok(())
}

async fn state_of(cri: &Cri, id: &str) -> anyhow::Result<(i32, i32)> {
    let s = cri.container_status(id).await?;
    Ok((s.state, s.exit_code))
}

/// Waits for a (non-sidecar) init container to exit; its exit code.
async fn wait_exit(
    cri: &Cri,
    run: &PodRun,
    c: &Container,
    stop: &CancellationToken,
) -> anyhow::Result<Option<i32>> {
    let id = run.containers.get(&c.name).map(|r| r.id.clone()).unwrap_or_default();
    loop {
        let (state, code) = state_of(cri, &id).await?;
        if state == ContainerState::ContainerExited as i32 {
            return Ok(Some(code));
        }
        if stop.is_cancelled() {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits for a native sidecar to be started (its startup probe passed, if it has one).
async fn wait_started(
    shared: &Arc<Shared>,
    cri: &Cri,
    run: &mut PodRun,
    c: &Container,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let (ns, name) = (run.m.namespace().to_string(), run.m.name().to_string());
    while !run.containers.get(&c.name).is_some_and(|r| r.started) {
        if stop.is_cancelled() || deleting(shared, &ns, &name) {
            return Ok(());
        }
        tick(shared, cri, run, "Always").await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// One round: exited containers restarted by policy (native sidecars always), due
/// probes run, the status written when it changed.
async fn tick(shared: &Arc<Shared>, cri: &Cri, run: &mut PodRun, policy: &str) -> anyhow::Result<()> {
    let all: Vec<(Container, bool)> = run
        .m
        .spec
        .init_containers
        .iter()
        .filter(|c| c.is_sidecar())
        .map(|c| (c.clone(), true))
        .chain(run.m.spec.containers.iter().map(|c| (c.clone(), false)))
        .collect();
    let mut changed = false;
    for (c, sidecar) in all {
        let Some(r) = run.containers.get(&c.name) else { continue };
        let (state, code) =
            state_of(cri, &r.id).await.unwrap_or((ContainerState::ContainerUnknown as i32, -1));
        if state == ContainerState::ContainerExited as i32 {
            let restart = sidecar || policy == "Always" || (policy == "OnFailure" && code != 0);
            let r = run.containers.get_mut(&c.name).expect("present");
            if r.exited.is_none() {
                r.exited = Some(code);
                r.ready = false;
                let backoff = Duration::from_secs(1 << r.attempt.min(3));
                r.backoff_until = Some(Instant::now() + backoff);
                shared.view(&run.uid, |v| {
                    if let Some(cv) = v.containers.iter_mut().find(|cv| cv.name == c.name) {
                        cv.exited = Some(code);
                        cv.ready = false;
                    }
                });
                changed = true;
            }
            if restart && r.backoff_until.is_some_and(|t| Instant::now() >= t) {
                start_container(shared, cri, run, &c, sidecar).await?;
            }
            continue;
        }
        changed |= probe_round(shared, cri, run, &c).await;
    }
    if changed {
        shared.write_status(&run.uid);
    }
    Ok(())
}

/// What kubelet.log says when a probe fails:
/// `<ms> probe-failed <ns>/<pod> <container> <kind>: <why>`.
pub const PROBE_FAILED: &str = "probe-failed";

/// Runs the container's due probes (startup until it passes; then readiness and
/// liveness); a liveness or startup failure over its threshold restarts it. Returns
/// whether its started or ready state changed.
async fn probe_round(shared: &Arc<Shared>, cri: &Cri, run: &mut PodRun, c: &Container) -> bool {
    let ip = run.status.pod_ips[0];
    let Some(r) = run.containers.get_mut(&c.name) else { return false };
    let id = r.id.clone();
    let mut kinds: Vec<(&'static str, &Probe)> = Vec::new();
    if !r.started {
        if let Some(p) = &c.startup_probe {
            kinds.push(("startup", p));
        }
    } else {
        if let Some(p) = &c.readiness_probe {
            kinds.push(("readiness", p));
        }
        if let Some(p) = &c.liveness_probe {
            kinds.push(("liveness", p));
        }
    }
    let (before_started, before_ready) = (r.started, r.ready);
    let since_start = r.started_at.map(|t| t.elapsed()).unwrap_or_default();
    let mut kill = false;
    for (kind, p) in kinds {
        let state = r.probes.entry(kind).or_default();
        // A finished probe's result.
        if let Some(slot) = &state.running {
            let done = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(result) = done {
                state.running = None;
                match result {
                    Ok(()) => {
                        state.successes += 1;
                        state.failures = 0;
                    }
                    Err(why) => {
                        state.failures += 1;
                        state.successes = 0;
                        shared.log(&format!(
                            "{PROBE_FAILED} {}/{} {} {kind}: {why}",
                            run.m.namespace(),
                            run.m.name(),
                            c.name
                        ));
                    }
                }
            }
        }
        let threshold_ok = p.success_threshold.unwrap_or(1).max(1);
        let threshold_fail = p.failure_threshold.unwrap_or(3).max(1);
        match kind {
            "startup" if state.successes >= threshold_ok => r.started = true,
            "startup" | "liveness" if state.failures >= threshold_fail => kill = true,
            "readiness" => {
                r.ready =
                    state.successes >= threshold_ok && state.failures < threshold_fail && state.successes > 0
            }
            _ => {}
        }
        let period = Duration::from_secs(p.period_seconds.unwrap_or(10).max(1));
        let delay = Duration::from_secs(p.initial_delay_seconds.unwrap_or(0));
        let due = state.running.is_none()
            && since_start >= delay
            && state.last.is_none_or(|t| t.elapsed() >= period);
        if due {
            state.last = Some(Instant::now());
            let slot = Arc::new(Mutex::new(None));
            state.running = Some(slot.clone());
            let (cri, id, probe, container) = (cri.clone(), id.clone(), p.clone(), c.clone());
            tokio::spawn(async move {
                let result = run_probe(&cri, &id, &probe, &container, ip).await;
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
            });
        }
    }
    if c.readiness_probe.is_none() {
        r.ready = r.started;
    }
    let (started, ready) = (r.started, r.ready);
    if kill {
        shared.log(&format!("{}: {}: probe failed over its threshold: restarting", run.m.name(), c.name));
        let grace = Duration::from_secs(run.m.spec.termination_grace_period_seconds.unwrap_or(30));
        let _ = cri.stop_container(&id, grace).await;
        if let Some(r) = run.containers.get_mut(&c.name) {
            r.probes.clear();
        }
    }
    let uid = run.uid.clone();
    shared.view(&uid, |v| {
        if let Some(cv) = v.containers.iter_mut().find(|cv| cv.name == c.name) {
            cv.started = started;
            cv.ready = ready;
        }
    });
    before_started != started || before_ready != ready
}

/// One probe from the node: HTTP (2xx/3xx), TCP (connects), gRPC (SERVING), exec (0).
/// A failure says why: the probe's timeout, or what the probe got.
async fn run_probe(cri: &Cri, id: &str, p: &Probe, c: &Container, pod_ip: IpAddr) -> Result<(), String> {
    let timeout = Duration::from_secs(p.timeout_seconds.unwrap_or(1).max(1));
    let target = |host: Option<&String>, port: u16| -> SocketAddr {
        let ip = host.and_then(|h| h.parse().ok()).unwrap_or(pod_ip);
        SocketAddr::new(ip, port)
    };
    let status = |what: &str, status: u16| {
        if (200..400).contains(&status) { Ok(()) } else { Err(format!("{what}: status {status}")) }
    };
    let probe = async {
        if let Some(h) = &p.http_get {
            let port = c.port(&h.port).map_err(|e| format!("port {:?}: {e}", h.port))?;
            let path = h.path.clone().unwrap_or_else(|| "/".into());
            let to = target(h.host.as_ref(), port);
            if h.scheme.as_deref().is_some_and(|s| s.eq_ignore_ascii_case("HTTPS")) {
                // kubelet does not check the certificate: a TLS handshake and an answer.
                let got = crate::http::https_status(to, &path)
                    .await
                    .map_err(|e| format!("GET https://{to}{path}: {e:#}"))?;
                return status(&format!("GET https://{to}{path}"), got);
            }
            let mut headers: Vec<(String, String)> =
                vec![("User-Agent".into(), "kube-probe/1.33".into()), ("Accept".into(), "*/*".into())];
            headers.extend(h.http_headers.iter().map(|x| (x.name.clone(), x.value.clone())));
            let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
            let (got, _) = crate::http::request_with(to, "GET", &path, &headers, None)
                .await
                .map_err(|e| format!("GET http://{to}{path}: {e:#}"))?;
            return status(&format!("GET http://{to}{path}"), got);
        }
        if let Some(t) = &p.tcp_socket {
            let port = c.port(&t.port).map_err(|e| format!("port {:?}: {e}", t.port))?;
            let to = target(t.host.as_ref(), port);
            return tokio::net::TcpStream::connect(to)
                .await
                .map(drop)
                .map_err(|e| format!("connect {to}: {e}"));
        }
        if let Some(g) = &p.grpc {
            let to = SocketAddr::new(pod_ip, g.port);
            return match crate::http::grpc_health(to, g.service.as_deref().unwrap_or_default()).await {
                Ok(true) => Ok(()),
                Ok(false) => Err(format!("gRPC health of {to}: not SERVING")),
                Err(e) => Err(format!("gRPC health of {to}: {e:#}")),
            };
        }
        if let Some(e) = &p.exec {
            return match cri.exec_sync(id, &e.command, timeout).await {
                Ok((0, _, _)) => Ok(()),
                Ok((code, _, _)) => Err(format!("exec {:?}: exit {code}", e.command)),
                Err(err) => Err(format!("exec {:?}: {err:#}", e.command)),
            };
        }
        Err("no handler".to_string())
    };
    tokio::time::timeout(timeout, probe)
        .await
        .unwrap_or_else(|_| Err(format!("timed out after {} s (timeoutSeconds)", timeout.as_secs())))
}

/// Deletion as kubelet does it: each container's preStop, then SIGTERM (SIGKILL after
/// the grace period) to the app containers, then the native sidecars in reverse
/// order; then the sandbox stopped and removed, and tmpfs volumes unmounted.
async fn terminate(shared: &Arc<Shared>, cri: &Cri, run: &mut PodRun) {
    let pod = shared.api.pod(run.m.namespace(), run.m.name());
    let grace = pod
        .as_ref()
        .and_then(|p| p["metadata"]["deletionGracePeriodSeconds"].as_u64())
        .or(run.m.spec.termination_grace_period_seconds)
        .unwrap_or(30);
    let deadline = Instant::now() + Duration::from_secs(grace);
    let stop_one = |c: Container, id: String| {
        let cri = cri.clone();
        async move {
            if let Some(cmd) =
                c.lifecycle.as_ref().and_then(|l| l.pre_stop.as_ref()).and_then(|h| h.exec.as_ref())
            {
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = cri.exec_sync(&id, &cmd.command, left.max(Duration::from_secs(1))).await;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = cri.stop_container(&id, left).await;
        }
    };
    let apps: Vec<_> = run
        .m
        .spec
        .containers
        .iter()
        .filter_map(|c| Some(stop_one(c.clone(), run.containers.get(&c.name)?.id.clone())))
        .collect();
    futures::future::join_all(apps).await;
    for c in run.m.spec.init_containers.iter().rev() {
        if let Some(r) = run.containers.get(&c.name) {
            stop_one(c.clone(), r.id.clone()).await;
        }
    }
    for r in run.containers.values() {
        let _ = cri.remove_container(&r.id).await;
    }
    let _ = cri.stop_pod_sandbox(&run.sandbox).await;
    let _ = cri.remove_pod_sandbox(&run.sandbox).await;
    for v in &run.m.spec.volumes {
        if run.volumes.tmpfs_options(&v.name).is_some() {
            let dir = run.volumes.root().join("tmpfs").join(&v.name);
            let _ = std::process::Command::new("nsenter")
                .arg(format!("--mount={}", shared.node.mount_ns.display()))
                .args(["--", "umount", "-l"])
                .arg(&dir)
                .output();
        }
    }
}
