//! eBPF capture with real traffic: the capture programs on a test cgroup, the inbound
//! classifier on the pod's interface, no netfilter rules anywhere.

use std::net::{IpAddr, SocketAddr};

use weir_agent::capture::ebpf::{
    capture::CapturePrograms,
    config::{EbpfOptions, PodCapture},
    inbound::InboundProgram,
    netns::netns_cookie,
};
use weir_iptables::config::{CaptureConfig, Cidr, InboundPorts, IpRanges, parse_ports};
use weir_tests::{
    Placement,
    capture::{CaptureScene, Family, ask, ask_placed, captured, run_testkit},
    require_root, test_cgroup, test_name,
};

fn injector_config(exclude: Option<Cidr>) -> CaptureConfig {
    CaptureConfig {
        outbound_ip_ranges_include: IpRanges::All,
        outbound_ip_ranges_exclude: exclude.into_iter().collect(),
        outbound_ports_exclude: parse_ports("-o", "9090").unwrap(),
        inbound_ports: InboundPorts::All,
        inbound_ports_exclude: parse_ports("-d", "15090,15021,15020").unwrap(),
        enable_ipv6: true,
        ..CaptureConfig::default()
    }
}

struct Captured {
    programs: CapturePrograms,
    inbound: Option<InboundProgram>,
}

fn capture(
    scene: &CaptureScene,
    cgroup: &weir_tests::Cgroup,
    cfg: &CaptureConfig,
    accelerate: bool,
) -> Captured {
    let mut programs = CapturePrograms::load().expect("the verifier accepts every capture program");
    programs.attach(cgroup.path()).expect("attach to the test cgroup");
    let own: Vec<IpAddr> = vec![scene.client.ipv4().into(), scene.client.ipv6().into()];
    let pod = PodCapture::new(cfg, own, EbpfOptions { accelerate }).unwrap();
    let cookie = netns_cookie(Some(scene.client.netns().path())).unwrap();
    programs.register(cookie, &pod, None).unwrap();
    let inbound = pod.inbound.map(|cfg| {
        InboundProgram::attach(scene.client.netns().path(), "eth0", &cfg).expect("attach tc inbound")
    });
    Captured { programs, inbound }
}

