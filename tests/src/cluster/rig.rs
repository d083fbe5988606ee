//! The cluster: an underlay namespace (a bridge every node is plugged into, and the API
//! stand-in on 192.168.77.2:6443 over TLS with the cluster CA's certificate), the
//! nodes, their kubelets, and the API's admission work a real cluster does before a
//! pod reaches a kubelet (a UID, the node, the service account's token volume).
//! Dropping it stops every kubelet and node, then removes the underlay and the rig's
//! folder: nothing is left on the machine.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};
use weir_agent::sandbox::{Cgroup, NetNs, unique_name};

use super::{
    kubelet::{Kubelet, NodeAccess, Objects, PodView, spec::NodeFacts},
    node::Node,
};
use crate::{control_plane::TestCa, kube_api::KubeApi};

/// The API stand-in's address on the underlay, and the token every service account has.
pub const API: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(192, 168, 77, 2)), 6443);
pub const TOKEN: &str = "weir-rig-service-account-token";

/// One node and its kubelet.
pub struct RigNode {
    pub kubelet: Option<Kubelet>,
    pub node: Node,
}

/// The cluster.
pub struct Cluster {
    /// Kubelets and nodes go first (their containers, then namespaces and cgroups).
    pub nodes: Vec<RigNode>,
    pub api: Arc<KubeApi>,
    pub objects: Arc<Objects>,
    /// Pods no kubelet starts until they are taken out again.
    pub held: super::kubelet::Held,
    pub ca: TestCa,
    pub hub: NetNs,
    pub dir: PathBuf,
    next_uid: std::sync::atomic::AtomicU32,
}

fn ip(ns: &NetNs, args: &[&str]) -> anyhow::Result<()> {
    let out = crate::cni::try_run_placed(
        weir_agent::sandbox::Placement { netns: Some(ns), ..Default::default() },
        Command::new("ip"),
        args,
    );
    out.map(drop).map_err(|e| anyhow::anyhow!("ip {args:?}: {e}"))
}

impl Cluster {
    /// A cluster of `count` nodes for `test`, every image imported on every node.
    pub fn new(test: &str, count: u8) -> anyhow::Result<Self> {
        // Short: containerd's sockets live under it (a unix socket path is 104 bytes at most).
        let dir = PathBuf::from("/var/lib/weir-rig").join(unique_name("rig"));
        std::fs::create_dir_all(&dir)?;
        let hub = NetNs::create(&unique_name(&format!("{test}-underlay")))?;
        ip(&hub, &["link", "set", "lo", "up"])?;
        ip(&hub, &["link", "add", "ul0", "type", "bridge"])?;
        ip(&hub, &["addr", "add", "192.168.77.1/24", "dev", "ul0"])?;
        ip(&hub, &["addr", "add", "192.168.77.2/24", "dev", "ul0"])?;
        ip(&hub, &["link", "set", "ul0", "up"])?;
        let ca = TestCa::new("weir-rig cluster CA")?;
        let api = Arc::new(KubeApi::start_on(&hub, API, TOKEN, Some(&ca))?);
        let objects = Arc::new(Objects::default());
        *objects.token.lock().unwrap_or_else(|p| p.into_inner()) = TOKEN.into();
        let mut cluster = Self {
            nodes: Vec::new(),
            api,
            objects,
            held: Default::default(),
            ca,
            hub,
            dir,
            next_uid: std::sync::atomic::AtomicU32::new(1),
        };
        cluster.config_map("*", "kube-root-ca.crt", &[("ca.crt", cluster.ca.root_pem())]);
        for ns in ["default", "kube-system", "istio-system"] {
            cluster.api.set_namespace(ns, &[]);
        }
        for index in 1..=count {
            cluster.add_node(test, index)?;
        }
        let archives: Vec<PathBuf> = ["weir-cni", "weir-cni-next", "weir-init", "weir-proxy-standalone"]
            .iter()
            .map(|i| crate::oci::images_dir().join(format!("{i}.tar")))
            .chain(super::images::build_rig_images()?)
            .collect();
        for a in &archives {
            if !a.exists() {
                bail!(
                    "{} is missing: scripts/image builds Weir's images (scripts/test runs it)",
                    a.display()
                );
            }
        }
        for n in &cluster.nodes {
            for a in &archives {
                n.node.containerd.import(a).with_context(|| format!("on {}", n.node.name))?;
            }
        }
        for i in 0..cluster.nodes.len() {
            cluster.start_kubelet(i)?;
        }
        Ok(cluster)
    }

