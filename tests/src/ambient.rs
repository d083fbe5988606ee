//! The ambient side of the rig: a test "node" (a namespace of the mesh) where Weir's
//! ambient node agent (`weir cni ambient`, the binary under test) runs against the test
//! API server with watches (`kube_api`), with its ZDS socket, its run dir (the plugin's
//! kubeconfig and event socket) and its host probe rule all inside the test's own
//! namespaces and temp dir. Pods are the mesh's pods, registered in the API as ambient
//! or not, and optionally given a kubelet-shaped sandbox (a process in a `pod<uid>`
//! cgroup) so the agent finds them through /proc. The plugin is run as a runtime runs
//! it (`cni::CniRuntime`), with Istio's ambient fields in its config.

use std::{
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};
use weir_agent::sandbox::{Mesh, Pod, PodChild};

use crate::{
    cni::{Attachment, CniFailure, CniRuntime, KubeletSandbox},
    kube_api::KubeApi,
    tools,
    ztunnel::{Ztunnel, listening_tcp_ports},
};

/// The node name every pod is scheduled on.
pub const NODE: &str = "weir-node";
/// The API token.
pub const TOKEN: &str = "ambient-token";
/// Istio's chart selector, as the DaemonSet's env carries it.
pub const CHART_SELECTOR: &str = "- podSelector:\n    matchLabels: {istio.io/dataplane-mode: ambient}\n- podSelector:\n    matchExpressions:\n    - {key: istio.io/dataplane-mode, operator: NotIn, values: [none]}\n  namespaceSelector:\n    matchLabels: {istio.io/dataplane-mode: ambient}\n";

/// A Pod object on the test node.
pub fn pod_object(
    namespace: &str,
    name: &str,
    uid: &str,
    ip: IpAddr,
    labels: &[(&str, &str)],
    annotations: &[(&str, &str)],
) -> Value {
    let labels: serde_json::Map<String, Value> =
        labels.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
    let annotations: serde_json::Map<String, Value> =
        annotations.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": namespace, "name": name, "uid": uid, "labels": labels, "annotations": annotations},
        "spec": {"nodeName": NODE, "serviceAccountName": name, "containers": [{"name": "app", "image": "app"}]},
        "status": {"phase": "Running", "podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}]}
    })
}

/// The test node and its agent.
pub struct AmbientNode {
    pub node: Pod,
    pub api: KubeApi,
    dir: tempfile::TempDir,
    agent: Option<PodChild>,
    starts: u32,
    /// The agent's environment besides the rig's own.
    pub env: Vec<(String, String)>,
}

