//! Weir's eBPF capture of an ambient pod beneath a socket load balancer with Cilium's
//! semantics (issue 49; the stand-in is `weir_tests::socket_lb`, its kernel programs
//! `tests/lb-standin`), with the real ztunnel (`weir_tests::ztunnel`). The cgroups are
//! laid out as on a node: the load balancer is linked (a bpf_link, as Cilium links it
//! on Linux ≥ 5.7) at a test cgroup that plays the cgroup root; beneath it `kubepods`,
//! where Weir's node capture is linked, holding the pods' cgroups and ztunnel's (a
//! DaemonSet pod); beside `kubepods`, `host`, for a process of the node's own.
//!
//! **Whose socket is it.** ztunnel (in-pod mode) opens its sockets for a pod inside the
//! pod's network namespace: its listeners, its HBONE connections, its passthrough
//! connections, its DNS proxy's upstream queries. A socket belongs to the cgroup of the
//! process that created it, so these belong to ztunnel's cgroup, whatever namespace
//! they are in, and a cgroup's programs run for the sockets of it and its descendants.
//! Weir's node capture, at `kubepods`, therefore runs for ztunnel's sockets too; its
//! programs act only in the network namespaces registered as captured pods (by
//! namespace cookie: not ztunnel's own), and there leave every socket that carries
//! ztunnel's mark (0x539/0xfff, which ztunnel sets on each socket it makes in a pod)
//! alone, as Istio's in-pod rules return it first (`net::proxy_marked` in
//! `ebpf/programs/src/capture`, `PodCapture::ambient` in `agent/src/capture/ebpf`).
//! A process in the pod's namespace whose cgroup is not beneath the capture's is not
//! seen by Weir at all. The load balancer, at the root, runs for every socket (the
//! app's, ztunnel's, the host's) and tells none apart: it translates by destination
//! only (a Service frontend becomes a backend). The kernel runs a socket's nearer
//! cgroup's programs first, so Weir has turned the app's VIP into ztunnel's
//! `127.0.0.1:15001` before the load balancer looks, and that is no frontend; ztunnel's
//! HBONE connect goes to the endpoint pod's address and 15008, no frontend either.
//! What the load balancer does translate is what ztunnel itself addresses to a
//! frontend: a passthrough connection to a Service ztunnel does not know, its DNS
//! proxy's upstream query to the cluster DNS VIP. As under Istio's in-pod rules, the
//! mark is the whole test in the pod's namespace: a process there allowed to set
//! `SO_MARK` could pass as ztunnel.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
    time::Duration,
};

use weir_agent::capture::ebpf::{capture::Counters, netns::netns_cookie, pod, record::PinRecord};
use weir_tests::{
    BpffsUse, Cgroup, Mesh, Placement, Pod, PodChild,
    ambient::AmbientNode,
    capture::NodeCapture,
    cni::{KubeletSandbox, start_placed, try_run_placed},
    require_root,
    socket_lb::{AttachMode, Frontend, LbCounters, Settings, SocketLb},
    test_cgroup, test_name, tools,
    ztunnel::{self, LocalConfig, LocalService, LocalWorkload, Ztunnel, ZtunnelPlacement},
};

const PATIENCE: Duration = Duration::from_secs(60);
const NS: &str = "default";
/// The Service in the mesh: ztunnel's config and the load balancer both have it.
const VIP4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20);
const HOSTNAME: &str = "server.default.svc.cluster.local";
const SERVICE_PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;
/// A Service outside the mesh: only the load balancer has it (its backend is the
/// outsider pod's 9005), so ztunnel passes a connection to it through as plain TCP.
const EXTERNAL_VIP4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const EXTERNAL_PORT: u16 = 9005;
/// The cluster DNS Service: the load balancer's backend is the outsider pod's DNS
/// server (answering 9.9.9.9 to every name); ztunnel's resolv.conf names it, as a
/// `ClusterFirst` pod's does.
const DNS_VIP4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const UPSTREAM_ANSWER: &str = "9.9.9.9";

/// The test's cgroups. Fields drop in order: children first.
struct Hierarchy {
    ztunnel: Cgroup,
    host: Cgroup,
    kubepods: Cgroup,
    root: Cgroup,
}

