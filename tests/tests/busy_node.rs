//! Capture on a busy node (tests/src/busynode.rs): 62 pods under one `kubepods`
//! cgroup, two thirds meshed and captured by the CNI node agent with eBPF, a third
//! plain, every pod's client connecting to others all along. One after another: the
//! agent stopped, killed, started again after its record was lost, rolled to another
//! build and back; a sidecar killed and a
//! pod whose sidecar never listens; 20 pods added and deleted; a pod asking to exclude
//! 20 000 ranges; a connect storm; crafted SYNs; a link detached and a tc filter
//! deleted. After each: no connection got past a sidecar (checked at both ends), and
//! no connection failed between pods the event did not touch.
//!
//! `WEIR_BUSY_NODE_MINUTES=<n>` repeats the events for that long (the soak mode of
//! `scripts/soak busy-node`).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    process::Command,
    time::{Duration, Instant},
};

use weir_tests::{
    busynode::{BusyNode, now_ms},
    require_root, test_name, tools,
};

const MESHED: usize = 40;
const PLAIN: usize = 20;
/// The meshed pod whose sidecar never listens: every connection to it fails, none
/// reaches its app.
const NO_LISTENER: &str = "m-nolistener";
const SETTLE: Duration = Duration::from_secs(3);

/// Targets for pod `i`'s client: three meshed pods and one plain pod, spread so every
/// pod is someone's target.
fn targets(node: &BusyNode, i: usize) -> Vec<SocketAddr> {
    let meshed: Vec<&weir_tests::busynode::RigPod> =
        node.pods.iter().filter(|p| p.meshed && p.name != NO_LISTENER && p.name.starts_with('m')).collect();
    let plain: Vec<&weir_tests::busynode::RigPod> = node.pods.iter().filter(|p| !p.meshed).collect();
    let mut out: Vec<SocketAddr> = (1..=3).map(|k| meshed[(i * 7 + k * 11) % meshed.len()].addr()).collect();
    out.push(plain[(i * 3) % plain.len()].addr());
    out.retain(|a| *a != node.pods[i].addr());
    out
}

/// The pod name of each address.
fn names(node: &BusyNode) -> BTreeMap<String, String> {
    node.pods.iter().map(|p| (p.addr().to_string(), p.name.clone())).collect()
}

/// Runs `event`, lets traffic run, and holds the node to the rules: no bypass at all,
/// no failure between pods outside `touched`.
fn event(node: &mut BusyNode, what: &str, touched: &[&str], event: impl FnOnce(&mut BusyNode)) {
    let names_before = names(node);
    let mark = now_ms();
    let started = Instant::now();
    event(node);
    std::thread::sleep(SETTLE);
    let verdict = node.check(mark);
    let mut names = names(node);
    names.extend(names_before);
    assert!(verdict.bypasses.is_empty(), "{what}: connections got past a sidecar: {:?}", verdict.bypasses);
    let untouched = |pod: &str| !touched.contains(&pod) && pod != NO_LISTENER;
    let failed: Vec<String> = verdict
        .failures
        .iter()
        .filter(|((client, target), _)| {
            let target = names.get(target).map(String::as_str).unwrap_or(target);
            untouched(client) && untouched(target)
        })
        .map(|((c, t), n)| format!("{c} -> {} ({n})", names.get(t).unwrap_or(t)))
        .collect();
    assert!(
        failed.is_empty(),
        "{what}: connections failed between untouched pods: {failed:?}\nagent log:\n{}",
        node.agent_log()
    );
    assert!(verdict.ok > 0, "{what}: no connection succeeded at all");
    eprintln!(
        "busy node: {what}: {} connections, none past a sidecar ({:.1} s)",
        verdict.ok,
        started.elapsed().as_secs_f64()
    );
}

