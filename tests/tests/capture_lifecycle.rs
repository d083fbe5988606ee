//! The life of capture rules in a real pod namespace: apply, re-apply (no-op), drift
//! and reconcile, cleanup (idempotent, routes included), rollback of a failed run, the
//! injector's exact command line, and Istio's validation probe.

use std::{os::unix::fs::symlink, process::Command};

use weir_iptables::{
    Action, CaptureConfig, CaptureError, RunOptions,
    config::{InboundPorts, InterceptionMode, IpRanges, parse_ports},
    nft_exec::zero_counters,
    state::Verdict,
};
use weir_tests::{
    capture::{CaptureScene, Family, ask, capture_state, captured, in_pod, istio_iptables},
    require_root, test_name,
};

fn injector_config(mode: InterceptionMode) -> CaptureConfig {
    CaptureConfig {
        interception_mode: mode,
        outbound_ip_ranges_include: IpRanges::All,
        inbound_ports: InboundPorts::All,
        inbound_ports_exclude: parse_ports("-d", "15090,15021,15020").unwrap(),
        ..CaptureConfig::default()
    }
}

fn opts(scene: &CaptureScene, nft: bool) -> RunOptions {
    RunOptions {
        native_nftables: nft,
        network_namespace: Some(scene.client.netns().path().to_path_buf()),
        ..RunOptions::default()
    }
}

fn state(scene: &CaptureScene) -> String {
    zero_counters(&capture_state(&scene.client))
}

fn is_captured(scene: &CaptureScene) -> bool {
    captured(&ask(&scene.client, 1000, scene.addr(&scene.server, 8080))).is_some()
}

fn lifecycle(test: &str, nft: bool, drift: &[&str]) {
    let scene = CaptureScene::new(test, Family::V4, true);
    let cfg = injector_config(InterceptionMode::Tproxy);
    let base = opts(&scene, nft);

    // Apply to a clean namespace.
    let report = weir_iptables::program(&cfg, &base).unwrap();
    assert_eq!(report.action, Action::Applied);
    assert!(is_captured(&scene));
    let applied = state(&scene);
    let rules = in_pod(&scene.client, "ip", &["rule", "show"]);
    assert!(rules.contains("fwmark 0x539 lookup 133"), "TPROXY rule installed: {rules}");
    assert!(in_pod(&scene.client, "ip", &["route", "show", "table", "133"]).contains("local default dev lo"));

    // Re-running changes nothing.
    let report = weir_iptables::program(&cfg, &base).unwrap();
    assert_eq!(report.action, Action::AlreadyApplied);
    assert_eq!(state(&scene), applied);

    // Drift is refused without --reconcile, and nothing changes.
    in_pod(&scene.client, drift[0], &drift[1..]);
    let drifted = state(&scene);
    assert_ne!(drifted, applied);
    assert_eq!(weir_iptables::apply::verify(&cfg, &base).unwrap(), Verdict::Drifted);
    let err = weir_iptables::program(&cfg, &base).unwrap_err();
    assert!(matches!(err, CaptureError::Drift { .. }), "{err}");
    assert_eq!(state(&scene), drifted);

    // --reconcile repairs it.
    let report = weir_iptables::program(&cfg, &RunOptions { reconcile: true, ..base.clone() }).unwrap();
    assert_eq!(report.action, Action::Reconciled);
    assert_eq!(state(&scene), applied);
    assert_eq!(weir_iptables::apply::verify(&cfg, &base).unwrap(), Verdict::Applied);
    assert!(is_captured(&scene));
    assert!(
        in_pod(&scene.client, "iptables-save", &["-t", "filter"]).lines().all(|l| !l.contains("DROP")),
        "guardrails removed"
    );

    // --cleanup-only removes everything, routes included, and is idempotent.
    let cleanup = RunOptions { cleanup_only: true, ..base.clone() };
    for _ in 0..2 {
        let report = weir_iptables::program(&cfg, &cleanup).unwrap();
        assert_eq!(report.action, Action::Cleaned);
        assert_eq!(capture_state(&scene.client), "", "no Istio chains, rules or tables remain");
        assert!(!in_pod(&scene.client, "ip", &["rule", "show"]).contains("lookup 133"));
        assert!(in_pod(&scene.client, "ip", &["route", "show", "table", "133"]).trim().is_empty());
    }
    assert!(
        ask(&scene.client, 1000, scene.addr(&scene.server, 8080)).starts_with("hello server "),
        "uncaptured after cleanup"
    );
    assert_eq!(weir_iptables::apply::verify(&cfg, &base).unwrap(), Verdict::Clean);
}