    fn add_node(&mut self, test: &str, index: u8) -> anyhow::Result<()> {
        let name = format!("node-{index}");
        let netns = NetNs::create(&unique_name(&format!("{test}-{name}")))?;
        let veth = format!("ul-n{index}");
        ip(
            &self.hub,
            &["link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", netns.name()],
        )?;
        ip(&self.hub, &["link", "set", &veth, "master", "ul0", "up"])?;
        let me = super::underlay_ip(index);
        ip(&netns, &["link", "set", "lo", "up"])?;
        ip(&netns, &["addr", "add", &format!("{me}/24"), "dev", "eth0"])?;
        ip(&netns, &["link", "set", "eth0", "up"])?;
        netns
            .run(|| async { std::fs::write("/proc/sys/net/ipv4/ip_forward", "1") })
            .context("run in the node's namespace")??;
        // Every other node's pods through that node, and the other nodes' routes to ours.
        for other in &self.nodes {
            let j = other.node.index;
            ip(&netns, &["route", "add", &super::pod_cidr(j), "via", &super::underlay_ip(j).to_string()])?;
            ip(&other.node.netns, &["route", "add", &super::pod_cidr(index), "via", &me.to_string()])?;
        }
        ip(&self.hub, &["route", "add", &super::pod_cidr(index), "via", &me.to_string()])?;
        let kubepods = Cgroup::create(&unique_name(&format!("{name}-kubepods")))?;
        let node = Node::create(&self.dir, &name, index, netns, kubepods)?;
        self.nodes.push(RigNode { kubelet: None, node });
        Ok(())
    }

    /// The node access a kubelet needs.
    fn access(&self, i: usize) -> anyhow::Result<NodeAccess> {
        let n = &self.nodes[i].node;
        let mount = weir_agent::sandbox::cgroup::cgroup2_mount()?;
        let kubepods = format!("/{}", n.kubepods.path().strip_prefix(&mount)?.display());
        let pods_dir = n.dir.join("kubelet");
        std::fs::create_dir_all(&pods_dir)?;
        Ok(NodeAccess {
            facts: NodeFacts {
                name: n.name.clone(),
                kubepods,
                log_root: n.dir.join("log/pods").display().to_string(),
                resolv_servers: vec!["192.168.77.1".into()],
                resolv_searches: Vec::new(),
            },
            ip: IpAddr::V4(n.ip()),
            root: n.host_path("/"),
            mount_ns: n.mount_ns(),
            netns: n.netns.path().to_path_buf(),
            pods_dir,
            service_env: vec![
                ("KUBERNETES_SERVICE_HOST".into(), API.ip().to_string()),
                ("KUBERNETES_SERVICE_PORT".into(), API.port().to_string()),
                ("KUBERNETES_SERVICE_PORT_HTTPS".into(), API.port().to_string()),
                ("KUBERNETES_PORT".into(), format!("tcp://{API}")),
            ],
        })
    }

    /// Starts (again) node `i`'s kubelet.
    pub fn start_kubelet(&mut self, i: usize) -> anyhow::Result<()> {
        self.nodes[i].kubelet = None;
        let access = self.access(i)?;
        let socket = self.nodes[i].node.containerd.socket.clone();
        self.nodes[i].kubelet =
            Some(Kubelet::start(access, &socket, self.api.clone(), self.objects.clone(), self.held.clone())?);
        Ok(())
    }

    /// A ConfigMap (`namespace` `*`: in every namespace).
    pub fn config_map(&self, namespace: &str, name: &str, data: &[(&str, &str)]) {
        self.objects.config_maps.lock().unwrap_or_else(|p| p.into_inner()).insert(
            (namespace.into(), name.into()),
            data.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        );
    }

    /// A Secret.
    pub fn secret(&self, namespace: &str, name: &str, data: &[(&str, &str)]) {
        self.objects.secrets.lock().unwrap_or_else(|p| p.into_inner()).insert(
            (namespace.into(), name.into()),
            data.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        );
    }

