//! The busy-node rig: one node, many pods, the CNI node agent capturing them with
//! eBPF, and traffic that tells every connection that got past a sidecar
//! (`meshtraffic`). The node is a network namespace with the reference bridge, a test
//! Kubernetes API server, the DaemonSet's two containers (`weir cni install`, `weir
//! cni repair`) as processes, and a `kubepods` cgroup whose pods each live in
//! `kubepods/pod<uid>` with a sandbox process, as the kubelet lays them out. Meshed pods
//! run a stand-in sidecar, an app that logs a verdict per connection, and a client;
//! plain pods an app and a client. Events (agent restarts, rollouts, faults, crafted
//! packets, tenants) are methods; [`BusyNode::check`] says, since a mark, whether any
//! connection got past a sidecar and which connections failed.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};
use weir_agent::sandbox::{NetNs, unique_name};

use crate::{
    Cgroup, Placement, PodChild,
    cni::{Attachment, CniRuntime, TestApiServer, conflist, pod_object, start_placed, write_kubeconfig},
    envoy::tempfile_dir::Dir,
    tools,
};

const TOKEN: &str = "busy-node-token";
pub const SUBNET: &str = "10.88.0.0/16";
pub const NODE: &str = "busy-node";
const APP_PORT: u16 = 8080;

/// Milliseconds since the epoch, as the traffic logs stamp lines.
pub fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0)
}

/// One pod of the rig.
pub struct RigPod {
    pub name: String,
    pub uid: String,
    pub meshed: bool,
    pub ip: String,
    pub attachment: Attachment,
    pub result: Value,
    /// Processes, killed before the sandbox and cgroup go.
    pub sidecar: Option<PodChild>,
    pub app: Option<PodChild>,
    pub client: Option<PodChild>,
    _sandbox: PodChild,
    pub cgroup: Cgroup,
    pub ns: NetNs,
}

impl RigPod {
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip.parse().expect("pod IP"), APP_PORT)
    }
}

/// What [`BusyNode::check`] found since a mark.
#[derive(Debug, Default)]
pub struct Verdict {
    /// `bypass-*` lines from meshed apps: connections that got past a sidecar.
    pub bypasses: Vec<String>,
    /// Failed connections by (client pod, target address).
    pub failures: BTreeMap<(String, String), usize>,
    /// Successful connections seen.
    pub ok: usize,
}

/// The rig.
pub struct BusyNode {
    pub pods: Vec<RigPod>,
    agent: Option<Child>,
    repair: Option<Child>,
    /// The program set suffix (`WEIR_EBPF_PROGRAM_SET`) the agent and plugin run as.
    pub set: String,
    /// Every suffix the node ran, for cleanup.
    sets: Vec<String>,
    pub capture: String,
    pub api: TestApiServer,
    pub logs: Dir,
    host: Dir,
    run_dir: Dir,
    ipam: Dir,
    pub kubepods: Cgroup,
    pub ns: NetNs,
}