impl Hierarchy {
    /// `root` (named after the test, which must not say `kubepods`: the agent takes a
    /// pod's cgroup to be right under the first component that does), `root/kubepods`,
    /// `root/kubepods/ztunnel`, `root/host`.
    fn new(test: &str) -> Self {
        let root = test_cgroup(test);
        let name = root.path().file_name().and_then(|n| n.to_str()).expect("cgroup name").to_string();
        assert!(!name.contains("kubepods"), "{name}");
        let kubepods = Cgroup::create(&format!("{name}/kubepods")).expect("kubepods cgroup");
        let ztunnel = Cgroup::create(&format!("{name}/kubepods/ztunnel")).expect("ztunnel's cgroup");
        let host = Cgroup::create(&format!("{name}/host")).expect("host cgroup");
        Self { ztunnel, host, kubepods, root }
    }
}

fn sa(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

fn dual_stack(pod: &Pod, name: &str) -> LocalWorkload {
    LocalWorkload {
        name: name.into(),
        namespace: NS.into(),
        service_account: name.into(),
        ips: vec![pod.ipv4().into(), pod.ipv6().into()],
    }
}

/// The capture's counters for `pod` (its registration with node capture `capture`).
fn weir_counters(capture: &str, pod: &Pod) -> Counters {
    let cookie = netns_cookie(Some(pod.netns().path())).expect("the pod's namespace cookie");
    let record = PinRecord::load_all()
        .into_iter()
        .find(|r| r.pod.starts_with(capture) && r.netns_cookie == cookie)
        .expect("the pod's registration record");
    let maps = pod::maps_of(&record).expect("the node capture's maps");
    maps.pod_counters(cookie).expect("read the pod's counters").expect("the pod is registered")
}

/// The change of each of `names` from `before` to `after`.
fn weir_delta(before: &Counters, after: &Counters, names: &[&str]) -> Vec<(String, u64)> {
    names.iter().map(|n| (n.to_string(), after.get(n) - before.get(n))).collect()
}

fn lb_delta(before: &LbCounters, after: &LbCounters, name: &str) -> u64 {
    after.get(name) - before.get(name)
}

/// ztunnel's access-log lines of completed connections that contain every one of
/// `parts`.
fn access(zt: &Ztunnel, parts: &[&str]) -> Vec<String> {
    zt.log()
        .lines()
        .filter(|l| l.contains("connection complete") && parts.iter().all(|p| l.contains(p)))
        .map(str::to_string)
        .collect()
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_string).collect()
}

/// `ask-peer`'s two lines: what getpeername() said, and the server's answer.
fn ask_peer(from: Placement<'_>, to: SocketAddr, zt: &Ztunnel) -> (String, String) {
    let said = try_run_placed(from, tools::testkit_command(), &["ask-peer", &to.to_string()])
        .unwrap_or_else(|e| panic!("ask-peer {to}: {e}\nztunnel:\n{}", zt.log()));
    let (peer, answer) = said.split_once('\n').unwrap_or_else(|| panic!("ask-peer {to}: {said:?}"));
    (peer.to_string(), answer.to_string())
}

fn dns_query(from: Placement<'_>, name: &str, zt: &Ztunnel) -> String {
    let server = sa(DNS_VIP4, 53).to_string();
    try_run_placed(from, tools::testkit_command(), &["dns-query", &server, name])
        .unwrap_or_else(|e| panic!("DNS {name}: {e}\nztunnel:\n{}", zt.log()))
}

/// The scene: the load balancer at the root with Cilium's services, the ambient
/// client and server pods enrolled and captured by Weir's node capture, ztunnel, the
/// Service's endpoint (the server app, logging each connection) and, in the outsider
/// pod (no mesh), the external Service's backend and the DNS backend. Fields drop in
/// order: processes, ztunnel, sandboxes, the agent, the node capture, the load
/// balancer, pods, cgroups.
struct Scene {
    _servers: Vec<PodChild>,
    zt: Ztunnel,
    _sandboxes: Vec<KubeletSandbox>,
    node: AmbientNode,
    node_capture: NodeCapture,
    lb: SocketLb,
    /// ztunnel's resolv.conf, the backends' logs.
    files: tempfile::TempDir,
    client: Pod,
    server: Pod,
    outsider: Pod,
    h: Hierarchy,
    _mesh: Mesh,
    _bpffs: BpffsUse,
}