fn matrix(test: &str, family: Family) {
    let cgroup = test_cgroup(test);
    let s = CaptureScene::in_cgroup(test, family, &cgroup);
    let server2 = s.server2.ipv4();
    let exclude = match family {
        Family::V4 => Cidr { addr: server2.into(), bits: 32 },
        Family::V6 => Cidr { addr: s.server2.ipv6().into(), bits: 128 },
    };
    let c = capture(&s, &cgroup, &injector_config(Some(exclude)), true);
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    let proxy = Placement { user: Some((1337, 1337)), cgroup: Some(&cgroup), ..Placement::default() };

    let server = s.addr(&s.server, 8080);
    let line = ask_placed(&s.client, app, server);
    let (_, orig) = captured(&line).unwrap_or_else(|| panic!("outbound not captured: {line:?}"));
    assert_eq!(orig, server.to_string(), "getsockopt(SO_ORIGINAL_DST) answered by the eBPF program");
    // Envoy's accepted socket's peer is the app's own address, untouched.
    let peer = line.split_whitespace().find_map(|f| f.strip_prefix("peer=")).unwrap_or_default().to_string();
    assert!(!peer.ends_with(&format!(":{}", server.port())), "Envoy's side is never rewritten: {line:?}");

    // The app's getpeername() names where it connected, as under an iptables REDIRECT,
    // not Envoy's loopback listener (before: 127.0.0.1:15001 / [::1]:15001).
    let said = weir_tests::capture::run_testkit(&s.client, app, &["ask-peer", &server.to_string()]);
    assert!(said.starts_with(&format!("peer={server}\ncaptured ")), "getpeername under capture: {said:?}");
    // A dual-stack socket's connect to the v4-mapped address gets it back mapped.
    if let SocketAddr::V4(v4) = server {
        let mapped = SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port());
        let said = weir_tests::capture::run_testkit(&s.client, app, &["ask-peer", &mapped.to_string()]);
        assert!(said.starts_with(&format!("peer={mapped}\ncaptured ")), "getpeername, v4-mapped: {said:?}");
    }

    assert!(ask_placed(&s.client, proxy, server).starts_with("hello server "), "uid 1337 bypasses");
    assert!(ask_placed(&s.client, app, s.addr(&s.server, 9090)).starts_with("hello server "), "-o 9090");
    assert!(ask_placed(&s.client, app, s.addr(&s.server2, 8080)).starts_with("hello server2 "), "-x server2");
    // A process outside the cgroup (same pod) is never redirected.
    assert!(ask(&s.client, 1000, server).starts_with("hello server "), "outside the cgroup");

    let app_addr = s.addr(&s.client, 8080);
    let line = ask(&s.server, 0, app_addr);
    let (local, _) = captured(&line).unwrap_or_else(|| panic!("inbound not captured: {line:?}"));
    assert_eq!(local, app_addr.to_string(), "sk_assign keeps the original destination as the local address");
    assert!(ask(&s.server, 0, s.addr(&s.client, 15021)).starts_with("hello app-15021 "), "-d 15021");

    let counters = c.programs.counters().unwrap();
    assert!(counters.get("redirected") >= 1 && counters.get("orig_dst_answered") >= 1, "{counters:?}");
    let inbound = c.inbound.as_ref().unwrap().counters().unwrap();
    // One SYN to 8080 assigned, one to 15021 (-d) not captured: exactly.
    let decided = ["inbound_assigned", "inbound_not_captured", "inbound_no_listener"].map(|n| inbound.get(n));
    assert_eq!(decided, [1, 1, 0], "{inbound:?}");
}

#[test]
fn ebpf_capture_ipv4() {
    require_root!();
    matrix(&test_name!(), Family::V4);
}

#[test]
fn ebpf_capture_ipv6() {
    require_root!();
    matrix(&test_name!(), Family::V6);
}

/// Programs, links and classifiers on `cgroup` and the pod's eth0, as bpftool and tc
/// report them.
fn attached(cgroup: &weir_tests::Cgroup, pod: &weir_tests::Pod) -> String {
    let mut out = weir_tests::capture::cgroup_programs(cgroup.path())
        .iter()
        .map(|l| format!("{l}\n"))
        .collect::<String>();
    for name in weir_tests::capture::inbound_programs(pod) {
        out.push_str(&format!("eth0 ingress {name}\n"));
    }
    out
}

#[test]
fn a_sibling_cgroup_is_never_redirected_and_detach_removes_everything() {
    require_root!();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let sibling = test_cgroup(&format!("{test}-sibling"));
    let s = CaptureScene::in_cgroup(&test, Family::V4, &cgroup);
    let c = capture(&s, &cgroup, &injector_config(None), false);
    let server = s.addr(&s.server, 8080);
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    let neighbour = Placement { user: Some((1000, 1000)), cgroup: Some(&sibling), ..Placement::default() };
    assert!(captured(&ask_placed(&s.client, app, server)).is_some());
    assert!(
        ask_placed(&s.client, neighbour, server).starts_with("hello server "),
        "a sibling cgroup in the same pod is untouched"
    );
    let before = attached(&cgroup, &s.client);
    assert!(
        before.contains("weir_connect4")
            && before.contains("weir_getsockopt")
            && before.contains("weir_sockops"),
        "{before}"
    );
    assert!(before.contains("weir_in_pod"), "tc classifier on eth0: {before}");

    drop(c);
    assert_eq!(attached(&cgroup, &s.client), "", "nothing left attached");
    assert!(ask_placed(&s.client, app, server).starts_with("hello server "), "uncaptured after detach");
    assert!(
        ask(&s.server, 0, s.addr(&s.client, 8080)).starts_with("hello app "),
        "inbound uncaptured after detach"
    );
}

