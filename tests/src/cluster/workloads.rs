//! What runs on the cluster besides Weir's DaemonSet: istiod (the test control plane,
//! `weir-rig istiod`, as a pod), and workloads — pods as Istio's injector writes them
//! (the goldens in `tests/testdata/istio-inject`) with Weir's images as
//! `istio-init`/`istio-proxy` and a 3 s app readiness timeout (as the injector writes a
//! pod whose probe has one), ambient pods, plain pods — each running `weir-rig app`
//! and a `weir-rig client` that calls the targets the test gives it. The traffic
//! verdict reads their logs: a meshed pod's connection whose other end is not a socket
//! of the pod (its proxy) is a bypass, at either end.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use anyhow::Context as _;
use serde_json::{Value, json};

use super::{images::RIG_IMAGE, rig::Cluster};

/// The port every app listens on (the goldens' `hello` container's), and the one its
/// probes are rewritten to reach.
pub const APP_PORT: u16 = 80;
const PROBE_PORT: u16 = 8000;
/// Every app readiness probe's `timeoutSeconds` in the rig: 3, not Kubernetes' 1. The
/// rig counts every failed probe (not `failureThreshold`'s three in a row), and on two
/// cores with 20 pods starting at once an answer once took 1.06 s (an ambient pod's) and
/// once over 1 s (a sidecar pod's, through the agent). A probe the capture misroutes or
/// drops for good still fails; one dropped SYN passes on the retransmit.
const PROBE_TIMEOUT_SECONDS: u64 = 3;
/// Istio's `HOST_PROBE_SNAT_IP` default: the node's kubelet probes of ambient pods come
/// from it.
const KUBELET_PROBE_SNAT: &str = "169.254.7.127";
pub const PROXY_IMAGE: &str = "localhost/weir-proxy-standalone:dev";
pub const INIT_IMAGE: &str = "localhost/weir-init:dev";
pub const ISTIOD_SAN: &str = "istiod.istio-system.svc";

/// Writes the rig's probe timeout into the proxy's `ISTIO_KUBE_APP_PROBERS` entry for
/// the readiness probe of each of `containers` (`/app-health/<name>/readyz`), as Istio's
/// injector does for an app readiness probe with `timeoutSeconds`
/// (`pkg/kube/inject/app_probe.go`, `DumpAppProbers`): the agent's forward to the app
/// then waits as long as the kubelet. Other entries (liveness, startup, lifecycle) are
/// left as the golden has them.
fn with_app_probe_timeout(proxy: &mut Value, containers: &[String]) -> anyhow::Result<()> {
    let Some(env) = proxy["env"].as_array_mut() else { return Ok(()) };
    for var in env.iter_mut().filter(|v| v["name"] == "ISTIO_KUBE_APP_PROBERS") {
        let text = var["value"].as_str().context("ISTIO_KUBE_APP_PROBERS has a value")?;
        let mut probers: Value = serde_json::from_str(text).context("ISTIO_KUBE_APP_PROBERS is JSON")?;
        for name in containers {
            let prober = &mut probers[format!("/app-health/{name}/readyz")];
            if prober.is_object() {
                prober["timeoutSeconds"] = json!(PROBE_TIMEOUT_SECONDS);
            }
        }
        var["value"] = json!(probers.to_string());
    }
    Ok(())
}

/// How a sidecar pod is captured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capture {
    /// The injector's `istio-init` (Weir's weir-init image) programs the rules.
    InitContainer,
    /// The CNI plugin captures it; the injector writes `istio-validation` instead.
    Cni,
}

/// Where the injector puts `istio-proxy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sidecar {
    /// An init container with `restartPolicy: Always` (Istio's default since 1.27).
    Native,
    /// A regular container, as before.
    Classic,
}

/// What kind a workload is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Sidecar(Capture, Sidecar),
    Ambient,
    Plain,
}

impl Kind {
    pub fn meshed(&self) -> bool {
        !matches!(self, Kind::Plain)
    }
}

