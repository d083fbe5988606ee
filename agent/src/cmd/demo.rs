//! `weir demo`: Weir's main job on an embedded default, in sandbox pods on this host.
//! A client pod and a server pod, each with a real Envoy run by `weir proxy sidecar
//! --discovery-address embedded` (standalone mode: xDS and certificates from the
//! agent, one mesh CA in a shared state directory); both pods captured with the best
//! backend this machine offers; the client's app calls the server by its plain
//! address in a loop and Envoy carries it over mutual TLS. It prints each step, live
//! rates and latencies, and a summary proven from Envoy's own stats; on Ctrl-C or
//! `--duration` it drains the sidecars and removes every namespace, cgroup, rule and
//! pin it made. Its files live in a fresh directory only root and the proxy's group can
//! enter (`workdir`), never through a path another user could have prepared.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use std::os::unix::process::CommandExt as _;

use anyhow::{Context as _, bail};

use crate::{
    capture::ebpf::detect::{self, Backend, CaptureMode},
    cmd::DemoArgs,
    node::cni::pod::PodInfo,
    sandbox::{Cgroup, Mesh, Placement, Pod, PodChild, unique_name},
    support::executable::Executable,
    support::privileges::{self, Capability},
};

const APP_PORT: u16 = 8080;
const APP_UID: u32 = 1000;
/// Envoy's user (and group), as the injector's.
const PROXY_UID: u32 = 1337;
const CLIENT_SA: &str = "client";
const SERVER_SA: &str = "server";

fn step(name: &str, text: &str) {
    println!("[demo] {name:<9} {text}");
}

/// A pod's sidecar: its root directory (the agent's working directory) and agent.
struct Sidecar {
    name: &'static str,
    root: PathBuf,
    agent: PodChild,
}

/// Everything the demo made; dropped in reverse order of making.
struct Demo {
    sidecars: Vec<Sidecar>,
    apps: Vec<PodChild>,
    ebpf_node: Option<String>,
    cgroup: Cgroup,
    client: Pod,
    server: Pod,
    _mesh: Mesh,
    dir: PathBuf,
    /// Last: released after the eBPF capture is detached (unmounts a bpffs it mounted).
    _bpffs: crate::capture::ebpf::bpffs::BpffsUse,
}

