//! An injected pod run as the kubelet runs it: init containers in order (`istio-init`
//! to completion as root in the pod's network namespace; a native sidecar started and
//! waited on until its startup probe passes), then the app containers; probes sent from
//! the node to the pod's IP; `exec` as the container's user with its environment; and
//! termination in the kubelet's order (apps, then the sidecar's preStop and SIGTERM
//! within the grace period), after which nothing of the pod may be left.
//!
//! Images: the proxy image (`proxyv2`) is Weir: its entrypoint `pilot-agent` is the
//! binary under test (run through a descriptor, as `tools::pilot_agent_command`), its
//! Envoy at `/usr/local/bin/envoy` is the real one, and its bootstrap template sits at
//! `/var/lib/istio/envoy/envoy_bootstrap_tmpl.json`. An app image is stood in for by
//! `weir-testkit` servers on the ports its rewritten probes target (HTTP, HTTPS, TCP,
//! gRPC, from `ISTIO_KUBE_APP_PROBERS`) and on its declared ports.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Output, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use weir_agent::{
    sandbox::process::Mount,
    sidecar::controlplane::{Snapshot, resources},
};
use weir_proto::type_url;

use super::{
    cluster::{Cluster, NODE_NAME},
    env::{PodStatus, command_line, container_env},
    images::{self, PodImages},
    manifest::{Container, Manifest, Probe, ProbeKind, Scalar},
    metadata::NodeInputs,
    volumes::{ExtraMount, PodVolumes, VolumeSources, hosts_file},
};
use crate::{
    Placement, Pod, PodChild,
    capture::start_server_placed,
    control_plane::{ISTIOD_SAN, TestCa},
    envoy, http, tools,
};

/// The listener istiod gives every injected pod's Envoy: Istio's inbound port,
/// terminating mutual TLS with the workload certificate (so it warms only once Envoy
/// holds `default` and `ROOTCA`).
pub const INBOUND_LISTENER: &str = "virtualInbound";
/// The cluster behind it.
pub const INBOUND_CLUSTER: &str = "inbound|80||";
/// The image's PATH.
const IMAGE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// How long the rig waits for a probe to pass (the manifests allow far longer).
pub const PROBE_BUDGET: Duration = Duration::from_secs(30);

/// The config the test istiod serves.
pub fn snapshot() -> Snapshot {
    let mut s = Snapshot::new();
    let inbound = SocketAddr::from(([0, 0, 0, 0], 15006));
    s.set(
        type_url::LISTENER,
        "1",
        [(
            INBOUND_LISTENER,
            resources::mtls_tcp_proxy_listener(INBOUND_LISTENER, inbound, INBOUND_CLUSTER, &[]),
        )],
    );
    let app = SocketAddr::from(([127, 0, 0, 1], 80));
    s.set(
        type_url::CLUSTER,
        "1",
        [(INBOUND_CLUSTER, resources::static_cluster(INBOUND_CLUSTER, &[app], Duration::from_secs(1)))],
    );
    s
}

/// What a test adds to a manifest's world.
#[derive(Default)]
pub struct PodOptions {
    /// The mesh root: signs istiod's serving certificate and is the
    /// `istio-ca-root-cert` ConfigMap (a new one when `None`).
    pub root_ca: Option<TestCa>,
    /// Annotations the pod gets besides its own (each noted in `manifest.notes`).
    pub annotations: Vec<(String, String)>,
    /// Secrets in the pod's namespace: name → key → content.
    pub secrets: BTreeMap<String, BTreeMap<String, String>>,
    /// Directories CSI drivers publish, by driver.
    pub csi: BTreeMap<String, PathBuf>,
    /// Run Istio's containers from these images (chrooted) instead of the host's
    /// `weir` with the proxy image's files mounted.
    pub images: Option<PodImages>,
}

