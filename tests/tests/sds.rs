//! Workload certificates end to end (`weir_tests::mtls_pair`): two sidecar pods, each with `weir proxy sidecar`
//! serving SDS to a real Envoy, certificates issued by the test CA that istiod's
//! stand-in serves beside xDS (over TLS, on 15012). The client Envoy originates mutual
//! TLS with `default` + `ROOTCA`; the server Envoy requires it and checks the client's
//! SPIFFE ID. Real TCP requests cross it while certificates rotate and the CA goes away.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use weir_agent::sidecar::controlplane::{AdsServer, AuthPolicy, Snapshot, resources};
use weir_proto::type_url;
use weir_tests::{
    Mesh,
    control_plane::{CLUSTER_ID, ControlPlane, TOKEN, TestCa, eventually},
    istiod_ca::IstiodCa,
    mtls_pair::{APP, CONVERGE, Rig, load, metric, snapshot, snapshot_with, spiffe},
    require_root,
    sidecar::{AgentProcess, SidecarRoot},
    test_name,
};

#[test]
fn mutual_tls_between_two_sidecars_checks_the_spiffe_identity() {
    require_root!();
    let rig = Rig::new(&test_name!(), None);
    rig.expect_calls_pass();

    // Each agent made one CSR with its own SPIFFE ID and istiod's credentials.
    let requests = rig.ca.requests();
    let mut sans: Vec<_> = requests.iter().flat_map(|r| r.uri_sans.clone()).collect();
    sans.sort();
    assert_eq!(sans, [spiffe("client"), spiffe("server")], "{requests:?}");
    assert!(requests.iter().all(|r| r.authorization.as_deref() == Some(&*format!("Bearer {TOKEN}"))));
    assert!(requests.iter().all(|r| r.validity_seconds == 86_400), "SECRET_TTL defaults to 24h");
    // Envoy holds a certificate for its own identity, chained to the mesh root.
    let certs = rig.server.envoy().admin_get(&rig.server.pod, "/certs").unwrap();
    assert!(certs.contains(&spiffe("server")) && !certs.contains(&spiffe("client")), "{certs}");
    let expiry = metric(&rig.client.metrics(), "istio_agent_cert_expiry_seconds");
    assert!(expiry > 80_000.0 && expiry <= 86_400.0, "cert expiry gauge {expiry}");

    // The server accepts only the identity it is told to: require another one and the
    // same client is refused at the handshake; restore it and calls pass again.
    rig.cp.ads.push(snapshot(&rig.server.pod, "2", "somebody-else"));
    assert!(rig.cp.wait_for_ack(type_url::LISTENER, "2", CONVERGE), "{}", rig.logs());
    let refused = eventually(CONVERGE, || {
        let answer = rig.call();
        (!answer.starts_with("hello")).then_some(answer)
    });
    assert!(refused.is_some(), "a client with the wrong identity still got through\n{}", rig.logs());
    let handshake_errors =
        rig.server.envoy().stat(&rig.server.pod, "listener.0.0.0.0_15006.ssl.fail_verify_san").unwrap();
    assert!(handshake_errors.unwrap_or(0) > 0, "server counted SAN verification failures");
    rig.cp.ads.push(snapshot(&rig.server.pod, "3", "client"));
    rig.expect_calls_pass();
}

