//! Weir's eBPF capture beneath a socket load balancer with Cilium's semantics (issue
//! 49; the stand-in is `weir_tests::socket_lb`, kernel programs in `tests/lb-standin`),
//! sidecar pods, real traffic in test namespaces. The load balancer sits at the root of
//! a test cgroup hierarchy, as Cilium sits at the cgroup root; the pod's cgroup is a
//! child, and Weir attaches there. The kernel runs a socket's own cgroup's programs
//! first, then its ancestors' that allow multiple programs (a bpf_link always does):
//! Weir sees the Service address before the load balancer does.
//!
//! Each scene: a Service VIP (10.96.0.20:80, `fd00:96::20`) with two backends that log
//! every connection they take, the cluster DNS VIP (10.96.0.10:53, `fd00:96::a`) with a
//! DNS backend answering 9.9.9.9, and in the pod the agent's DNS listener (15053,
//! answering 1.2.3.4) and Envoy stand-ins on 15001/15006 reporting SO_ORIGINAL_DST.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
};

use weir_agent::capture::ebpf::{
    capture::CapturePrograms,
    config::{EbpfOptions, PodCapture},
    detect::{self, Backend, CaptureMode},
    netns::netns_cookie,
};
use weir_iptables::config::{CaptureConfig, InboundPorts, IpRanges};
use weir_tests::{
    Cgroup, Placement, PodChild,
    capture::{
        CaptureScene, Family, captured, istio_iptables, run_testkit, start_server, start_server_placed,
    },
    require_root,
    socket_lb::{AttachMode, Frontend, NodeAddress, Settings, SocketLb, unreachable},
    test_cgroup, test_name,
};

const VIP4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const DNS_VIP4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20);
const DNS_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0xa);
const BACKEND_PORT: u16 = 8081;

/// The test's cgroups: `root` (where the load balancer attaches, as Cilium's at the
/// cgroup root), `pod` beneath it (Weir's capture cgroup) and `node` beside the pod
/// (the host's own processes). Fields drop in order: children first.
struct Hierarchy {
    pod: Cgroup,
    node: Cgroup,
    root: Cgroup,
}

impl Hierarchy {
    fn new(test: &str) -> Self {
        let root = test_cgroup(test);
        let name = root.path().file_name().and_then(|n| n.to_str()).expect("cgroup name").to_string();
        let pod = Cgroup::create(&format!("{name}/pod")).expect("pod cgroup");
        let node = Cgroup::create(&format!("{name}/node")).expect("node cgroup");
        Self { pod, node, root }
    }
}

/// A capture scene under the load balancer. Fields drop in order: the load balancer
/// and the capture detach first, then processes, namespaces and cgroups go.
struct Scene {
    lb: SocketLb,
    capture: Option<CapturePrograms>,
    _servers: Vec<PodChild>,
    s: CaptureScene,
    log: tempfile::TempDir,
    h: Hierarchy,
}

impl Scene {
    /// The pods and listeners, the backends, and the load balancer's services (not yet
    /// attached).
    fn new(test: &str, family: Family, settings: Settings) -> Self {
        let h = Hierarchy::new(test);
        let s = CaptureScene::in_cgroup(test, family, &h.pod);
        let log = tempfile::tempdir().expect("temp dir");
        let log_path = log.path().join("backends.log");
        let log_arg = log_path.to_str().expect("UTF-8 temp path");
        let mut servers = Vec::new();
        for (pod, name) in [(&s.server, "backend-a"), (&s.server2, "backend-b")] {
            let addr = s.addr(pod, BACKEND_PORT).to_string();
            servers.push(start_server(pod, 0, &["serve-hello", &addr, name, "--log", log_arg]));
        }
        let dns_backend = s.addr(&s.server, 53).to_string();
        servers.push(start_server(&s.server, 0, &["dns-serve", &dns_backend, "9.9.9.9"]));
        let agent_dns = SocketAddr::new(loopback(family), 15053).to_string();
        let proxy = Placement { user: Some((1337, 1337)), cgroup: Some(&h.pod), ..Placement::default() };
        servers.push(start_server_placed(&s.client, proxy, &["dns-serve", &agent_dns, "1.2.3.4"]));
        let mut lb = SocketLb::load(settings).expect("the verifier accepts the stand-in");
        lb.add_service(Frontend::ClusterIp(vip(family)), &backends(&s)).unwrap();
        lb.add_service(Frontend::ClusterIp(dns_vip(family)), &[s.addr(&s.server, 53)]).unwrap();
        Self { lb, capture: None, _servers: servers, s, log, h }
    }

