//! Node install (`weir cni install` / `uninstall`), what istio-cni's DaemonSet does:
//! put the plugin binary into the CNI bin dir (atomically), write the plugin's
//! kubeconfig (from the pod's service account, or a given file), and chain Weir into
//! the primary CNI's network config (a `.conf` becomes a `.conflist`, as Istio does);
//! then keep it there: the primary CNI rewriting its file (istio/istio#11037) or a
//! rotated token is repaired on the next poll. Uninstall takes out exactly what install
//! put in (istio/istio.io#16748). The config editing is pure (`insert`, `remove`).

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::{Map, Value, json};

use crate::{
    node::metrics::{self, InstallStep},
    support::readiness::Readiness,
};

/// The plugin type Weir chains as (its binary's name in the CNI bin dir).
pub const PLUGIN_TYPE: &str = "weir-cni";
/// Istio's plugin type: replaced when found, so Weir takes over from istio-cni.
pub const ISTIO_PLUGIN_TYPE: &str = "istio-cni";

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("no CNI network config (*.conf, *.conflist) in {dir} yet")]
    NoPrimary { dir: PathBuf },
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the service account's {what} is missing ({path}): is this running in a pod with a service account?"
    )]
    ServiceAccount { what: &'static str, path: PathBuf },
    #[error("eBPF node capture")]
    Ebpf(#[from] super::ebpf::CniEbpfError),
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> InstallError {
    let path = path.to_path_buf();
    move |source| InstallError::Io { what, path, source }
}

/// What install does and where.
#[derive(Debug, Clone)]
pub struct InstallSettings {
    /// `CNI_NET_DIR` (the host's /etc/cni/net.d, mounted).
    pub net_dir: PathBuf,
    /// `CNI_BIN_DIR` (the host's /opt/cni/bin, mounted).
    pub bin_dir: PathBuf,
    /// `CNI_CONF_NAME`: the primary config's file name; the first one kubelet would
    /// pick when empty.
    pub conf_name: Option<String>,
    /// Where the kubeconfig goes (`cni_agent_run_dir`).
    pub run_dir: PathBuf,
    /// Weir's entry in the chain (type, run dir and options are set by install).
    pub plugin: Map<String, Value>,
    /// The plugin binary to install (`weir-cni` next to this executable by default).
    pub binary: PathBuf,
    pub kubeconfig: KubeconfigSource,
    /// eBPF: attach the node capture (its name) to the pods' cgroup.
    pub ebpf: Option<(String, PathBuf)>,
    /// The plugin's name in the chain and in the bin dir: [`PLUGIN_TYPE`], or
    /// [`ISTIO_PLUGIN_TYPE`] when Weir runs as Istio's `install-cni` (the swap replaces
    /// istio-cni's binary and entry in place, and back).
    pub plugin_type: &'static str,
    /// The mode of a CNI config file Weir creates (the Istio-owned one): Istio's 0600,
    /// 0640 with `CNI_CONF_GROUP_READ`. The primary's own file keeps its mode.
    pub config_mode: u32,
    /// `ISTIO_OWNED_CNI_CONFIG`: the file (in `net_dir`) the chained list is written to,
    /// a copy of the primary's list with the plugin last; the primary's file is left as
    /// its CNI wrote it. `None`: the plugin is chained into the primary's file.
    pub owned_config: Option<String>,
    /// The kubeconfig's mode (`KUBECONFIG_MODE`, 0600).
    pub kubeconfig_mode: u32,
}

/// Istio's CNI config file mode (`CNIConfModeDefault`), and with group read.
pub const CONFIG_MODE: u32 = 0o600;
pub const CONFIG_MODE_GROUP_READ: u32 = 0o640;

/// Where the plugin's kubeconfig comes from.
#[derive(Debug, Clone)]
pub enum KubeconfigSource {
    /// In-cluster: `KUBERNETES_SERVICE_HOST`/`_PORT` and the service account's token
    /// and CA (re-read on every poll: tokens rotate).
    ServiceAccount { host: String, port: String, dir: PathBuf },
    /// A kubeconfig file copied as is.
    File(PathBuf),
}

/// The entry Weir adds to a chain.
pub fn plugin_entry(s: &InstallSettings) -> Value {
    let mut entry = s.plugin.clone();
    entry.insert("type".into(), json!(s.plugin_type));
    entry.insert("cni_agent_run_dir".into(), json!(s.run_dir));
    if let Some((name, _)) = &s.ebpf {
        entry.insert("ebpf_node_capture".into(), json!(name));
    }
    Value::Object(entry)
}

/// `existing` with `entry` chained last (replacing an older Weir or istio-cni entry).
/// A single-plugin `.conf` becomes a list, as Istio's installer makes it.
pub fn insert(existing: &Value, entry: &Value) -> Result<Value, String> {
    let mut entry = entry.clone();
    if let Some(e) = entry.as_object_mut() {
        e.remove("cniVersion");
    }
    let obj = existing.as_object().ok_or("not a JSON object")?;
    if obj.contains_key("type") {
        let mut single = obj.clone();
        let version = single.remove("cniVersion").unwrap_or_else(|| json!("0.3.1"));
        let name = single.get("name").cloned().unwrap_or_else(|| json!("k8s-pod-network"));
        return Ok(json!({ "cniVersion": version, "name": name, "plugins": [Value::Object(single), entry] }));
    }
    let mut list = obj.clone();
    let plugins = list.get_mut("plugins").and_then(Value::as_array_mut).ok_or("no \"plugins\" list")?;
    plugins.retain(|p| !is_ours(p));
    plugins.push(entry);
    Ok(Value::Object(list))
}

/// `existing` without Weir's (or istio-cni's) entry.
pub fn remove(existing: &Value) -> Value {
    let mut out = existing.clone();
    if let Some(plugins) = out.get_mut("plugins").and_then(Value::as_array_mut) {
        plugins.retain(|p| !is_ours(p));
    }
    out
}

fn is_ours(plugin: &Value) -> bool {
    matches!(plugin["type"].as_str(), Some(PLUGIN_TYPE) | Some(ISTIO_PLUGIN_TYPE))
}

/// Whether `config` already ends with exactly `entry`.
pub fn is_installed(config: &Value, entry: &Value) -> bool {
    let mut entry = entry.clone();
    if let Some(e) = entry.as_object_mut() {
        e.remove("cniVersion");
    }
    config["plugins"].as_array().and_then(|p| p.last()).is_some_and(|last| *last == entry)
}

/// The primary config kubelet would use: `conf_name`, or the first valid `*.conf` /
/// `*.conflist` in name order (a `.conf` whose `.conflist` twin exists is the list).
pub fn primary_config(net_dir: &Path, conf_name: Option<&str>) -> Result<PathBuf, InstallError> {
    if let Some(name) = conf_name {
        let path = net_dir.join(name);
        for candidate in [path.clone(), PathBuf::from(format!("{}list", path.display()))] {
            if candidate.exists() {
                return Ok(candidate);
            }
        }
        return Err(InstallError::NoPrimary { dir: net_dir.into() });
    }
    let mut names: Vec<PathBuf> = std::fs::read_dir(net_dir)
        .map_err(io("read the CNI config dir", net_dir))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("conf") | Some("conflist")))
        .collect();
    names.sort();
    names
        .into_iter()
        .find(|p| {
            std::fs::read(p).ok().and_then(|b| serde_json::from_slice::<Value>(&b).ok()).is_some_and(|v| {
                v["type"].is_string() || v["plugins"].as_array().is_some_and(|p| !p.is_empty())
            })
        })
        .ok_or_else(|| InstallError::NoPrimary { dir: net_dir.into() })
}

