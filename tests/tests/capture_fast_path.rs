//! The iptables fast path (one restore into a namespace the in-process probe finds
//! empty) must be taken where it can be, and say so (`Report::path`, the `path` log
//! field); it must leave exactly what the full path (save, verify, restore) leaves,
//! and must hand every namespace it cannot settle to the full path: rules and empty
//! chains of others kept (also through a rollback), legacy rules keep the run on
//! legacy, another plan's rules still removed whole.

use weir_iptables::{
    Action, ApplyPath, CaptureConfig, CaptureError, RunOptions,
    config::{InboundPorts, InterceptionMode, IpRanges, parse_ports},
    nft_exec::zero_counters,
    state::Verdict,
};
use weir_tests::{
    capture::{CaptureScene, Family, ask, capture_state, captured, in_pod},
    require_root, test_name,
};

const OTHERS_RULE: [&str; 9] = ["-t", "filter", "-A", "INPUT", "-p", "tcp", "--dport", "9", "-j"];

fn config(mode: InterceptionMode) -> CaptureConfig {
    CaptureConfig {
        interception_mode: mode,
        outbound_ip_ranges_include: IpRanges::All,
        inbound_ports: InboundPorts::All,
        inbound_ports_exclude: parse_ports("-d", "15090,15021,15020").unwrap(),
        ..CaptureConfig::default()
    }
}

fn opts(scene: &CaptureScene) -> RunOptions {
    RunOptions { network_namespace: Some(scene.client.netns().path().to_path_buf()), ..RunOptions::default() }
}

fn reconcile(scene: &CaptureScene) -> RunOptions {
    RunOptions { reconcile: true, ..opts(scene) }
}

fn cleanup(scene: &CaptureScene) -> RunOptions {
    RunOptions { cleanup_only: true, ..opts(scene) }
}

fn is_captured(scene: &CaptureScene) -> bool {
    captured(&ask(&scene.client, 1000, scene.addr(&scene.server, 8080))).is_some()
}

/// Someone else's rule, added with `binary` (iptables-nft or iptables-legacy).
fn add_others_rule(scene: &CaptureScene, binary: &str) {
    let mut args = OTHERS_RULE.to_vec();
    args.push("ACCEPT");
    in_pod(&scene.client, binary, &args);
}

fn has_others_rule(scene: &CaptureScene, save: &str) -> bool {
    in_pod(&scene.client, save, &["-t", "filter"]).contains("-A INPUT -p tcp -m tcp --dport 9 -j ACCEPT")
}