/// A container's process and how it was run.
pub struct RunningContainer {
    pub name: String,
    pub child: PodChild,
    pub env: BTreeMap<String, String>,
    pub user: (u32, u32),
    pub groups: Vec<u32>,
    /// Inode of its mount namespace.
    pub mount_ns: u64,
    /// Stand-in servers of an app container (port, kind).
    pub serves: Vec<(u16, &'static str)>,
    /// Its servers after the first.
    extra: Vec<PodChild>,
    log: Option<PathBuf>,
}

impl RunningContainer {
    fn new(
        name: &str,
        child: PodChild,
        run: RunAs,
        serves: Vec<(u16, &'static str)>,
        extra: Vec<PodChild>,
        log: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        let mount_ns = std::fs::metadata(format!("/proc/{}/ns/mnt", child.pid()))?.ino();
        let RunAs { env, user, groups } = run;
        Ok(Self { name: name.into(), child, env, user, groups, mount_ns, serves, extra, log })
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        self.log.as_ref().and_then(|l| std::fs::read_to_string(l).ok()).unwrap_or_default()
    }
}

/// How a container's process runs: its environment, user and groups.
struct RunAs {
    env: BTreeMap<String, String>,
    user: (u32, u32),
    groups: Vec<u32>,
}

/// A run-to-completion init container's result.
pub struct Completed {
    pub name: String,
    pub command: Vec<String>,
    pub output: Output,
}

/// One probe's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    Success(String),
    Failure(String),
    /// The rig cannot run it (an `exec` probe in an image it stands in for).
    NotRun(String),
}

/// How the pod ended.
#[derive(Debug)]
pub struct Termination {
    /// The sidecar's preStop hook and what it printed.
    pub pre_stop: Option<Output>,
    pub exit: ExitStatus,
    pub grace: Duration,
    pub took: Duration,
    /// Processes still in the pod's network namespace after the sidecar exited.
    pub processes_left: Vec<u32>,
    /// Processes still in the sidecar's mount namespace.
    pub in_mount_ns: Vec<u32>,
}

/// A running injected pod. Fields drop in order: containers (killed), volumes (the
/// pod's directory), the pod's namespace, the cluster.
pub struct InjectedPod {
    containers: Vec<RunningContainer>,
    pub completed: Vec<Completed>,
    volumes: PodVolumes,
    /// Every mount target a container got, and the host's mount points before the
    /// pod started (for the leftover check).
    mount_targets: Vec<PathBuf>,
    host_mounts_before: std::collections::BTreeSet<PathBuf>,
    pub pod: Pod,
    pub cluster: Cluster,
    pub manifest: Manifest,
    pub status: PodStatus,
    /// The images Istio's containers run from, when not the host's files.
    pub images: Option<PodImages>,
}

impl InjectedPod {
    /// Runs `manifest`'s pod up to its app containers; fails naming the container that
    /// did not start, with its log.
    pub fn start(test: &str, mut manifest: Manifest, options: PodOptions) -> anyhow::Result<Self> {
        for (k, v) in &options.annotations {
            manifest.notes.push(format!("annotation {k}={v:?} added"));
            manifest.meta.annotations.insert(k.clone(), v.clone());
        }
        let root_ca = match options.root_ca {
            Some(ca) => ca,
            None => TestCa::new("mesh root CA")?,
        };
        let cluster = Cluster::start(test, snapshot(), root_ca)?;
        let pod = cluster.mesh.pod(manifest.name())?;
        allow_unprivileged_ports(&pod)?;
        let status = PodStatus {
            pod_ips: vec![pod.ipv4().into(), pod.ipv6().into()],
            host_ip: cluster.node.ipv4().into(),
            node_name: NODE_NAME.into(),
            node_cpu: Scalar(std::thread::available_parallelism().map_or(1, usize::from).to_string()),
            node_memory: Scalar(node_memory()),
        };
        let sources = VolumeSources {
            config_maps: [(
                "istio-ca-root-cert".to_string(),
                [("root-cert.pem".to_string(), cluster.serving_ca.root_pem().to_string())].into(),
            )]
            .into(),
            secrets: options.secrets,
            token: cluster.token().into(),
            csi: options.csi,
        };
        let volumes = PodVolumes::create(&manifest, &status, &sources)?;
        let mut me = Self {
            containers: Vec::new(),
            completed: Vec::new(),
            volumes,
            mount_targets: Vec::new(),
            host_mounts_before: host_mount_points(),
            pod,
            cluster,
            manifest,
            status,
            images: options.images,
        };
        for container in me.manifest.spec.init_containers.clone() {
            if container.is_sidecar() {
                me.start_container(&container)?;
                if container.startup_probe.is_some() {
                    me.wait_probe(&container.name, ProbeKind::Startup, PROBE_BUDGET).map_err(|e| {
                        anyhow::anyhow!("{e:#}\n{} log:\n{}", container.name, me.log(&container.name))
                    })?;
                }
            } else {
                me.run_to_completion(&container)?;
            }
        }
        for container in me.manifest.spec.containers.clone() {
            me.start_container(&container)?;
        }
        Ok(me)
    }