#[test]
fn ten_second_certificates_rotate_under_load_without_a_failed_request() {
    require_root!();
    let rig = Rig::new(&test_name!(), Some(Duration::from_secs(10)));
    rig.expect_calls_pass();
    let (client_before, server_before) = (rig.client.serial(), rig.server.serial());
    let issued_before = (rig.client.issued(), rig.server.issued());

    // 13 s of load spans at least two rotations (each at ~half the 10 s lifetime).
    let (passed, failed) = load(&rig.client.pod, 4, Duration::from_secs(13)).join().unwrap();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed during rotation: {:?}\n{}",
        failed.len(),
        passed + failed.len() as u64,
        &failed[..failed.len().min(5)],
        rig.logs()
    );
    assert!(passed > 100, "the load ran ({passed} requests)");

    assert!(rig.client.issued() >= issued_before.0 + 2, "client rotated twice\n{}", rig.logs());
    assert!(rig.server.issued() >= issued_before.1 + 2, "server rotated twice\n{}", rig.logs());
    let new = eventually(CONVERGE, || {
        let (c, s) = (rig.client.serials(), rig.server.serials());
        (!c.is_empty() && !s.is_empty() && !c.contains(&client_before) && !s.contains(&server_before))
            .then_some((c, s))
    });
    assert!(new.is_some(), "Envoy /certs still shows the first certificates\n{}", rig.logs());
    rig.expect_calls_pass();
}

#[test]
fn a_ca_outage_at_rotation_keeps_the_old_certificate_until_the_ca_returns() {
    require_root!();
    let mut rig = Rig::new(&test_name!(), Some(Duration::from_secs(12)));
    rig.expect_calls_pass();
    // Start the clock once both sides hold a freshly rotated certificate (the server's
    // own rotation must not be the one the outage interrupts), then take istiod (xDS
    // and CA) down. The clock starts at the older of the two rotations.
    let (client_first, server_first) = (rig.client.serial(), rig.server.serial());
    let (mut client_seen, mut server_seen) = (None, None);
    let both = eventually(CONVERGE, || {
        for (side, first, seen) in
            [(&rig.client, &client_first, &mut client_seen), (&rig.server, &server_first, &mut server_seen)]
        {
            let s = side.serials();
            if seen.is_none() && s.len() == 1 && &s[0] != first {
                *seen = Some((s[0].clone(), Instant::now()));
            }
        }
        client_seen.clone().zip(server_seen.clone())
    });
    let ((fresh, client_since), (_, server_since)) = both.expect("a rotation on both sides");
    let since = client_since.min(server_since);
    rig.cp.stop();

    // Rotation (at ~6 s) fails; the agent keeps the still-valid certificate.
    let failures = eventually(Duration::from_secs(11), || {
        let f = metric(&rig.client.metrics(), "istio_agent_num_failed_outgoing_requests_total");
        (f > 0.0 && rig.client.agent.log().contains("cannot issue the workload certificate")).then_some(f)
    });
    assert!(failures.is_some(), "no failed CSR counted and logged\n{}", rig.logs());
    assert!(since.elapsed() < Duration::from_secs(12), "checked before the old certificate expired");
    assert_eq!(rig.client.serial(), fresh, "Envoy still holds the certificate it had");
    assert!(
        rig.call().starts_with("hello v1 "),
        "traffic still flows on the valid certificate\n{}",
        rig.logs()
    );

    rig.cp.resume().unwrap();
    let renewed = eventually(CONVERGE, || {
        let s = rig.client.serials();
        (s.len() == 1 && s[0] != fresh).then(|| s[0].clone())
    });
    assert!(renewed.is_some(), "no new certificate after the CA came back\n{}", rig.logs());
    rig.expect_calls_pass();
    assert!(rig.client.agent.is_running() && rig.server.agent.is_running());
}

#[test]
fn the_agent_survives_sds_requests_it_cannot_serve() {
    require_root!();
    let mut rig = Rig::new(&test_name!(), None);
    rig.expect_calls_pass();
    // Clusters asking for a secret name the agent does not know, and for a root file
    // that does not exist: those never warm; the agent names each, keeps running,
    // and everything else keeps working.
    let app: SocketAddr = APP.parse().unwrap();
    let timeout = Duration::from_secs(1);
    let bad_name = ("kubernetes://my-credential", "ROOTCA");
    let bad_file = ("default", "file-root:/nonexistent/root-cert.pem");
    rig.cp.ads.push(snapshot_with(
        &rig.server.pod,
        "2",
        "client",
        vec![
            ("bad-name", resources::tls_static_cluster("bad-name", &[app], timeout, &[], bad_name)),
            ("bad-file", resources::tls_static_cluster("bad-file", &[app], timeout, &[], bad_file)),
        ],
    ));
    let named = eventually(CONVERGE, || {
        let log = rig.client.agent.log();
        (log.contains("unknown SDS resource \"kubernetes://my-credential\"")
            && log.contains("/nonexistent/root-cert.pem"))
        .then_some(())
    });
    assert!(named.is_some(), "the agent did not name both bad resources\n{}", rig.logs());
    assert!(!rig.client.agent.log().contains("panicked"));
    std::thread::sleep(Duration::from_secs(2));
    assert!(rig.client.agent.is_running(), "{}", rig.logs());
    rig.expect_calls_pass();
}