    /// Weir's eBPF capture on the pod's cgroup, as the injector configures a sidecar
    /// (DNS capture on, the cluster DNS VIP as the pod's resolver).
    fn capture(&mut self) {
        let mut programs = CapturePrograms::load().expect("the verifier accepts every capture program");
        programs.attach(self.h.pod.path()).expect("attach Weir beneath the load balancer");
        self.register(programs);
    }

    fn register(&mut self, mut programs: CapturePrograms) {
        let own: Vec<IpAddr> = vec![self.s.client.ipv4().into(), self.s.client.ipv6().into()];
        let pod =
            PodCapture::new(&sidecar_config(self.s.family), own, EbpfOptions { accelerate: false }).unwrap();
        programs.register(netns_cookie(Some(self.s.client.netns().path())).unwrap(), &pod, None).unwrap();
        self.capture = Some(programs);
    }

    fn backend_connections(&self) -> usize {
        backend_lines(&self.log.path().join("backends.log"))
    }

    fn app(&self) -> Placement<'_> {
        Placement { user: Some((1000, 1000)), cgroup: Some(&self.h.pod), ..Placement::default() }
    }

    fn proxy(&self) -> Placement<'_> {
        Placement { user: Some((1337, 1337)), cgroup: Some(&self.h.pod), ..Placement::default() }
    }

    fn is_backend(&self, addr: &str) -> bool {
        backends(&self.s).iter().any(|b| b.to_string() == addr)
    }
}

/// Nothing of Weir's (nor anything else) is attached to `cgroup`: a refusal leaves
/// nothing behind.
fn assert_no_programs(cgroup: &weir_tests::Cgroup) {
    let left = weir_tests::capture::cgroup_programs(cgroup.path());
    assert!(left.is_empty(), "left attached to {}: {left:?}", cgroup.path().display());
}

fn backend_lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map(|t| t.lines().count()).unwrap_or(0)
}

fn loopback(family: Family) -> IpAddr {
    match family {
        Family::V4 => Ipv4Addr::LOCALHOST.into(),
        Family::V6 => Ipv6Addr::LOCALHOST.into(),
    }
}

fn vip(family: Family) -> SocketAddr {
    match family {
        Family::V4 => SocketAddr::new(VIP4.into(), 80),
        Family::V6 => SocketAddr::new(VIP6.into(), 80),
    }
}

fn dns_vip(family: Family) -> SocketAddr {
    match family {
        Family::V4 => SocketAddr::new(DNS_VIP4.into(), 53),
        Family::V6 => SocketAddr::new(DNS_VIP6.into(), 53),
    }
}

fn backends(s: &CaptureScene) -> Vec<SocketAddr> {
    vec![s.addr(&s.server, BACKEND_PORT), s.addr(&s.server2, BACKEND_PORT)]
}

fn sidecar_config(family: Family) -> CaptureConfig {
    let mut cfg = CaptureConfig {
        outbound_ip_ranges_include: IpRanges::All,
        inbound_ports: InboundPorts::None,
        enable_ipv6: true,
        redirect_dns: true,
        ..CaptureConfig::default()
    };
    match family {
        Family::V4 => cfg.dns_servers_v4 = vec![DNS_VIP4.to_string()],
        Family::V6 => cfg.dns_servers_v6 = vec![DNS_VIP6.to_string()],
    }
    cfg
}

/// `local=<addr>` of a testkit hello line.
fn local_of(line: &str) -> String {
    line.split_whitespace().find_map(|f| f.strip_prefix("local=")).unwrap_or_default().to_string()
}

