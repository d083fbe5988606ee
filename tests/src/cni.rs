//! The CNI side of the rig: a small container runtime that executes a conflist as the
//! CNI spec says (each plugin exec'd with `CNI_*` env and its config on stdin,
//! `prevResult` threaded through ADD, DEL in reverse, CHECK with the cached result),
//! run inside a test "node" namespace so the reference plugins' bridge never touches
//! the host; and a test Kubernetes API server (`TestApiServer`) that serves Pod
//! objects over HTTP or HTTPS with a bearer token, as the plugin's kubeconfig names it.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Arc, Mutex},
};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use crate::{Placement, envoy::tempfile_dir::Dir, tools};
use weir_agent::sandbox::NetNs;

/// Where Debian's containernetworking-plugins live.
pub const REFERENCE_PLUGINS: &str = "/usr/lib/cni";

/// A plugin's failure: which plugin, its exit, and the error JSON it printed.
#[derive(Debug)]
pub struct CniFailure {
    pub plugin: String,
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl CniFailure {
    /// The spec's error object from stdout.
    pub fn error(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or(Value::Null)
    }
}

impl std::fmt::Display for CniFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} exited {:?}: stdout {} stderr {}",
            self.plugin,
            self.code,
            self.stdout.trim(),
            self.stderr.trim()
        )
    }
}

impl std::error::Error for CniFailure {}

/// One container's attachment.
#[derive(Debug, Clone)]
pub struct Attachment {
    pub container_id: String,
    pub netns: PathBuf,
    pub ifname: String,
    /// `CNI_ARGS`.
    pub args: String,
}

impl Attachment {
    /// A Kubernetes pod's attachment, as kubelet's runtime passes it.
    pub fn pod(container_id: &str, netns: &Path, namespace: &str, name: &str) -> Self {
        Self {
            container_id: container_id.into(),
            netns: netns.into(),
            ifname: "eth0".into(),
            args: format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID={container_id};K8S_POD_UID=uid-{name}"
            ),
        }
    }
}

/// One plugin's run: `CLOCK_MONOTONIC` (ns) just before it was spawned and just after
/// it was reaped, and what it wrote to stderr.
#[derive(Debug, Clone)]
pub struct PluginRun {
    pub plugin: String,
    pub spawned_ns: u64,
    pub exited_ns: u64,
    pub stderr: String,
}

/// Executes conflists inside `node`.
pub struct CniRuntime<'a> {
    pub node: &'a NetNs,
    /// Searched in order for each plugin's `type`: Weir's link dir, then the reference plugins.
    pub path: Vec<PathBuf>,
    /// Variables every plugin gets besides the spec's (e.g. another build's program set).
    pub env: Vec<(String, String)>,
    bin: Dir,
}

impl<'a> CniRuntime<'a> {
    /// Links the plugin binary (`weir-cni`, as `weir cni install` installs it) as
    /// `istio-cni` and `weir-cni` into a plugin dir ahead of the reference plugins.
    pub fn new(node: &'a NetNs) -> anyhow::Result<Self> {
        let bin = Dir::new("cni-bin")?;
        for name in ["istio-cni", "weir-cni"] {
            std::os::unix::fs::symlink(tools::weir_cni(), bin.path().join(name))?;
        }
        Ok(Self {
            node,
            path: vec![bin.path().to_path_buf(), REFERENCE_PLUGINS.into()],
            env: Vec::new(),
            bin,
        })
    }

    pub fn bin_dir(&self) -> &Path {
        self.bin.path()
    }

    fn find(&self, plugin_type: &str) -> anyhow::Result<PathBuf> {
        self.path
            .iter()
            .map(|d| d.join(plugin_type))
            .find(|p| p.exists())
            .with_context(|| format!("no CNI plugin {plugin_type:?} in {:?}", self.path))
    }

    /// Execs one plugin with `stdin`; its stdout on success.
    pub fn exec(
        &self,
        plugin_type: &str,
        command: &str,
        a: &Attachment,
        stdin: &[u8],
    ) -> Result<String, CniFailure> {
        self.exec_traced(plugin_type, command, a, stdin).map(|(stdout, _)| stdout)
    }

