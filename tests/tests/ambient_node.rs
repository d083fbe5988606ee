//! Weir's ambient node agent (`weir cni ambient`) on a test node, against the test API
//! server with watches and a stand-in ztunnel that acks (the real one is
//! `ambient_ztunnel.rs`): a pod the chart's selector picks is captured at CNI ADD (the
//! plugin posts Istio's event, the agent applies the in-pod rules, ztunnel is sent the
//! pod, its address joins the node's probe ipset, the pod is annotated `enabled`) and
//! released when deleted; ADD fails while the agent is down, but not for a pod that is
//! not ambient; a running pod is enrolled when its namespace is labelled later (found
//! through /proc) and unenrolled, rules undone, when it opts out; a restarted agent
//! finds every enrolled pod again and the next ztunnel gets them all (Add with the
//! netns, not Keep); a watch whose version expired lists again; the node's probe rule
//! and set come back when flushed. The plugin retries a namespace read that fails for a
//! moment (`enable_ambient_detection_retry` for longer); an event whose namespace path
//! the agent cannot open under the node's root is served through the node's /proc; an
//! AWS branch-ENI pod (aws-vpc-cni's `iif` rule and table, simulated on a veth pair)
//! gets Istio's host rules for kubelet's probes while it is in the probe set, and none
//! without `tcp_early_demux=0` or with `AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE=false`.

use std::{net::IpAddr, time::Duration};

use weir_iptables::{
    ambient::{AmbientConfig, PROBE_SET_V4, verify_host_probe, verify_inpod},
    ipset,
    state::Verdict,
};
use weir_tests::{
    Mesh, Pod,
    ambient::{AmbientNode, pod_object},
    fake_ztunnel::FakeZtunnel,
    require_root, test_cgroup, test_name,
};

const PATIENCE: Duration = Duration::from_secs(20);
const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");

/// The agent's rule settings in this rig (DNS capture on, as the chart).
fn rules() -> AmbientConfig {
    AmbientConfig { redirect_dns: true, ..AmbientConfig::default() }
}

fn inpod(pod: &Pod) -> Verdict {
    verify_inpod(pod.netns().path(), &rules().for_pod(Default::default())).expect("verify the pod's rules")
}

fn probe_set(node: &AmbientNode) -> Vec<(IpAddr, Option<String>)> {
    node.in_node(|| ipset::list(PROBE_SET_V4).expect("list the probe set"))
        .unwrap_or_default()
        .into_iter()
        .map(|m| (m.ip, m.comment))
        .collect()
}

fn ip(pod: &Pod) -> IpAddr {
    IpAddr::V4(pod.ipv4())
}

#[test]
fn an_ambient_pod_is_captured_at_add_and_released_when_deleted() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    node.api.set_namespace("apps", &[AMBIENT]);
    node.api.set_namespace("plain", &[]);
    node.start_agent().unwrap();
    let zt = FakeZtunnel::start(&node.zds_socket());
    node.wait("ztunnel's snapshot", PATIENCE, || zt.log().contains(&"SnapshotSent".to_string())).unwrap();

    let web = mesh.pod("web").unwrap();
    node.api.set_pod(pod_object("apps", "web", "uid-web", ip(&web), &[], &[]));
    node.cni_add(&web, "apps", "web").unwrap_or_else(|e| panic!("ADD: {e}\n{}", node.agent_logs()));
    // The plugin's 200 comes after every step: no waiting.
    assert_eq!(node.api.redirection("apps", "web").as_deref(), Some("enabled"));
    assert!(zt.log().contains(&"Add uid-web".to_string()), "{:?}", zt.log());
    assert_eq!(inpod(&web), Verdict::Applied, "the in-pod rules, ip rule and route");
    assert_eq!(probe_set(&node), [(ip(&web), Some("uid-web".into()))]);
    let patch = node.api.requests().into_iter().find(|r| r.starts_with("PATCH")).unwrap();
    assert_eq!(patch, "PATCH /api/v1/namespaces/apps/pods/web/status", "annotations through pods/status");

    // A pod of a namespace that is not ambient, without a sidecar: left alone.
    let other = mesh.pod("other").unwrap();
    node.api.set_pod(pod_object("plain", "other", "uid-other", ip(&other), &[], &[]));
    node.cni_add(&other, "plain", "other").unwrap();
    assert_eq!(inpod(&other), Verdict::Clean);
    assert_eq!(node.api.redirection("plain", "other"), None);
    // The opt-out label in an ambient namespace: left alone too.
    let out = mesh.pod("out").unwrap();
    node.api.set_pod(pod_object(
        "apps",
        "out",
        "uid-out",
        ip(&out),
        &[("istio.io/dataplane-mode", "none")],
        &[],
    ));
    node.cni_add(&out, "apps", "out").unwrap();
    assert_eq!(inpod(&out), Verdict::Clean);

    node.api.delete_pod("apps", "web");
    node.wait("Del to ztunnel", PATIENCE, || zt.log().contains(&"Del uid-web".to_string())).unwrap();
    node.wait("the probe set emptied", PATIENCE, || probe_set(&node).is_empty()).unwrap();
}