/// The sidecar case with the load balancer at the ancestor as Cilium attaches it on
/// current kernels (a bpf_link): the app's VIP reaches Envoy's listener as the VIP (and
/// getpeername() says so), the proxy's own connect is load-balanced, nothing reaches a
/// backend around the proxy; DNS to the cluster DNS VIP reaches the agent, the proxy's
/// query reaches the DNS backend, and both replies come from the VIP.
fn vip_survives(test: &str, family: Family) {
    let mut sc = Scene::new(test, family, Settings::default());
    sc.lb.attach(sc.h.root.path(), AttachMode::Link).expect("attach the load balancer at the root");
    sc.capture();
    let vip = vip(family);

    for _ in 0..3 {
        let said = run_testkit(&sc.s.client, sc.app(), &["ask-peer", &vip.to_string()]);
        let (peer, line) = said.split_once('\n').unwrap_or_else(|| panic!("app to the VIP: {said:?}"));
        let (_, orig) = captured(line).unwrap_or_else(|| panic!("app to the VIP not captured: {said:?}"));
        assert_eq!(orig, vip.to_string(), "SO_ORIGINAL_DST is the Service VIP, not a backend");
        assert_eq!(peer, format!("peer={vip}"), "the app's getpeername() is the VIP");
    }
    assert_eq!(sc.backend_connections(), 0, "no app connection reached a backend around the proxy");

    let line = run_testkit(&sc.s.client, sc.proxy(), &["ask", &vip.to_string()]);
    assert!(line.starts_with("hello backend-"), "the proxy's connect to the VIP: {line:?}");
    assert!(sc.is_backend(&local_of(&line)), "translated to a backend by the load balancer: {line}");
    assert_eq!(sc.backend_connections(), 1, "only the proxy's connection reached a backend");
    let said = run_testkit(&sc.s.client, sc.proxy(), &["ask-peer", &vip.to_string()]);
    assert!(said.starts_with(&format!("peer={vip}\nhello backend-")), "the LB's getpeername: {said:?}");

    let dns = dns_vip(family).to_string();
    let query = ["dns-query", dns.as_str(), "echo.ns.svc.cluster.local"];
    let reply = run_testkit(&sc.s.client, sc.app(), &query);
    assert_eq!(reply, format!("answer 1.2.3.4 from {dns}"), "the app's DNS reached the agent, from the VIP");
    let reply = run_testkit(&sc.s.client, sc.proxy(), &query);
    assert_eq!(reply, format!("answer 9.9.9.9 from {dns}"), "the agent's query reached the DNS backend");

    let weir = sc.capture.as_ref().unwrap().counters().unwrap();
    assert_eq!(weir.get("redirected"), 3, "{weir:?}");
    assert!(weir.get("dns_redirected") >= 1 && weir.get("dns_restored") >= 1, "{weir:?}");
    let lb = sc.lb.counters().unwrap();
    // The proxy's two TCP connects and its DNS datagram; the reply's source restored.
    assert_eq!(lb.get("forward"), 3, "{lb:?}");
    assert!(lb.get("reverse_recvmsg") >= 1 && lb.get("reverse_peer") >= 1, "{lb:?}");
}

#[test]
fn the_vip_survives_a_socket_lb_at_the_ancestor_ipv4() {
    require_root!();
    vip_survives(&test_name!(), Family::V4);
}

#[test]
fn the_vip_survives_a_socket_lb_at_the_ancestor_ipv6() {
    require_root!();
    vip_survives(&test_name!(), Family::V6);
}

/// A dual-stack socket's connect to `::ffff:<VIP>`: Weir records the IPv4 VIP, the
/// load balancer looks the mapped address up as IPv4 (`sock6_xlate_v4_in_v6`).
#[test]
fn a_v4_mapped_vip_survives_and_the_proxy_s_is_load_balanced() {
    require_root!();
    let test = test_name!();
    let mut sc = Scene::new(&test, Family::V4, Settings::default());
    sc.lb.attach(sc.h.root.path(), AttachMode::Link).unwrap();
    sc.capture();
    let mapped = SocketAddr::new(IpAddr::V6(VIP4.to_ipv6_mapped()), 80);
    let said = run_testkit(&sc.s.client, sc.app(), &["ask-peer", &mapped.to_string()]);
    let (peer, line) = said.split_once('\n').unwrap_or_else(|| panic!("{said:?}"));
    assert_eq!(peer, format!("peer={mapped}"), "getpeername, v4-mapped");
    assert_eq!(captured(line).map(|(_, o)| o), Some(vip(Family::V4).to_string()), "{said:?}");
    let line = run_testkit(&sc.s.client, sc.proxy(), &["ask", &mapped.to_string()]);
    assert!(line.starts_with("hello backend-"), "the proxy's v4-mapped connect: {line:?}");
    assert_eq!(sc.backend_connections(), 1);
}

