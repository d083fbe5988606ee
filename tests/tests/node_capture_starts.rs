//! A node agent start that fails or is refused never takes capture away from a pod.
//! On a small busy node (tests/src/busynode.rs: meshed pods with a sidecar stand-in,
//! a plain pod, clients calling each other all along), the agent is stopped and what
//! it left on the node is changed the ways a real node changes it: the node capture's
//! record lost (a new DaemonSet version mounting another /run/weir), a stray pin beside
//! its links, its pins gone while the record stays, a record naming another build, a
//! capture of another name on the same cgroup, every record lost before an uninstall.
//! Each start then has one defined outcome (adopted, refused naming the pins and the
//! command, attached again), and through all of it no connection gets past a sidecar
//! and the links that captured the pods are the same links afterwards.
//!
//! Before: the lost record made the next start pin over the old links (EEXIST) and its
//! error path removed every pin under the capture's folder, detaching every program.

use std::{collections::BTreeMap, process::Command, time::Duration};

use weir_tests::{
    busynode::{BusyNode, now_ms},
    require_root, test_name,
};

const SETTLE: Duration = Duration::from_secs(2);

/// The cgroup hooks one node capture attaches (each program once).
const HOOKS: usize = weir_agent::capture::ebpf::capture::CGROUP_HOOKS;

/// A node with two meshed pods and a plain one, every pod's client calling the other two.
fn small_node(test: &str) -> (BusyNode, String) {
    let set = weir_agent::sandbox::unique_name("st").replace('-', "_");
    let mut node = BusyNode::new(test, &set).unwrap();
    for (name, meshed) in [("m0", true), ("m1", true), ("p0", false)] {
        let i = node.add_pod(name, meshed, &[]).unwrap();
        node.start_workload(i).unwrap();
    }
    for i in 0..node.pods.len() {
        let targets: Vec<_> = (0..node.pods.len()).filter(|j| *j != i).map(|j| node.pods[j].addr()).collect();
        node.start_client(i, &targets, Duration::from_millis(200)).unwrap();
    }
    std::thread::sleep(SETTLE);
    (node, set)
}

/// Holds the node to the rule since `mark`: no connection got past a sidecar, none
/// failed, and some were made.
fn no_bypass(node: &BusyNode, mark: u128, what: &str) {
    std::thread::sleep(SETTLE);
    let v = node.check(mark);
    assert!(v.bypasses.is_empty(), "{what}: connections got past a sidecar: {:?}", v.bypasses);
    assert!(v.failures.is_empty(), "{what}: connections failed: {:?}\n{}", v.failures, node.agent_log());
    assert!(v.ok > 0, "{what}: no connection was made at all");
    eprintln!("{what}: {} connections, none past a sidecar", v.ok);
}

