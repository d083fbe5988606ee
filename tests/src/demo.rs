//! `weir demo` run as the README's first command runs it, and checked by its own
//! summary: requests went through the sidecars, Envoy's stats show mutual TLS, the
//! sidecars drained, and the process that ran it left nothing behind.

use std::{path::Path, process::Command};

use crate::{envoy::tempfile_dir::Dir, tools};

/// Runs `<weir> demo --duration 3 --capture-mode <mode>` with `env` added, and asserts
/// on its summary and on what it left. Before it starts, every path the demo could be
/// predicted to use in its temporary directory is a symlink to a folder of the test's;
/// while its traffic runs, its files must be out of an app's (uid 1000) reach.
pub fn assert_demo_works(weir: &Path, mode: &str, env: &[(&str, &std::ffi::OsStr)]) {
    let tmp = Dir::new("demo-tmpdir").unwrap();
    let lure = Dir::new("demo-lure").unwrap();
    // Stopped before it runs, so its process id is known and the lures laid first.
    let mut child = Command::new("/bin/sh")
        .args(["-c", "kill -STOP $$; exec \"$0\" \"$@\""])
        .arg(weir)
        .args(["demo", "--duration", "3", "--capture-mode", mode])
        .env("WEIR_LOG", "warn")
        .env("TMPDIR", tmp.path())
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", weir.display()));
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let stopped = nix::sys::wait::waitpid(pid, Some(nix::sys::wait::WaitPidFlag::WUNTRACED)).unwrap();
    assert!(matches!(stopped, nix::sys::wait::WaitStatus::Stopped(..)), "{stopped:?}");
    for n in 0..64 {
        std::os::unix::fs::symlink(lure.path(), tmp.path().join(format!("weir-{pid}-{n}-demo"))).unwrap();
    }
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    // Sandboxes are named after the process that made them.
    let mine = format!("weir-{pid}-");
    let stderr = child.stderr.take().unwrap();
    let errors = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let mut lines = Vec::new();
    for line in std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap())) {
        let line = line.unwrap();
        if line.starts_with("[demo] traffic")
            && !lines.iter().any(|l: &String| l.starts_with("[demo] traffic"))
        {
            assert_out_of_an_apps_reach(tmp.path());
        }
        lines.push(line);
    }
    let status = child.wait().unwrap();
    let out = std::process::Output {
        status,
        stdout: (lines.join("\n") + "\n").into_bytes(),
        stderr: errors.join().unwrap().into_bytes(),
    };
    let lured: Vec<_> = std::fs::read_dir(lure.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(lured.is_empty(), "the demo wrote through a symlink another user could have laid: {lured:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{} demo --capture-mode {mode}:\n{stdout}\n{stderr}", weir.display());
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("[demo] summary"))
        .unwrap_or_else(|| panic!("no summary:\n{stdout}"));
    let field = |name: &str| {
        summary
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name} in {summary}"))
            .to_string()
    };
    assert_eq!(field("backend"), mode, "{summary}");
    assert!(field("requests_ok").parse::<u64>().unwrap() > 0, "{summary}");
    assert_eq!(field("requests_failed"), "0", "{summary}");
    assert_eq!(
        field("envoy_upstream_requests"),
        field("requests_ok"),
        "every request went through Envoy: {summary}"
    );
    assert_eq!(field("mtls"), "true", "{summary}");
    assert_eq!(field("drained"), "true", "{summary}");
    assert!(stdout.contains("identity  client: spiffe://cluster.local/ns/default/sa/client"), "{stdout}");
    assert!(stdout.contains("identity  server: spiffe://cluster.local/ns/default/sa/server"), "{stdout}");
    // Its steps, in order (one `traffic` line per second, one `identity` per sidecar).
    let mut steps: Vec<&str> =
        stdout.lines().filter_map(|l| l.strip_prefix("[demo] ")?.split_whitespace().next()).collect();
    steps.dedup();
    let expected = [
        "sandbox", "capture", "mesh", "capture", "envoy", "ready", "identity", "traffic", "envoy", "drain",
        "cleanup", "summary",
    ];
    assert_eq!(steps, expected, "{stdout}");
    // Nothing left by that process: no namespace, cgroup, pin or capture record.
    let left = tools::weir_command().args(["sandbox", "list"]).output().unwrap();
    assert!(left.status.success(), "weir sandbox list: {}", String::from_utf8_lossy(&left.stderr));
    let left = String::from_utf8_lossy(&left.stdout);
    assert!(!left.contains(&mine), "{left}");
    let pins: Vec<_> = match std::fs::read_dir("/sys/fs/bpf/weir") {
        Ok(dir) => dir
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&mine))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("read /sys/fs/bpf/weir: {e}"),
    };
    assert!(pins.is_empty(), "pins left: {pins:?}");
}

/// The demo's files while it runs (its one directory under `tmp`): the CA's directory
/// is its own (0700), and an app's user can reach neither sidecar's sockets nor the
/// mesh CA's key.
fn assert_out_of_an_apps_reach(tmp: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    use weir_agent::sidecar::envoy::access::{Need, check};
    let dirs: Vec<_> = std::fs::read_dir(tmp)
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    let [dir] = dirs.as_slice() else { panic!("not one demo directory in {}: {dirs:?}", tmp.display()) };
    let ca = std::fs::metadata(dir.join("ca")).unwrap().permissions().mode() & 0o777;
    assert_eq!(ca, 0o700, "the mesh CA's directory");
    for need in [
        Need::Connect {
            what: "the SDS socket",
            path: dir.join("client/var/run/secrets/workload-spiffe-uds/socket"),
        },
        Need::Connect { what: "the XDS socket", path: dir.join("server/etc/istio/proxy/XDS") },
        Need::Read { what: "the mesh CA's key", path: dir.join("ca/root-key.pem") },
    ] {
        let path = match &need {
            Need::Connect { path, .. } | Need::Read { path, .. } => path.clone(),
        };
        assert!(path.exists(), "{} is not there", path.display());
        assert!(check(1000, 1000, &[need]).is_err(), "an app (uid 1000) reaches {}", path.display());
    }
}