impl Scene {
    /// The scene with the load balancer in `settings`' mode.
    fn start(test: &str, settings: Settings) -> Self {
        ztunnel::binary().unwrap_or_else(|e| panic!("the ztunnel peer: {e:#}"));
        let bpffs = BpffsUse::acquire().unwrap();
        let mesh = Mesh::new(test).unwrap();
        let h = Hierarchy::new(test);
        let (client, server, outsider) =
            (mesh.pod("client").unwrap(), mesh.pod("server").unwrap(), mesh.pod("outsider").unwrap());
        let files = tempfile::tempdir().unwrap();
        // The server app (uid 1000) writes its log here.
        std::fs::set_permissions(files.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();

        // The load balancer at the root, with Cilium's services: the mesh Service's VIPs
        // to the server pod's target port, the Service outside the mesh, the cluster DNS.
        let mut lb = SocketLb::load(settings).expect("the verifier accepts the stand-in");
        let services = [
            (sa(VIP4, SERVICE_PORT), sa(server.ipv4(), TARGET_PORT)),
            (sa(VIP6, SERVICE_PORT), sa(server.ipv6(), TARGET_PORT)),
            (sa(EXTERNAL_VIP4, SERVICE_PORT), sa(outsider.ipv4(), EXTERNAL_PORT)),
            (sa(DNS_VIP4, 53), sa(outsider.ipv4(), 53)),
        ];
        for (frontend, backend) in services {
            lb.add_service(Frontend::ClusterIp(frontend), &[backend]).unwrap();
        }
        lb.attach(h.root.path(), AttachMode::Link).expect("attach the load balancer at the root");

        let node_capture = NodeCapture::attach("ambient-lb", h.kubepods.path()).unwrap();
        let mut node = AmbientNode::new(&mesh).unwrap();
        let pods = [(&client, "client"), (&server, "server")];
        let sandboxes: Vec<KubeletSandbox> = pods
            .iter()
            .zip(UIDS)
            .map(|((pod, _), uid)| node.sandbox(&h.kubepods, uid, pod).unwrap())
            .collect();
        node.api.set_namespace(NS, &[("istio.io/dataplane-mode", "ambient")]);
        for ((pod, name), uid) in pods.iter().zip(UIDS) {
            node.set_pending_pod(NS, name, uid, pod, &[]);
        }
        node.capture_with_ebpf(node_capture.name());
        node.start_agent().unwrap();
        let zt = start_ztunnel(&node, &h, &files, &client, &server);
        node.add_to_ztunnel(&zt, NS, &pods, PATIENCE);
        for (pod, name) in pods {
            node.set_running(NS, name, pod);
        }
        for ((pod, name), uid) in pods.iter().zip(UIDS) {
            assert!(
                weir_agent::node::cni::ebpf::ambient_registered(node_capture.name(), uid, pod.netns().path())
                    .unwrap(),
                "{name} registered with the node capture:\n{}",
                node.agent_logs()
            );
        }
        let servers = start_servers(&h, &files, &server, &outsider);
        Self {
            _servers: servers,
            zt,
            _sandboxes: sandboxes,
            node,
            node_capture,
            lb,
            files,
            client,
            server,
            outsider,
            h,
            _mesh: mesh,
            _bpffs: bpffs,
        }
    }

    /// The client pod's app: its namespace, a cgroup beneath `kubepods` (Weir's
    /// programs run for its sockets), uid 1000.
    fn app(&self) -> Placement<'_> {
        in_kubepods(&self.client, &self.h)
    }

