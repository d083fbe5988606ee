//! The xDS relay end to end: a real Envoy bootstrapped to the agent's XDS socket gets
//! its listeners, clusters and endpoints through `weir proxy sidecar` from the test
//! control plane (Weir's own ADS server playing istiod over TLS, in its own pod), and
//! carries real TCP traffic with them. SotW and Delta; pushes, NACKs, upstream
//! restarts, refused credentials, floods, NDS and garbage on the socket.

use std::{
    io::Write as _,
    net::SocketAddr,
    process::{Command, Stdio},
    time::Duration,
};

use weir_agent::sidecar::controlplane::{AdsServer, AuthPolicy, Snapshot, resources};
use weir_proto::{istio::networking::nds::v1::NameTable, to_any, type_url};
use weir_tests::{
    Mesh, Placement, Pod, PodChild,
    capture::{ask, start_server},
    control_plane::{CLUSTER_ID, ControlPlane, TOKEN, TestCa, eventually, filler_clusters},
    envoy::{Envoy, ads_bootstrap},
    http, require_root,
    sidecar::{AgentProcess, IstiodEnv, PROXY_UID, SidecarRoot, peak_rss_kib},
    test_name,
};

const APP_UID: u32 = 1000;
const OUTBOUND: &str = "127.0.0.1:18000";
const ADMIN: &str = "127.0.0.1:15000";
const CONVERGE: Duration = Duration::from_secs(30);

/// istiod, a server with two versions of a service, and an app pod with the agent and
/// Envoy. Fields drop in order: Envoy, agent, control plane, then the pods.
struct Rig {
    envoy: Option<Envoy>,
    agent: AgentProcess,
    cp: ControlPlane,
    root: SidecarRoot,
    _servers: Vec<PodChild>,
    app: Pod,
    server: Pod,
    _istiod: Pod,
    _mesh: Mesh,
}

struct Options {
    delta: bool,
    token: &'static str,
    /// Give the agent a root certificate from another CA.
    wrong_ca: bool,
    dns: bool,
    /// Reject every stat in Envoy (large snapshots).
    lean_envoy: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self { delta: false, token: TOKEN, wrong_ca: false, dns: false, lean_envoy: false }
    }
}

/// The baseline snapshot: a TCP listener on 127.0.0.1:18000 → EDS cluster `hello` →
/// the server's port `port`.
fn snapshot(server: &Pod, port: u16) -> Snapshot {
    let mut s = Snapshot::new();
    s.set(
        type_url::LISTENER,
        "1",
        [("outbound", resources::tcp_proxy_listener("outbound", OUTBOUND.parse().unwrap(), "hello"))],
    );
    s.set(type_url::CLUSTER, "1", [("hello", resources::eds_cluster("hello", Duration::from_secs(1)))]);
    set_endpoints(&mut s, server, port, "1");
    s
}

fn set_endpoints(s: &mut Snapshot, server: &Pod, port: u16, version: &str) {
    let endpoint = SocketAddr::new(server.ipv4().into(), port);
    s.set(type_url::ENDPOINT, version, [("hello", resources::load_assignment("hello", &[endpoint]))]);
}

