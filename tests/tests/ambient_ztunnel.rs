//! The real ztunnel (`tests/src/ztunnel.rs`, istio/ztunnel built from `shared/peers`)
//! with Weir's ambient node agent on one test node: two ambient pods captured through
//! the plugin's ADD; the client pod's app calls the server pod's address and the
//! connection goes app → in-pod rules → ztunnel (client side) → HBONE mutual TLS on
//! 15008 → ztunnel (server side) → the server app, as ztunnel's own metrics and access
//! log say (SPIFFE identities, `mutual_tls`, HBONE address) and the server sees (the
//! client pod's address, its peer socket owned by ztunnel). Then: a third pod deleted
//! (ztunnel drops it), Weir's agent restarted under traffic (no connection fails, an
//! established one lives on, the new agent's snapshot carries both pods), ztunnel
//! restarted (the full snapshot again, traffic resumes), and a sidecar pod captured by
//! the same plugin on the same node beside them. If ztunnel cannot be built the test
//! fails naming why.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use weir_tests::{
    Mesh, Pod,
    ambient::{AmbientNode, in_pod, pod_object},
    cni::start_in,
    require_root, test_cgroup, test_name,
    ztunnel::{self, LocalWorkload, POD_PORTS, Ztunnel, listening_tcp_ports},
};

const PATIENCE: Duration = Duration::from_secs(60);
const NS: &str = "default";

fn workload(pod: &Pod, name: &str) -> LocalWorkload {
    LocalWorkload {
        name: name.into(),
        namespace: NS.into(),
        service_account: name.into(),
        ips: vec![pod.ipv4().into()],
    }
}

fn listening(pod: &Pod) -> Vec<u16> {
    let ports = listening_tcp_ports(pod.netns()).expect("listening ports");
    POD_PORTS.iter().copied().filter(|p| [15001, 15006, 15008].contains(p) && ports.contains(p)).collect()
}

/// One request from the client pod to `to`; the server's line.
fn ask(client: &Pod, to: SocketAddr) -> Result<String, String> {
    client
        .netns()
        .run(|| async move {
            let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(3))
                .map_err(|e| format!("connect: {e}"))?;
            s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
            let mut line = String::new();
            BufReader::new(&mut s).read_line(&mut line).map_err(|e| format!("read: {e}"))?;
            if line.is_empty() { Err("closed without an answer".into()) } else { Ok(line.trim().to_string()) }
        })
        .map_err(|e| e.to_string())?
}

