//! `weir cni install` on a node's CNI folders (temporary ones here): the binary and
//! kubeconfig are written, Weir is chained into the primary config (a `.conf` becomes
//! a `.conflist`), a primary CNI rewriting its file gets Weir re-inserted, a rotated
//! service-account token rewrites the kubeconfig, and SIGTERM takes out exactly what
//! was put in.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use weir_tests::{control_plane::eventually, envoy::tempfile_dir::Dir, tools};

struct Host {
    _dir: Dir,
    net: PathBuf,
    bin: PathBuf,
    run: PathBuf,
    sa: PathBuf,
}

impl Host {
    fn new() -> Self {
        let dir = Dir::new("cni-host").unwrap();
        let p = |s: &str| {
            let path = dir.path().join(s);
            std::fs::create_dir_all(&path).unwrap();
            path
        };
        let (net, bin, run, sa) = (p("etc/cni/net.d"), p("opt/cni/bin"), p("var/run/istio-cni"), p("sa"));
        std::fs::write(sa.join("token"), "token-1").unwrap();
        std::fs::write(sa.join("ca.crt"), "-----BEGIN CERTIFICATE-----\n").unwrap();
        Self { _dir: dir, net, bin, run, sa }
    }

    fn install(&self, extra: &[&str]) -> Command {
        self.verb("install", extra)
    }

    fn verb(&self, verb: &str, extra: &[&str]) -> Command {
        let mut cmd = Command::new(tools::weir());
        cmd.args(["cni", verb, "--cni-net-dir"])
            .arg(&self.net)
            .arg("--cni-bin-dir")
            .arg(&self.bin)
            .arg("--run-dir")
            .arg(&self.run)
            .arg("--service-account-dir")
            .arg(&self.sa)
            .args(extra)
            .env_clear()
            .env("KUBERNETES_SERVICE_HOST", "10.96.0.1")
            .env("KUBERNETES_SERVICE_PORT", "443")
            .env("WEIR_LOG", "info");
        cmd
    }

    fn config(&self, name: &str) -> Value {
        serde_json::from_slice(&std::fs::read(self.net.join(name)).unwrap()).unwrap()
    }
}

fn types(config: &Value) -> Vec<String> {
    config["plugins"].as_array().unwrap().iter().map(|p| p["type"].as_str().unwrap().to_string()).collect()
}

const BRIDGE_CONF: &str = r#"{"cniVersion": "0.4.0", "name": "cbr0", "type": "bridge", "bridge": "cni0",
  "ipam": {"type": "host-local", "subnet": "10.244.0.0/24"}}"#;
const PRIMARY_LIST: &str = r#"{"cniVersion": "1.0.0", "name": "k8s-pod-network", "plugins": [
  {"type": "ptp", "ipam": {"type": "host-local", "subnet": "10.244.0.0/24"}}, {"type": "portmap", "capabilities": {"portMappings": true}}]}"#;