/// Writes `text` to `path` atomically, created with `mode` (the kubeconfig 0600 from
/// its first byte).
fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), InstallError> {
    crate::support::atomic_file::write(path, bytes, mode).map_err(|e| InstallError::Io {
        what: e.what,
        path: e.path,
        source: e.source,
    })
}

/// The kubeconfig text for the plugin.
pub fn kubeconfig_text(source: &KubeconfigSource) -> Result<String, InstallError> {
    use base64::Engine as _;
    match source {
        KubeconfigSource::File(path) => std::fs::read_to_string(path).map_err(io("read kubeconfig", path)),
        KubeconfigSource::ServiceAccount { host, port, dir } => {
            let read = |what: &'static str, name: &str| {
                let path = dir.join(name);
                std::fs::read(&path).map_err(|_| InstallError::ServiceAccount { what, path })
            };
            let token = String::from_utf8_lossy(&read("token", "token")?).trim().to_string();
            let ca = base64::engine::general_purpose::STANDARD.encode(read("CA certificate", "ca.crt")?);
            let host = if host.contains(':') { format!("[{host}]") } else { host.clone() };
            Ok(format!(
                "# Written by weir cni install; rewritten when the token rotates.\napiVersion: v1\nkind: Config\n\
                 clusters:\n- name: local\n  cluster:\n    server: https://{host}:{port}\n    certificate-authority-data: {ca}\n\
                 users:\n- name: weir-cni\n  user:\n    token: {token}\n\
                 contexts:\n- name: weir-cni-context\n  context:\n    cluster: local\n    user: weir-cni\n\
                 current-context: weir-cni-context\n"
            ))
        }
    }
}