impl Drop for Demo {
    fn drop(&mut self) {
        for s in &mut self.sidecars {
            let _ = s.agent.signal(libc::SIGTERM);
        }
        for s in &mut self.sidecars {
            let _ = s.agent.wait_timeout(Duration::from_secs(10));
        }
        self.apps.clear();
        if let Some(node) = &self.ebpf_node {
            let _ = crate::node::cni::node_capture::detach_node(node);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The injected-pod shape capture is planned for (the CNI plugin's decision, reused).
fn sidecar_pod() -> PodInfo {
    let mut pod = PodInfo::default();
    pod.annotations.insert("sidecar.istio.io/status".into(), "{}".into());
    pod.containers.insert("istio-proxy".into());
    pod
}

fn envoy_binary() -> anyhow::Result<PathBuf> {
    if let Ok(path) = std::env::var("WEIR_ENVOY") {
        return Ok(path.into());
    }
    let exe = std::env::current_exe()?;
    let repo_tools = exe.ancestors().nth(3).map(|root| root.join(".tools/bin/envoy"));
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("envoy"))
        .chain(repo_tools)
        .find(|p| p.is_file())
        .context("no envoy binary (run scripts/bootstrap, or set WEIR_ENVOY)")
}

/// The services file the sidecars serve from, and the address clients call.
struct Services {
    file: PathBuf,
    server: SocketAddr,
}

/// What the client's app counted.
struct Traffic {
    ok: u64,
    failed: u64,
}

/// What Envoy's stats prove.
struct Proof {
    upstream_requests: u64,
    mtls: bool,
}

/// Runs the demo; returns when it has shown its result (Ctrl-C or `--duration`). Each
/// step below prints its `[demo] <step>` lines.
pub fn run(args: &DemoArgs) -> anyhow::Result<()> {
    privileges::require(&[Capability::SysAdmin, Capability::NetAdmin, Capability::Bpf], "weir demo")?;
    let started = Instant::now();
    let envoy = envoy_binary()?;
    let mut demo = Demo::sandbox()?;
    let choice = choose_capture(args, demo.cgroup.path())?;
    let services = demo.mesh()?;
    // The apps run as an unprivileged user: through a descriptor opened here, so the
    // directories above this binary (a checkout under /root) need not admit them.
    let exe = Executable::open(std::env::current_exe().context("find the weir binary")?)?;
    demo.start_server_app(&exe)?;
    demo.capture(&choice)?;
    let t = Instant::now();
    demo.envoy(&envoy, &services.file)?;
    demo.ready(t)?;
    demo.identity()?;
    let traffic = demo.traffic(&exe, services.server, args.duration)?;
    let proof = demo.envoy_stats()?;
    let drained = demo.drain()?;
    let elapsed = started.elapsed();
    cleanup(demo);
    summary(&choice, &traffic, &proof, drained, elapsed)
}

/// `[demo] capture`: the best capture backend here for the demo's cgroup (or the one
/// asked for).
fn choose_capture(args: &DemoArgs, cgroup: &std::path::Path) -> anyhow::Result<detect::Choice> {
    let choice = detect::choose_for(args.capture_mode.unwrap_or(CaptureMode::Auto), cgroup)?;
    step("capture", &format!("{choice}"));
    Ok(choice)
}

impl Demo {
    /// `[demo] sandbox`: the two pods, their cgroup and the demo's directory.
    fn sandbox() -> anyhow::Result<Self> {
        step("sandbox", "creating pods `client` and `server` (network namespaces on a private bridge)");
        let mesh = Mesh::new("demo")?;
        let client = mesh.pod("client")?;
        let server = mesh.pod("server")?;
        let dir = workdir()?;
        let cgroup = Cgroup::create(&unique_name("demo"))?;
        Ok(Self {
            sidecars: Vec::new(),
            apps: Vec::new(),
            ebpf_node: None,
            cgroup,
            client,
            server,
            _mesh: mesh,
            dir,
            _bpffs: crate::capture::ebpf::bpffs::BpffsUse::acquire()?,
        })
    }

    /// `[demo] mesh`: the services file, one HTTP service served by the server pod.
    fn mesh(&self) -> anyhow::Result<Services> {
        let server = SocketAddr::new(self.server.ipv4().into(), APP_PORT);
        let file = self.dir.join("mesh.yaml");
        write_new(
            &file,
            &format!(
                "# The demo mesh: one HTTP service.\nservices:\n- name: server\n  namespace: default\n  serviceAccount: {SERVER_SA}\n  \
                 address: {ip}\n  port: {APP_PORT}\n  protocol: http\n  endpoints: [\"{server}\"]\n  timeout: 5s\n  retries: 2\n",
                ip = self.server.ipv4()
            ),
        )?;
        step("mesh", &format!("service server.default → {server} (HTTP, mutual TLS, timeout 5s, 2 retries)"));
        Ok(Services { file, server })
    }

    /// The server's app (uid 1000), before capture, as a pod's app starts.
    fn start_server_app(&mut self, exe: &Executable) -> anyhow::Result<()> {
        let mut serve = exe.command();
        serve
            .args(["demo-app", "serve", &format!("0.0.0.0:{APP_PORT}")])
            .stdout(Stdio::null())
            .process_group(0);
        let app = self.server.spawn_placed(
            &mut serve,
            Placement { cgroup: Some(&self.cgroup), user: Some((APP_UID, APP_UID)), ..Placement::default() },
        )?;
        self.apps.push(app);
        Ok(())
    }

    /// `[demo] capture`: both pods captured with `choice`'s backend.
    fn capture(&mut self, choice: &detect::Choice) -> anyhow::Result<()> {
        let cfg = crate::node::cni::pod::capture_config(&sidecar_pod(), false)
            .expect("the default pod shape is valid");
        match choice.backend {
            Backend::Ebpf => {
                let node = unique_name("demo-node");
                crate::node::cni::node_capture::attach_node(&node, self.cgroup.path())?;
                self.ebpf_node = Some(node.clone());
                for (pod, name) in [(&self.client, "client"), (&self.server, "server")] {
                    let who = crate::node::cni::ebpf::PodIdentity {
                        name: format!("demo/{name}"),
                        uid: String::new(),
                    };
                    let netns = pod.netns().path();
                    let facts = crate::node::cni::ebpf::read_facts(netns)?;
                    crate::node::cni::ebpf::register(&node, name, netns, "eth0", &cfg, &who, &facts)?;
                }
            }
            Backend::Nftables | Backend::Iptables => {
                for pod in [&self.client, &self.server] {
                    let opts = weir_iptables::RunOptions {
                        network_namespace: Some(pod.netns().path().to_path_buf()),
                        cni_mode: true,
                        native_nftables: choice.backend == Backend::Nftables,
                        ..Default::default()
                    };
                    weir_iptables::program(&cfg, &opts)?;
                }
            }
        }
        step(
            "capture",
            &format!("{} programmed in both pods (outbound → 15001, inbound → 15006)", choice.backend),
        );
        Ok(())
    }

    /// `[demo] envoy`: a standalone sidecar (agent + Envoy) in each pod.
    fn envoy(&mut self, envoy: &Path, services: &Path) -> anyhow::Result<()> {
        for (pod_name, sa) in [("client", CLIENT_SA), ("server", SERVER_SA)] {
            let pod = if pod_name == "client" { &self.client } else { &self.server };
            let sidecar = start_sidecar(pod, pod_name, sa, &self.cgroup, envoy, services, &self.dir)?;
            self.sidecars.push(sidecar);
        }
        step("envoy", "starting real Envoy sidecars (weir proxy sidecar --discovery-address embedded)");
        Ok(())
    }

    /// `[demo] ready`: both sidecars answer `/healthz/ready` (started at `since`).
    fn ready(&mut self, since: Instant) -> anyhow::Result<()> {
        for (s, pod) in self.sidecars.iter_mut().zip([&self.client, &self.server]) {
            wait_ready(pod, s)?;
        }
        step(
            "ready",
            &format!("both sidecars ready in {:.1}s (/healthz/ready = 200)", since.elapsed().as_secs_f64()),
        );
        Ok(())
    }

    /// `[demo] identity`: the certificate each Envoy holds.
    fn identity(&self) -> anyhow::Result<()> {
        for (s, pod) in self.sidecars.iter().zip([&self.client, &self.server]) {
            step("identity", &format!("{}: {}", s.name, certificate(pod)?));
        }
        Ok(())
    }

    /// `[demo] traffic`: the client's app calls the server's plain address every 20 ms
    /// for `seconds` (or until Ctrl-C), a line per second.
    fn traffic(
        &mut self,
        exe: &Executable,
        server: SocketAddr,
        seconds: Option<u64>,
    ) -> anyhow::Result<Traffic> {
        let stop = Arc::new(AtomicBool::new(false));
        ctrlc_flag(stop.clone());
        let mut load = exe.command();
        load.args([
            "demo-app",
            "load",
            &format!("http://{server}/"),
            &seconds.unwrap_or(u64::MAX).to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .process_group(0);
        let mut loader = self.client.spawn_placed(
            &mut load,
            Placement { cgroup: Some(&self.cgroup), user: Some((APP_UID, APP_UID)), ..Placement::default() },
        )?;
        step(
            "traffic",
            &format!(
                "client app (uid {APP_UID}) → http://{server}/ (its plain address; capture sends it to Envoy)"
            ),
        );
        let stdout = loader.child_mut().stdout.take().context("loader stdout")?;
        let mut traffic = Traffic { ok: 0, failed: 0 };
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line?;
            if let Some(rest) = line.strip_prefix("second ") {
                let f: Vec<&str> = rest.split_whitespace().collect();
                if let [n, o, fl, p50, p99] = f.as_slice() {
                    traffic.ok += o.parse::<u64>().unwrap_or(0);
                    traffic.failed += fl.parse::<u64>().unwrap_or(0);
                    step(
                        "traffic",
                        &format!("t={n}s  {o} req/s ok, {fl} failed, p50 {p50} ms, p99 {p99} ms"),
                    );
                }
            }
            if stop.load(Ordering::SeqCst) {
                let _ = loader.signal(libc::SIGTERM);
            }
        }
        let _ = loader.child_mut().wait();
        Ok(traffic)
    }

    /// `[demo] envoy`: the proof from Envoy's own stats, client side and server side.
    fn envoy_stats(&self) -> anyhow::Result<Proof> {
        let cluster = "outbound|8080||server.default.svc.cluster.local";
        let client_stats = admin_stats(&self.client, &format!("cluster.{cluster}."))?;
        let server_stats = admin_stats(&self.server, "listener.0.0.0.0_15006.")?;
        let upstream_requests = stat(&client_stats, &format!("cluster.{cluster}.upstream_rq_completed"));
        let handshakes = stat(&client_stats, &format!("cluster.{cluster}.ssl.handshake"));
        let inbound_tls = stat(&server_stats, "listener.0.0.0.0_15006.ssl.handshake");
        step(
            "envoy",
            &format!(
                "client sidecar: {upstream_requests} requests on {cluster}, {handshakes} TLS handshakes"
            ),
        );
        step("envoy", &format!("server sidecar: {inbound_tls} mutual TLS handshakes accepted on 15006"));
        Ok(Proof { upstream_requests, mtls: handshakes > 0 && inbound_tls > 0 })
    }

    /// `[demo] drain`: SIGTERM to both sidecars; whether both exited 0.
    fn drain(&mut self) -> anyhow::Result<bool> {
        step("drain", "SIGTERM to the sidecars (readiness 503, drain, Envoy stopped)");
        let mut exits = Vec::new();
        for s in &mut self.sidecars {
            s.agent.signal(libc::SIGTERM)?;
        }
        for s in &mut self.sidecars {
            let status = s.agent.wait_timeout(Duration::from_secs(15))?;
            exits.push((s.name, status));
        }
        self.sidecars.clear();
        Ok(exits.iter().all(|(_, s)| s.is_some_and(|s| s.success())))
    }
}

/// `[demo] cleanup`: everything the demo made, removed (`Demo`'s drop).
fn cleanup(demo: Demo) {
    drop(demo);
    step("cleanup", "removed pods, cgroup, capture and pins");
}

/// `[demo] summary`: the result in one line; an error when it does not show what it should.
fn summary(
    choice: &detect::Choice,
    traffic: &Traffic,
    proof: &Proof,
    drained: bool,
    elapsed: Duration,
) -> anyhow::Result<()> {
    let (ok, failed, upstream_rq, mtls) = (traffic.ok, traffic.failed, proof.upstream_requests, proof.mtls);
    println!(
        "[demo] summary   backend={} requests_ok={ok} requests_failed={failed} envoy_upstream_requests={upstream_rq} \
         mtls={mtls} drained={drained} seconds={:.1}",
        choice.backend,
        elapsed.as_secs_f64()
    );
    if ok == 0 || upstream_rq == 0 || !mtls || !drained {
        bail!("the demo did not show what it should: see the summary above");
    }
    Ok(())
}

fn start_sidecar(
    pod: &Pod,
    name: &'static str,
    sa: &str,
    cgroup: &Cgroup,
    envoy: &Path,
    services: &Path,
    dir: &Path,
) -> anyhow::Result<Sidecar> {
    let root = dir.join(name);
    // The pod's tree as pilot-agent makes it: 0750, the proxy user's, so its sockets
    // (xDS, and SDS with the workload's key) are the proxy's and root's alone.
    for d in ["etc/istio/proxy", "var/run/secrets/workload-spiffe-uds"] {
        crate::sidecar::envoy::access::create_dir(&root.join(d), Some((PROXY_UID, PROXY_UID)))?;
    }
    let exe = std::env::current_exe()?;
    let log = create_new(&root.join("agent.log"))?;
    let mut cmd = Command::new(&exe);
    cmd.args(["proxy", "sidecar", "--discovery-address", "embedded", "--mesh-services"])
        .arg(services)
        .arg("--state-dir")
        .arg(dir.join("ca"))
        .current_dir(&root)
        .env_clear()
        .env("WEIR_LOG", "warn")
        .env("POD_NAME", name)
        .env("POD_NAMESPACE", "default")
        .env("SERVICE_ACCOUNT", sa)
        .env("INSTANCE_IP", pod.ipv4().to_string())
        .env("ECC_SIGNATURE_ALGORITHM", "ECDSA")
        .env(
            "PROXY_CONFIG",
            format!(
                // Istio's bootstrap keeps only its own stats; the demo's proof reads the
                // outbound cluster's and the inbound listener's, so it asks for them as
                // an Istio user would (proxyStatsMatcher).
                "{{\"binaryPath\": \"{}\", \"concurrency\": 1, \"terminationDrainDuration\": \"2s\", \
                 \"proxyStatsMatcher\": {{\"inclusionPrefixes\": [\"cluster.outbound|\", \"listener.0.0.0.0_15006.\"]}}}}",
                envoy.display()
            ),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Ctrl-C is the demo's to handle: the sidecars are drained by it, in order.
        .process_group(0);
    let agent = pod.spawn_placed(&mut cmd, Placement { cgroup: Some(cgroup), ..Placement::default() })?;
    Ok(Sidecar { name, root, agent })
}

/// The demo's directory: made fresh under the temporary directory with a name no one
/// can guess (`mkdtemp`, 0700), then opened to the proxy's group only (0750), which
/// Envoy needs to walk to its pod's files. The mesh CA's directory inside stays the
/// agents' own (0700); the apps (uid 1000) can enter none of it.
fn workdir() -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let template = std::env::temp_dir().join(format!("weir-{}-demo-XXXXXX", std::process::id()));
    let dir = nix::unistd::mkdtemp(&template).with_context(|| format!("make {}", template.display()))?;
    std::os::unix::fs::chown(&dir, None, Some(PROXY_UID))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750))?;
    Ok(dir)
}

/// A new file (never one that is there already, nor through a symlink).
fn create_new(path: &Path) -> anyhow::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o640)
        .open(path)
        .with_context(|| format!("create {}", path.display()))
}

