//! Ambient mode's in-pod and host-probe rules in real namespaces, as Istio's e2e tests
//! run them (`cni/pkg/{iptables,nftables}/*_e2e_linux_test.go`): every case of Istio's
//! table applied in a fresh pod namespace and read back (iptables-save / nft list,
//! `ip rule`, `ip route`), re-run equal (nothing changes) and unequal (tampered Istio
//! chains, a different pod configuration: replaced with no leftovers, or refused
//! without reconcile and nothing changed), removed. Then real traffic: an app's
//! connection lands on ztunnel's 15001, inbound on 15006, DNS on 15053, and a probe
//! from the node's SNAT address reaches the app uncaptured. Last, the node's probe SNAT
//! rule: applied, kept, restored after a flush, removed.

use std::{net::SocketAddr, path::Path};

use weir_iptables::{
    ambient::{
        self, AmbientBackend, AmbientConfig, AmbientError, InpodConfig, PodDns, PodOverrides,
        apply_host_probe, apply_inpod, remove_host_probe, remove_inpod, verify_host_probe, verify_inpod,
    },
    apply::Action,
    netlink::{Family as NlFamily, Netlink},
    state::Verdict,
};
use weir_tests::{
    Mesh, Placement, Pod,
    capture::{CaptureScene, Family, ask, captured, in_pod, run_testkit, start_server},
    require_root, test_name,
};

/// Istio's GetCommonInPodTestCases, as config changes and pod annotations.
fn cases(backend: AmbientBackend, ipv6: bool) -> Vec<(&'static str, InpodConfig)> {
    let base = AmbientConfig { backend, enable_ipv6: ipv6, ..Default::default() };
    let with =
        |redirect_dns: bool, pod: PodOverrides| AmbientConfig { redirect_dns, ..base.clone() }.for_pod(pod);
    let nics = || vec!["fake1s0f0".to_string(), "fake1s0f1".to_string()];
    vec![
        ("default", with(true, PodOverrides::default())),
        ("ingress", with(false, PodOverrides { ingress_mode: true, ..Default::default() })),
        (
            "virtual_interfaces",
            with(false, PodOverrides { virtual_interfaces: nics(), ..Default::default() }),
        ),
        (
            "ingress_and_virtual_interfaces",
            with(
                false,
                PodOverrides { ingress_mode: true, virtual_interfaces: nics(), ..Default::default() },
            ),
        ),
        (
            "dns_pod_enabled_and_off_globally",
            with(false, PodOverrides { dns: PodDns::Enabled, ..Default::default() }),
        ),
        (
            "dns_pod_disabled_and_on_globally",
            with(true, PodOverrides { dns: PodDns::Disabled, ..Default::default() }),
        ),
    ]
}

/// What the namespace holds, as the tools print it (counters left out): the rules of
/// both families and the ambient nft tables.
fn rules_of(pod: &Pod) -> String {
    let mut out = String::new();
    for save in ["iptables-save", "ip6tables-save"] {
        // Rules and Istio's chains; tables and builtin chains that iptables-nft keeps
        // once made (empty) are not rules. Chain declarations lose their counters.
        for line in in_pod(pod, save, &[]).lines() {
            if line.starts_with("-A") {
                out.push_str(&format!("{save}: {line}\n"));
            } else if line.starts_with(":ISTIO") {
                out.push_str(&format!("{save}: {}\n", line.split(' ').next().unwrap_or(line)));
            }
        }
    }
    let tables = in_pod(pod, "nft", &["list", "tables"]);
    for name in tables.lines().filter_map(|l| l.strip_prefix("table inet istio-ambient-")) {
        let listing = in_pod(pod, "nft", &["list", "table", "inet", &format!("istio-ambient-{name}")]);
        out.push_str(&weir_iptables::nft_exec::zero_counters(&listing));
    }
    out
}