impl Rig {
    fn new(test: &str, options: Options) -> Self {
        let mesh = Mesh::new(test).unwrap();
        let istiod = mesh.pod("istiod").unwrap();
        let server = mesh.pod("server").unwrap();
        let app = mesh.pod("app").unwrap();
        let servers = vec![
            start_server(&server, APP_UID, &["serve-hello", "0.0.0.0:8080", "v1"]),
            start_server(&server, APP_UID, &["serve-hello", "0.0.0.0:8081", "v2"]),
        ];
        let ca = TestCa::new("istiod test CA").unwrap();
        let ads = AdsServer::new(
            snapshot(&server, 8080),
            AuthPolicy { token: Some(TOKEN.into()), cluster_id: Some(CLUSTER_ID.into()) },
        );
        let cp = ControlPlane::istiod(&istiod, &ca, ads).unwrap();
        let other_ca;
        let root_pem = if options.wrong_ca {
            other_ca = TestCa::new("somebody else's CA").unwrap();
            other_ca.root_pem()
        } else {
            ca.root_pem()
        };
        let root = SidecarRoot::new(root_pem, options.token).unwrap();
        let ip = app.ipv4().to_string();
        let pod_env = IstiodEnv::new(cp.addr, &app, "app");
        let mut env = pod_env.with(&[("WEIR_ENVOY_MODE", "external"), ("XDS_HEADER_WEIR_TEST", "relay")]);
        if options.dns {
            env.push(("ISTIO_META_DNS_CAPTURE", "true"));
        }
        let agent = AgentProcess::start(&app, &root, &env, None).unwrap();
        let node = format!("sidecar~{ip}~app.default~default.svc.cluster.local");
        let mut bootstrap = ads_bootstrap(&root.xds_socket(), options.delta, &node, ADMIN.parse().unwrap());
        if options.lean_envoy {
            bootstrap.push_str("stats_config: { stats_matcher: { reject_all: true } }\n");
        }
        let placement = Placement { user: Some((PROXY_UID, PROXY_UID)), ..Placement::default() };
        // Refused credentials leave Envoy in initialization: no LIVE to wait for.
        let envoy = if options.token != TOKEN || options.wrong_ca {
            Envoy::start_uninitialized(&app, &bootstrap, ADMIN.parse().unwrap(), placement)
        } else {
            Envoy::start_placed(&app, &bootstrap, ADMIN.parse().unwrap(), placement)
        };
        let envoy = match envoy {
            Ok(e) => e,
            Err(e) => panic!("{e:#}\nagent log:\n{}", agent.log()),
        };
        Self {
            envoy: Some(envoy),
            agent,
            cp,
            root,
            _servers: servers,
            app,
            server,
            _istiod: istiod,
            _mesh: mesh,
        }
    }

    fn envoy(&self) -> &Envoy {
        self.envoy.as_ref().expect("Envoy running")
    }

    /// What the app gets through Envoy's outbound listener ("hello v1 ..." or an error).
    fn call(&self) -> String {
        ask(&self.app, APP_UID, OUTBOUND.parse().unwrap())
    }

    /// Waits until a call answers from `version`; panics with both logs if it never does.
    fn expect_served_by(&self, version: &str) {
        let want = format!("hello {version} ");
        let mut last = String::new();
        if eventually(CONVERGE, || {
            last = self.call();
            last.starts_with(&want).then_some(())
        })
        .is_none()
        {
            panic!(
                "never served by {version} (last: {last:?})\nagent log:\n{}\nEnvoy log:\n{}",
                self.agent.log(),
                self.envoy().log()
            );
        }
    }

    fn config_dump(&self) -> String {
        self.envoy().admin_get(&self.app, "/config_dump?include_eds").unwrap()
    }

    /// The agent's own metrics from its status server (:15020).
    fn agent_metrics(&self) -> String {
        let (status, body) = self
            .app
            .run(|| async { http::get("127.0.0.1:15020".parse().unwrap(), "/stats/prometheus").await })
            .unwrap()
            .unwrap();
        assert_eq!(status, 200);
        body
    }

    fn metric(&self, name: &str) -> f64 {
        metric_value(&self.agent_metrics(), name)
    }
}

