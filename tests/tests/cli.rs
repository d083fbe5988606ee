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
fn the_cni_personality_speaks_the_cni_protocol() {
    let (_dir, cni) = as_named("istio-cni");
    let out = Command::new(&cni).env("CNI_COMMAND", "VERSION").output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cniVersion"], "1.0.0");
    // No command: the spec's error JSON on stdout, exit 1, logs only on stderr.
    let out = Command::new(&cni).env_remove("CNI_COMMAND").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let e: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(e["code"], 4, "{e}");
}

#[test]
fn the_per_pod_binaries_do_their_one_job() {
    // weir-cni: the plugin, whatever it is named.
    let cni = tools::weir_cni();
    let out = Command::new(&cni).env("CNI_COMMAND", "VERSION").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cniVersion"], "1.0.0");
    let out = Command::new(&cni).env("CNI_COMMAND", "FROB").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let e: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(e["code"], 4, "{e}");

    // weir-init: pilot-agent's istio-init commands, the same istio-iptables as weir's.
    let init = tools::weir_init().expect("this checkout builds weir-init");
    let out = Command::new(&init).args(["version", "--short"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), env!("CARGO_PKG_VERSION"), "{out:?}");
    let flags: Vec<&str> =
        weir_tests::capture::injector_istio_init_args().into_iter().chain(["--dry-run"]).collect();
    let run = |bin: &std::path::Path| {
        let out = Command::new(bin).args(&flags).env_remove("WEIR_LOG").output().unwrap();
        assert!(
            out.status.success(),
            "{} {flags:?}: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let (small, whole) = (run(&init), run(&tools::weir()));
    assert!(small.contains("-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001"), "{small}");
    assert_eq!(small, whole, "weir-init and weir plan the same rules from the injector's flags");
    // The sidecar's commands are weir's: a usage error that says where they are.
    for command in ["proxy", "wait", "request"] {
        let out = Command::new(&init).arg(command).output().unwrap();
        assert_eq!(out.status.code(), Some(64), "{command}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("not in weir-init") && err.contains("weir-proxy"), "{command}: {err}");
    }
    let out = Command::new(&init).arg("demo").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// `pilot-agent proxy ...` in an empty pod directory (`etc/istio/proxy` made, as the
/// injector's emptyDir), with the system roots, a loopback control plane nobody
/// serves and no status server, plus `env`.
fn proxy_in_empty_pod(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let (dir, pilot) = as_named("pilot-agent");
    for d in ["etc/istio/proxy", "var/run/secrets/workload-spiffe-uds"] {
        std::fs::create_dir_all(dir.0.join(d)).unwrap();
    }
    Command::new(&pilot)
        .args(args)
        .current_dir(&dir.0)
        .env_clear()
        .env("XDS_ROOT_CA", "SYSTEM")
        .env("CA_ROOT_CA", "SYSTEM")
        .env("CA_ADDR", "127.0.0.1:1")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

#[test]
fn bad_proxy_input_exits_with_a_clear_error_naming_it() {
    let pc = r#"{"discoveryAddress": "127.0.0.1:1", "statusPort": 0, "binaryPath": "/nonexistent/envoy"}"#;
    /// (args, env, exit code, what stderr must name)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], i32, &'a str);
    let cases: &[Case] = &[
        (&["proxy", "sidecar"], &[("PROXY_CONFIG", "{\"concurrency\": \"two\"")], 64, "PROXY_CONFIG"),
        (&["proxy", "sidecar"], &[("PROXY_CONFIG", "drainDuration: soon")], 64, "drainDuration"),
        (&["proxy", "waypoint"], &[], 64, "waypoint"),
        (
            &["proxy", "sidecar"],
            &[("PROXY_CONFIG", pc), ("ISTIO_KUBE_APP_PROBERS", "[]")],
            64,
            "ISTIO_KUBE_APP_PROBERS",
        ),
        (
            &["proxy", "sidecar"],
            &[("PROXY_CONFIG", pc)],
            1,
            "start Envoy: open the executable /nonexistent/envoy",
        ),
        (
            &["proxy", "sidecar", "--templateFile", "/nonexistent/template.json"],
            &[("PROXY_CONFIG", pc)],
            1,
            "bootstrap template /nonexistent/template.json",
        ),
        (
            &["proxy", "sidecar"],
            &[("PROXY_CONFIG", pc), ("ISTIO_BOOTSTRAP_OVERRIDE", "/nonexistent/override.yaml")],
            1,
            "ISTIO_BOOTSTRAP_OVERRIDE /nonexistent/override.yaml",
        ),
    ];
    for (args, env, code, needle) in cases {
        let out = proxy_in_empty_pod(args, env);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(*code), "{args:?} {env:?}: {err}");
        assert!(err.contains(needle), "{args:?} {env:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// Istio issue 24: a duration past Go's limit in the pod's `proxy.istio.io/config`
/// annotation (which any pod author writes) is a usage error naming the field and the
/// annotation, never a panic.
#[test]
fn an_overflowing_duration_in_the_pod_annotation_exits_64_naming_it() {
    let (dir, pilot) = as_named("pilot-agent");
    for d in ["etc/istio/proxy", "etc/istio/pod", "var/run/secrets/workload-spiffe-uds"] {
        std::fs::create_dir_all(dir.0.join(d)).unwrap();
    }
    // As kubelet's downward API writes it: key="Go-quoted value".
    std::fs::write(
        dir.0.join("etc/istio/pod/annotations"),
        "proxy.istio.io/config=\"drainDuration: 6000000000000000h\\n\"\n",
    )
    .unwrap();
    let out = Command::new(&pilot)
        .args(["proxy", "sidecar"])
        .current_dir(&dir.0)
        .env_clear()
        .env("XDS_ROOT_CA", "SYSTEM")
        .env("CA_ROOT_CA", "SYSTEM")
        .env("CA_ADDR", "127.0.0.1:1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(err.contains("drainDuration") && err.contains("proxy.istio.io/config"), "{err}");
}

#[test]
fn config_dump_prints_the_effective_config() {
    let out = Command::new(tools::weir())
        .args(["config", "dump", "sidecar", "--concurrency", "3"])
        .env("XDS_ROOT_CA", "SYSTEM")
        .env("CA_ROOT_CA", "SYSTEM")
        .env("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true")
        .output()
        .unwrap();
    let yaml = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for needle in [
        "concurrency: 3",
        "mode: untilIdle",
        "binary: /usr/local/bin/envoy",
        "bootstrap: ./etc/istio/proxy/envoy-rev.json",
    ] {
        assert!(yaml.contains(needle), "{needle}:\n{yaml}");
    }
}

#[test]
fn local_commands_check_their_flags() {
    let (_dir, pilot) = as_named("pilot-agent");
    let cases: &[(&[&str], &str)] = &[
        (&["wait", "--timeoutSeconds=soon"], "--timeoutSeconds"),
        (&["wait", "--bogus"], "--bogus"),
        (&["request", "GET"], "<method> <path>"),
        (&["request", "GET", "/stats", "--debug-port", "22"], "not in the allowed list"),
    ];
    for (args, needle) in cases {
        let out = Command::new(&pilot).args(*args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let out = Command::new(&pilot).args(["wait", "--help"]).output().unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("--periodMillis"));
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