/// `ip <args>` in the pod: its output, or nothing when it fails (`ip -6 route show
/// table 100` fails while the table does not exist).
fn ip(pod: &Pod, args: &[&str]) -> String {
    let mut cmd = std::process::Command::new("ip");
    cmd.args(args).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::null());
    let out = pod.spawn(&mut cmd, 0).expect("spawn ip").into_inner().wait_with_output().expect("wait ip");
    if out.status.success() { String::from_utf8_lossy(&out.stdout).into_owned() } else { String::new() }
}

/// The in-pod policy route, read back with `ip`: (v4 rule, v4 route, v6 rule, v6 route).
fn policy_route(pod: &Pod) -> [bool; 4] {
    let rule =
        |flag| ip(pod, &[flag, "rule", "show"]).contains("32764:\tfrom all fwmark 0x111/0xfff lookup 100");
    let route = |flag| ip(pod, &[flag, "route", "show", "table", "100"]).contains("local default dev lo");
    [rule("-4"), route("-4"), rule("-6"), route("-6")]
}

fn verify(pod: &Pod, cfg: &InpodConfig) -> Verdict {
    verify_inpod(pod.netns().path(), cfg).unwrap()
}

fn apply(pod: &Pod, cfg: &InpodConfig) -> Action {
    apply_inpod(pod.netns().path(), cfg).unwrap_or_else(|e| panic!("apply: {e:?}")).action
}

/// One case in a fresh namespace: Istio's TestIdempotentEquivalentInPodRerun and more.
fn case_round_trip(pod: &Pod, name: &str, cfg: &InpodConfig) {
    assert_eq!(verify(pod, cfg), Verdict::Clean, "{name}: a new namespace is clean");
    assert_eq!(apply(pod, cfg), Action::Applied, "{name}");
    assert_eq!(verify(pod, cfg), Verdict::Applied, "{name}");
    let applied = rules_of(pod);
    let v6 = cfg.ambient.enable_ipv6;
    assert_eq!(policy_route(pod), [true, true, v6, v6], "{name}: ip rule and route per family");
    let expected_jumps = if cfg.redirect_dns() { 3 } else { 2 };
    match cfg.ambient.backend {
        AmbientBackend::Iptables => {
            assert!(applied.contains("iptables-save: -A OUTPUT -j ISTIO_OUTPUT"), "{name}:\n{applied}");
            let jumps =
                applied.lines().filter(|l| *l == "iptables-save: -A PREROUTING -j ISTIO_PRERT").count();
            assert_eq!(jumps, expected_jumps, "{name}: mangle, nat (and raw with DNS)");
            assert_eq!(
                applied.contains("ip6tables-save: -A OUTPUT -j ISTIO_OUTPUT"),
                v6,
                "{name}:\n{applied}"
            );
            assert!(!applied.contains("istio-ambient"), "{name}: no nft tables beside iptables");
        }
        AmbientBackend::Nftables => {
            assert!(applied.contains("table inet istio-ambient-nat"), "{name}:\n{applied}");
            assert_eq!(applied.contains("table inet istio-ambient-raw"), cfg.redirect_dns(), "{name}");
            assert!(!applied.contains("ISTIO_"), "{name}: no iptables chains beside nft");
        }
    }
    assert_eq!(applied.contains("15006"), !cfg.pod.ingress_mode, "{name}: inbound redirection");
    assert_eq!(applied.contains("15053"), cfg.redirect_dns(), "{name}: DNS redirection");
    assert_eq!(applied.contains("fake1s0f0"), !cfg.pod.virtual_interfaces.is_empty(), "{name}");

    // Equal re-run: nothing changes.
    assert_eq!(apply(pod, cfg), Action::AlreadyApplied, "{name}");
    assert_eq!(rules_of(pod), applied, "{name}: an equal re-run changes nothing");

    // Removal, then a second apply as the first.
    assert_eq!(remove_inpod(pod.netns().path()).unwrap(), Action::Cleaned);
    assert_eq!(verify(pod, cfg), Verdict::Clean, "{name}");
    let left = rules_of(pod);
    assert!(!left.contains("ISTIO") && !left.contains("istio-ambient"), "{name}: removal left\n{left}");
    assert_eq!(policy_route(pod), [false; 4], "{name}: rule and route removed");
    assert_eq!(apply(pod, cfg), Action::Applied, "{name}: second run");
    assert_eq!(rules_of(pod), applied, "{name}: the second run programs the same rules");
}

