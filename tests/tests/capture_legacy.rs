//! `weir istio-iptables` on nodes whose iptables is older than this host's, faked by
//! wrappers around this host's binaries put first on PATH (each logs how it was run,
//! which lock file it would take and how big the nsswitch.conf it sees is): an
//! iptables-legacy older than 1.8.6 (it reports 1.8.5 and ignores
//! `XTABLES_LOCKFILE`). A pod's commands never take the node's xtables lock (a
//! private mount namespace for old versions), and every legacy write waits for its
//! lock (`--wait`).

use std::{
    fs,
    os::{fd::AsRawFd as _, unix::fs::PermissionsExt as _},
    path::PathBuf,
    process::{Output, Stdio},
};

use weir_agent::sandbox::process::Mount;
use weir_tests::{
    Mesh, Placement, Pod, capture::in_pod, envoy::tempfile_dir::Dir, require_root, test_name, tools,
};

/// Wrappers around the host's iptables binaries, a log of their runs, and a `run/`
/// directory that stands for the node's /run in the command's mount namespace.
struct FakeIptables {
    dir: Dir,
}

impl FakeIptables {
    fn new(tag: &str) -> Self {
        let dir = Dir::new(tag).unwrap();
        for sub in ["bin", "run"] {
            fs::create_dir(dir.path().join(sub)).unwrap();
        }
        fs::write(dir.path().join("run/xtables.lock"), "").unwrap();
        fs::write(dir.path().join("calls"), "").unwrap();
        Self { dir }
    }

    /// `name`, wrapped: logs its arguments, the lock file /run/xtables.lock is
    /// (device:inode) and nsswitch.conf's size, then runs `body` (sh) with "$@".
    fn wrap(&self, name: &str, body: &str) {
        let log = self.dir.path().join("calls");
        let script = format!(
            "#!/bin/sh\necho \"{name} $* |lock=$(stat -Lc %d:%i /run/xtables.lock 2>/dev/null) \
             nss=$(wc -c </etc/nsswitch.conf 2>/dev/null)\" >> '{}'\n{body}\n",
            log.display()
        );
        let path = self.dir.path().join("bin").join(name);
        fs::write(&path, script).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// iptables-legacy (both families) as 1.8.5: the version it reports, and
    /// `XTABLES_LOCKFILE` ignored (1.8.6 was the first to read it).
    fn legacy_1_8_5(&self) {
        for base in ["iptables-legacy", "ip6tables-legacy"] {
            for name in [base.to_string(), format!("{base}-save"), format!("{base}-restore")] {
                let real = host_binary(&name);
                self.wrap(
                    &name,
                    &format!(
                        "unset XTABLES_LOCKFILE\n[ \"$1\" = --version ] && {{ echo \"{name} v1.8.5 (legacy)\"; exit 0; }}\n\
                         exec {} \"$@\"",
                        real.display()
                    ),
                );
            }
        }
    }

    /// PATH with the wrappers first.
    fn path(&self) -> String {
        format!("{}:{}", self.dir.path().join("bin").display(), std::env::var("PATH").unwrap_or_default())
    }

    /// The node's lock as the pod's commands see it, held by the test (`flock`, as
    /// iptables takes it) until the returned file is dropped.
    fn hold_node_lock(&self) -> fs::File {
        let file = fs::File::open(self.dir.path().join("run/xtables.lock")).unwrap();
        // SAFETY: flock(2) on a descriptor this test owns.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        assert_eq!(rc, 0, "take the test's node lock: {}", std::io::Error::last_os_error());
        file
    }

    /// The held lock's device:inode, as the wrappers print it.
    fn node_lock_id(&self) -> String {
        use std::os::unix::fs::MetadataExt as _;
        let meta = fs::metadata(self.dir.path().join("run/xtables.lock")).unwrap();
        format!("{}:{}", meta.dev(), meta.ino())
    }

    /// The wrappers' runs, one line each.
    fn calls(&self) -> Vec<String> {
        fs::read_to_string(self.dir.path().join("calls")).unwrap().lines().map(String::from).collect()
    }

    /// `program args` in `pod` as root with the wrappers first on PATH, `env` set,
    /// and `run/` over /run in its own mount namespace (so /run/xtables.lock is the
    /// test's file, never the host's).
    fn run(&self, pod: &Pod, program: &mut std::process::Command, env: &[(&str, &str)]) -> Output {
        program.env("PATH", self.path()).env("WEIR_LOG", "info").envs(env.iter().copied());
        program.stdout(Stdio::piped()).stderr(Stdio::piped());
        let run = self.dir.path().join("run");
        let mounts = [Mount::Bind { source: run, target: "/run".into(), read_only: false }];
        let placement = Placement { user: Some((0, 0)), mounts: &mounts, ..Placement::default() };
        pod.spawn_placed(program, placement).unwrap().into_inner().wait_with_output().unwrap()
    }

    /// `weir istio-iptables <args>` through [`FakeIptables::run`].
    fn istio_iptables(&self, pod: &Pod, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = tools::weir_command();
        cmd.arg("istio-iptables").args(args);
        self.run(pod, &mut cmd, env)
    }
}

/// Where `name` is on this host (PATH, then the sbin directories).
fn host_binary(name: &str) -> PathBuf {
    let path = std::env::var("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} is not installed (scripts/bootstrap installs iptables)"))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The injector's capture flags, for a CNI plugin working on the pod's namespace
/// (given as the command's own, since /run is the test's in its mount namespace).
const CNI_CAPTURE: &[&str] = &[
    "--cni-mode",
    "--network-namespace",
    "/proc/self/ns/net",
    "-p",
    "15001",
    "-z",
    "15006",
    "-u",
    "1337",
    "-i",
    "*",
    "-b",
    "*",
    "-d",
    "15090,15021,15020",
];

/// With iptables-legacy before 1.8.6, `XTABLES_LOCKFILE` does nothing: a pod's
/// commands would queue behind kube-proxy on the node's /run/xtables.lock. Weir runs
/// them (detection's test rule, the restore, the removal) with the pod's namespace
/// file mounted over that path in a mount namespace of their own, with --wait, and
/// nsswitch.conf hidden; the test holds the node's lock throughout.
#[test]
fn a_pods_rules_never_wait_on_the_nodes_lock_with_iptables_legacy_1_8_5() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    let fake = FakeIptables::new("xtables-lock");
    fake.legacy_1_8_5();
    let _held = fake.hold_node_lock();