    /// A process of the node's own (cgroup `host`, outside `kubepods`) that entered
    /// the client pod's namespace.
    fn host_process(&self) -> Placement<'_> {
        Placement { netns: Some(self.client.netns()), cgroup: Some(&self.h.host), ..Placement::default() }
    }

    /// Weir's counters for the client pod.
    fn weir(&self) -> Counters {
        weir_counters(self.node_capture.name(), &self.client)
    }

    fn lb(&mut self) -> LbCounters {
        self.lb.counters().expect("the load balancer's counters")
    }

    /// The connections the Service's endpoint (the server app) took.
    fn endpoint_log(&self) -> Vec<String> {
        lines(&self.files.path().join("server.log"))
    }

    /// The connections the external Service's backend took.
    fn external_log(&self) -> Vec<String> {
        lines(&self.files.path().join("external.log"))
    }

    fn external_backend(&self) -> SocketAddr {
        sa(self.outsider.ipv4(), EXTERNAL_PORT)
    }
}

const UIDS: [&str; 2] = ["8b1e2d3c-aaaa-bbbb-cccc-00000000000c", "8b1e2d3c-aaaa-bbbb-cccc-00000000000d"];

/// ztunnel in `kubepods/ztunnel`, with both pods, the Service (its VIPs, port 80 →
/// 8080, the server pod behind it) and a resolv.conf naming the cluster DNS VIP.
fn start_ztunnel(
    node: &AmbientNode,
    h: &Hierarchy,
    files: &tempfile::TempDir,
    client: &Pod,
    server: &Pod,
) -> Ztunnel {
    let resolv_conf = files.path().join("resolv.conf");
    std::fs::write(&resolv_conf, format!("nameserver {DNS_VIP4}\n")).unwrap();
    let config = LocalConfig {
        workloads: vec![dual_stack(client, "client"), dual_stack(server, "server")],
        services: vec![LocalService {
            name: "server".into(),
            namespace: NS.into(),
            hostname: HOSTNAME.into(),
            vips: vec![VIP4.into(), VIP6.into()],
            ports: vec![(SERVICE_PORT, TARGET_PORT)],
            endpoints: vec!["server".into()],
        }],
    };
    let placement = ZtunnelPlacement { cgroup: Some(&h.ztunnel), resolv_conf: Some(&resolv_conf) };
    Ztunnel::start_with(&node.node, &node.zds_socket(), &config, placement).unwrap()
}

/// The Service's endpoint on both families (the testkit's IPv6 listeners are IPv6
/// only), as the server pod's app; the external Service's backend and the DNS
/// backend in the outsider pod.
fn start_servers(h: &Hierarchy, files: &tempfile::TempDir, server: &Pod, outsider: &Pod) -> Vec<PodChild> {
    let log = |name: &str| files.path().join(name).to_str().expect("UTF-8 temp path").to_string();
    let outside = Placement { netns: Some(outsider.netns()), ..Placement::default() };
    let external = sa(outsider.ipv4(), EXTERNAL_PORT).to_string();
    let dns = sa(outsider.ipv4(), 53).to_string();
    [
        (in_kubepods(server, h), vec!["serve-hello", "0.0.0.0:8080", "server", "--log", &log("server.log")]),
        (in_kubepods(server, h), vec!["serve-hello", "[::]:8080", "server", "--log", &log("server.log")]),
        (outside, vec!["serve-hello", &external, "external", "--log", &log("external.log")]),
        (outside, vec!["dns-serve", &dns, UPSTREAM_ANSWER]),
    ]
    .into_iter()
    .map(|(placement, args)| start_placed(placement, &args).unwrap_or_else(|e| panic!("{args:?}: {e:#}")))
    .collect()
}

/// The load balancer at the root as on a cluster where Cilium runs its socket LB in
/// every namespace (`socketLB.hostNamespaceOnly=false`, its default), with two ambient
/// pods under Weir's eBPF capture (`WEIR_AMBIENT_CAPTURE=auto`, the node capture
/// linked at `kubepods`) and the real ztunnel in `kubepods/ztunnel`. See the module's
/// comment for how each side tells ztunnel's sockets from the pod's; each phase says
/// what it shows.
#[test]
fn an_ambient_pod_s_service_vip_reaches_ztunnel_beneath_the_socket_lb() {
    require_root!();
    let mut sc = Scene::start(&test_name!(), Settings::default());
    service_vip_through_ztunnel(&mut sc);
    dns_through_ztunnel(&mut sc);
    passthrough_is_load_balanced(&mut sc);
    a_node_process_is_not_weir_s(&mut sc);
    assert_eq!(sc.endpoint_log().len(), 4, "nothing else reached the Service's endpoint");
}