/// Connections from the client every 50 ms until stopped; counts failures.
struct Traffic {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU32>,
    failed: Arc<std::sync::Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Traffic {
    fn start(client: &Pod, to: SocketAddr) -> Self {
        let (stop, ok, failed) =
            (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU32::new(0)), Arc::default());
        let (s, o, f): (Arc<AtomicBool>, Arc<AtomicU32>, Arc<std::sync::Mutex<Vec<String>>>) =
            (stop.clone(), ok.clone(), Arc::clone(&failed));
        let thread = client
            .netns()
            .spawn_thread(move || async move {
                while !s.load(Ordering::SeqCst) {
                    let r = TcpStream::connect_timeout(&to, Duration::from_secs(3)).and_then(|mut c| {
                        c.set_read_timeout(Some(Duration::from_secs(5)))?;
                        let mut line = String::new();
                        BufReader::new(&mut c).read_line(&mut line)?;
                        if line.starts_with("hello") {
                            Ok(())
                        } else {
                            Err(std::io::Error::other(format!("got {line:?}")))
                        }
                    });
                    match r {
                        Ok(()) => drop(o.fetch_add(1, Ordering::SeqCst)),
                        Err(e) => f.lock().unwrap().push(e.to_string()),
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
            .unwrap();
        Self { stop, ok, failed, thread: Some(thread) }
    }

    fn finish(mut self) -> (u32, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        (self.ok.load(Ordering::SeqCst), self.failed.lock().unwrap().clone())
    }
}

fn snapshots(zt: &Ztunnel) -> usize {
    zt.log().matches("received snapshot sent").count()
}

#[test]
fn two_ambient_pods_talk_over_hbone_through_weir_and_the_real_ztunnel() {
    require_root!();
    ztunnel::binary().unwrap_or_else(|e| panic!("the ztunnel peer: {e:#}"));
    let mesh = Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    let cgroup = test_cgroup(&format!("{}-kubepods", test_name!()));
    let (client, server, extra) =
        (mesh.pod("client").unwrap(), mesh.pod("server").unwrap(), mesh.pod("extra").unwrap());
    let uids = [
        "6f1e2d3c-aaaa-bbbb-cccc-00000000000c",
        "6f1e2d3c-aaaa-bbbb-cccc-00000000000d",
        "6f1e2d3c-aaaa-bbbb-cccc-00000000000e",
    ];
    let _sandboxes: Vec<_> = [(&client, uids[0]), (&server, uids[1]), (&extra, uids[2])]
        .iter()
        .map(|(pod, uid)| node.sandbox(&cgroup, uid, pod).unwrap())
        .collect();
    node.api.set_namespace(NS, &[("istio.io/dataplane-mode", "ambient")]);
    for ((pod, name), uid) in
        [(&client, "client"), (&server, "server"), (&extra, "extra")].into_iter().zip(uids)
    {
        node.api.set_pod(pod_object(NS, name, uid, IpAddr::V4(pod.ipv4()), &[], &[]));
    }
    // ztunnel's DNS proxy is not part of this test: DNS capture off.
    node.env.push(("AMBIENT_DNS_CAPTURE".into(), "false".into()));
    node.start_agent().unwrap();
    let workloads = [workload(&client, "client"), workload(&server, "server"), workload(&extra, "extra")];
    let mut zt = Ztunnel::start(&node.node, &node.zds_socket(), &workloads).unwrap();
    node.wait("ztunnel's first snapshot", PATIENCE, || snapshots(&zt) >= 1)
        .unwrap_or_else(|e| panic!("{e}\nztunnel:\n{}", zt.log()));

    for (pod, name) in [(&client, "client"), (&server, "server"), (&extra, "extra")] {
        node.cni_add(pod, NS, name)
            .unwrap_or_else(|e| panic!("ADD {name}: {e}\n{}\nztunnel:\n{}", node.agent_logs(), zt.log()));
        assert_eq!(node.api.redirection(NS, name).as_deref(), Some("enabled"));
        node.wait(&format!("ztunnel listening in {name}"), PATIENCE, || {
            listening(pod) == [15001, 15006, 15008]
        })
        .unwrap();
    }
    let _hello = start_in(server.netns(), 1000, &["serve-hello", "0.0.0.0:8080", "server"]).unwrap();
    let _echo = start_in(server.netns(), 1000, &["serve-echo", "0.0.0.0:8081"]).unwrap();
    let to = SocketAddr::new(server.ipv4().into(), 8080);

    // app → rules → ztunnel → HBONE mTLS → ztunnel → app.
    let answer = ask(&client, to).unwrap_or_else(|e| panic!("{e}\nztunnel:\n{}", zt.log()));
    assert!(answer.starts_with("hello server"), "{answer}");
    assert!(
        answer.contains(&format!("peer={}:", client.ipv4())),
        "the server sees the client pod's address: {answer}"
    );
    let metrics = in_pod(&node.node, "curl", &["-s", "http://127.0.0.1:15020/metrics"]);
    for reporter in ["source", "destination"] {
        let line = metrics
            .lines()
            .find(|l| {
                l.starts_with("istio_tcp_connections_opened_total")
                    && l.contains(&format!("reporter=\"{reporter}\""))
            })
            .unwrap_or_else(|| panic!("no {reporter} connection in ztunnel's metrics:\n{metrics}"));
        assert!(line.contains("connection_security_policy=\"mutual_tls\""), "{line}");
        assert!(line.contains("source_principal=\"spiffe://cluster.local/ns/default/sa/client\""), "{line}");
        assert!(
            line.contains("destination_principal=\"spiffe://cluster.local/ns/default/sa/server\""),
            "{line}"
        );
    }
    node.wait("ztunnel's access log", PATIENCE, || zt.log().matches("connection complete").count() >= 2)
        .unwrap();
    let log = zt.log();
    let hbone = format!("dst.hbone_addr={}:8080", server.ipv4());
    let access: Vec<&str> =
        log.lines().filter(|l| l.contains("connection complete") && l.contains(&hbone)).collect();
    assert!(
        access.iter().any(|l| l.contains("direction=\"outbound\""))
            && access.iter().any(|l| l.contains("direction=\"inbound\"")),
        "{log}"
    );
    assert!(
        access.iter().all(|l| l.contains("src.identity=\"spiffe://cluster.local/ns/default/sa/client\"")),
        "{access:?}"
    );
    assert!(access.iter().any(|l| l.contains(&format!("dst.addr={}:15008", server.ipv4()))), "{access:?}");

    // The server's peer socket is ztunnel's: an established connection open while ss looks.
    let mut held = client
        .netns()
        .run(|| async { TcpStream::connect(SocketAddr::new(server.ipv4().into(), 8081)) })
        .unwrap()
        .unwrap();
    held.write_all(b"before\n").unwrap();
    held.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut echoed = [0u8; 7];
    held.read_exact(&mut echoed).unwrap();
    assert_eq!(&echoed, b"before\n", "echoed through both ztunnels");
    let ss = in_pod(&server, "ss", &["-tnpH", "state", "established"]);
    let peer = ss.lines().find(|l| {
        l.contains(&format!("{}:8081", server.ipv4()))
            && l.contains(&client.ipv4().to_string())
            && l.contains("ztunnel")
    });
    assert!(peer.is_some(), "the app's peer socket is owned by ztunnel:\n{ss}");

    // A pod deleted: ztunnel drops it.
    node.api.delete_pod(NS, "extra");
    node.wait("ztunnel drops the deleted pod", PATIENCE, || listening(&extra).is_empty()).unwrap();
    // ztunnel logs through a non-blocking writer: the line may come after the ports go.
    let deleted = format!("pod delete request, shutting down proxy\tuid=\"{}\"", uids[2]);
    node.wait("ztunnel logs the delete", PATIENCE, || zt.log().contains(&deleted))
        .unwrap_or_else(|e| panic!("{e}\n{}", zt.log()));

    // Weir's agent restarted under traffic.
    let traffic = Traffic::start(&client, to);
    std::thread::sleep(Duration::from_millis(300));
    let before = snapshots(&zt);
    node.stop_agent().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    node.start_agent().unwrap();
    node.wait("ztunnel reconnects to the new agent", PATIENCE, || snapshots(&zt) > before).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let (ok, failed) = traffic.finish();
    assert!(
        failed.is_empty() && ok > 0,
        "connections failed across the agent's restart ({ok} ok): {failed:?}"
    );
    held.write_all(b"after\n").unwrap();
    let mut echoed = [0u8; 6];
    held.read_exact(&mut echoed).unwrap();
    assert_eq!(&echoed, b"after\n", "the established connection lived through the restart");
    assert!(node.agent_log(2).contains("found=2"), "the new agent found both pods:\n{}", node.agent_log(2));
    assert_eq!(listening(&client), [15001, 15006, 15008]);

    // ztunnel restarted: the full snapshot again, traffic resumes.
    zt.stop(Duration::from_secs(10)).unwrap();
    let zt = Ztunnel::start(&node.node, &node.zds_socket(), &workloads).unwrap();
    node.wait("the new ztunnel's snapshot", PATIENCE, || snapshots(&zt) >= 1)
        .unwrap_or_else(|e| panic!("{e}\nztunnel:\n{}", zt.log()));
    for uid in &uids[..2] {
        assert!(zt.log().contains(&format!("pod received, starting proxy\tuid=\"{uid}\"")), "{}", zt.log());
    }
    node.wait("ztunnel listening again", PATIENCE, || listening(&server) == [15001, 15006, 15008]).unwrap();
    let mut resumed = Err(String::new());
    node.wait("traffic resumes", PATIENCE, || {
        resumed = ask(&client, to);
        resumed.is_ok()
    })
    .unwrap_or_else(|e| panic!("{e}: {resumed:?}"));

    // A sidecar pod on the same node, through the same plugin: captured for its Envoy.
    let legacy = mesh.pod("legacy").unwrap();
    node.api.set_namespace("legacy", &[]);
    node.api.set_pod(weir_tests::cni::pod_object("legacy", "legacy", true, &[], &[]));
    node.cni_add(&legacy, "legacy", "legacy").unwrap_or_else(|e| panic!("ADD legacy: {e}"));
    let rules = in_pod(&legacy, "iptables-save", &[]);
    assert!(
        rules.contains("-j ISTIO_REDIRECT") && !rules.contains("ISTIO_PRERT"),
        "sidecar rules, not ambient ones:\n{rules}"
    );
    assert_eq!(node.api.redirection("legacy", "legacy"), None);
}
