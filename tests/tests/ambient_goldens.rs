//! Istio's 28 ambient goldens (`iptables-compat/testdata/ambient/`: 12 in-pod + 2 host
//! per backend) twice over: through the command line (`weir cni ambient-rules`, the
//! settings under istio-cni's env names and the pod's annotations as flags, printed
//! and not applied), and through the live agent (`weir cni ambient` on a test node
//! enrolls one pod per case, and what it applied in the pod's namespace is exactly the
//! case's plan — the plan the golden holds — by Istio's own verification; the node's
//! probe rule likewise).

use std::{path::PathBuf, process::Stdio, time::Duration};

use weir_iptables::{
    ambient::{AmbientBackend, AmbientConfig, PodDns, PodOverrides, verify_host_probe, verify_inpod},
    state::Verdict,
};
use weir_tests::{
    Mesh,
    ambient::{AmbientNode, pod_object},
    fake_ztunnel::FakeZtunnel,
    require_root, test_name, tools,
};

const DNS: &str = "ambient.istio.io/dns-capture";
const BYPASS: &str = "ambient.istio.io/bypass-inbound-capture";
const VIRT: &str = "istio.io/reroute-virtual-interfaces";

/// One case: its name, the agent's DNS capture, the pod's annotations.
type Case = (&'static str, bool, &'static [(&'static str, &'static str)]);

/// Istio's GetCommonInPodTestCases.
const INPOD: &[Case] = &[
    ("default", true, &[]),
    ("ingress", false, &[(BYPASS, "true")]),
    ("virtual_interfaces", false, &[(VIRT, "fake1s0f0,fake1s0f1")]),
    ("ingress_and_virtual_interfaces", false, &[(BYPASS, "true"), (VIRT, "fake1s0f0,fake1s0f1")]),
    ("dns_pod_enabled_and_off_globally", false, &[(DNS, "true")]),
    ("dns_pod_disabled_and_on_globally", true, &[(DNS, "false")]),
];

/// Istio's constructTestConfig's v6 probe address (the in-pod goldens').
const GOLDEN_V6_PROBE: &str = "e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164";

fn golden(backend: &str, name: &str, ipv6: bool) -> String {
    let file = if ipv6 { format!("{name}_ipv6.golden") } else { format!("{name}.golden") };
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../iptables-compat/testdata/ambient")
        .join(backend)
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn cli(env: &[(&str, String)], args: &[String]) -> String {
    let out = tools::weir_command()
        .args(["cni", "ambient-rules"])
        .args(args)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("run weir cni ambient-rules");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_28_goldens_through_the_command_line() {
    let mut failures = Vec::new();
    for (backend, nft) in [("iptables", "false"), ("nftables", "true")] {
        for ipv6 in [false, true] {
            for (name, dns, annotations) in INPOD {
                let env = [
                    ("NATIVE_NFTABLES", nft.to_string()),
                    ("AMBIENT_IPV6", ipv6.to_string()),
                    ("AMBIENT_DNS_CAPTURE", dns.to_string()),
                    ("HOST_PROBE_SNAT_IPV6", GOLDEN_V6_PROBE.to_string()),
                ];
                let args: Vec<String> =
                    annotations.iter().map(|(k, v)| format!("--annotation={k}={v}")).collect();
                if cli(&env, &args).trim() != golden(backend, name, ipv6).trim() {
                    failures.push(format!("{backend} {name} ipv6={ipv6}"));
                }
            }
            // Istio's iptables host test sets the chart's v6 probe address; its nftables
            // host test keeps constructTestConfig's.
            let mut env = vec![("NATIVE_NFTABLES", nft.to_string()), ("AMBIENT_IPV6", ipv6.to_string())];
            if backend == "nftables" {
                env.push(("HOST_PROBE_SNAT_IPV6", GOLDEN_V6_PROBE.to_string()));
            }
            let args = ["--host-probe".to_string(), "--kubelet-uid=1000".to_string()];
            if cli(&env, &args).trim() != golden(backend, "hostprobe", ipv6).trim() {
                failures.push(format!("{backend} hostprobe ipv6={ipv6}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} of 28 differ: {failures:?}", failures.len());
}

/// The case's configuration as the goldens were made from it.
fn case_config(
    backend: AmbientBackend,
    ipv6: bool,
    dns: bool,
    annotations: &[(&str, &str)],
) -> weir_iptables::ambient::InpodConfig {
    let cfg = AmbientConfig {
        backend,
        enable_ipv6: ipv6,
        redirect_dns: dns,
        host_probe_snat_v6: GOLDEN_V6_PROBE.parse().unwrap(),
        ..AmbientConfig::default()
    };
    let pod = PodOverrides::from_annotations(annotations.iter().copied()).unwrap();
    assert!(pod.dns != PodDns::Unset || !annotations.iter().any(|(k, _)| *k == DNS));
    cfg.for_pod(pod)
}

#[test]
fn the_28_goldens_through_the_live_agent() {
    require_root!();
    let mut failures = Vec::new();
    for (backend, nft) in [(AmbientBackend::Iptables, "false"), (AmbientBackend::Nftables, "true")] {
        for ipv6 in [false, true] {
            for dns in [true, false] {
                let mesh = Mesh::new(&format!("{}-{nft}-{ipv6}-{dns}", test_name!())).unwrap();
                let mut node = AmbientNode::new(&mesh).unwrap();
                node.env.extend([
                    ("NATIVE_NFTABLES".into(), nft.into()),
                    ("AMBIENT_IPV6".into(), ipv6.to_string()),
                    ("AMBIENT_DNS_CAPTURE".into(), dns.to_string()),
                    ("HOST_PROBE_SNAT_IPV6".into(), GOLDEN_V6_PROBE.into()),
                ]);
                node.api.set_namespace("apps", &[("istio.io/dataplane-mode", "ambient")]);
                node.start_agent().unwrap();
                let _zt = FakeZtunnel::start(&node.zds_socket());
                for (name, case_dns, annotations) in INPOD.iter().filter(|c| c.1 == dns) {
                    let pod = mesh.pod(name).unwrap();
                    let k8s_name = name.replace('_', "-");
                    let ip = std::net::IpAddr::V4(pod.ipv4());
                    node.api.set_pod(pod_object(
                        "apps",
                        &k8s_name,
                        &format!("uid-{k8s_name}"),
                        ip,
                        &[],
                        annotations,
                    ));
                    node.cni_add(&pod, "apps", &k8s_name)
                        .unwrap_or_else(|e| panic!("ADD {name}: {e}\n{}", node.agent_logs()));
                    let cfg = case_config(backend, ipv6, *case_dns, annotations);
                    let verdict = verify_inpod(pod.netns().path(), &cfg).unwrap();
                    if verdict != Verdict::Applied {
                        failures.push(format!("{nft} {name} ipv6={ipv6}: {verdict:?}"));
                    }
                }
                // The probe rule (nftables: kubelet's uid is the rig's 0).
                let host = AmbientConfig {
                    backend,
                    enable_ipv6: ipv6,
                    host_probe_snat_v6: GOLDEN_V6_PROBE.parse().unwrap(),
                    ..AmbientConfig::default()
                };
                let verdict = node.in_node(|| verify_host_probe(None, &host, 0).unwrap());
                if verdict != Verdict::Applied {
                    failures.push(format!("{nft} hostprobe ipv6={ipv6} dns={dns}: {verdict:?}"));
                }
                node.stop_agent().unwrap();
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}
