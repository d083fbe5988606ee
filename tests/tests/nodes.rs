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

/// Istio's istio-cni chart, rendered for the ambient profile, with only its image
/// changed to weir-cni: on every node Weir runs as Istio's one `install-cni` container
/// (not privileged, not on the host's network, no bpffs: netfilter capture), with the
/// chart's ConfigMap, mounts, capabilities and ports. The standing workloads (sidecar
/// pods with istio-init and with the CNI plugin, native and classic; ambient pods with
/// ztunnel; plain pods) call each other across the nodes with nothing bypassed and every
/// call answered; the plugin is chained as `istio-cni`, the primary's file keeping its mode;
/// readiness is the chart's probe on 8000 and metrics are served on 15014 under Istio's
/// names. Then, node by node, the chart's agent is rolled away (Weir leaves the node for
/// the next agent), the node is left as Istio's installer leaves it, and Weir comes
/// back: no call fails, nothing is bypassed.
#[test]
fn istios_chart_with_weirs_image_runs_sidecar_and_ambient_pods_under_traffic() {
    use weir_tests::cluster::{
        chart::{self, Profile},
        scene::{NodeAgent, Scene, Touched},
    };
    require_root!();
    let mut scene = Scene::up_with(&test_name!(), NodeAgent::IstioChart(Profile::Ambient))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let since = weir_tests::busynode::now_ms();
    std::thread::sleep(Duration::from_secs(10));
    scene.judge("the chart's steady state", since, &Touched::none()).unwrap_or_else(|e| panic!("{e:#}"));
    for i in 1..=3u8 {
        let node = scene.cluster.node(i);
        let path = node.folder("/etc/cni/net.d/10-primary.conflist");
        let list: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let types: Vec<&str> =
            list["plugins"].as_array().unwrap().iter().filter_map(|p| p["type"].as_str()).collect();
        assert_eq!(types.last(), Some(&"istio-cni"), "node {i}: {types:?}");
        assert_eq!(types.iter().filter(|t| **t == "istio-cni").count(), 1, "node {i}: {types:?}");
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644, "node {i}: the primary's file keeps its mode (Istio's writeCNIConfig)");
        let pod = scene.cluster.pod_view(chart::NAMESPACE, &chart::pod_name(i)).expect("the agent's pod");
        let ip = pod.ip.expect("the agent's pod has an address (not the host's network)");
        let metrics = node
            .run("curl", &["-sS", "--max-time", "5", &format!("http://{ip}:15014/metrics")])
            .unwrap_or_else(|e| panic!("node {i}: metrics: {e:#}"));
        for name in [
            "istio_cni_install_ready 1",
            "ztunnel_connected 1",
            "nodeagent_reconcile_events_total{type=\"add\"}",
        ] {
            assert!(metrics.contains(name), "node {i}: {name} not in\n{metrics}");
        }
    }
    let ambient_node = scene
        .workloads
        .iter()
        .find(|w| w.kind == weir_tests::cluster::workloads::Kind::Ambient)
        .map(|w| w.node)
        .expect("an ambient workload");
    let node = scene.cluster.node(ambient_node);
    let pod = scene.cluster.pod_view(chart::NAMESPACE, &chart::pod_name(ambient_node)).unwrap();
    let metrics = node
        .run("curl", &["-sS", "--max-time", "5", &format!("http://{}:15014/metrics", pod.ip.unwrap())])
        .unwrap();
    assert!(
        metrics.contains("istio_cni_plugin_requests_total{response_code=\"200\"}"),
        "the ambient pod's add event is counted:\n{metrics}"
    );
    // The chart rolled node by node to Istio's state and back to Weir's, under traffic.
    for i in 1..=3u8 {
        let since = weir_tests::busynode::now_ms();
        scene.swap_chart_node(i, Duration::from_secs(5)).unwrap_or_else(|e| panic!("node {i}: {e:#}"));
        std::thread::sleep(Duration::from_secs(5));
        scene
            .judge(&format!("the chart swapped on node-{i}"), since, &Touched::none())
            .unwrap_or_else(|e| panic!("{e:#}"));
    }
}