/// The real Envoy as the sidecar: the app's connections to the VIP all go through it
/// (its original_dst listener reads the VIP), and its own upstream connections to the
/// VIP are load-balanced to the backends: as many reach the backends as Envoy opened.
#[test]
fn envoy_s_upstream_to_the_vip_is_load_balanced_and_nothing_goes_around_it() {
    require_root!();
    let test = test_name!();
    let h = Hierarchy::new(&test);
    let mesh = weir_tests::Mesh::new(&test).unwrap();
    let client = mesh.pod("client").unwrap();
    let server = mesh.pod("server").unwrap();
    let log = tempfile::tempdir().unwrap();
    let log_path = log.path().join("backends.log");
    let backend = SocketAddr::new(server.ipv4().into(), BACKEND_PORT);
    let args = ["serve-hello", &backend.to_string(), "backend-a", "--log", log_path.to_str().unwrap()];
    let _backend = start_server(&server, 0, &args);

    let mut lb = SocketLb::load(Settings::default()).unwrap();
    lb.add_service(Frontend::ClusterIp(vip(Family::V4)), &[backend]).unwrap();
    lb.attach(h.root.path(), AttachMode::Link).unwrap();
    let mut programs = CapturePrograms::load().unwrap();
    programs.attach(h.pod.path()).unwrap();
    let own: Vec<IpAddr> = vec![client.ipv4().into(), client.ipv6().into()];
    let pod = PodCapture::new(&sidecar_config(Family::V4), own, EbpfOptions { accelerate: false }).unwrap();
    programs.register(netns_cookie(Some(client.netns().path())).unwrap(), &pod, None).unwrap();

    let sidecar = Placement { user: Some((1337, 1337)), cgroup: Some(&h.pod), ..Placement::default() };
    let envoy = weir_tests::envoy::Envoy::start_placed(
        &client,
        weir_tests::envoy::OUTBOUND_PASSTHROUGH,
        "127.0.0.1:15000".parse().unwrap(),
        sidecar,
    )
    .expect("envoy starts");
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&h.pod), ..Placement::default() };
    for _ in 0..3 {
        let reply = run_testkit(&client, app, &["ask", &vip(Family::V4).to_string()]);
        assert!(reply.starts_with("hello backend-a "), "the backend answered through Envoy: {reply:?}");
        assert_eq!(local_of(&reply), backend.to_string(), "{reply}");
    }
    let stat = |name: &str| envoy.stat(&client, name).unwrap();
    assert_eq!(stat("tcp.outbound.downstream_cx_total"), Some(3), "Envoy carried the app's connections");
    assert_eq!(stat("cluster.PassthroughCluster.upstream_cx_total"), Some(3), "and opened its own");
    assert_eq!(backend_lines(&log_path), 3, "as many reached the backend as Envoy opened: none around it");
    let counters = programs.counters().unwrap();
    assert_eq!((counters.get("redirected"), counters.get("orig_dst_answered")), (3, 3), "{counters:?}");
    assert_eq!(lb.counters().unwrap().get("forward"), 3, "Envoy's upstream connects were load-balanced");
}

/// Istio's behaviour under the full socket LB (istio/istio#27619): with Weir's own
/// netfilter rules in the pod, the load balancer has already rewritten the app's
/// connect when the REDIRECT sees its first packet, so SO_ORIGINAL_DST is a backend,
/// not the VIP (Envoy's Service routing is lost), while the app's getpeername(), the
/// load balancer's own, says VIP.
fn netfilter_loses_the_vip(test: &str, nft: bool) {
    let mut sc = Scene::new(test, Family::V4, Settings::default());
    sc.lb.attach(sc.h.root.path(), AttachMode::Link).unwrap();
    let mut args = vec!["-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-b", ""];
    if nft {
        args.push("--native-nftables");
    }
    let out = istio_iptables(&sc.s.client, &args, None);
    assert!(out.status.success(), "istio-iptables: {}", String::from_utf8_lossy(&out.stderr));
    let vip = vip(Family::V4);
    for _ in 0..3 {
        let said = run_testkit(&sc.s.client, sc.app(), &["ask-peer", &vip.to_string()]);
        let (peer, line) = said.split_once('\n').unwrap_or_else(|| panic!("app to the VIP: {said:?}"));
        let (_, orig) = captured(line).unwrap_or_else(|| panic!("not captured by the rules: {said:?}"));
        assert!(sc.is_backend(&orig), "SO_ORIGINAL_DST is a backend, the VIP is lost: {said:?}");
        assert_ne!(orig, vip.to_string());
        assert_eq!(peer, format!("peer={vip}"), "the app itself still reads the VIP");
    }
    assert_eq!(sc.backend_connections(), 0, "captured all the same");
}