/// A SPIRE agent (or any SDS server) already listening on the workload socket is used
/// as it is: Weir neither replaces it nor asks the CA. A socket nobody answers on is
/// stale and is replaced by Weir's own.
#[test]
fn an_existing_sds_socket_is_left_to_its_owner_and_a_stale_one_replaced() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let istiod = mesh.pod("istiod").unwrap();
    let app = mesh.pod("app").unwrap();
    let tls_ca = TestCa::new("istiod serving CA").unwrap();
    let ca = IstiodCa::new("mesh workload CA", Some(TOKEN)).unwrap();
    let ads = AdsServer::new(Snapshot::new(), AuthPolicy::default());
    let cp = ControlPlane::istiod(&istiod, &tls_ca, ads).unwrap().with_ca(ca.clone()).unwrap();
    let proxy_config = format!("{{\"discoveryAddress\": \"{}\"}}", cp.addr);
    let env = [
        ("WEIR_ENVOY_MODE", "external"),
        ("PROXY_CONFIG", proxy_config.as_str()),
        ("ISTIOD_SAN", weir_tests::control_plane::ISTIOD_SAN),
        ("ISTIO_META_CLUSTER_ID", CLUSTER_ID),
        ("POD_NAMESPACE", "default"),
        ("SERVICE_ACCOUNT", "app"),
    ];

    // "SPIRE": a listener the test owns on the socket path.
    let root = SidecarRoot::new(tls_ca.root_pem(), TOKEN).unwrap();
    let spire = std::os::unix::net::UnixListener::bind(root.sds_socket()).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(root.sds_socket(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut agent = AgentProcess::start(&app, &root, &env, None).unwrap();
    let used =
        eventually(CONVERGE, || agent.log().contains("existing workload SDS socket found").then_some(()));
    assert!(used.is_some(), "{}", agent.log());
    spire.set_nonblocking(false).unwrap();
    let dialer = std::thread::spawn({
        let path = root.sds_socket();
        move || std::os::unix::net::UnixStream::connect(path).is_ok()
    });
    assert!(spire.accept().is_ok() && dialer.join().unwrap(), "the socket still belongs to SPIRE");
    // File-based secrets are still Weir's, on the credential socket, as pilot-agent's.
    let files = root.path().join("var/run/secrets/credential-uds/files-socket");
    assert!(
        std::os::unix::net::UnixStream::connect(&files).is_ok(),
        "no file-secret SDS server on {}",
        files.display()
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(ca.requests().is_empty(), "no CSR while another SDS server owns the identity");
    agent.terminate().unwrap();
    assert!(root.sds_socket().exists(), "Weir does not remove a socket it does not own");
    drop(spire);

    // The listener is gone; the socket file stays behind: stale, so Weir takes over.
    let mut agent = AgentProcess::start(&app, &root, &env, None).unwrap();
    let issued =
        eventually(CONVERGE, || agent.log().contains("generated new workload certificate").then_some(()));
    assert!(issued.is_some(), "{}", agent.log());
    assert!(!agent.log().contains("existing workload SDS socket found"), "{}", agent.log());
    assert_eq!(ca.requests().len(), 1);
    agent.terminate().unwrap();
    assert!(!root.sds_socket().exists(), "Weir removes its own socket on exit");
}