    // The premise: a plain legacy write here waits for the held lock and gives up.
    let mut plain = std::process::Command::new("iptables-legacy");
    plain.args(["-t", "filter", "-A", "INPUT", "-p", "255", "-j", "RETURN", "--wait=1"]);
    let out = fake.run(&pod, &mut plain, &[]);
    assert!(!out.status.success(), "the test's lock is the one iptables takes here");
    assert!(stderr(&out).contains("holding the xtables lock"), "{}", stderr(&out));

    let premise = fake.calls().len();
    let legacy = [("FORCE_IPTABLES_BINARY", "legacy")];
    let out = fake.istio_iptables(&pod, CNI_CAPTURE, &legacy);
    assert!(out.status.success(), "{}", stderr(&out));
    let nat = in_pod(&pod, "iptables-legacy-save", &["-t", "nat"]);
    assert!(nat.contains("-A OUTPUT -j ISTIO_OUTPUT"), "rules went to legacy:\n{nat}");

    let mut cleanup = CNI_CAPTURE.to_vec();
    cleanup.push("--cleanup-only");
    let out = fake.istio_iptables(&pod, &cleanup, &legacy);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!in_pod(&pod, "iptables-legacy-save", &[]).contains("ISTIO"), "removed");

    let calls = fake.calls().split_off(premise);
    let writes: Vec<&String> = calls
        .iter()
        .filter(|c| {
            c.split_whitespace()
                .next()
                .is_some_and(|b| b.ends_with("-legacy") || b.ends_with("-legacy-restore"))
        })
        .collect();
    assert!(writes.iter().any(|w| w.contains(" -A INPUT -p 255 ")), "detection's test rule ran: {calls:#?}");
    assert!(writes.iter().filter(|w| w.starts_with("iptables-legacy-restore")).count() >= 1, "{calls:#?}");
    let node = format!("lock={}", fake.node_lock_id());
    for write in &writes {
        assert!(write.contains("--wait=30"), "every legacy write waits for its lock: {write}");
        assert!(!write.contains(&node), "a pod's write saw the node's lock: {write}");
        assert!(write.ends_with(" nss=0"), "nsswitch.conf hidden from a pod's command: {write}");
    }
}