#[test]
fn iptables_apply_twice_drift_reconcile_cleanup() {
    require_root!();
    lifecycle(
        &test_name!(),
        false,
        &["iptables", "-t", "nat", "-D", "ISTIO_OUTPUT", "-o", "lo", "-s", "127.0.0.6/32", "-j", "RETURN"],
    );
}

#[test]
fn nft_apply_twice_drift_reconcile_cleanup() {
    require_root!();
    lifecycle(
        &test_name!(),
        true,
        &["nft", "add", "rule", "inet", "istio-proxy-nat", "istio-output", "counter", "return"],
    );
}

#[test]
fn a_failure_part_way_restores_the_previous_state() {
    require_root!();
    let scene = CaptureScene::new(&test_name!(), Family::V4, false);
    let base = opts(&scene, false);
    let before = injector_config(InterceptionMode::Redirect);
    assert_eq!(weir_iptables::program(&before, &base).unwrap().action, Action::Applied);
    let applied = state(&scene);

    // A new config whose IPv4 rules apply but whose IPv6 rules cannot (a bad DNS
    // server address): the v4 table has already changed when v6 fails.
    let broken = CaptureConfig {
        enable_ipv6: true,
        redirect_dns: true,
        dns_servers_v6: vec!["not-an-address".into()],
        ..injector_config(InterceptionMode::Redirect)
    };
    let err = weir_iptables::program(&broken, &RunOptions { reconcile: true, ..base.clone() }).unwrap_err();
    assert!(matches!(err, CaptureError::RolledBack { .. }), "{err}");
    assert_eq!(state(&scene), applied, "the namespace is as it was before the failed run");
    assert!(is_captured(&scene));
    assert_eq!(weir_iptables::apply::verify(&before, &base).unwrap(), Verdict::Applied);
}

#[test]
fn the_injectors_command_line_programs_istios_rules() {
    require_root!();
    let scene = CaptureScene::new(&test_name!(), Family::V4, false);
    let dir = weir_tests::envoy::tempfile_dir::Dir::new("pilot-agent").unwrap();
    let pilot_agent = dir.path().join("pilot-agent");
    symlink(weir_tests::tools::weir(), &pilot_agent).unwrap();
    let mut cmd = Command::new(&pilot_agent);
    cmd.args(weir_tests::capture::injector_istio_init_args());
    cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let out = scene.client.spawn(&mut cmd, 0).unwrap().into_inner().wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Every rule of Istio's plan for that line is present (iptables -C), chain shapes match.
    let cfg = injector_config(InterceptionMode::Redirect);
    assert_eq!(weir_iptables::apply::verify(&cfg, &opts(&scene, false)).unwrap(), Verdict::Applied);
    let planned = weir_iptables::plan::plan(&cfg).v4.len();
    let saved = in_pod(&scene.client, "iptables-save", &["-t", "nat"]);
    assert_eq!(
        saved.lines().filter(|l| l.starts_with("-A ")).count(),
        planned,
        "no more and no fewer rules than Istio's:\n{saved}"
    );
    assert!(is_captured(&scene));
}

#[test]
fn validation_passes_with_rules_and_fails_with_126_without() {
    require_root!();
    let mesh = weir_tests::Mesh::new(&test_name!()).unwrap();
    let captured_pod = mesh.pod("captured").unwrap();
    let bare_pod = mesh.pod("bare").unwrap();
    let rules = ["-u", "1337", "-i", "*", "-b", "*"];
    let out = istio_iptables(&captured_pod, &rules, None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let probe = ["--skip-rule-apply", "--run-validation", "--probe-timeout", "3s"];
    // istio-validation runs as istio-proxy (1337), from the init image (weir-init) or
    // from the proxy image (weir).
    for (what, cmd) in [
        ("weir", weir_tests::tools::weir_command as fn() -> _),
        ("weir-init", weir_tests::tools::init_command),
    ] {
        let as_proxy = || weir_tests::Placement { user: Some((1337, 1337)), ..Default::default() };
        let out = weir_tests::capture::istio_iptables_with(cmd(), &captured_pod, as_proxy(), &probe);
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{what}: validation with rules: {said}");
        let out = weir_tests::capture::istio_iptables_with(cmd(), &bare_pod, as_proxy(), &probe);
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(126), "{what}: validation without rules: {said}");
        assert!(said.contains("validation failed"), "{what}: {said}");
    }
}
