//! "Why did this connection bypass the sidecar?" answered from a live pod: real
//! connections are made, outbound and inbound, the pod's decision counters count each
//! by its reason (in `weir capture status` and as `weir_capture_*` metrics), and `weir
//! capture explain` says, before any connection is made, what capture will do with it
//! and which program decision or netfilter rule decides — and the traffic then does
//! exactly that.

use std::process::{Command, Output, Stdio};

use weir_tests::{
    Placement,
    capture::{CaptureScene, Family, PinnedCapture, ask, ask_placed, captured, istio_iptables},
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
fn ebpf_decisions_are_counted_per_pod_and_explained_from_its_maps() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V4, &cgroup);
    let pod = cgroup.path().file_name().unwrap().to_string_lossy().into_owned();
    let _pins = PinnedCapture(pod.clone());
    let cg = cgroup.path().to_str().unwrap();
    let netns = s.client.netns().path().to_str().unwrap();
    ok(
        &weir(&[
            "capture", "ebpf", "--cgroup", cg, "--netns", netns, "-p", "15001", "-z", "15006", "-u", "1337",
            "-i", "*", "-b", "*", "-d", "15021", "-o", "9090",
        ]),
        "weir capture ebpf",
    );
    let (to_8080, to_9090) = (s.addr(&s.server, 8080), s.addr(&s.server, 9090));

    // Asked first: what will happen, and why.
    let explain = |dst: std::net::SocketAddr, uid: &str| {
        ok(&weir(&["capture", "explain", "--pod", &pod, &dst.to_string(), "--uid", uid]), "explain")
    };
    let app_8080 = explain(to_8080, "1000");
    assert!(app_8080.contains("redirected to 127.0.0.1:15001 (Envoy's outbound listener)"), "{app_8080}");
    assert!(app_8080.contains("-i '*'"), "{app_8080}");
    let app_9090 = explain(to_9090, "1000");
    assert!(
        app_9090.contains("not captured") && app_9090.contains("excluded outbound port (-o 9090)"),
        "{app_9090}"
    );
    let proxy = explain(to_8080, "1337");
    assert!(proxy.contains("not captured") && proxy.contains("is the proxy's (-u 1337"), "{proxy}");
    // Inbound, from the tc classifier's registered config and the pod's listeners.
    let (app_8080_in, app_15021_in) = (s.addr(&s.client, 8080), s.addr(&s.client, 15021));
    let explain_in = |dst: std::net::SocketAddr| {
        ok(&weir(&["capture", "explain", "--pod", &pod, "--inbound", &dst.to_string()]), "explain --inbound")
    };
    let assigned = explain_in(app_8080_in);
    assert!(assigned.contains("assigned to Envoy's inbound listener on port 15006"), "{assigned}");
    assert!(assigned.contains("every port (-b '*') except -d 15021"), "{assigned}");
    let health = explain_in(app_15021_in);
    assert!(
        health.contains("not captured") && health.contains("excluded inbound port (-d 15021)"),
        "{health}"
    );

    // Then done: two app connections captured, one to the excluded port and one by the
    // proxy uid left alone, exactly as explained.
    let as_uid = |uid| Placement { user: Some((uid, uid)), cgroup: Some(&cgroup), ..Placement::default() };
    for _ in 0..2 {
        let line = ask_placed(&s.client, as_uid(1000), to_8080);
        assert_eq!(captured(&line).map(|(_, o)| o), Some(to_8080.to_string()), "{line}");
    }
    assert!(ask_placed(&s.client, as_uid(1000), to_9090).starts_with("hello server "));
    assert!(ask_placed(&s.client, as_uid(1337), to_8080).starts_with("hello server "));
    // Inbound, decided by the tc classifier: one connection to the app's 8080 assigned
    // to Envoy's 15006, one to 15021 (-d) left to the port it was sent to.
    let line = ask(&s.server, 0, s.addr(&s.client, 8080));
    assert_eq!(captured(&line).map(|(l, _)| l), Some(s.addr(&s.client, 8080).to_string()), "{line}");
    assert!(ask(&s.server, 0, s.addr(&s.client, 15021)).starts_with("hello app-15021 "));

    // Counted per pod, by reason.
    let status: serde_json::Value =
        serde_json::from_str(&ok(&weir(&["capture", "status", "--json", "--pod", &pod]), "status")).unwrap();
    let counters = &status[0]["counters"];
    assert_eq!(counters["redirected"], 2, "{counters}");
    assert_eq!(counters["bypass_excluded_port"], 1, "{counters}");
    assert_eq!(counters["bypass_proxy"], 1, "{counters}");
    assert_eq!(counters["inbound_assigned"], 1, "{counters}");
    assert_eq!(counters["inbound_not_captured"], 1, "{counters}");
    assert_eq!(counters["inbound_no_listener"], 0, "{counters}");
    assert_eq!(
        counters["orig_dst_answered"], 2,
        "the stand-in asked for each original destination: {counters}"
    );
    assert!(explain(to_8080, "1000").contains("counted as redirected (this pod so far: 2)"));
    assert!(explain_in(app_8080_in).contains("counted as inbound_assigned (this pod so far: 1)"));

    // And as metrics, labelled by pod and decision.
    let pods = weir_agent::capture::ebpf::metrics::pod_counters();
    let mine: Vec<_> = pods.into_iter().filter(|(p, _)| *p == pod).map(|(p, c)| (p, c.unwrap())).collect();
    let text = weir_agent::capture::ebpf::metrics::exposition(&mine, 0, &[]);
    for series in [
        format!("weir_capture_decisions_total{{pod=\"{pod}\",decision=\"redirected\"}} 2"),
        format!("weir_capture_decisions_total{{pod=\"{pod}\",decision=\"bypass_excluded_port\"}} 1"),
        format!("weir_capture_decisions_total{{pod=\"{pod}\",decision=\"bypass_proxy\"}} 1"),
        format!("weir_capture_decisions_total{{pod=\"{pod}\",decision=\"inbound_assigned\"}} 1"),
        format!("weir_capture_decisions_total{{pod=\"{pod}\",decision=\"inbound_not_captured\"}} 1"),
    ] {
        assert!(text.contains(&series), "{series} in\n{text}");
    }
    ok(&weir(&["capture", "clean", "--cgroup", cg]), "clean");
    let gone = weir(&["capture", "explain", "--pod", &pod, &to_8080.to_string()]);
    assert!(!gone.status.success());
    assert!(String::from_utf8_lossy(&gone.stderr).contains(&format!("no eBPF capture named {pod}")));
}