/// What one pass changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub binary: bool,
    pub kubeconfig: bool,
    /// The config file Weir is chained into, when it had to be (re)written.
    pub chained_into: Option<PathBuf>,
}

/// The plugin binary in the bin dir; whether it was written.
fn ensure_binary(s: &InstallSettings) -> Result<bool, InstallError> {
    let target = s.bin_dir.join(s.plugin_type);
    let want = std::fs::read(&s.binary).map_err(io("read the plugin binary", &s.binary))?;
    if std::fs::read(&target).ok().as_deref() == Some(&want[..]) {
        return Ok(false);
    }
    std::fs::create_dir_all(&s.bin_dir).map_err(io("create", &s.bin_dir))?;
    write_atomic(&target, &want, 0o755)?;
    Ok(true)
}

/// The plugin's kubeconfig in the run dir; whether it was written.
fn ensure_kubeconfig(s: &InstallSettings) -> Result<bool, InstallError> {
    std::fs::create_dir_all(&s.run_dir).map_err(io("create", &s.run_dir))?;
    let kubeconfig = s.run_dir.join(super::plugin::KUBECONFIG_NAME);
    let text = kubeconfig_text(&s.kubeconfig)?;
    let mode = std::fs::metadata(&kubeconfig).map(|m| m.permissions().mode() & 0o7777).ok();
    if std::fs::read_to_string(&kubeconfig).ok().as_deref() == Some(text.as_str())
        && mode == Some(s.kubeconfig_mode)
    {
        return Ok(false);
    }
    write_atomic(&kubeconfig, text.as_bytes(), s.kubeconfig_mode)?;
    Ok(true)
}

/// The plugin last in the primary CNI's list, as Istio's `writeCNIConfig` writes it:
/// into the primary's own file, which keeps its mode (a CNI may need its own, 0660
/// say); or, with [`InstallSettings::owned_config`], into Istio's own file at the
/// configured mode, the primary's file untouched. The file written, if any.
fn ensure_chained(s: &InstallSettings) -> Result<Option<PathBuf>, InstallError> {
    let path = primary_config(&s.net_dir, s.conf_name.as_deref())?;
    let bad = |message: String| InstallError::Config { path: path.clone(), message };
    let bytes = std::fs::read(&path).map_err(io("read", &path))?;
    let existing: Value = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
    let entry = plugin_entry(s);
    let mode_of = |p: &Path| std::fs::metadata(p).map(|m| m.permissions().mode() & 0o7777).ok();
    if let Some(owned) = &s.owned_config {
        let target = s.net_dir.join(owned);
        let chained = insert(&existing, &entry).map_err(bad)?;
        let current = std::fs::read(&target).ok().and_then(|b| serde_json::from_slice::<Value>(&b).ok());
        let written = if current.as_ref() == Some(&chained) && mode_of(&target) == Some(s.config_mode) {
            None
        } else {
            let text = serde_json::to_vec_pretty(&chained).expect("JSON serializes");
            write_atomic(&target, &text, s.config_mode)?;
            Some(target.clone())
        };
        // The runtime takes the first config by name: Istio's file must be it, or pods
        // start with a list that lacks the plugin (Istio's checkValidCNIConfig).
        let first = primary_config(&s.net_dir, None)?;
        if first != target {
            return Err(InstallError::Config {
                path: target,
                message: format!(
                    "{} comes before it: the runtime uses that file, which lacks the plugin, so new pods would start uncaptured (name the Istio-owned file to sort first)",
                    first.display()
                ),
            });
        }
        return Ok(written);
    }
    if is_installed(&existing, &entry) {
        return Ok(None);
    }
    let mode = mode_of(&path).unwrap_or(s.config_mode);
    let chained = insert(&existing, &entry).map_err(bad)?;
    let text = serde_json::to_vec_pretty(&chained).expect("JSON serializes");
    if path.extension().is_some_and(|e| e == "conf") {
        // kubelet picks by name: the list takes the .conf's place.
        let list = path.with_extension("conflist");
        write_atomic(&list, &text, mode)?;
        std::fs::remove_file(&path).map_err(io("remove", &path))?;
        return Ok(Some(list));
    }
    write_atomic(&path, &text, mode)?;
    Ok(Some(path))
}

