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

/// The node rig (tests/src/cluster/scene.rs): three nodes, Weir's DaemonSet, istiod,
/// ztunnel on every node; sidecar pods as Istio's injector writes them (istio-init and
/// the CNI plugin, native and classic sidecars), ambient pods and plain pods calling each
/// other across the nodes all the time. Then, one after another under that traffic:
/// the DaemonSet rolled node by node to the next version (a pod started under it) and
/// back, containerd restarted, the node agent killed, a node rebooted with its agent held
/// back until its other pods' sandboxes were tried, a pod deleted with a request in
/// flight, 20 pods started at once on a node and deleted. Each event ends with no bypass,
/// no failed request between pods it did not touch, every call answered, every pod
/// Ready, nothing of Weir's left on a node that nothing needs.
#[test]
fn three_nodes_under_traffic_through_rolls_restarts_reboots_and_deletions() {
    use weir_tests::cluster::scene::Scene;
    require_root!();
    let mut scene = Scene::up(&test_name!()).unwrap_or_else(|e| panic!("{e:#}"));
    scene.run_events(&|| false).unwrap_or_else(|e| panic!("{e:#}"));
}