impl BusyNode {
    /// A node with its agent running as build `set`, and no pods yet.
    pub fn new(test: &str, set: &str) -> anyhow::Result<Self> {
        let ns = NetNs::create(&unique_name(&format!("{test}-node")))?;
        crate::cni::run_in(&ns, None, Command::new("ip"), &["link", "set", "lo", "up"]);
        let api = TestApiServer::start(&ns, TOKEN, None)?;
        let run_dir = Dir::new("busy-run")?;
        write_kubeconfig(run_dir.path(), &api.kubeconfig(TOKEN, None))?;
        let host = Dir::new("busy-host")?;
        for d in ["net.d", "bin", "run"] {
            std::fs::create_dir_all(host.path().join(d))?;
        }
        std::fs::write(
            host.path().join("net.d/10-k8s.conflist"),
            r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"ptp"}]}"#,
        )?;
        // Apps and clients run as 1000 and write their logs here.
        let logs = Dir::new("busy-logs")?;
        std::fs::set_permissions(logs.path(), std::os::unix::fs::PermissionsExt::from_mode(0o1777))?;
        let mut node = Self {
            pods: Vec::new(),
            agent: None,
            repair: None,
            set: set.to_string(),
            sets: vec![set.to_string()],
            capture: unique_name("busy-node"),
            api,
            logs,
            host,
            run_dir,
            ipam: Dir::new("busy-ipam")?,
            kubepods: crate::test_cgroup(&format!("{test}-kubepods")),
            ns,
        };
        node.start_agent(set)?;
        Ok(node)
    }

    fn weir(&self, set: &str) -> Command {
        let mut cmd = tools::weir_command();
        cmd.env(weir_agent::capture::ebpf::set::SET_ENV, set).env("WEIR_LOG", "info");
        cmd
    }

    fn log_file(&self, name: &str) -> std::io::Result<std::fs::File> {
        std::fs::OpenOptions::new().create(true).append(true).open(self.logs.path().join(name))
    }

    /// The DaemonSet's pod as build `set`: `weir cni install` and `weir cni repair`;
    /// returns once the node capture runs that build's program set.
    pub fn start_agent(&mut self, set: &str) -> anyhow::Result<()> {
        if let Some(mut repair) = self.repair.take() {
            let _ = repair.kill();
            let _ = repair.wait();
        }
        let mut cmd = self.install_command(set)?;
        let ready = |log: &str| log.matches("node agent ready").count();
        let ready_before = ready(&self.agent_log());
        self.agent = Some(cmd.spawn()?);
        self.set = set.to_string();
        if !self.sets.iter().any(|s| s == set) {
            self.sets.push(set.to_string());
        }
        let capture = self.capture.clone();
        // Generous deadlines: a new build verifies its programs first, which takes a
        // software-emulated VM (the kernel matrix) most of a minute. An agent that
        // exits is not waited for.
        let deadline = std::time::Instant::now() + Duration::from_secs(180);
        loop {
            let record = weir_agent::capture::ebpf::record::PinRecord::load(&capture);
            if record.and_then(|r| r.programs).is_some_and(|k| k.ends_with(set)) {
                break;
            }
            if let Some(status) = self.agent.as_mut().and_then(|a| a.try_wait().ok().flatten()) {
                bail!(
                    "the node agent exited ({status}) before it attached build {set}: {}",
                    self.agent_log()
                );
            }
            if std::time::Instant::now() > deadline {
                bail!("the node agent did not attach build {set}: {}", self.agent_log());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // The record may be the previous agent's (capture outlives it): this one is
        // running when it says so.
        crate::control_plane::eventually(Duration::from_secs(180), || {
            (ready(&self.agent_log()) > ready_before).then_some(())
        })
        .with_context(|| format!("the node agent never said it was ready: {}", self.agent_log()))?;
        self.start_repair()
    }

    /// `weir cni install` as the DaemonSet's container runs it, as build `set`, logging
    /// to agent.log.
    fn install_command(&self, set: &str) -> anyhow::Result<Command> {
        let mut cmd = crate::cni::node_agent_command(
            "install",
            self.host.path(),
            self.kubepods.path(),
            &self.capture,
            &self.run_dir.path().join("istio-cni-kubeconfig"),
        );
        cmd.env(weir_agent::capture::ebpf::set::SET_ENV, set)
            .env("WEIR_LOG", "info")
            .args(["--interval", "500ms"])
            .stdout(Stdio::null())
            .stderr(self.log_file("agent.log")?);
        crate::daemonset::confine(&mut cmd, "install");
        Ok(cmd)
    }

    /// Starts the agent as build `set` expecting it to refuse to start: returns what it
    /// logged once it exited non-zero; an error if it started or exited 0.
    pub fn start_agent_refused(&mut self, set: &str) -> anyhow::Result<String> {
        let before = self.agent_log().len();
        let mut child = self.install_command(set)?.spawn()?;
        let status =
            crate::control_plane::eventually(Duration::from_secs(180), || child.try_wait().ok().flatten());
        let log = self.agent_log().get(before..).unwrap_or_default().to_string();
        match status {
            None => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the node agent did not refuse to start: {log}")
            }
            Some(s) if s.success() => bail!("the node agent exited 0 instead of refusing: {log}"),
            Some(_) => Ok(log),
        }
    }

    /// `weir cni uninstall` (with `--detach-running-pods` when asked) as build `set`
    /// of the running agent: what it said; an error if it failed.
    pub fn uninstall(&self, detach_running_pods: bool) -> anyhow::Result<String> {
        let mut cmd = crate::cni::node_agent_command(
            "uninstall",
            self.host.path(),
            self.kubepods.path(),
            &self.capture,
            &self.run_dir.path().join("istio-cni-kubeconfig"),
        );
        cmd.env(weir_agent::capture::ebpf::set::SET_ENV, &self.set).env("WEIR_LOG", "info");
        if detach_running_pods {
            cmd.arg("--detach-running-pods");
        }
        let out = cmd.output()?;
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() {
            bail!("weir cni uninstall failed ({}): {said}", out.status);
        }
        Ok(said)
    }

    /// The DaemonSet's repair container: `weir cni repair` every second.
    fn start_repair(&mut self) -> anyhow::Result<()> {
        let mut cmd = self.weir(&self.set.clone());
        cmd.args(["cni", "repair", "--interval", "1s", "--node-name", NODE, "--proc-dir", "/proc"])
            .args(["--capture-mode", "ebpf", "--ebpf-name", &self.capture])
            .arg("--kubeconfig")
            .arg(self.run_dir.path().join("istio-cni-kubeconfig"))
            .stdout(Stdio::null())
            .stderr(self.log_file("repair.log")?);
        crate::daemonset::confine(&mut cmd, "repair");
        let placed = Placement { netns: Some(&self.ns), ..Placement::default() };
        self.repair = Some(weir_agent::sandbox::process::spawn(&mut cmd, placed)?.into_inner());
        Ok(())
    }

    pub fn agent_log(&self) -> String {
        std::fs::read_to_string(self.logs.path().join("agent.log")).unwrap_or_default()
    }

    /// Ends the agent with `signal` (SIGTERM: a rollout, an eviction; SIGKILL).
    pub fn stop_agent(&mut self, signal: i32) -> anyhow::Result<()> {
        if let Some(mut repair) = self.repair.take() {
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(repair.id() as i32, signal) };
            let _ = repair.wait();
        }
        if let Some(mut agent) = self.agent.take() {
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(agent.id() as i32, signal) };
            let status = agent.wait()?;
            if signal == libc::SIGTERM && !status.success() {
                bail!("the node agent did not stop cleanly ({status}): {}", self.agent_log());
            }
        }
        Ok(())
    }

    /// The CNI runtime, running the plugin as the agent's build.
    fn runtime(&self) -> anyhow::Result<CniRuntime<'_>> {
        let mut rt = CniRuntime::new(&self.ns)?;
        rt.env = vec![(weir_agent::capture::ebpf::set::SET_ENV.into(), self.set.clone())];
        Ok(rt)
    }

    fn conflist(&self) -> Value {
        conflist(
            SUBNET,
            self.ipam.path(),
            json!({"cni_agent_run_dir": self.run_dir.path(), "capture_mode": "auto", "ebpf_node_capture": self.capture}),
        )
    }

    /// A pod as the kubelet starts it: namespace, cgroup and sandbox, then the CNI
    /// chain's ADD; `annotations` on its Pod object. Returns its index; its processes
    /// start with [`BusyNode::start_workload`].
    pub fn add_pod(
        &mut self,
        name: &str,
        meshed: bool,
        annotations: &[(&str, &str)],
    ) -> anyhow::Result<usize> {
        let rt = self.runtime()?;
        let uid = format!("{}-{name}", unique_name("uid"));
        let ns = NetNs::create(&unique_name(name))?;
        let lo =
            Attachment { ifname: "lo".into(), ..Attachment::pod(&format!("c-{name}"), ns.path(), "x", name) };
        rt.exec("loopback", "ADD", &lo, br#"{"cniVersion":"1.0.0","name":"lo","type":"loopback"}"#)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mount = weir_agent::sandbox::cgroup::cgroup2_mount()?;
        let relative = self.kubepods.path().strip_prefix(&mount)?.join(format!("pod{uid}"));
        let cgroup = Cgroup::create(&relative.to_string_lossy())?;
        let mut sleep = Command::new("sleep");
        sleep.arg("infinity");
        let sandbox = weir_agent::sandbox::process::spawn(
            &mut sleep,
            Placement { netns: Some(&ns), cgroup: Some(&cgroup), ..Placement::default() },
        )?;
        let mut object = pod_object("busy", name, meshed, annotations, &[]);
        object["metadata"]["uid"] = json!(uid);
        object["spec"]["nodeName"] = json!(NODE);
        self.api.set_pod(object.clone());
        let a = Attachment::pod(&format!("c-{name}"), ns.path(), "busy", name);
        let result = rt.add(&self.conflist(), &a).map_err(|e| anyhow::anyhow!("ADD {name}: {e}"))?;
        let ip =
            result["ips"][0]["address"].as_str().context("no IP")?.split('/').next().unwrap().to_string();
        object["status"] = json!({"podIP": ip});
        self.api.set_pod(object);
        drop(rt);
        self.pods.push(RigPod {
            name: name.to_string(),
            uid,
            meshed,
            ip,
            attachment: a,
            result,
            sidecar: None,
            app: None,
            client: None,
            _sandbox: sandbox,
            cgroup,
            ns,
        });
        Ok(self.pods.len() - 1)
    }

    /// The CNI chain's ADD refused for a pod: the plugin's error.
    pub fn add_refused(&mut self, name: &str, annotations: &[(&str, &str)]) -> anyhow::Result<String> {
        match self.add_pod(name, true, annotations) {
            Ok(_) => bail!("ADD of {name} was not refused"),
            Err(e) => Ok(e.to_string()),
        }
    }

    fn placed(&self, pod: usize, uid: u32) -> Placement<'_> {
        let p = &self.pods[pod];
        Placement {
            netns: Some(&p.ns),
            cgroup: Some(&p.cgroup),
            user: Some((uid, uid)),
            ..Placement::default()
        }
    }

    /// Starts a pod's sidecar stand-in (meshed pods) and app.
    pub fn start_workload(&mut self, pod: usize) -> anyhow::Result<()> {
        if self.pods[pod].meshed {
            self.start_sidecar(pod)?;
        }
        self.start_app(pod)
    }

    /// Starts a pod's app alone.
    pub fn start_app(&mut self, pod: usize) -> anyhow::Result<()> {
        let log = self.logs.path().join(format!("app-{}.log", self.pods[pod].name));
        let app = start_placed(
            self.placed(pod, 1000),
            &["mesh-app", &format!("0.0.0.0:{APP_PORT}"), log.to_str().unwrap()],
        )?;
        self.pods[pod].app = Some(app);
        Ok(())
    }

    pub fn start_sidecar(&mut self, pod: usize) -> anyhow::Result<()> {
        let sidecar = start_placed(self.placed(pod, 1337), &["sidecar"])?;
        self.pods[pod].sidecar = Some(sidecar);
        Ok(())
    }

    /// Starts a pod's client, connecting to `targets` in turn every `interval`.
    pub fn start_client(
        &mut self,
        pod: usize,
        targets: &[SocketAddr],
        interval: Duration,
    ) -> anyhow::Result<()> {
        let p = &self.pods[pod];
        let log = self.logs.path().join(format!("client-{}.log", p.name));
        let kind = if p.meshed { "meshed" } else { "plain" };
        let ms = interval.as_millis().to_string();
        let mut args = vec!["mesh-client", &p.name, kind, &ms, log.to_str().unwrap()];
        let targets: Vec<String> = targets.iter().map(ToString::to_string).collect();
        args.extend(targets.iter().map(String::as_str));
        let name = p.name.clone();
        let client =
            start_placed(self.placed(pod, 1000), &args).with_context(|| format!("client of {name}"))?;
        self.pods[pod].client = Some(client);
        Ok(())
    }

    /// DEL of a pod through the chain; its processes, sandbox, cgroup and namespace go.
    pub fn delete_pod(&mut self, pod: usize) -> anyhow::Result<()> {
        let p = self.pods.remove(pod);
        let rt = self.runtime()?;
        rt.del(&self.conflist(), &p.attachment, Some(&p.result))
            .map_err(|e| anyhow::anyhow!("DEL {}: {e}", p.name))?;
        drop(p);
        Ok(())
    }

    /// Connections since `since` (ms): bypasses in meshed apps' logs, failures in the
    /// clients' logs.
    pub fn check(&self, since: u128) -> Verdict {
        let mut v = Verdict::default();
        for p in &self.pods {
            let read = |kind: &str| {
                std::fs::read_to_string(self.logs.path().join(format!("{kind}-{}.log", p.name)))
                    .unwrap_or_default()
            };
            let lines = |text: String| -> Vec<(u128, String)> {
                text.lines()
                    .filter_map(|l| {
                        l.split_once(' ').and_then(|(t, rest)| Some((t.parse().ok()?, rest.to_string())))
                    })
                    .filter(|(t, _)| *t >= since)
                    .collect()
            };
            if p.meshed {
                for (_, line) in lines(read("app")) {
                    if line.starts_with("bypass") {
                        v.bypasses.push(format!("{}: {line}", p.name));
                    }
                }
            }
            for (_, line) in lines(read("client")) {
                let mut words = line.split_whitespace();
                match (words.next(), words.next()) {
                    (Some("ok"), _) => v.ok += 1,
                    (Some("fail"), Some(target)) => {
                        *v.failures.entry((p.name.clone(), target.to_string())).or_default() += 1;
                    }
                    _ => {}
                }
            }
        }
        v
    }

    /// The index of pod `name`.
    pub fn pod(&self, name: &str) -> usize {
        self.pods.iter().position(|p| p.name == name).unwrap_or_else(|| panic!("no pod {name}"))
    }

    pub fn host_path(&self) -> &Path {
        self.host.path()
    }

    pub fn logs_path(&self) -> PathBuf {
        self.logs.path().to_path_buf()
    }
}

impl Drop for BusyNode {
    fn drop(&mut self) {
        for child in [self.agent.take(), self.repair.take()].into_iter().flatten() {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
        // Processes first, then each pod's sandbox, cgroup and namespace.
        self.pods.clear();
        let _ = weir_agent::node::cni::node_capture::detach_node(&self.capture);
        for key in weir_agent::capture::ebpf::set::pinned_keys() {
            if self.sets.iter().any(|s| key.ends_with(s.as_str()))
                && let Ok(Some(set)) = weir_agent::capture::ebpf::set::LockedSet::open(&key)
            {
                let _ = set.release();
            }
        }
    }
}