#[test]
fn netfilter_rules_are_explained_rule_by_rule_and_traffic_agrees() {
    require_root!();
    for native_nftables in [false, true] {
        explain_netfilter(&format!("{}-{native_nftables}", test_name!()), native_nftables);
    }
}

fn explain_netfilter(test: &str, native_nftables: bool) {
    let s = CaptureScene::new(test, Family::V4, false);
    let mut flags = vec![
        "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-b", "*", "-d", "15021",
        "-o", "9090",
    ];
    if native_nftables {
        flags.push("--native-nftables");
    }
    let out = istio_iptables(&s.client, &flags, None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let netns = s.client.netns().path().to_str().unwrap();
    let (to_8080, to_9090) = (s.addr(&s.server, 8080), s.addr(&s.server, 9090));
    let explain = |dst: std::net::SocketAddr, uid: &str| {
        ok(&weir(&["capture", "explain", "--netns", netns, &dst.to_string(), "--uid", uid]), "explain")
    };
    // Each backend's own rule text: iptables-save's, or nft's listing.
    let (backend, redirect, into_redirect, port_return, proxy_return) = if native_nftables {
        (
            "nftables capture",
            "redirect to :15001",
            "jump istio-redirect",
            "tcp dport 9090 counter packets 0 bytes 0 return",
            "meta skuid 1337 counter packets 0 bytes 0 return",
        )
    } else {
        (
            "iptables capture",
            "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001",
            "-A ISTIO_OUTPUT -j ISTIO_REDIRECT",
            "--dport 9090 -j RETURN",
            "--uid-owner 1337 -j RETURN",
        )
    };
    let app = explain(to_8080, "1000");
    assert!(app.starts_with(backend), "{app}");
    assert!(app.contains("redirected to local port 15001") && app.contains(redirect), "{app}");
    assert!(app.contains("through `") && app.contains(into_redirect), "{app}");
    let excluded = explain(to_9090, "1000");
    assert!(excluded.contains("not captured") && excluded.contains(port_return), "{excluded}");
    let proxy = explain(to_8080, "1337");
    assert!(proxy.contains("not captured") && proxy.contains(proxy_return), "{proxy}");

    // Inbound, walked from PREROUTING.
    let (in_8080, in_15021) = (s.addr(&s.client, 8080), s.addr(&s.client, 15021));
    let explain_in = |dst: std::net::SocketAddr| {
        ok(
            &weir(&["capture", "explain", "--netns", netns, "--inbound", &dst.to_string()]),
            "explain --inbound",
        )
    };
    let (in_redirect, in_return) = if native_nftables {
        ("redirect to :15006", "tcp dport 15021 counter packets 0 bytes 0 return")
    } else {
        ("-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006", "--dport 15021 -j RETURN")
    };
    let inbound = explain_in(in_8080);
    assert!(inbound.contains("redirected to local port 15006") && inbound.contains(in_redirect), "{inbound}");
    let health = explain_in(in_15021);
    assert!(health.contains("not captured") && health.contains(in_return), "{health}");

    let as_uid = |uid| Placement { user: Some((uid, uid)), ..Placement::default() };
    let line = ask_placed(&s.client, as_uid(1000), to_8080);
    assert_eq!(captured(&line).map(|(_, o)| o), Some(to_8080.to_string()), "{line}");
    assert!(ask_placed(&s.client, as_uid(1000), to_9090).starts_with("hello server "));
    assert!(ask_placed(&s.client, as_uid(1337), to_8080).starts_with("hello server "));
    // And inbound traffic does what was explained.
    let line = ask(&s.server, 0, in_8080);
    assert_eq!(captured(&line).map(|(_, o)| o), Some(in_8080.to_string()), "{line}");
    assert!(ask(&s.server, 0, in_15021).starts_with("hello app-15021 "));
}

#[test]
fn explain_names_what_it_needs() {
    let out = weir(&["capture", "explain", "10.0.0.1:80"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--pod") && err.contains("--netns"), "{err}");
    let out = weir(&["capture", "explain", "--pod", "x", "not-an-address"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not-an-address"));
    // No uid sends an arriving connection: the flags refuse each other by name.
    let out = weir(&["capture", "explain", "--pod", "x", "--inbound", "--uid", "5", "10.0.0.1:80"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--inbound") && err.contains("--uid"), "{err}");
}