    /// Creates `pod` as the API server would after admission: a UID, `node` (1-based)
    /// as its node, the default service account and its token volume mounted in every
    /// container (unless `automountServiceAccountToken: false`). Returns its UID.
    pub fn create_pod(&self, mut pod: Value, node: u8) -> String {
        let n = self.next_uid.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let uid = format!("{:08x}-rig0-4000-8000-{:012x}", std::process::id(), n);
        pod["apiVersion"] = json!("v1");
        pod["kind"] = json!("Pod");
        pod["metadata"]["uid"] = json!(uid);
        if pod["metadata"]["namespace"].is_null() {
            pod["metadata"]["namespace"] = json!("default");
        }
        pod["spec"]["nodeName"] = json!(format!("node-{node}"));
        if pod["spec"]["serviceAccountName"].is_null() {
            pod["spec"]["serviceAccountName"] = json!("default");
        }
        if pod["spec"]["automountServiceAccountToken"] != json!(false) {
            let volume = "kube-api-access-rig";
            let mut volumes = pod["spec"]["volumes"].as_array().cloned().unwrap_or_default();
            volumes.push(json!({"name": volume, "projected": {"defaultMode": 420, "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}
            ]}}));
            pod["spec"]["volumes"] = json!(volumes);
            for list in ["initContainers", "containers"] {
                if let Some(containers) = pod["spec"].get_mut(list).and_then(Value::as_array_mut) {
                    for c in containers {
                        let mut mounts = c["volumeMounts"].as_array().cloned().unwrap_or_default();
                        if !mounts
                            .iter()
                            .any(|m| m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount")
                        {
                            mounts.push(json!({"name": volume, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}));
                        }
                        c["volumeMounts"] = json!(mounts);
                    }
                }
            }
        }
        pod["status"] = json!({"phase": "Pending"});
        self.api.set_pod(pod);
        uid
    }

    /// Deletes a pod gracefully: its kubelet stops it within `grace` and removes it.
    pub fn delete_pod(&self, namespace: &str, name: &str, grace: Duration) {
        self.api.try_update_pod(namespace, name, |p| {
            p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            p["metadata"]["deletionGracePeriodSeconds"] = json!(grace.as_secs());
        });
    }

    /// Pod `namespace/name` as its node's kubelet runs it.
    pub fn pod_view(&self, namespace: &str, name: &str) -> Option<PodView> {
        self.nodes.iter().filter_map(|n| n.kubelet.as_ref()?.pod(namespace, name)).next()
    }