    /// [`CniRuntime::exec`], with when the plugin was spawned and reaped and its stderr.
    pub fn exec_traced(
        &self,
        plugin_type: &str,
        command: &str,
        a: &Attachment,
        stdin: &[u8],
    ) -> Result<(String, PluginRun), CniFailure> {
        let fail = |stdout: String, stderr: String, code| CniFailure {
            plugin: plugin_type.into(),
            code,
            stdout,
            stderr,
        };
        let binary = self.find(plugin_type).map_err(|e| fail(String::new(), e.to_string(), None))?;
        let path = self.path.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(":");
        let mut cmd = Command::new(&binary);
        cmd.env_clear()
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &a.container_id)
            .env("CNI_NETNS", &a.netns)
            .env("CNI_IFNAME", &a.ifname)
            .env("CNI_ARGS", &a.args)
            .env("CNI_PATH", path)
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let spawned_ns = weir_agent::node::cni::phases::now_ns();
        let child = weir_agent::sandbox::process::spawn(
            &mut cmd,
            Placement { netns: Some(self.node), ..Placement::default() },
        )
        .map_err(|e| fail(String::new(), e.to_string(), None))?;
        let mut child = child.into_inner();
        {
            use std::io::Write as _;
            let mut input = child.stdin.take().expect("piped stdin");
            let _ = input.write_all(stdin);
        }
        let out = child.wait_with_output().map_err(|e| fail(String::new(), e.to_string(), None))?;
        let exited_ns = weir_agent::node::cni::phases::now_ns();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() {
            return Err(fail(stdout, stderr, out.status.code()));
        }
        Ok((stdout, PluginRun { plugin: plugin_type.into(), spawned_ns, exited_ns, stderr }))
    }

    /// The config the runtime gives `plugin` of `list`, with `prev` as prevResult.
    pub fn plugin_config(list: &Value, plugin: &Value, prev: Option<&Value>) -> Value {
        let mut conf = plugin.clone();
        conf["cniVersion"] = list["cniVersion"].clone();
        conf["name"] = list["name"].clone();
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        conf
    }

    /// ADD through the list; the final result.
    pub fn add(&self, list: &Value, a: &Attachment) -> Result<Value, CniFailure> {
        self.add_traced(list, a).map(|(result, _)| result)
    }

    /// [`CniRuntime::add`], with each plugin's run.
    pub fn add_traced(&self, list: &Value, a: &Attachment) -> Result<(Value, Vec<PluginRun>), CniFailure> {
        let mut prev: Option<Value> = None;
        let mut runs = Vec::new();
        for plugin in list["plugins"].as_array().into_iter().flatten() {
            let conf = Self::plugin_config(list, plugin, prev.as_ref());
            let (out, run) = self.exec_traced(
                plugin["type"].as_str().unwrap_or_default(),
                "ADD",
                a,
                conf.to_string().as_bytes(),
            )?;
            runs.push(run);
            prev = Some(serde_json::from_str(&out).map_err(|e| CniFailure {
                plugin: plugin["type"].to_string(),
                code: Some(0),
                stdout: out.clone(),
                stderr: format!("the result is not JSON: {e}"),
            })?);
        }
        Ok((prev.unwrap_or(Value::Null), runs))
    }

    /// DEL through the list in reverse, with the cached result.
    pub fn del(&self, list: &Value, a: &Attachment, result: Option<&Value>) -> Result<(), CniFailure> {
        for plugin in list["plugins"].as_array().into_iter().flatten().rev() {
            let conf = Self::plugin_config(list, plugin, result);
            self.exec(plugin["type"].as_str().unwrap_or_default(), "DEL", a, conf.to_string().as_bytes())?;
        }
        Ok(())
    }

    /// CHECK through the list with the cached result.
    pub fn check(&self, list: &Value, a: &Attachment, result: &Value) -> Result<(), CniFailure> {
        for plugin in list["plugins"].as_array().into_iter().flatten() {
            let conf = Self::plugin_config(list, plugin, Some(result));
            self.exec(plugin["type"].as_str().unwrap_or_default(), "CHECK", a, conf.to_string().as_bytes())?;
        }
        Ok(())
    }
}