fn every_case(test: &str, backend: AmbientBackend) {
    let mesh = Mesh::new(test).expect("mesh");
    let mut n = 0;
    for ipv6 in [false, true] {
        for (name, cfg) in cases(backend, ipv6) {
            n += 1;
            let pod = mesh.pod(&format!("p{n}")).expect("pod");
            case_round_trip(&pod, &format!("{name} ipv6={ipv6}"), &cfg);
        }
    }
}

#[test]
fn iptables_every_case_applies_reruns_and_removes() {
    require_root!();
    every_case(&test_name!(), AmbientBackend::Iptables);
}

#[test]
fn nft_every_case_applies_reruns_and_removes() {
    require_root!();
    every_case(&test_name!(), AmbientBackend::Nftables);
}

/// Istio's TestIdempotentUnequalInPodRerun: a tampered Istio chain is drift, refused
/// without reconcile (nothing changed), repaired with it; a non-Istio rule is not drift.
#[test]
fn iptables_tampered_rules_are_refused_then_reconciled() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).expect("mesh");
    for (i, (name, cfg)) in cases(AmbientBackend::Iptables, false).into_iter().enumerate() {
        let pod = mesh.pod(&format!("u{i}")).expect("pod");
        let iptables = |args: &[&str]| in_pod(&pod, "iptables", args);
        assert_eq!(apply(&pod, &cfg), Action::Applied);
        iptables(&["-t", "nat", "-N", "ISTIO_TEST"]);
        iptables(&["-t", "nat", "-A", "OUTPUT", "-j", "ISTIO_TEST"]);
        iptables(&["-t", "nat", "-A", "ISTIO_TEST", "-p", "tcp", "--dport", "123", "-j", "ACCEPT"]);
        assert_eq!(verify(&pod, &cfg), Verdict::Drifted, "{name}");
        let tampered = rules_of(&pod);

        let err = apply_inpod(pod.netns().path(), &cfg).unwrap_err();
        assert!(matches!(err, AmbientError::Drift { .. }), "{name}: {err}");
        assert!(err.to_string().contains("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP"), "{err}");
        assert_eq!(rules_of(&pod), tampered, "{name}: a refused run changes nothing");

        let reconcile =
            InpodConfig { ambient: AmbientConfig { reconcile: true, ..cfg.ambient.clone() }, ..cfg.clone() };
        assert_eq!(apply(&pod, &reconcile), Action::Reconciled, "{name}");
        assert_eq!(verify(&pod, &cfg), Verdict::Applied, "{name}");
        assert!(!rules_of(&pod).contains("ISTIO_TEST"), "{name}: the tampering jump and chain are gone");

        // Diverging outside Istio's chains is no drift.
        iptables(&["-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "123", "-j", "ACCEPT"]);
        assert_eq!(verify(&pod, &cfg), Verdict::Applied, "{name}");
        assert_eq!(apply(&pod, &cfg), Action::AlreadyApplied, "{name}");
        remove_inpod(pod.netns().path()).unwrap();
        assert!(
            rules_of(&pod).contains("--dport 123 -j ACCEPT"),
            "{name}: removal keeps rules that are not ours"
        );
    }
}

/// A pod whose configuration changes (annotations edited, agent settings changed):
/// the new rules replace the old with nothing left of them, for both backends, and a
/// change of backend takes the other backend's rules away.
#[test]
fn an_unequal_rerun_replaces_the_rules_without_leftovers() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).expect("mesh");
    for (i, backend) in [AmbientBackend::Iptables, AmbientBackend::Nftables].into_iter().enumerate() {
        let pod = mesh.pod(&format!("c{i}")).expect("pod");
        let all = cases(backend, true);
        let reconcile = |cfg: &InpodConfig| InpodConfig {
            ambient: AmbientConfig { reconcile: true, ..cfg.ambient.clone() },
            ..cfg.clone()
        };
        // default (DNS, inbound) → ingress with virtual interfaces (no DNS, no inbound).
        let (first, second) = (reconcile(&all[0].1), reconcile(&all[3].1));
        assert_eq!(apply(&pod, &first), Action::Applied);
        assert_eq!(apply(&pod, &second), Action::Reconciled);
        assert_eq!(verify(&pod, &second), Verdict::Applied);
        assert_eq!(verify(&pod, &first), Verdict::Drifted);
        let now = rules_of(&pod);
        let dns = now.contains("15053") || now.contains("zone");
        assert!(!dns && !now.contains("15006") && !now.contains("istio-ambient-raw"), "{backend:?}:\n{now}");
        // The same pod's rules fresh, for comparison.
        let fresh = mesh.pod(&format!("f{i}")).expect("pod");
        apply(&fresh, &second);
        assert_eq!(now, rules_of(&fresh), "{backend:?}: replaced rules equal a fresh apply");

        // Switching backends leaves only the new backend's rules.
        let other = if backend == AmbientBackend::Iptables {
            AmbientBackend::Nftables
        } else {
            AmbientBackend::Iptables
        };
        let switched =
            InpodConfig { ambient: AmbientConfig { backend: other, ..second.ambient.clone() }, ..second };
        apply(&pod, &switched);
        assert_eq!(verify(&pod, &switched), Verdict::Applied, "{backend:?} → {other:?}");
        let now = rules_of(&pod);
        match other {
            AmbientBackend::Iptables => assert!(!now.contains("istio-ambient"), "{now}"),
            AmbientBackend::Nftables => assert!(!now.contains("ISTIO_"), "{now}"),
        }
    }
}