fn dns_redirect(test: &str, connected: bool) {
    let cgroup = test_cgroup(test);
    let s = CaptureScene::in_cgroup(test, Family::V4, &cgroup);
    let server = std::net::SocketAddr::new(s.server.ipv4().into(), 53);
    let _upstream =
        weir_tests::capture::start_server(&s.server, 0, &["dns-serve", &server.to_string(), "9.9.9.9"]);
    let agent = Placement { user: Some((1337, 1337)), cgroup: Some(&cgroup), ..Placement::default() };
    let _agent = weir_tests::capture::start_server_placed(
        &s.client,
        agent,
        &["dns-serve", "127.0.0.1:15053", "1.2.3.4"],
    );
    let mut cfg = injector_config(None);
    cfg.redirect_dns = true;
    cfg.dns_servers_v4 = vec![s.server.ipv4().to_string()];
    let c = capture(&s, &cgroup, &cfg, false);

    let mut args = vec!["dns-query".to_string(), server.to_string(), "echo.ns.svc.cluster.local".to_string()];
    if connected {
        args.push("--connected".into());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    let reply = weir_tests::capture::run_testkit(&s.client, app, &args);
    assert_eq!(
        reply,
        format!("answer 1.2.3.4 from {server}"),
        "answered by the agent, from the server's address"
    );
    let reply = weir_tests::capture::run_testkit(&s.client, agent, &args);
    assert_eq!(reply, format!("answer 9.9.9.9 from {server}"), "the agent's own upstream query goes out");
    let counters = c.programs.counters().unwrap();
    assert!(counters.get("dns_redirected") >= 1 && counters.get("dns_restored") >= 1, "{counters:?}");
}

#[test]
fn dns_over_udp_goes_to_the_agent_and_replies_come_from_the_server() {
    require_root!();
    dns_redirect(&test_name!(), false);
}

#[test]
fn dns_on_a_connected_udp_socket_goes_to_the_agent() {
    require_root!();
    dns_redirect(&test_name!(), true);
}

/// sk_msg: an 8 MiB echo through the redirected local pair arrives intact, and the
/// counters show the data took the socket-to-socket path (and not without it).
fn transfer(test: &str, accelerate: bool) -> weir_agent::capture::ebpf::capture::Counters {
    let cgroup = test_cgroup(test);
    let mesh = weir_tests::Mesh::new(test).unwrap();
    let pod = mesh.pod("client").unwrap();
    let server = mesh.pod("server").unwrap();
    let envoy = Placement { user: Some((1337, 1337)), cgroup: Some(&cgroup), ..Placement::default() };
    let _echo = weir_tests::capture::start_server_placed(&pod, envoy, &["serve-echo", "127.0.0.1:15001"]);
    let mut programs = CapturePrograms::load().unwrap();
    programs.attach(cgroup.path()).unwrap();
    let own: Vec<IpAddr> = vec![pod.ipv4().into(), pod.ipv6().into()];
    let cfg = CaptureConfig { inbound_ports: InboundPorts::None, ..injector_config(None) };
    let capture = PodCapture::new(&cfg, own, EbpfOptions { accelerate }).unwrap();
    programs.register(netns_cookie(Some(pod.netns().path())).unwrap(), &capture, None).unwrap();
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    let target = std::net::SocketAddr::new(server.ipv4().into(), 8080).to_string();
    let out = weir_tests::capture::run_testkit(&pod, app, &["transfer", &target, "8388608"]);
    let counters = programs.counters().unwrap();
    assert_eq!(out, "ok 8388608", "every byte came back in order ({counters:?})");
    counters
}

#[test]
fn sk_msg_passes_local_pairs_socket_to_socket_and_keeps_data_intact() {
    require_root!();
    let fast = transfer(&test_name!(), true);
    assert!(fast.get("pairs_registered") >= 2, "both ends registered: {fast:?}");
    assert!(
        fast.get("skmsg_redirected") > 0 && fast.get("skmsg_bytes") > 1_000_000,
        "data went socket to socket: {fast:?}"
    );
    let plain = transfer(&format!("{}-plain", test_name!()), false);
    assert_eq!(plain.get("skmsg_redirected"), 0, "without acceleration nothing is redirected: {plain:?}");
}

#[test]
fn real_envoy_forwards_captured_traffic_to_the_original_destination() {
    require_root!();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let mesh = weir_tests::Mesh::new(&test).unwrap();
    let client = mesh.pod("client").unwrap();
    let server = mesh.pod("server").unwrap();
    let server_addr = std::net::SocketAddr::new(server.ipv4().into(), 8080);
    let _hello =
        weir_tests::capture::start_server(&server, 0, &["serve-hello", &server_addr.to_string(), "server"]);

    let mut programs = CapturePrograms::load().unwrap();
    programs.attach(cgroup.path()).unwrap();
    let cfg = CaptureConfig { inbound_ports: InboundPorts::None, ..injector_config(None) };
    let pod = PodCapture::new(
        &cfg,
        vec![client.ipv4().into(), client.ipv6().into()],
        EbpfOptions { accelerate: false },
    )
    .unwrap();
    programs.register(netns_cookie(Some(client.netns().path())).unwrap(), &pod, None).unwrap();

    let sidecar = Placement { user: Some((1337, 1337)), cgroup: Some(&cgroup), ..Placement::default() };
    let envoy = weir_tests::envoy::Envoy::start_placed(
        &client,
        weir_tests::envoy::OUTBOUND_PASSTHROUGH,
        "127.0.0.1:15000".parse().unwrap(),
        sidecar,
    )
    .expect("envoy starts");

    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    for _ in 0..3 {
        let reply = ask_placed(&client, app, server_addr);
        assert!(reply.starts_with("hello server "), "the server answered through Envoy: {reply:?}");
        assert!(
            reply.contains(&format!("local={server_addr}")),
            "Envoy connected to the original destination: {reply}"
        );
    }
    assert_eq!(
        envoy.stat(&client, "tcp.outbound.downstream_cx_total").unwrap(),
        Some(3),
        "Envoy carried the app's connections"
    );
    assert_eq!(
        envoy.stat(&client, "cluster.PassthroughCluster.upstream_cx_total").unwrap(),
        Some(3),
        "and opened its own upstream ones"
    );
    let counters = programs.counters().unwrap();
    assert_eq!(counters.get("redirected"), 3, "{counters:?}");
    assert_eq!(
        counters.get("orig_dst_answered"),
        3,
        "Envoy's original_dst filter got its answer: {counters:?}"
    );
    assert!(counters.get("bypass_proxy") >= 3, "Envoy's upstream connects were not captured: {counters:?}");
}

/// `weir istio-iptables --run-validation` in `pod`, placed as istio-validation runs.
fn validation(pod: &weir_tests::Pod, placement: Placement<'_>) -> std::process::Output {
    let probe = ["--skip-rule-apply", "--run-validation", "--probe-timeout", "3s"];
    weir_tests::capture::istio_iptables_placed(pod, placement, &probe)
}

#[test]
fn istio_validation_passes_under_ebpf_capture() {
    require_root!();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let sibling = test_cgroup(&format!("{test}-sibling"));
    let mesh = weir_tests::Mesh::new(&test).unwrap();
    let pod = mesh.pod("validated").unwrap();
    let mut programs = CapturePrograms::load().expect("the verifier accepts every capture program");
    programs.attach(cgroup.path()).expect("attach to the test cgroup");
    let own: Vec<IpAddr> = vec![pod.ipv4().into(), pod.ipv6().into()];
    let cfg = PodCapture::new(&injector_config(None), own, EbpfOptions { accelerate: false }).unwrap();
    programs.register(netns_cookie(Some(pod.netns().path())).unwrap(), &cfg, None).unwrap();

    // istio-validation (injected when a CNI captures pods) runs as the proxy user and
    // connects to 127.0.0.6:15002: Istio's `-o lo ! -d 127.0.0.1/32 ... --uid-owner 1337
    // -j ISTIO_IN_REDIRECT` sends it to the inbound port, and so must the programs.
    let proxy = Placement { user: Some((1337, 1337)), cgroup: Some(&cgroup), ..Placement::default() };
    let out = validation(&pod, proxy);
    assert_eq!(out.status.code(), Some(0), "validation under eBPF: {}", String::from_utf8_lossy(&out.stderr));
    let uncaptured = Placement { user: Some((1337, 1337)), cgroup: Some(&sibling), ..Placement::default() };
    let out = validation(&pod, uncaptured);
    assert_eq!(
        out.status.code(),
        Some(126),
        "validation without capture: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn envoys_inbound_passthrough_reaches_the_app_instead_of_looping() {
    require_root!();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V4, &cgroup);
    let _c = capture(&s, &cgroup, &injector_config(None), false);
    let proxy = Placement { user: Some((1337, 1337)), cgroup: Some(&cgroup), ..Placement::default() };
    // The proxy calling its own pod goes to the inbound side, unless it is Envoy's
    // inbound passthrough (bound to 127.0.0.6: Istio's `-o lo -s 127.0.0.6/32 -j
    // RETURN`), which must reach the app.
    let own = s.addr(&s.client, 8080);
    let line = ask_placed(&s.client, proxy, own);
    assert!(captured(&line).is_some(), "proxy to its own pod: {line:?}");
    let line = run_testkit(&s.client, proxy, &["ask-from", "127.0.0.6", &own.to_string()]);
    assert!(line.starts_with("hello app "), "inbound passthrough from 127.0.0.6: {line:?}");
}

/// Envoy's IPv6 inbound passthrough source (`::6`) is left alone only where Istio's
/// `-o lo -s ::6 -j RETURN` leaves it: on its way to the pod itself. An app that binds
/// `::6` (IPV6_FREEBIND needs no privilege) and connects to another pod is captured
/// like any of its connections. Before, the connect went out around Envoy (counted as
/// Envoy's passthrough).
#[test]
fn an_app_bound_to_the_v6_passthrough_source_is_captured_when_it_leaves_the_pod() {
    require_root!();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V6, &cgroup);
    let c = capture(&s, &cgroup, &injector_config(None), false);
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    let server = s.addr(&s.server, 8080);
    let before = c.programs.counters().unwrap();
    // The redirected connection's replies go to `::6`, which the pod cannot route: the
    // connect itself may fail; what matters is where capture sent it.
    let line = run_testkit(&s.client, app, &["ask-from", "::6", &server.to_string()]);
    assert!(!line.starts_with("hello server "), "the app reached the server around Envoy: {line:?}");
    let after = c.programs.counters().unwrap();
    let grew = |name: &str| after.get(name) - before.get(name);
    assert_eq!(grew("redirected"), 1, "{after:?}");
    assert_eq!(grew("bypass_inbound_passthrough"), 0, "{after:?}");
}

