//! pilot-agent on a bare host or VM: the agent runs as root in a directory holding
//! nothing but istiod's root certificate and a token (no Kubernetes volumes). It makes
//! what pilot-agent makes — the config directory and the SDS socket's — reachable by
//! the user it runs Envoy as (1337), and Envoy gets its mTLS certificate; a directory
//! Envoy's user cannot reach stops the agent at start, naming the path and the uid.

use std::{net::SocketAddr, os::unix::fs::MetadataExt as _, process::Stdio, time::Duration};

use weir_agent::sidecar::controlplane::{AdsServer, AuthPolicy, Snapshot, resources};
use weir_proto::type_url;
use weir_tests::{
    Mesh, Pod,
    control_plane::{CLUSTER_ID, ControlPlane, TOKEN, TestCa},
    envoy,
    istiod_ca::IstiodCa,
    require_root,
    sidecar::{AgentProcess, IstiodEnv, PROXY_UID, SidecarRoot},
    test_name, tools,
};

/// An inbound mTLS listener (its secrets come over SDS) and an outbound one.
fn snapshot(pod: &Pod) -> Snapshot {
    let inbound = SocketAddr::new(pod.ipv4().into(), 15006);
    let mut s = Snapshot::new();
    s.set(
        type_url::LISTENER,
        "1",
        [("inbound", resources::mtls_tcp_proxy_listener("inbound", inbound, "local", &[]))],
    );
    let local = SocketAddr::from(([127, 0, 0, 1], 8080));
    s.set(
        type_url::CLUSTER,
        "1",
        [("local", resources::static_cluster("local", &[local], Duration::from_secs(1)))],
    );
    s
}

struct Host {
    cp: ControlPlane,
    pod: Pod,
    _istiod: Pod,
    _mesh: Mesh,
    ca: TestCa,
}

impl Host {
    fn new(test: &str) -> Self {
        Self::with_ca(test, true)
    }

    /// `ca`: whether istiod's CA serves (without it no certificate can be had).
    fn with_ca(test: &str, with_ca: bool) -> Self {
        let mesh = Mesh::new(test).unwrap();
        let istiod = mesh.pod("istiod").unwrap();
        let pod = mesh.pod("vm").unwrap();
        let ca = TestCa::new("istiod serving CA").unwrap();
        let ads = AdsServer::new(
            snapshot(&pod),
            AuthPolicy { token: Some(TOKEN.into()), cluster_id: Some(CLUSTER_ID.into()) },
        );
        let mut cp = ControlPlane::istiod(&istiod, &ca, ads).unwrap();
        if with_ca {
            cp = cp.with_ca(IstiodCa::new("mesh workload CA", Some(TOKEN)).unwrap()).unwrap();
        }
        Self { cp, pod, _istiod: istiod, _mesh: mesh, ca }
    }

    /// `pilot-agent proxy sidecar` as root in `root`, launching the real Envoy.
    fn agent(&self, root: &SidecarRoot) -> anyhow::Result<AgentProcess> {
        let env = IstiodEnv::new(self.cp.addr, &self.pod, "vm");
        let pc = format!(
            "{{\"discoveryAddress\": \"{}\", \"binaryPath\": \"{}\"}}",
            self.cp.addr,
            envoy::binary()?.display()
        );
        let args = ["proxy", "sidecar", "--domain", "default.svc.cluster.local"];
        AgentProcess::launch(
            &self.pod,
            root,
            tools::pilot_agent_command(),
            &args,
            &env.with(&[("PROXY_CONFIG", &pc)]),
            None,
            None,
        )
    }
}