/// Traffic through the rules: the app's connection to another pod lands on ztunnel's
/// 15001 with its original destination, another pod's connection to the app on 15006,
/// the app's DNS on 15053 (the reply still from the server's address); HBONE (15008)
/// and a probe from the node's SNAT address reach their listeners directly.
fn traffic(test: &str, backend: AmbientBackend, family: Family) {
    let s = CaptureScene::new(test, family, false);
    let cfg = AmbientConfig {
        backend,
        redirect_dns: true,
        enable_ipv6: family == Family::V6,
        ..Default::default()
    }
    .for_pod(PodOverrides::default());
    let _hbone =
        start_server(&s.client, 1000, &["serve-hello", &s.addr(&s.client, 15008).to_string(), "hbone"]);
    let dns_server = SocketAddr::new(s.server.ipv4().into(), 53);
    let _upstream = start_server(&s.server, 0, &["dns-serve", &dns_server.to_string(), "9.9.9.9"]);
    let _ztunnel_dns = start_server(&s.client, 1337, &["dns-serve", "127.0.0.1:15053", "1.2.3.4"]);
    assert_eq!(apply(&s.client, &cfg), Action::Applied);

    let server = s.addr(&s.server, 8080);
    for uid in [1000, 1337] {
        // Ambient tells ztunnel apart by its packet mark, not its uid: every uid is captured.
        let line = ask(&s.client, uid, server);
        let (_, orig) =
            captured(&line).unwrap_or_else(|| panic!("uid {uid}: outbound not captured: {line:?}"));
        assert_eq!(orig, server.to_string());
    }
    let app = s.addr(&s.client, 8080);
    let line = ask(&s.server, 0, app);
    let (_, orig) = captured(&line).unwrap_or_else(|| panic!("inbound not captured: {line:?}"));
    assert_eq!(orig, app.to_string());
    assert!(
        ask(&s.server, 0, s.addr(&s.client, 15008)).starts_with("hello hbone "),
        "15008 is not redirected"
    );

    let query = ["dns-query", &dns_server.to_string(), "echo.ns.svc.cluster.local"];
    let reply =
        run_testkit(&s.client, Placement { user: Some((1000, 1000)), ..Placement::default() }, &query);
    assert_eq!(reply, format!("answer 1.2.3.4 from {dns_server}"), "ztunnel's DNS answered");

    if family == Family::V4 {
        probe_is_not_captured(&s, app);
    }
    remove_inpod(s.client.netns().path()).unwrap();
    assert!(ask(&s.client, 1000, server).starts_with("hello server "), "after removal, direct again");
}