#[test]
fn under_iptables_the_socket_lb_leaves_envoy_a_backend_not_the_vip() {
    require_root!();
    netfilter_loses_the_vip(&test_name!(), false);
}

#[test]
fn under_nftables_the_socket_lb_leaves_envoy_a_backend_not_the_vip() {
    require_root!();
    netfilter_loses_the_vip(&test_name!(), true);
}

/// `socketLB.hostNamespaceOnly=true`: the load balancer leaves every socket outside
/// the host's namespace alone. The app's VIP reaches Envoy's listener as the VIP
/// (with or without Weir first); the proxy's own connect to the VIP is not translated
/// here, so in a cluster it leaves the pod for the VIP and Cilium's per-packet load
/// balancer (tc on the pod's interface) translates it. The test pod has no route to
/// the VIP: the connect fails, and no backend is reached.
#[test]
fn host_namespace_only_translates_nothing_in_the_pod() {
    require_root!();
    let test = test_name!();
    let settings = Settings { host_namespace_only: true, ..Settings::default() };
    let mut sc = Scene::new(&test, Family::V4, settings);
    sc.lb.attach(sc.h.root.path(), AttachMode::Link).unwrap();
    sc.capture();
    let vip = vip(Family::V4);
    let said = run_testkit(&sc.s.client, sc.app(), &["ask-peer", &vip.to_string()]);
    assert_eq!(said.lines().next(), Some(format!("peer={vip}").as_str()), "{said:?}");
    assert_eq!(captured(said.lines().nth(1).unwrap_or_default()).map(|(_, o)| o), Some(vip.to_string()));
    let line = run_testkit(&sc.s.client, sc.proxy(), &["ask", &vip.to_string()]);
    assert!(unreachable(&line), "the proxy's connect was left to the packet path: {line:?}");
    let dns = dns_vip(Family::V4).to_string();
    let reply = run_testkit(&sc.s.client, sc.proxy(), &["dns-query", &dns, "echo.ns.svc.cluster.local"]);
    assert!(reply.ends_with("Network is unreachable (os error 101)"), "nor the proxy's DNS: {reply:?}");
    assert_eq!(sc.backend_connections(), 0);
    let lb = sc.lb.counters().unwrap();
    assert_eq!(lb.get("forward"), 0, "{lb:?}");
    assert!(lb.get("not_host_namespace") >= 2, "{lb:?}");
}

