//! `pilot-agent proxy sidecar` as the injector runs it (seed 003's command line and
//! env), starting a real Envoy: bootstrap, readiness, `wait` and `request`, traffic
//! through Envoy, SIGTERM under wrk load, EXIT_ON_ZERO_ACTIVE_CONNECTIONS, Envoy dying
//! (reported, or restarted in VM mode), merged metrics, rewritten kubelet probes,
//! `/quitquitquit`, and a status port already taken. The upstream is the test control
//! plane (xDS + CA, over TLS, the istiod stand-in).

use std::{
    net::SocketAddr,
    path::Path,
    process::{Command, Output, Stdio},
    time::Duration,
};

use weir_agent::sidecar::controlplane::{AdsServer, AuthPolicy, Snapshot, resources};
use weir_proto::type_url;
use weir_tests::{
    Mesh, Pod, PodChild,
    capture::start_server,
    control_plane::{CLUSTER_ID, ControlPlane, ISTIOD_SAN, TOKEN, TestCa, eventually},
    envoy, http,
    istiod_ca::IstiodCa,
    require_root,
    sidecar::{AgentProcess, PROXY_UID, SidecarRoot},
    test_name, tools,
};

const APP_UID: u32 = 1000;
/// Envoy's outbound listeners in the sidecar pod: HTTP app and TCP echo upstreams.
const OUTBOUND_HTTP: &str = "127.0.0.1:18000";
const OUTBOUND_ECHO: &str = "127.0.0.1:18001";

/// Outbound listeners to the upstream pod's HTTP app (8080) and echo server (9000).
fn snapshot(upstream: &Pod) -> Snapshot {
    let mut s = Snapshot::new();
    s.set(
        type_url::LISTENER,
        "1",
        [
            (
                "outbound-http",
                resources::tcp_proxy_listener(
                    "outbound-http",
                    OUTBOUND_HTTP.parse().unwrap(),
                    "upstream-http",
                ),
            ),
            (
                "outbound-echo",
                resources::tcp_proxy_listener(
                    "outbound-echo",
                    OUTBOUND_ECHO.parse().unwrap(),
                    "upstream-echo",
                ),
            ),
        ],
    );
    let ip = upstream.ipv4();
    s.set(
        type_url::CLUSTER,
        "1",
        [
            (
                "upstream-http",
                resources::static_cluster(
                    "upstream-http",
                    &[SocketAddr::new(ip.into(), 8080)],
                    Duration::from_secs(1),
                ),
            ),
            (
                "upstream-echo",
                resources::static_cluster(
                    "upstream-echo",
                    &[SocketAddr::new(ip.into(), 9000)],
                    Duration::from_secs(1),
                ),
            ),
        ],
    );
    s
}

/// The injector's `istio-proxy` args (seed 003).
const INJECTED_ARGS: [&str; 11] = [
    "proxy",
    "sidecar",
    "--domain",
    "default.svc.cluster.local",
    "--serviceCluster",
    "app.default",
    "--proxyLogLevel=warning",
    "--proxyComponentLogLevel=misc:error",
    "--trust-domain=cluster.local",
    "--concurrency",
    "2",
];

/// Who runs the agent: the proxy user (Kubernetes' istio-proxy container) or root (VMs,
/// where the agent drops Envoy to 1337 itself).
#[derive(Clone, Copy, PartialEq)]
enum AgentUser {
    Proxy,
    Root,
}

/// Fields drop in order: agent (and its Envoy), apps, control plane, pods.
struct Rig {
    agent: AgentProcess,
    root: SidecarRoot,
    pod: Pod,
    _apps: Vec<PodChild>,
    upstream: Pod,
    cp: ControlPlane,
    _istiod: Pod,
    _mesh: Mesh,
}