/// Sum of every sample of `name` (any labels) in Prometheus text.
fn metric_value(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            let bare = key.split('{').next()?;
            (bare == name).then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

fn envoy_follows_pushes_and_reports_nacks(delta: bool) {
    let rig = Rig::new(&test_name!(), Options { delta, ..Options::default() });
    rig.expect_served_by("v1");

    // istiod saw the stream with the agent's credentials and headers.
    let streams = rig.cp.log.streams();
    let stream = streams.iter().find(|s| s.refused.is_none()).expect("an accepted stream");
    assert_eq!(stream.delta, delta);
    assert_eq!(stream.authorization.as_deref(), Some(format!("Bearer {TOKEN}").as_str()));
    assert_eq!(stream.cluster_id.as_deref(), Some(CLUSTER_ID));
    assert!(stream.metadata.iter().any(|(k, v)| k == "weir_test" && v == "relay"), "{:?}", stream.metadata);
    let first = rig.cp.log.requests().into_iter().next().expect("a request");
    assert!(
        first.node_id.as_deref().is_some_and(|n| n.starts_with("sidecar~")),
        "Envoy's node reaches istiod on the first request: {first:?}"
    );

    // A push of new endpoints reaches Envoy: traffic moves and config_dump shows it.
    let acks_before =
        rig.cp.log.requests().iter().filter(|r| r.type_url == type_url::ENDPOINT && r.is_ack()).count();
    rig.cp.update(|s| set_endpoints(s, &rig.server, 8081, "2"));
    rig.expect_served_by("v2");
    assert!(rig.config_dump().contains("\"port_value\": 8081"), "EDS update visible in /config_dump");
    assert!(
        rig.cp
            .wait_for(CONVERGE, |reqs, _| {
                (reqs.iter().filter(|r| r.type_url == type_url::ENDPOINT && r.is_ack()).count() > acks_before)
                    .then_some(())
            })
            .is_some(),
        "Envoy's ACK of the push reaches istiod"
    );

    // A listener Envoy cannot take is NACKed, the NACK reaches istiod with Envoy's
    // reason, and Envoy keeps serving the last good config.
    rig.cp.update(|s| {
        s.set(type_url::LISTENER, "bad", [("outbound", listener_on("not-an-ip"))]);
    });
    let nack = rig.cp.wait_for(CONVERGE, |reqs, _| {
        reqs.iter().find(|r| r.type_url == type_url::LISTENER && r.is_nack()).cloned()
    });
    let nack = nack.unwrap_or_else(|| panic!("no NACK upstream\nagent log:\n{}", rig.agent.log()));
    assert!(
        nack.error.as_deref().unwrap_or_default().contains("not-an-ip"),
        "Envoy's reason reaches istiod: {nack:?}"
    );
    if !delta {
        assert_eq!(nack.version_info, "1", "a SotW NACK names the last accepted version");
    }
    rig.expect_served_by("v2");
}

/// A listener whose address Envoy must reject.
fn listener_on(address: &str) -> prost_types::Any {
    use weir_proto::envoy::config::{core::v3, listener::v3::Listener};
    let listener = Listener {
        name: "outbound".into(),
        address: Some(v3::Address {
            address: Some(v3::address::Address::SocketAddress(v3::SocketAddress {
                address: address.into(),
                port_specifier: Some(v3::socket_address::PortSpecifier::PortValue(18000)),
                ..Default::default()
            })),
        }),
        ..Default::default()
    };
    to_any(type_url::LISTENER, &listener)
}

#[test]
fn sotw_envoy_follows_pushes_and_nacks_reach_istiod() {
    require_root!();
    envoy_follows_pushes_and_reports_nacks(false);
}

#[test]
fn delta_envoy_follows_pushes_and_nacks_reach_istiod() {
    require_root!();
    envoy_follows_pushes_and_reports_nacks(true);
}

#[test]
fn upstream_restart_is_survived_and_reconverges() {
    require_root!();
    let mut rig = Rig::new(&test_name!(), Options { delta: true, ..Options::default() });
    rig.expect_served_by("v1");
    let failures_before = rig.metric("istio_agent_istiod_connection_failures_total");

    rig.cp.stop();
    // While istiod is away Envoy keeps its config and the relay keeps failing to
    // reconnect (counted), without exiting.
    rig.cp.update(|s| set_endpoints(s, &rig.server, 8081, "2"));
    assert!(
        eventually(CONVERGE, || (rig.metric("istio_agent_istiod_connection_failures_total")
            > failures_before)
            .then_some(()))
        .is_some(),
        "failed reconnects are counted\n{}",
        rig.agent.log()
    );
    assert!(rig.call().starts_with("hello v1 "), "Envoy keeps serving while istiod is down");
    assert!(rig.agent.is_running());

    rig.cp.resume().unwrap();
    rig.expect_served_by("v2");
    assert!(rig.agent.log().contains("failed to connect to upstream"), "{}", rig.agent.log());
}

/// istiod flapping: stopped and started five times, each time with a new push while
/// it was away. Envoy keeps serving throughout, the agent never exits, and after each
/// return Envoy converges on the config pushed while istiod was down.
#[test]
fn a_flapping_istiod_is_survived_and_every_return_converges() {
    require_root!();
    let mut rig = Rig::new(&test_name!(), Options { delta: true, ..Options::default() });
    rig.expect_served_by("v1");
    for (i, (port, version)) in
        [(8081, "v2"), (8080, "v1"), (8081, "v2"), (8080, "v1"), (8081, "v2")].into_iter().enumerate()
    {
        rig.cp.stop();
        rig.cp.update(|s| set_endpoints(s, &rig.server, port, &format!("{}", i + 2)));
        assert!(rig.call().starts_with("hello "), "flap {i}: Envoy keeps serving while istiod is down");
        assert!(rig.agent.is_running(), "flap {i}: the agent stays up\n{}", rig.agent.log());
        rig.cp.resume().unwrap();
        rig.expect_served_by(version);
    }
}

#[test]
fn a_bad_token_is_refused_with_a_clear_error_counted_and_retried() {
    require_root!();
    let rig = Rig::new(&test_name!(), Options { token: "not-the-token", ..Options::default() });
    // Refused streams are retried (Envoy reconnects, the relay reopens upstream).
    let refused = rig.cp.wait_for(CONVERGE, |_, streams| {
        (streams.iter().filter(|s| s.refused.is_some()).count() >= 2).then_some(())
    });
    assert!(refused.is_some(), "the refused stream is retried\n{}", rig.agent.log());
    let log = rig.agent.log();
    assert!(
        log.contains("upstream refused the XDS stream") && log.contains("authentication failure"),
        "{log}"
    );
    assert!(rig.metric("istio_agent_istiod_connection_terminations_total") >= 1.0);
    assert!(rig.call().starts_with("error"), "no config, no listener");

    // The token is read on every connect: fixing the file is enough.
    rig.root.set_token(TOKEN).unwrap();
    rig.expect_served_by("v1");
}

#[test]
fn a_server_certificate_from_another_ca_is_refused_with_a_clear_error() {
    require_root!();
    let rig = Rig::new(&test_name!(), Options { wrong_ca: true, ..Options::default() });
    let counted = eventually(CONVERGE, || {
        (rig.metric("istio_agent_istiod_connection_failures_total") >= 2.0).then_some(())
    });
    assert!(counted.is_some(), "each retry fails and is counted\n{}", rig.agent.log());
    let log = rig.agent.log();
    assert!(log.contains("failed to connect to upstream"), "{log}");
    assert!(
        log.contains("invalid peer certificate: UnknownIssuer"),
        "the error names the certificate problem: {log}"
    );
    assert!(rig.cp.log.streams().is_empty(), "no stream ever reached istiod");
    assert!(rig.call().starts_with("error"));
}

#[test]
fn nds_is_answered_by_the_dns_proxy_and_never_reaches_envoy() {
    require_root!();
    let rig = Rig::new(&test_name!(), Options { dns: true, ..Options::default() });
    rig.expect_served_by("v1");
    let mut table = NameTable::default();
    table.table.insert(
        "productpage.default.svc.cluster.local".into(),
        weir_proto::istio::networking::nds::v1::name_table::NameInfo {
            ips: vec!["10.66.0.99".into()],
            registry: "Kubernetes".into(),
            shortname: "productpage".into(),
            namespace: "default".into(),
            ..Default::default()
        },
    );
    rig.cp.update(|s| {
        s.set(type_url::NAME_TABLE, "1", [("", to_any(type_url::NAME_TABLE, &table))]);
    });
    assert!(
        rig.cp.wait_for_ack(type_url::NAME_TABLE, "1", CONVERGE),
        "the agent ACKs NDS\n{}",
        rig.agent.log()
    );

    for (name, transport) in [
        ("productpage.default.svc.cluster.local", "+notcp"),
        ("productpage.default", "+tcp"),
        ("productpage.default.svc", "+notcp"),
    ] {
        let answer = dig(&rig.app, name, transport);
        assert_eq!(answer, "10.66.0.99", "{name} over {transport}");
    }
    let dump = rig.config_dump();
    assert!(!dump.contains("NameTable") && !dump.contains("productpage"), "NDS must not reach Envoy");
    assert!(rig.metric("istio_agent_dns_requests_total") >= 3.0);
}

fn dig(pod: &Pod, name: &str, transport: &str) -> String {
    let mut cmd = Command::new("dig");
    cmd.args(["@127.0.0.1", "-p", "15053", "+short", "+time=2", "+tries=1", transport, name, "A"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = pod.spawn(&mut cmd, APP_UID).unwrap().into_inner().wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn garbage_on_the_xds_socket_does_not_take_the_agent_down() {
    require_root!();
    let mut rig = Rig::new(&test_name!(), Options::default());
    rig.expect_served_by("v1");
    for junk in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\xff\xff\xff\xff",
        &[0u8; 4096],
    ] {
        let path = rig.root.xds_socket();
        let _ = rig.app.run(|| async move {
            let mut s = std::os::unix::net::UnixStream::connect(&path)?;
            s.write_all(junk)?;
            std::io::Result::Ok(())
        });
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(rig.agent.is_running(), "{}", rig.agent.log());
    rig.cp.update(|s| set_endpoints(s, &rig.server, 8081, "2"));
    rig.expect_served_by("v2");
    // SIGTERM: the agent exits cleanly and removes its socket.
    rig.envoy = None;
    let status = rig.agent.terminate().unwrap();
    assert!(status.success(), "{status}\n{}", rig.agent.log());
    assert!(!rig.root.xds_socket().exists());
}

#[test]
fn ten_thousand_clusters_and_a_thousand_pushes_do_not_wedge_the_relay() {
    require_root!();
    let rig = Rig::new(&test_name!(), Options { lean_envoy: true, ..Options::default() });
    rig.expect_served_by("v1");
    let filler = SocketAddr::new(rig.server.ipv4().into(), 9);
    rig.cp.update(|s| {
        s.set(type_url::CLUSTER, "big", filler_clusters(10_000, filler));
    });
    assert!(
        rig.cp.wait_for_ack(type_url::CLUSTER, "big", Duration::from_secs(120)),
        "Envoy ACKs the 10 001-cluster snapshot\n{}",
        rig.agent.log()
    );
    let clusters = rig.envoy().admin_get(&rig.app, "/clusters").unwrap();
    assert!(
        clusters.contains("filler-00000::") && clusters.contains("filler-09999::"),
        "all clusters reached Envoy"
    );
    // A burst of endpoint pushes, unthrottled, while Envoy ACKs each one.
    for i in 0..1000u32 {
        let port = if i == 999 { 8081 } else { 8080 };
        rig.cp.update(|s| set_endpoints(s, &rig.server, port, &format!("burst-{i}")));
    }
    assert!(
        rig.cp.wait_for_ack(type_url::ENDPOINT, "burst-999", Duration::from_secs(120)),
        "the last push is ACKed: nothing wedged\n{}",
        rig.agent.log()
    );
    rig.expect_served_by("v2");
    let hwm_kib = peak_rss_kib(rig.agent.child.pid()).unwrap();
    assert!(hwm_kib < 256 * 1024, "agent peak RSS {hwm_kib} KiB");
}