/// One install pass: makes everything as it should be, changing only what differs.
pub fn ensure(s: &InstallSettings) -> Result<Changes, InstallError> {
    let mut changes = Changes::default();
    // The node's eBPF capture, before any pod can be chained to it.
    if let Some((name, cgroup)) = &s.ebpf
        && super::node_capture::attach_node(name, cgroup)?
    {
        tracing::info!(node_capture = %name, cgroup = %cgroup.display(), "eBPF node capture attached");
    }
    // Failures are counted by step, as Istio's `istio_cni_installs_total{result}`; a
    // primary CNI that has not written its config yet is waited for, not a failure.
    let step = |step: InstallStep| {
        move |e: InstallError| {
            if !matches!(e, InstallError::NoPrimary { .. }) {
                metrics::install_failed(step);
            }
            e
        }
    };
    changes.binary = ensure_binary(s).map_err(step(InstallStep::Binary))?;
    changes.kubeconfig = ensure_kubeconfig(s).map_err(step(InstallStep::Kubeconfig))?;
    changes.chained_into = ensure_chained(s).map_err(step(InstallStep::CniConfig))?;
    Ok(changes)
}

/// What uninstall left in place, and why.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Uninstalled {
    /// Pods still captured by the node's eBPF capture, which was kept for them.
    pub pods_kept_captured: usize,
}

/// Takes Weir out: its chain entry, the kubeconfig and the binary, so new pods are no
/// longer captured. The node's eBPF capture goes only when no pod is registered with
/// it, or when `detach_running_pods` says to take capture away from running pods.
/// Missing parts are fine (uninstall is idempotent).
pub fn uninstall(s: &InstallSettings, detach_running_pods: bool) -> Result<Uninstalled, InstallError> {
    let mut report = Uninstalled::default();
    if let Some(owned) = &s.owned_config {
        let path = s.net_dir.join(owned);
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::info!(config = %path.display(), "removed the Istio-owned CNI config"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("remove", &path)(e)),
        }
    }
    // The primary's file too (an entry left by a chained install before the owned one,
    // whose binary goes below, would fail every pod's ADD).
    if let Ok(path) = primary_config(&s.net_dir, s.conf_name.as_deref()) {
        let bytes = std::fs::read(&path).map_err(io("read", &path))?;
        if let Ok(existing) = serde_json::from_slice::<Value>(&bytes) {
            let cleaned = remove(&existing);
            if cleaned != existing {
                // The primary's file keeps its mode, as Istio's `Cleanup` keeps it.
                let mode = std::fs::metadata(&path).map(|m| m.permissions().mode() & 0o7777);
                let text = serde_json::to_vec_pretty(&cleaned).expect("JSON serializes");
                write_atomic(&path, &text, mode.unwrap_or(s.config_mode))?;
                tracing::info!(config = %path.display(), "removed weir-cni from the chain");
            }
        }
    }
    if let Some((name, cgroup)) = &s.ebpf {
        // Counted in the sets' maps: records can be lost, registrations cannot.
        let pods = super::node_capture::pods_registered(name, cgroup)?;
        if pods == 0 || detach_running_pods {
            super::node_capture::detach_node(name)?;
            tracing::info!(node_capture = %name, pods_uncaptured = pods, "eBPF node capture detached");
        } else {
            report.pods_kept_captured = pods;
            tracing::warn!(node_capture = %name, pods, "eBPF node capture kept: pods are still captured by it (--detach-running-pods takes it away from them)");
        }
    }
    for path in [s.run_dir.join(super::plugin::KUBECONFIG_NAME), s.bin_dir.join(s.plugin_type)] {
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::info!(path = %path.display(), "removed"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("remove", &path)(e)),
        }
    }
    Ok(report)
}

