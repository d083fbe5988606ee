//! Conformance for ambient mode: each case of Istio's node-agent test tables
//! (`GetCommonInPodTestCases`, `GetCommonHostTestCases`), for IPv4 and IPv6, run
//! through the same code the node agent applies with (a recorder in place of the
//! system's iptables and nft), must equal Istio's golden as Istio compares it: both
//! sides trimmed, then equal. 14 iptables + 14 nftables files (testdata/ambient/README.md).

use std::{net::Ipv6Addr, path::PathBuf};

use weir_iptables::{
    ambient::{
        self, AmbientConfig, InpodConfig, PodDns, PodOverrides, program_host_iptables, program_host_nft,
        program_inpod_iptables, program_inpod_nft,
    },
    apply::Action,
    nft_exec::NftRecorder,
    xtables::Recorder,
};

type InpodCase = (&'static str, fn(&mut AmbientConfig), fn() -> PodOverrides);

fn virtual_interfaces() -> Vec<String> {
    vec!["fake1s0f0".into(), "fake1s0f1".into()]
}

/// Istio's GetCommonInPodTestCases: case name, config change, pod overrides.
const INPOD: &[InpodCase] = &[
    ("default", |c| c.redirect_dns = true, PodOverrides::default),
    ("ingress", |_| {}, || PodOverrides { ingress_mode: true, ..Default::default() }),
    (
        "virtual_interfaces",
        |_| {},
        || PodOverrides { virtual_interfaces: virtual_interfaces(), ..Default::default() },
    ),
    (
        "ingress_and_virtual_interfaces",
        |_| {},
        || PodOverrides {
            ingress_mode: true,
            virtual_interfaces: virtual_interfaces(),
            ..Default::default()
        },
    ),
    (
        "dns_pod_enabled_and_off_globally",
        |c| c.redirect_dns = false,
        || PodOverrides { dns: PodDns::Enabled, ..Default::default() },
    ),
    (
        "dns_pod_disabled_and_on_globally",
        |c| c.redirect_dns = true,
        || PodOverrides { dns: PodDns::Disabled, ..Default::default() },
    ),
];

/// Istio's constructTestConfig: the probe addresses its goldens carry.
fn test_config(ipv6: bool) -> AmbientConfig {
    AmbientConfig {
        host_probe_snat_v4: "169.254.7.127".parse().unwrap(),
        host_probe_snat_v6: "e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164".parse().unwrap(),
        enable_ipv6: ipv6,
        ..Default::default()
    }
}

fn inpod_config(case: &InpodCase, ipv6: bool) -> InpodConfig {
    let mut cfg = test_config(ipv6);
    (case.1)(&mut cfg);
    cfg.for_pod((case.2)())
}

fn golden(backend: &str, name: &str, ipv6: bool) -> String {
    let file = if ipv6 { format!("{name}_ipv6.golden") } else { format!("{name}.golden") };
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/ambient").join(backend).join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Istio's comparison: trimmed, then equal. The message shows the first differing line.
fn compare(what: &str, want: &str, got: &str) -> Option<String> {
    let (want, got) = (want.trim(), got.trim());
    if want == got {
        return None;
    }
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    let at = w.iter().zip(&g).position(|(a, b)| a != b).unwrap_or(w.len().min(g.len()));
    Some(format!(
        "{what}: line {}: want {:?}, got {:?} ({} vs {} lines)",
        at + 1,
        w.get(at),
        g.get(at),
        w.len(),
        g.len()
    ))
}

fn iptables_inpod(cfg: &InpodConfig) -> String {
    let mut rec = Recorder::default();
    let report = program_inpod_iptables(cfg, &mut rec).unwrap();
    assert_eq!(report.action, Action::Applied);
    rec.lines.join("\n")
}

fn nft_inpod(cfg: &InpodConfig) -> String {
    let mut rec = NftRecorder::default();
    program_inpod_nft(cfg, &mut rec).unwrap();
    rec.transactions.join("\n")
}

fn run_all(backend: &str, run: fn(&InpodConfig) -> String) -> Vec<String> {
    let mut failures = Vec::new();
    for case in INPOD {
        for ipv6 in [false, true] {
            let got = run(&inpod_config(case, ipv6));
            let what = format!("{backend} {}{}", case.0, if ipv6 { "_ipv6" } else { "" });
            failures.extend(compare(&what, &golden(backend, case.0, ipv6), &got));
        }
    }
    failures
}

#[test]
fn iptables_inpod_rules_match_istios_12_goldens() {
    let failures = run_all("iptables", iptables_inpod);
    assert!(failures.is_empty(), "{} of 12 differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn nftables_inpod_rules_match_istios_12_goldens() {
    let failures = run_all("nftables", nft_inpod);
    assert!(failures.is_empty(), "{} of 12 differ:\n{}", failures.len(), failures.join("\n"));
}

/// Istio's GetCommonHostTestCases ("hostprobe": RedirectDNS), with TestIptablesHostRules'
/// own v6 probe address.
#[test]
fn iptables_host_probe_matches_istios_2_goldens() {
    let mut failures = Vec::new();
    for ipv6 in [false, true] {
        let mut cfg = AmbientConfig { redirect_dns: true, ..test_config(ipv6) };
        cfg.host_probe_snat_v6 = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff".parse::<Ipv6Addr>().unwrap();
        let mut rec = Recorder::default();
        program_host_iptables(&cfg, &mut rec).unwrap();
        failures.extend(compare(
            &format!("hostprobe ipv6={ipv6}"),
            &golden("iptables", "hostprobe", ipv6),
            &rec.lines.join("\n"),
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// TestNftablesHostRules: the kubelet uid provider answers 1000.
#[test]
fn nftables_host_probe_matches_istios_2_goldens() {
    let mut failures = Vec::new();
    for ipv6 in [false, true] {
        let cfg = AmbientConfig { redirect_dns: true, ..test_config(ipv6) };
        let mut rec = NftRecorder::default();
        program_host_nft(&cfg, 1000, &mut rec).unwrap();
        let got = rec.transactions.join("\n");
        failures.extend(compare(
            &format!("hostprobe ipv6={ipv6}"),
            &golden("nftables", "hostprobe", ipv6),
            &got,
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// TestInvokedTwiceIsIdempotent: a second run (against the stub, which reads back
/// nothing) writes the same rules again.
#[test]
fn a_second_run_writes_the_same_rules() {
    for case in INPOD {
        let cfg = inpod_config(case, false);
        assert_eq!(iptables_inpod(&cfg), iptables_inpod(&cfg), "{}", case.0);
        assert_eq!(nft_inpod(&cfg), nft_inpod(&cfg), "{}", case.0);
    }
}

/// The cases as the node agent meets them: from the pod's annotations.
#[test]
fn the_cases_read_from_annotations_are_istios() {
    use ambient::config::{
        ANNOTATION_BYPASS_INBOUND_CAPTURE as BYPASS, ANNOTATION_DNS_CAPTURE as DNS,
        ANNOTATION_REROUTE_VIRTUAL_INTERFACES as VIRT,
    };
    let from = |a: &[(&str, &str)]| PodOverrides::from_annotations(a.iter().copied()).unwrap();
    assert_eq!(from(&[]), (INPOD[0].2)());
    assert_eq!(from(&[(BYPASS, "true")]), (INPOD[1].2)());
    assert_eq!(from(&[(VIRT, "fake1s0f0,fake1s0f1")]), (INPOD[2].2)());
    assert_eq!(from(&[(BYPASS, "true"), (VIRT, "fake1s0f0, fake1s0f1")]), (INPOD[3].2)());
    assert_eq!(from(&[(DNS, "true")]), (INPOD[4].2)());
    assert_eq!(from(&[(DNS, "false")]), (INPOD[5].2)());
}

#[test]
fn every_golden_file_has_a_case() {
    for backend in ["iptables", "nftables"] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/ambient").join(backend);
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let mut want: Vec<String> = INPOD
            .iter()
            .map(|c| c.0)
            .chain(["hostprobe"])
            .flat_map(|n| [format!("{n}.golden"), format!("{n}_ipv6.golden")])
            .collect();
        want.sort();
        assert_eq!(names, want, "{backend}");
    }
}