/// The load balancer as Cilium's and Istio's docs ask for it under a mesh
/// (`socketLB.hostNamespaceOnly=true`): it acts only in the host's network namespace,
/// and Cilium translates a pod's Service traffic per packet instead (which the
/// stand-in does not play). Weir's capture of the ambient pod is the same as beneath
/// the full socket load balancer: the app's VIP reaches ztunnel's 15001 with the VIP
/// as its original destination and its getpeername(), ztunnel's DNS proxy answers the
/// Service's name, and the load balancer translates nothing in the pod's namespace,
/// not even ztunnel's own connects (the passthrough and the DNS upstream, which the
/// full mode translates, go to Cilium's per-packet path here, and are not played).
#[test]
fn under_host_namespace_only_an_ambient_pod_s_vip_reaches_ztunnel_and_nothing_is_translated_in_the_pod() {
    require_root!();
    let settings = Settings { host_namespace_only: true, ..Settings::default() };
    let mut sc = Scene::start(&test_name!(), settings);
    let lb0 = sc.lb();
    service_vip_through_ztunnel(&mut sc);
    let dns = sa(DNS_VIP4, 53);
    let answer = dns_query(sc.app(), HOSTNAME, &sc.zt);
    assert_eq!(answer, format!("answer {VIP4} from {dns}"), "ztunnel's DNS proxy answered, from the VIP");
    // A node process in the pod's namespace: the load balancer leaves it alone too (not
    // the host's namespace), and its connect to the VIP goes nowhere without the
    // per-packet path.
    let external = sa(EXTERNAL_VIP4, SERVICE_PORT);
    let said = try_run_placed(sc.host_process(), tools::testkit_command(), &["ask", &external.to_string()]);
    assert!(
        said.as_ref().is_err_and(|e| weir_tests::socket_lb::unreachable(e)),
        "the VIP left untranslated (the pods have no route to the Service range): {said:?}"
    );
    let lb1 = sc.lb();
    for counter in ["forward", "reverse_peer", "reverse_recvmsg"] {
        assert_eq!(lb_delta(&lb0, &lb1, counter), 0, "{counter}: nothing translated in the pod: {lb1:?}");
    }
    // The load balancer ran, and stood aside: the app's four connects, its DNS query,
    // ztunnel's HBONE connects and the node process's connect, all outside the host's
    // namespace.
    assert!(lb_delta(&lb0, &lb1, "not_host_namespace") >= 6, "the load balancer saw them: {lb1:?}");
    assert!(sc.external_log().is_empty(), "nothing reached the external backend: {:?}", sc.external_log());
}