#[test]
fn add_fails_closed_while_the_agent_is_down() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let node = AmbientNode::new(&mesh).unwrap();
    node.api.set_namespace("apps", &[AMBIENT]);
    let web = mesh.pod("web").unwrap();
    node.api.set_pod(pod_object("apps", "web", "uid-web", ip(&web), &[], &[]));
    let e = node.cni_add(&web, "apps", "web").unwrap_err();
    assert_eq!(e.error()["code"], 11, "try again later: {e}");
    assert!(e.error()["details"].as_str().unwrap().contains("pluginevent.sock"), "{e}");
    assert_eq!(inpod(&web), Verdict::Clean);
    // Not ambient: ADD goes on without the agent.
    let other = mesh.pod("other").unwrap();
    node.api.set_namespace("plain", &[]);
    node.api.set_pod(pod_object("plain", "other", "uid-other", ip(&other), &[], &[]));
    node.cni_add(&other, "plain", "other").unwrap();
    // The agent's own pod (in the plugin's `pod_namespace`) is exempt before anything
    // is looked up: the API has no such pod, and ADD still succeeds.
    node.cni_add(&other, "istio-system", "istio-cni-node-x").unwrap();
    assert!(!node.api.requests().iter().any(|r| r.contains("istio-cni-node-x")));
    // A namespace the plugin cannot read (read beside the pod) fails ADD when its labels
    // decide, naming it; a pod its own label makes ambient does not need it.
    let lost = mesh.pod("lost").unwrap();
    node.api.set_pod(pod_object("ghost", "lost", "uid-lost", ip(&lost), &[], &[]));
    let e = node.cni_add(&lost, "ghost", "lost").unwrap_err();
    assert!(e.to_string().contains("cannot get namespace ghost"), "{e}");
    assert_eq!(inpod(&lost), Verdict::Clean);
    let labelled = mesh.pod("labelled").unwrap();
    node.api.set_pod(pod_object("ghost", "labelled", "uid-labelled", ip(&labelled), &[AMBIENT], &[]));
    let e = node.cni_add(&labelled, "ghost", "labelled").unwrap_err();
    assert!(
        e.error()["details"].as_str().unwrap().contains("pluginevent.sock"),
        "handed over, agent down: {e}"
    );
}