/// The kernel id of each link pinned under capture `name`'s folder (bpftool), by hook;
/// only links attached to a cgroup count.
fn link_ids(name: &str) -> BTreeMap<String, u64> {
    let dir = weir_agent::capture::ebpf::record::pin_dir(name).join("links");
    let Ok(entries) = std::fs::read_dir(&dir) else { return BTreeMap::new() };
    let mut out = BTreeMap::new();
    // Hooks' pins only (a test's stray pin beside them is no link).
    for e in entries.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("weir_")) {
        let path = e.path();
        let o = Command::new("bpftool").args(["-j", "link", "show", "pinned"]).arg(&path).output().unwrap();
        assert!(
            o.status.success(),
            "bpftool link show pinned {}: {}",
            path.display(),
            String::from_utf8_lossy(&o.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        if v.get("cgroup_id").and_then(serde_json::Value::as_u64).is_some_and(|c| c != 0) {
            out.insert(e.file_name().to_string_lossy().into_owned(), v["id"].as_u64().unwrap());
        }
    }
    out
}

/// The names of the programs attached to the node's pods' cgroup (one line per link).
fn attached(node: &BusyNode) -> Vec<String> {
    weir_tests::capture::cgroup_programs(node.kubepods.path())
}

fn record_path(name: &str) -> std::path::PathBuf {
    weir_agent::capture::ebpf::record::PinRecord::path(name)
}

fn remove_record(name: &str) {
    std::fs::remove_file(record_path(name)).unwrap_or_else(|e| panic!("remove the record of {name}: {e}"));
}

/// The lost record: the start adopts the pins (the same ten links, never detached),
/// rewrites the record from them, and new pods are captured as before.

#[test]
fn pins_found_without_their_record_are_adopted_and_stay_attached() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let (mut node, set) = small_node(&test_name!());
    let capture = node.capture.clone();
    let before = link_ids(&capture);
    assert_eq!(before.len(), HOOKS, "the node capture's hooks, each once: {before:?}");
    let key = weir_agent::capture::ebpf::record::PinRecord::load(&capture).unwrap().programs;

    let mark = now_ms();
    node.stop_agent(libc::SIGTERM).unwrap();
    remove_record(&capture);
    node.start_agent(&set).unwrap();
    let log = node.agent_log();
    assert!(log.contains("node capture found on bpffs without its record: adopted"), "{log}");
    assert_eq!(link_ids(&capture), before, "the same links, never detached or pinned again");
    assert_eq!(
        attached(&node).len(),
        HOOKS,
        "each program on the cgroup once, not twice: {:?}",
        attached(&node)
    );
    let record =
        weir_agent::capture::ebpf::record::PinRecord::load(&capture).expect("the record written again");
    assert_eq!((record.programs, record.cgroup.as_path()), (key, node.kubepods.path()));
    let i = node.add_pod("m2", true, &[]).unwrap();
    node.start_workload(i).unwrap();
    let targets = [node.pods[0].addr()];
    node.start_client(i, &targets, Duration::from_millis(200)).unwrap();
    no_bypass(&node, mark, "record lost, agent started again");
}

/// Pins that are not a capture Weir can take up (here a stray pin beside the links,
/// without the record): the agent refuses to start, naming the pins and the command
/// that resolves it, and leaves every link attached; once the stray pin is gone, the
/// next start adopts the rest.
#[test]
fn pins_that_do_not_check_out_are_refused_and_left_attached() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let (mut node, set) = small_node(&test_name!());
    let capture = node.capture.clone();
    let before = link_ids(&capture);
    let links = weir_agent::capture::ebpf::record::pin_dir(&capture).join("links");
    let key = weir_agent::capture::ebpf::record::PinRecord::load(&capture).unwrap().programs.unwrap();
    let map = weir_agent::capture::ebpf::set::set_dir(&key).join("maps/POD_CONFIG");
    let stray = links.join("stray");

    let mark = now_ms();
    node.stop_agent(libc::SIGTERM).unwrap();
    remove_record(&capture);
    let o = Command::new("bpftool").args(["map", "pin", "pinned"]).arg(&map).arg(&stray).output().unwrap();
    assert!(o.status.success(), "bpftool map pin: {}", String::from_utf8_lossy(&o.stderr));
    let log = node.start_agent_refused(&set).unwrap();
    for needle in [
        format!("the node capture {capture} has pins under"),
        "no record".to_string(),
        format!("{} cannot be read as a link", stray.display()),
        "left attached".to_string(),
        format!("weir cni uninstall --ebpf-name {capture}"),
    ] {
        assert!(log.contains(&needle), "the refusal names {needle:?}: {log}");
    }
    assert_eq!(link_ids(&capture), before, "every link left attached");
    assert!(!record_path(&capture).exists(), "no record written for pins it refused");
    no_bypass(&node, mark, "a start refused");

    std::fs::remove_file(&stray).unwrap();
    let mark = now_ms();
    node.start_agent(&set).unwrap();
    assert_eq!(link_ids(&capture), before, "adopted once the stray pin is gone");
    no_bypass(&node, mark, "started once the pins check out");
}