impl Rig {
    /// The env is seed 003's, but for `CA_ADDR`: unset, so the CA is the discovery
    /// address with `ISTIOD_SAN` as its TLS name, as Istio does (the rig has no DNS for
    /// `istiod.istio-system.svc`).
    /// `proxy_config`: extra ProxyConfig fields (JSON members, without braces).
    fn new(test: &str, user: AgentUser, proxy_config: &str, env: &[(&str, &str)]) -> Self {
        Self::try_new(test, user, proxy_config, env, |_| Vec::new()).unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// `local_apps` starts processes in the sidecar pod before the agent.
    fn try_new(
        test: &str,
        user: AgentUser,
        proxy_config: &str,
        env: &[(&str, &str)],
        local_apps: impl FnOnce(&Pod) -> Vec<PodChild>,
    ) -> anyhow::Result<Self> {
        Self::try_new_serving(test, user, proxy_config, env, local_apps, |upstream| Some(snapshot(upstream)))
    }

    /// As `try_new`, with istiod serving `initial(upstream pod)` first; `None`: istiod
    /// is down when the agent starts.
    fn try_new_serving(
        test: &str,
        user: AgentUser,
        proxy_config: &str,
        env: &[(&str, &str)],
        local_apps: impl FnOnce(&Pod) -> Vec<PodChild>,
        initial: impl FnOnce(&Pod) -> Option<Snapshot>,
    ) -> anyhow::Result<Self> {
        let mesh = Mesh::new(test)?;
        let istiod = mesh.pod("istiod")?;
        let pod = mesh.pod("app")?;
        let upstream = mesh.pod("upstream")?;
        let mut apps = vec![
            start_server(&upstream, APP_UID, &["serve-http", "0.0.0.0:8080"]),
            start_server(&upstream, APP_UID, &["serve-echo", "0.0.0.0:9000"]),
        ];
        apps.extend(local_apps(&pod));
        let tls_ca = TestCa::new("istiod serving CA")?;
        let ca = IstiodCa::new("mesh workload CA", Some(TOKEN))?;
        let initial = initial(&upstream);
        let ads = AdsServer::new(
            initial.clone().unwrap_or_default(),
            AuthPolicy { token: Some(TOKEN.into()), cluster_id: Some(CLUSTER_ID.into()) },
        );
        let mut cp = ControlPlane::istiod(&istiod, &tls_ca, ads)?.with_ca(ca)?;
        if initial.is_none() {
            cp.stop();
        }
        let root = SidecarRoot::new(tls_ca.root_pem(), TOKEN)?;
        let envoy_binary = envoy::binary_for_children()?;
        let mut pc = format!(
            "{{\"discoveryAddress\": \"{}\", \"binaryPath\": \"{}\", \"proxyMetadata\": {{\"DNS_AGENT\": \"\"}}",
            cp.addr,
            envoy_binary.display()
        );
        if !proxy_config.is_empty() {
            pc.push_str(", ");
            pc.push_str(proxy_config);
        }
        pc.push('}');
        let ip = pod.ipv4().to_string();
        let host_ip = istiod.ipv4().to_string();
        let mut all_env: Vec<(&str, &str)> = vec![
            ("JWT_POLICY", "first-party-jwt"),
            ("PILOT_CERT_PROVIDER", "istiod"),
            ("POD_NAME", "app"),
            ("POD_NAMESPACE", "default"),
            ("INSTANCE_IP", &ip),
            ("SERVICE_ACCOUNT", "app"),
            ("HOST_IP", &host_ip),
            ("CANONICAL_SERVICE", "app"),
            ("CANONICAL_REVISION", "latest"),
            ("PROXY_CONFIG", &pc),
            ("ISTIO_META_POD_PORTS", "[\n]"),
            ("ISTIO_META_APP_CONTAINERS", "app"),
            ("ISTIO_META_CLUSTER_ID", CLUSTER_ID),
            ("ISTIO_META_INTERCEPTION_MODE", "REDIRECT"),
            ("ISTIO_META_WORKLOAD_NAME", "app"),
            ("ISTIO_META_OWNER", "kubernetes://apis/apps/v1/namespaces/default/deployments/app"),
            ("ISTIO_META_MESH_ID", "cluster.local"),
            ("DNS_AGENT", ""),
            ("ISTIOD_SAN", ISTIOD_SAN),
        ];
        if !env.iter().any(|(k, _)| *k == "ISTIO_KUBE_APP_PROBERS") {
            all_env.push(("ISTIO_KUBE_APP_PROBERS", "{}"));
        }
        all_env.extend_from_slice(env);
        let uid = match user {
            AgentUser::Proxy => Some((PROXY_UID, PROXY_UID)),
            AgentUser::Root => None,
        };
        let agent = AgentProcess::launch(
            &pod,
            &root,
            tools::pilot_agent_command(),
            &INJECTED_ARGS,
            &all_env,
            uid,
            None,
        )?;
        Ok(Self { agent, root, pod, _apps: apps, upstream, cp, _istiod: istiod, _mesh: mesh })
    }

    /// `pilot-agent <args>` in the pod as the proxy user, as a container's command.
    fn pilot_agent(&self, args: &[&str]) -> Output {
        let mut cmd = tools::pilot_agent_command();
        cmd.args(args).env("WEIR_LOG", "warn").stdout(Stdio::piped()).stderr(Stdio::piped());
        let child = self.pod.spawn(&mut cmd, PROXY_UID).unwrap();
        child.into_inner().wait_with_output().unwrap()
    }

    /// `pilot-agent wait` succeeded.
    fn wait_ready(&self) {
        let out = self.pilot_agent(&["wait", "--timeoutSeconds", "60"]);
        assert!(
            out.status.success(),
            "wait: {}\nagent log:\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.agent.log()
        );
    }

    fn local_get(&self, port: u16, path: &str) -> (u16, String) {
        self.pod
            .run(|| async move { http::get(SocketAddr::from(([127, 0, 0, 1], port)), path).await })
            .unwrap()
            .unwrap_or_else(|e| panic!("GET :{port}{path}: {e:#}\nagent log:\n{}", self.agent.log()))
    }

    fn local_post(&self, port: u16, path: &str) -> (u16, String) {
        self.pod
            .run(|| async move {
                http::request(SocketAddr::from(([127, 0, 0, 1], port)), "POST", path, None).await
            })
            .unwrap()
            .unwrap()
    }

    /// A request from another pod (as kubelet and Prometheus come from off-pod).
    fn remote(&self, method: &str, path: &str) -> (u16, String) {
        let target = SocketAddr::new(self.pod.ipv4().into(), 15020);
        self.upstream.run(|| async move { http::request(target, method, path, None).await }).unwrap().unwrap()
    }

    /// The one Envoy the agent runs.
    fn envoy_pid(&self) -> u32 {
        let children = eventually(Duration::from_secs(10), || {
            let c = self.agent.children();
            (c.len() == 1).then_some(c)
        })
        .unwrap_or_else(|| panic!("the agent has not exactly one child; log:\n{}", self.agent.log()));
        children[0]
    }

    fn wrk(&self, seconds: u32) -> std::thread::JoinHandle<String> {
        let mut cmd = Command::new("wrk");
        cmd.args(["-t1", "-c4", &format!("-d{seconds}s"), &format!("http://{OUTBOUND_HTTP}/")])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = self.pod.spawn(&mut cmd, APP_UID).unwrap();
        std::thread::spawn(move || {
            let out = child.into_inner().wait_with_output().unwrap();
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
        })
    }
}

/// `/proc/<pid>/status` field (`Uid`, `CapEff`, ...): its first value.
fn proc_status(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.split_whitespace().next())
        .unwrap_or_default()
        .to_string()
}