    /// A started container, by name.
    pub fn container(&self, name: &str) -> &RunningContainer {
        self.containers
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no running container {name}"))
    }

    /// What a container logged.
    pub fn log(&self, name: &str) -> String {
        self.containers.iter().find(|c| c.name == name).map(RunningContainer::log).unwrap_or_default()
    }

    /// The pod's directory (volumes, logs).
    pub fn dir(&self) -> &Path {
        self.volumes.root()
    }

    /// Where a volume is on the host.
    pub fn volume_dir(&self, volume: &str) -> Option<&Path> {
        self.volumes.host_dir(volume)
    }

    /// The inputs of the node pilot-agent presents (for [`super::metadata`]).
    pub fn node_inputs<'a>(
        &'a self,
        container: &'a RunningContainer,
        istio_version: &'a str,
    ) -> NodeInputs<'a> {
        NodeInputs {
            env: &container.env,
            labels: &self.manifest.meta.labels,
            annotations: &self.manifest.meta.annotations,
            pod_ips: &self.status.pod_ips,
            external_sds: self.manifest.spec.volumes.iter().any(|v| v.csi.is_some()),
            istio_version,
        }
    }

    fn run_to_completion(&mut self, container: &Container) -> anyhow::Result<()> {
        let env = container_env(&self.manifest, &self.status, container)?;
        let (mut cmd, argv) = self.proxy_image_command(container, &env)?;
        let (uid, gid) = container.user(&self.manifest.spec.security_context);
        let groups = container.groups(&self.manifest.spec.security_context);
        self.as_container(&mut cmd, &env).stdout(Stdio::piped()).stderr(Stdio::piped());
        let root = self.images.as_ref().map(|i| i.for_container(container).root.clone());
        let mounts = match &root {
            Some(root) => self.volumes.mounts_under(root, container, &[])?,
            None => Vec::new(),
        };
        self.mount_targets.extend(mounts.iter().map(|m| m.target().to_path_buf()));
        let child = self.pod.spawn_placed(
            &mut cmd,
            Placement {
                user: Some((uid, gid)),
                groups: &groups,
                mounts: &mounts,
                root: root.as_deref(),
                ..Placement::default()
            },
        )?;
        let output = child.into_inner().wait_with_output()?;
        let ok = output.status.success();
        self.completed.push(Completed { name: container.name.clone(), command: argv, output });
        if !ok {
            let done = self.completed.last().expect("pushed");
            bail!(
                "init container {} exited with {}:\n{}{}",
                container.name,
                done.output.status,
                String::from_utf8_lossy(&done.output.stdout),
                String::from_utf8_lossy(&done.output.stderr)
            );
        }
        Ok(())
    }

    /// `cmd` with a container's process environment: only `env`, the image's PATH and
    /// the pod's HOSTNAME, working directory `/`, no stdin.
    fn as_container<'c>(&self, cmd: &'c mut Command, env: &BTreeMap<String, String>) -> &'c mut Command {
        cmd.env_clear()
            .env("PATH", IMAGE_PATH)
            .env("HOSTNAME", self.manifest.name())
            .envs(env)
            .current_dir("/")
            .stdin(Stdio::null())
    }

    /// The proxy image's command for `container` (entrypoint `pilot-agent`, or a
    /// `command` naming it), with its expanded argv for the record.
    fn proxy_image_command(
        &self,
        container: &Container,
        env: &BTreeMap<String, String>,
    ) -> anyhow::Result<(Command, Vec<String>)> {
        let (command, args) = command_line(container, env);
        if let Some(images) = &self.images {
            let (cmd, argv) = images::command(images.for_container(container), command, args)?;
            if argv[0].rsplit('/').next() != Some("pilot-agent") {
                bail!("container {}: the image runs {:?}, not pilot-agent", container.name, argv[0]);
            }
            return Ok((cmd, argv));
        }
        let mut argv = if command.is_empty() { vec!["pilot-agent".to_string()] } else { command };
        argv.extend(args);
        let program = argv[0].rsplit('/').next().unwrap_or_default();
        if program != "pilot-agent" {
            bail!("container {}: the proxy image runs pilot-agent, not {:?}", container.name, argv[0]);
        }
        let mut cmd = tools::pilot_agent_command();
        cmd.args(&argv[1..]);
        Ok((cmd, argv))
    }

    fn is_proxy_image(container: &Container) -> bool {
        container.image.as_deref().is_some_and(|i| i.contains("/proxyv2:"))
    }

    fn start_container(&mut self, container: &Container) -> anyhow::Result<()> {
        let run = RunAs {
            env: container_env(&self.manifest, &self.status, container)?,
            user: container.user(&self.manifest.spec.security_context),
            groups: container.groups(&self.manifest.spec.security_context),
        };
        let running = if Self::is_proxy_image(container) {
            self.start_proxy(container, run)?
        } else {
            self.start_stand_in(container, run)?
        };
        self.containers.push(running);
        Ok(())
    }

    fn start_proxy(&mut self, container: &Container, run: RunAs) -> anyhow::Result<RunningContainer> {
        let (mut cmd, _) = self.proxy_image_command(container, &run.env)?;
        let files = self.dir().join(format!("{}-files", container.name));
        std::fs::create_dir(&files)?;
        let hosts = files.join("hosts");
        std::fs::write(
            &hosts,
            hosts_file(
                self.pod.ipv4().into(),
                self.manifest.name(),
                &[(self.cluster.istiod.ipv4().into(), ISTIOD_SAN)],
            ),
        )?;
        // ClusterFirst DNS: the cluster's resolver is not reachable from the rig's
        // pods, and istiod's name comes from the hosts file.
        let resolv = files.join("resolv.conf");
        let ns = self.manifest.namespace();
        std::fs::write(
            &resolv,
            format!(
                "search {ns}.svc.cluster.local svc.cluster.local cluster.local\nnameserver 10.96.0.10\noptions ndots:5\n"
            ),
        )?;
        for f in [&hosts, &resolv] {
            std::fs::set_permissions(f, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
        }
        let mut extra = vec![
            ExtraMount { target: "/etc/hosts".into(), source: hosts, read_only: false },
            ExtraMount { target: "/etc/resolv.conf".into(), source: resolv, read_only: false },
        ];
        let root = self.images.as_ref().map(|i| i.for_container(container).root.clone());
        let mounts: Vec<Mount> = match &root {
            // The image brings its own Envoy (and template, if it has one).
            Some(root) => self.volumes.mounts_under(root, container, &extra)?,
            None => {
                extra.push(ExtraMount {
                    target: "/var/lib/istio/envoy/envoy_bootstrap_tmpl.json".into(),
                    source: bootstrap_template(),
                    read_only: true,
                });
                extra.push(ExtraMount {
                    target: "/usr/local/bin/envoy".into(),
                    source: envoy::binary()?,
                    read_only: true,
                });
                self.volumes.mounts(container, &extra)?
            }
        };
        self.mount_targets.extend(mounts.iter().map(|m| m.target().to_path_buf()));
        let log = self.dir().join(format!("{}.log", container.name));
        let file = std::fs::File::create(&log)?;
        self.as_container(&mut cmd, &run.env).stdout(file.try_clone()?).stderr(file);
        let placement = Placement {
            user: Some(run.user),
            groups: &run.groups,
            mounts: &mounts,
            root: root.as_deref(),
            ..Placement::default()
        };
        let child = self.pod.spawn_placed(&mut cmd, placement)?;
        RunningContainer::new(&container.name, child, run, Vec::new(), Vec::new(), Some(log))
    }

    /// The app image's stand-in: one testkit server per port its rewritten probes
    /// target (by the prober's kind) and per declared TCP port (HTTP).
    fn start_stand_in(&mut self, container: &Container, run: RunAs) -> anyhow::Result<RunningContainer> {
        let mut serves: BTreeMap<u16, &'static str> = BTreeMap::new();
        for (port, kind) in self.prober_targets(&container.name)? {
            serves.insert(port, kind);
        }
        for p in &container.ports {
            if p.protocol.as_deref().unwrap_or("TCP") == "TCP" {
                serves.entry(p.container_port).or_insert("serve-http");
            }
        }
        let placement = Placement { user: Some(run.user), groups: &run.groups, ..Placement::default() };
        let mut children = Vec::new();
        for (port, kind) in &serves {
            let mut args = vec![kind.to_string(), format!("0.0.0.0:{port}")];
            if *kind == "serve-grpc-health" {
                args.push("SERVING".into());
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            children.push(start_server_placed(&self.pod, placement, &args));
        }
        // One process per container: the first server; the others are kept with it.
        let mut children = children.into_iter();
        let child = match children.next() {
            Some(c) => c,
            None => {
                let mut cmd = Command::new("sleep");
                cmd.arg("infinity");
                self.pod.spawn_placed(&mut cmd, placement)?
            }
        };
        RunningContainer::new(
            &container.name,
            child,
            run,
            serves.into_iter().collect(),
            children.collect(),
            None,
        )
    }

    /// The ports `container`'s rewritten probes reach (from istio-proxy's
    /// `ISTIO_KUBE_APP_PROBERS`), with the stand-in each needs.
    fn prober_targets(&self, container: &str) -> anyhow::Result<Vec<(u16, &'static str)>> {
        let Some(proxy) = self.manifest.init_container("istio-proxy") else { return Ok(Vec::new()) };
        let env = container_env(&self.manifest, &self.status, proxy)?;
        let Some(raw) = env.get("ISTIO_KUBE_APP_PROBERS") else { return Ok(Vec::new()) };
        let probers: BTreeMap<String, serde_json::Value> =
            serde_json::from_str(raw).context("ISTIO_KUBE_APP_PROBERS")?;
        let app = self.manifest.container(container);
        let mut out = Vec::new();
        for (path, prober) in probers {
            if path.split('/').nth(2) != Some(container) {
                continue;
            }
            let port_of = |v: &serde_json::Value| -> anyhow::Result<u16> {
                match v {
                    serde_json::Value::Number(n) => {
                        u16::try_from(n.as_u64().unwrap_or(0)).context("prober port")
                    }
                    serde_json::Value::String(name) => app
                        .context("named port without a container")?
                        .port(&super::manifest::IntOrString::String(name.clone())),
                    other => bail!("prober {path}: port {other}"),
                }
            };
            if let Some(get) = prober.get("httpGet") {
                let https = get["scheme"].as_str().is_some_and(|s| s.eq_ignore_ascii_case("HTTPS"));
                out.push((port_of(&get["port"])?, if https { "serve-https" } else { "serve-http" }));
            } else if let Some(tcp) = prober.get("tcpSocket") {
                out.push((port_of(&tcp["port"])?, "serve-echo"));
            } else if let Some(grpc) = prober.get("grpc") {
                out.push((port_of(&grpc["port"])?, "serve-grpc-health"));
            } else {
                bail!("prober {path}: no httpGet, tcpSocket or grpc");
            }
        }
        Ok(out)
    }

    /// Runs `container`'s probe of `kind` once, from the node, as the kubelet does.
    pub fn probe(&self, container: &str, kind: ProbeKind) -> anyhow::Result<ProbeOutcome> {
        let spec = self.manifest.container(container).with_context(|| format!("no container {container}"))?;
        let probe = spec
            .probes()
            .into_iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, p)| p)
            .with_context(|| format!("{container} has no {kind:?} probe"))?;
        self.run_probe(spec, probe)
    }

    fn run_probe(&self, container: &Container, probe: &Probe) -> anyhow::Result<ProbeOutcome> {
        let timeout = Duration::from_secs(probe.timeout_seconds.unwrap_or(1).max(1));
        let host = |h: &Option<String>| -> anyhow::Result<IpAddr> {
            match h {
                Some(h) if !h.is_empty() => h.parse().with_context(|| format!("probe host {h:?}")),
                _ => Ok(self.pod.ipv4().into()),
            }
        };
        if let Some(get) = &probe.http_get {
            if get.scheme.as_deref().is_some_and(|s| !s.eq_ignore_ascii_case("HTTP")) {
                bail!("{}: the rig's kubelet sends HTTP probes only", container.name);
            }
            let addr = SocketAddr::new(host(&get.host)?, container.port(&get.port)?);
            let path = get.path.clone().unwrap_or_else(|| "/".into());
            let mut headers: Vec<(String, String)> =
                vec![("User-Agent".into(), "kube-probe/1.33".into()), ("Accept".into(), "*/*".into())];
            headers.extend(get.http_headers.iter().map(|h| (h.name.clone(), h.value.clone())));
            let result = self.cluster.node.run(|| async move {
                let headers: Vec<(&str, &str)> =
                    headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
                tokio::time::timeout(timeout, http::request_with(addr, "GET", &path, &headers, None)).await
            })?;
            return Ok(match result {
                Ok(Ok((status, _))) if (200..400).contains(&status) => {
                    ProbeOutcome::Success(format!("HTTP {status}"))
                }
                Ok(Ok((status, body))) => ProbeOutcome::Failure(format!("HTTP {status}: {}", body.trim())),
                Ok(Err(e)) => ProbeOutcome::Failure(format!("GET {addr}: {e:#}")),
                Err(_) => ProbeOutcome::Failure(format!("GET {addr}: no answer in {timeout:?}")),
            });
        }
        if let Some(tcp) = &probe.tcp_socket {
            let addr = SocketAddr::new(host(&tcp.host)?, container.port(&tcp.port)?);
            let result = self.cluster.node.run(|| async move {
                tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await
            })?;
            return Ok(match result {
                Ok(Ok(_)) => ProbeOutcome::Success(format!("connected to {addr}")),
                Ok(Err(e)) => ProbeOutcome::Failure(format!("connect {addr}: {e}")),
                Err(_) => ProbeOutcome::Failure(format!("connect {addr}: no answer in {timeout:?}")),
            });
        }
        if let Some(exec) = &probe.exec {
            return Ok(ProbeOutcome::NotRun(format!(
                "exec {:?} runs inside {}'s image, which the rig stands in for",
                exec.command, container.name
            )));
        }
        if probe.grpc.is_some() {
            return Ok(ProbeOutcome::NotRun("gRPC probes are not sent by the rig's kubelet".into()));
        }
        bail!("{}: a probe with no handler", container.name)
    }

    /// Probes until success (every 100 ms, up to `budget`); the last failure otherwise.
    pub fn wait_probe(
        &self,
        container: &str,
        kind: ProbeKind,
        budget: Duration,
    ) -> anyhow::Result<ProbeOutcome> {
        let deadline = Instant::now() + budget;
        loop {
            let outcome = self.probe(container, kind)?;
            match &outcome {
                ProbeOutcome::Failure(why) if Instant::now() < deadline => {
                    if let Some(c) = self.containers.iter().find(|c| c.name == container)
                        && exited(c.child.pid())
                    {
                        bail!(
                            "{container} exited while its {kind:?} probe failed ({why}); log:\n{}",
                            c.log()
                        );
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                ProbeOutcome::Failure(why) => {
                    bail!("{container} {kind:?} probe still failing after {budget:?}: {why}")
                }
                _ => return Ok(outcome),
            }
        }
    }

    /// `argv` run as the kubelet's `exec` in `container`: its user, groups and
    /// environment, in the pod's network namespace (not its mount namespace).
    /// `pilot-agent` is the proxy image's binary.
    pub fn exec(&self, container: &str, argv: &[String]) -> anyhow::Result<Output> {
        let running = self.container(container);
        let Some((program, args)) = argv.split_first() else { bail!("exec with no command") };
        // In an image, the command runs in the image's root (without the container's
        // volumes: the hooks and probes this rig sends need none).
        let spec = self.manifest.init_container(container).or_else(|| self.manifest.container(container));
        let image = self.images.as_ref().zip(spec).map(|(i, c)| i.for_container(c));
        let mut cmd = match image {
            Some(image) => images::command(image, argv.to_vec(), Vec::new())?.0,
            None if program.rsplit('/').next() == Some("pilot-agent") => {
                let mut cmd = tools::pilot_agent_command();
                cmd.args(args);
                cmd
            }
            None => {
                let mut cmd = Command::new(program);
                cmd.args(args);
                cmd
            }
        };
        self.as_container(&mut cmd, &running.env).stdout(Stdio::piped()).stderr(Stdio::piped());
        let placement = Placement {
            user: Some(running.user),
            groups: &running.groups,
            root: image.map(|i| i.root.as_path()),
            ..Placement::default()
        };
        let child = self.pod.spawn_placed(&mut cmd, placement)?;
        Ok(child.into_inner().wait_with_output()?)
    }

    /// The kubelet's termination of the pod: app containers get SIGTERM and go, then
    /// the sidecar's preStop hook runs and it gets SIGTERM, waited on for the pod's
    /// grace period.
    pub fn terminate(&mut self, sidecar: &str) -> anyhow::Result<Termination> {
        let grace = Duration::from_secs(self.manifest.spec.termination_grace_period_seconds.unwrap_or(30));
        let started = Instant::now();
        let apps: Vec<String> = self.manifest.spec.containers.iter().map(|c| c.name.clone()).collect();
        for app in &apps {
            if let Some(c) = self.containers.iter_mut().find(|c| &c.name == app) {
                for child in std::iter::once(&mut c.child).chain(c.extra.iter_mut()) {
                    child.signal(libc::SIGTERM)?;
                    child.wait_timeout(grace)?;
                }
            }
        }
        let pre_stop = match self
            .manifest
            .container(sidecar)
            .and_then(|c| c.lifecycle.as_ref())
            .and_then(|l| l.pre_stop.as_ref())
            .and_then(|h| h.exec.as_ref())
        {
            Some(exec) => Some(self.exec(sidecar, &exec.command)?),
            None => None,
        };
        let mount_ns = self.container(sidecar).mount_ns;
        let proxy = self.containers.iter_mut().find(|c| c.name == sidecar).expect("running");
        proxy.child.signal(libc::SIGTERM)?;
        let exit = match proxy.child.wait_timeout(grace.saturating_sub(started.elapsed()))? {
            Some(status) => status,
            None => bail!("{sidecar} still running after the {grace:?} grace period:\n{}", proxy.log()),
        };
        // Envoy goes with the agent (the parent-death signal is delivered, then Envoy
        // exits: on a loaded machine that can take a moment, in either namespace).
        // What is reported is what was last seen: read again after the namespace is
        // gone, its inode number may already be a new namespace's (another test's).
        let settled = Instant::now() + Duration::from_secs(5);
        let (processes_left, in_mount_ns) = loop {
            let seen = (self.pod.processes(), processes_in_mount_ns(mount_ns));
            if (seen.0.is_empty() && seen.1.is_empty()) || Instant::now() >= settled {
                break seen;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        Ok(Termination { pre_stop, exit, grace, took: started.elapsed(), processes_left, in_mount_ns })
    }

    /// Drops the pod and checks that nothing of it is left: its network namespace, its
    /// directory, any sandbox object of this test, any host mount on a container path.
    pub fn remove(self) -> Vec<String> {
        let netns = self.pod.netns().path().to_path_buf();
        let dir = self.dir().to_path_buf();
        let targets = self.mount_targets.clone();
        let before = self.host_mounts_before.clone();
        drop(self);
        let mut left = Vec::new();
        if netns.exists() {
            left.push(format!("network namespace {}", netns.display()));
        }
        if dir.exists() {
            left.push(format!("pod directory {}", dir.display()));
        }
        let me = std::process::id();
        for leftover in weir_agent::sandbox::leftovers(false) {
            let owner = match &leftover {
                weir_agent::sandbox::Leftover::Netns { owner, .. }
                | weir_agent::sandbox::Leftover::Cgroup { owner, .. }
                | weir_agent::sandbox::Leftover::Capture { owner, .. } => *owner,
            };
            if owner == me {
                left.push(leftover.to_string());
            }
        }
        for point in host_mount_points() {
            if !before.contains(&point) && (point.starts_with(&dir) || targets.contains(&point)) {
                left.push(format!("host mount on {}", point.display()));
            }
        }
        left
    }
}

/// Whether `pid` has exited (gone, or a zombie not yet reaped).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) == Some("Z"),
        Err(_) => true,
    }
}

/// The mount points of the test process's (the host's) mount namespace.
fn host_mount_points() -> std::collections::BTreeSet<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(PathBuf::from))
        .collect()
}

/// Pids whose mount namespace has inode `inode`.
fn processes_in_mount_ns(inode: u64) -> Vec<u32> {
    let Ok(proc) = std::fs::read_dir("/proc") else { return Vec::new() };
    proc.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::metadata(format!("/proc/{pid}/ns/mnt")).is_ok_and(|m| m.ino() == inode))
        .collect()
}

/// As containerd does for pods: any user may bind any port in the pod's namespace
/// (`net.ipv4.ip_unprivileged_port_start=0`).
fn allow_unprivileged_ports(pod: &Pod) -> anyhow::Result<()> {
    pod.run(|| async { std::fs::write("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0") })?
        .context("set net.ipv4.ip_unprivileged_port_start in the pod")
}

/// The node's memory (allocatable for a container with no limit), in bytes.
fn node_memory() -> String {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let kib: u64 = m
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some((kib * 1024).to_string())
        })
        .unwrap_or_else(|| "8Gi".into())
}

/// The proxy image's bootstrap template (Istio's `envoy_bootstrap.json`).
pub fn bootstrap_template() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/istio-bootstrap/envoy_bootstrap.json")
}
