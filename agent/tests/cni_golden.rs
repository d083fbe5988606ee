//! Conformance: istio-cni's ADD for 8 pod shapes. Each pod (containers test,
//! istio-proxy, istio-validate, as Istio's test builds it) goes through Weir's pod
//! decision and capture config, then a dry run of the iptables plan; the result must
//! equal Istio's golden file compared as Istio compares it: blocks split on COMMIT,
//! keyed by table, `iptables-save` lines dropped (iptables-compat/testdata/cni-plugin).

use std::{collections::BTreeMap, path::PathBuf};

use weir_agent::node::cni::pod::{PodInfo, capture_config, skip_reason};
use weir_iptables::{RunOptions, apply::program_iptables, xtables::Recorder};

/// (golden, annotations beyond sidecar.istio.io/status, istio-proxy env, runAsUser/Group)
type Case = (
    &'static str,
    &'static [(&'static str, &'static str)],
    &'static [(&'static str, &'static str)],
    Option<(i64, i64)>,
);

const CASES: &[Case] = &[
    ("basic", &[], &[], None),
    ("basic", &[], &[], Some((0, 0))), // custom-uid-zero: 0 falls back to 1337
    (
        "include-exclude-ip",
        &[
            ("traffic.sidecar.istio.io/includeOutboundIPRanges", "127.0.0.0/8"),
            ("traffic.sidecar.istio.io/excludeOutboundIPRanges", "10.0.0.0/8"),
        ],
        &[],
        None,
    ),
    (
        "include-exclude-ports",
        &[
            ("traffic.sidecar.istio.io/includeInboundPorts", "1111,2222"),
            ("traffic.sidecar.istio.io/excludeInboundPorts", "3333,4444"),
            ("traffic.sidecar.istio.io/excludeOutboundPorts", "5555,6666"),
        ],
        &[],
        None,
    ),
    ("tproxy", &[("sidecar.istio.io/interceptionMode", "TPROXY")], &[], None),
    ("dns", &[], &[("ISTIO_META_DNS_CAPTURE", "true")], None),
    ("invalid-drop", &[], &[("INVALID_DROP", "true")], None),
    ("custom-uid", &[], &[], Some((1000670000, 1000670001))),
    (
        "custom-uid-tproxy",
        &[("sidecar.istio.io/interceptionMode", "TPROXY")],
        &[],
        Some((1000670000, 1000670001)),
    ),
];

fn pod(annotations: &[(&str, &str)], env: &[(&str, &str)], ids: Option<(i64, i64)>) -> PodInfo {
    let mut all: BTreeMap<&str, &str> = annotations.iter().copied().collect();
    all.insert("sidecar.istio.io/status", "{\"containers\":[\"istio-proxy\"]}");
    let env: Vec<_> = env.iter().map(|(k, v)| serde_json::json!({"name": k, "value": v})).collect();
    let mut proxy = serde_json::json!({"name": "istio-proxy", "args": ["proxy", "sidecar"], "env": env});
    if let Some((u, g)) = ids {
        proxy["securityContext"] = serde_json::json!({"runAsUser": u, "runAsGroup": g});
    }
    let json = serde_json::json!({
        "metadata": {"name": "test", "namespace": "testNS", "annotations": all},
        "spec": {"containers": [{"name": "test"}, proxy, {"name": "istio-validate"}]}
    });
    PodInfo::from_json(json.to_string().as_bytes()).unwrap()
}

/// Istio's comparison: table → block, from text split on COMMIT. A table seen twice
/// (an IPv4 and an IPv6 `* nat`) is keyed `* nat #2`, so a second block can never
/// hide behind the first as it would in Istio's map.
fn blocks(text: &str) -> BTreeMap<String, String> {
    let kept: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && *l != "iptables-save" && *l != "ip6tables-save")
        .collect();
    let mut out = BTreeMap::new();
    for block in kept.join("\n").split("COMMIT").map(str::trim).filter(|b| !b.is_empty()) {
        assert!(block.starts_with("* "), "a block must start with '* ': {block}");
        let header = block.lines().next().unwrap_or_default();
        let key = (1..).map(|n| if n == 1 { header.to_string() } else { format!("{header} #{n}") });
        let key = key.into_iter().find(|k| !out.contains_key(k)).expect("an unused key");
        out.insert(key, block.to_string());
    }
    out
}

#[test]
fn a_second_block_for_the_same_table_is_not_collapsed() {
    let v4_and_v6 = "* nat\n-N ISTIO_OUTPUT\nCOMMIT\n* nat\n-N ISTIO_OUTPUT\nCOMMIT\n";
    assert_eq!(blocks(v4_and_v6).len(), 2);
    assert_ne!(blocks(v4_and_v6), blocks("* nat\n-N ISTIO_OUTPUT\nCOMMIT\n"));
}

#[test]
fn cni_add_rules_match_istios_goldens() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../iptables-compat/testdata/cni-plugin");
    let mut failures = Vec::new();
    for (name, annotations, env, ids) in CASES {
        let p = pod(annotations, env, *ids);
        assert_eq!(skip_reason(&p), None, "{name}: captured");
        let cfg = capture_config(&p, false).unwrap();
        let mut rec = Recorder::default();
        program_iptables(&cfg, &RunOptions { cni_mode: true, ..RunOptions::default() }, &mut rec).unwrap();
        let want = std::fs::read_to_string(dir.join(format!("{name}.txt.golden"))).unwrap();
        if blocks(&want) != blocks(&rec.transcript()) {
            failures.push(format!("{name}:\nwant:\n{want}\ngot:\n{}", rec.transcript()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