#[test]
fn an_empty_namespace_and_a_busy_one_end_with_the_same_rules() {
    require_root!();
    for (i, mode) in [InterceptionMode::Redirect, InterceptionMode::Tproxy].into_iter().enumerate() {
        let cfg = config(mode);
        let empty = CaptureScene::new(&format!("{}-e{i}", test_name!()), Family::V4, true);
        let busy = CaptureScene::new(&format!("{}-b{i}", test_name!()), Family::V4, true);
        add_others_rule(&busy, "iptables-nft");

        // Another rule is a residue to Istio's verify: without --reconcile the run
        // refuses, as Istio's does; with it, Istio's rules go in beside the other.
        let refused = weir_iptables::program(&cfg, &opts(&busy)).unwrap_err();
        assert!(matches!(refused, CaptureError::Drift { .. }), "{refused}");
        assert_eq!(capture_state(&busy.client), "", "a refused run changes nothing");
        let report = weir_iptables::program(&cfg, &opts(&empty)).unwrap();
        assert_eq!(report.action, Action::Applied, "{mode:?}");
        assert_eq!(report.path, ApplyPath::Fast, "{mode:?}: an empty namespace takes the fast path");
        let report = weir_iptables::program(&cfg, &reconcile(&busy)).unwrap();
        assert_eq!(report.action, Action::Reconciled, "{mode:?}");
        assert_eq!(report.path, ApplyPath::Full, "{mode:?}: another's rule sends the run the full way");
        for scene in [&empty, &busy] {
            assert_eq!(weir_iptables::apply::verify(&cfg, &opts(scene)).unwrap(), Verdict::Applied);
            assert!(is_captured(scene), "{mode:?}: traffic captured");
        }
        let state = |s: &CaptureScene| zero_counters(&capture_state(&s.client));
        assert_eq!(state(&empty), state(&busy), "{mode:?}: the fast path's rules are the full path's");
        assert!(!state(&empty).is_empty());
        assert!(has_others_rule(&busy, "iptables-nft-save"), "the other rule is kept");

        // A second run sees its own rules and changes nothing.
        let again = weir_iptables::program(&cfg, &opts(&empty)).unwrap();
        assert_eq!(again.action, Action::AlreadyApplied);

        for scene in [&empty, &busy] {
            let report = weir_iptables::program(&cfg, &cleanup(scene)).unwrap();
            assert_eq!(report.action, Action::Cleaned);
            // The plan's removal names Istio's rules and chains only: the other rule
            // does not stop it.
            assert_eq!(report.path, ApplyPath::Fast, "{mode:?}: removal");
            assert_eq!(capture_state(&scene.client), "", "{mode:?}: nothing of Istio's remains");
            assert!(!in_pod(&scene.client, "ip", &["rule", "show"]).contains("lookup 133"));
        }
        assert_eq!(weir_iptables::apply::verify(&cfg, &opts(&empty)).unwrap(), Verdict::Clean);
        // Istio's verify reads the other rule as a residue, never as Istio's rules.
        assert_eq!(weir_iptables::apply::verify(&cfg, &opts(&busy)).unwrap(), Verdict::Drifted);
        assert!(has_others_rule(&busy, "iptables-nft-save"), "removal keeps the other rule");
    }
}

#[test]
fn legacy_rules_keep_the_run_on_iptables_legacy() {
    require_root!();
    let scene = CaptureScene::new(&test_name!(), Family::V4, false);
    add_others_rule(&scene, "iptables-legacy");
    let cfg = config(InterceptionMode::Redirect);

    assert_eq!(weir_iptables::program(&cfg, &reconcile(&scene)).unwrap().action, Action::Reconciled);
    let legacy = in_pod(&scene.client, "iptables-legacy-save", &["-t", "nat"]);
    assert!(legacy.contains("-A OUTPUT -j ISTIO_OUTPUT"), "Istio's rules went to legacy:\n{legacy}");
    let nft = in_pod(&scene.client, "iptables-nft-save", &[]);
    assert!(!nft.contains("ISTIO"), "nothing went to nf_tables:\n{nft}");
    assert!(is_captured(&scene));
    assert_eq!(weir_iptables::apply::verify(&cfg, &opts(&scene)).unwrap(), Verdict::Applied);

    assert_eq!(weir_iptables::program(&cfg, &cleanup(&scene)).unwrap().action, Action::Cleaned);
    assert!(!in_pod(&scene.client, "iptables-legacy-save", &[]).contains("ISTIO"));
    assert!(has_others_rule(&scene, "iptables-legacy-save"), "removal keeps the other rule");
}

#[test]
fn removal_with_another_plan_still_removes_every_istio_rule() {
    require_root!();
    let scene = CaptureScene::new(&test_name!(), Family::V4, true);
    let applied = config(InterceptionMode::Redirect);
    assert_eq!(weir_iptables::program(&applied, &opts(&scene)).unwrap().action, Action::Applied);
    assert!(is_captured(&scene));

    // Istio's cleanup does not depend on the flags it is given: a removal whose plan
    // differs from what is installed (TPROXY, other exclusions) removes all of it.
    let other = CaptureConfig {
        inbound_ports_exclude: parse_ports("-d", "15090").unwrap(),
        ..config(InterceptionMode::Tproxy)
    };
    assert_eq!(weir_iptables::program(&other, &cleanup(&scene)).unwrap().action, Action::Cleaned);
    assert_eq!(capture_state(&scene.client), "", "no Istio chain or rule remains");
    assert!(ask(&scene.client, 1000, scene.addr(&scene.server, 8080)).starts_with("hello server "));
    assert_eq!(weir_iptables::apply::verify(&applied, &opts(&scene)).unwrap(), Verdict::Clean);
}