fn write_new(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    create_new(path)?.write_all(text.as_bytes()).with_context(|| format!("write {}", path.display()))
}

fn wait_ready(pod: &Pod, s: &mut Sidecar) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let address = SocketAddr::from(([127, 0, 0, 1], 15021));
    loop {
        let ready = pod.run(|| async move {
            crate::sidecar::envoy::admin::request(
                address,
                hyper::Method::GET,
                "/healthz/ready",
                None,
                Duration::from_secs(1),
            )
            .await
        })?;
        if matches!(ready, Ok((s, _)) if s.is_success()) {
            return Ok(());
        }
        if let Some(status) = s.agent.child_mut().try_wait()? {
            bail!("the {} sidecar exited ({status}); its log:\n{}", s.name, log(s));
        }
        if Instant::now() > deadline {
            bail!("the {} sidecar is not ready after 60 s; its log:\n{}", s.name, log(s));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn log(s: &Sidecar) -> String {
    std::fs::read_to_string(s.root.join("agent.log")).unwrap_or_default()
}

/// `SPIFFE ID, expires <date>` of the workload certificate Envoy holds.
fn certificate(pod: &Pod) -> anyhow::Result<String> {
    let admin = crate::sidecar::envoy::EnvoyAdmin::new(15000).address;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, body) = pod
            .run(|| async move {
                crate::sidecar::envoy::admin::request(
                    admin,
                    hyper::Method::GET,
                    "/certs",
                    None,
                    Duration::from_secs(2),
                )
                .await
            })?
            .context("Envoy admin /certs")?;
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let found = json["certificates"].as_array().into_iter().flatten().find_map(|c| {
            let leaf = c["cert_chain"].as_array()?.first()?;
            let uri = leaf["subject_alt_names"].as_array()?.iter().find_map(|s| s["uri"].as_str())?;
            Some(format!("{uri}, expires {}", leaf["expiration_time"].as_str().unwrap_or("?")))
        });
        if let Some(found) = found {
            return Ok(found);
        }
        if Instant::now() > deadline {
            bail!("Envoy holds no workload certificate after 20 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn admin_stats(pod: &Pod, prefix: &str) -> anyhow::Result<std::collections::BTreeMap<String, u64>> {
    let admin = crate::sidecar::envoy::EnvoyAdmin::new(15000);
    let filter = format!("^{}", prefix.replace('.', "\\.").replace('|', "\\|"));
    Ok(pod.run(|| async move { admin.stats(&filter).await })??)
}

fn stat(stats: &std::collections::BTreeMap<String, u64>, name: &str) -> u64 {
    stats.get(name).copied().unwrap_or(0)
}

/// Ctrl-C (or SIGTERM) sets `flag` (the demo then stops its traffic and cleans up); a
/// second one ends the demo at once.
fn ctrlc_flag(flag: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let Ok(runtime) = crate::support::runtime::current_thread("the demo's signal watch") else { return };
        runtime.block_on(async {
            let Ok(shutdown) = crate::support::shutdown::Shutdown::watch() else { return };
            shutdown.requested().await;
            println!("[demo] ctrl-c    stopping the traffic, then draining and cleaning up");
            flag.store(true, Ordering::SeqCst);
            // The watch lives on this thread's runtime: a second signal ends the demo.
            std::future::pending::<()>().await
        });
    });
}

/// The demo's apps (hidden subcommand `demo-app`): `serve <addr>` answers every HTTP
/// request with 200 `hello from server`; `load <url> <seconds>` sends requests on two
/// keep-alive connections and prints `second <n> <ok> <failed> <p50 ms> <p99 ms>`
/// every second.
pub fn app(args: &[String]) -> anyhow::Result<()> {
    let runtime = crate::support::runtime::current_thread("the demo app")?;
    match args {
        [cmd, addr] if cmd == "serve" => {
            let addr: SocketAddr = addr.parse().with_context(|| format!("address {addr:?}"))?;
            runtime.block_on(serve(addr))
        }
        [cmd, url, seconds] if cmd == "load" => {
            let target: SocketAddr = url
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .parse()
                .with_context(|| format!("url {url:?}: expected http://<ip>:<port>/"))?;
            let seconds: u64 = seconds.parse().context("seconds")?;
            runtime.block_on(load(target, seconds))
        }
        _ => bail!("usage: weir demo-app serve <addr> | load http://<ip>:<port>/ <seconds>"),
    }
}

async fn serve(addr: SocketAddr) -> anyhow::Result<()> {
    use hyper::{Response, service::service_fn};
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("bind {addr}"))?;
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            let service = service_fn(|_req| async {
                Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(
                    bytes::Bytes::from_static(b"hello from server\n"),
                )))
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn load(target: SocketAddr, seconds: u64) -> anyhow::Result<()> {
    use http_body_util::{BodyExt as _, Empty};
    let results = Arc::new(std::sync::Mutex::new(Vec::<Option<f64>>::new()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(seconds.min(100_000_000));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let results = results.clone();
        workers.spawn(async move {
            'connect: while tokio::time::Instant::now() < deadline {
                let Ok(stream) = tokio::net::TcpStream::connect(target).await else {
                    results.lock().expect("results").push(None);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let Ok((mut sender, conn)) =
                    hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await
                else {
                    continue;
                };
                tokio::spawn(conn);
                while tokio::time::Instant::now() < deadline {
                    let started = Instant::now();
                    let request = hyper::Request::get("/")
                        .header("host", "server.default.svc.cluster.local")
                        .body(Empty::<bytes::Bytes>::new())
                        .expect("a valid request");
                    let ok = match sender.send_request(request).await {
                        Ok(r) => r.status().is_success() && r.into_body().collect().await.is_ok(),
                        Err(_) => false,
                    };
                    results
                        .lock()
                        .expect("results")
                        .push(ok.then(|| started.elapsed().as_secs_f64() * 1000.0));
                    if !ok {
                        continue 'connect;
                    }
                    // About 50 requests/s per connection: a steady, readable rate.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        });
    }
    let mut second = 0u64;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(1)).await;
        second += 1;
        if tokio::time::Instant::now() >= deadline {
            // The workers issue nothing after the deadline; what is still in flight
            // counts in this last line, as Envoy counts it.
            let finished = async { while workers.join_next().await.is_some() {} };
            let _ = tokio::time::timeout(Duration::from_secs(5), finished).await;
        }
        let batch: Vec<Option<f64>> = std::mem::take(&mut *results.lock().expect("results"));
        let mut ms: Vec<f64> = batch.iter().flatten().copied().collect();
        ms.sort_by(f64::total_cmp);
        let pct = |q: f64| if ms.is_empty() { 0.0 } else { ms[((ms.len() - 1) as f64 * q).round() as usize] };
        println!("second {second} {} {} {:.2} {:.2}", ms.len(), batch.len() - ms.len(), pct(0.5), pct(0.99));
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
    }
    workers.abort_all();
    Ok(())
}