#[test]
fn a_root_agent_on_a_bare_directory_delivers_certificates_to_envoy_as_1337() {
    require_root!();
    let host = Host::new(&test_name!());
    let root = SidecarRoot::bare(host.ca.root_pem(), TOKEN).unwrap();
    let mut agent = host.agent(&root).unwrap();
    // Ready on its own probe: the inbound listener has its certificate.
    let mut wait = tools::pilot_agent_command();
    wait.args(["wait", "--timeoutSeconds", "60"]).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = host.pod.spawn(&mut wait, 0).unwrap().into_inner().wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "not ready: {}\nagent log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        agent.log()
    );
    for dir in ["etc/istio/proxy", "var/run/secrets/workload-spiffe-uds"] {
        let meta = std::fs::metadata(root.path().join(dir)).unwrap();
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o777), (PROXY_UID, PROXY_UID, 0o750), "{dir}");
    }
    let envoy = agent.children()[0];
    let status = std::fs::read_to_string(format!("/proc/{envoy}/status")).unwrap();
    assert!(
        status.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("1337")),
        "{status}"
    );
    let certs = host
        .pod
        .run(|| async {
            weir_agent::sidecar::envoy::admin::request(
                SocketAddr::from(([127, 0, 0, 1], 15000)),
                hyper::Method::GET,
                "/certs",
                None,
                Duration::from_secs(2),
            )
            .await
        })
        .unwrap()
        .unwrap();
    let body = String::from_utf8_lossy(&certs.1);
    assert!(
        body.contains("spiffe://cluster.local/ns/default/sa/vm"),
        "Envoy holds no workload certificate:\n{body}"
    );
    agent.child.signal(libc::SIGTERM).unwrap();
    assert_eq!(agent.wait_exit(Duration::from_secs(20)).unwrap().code(), Some(0), "{}", agent.log());
}

#[test]
fn a_socket_directory_envoy_cannot_reach_stops_the_agent_naming_it() {
    require_root!();
    use std::os::unix::fs::PermissionsExt as _;
    let host = Host::new(&test_name!());
    let root = SidecarRoot::bare(host.ca.root_pem(), TOKEN).unwrap();
    let sds_dir = root.path().join("var/run/secrets/workload-spiffe-uds");
    std::fs::create_dir_all(&sds_dir).unwrap();
    std::fs::set_permissions(&sds_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    // The agent exits during start-up (before or after its XDS socket appears).
    let log = match host.agent(&root) {
        Err(e) => format!("{e:#}"),
        Ok(mut agent) => {
            let status = agent.wait_exit(Duration::from_secs(20)).unwrap();
            assert!(agent.children().is_empty(), "no Envoy was started");
            format!("{status}\n{}", agent.log())
        }
    };
    assert!(log.contains("exit status: 1"), "{log}");
    assert!(
        log.contains("Envoy runs as uid 1337 gid 1337 and cannot connect to the SDS socket")
            && log.contains("workload-spiffe-uds/socket")
            && log.contains("Permission denied"),
        "{log}"
    );
    assert!(!log.contains("Envoy started"), "{log}");
}

#[test]
fn a_listener_waiting_for_a_secret_the_agent_cannot_get_keeps_the_pod_unready() {
    require_root!();
    let host = Host::with_ca(&test_name!(), false);
    let root = SidecarRoot::bare(host.ca.root_pem(), TOKEN).unwrap();
    let agent = host.agent(&root).unwrap();
    // Envoy has its listeners, but the inbound one waits for a certificate no CA gives.
    let ready = || {
        host.pod
            .run(|| async {
                weir_agent::sidecar::envoy::admin::request(
                    SocketAddr::from(([127, 0, 0, 1], 15020)),
                    hyper::Method::GET,
                    "/healthz/ready",
                    None,
                    Duration::from_secs(2),
                )
                .await
            })
            .unwrap()
    };
    // Once Envoy has its config, the answer is Envoy's state, and it stays no.
    let why = |r: &(hyper::StatusCode, bytes::Bytes)| format!("{} {}", r.0, String::from_utf8_lossy(&r.1));
    weir_tests::control_plane::eventually(Duration::from_secs(20), || {
        ready().ok().filter(|r| why(r).contains("Envoy is not ready"))
    })
    .unwrap_or_else(|| {
        let last = ready().map(|r| why(&r));
        panic!("Envoy never got its config (last: {last:?}); log:\n{}", agent.log())
    });
    for _ in 0..5 {
        std::thread::sleep(Duration::from_secs(1));
        let r = ready().unwrap();
        assert!(r.0 == 503 && why(&r).contains("Envoy is not ready"), "{}", why(&r));
    }
}