/// The app's connect to the Service VIP (three times over IPv4, once over IPv6)
/// reaches ztunnel's 15001 with the VIP as its original destination: ztunnel resolves
/// the Service from its own config (its access log names it; a connection to the pod's
/// address would name none), picks the endpoint and its target port (80 became 8080),
/// and goes over HBONE to the endpoint pod's 15008, to the server app, which sees the
/// client pod's address. The app's getpeername() is the VIP. The load balancer
/// translated nothing, so no connection reached the backend around ztunnel, and
/// ztunnel's HBONE connect (pod address:15008, no frontend) was left alone. Weir
/// redirected the app's four connects and only those: ztunnel's HBONE connects from
/// the client's namespace (one a family) it counted as the proxy's (their mark).
fn service_vip_through_ztunnel(sc: &mut Scene) {
    let (lb0, weir0) = (sc.lb(), sc.weir());
    for (vip, from) in [
        (sa(VIP4, SERVICE_PORT), format!(" peer={}:", sc.client.ipv4())),
        (sa(VIP4, SERVICE_PORT), format!(" peer={}:", sc.client.ipv4())),
        (sa(VIP4, SERVICE_PORT), format!(" peer={}:", sc.client.ipv4())),
        (sa(VIP6, SERVICE_PORT), format!(" peer=[{}]:", sc.client.ipv6())),
    ] {
        let (peer, answer) = ask_peer(sc.app(), vip, &sc.zt);
        assert_eq!(peer, format!("peer={vip}"), "the app's getpeername() is the VIP it connected to");
        assert!(answer.starts_with("hello server "), "the Service's endpoint answered: {answer}");
        assert!(answer.contains(&from), "the server sees the client pod: {answer}");
    }
    let lb1 = sc.lb();
    assert_eq!(lb_delta(&lb0, &lb1, "forward"), 0, "the load balancer translated nothing: {lb1:?}");
    assert_eq!(lb_delta(&lb0, &lb1, "reverse_peer"), 0, "{lb1:?}");
    let weir1 = sc.weir();
    assert_eq!(
        weir_delta(&weir0, &weir1, &["redirected", "orig_dst_answered"]),
        [("redirected".to_string(), 4), ("orig_dst_answered".to_string(), 4)],
        "Weir redirected the app's four connects, and only those: {weir1:?}"
    );
    assert!(
        weir_delta(&weir0, &weir1, &["bypass_proxy"])[0].1 >= 2,
        "ztunnel's HBONE connects (IPv4, IPv6) from the client's namespace, left alone by its mark: {weir1:?}"
    );
    assert_eq!(sc.endpoint_log().len(), 4, "the server app took the four: {:?}", sc.endpoint_log());

    let service = format!("dst.service=\"{HOSTNAME}\"");
    let outbound = ["direction=\"outbound\"", service.as_str()];
    sc.node
        .wait("ztunnel's access log of the four", PATIENCE, || access(&sc.zt, &outbound).len() >= 4)
        .unwrap_or_else(|e| panic!("{e}\nztunnel:\n{}", sc.zt.log()));
    let out = access(&sc.zt, &outbound);
    assert_eq!(out.len(), 4, "{out:#?}");
    let (server4, server6) = (sc.server.ipv4(), sc.server.ipv6());
    for (endpoint, tunnel) in
        [(sa(server4, TARGET_PORT), sa(server4, 15008)), (sa(server6, TARGET_PORT), sa(server6, 15008))]
    {
        let (hbone, tunnel) = (format!("dst.hbone_addr={endpoint} "), format!("dst.addr={tunnel} "));
        assert!(
            out.iter().any(|l| l.contains(&hbone) && l.contains(&tunnel)),
            "{hbone}over {tunnel}: {out:#?}"
        );
    }
}

/// DNS: the app's query to the cluster DNS VIP reaches ztunnel's DNS proxy (15053),
/// which answers the Service's name with its VIP (the load balancer's DNS backend
/// would have said 9.9.9.9), the reply from the VIP; the load balancer translated
/// nothing. A name ztunnel does not know it forwards to its upstream, the DNS VIP,
/// from the client's namespace: that query, ztunnel's own, Weir leaves alone (its
/// mark) and the load balancer sends to the DNS backend, restoring the reply's source.
fn dns_through_ztunnel(sc: &mut Scene) {
    let (lb0, weir0) = (sc.lb(), sc.weir());
    let dns = sa(DNS_VIP4, 53);
    let answer = dns_query(sc.app(), HOSTNAME, &sc.zt);
    assert_eq!(answer, format!("answer {VIP4} from {dns}"), "ztunnel's DNS proxy answered, from the VIP");
    let lb1 = sc.lb();
    assert_eq!(lb_delta(&lb0, &lb1, "forward"), 0, "the app's query was not load-balanced: {lb1:?}");
    let answer = dns_query(sc.app(), "external.test", &sc.zt);
    assert_eq!(
        answer,
        format!("answer {UPSTREAM_ANSWER} from {dns}"),
        "ztunnel forwarded it to the DNS backend"
    );
    let lb2 = sc.lb();
    assert!(lb_delta(&lb1, &lb2, "forward") >= 1, "ztunnel's upstream query was load-balanced: {lb2:?}");
    assert!(lb_delta(&lb1, &lb2, "reverse_recvmsg") >= 1, "and its reply's source restored: {lb2:?}");
    let weir1 = sc.weir();
    assert_eq!(
        weir_delta(&weir0, &weir1, &["dns_redirected", "dns_restored"]),
        [("dns_redirected".to_string(), 2), ("dns_restored".to_string(), 2)],
        "the app's two queries, not ztunnel's upstream one: {weir1:?}"
    );
}