/// The id of the BPF link pinned at `path`, or None when nothing is pinned there or the
/// link is detached (bpftool shows a detached cgroup link without its cgroup).
fn pinned_link_id(path: &str) -> Option<u64> {
    let out = Command::new("bpftool").args(["-j", "link", "show", "pinned", path]).output().unwrap();
    if !out.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("bpftool link show pinned {path}: {e}: {}", String::from_utf8_lossy(&out.stdout))
    });
    let attached = v.get("cgroup_id").and_then(|c| c.as_u64()).is_some_and(|c| c != 0);
    attached.then(|| v["id"].as_u64()).flatten()
}

/// Waits until `done` says the tampering was repaired and `weir capture status` is live
/// again; says how long it took and whether the BROKEN window was seen on the way.
fn repaired(within: Duration, mut done: impl FnMut() -> bool) -> String {
    let started = Instant::now();
    let mut saw_broken = false;
    loop {
        let live = Command::new(tools::weir()).args(["capture", "status"]).output().unwrap().status.success();
        saw_broken |= !live;
        if live && done() {
            let seen = if saw_broken { "BROKEN seen meanwhile" } else { "repaired before status was polled" };
            return format!("{:.1} s ({seen})", started.elapsed().as_secs_f64());
        }
        assert!(started.elapsed() < within, "not repaired in {within:?} (status live: {live})");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn stop_clients(node: &mut BusyNode) {
    for p in &mut node.pods {
        p.client = None;
    }
}

fn start_clients(node: &mut BusyNode) {
    for i in 0..node.pods.len() {
        let name = &node.pods[i].name;
        let steady = name != NO_LISTENER && (name.starts_with('m') || name.starts_with('p'));
        if node.pods[i].client.is_none() && steady {
            let t = targets(node, i);
            node.start_client(i, &t, Duration::from_millis(400)).unwrap();
        }
    }
}

fn events(node: &mut BusyNode, old: &str, new: &str, round: usize) {
    event(node, "agent SIGTERMed and started again", &[], |n| {
        n.stop_agent(libc::SIGTERM).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        n.start_agent(old).unwrap();
    });
    event(node, "agent SIGKILLed and started again", &[], |n| {
        n.stop_agent(libc::SIGKILL).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        n.start_agent(old).unwrap();
    });
    // A new DaemonSet version that mounts another /run/weir: the node capture's record
    // is gone, its pins are not. The start adopts them; nothing is detached.
    event(node, "agent stopped, its record lost, started again", &[], |n| {
        n.stop_agent(libc::SIGTERM).unwrap();
        std::fs::remove_file(weir_agent::capture::ebpf::record::PinRecord::path(&n.capture)).unwrap();
        n.start_agent(old).unwrap();
        assert!(n.agent_log().contains("without its record: adopted"), "{}", n.agent_log());
    });
    let newcomer = format!("m-new{round}");
    event(node, "rolled to another build, a pod added", &[&newcomer], |n| {
        n.stop_agent(libc::SIGTERM).unwrap();
        n.start_agent(new).unwrap();
        let i = n.add_pod(&newcomer, true, &[]).unwrap();
        n.start_workload(i).unwrap();
        let t = targets(n, i);
        n.start_client(i, &t, Duration::from_millis(400)).unwrap();
    });
    let record = weir_agent::node::cni::ebpf::pod_records(&node.capture)
        .into_iter()
        .find(|r| r.k8s_pod.as_deref() == Some(&format!("busy/{newcomer}")))
        .expect("the newcomer's record");
    assert!(
        record.programs.as_deref().is_some_and(|k| k.ends_with(new)),
        "registered with the new build's set"
    );
    event(node, "rolled back", &[&newcomer], |n| {
        n.stop_agent(libc::SIGTERM).unwrap();
        n.start_agent(old).unwrap();
    });
    let m0 = node.pod("m0");
    event(node, "a sidecar killed", &["m0"], |n| n.pods[m0].sidecar = None);
    event(node, "the sidecar back", &["m0"], |n| n.start_sidecar(m0).unwrap());
    event(node, "the sidecar settled", &[], |_| {});
    let churn: Vec<String> = (0..20).map(|i| format!("c{round}-{i}")).collect();
    let churn_refs: Vec<&str> = churn.iter().map(String::as_str).collect();
    event(node, "20 pods added and deleted", &churn_refs, |n| {
        for name in &churn {
            let i = n.add_pod(name, true, &[]).unwrap();
            n.start_workload(i).unwrap();
        }
        std::thread::sleep(Duration::from_secs(1));
        for name in &churn {
            let i = n.pod(name);
            n.delete_pod(i).unwrap();
        }
    });
    event(node, "a pod asking to exclude 20 000 ranges", &[], |n| {
        let ranges: Vec<String> =
            (0..20_000u32).map(|i| format!("11.{}.{}.0/24", i / 256, i % 256)).collect();
        let annotation = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
        let e = n.add_refused(&format!("greedy{round}"), &[(annotation, &ranges.join(","))]).unwrap();
        assert!(e.contains(annotation) && e.contains("256"), "{e}");
    });
    let m2 = node.pod("m2");
    event(node, "a connect storm (70 000 connects, nothing on 15001)", &["m2"], |n| {
        n.pods[m2].sidecar = None;
        let p = &n.pods[m2];
        let placed = weir_tests::Placement {
            netns: Some(&p.ns),
            cgroup: Some(&p.cgroup),
            user: Some((1000, 1000)),
            ..Default::default()
        };
        let out = weir_tests::cni::run_placed(
            placed,
            tools::testkit_command(),
            // Each connect may take 2 s (an emulated VM stalls for longer than the
            // default 100 ms): only one that is neither made nor refused counts.
            &["connect-storm", "10.99.0.1:80", "70000", "2000", "20"],
        );
        assert!(out.starts_with("connected 0 refused 70000"), "{out}");
        n.start_sidecar(m2).unwrap();
    });
    let (m3, p3) = (node.pod("m3"), node.pod("p3"));
    event(node, "crafted SYNs", &[], |n| {
        let mac = weir_agent::capture::ebpf::netns::interface_mac(n.pods[m3].ns.path(), "eth0").unwrap();
        let mac = mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
        let (src, dst) = (n.pods[p3].ip.clone(), n.pods[m3].ip.clone());
        for (shape, expected) in [("plain", "syn-ack"), ("fragments", "nothing"), ("fragments", "nothing")] {
            let args = ["syn-probe", "eth0", &mac, &src, &dst, "8080", shape];
            let said = weir_tests::cni::run_in(&n.pods[p3].ns, None, tools::testkit_command(), &args);
            assert_eq!(said, expected, "{shape} SYN");
        }
    });
    // Tampering by the node's root cannot be kept out of the data path while it lasts:
    // traffic pauses; health must see it and the agent or repair must restore it.
    stop_clients(node);
    // The agent may repair faster than `weir capture status` can be polled, so the
    // repair is told by what changed (a new link pinned, the filter back);
    // capture_cli shows status calling each fault BROKEN when nothing repairs it.
    let link = format!("/sys/fs/bpf/weir/{}/links/weir_connect4", node.capture);
    let before = pinned_link_id(&link).expect("the node's connect4 link is pinned");
    let out = Command::new("bpftool").args(["link", "detach", "pinned", &link]).output().unwrap();
    assert!(out.status.success(), "bpftool link detach: {}", String::from_utf8_lossy(&out.stderr));
    let took = repaired(Duration::from_secs(10), || pinned_link_id(&link).is_some_and(|id| id != before));
    eprintln!("busy node: a detached node link was attached again in {took}");
    let m4 = node.pod("m4");
    let filters = |n: &BusyNode| {
        weir_tests::cni::run_in(
            &n.pods[m4].ns,
            None,
            Command::new("tc"),
            &["filter", "show", "dev", "eth0", "ingress"],
        )
    };
    assert!(filters(node).contains("bpf"), "m4 has its inbound filter: {}", filters(node));
    weir_tests::cni::run_in(
        &node.pods[m4].ns,
        None,
        Command::new("tc"),
        &["filter", "del", "dev", "eth0", "ingress"],
    );
    let took = repaired(Duration::from_secs(10), || filters(node).contains("bpf"));
    eprintln!("busy node: a deleted inbound filter was restored by repair in {took}");
    event(node, "traffic after the tampering was repaired", &[], start_clients);
}

#[test]
fn capture_holds_on_a_busy_node() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let (old, new) = (
        weir_agent::sandbox::unique_name("busy-a").replace('-', "_"),
        weir_agent::sandbox::unique_name("busy-b").replace('-', "_"),
    );
    let mut node = BusyNode::new(&test, &old).unwrap();
    for i in 0..MESHED {
        let p = node.add_pod(&format!("m{i}"), true, &[]).unwrap();
        node.start_workload(p).unwrap();
    }
    for i in 0..PLAIN {
        let p = node.add_pod(&format!("p{i}"), false, &[]).unwrap();
        node.start_workload(p).unwrap();
    }
    let nolistener = node.add_pod(NO_LISTENER, true, &[]).unwrap();
    // Its app listens; its sidecar never does.
    node.start_app(nolistener).unwrap();
    start_clients(&mut node);
    // One plain pod also calls the pod without a listener: refused, never its app.
    let p1 = node.pod("p1");
    let mut t = targets(&node, p1);
    t.push(node.pods[nolistener].addr());
    node.pods[p1].client = None;
    node.start_client(p1, &t, Duration::from_millis(400)).unwrap();
    std::thread::sleep(SETTLE);

    event(&mut node, "traffic on a busy node", &[], |_| {});
    let minutes: u64 = std::env::var("WEIR_BUSY_NODE_MINUTES").ok().and_then(|m| m.parse().ok()).unwrap_or(0);
    let until = Instant::now() + Duration::from_secs(minutes * 60);
    let mut round = 0;
    loop {
        events(&mut node, &old, &new, round);
        round += 1;
        if Instant::now() >= until {
            break;
        }
    }

    // The pod without a listener was called all along and never answered by its app.
    let v = node.check(0);
    let refused =
        v.failures.iter().filter(|((c, t), _)| c == "p1" && *t == node.pods[nolistener].addr().to_string());
    assert!(refused.map(|(_, n)| n).sum::<usize>() > 0, "the pod without a listener was called");
    assert!(v.bypasses.is_empty(), "{:?}", v.bypasses);
    // Non-mesh pods on the shared cgroup: large getsockopt answers come back whole.
    let (plain, meshed) = (node.pod("p4"), node.pod("m5"));
    for i in [plain, meshed] {
        let p = &node.pods[i];
        let rules: String =
            (0..400).map(|k| format!("-A INPUT -s 10.200.{}.{}/32 -j ACCEPT\n", k / 250, k % 250)).collect();
        let table = node.logs_path().join(format!("table-{}", p.name));
        std::fs::write(&table, format!("*filter\n:INPUT ACCEPT [0:0]\n{rules}COMMIT\n")).unwrap();
        let restore = weir_tests::cni::try_run_placed(
            weir_tests::Placement { netns: Some(&p.ns), ..Default::default() },
            Command::new("iptables-legacy-restore"),
            &[table.to_str().unwrap()],
        );
        assert!(restore.is_ok(), "{restore:?}");
        let placed =
            weir_tests::Placement { netns: Some(&p.ns), cgroup: Some(&p.cgroup), ..Default::default() };
        let saved =
            weir_tests::cni::run_placed(placed, Command::new("iptables-legacy-save"), &["-t", "filter"]);
        assert_eq!(saved.lines().filter(|l| l.starts_with("-A INPUT")).count(), 400, "{}", p.name);
    }
    let captured: BTreeSet<String> = weir_agent::node::cni::ebpf::pod_records(&node.capture)
        .into_iter()
        .filter_map(|r| r.k8s_pod)
        .collect();
    assert!(captured.contains("busy/m0") && !captured.contains("busy/p0"), "meshed pods only: {captured:?}");
}