#[test]
fn running_pods_are_enrolled_by_label_and_restarts_lose_nothing() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    let cgroup = test_cgroup(&format!("{}-kubepods", test_name!()));
    node.api.set_namespace("apps", &[]);
    let web = mesh.pod("web").unwrap();
    let uid = "2c48913c-b29f-11e7-9350-020968147796";
    let _sandbox = node.sandbox(&cgroup, uid, &web).unwrap();
    node.api.set_pod(pod_object("apps", "web", uid, ip(&web), &[], &[]));
    node.start_agent().unwrap();
    let zt = FakeZtunnel::start(&node.zds_socket());
    assert_eq!(node.api.redirection("apps", "web"), None);

    // The namespace is labelled: the running pod is found through /proc and enrolled.
    node.api.set_namespace("apps", &[AMBIENT]);
    node.wait("the pod enrolled", PATIENCE, || {
        node.api.redirection("apps", "web").as_deref() == Some("enabled")
    })
    .unwrap();
    assert_eq!(inpod(&web), Verdict::Applied);
    assert!(zt.log().contains(&format!("Add {uid}")), "{:?}", zt.log());

    // The agent restarts: the rules stay, the next ztunnel connection gets the pod
    // with its namespace (an Add, not a Keep) in its snapshot.
    node.stop_agent().unwrap();
    assert_eq!(inpod(&web), Verdict::Applied, "stopping the agent removes nothing");
    let before = zt.log().len();
    node.start_agent().unwrap();
    node.wait("a snapshot from the new agent", PATIENCE, || {
        zt.log()[before..].contains(&"SnapshotSent".to_string())
    })
    .unwrap();
    let snapshot = zt.log()[before..].to_vec();
    assert_eq!(
        snapshot,
        [format!("Add {uid}"), "SnapshotSent".to_string()],
        "the restarted agent's snapshot"
    );
    assert!(node.agent_log(2).contains("found=1"), "{}", node.agent_log(2));

    // Versions expire: the watch lists again and still sees the opt-out.
    node.api.expire_history();
    node.api
        .update_pod("apps", "web", |p| p["metadata"]["labels"]["istio.io/dataplane-mode"] = "none".into());
    node.wait("the pod unenrolled", PATIENCE, || node.api.redirection("apps", "web").is_none()).unwrap();
    assert_eq!(inpod(&web), Verdict::Clean, "opting out undoes the rules");
    assert!(zt.log().contains(&format!("Del {uid}")), "{:?}", zt.log());
}

#[test]
fn the_nodes_probe_rule_and_set_come_back() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    node.api.set_namespace("apps", &[AMBIENT]);
    node.start_agent().unwrap();
    let _zt = FakeZtunnel::start(&node.zds_socket());
    let web = mesh.pod("web").unwrap();
    node.api.set_pod(pod_object("apps", "web", "uid-web", ip(&web), &[], &[]));
    node.cni_add(&web, "apps", "web").unwrap_or_else(|e| panic!("ADD: {e}\n{}", node.agent_logs()));
    let host = |node: &AmbientNode| node.in_node(|| verify_host_probe(None, &rules(), 0).unwrap());
    assert_eq!(host(&node), Verdict::Applied);
    // Someone flushes the node's nat POSTROUTING and empties the set.
    node.in_node(|| {
        let out =
            std::process::Command::new("iptables").args(["-t", "nat", "-F", "POSTROUTING"]).status().unwrap();
        assert!(out.success());
        ipset::flush(PROBE_SET_V4).unwrap();
    });
    assert_ne!(host(&node), Verdict::Applied);
    node.wait("the probe rule restored", PATIENCE, || host(&node) == Verdict::Applied).unwrap();
    node.wait("the probe set refilled", PATIENCE, || {
        probe_set(&node) == [(ip(&web), Some("uid-web".into()))]
    })
    .unwrap();
}

/// Weir's own DaemonSet's ambient agent stops as Istio's with
/// `AMBIENT_DISABLE_SAFE_UPGRADE=true` (the dataplane's `Stop(cleanup)`): every stop is
/// for good, and the node's probe rule and sets go with it. Without the setting (the
/// start before), a stop keeps both for the next agent. Before, the setting was
/// accepted and ignored: both stayed.
#[test]
fn with_safe_upgrade_disabled_the_agents_stop_takes_the_nodes_probe_rule_out() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    node.api.set_namespace("apps", &[AMBIENT]);
    let host = |node: &AmbientNode| node.in_node(|| verify_host_probe(None, &rules(), 0).unwrap());
    let set = |node: &AmbientNode| node.in_node(|| ipset::list(PROBE_SET_V4).unwrap().is_some());
    node.start_agent().unwrap();
    node.stop_agent().unwrap();
    assert_eq!((host(&node), set(&node)), (Verdict::Applied, true), "a safe stop keeps the rule and set");
    node.env.push(("AMBIENT_DISABLE_SAFE_UPGRADE".into(), "true".into()));
    node.start_agent().unwrap();
    node.stop_agent().unwrap();
    let logs = node.agent_logs();
    assert_eq!((host(&node), set(&node)), (Verdict::Clean, false), "{logs}");
    assert!(logs.contains("stopping for good"), "{logs}");
}