/// The install loop's readiness blocker: the plugin is in the node's CNI config (and,
/// with eBPF, the node capture is attached: that happens before the loop starts).
pub const CHAINED: &str = "weir-cni chained into the CNI config";

/// Install, then keep it installed (and the node's eBPF capture tidy: see
/// [`tidy_node_capture`]) every `interval` until `stop` resolves. The loop's end changes
/// nothing; what stopping does to the node is the caller's decision (Weir's DaemonSet
/// keeps the plugin chained through a restart, an eviction or a rollout, unless
/// `AMBIENT_DISABLE_SAFE_UPGRADE`; the chart mode follows istio-cni's stop).
pub async fn watch(
    s: &InstallSettings,
    interval: Duration,
    readiness: &Readiness,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), InstallError> {
    tokio::pin!(stop);
    let mut first = true;
    let mut last_gone_pass: Option<std::time::Instant> = None;
    loop {
        let pass = ensure(s);
        match &pass {
            Ok(_) => readiness.clear(CHAINED),
            Err(_) => readiness.block(CHAINED),
        }
        metrics::install_ready(pass.is_ok());
        if matches!(&pass, Ok(changes) if *changes != Changes::default()) {
            metrics::installed();
        }
        match pass {
            Ok(changes) if changes != Changes::default() => {
                let repaired = !first;
                tracing::info!(
                    binary = changes.binary,
                    from = %s.binary.display(),
                    kubeconfig = changes.kubeconfig,
                    chained_into = ?changes.chained_into.as_ref().map(|p| p.display().to_string()),
                    repaired,
                    "weir-cni installed"
                );
            }
            Ok(_) => {}
            Err(InstallError::NoPrimary { dir }) => {
                tracing::warn!(dir = %dir.display(), "waiting for the primary CNI to write its network config");
            }
            Err(e) if first => return Err(e),
            Err(e) => tracing::error!(error = %crate::error_chain(&e), "cannot keep weir-cni installed"),
        }
        if let Some((name, _)) = &s.ebpf {
            let collect_gone = last_gone_pass.is_none_or(|t| t.elapsed() >= GONE_PODS_EVERY);
            if collect_gone {
                last_gone_pass = Some(std::time::Instant::now());
            }
            tidy_node_capture(name, collect_gone);
        }
        if first {
            // Operators (and the test rigs) read this line as "running": SIGTERM is
            // handled from here on, and the chain is kept every `interval`.
            tracing::info!(interval = ?interval, "node agent ready: keeping weir-cni chained");
        }
        first = false;
        tokio::select! {
            _ = &mut stop => break,
            _ = tokio::time::sleep(interval) => {}
        }
    }
    tracing::info!("the install loop stopped");
    Ok(())
}

/// How often the node agent looks for pods that are gone (a walk of the host's /proc).
pub const GONE_PODS_EVERY: Duration = Duration::from_secs(30);

/// The node agent's housekeeping for its eBPF capture: registrations of pods that are
/// gone (a DEL that never came; when `collect_gone`), list entries no registration
/// owns, other builds' sets whose last pod went. Logged, never fatal.
pub fn tidy_node_capture(name: &str, collect_gone: bool) {
    if collect_gone {
        collect_gone_pods();
    }
    match crate::capture::ebpf::gc::collect_orphans() {
        Ok(0) => {}
        Ok(n) => tracing::info!(entries = n, "orphaned capture list entries removed"),
        Err(e) => {
            tracing::warn!(error = %crate::error_chain(&e), "orphaned capture list entries not collected")
        }
    }
    if let Err(e) = super::node_capture::collect_retired(name) {
        tracing::warn!(node_capture = name, error = %crate::error_chain(&e), "other builds' node captures not collected");
    }
    crate::capture::ebpf::metrics::warn_on_full_maps();
}