/// `weir cni <verb>` (install, uninstall, ...) as a node's DaemonSet agent runs it,
/// the build under test's: node capture `name` on `cgroup`, the host's CNI folders
/// under `host` (`net.d`, `bin`, `run`), the plugin's kubeconfig from `kubeconfig`.
pub fn node_agent_command(verb: &str, host: &Path, cgroup: &Path, name: &str, kubeconfig: &Path) -> Command {
    let mut cmd = tools::weir_command();
    cmd.args(["cni", verb, "--ebpf-name", name])
        .arg("--ebpf-cgroup")
        .arg(cgroup)
        .arg("--cni-net-dir")
        .arg(host.join("net.d"))
        .arg("--cni-bin-dir")
        .arg(host.join("bin"))
        .arg("--run-dir")
        .arg(host.join("run"))
        .arg("--kubeconfig")
        .arg(kubeconfig);
    cmd
}

/// `bridge` + `host-local` (state in `ipam_dir`) then Weir as `istio-cni` with `weir`'s
/// fields: a cluster's conflist with Istio chained last.
pub fn conflist(subnet: &str, ipam_dir: &Path, weir: Value) -> Value {
    let mut istio = json!({"type": "istio-cni"});
    for (k, v) in weir.as_object().into_iter().flatten() {
        istio[k] = v.clone();
    }
    json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": true,
                "ipMasq": false,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]], "dataDir": ipam_dir}
            },
            istio
        ]
    })
}

/// A Pod object as the API server returns it: containers `app` and (unless
/// `sidecar` is false) `istio-proxy` with `env`, `sidecar.istio.io/status` when
/// injected, plus `annotations`.
pub fn pod_object(
    namespace: &str,
    name: &str,
    sidecar: bool,
    annotations: &[(&str, &str)],
    env: &[(&str, &str)],
) -> Value {
    let mut all: BTreeMap<&str, &str> = annotations.iter().copied().collect();
    let mut containers = vec![json!({"name": "app", "image": "app"})];
    if sidecar {
        all.entry("sidecar.istio.io/status").or_insert("{\"containers\":[\"istio-proxy\"]}");
        let env: Vec<Value> = env.iter().map(|(k, v)| json!({"name": k, "value": v})).collect();
        containers.push(json!({"name": "istio-proxy", "args": ["proxy", "sidecar"], "env": env}));
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": namespace, "name": name, "annotations": all},
        "spec": {"containers": containers}
    })
}

type Pods = Arc<Mutex<BTreeMap<(String, String), Value>>>;

/// Faults the test API server plays on purpose: status codes to answer the next
/// requests with, and a hold on the next pod GET.
#[derive(Default)]
struct ApiFaults {
    fail: std::collections::VecDeque<u16>,
    hold: Option<HeldAnswer>,
}

/// The server's side of a [`Hold`].
struct HeldAnswer {
    reached: std::sync::mpsc::Sender<()>,
    release: std::sync::mpsc::Receiver<()>,
}

/// A pod GET held by the server: `reached` fires when the request has arrived (the
/// plugin is waiting on it); the answer goes out when `release` is sent to or dropped.
pub struct Hold {
    pub reached: std::sync::mpsc::Receiver<()>,
    pub release: std::sync::mpsc::Sender<()>,
}

/// A test Kubernetes API server: `GET /api/v1/namespaces/<ns>/pods/<name>` from a map
/// of Pod objects, with a bearer-token check; records every request path. It can
/// fail requests ([`TestApiServer::fail_next`]) or hold one ([`TestApiServer::hold_next_pod_get`]).
pub struct TestApiServer {
    pub addr: SocketAddr,
    pub https: bool,
    pods: Pods,
    faults: Arc<Mutex<ApiFaults>>,
    pub requests: Arc<Mutex<Vec<String>>>,
    _server: crate::http_server::TestHttpServer,
}

impl TestApiServer {
    /// Listens on 127.0.0.1 inside `netns`; TLS with `tls` = (cert chain, key) PEM.
    pub fn start(netns: &NetNs, token: &str, tls: Option<(String, String)>) -> anyhow::Result<Self> {
        let pods: Pods = Arc::default();
        let requests: Arc<Mutex<Vec<String>>> = Arc::default();
        let faults: Arc<Mutex<ApiFaults>> = Arc::default();
        let https = tls.is_some();
        let (p, r, f, token) = (pods.clone(), requests.clone(), faults.clone(), token.to_string());
        let server = crate::http_server::TestHttpServer::start_tls(
            netns,
            "127.0.0.1:0".parse().expect("address"),
            tls,
            move |req| faulty_answer(&f, &r, req).unwrap_or_else(|| answer(&p, &r, &token, req)),
        )?;
        Ok(Self { addr: server.addr, https, pods, faults, requests, _server: server })
    }

