//! Weir from a checkout no other user can walk into: a clone under `/root` (0700, as
//! Debian makes it), a path with a space, on a file system of its own. The build is
//! copied under such a directory (a tmpfs mounted `mode=0700` in this test's private
//! mount namespace, at `<tmpfs>/my checkout`) and run from there as the README's
//! commands run it: the demo (its apps as 1000, Envoy as 1337) and a capture test (the
//! app as 1000, the proxy stand-in as 1337). Nothing there can be reached by path by
//! those users; everything Weir hands them must go through descriptors it opened.

use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    process::Command,
};

use nix::{
    mount::{MntFlags, MsFlags, mount, umount2},
    sched::{CloneFlags, unshare},
};
use weir_tests::{
    Placement,
    capture::{CaptureScene, Family, PinnedCapture, ask_placed, captured},
    demo::assert_demo_works,
    envoy::tempfile_dir::Dir,
    require_root, test_cgroup, test_name, tools,
};

/// What the copied test executable prints when the capture test passed in it.
const CAPTURE_PASSED: &str = "private-checkout capture passed";

/// A tmpfs (mode 0700, root's) mounted in this thread's own mount namespace; children
/// started from this thread see it, the host does not, and it goes with the test.
struct PrivateFs {
    mountpoint: Dir,
}

impl PrivateFs {
    fn new() -> Self {
        let mountpoint = Dir::new("private-checkout").unwrap();
        unshare(CloneFlags::CLONE_NEWNS).expect("unshare the mount namespace");
        mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
            .expect("make mounts private");
        mount(Some("tmpfs"), mountpoint.path(), Some("tmpfs"), MsFlags::empty(), Some("mode=0700,size=2g"))
            .expect("mount a tmpfs");
        Self { mountpoint }
    }

    fn path(&self) -> &Path {
        self.mountpoint.path()
    }
}

impl Drop for PrivateFs {
    fn drop(&mut self) {
        let _ = umount2(self.mountpoint.path(), MntFlags::MNT_DETACH);
    }
}

fn copy_executable(from: &Path, to: &Path) {
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(from, to).unwrap_or_else(|e| panic!("copy {} to {}: {e}", from.display(), to.display()));
}

#[test]
fn the_demo_and_a_capture_test_run_from_a_private_checkout_on_another_file_system() {
    require_root!();
    let fs = PrivateFs::new();
    let checkout = fs.path().join("my checkout");
    let debug = checkout.join("target/debug");
    copy_executable(&tools::weir(), &debug.join("weir"));
    copy_executable(&tools::testkit(), &debug.join("weir-testkit"));
    let me = std::env::current_exe().unwrap();
    let copied_test = debug.join("deps").join(me.file_name().unwrap());
    copy_executable(&me, &copied_test);
    copy_executable(&weir_tests::envoy::binary().unwrap(), &checkout.join(".tools/bin/envoy"));
    for unreachable in [&debug.join("weir"), &copied_test] {
        assert!(
            !reachable_by_app(unreachable),
            "{} must be out of reach for this test",
            unreachable.display()
        );
    }

    // The demo finds Envoy in the checkout itself (no WEIR_ENVOY, no .tools on PATH).
    let path: &OsStr = OsStr::new("/usr/sbin:/usr/bin:/sbin:/bin");
    assert_demo_works(&debug.join("weir"), "ebpf", &[("PATH", path)]);

    // A capture test, run by the copied test executable with the copied binaries.
    let out = Command::new(&copied_test)
        .args(["--exact", "capture_works_from_the_build_this_executable_sits_in", "--nocapture"])
        .args(["--test-threads", "1"])
        .env("PATH", path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the copied capture test failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("{CAPTURE_PASSED}: {}", debug.join("weir-testkit").display())),
        "the copied capture test did not run with the copied binaries:\n{stdout}\n{stderr}"
    );
}

/// Whether uid 1000 could open `path` by name (asked of a child running as 1000).
fn reachable_by_app(path: &PathBuf) -> bool {
    let mut cmd = Command::new("test");
    cmd.arg("-e").arg(path);
    let placement = Placement { user: Some((1000, 1000)), ..Placement::default() };
    let mut child = weir_agent::sandbox::process::spawn(&mut cmd, placement).expect("spawn test -e");
    child.child_mut().wait().expect("wait test -e").success()
}

/// eBPF capture attached by `weir capture ebpf`, an app as 1000 captured to the proxy
/// stand-in as 1337, all started from the binaries next to this test executable.
#[test]
fn capture_works_from_the_build_this_executable_sits_in() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let cgroup = test_cgroup(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V4, &cgroup);
    let pod = cgroup.path().file_name().unwrap().to_string_lossy().into_owned();
    let _pins = PinnedCapture(pod);
    let cg = cgroup.path().to_str().unwrap();
    let netns = s.client.netns().path().to_str().unwrap();
    let out = tools::weir_command()
        .args(["capture", "ebpf", "--cgroup", cg, "--netns", netns, "-p", "15001", "-u", "1337", "-i", "*"])
        .env("WEIR_LOG", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "weir capture ebpf: {}", String::from_utf8_lossy(&out.stderr));
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&cgroup), ..Placement::default() };
    let server = s.addr(&s.server, 8080);
    let line = ask_placed(&s.client, app, server);
    assert_eq!(captured(&line).map(|(_, orig)| orig), Some(server.to_string()), "{line}");
    let clean = tools::weir_command().args(["capture", "clean", "--cgroup", cg]).output().unwrap();
    assert!(clean.status.success(), "weir capture clean: {}", String::from_utf8_lossy(&clean.stderr));
    println!("{CAPTURE_PASSED}: {}", tools::testkit().display());
}
