//! eBPF capture with real traffic: the capture programs on a test cgroup, the inbound
//! classifier on the pod's interface, no netfilter rules anywhere.

use std::net::IpAddr;

use weir_agent::ebpf::{
    capture::{CapturePrograms, InboundProgram, netns_cookie},
    config::{EbpfOptions, PodCapture},
};
use weir_iptables::config::{CaptureConfig, Cidr, InboundPorts, IpRanges, parse_ports};
use weir_tests::{
    Placement,
    capture::{CaptureScene, Family, ask, ask_placed, captured},
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
    let pod = PodCapture::new(cfg, own, EbpfOptions { accelerate, clamp_optlen: false }).unwrap();
    let cookie = netns_cookie(Some(scene.client.netns().path())).unwrap();
    programs.register(cookie, &pod).unwrap();
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
    assert!(c.inbound.as_ref().unwrap().assigned().unwrap() >= 1);
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
