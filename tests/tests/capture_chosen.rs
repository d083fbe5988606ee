//! The backend `auto` picks on this kernel, held to what the kernel's facts say it must
//! be (`weir_tests::kernel`): eBPF where the kernel and a cgroup v2 mount allow it,
//! nftables with the reason named where not (5.10, a cgroup v1 boot). Then a sidecar
//! as an operator sets one up, `weir capture apply --capture-mode auto` plus the real
//! Envoy, carries an app's connections through whichever backend that is. These run on
//! every kernel of vagrant/qemu-kernels and on the host.

use std::{net::SocketAddr, path::Path, process::Output};

use weir_agent::sandbox::unique_name;
use weir_tests::{
    Placement,
    capture::{INJECTOR_OUTBOUND, ask_placed, start_server},
    envoy::{Envoy, OUTBOUND_PASSTHROUGH},
    kernel::{PodCgroup, expected_capture},
    require_root, test_name, tools,
};

fn weir(args: &[&str]) -> Output {
    tools::weir_command().args(args).output().unwrap()
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[test]
fn detect_picks_the_backend_this_kernel_supports_and_names_why() {
    require_root!();
    let expected = expected_capture();
    let out = weir(&["capture", "detect"]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().next(), Some(expected.backend), "expected {expected:?}:\n{stdout}");
    let forced = weir(&["capture", "detect", "--capture-mode", "ebpf"]);
    match expected.because {
        None => {
            assert!(stdout.contains("verified and loaded every capture program"), "{stdout}");
            assert!(forced.status.success(), "{}", text(&forced));
        }
        Some(because) => {
            assert!(stdout.contains("not ebpf: ") && stdout.contains(because), "{stdout}");
            // Forced, eBPF is refused with the same reason, and nothing is loaded.
            assert!(!forced.status.success(), "--capture-mode ebpf worked on a kernel without it");
            let err = String::from_utf8_lossy(&forced.stderr);
            assert!(
                err.contains("--capture-mode=ebpf cannot work on this machine") && err.contains(because),
                "{err}"
            );
        }
    }
}

/// Removes a pinned eBPF capture, pass or fail (a netfilter capture dies with its
/// namespace).
struct Pinned(String);

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = weir(&["capture", "clean", "--pod", &self.0]);
    }
}

#[test]
fn a_sidecar_with_real_envoy_carries_traffic_through_the_chosen_backend() {
    require_root!();
    let expected = expected_capture();
    let test = test_name!();
    // Declared first, dropped last: a bpffs this test mounted is unmounted.
    let _bpffs = weir_agent::capture::ebpf::bpffs::BpffsUse::acquire().unwrap();
    // On a cgroup v1 boot there is no cgroup v2 directory to give: the pod's cgroup is
    // then a v1 directory, which eBPF capture must never attach to.
    let pod_cgroup = PodCgroup::create(&test);
    let cgroup = pod_cgroup.v2();
    let mesh = weir_tests::Mesh::new(&test).unwrap();
    let client = mesh.pod("client").unwrap();
    let server = mesh.pod("server").unwrap();
    let server_addr = SocketAddr::new(server.ipv4().into(), 8080);
    let _hello = start_server(&server, 0, &["serve-hello", &server_addr.to_string(), "server"]);

    // Istio's injector flags, outbound only (the Envoy below has no inbound listener).
    let name = unique_name("chosen");
    let _pinned = Pinned(name.clone());
    let netns = client.netns().path().display().to_string();
    let cg = pod_cgroup.path().display().to_string();
    let capture = |mode: &str| {
        let node = ["--capture-mode", mode, "--cgroup", &cg, "--netns", &netns, "--pod", &name];
        let mut cmd = tools::weir_command();
        cmd.args(["capture", "apply"]).args(node).args(INJECTOR_OUTBOUND).args(["-b", ""]);
        cmd.output().unwrap()
    };
    if cgroup.is_none() {
        let forced = capture("ebpf");
        assert!(!forced.status.success(), "eBPF capture attached on a cgroup v1 host");
        assert!(text(&forced).contains("no cgroup v2 mount"), "{}", text(&forced));
    }
    let out = capture("auto");
    assert!(out.status.success(), "capture apply: {}", text(&out));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!("capture backend: {}", expected.backend)),
        "expected {expected:?}: {said}"
    );
    if let Some(because) = expected.because {
        assert!(said.contains(because), "{said}");
    }
    let pinned = Path::new("/sys/fs/bpf/weir").join(&name).exists();
    assert_eq!(pinned, expected.ebpf(), "eBPF pins for {name} exist exactly when eBPF was chosen");
    let rules = weir_tests::capture::in_pod(&client, "nft", &["list", "ruleset"]);
    assert_eq!(
        rules.contains("istio"),
        !expected.ebpf(),
        "nftables rules exactly when it was chosen:\n{rules}"
    );

    let sidecar = Placement { user: Some((1337, 1337)), cgroup, ..Placement::default() };
    let envoy =
        Envoy::start_placed(&client, OUTBOUND_PASSTHROUGH, "127.0.0.1:15000".parse().unwrap(), sidecar)
            .expect("envoy starts");
    let app = Placement { user: Some((1000, 1000)), cgroup, ..Placement::default() };
    for _ in 0..3 {
        let reply = ask_placed(&client, app, server_addr);
        assert!(reply.starts_with("hello server "), "the server answered: {reply:?}");
        assert!(reply.contains(&format!("local={server_addr}")), "at the original destination: {reply}");
    }
    assert_eq!(
        envoy.stat(&client, "tcp.outbound.downstream_cx_total").unwrap(),
        Some(3),
        "Envoy carried the app's connections ({})",
        expected.backend
    );
    assert_eq!(
        envoy.stat(&client, "cluster.PassthroughCluster.upstream_cx_total").unwrap(),
        Some(3),
        "and opened its own, uncaptured, to the original destination"
    );
}