/// Someone else's empty chain (kube-proxy makes them; so does an operator's
/// `iptables -N`) is not a clean namespace: the fast path declines it, and no rollback
/// or removal of Istio's rules takes it with them. Rolled back here by a route that
/// cannot be made: IPv6 is off on the pod's `lo`, where the plan puts `::6`.
#[test]
fn another_s_empty_chain_survives_apply_rollback_and_removal() {
    require_root!();
    let scene = CaptureScene::new(&test_name!(), Family::V4, false);
    in_pod(&scene.client, "iptables-nft", &["-t", "nat", "-N", "FOREIGN"]);
    in_pod(&scene.client, "ip6tables-nft", &["-t", "nat", "-N", "FOREIGN6"]);
    let foreign = |s: &CaptureScene| {
        let v4 = in_pod(&s.client, "iptables-nft-save", &["-t", "nat"]).contains(":FOREIGN - [0:0]");
        let v6 = in_pod(&s.client, "ip6tables-nft-save", &["-t", "nat"]).contains(":FOREIGN6 - [0:0]");
        (v4, v6)
    };
    in_pod(&scene.client, "sysctl", &["-q", "-w", "net.ipv6.conf.lo.disable_ipv6=1"]);
    let cfg = CaptureConfig { enable_ipv6: true, ..config(InterceptionMode::Redirect) };
    let failed = weir_iptables::program(&cfg, &opts(&scene)).unwrap_err();
    assert!(matches!(failed, CaptureError::RolledBack { .. }), "{failed}");
    assert_eq!(capture_state(&scene.client), "", "rolled back: nothing of Istio's remains");
    assert_eq!(foreign(&scene), (true, true), "the rollback kept the other's empty chains");

    in_pod(&scene.client, "sysctl", &["-q", "-w", "net.ipv6.conf.lo.disable_ipv6=0"]);
    let report = weir_iptables::program(&cfg, &opts(&scene)).unwrap();
    assert_eq!((report.action, report.path), (Action::Applied, ApplyPath::Full), "declined by the probe");
    assert!(is_captured(&scene));
    assert_eq!(foreign(&scene), (true, true));
    let report = weir_iptables::program(&cfg, &cleanup(&scene)).unwrap();
    assert_eq!(report.action, Action::Cleaned);
    assert_eq!(capture_state(&scene.client), "");
    assert_eq!(foreign(&scene), (true, true), "removal kept them too");
}

/// `weir istio-iptables` says which path it took, in its log line's `path` field.
#[test]
fn the_command_logs_the_path_it_took() {
    require_root!();
    let scene = CaptureScene::new(&test_name!(), Family::V4, false);
    let run = |extra: &[&str]| {
        let mut cmd = weir_tests::tools::weir_command();
        cmd.args(["istio-iptables", "-u", "1337", "-i", "*", "-b", "*"]).args(extra).env("WEIR_LOG", "info");
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        let out = scene.client.spawn(&mut cmd, 0).unwrap().into_inner().wait_with_output().unwrap();
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{log}");
        log
    };
    let line = |log: &str, what: &str| log.lines().find(|l| l.contains(what)).unwrap_or_default().to_string();
    let log = run(&[]);
    let applied = line(&log, "capture rules applied");
    assert!(applied.contains("path=fast"), "{applied}");
    // REDIRECT's nat rules are written in process, no iptables-restore run.
    assert!(log.contains("Final iptables state (IPv4), written in process"), "{log}");
    let again = line(&run(&[]), "capture rules already in place");
    assert!(again.contains("path=full"), "a namespace with rules is read the full way: {again}");
    let removed = line(&run(&["--cleanup-only"]), "capture rules removed");
    assert!(removed.contains("path=fast"), "{removed}");
    // TPROXY's mangle rules are not known in process: one restore.
    let log = run(&["-m", "TPROXY"]);
    assert!(log.contains("Final iptables state (IPv4), restored into an empty namespace"), "{log}");
    let removed = line(&run(&["-m", "TPROXY", "--cleanup-only"]), "capture rules removed");
    assert!(removed.contains("path=fast"), "{removed}");
}