/// A Multipath TCP connect goes through capture like a TCP one (its first subflow
/// runs the same connect hook): the app reaches Envoy's stand-in with its original
/// destination, never the server directly. On a kernel without MPTCP the socket cannot
/// be made, and nothing reaches the server either.
#[test]
fn a_multipath_tcp_connect_is_captured() {
    require_root!();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V4, &cgroup);
    let _c = capture(&s, &cgroup, &injector_config(None), false);
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    let server = s.addr(&s.server, 8080);
    let line = run_testkit(&s.client, app, &["ask-mptcp", &server.to_string()]);
    if line.contains("socket(IPPROTO_MPTCP)") {
        // Only a kernel without MPTCP (or with it switched off) may refuse the socket.
        let no_mptcp = ["Protocol not supported", "Protocol not available"].iter().any(|e| line.contains(e));
        assert!(no_mptcp, "the MPTCP socket failed for another reason: {line}");
        eprintln!("this kernel makes no MPTCP sockets, so none can go around capture: {line}");
        return;
    }
    let (_, orig) =
        captured(&line).unwrap_or_else(|| panic!("an MPTCP connect went around capture: {line:?}"));
    assert_eq!(orig, server.to_string());
}

/// An IPv4 packet (no options) carrying `payload` as protocol `protocol`.
fn ipv4_packet(protocol: u8, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0x45, 0, 0, 0, 0, 0, 0, 0, 64, protocol, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2];
    h[2..4].copy_from_slice(&(20 + payload.len() as u16).to_be_bytes());
    [h, payload.to_vec()].concat()
}

