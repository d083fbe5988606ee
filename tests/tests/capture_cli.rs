//! `weir capture` as an init container runs it: attach and pin, exit 0, capture stays
//! live; status shows it; re-running updates it in place; clean removes every program,
//! link, pin and classifier, and is idempotent. Also backend detection.

use std::process::{Command, Output, Stdio};

use weir_tests::{
    Placement,
    capture::{CaptureScene, Family, PinnedCapture, ask_placed, capture_state, captured, in_pod},
    require_root, test_cgroup, test_name, tools,
};

fn weir(args: &[&str]) -> Output {
    Command::new(tools::weir())
        .args(args)
        .env("WEIR_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

fn ok(out: &Output, what: &str) -> String {
    assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn pinned_capture_outlives_the_command_and_cleans_up_completely() {
    require_root!();
    // Declared first, dropped last: a bpffs this test mounted is unmounted, pass or fail.
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V4, &cgroup);
    let pod = cgroup.path().file_name().unwrap().to_string_lossy().into_owned();
    // Whatever the test reaches, the pinned capture goes before the cgroup and bpffs.
    let _pins = PinnedCapture(pod.clone());
    let cg = cgroup.path().to_str().unwrap();
    let netns = s.client.netns().path().to_str().unwrap();
    let attach = [
        "capture", "ebpf", "--cgroup", cg, "--netns", netns, "-p", "15001", "-z", "15006", "-u", "1337",
        "-i", "*", "-b", "*", "-d", "15021",
    ];
    ok(&weir(&attach), "weir capture ebpf");

    // The command has exited; capture is live.
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    let server = s.addr(&s.server, 8080);
    let line = ask_placed(&s.client, app, server);
    assert_eq!(captured(&line).map(|(_, o)| o), Some(server.to_string()), "{line}");
    assert!(
        weir_tests::capture::ask(&s.server, 0, s.addr(&s.client, 8080)).starts_with("captured "),
        "inbound classifier pinned too"
    );

    let status: serde_json::Value =
        serde_json::from_str(&ok(&weir(&["capture", "status", "--json"]), "status")).unwrap();
    let mine = status.as_array().unwrap().iter().find(|p| p["pod"] == pod).expect("status lists the pod");
    assert!(mine["counters"]["redirected"].as_u64().unwrap() >= 1, "{mine}");
    assert!(mine["links"].as_array().unwrap().iter().any(|l| l == "weir_connect4"), "{mine}");
    assert_eq!(mine["registered_pods"], 1);
    ok(&weir(&["capture", "log", "on", "--pod", &pod]), "log on");
    ok(&weir(&["capture", "log", "off", "--pod", &pod]), "log off");

    // Re-running updates the configuration in place (here: exclude the server).
    let mut again: Vec<String> = attach.iter().map(|s| s.to_string()).collect();
    again.extend(["-x".into(), format!("{}/32", s.server.ipv4())]);
    let again: Vec<&str> = again.iter().map(String::as_str).collect();
    let out = weir(&again);
    ok(&out, "weir capture ebpf, again");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("updated in place"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(ask_placed(&s.client, app, server).starts_with("hello server "), "the new -x applies at once");

    for _ in 0..2 {
        ok(&weir(&["capture", "clean", "--cgroup", cg]), "clean");
    }
    assert!(!weir_agent::ebpf::capture::pin_dir(&pod).exists(), "pins removed");
    let attached = weir_tests::capture::cgroup_programs(cgroup.path());
    assert!(attached.is_empty(), "no program left on the cgroup: {attached:?}");
    assert!(weir_tests::capture::inbound_programs(&s.client).is_empty());
    assert!(
        ask_placed(&s.client, app, s.addr(&s.server2, 8080)).starts_with("hello server2 "),
        "uncaptured after clean"
    );
    assert!(weir_tests::capture::ask(&s.server, 0, s.addr(&s.client, 8080)).starts_with("hello app "));
}

#[test]
fn detection_prefers_ebpf_here_and_apply_falls_back_when_told() {
    require_root!();
    let out = ok(&weir(&["capture", "detect"]), "detect");
    assert!(out.starts_with("ebpf\n"), "this kernel runs eBPF capture: {out}");
    assert!(
        ok(&weir(&["capture", "detect", "--capture-mode", "nftables"]), "detect nft")
            .starts_with("nftables\n")
    );

    let test = test_name!();
    let s = CaptureScene::new(&test, Family::V4, false);
    let netns = s.client.netns().path().to_str().unwrap();
    let cg = "/nonexistent-cgroup";
    let out = weir(&[
        "capture",
        "apply",
        "--capture-mode",
        "nftables",
        "--cgroup",
        cg,
        "--netns",
        netns,
        "-u",
        "1337",
        "-i",
        "*",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("capture backend: nftables"));
    assert!(capture_state(&s.client).contains("istio-proxy-nat"), "nft rules in the pod");
    assert!(captured(&weir_tests::capture::ask(&s.client, 1000, s.addr(&s.server, 8080))).is_some());
    // The host namespace was not touched.
    assert!(!in_pod(&s.server, "nft", &["list", "tables"]).contains("istio"));
}

#[test]
fn ebpf_limits_are_named_errors() {
    require_root!();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let out =
        weir(&["capture", "ebpf", "--cgroup", cgroup.path().to_str().unwrap(), "-c", "eth1", "-i", "*"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("-c/--istio-exclude-interfaces"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out =
        weir(&["capture", "ebpf", "--cgroup", cgroup.path().to_str().unwrap(), "-o", "8000:8080", "-i", "*"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("port ranges"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
