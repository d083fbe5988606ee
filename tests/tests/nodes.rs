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