/// An IPv6 packet carrying `payload` with next header `next`.
fn ipv6_packet(next: u8, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0x60, 0, 0, 0, 0, 0, next, 64];
    h[4..6].copy_from_slice(&(payload.len() as u16).to_be_bytes());
    h.extend(
        [
            [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
        ]
        .concat(),
    );
    [h, payload.to_vec()].concat()
}

/// A frame: Ethernet header, `tags` VLAN tags (VID 0), `ethertype`, `packet`.
fn frame(tags: usize, ethertype: u16, packet: &[u8]) -> Vec<u8> {
    let mut f = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1];
    for _ in 0..tags {
        f.extend([0x81, 0, 0, 0]);
    }
    f.extend(ethertype.to_be_bytes());
    [f, packet.to_vec()].concat()
}

/// The IP packet of a plain SYN to `port` (from the test kit's crafted SYNs).
fn syn_packet(v6: bool, port: u16) -> Vec<u8> {
    let (src, dst) = if v6 { ("fd00::1", "fd00::2") } else { ("10.0.0.1", "10.0.0.2") };
    let probe = weir_tests::synprobe::Probe {
        interface: "eth0".into(),
        src_mac: [2, 0, 0, 0, 0, 1],
        dst_mac: [2, 0, 0, 0, 0, 2],
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        sport: 40000,
        dport: port,
        shape: weir_tests::synprobe::Shape::Plain,
    };
    probe.frames().remove(0)[14..].to_vec()
}

