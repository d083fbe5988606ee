//! `weir demo` run as the README's first command runs it, and checked by its own
//! summary: requests went through the sidecars, Envoy's stats show mutual TLS, the
//! sidecars drained, and the process that ran it left nothing behind.

use std::{path::Path, process::Command};

use crate::tools;

/// Runs `<weir> demo --duration 3 --capture-mode <mode>` with `env` added, and asserts
/// on its summary and on what it left.
pub fn assert_demo_works(weir: &Path, mode: &str, env: &[(&str, &std::ffi::OsStr)]) {
    let child = Command::new(weir)
        .args(["demo", "--duration", "3", "--capture-mode", mode])
        .env("WEIR_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", weir.display()));
    // Sandboxes are named after the process that made them.
    let mine = format!("weir-{}-", child.id());
    let out = child.wait_with_output().unwrap();
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
        "capture", "sandbox", "mesh", "capture", "envoy", "ready", "identity", "traffic", "envoy", "drain",
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