/// The node SNATs kubelet's probes to 169.254.7.127; from there the app is reached
/// directly (the server pod stands in for the node here).
fn probe_is_not_captured(s: &CaptureScene, app: SocketAddr) {
    s.server
        .run(|| async {
            Netlink::open().unwrap().add_address("eth0", [169, 254, 7, 127].into(), 32).await.unwrap()
        })
        .unwrap();
    s.client
        .run(|| async { Netlink::open().unwrap().add_default_route_dev(NlFamily::V4, "eth0").await.unwrap() })
        .unwrap();
    let root = Placement { user: Some((0, 0)), ..Placement::default() };
    let reply = run_testkit(&s.server, root, &["ask-from", "169.254.7.127", &app.to_string()]);
    assert!(reply.starts_with("hello app "), "a probe from the SNAT address reaches the app: {reply:?}");
}

#[test]
fn iptables_traffic_reaches_ztunnels_ports_ipv4() {
    require_root!();
    traffic(&test_name!(), AmbientBackend::Iptables, Family::V4);
}

#[test]
fn iptables_traffic_reaches_ztunnels_ports_ipv6() {
    require_root!();
    traffic(&test_name!(), AmbientBackend::Iptables, Family::V6);
}

#[test]
fn nft_traffic_reaches_ztunnels_ports_ipv4() {
    require_root!();
    traffic(&test_name!(), AmbientBackend::Nftables, Family::V4);
}

#[test]
fn nft_traffic_reaches_ztunnels_ports_ipv6() {
    require_root!();
    traffic(&test_name!(), AmbientBackend::Nftables, Family::V6);
}

fn nft_ruleset(pod: &Pod) -> String {
    weir_iptables::nft_exec::zero_counters(&in_pod(pod, "nft", &["list", "ruleset"]))
}

/// Istio's TestHostIdempotentEquivalentRerun for nftables, in a namespace standing in
/// for the node: the sets are made, the rule goes in, a re-run changes nothing, a
/// flushed rule comes back, removal keeps the sets and their members.
#[test]
fn nft_host_probe_rule_is_kept_and_removed() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).expect("mesh");
    let node = mesh.pod("node").expect("node namespace");
    let ns: &Path = node.netns().path();
    let cfg = AmbientConfig { backend: AmbientBackend::Nftables, enable_ipv6: true, ..Default::default() };
    assert_eq!(verify_host_probe(Some(ns), &cfg, 1000).unwrap(), Verdict::Clean);
    assert_eq!(apply_host_probe(Some(ns), &cfg, 1000).unwrap().action, Action::Applied);
    assert_eq!(verify_host_probe(Some(ns), &cfg, 1000).unwrap(), Verdict::Applied);
    in_pod(
        &node,
        "nft",
        &["add", "element", "inet", "istio-ambient-nat", ambient::PROBE_SET_V4, "{ 10.66.0.9 }"],
    );
    let first = nft_ruleset(&node);
    assert!(first.contains("meta skuid 1000 ip daddr @istio-inpod-probes-v4"), "{first}");
    assert!(first.contains("snat ip6 to fd16:9254:7127:1337:ffff:ffff:ffff:ffff"), "{first}");
    assert_eq!(apply_host_probe(Some(ns), &cfg, 1000).unwrap().action, Action::AlreadyApplied);
    assert_eq!(nft_ruleset(&node), first, "an equal re-run changes nothing");

    in_pod(&node, "nft", &["flush", "chain", "inet", "istio-ambient-nat", "postrouting"]);
    assert_eq!(verify_host_probe(Some(ns), &cfg, 1000).unwrap(), Verdict::Drifted);
    apply_host_probe(Some(ns), &cfg, 1000).unwrap();
    assert_eq!(nft_ruleset(&node), first, "a flushed rule comes back, the set's members kept");
    assert_eq!(verify_host_probe(Some(ns), &cfg, 4242).unwrap(), Verdict::Drifted, "another kubelet uid");

    remove_host_probe(Some(ns), &cfg).unwrap();
    assert_eq!(verify_host_probe(Some(ns), &cfg, 1000).unwrap(), Verdict::Clean);
    let left = nft_ruleset(&node);
    assert!(!left.contains("snat") && left.contains("10.66.0.9"), "the rule goes, the set stays:\n{left}");
}