/// What hides a TCP connection from the inbound classifier is dropped at a captured pod:
/// IP in IP, IPv6 in IP and GRE (decapsulated after this hook, on a tunnel device the
/// classifier is not on), and more VLAN tags than it reads; what it can read and need
/// not capture passes. Run on the classifier itself (BPF_PROG_TEST_RUN): this kernel
/// may have no tunnel devices to show the bypass end to end. Before, every tunnelled
/// SYN passed.
#[test]
fn the_inbound_classifier_drops_tunnels_and_deep_vlan_stacks() {
    require_root!();
    let test = test_name!();
    let mesh = weir_tests::Mesh::new(&test).unwrap();
    let pod = mesh.pod("p").unwrap();
    let cfg =
        PodCapture::new(&injector_config(None), vec![pod.ipv4().into()], EbpfOptions { accelerate: false })
            .unwrap()
            .inbound
            .expect("inbound capture");
    let classifier = InboundProgram::attach(pod.netns().path(), "eth0", &cfg).expect("attach tc inbound");
    const PASS: u32 = 0;
    const DROP: u32 = 2;
    let (syn4, syn6) = (syn_packet(false, 8080), syn_packet(true, 8080));
    let gre = |inner_type: u16, inner: &[u8]| [&[0, 0][..], &inner_type.to_be_bytes(), inner].concat();
    let mut ack = syn_packet(false, 8080);
    ack[20 + 13] = 0x10;
    let cases: Vec<(&str, Vec<u8>, u32)> = vec![
        ("IPv4 in IPv4", frame(0, 0x0800, &ipv4_packet(4, &syn4)), DROP),
        ("IPv6 in IPv4", frame(0, 0x0800, &ipv4_packet(41, &syn6)), DROP),
        ("GRE in IPv4", frame(0, 0x0800, &ipv4_packet(47, &gre(0x0800, &syn4))), DROP),
        ("IPv4 in IPv6", frame(0, 0x86dd, &ipv6_packet(4, &syn4)), DROP),
        ("IPv6 in IPv6", frame(0, 0x86dd, &ipv6_packet(41, &syn6)), DROP),
        ("GRE in IPv6", frame(0, 0x86dd, &ipv6_packet(47, &gre(0x86dd, &syn6))), DROP),
        ("a SYN behind three VLAN tags", frame(3, 0x0800, &syn4), DROP),
        ("UDP", frame(0, 0x0800, &ipv4_packet(17, &[0; 16])), PASS),
        ("a TCP segment of a connection", frame(0, 0x0800, &ack), PASS),
        ("a SYN to an excluded port", frame(0, 0x0800, &syn_packet(false, 15021)), PASS),
        ("the same behind two VLAN tags", frame(2, 0x0800, &syn_packet(false, 15021)), PASS),
    ];
    for (what, f, expected) in cases {
        assert_eq!(classifier.verdict(&f).unwrap(), expected, "{what}");
    }
}

