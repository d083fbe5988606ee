//! The README's first command ends in `weir demo`: run it briefly with each capture
//! backend this machine has and check its own summary — requests went through the
//! sidecars, Envoy's stats show mutual TLS, the sidecars drained, nothing was left.

use std::process::Command;

use weir_tests::{require_root, tools};

fn demo(mode: &str) {
    let envoy = weir_tests::envoy::binary().unwrap();
    let child = Command::new(tools::weir())
        .args(["demo", "--duration", "3", "--capture-mode", mode])
        .env("WEIR_ENVOY", &envoy)
        .env("WEIR_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Sandboxes are named after the process that made them.
    let mine = format!("weir-{}-", child.id());
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "weir demo --capture-mode {mode}:\n{stdout}\n{stderr}");
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("[demo] summary"))
        .unwrap_or_else(|| panic!("no summary:\n{stdout}"));
    let field = |name: &str| {
        summary
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name} in {summary}"))
            .to_string()
    };
    assert_eq!(field("backend"), mode, "{summary}");
    assert!(field("requests_ok").parse::<u64>().unwrap() > 0, "{summary}");
    assert_eq!(field("requests_failed"), "0", "{summary}");
    assert_eq!(
        field("envoy_upstream_requests"),
        field("requests_ok"),
        "every request went through Envoy: {summary}"
    );
    assert_eq!(field("mtls"), "true", "{summary}");
    assert_eq!(field("drained"), "true", "{summary}");
    assert!(stdout.contains("identity  client: spiffe://cluster.local/ns/default/sa/client"), "{stdout}");
    // Nothing left by that process: no namespace, cgroup, pin or capture record.
    let left = Command::new(tools::weir()).args(["sandbox", "list"]).output().unwrap();
    let left = String::from_utf8_lossy(&left.stdout);
    assert!(!left.contains(&mine), "{left}");
    let pins: Vec<_> = std::fs::read_dir("/sys/fs/bpf/weir")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&mine))
                .collect()
        })
        .unwrap_or_default();
    assert!(pins.is_empty(), "pins left: {pins:?}");
}

#[test]
fn the_demo_carries_traffic_over_mtls_with_ebpf() {
    require_root!();
    demo("ebpf");
}

#[test]
fn the_demo_carries_traffic_over_mtls_with_nftables() {
    require_root!();
    demo("nftables");
}

#[test]
fn the_demo_carries_traffic_over_mtls_with_iptables() {
    require_root!();
    demo("iptables");
}