/// iptables on the node matches the probe ipsets, which the agent owns: without them
/// the run fails naming the set and the node's rules are as they were.
#[test]
fn iptables_host_probe_without_its_ipset_changes_nothing() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).expect("mesh");
    let node = mesh.pod("node").expect("node namespace");
    let before = rules_of(&node);
    let err = apply_host_probe(Some(node.netns().path()), &AmbientConfig::default(), 0).unwrap_err();
    assert!(format!("{err:?}").contains("istio-inpod-probes-v4"), "{err:?}");
    assert_eq!(rules_of(&node), before);
    assert_eq!(
        verify_host_probe(Some(node.netns().path()), &AmbientConfig::default(), 0).unwrap(),
        Verdict::Clean
    );
}

/// All or nothing: when IPv6's restore fails after IPv4's went in, IPv4's rules are
/// taken out again and the error says the namespace was restored.
#[test]
fn a_failure_part_way_leaves_the_namespace_as_it_was() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).expect("mesh");
    let pod = mesh.pod("pod").expect("pod");
    // IPv6's nat table is owned by another process (nft's `flags owner`): it holds no
    // chain and no rule, so the namespace still looks clean, but IPv6's restore is
    // refused there (EPERM), after IPv4's and IPv6's mangle went in.
    let _owner = own_table(&pod, "ip6 nat");
    let before = rules_of(&pod);
    let cfg = AmbientConfig { enable_ipv6: true, ..Default::default() }.for_pod(PodOverrides::default());
    let err = apply_inpod(pod.netns().path(), &cfg).unwrap_err();
    let text = format!("{err:?}");
    assert!(text.contains("RolledBack"), "{text}");
    // iptables-nft-restore commits table by table: IPv6's mangle went in before its nat
    // failed, and is taken out with IPv4's rules.
    let after = rules_of(&pod);
    assert!(!after.contains("-A "), "no rule of either family is left:\n{after}\n(before:\n{before})");
    assert_eq!(policy_route(&pod), [false; 4], "no route was set");

    // The policy route fails part-way (IPv6's local route needs `lo` up): the rules of
    // both families and IPv4's rule and route, already in, are taken out again.
    for (i, backend) in [AmbientBackend::Iptables, AmbientBackend::Nftables].into_iter().enumerate() {
        let pod = mesh.pod(&format!("lo-down{i}")).expect("pod");
        ip(&pod, &["link", "set", "lo", "down"]);
        let cfg = InpodConfig { ambient: AmbientConfig { backend, ..cfg.ambient.clone() }, ..cfg.clone() };
        let err = apply_inpod(pod.netns().path(), &cfg).unwrap_err();
        let text = format!("{err:?}");
        assert!(text.contains("RolledBack") && text.contains("local default dev lo"), "{text}");
        let after = rules_of(&pod);
        assert!(
            !after.contains("-A ") && !after.contains("istio-ambient"),
            "{backend:?}: rules left:\n{after}"
        );
        assert_eq!(policy_route(&pod), [false; 4], "{backend:?}: IPv4's rule and route were taken out again");
    }
}