    /// Answers the next requests with these status codes (a Kubernetes `Status`
    /// body), one each, before serving normally again.
    pub fn fail_next(&self, codes: &[u16]) {
        self.faults.lock().unwrap().fail.extend(codes);
    }

    /// Holds the answer to the next pod GET until the returned [`Hold`] releases it.
    pub fn hold_next_pod_get(&self) -> Hold {
        let (reached_tx, reached_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel();
        self.faults.lock().unwrap().hold = Some(HeldAnswer { reached: reached_tx, release: release_rx });
        Hold { reached: reached_rx, release: release_tx }
    }

    /// Serves `pod` (a Pod object) from now on.
    pub fn set_pod(&self, pod: Value) {
        let key = (
            pod["metadata"]["namespace"].as_str().unwrap_or_default().to_string(),
            pod["metadata"]["name"].as_str().unwrap_or_default().to_string(),
        );
        self.pods.lock().unwrap().insert(key, pod);
    }

    /// A kubeconfig for this server (`ca_pem` for HTTPS).
    pub fn kubeconfig(&self, token: &str, ca_pem: Option<&str>) -> String {
        use base64::Engine as _;
        let (scheme, host) = if self.https { ("https", "localhost") } else { ("http", "127.0.0.1") };
        let ca = ca_pem
            .map(|pem| {
                format!(
                    "\n    certificate-authority-data: {}",
                    base64::engine::general_purpose::STANDARD.encode(pem)
                )
            })
            .unwrap_or_default();
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: {scheme}://{host}:{}{ca}\n\
             users:\n- name: istio-cni\n  user:\n    token: {token}\ncontexts:\n- name: istio-cni-context\n  context:\n    cluster: local\n    user: istio-cni\n\
             current-context: istio-cni-context\n",
            self.addr.port()
        )
    }
}

/// A planned fault for `req`, if one is due: a failure is answered at once (and
/// recorded as `FAILED <code> <path>`); a hold waits for its release, then lets the
/// request be served normally.
fn faulty_answer(
    faults: &Mutex<ApiFaults>,
    requests: &Mutex<Vec<String>>,
    req: &crate::http_server::SeenRequest,
) -> Option<crate::http_server::Answer> {
    let (code, hold) = {
        let mut f = faults.lock().unwrap();
        let is_pod_get = req.path.contains("/pods/");
        (f.fail.pop_front(), if is_pod_get { f.hold.take() } else { None })
    };
    if let Some(code) = code {
        requests.lock().unwrap().push(format!("FAILED {code} {}", req.path));
        let body = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": "injected fault", "reason": "InternalError", "code": code});
        return Some((code, "application/json", body.to_string().into_bytes()));
    }
    if let Some(hold) = hold {
        let _ = hold.reached.send(());
        // Released by a send or by the test dropping its end.
        let _ = hold.release.recv();
    }
    None
}

fn answer(
    pods: &Pods,
    requests: &Mutex<Vec<String>>,
    token: &str,
    req: &crate::http_server::SeenRequest,
) -> crate::http_server::Answer {
    let (path, query) = req.path.split_once('?').unwrap_or((req.path.as_str(), ""));
    requests.lock().unwrap().push(req.path.clone());
    let json_answer = |code: u16, body: Value| (code, "application/json", body.to_string().into_bytes());
    let status = |code: u16, message: String| {
        json_answer(
            code,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}),
        )
    };
    if req.header("authorization").unwrap_or_default() != format!("Bearer {token}") {
        return status(401, "Unauthorized".into());
    }
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    if parts == ["api", "v1", "pods"] {
        // `?fieldSelector=spec.nodeName=<node>` (the only selector the plugin uses).
        let query = query.replace("%3D", "=");
        let node =
            query.split('&').find_map(|kv| kv.strip_prefix("fieldSelector=spec.nodeName=")).map(String::from);
        let items: Vec<Value> = pods
            .lock()
            .unwrap()
            .values()
            .filter(|p| node.as_deref().is_none_or(|n| p["spec"]["nodeName"] == n))
            .cloned()
            .collect();
        return json_answer(200, json!({"apiVersion": "v1", "kind": "PodList", "items": items}));
    }
    match parts.as_slice() {
        ["api", "v1", "namespaces", ns, "pods", name] => {
            match pods.lock().unwrap().get(&(ns.to_string(), name.to_string())) {
                Some(pod) => json_answer(200, pod.clone()),
                None => status(404, format!("pods \"{name}\" not found")),
            }
        }
        _ => status(404, "the server could not find the requested resource".into()),
    }
}

