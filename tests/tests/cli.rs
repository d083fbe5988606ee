//! The binary's command-line surface: personalities by argv[0], version output, and
//! commands that are not built yet exiting 2 with a message instead of panicking.

use std::{os::unix::fs::symlink, path::PathBuf, process::Command};

use weir_tests::tools;

/// `weir` linked under another name, as an image would install it.
fn as_named(name: &str) -> (tempdir::TempDir, PathBuf) {
    let dir = tempdir::TempDir::new();
    let link = dir.0.join(name);
    symlink(tools::weir(), &link).unwrap();
    (dir, link)
}

mod tempdir {
    pub struct TempDir(pub std::path::PathBuf);
    impl TempDir {
        pub fn new() -> Self {
            let p = std::env::temp_dir().join(weir_agent::sandbox::unique_name("cli"));
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn version_prints_version_and_build_info() {
    let out = Command::new(tools::weir()).arg("version").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with(&format!("weir {}", env!("CARGO_PKG_VERSION"))), "{text}");
    assert!(text.contains("eBPF objects: bpfel"), "the test build carries real eBPF objects: {text}");

    let json = Command::new(tools::weir()).args(["version", "-o", "json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert!(v["git_sha"].is_string());
}

#[test]
fn pilot_agent_personality_accepts_pilot_agent_commands() {
    let (_dir, pilot) = as_named("pilot-agent");
    let out = Command::new(&pilot).args(["version", "--short"]).output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), env!("CARGO_PKG_VERSION"));

    // Weir-only subcommands are not part of pilot-agent's surface.
    let out = Command::new(&pilot).arg("demo").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unrecognized subcommand"));
}

#[test]
fn commands_not_built_yet_exit_2_naming_their_area() {
    let (_dir, pilot) = as_named("pilot-agent");
    let cases: &[(&PathBuf, &[&str], &str)] = &[
        (&pilot, &["proxy", "sidecar", "--domain", "ns.svc.cluster.local"], "Envoy lifecycle"),
        (&pilot, &["wait"], "status server"),
    ];
    for (bin, args, area) in cases {
        let out = Command::new(bin)
            .args(*args)
            .env("XDS_ROOT_CA", "SYSTEM")
            .env("CA_ROOT_CA", "SYSTEM")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("not built yet") && err.contains(area), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn proxy_with_a_missing_root_certificate_exits_64_naming_it() {
    let (dir, pilot) = as_named("pilot-agent");
    let out = Command::new(&pilot)
        .args(["proxy", "sidecar", "--domain", "ns.svc.cluster.local"])
        .current_dir(&dir.0)
        .env_remove("XDS_ROOT_CA")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("./var/run/secrets/istio/root-cert.pem") && err.contains("XDS_ROOT_CA"), "{err}");
}

#[test]
fn unknown_subcommands_are_usage_errors() {
    let out = Command::new(tools::weir()).arg("frobnicate").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("frobnicate"));
}
