//! Only the plugin drives the ambient node agent. Against a running `weir cni ambient`
//! (tests/src/ambient.rs): a process as an unprivileged user (uid 65534) cannot reach
//! the event socket, and is refused by its credentials where the socket's mode is
//! loosened; an event, even from root, is refused when its `Netns` is not a pod's
//! (the agent's own, the node's, a path that walks elsewhere, a FIFO) or would move an
//! enrolled pod whose processes still run to another namespace; a FIFO never stalls
//! the agent; a slow client never delays another event. Before: the socket was `0666`
//! with no credential check, `Netns` was joined onto the host root unchecked (rules
//! landed in the node's own namespace), and a FIFO blocked a runtime worker for good.

use std::{
    net::IpAddr,
    os::unix::fs::PermissionsExt as _,
    process::{Command, Stdio},
    time::Duration,
};

use weir_tests::{
    ambient::{AmbientNode, pod_object},
    cni::KubeletSandbox,
    fake_ztunnel::FakeZtunnel,
    require_root, test_cgroup, test_name, tools,
};

const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");
const PATIENCE: Duration = Duration::from_secs(20);

/// `weir-testkit unix-post` in the node namespace as `uid`: the status line and body.
fn post(node: &AmbientNode, uid: u32, body: &str, hold_ms: Option<u64>) -> String {
    let socket = node.run_dir().join("pluginevent.sock");
    let mut cmd = tools::testkit_command();
    cmd.args(["unix-post", socket.to_str().unwrap(), "/cmdadd", body]);
    if let Some(ms) = hold_ms {
        cmd.arg(ms.to_string());
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = node.node.spawn(&mut cmd, uid).unwrap().into_inner().wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Istio's add event for `namespace/name` naming `netns` and `ip`.
fn event(namespace: &str, name: &str, netns: &str, ip: IpAddr) -> String {
    let e = weir_agent::node::enroll::event::AddEvent::new(
        netns,
        namespace,
        name,
        Some(&serde_json::json!({"ips": [{"address": format!("{ip}/24")}]})),
    );
    serde_json::to_string(&e).unwrap()
}

/// What the node's own namespace holds of a pod's in-pod rules (none, ever; the host
/// probe SNAT rule is the node's own).
fn node_rules(node: &AmbientNode) -> String {
    let mut cmd = Command::new("iptables-save");
    cmd.stdout(Stdio::piped()).stderr(Stdio::null());
    let out = node.node.spawn(&mut cmd, 0).unwrap().into_inner().wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("ISTIO") && !l.contains("ISTIO_POSTRT"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn only_root_reaches_the_event_socket_and_only_a_pods_namespace_is_taken() {
    require_root!();
    let mesh = weir_tests::Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    // The run dir as a node has it (other users may walk through it): the socket's own
    // mode and credential check are what is tested.
    std::fs::set_permissions(node.run_dir(), std::fs::Permissions::from_mode(0o755)).unwrap();
    node.api.set_namespace("apps", &[AMBIENT]);
    node.start_agent().unwrap();
    let zt = FakeZtunnel::start(&node.zds_socket());
    node.wait("ztunnel's snapshot", PATIENCE, || zt.log().contains(&"SnapshotSent".to_string())).unwrap();
    let web = mesh.pod("web").unwrap();
    let ip = IpAddr::V4(web.ipv4());
    node.api.set_pod(pod_object("apps", "web", "uid-web", ip, &[], &[]));
    let agent_ns = format!("/proc/{}/ns/net", node.agent_pid().unwrap());

    // Row 1: an unprivileged user on the node.
    let socket = node.run_dir().join("pluginevent.sock");
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the event socket is root's alone");
    let said = post(&node, 65534, &event("apps", "web", &agent_ns, ip), None);
    assert!(said.starts_with("connect: Permission denied"), "uid 65534 reached the socket: {said}");
    // Loosened by hand (a hostPath mounted into a pod, an operator's chmod): the
    // credentials still refuse, before the event is read.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let said = post(&node, 65534, &event("apps", "web", &agent_ns, ip), None);
    assert!(said.starts_with("HTTP/1.1 403") && said.contains("uid 65534 refused"), "{said}");
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600)).unwrap();

    // Root (the plugin's credentials) with namespaces that are not a pod's.
    for (netns, why) in [
        (agent_ns.as_str(), "node agent's own network namespace"),
        ("/proc/2/ns/net", "the node's network namespace"),
        ("/var/run/netns/../../../proc/1/ns/net", "expected /var/run/netns/<name>"),
        ("/etc/passwd", "not under a folder of named namespaces"),
    ] {
        let said = post(&node, 0, &event("apps", "web", netns, ip), None);
        assert!(said.starts_with("HTTP/1.1 500") && said.contains(why), "{netns}: {said}");
    }
    assert_eq!(node_rules(&node), "", "no rule ever lands in the node's namespace");
    assert!(!zt.log().iter().any(|l| l.starts_with("Add")), "ztunnel was sent nothing: {:?}", zt.log());

    // The pod itself, through its real namespace: taken.
    let web_ns = web.netns().path().to_str().unwrap().to_string();
    let kubepods = test_cgroup(&format!("{}-kubepods", test_name!()));
    let _sandbox = KubeletSandbox::start(&kubepods, "uid-web", web.netns()).unwrap();
    let said = post(&node, 0, &event("apps", "web", &web_ns, ip), None);
    assert!(said.starts_with("HTTP/1.1 200"), "{said}\n{}", node.agent_logs());
    // Another pod's namespace for the enrolled pod while its processes run: refused,
    // the pod stays where it is. An address the namespace does not hold: refused.
    let other = mesh.pod("other").unwrap();
    let other_ns = other.netns().path().to_str().unwrap().to_string();
    let said = post(&node, 0, &event("apps", "web", &other_ns, IpAddr::V4(other.ipv4())), None);
    assert!(said.starts_with("HTTP/1.1 500") && said.contains("its processes still run there"), "{said}");
    let said = post(&node, 0, &event("apps", "web", &other_ns, ip), None);
    assert!(said.starts_with("HTTP/1.1 500") && said.contains("none of the pod's addresses"), "{said}");
    assert_eq!(zt.log().iter().filter(|l| l.starts_with("Add uid-web")).count(), 1, "{:?}", zt.log());
    // Another pod named with web's namespace and address (a forged event: its
    // addresses are the event's own): web's namespace is enrolled, never a second
    // pod's (before, ztunnel would have been given web's namespace as "spy" too).
    node.api.set_pod(pod_object("apps", "spy", "uid-spy", ip, &[], &[]));
    let said = post(&node, 0, &event("apps", "spy", &web_ns, ip), None);
    assert!(said.starts_with("HTTP/1.1 500") && said.contains("pod uid-web's (enrolled already)"), "{said}");
    assert!(!zt.log().iter().any(|l| l.starts_with("Add uid-spy")), "{:?}", zt.log());
}

#[test]
fn a_fifo_or_a_slow_client_never_delays_another_event() {
    require_root!();
    let mesh = weir_tests::Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    node.api.set_namespace("apps", &[AMBIENT]);
    node.start_agent().unwrap();
    let zt = FakeZtunnel::start(&node.zds_socket());
    node.wait("ztunnel's snapshot", PATIENCE, || zt.log().contains(&"SnapshotSent".to_string())).unwrap();
    let web = mesh.pod("web").unwrap();
    let ip = IpAddr::V4(web.ipv4());
    node.api.set_pod(pod_object("apps", "web", "uid-web", ip, &[], &[]));

    // Row 2: a FIFO where a namespace should be (root made it: the path's form passes).
    let made = weir_tests::cni::FifoNetns::make().unwrap();
    let fifo = made.0.clone();
    // Two at once on a two-worker runtime: before, each held a worker in open(2).
    let body = event("apps", "web", fifo.to_str().unwrap(), ip);
    let posts: Vec<String> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..2).map(|_| s.spawn(|| post(&node, 0, &body, None))).collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for said in &posts {
        assert!(said.starts_with("HTTP/1.1 500") && said.contains("not a network namespace"), "{said}");
    }
    // A client that sends its request line and stalls holds only its own connection.
    let slow = {
        let body = event("apps", "web", web.netns().path().to_str().unwrap(), ip);
        let node_ref = &node;
        std::thread::scope(|s| {
            let slow = s.spawn(move || post(node_ref, 0, &body, Some(8_000)));
            std::thread::sleep(Duration::from_millis(300));
            let said =
                post(node_ref, 0, &event("apps", "web", web.netns().path().to_str().unwrap(), ip), None);
            assert!(
                said.starts_with("HTTP/1.1 200"),
                "an event beside a stalled client: {said}\n{}",
                node_ref.agent_logs()
            );
            slow.join().unwrap()
        })
    };
    // The stalled client's headers took longer than the agent waits: it got no 200.
    assert!(!slow.starts_with("HTTP/1.1 200"), "{slow}");
}