/// A raw key whose length is not the map's (a damaged pin record) is refused before the
/// kernel reads the map's key size from it: before, a short key had the kernel read
/// past it and delete whatever key those bytes made.
#[test]
fn a_raw_key_of_the_wrong_length_deletes_nothing() {
    use std::os::fd::{AsFd as _, FromRawFd as _, OwnedFd};
    require_root!();
    // BPF_MAP_CREATE: a hash map with 8-byte keys and 1-byte values.
    let mut attr = [0u32; 32];
    (attr[0], attr[1], attr[2], attr[3]) = (1, 8, 1, 4);
    // SAFETY: a zeroed bpf_attr for BPF_MAP_CREATE.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, 0, attr.as_mut_ptr(), std::mem::size_of_val(&attr)) };
    assert!(fd >= 0, "BPF_MAP_CREATE: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor we own.
    let map = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let e = weir_agent::capture::ebpf::sys::delete_raw(map.as_fd(), &[1, 2, 3, 4]).unwrap_err();
    assert!(e.to_string().contains("a key of 4 bytes for a map whose keys are 8 bytes"), "{e}");
    assert!(
        !weir_agent::capture::ebpf::sys::delete_raw(map.as_fd(), &[0; 8]).unwrap(),
        "an absent key of the right length"
    );
}

/// A visit to a pod's namespace runs on the calling thread, which comes back: the
/// visit sees the pod's namespace, the caller its own afterwards, also when the visit
/// fails or panics, and a visit inside a visit comes back to the outer one.
#[test]
fn a_namespace_visit_returns_the_thread_to_its_own_namespace() {
    require_root!();
    use weir_agent::capture::ebpf::netns::{NetnsFacts, in_netns};
    let pod = weir_agent::sandbox::NetNs::create(&weir_agent::sandbox::unique_name("visit")).unwrap();
    let other = weir_agent::sandbox::NetNs::create(&weir_agent::sandbox::unique_name("visit-2")).unwrap();
    let home = netns_cookie(None).unwrap();
    let (pod_cookie, other_cookie) =
        (netns_cookie(Some(pod.path())).unwrap(), netns_cookie(Some(other.path())).unwrap());
    assert!(home != pod_cookie && pod_cookie != other_cookie && home != other_cookie);
    let thread = std::thread::current().id();
    let seen = in_netns(pod.path(), || {
        assert_eq!(std::thread::current().id(), thread, "the visit runs on the caller's thread");
        let inner = in_netns(other.path(), || netns_cookie(None))?;
        Ok((netns_cookie(None)?, inner, netns_cookie(None)?))
    })
    .unwrap();
    assert_eq!(seen, (pod_cookie, other_cookie, pod_cookie), "inside, and back from the inner visit");
    assert_eq!(netns_cookie(None).unwrap(), home, "back home");
    let failed: std::io::Result<()> = in_netns(pod.path(), || Err(std::io::Error::other("no")));
    assert!(failed.is_err());
    assert_eq!(netns_cookie(None).unwrap(), home, "back home after an error");
    let panicked =
        std::panic::catch_unwind(|| in_netns(pod.path(), || -> std::io::Result<()> { panic!("inside") }));
    assert!(panicked.is_err());
    assert_eq!(netns_cookie(None).unwrap(), home, "back home after a panic");
    // The facts of a namespace come from one visit: its cookie and its loopback.
    let facts = NetnsFacts::read(pod.path()).unwrap();
    assert_eq!(facts.cookie, Some(pod_cookie));
    assert!(facts.interfaces.iter().any(|i| i.name == "lo"), "{facts:?}");
    assert!(facts.own_addresses().is_empty(), "a fresh namespace has only loopback: {facts:?}");
    assert!(facts.mac("eth0").is_err());
}

/// Connections from one client port, one after another: each reply from the pod's side
/// (the testkit's 15006 listener) closes first, so the pod holds the previous
/// connection's 4-tuple in TIME_WAIT when the next SYN comes.
fn reconnect_from_one_port(test: &str, family: Family) {
    use std::time::Duration;
    let cgroup = test_cgroup(test);
    let s = CaptureScene::in_cgroup(test, family, &cgroup);
    let c = capture(&s, &cgroup, &injector_config(None), false);
    let app = s.addr(&s.client, 8080);
    let from: std::net::SocketAddr = match family {
        Family::V4 => "0.0.0.0:40123".parse().unwrap(),
        Family::V6 => "[::]:40123".parse().unwrap(),
    };
    let time_wait = || {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", s.client.netns().name(), "ss", "-Htan", "state", "time-wait"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).lines().any(|l| l.contains(":8080") && l.contains(":40123"))
    };
    for round in 0..3 {
        let line = s
            .server
            .run(move || async move {
                use tokio::io::AsyncReadExt as _;
                let sock = if from.is_ipv4() {
                    tokio::net::TcpSocket::new_v4()
                } else {
                    tokio::net::TcpSocket::new_v6()
                }?;
                sock.set_reuseaddr(true)?;
                sock.bind(from)?;
                let mut stream = tokio::time::timeout(Duration::from_secs(4), sock.connect(app))
                    .await
                    .map_err(|_| std::io::Error::other("connect timed out"))??;
                let mut answer = String::new();
                stream.read_to_string(&mut answer).await?;
                Ok::<_, std::io::Error>(answer)
            })
            .unwrap()
            .unwrap_or_else(|e| panic!("connection {round} from port 40123: {e}"));
        let (local, _) =
            captured(&line).unwrap_or_else(|| panic!("connection {round} not captured: {line:?}"));
        assert_eq!(local, app.to_string(), "connection {round}");
        assert!(time_wait(), "the pod holds connection {round}'s 4-tuple in TIME_WAIT (the case under test)");
    }
    let inbound = c.inbound.as_ref().unwrap().counters().unwrap();
    assert_eq!(inbound.get("inbound_assigned"), 3, "{inbound:?}");
}

/// A client reconnecting from the same port while the pod still holds the previous
/// connection in TIME_WAIT is captured again: the kernel reopens the 4-tuple and asks
/// for a listener, and the namespace's lookup hook answers with Envoy's. Before, the
/// classifier assigned the SYN to the listener, the kernel dropped it as a duplicate of
/// the TIME_WAIT socket, and the client timed out (found by the node rig: an ambient
/// client's ztunnel reusing a port towards a sidecar pod).
#[test]
fn a_connection_reopening_a_time_wait_tuple_is_captured_ipv4() {
    require_root!();
    reconnect_from_one_port(&test_name!(), Family::V4);
}

#[test]
fn a_connection_reopening_a_time_wait_tuple_is_captured_ipv6() {
    require_root!();
    reconnect_from_one_port(&test_name!(), Family::V6);
}