/// Cilium answers NodePorts (30000-32767) on loopback from the host's namespace and on
/// node addresses from anywhere, and hostPorts on loopback (a hostIP of 127.0.0.1)
/// from the host's namespace (`sock4_wildcard_lookup`: `in_hostns &&
/// is_v4_loopback`). Here a hostPort 15001 on loopback, the worst a user could publish:
/// from the host's namespace (a `node` pod the load balancer is told is the host's)
/// 127.0.0.1:15001 and :30080 are translated; in the pod they are not, so Weir's
/// redirect to 127.0.0.1:15001 reaches Envoy. The node's own address is a NodePort
/// frontend in the pod too: the app's connect to it is captured with it as the original
/// destination, the proxy's is translated.
#[test]
fn loopback_node_and_host_ports_are_answered_only_in_the_host_namespace() {
    require_root!();
    let test = test_name!();
    let h = Hierarchy::new(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V4, &h.pod);
    let node = s.mesh.pod("node").unwrap();
    let log = tempfile::tempdir().unwrap();
    let log_path = log.path().join("backends.log");
    let backend = s.addr(&s.server, BACKEND_PORT);
    let args = ["serve-hello", &backend.to_string(), "backend-a", "--log", log_path.to_str().unwrap()];
    let _backend = start_server(&s.server, 0, &args);

    let host = netns_cookie(Some(node.netns().path())).unwrap();
    let mut lb = SocketLb::load(Settings { host_netns: Some(host), ..Settings::default() }).unwrap();
    lb.add_service(Frontend::NodePort { port: 30080, v6: false }, &[backend]).unwrap();
    lb.add_service(Frontend::HostPort { port: 15001, v6: false, loopback: true }, &[backend]).unwrap();
    lb.add_node_address(node.ipv4().into(), NodeAddress::Host).unwrap();
    lb.attach(h.root.path(), AttachMode::Link).unwrap();
    let mut programs = CapturePrograms::load().unwrap();
    programs.attach(h.pod.path()).unwrap();
    let own: Vec<IpAddr> = vec![s.client.ipv4().into(), s.client.ipv6().into()];
    let pod = PodCapture::new(&sidecar_config(Family::V4), own, EbpfOptions { accelerate: false }).unwrap();
    programs.register(netns_cookie(Some(s.client.netns().path())).unwrap(), &pod, None).unwrap();

    let on_node = Placement { user: Some((0, 0)), cgroup: Some(&h.node), ..Placement::default() };
    for port in [30080, 15001] {
        let line = run_testkit(&node, on_node, &["ask", &format!("127.0.0.1:{port}")]);
        assert!(line.starts_with("hello backend-a "), "host namespace, 127.0.0.1:{port}: {line:?}");
    }
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&h.pod), ..Placement::default() };
    let proxy = Placement { user: Some((1337, 1337)), cgroup: Some(&h.pod), ..Placement::default() };
    let line = run_testkit(&s.client, app, &["ask", &vip(Family::V4).to_string()]);
    assert_eq!(
        captured(&line).map(|(_, o)| o),
        Some(vip(Family::V4).to_string()),
        "Weir's redirect: {line:?}"
    );
    let line = run_testkit(&s.client, proxy, &["ask", "127.0.0.1:15001"]);
    assert!(captured(&line).is_some(), "the pod's own 127.0.0.1:15001 is Envoy's: {line:?}");
    let line = run_testkit(&s.client, app, &["ask", "127.0.0.1:30080"]);
    assert!(
        line.ends_with("connect: Connection refused (os error 111)"),
        "no NodePort on the pod's loopback: {line:?}"
    );
    let node_port = SocketAddr::new(node.ipv4().into(), 30080);
    let line = run_testkit(&s.client, app, &["ask", &node_port.to_string()]);
    assert_eq!(captured(&line).map(|(_, o)| o), Some(node_port.to_string()), "{line:?}");
    let line = run_testkit(&s.client, proxy, &["ask", &node_port.to_string()]);
    assert!(line.starts_with("hello backend-a "), "the proxy's NodePort connect: {line:?}");
    assert_eq!(backend_lines(&log_path), 3, "the node's two and the proxy's one");
}

/// The kernel's rule for a flagless ancestor (Cilium before Linux 5.7, or a node an
/// older Cilium set up): nothing can be attached below it, so Weir's eBPF capture
/// cannot be had there: Weir refuses before the kernel would, naming the program, its
/// cgroup and why, and `auto` picks netfilter. The other order (Weir first, then the flagless load balancer
/// above) is accepted, and the load balancer then never runs for the pod's sockets: a
/// descendant with programs of its own stops the walk at an ancestor that does not
/// allow multiple programs (`compute_effective_progs`).
#[test]
fn a_flagless_ancestor_refuses_weir_below_it_and_is_skipped_when_weir_came_first() {
    require_root!();
    let test = test_name!();
    let mut sc = Scene::new(&test, Family::V4, Settings::default());
    sc.lb.attach(sc.h.root.path(), AttachMode::Flagless).expect("flagless attach at the root");
    let mut programs = CapturePrograms::load().unwrap();
    let refused = programs.attach(sc.h.pod.path()).expect_err("Weir refuses below a flagless program");
    let chain = format!("{:#}", anyhow::Error::from(refused));
    let root = sc.h.root.path().display().to_string();
    for named in ["\"lb_connect4\"", root.as_str(), "without BPF_F_ALLOW_MULTI", "Weir cannot attach"] {
        assert!(chain.contains(named), "the refusal names {named}: {chain}");
    }
    assert_no_programs(&sc.h.pod);
    let choice = detect::choose_for(CaptureMode::Auto, sc.h.pod.path()).expect("auto still chooses");
    assert_ne!(choice.backend, Backend::Ebpf, "auto falls back to netfilter: {choice}");
    assert!(choice.to_string().contains("lb_connect4"), "and says why: {choice}");
    drop(programs);
    let line = run_testkit(&sc.s.client, sc.proxy(), &["ask", &vip(Family::V4).to_string()]);
    assert!(line.starts_with("hello backend-"), "without Weir the flagless LB runs: {line:?}");

    sc.lb.detach();
    sc.capture();
    sc.lb.attach(sc.h.root.path(), AttachMode::Flagless).expect("flagless above Weir is accepted");
    let line = run_testkit(&sc.s.client, sc.proxy(), &["ask", &vip(Family::V4).to_string()]);
    assert!(unreachable(&line), "the flagless LB no longer runs for the pod: {line:?}");
    assert_eq!(sc.backend_connections(), 1);
}