/// A workload of the cluster.
#[derive(Debug, Clone)]
pub struct Workload {
    pub name: String,
    pub namespace: String,
    pub node: u8,
    pub kind: Kind,
    pub ip: Option<IpAddr>,
    /// The container the rig's app runs in (the golden's name for it in an injected
    /// pod, `app` elsewhere).
    pub app: String,
}

impl Workload {
    pub fn addr(&self) -> Option<SocketAddr> {
        self.ip.map(|ip| SocketAddr::new(ip, APP_PORT))
    }
}

/// The folders the rig shares with its pods (hostPath volumes).
fn shared_dir(cluster: &Cluster, what: &str) -> anyhow::Result<PathBuf> {
    let dir = cluster.dir().join(what);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

impl Cluster {
    /// Starts istiod on node `node`: its serving certificate (for
    /// `istiod.istio-system.svc`) from the cluster CA, whose root every pod trusts
    /// through the `istio-ca-root-cert` ConfigMap; `mtls` the mesh's PeerAuthentication
    /// (`strict` or `permissive`). Returns its address once it is Ready.
    pub fn start_istiod(&self, node: u8, mtls: &str) -> anyhow::Result<IpAddr> {
        let dir = shared_dir(self, "istiod")?;
        let address = self.node(node).ip().to_string();
        let (chain, key) =
            self.ca.server_cert(&[ISTIOD_SAN, &format!("{ISTIOD_SAN}.cluster.local"), &address])?;
        std::fs::write(dir.join("serving.pem"), chain)?;
        std::fs::write(dir.join("serving-key.pem"), key)?;
        std::fs::write(dir.join("token"), super::rig::TOKEN)?;
        std::fs::write(dir.join("mesh.yaml"), format!("mtls: {mtls}\nservices: []\n"))?;
        self.config_map("*", "istio-ca-root-cert", &[("root-cert.pem", self.ca.root_pem())]);
        self.create_pod(
            json!({"metadata": {"name": "istiod", "namespace": "istio-system", "labels": {"app": "istiod"}},
                   // On the node's network: its address is known before it starts, so its
                   // serving certificate can name it (ztunnel dials istiod by address).
                   "spec": {"hostNetwork": true,
                     "containers": [{"name": "discovery", "image": RIG_IMAGE, "args": ["istiod", "/etc/istiod"],
                       "ports": [{"containerPort": 15012}],
                       "readinessProbe": {"tcpSocket": {"port": 15012}, "periodSeconds": 1},
                       "volumeMounts": [{"name": "config", "mountPath": "/etc/istiod"}]}],
                     "volumes": [{"name": "config", "hostPath": {"path": dir.display().to_string(), "type": "Directory"}}]}}),
            node,
        );
        let pod = self.wait_pod("istio-system", "istiod", Duration::from_secs(120), "Ready", ready)?;
        pod["status"]["podIP"].as_str().context("istiod's IP")?.parse().context("istiod's IP")
    }

    /// ztunnel on every node, as Istio's ztunnel DaemonSet runs it (its own network
    /// namespace, `NET_ADMIN`, `SYS_ADMIN`, `NET_RAW`, the ZDS socket folder
    /// `/var/run/ztunnel` from the node, its token and istiod's root), its workloads from
    /// istiod's workload discovery at `istiod`, its certificates from its built-in
    /// test CA (`FAKE_CA`: every ztunnel shares that root, so HBONE between nodes is
    /// mutual TLS).
    pub fn start_ztunnels(&self, istiod: IpAddr) -> anyhow::Result<()> {
        let all: Vec<u8> = self.nodes.iter().map(|n| n.node.index).collect();
        self.start_ztunnels_on(istiod, &all)
    }

    /// [`start_ztunnels`] on `nodes` only.
    ///
    /// [`start_ztunnels`]: Self::start_ztunnels
    pub fn start_ztunnels_on(&self, istiod: IpAddr, nodes: &[u8]) -> anyhow::Result<()> {
        for &i in nodes {
            let field = |path: &str| json!({"fieldRef": {"fieldPath": path}});
            self.create_pod(
                json!({"metadata": {"name": format!("ztunnel-{i}"), "namespace": "istio-system", "labels": {"app": "ztunnel"}},
                   "spec": {"serviceAccountName": "ztunnel", "terminationGracePeriodSeconds": 5,
                     "containers": [{"name": "istio-proxy", "image": super::images::ZTUNNEL_IMAGE, "args": ["proxy", "ztunnel"],
                       "env": [
                         {"name": "CLUSTER_ID", "value": "Kubernetes"},
                         {"name": "FAKE_CA", "value": "true"},
                         {"name": "XDS_ADDRESS", "value": format!("https://{istiod}:15012")},
                         {"name": "XDS_ROOT_CA", "value": "/var/run/secrets/istio/root-cert.pem"},
                         {"name": "RUST_LOG", "value": "info"},
                         {"name": "NODE_NAME", "valueFrom": field("spec.nodeName")},
                         {"name": "POD_NAME", "valueFrom": field("metadata.name")},
                         {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
                         {"name": "INSTANCE_IP", "valueFrom": field("status.podIP")},
                         {"name": "SERVICE_ACCOUNT", "valueFrom": field("spec.serviceAccountName")}],
                       "readinessProbe": {"httpGet": {"path": "/healthz/ready", "port": 15021}, "periodSeconds": 1},
                       "securityContext": {"privileged": false, "runAsUser": 0, "runAsGroup": 1337, "readOnlyRootFilesystem": true,
                         "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "SYS_ADMIN", "NET_RAW"]}},
                       "volumeMounts": [
                         {"name": "istiod-ca-cert", "mountPath": "/var/run/secrets/istio"},
                         {"name": "istio-token", "mountPath": "/var/run/secrets/tokens"},
                         {"name": "cni-ztunnel-sock-dir", "mountPath": "/var/run/ztunnel"},
                         {"name": "tmp", "mountPath": "/tmp"}]}],
                     "volumes": [
                       {"name": "istio-token", "projected": {"sources": [{"serviceAccountToken": {"audience": "istio-ca", "expirationSeconds": 43200, "path": "istio-token"}}]}},
                       {"name": "istiod-ca-cert", "configMap": {"name": "istio-ca-root-cert"}},
                       {"name": "cni-ztunnel-sock-dir", "hostPath": {"path": "/var/run/ztunnel", "type": "DirectoryOrCreate"}},
                       {"name": "tmp", "emptyDir": {}}]}}),
                i,
            );
        }
        for &i in nodes {
            self.wait_pod("istio-system", &format!("ztunnel-{i}"), Duration::from_secs(120), "Ready", ready)?;
        }
        Ok(())
    }

    /// The ambient workloads istiod tells ztunnel about.
    pub fn set_ambient_workloads(&self, workloads: &[&Workload]) -> anyhow::Result<()> {
        let list: Vec<Value> = workloads
            .iter()
            .filter_map(|w| {
                Some(json!({"name": w.name, "namespace": w.namespace, "ip": w.ip?.to_string(),
                            "node": format!("node-{}", w.node), "serviceAccount": "default"}))
            })
            .collect();
        let path = shared_dir(self, "istiod")?.join("workloads.json");
        std::fs::write(path.with_extension("tmp"), serde_json::to_vec(&list)?)?;
        std::fs::rename(path.with_extension("tmp"), &path)?;
        Ok(())
    }

    /// The services istiod serves: each sidecar server by its own address (clients call
    /// pods by IP: the rig has no Service VIPs without kube-proxy).
    pub fn set_mesh_services(&self, servers: &[&Workload], mtls: &str) -> anyhow::Result<()> {
        let mut text = format!("mtls: {mtls}\nservices:\n");
        for w in servers {
            let Some(ip) = w.ip else { continue };
            text.push_str(&format!(
                "- name: {}\n  namespace: {}\n  serviceAccount: default\n  address: {ip}\n  port: {APP_PORT}\n  endpoints: [\"{ip}:{APP_PORT}\"]\n",
                w.name, w.namespace
            ));
        }
        let path = shared_dir(self, "istiod")?.join("mesh.yaml");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    /// The targets `client`'s client calls (read again every round): `ip:port`, or
    /// `ip:port/path`.
    pub fn set_targets(&self, client: &str, targets: &[impl std::fmt::Display]) -> anyhow::Result<()> {
        let dir = shared_dir(self, &format!("targets/{client}"))?;
        let text: String = targets.iter().map(|t| format!("{t}\n")).collect();
        std::fs::write(dir.join("targets.tmp"), text)?;
        std::fs::rename(dir.join("targets.tmp"), dir.join("targets"))?;
        Ok(())
    }

    /// The rig's app and client containers for workload `name`.
    fn rig_containers(&self, name: &str) -> anyhow::Result<(Value, Value, Value)> {
        let targets = shared_dir(self, &format!("targets/{name}"))?;
        if !targets.join("targets").exists() {
            std::fs::write(targets.join("targets"), "")?;
        }
        let app = json!({"name": "app", "image": RIG_IMAGE, "args": ["app", name, APP_PORT.to_string(), PROBE_PORT.to_string()],
                         "ports": [{"containerPort": APP_PORT, "name": "http"}]});
        let client = json!({"name": "client", "image": RIG_IMAGE, "args": ["client", name, "300", "/etc/rig/targets"],
                            "volumeMounts": [{"name": "rig-targets", "mountPath": "/etc/rig"}]});
        let volume = json!({"name": "rig-targets", "hostPath": {"path": targets.display().to_string(), "type": "Directory"}});
        Ok((app, client, volume))
    }

    /// A pod as Istio's injector writes `golden` (a file of tests/testdata/istio-inject),
    /// named `name`, with Weir's images as `istio-init` and `istio-proxy`, the rig's app
    /// in place of the app's image (its readiness probe given the rig's 3 s timeout, in
    /// the pod and in `ISTIO_KUBE_APP_PROBERS`) and a client beside it,
    /// `istiod.istio-system.svc` resolving to `istiod` (a hostAlias: the rig has no DNS),
    /// captured as `capture` says, the sidecar placed as `sidecar` says.
    pub fn sidecar_pod(
        &self,
        golden: &str,
        name: &str,
        node: u8,
        capture: Capture,
        sidecar: Sidecar,
        istiod: IpAddr,
    ) -> anyhow::Result<Workload> {
        let path = crate::inject::manifest::testdata_dir().join(golden);
        let text = std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        let doc: Value = serde_yaml_ng::Deserializer::from_str(&text)
            .map(|d| serde::Deserialize::deserialize(d).expect("YAML"))
            .find(|d: &Value| !d.is_null())
            .context("an injected pod")?;
        let (mut meta, mut spec) = match doc["kind"].as_str() {
            Some("Deployment") => {
                (doc["spec"]["template"]["metadata"].clone(), doc["spec"]["template"]["spec"].clone())
            }
            _ => (doc["metadata"].clone(), doc["spec"].clone()),
        };
        meta["name"] = json!(name);
        meta["namespace"] = json!("default");
        let (app, client, volume) = self.rig_containers(name)?;
        // The app's containers: the rig's app (the golden's probes, rewritten to the
        // agent's status port, reach it there) and its client.
        let mut containers: Vec<Value> = Vec::new();
        let mut app_container = None;
        let mut probed: Vec<String> = Vec::new();
        for c in spec["containers"].as_array().cloned().unwrap_or_default() {
            if c["name"] == "istio-proxy" {
                containers.push(c);
                continue;
            }
            app_container.get_or_insert_with(|| c["name"].as_str().unwrap_or("app").to_string());
            let mut c = c;
            c["image"] = app["image"].clone();
            c["args"] = json!(["app", name, APP_PORT.to_string(), PROBE_PORT.to_string()]);
            if c["readinessProbe"].is_object() {
                c["readinessProbe"]["timeoutSeconds"] = json!(PROBE_TIMEOUT_SECONDS);
                probed.push(c["name"].as_str().unwrap_or_default().to_string());
            }
            containers.push(c);
        }
        containers.push(client);
        let mut inits: Vec<Value> = spec["initContainers"].as_array().cloned().unwrap_or_default();
        for c in inits.iter_mut().chain(containers.iter_mut()) {
            match c["name"].as_str() {
                Some("istio-proxy") => {
                    c["image"] = json!(PROXY_IMAGE);
                    with_app_probe_timeout(c, &probed)?;
                }
                Some("istio-init") => c["image"] = json!(INIT_IMAGE),
                _ => {}
            }
        }
        if capture == Capture::Cni {
            // The injector with `pilot.cni.enabled`: istio-validation in istio-init's
            // place, run as the proxy user, no capabilities: it only checks the rules.
            for c in inits.iter_mut().filter(|c| c["name"] == "istio-init") {
                c["name"] = json!("istio-validation");
                let mut args = c["args"].as_array().cloned().unwrap_or_default();
                args.push(json!("--run-validation"));
                args.push(json!("--skip-rule-apply"));
                c["args"] = json!(args);
                c["securityContext"] = json!({"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
                    "privileged": false, "readOnlyRootFilesystem": true, "runAsGroup": 1337, "runAsNonRoot": true, "runAsUser": 1337});
            }
        }
        if sidecar == Sidecar::Classic {
            // Before 1.27: istio-proxy first among the containers, no restartPolicy, and
            // no preStop drain: the injection template writes that hook only for a
            // native sidecar, which the kubelet stops after the app (a classic one is
            // stopped with it, and drains for terminationDrainDuration on SIGTERM).
            if let Some(i) = inits.iter().position(|c| c["name"] == "istio-proxy") {
                let mut proxy = inits.remove(i);
                proxy.as_object_mut().map(|o| o.remove("restartPolicy"));
                if proxy["lifecycle"]["preStop"]["exec"]["command"]
                    .as_array()
                    .is_some_and(|c| c.iter().any(|a| a == "drain"))
                {
                    proxy.as_object_mut().map(|o| o.remove("lifecycle"));
                }
                containers.insert(0, proxy);
            }
        }
        spec["initContainers"] = json!(inits);
        spec["containers"] = json!(containers);
        let mut volumes = spec["volumes"].as_array().cloned().unwrap_or_default();
        volumes.push(volume);
        spec["volumes"] = json!(volumes);
        spec["hostAliases"] = json!([{"ip": istiod.to_string(), "hostnames": [ISTIOD_SAN]}]);
        if capture == Capture::Cni {
            let status = meta["annotations"]["sidecar.istio.io/status"]
                .as_str()
                .unwrap_or_default()
                .replace("istio-init", "istio-validation");
            meta["annotations"]["sidecar.istio.io/status"] = json!(status);
        }
        self.create_pod(json!({"metadata": meta, "spec": spec}), node);
        Ok(Workload {
            name: name.into(),
            namespace: "default".into(),
            node,
            kind: Kind::Sidecar(capture, sidecar),
            ip: None,
            app: app_container.context("the golden has an app container")?,
        })
    }

    /// A pod with the rig's app and client and nothing of the mesh; `ambient` labels it
    /// into the mesh's ambient mode.
    pub fn app_pod(&self, name: &str, node: u8, ambient: bool) -> anyhow::Result<Workload> {
        let (mut app, client, volume) = self.rig_containers(name)?;
        // The kubelet's readiness probe, from the node: for an ambient pod it is the
        // node's probe SNAT that lets it past ztunnel's inbound capture.
        app["readinessProbe"] = json!({"httpGet": {"path": "/", "port": PROBE_PORT}, "periodSeconds": 1,
                                       "timeoutSeconds": PROBE_TIMEOUT_SECONDS});
        let mut labels = json!({"app": name});
        if ambient {
            labels["istio.io/dataplane-mode"] = json!("ambient");
        }
        self.create_pod(
            json!({"metadata": {"name": name, "namespace": "default", "labels": labels},
                   "spec": {"containers": [app, client], "volumes": [volume]}}),
            node,
        );
        Ok(Workload {
            name: name.into(),
            namespace: "default".into(),
            node,
            kind: if ambient { Kind::Ambient } else { Kind::Plain },
            ip: None,
            app: "app".into(),
        })
    }

    /// Waits for `w` to be Ready; fills in its address.
    pub fn wait_ready(&self, w: &mut Workload, limit: Duration) -> anyhow::Result<()> {
        let pod = self.wait_pod(&w.namespace, &w.name, limit, "Ready", ready)?;
        w.ip = pod["status"]["podIP"].as_str().and_then(|ip| ip.parse().ok());
        Ok(())
    }

    /// What the workloads' logs say since `since` (ms).
    pub fn traffic(&self, workloads: &[&Workload], since: u128) -> Traffic {
        let mut t = Traffic::default();
        let stamped = |line: &str| -> Option<(u128, String)> {
            let (ms, rest) = line.split_once(' ')?;
            Some((ms.parse().ok()?, rest.to_string()))
        };
        for w in workloads {
            for (ms, line) in
                self.container_log(&w.namespace, &w.name, &w.app).iter().filter_map(|l| stamped(l))
            {
                if ms < since || !line.starts_with("conn ") {
                    continue;
                }
                // The kubelet's probes of an ambient pod come from the node's probe SNAT
                // address and are let past ztunnel by design (Istio's host probe rule).
                let probe = line.contains(&format!("peer={KUBELET_PROBE_SNAT}:"));
                if w.kind.meshed() && line.contains("via=network") && !probe {
                    t.bypasses.push(format!("{} (server) at {ms}: {line}", w.name));
                }
            }
            for (ms, line) in
                self.container_log(&w.namespace, &w.name, "client").iter().filter_map(|l| stamped(l))
            {
                if ms < since {
                    continue;
                }
                let target = line
                    .split_whitespace()
                    .find_map(|f| f.strip_prefix("target="))
                    .unwrap_or("?")
                    .to_string();
                if line.starts_with("ok ") {
                    t.ok += 1;
                    *t.answered.entry((w.name.clone(), target.clone())).or_default() += 1;
                    if w.kind.meshed() && line.contains("via=network") {
                        t.bypasses.push(format!("{} (client) at {ms}: {line}", w.name));
                    }
                    if !w.kind.meshed() {
                        *t.plain
                            .entry(if line.contains("via=network") { "network" } else { "proxy" })
                            .or_default() += 1;
                    }
                } else if line.starts_with("fail ") {
                    *t.failures.entry((w.name.clone(), target.clone())).or_default() += 1;
                    t.failure_lines.entry((w.name.clone(), target)).or_insert_with(|| format!("{ms} {line}"));
                }
            }
        }
        t
    }
}

/// Whether a pod's status says Ready.
pub fn ready(p: &Value) -> bool {
    p["status"]["conditions"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
}

/// The traffic between workloads since a mark.
#[derive(Debug, Default)]
pub struct Traffic {
    /// Connections of a meshed pod that did not go through its proxy, at either end.
    pub bypasses: Vec<String>,
    /// Failed requests by (client, target).
    pub failures: BTreeMap<(String, String), usize>,
    /// The first failure's log line, by (client, target).
    pub failure_lines: BTreeMap<(String, String), String>,
    pub ok: usize,
    /// Answered requests by (client, target).
    pub answered: BTreeMap<(String, String), usize>,
    /// The plain pods' answered requests by what the check saw (`network`, `proxy`):
    /// the control that shows the check sees a connection with no proxy in its pod.
    pub plain: BTreeMap<&'static str, usize>,
}

impl Traffic {
    /// Asserts the check saw every plain pod's connection leave without a proxy, and
    /// that there were some: a check that always says "proxy" fails here.
    pub fn assert_control(&self) {
        assert!(
            self.plain.get("network").copied().unwrap_or(0) > 0,
            "no plain pod's request answered: {self:?}"
        );
        assert_eq!(self.plain.get("proxy"), None, "a plain pod's connection seen as proxied: {self:?}");
    }
}
