//! Proxyless gRPC end to end: `DISABLE_ENVOY=true` starts no Envoy and no SDS server,
//! keeps the workload certificate fresh in `OUTPUT_CERTS`, and writes the gRPC xDS
//! bootstrap. A real gRPC library (Python grpcio, C core) reads that bootstrap,
//! resolves `xds:///hello.default.svc.cluster.local:7070` through the agent's XDS
//! socket from the test control plane (Weir's ADS + CA server playing istiod over
//! TLS), and calls a gRPC server in another pod at the endpoint EDS names.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, SystemTime},
};

use weir_agent::{
    sidecar::controlplane::{AdsServer, AuthPolicy, Snapshot, resources},
    sidecar::identity::chain,
};
use weir_proto::type_url;
use weir_tests::{
    Mesh, Pod, PodChild,
    capture::start_server,
    control_plane::{CLUSTER_ID, ControlPlane, TOKEN, TestCa, eventually},
    istiod_ca::IstiodCa,
    require_root,
    sidecar::{AgentProcess, IstiodEnv, SidecarRoot},
    test_name, tools,
};

const APP_UID: u32 = 1000;
const SERVICE: &str = "hello.default.svc.cluster.local";
const PORT: u16 = 7070;
const CONVERGE: Duration = Duration::from_secs(30);

/// What istiod's gRPC generator serves for `xds:///hello...:7070`: the API listener
/// named after the target, its routes, an EDS cluster and its endpoints.
fn grpc_snapshot(endpoint: SocketAddr, version: &str) -> Snapshot {
    let target = format!("{SERVICE}:{PORT}");
    let cluster = format!("outbound|{PORT}||{SERVICE}");
    let mut s = Snapshot::new();
    s.set(type_url::LISTENER, version, [(target.clone(), resources::grpc_api_listener(&target, &target))]);
    s.set(
        type_url::ROUTE,
        version,
        [(
            target.clone(),
            resources::route_config(&target, resources::RouteTarget::Cluster(cluster.clone())),
        )],
    );
    s.set(
        type_url::CLUSTER,
        version,
        [(cluster.clone(), resources::eds_cluster(&cluster, Duration::from_secs(1)))],
    );
    s.set(
        type_url::ENDPOINT,
        version,
        [(cluster.clone(), resources::load_assignment(&cluster, &[endpoint]))],
    );
    s
}