/// `NATIVE_NFTABLES=true` on a node whose iptables probe set exists (an iptables-mode
/// agent ran since the last boot) keeps the agent on iptables until the node reboots,
/// as Istio 1.31 does (istio/istio#58353): the probe rule and a pod's in-pod rules are
/// iptables', and the log says why and what completes the move. Before, the agent
/// switched to nftables at once, leaving the running pods' iptables rules and the
/// node's ipset behind. Without that set, the same settings get nftables.
#[test]
fn native_nftables_stays_on_iptables_while_the_nodes_iptables_set_exists() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    node.api.set_namespace("apps", &[AMBIENT]);
    node.in_node(|| ipset::create_hash_ip(PROBE_SET_V4, false).unwrap());
    node.env.push(("NATIVE_NFTABLES".into(), "true".into()));
    node.start_agent().unwrap();
    let _zt = FakeZtunnel::start(&node.zds_socket());
    let web = mesh.pod("web").unwrap();
    node.api.set_pod(pod_object("apps", "web", "uid-web", ip(&web), &[], &[]));
    node.cni_add(&web, "apps", "web").unwrap_or_else(|e| panic!("ADD: {e}\n{}", node.agent_logs()));
    assert_eq!(node.in_node(|| verify_host_probe(None, &rules(), 0).unwrap()), Verdict::Applied);
    assert_eq!(inpod(&web), Verdict::Applied, "the pod's rules are iptables'");
    assert_eq!(probe_set(&node), [(ip(&web), Some("uid-web".into()))]);
    let logs = node.agent_logs();
    assert!(logs.contains("staying on iptables") && logs.contains("reboot the node"), "{logs}");
}

/// The plugin reads an ambient pod's namespace (its labels decide) as istio-cni's
/// `isAmbientPod` does: an answer that may pass (503) is tried again a second later,
/// once by default and up to 30 times with `enable_ambient_detection_retry`; a
/// namespace still unread fails ADD, naming it, and nothing is captured.
#[test]
fn a_namespace_read_failing_for_a_moment_is_retried_before_add_decides() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    node.api.set_namespace("apps", &[AMBIENT]);
    node.start_agent().unwrap();
    let zt = FakeZtunnel::start(&node.zds_socket());
    node.wait("ztunnel's snapshot", PATIENCE, || zt.log().contains(&"SnapshotSent".to_string())).unwrap();
    let namespace = "/api/v1/namespaces/apps";
    let reads =
        |node: &AmbientNode| node.api.requests().iter().filter(|r| *r == &format!("GET {namespace}")).count();

    // One 503: read again, and the pod is captured.
    let web = mesh.pod("web").unwrap();
    node.api.set_pod(pod_object("apps", "web", "uid-web", ip(&web), &[], &[]));
    node.api.fail_next(namespace, 1, 503);
    node.cni_add(&web, "apps", "web").unwrap_or_else(|e| panic!("ADD: {e}\n{}", node.agent_logs()));
    assert_eq!(reads(&node), 2, "read twice");
    assert_eq!(node.api.redirection("apps", "web").as_deref(), Some("enabled"));
    assert_eq!(inpod(&web), Verdict::Applied);

    // Three: two reads by default, then ADD fails closed naming the namespace.
    let api = mesh.pod("api").unwrap();
    node.api.set_pod(pod_object("apps", "api", "uid-api", ip(&api), &[], &[]));
    node.api.fail_next(namespace, 3, 503);
    let e = node.cni_add(&api, "apps", "api").unwrap_err();
    assert!(e.to_string().contains("cannot get namespace apps"), "{e}");
    assert!(e.error()["details"].as_str().unwrap().contains("503"), "names the answer: {e}");
    assert_eq!(reads(&node), 4, "two more reads");
    assert_eq!(inpod(&api), Verdict::Clean, "nothing captured");

    // Three again, with the flag: read until it answers.
    let mut conf = node.plugin_conf(Some(ip(&api)));
    conf["enable_ambient_detection_retry"] = true.into();
    node.api.fail_next(namespace, 3, 503);
    node.cni_add_conf(&api, "apps", "api", &[], &conf)
        .unwrap_or_else(|e| panic!("ADD with retries: {e}\n{}", node.agent_logs()));
    assert_eq!(reads(&node), 8, "four more reads");
    assert_eq!(inpod(&api), Verdict::Applied);
}