/// `nft --debug=netlink list ruleset`: every table, chain, set and rule as the kernel
/// holds it, expression by expression, with handles.
fn nft_state() -> String {
    let out =
        std::process::Command::new("nft").args(["--debug=netlink", "list", "ruleset"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// What `read` sees in a scratch namespace after `f` ran there.
fn state_after(read: fn() -> String, f: impl FnOnce() -> Result<(), String> + Send) -> String {
    weir_iptables::nft_exec::in_scratch_netns(|| {
        f().map_err(|e| weir_iptables::nft_exec::NftError::Failed { what: "apply".into(), stderr: e })?;
        Ok(read())
    })
    .unwrap()
}

fn kernel_state_after(f: impl FnOnce() -> Result<(), String> + Send) -> String {
    state_after(nft_state, f)
}

fn send(batch: &weir_iptables::nft_wire::Batch) -> Result<(), String> {
    weir_iptables::nft_batch::send(batch).map_err(|e| e.to_string())
}

/// Istio's goldens under `dir` of testdata, by name and text, sorted; all `count`.
fn goldens(dir: &str, count: usize) -> Vec<(String, String)> {
    let dir = weir_tests::tools::workspace().join("iptables-compat/testdata").join(dir);
    let mut paths: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    paths.sort();
    assert_eq!(paths.len(), count, "every golden under {} is read", dir.display());
    paths
        .iter()
        .map(|p| (p.file_stem().unwrap().to_string_lossy().into_owned(), std::fs::read_to_string(p).unwrap()))
        .collect()
}

fn nft_f(tx: &str) -> Result<(), String> {
    use weir_iptables::nft_exec::{Nft as _, SystemNft};
    SystemNft.apply(tx).map_err(|e| e.to_string())
}

/// Every nftables golden of Istio's (the transactions Weir's plans render, checked
/// against them elsewhere) is compiled into one in-process batch, bar those naming a
/// user or group (nft resolves names; they stay with `nft -f`), and the batch leaves
/// exactly what `nft -f` of the same text leaves: the same rules, expressions, sets,
/// and handles, read back from the kernel.
#[test]
fn nf_tables_batches_leave_what_nft_leaves_for_every_golden() {
    require_root!();
    let (mut compiled, mut declined) = (0, Vec::new());
    for (name, tx) in goldens("nftables-capture", 28) {
        let batch = match weir_iptables::nft_wire::compile(&tx) {
            Ok(b) => b,
            Err(why) => {
                declined.push(format!("{name}: {why}"));
                continue;
            }
        };
        compiled += 1;
        let by_nft = kernel_state_after(|| nft_f(&tx));
        let by_batch = kernel_state_after(|| send(&batch));
        assert!(by_nft.contains("[ immediate reg 0"), "{name}: the listing shows expressions:\n{by_nft}");
        assert_eq!(by_batch, by_nft, "{name}: the batch leaves what nft -f leaves");
    }
    assert_eq!(
        declined,
        [
            "ipv6-dns-outbound-owner-groups-exclude: not compiled in process (skgid ftp)",
            "ipv6-dns-outbound-owner-groups: not compiled in process (skgid java)",
            "outbound-owner-groups-exclude: not compiled in process (skgid ftp)",
            "outbound-owner-groups: not compiled in process (skgid java)",
        ],
        "only the goldens naming groups are left to nft"
    );
    assert_eq!(compiled, 24);
}

/// A table that appeared between the look and the batch (another writer) makes the
/// kernel refuse the whole batch, named, and nothing of it is applied; the run then
/// goes the `nft -f` way, which flushes that table as Istio's does.
#[test]
fn an_nf_tables_batch_is_refused_whole_when_a_table_is_already_there() {
    require_root!();
    use weir_iptables::nft_exec::{Nft as _, SystemNft};
    let tx = weir_iptables::nft::render(&weir_iptables::nft::plan(&config(InterceptionMode::Redirect)));
    let batch = weir_iptables::nft_wire::compile(&tx).unwrap();
    let theirs = "add table inet istio-proxy-nat\nadd chain inet istio-proxy-nat theirs\n\
                  add rule inet istio-proxy-nat theirs counter accept\n";
    let by_nft = kernel_state_after(|| nft_f(&tx));
    let mut refusal = String::new();
    let after_refusal = kernel_state_after(|| {
        nft_f(theirs)?;
        let err = weir_iptables::nft_batch::send(&batch).unwrap_err();
        assert_eq!(err.errno(), Some(libc::EEXIST), "{err}");
        refusal = err.to_string();
        Ok(())
    });
    assert!(refusal.contains("`add table inet istio-proxy-nat`"), "the refused message is named: {refusal}");
    let theirs_only = kernel_state_after(|| nft_f(theirs));
    assert_eq!(after_refusal, theirs_only, "nothing of the refused batch was applied");
    let fallback = kernel_state_after(|| {
        nft_f(theirs)?;
        let path = SystemNft.apply_new(&tx).map_err(|e| e.to_string())?;
        assert_eq!(path, ApplyPath::Full, "refused in process, applied by nft -f");
        Ok(())
    });
    // nft's `flush table` empties the other writer's chain (Istio's plan here accepts
    // nothing, so an accept left would be theirs).
    assert!(!fallback.contains("[ immediate reg 0 accept ]"), "{fallback}");
    assert_eq!(
        fallback.matches("[ immediate reg 0").count(),
        by_nft.matches("[ immediate reg 0").count(),
        "the fallback leaves Istio's rules and none of the other writer's:\n{fallback}"
    );
}

/// With `--native-nftables` a fresh pod's namespace is programmed by one in-process
/// batch (`path` fast), traffic is captured, a second run sees its rules, and removal
/// leaves nothing.
#[test]
fn native_nftables_goes_in_by_one_batch_and_captures() {
    require_root!();
    for (i, mode) in [InterceptionMode::Redirect, InterceptionMode::Tproxy].into_iter().enumerate() {
        let cfg = config(mode);
        let scene = CaptureScene::new(&format!("{}-{i}", test_name!()), Family::V4, true);
        let nft = RunOptions { native_nftables: true, ..opts(&scene) };
        let report = weir_iptables::program(&cfg, &nft).unwrap();
        assert_eq!((report.action, report.path), (Action::Applied, ApplyPath::Fast), "{mode:?}");
        assert!(is_captured(&scene), "{mode:?}: traffic captured");
        assert_eq!(weir_iptables::apply::verify(&cfg, &nft).unwrap(), Verdict::Applied, "{mode:?}");
        let again = weir_iptables::program(&cfg, &nft).unwrap();
        assert_eq!((again.action, again.path), (Action::AlreadyApplied, ApplyPath::Full), "{mode:?}");
        let removed =
            weir_iptables::program(&cfg, &RunOptions { cleanup_only: true, ..nft.clone() }).unwrap();
        assert_eq!(removed.action, Action::Cleaned);
        assert_eq!(in_pod(&scene.client, "nft", &["list", "tables"]).trim(), "", "{mode:?}: nothing remains");
        assert!(!is_captured(&scene), "{mode:?}: not captured after removal");
    }
}

/// A namespace's IPv4 iptables-nft state, read both ways: `iptables-nft-save` (what
/// Istio's verify and Weir's removal read) and the kernel's expressions
/// (`nft --debug=netlink list ruleset`, rule handles left out: iptables-nft numbers
/// its messages differently, and no reader uses them).
fn iptables_state() -> String {
    let run = |program: &str, args: &[&str]| {
        let out = std::process::Command::new(program).args(args).output().unwrap();
        assert!(out.status.success(), "{program}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let save: String = run("iptables-nft-save", &[])
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    let kernel: String = run("nft", &["--debug=netlink", "list", "ruleset"])
        .lines()
        .map(|l| match l.starts_with("ip ") {
            true => l.split_whitespace().filter(|w| w.parse::<u64>().is_err()).collect::<Vec<_>>().join(" "),
            false => l.to_string(),
        })
        .map(|l| format!("{l}\n"))
        .collect();
    format!("{save}{kernel}")
}

fn iptables_nft_restore(text: &str) -> Result<(), String> {
    use std::io::Write as _;
    let mut child = std::process::Command::new("iptables-nft-restore")
        .arg("--noflush")
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    child.stdin.take().unwrap().write_all(text.as_bytes()).map_err(|e| e.to_string())?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    out.status.success().then_some(()).ok_or_else(|| String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The IPv4 restore text of every iptables golden of Istio's that the in-process
/// writer knows (the nat table of REDIRECT mode) leaves, written as one batch, what
/// `iptables-nft-restore --noflush` of the same text leaves: the same
/// `iptables-nft-save` and the same kernel expressions. The others are named.
#[test]
fn iptables_nft_batches_leave_what_iptables_nft_restore_leaves_for_every_golden() {
    require_root!();
    let (mut compiled, mut declined) = (Vec::new(), Vec::new());
    for (name, text) in goldens("iptables-capture", 27) {
        // Its restore blocks; the IPv4 ones hold no IPv6 address.
        let mut v4 = String::new();
        let mut block = String::new();
        for line in text.lines() {
            if line.starts_with("* ") || !block.is_empty() {
                block.push_str(line);
                block.push('\n');
            }
            if line == "COMMIT" {
                if !block.contains("::") {
                    v4.push_str(&block);
                }
                block.clear();
            }
        }
        assert!(v4.contains("COMMIT"), "{name}: an IPv4 restore is read");
        let batch = match weir_iptables::xt_wire::compile(&v4, &[]) {
            Ok(b) => b,
            Err(why) => {
                declined.push(format!("{name}: {}", why.0));
                continue;
            }
        };
        let by_restore = kernel_state_after_xt(|| iptables_nft_restore(&v4));
        let by_batch = kernel_state_after_xt(|| send(&batch));
        assert!(by_restore.contains("-A ISTIO_OUTPUT"), "{name}: the state is read:\n{by_restore}");
        assert_eq!(by_batch, by_restore, "{name}: the batch leaves what iptables-nft-restore leaves");
        compiled.push(name);
    }
    // Left to iptables-restore: the other tables (TPROXY's mangle, DNS's raw conntrack
    // zones) and group names (the kernel tool resolves them).
    assert_eq!(
        declined,
        [
            "dns-uid-gid: `* raw`",
            "drop-invalid: `* mangle`",
            "inbound-ports-tproxy: `* mangle`",
            "inbound-ports-wildcard-tproxy: `* mangle`",
            "ip-range: `* raw`",
            "ipv6-dns-outbound-owner-groups-exclude: owner ftp in `-A ISTIO_OUTPUT -m owner --gid-owner ftp -j RETURN`",
            "ipv6-dns-outbound-owner-groups: owner java in \
             `-A ISTIO_OUTPUT -m owner ! --gid-owner java -m owner ! --gid-owner 202 -j RETURN`",
            "loopback-outbound-iprange: `* raw`",
            "outbound-owner-groups-exclude: owner ftp in `-A ISTIO_OUTPUT -m owner --gid-owner ftp -j RETURN`",
            "outbound-owner-groups: owner java in \
             `-A ISTIO_OUTPUT -m owner ! --gid-owner java -m owner ! --gid-owner 202 -j RETURN`",
            "tproxy: `* mangle`",
        ]
    );
    assert!(compiled.contains(&"empty".to_string()), "the injector's default is written in process");
    assert_eq!(compiled.len(), 16);

    // A builtin chain already there (the probe allows one with no rule) keeps its own
    // policy, as it does under iptables-nft-restore.
    let v4 =
        weir_iptables::render::restore(&weir_iptables::plan::plan(&config(InterceptionMode::Redirect)).v4);
    // Told it is there (as the probe tells it), or not: the chain is kept either way.
    for existing in [&["OUTPUT"][..], &[]] {
        let batch = weir_iptables::xt_wire::compile(&v4, existing).unwrap();
        let theirs = "add table ip nat\nadd chain ip nat OUTPUT { type nat hook output priority -100 ; policy drop ; }\n";
        let by_restore = kernel_state_after_xt(|| nft_f(theirs).and_then(|()| iptables_nft_restore(&v4)));
        let by_batch = kernel_state_after_xt(|| {
            nft_f(theirs)?;
            send(&batch)
        });
        assert!(by_restore.contains(":OUTPUT DROP"), "{by_restore}");
        assert_eq!(by_batch, by_restore, "{existing:?}");
    }
}

fn kernel_state_after_xt(f: impl FnOnce() -> Result<(), String> + Send) -> String {
    state_after(iptables_state, f)
}

/// Beyond the goldens: prefixes off byte boundaries (masked loads), IPv6 ones, and a
/// plan of over 300 rules (more answers than a socket holds, were each message
/// acknowledged). Each is compiled in process, for nftables and for iptables-nft, and
/// leaves what the kernel tool leaves.
#[test]
fn in_process_batches_match_the_kernel_tools_beyond_the_goldens() {
    require_root!();
    use weir_iptables::config::parse_exclude_ranges;
    let many: Vec<String> =
        (0..300).map(|i| format!("10.{}.{}.0/23", 100 + i / 128, (i % 128) * 2)).collect();
    let cases = [
        (
            "masked prefixes",
            "10.96.0.0/12,172.16.0.0/13,192.168.3.128/25,fd00::/9,2001:db8:8000::/33".to_string(),
        ),
        ("300 exclusions", many.join(",")),
    ];
    for (what, exclude) in cases {
        let cfg = CaptureConfig {
            outbound_ip_ranges_exclude: parse_exclude_ranges("-x", &exclude).unwrap(),
            enable_ipv6: true,
            ..config(InterceptionMode::Redirect)
        };
        let tx = weir_iptables::nft::render(&weir_iptables::nft::plan(&cfg));
        let batch = weir_iptables::nft_wire::compile(&tx).unwrap_or_else(|e| panic!("{what}: {e}"));
        let by_nft = kernel_state_after(|| nft_f(&tx));
        let by_batch = kernel_state_after(|| send(&batch));
        assert!(by_nft.contains("bitwise") || what != "masked prefixes", "{what}: masked loads are compared");
        assert_eq!(by_batch, by_nft, "{what}: nftables");

        let v4 = weir_iptables::render::restore(&weir_iptables::plan::plan(&cfg).v4);
        let batch = weir_iptables::xt_wire::compile(&v4, &[]).unwrap_or_else(|e| panic!("{what}: {e}"));
        if what == "300 exclusions" {
            assert!(batch.messages.len() > 300, "{}", batch.messages.len());
        }
        let by_restore = kernel_state_after_xt(|| iptables_nft_restore(&v4));
        let by_batch = kernel_state_after_xt(|| send(&batch));
        assert_eq!(by_batch, by_restore, "{what}: iptables-nft");
    }
}
