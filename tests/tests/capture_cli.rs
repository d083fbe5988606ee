//! `weir capture` as an init container runs it: attach and pin, exit 0, capture stays
//! live; status shows it; re-running updates it in place; clean removes every program,
//! link, pin and classifier, and is idempotent. Also backend detection.

use std::process::{Command, Output, Stdio};

use weir_tests::{
    Placement,
    capture::{CaptureScene, Family, PinnedCapture, ask_placed, capture_state, captured, in_pod},
    require_root, test_cgroup, test_name, tools,
};

fn weir(args: &[&str]) -> Output {
    Command::new(tools::weir())
        .args(args)
        .env("WEIR_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

fn ok(out: &Output, what: &str) -> String {
    assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn pinned_capture_outlives_the_command_and_cleans_up_completely() {
    require_root!();
    // Declared first, dropped last: a bpffs this test mounted is unmounted, pass or fail.
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V4, &cgroup);
    let pod = cgroup.path().file_name().unwrap().to_string_lossy().into_owned();
    // Whatever the test reaches, the pinned capture goes before the cgroup and bpffs.
    let _pins = PinnedCapture(pod.clone());
    let cg = cgroup.path().to_str().unwrap();
    let netns = s.client.netns().path().to_str().unwrap();
    let attach = [
        "capture", "ebpf", "--cgroup", cg, "--netns", netns, "-p", "15001", "-z", "15006", "-u", "1337",
        "-i", "*", "-b", "*", "-d", "15021",
    ];
    ok(&weir(&attach), "weir capture ebpf");

    // The command has exited; capture is live.
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    let server = s.addr(&s.server, 8080);
    let line = ask_placed(&s.client, app, server);
    assert_eq!(captured(&line).map(|(_, o)| o), Some(server.to_string()), "{line}");
    assert!(
        weir_tests::capture::ask(&s.server, 0, s.addr(&s.client, 8080)).starts_with("captured "),
        "inbound classifier pinned too"
    );

    let status: serde_json::Value =
        serde_json::from_str(&ok(&weir(&["capture", "status", "--json", "--pod", pod.as_str()]), "status"))
            .unwrap();
    let mine = status
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pod"] == pod)
        .unwrap_or_else(|| panic!("status lists the pod {pod}: {status}"));
    assert_eq!(mine["live"], true, "{mine}");
    assert!(mine["counters"]["redirected"].as_u64().unwrap() >= 1, "{mine}");
    assert!(mine["links"].as_array().unwrap().iter().any(|l| l == "weir_connect4"), "{mine}");
    assert_eq!(mine["registered"], true, "{mine}");
    ok(&weir(&["capture", "log", "on", "--pod", &pod]), "log on");
    ok(&weir(&["capture", "log", "off", "--pod", &pod]), "log off");

    // Re-running updates the configuration in place (here: exclude the server).
    let mut again: Vec<String> = attach.iter().map(|s| s.to_string()).collect();
    again.extend(["-x".into(), format!("{}/32", s.server.ipv4())]);
    let again: Vec<&str> = again.iter().map(String::as_str).collect();
    let out = weir(&again);
    ok(&out, "weir capture ebpf, again");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("updated in place"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(ask_placed(&s.client, app, server).starts_with("hello server "), "the new -x applies at once");

    for _ in 0..2 {
        ok(&weir(&["capture", "clean", "--cgroup", cg]), "clean");
    }
    assert!(!weir_agent::capture::ebpf::record::pin_dir(&pod).exists(), "pins removed");
    let attached = weir_tests::capture::cgroup_programs(cgroup.path());
    assert!(attached.is_empty(), "no program left on the cgroup: {attached:?}");
    assert!(weir_tests::capture::inbound_programs(&s.client).is_empty());
    assert!(
        ask_placed(&s.client, app, s.addr(&s.server2, 8080)).starts_with("hello server2 "),
        "uncaptured after clean"
    );
    assert!(weir_tests::capture::ask(&s.server, 0, s.addr(&s.client, 8080)).starts_with("hello app "));
}

#[test]
fn detection_prefers_ebpf_here_and_apply_falls_back_when_told() {
    require_root!();
    let out = ok(&weir(&["capture", "detect"]), "detect");
    assert!(out.starts_with("ebpf\n"), "this kernel runs eBPF capture: {out}");
    assert!(
        ok(&weir(&["capture", "detect", "--capture-mode", "nftables"]), "detect nft")
            .starts_with("nftables\n")
    );

    let test = test_name!();
    let s = CaptureScene::new(&test, Family::V4, false);
    let netns = s.client.netns().path().to_str().unwrap();
    let cg = "/nonexistent-cgroup";
    let out = weir(&[
        "capture",
        "apply",
        "--capture-mode",
        "nftables",
        "--cgroup",
        cg,
        "--netns",
        netns,
        "-u",
        "1337",
        "-i",
        "*",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("capture backend: nftables"));
    assert!(capture_state(&s.client).contains("istio-proxy-nat"), "nft rules in the pod");
    assert!(captured(&weir_tests::capture::ask(&s.client, 1000, s.addr(&s.server, 8080))).is_some());
    // The host namespace was not touched.
    assert!(!in_pod(&s.server, "nft", &["list", "tables"]).contains("istio"));
}

#[test]
fn ebpf_limits_are_named_errors() {
    require_root!();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let out =
        weir(&["capture", "ebpf", "--cgroup", cgroup.path().to_str().unwrap(), "-c", "eth1", "-i", "*"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("-c/--istio-exclude-interfaces"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out =
        weir(&["capture", "ebpf", "--cgroup", cgroup.path().to_str().unwrap(), "-o", "8000:8080", "-i", "*"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("port ranges"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `weir capture ebpf` with a program set of the test's own (so tests running beside
/// it never share it) and the log level that shows when the set is loaded.
fn weir_in_set(set: &str, args: &[&str]) -> Output {
    Command::new(tools::weir())
        .args(args)
        .env("WEIR_LOG", "info")
        .env(weir_agent::capture::ebpf::set::SET_ENV, set)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

/// The arguments that capture the pod in `netns` on `cgroup`: outbound and inbound.
fn attach_args<'a>(cgroup: &'a str, netns: &'a str) -> Vec<&'a str> {
    vec![
        "capture", "ebpf", "--cgroup", cgroup, "--netns", netns, "-p", "15001", "-z", "15006", "-u", "1337",
        "-i", "*", "-b", "*", "-d", "15021",
    ]
}

/// The program set a pinned capture uses, from `weir capture status`.
fn program_set_of(pod: &str) -> String {
    let status: serde_json::Value =
        serde_json::from_str(&ok(&weir(&["capture", "status", "--json", "--pod", pod]), "status")).unwrap();
    let mine = status
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pod"] == pod)
        .unwrap_or_else(|| panic!("status lists the pod {pod}: {status}"));
    assert_eq!(mine["registered"], true, "{mine}");
    mine["program_set"].as_str().unwrap_or_else(|| panic!("no program set: {mine}")).to_string()
}

/// The kernel id of the program `name` attached to `cgroup` (bpftool's first column).
fn attached_id(cgroup: &std::path::Path, name: &str) -> u32 {
    let lines = weir_tests::capture::cgroup_programs(cgroup);
    let line = lines.iter().find(|l| l.split_whitespace().last() == Some(name));
    let line = line.unwrap_or_else(|| panic!("{name} not attached to {}: {lines:?}", cgroup.display()));
    line.split_whitespace().next().unwrap().parse().unwrap()
}

/// What of a program set is left under /sys/fs/bpf/weir/programs.
fn set_pinned(key: &str) -> bool {
    weir_agent::capture::ebpf::set::set_dir(key).exists()
}

/// Removes a program set the test made, whatever it reached (after its captures).
struct SetGuard(String);

impl Drop for SetGuard {
    fn drop(&mut self) {
        if let Ok(Some(set)) = weir_agent::capture::ebpf::set::NodePrograms::open_existing(&self.0) {
            let _ = set.release();
        }
    }
}

fn set_loads(out: &Output) -> usize {
    String::from_utf8_lossy(&out.stderr).matches("eBPF capture programs loaded and verified").count()
}

#[test]
fn a_second_pod_reuses_the_node_programs_and_the_last_pod_removes_them() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let set = weir_agent::sandbox::unique_name("second-pod");
    let scenes: Vec<(weir_tests::Cgroup, CaptureScene)> = ["a", "b"]
        .iter()
        .map(|tag| {
            let cgroup = test_cgroup(&format!("{test}-{tag}"));
            let scene = CaptureScene::in_cgroup(&format!("{test}-{tag}"), Family::V4, &cgroup);
            (cgroup, scene)
        })
        .collect();
    let pods: Vec<String> =
        scenes.iter().map(|(c, _)| c.path().file_name().unwrap().to_string_lossy().into_owned()).collect();
    let _pins: Vec<PinnedCapture> = pods.iter().cloned().map(PinnedCapture).collect();
    let mut loads = 0;
    for (cgroup, scene) in &scenes {
        let out = weir_in_set(
            &set,
            &attach_args(cgroup.path().to_str().unwrap(), scene.client.netns().path().to_str().unwrap()),
        );
        ok(&out, "weir capture ebpf");
        loads += set_loads(&out);
    }
    let key = program_set_of(&pods[0]);
    let _set = SetGuard(key.clone());
    assert!(key.ends_with(&set), "the set's key carries the suffix: {key}");
    assert_eq!(program_set_of(&pods[1]), key, "the second pod uses the first pod's set");
    assert_eq!(loads, 1, "the programs were loaded once");
    for program in ["weir_connect4", "weir_sockops", "weir_getsockopt"] {
        assert_eq!(
            attached_id(scenes[0].0.path(), program),
            attached_id(scenes[1].0.path(), program),
            "{program}: one program in the kernel serves both pods"
        );
    }
    // Both pods are captured, outbound and inbound.
    for (cgroup, s) in &scenes {
        let app = Placement { user: Some((1000, 1000)), cgroup: Some(cgroup), ..Placement::default() };
        let server = s.addr(&s.server, 8080);
        let line = ask_placed(&s.client, app, server);
        assert_eq!(captured(&line).map(|(_, o)| o), Some(server.to_string()), "{line}");
        let line = weir_tests::capture::ask(&s.server, 0, s.addr(&s.client, 8080));
        assert!(line.starts_with("captured "), "inbound through the node classifier: {line}");
    }

    // The first pod goes: the set stays for the second, which stays captured.
    ok(&weir(&["capture", "clean", "--pod", &pods[0]]), "clean the first pod");
    assert!(set_pinned(&key), "the set outlived a pod that still uses it");
    let (cgroup, s) = &scenes[1];
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(cgroup), ..Placement::default() };
    assert!(
        captured(&ask_placed(&s.client, app, s.addr(&s.server, 8080))).is_some(),
        "second pod still captured"
    );
    let (cgroup, s) = &scenes[0];
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(cgroup), ..Placement::default() };
    assert!(
        ask_placed(&s.client, app, s.addr(&s.server, 8080)).starts_with("hello server "),
        "first pod uncaptured"
    );

    // The last pod goes: so does the set, and nothing of this test is left in bpffs.
    ok(&weir(&["capture", "clean", "--pod", &pods[1]]), "clean the second pod");
    assert!(!set_pinned(&key), "the set is removed with its last pod");
    let root = std::path::Path::new(weir_agent::capture::ebpf::bpffs::PIN_ROOT);
    let left: Vec<String> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .chain(std::fs::read_dir(root.join("programs")).into_iter().flatten())
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| pods.contains(n) || n.ends_with(&set))
        .collect();
    assert!(left.is_empty(), "left under {}: {left:?}", root.display());
    for (cgroup, s) in &scenes {
        assert!(weir_tests::capture::cgroup_programs(cgroup.path()).is_empty());
        assert!(weir_tests::capture::inbound_programs(&s.client).is_empty());
    }
}

#[test]
fn programs_pinned_under_another_version_key_are_not_reused() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let set = weir_agent::sandbox::unique_name("other-version");
    // Another Weir's set: its key names another version (the objects here are ours,
    // what matters is that the key differs).
    let foreign = format!("0_0_0-000000000000-{set}");
    let _foreign_guard = SetGuard(foreign.clone());
    let foreign_ids =
        weir_agent::capture::ebpf::set::NodePrograms::acquire_key(&foreign).unwrap().program_ids().unwrap();
    let cgroup = test_cgroup(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V4, &cgroup);
    let pod = cgroup.path().file_name().unwrap().to_string_lossy().into_owned();
    let _pins = PinnedCapture(pod.clone());
    let out = weir_in_set(
        &set,
        &attach_args(cgroup.path().to_str().unwrap(), s.client.netns().path().to_str().unwrap()),
    );
    ok(&out, "weir capture ebpf");
    assert_eq!(set_loads(&out), 1, "this Weir loaded its own set: {}", String::from_utf8_lossy(&out.stderr));
    let key = program_set_of(&pod);
    let _set = SetGuard(key.clone());
    assert_ne!(key, foreign);
    let connect4 = attached_id(cgroup.path(), "weir_connect4");
    assert_ne!(
        Some(&connect4),
        foreign_ids.get("weir_connect4"),
        "the foreign set's program is not on the pod"
    );
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    assert!(captured(&ask_placed(&s.client, app, s.addr(&s.server, 8080))).is_some());

    ok(&weir(&["capture", "clean", "--pod", &pod]), "clean");
    assert!(!set_pinned(&key), "this Weir's set went with its pod");
    assert!(set_pinned(&foreign), "the other version's set is left to its own pods");
}

#[test]
fn pods_starting_together_load_one_set() {
    require_root!();
    const PODS: usize = 4;
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let set = weir_agent::sandbox::unique_name("together");
    let mesh = weir_tests::Mesh::new(&test).unwrap();
    let pods: Vec<weir_tests::Pod> = (0..PODS).map(|i| mesh.pod(&format!("p{i}")).unwrap()).collect();
    let cgroups: Vec<weir_tests::Cgroup> = (0..PODS).map(|i| test_cgroup(&format!("{test}-{i}"))).collect();
    let names: Vec<String> =
        cgroups.iter().map(|c| c.path().file_name().unwrap().to_string_lossy().into_owned()).collect();
    let _pins: Vec<PinnedCapture> = names.iter().cloned().map(PinnedCapture).collect();
    let children: Vec<std::process::Child> = pods
        .iter()
        .zip(&cgroups)
        .map(|(pod, cgroup)| {
            Command::new(tools::weir())
                .args(attach_args(cgroup.path().to_str().unwrap(), pod.netns().path().to_str().unwrap()))
                .env("WEIR_LOG", "info")
                .env(weir_agent::capture::ebpf::set::SET_ENV, &set)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    for out in &outs {
        ok(out, "weir capture ebpf, started together");
    }
    assert_eq!(outs.iter().map(set_loads).sum::<usize>(), 1, "one of them loaded the set");
    let key = program_set_of(&names[0]);
    let _set = SetGuard(key.clone());
    let sets: Vec<String> =
        weir_agent::capture::ebpf::set::pinned_keys().into_iter().filter(|k| k.ends_with(&set)).collect();
    assert_eq!(sets, vec![key.clone()], "one set");
    let id = attached_id(cgroups[0].path(), "weir_connect4");
    for (name, cgroup) in names.iter().zip(&cgroups) {
        assert_eq!(program_set_of(name), key);
        assert_eq!(attached_id(cgroup.path(), "weir_connect4"), id, "{name}");
    }
    for name in &names {
        ok(&weir(&["capture", "clean", "--pod", name]), "clean");
    }
    assert!(!set_pinned(&key), "the set went with the last of them");
}

#[test]
fn a_namespace_no_process_of_the_cgroup_is_in_is_refused_unless_allowed() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let set = weir_agent::sandbox::unique_name("trap");
    let mesh = weir_tests::Mesh::new(&test).unwrap();
    let pod = mesh.pod("app").unwrap();
    let cgroup = test_cgroup(&test);
    let name = cgroup.path().file_name().unwrap().to_string_lossy().into_owned();
    let _pins = PinnedCapture(name.clone());
    let cg = cgroup.path().to_str().unwrap().to_string();
    // The pod's process, in the pod's cgroup and namespace.
    let mut sleep = Command::new("sleep");
    sleep.arg("600");
    let _app =
        pod.spawn_placed(&mut sleep, Placement { cgroup: Some(&cgroup), ..Placement::default() }).unwrap();
    // Outbound only: nothing attaches to this (the host's) interfaces.
    let args = ["capture", "ebpf", "--cgroup", cg.as_str(), "-p", "15001", "-u", "1337", "-i", "*"];

    // From outside the pod without --netns: refused, naming the cgroup and namespace.
    let out = weir_in_set(&set, &args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&cg) && err.contains("net:[") && err.contains("--allow-netns-mismatch"), "{err}");
    assert!(weir_agent::capture::ebpf::record::PinRecord::load(&name).is_none(), "nothing registered");
    assert!(weir_tests::capture::cgroup_programs(cgroup.path()).is_empty(), "nothing attached");

    // From inside the pod (as an init container runs it): accepted.
    let inside = pod
        .spawn_placed(
            Command::new(tools::weir())
                .args(args)
                .env("WEIR_LOG", "warn")
                .env(weir_agent::capture::ebpf::set::SET_ENV, &set)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
            Placement { cgroup: Some(&cgroup), ..Placement::default() },
        )
        .unwrap()
        .into_inner()
        .wait_with_output()
        .unwrap();
    ok(&inside, "weir capture ebpf inside the pod");
    let key = program_set_of(&name);
    let _set = SetGuard(key.clone());
    ok(&weir(&["capture", "clean", "--pod", &name]), "clean");

    // The override registers this namespace anyway.
    let mut allowed = args.to_vec();
    allowed.push("--allow-netns-mismatch");
    ok(&weir_in_set(&set, &allowed), "weir capture ebpf --allow-netns-mismatch");
    let record = weir_agent::capture::ebpf::record::PinRecord::load(&name).expect("registered");
    assert_eq!(record.netns_cookie, weir_agent::capture::ebpf::netns::netns_cookie(None).unwrap());
    ok(&weir(&["capture", "clean", "--pod", &name]), "clean");
    assert!(!set_pinned(&key));
    let help = ok(&weir(&["capture", "ebpf", "--help"]), "help");
    assert!(help.contains("--allow-netns-mismatch"), "{help}");
}

#[test]
fn automatic_backend_choice_verifies_the_programs_once() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let set = weir_agent::sandbox::unique_name("auto");
    let mesh = weir_tests::Mesh::new(&test).unwrap();
    let cgroups: Vec<weir_tests::Cgroup> = (0..2).map(|i| test_cgroup(&format!("{test}-{i}"))).collect();
    let names: Vec<String> =
        cgroups.iter().map(|c| c.path().file_name().unwrap().to_string_lossy().into_owned()).collect();
    let _pins: Vec<PinnedCapture> = names.iter().cloned().map(PinnedCapture).collect();
    let (mut loads, mut pods) = (Vec::new(), Vec::new());
    for (i, cgroup) in cgroups.iter().enumerate() {
        // Kept until the end: a pod whose namespace is gone has its capture collected.
        pods.push(mesh.pod(&format!("p{i}")).unwrap());
        let pod = pods.last().unwrap();
        let (cg, netns) = (cgroup.path().to_str().unwrap(), pod.netns().path().to_str().unwrap());
        let mut args = attach_args(cg, netns);
        args[1] = "apply";
        let out = weir_in_set(&set, &args);
        ok(&out, "weir capture apply");
        assert!(String::from_utf8_lossy(&out.stderr).contains("capture backend: ebpf"));
        loads.push(set_loads(&out));
    }
    let _set = SetGuard(program_set_of(&names[0]));
    // Detection and capture in one process load the programs once; a node that has
    // them loads nothing.
    assert_eq!(loads, vec![1, 0]);
    for name in &names {
        ok(&weir(&["capture", "clean", "--pod", name]), "clean");
    }
}

/// A private mount namespace with a bpffs and a `/run/weir` of its own, held open by a
/// sleeping process: captures made in it are pinned where nothing else on the machine
/// sees them (so their bpffs can be unmounted under them), and go when it goes, pass or
/// fail: dropping it ends the namespace, and with it the bpffs and every pin in it.
struct PrivateMounts(std::process::Child);

impl PrivateMounts {
    fn new() -> Self {
        let script = "set -e; while grep -q ' /sys/fs/bpf ' /proc/self/mounts; do umount /sys/fs/bpf; done; \
                      mount -t bpf bpf /sys/fs/bpf; mkdir -p /run/weir; mount -t tmpfs weir-test /run/weir; \
                      echo ready; exec sleep infinity";
        let mut child = Command::new("unshare")
            .args(["--mount", "--propagation", "slave", "--", "sh", "-c", script])
            .stdout(Stdio::piped())
            .spawn()
            .expect("run unshare");
        let stdout = child.stdout.take().unwrap();
        let held = Self(child);
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).unwrap();
        assert_eq!(line.trim(), "ready", "the private mount namespace was not set up");
        held
    }

    /// Runs `program` in the namespace (its mounts only; network and cgroup are ours).
    fn run(&self, program: &str, args: &[&str]) -> Output {
        Command::new("nsenter")
            .arg(format!("--mount=/proc/{}/ns/mnt", self.0.id()))
            .arg("--")
            .arg(program)
            .args(args)
            .env("WEIR_LOG", "warn")
            .output()
            .expect("run nsenter")
    }

    fn weir(&self, args: &[&str]) -> Output {
        self.run(tools::weir().to_str().unwrap(), args)
    }

    /// `weir capture status --json --pod pod`: whether it exited 0, and the pod's entry.
    fn status(&self, pod: &str) -> (bool, serde_json::Value) {
        let out = self.weir(&["capture", "status", "--json", "--pod", pod]);
        let all: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("status --json: {e}: {}", String::from_utf8_lossy(&out.stderr)));
        let mine = all.as_array().unwrap().iter().find(|p| p["pod"] == pod).expect("status lists the pod");
        (out.status.success(), mine.clone())
    }
}

impl Drop for PrivateMounts {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Init-container mode has nothing that unregisters a pod when it goes: the next
/// capture on the node collects the captures of pods whose namespace or cgroup is gone,
/// and `weir capture clean --gone` does too (with the program set, once unused).
/// Before, their registrations, pins and records stayed until the node's maps filled.
#[test]
fn captures_of_pods_that_are_gone_are_collected() {
    require_root!();
    let test = test_name!();
    let mesh = weir_tests::Mesh::new(&test).unwrap();
    let mounts = PrivateMounts::new();
    let mut pods: Vec<(weir_tests::Cgroup, weir_tests::Pod)> =
        (0..3).map(|i| (test_cgroup(&format!("{test}-{i}")), mesh.pod(&format!("p{i}")).unwrap())).collect();
    let name = |c: &weir_tests::Cgroup| c.path().file_name().unwrap().to_string_lossy().into_owned();
    let capture = |(cgroup, pod): &(weir_tests::Cgroup, weir_tests::Pod)| {
        let (cg, netns) = (cgroup.path().to_str().unwrap(), pod.netns().path().to_str().unwrap());
        ok(&mounts.weir(&attach_args(cg, netns)), "weir capture ebpf");
    };
    let listed = || {
        let out = mounts.weir(&["capture", "status", "--json"]);
        let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        all.as_array().unwrap().iter().map(|p| p["pod"].as_str().unwrap().to_string()).collect::<Vec<_>>()
    };
    capture(&pods[0]);
    capture(&pods[1]);
    let first = name(&pods[0].0);
    let second = name(&pods[1].0);
    // Pod 0 goes: its namespace and cgroup are removed, nothing unregisters it.
    let (cgroup, pod) = pods.remove(0);
    drop(pod);
    cgroup.remove().unwrap();
    let (exit0, mine) = mounts.status(&first);
    assert!(!exit0 && mine["faults"].to_string().contains("network namespace is gone"), "{mine}");
    // The next capture on the node (pod 2's) collects it.
    capture(&pods[1]);
    assert!(!listed().contains(&first), "pod 0's capture collected: {:?}", listed());
    assert!(listed().contains(&second) && listed().len() == 2, "{:?}", listed());
    // `clean --gone` collects the rest once they go, and the set nothing uses then.
    let gone: Vec<String> = pods.iter().map(|(c, _)| name(c)).collect();
    for (cgroup, pod) in pods {
        drop(pod);
        cgroup.remove().unwrap();
    }
    let out = mounts.weir(&["capture", "clean", "--gone"]);
    let said = ok(&out, "clean --gone") + &String::from_utf8_lossy(&out.stderr);
    for pod in &gone {
        assert!(said.contains(&format!("removed the eBPF capture of {pod}: the pod is gone")), "{said}");
    }
    assert!(listed().is_empty(), "{:?}", listed());
    let sets = mounts.run("sh", &["-c", "ls /sys/fs/bpf/weir/programs 2>/dev/null | wc -l"]);
    assert_eq!(String::from_utf8_lossy(&sets.stdout).trim(), "0", "the program set went with its last pod");
}

/// A pod is collected only on evidence that it is gone, never because its namespace
/// path cannot be seen: with `/run/netns` hidden (a node agent's container without the
/// host's), and with the namespace's bind mount gone while a process still runs in it,
/// the pod stays registered and captured. When nothing holds its namespace any more it
/// is collected. Before, both removed the capture of a running pod (its traffic then
/// went around its sidecar).
#[test]
fn a_pod_is_collected_only_on_evidence_that_it_is_gone() {
    require_root!();
    let test = test_name!();
    let mesh = weir_tests::Mesh::new(&test).unwrap();
    let mounts = PrivateMounts::new();
    let cgroup = test_cgroup(&test);
    let pod = mesh.pod("p0").unwrap();
    let name = cgroup.path().file_name().unwrap().to_string_lossy().into_owned();
    let netns = pod.netns().path().to_path_buf();
    let args = attach_args(cgroup.path().to_str().unwrap(), netns.to_str().unwrap());
    ok(&mounts.weir(&args), "weir capture ebpf");
    let listed = || {
        let out = mounts.weir(&["capture", "status", "--json"]);
        let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        all.as_array().unwrap().iter().any(|p| p["pod"] == name.as_str())
    };
    let clean_gone = || {
        let o = mounts.weir(&["capture", "clean", "--gone"]);
        eprintln!("{}", String::from_utf8_lossy(&o.stderr));
        ok(&o, "clean --gone")
    };

    // 1. /run/netns hidden from the collector (only in its mount namespace).
    ok(&mounts.run("mount", &["-t", "tmpfs", "hide-netns", "/run/netns"]), "hide /run/netns");
    clean_gone();
    assert!(listed(), "collected although its namespace was merely out of sight");
    ok(&mounts.run("umount", &["/run/netns"]), "show /run/netns again");

    // 2. The bind mount gone, a process still in the namespace: the pod lives on.
    let sleeper = pod.spawn(std::process::Command::new("sleep").arg("600"), 0).unwrap();
    weir_agent::sandbox::netns::remove(&netns).unwrap();
    assert!(!netns.exists(), "the namespace's path is gone");
    clean_gone();
    assert!(listed(), "collected although a process still runs in its namespace");

    // 3. Nothing holds the namespace any more: collected.
    drop(sleeper);
    drop(pod);
    clean_gone();
    assert!(!listed(), "the pod whose namespace is gone was not collected");
    drop(cgroup);
}

/// A pod that starts while the gone-pod collector reads the node is never taken for
/// gone: its namespace is made and it is registered between the collector's two reads
/// (records, then namespaces), and it stays registered. Before, the namespaces were
/// read first: such a pod was judged on a view older than its namespace, and its
/// capture removed while it ran (until repair's next pass, its traffic went around
/// its sidecar).
#[test]
fn a_pod_that_starts_while_the_collector_reads_the_node_is_kept() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let mesh = weir_tests::Mesh::new(&test).unwrap();
    let cgroup = test_cgroup(&test);
    let name = cgroup.path().file_name().unwrap().to_string_lossy().into_owned();
    let _capture = PinnedCapture(name.clone());
    let mut pod = None;
    let (view, removed) =
        weir_agent::capture::ebpf::gc::collect_gone_pods_with(std::path::Path::new("/proc"), || {
            let started = mesh.pod("p0").unwrap();
            let netns = started.netns().path().to_str().unwrap().to_string();
            ok(&weir(&attach_args(cgroup.path().to_str().unwrap(), &netns)), "weir capture ebpf");
            pod = Some(started);
        });
    assert!(view.is_ok(), "the collector could not read the node: {:?}", view.err());
    assert!(
        !removed.iter().any(|(p, _)| *p == name),
        "the pod that started meanwhile was collected: {removed:?}"
    );
    let record = weir_agent::capture::ebpf::record::PinRecord::load(&name).expect("the pod's capture record");
    assert!(record.netns_cookie != 0, "{record:?}");
    drop(pod);
}

#[test]
fn removed_pins_and_an_unmounted_bpffs_are_reported_and_capture_apply_repairs_them() {
    require_root!();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V4, &cgroup);
    // Declared after the scene: dropped first, taking every pin made in it along.
    let mounts = PrivateMounts::new();
    let pod = cgroup.path().file_name().unwrap().to_string_lossy().into_owned();
    let cg = cgroup.path().to_str().unwrap();
    let netns = s.client.netns().path().to_str().unwrap();
    let args = [
        "--cgroup", cg, "--netns", netns, "-p", "15001", "-z", "15006", "-u", "1337", "-i", "*", "-b", "*",
        "-d", "15021",
    ];
    let with = |first: &[&'static str]| -> Vec<&str> { first.iter().copied().chain(args).collect() };
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    let server = s.addr(&s.server, 8080);
    let outbound_captured = || {
        let line = ask_placed(&s.client, app, server);
        match captured(&line) {
            Some((_, orig)) => orig == server.to_string(),
            None if line.starts_with("hello server ") => false,
            None => panic!("neither captured nor answered by the server: {line}"),
        }
    };
    let inbound_captured =
        || weir_tests::capture::ask(&s.server, 0, s.addr(&s.client, 8080)).starts_with("captured ");
    let live = |why: &str| {
        let (exit0, mine) = mounts.status(&pod);
        assert!(exit0 && mine["live"] == true && mine["faults"] == serde_json::json!([]), "{why}: {mine}");
    };

    ok(&mounts.weir(&with(&["capture", "ebpf"])), "weir capture ebpf");
    assert!(outbound_captured() && inbound_captured(), "captured");
    live("after capture");

    // 1. The pod's pins removed: its cgroup links went with them, the pod is not
    // captured, and status says which and how to repair.
    ok(&mounts.run("rm", &["-r", &format!("/sys/fs/bpf/weir/{pod}")]), "rm the pod's pins");
    assert!(!outbound_captured(), "the fault is real: without its links the pod is not captured");
    let (exit0, mine) = mounts.status(&pod);
    assert!(!exit0, "status exits 1 on a broken capture: {mine}");
    assert_eq!(mine["live"], false, "{mine}");
    let faults = mine["faults"].to_string();
    assert!(faults.contains(&format!("its pins (/sys/fs/bpf/weir/{pod}) are gone")), "{faults}");
    let text = mounts.weir(&["capture", "status", "--pod", &pod]);
    let shown = String::from_utf8_lossy(&text.stdout);
    assert!(
        !text.status.success() && shown.contains("BROKEN: its pins") && shown.contains("weir capture apply"),
        "{shown}"
    );
    let out = mounts.weir(&with(&["capture", "apply"]));
    let said = ok(&out, "weir capture apply repairs") + &String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("was broken") && said.contains("capturing it again"), "{said}");
    assert!(outbound_captured() && inbound_captured(), "repaired");
    live("after the repair of removed pins");

    // 2. bpffs unmounted under the capture: every pin (the node's program set too) is
    // gone, the links with them. The inbound filter holds its program and stays.
    ok(&mounts.run("umount", &["/sys/fs/bpf"]), "umount bpffs");
    assert!(!outbound_captured(), "the fault is real: with bpffs gone the pod is not captured");
    let (exit0, mine) = mounts.status(&pod);
    assert!(!exit0, "{mine}");
    assert_eq!(mine["faults"].as_array().map(Vec::len), Some(1), "{mine}");
    assert!(mine["faults"][0].as_str().unwrap().starts_with("bpffs is not mounted at /sys/fs/bpf"), "{mine}");
    ok(&mounts.weir(&with(&["capture", "ebpf"])), "weir capture ebpf repairs (mounting bpffs)");
    assert!(outbound_captured() && inbound_captured(), "repaired");
    live("after the repair of an unmounted bpffs");
    let classifiers = weir_tests::capture::inbound_programs(&s.client);
    assert_eq!(classifiers, ["weir_inbound"], "one inbound classifier, not the old one besides");

    // 3. A link detached behind Weir's back (`bpftool link detach`): still pinned, but
    // the hook no longer runs. Before, status said live: it looked at pins only.
    let connect4 = format!("/sys/fs/bpf/weir/{pod}/links/weir_connect4");
    ok(&mounts.run("bpftool", &["link", "detach", "pinned", &connect4]), "bpftool link detach");
    assert!(!outbound_captured(), "the fault is real: a detached connect4 captures nothing");
    let (exit0, mine) = mounts.status(&pod);
    assert!(!exit0, "{mine}");
    assert!(
        mine["faults"].to_string().contains("pinned but detached from the cgroup: weir_connect4"),
        "{mine}"
    );
    let out = mounts.weir(&with(&["capture", "apply"]));
    let said = ok(&out, "weir capture apply repairs") + &String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("was broken"), "{said}");
    assert!(outbound_captured() && inbound_captured(), "repaired");
    live("after the repair of a detached link");

    // 4. The inbound filter deleted from the pod's interface.
    weir_tests::cni::run_in(
        s.client.netns(),
        None,
        Command::new("tc"),
        &["filter", "del", "dev", "eth0", "ingress"],
    );
    let (exit0, mine) = mounts.status(&pod);
    assert!(!exit0, "{mine}");
    assert!(mine["faults"].to_string().contains("no Weir inbound filter on eth0"), "{mine}");
    ok(&mounts.weir(&with(&["capture", "apply"])), "weir capture apply repairs the filter");
    assert!(outbound_captured() && inbound_captured(), "repaired");
    live("after the repair of a deleted filter");

    // 5. A check that cannot be made: the pod's interface renamed (its filter follows
    // it and still captures, but cannot be listed under the recorded name). Status
    // says the capture cannot be confirmed; capturing again refuses to tear down a
    // capture it could not check, and leaves it live. Before, a failed listing read as
    // "filter found"; and a repair for it would have torn the capture down and then
    // failed to attach to eth0, leaving the pod uncaptured.
    let rename = |from: &str, to: &str| {
        for args in [
            vec!["link", "set", from, "down"],
            vec!["link", "set", from, "name", to],
            vec!["link", "set", to, "up"],
        ] {
            weir_tests::cni::run_in(s.client.netns(), None, Command::new("ip"), &args);
        }
    };
    rename("eth0", "weir-renamed0");
    let (exit0, mine) = mounts.status(&pod);
    assert!(!exit0 && mine["live"] == false, "{mine}");
    assert!(mine["faults"].to_string().contains("cannot check the inbound filters on eth0"), "{mine}");
    let out = mounts.weir(&with(&["capture", "ebpf"]));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("cannot confirm the eBPF capture"), "{said}");
    assert!(outbound_captured() && inbound_captured(), "a capture that could not be checked was torn down");
    rename("weir-renamed0", "eth0");
    live("with eth0 back");

    // Clean removes the repaired capture completely.
    ok(&mounts.weir(&["capture", "clean", "--pod", &pod]), "clean");
    assert!(weir_tests::capture::cgroup_programs(cgroup.path()).is_empty(), "no program left on the cgroup");
    assert!(weir_tests::capture::inbound_programs(&s.client).is_empty(), "no inbound classifier left");
    assert!(!outbound_captured(), "uncaptured after clean");
    let out = mounts.weir(&["capture", "status", "--json"]);
    assert_eq!(ok(&out, "status after clean").trim(), "[]");
}

/// A pod's capture whose record was lost (another /run/weir, `/run` cleaned) while its
/// pins stayed: capturing the pod again takes the live links up (the same link ids,
/// each program once, not twice), keeps it registered and writes its record again; pins
/// of this name that attach elsewhere are refused and left. Before, the second run
/// attached ten more links, failed to pin them (EEXIST), and its error path removed
/// every pin under the pod's folder and the pod's registration: the pod uncaptured.
#[test]
fn a_pod_capture_found_without_its_record_is_taken_up_not_torn_down() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V4, &cgroup);
    let pod = cgroup.path().file_name().unwrap().to_string_lossy().into_owned();
    let _pins = PinnedCapture(pod.clone());
    let (cg, netns) = (cgroup.path().to_str().unwrap(), s.client.netns().path().to_str().unwrap());
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    let server = s.addr(&s.server, 8080);
    let outbound =
        || captured(&ask_placed(&s.client, app, server)).map(|(_, o)| o) == Some(server.to_string());
    let inbound = || weir_tests::capture::ask(&s.server, 0, s.addr(&s.client, 8080)).starts_with("captured ");
    ok(&weir(&attach_args(cg, netns)), "weir capture ebpf");
    assert!(outbound() && inbound(), "captured");
    let ids = |hook: &str| attached_id(cgroup.path(), hook);
    let before: Vec<u32> =
        ["weir_connect4", "weir_sockops", "weir_getsockopt"].iter().map(|h| ids(h)).collect();

    let record = weir_agent::capture::ebpf::record::PinRecord::path(&pod);
    std::fs::remove_file(&record).unwrap();
    let out = weir(&attach_args(cg, netns));
    ok(&out, "weir capture ebpf with the record lost");
    assert!(outbound() && inbound(), "still captured: {}", String::from_utf8_lossy(&out.stderr));
    let after: Vec<u32> =
        ["weir_connect4", "weir_sockops", "weir_getsockopt"].iter().map(|h| ids(h)).collect();
    assert_eq!(before, after, "the same programs on the cgroup");
    assert_eq!(
        weir_tests::capture::cgroup_programs(cgroup.path()).len(),
        weir_agent::capture::ebpf::capture::CGROUP_HOOKS,
        "each hook once, not twice"
    );
    assert!(record.exists(), "the record written again");
    assert!(weir(&["capture", "status", "--pod", &pod]).status.success(), "status: live");

    // The same name on another cgroup: the pins attach elsewhere; refused, left as they are.
    std::fs::remove_file(&record).unwrap();
    let other = test_cgroup(&format!("{test}-other"));
    let out = weir(
        &attach_args(other.path().to_str().unwrap(), netns)
            .into_iter()
            .chain(["--pod", &pod])
            .collect::<Vec<_>>(),
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "another cgroup's capture under the same name: {said}");
    assert!(
        said.contains(&format!("/sys/fs/bpf/weir/{pod}/links/")) && said.contains("did not make"),
        "{said}"
    );
    assert!(
        weir_tests::capture::cgroup_programs(other.path()).is_empty(),
        "nothing attached to the other cgroup"
    );
    assert!(outbound() && inbound(), "the pod keeps its capture");
}