    /// The pid of container `container` of pod `namespace/name` (the first running
    /// one that is not an init container when `None`), from its node's `ctr tasks ls`.
    pub fn container_pid(&self, namespace: &str, name: &str, container: Option<&str>) -> anyhow::Result<u32> {
        let view = self.pod_view(namespace, name).with_context(|| format!("no pod {namespace}/{name}"))?;
        let id = view
            .containers
            .iter()
            .find(|c| !c.id.is_empty() && c.exited.is_none() && container.map_or(!c.init, |n| c.name == n))
            .map(|c| c.id.clone())
            .with_context(|| format!("{namespace}/{name} has no running container {container:?}"))?;
        for n in &self.nodes {
            let out = n.node.containerd.ctr().args(["tasks", "ls"]).output()?;
            let text = String::from_utf8_lossy(&out.stdout);
            let pid = text.lines().find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next()? == id).then(|| f.next()?.parse().ok()).flatten()
            });
            if let Some(pid) = pid {
                return Ok(pid);
            }
        }
        bail!("no task for {namespace}/{name}'s container {id} on any node")
    }

    /// Waits up to `limit` for the pod to be gone from the API (its kubelet removed it).
    pub fn wait_gone(&self, namespace: &str, name: &str, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        while self.api.pod(namespace, name).is_some() {
            if Instant::now() > deadline {
                bail!(
                    "pod {namespace}/{name}: not gone within {limit:?}; the kubelet sees {:?}",
                    self.pod_view(namespace, name)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Waits up to `limit` for `check` on the pod's status in the API (Ready, ...).
    pub fn wait_pod(
        &self,
        namespace: &str,
        name: &str,
        limit: Duration,
        what: &str,
        check: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<Value> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(p) = self.api.pod(namespace, name)
                && check(&p)
            {
                return Ok(p);
            }
            if Instant::now() > deadline {
                let view = self.pod_view(namespace, name);
                bail!(
                    "pod {namespace}/{name}: not {what} within {limit:?}; the kubelet sees {view:?}; its status {}",
                    self.api.pod(namespace, name).map(|p| p["status"].to_string()).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A container's log lines (the runtime's log files: the message part), from every
    /// node and every incarnation of the pod (a deleted pod's too: kubelet's log
    /// folders outlive it here).
    pub fn container_log(&self, namespace: &str, name: &str, container: &str) -> Vec<String> {
        let prefix = format!("{namespace}_{name}_");
        let mut files: Vec<PathBuf> = Vec::new();
        for n in &self.nodes {
            let Ok(pods) = std::fs::read_dir(n.node.dir.join("log/pods")) else { continue };
            for pod in pods.flatten() {
                if !pod.file_name().to_string_lossy().starts_with(&prefix) {
                    continue;
                }
                let Ok(entries) = std::fs::read_dir(pod.path().join(container)) else { continue };
                files.extend(entries.flatten().map(|e| e.path()));
            }
        }
        files.sort();
        let mut lines = Vec::new();
        for f in files {
            for l in std::fs::read_to_string(&f).unwrap_or_default().lines() {
                // CRI log format: <time> <stream> <P|F> <message>
                let mut parts = l.splitn(4, ' ');
                let msg = parts.nth(3).unwrap_or_default();
                lines.push(msg.to_string());
            }
        }
        lines
    }

    /// The rig's folder for `node` (1-based).
    pub fn node(&self, index: u8) -> &Node {
        &self.nodes[usize::from(index - 1)].node
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.kubelet = None;
        }
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Weir's CNI DaemonSet as `kubectl apply -k agent/deploy` creates it, on a cluster.
impl Cluster {
    /// The DaemonSet's pod for node `index` running image `image` (kustomize's image
    /// setting), with the one path that must point into the node's own folders
    /// re-rooted: `WEIR_EBPF_CGROUP`, the node's pods' cgroup (a `kubepods` of its own
    /// under this host's cgroup2 mount, /sys/fs/cgroup/unified). Everything else is the
    /// manifest's: hostPaths resolve in the node's own mount namespace.
    pub fn daemonset_pod(&self, index: u8, image: &str) -> anyhow::Result<Value> {
        let spec = crate::daemonset::pod_spec();
        let text = std::fs::read_to_string(crate::daemonset::manifest_path())?;
        let ds: Value = serde_yaml_ng::Deserializer::from_str(&text)
            .map(|d| serde::Deserialize::deserialize(d).expect("the manifest is YAML"))
            .find(|doc: &Value| doc["kind"] == "DaemonSet")
            .context("the manifest has a DaemonSet")?;
        let node = self.node(index);
        let mount = weir_agent::sandbox::cgroup::cgroup2_mount()?;
        let kubepods = Path::new("/sys/fs/cgroup").join(node.kubepods.path().strip_prefix("/sys/fs/cgroup")?);
        debug_assert!(node.kubepods.path().starts_with(&mount));
        let mut spec = spec;
        for c in spec["containers"].as_array_mut().context("containers")? {
            if c["image"] == "weir-cni" {
                c["image"] = json!(image);
            }
            for e in c["env"].as_array_mut().into_iter().flatten() {
                if e["name"] == "WEIR_EBPF_CGROUP" {
                    e["value"] = json!(kubepods.display().to_string());
                }
            }
        }
        let meta = &ds["spec"]["template"]["metadata"];
        Ok(json!({
            "metadata": {"name": format!("weir-cni-node-{index}"), "namespace": ds["metadata"]["namespace"],
                         "labels": meta["labels"], "annotations": meta["annotations"]},
            "spec": spec,
        }))
    }

    /// Creates the DaemonSet's ServiceAccount tokens (the agent's and the plugin's
    /// read-only one, as the manifest's Secret), its ConfigMap, and its pod on every
    /// node.
    pub fn apply_daemonset(&self, image: &str) -> anyhow::Result<()> {
        let all: Vec<u8> = self.nodes.iter().map(|n| n.node.index).collect();
        self.apply_daemonset_on(image, &all)
    }

    /// [`apply_daemonset`] on `nodes` only (a node selector that the others do not
    /// match).
    ///
    /// [`apply_daemonset`]: Self::apply_daemonset
    pub fn apply_daemonset_on(&self, image: &str, nodes: &[u8]) -> anyhow::Result<()> {
        let plugin_token = "weir-rig-plugin-read-only-token";
        self.api.allow_reads_with(plugin_token);
        self.secret(
            "kube-system",
            "weir-cni-plugin-token",
            &[("token", plugin_token), ("ca.crt", self.ca.root_pem()), ("namespace", "kube-system")],
        );
        let data = crate::daemonset::config_map_data();
        let data: Vec<(&str, &str)> = data.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        self.config_map("kube-system", "weir-cni-config", &data);
        for &index in nodes {
            let pod = self.daemonset_pod(index, image)?;
            self.create_pod(pod, index);
        }
        Ok(())
    }
}