/// A table owned by an `nft -i` process: nobody else may change it, and it goes when
/// this is dropped (nft's input closes, then the process is reaped).
struct OwnedTable {
    _input: std::process::ChildStdin,
    _owner: weir_tests::PodChild,
}

/// Makes `table` in `pod`, owned by an `nft -i` process (`flags owner`).
fn own_table(pod: &Pod, table: &str) -> OwnedTable {
    use std::io::Write as _;
    let mut cmd = std::process::Command::new("nft");
    cmd.arg("-i").stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::null());
    let mut owner = pod.spawn(&mut cmd, 0).expect("spawn nft -i");
    let mut input = owner.child_mut().stdin.take().expect("piped stdin");
    writeln!(input, "add table {table} {{ flags owner; }}").expect("write to nft -i");
    let listed = format!("table {table}");
    for _ in 0..250 {
        if in_pod(pod, "nft", &["list", "tables"]).lines().any(|l| l.trim() == listed) {
            return OwnedTable { _input: input, _owner: owner };
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("nft -i did not make the owned table {table}");
}

/// A missing policy route is drift, and an apply puts it back without touching rules.
#[test]
fn a_missing_policy_route_is_drift_and_comes_back() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).expect("mesh");
    for (i, backend) in [AmbientBackend::Iptables, AmbientBackend::Nftables].into_iter().enumerate() {
        let pod = mesh.pod(&format!("r{i}")).expect("pod");
        let cfg = AmbientConfig { backend, ..Default::default() }.for_pod(PodOverrides::default());
        apply(&pod, &cfg);
        let rules = rules_of(&pod);
        ip(&pod, &["-4", "rule", "del", "fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100"]);
        assert_eq!(policy_route(&pod), [false, true, false, false]);
        assert_eq!(verify(&pod, &cfg), Verdict::Drifted, "{backend:?}");
        assert_eq!(apply(&pod, &cfg), Action::AlreadyApplied, "{backend:?}: the rules were in place");
        assert_eq!(policy_route(&pod), [true, true, false, false], "{backend:?}");
        assert_eq!(verify(&pod, &cfg), Verdict::Applied);
        assert_eq!(rules_of(&pod), rules);
    }
}

/// The node's probe sets, over netlink (ipsets) and nft (sets in `istio-ambient-nat`),
/// in a namespace of the test's: created (an existing set kept, members and all), an
/// address added with its pod's uid, taken over by a newer pod (an upsert), removed
/// only by the pod that holds it, pruned to a snapshot; and the iptables probe rule,
/// which names the ipset, applies once the set exists.
#[test]
fn probe_sets_keep_each_address_with_its_pod() {
    use weir_iptables::ambient::probeset::{ProbeEntry, ProbeSets};
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let node = mesh.pod("node").unwrap();
    for backend in [AmbientBackend::Iptables, AmbientBackend::Nftables] {
        let cfg = AmbientConfig { backend, enable_ipv6: true, ..Default::default() };
        node.run(|| async {
            let sets = ProbeSets::new(&cfg);
            sets.ensure().unwrap();
            let (a, b, v6): (std::net::IpAddr, std::net::IpAddr, std::net::IpAddr) =
                ("10.1.0.5".parse().unwrap(), "10.1.0.6".parse().unwrap(), "fd00::5".parse().unwrap());
            sets.upsert(a, "uid-a").unwrap();
            sets.upsert(b, "uid-b").unwrap();
            sets.upsert(v6, "uid-a").unwrap();
            sets.ensure().unwrap();
            let entry = |ip, uid: &str| ProbeEntry { ip, uid: Some(uid.into()) };
            assert_eq!(
                sets.entries().unwrap(),
                [entry(a, "uid-a"), entry(b, "uid-b"), entry(v6, "uid-a")],
                "{backend:?}"
            );
            // A reused address: the newer pod takes it; the older pod's removal leaves it.
            sets.upsert(b, "uid-c").unwrap();
            assert_eq!(sets.remove(b, "uid-b").unwrap(), Some("uid-c".into()));
            assert!(sets.entries().unwrap().contains(&entry(b, "uid-c")));
            assert_eq!(sets.remove(b, "uid-c").unwrap(), None);
            let pruned = sets.prune(&[a].into()).unwrap();
            assert_eq!(pruned, [v6]);
            assert_eq!(sets.entries().unwrap(), [entry(a, "uid-a")]);
            let rule = apply_host_probe(None, &cfg, 0).unwrap();
            assert_eq!(verify_host_probe(None, &cfg, 0).unwrap(), Verdict::Applied, "{rule:?}");
            remove_host_probe(None, &cfg).unwrap();
        })
        .unwrap();
    }
}