/// Writes `kubeconfig` as `<dir>/istio-cni-kubeconfig`.
pub fn write_kubeconfig(dir: &Path, kubeconfig: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join("istio-cni-kubeconfig");
    std::fs::write(&path, kubeconfig)?;
    if !path.exists() {
        bail!("kubeconfig not written");
    }
    Ok(path)
}

/// Starts a testkit server in `ns` as `uid`; returns once it prints `listening`.
pub fn start_in(ns: &NetNs, uid: u32, args: &[&str]) -> anyhow::Result<crate::PodChild> {
    start_placed(Placement { netns: Some(ns), user: Some((uid, uid)), ..Placement::default() }, args)
}

/// As [`start_in`], placed as `placement` says (a cgroup for eBPF capture).
pub fn start_placed(placement: Placement<'_>, args: &[&str]) -> anyhow::Result<crate::PodChild> {
    use std::io::BufRead as _;
    let mut cmd = tools::testkit_command();
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = weir_agent::sandbox::process::spawn(&mut cmd, placement)?;
    let stdout = child.child_mut().stdout.take().context("stdout")?;
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line)?;
    if !line.starts_with("listening") {
        bail!("testkit {args:?} said {line:?}");
    }
    Ok(child)
}

/// Runs `program args` in `ns` as `uid` (root when `None`) and returns its stdout;
/// panics, naming the command and its stderr, when it fails.
pub fn run_in(ns: &NetNs, uid: Option<u32>, program: Command, args: &[&str]) -> String {
    run_placed(
        Placement { netns: Some(ns), user: uid.map(|u| (u, u)), ..Placement::default() },
        program,
        args,
    )
}

/// As [`run_in`], placed as `placement` says.
pub fn run_placed(placement: Placement<'_>, cmd: Command, args: &[&str]) -> String {
    let what = format!("{:?} {args:?}", cmd.get_program());
    try_run_placed(placement, cmd, args).unwrap_or_else(|stderr| panic!("{what} failed: {stderr}"))
}

/// As [`run_placed`], for a command whose failure is the point: stdout, or its stderr
/// when it exits non-zero. Failing to start it at all still panics.
pub fn try_run_placed(placement: Placement<'_>, mut cmd: Command, args: &[&str]) -> Result<String, String> {
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = weir_agent::sandbox::process::spawn(&mut cmd, placement).expect("spawn in namespace");
    let out = child.into_inner().wait_with_output().expect("wait");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!("exit {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// A pod's sandbox as the kubelet makes it, for code that finds pods through the
/// node's /proc: a process in the pod's network namespace and in a cgroup named after
/// the pod's UID (`<parent>/pod<uid>`, the cgroupfs driver's shape; `parent` plays
/// `kubepods`, and its name must say so). Both go on drop.
pub struct KubeletSandbox {
    _process: crate::PodChild,
    _cgroup: crate::Cgroup,
}

impl KubeletSandbox {
    pub fn start(parent: &crate::Cgroup, uid: &str, netns: &NetNs) -> anyhow::Result<Self> {
        let mount = weir_agent::sandbox::cgroup::cgroup2_mount()?;
        let relative = parent.path().strip_prefix(&mount)?.join(format!("pod{uid}"));
        let cgroup = crate::Cgroup::create(&relative.to_string_lossy())?;
        let mut sleep = Command::new("sleep");
        sleep.arg("infinity");
        let process = weir_agent::sandbox::process::spawn(
            &mut sleep,
            Placement { netns: Some(netns), cgroup: Some(&cgroup), ..Placement::default() },
        )?;
        Ok(Self { _process: process, _cgroup: cgroup })
    }
}

/// A FIFO at `/run/netns/<unique name>`, where a runtime's named namespaces live (its
/// path has a runtime's form; opening it blocks until a writer comes), removed on drop.
pub struct FifoNetns(pub PathBuf);

impl FifoNetns {
    pub fn make() -> std::io::Result<Self> {
        std::fs::create_dir_all("/run/netns")?;
        let path = Path::new("/run/netns").join(weir_agent::sandbox::unique_name("fifo"));
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
        Ok(Self(path))
    }
}

impl Drop for FifoNetns {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