/// Whether the ipset `name` exists in the network namespace at `netns`.
fn ipset_exists(netns: &std::path::Path, name: &'static str) -> bool {
    let netns = netns.to_path_buf();
    std::thread::spawn(move || {
        use std::os::fd::AsFd as _;
        let f = std::fs::File::open(&netns).unwrap();
        nix::sched::setns(f.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        weir_iptables::kernel::ipset::list(name).unwrap().is_some()
    })
    .join()
    .unwrap()
}

/// Istio's chart with Weir's image, ambient profile, stopping as istio-cni stops
/// (cni/pkg/cmd/root.go, the node agent's `ShouldStopCleanup`): while the DaemonSet
/// exists (a rolling upgrade, a reboot) everything stays for the next agent: the
/// `istio-cni` entry last in the chain, its binary and kubeconfig, the node's probe
/// rule and set. The next agent here finds the entry as Istio's installer writes it
/// (cni/pkg/install/cniconfig.go: `plugin.Config`, name and type `istio-cni`) and
/// replaces it in place: one `istio-cni` entry, Weir's. Once the DaemonSet no longer
/// takes the node (its required node affinity), or is gone (an uninstall), stopping
/// takes all of it out of the node. Before, Weir kept everything
/// on every stop: after `helm uninstall`, the chain kept a plugin whose kubeconfig's
/// token was deleted, and every pod's ADD on the node failed.
#[test]
fn the_chart_keeps_the_node_for_the_next_agent_and_cleans_it_once_uninstalled() {
    use weir_tests::cluster::chart::{self, Profile};
    require_root!();
    let cluster = Cluster::new(&test_name!(), 1).unwrap();
    cluster.apply_istio_cni_chart("localhost/weir-cni:dev", Profile::Ambient, &[1]).unwrap();
    let name = chart::pod_name(1);
    let node = cluster.node(1);
    let conflist = node.folder("/etc/cni/net.d/10-primary.conflist");
    let entries = || -> Vec<serde_json::Value> {
        let list: serde_json::Value = serde_json::from_slice(&std::fs::read(&conflist).unwrap()).unwrap();
        list["plugins"].as_array().unwrap().iter().filter(|p| p["type"] == "istio-cni").cloned().collect()
    };
    let binary = node.folder("/opt/cni/bin/istio-cni");
    let kubeconfig = node.folder("/run/istio-cni/istio-cni-kubeconfig");
    let probe_rule =
        || node.run("iptables-save", &["-t", "nat"]).unwrap().contains("-A POSTROUTING -j ISTIO_POSTRT");
    let probe_set = || ipset_exists(node.netns.path(), "istio-inpod-probes-v4");
    let ready_again = |what: &str| {
        cluster.wait_pod(chart::NAMESPACE, &name, READY, "Ready", ready).unwrap_or_else(|e| {
            panic!(
                "{what}: {e:#}; install-cni says {:?}",
                cluster.container_log(chart::NAMESPACE, &name, "install-cni")
            )
        })
    };
    ready_again("first start");
    assert_eq!(entries().len(), 1);
    assert!(binary.exists() && kubeconfig.exists() && probe_rule() && probe_set(), "installed");

    // An upgrade: the DaemonSet stays; the node keeps everything.
    cluster.delete_pod(chart::NAMESPACE, &name, Duration::from_secs(30));
    cluster.wait_gone(chart::NAMESPACE, &name, Duration::from_secs(60)).unwrap();
    assert_eq!(entries().len(), 1, "the plugin stays chained through an upgrade");
    assert!(binary.exists() && kubeconfig.exists(), "binary and kubeconfig stay");
    assert!(probe_rule() && probe_set(), "the probe rule and set stay");

    // The entry as Istio's installer leaves it, then the next agent (Weir's) starts.
    chart::put_chain_entry(&conflist, chart::istio_installer_entry(Profile::Ambient).unwrap()).unwrap();
    cluster.apply_istio_cni_chart("localhost/weir-cni:dev", Profile::Ambient, &[1]).unwrap();
    ready_again("after Istio's entry");
    let now = entries();
    assert_eq!(now.len(), 1, "one istio-cni entry: {now:?}");
    assert!(
        now[0].get("dns").is_none() && now[0]["capture_mode"] == "auto",
        "Weir's entry in Istio's place: {now:?}"
    );

    // The DaemonSet's required node affinity no longer takes this node: not an upgrade
    // (Istio's ShouldStopCleanup); stopping takes Weir out of the node.
    let node_name = node.name.clone();
    cluster
        .api
        .set_node(&node_name, Some(serde_json::json!({"metadata": {"name": node_name, "labels": {}}})));
    let mut ds = cluster.api.daemonset(chart::NAMESPACE, chart::DAEMONSET).expect("the chart's DaemonSet");
    ds["spec"]["template"]["spec"]["affinity"] = serde_json::json!({"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "istio-cni", "operator": "In", "values": ["on"]}]}]}}});
    cluster.api.set_daemonset(chart::NAMESPACE, chart::DAEMONSET, Some(ds));
    cluster.delete_pod(chart::NAMESPACE, &name, Duration::from_secs(30));
    cluster.wait_gone(chart::NAMESPACE, &name, Duration::from_secs(60)).unwrap();
    assert_eq!(entries().len(), 0, "the plugin is out of the chain once the DaemonSet leaves the node");
    assert!(!binary.exists() && !kubeconfig.exists() && !probe_rule() && !probe_set(), "the node cleaned");
    cluster.apply_istio_cni_chart("localhost/weir-cni:dev", Profile::Ambient, &[1]).unwrap();
    ready_again("back on the node");
    assert!(entries().len() == 1 && probe_rule() && probe_set(), "installed again");

    // An uninstall: the DaemonSet is gone; stopping takes Weir out of the node.
    cluster.api.set_daemonset(chart::NAMESPACE, chart::DAEMONSET, None);
    cluster.delete_pod(chart::NAMESPACE, &name, Duration::from_secs(30));
    cluster.wait_gone(chart::NAMESPACE, &name, Duration::from_secs(60)).unwrap();
    assert_eq!(entries().len(), 0, "the plugin is out of the chain after an uninstall");
    assert!(!binary.exists() && !kubeconfig.exists(), "binary and kubeconfig removed");
    assert!(!probe_rule() && !probe_set(), "the probe rule and set removed");
}

/// Istio's chart for its default values (sidecar mode only: Istio's own rendering of
/// the DaemonSet, unchanged but for the image) runs Weir: the one container is Ready
/// on the node, the plugin is chained as `istio-cni`, and a pod as Istio's injector
/// writes it for the CNI (no `istio-init`; `istio-validation` checks the redirect and
/// fails the pod without it) starts with its traffic captured and its proxy Ready.
#[test]
fn istios_chart_for_its_default_values_captures_sidecar_pods_with_weirs_image() {
    use weir_tests::cluster::{
        chart::{self, Profile},
        workloads::{Capture, Sidecar},
    };
    require_root!();
    let cluster = Cluster::new(&test_name!(), 1).unwrap();
    cluster.apply_istio_cni_chart("localhost/weir-cni:dev", Profile::Default, &[1]).unwrap();
    let name = chart::pod_name(1);
    cluster.wait_pod(chart::NAMESPACE, &name, READY, "Ready", ready).unwrap_or_else(|e| {
        panic!("{e:#}; install-cni says {:?}", cluster.container_log(chart::NAMESPACE, &name, "install-cni"))
    });
    let istiod = cluster.start_istiod(1, "permissive").unwrap();
    let mut web = cluster
        .sidecar_pod("hello-readiness.yaml.injected", "web", 1, Capture::Cni, Sidecar::Native, istiod)
        .unwrap();
    cluster.wait_ready(&mut web, READY).unwrap_or_else(|e| {
        panic!(
            "{e:#}; istio-validation says {:?}; install-cni says {:?}",
            cluster.container_log(&web.namespace, &web.name, "istio-validation"),
            cluster.container_log(chart::NAMESPACE, &name, "install-cni")
        )
    });
    let list: serde_json::Value = serde_json::from_slice(
        &std::fs::read(cluster.node(1).folder("/etc/cni/net.d/10-primary.conflist")).unwrap(),
    )
    .unwrap();
    let last = list["plugins"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["type"], "istio-cni");
    assert_eq!(last["ambient_enabled"], false, "the default profile: {last}");
}