/// A runtime whose namespace folder the agent does not see under the node's root
/// (cri-dockerd's, a host mount without it): the event's path does not open under
/// `WEIR_HOST_ROOT`, so the pod's namespace is found through the node's /proc by its
/// UID, checked to hold the event's address, and captured; the agent logs which way.
#[test]
fn an_event_whose_netns_path_does_not_open_is_served_through_the_nodes_proc() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    let cgroup = test_cgroup(&format!("{}-kubepods", test_name!()));
    let unmounted = tempfile::tempdir().unwrap();
    node.env.push(("WEIR_HOST_ROOT".into(), unmounted.path().display().to_string()));
    node.api.set_namespace("apps", &[AMBIENT]);
    node.start_agent().unwrap();
    let zt = FakeZtunnel::start(&node.zds_socket());
    node.wait("ztunnel's snapshot", PATIENCE, || zt.log().contains(&"SnapshotSent".to_string())).unwrap();

    let web = mesh.pod("web").unwrap();
    let uid = "7d3a1c52-6a0e-4b8e-9f31-0c2a5b7e9d14";
    let _sandbox = node.sandbox(&cgroup, uid, &web).unwrap();
    // As at a real ADD, the API has no address for the pod yet: only the event enrolls it.
    let mut object = pod_object("apps", "web", uid, ip(&web), &[], &[]);
    object["status"] = serde_json::json!({"phase": "Pending"});
    node.api.set_pod(object);
    node.cni_add(&web, "apps", "web").unwrap_or_else(|e| panic!("ADD: {e}\n{}", node.agent_logs()));
    assert_eq!(node.api.redirection("apps", "web").as_deref(), Some("enabled"));
    assert_eq!(inpod(&web), Verdict::Applied);
    assert!(zt.log().contains(&format!("Add {uid}")), "{:?}", zt.log());
    let logs = node.agent_logs();
    assert!(logs.contains("netns_from=host_proc"), "the log says how it was found:\n{logs}");
}

/// aws-vpc-cni's routing of a branch-ENI pod at `pod`, in the node's namespace: its
/// host-side device `dev` (one end of a veth pair here), `iif <dev> lookup <table> pref 10`, and in
/// `table` a route to the pod via `dev`; the node's `net.ipv4.tcp_early_demux` (per
/// namespace) set to `early_demux` (0: security groups for pods, as AWS requires).
fn aws_vpc_cni_branch_eni(node: &AmbientNode, dev: &str, table: u32, pod: IpAddr, early_demux: u8) {
    node.in_node(|| {
        let table = table.to_string();
        let route = format!("{pod}/32");
        let peer = format!("{dev}p");
        for args in [
            &["link", "add", dev, "type", "veth", "peer", "name", &peer][..],
            &["link", "set", dev, "up"],
            &["link", "set", &peer, "up"],
            &["rule", "add", "iif", dev, "lookup", &table, "priority", "10"],
            &["route", "add", &route, "dev", dev, "table", &table],
        ] {
            let out = std::process::Command::new("ip").args(args).output().unwrap();
            assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::fs::write("/proc/sys/net/ipv4/tcp_early_demux", early_demux.to_string()).unwrap();
    });
}

/// The node's rules Istio gives the branch-ENI pod at `pod` behind `dev`, as `ip rule`
/// shows them: the return rule (pref 9: one before aws-vpc-cni's `iif` rule), then the
/// forward rule (pref 512).
fn branch_eni_rules(node: &AmbientNode, dev: &str, pod: IpAddr) -> Vec<String> {
    let out =
        node.in_node(|| std::process::Command::new("ip").args(["-4", "rule", "show"]).output().unwrap());
    assert!(out.status.success(), "ip rule show: {}", String::from_utf8_lossy(&out.stderr));
    let (back, forward) = (format!(" iif {dev} lookup local"), format!(" to {pod} lookup "));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| l.contains(&back) || l.contains(&forward))
        .collect()
}