/// Removes the registrations of pods that are gone, judged from the host's /proc (the
/// DaemonSet runs with `hostPID`); without that view only positive path evidence counts.
fn collect_gone_pods() {
    let (view, removed) = crate::capture::ebpf::gc::collect_gone_pods(std::path::Path::new("/proc"));
    if let Err(e) = &view {
        tracing::warn!(reason = %e, "pods that are gone are collected only when their namespace path names another namespace (run with hostPID to collect the rest)");
    }
    if let Err(e) = crate::capture::ebpf::gc::collect_unrecorded(&view) {
        tracing::warn!(error = %crate::error_chain(&e), "registrations without a record not collected");
    }
    for (pod, result) in removed {
        match result {
            Ok(()) => tracing::info!(capture = %pod, "capture of a pod that is gone removed"),
            Err(e) => {
                tracing::warn!(capture = %pod, error = %crate::error_chain(&e), "capture of a pod that is gone not removed")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(dir: &Path, owned: Option<&str>) -> InstallSettings {
        InstallSettings {
            net_dir: dir.join("net.d"),
            bin_dir: dir.join("bin"),
            conf_name: Some("10-calico.conflist".into()),
            run_dir: dir.join("run"),
            plugin: Map::new(),
            binary: dir.join("weir-cni"),
            kubeconfig: KubeconfigSource::File(dir.join("kubeconfig")),
            ebpf: None,
            plugin_type: ISTIO_PLUGIN_TYPE,
            config_mode: CONFIG_MODE,
            kubeconfig_mode: 0o600,
            owned_config: owned.map(String::from),
        }
    }

    /// `ISTIO_OWNED_CNI_CONFIG` as Istio's `writeCNIConfig` does it: the primary's list
    /// copied with the plugin last into Istio's own file (named before the primary's,
    /// so the runtime takes it), at the configured mode; the primary's file untouched;
    /// a second pass changes nothing; uninstall removes Istio's file alone.
    #[test]
    fn the_owned_config_is_a_copy_with_the_plugin_and_the_primary_is_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(dir.path(), Some("02-istio-cni.conflist"));
        std::fs::create_dir_all(&s.net_dir).unwrap();
        let primary = s.net_dir.join("10-calico.conflist");
        let text = r#"{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico"},{"type":"portmap"}]}"#;
        std::fs::write(&primary, text).unwrap();
        std::fs::set_permissions(&primary, std::fs::Permissions::from_mode(0o644)).unwrap();
        let owned = s.net_dir.join("02-istio-cni.conflist");
        assert_eq!(ensure_chained(&s).unwrap(), Some(owned.clone()));
        let list: Value = serde_json::from_slice(&std::fs::read(&owned).unwrap()).unwrap();
        let types: Vec<&str> =
            list["plugins"].as_array().unwrap().iter().filter_map(|p| p["type"].as_str()).collect();
        assert_eq!(types, ["calico", "portmap", "istio-cni"]);
        assert_eq!(std::fs::metadata(&owned).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::read_to_string(&primary).unwrap(),
            text,
            "the primary's file as its CNI wrote it"
        );
        assert_eq!(std::fs::metadata(&primary).unwrap().permissions().mode() & 0o777, 0o644);
        assert_eq!(ensure_chained(&s).unwrap(), None, "a second pass changes nothing");
        assert_eq!(
            primary_config(&s.net_dir, s.conf_name.as_deref()).unwrap(),
            primary,
            "CNI_CONF_NAME names it"
        );
        uninstall(&s, false).unwrap();
        assert!(!owned.exists());
        assert_eq!(std::fs::read_to_string(&primary).unwrap(), text);

        // A config that sorts before Istio's file: the runtime would take it; an error
        // (readiness blocked), never a silent bypass.
        std::fs::write(s.net_dir.join("00-multus.conflist"), text).unwrap();
        let e = ensure_chained(&s).unwrap_err().to_string();
        assert!(e.contains("00-multus.conflist") && e.contains("uncaptured"), "{e}");
    }

    /// Chained into the primary's own file, the file keeps the mode its CNI gave it.
    #[test]
    fn chaining_into_the_primarys_file_keeps_its_mode() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(dir.path(), None);
        std::fs::create_dir_all(&s.net_dir).unwrap();
        let primary = s.net_dir.join("10-calico.conflist");
        std::fs::write(&primary, r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"calico"}]}"#)
            .unwrap();
        std::fs::set_permissions(&primary, std::fs::Permissions::from_mode(0o660)).unwrap();
        assert_eq!(ensure_chained(&s).unwrap(), Some(primary.clone()));
        assert_eq!(std::fs::metadata(&primary).unwrap().permissions().mode() & 0o777, 0o660);
        assert_eq!(ensure_chained(&s).unwrap(), None);
    }

    /// The kubeconfig holds the node agent's token: it never passes through a file
    /// that was already there (which someone may hold open), and lands 0600.
    #[test]
    fn the_kubeconfig_is_written_to_a_file_of_its_own() {
        use std::io::Read as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(super::super::plugin::KUBECONFIG_NAME);
        let leftover = dir.path().join(format!(".{}.weir-tmp", super::super::plugin::KUBECONFIG_NAME));
        std::fs::write(&leftover, b"").unwrap();
        std::fs::set_permissions(&leftover, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut held = std::fs::File::open(&leftover).unwrap();
        write_atomic(&path, b"token: node-agent-secret", 0o600).unwrap();
        let mut seen = String::new();
        held.read_to_string(&mut seen).unwrap();
        assert_eq!(seen, "", "the token went through a file opened before it was written");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!((std::fs::read(&path).unwrap(), mode), (b"token: node-agent-secret".to_vec(), 0o600));
    }

    fn entry() -> Value {
        json!({"type": "weir-cni", "cni_agent_run_dir": "/var/run/istio-cni", "capture_mode": "auto"})
    }

    #[test]
    fn a_conf_becomes_a_list_and_a_list_gains_one_entry() {
        let conf = json!({"cniVersion": "1.0.0", "name": "cbr0", "type": "bridge", "bridge": "cni0"});
        let chained = insert(&conf, &entry()).unwrap();
        assert_eq!(chained["cniVersion"], "1.0.0");
        assert_eq!(chained["name"], "cbr0");
        assert_eq!(chained["plugins"][0]["type"], "bridge");
        assert!(chained["plugins"][0].get("cniVersion").is_none());
        assert_eq!(chained["plugins"][1], entry());
        assert!(is_installed(&chained, &entry()));

        let list = json!({"cniVersion": "0.4.0", "name": "k8s", "plugins": [
            {"type": "calico"}, {"type": "istio-cni", "log_level": "info"}, {"type": "portmap"}]});
        let chained = insert(&list, &entry()).unwrap();
        let types: Vec<_> =
            chained["plugins"].as_array().unwrap().iter().map(|p| p["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["calico", "portmap", "weir-cni"], "istio-cni is replaced, Weir goes last");
        assert_eq!(insert(&chained, &entry()).unwrap(), chained, "idempotent");
        let removed = remove(&chained);
        let types: Vec<_> =
            removed["plugins"].as_array().unwrap().iter().map(|p| p["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["calico", "portmap"]);
        assert!(insert(&json!({"name": "x"}), &entry()).is_err());
        assert!(insert(&json!([1]), &entry()).is_err());
    }

    #[test]
    fn the_primary_config_is_the_one_kubelet_would_pick() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(primary_config(dir.path(), None), Err(InstallError::NoPrimary { .. })));
        std::fs::write(
            dir.path().join("20-b.conflist"),
            r#"{"cniVersion":"1.0.0","name":"b","plugins":[{"type":"ptp"}]}"#,
        )
        .unwrap();
        std::fs::write(dir.path().join("10-a.conf"), r#"{"cniVersion":"1.0.0","name":"a","plugins":[]}"#)
            .unwrap();
        std::fs::write(dir.path().join("05-notes.txt"), "x").unwrap();
        assert_eq!(
            primary_config(dir.path(), None).unwrap(),
            dir.path().join("20-b.conflist"),
            "invalid configs skipped"
        );
        std::fs::write(dir.path().join("15-c.conf"), r#"{"cniVersion":"1.0.0","name":"c","type":"bridge"}"#)
            .unwrap();
        assert_eq!(primary_config(dir.path(), None).unwrap(), dir.path().join("15-c.conf"));
        assert_eq!(
            primary_config(dir.path(), Some("20-b.conflist")).unwrap(),
            dir.path().join("20-b.conflist")
        );
    }
}