/// `BPF_F_PREORDER` (Linux 6.15) on the ancestor: the load balancer runs before Weir
/// and rewrites the VIP first, so Weir captures the backend's address (the VIP is
/// lost, as under netfilter) and the app's getpeername() would say backend. Weir
/// refuses this layout, naming the program and why, and `auto` picks netfilter. A
/// kernel without the flag (before 6.15; upstream 4b82b181a26c) refuses it with EINVAL.
#[test]
fn a_preorder_ancestor_rewrites_the_vip_before_weir_sees_it() {
    require_root!();
    let test = test_name!();
    let mut sc = Scene::new(&test, Family::V4, Settings::default());
    let kernel = aya::util::KernelVersion::current().expect("kernel version");
    if let Err(e) = sc.lb.attach(sc.h.root.path(), AttachMode::Preorder) {
        // Only a kernel without the flag (before 6.15, unless a stable tree took the
        // commit) may refuse it, and then with EINVAL.
        let chain = format!("{:?}", anyhow::Error::from(e));
        let without_flag =
            kernel < aya::util::KernelVersion::new(6, 15, 0) && chain.contains("Invalid argument");
        assert!(without_flag, "BPF_F_PREORDER refused on Linux {kernel:?}: {chain}");
        eprintln!("Linux {kernel:?} has no BPF_F_PREORDER, so no load balancer can run before Weir: {chain}");
        return;
    }
    // Weir refuses, naming the program: under it the VIP would be lost (the load
    // balancer rewrites first; Weir would capture the backend's address).
    let mut programs = CapturePrograms::load().unwrap();
    let refused = programs.attach(sc.h.pod.path()).expect_err("Weir refuses below a PREORDER program");
    let chain = format!("{:#}", anyhow::Error::from(refused));
    let root = sc.h.root.path().display().to_string();
    for named in ["\"lb_connect4\"", root.as_str(), "BPF_F_PREORDER", "before Weir sees it"] {
        assert!(chain.contains(named), "the refusal names {named}: {chain}");
    }
    assert_no_programs(&sc.h.pod);
    let choice = detect::choose_for(CaptureMode::Auto, sc.h.pod.path()).expect("auto still chooses");
    assert_ne!(choice.backend, Backend::Ebpf, "auto falls back to netfilter: {choice}");
    drop(programs);
    // Without Weir, the load balancer alone: the app reaches a backend (as under
    // netfilter, the VIP is the load balancer's to translate).
    let line = run_testkit(&sc.s.client, sc.app(), &["ask", &vip(Family::V4).to_string()]);
    assert!(line.starts_with("hello backend-"), "{line:?}");
}

/// The load balancer refuses to attach to the cgroup2 mount itself (every process's
/// cgroup) or to anything outside it.
#[test]
fn the_stand_in_never_attaches_to_the_root_cgroup() {
    require_root!();
    let mut lb = SocketLb::load(Settings::default()).unwrap();
    let mount = weir_agent::sandbox::cgroup::cgroup2_mount().unwrap();
    for path in [mount.clone(), mount.join("."), PathBuf::from("/tmp")] {
        let e = lb.attach(&path, AttachMode::Link).expect_err("refused");
        assert!(e.to_string().contains("not a cgroup below the cgroup2 mount"), "{path:?}: {e}");
    }
}