/// Istio 1.30's `AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE` (default true): on a node with
/// `tcp_early_demux=0`, a pod aws-vpc-cni routes through a branch ENI gets
/// `to <pod> lookup <its table> pref 512` and `iif <its device> lookup local` one
/// before aws-vpc-cni's `iif` rule when it joins the probe set, and loses them when it
/// is deleted. Before, nothing was added and kubelet's SNATed probes left through the
/// VPC.
#[test]
fn an_aws_branch_eni_pod_gets_probe_rules_at_add_and_loses_them_when_deleted() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    node.api.set_namespace("apps", &[AMBIENT]);
    let web = mesh.pod("web").unwrap();
    aws_vpc_cni_branch_eni(&node, "vlan.eth.1", 101, ip(&web), 0);
    node.start_agent().unwrap();
    let zt = FakeZtunnel::start(&node.zds_socket());
    assert!(branch_eni_rules(&node, "vlan.eth.1", ip(&web)).is_empty());

    node.api.set_pod(pod_object("apps", "web", "uid-web", ip(&web), &[], &[]));
    node.cni_add(&web, "apps", "web").unwrap_or_else(|e| panic!("ADD: {e}\n{}", node.agent_logs()));
    assert_eq!(
        branch_eni_rules(&node, "vlan.eth.1", ip(&web)),
        [
            "9: from all iif vlan.eth.1 lookup local".to_string(),
            format!("512: from all to {} lookup 101", ip(&web))
        ],
        "{}",
        node.agent_logs()
    );
    assert_eq!(probe_set(&node), [(ip(&web), Some("uid-web".into()))]);

    node.api.delete_pod("apps", "web");
    node.wait("Del to ztunnel", PATIENCE, || zt.log().contains(&"Del uid-web".to_string())).unwrap();
    node.wait("the branch-ENI rules removed", PATIENCE, || {
        branch_eni_rules(&node, "vlan.eth.1", ip(&web)).is_empty()
    })
    .unwrap();
    assert!(probe_set(&node).is_empty());
}

/// A branch-ENI pod gets no rules on a node whose `tcp_early_demux` is 1 (no security
/// groups for pods there: nothing is looked at), nor with
/// `AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE=false`; with the default and
/// `tcp_early_demux=0`, the next one does.
#[test]
fn branch_eni_probe_rules_need_tcp_early_demux_0_and_the_setting_left_on() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let mut node = AmbientNode::new(&mesh).unwrap();
    node.api.set_namespace("apps", &[AMBIENT]);
    let _zt = FakeZtunnel::start(&node.zds_socket());
    let flag = "AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE";
    for (n, (name, early_demux, setting, rules)) in
        [("web", 1, None, 0), ("api", 0, Some("false"), 0), ("db", 0, None, 2)].into_iter().enumerate()
    {
        let (dev, table) = (format!("vlan.eth.{}", n + 1), 101 + n as u32);
        let pod = mesh.pod(name).unwrap();
        aws_vpc_cni_branch_eni(&node, &dev, table, ip(&pod), early_demux);
        node.env.retain(|(k, _)| k != flag);
        node.env.extend(setting.map(|v| (flag.to_string(), v.to_string())));
        node.start_agent().unwrap();
        let uid = format!("uid-{name}");
        node.api.set_pod(pod_object("apps", name, &uid, ip(&pod), &[], &[]));
        node.cni_add(&pod, "apps", name).unwrap_or_else(|e| panic!("ADD: {e}\n{}", node.agent_logs()));
        assert!(probe_set(&node).contains(&(ip(&pod), Some(uid))), "{name}");
        let found = branch_eni_rules(&node, &dev, ip(&pod));
        assert_eq!(found.len(), rules, "{name}: tcp_early_demux={early_demux} {flag}={setting:?}: {found:?}");
        node.stop_agent().unwrap();
    }
}