/// Runs the grpcio client in `pod` as the app user, with the agent's bootstrap.
fn grpc_calls(pod: &Pod, bootstrap: &Path, calls: u32) -> (bool, String) {
    let workspace = tools::workspace();
    // The app user reaches the script and grpcio through this test's descriptors,
    // whatever the directories above the checkout allow.
    let script = tools::for_children(&workspace.join("tests/py/grpc_xds_client.py"));
    // The interpreter scripts/bootstrap installed grpcio for (one the app user can run).
    let interpreter = std::fs::read_to_string(workspace.join(".tools/python/INTERPRETER"))
        .expect("scripts/bootstrap records the Python interpreter grpcio was installed for");
    let mut cmd = Command::new(interpreter.trim());
    cmd.arg(&script)
        .arg(format!("xds:///{SERVICE}:{PORT}"))
        .arg(calls.to_string())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("PYTHONPATH", tools::for_children(&workspace.join(".tools/python")))
        .env("GRPC_XDS_BOOTSTRAP", bootstrap)
        .envs(std::env::vars().filter(|(k, _)| k == "GRPC_TRACE" || k == "GRPC_VERBOSITY"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = pod.spawn(&mut cmd, APP_UID).expect("start the gRPC client");
    let status = child.wait_timeout(Duration::from_secs(60)).expect("wait");
    let mut out = child.into_inner();
    let status = status.unwrap_or_else(|| {
        let _ = out.kill();
        out.wait().expect("reap the gRPC client")
    });
    let (mut stdout, mut stderr) = (String::new(), String::new());
    use std::io::Read as _;
    out.stdout.take().expect("piped").read_to_string(&mut stdout).unwrap();
    out.stderr.take().expect("piped").read_to_string(&mut stderr).unwrap();
    (status.success(), format!("{stdout}{}", if status.success() { String::new() } else { stderr }))
}

/// The leaf certificate the agent wrote to `OUTPUT_CERTS`, if any.
fn output_leaf(dir: &Path) -> Option<chain::LeafInfo> {
    let pem = std::fs::read_to_string(dir.join("cert-chain.pem")).ok()?;
    chain::check_bundle("cert-chain.pem", &pem, SystemTime::now()).ok()
}

struct Rig {
    agent: AgentProcess,
    root: SidecarRoot,
    cp: ControlPlane,
    _servers: Vec<PodChild>,
    app: Pod,
    server: Pod,
    _istiod: Pod,
    _mesh: Mesh,
}

impl Rig {
    fn new(test: &str) -> Self {
        let mesh = Mesh::new(test).unwrap();
        let istiod = mesh.pod("istiod").unwrap();
        let server = mesh.pod("server").unwrap();
        let app = mesh.pod("app").unwrap();
        let servers = vec![
            start_server(&server, APP_UID, &["serve-grpc-health", "0.0.0.0:7070", "SERVING"]),
            start_server(&server, APP_UID, &["serve-grpc-health", "0.0.0.0:7071", "NOT_SERVING"]),
        ];
        let tls_ca = TestCa::new("istiod serving CA").unwrap();
        let ca = IstiodCa::new("mesh workload CA", Some(TOKEN)).unwrap();
        ca.force_lifetime(Some(Duration::from_secs(8)));
        let ads = AdsServer::new(
            grpc_snapshot(SocketAddr::new(server.ipv4().into(), 7070), "1"),
            AuthPolicy { token: Some(TOKEN.into()), cluster_id: Some(CLUSTER_ID.into()) },
        );
        let cp = ControlPlane::istiod(&istiod, &tls_ca, ads).unwrap().with_ca(ca).unwrap();
        let root = SidecarRoot::new(tls_ca.root_pem(), TOKEN).unwrap();
        let pod_env = IstiodEnv::new(cp.addr, &app, "app");
        let env = pod_env.with(&[("DISABLE_ENVOY", "true"), ("OUTPUT_CERTS", "./var/lib/istio/data")]);
        std::fs::create_dir_all(root.path().join("var/lib/istio")).unwrap();
        std::os::unix::fs::chown(root.path().join("var/lib/istio"), Some(1337), Some(1337)).unwrap();
        let agent = AgentProcess::start(&app, &root, &env, None).unwrap();
        Self { agent, root, cp, _servers: servers, app, server, _istiod: istiod, _mesh: mesh }
    }

    fn bootstrap(&self) -> PathBuf {
        self.root.path().join("etc/istio/proxy/grpc-bootstrap.json")
    }

    fn certs(&self) -> PathBuf {
        self.root.path().join("var/lib/istio/data")
    }
}

#[test]
fn a_grpc_client_resolves_xds_targets_through_the_agent_and_follows_pushes() {
    require_root!();
    let rig = Rig::new(&test_name!());

    // The bootstrap points grpcio at the agent's socket, by an absolute path.
    let text = std::fs::read_to_string(rig.bootstrap()).unwrap();
    let bootstrap: serde_json::Value = serde_json::from_str(&text).unwrap();
    let socket = rig.root.xds_socket();
    assert_eq!(bootstrap["xds_servers"][0]["server_uri"], format!("unix://{}", socket.display()), "{text}");
    assert_eq!(bootstrap["node"]["metadata"]["GENERATOR"], "grpc");

    let (ok, out) = grpc_calls(&rig.app, &rig.bootstrap(), 3);
    assert!(ok, "gRPC calls over xds:/// failed:\n{out}\nagent log:\n{}", rig.agent.log());
    assert_eq!(out.lines().collect::<Vec<_>>(), ["status 1"; 3], "every call reached the SERVING server");

    // istiod saw grpcio's own requests, relayed: the listener named after the target,
    // from the node the bootstrap names.
    let node = bootstrap["node"]["id"].as_str().unwrap().to_string();
    let seen = rig.cp.wait_for(CONVERGE, |reqs, _| {
        reqs.iter()
            .any(|r| {
                r.type_url == type_url::LISTENER
                    && r.names.iter().any(|n| n == &format!("{SERVICE}:{PORT}"))
                    && r.node_id.as_deref() == Some(node.as_str())
            })
            .then_some(())
    });
    assert!(seen.is_some(), "no LDS request for the target from {node}");

    // A push moves the service to the NOT_SERVING endpoint; a new client follows it.
    rig.cp.ads.push(grpc_snapshot(SocketAddr::new(rig.server.ipv4().into(), 7071), "2"));
    let (ok, out) = grpc_calls(&rig.app, &rig.bootstrap(), 1);
    assert!(ok && out.trim() == "status 2", "after the EDS push: {out}\nagent log:\n{}", rig.agent.log());
}

#[test]
fn without_envoy_there_is_no_sds_server_and_output_certs_stay_fresh() {
    require_root!();
    let mut rig = Rig::new(&test_name!());

    let first = eventually(CONVERGE, || output_leaf(&rig.certs()));
    let first = first.unwrap_or_else(|| panic!("no certificate in OUTPUT_CERTS\n{}", rig.agent.log()));
    assert_eq!(first.uris, ["spiffe://cluster.local/ns/default/sa/app"]);
    assert!(
        std::fs::read_to_string(rig.certs().join("key.pem")).unwrap().contains("PRIVATE KEY-----"),
        "the key is written beside the chain"
    );
    assert!(rig.certs().join("root-cert.pem").is_file());

    // As pilot-agent with DISABLE_ENVOY: nothing serves SDS, no Envoy runs.
    assert!(!rig.root.sds_socket().exists(), "an SDS socket was created");
    assert!(rig.agent.children().is_empty(), "the agent started a child: {:?}", rig.agent.children());

    // The 8 s certificate is renewed at about half its life, on disk.
    let renewed = eventually(Duration::from_secs(15), || {
        output_leaf(&rig.certs()).filter(|l| l.serial != first.serial)
    });
    let renewed = renewed.unwrap_or_else(|| panic!("OUTPUT_CERTS was not renewed\n{}", rig.agent.log()));
    assert!(renewed.not_after > first.not_after);
    assert!(rig.agent.is_running());
    let status = rig.agent.terminate().unwrap();
    assert!(status.success(), "agent exit {status}\n{}", rig.agent.log());
}