/// A record whose pins are gone (removed from bpffs: the pods' outbound capture went
/// with them, which this test does not hold Weir to; traffic pauses): the start
/// attaches again, the pods registered before are captured, and the record stays.
#[test]
fn a_record_whose_pins_are_gone_is_attached_again() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let (mut node, set) = small_node(&test_name!());
    let capture = node.capture.clone();
    node.stop_agent(libc::SIGTERM).unwrap();
    let clients: Vec<_> = node.pods.iter_mut().map(|p| p.client.take()).collect();
    drop(clients);
    std::fs::remove_dir_all(weir_agent::capture::ebpf::record::pin_dir(&capture)).unwrap();
    assert!(attached(&node).is_empty(), "the pins held the links: {:?}", attached(&node));
    node.start_agent(&set).unwrap();
    assert_eq!(link_ids(&capture).len(), HOOKS, "attached again");
    let mark = now_ms();
    for i in 0..node.pods.len() {
        let targets: Vec<_> = (0..node.pods.len()).filter(|j| *j != i).map(|j| node.pods[j].addr()).collect();
        node.start_client(i, &targets, Duration::from_millis(200)).unwrap();
    }
    no_bypass(&node, mark, "pins lost, agent started again");
}

/// A record naming another build's set while the pins run this build's: the pins
/// decide (the record is rewritten from them), nothing is detached or attached twice.
#[test]
fn a_record_of_another_build_over_this_builds_pins_is_rewritten_from_the_pins() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let (mut node, set) = small_node(&test_name!());
    let capture = node.capture.clone();
    let before = link_ids(&capture);
    let mut record = weir_agent::capture::ebpf::record::PinRecord::load(&capture).unwrap();
    let key = record.programs.clone();
    let mark = now_ms();
    node.stop_agent(libc::SIGTERM).unwrap();
    record.programs = Some("0_0_0-000000000000".into());
    record.save().unwrap();
    node.start_agent(&set).unwrap();
    assert_eq!(link_ids(&capture), before, "the same links");
    assert_eq!(attached(&node).len(), HOOKS, "{:?}", attached(&node));
    assert_eq!(weir_agent::capture::ebpf::record::PinRecord::load(&capture).unwrap().programs, key);
    assert!(
        weir_agent::capture::ebpf::record::PinRecord::load(&format!("{capture}-set-0_0_0-000000000000"))
            .is_none(),
        "no capture kept for a set that is not there"
    );
    no_bypass(&node, mark, "a record of another build");
}

/// A capture of another name on the same cgroup (a new manifest renamed it): the start
/// is refused, naming the capture there and both ways out; nothing is attached twice
/// and the capture that runs keeps running.
#[test]
fn a_capture_of_another_name_on_the_cgroup_is_refused_not_doubled() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let (mut node, set) = small_node(&test_name!());
    let capture = node.capture.clone();
    let before = link_ids(&capture);
    let mark = now_ms();
    node.stop_agent(libc::SIGTERM).unwrap();
    let renamed = weir_agent::sandbox::unique_name("renamed");
    node.capture = renamed.clone();
    let refused = node.start_agent_refused(&set);
    node.capture = capture.clone();
    let log = refused.unwrap();
    for needle in [
        format!("is captured already by the node capture {capture}"),
        format!("--ebpf-name {capture}"),
        "--detach-running-pods".to_string(),
    ] {
        assert!(log.contains(&needle), "the refusal names {needle:?}: {log}");
    }
    assert!(!weir_agent::capture::ebpf::record::pin_dir(&renamed).exists(), "nothing pinned under {renamed}");
    assert_eq!(attached(&node).len(), HOOKS, "never attached twice: {:?}", attached(&node));
    assert_eq!(link_ids(&capture), before);
    no_bypass(&node, mark, "a second name refused");
    node.start_agent(&set).unwrap();
}

/// Every record lost (another /run/weir), then `weir cni uninstall` without
/// `--detach-running-pods`: the pods registered in the set's maps keep their capture;
/// only the explicit flag takes it away.
#[test]
fn uninstall_counts_registered_pods_in_the_maps_not_in_records() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let (mut node, _set) = small_node(&test_name!());
    let capture = node.capture.clone();
    let before = link_ids(&capture);
    let mark = now_ms();
    node.stop_agent(libc::SIGTERM).unwrap();
    for record in weir_agent::capture::ebpf::record::PinRecord::load_all() {
        if record.pod == capture || record.pod.starts_with(&format!("{capture}-")) {
            remove_record(&record.pod);
        }
    }
    let out = node.uninstall(false).unwrap();
    assert!(out.contains("stays for the 2 pods still registered"), "{out}");
    assert_eq!(link_ids(&capture), before, "kept for the registered pods");
    no_bypass(&node, mark, "uninstall without --detach-running-pods, records lost");
}