/// The requests wrk completed and whether it saw any error.
fn wrk_summary(out: &str) -> (u64, bool) {
    let requests = out
        .lines()
        .find(|l| l.contains("requests in"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let errors = out.contains("Socket errors") || out.contains("Non-2xx");
    (requests, errors)
}

#[test]
fn injected_command_line_starts_envoy_that_becomes_ready_and_carries_traffic() {
    require_root!();
    // ISTIO_BOOTSTRAP_OVERRIDE, YAML with `$(HOST_IP)`, reaches Envoy as --config-yaml.
    let dir = envoy::tempfile_dir::Dir::new("override").unwrap();
    let override_file = dir.path().join("override.yaml");
    std::fs::write(&override_file, "node:\n  locality:\n    zone: \"$(HOST_IP)-zone\"\n").unwrap();
    std::fs::set_permissions(&override_file, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let override_path = override_file.display().to_string();
    let rig = Rig::new(&test_name!(), AgentUser::Proxy, "", &[("ISTIO_BOOTSTRAP_OVERRIDE", &override_path)]);
    rig.wait_ready();

    // The bootstrap is Istio's: node, cluster, metadata from ISTIO_META_*, Delta ADS
    // over the XDS socket; the real Envoy accepts it in validate mode.
    let text = std::fs::read_to_string(rig.root.bootstrap()).unwrap();
    let b: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ip = rig.pod.ipv4();
    assert_eq!(b["node"]["id"], format!("sidecar~{ip}~app.default~default.svc.cluster.local"));
    assert_eq!(b["node"]["cluster"], "app.default");
    assert_eq!(b["node"]["metadata"]["WORKLOAD_NAME"], "app");
    assert_eq!(b["node"]["metadata"]["INTERCEPTION_MODE"], "REDIRECT");
    assert_eq!(b["dynamic_resources"]["ads_config"]["api_type"], "DELTA_GRPC");
    let validate = Command::new(envoy::binary().unwrap())
        .args(["--mode", "validate", "-c"])
        .arg(rig.root.bootstrap())
        .current_dir(rig.root.path())
        .output()
        .unwrap();
    assert!(
        validate.status.success(),
        "envoy --mode validate: {}",
        String::from_utf8_lossy(&validate.stderr)
    );

    // Proxyless gRPC applications get a bootstrap to the same socket.
    let grpc: serde_json::Value = serde_json::from_slice(
        &std::fs::read(rig.root.path().join("etc/istio/proxy/grpc-bootstrap.json")).unwrap(),
    )
    .unwrap();
    let socket = rig.root.xds_socket();
    assert_eq!(grpc["xds_servers"][0]["server_uri"], format!("unix://{}", socket.display()));
    assert_eq!(grpc["node"]["id"], b["node"]["id"]);
    assert_eq!(grpc["node"]["metadata"]["GENERATOR"], "grpc");

    // istiod saw a Delta stream from this node.
    let streams = rig.cp.log.streams();
    assert!(streams.iter().any(|s| s.delta && s.refused.is_none()), "{streams:?}");
    let node = format!("sidecar~{ip}~app.default~default.svc.cluster.local");
    assert!(rig.cp.log.requests().iter().any(|r| r.node_id.as_deref() == Some(&*node)));

    // Envoy runs with pilot-agent's flags: `request` reads them from the admin API.
    let out = rig.pilot_agent(&["request", "GET", "server_info"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let options = &info["command_line_options"];
    assert_eq!(options["concurrency"], 2, "{options}");
    assert_eq!(options["log_level"], "warning", "{options}");
    assert_eq!(options["component_log_level"], "misc:error", "{options}");
    assert_eq!(options["drain_strategy"], "Immediate", "{options}");
    assert_eq!(options["disable_hot_restart"], true, "{options}");
    assert_eq!(info["state"], "LIVE");
    let out = rig.pilot_agent(&["request", "GET", "config_dump"]);
    let dump = String::from_utf8_lossy(&out.stdout);
    assert!(
        dump.contains(&format!("\"zone\": \"{}-zone\"", rig._istiod.ipv4())),
        "override not applied:\n{dump}"
    );
    // `request` only reaches the ports pilot-agent allows.
    let out = rig.pilot_agent(&["request", "GET", "/", "--debug-port", "8080"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not in the allowed list"));

    // Traffic goes through Envoy to the upstream app; readiness answers through
    // Envoy's 15021 listener as kubelet would call it.
    let (status, body) = rig.local_get(18000, "/hello");
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    assert_eq!(rig.local_get(15021, "/healthz/ready").0, 200);
    assert_eq!(rig.remote("GET", "/healthz/ready").0, 200);
    // The workload certificate came from istiod's CA (the SDS path itself is
    // covered by tests/sds.rs).
    eventually(Duration::from_secs(20), || {
        rig.agent.log().contains("generated new workload certificate").then_some(())
    })
    .unwrap_or_else(|| panic!("no workload certificate; log:\n{}", rig.agent.log()));

    let mut rig = rig;
    let exit = rig.agent.terminate().unwrap();
    assert_eq!(exit.code(), Some(0), "log:\n{}", rig.agent.log());
}

#[test]
fn readiness_says_whether_config_is_missing_or_rejected() {
    require_root!();
    let mut rig = Rig::try_new_serving(&test_name!(), AgentUser::Proxy, "", &[], |_| Vec::new(), |_| None)
        .unwrap_or_else(|e| panic!("{e:#}"));
    fn not_ready(rig: &Rig, needle: &str) {
        let mut last = (0, String::new());
        eventually(Duration::from_secs(20), || {
            last = rig.local_get(15020, "/healthz/ready");
            (last.0 == 503 && last.1.contains(needle)).then_some(())
        })
        .unwrap_or_else(|| {
            panic!("readiness never said {needle:?}; last {last:?}; log:\n{}", rig.agent.log())
        });
    }
    // istiod is down: nothing received.
    not_ready(&rig, "config not received from XDS server (is Istiod running?)");
    // istiod comes up with clusters and a listener on an address the pod does not
    // have: Envoy accepts the clusters and rejects the listeners.
    let mut bad = snapshot(&rig.upstream);
    bad.set(
        type_url::LISTENER,
        "2",
        [(
            "elsewhere",
            resources::tcp_proxy_listener("elsewhere", "192.0.2.1:18000".parse().unwrap(), "upstream-http"),
        )],
    );
    rig.cp.ads.push(bad);
    rig.cp.resume().unwrap();
    not_ready(&rig, "config received from XDS server, but was rejected");
    // A good push makes it ready.
    let mut good = snapshot(&rig.upstream);
    good.set(
        type_url::LISTENER,
        "3",
        [(
            "outbound-http",
            resources::tcp_proxy_listener("outbound-http", OUTBOUND_HTTP.parse().unwrap(), "upstream-http"),
        )],
    );
    rig.cp.ads.push(good);
    rig.wait_ready();
}

#[test]
fn sigterm_under_load_drains_without_a_failed_request_and_exits_0() {
    require_root!();
    let mut rig = Rig::new(&test_name!(), AgentUser::Root, "\"terminationDrainDuration\": \"4s\"", &[]);
    rig.wait_ready();
    // A root agent runs Envoy as the proxy user with no capabilities (REDIRECT mode).
    let envoy = rig.envoy_pid();
    assert_eq!(proc_status(envoy, "Uid"), PROXY_UID.to_string());
    assert_eq!(proc_status(envoy, "CapEff"), "0000000000000000");

    let load = rig.wrk(4);
    std::thread::sleep(Duration::from_secs(1));
    rig.agent.child.signal(libc::SIGTERM).unwrap();
    // Draining: readiness fails at once, both on 15020 and through Envoy's 15021, while
    // Envoy keeps serving (outbound listeners are not drained).
    let (status, body) = eventually(Duration::from_secs(2), || {
        let r = rig.local_get(15020, "/healthz/ready");
        (r.0 == 503).then_some(r)
    })
    .unwrap_or_else(|| panic!("readiness still 200 after SIGTERM; log:\n{}", rig.agent.log()));
    assert!(body.contains("draining"), "{status} {body}");
    assert_eq!(rig.local_get(15021, "/healthz/ready").0, 503);

    let out = load.join().unwrap();
    let (requests, errors) = wrk_summary(&out);
    assert!(requests > 0 && !errors, "wrk through a draining Envoy:\n{out}\nagent log:\n{}", rig.agent.log());
    let exit = rig.agent.wait_exit(Duration::from_secs(20)).unwrap();
    assert_eq!(exit.code(), Some(0), "log:\n{}", rig.agent.log());
    let log = rig.agent.log();
    assert!(log.contains("graceful termination period starting") && log.contains("Envoy stopped"), "{log}");
    assert!(!Path::new(&format!("/proc/{envoy}")).exists(), "Envoy outlived its agent");
}

#[test]
fn a_root_agent_gives_a_tproxy_envoy_only_cap_net_admin() {
    require_root!();
    let mut rig = Rig::new(&test_name!(), AgentUser::Root, "", &[("ISTIO_META_INTERCEPTION_MODE", "TPROXY")]);
    rig.wait_ready();
    let envoy = rig.envoy_pid();
    assert_eq!(proc_status(envoy, "Uid"), PROXY_UID.to_string());
    assert_eq!(proc_status(envoy, "Gid"), PROXY_UID.to_string());
    // CAP_NET_ADMIN is bit 12; nothing else, in the effective and ambient sets.
    assert_eq!(proc_status(envoy, "CapEff"), "0000000000001000");
    assert_eq!(proc_status(envoy, "CapAmb"), "0000000000001000");
    let exit = rig.agent.terminate().unwrap();
    assert_eq!(exit.code(), Some(0), "log:\n{}", rig.agent.log());
}

/// An agent killed outright (SIGKILL: the OOM killer, a kubelet kill) takes its Envoy
/// with it, also when it runs Envoy as another user (the credential change used to
/// clear the parent-death signal, and Envoy lived on, serving with nobody rotating its
/// certificates).
#[test]
fn a_killed_root_agent_takes_its_envoy_with_it() {
    require_root!();
    let mut rig = Rig::new(&test_name!(), AgentUser::Root, "", &[]);
    rig.wait_ready();
    let envoy = rig.envoy_pid();
    assert_eq!(proc_status(envoy, "Uid"), PROXY_UID.to_string(), "Envoy runs as the proxy user");
    rig.agent.kill().unwrap();
    // Gone, or dead and not yet reaped by whoever inherited it.
    let state = || {
        std::fs::read_to_string(format!("/proc/{envoy}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()))
    };
    let gone =
        eventually(Duration::from_secs(10), || matches!(state(), None | Some('Z' | 'X')).then_some(()));
    assert!(gone.is_some(), "Envoy {envoy} outlived its SIGKILLed agent (state {:?})", state());
}

#[test]
fn exit_on_zero_active_connections_waits_for_the_last_connection() {
    require_root!();
    let mut rig = Rig::new(
        &test_name!(),
        AgentUser::Proxy,
        "\"terminationDrainDuration\": \"1s\"",
        &[("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true"), ("MINIMUM_DRAIN_DURATION", "1s")],
    );
    rig.wait_ready();
    // One long-lived connection through Envoy to the echo server.
    let conn = rig
        .pod
        .run(|| async {
            use std::io::{Read as _, Write as _};
            let mut s = std::net::TcpStream::connect(OUTBOUND_ECHO)?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.write_all(b"ping")?;
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf)?;
            anyhow::ensure!(&buf == b"ping", "echo answered {buf:?}");
            Ok(s)
        })
        .unwrap()
        .unwrap();
    rig.agent.child.signal(libc::SIGTERM).unwrap();
    // Past MINIMUM_DRAIN_DURATION and terminationDrainDuration, the open connection
    // keeps Envoy (and the agent) up.
    std::thread::sleep(Duration::from_secs(4));
    assert!(rig.agent.is_running(), "agent exited with a connection open; log:\n{}", rig.agent.log());
    assert!(rig.agent.log().contains("still draining active connections"), "{}", rig.agent.log());
    drop(conn);
    let exit = rig.agent.wait_exit(Duration::from_secs(15)).unwrap();
    assert_eq!(exit.code(), Some(0), "log:\n{}", rig.agent.log());
    assert!(rig.agent.log().contains("no active connections left"), "{}", rig.agent.log());
}

#[test]
fn envoy_killed_by_a_signal_is_reported_and_the_agent_exits() {
    require_root!();
    let mut rig = Rig::new(&test_name!(), AgentUser::Proxy, "", &[]);
    rig.wait_ready();
    let envoy = rig.envoy_pid();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(envoy as i32), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    let exit = rig.agent.wait_exit(Duration::from_secs(15)).unwrap();
    assert_eq!(exit.code(), Some(1), "log:\n{}", rig.agent.log());
    let log = rig.agent.log();
    assert!(log.contains("Envoy exited on its own (killed by signal 9 (SIGKILL))"), "{log}");
    assert!(log.contains("out-of-memory"), "{log}");
}

/// The descriptor (in `pid`) of the Unix socket listening on a path ending in `suffix`,
/// found through the process's own view of its network namespace.
fn listening_unix_fd(pid: u32, suffix: &str) -> i32 {
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).unwrap();
    // Num RefCount Protocol Flags Type St Inode Path; a listener has __SO_ACCEPTCON.
    let inode = table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() == 8 && f[3] == "00010000" && f[7].ends_with(suffix))
        .unwrap_or_else(|| panic!("no listener on *{suffix} in\n{table}"))[6]
        .to_string();
    let target = format!("socket:[{inode}]");
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .find(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_str() == Some(target.as_str())))
        .and_then(|e| e.file_name().to_str()?.parse().ok())
        .unwrap_or_else(|| panic!("no descriptor of {pid} is {target}"))
}

/// Shuts down descriptor `fd` of process `pid`, through a copy of it (pidfd_getfd):
/// the socket breaks under the process as it would on its own.
fn shut_down_in(pid: u32, fd: i32) {
    // SAFETY: plain system calls; both descriptors are ours and closed here.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0) as i32;
        assert!(pidfd >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
        let copy = libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) as i32;
        assert!(copy >= 0, "pidfd_getfd: {}", std::io::Error::last_os_error());
        assert_eq!(libc::shutdown(copy, libc::SHUT_RDWR), 0, "{}", std::io::Error::last_os_error());
        libc::close(copy);
        libc::close(pidfd);
    }
}

/// Every service is watched to its end: the SDS server's socket breaking under it
/// (shut down) ends the SDS server, and the agent says so and exits non-zero, as
/// pilot-agent exits when its servers fail; its socket files are gone.
#[test]
fn an_agent_whose_sds_server_dies_exits_non_zero() {
    require_root!();
    let mut rig = Rig::new(&test_name!(), AgentUser::Proxy, "", &[]);
    rig.wait_ready();
    let pid = rig.agent.child.pid();
    shut_down_in(pid, listening_unix_fd(pid, "workload-spiffe-uds/socket"));
    let exit = rig.agent.wait_exit(Duration::from_secs(30)).unwrap();
    let log = rig.agent.log();
    assert_eq!(exit.code(), Some(1), "log:\n{log}");
    assert!(log.contains("SDS server failed") && log.contains("shut down"), "{log}");
    assert!(!rig.root.sds_socket().exists(), "the SDS socket file is left behind");
    assert!(!rig.root.xds_socket().exists(), "the XDS socket file is left behind");
}

#[test]
fn envoy_killed_in_vm_mode_is_started_again_and_becomes_ready() {
    require_root!();
    let mut rig = Rig::new(&test_name!(), AgentUser::Proxy, "", &[("WEIR_RESTART_ENVOY", "true")]);
    rig.wait_ready();
    let first = rig.envoy_pid();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(first as i32), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    let second = eventually(Duration::from_secs(15), || {
        let c = rig.agent.children();
        (c.len() == 1 && c[0] != first).then(|| c[0])
    })
    .unwrap_or_else(|| panic!("no new Envoy; log:\n{}", rig.agent.log()));
    assert_ne!(first, second);
    rig.wait_ready();
    assert_eq!(rig.local_get(18000, "/").0, 200);
    assert!(rig.agent.is_running());
    assert!(rig.agent.log().contains("starting it again"), "{}", rig.agent.log());
    let exit = rig.agent.terminate().unwrap();
    assert_eq!(exit.code(), Some(0), "log:\n{}", rig.agent.log());
}

/// Probes as the injector writes them, against apps in the sidecar pod: an HTTP app on
/// 8080 and gRPC health servers on 9090 (SERVING) and 9091 (NOT_SERVING).
const PROBERS: &str = r#"{
  "/app-health/web/livez": {"httpGet": {"path": "/ok", "port": 8080, "scheme": "HTTP"}, "timeoutSeconds": 2},
  "/app-health/web/readyz": {"httpGet": {"path": "/status/503", "port": 8080}},
  "/app-health/web/startupz": {"httpGet": {"path": "/redirect/same", "port": 8080}},
  "/app-health/away/livez": {"httpGet": {"path": "/redirect/away", "port": 8080}},
  "/app-health/peer/livez": {"httpGet": {"path": "/require/peer/127.0.0.6", "port": 8080}},
  "/app-health/headers/livez": {"httpGet": {"path": "/require/header/x-probe/yes", "port": 8080, "httpHeaders": [{"name": "X-Probe", "value": "yes"}]}},
  "/app-health/host/livez": {"httpGet": {"path": "/require/header/host/web.internal", "port": 8080, "httpHeaders": [{"name": "Host", "value": "web.internal"}]}},
  "/app-health/tcp/livez": {"tcpSocket": {"port": 8080}},
  "/app-health/tcpdown/livez": {"tcpSocket": {"port": 8089}},
  "/app-health/grpc/livez": {"grpc": {"port": 9090}},
  "/app-health/grpcdown/livez": {"grpc": {"port": 9091}}
}"#;

#[test]
fn status_server_merges_metrics_rewrites_probes_and_quits_on_request() {
    require_root!();
    let env = [
        ("ISTIO_KUBE_APP_PROBERS", PROBERS),
        ("ISTIO_PROMETHEUS_ANNOTATIONS", r#"{"scrape":"true","port":"8080","path":"/metrics"}"#),
    ];
    let mut rig = Rig::try_new(&test_name!(), AgentUser::Proxy, "", &env, |pod| {
        vec![
            start_server(pod, APP_UID, &["serve-http", "0.0.0.0:8080"]),
            start_server(pod, APP_UID, &["serve-grpc-health", "0.0.0.0:9090", "SERVING"]),
            start_server(pod, APP_UID, &["serve-grpc-health", "0.0.0.0:9091", "NOT_SERVING"]),
        ]
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    rig.wait_ready();

    // Merged metrics: the agent's, Envoy's and the app's, in one text exposition.
    let (status, metrics) = rig.remote("GET", "/stats/prometheus");
    assert_eq!(status, 200);
    assert!(metrics.contains("istio_agent_scrapes_total"), "{metrics}");
    assert!(metrics.contains("envoy_server_live"), "no Envoy metrics");
    assert!(metrics.contains("app_requests_total 7"), "no app metrics");
    assert!(!metrics.contains("# EOF"), "an OpenMetrics EOF in the middle of the merge");

    // Rewritten probes, as kubelet sends them (to the pod IP, from off the pod): the
    // app's status comes back, never its body.
    let probe = |path: &str| rig.remote("GET", path);
    assert_eq!(probe("/app-health/web/livez"), (200, String::new()));
    assert_eq!(probe("/app-health/web/readyz"), (503, String::new()));
    assert_eq!(probe("/app-health/web/startupz"), (200, String::new()), "same-host redirect followed");
    assert_eq!(probe("/app-health/away/livez").0, 200, "a redirect elsewhere counts as success");
    assert_eq!(probe("/app-health/peer/livez").0, 200, "probes come from 127.0.0.6");
    assert_eq!(probe("/app-health/headers/livez").0, 200, "the probe's header, once, and no content-length");
    assert_eq!(probe("/app-health/host/livez").0, 200, "the probe's own Host");
    assert_eq!(probe("/app-health/tcp/livez").0, 200);
    assert_eq!(probe("/app-health/tcpdown/livez").0, 500);
    assert_eq!(probe("/app-health/grpc/livez").0, 200);
    assert_eq!(probe("/app-health/grpcdown/livez").0, 500);
    assert_eq!(probe("/app-health/nobody/livez").0, 400);

    // The DNS name table, /quitquitquit and /drain: from localhost only.
    assert_eq!(rig.remote("GET", "/debug/ndsz"), (403, "Only requests from localhost are allowed\n".into()));
    assert_ne!(rig.local_get(15020, "/debug/ndsz").0, 403);
    assert_eq!(rig.remote("POST", "/quitquitquit").0, 403);
    assert_eq!(rig.remote("POST", "/drain").0, 403);
    assert_eq!(rig.local_get(15020, "/quitquitquit").0, 405);
    assert!(rig.agent.is_running());
    assert_eq!(rig.local_post(15020, "/quitquitquit"), (200, "OK".into()));
    let exit = rig.agent.wait_exit(Duration::from_secs(10)).unwrap();
    assert_eq!(exit.code(), Some(0), "log:\n{}", rig.agent.log());
    assert!(rig.agent.log().contains("already drained"), "{}", rig.agent.log());
}

#[test]
fn a_status_port_in_use_is_a_clear_startup_error() {
    require_root!();
    let result = Rig::try_new(&test_name!(), AgentUser::Proxy, "", &[], |pod| {
        vec![start_server(pod, APP_UID, &["serve-echo", "0.0.0.0:15020"])]
    });
    let Err(e) = result else { panic!("the agent started with 15020 taken") };
    let e = format!("{e:#}");
    assert!(e.contains("status server cannot listen on :15020") && e.contains("in use"), "{e}");
}

#[test]
fn wait_times_out_naming_the_last_error() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    // No Envoy in this pod: nothing answers on 15021.
    let mut cmd = weir_tests::tools::weir_command();
    cmd.args(["wait", "--timeoutSeconds=1", "--periodMillis=100"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = pod.spawn(&mut cmd, PROXY_UID).unwrap().into_inner().wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("timeout waiting for Envoy proxy to become ready") && err.contains("127.0.0.1:15021"),
        "{err}"
    );
}

/// VM workload health: ProxyConfig's `readinessProbe` (a WorkloadGroup's) probes the
/// app together with Envoy's readiness, and each transition reaches istiod once as
/// `istio.v1.HealthInformation`: healthy with no error, unhealthy with code 13 and why.
#[test]
fn vm_readiness_probe_transitions_reach_istiod_once_each() {
    require_root!();
    let probe = r#""readinessProbe": {"httpGet": {"path": "/status/200", "port": 8081}, "periodSeconds": 1, "failureThreshold": 2}"#;
    let mut rig = Rig::try_new(&test_name!(), AgentUser::Proxy, probe, &[], |pod| {
        vec![start_server(pod, APP_UID, &["serve-http", "0.0.0.0:8081"])]
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    let reports = |rig: &Rig| -> Vec<Option<(i32, String)>> {
        rig.cp
            .log
            .requests()
            .into_iter()
            .filter(|r| r.type_url == type_url::HEALTH_INFO)
            .map(|r| r.error.map(|m| (r.error_code.unwrap_or_default(), m)))
            .collect()
    };
    let settle = Duration::from_secs(30);

    // Healthy once Envoy is ready and the app answers (an unhealthy report may come
    // first while Envoy starts).
    let healthy_at = eventually(settle, || {
        let r = reports(&rig);
        (r.last() == Some(&None)).then_some(r.len())
    })
    .unwrap_or_else(|| panic!("no healthy report: {:?}\n{}", reports(&rig), rig.agent.log()));

    // The app goes away: after two failed probes, one unhealthy report.
    let app = rig._apps.pop().expect("the local app is the last one started");
    drop(app);
    let unhealthy = eventually(settle, || {
        let r = reports(&rig);
        (r.len() > healthy_at).then(|| r[healthy_at].clone())
    });
    let (code, message) = unhealthy.flatten().unwrap_or_else(|| panic!("{:?}", reports(&rig)));
    assert_eq!(code, 13, "INTERNAL, as pilot-agent");
    assert!(message.contains("8081"), "the reason names the probe: {message}");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(reports(&rig).len(), healthy_at + 1, "repeated while unhealthy: {:?}", reports(&rig));

    // Back again: one healthy report.
    rig._apps.push(start_server(&rig.pod, APP_UID, &["serve-http", "0.0.0.0:8081"]));
    let recovered = eventually(settle, || (reports(&rig).len() > healthy_at + 1).then(|| reports(&rig)));
    assert_eq!(recovered.as_ref().and_then(|r| r.last().cloned()), Some(None), "{recovered:?}");
    std::thread::sleep(Duration::from_secs(3));
    let all = reports(&rig);
    assert_eq!(all.len(), healthy_at + 2, "repeated while healthy: {all:?}");
    assert!(all.windows(2).all(|w| w[0].is_none() != w[1].is_none()), "only transitions: {all:?}");
}

/// SIGTERM while the agent is still starting (istiod down, Envoy not yet configured):
/// the agent exits 0 as pilot-agent does, Envoy goes with it, and the agent's sockets
/// are removed. Sent twice: at once after the start, and once Envoy is running.
#[test]
fn sigterm_while_starting_exits_0_and_leaves_nothing() {
    require_root!();
    for at_once in [true, false] {
        let mut rig = Rig::try_new_serving(
            &format!("{}-{at_once}", test_name!()),
            AgentUser::Proxy,
            "",
            &[],
            |_| Vec::new(),
            |_| None,
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        let envoy = if at_once {
            None
        } else {
            eventually(Duration::from_secs(20), || {
                let (code, body) = rig.local_get(15020, "/healthz/ready");
                (code == 503 && body.contains("config not received")).then_some(())
            })
            .unwrap_or_else(|| panic!("the agent never reported itself starting; log:\n{}", rig.agent.log()));
            Some(rig.envoy_pid())
        };
        rig.agent.child.signal(libc::SIGTERM).unwrap();
        let exit = rig.agent.wait_exit(Duration::from_secs(30)).unwrap_or_else(|e| {
            panic!("at_once={at_once}: the agent did not exit on SIGTERM: {e:#}; log:\n{}", rig.agent.log())
        });
        assert_eq!(exit.code(), Some(0), "at_once={at_once}: log:\n{}", rig.agent.log());
        if let Some(envoy) = envoy {
            assert!(!Path::new(&format!("/proc/{envoy}")).exists(), "Envoy outlived its agent");
        }
        for socket in [rig.root.xds_socket(), rig.root.sds_socket()] {
            assert!(!socket.exists(), "at_once={at_once}: {} left behind", socket.display());
        }
    }
}