/// istio/istio#61020 (1.30.5): Istio's backend detection probed `iptables-legacy` with
/// a write (`-A`/`-D` of its test rule), which leaves an empty legacy `nat` table, and
/// then read any legacy table as "rules exist": the first start chose nft, every
/// restart after it legacy, and wrote a second ruleset into enrolled pods. Weir's
/// detection reads legacy tables as in use only when they hold a rule or a user chain
/// (`binaries::has_rules`, `nf_probe::legacy_entries_beyond_policies`), so it is not
/// self-priming: across starts in the same namespaces (the node's and a pod's), with
/// the legacy `nat` table left behind by the first probe, it stays on nft, re-runs
/// change nothing, and legacy holds no rule.
#[test]
fn the_iptables_backend_is_the_same_on_every_start() {
    use weir_iptables::ambient::probeset::ProbeSets;
    require_root!();
    let mesh = Mesh::new(&test_name!()).expect("mesh");
    let node = mesh.pod("node").expect("node namespace");
    let pod = mesh.pod("pod").expect("pod namespace");
    let cfg = AmbientConfig { backend: AmbientBackend::Iptables, enable_ipv6: true, ..Default::default() };
    node.run(|| async { ProbeSets::new(&cfg).ensure().unwrap() }).unwrap();
    let inpod = InpodConfig { ambient: cfg.clone(), ..Default::default() };
    let legacy_rules = |p: &Pod| -> Vec<String> {
        ["iptables-legacy-save", "ip6tables-legacy-save"]
            .iter()
            .flat_map(|save| {
                in_pod(p, save, &[])
                    .lines()
                    .filter(|l| l.starts_with("-A"))
                    .map(String::from)
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let legacy_tables = |p: &Pod| in_pod(p, "cat", &["/proc/net/ip_tables_names"]);
    let mut seen = Vec::new();
    for start in 1..=3 {
        let host = apply_host_probe(Some(node.netns().path()), &cfg, 0).unwrap();
        let inpod_report = apply_inpod(pod.netns().path(), &inpod).unwrap();
        let expected = if start == 1 { Action::Applied } else { Action::AlreadyApplied };
        assert_eq!((host.action, inpod_report.action), (expected, expected), "start {start}");
        assert_eq!(legacy_rules(&node), Vec::<String>::new(), "start {start}: the node's legacy tables");
        assert_eq!(legacy_rules(&pod), Vec::<String>::new(), "start {start}: the pod's legacy tables");
        assert!(
            in_pod(&node, "iptables-nft-save", &["-t", "nat"]).contains("-A POSTROUTING -j ISTIO_POSTRT")
        );
        assert!(in_pod(&pod, "iptables-nft-save", &["-t", "nat"]).contains("-A PREROUTING -j ISTIO_PRERT"));
        seen.push((rules_of(&node), rules_of(&pod)));
    }
    assert!(
        legacy_tables(&node).contains("nat"),
        "the first probe left legacy's nat table (the trap of #61020)"
    );
    assert!(seen.windows(2).all(|w| w[0] == w[1]), "every start leaves the same rules: {seen:#?}");
    remove_inpod(pod.netns().path()).unwrap();
    remove_host_probe(Some(node.netns().path()), &cfg).unwrap();
}