impl AmbientNode {
    /// The node namespace (from `mesh`), the API server, the plugin's kubeconfig.
    pub fn new(mesh: &Mesh) -> anyhow::Result<Self> {
        let node = mesh.pod("node")?;
        let api = KubeApi::start(node.netns(), TOKEN)?;
        let dir = tempfile::Builder::new().prefix("weir-ambient-").tempdir()?;
        fs::write(dir.path().join("istio-cni-kubeconfig"), api.kubeconfig())?;
        let env = [
            ("AMBIENT_ENABLED", "true"),
            ("AMBIENT_ENABLEMENT_SELECTOR", CHART_SELECTOR),
            ("AMBIENT_DNS_CAPTURE", "true"),
            ("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "true"),
            ("EXCLUDE_NAMESPACES", "kube-system"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        Ok(Self { node, api, dir, agent: None, starts: 0, env })
    }

    pub fn run_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The agent's ZDS socket (ztunnel's `INPOD_UDS`).
    pub fn zds_socket(&self) -> PathBuf {
        self.dir.path().join("ztunnel/ztunnel.sock")
    }

    /// The log of the agent's `n`th run (1-based).
    pub fn agent_log(&self, n: u32) -> String {
        fs::read_to_string(self.dir.path().join(format!("agent-{n}.log"))).unwrap_or_default()
    }

    /// Every run's log.
    pub fn agent_logs(&self) -> String {
        (1..=self.starts).map(|n| format!("--- agent run {n}\n{}", self.agent_log(n))).collect()
    }

    /// Starts `weir cni ambient` in the node namespace and waits until it says it is ready.
    pub fn start_agent(&mut self) -> anyhow::Result<()> {
        self.starts += 1;
        let log_path = self.dir.path().join(format!("agent-{}.log", self.starts));
        let log = fs::File::create(&log_path)?;
        fs::write(self.dir.path().join("kubeconfig"), self.api.kubeconfig())?;
        let mut cmd = tools::weir_command();
        cmd.args(["cni", "ambient"])
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("WEIR_LOG", "info")
            .env("NODE_NAME", NODE)
            .env("ZTUNNEL_UDS_ADDRESS", self.zds_socket())
            .env("CNI_AGENT_RUN_DIR", self.dir.path())
            .env("WEIR_HOST_ROOT", "")
            .env("WEIR_HOST_PROC", "/proc")
            .env("WEIR_KUBELET_UID", "0")
            .env("WEIR_AMBIENT_KUBECONFIG", self.dir.path().join("kubeconfig"))
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        crate::daemonset::confine(&mut cmd, "ambient");
        self.agent = Some(self.node.spawn(&mut cmd, 0).context("start weir cni ambient")?);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = fs::read_to_string(&log_path).unwrap_or_default();
            if text.contains("ambient node agent ready") {
                return Ok(());
            }
            if self.agent.as_mut().is_some_and(|a| matches!(a.wait_timeout(Duration::ZERO), Ok(Some(_)))) {
                bail!("weir cni ambient exited before it was ready; its log:\n{text}");
            }
            if Instant::now() > deadline {
                bail!("weir cni ambient not ready within 30 s; its log:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The running agent's process id.
    pub fn agent_pid(&self) -> Option<u32> {
        self.agent.as_ref().map(PodChild::pid)
    }

    /// SIGTERM to the agent, and waits for it to exit.
    pub fn stop_agent(&mut self) -> anyhow::Result<()> {
        let Some(mut agent) = self.agent.take() else { return Ok(()) };
        agent.signal(libc::SIGTERM)?;
        if agent.wait_timeout(Duration::from_secs(10))?.is_none() {
            agent.signal(libc::SIGKILL)?;
            bail!("weir cni ambient did not stop within 10 s of SIGTERM");
        }
        Ok(())
    }

    /// The plugin's network config: Istio's ambient fields, the chart's selector.
    pub fn plugin_conf(&self, prev_ip: Option<IpAddr>) -> Value {
        let selectors =
            weir_agent::node::enroll::selector::EnablementSelectors::parse(CHART_SELECTOR).expect("selector");
        let mut conf = json!({
            "cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "istio-cni",
            "cni_agent_run_dir": self.dir.path(), "ambient_enabled": true,
            "enablement_selectors": selectors.entries(), "exclude_namespaces": ["kube-system"],
            "pod_namespace": "istio-system", "capture_mode": "iptables"
        });
        if let Some(ip) = prev_ip {
            let prefix = if ip.is_ipv4() { 24 } else { 64 };
            conf["prevResult"] =
                json!({"cniVersion": "1.0.0", "ips": [{"address": format!("{ip}/{prefix}")}]});
        }
        conf
    }

    /// The plugin's ADD for `pod` (registered in the API as `namespace/name`).
    pub fn cni_add(&self, pod: &Pod, namespace: &str, name: &str) -> Result<String, CniFailure> {
        self.cni_add_traced(pod, namespace, name, &[]).map(|(stdout, _)| stdout)
    }

    /// [`AmbientNode::cni_add`] with `env` added to the plugin's, and the run's trace
    /// (spawn and reap times, stderr: where the plugin's phase report goes).
    pub fn cni_add_traced(
        &self,
        pod: &Pod,
        namespace: &str,
        name: &str,
        env: &[(&str, &str)],
    ) -> Result<(String, crate::cni::PluginRun), CniFailure> {
        let conf = self.plugin_conf(Some(IpAddr::V4(pod.ipv4())));
        self.cni_add_conf(pod, namespace, name, env, &conf)
    }

    /// [`AmbientNode::cni_add_traced`] with `conf` as the plugin's network config (from
    /// [`AmbientNode::plugin_conf`], changed by the test).
    pub fn cni_add_conf(
        &self,
        pod: &Pod,
        namespace: &str,
        name: &str,
        env: &[(&str, &str)],
        conf: &Value,
    ) -> Result<(String, crate::cni::PluginRun), CniFailure> {
        let mut rt = CniRuntime::new(self.node.netns()).expect("CNI runtime");
        rt.env.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let a = Attachment::pod(&format!("c-{name}"), pod.netns().path(), namespace, name);
        rt.exec_traced("istio-cni", "ADD", &a, conf.to_string().as_bytes())
    }

    /// A kubelet-shaped sandbox for `pod` under uid `uid` (found through /proc); `parent`
    /// plays `kubepods` and its name must say so (podns looks right under it).
    pub fn sandbox(&self, parent: &crate::Cgroup, uid: &str, pod: &Pod) -> anyhow::Result<KubeletSandbox> {
        KubeletSandbox::start(parent, uid, pod.netns())
    }

    /// Waits for `check`, naming `what` and the agent's log when it does not come.
    pub fn wait(&self, what: &str, limit: Duration, mut check: impl FnMut() -> bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        while !check() {
            if Instant::now() > deadline {
                bail!("{what}: not within {limit:?}; the agent's log:\n{}", self.agent_logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The agent's environment for Weir's eBPF capture of ambient pods through node
    /// capture `capture` (`WEIR_AMBIENT_CAPTURE=auto`), with DNS capture and IPv6 on.
    pub fn capture_with_ebpf(&mut self, capture: &str) {
        self.env.extend(
            [
                ("AMBIENT_DNS_CAPTURE", "true"),
                ("AMBIENT_IPV6", "true"),
                ("WEIR_AMBIENT_CAPTURE", "auto"),
                ("WEIR_EBPF_NODE_CAPTURE", capture),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string())),
        );
    }

    /// Registers pod `namespace/name` as kubelet creates it: `Pending`, with no address
    /// before its ADD (`auto` gives eBPF to new sandboxes only; a pod found running gets
    /// the rules).
    pub fn set_pending_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        pod: &Pod,
        annotations: &[(&str, &str)],
    ) {
        let mut object = pod_object(namespace, name, uid, IpAddr::V4(pod.ipv4()), &[], annotations);
        object["status"] = json!({"phase": "Pending"});
        self.api.set_pod(object);
    }

    /// Pod `namespace/name` running with `pod`'s IPv4 address, as kubelet reports it
    /// after the ADD.
    pub fn set_running(&self, namespace: &str, name: &str, pod: &Pod) {
        let ip = pod.ipv4().to_string();
        self.api.update_pod(namespace, name, |p| {
            p["status"] = json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]});
        });
    }

    /// Once `zt` has its first snapshot: each pod's ADD through the plugin, the pod
    /// annotated `enabled` and ztunnel listening in it (15001, 15006, 15008); each wait
    /// up to `patience`.
    pub fn add_to_ztunnel(&self, zt: &Ztunnel, namespace: &str, pods: &[(&Pod, &str)], patience: Duration) {
        self.wait("ztunnel's first snapshot", patience, || zt.log().contains("received snapshot sent"))
            .unwrap_or_else(|e| panic!("{e}\nztunnel:\n{}", zt.log()));
        for (pod, name) in pods {
            self.cni_add(pod, namespace, name)
                .unwrap_or_else(|e| panic!("ADD {name}: {e}\n{}\nztunnel:\n{}", self.agent_logs(), zt.log()));
            assert_eq!(self.api.redirection(namespace, name).as_deref(), Some("enabled"));
            self.wait(&format!("ztunnel listening in {name}"), patience, || {
                let ports = listening_tcp_ports(pod.netns()).unwrap_or_default();
                [15001, 15006, 15008].iter().all(|p| ports.contains(p))
            })
            .unwrap_or_else(|e| panic!("{e}\nztunnel:\n{}", zt.log()));
        }
    }

    /// Runs `f` inside the node namespace (the host probe rule and sets live there).
    pub fn in_node<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.node.netns().run(|| async { f() }).expect("run in the node namespace")
    }
}

impl Drop for AmbientNode {
    fn drop(&mut self) {
        if let Some(mut agent) = self.agent.take() {
            let _ = agent.signal(libc::SIGKILL);
            let _ = agent.wait_timeout(Duration::from_secs(5));
        }
    }
}
