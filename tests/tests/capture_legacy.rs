//! `weir istio-iptables` on nodes whose iptables is older or odder than this host's,
//! faked by wrappers around this host's binaries put first on PATH (each logs how it
//! was run, which lock file it would take and how big the nsswitch.conf it sees is):
//! an iptables-legacy older than 1.8.6 (it reports 1.8.5 and ignores
//! `XTABLES_LOCKFILE`), a legacy without `iptable_nat`, a node without IPv6. Istio
//! 1.29–1.30's sidecar-side answers: a pod's commands never take the node's xtables
//! lock (a private mount namespace for old versions), every legacy write waits for its
//! lock (`--wait`), detection falls back to iptables-nft when the nat table cannot be
//! used, FORCE_IPTABLES_BINARY chooses, and a node without ip6tables is fine while
//! IPv6 is off.

use std::{
    fs,
    os::{fd::AsRawFd as _, unix::fs::PermissionsExt as _},
    path::PathBuf,
    process::{Output, Stdio},
};

use weir_agent::sandbox::process::Mount;
use weir_tests::{
    Mesh, Placement, Pod,
    capture::{capture_state, in_pod},
    envoy::tempfile_dir::Dir,
    require_root, test_name, tools,
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

    /// Every ip6tables binary failing as on a kernel booted without IPv6.
    fn no_ipv6(&self) {
        for base in ["ip6tables", "ip6tables-legacy", "ip6tables-nft"] {
            for name in [base.to_string(), format!("{base}-save"), format!("{base}-restore")] {
                self.wrap(
                    &name,
                    &format!(
                        "echo \"{name} v1.8.9: can't initialize ip6tables table \\`filter': Address family not \
                         supported by protocol\" >&2\nexit 3"
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

/// FORCE_IPTABLES_BINARY chooses the flavour whatever the namespace holds (Istio
/// 1.29, istio/istio#57976): `nft` here puts the rules in nf_tables beside another's
/// legacy rule, which detection alone would follow.
#[test]
fn force_iptables_binary_overrides_detection() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    in_pod(
        &pod,
        "iptables-legacy",
        &["-t", "filter", "-A", "INPUT", "-p", "tcp", "--dport", "9", "-j", "ACCEPT"],
    );
    let fake = FakeIptables::new("force-binary");
    let out = fake.istio_iptables(&pod, &CNI_CAPTURE[3..], &[("FORCE_IPTABLES_BINARY", "nft")]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(in_pod(&pod, "iptables-nft-save", &["-t", "nat"]).contains("ISTIO_OUTPUT"));
    assert!(!in_pod(&pod, "iptables-legacy-save", &[]).contains("ISTIO"), "nothing went to legacy");
    let out = fake.istio_iptables(&pod, &CNI_CAPTURE[3..], &[("FORCE_IPTABLES_BINARY", "iptables")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("FORCE_IPTABLES_BINARY") && stderr(&out).contains("legacy or nft"),
        "{}",
        stderr(&out)
    );
}

/// A node whose iptables-legacy holds rules but whose kernel lacks `iptable_nat`:
/// detection's test rule goes to nat, fails there, and the run moves on to
/// iptables-nft (istio/istio#57385) instead of failing half-way in legacy.
#[test]
fn detection_falls_back_to_nft_without_iptable_nat() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    in_pod(
        &pod,
        "iptables-legacy",
        &["-t", "filter", "-A", "INPUT", "-p", "tcp", "--dport", "9", "-j", "ACCEPT"],
    );
    let fake = FakeIptables::new("no-iptable-nat");
    let real = host_binary("iptables-legacy");
    fake.wrap(
        "iptables-legacy",
        &format!(
            "case \" $* \" in *\" nat \"*) echo \"iptables v1.8.9 (legacy): can't initialize iptables table \
             \\`nat': Table does not exist (do you need to insmod?)\" >&2; exit 3;; esac\nexec {} \"$@\"",
            real.display()
        ),
    );
    let out = fake.istio_iptables(&pod, &CNI_CAPTURE[3..], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        fake.calls().iter().any(|c| c.starts_with("iptables-legacy -t nat -A INPUT -p 255")),
        "legacy was tried"
    );
    assert!(
        in_pod(&pod, "iptables-nft-save", &["-t", "nat"]).contains("ISTIO_OUTPUT"),
        "the rules are in nf_tables"
    );
    let legacy = in_pod(&pod, "iptables-legacy-save", &[]);
    assert!(!legacy.contains("ISTIO") && legacy.contains("--dport 9 -j ACCEPT"), "{legacy}");
}

/// A node booted without IPv6 has no working ip6tables: an IPv4 pod is captured (the
/// fast path and Istio's detection both go on without it, as Istio's does while
/// IPv6 is off); a dual-stack pod's run fails, naming it, and applies nothing.
#[test]
fn a_node_without_ipv6_captures_ipv4_pods() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    let fake = FakeIptables::new("no-ipv6");
    fake.no_ipv6();
    for path in ["fast", "full"] {
        if path == "full" {
            // Another's empty chain: the fast path declines, Istio's detection runs.
            in_pod(&pod, "iptables-nft", &["-t", "filter", "-N", "OTHERS"]);
        }
        let out = fake.istio_iptables(&pod, &CNI_CAPTURE[3..], &[]);
        assert!(out.status.success(), "{path}: {}", stderr(&out));
        assert!(stderr(&out).contains(&format!("path={path}")), "{}", stderr(&out));
        assert!(in_pod(&pod, "iptables-nft-save", &["-t", "nat"]).contains("ISTIO_OUTPUT"), "{path}");
        if path == "full" {
            assert!(stderr(&out).contains("continuing because IPv6 is disabled"), "{}", stderr(&out));
        }
        let mut cleanup = CNI_CAPTURE[3..].to_vec();
        cleanup.push("--cleanup-only");
        let out = fake.istio_iptables(&pod, &cleanup, &[]);
        assert!(out.status.success(), "{path}: {}", stderr(&out));
        assert_eq!(capture_state(&pod), "");
    }
    let mut dual = CNI_CAPTURE[3..].to_vec();
    dual.push("--dual-stack");
    let out = fake.istio_iptables(&pod, &dual, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("ip6tables"), "{}", stderr(&out));
    assert_eq!(capture_state(&pod), "", "nothing applied");
}
