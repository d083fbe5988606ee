//! Weir on real nodes: containerd (CRI) runs the pods, the kubelet stand-in plays
//! kubelet (tests/src/cluster). See tests/src/cluster.rs for the rig.

use std::time::Duration;

use serde_json::json;
use weir_tests::{cluster::rig::Cluster, require_root, test_name};

const READY: Duration = Duration::from_secs(120);

fn ready(p: &serde_json::Value) -> bool {
    p["status"]["conditions"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
}

/// A plain pod through containerd: its sandbox on the node's bridge (the primary CNI),
/// its app started, probed from the node and reported Ready; deleted with its grace
/// period; nothing left in the runtime.
#[test]
fn a_pod_runs_through_the_runtime_and_goes_with_its_deletion() {
    require_root!();
    let cluster = Cluster::new(&test_name!(), 1).unwrap();
    cluster.create_pod(
        json!({"metadata": {"name": "web", "namespace": "shop", "labels": {"app": "web"}},
               "spec": {"containers": [{"name": "app", "image": weir_tests::cluster::images::RIG_IMAGE,
                 "args": ["app", "web", "8080"], "ports": [{"containerPort": 8080}],
                 "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 1}}]}}),
        1,
    );
    let pod = cluster.wait_pod("shop", "web", READY, "Ready", ready).unwrap();
    let ip = pod["status"]["podIP"].as_str().unwrap().to_string();
    assert!(ip.starts_with("10.80.1."), "the node's pod CIDR: {ip}");
    cluster.delete_pod("shop", "web", Duration::from_secs(5));
    cluster.wait_pod("shop", "web", Duration::from_secs(30), "gone", |_| false).unwrap_err();
}

/// Weir's DaemonSet from agent/deploy as the runtime runs it: the install container
/// chains the plugin into the node's primary CNI config and attaches the eBPF node
/// capture to the node's pods' cgroup, with the manifest's capabilities only.
#[test]
fn the_daemonset_runs_on_a_node_and_chains_the_plugin() {
    require_root!();
    let cluster = Cluster::new(&test_name!(), 1).unwrap();
    cluster.apply_daemonset("localhost/weir-cni:dev").unwrap();
    cluster.wait_pod("kube-system", "weir-cni-node-1", READY, "Ready", ready).unwrap();
    let node = cluster.node(1);
    let chained = || {
        std::fs::read_to_string(node.folder("/etc/cni/net.d/10-primary.conflist"))
            .unwrap_or_default()
            .contains("weir-cni")
    };
    weir_tests::control_plane::eventually(Duration::from_secs(60), || chained().then_some(()))
        .unwrap_or_else(|| {
            panic!(
                "not chained; install says {:?}",
                cluster.container_log("kube-system", "weir-cni-node-1", "install")
            )
        });
    assert!(node.folder("/opt/cni/bin/weir-cni").exists(), "the plugin binary on the node");
    let programs = weir_tests::capture::cgroup_programs(node.kubepods.path());
    assert!(
        programs.iter().any(|p| p.contains("weir_connect4")),
        "the node capture on the pods' cgroup: {programs:?}"
    );
}

/// Sidecar pods as Istio's injector writes them, on two nodes: one captured by its
/// istio-init (Weir's weir-init image), one by the CNI plugin (istio-validation in its
/// place), both running Weir's proxy image as the native sidecar; istiod a pod. They
/// call each other through both Envoys (mutual TLS) and a plain pod calls one: no
/// connection of a meshed pod gets past its proxy, none fails.
#[test]
fn injected_sidecar_pods_talk_across_nodes_through_their_proxies() {
    use weir_tests::cluster::workloads::{Capture, Sidecar};
    require_root!();
    let cluster = Cluster::new(&test_name!(), 2).unwrap();
    cluster.apply_daemonset("localhost/weir-cni:dev").unwrap();
    for i in 1..=2 {
        cluster.wait_pod("kube-system", &format!("weir-cni-node-{i}"), READY, "Ready", ready).unwrap();
    }
    let istiod = cluster.start_istiod(1, "permissive").unwrap();
    let golden = "hello-readiness.yaml.injected";
    let mut s1 =
        cluster.sidecar_pod(golden, "s1", 1, Capture::InitContainer, Sidecar::Native, istiod).unwrap();
    let mut s2 = cluster.sidecar_pod(golden, "s2", 2, Capture::Cni, Sidecar::Native, istiod).unwrap();
    let mut p1 = cluster.app_pod("p1", 1, false).unwrap();
    for w in [&mut s1, &mut s2, &mut p1] {
        cluster.wait_ready(w, READY).unwrap_or_else(|e| panic!("{e:#}"));
    }
    cluster.set_mesh_services(&[&s1, &s2], "permissive").unwrap();
    cluster.set_targets("s1", &[s2.addr().unwrap()]).unwrap();
    cluster.set_targets("s2", &[s1.addr().unwrap()]).unwrap();
    cluster.set_targets("p1", &[s1.addr().unwrap()]).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let mark = weir_tests::busynode::now_ms();
    std::thread::sleep(Duration::from_secs(5));
    let t = cluster.traffic(&[&s1, &s2, &p1], mark);
    assert!(t.bypasses.is_empty(), "{:?}", t.bypasses);
    assert!(
        t.failures.is_empty(),
        "{:?}\ns1's proxy: {:?}",
        t.failures,
        cluster.container_log("default", "s1", "istio-proxy").iter().rev().take(20).collect::<Vec<_>>()
    );
    assert!(t.ok > 10, "{t:?}");
}