#[test]
fn once_writes_the_binary_the_kubeconfig_and_the_chain() {
    use std::os::unix::fs::PermissionsExt as _;
    let host = Host::new();
    std::fs::write(host.net.join("10-bridge.conf"), BRIDGE_CONF).unwrap();
    std::fs::set_permissions(host.net.join("10-bridge.conf"), std::fs::Permissions::from_mode(0o600))
        .unwrap();
    let out = host
        .install(&[
            "--once",
            "--capture-mode",
            "nftables",
            "--exclude-namespaces",
            "kube-system,istio-system",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // The .conf became a .conflist with Weir last, with the .conf's mode, as Istio's
    // installer writes the .conf and renames it.
    assert!(!host.net.join("10-bridge.conf").exists());
    assert_eq!(
        std::fs::metadata(host.net.join("10-bridge.conflist")).unwrap().permissions().mode() & 0o777,
        0o600,
        "the .conf's mode"
    );
    let list = host.config("10-bridge.conflist");
    assert_eq!(types(&list), ["bridge", "weir-cni"]);
    assert_eq!(list["cniVersion"], "0.4.0");
    let weir = &list["plugins"][1];
    assert_eq!(weir["capture_mode"], "nftables");
    assert_eq!(weir["exclude_namespaces"], serde_json::json!(["kube-system", "istio-system"]));
    assert_eq!(weir["cni_agent_run_dir"], host.run.display().to_string());

    // The binary is the plugin built beside this weir (`weir-cni`, not `weir`),
    // executable; the kubeconfig is the service account's.
    let bin = host.bin.join("weir-cni");
    assert_eq!(std::fs::read(&bin).unwrap(), std::fs::read(tools::weir_cni()).unwrap());
    assert_ne!(std::fs::read(&bin).unwrap(), std::fs::read(tools::weir()).unwrap());
    assert_eq!(std::fs::metadata(&bin).unwrap().permissions().mode() & 0o777, 0o755);
    let kubeconfig = std::fs::read_to_string(host.run.join("istio-cni-kubeconfig")).unwrap();
    assert!(
        kubeconfig.contains("server: https://10.96.0.1:443") && kubeconfig.contains("token: token-1"),
        "{kubeconfig}"
    );
    assert_eq!(
        std::fs::metadata(host.run.join("istio-cni-kubeconfig")).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // The installed plugin answers as a CNI plugin.
    let v = Command::new(&bin).env("CNI_COMMAND", "VERSION").output().unwrap();
    assert!(String::from_utf8_lossy(&v.stdout).contains("supportedVersions"));

    // A second pass changes nothing.
    let before = std::fs::read(host.net.join("10-bridge.conflist")).unwrap();
    assert!(
        host.install(&[
            "--once",
            "--capture-mode",
            "nftables",
            "--exclude-namespaces",
            "kube-system,istio-system"
        ])
        .status()
        .unwrap()
        .success()
    );
    assert_eq!(std::fs::read(host.net.join("10-bridge.conflist")).unwrap(), before);
}

fn wait_for(what: &str, f: impl FnMut() -> bool) {
    let mut f = f;
    eventually(Duration::from_secs(10), || f().then_some(()))
        .unwrap_or_else(|| panic!("{what} did not happen in 10 s"));
}

#[test]
fn the_watcher_reinserts_after_a_rewrite_follows_the_token_and_stays_installed_on_sigterm() {
    let host = Host::new();
    std::fs::write(host.net.join("10-k8s.conflist"), PRIMARY_LIST).unwrap();
    let log = host.run.parent().unwrap().join("install.log");
    let mut child = host
        .install(&["--interval", "100ms"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let chained = |h: &Host| types(&h.config("10-k8s.conflist")) == ["ptp", "portmap", "weir-cni"];
    wait_for("install", || chained(&host));

    // The primary CNI rewrites its config (istio/istio#11037): Weir comes back.
    std::fs::write(host.net.join("10-k8s.conflist"), PRIMARY_LIST).unwrap();
    wait_for("re-insertion", || chained(&host));
    // The token rotates: the kubeconfig follows.
    std::fs::write(host.sa.join("token"), "token-2").unwrap();
    let kubeconfig = host.run.join("istio-cni-kubeconfig");
    wait_for("kubeconfig rewrite", || {
        std::fs::read_to_string(&kubeconfig).unwrap_or_default().contains("token: token-2")
    });

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{}", std::fs::read_to_string(&log).unwrap());
    // Stopping the agent (a rollout, an eviction) takes nothing out: pods starting
    // meanwhile are still captured by the plugin.
    assert!(chained(&host), "still chained after SIGTERM: {}", host.config("10-k8s.conflist"));
    assert!(kubeconfig.exists() && host.bin.join("weir-cni").exists(), "kubeconfig and binary stay");
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(log.contains("repaired=true"), "{log}");
    assert!(log.contains("the plugin stays chained and every pod stays captured"), "{log}");

    // Uninstall is the explicit act that takes Weir out.
    let out = host.verb("uninstall", &[]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        types(&host.config("10-k8s.conflist")),
        ["ptp", "portmap"],
        "Weir's entry removed, the rest untouched"
    );
    assert_eq!(host.config("10-k8s.conflist")["plugins"][1]["capabilities"]["portMappings"], true);
    assert!(!kubeconfig.exists() && !host.bin.join("weir-cni").exists(), "kubeconfig and binary removed");
}

/// `AMBIENT_DISABLE_SAFE_UPGRADE` (from the shared ConfigMap, with ambient on): every
/// stop of Weir's DaemonSet is for good, as Istio's agent stops with it: SIGTERM takes
/// the plugin's entry, kubeconfig and binary out. A value that is not a boolean stops
/// the start, naming the variable.
#[test]
fn with_safe_upgrade_disabled_sigterm_takes_the_plugin_out() {
    let host = Host::new();
    std::fs::write(host.net.join("10-k8s.conflist"), PRIMARY_LIST).unwrap();
    let bad = host
        .install(&["--once"])
        .env("AMBIENT_ENABLED", "true")
        .env("AMBIENT_DISABLE_SAFE_UPGRADE", "maybe")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && stderr.contains("AMBIENT_DISABLE_SAFE_UPGRADE"), "{stderr}");
    assert_eq!(types(&host.config("10-k8s.conflist")), ["ptp", "portmap"], "nothing installed on bad input");

    let log = host.run.parent().unwrap().join("install.log");
    let mut child = host
        .install(&["--interval", "100ms"])
        .env("AMBIENT_ENABLED", "true")
        .env("AMBIENT_DISABLE_SAFE_UPGRADE", "true")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let kubeconfig = host.run.join("istio-cni-kubeconfig");
    wait_for("install", || types(&host.config("10-k8s.conflist")) == ["ptp", "portmap", "weir-cni"]);
    assert!(kubeconfig.exists() && host.bin.join("weir-cni").exists());
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .unwrap();
    let status = child.wait().unwrap();
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{log}");
    assert_eq!(types(&host.config("10-k8s.conflist")), ["ptp", "portmap"], "out of the chain at stop: {log}");
    assert!(!kubeconfig.exists() && !host.bin.join("weir-cni").exists(), "kubeconfig and binary removed");
    assert!(log.contains("stopping for good"), "{log}");
}

#[test]
fn install_errors_name_what_is_missing() {
    let host = Host::new();
    let out = host.install(&["--once"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no CNI network config") && err.contains(&host.net.display().to_string()), "{err}");

    std::fs::write(host.net.join("10-k8s.conflist"), PRIMARY_LIST).unwrap();
    let out = host.install(&["--once", "--capture-mode", "magic"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--capture-mode \"magic\""));

    std::fs::remove_file(host.sa.join("token")).unwrap();
    let out = host.install(&["--once"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("service account's token") && err.contains("sa/token"), "{err}");
    let out = host.install(&["--once"]).env_remove("KUBERNETES_SERVICE_HOST").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("KUBERNETES_SERVICE_HOST"));
}

/// `/metrics` listens on the pod's own address (`POD_IP`: the node's, hostNetwork),
/// not on every address of the node, and names no pod unless asked. Before, it bound
/// 0.0.0.0 and labelled every pod by namespace/name with its bypass counters.
#[test]
fn metrics_listen_on_the_pods_address_and_name_no_pod() {
    weir_tests::require_root!();
    let mesh = weir_tests::Mesh::new(&weir_tests::test_name!()).unwrap();
    let node = mesh.pod("node").unwrap();
    let host = Host::new();
    std::fs::write(host.net.join("10-bridge.conf"), BRIDGE_CONF).unwrap();
    let ip = node.ipv4();
    let mut cmd = host.install(&["--monitoring-port", "15014", "--interval", "200ms"]);
    cmd.env("POD_IP", ip.to_string()).stdout(Stdio::null()).stderr(Stdio::null());
    let _agent = node.spawn(&mut cmd, 0).unwrap();
    let get = |addr: std::net::IpAddr| {
        node.run(move || async move { weir_tests::http::get((addr, 15014).into(), "/metrics").await.ok() })
            .unwrap()
    };
    let served =
        eventually(Duration::from_secs(10), || get(ip.into())).expect("/metrics on the pod's address");
    assert_eq!(served.0, 200, "{}", served.1);
    // Other tests may have pods registered on this host while this runs: the count is
    // theirs, but no pod may be named.
    assert!(served.1.contains("\nweir_capture_pods ") && !served.1.contains("pod="), "{}", served.1);
    assert!(get([127, 0, 0, 1].into()).is_none(), "loopback: not listened on");
}

/// `/readyz` on the readiness port (istio-cni's 8000 in the DaemonSet): 503 naming what
/// is missing while the primary CNI has written no config (pods scheduled now would
/// start uncaptured), 200 once weir-cni is chained, 503 again while the chain is gone.
#[test]
fn readyz_waits_for_the_chain_and_names_what_is_missing() {
    weir_tests::require_root!();
    let mesh = weir_tests::Mesh::new(&weir_tests::test_name!()).unwrap();
    let node = mesh.pod("node").unwrap();
    let host = Host::new();
    let ip = node.ipv4();
    let mut cmd = host.install(&["--readiness-port", "8000", "--interval", "100ms"]);
    cmd.env("POD_IP", ip.to_string()).stdout(Stdio::null()).stderr(Stdio::null());
    let _agent = node.spawn(&mut cmd, 0).unwrap();
    let get = |path: &'static str| {
        node.run(move || async move { weir_tests::http::get((ip, 8000).into(), path).await.ok() }).unwrap()
    };
    let waiting = eventually(Duration::from_secs(10), || get("/readyz")).expect("/readyz served");
    assert_eq!(waiting, (503, "not ready: weir-cni chained into the CNI config\n".to_string()));
    assert_eq!(get("/healthz").map(|(s, _)| s), Some(200), "alive while not ready");

    std::fs::write(host.net.join("10-bridge.conf"), BRIDGE_CONF).unwrap();
    eventually(Duration::from_secs(10), || (get("/readyz")? == (200, "ready\n".to_string())).then_some(()))
        .expect("ready once chained");
    // The primary's config goes (a CNI being reinstalled): not ready until it is back.
    for f in std::fs::read_dir(&host.net).unwrap().flatten() {
        std::fs::remove_file(f.path()).unwrap();
    }
    eventually(Duration::from_secs(10), || (get("/readyz")?.0 == 503).then_some(()))
        .expect("not ready while the chain is gone");
}

/// Chaining into the primary CNI's own file keeps that file's mode, as Istio's
/// installer does (cni/pkg/install/cniconfig.go `writeCNIConfig`, and `Cleanup` at
/// uninstall: a CNI may need its own mode, 0660 say); `CNI_CONF_GROUP_READ` applies
/// only to files Istio creates (the Istio-owned config). Before, Weir wrote the
/// primary's file 0600 (0640) whatever its mode, from Istio's release note.
#[test]
fn the_chained_config_keeps_the_primarys_mode() {
    use std::os::unix::fs::PermissionsExt as _;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    for (group_read, primary_mode) in [(None, 0o644), (Some("true"), 0o660)] {
        let host = Host::new();
        let list = host.net.join("10-calico.conflist");
        std::fs::write(&list, PRIMARY_LIST).unwrap();
        std::fs::set_permissions(&list, std::fs::Permissions::from_mode(primary_mode)).unwrap();
        let mut install = host.install(&["--once"]);
        if let Some(v) = group_read {
            install.env("CNI_CONF_GROUP_READ", v);
        }
        let out = install.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(types(&host.config("10-calico.conflist")).last().unwrap(), "weir-cni");
        assert_eq!(mode(&list), primary_mode, "CNI_CONF_GROUP_READ={group_read:?}");
        let out = host.verb("uninstall", &[]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(types(&host.config("10-calico.conflist")), ["ptp", "portmap"]);
        assert_eq!(mode(&list), primary_mode, "uninstall keeps it too");
    }
    // A mode Istio's KUBECONFIG_MODE reads (Go's base-0 integers) for the kubeconfig.
    let host = Host::new();
    std::fs::write(host.net.join("10-calico.conflist"), PRIMARY_LIST).unwrap();
    let out = host.install(&["--once"]).env("KUBECONFIG_MODE", "0640").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(mode(&host.run.join("istio-cni-kubeconfig")), 0o640);
    let out = host.install(&["--once"]).env("KUBECONFIG_MODE", "0999").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("KUBECONFIG_MODE") && err.contains("file mode"), "{err}");
}