/// Passthrough: the app's connect to a Service ztunnel does not know reaches ztunnel
/// (getpeername() the VIP), which connects to that VIP itself, as plain TCP from the
/// client's namespace: Weir leaves that connect alone (its mark) and the load balancer
/// translates it, by its destination, to the backend, which takes that one
/// connection, from the client pod's address.
fn passthrough_is_load_balanced(sc: &mut Scene) {
    let (lb0, weir0) = (sc.lb(), sc.weir());
    let external = sa(EXTERNAL_VIP4, SERVICE_PORT);
    let (peer, answer) = ask_peer(sc.app(), external, &sc.zt);
    assert_eq!(peer, format!("peer={external}"), "the app's getpeername()");
    let expected = format!("hello external local={} peer={}:", sc.external_backend(), sc.client.ipv4());
    assert!(answer.starts_with(&expected), "{answer}");
    let lb1 = sc.lb();
    assert_eq!(
        lb_delta(&lb0, &lb1, "forward"),
        1,
        "ztunnel's passthrough connect was load-balanced: {lb1:?}"
    );
    let weir1 = sc.weir();
    assert_eq!(
        weir_delta(&weir0, &weir1, &["redirected", "bypass_proxy"]),
        [("redirected".to_string(), 1), ("bypass_proxy".to_string(), 1)],
        "the app's connect went to ztunnel, ztunnel's own was left alone: {weir1:?}"
    );
    assert_eq!(sc.external_log().len(), 1, "only ztunnel's connection reached the backend");
    let passthrough = format!("dst.addr={external} ");
    sc.node
        .wait("ztunnel's passthrough in its access log", PATIENCE, || {
            !access(&sc.zt, &["direction=\"outbound\"", &passthrough]).is_empty()
        })
        .unwrap_or_else(|e| panic!("{e}\nztunnel:\n{}", sc.zt.log()));
}

/// Cgroup membership: a process in the client pod's namespace whose cgroup is not
/// beneath `kubepods` is not seen by Weir at all (none of its counters moves); the
/// load balancer, at the root, translates its connect to the same VIP straight to the
/// backend and restores the VIP in its getpeername().
fn a_node_process_is_not_weir_s(sc: &mut Scene) {
    let (lb0, weir0) = (sc.lb(), sc.weir());
    let external = sa(EXTERNAL_VIP4, SERVICE_PORT);
    let (peer, answer) = ask_peer(sc.host_process(), external, &sc.zt);
    assert_eq!(peer, format!("peer={external}"), "the load balancer's getpeername()");
    assert!(answer.starts_with(&format!("hello external local={} ", sc.external_backend())), "{answer}");
    let lb1 = sc.lb();
    assert_eq!(lb_delta(&lb0, &lb1, "forward"), 1, "{lb1:?}");
    assert_eq!(lb_delta(&lb0, &lb1, "reverse_peer"), 1, "{lb1:?}");
    let weir1 = sc.weir();
    let names = ["redirected", "bypass_proxy", "orig_dst_answered", "bypass_loopback", "not_included"];
    assert!(weir_delta(&weir0, &weir1, &names).iter().all(|(_, d)| *d == 0), "Weir saw it: {weir1:?}");
    assert_eq!(sc.external_log().len(), 2);
}

/// An app of `pod`: its namespace, a cgroup beneath `kubepods` (Weir's programs run
/// for its sockets), uid 1000.
fn in_kubepods<'a>(pod: &'a Pod, h: &'a Hierarchy) -> Placement<'a> {
    Placement {
        netns: Some(pod.netns()),
        cgroup: Some(&h.kubepods),
        user: Some((1000, 1000)),
        ..Placement::default()
    }
}
