//! `weir cni install|uninstall|repair|ambient|ambient-rules`: the node side of the CNI
//! plugin, as istio-cni's DaemonSet runs it (flags, or the same env vars Istio's
//! installer and node agent read).

use std::{path::PathBuf, time::Duration};

use anyhow::Context as _;
use clap::{Args, Subcommand};
use serde_json::{Map, Value, json};

use crate::{
    node::cni::install::{self, InstallSettings, KubeconfigSource},
    support::privileges::{self, Capability},
};

#[derive(Debug, Args)]
pub struct CniArgs {
    #[command(subcommand)]
    pub command: CniCommand,
}

#[derive(Debug, Subcommand)]
pub enum CniCommand {
    /// Install the plugin and chain it into the primary CNI's config, and keep it there
    /// (unless --once). Stopping (SIGTERM) leaves everything in place: pods stay
    /// captured through restarts and rollouts.
    Install(InstallArgs),
    /// Take the plugin out: its chain entry, kubeconfig and binary (new pods are no
    /// longer captured). The node's eBPF capture stays while pods are registered with
    /// it, unless --detach-running-pods.
    Uninstall(InstallArgs),
    /// Capture the node's sidecar pods that started before the plugin was installed.
    Repair(RepairArgs),
    /// Run the ambient node agent (istio-cni's ambient side): enroll this node's ambient
    /// pods (in-pod rules, then ztunnel over ZDS), serve the plugin's add events, keep
    /// the node's probe rule. Settings come from istio-cni's environment
    /// (AMBIENT_ENABLED, AMBIENT_ENABLEMENT_SELECTOR, ...; docs/install.md); with
    /// AMBIENT_ENABLED false it idles until stopped.
    Ambient(AmbientArgs),
    /// Print the rules the ambient agent would program (dry run): a pod's in-pod rules
    /// for the environment's settings and its annotations, or the node's probe rule.
    AmbientRules(AmbientRulesArgs),
}

#[derive(Debug, Args)]
pub struct AmbientArgs {
    /// A kubeconfig to use instead of the pod's service account.
    #[arg(long, env = "WEIR_AMBIENT_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The service account folder (token, ca.crt) for the in-cluster client.
    #[arg(long, default_value = "/var/run/secrets/kubernetes.io/serviceaccount")]
    pub service_account_dir: PathBuf,
    /// Serve `/readyz` (ready once the agent has started every part, each named while
    /// it is not) and `/healthz` on this port (0: off).
    #[arg(long, env = "WEIR_AMBIENT_READINESS_PORT", default_value_t = 0)]
    pub readiness_port: u16,
    /// The address `/readyz` listens on: the pod's own (`POD_IP`), loopback when unset.
    #[arg(long, env = "POD_IP", default_value = "127.0.0.1")]
    pub readiness_address: std::net::IpAddr,
}

#[derive(Debug, Args)]
pub struct AmbientRulesArgs {
    /// A pod annotation (KEY=VALUE; repeat): ambient.istio.io/dns-capture,
    /// ambient.istio.io/bypass-inbound-capture, istio.io/reroute-virtual-interfaces.
    #[arg(long = "annotation")]
    pub annotations: Vec<String>,
    /// The node's kubelet-probe SNAT rule instead of a pod's rules.
    #[arg(long)]
    pub host_probe: bool,
    /// kubelet's uid, for the nftables probe rule.
    #[arg(long, default_value_t = 0)]
    pub kubelet_uid: u32,
}

/// The Kubernetes client of the ambient agent: the kubeconfig given, else the pod's
/// service account (`KUBERNETES_SERVICE_HOST`/`_PORT`, its token re-read per request).
pub(crate) fn ambient_kube(a: &AmbientArgs) -> anyhow::Result<crate::node::cni::kube::KubeClient> {
    use crate::node::cni::kube::{Credentials, KubeClient, Kubeconfig};
    if let Some(path) = &a.kubeconfig {
        return Ok(KubeClient::load(path)?);
    }
    let host = std::env::var("KUBERNETES_SERVICE_HOST")
        .context("KUBERNETES_SERVICE_HOST is not set (not in a pod?): pass --kubeconfig")?;
    let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    let ca = a.service_account_dir.join("ca.crt");
    let config = Kubeconfig {
        server: format!("https://{host}:{port}").parse().context("the API server's address")?,
        ca_pem: Some(std::fs::read(&ca).with_context(|| format!("read {}", ca.display()))?),
        insecure: false,
        credentials: Credentials::TokenFile(a.service_account_dir.join("token")),
    };
    Ok(KubeClient::new(&a.service_account_dir, config)?)
}

fn ambient(a: &AmbientArgs) -> anyhow::Result<()> {
    use crate::node::ambient::{run, settings::AmbientSettings};
    let settings =
        AmbientSettings::from_settings(|k| std::env::var(k).ok()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let runtime = crate::support::runtime::workers("the ambient node agent", 2)?;
    runtime.block_on(async {
        let stop = crate::support::shutdown::Shutdown::watch()?.token();
        let readiness = run::readiness();
        crate::support::readiness::serve_on(a.readiness_address, a.readiness_port, readiness.clone())
            .await
            .context("--readiness-port")?;
        if !settings.enabled {
            tracing::info!("AMBIENT_ENABLED is not true: the ambient node agent idles (sidecar pods are served by the plugin)");
            for blocker in readiness.pending() {
                readiness.clear(blocker);
            }
            stop.cancelled().await;
            return Ok(());
        }
        let kube = ambient_kube(a)?;
        let for_good = settings.disable_safe_upgrade.then(|| settings.clone());
        run::run(settings, kube, readiness, stop).await.map_err(|e| anyhow::anyhow!("{}", crate::error_chain(&e)))?;
        if let Some(settings) = for_good {
            tracing::info!("AMBIENT_DISABLE_SAFE_UPGRADE is true: stopping for good, taking the node's probe rule out");
            tokio::task::spawn_blocking(move || crate::node::ambient::hostprobe::remove_for_good(&settings))
                .await
                .context("the node's clean-up")?;
        }
        Ok(())
    })
}

fn ambient_rules(a: &AmbientRulesArgs) -> anyhow::Result<()> {
    use crate::node::ambient::rules_cmd::{RulesRequest, render};
    let cfg = weir_iptables::ambient::AmbientConfig::from_settings(|k| std::env::var(k).ok())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let req = RulesRequest {
        annotations: a.annotations.clone(),
        host_probe: a.host_probe,
        kubelet_uid: a.kubelet_uid,
    };
    println!("{}", render(&cfg, &req).map_err(|e| anyhow::anyhow!("{}", crate::error_chain(&e)))?);
    Ok(())
}

#[derive(Debug, Args)]
pub struct RepairArgs {
    /// This node's name (as in the pods' spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// The node's /proc (the DaemonSet runs with hostPID, so /proc is the host's): pods'
    /// namespaces are found through their processes' kubelet cgroups.
    #[arg(long, env = "WEIR_HOST_PROC", default_value = "/proc")]
    pub proc_dir: PathBuf,
    /// The plugin's kubeconfig (as installed).
    #[arg(long, default_value = "/var/run/istio-cni/istio-cni-kubeconfig")]
    pub kubeconfig: PathBuf,
    /// The plugin's options, as `install` chained them.
    #[command(flatten)]
    pub plugin: PluginOptions,
    /// One pass, then exit 1 if any pod could not be repaired.
    #[arg(long)]
    pub once: bool,
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub interval: Duration,
}

fn repair(a: &RepairArgs) -> anyhow::Result<()> {
    use crate::node::cni::{repair, spec::NetConf};
    let mut conf = a.plugin.fields()?;
    conf.insert("cniVersion".into(), json!("1.0.0"));
    conf.insert("name".into(), json!("weir-repair"));
    conf.insert("ebpf_node_capture".into(), json!(a.plugin.ebpf_name));
    let conf = Value::Object(conf);
    let conf = NetConf::parse(conf.to_string().as_bytes()).map_err(|e| anyhow::anyhow!("{e}"))?;
    loop {
        let report = repair::pass(&conf, &a.kubeconfig, &a.node_name, &a.proc_dir)?;
        if a.once {
            for (pod, netns) in &report.repaired {
                println!("repaired {pod} in {}", netns.display());
            }
            for pod in &report.not_found {
                println!(
                    "not found {pod} (no process of it runs on this node, per {})",
                    a.proc_dir.display()
                );
            }
            anyhow::ensure!(
                report.failed.is_empty(),
                "could not repair: {}",
                report.failed.iter().map(|(p, e)| format!("{p}: {e}")).collect::<Vec<_>>().join("; ")
            );
            return Ok(());
        }
        std::thread::sleep(a.interval);
    }
}

#[derive(Debug, Args)]
pub struct InstallArgs {
    /// The CNI network config dir (the host's /etc/cni/net.d, mounted).
    #[arg(long, env = "MOUNTED_CNI_NET_DIR", default_value = "/host/etc/cni/net.d")]
    pub cni_net_dir: PathBuf,
    /// The CNI plugin dir (the host's /opt/cni/bin, mounted).
    #[arg(long, env = "CNI_BIN_DIR", default_value = "/host/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    /// The primary config's file name (default: the one kubelet picks).
    #[arg(long, env = "CNI_CONF_NAME")]
    pub cni_conf_name: Option<String>,
    /// Where the plugin's kubeconfig goes (the plugin's cni_agent_run_dir).
    #[arg(long, env = "CNI_AGENT_RUN_DIR", default_value = crate::node::cni::plugin::DEFAULT_RUN_DIR)]
    pub run_dir: PathBuf,
    /// Copy this kubeconfig instead of building one from the pod's service account.
    #[arg(long, env = "WEIR_CNI_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The folder (token, ca.crt) of the token the plugin's in-cluster kubeconfig
    /// carries. The DaemonSet points it at a token of its own whose role only reads pods
    /// and namespaces (the agent's own token may patch pods/status).
    #[arg(
        long,
        env = "WEIR_PLUGIN_TOKEN_DIR",
        default_value = "/var/run/secrets/kubernetes.io/serviceaccount"
    )]
    pub service_account_dir: PathBuf,
    #[command(flatten)]
    pub plugin: PluginOptions,
    /// Write the CNI config with group read (0640) instead of Istio's 0600.
    #[arg(long, env = "CNI_CONF_GROUP_READ", default_value = "false", value_parser = go_bool, action = clap::ArgAction::Set)]
    pub cni_conf_group_read: bool,
    /// The kubeconfig's file mode (Istio's `KUBECONFIG_MODE`: `0600`; a leading 0 is octal).
    #[arg(long, env = "KUBECONFIG_MODE", default_value = "0600", value_parser = file_mode)]
    pub kubeconfig_mode: u32,
    /// The plugin's log level.
    #[arg(long, env = "PLUGIN_LOG_LEVEL", default_value = "info")]
    pub plugin_log_level: String,
    /// Attach Weir's eBPF capture to this cgroup (the one holding the node's pods,
    /// e.g. /sys/fs/cgroup/kubepods.slice); pods are then registered by the plugin.
    #[arg(long, env = "WEIR_EBPF_CGROUP")]
    pub ebpf_cgroup: Option<PathBuf>,
    /// The plugin binary to install (default: `weir-cni` next to this executable, as
    /// the weir-cni image has it; else this executable, which is the plugin too when
    /// named weir-cni).
    #[arg(long)]
    pub binary: Option<PathBuf>,
    /// One pass, then exit (no watching, no uninstall).
    #[arg(long)]
    pub once: bool,
    /// How often the chain and kubeconfig are checked.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub interval: Duration,
    /// Accepted for compatibility: stopping always leaves the plugin installed and
    /// every pod captured.
    #[arg(long, hide = true)]
    pub keep_on_exit: bool,
    /// With `uninstall`: also take eBPF capture away from the pods still registered
    /// with the node capture (they then send and receive around their sidecars).
    #[arg(long)]
    pub detach_running_pods: bool,
    /// Serve `/metrics` (eBPF capture decision counters) on this port (istio-cni's
    /// monitoring port is 15014; 0: off).
    #[arg(long, env = "MONITORING_PORT", default_value_t = 0)]
    pub monitoring_port: u16,
    /// The address `/metrics` listens on: the pod's own (the DaemonSet sets `POD_IP`
    /// from status.podIP), loopback when unset, never every address of the node.
    #[arg(long, env = "POD_IP", default_value = "127.0.0.1")]
    pub monitoring_address: std::net::IpAddr,
    /// Name each pod in `/metrics` (`pod="<namespace>/<name>"`); without it only the
    /// node's totals are served.
    #[arg(long, env = "WEIR_METRICS_POD_LABELS", default_value_t = false)]
    pub metrics_pod_labels: bool,
    /// Serve `/readyz` (ready once weir-cni is chained into the CNI config; the answer
    /// names what is not ready yet) and `/healthz` on this port, at the `/metrics`
    /// address (istio-cni's is 8000; 0: off).
    #[arg(long, env = "WEIR_READINESS_PORT", default_value_t = 0)]
    pub readiness_port: u16,
}

/// What the plugin does for pods, shared by `install` (written into the chain) and
/// `repair` (applied the same way).
#[derive(Debug, Args)]
pub struct PluginOptions {
    /// ebpf, nftables, iptables or auto.
    #[arg(long, env = "WEIR_CAPTURE_MODE", default_value = "auto")]
    pub capture_mode: String,
    /// Istio's native nftables switch.
    #[arg(long, env = "NATIVE_NFTABLES", default_value_t = false)]
    pub native_nftables: bool,
    /// Namespaces whose pods are never captured (comma separated).
    #[arg(long, env = "EXCLUDE_NAMESPACES", default_value = "kube-system")]
    pub exclude_namespaces: String,
    /// The eBPF node capture's name (its pins under /sys/fs/bpf/weir/).
    #[arg(long, default_value = crate::node::cni::ebpf::DEFAULT_NODE_CAPTURE)]
    pub ebpf_name: String,
    /// Istio's ambient switch: the plugin hands ambient pods to `weir cni ambient`.
    #[arg(long, env = "AMBIENT_ENABLED", default_value_t = false)]
    pub ambient_enabled: bool,
    /// Istio's enablement selector (YAML), written into the plugin's config as JSON.
    #[arg(long, env = "AMBIENT_ENABLEMENT_SELECTOR", default_value = "")]
    pub ambient_enablement_selector: String,
    /// Istio's switch for retrying the plugin's ambient check.
    #[arg(long, env = "ENABLE_AMBIENT_DETECTION_RETRY", default_value_t = false)]
    pub enable_ambient_detection_retry: bool,
    /// The node agent's own namespace (its pods are never captured).
    #[arg(long, env = "POD_NAMESPACE")]
    pub pod_namespace: Option<String>,
}

impl PluginOptions {
    /// The plugin's config fields.
    pub(crate) fn fields(&self) -> anyhow::Result<Map<String, Value>> {
        let mode = self.capture_mode.as_str();
        anyhow::ensure!(
            matches!(mode, "ebpf" | "nftables" | "iptables" | "auto"),
            "--capture-mode {mode:?}: expected ebpf, nftables, iptables or auto"
        );
        let excluded: Vec<Value> = self
            .exclude_namespaces
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(|n| json!(n))
            .collect();
        let mut fields = Map::new();
        fields.insert("exclude_namespaces".into(), Value::Array(excluded));
        fields.insert("capture_mode".into(), json!(mode));
        fields.insert("native_nftables".into(), json!(self.native_nftables));
        let selectors =
            crate::node::enroll::selector::EnablementSelectors::parse(&self.ambient_enablement_selector)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        fields.insert("ambient_enabled".into(), json!(self.ambient_enabled));
        fields.insert("enablement_selectors".into(), json!(selectors.entries()));
        fields.insert("enable_ambient_detection_retry".into(), json!(self.enable_ambient_detection_retry));
        if let Some(ns) = self.pod_namespace.as_deref().filter(|n| !n.is_empty()) {
            fields.insert("pod_namespace".into(), json!(ns));
        }
        Ok(fields)
    }
}

/// A boolean as Go's `strconv.ParseBool` reads it (Istio's settings are parsed so).
pub fn go_bool(v: &str) -> Result<bool, String> {
    match v.trim() {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" | "" => Ok(false),
        other => Err(format!("{other:?} is not a boolean (true or false)")),
    }
}

/// A file mode as Istio's `KUBECONFIG_MODE` is read (Go's base-0 integers: `0600` and
/// `0o600` octal, `384` decimal), at most 0777.
pub fn file_mode(v: &str) -> Result<u32, String> {
    let t = v.trim();
    let parsed = if let Some(hex) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        u32::from_str_radix(hex, 16)
    } else if let Some(oct) = t.strip_prefix("0o").or_else(|| t.strip_prefix("0O")) {
        u32::from_str_radix(oct, 8)
    } else if t.len() > 1 && t.starts_with('0') {
        u32::from_str_radix(&t[1..], 8)
    } else {
        t.parse()
    };
    parsed
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{v:?} is not a file mode such as 0600 or 0640 (at most 0777)"))
}

pub(crate) fn parse_duration(v: &str) -> Result<Duration, String> {
    crate::support::text::parse_duration(v)
        .ok_or_else(|| format!("{v:?} is not a duration such as 1s or 500ms"))
}

impl InstallArgs {
    fn settings(&self) -> anyhow::Result<InstallSettings> {
        let mut plugin = self.plugin.fields()?;
        plugin.insert("plugin_log_level".into(), json!(self.plugin_log_level));
        let kubeconfig = match &self.kubeconfig {
            Some(path) => KubeconfigSource::File(path.clone()),
            None => KubeconfigSource::ServiceAccount {
                host: std::env::var("KUBERNETES_SERVICE_HOST")
                    .context("KUBERNETES_SERVICE_HOST is not set (not in a pod?): pass --kubeconfig")?,
                port: std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into()),
                dir: self.service_account_dir.clone(),
            },
        };
        Ok(InstallSettings {
            net_dir: self.cni_net_dir.clone(),
            bin_dir: self.cni_bin_dir.clone(),
            conf_name: self.cni_conf_name.clone(),
            run_dir: self.run_dir.clone(),
            plugin,
            binary: match &self.binary {
                Some(b) => b.clone(),
                None => default_plugin_binary(&std::env::current_exe().context("find this executable")?),
            },
            kubeconfig,
            ebpf: self.ebpf_cgroup.clone().map(|cgroup| (self.plugin.ebpf_name.clone(), cgroup)),
            plugin_type: install::PLUGIN_TYPE,
            config_mode: if self.cni_conf_group_read {
                install::CONFIG_MODE_GROUP_READ
            } else {
                install::CONFIG_MODE
            },
            kubeconfig_mode: self.kubeconfig_mode,
            owned_config: None,
        })
    }
}

/// The plugin binary shipped with `exe`: `weir-cni` in its folder (the plugin alone,
/// which starts in a fraction of `weir`'s time) when it is this build's (it carries
/// [`crate::support::build_info::BUILD_MARKER`]: the same eBPF program set as the node capture
/// `weir` attaches), owned by `exe`'s owner and writable by no one else; else `exe`
/// itself, with a warning naming why. A stale or planted file is never installed.
pub fn default_plugin_binary(exe: &std::path::Path) -> PathBuf {
    use std::os::unix::fs::MetadataExt as _;
    let small = exe.with_file_name(crate::node::cni::install::PLUGIN_TYPE);
    let refused = |why: String| {
        tracing::warn!(plugin = %small.display(), installing = %exe.display(), "{why}: installing weir itself as the plugin");
        exe.to_path_buf()
    };
    let Ok(meta) = std::fs::metadata(&small) else { return exe.to_path_buf() };
    let owner = std::fs::metadata(exe).map(|m| m.uid()).ok();
    if !meta.is_file() {
        return refused("not a file".into());
    }
    if Some(meta.uid()) != owner || meta.mode() & 0o022 != 0 {
        return refused(format!(
            "owned by uid {} with mode {:o}: not {}'s owner's alone",
            meta.uid(),
            meta.mode() & 0o7777,
            exe.display()
        ));
    }
    match std::fs::read(&small) {
        Ok(bytes) if crate::support::build_info::carries_build_marker(&bytes) => small,
        Ok(_) => refused(format!("not this build's ({})", crate::support::build_info::BUILD_INFO)),
        Err(e) => refused(format!("unreadable: {e}")),
    }
}

/// A node whose kernel cannot run eBPF capture (before 5.15, a cgroup v1 host), or
/// whose pods' cgroup sits below programs that make it unsafe (a flagless, overridable
/// or pre-order one: `capture::ebpf::ancestors`), still gets the plugin: its pods are
/// captured with netfilter (`auto` finds no node capture), and the log says why. Only
/// `--capture-mode ebpf` makes that an error.
fn node_capture_or_fallback(s: &mut InstallSettings, capture_mode: &str) -> anyhow::Result<()> {
    let Some((name, cgroup)) = &s.ebpf else { return Ok(()) };
    if crate::node::cni::ebpf::node_capture_present(name) {
        return Ok(());
    }
    let detect = || {
        use crate::capture::ebpf::detect;
        detect::ebpf_unavailable().or_else(|| detect::ebpf_unsafe_for(cgroup))
    };
    let Some(why) = detect() else { return Ok(()) };
    anyhow::ensure!(
        capture_mode != "ebpf",
        "--capture-mode ebpf with --ebpf-cgroup {}: eBPF capture cannot work on this node: {why}",
        cgroup.display()
    );
    tracing::warn!(
        cgroup = %cgroup.display(),
        reason = %why,
        "eBPF node capture unavailable: pods are captured with netfilter"
    );
    s.ebpf = None;
    Ok(())
}

/// The node agent's monitoring endpoint: `/metrics` with the decision counters of every
/// pod captured on this node and how full the node-wide maps are, read from the pinned
/// maps. Reading bpffs is blocking work: it runs on a blocking thread, one scrape at a
/// time, and a scrape within a second of the last is answered from it, so a scrape
/// flood never delays the loop that keeps the plugin chained.
async fn monitoring(
    path: String,
    cache: std::sync::Arc<tokio::sync::Mutex<Option<(std::time::Instant, bytes::Bytes)>>>,
    read: impl FnOnce() -> bytes::Bytes + Send + 'static,
) -> hyper::Response<http_body_util::Full<bytes::Bytes>> {
    use hyper::{Response, StatusCode, header::CONTENT_TYPE};
    if path != "/metrics" {
        let mut r = Response::new(http_body_util::Full::new(bytes::Bytes::from_static(b"not found\n")));
        *r.status_mut() = StatusCode::NOT_FOUND;
        return r;
    }
    let mut cached = cache.lock().await;
    let text = match cached.as_ref().filter(|(at, _)| at.elapsed() < Duration::from_secs(1)) {
        Some((_, text)) => text.clone(),
        None => {
            let text = tokio::task::spawn_blocking(read).await.unwrap_or_default();
            *cached = Some((std::time::Instant::now(), text.clone()));
            text
        }
    };
    drop(cached);
    let mut r = Response::new(http_body_util::Full::new(text));
    r.headers_mut().insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

/// The metrics text, read from bpffs (blocking).
fn metrics_text(labels: crate::capture::ebpf::metrics::PodLabels) -> bytes::Bytes {
    let (mut readable, mut unreadable) = (Vec::new(), 0);
    for (pod, counters) in crate::capture::ebpf::metrics::pod_counters() {
        match counters {
            Ok(c) => readable.push((pod, c)),
            Err(e) => {
                unreadable += 1;
                tracing::warn!(pod, error = %crate::error_chain(&e), "capture counters left out of /metrics");
            }
        }
    }
    bytes::Bytes::from(crate::capture::ebpf::metrics::exposition_with(
        &readable,
        unreadable,
        &crate::capture::ebpf::metrics::map_fill(),
        labels,
    ))
}

pub fn run(args: CniArgs) -> anyhow::Result<()> {
    match args.command {
        CniCommand::Ambient(a) => {
            privileges::require(
                &[Capability::SysAdmin, Capability::NetAdmin, Capability::NetRaw, Capability::SysPtrace],
                "weir cni ambient",
            )?;
            ambient(&a)
        }
        CniCommand::AmbientRules(a) => ambient_rules(&a),
        CniCommand::Repair(a) => {
            privileges::require(
                &[Capability::SysAdmin, Capability::NetAdmin, Capability::SysPtrace],
                "weir cni repair",
            )?;
            repair(&a)
        }
        CniCommand::Uninstall(a) => {
            if a.ebpf_cgroup.is_some() {
                privileges::require(
                    &[Capability::SysAdmin, Capability::Bpf],
                    "weir cni uninstall --ebpf-cgroup",
                )?;
            }
            let done = install::uninstall(&a.settings()?, a.detach_running_pods)?;
            if done.pods_kept_captured > 0 {
                eprintln!(
                    "weir: the plugin is out of the chain (new pods are not captured); the eBPF node capture stays for the {} pods still registered with it: `weir cni uninstall --detach-running-pods` takes it away from them",
                    done.pods_kept_captured
                );
            }
            Ok(())
        }
        CniCommand::Install(a) => {
            if a.ebpf_cgroup.is_some() {
                privileges::require(
                    &[Capability::SysAdmin, Capability::NetAdmin, Capability::Bpf],
                    "weir cni install --ebpf-cgroup",
                )?;
            }
            let mut s = a.settings()?;
            let for_good = crate::node::ambient::settings::safe_upgrade_disabled(|k| std::env::var(k).ok())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            if a.once {
                node_capture_or_fallback(&mut s, &a.plugin.capture_mode)?;
                let changes = install::ensure(&s)?;
                tracing::info!(?changes, "weir-cni installed");
                return Ok(());
            }
            let runtime = crate::support::runtime::current_thread("the node agent's install loop")?;
            // SIGTERM and SIGINT are caught from before the node capture is attached: a
            // rollout that stops the agent while it starts ends it cleanly after one
            // pass, never by the signal's default action half way.
            let shutdown = {
                let _runtime = runtime.enter();
                crate::support::shutdown::Shutdown::watch()?
            };
            node_capture_or_fallback(&mut s, &a.plugin.capture_mode)?;
            runtime.block_on(async {
                if a.monitoring_port != 0 {
                    let at = std::net::SocketAddr::new(a.monitoring_address, a.monitoring_port);
                    let listener = tokio::net::TcpListener::bind(at)
                        .await
                        .with_context(|| format!("--monitoring-port {}: cannot listen on {at}", a.monitoring_port))?;
                    let labels = if a.metrics_pod_labels {
                        crate::capture::ebpf::metrics::PodLabels::Named
                    } else {
                        crate::capture::ebpf::metrics::PodLabels::NodeTotals
                    };
                    tracing::info!(address = %at, pods_named = a.metrics_pod_labels, "serving capture metrics on /metrics");
                    let cache = std::sync::Arc::new(tokio::sync::Mutex::new(None));
                    tokio::spawn(crate::support::http1::serve(listener, move |req, _| {
                        monitoring(req.uri().path().to_string(), cache.clone(), move || metrics_text(labels))
                    }));
                }
                let readiness = crate::support::readiness::Readiness::new(&[install::CHAINED]);
                crate::support::readiness::serve_on(a.monitoring_address, a.readiness_port, readiness.clone())
                    .await
                    .context("--readiness-port")?;
                let stop = async move { shutdown.requested().await };
                install::watch(&s, a.interval, &readiness, stop).await?;
                if for_good {
                    tracing::info!("AMBIENT_DISABLE_SAFE_UPGRADE is true: stopping for good, taking the plugin out of the CNI config");
                    install::uninstall(&s, false)?;
                } else {
                    tracing::info!("stopped; the plugin stays chained and every pod stays captured");
                }
                Ok(())
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    /// A folder holding a `weir` and, when given, a `weir-cni` with `bytes` and `mode`.
    fn layout(companion: Option<(&[u8], u32)>) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("weir");
        std::fs::write(&exe, b"weir").unwrap();
        if let Some((bytes, mode)) = companion {
            let plugin = dir.path().join("weir-cni");
            std::fs::write(&plugin, bytes).unwrap();
            std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        (dir, exe)
    }

    #[test]
    fn install_takes_the_companion_plugin_only_when_it_is_this_builds() {
        let this_build =
            [b"\x7fELF".as_slice(), crate::support::build_info::BUILD_MARKER.as_bytes()].concat();
        let (dir, exe) = layout(Some((&this_build, 0o755)));
        assert_eq!(default_plugin_binary(&exe), dir.path().join("weir-cni"));
        // None beside it: weir itself (it is the plugin too when named weir-cni).
        let (_dir, exe) = layout(None);
        assert_eq!(default_plugin_binary(&exe), exe);
        // Another build's (an older image layer, a partial rebuild): weir itself.
        let other = crate::support::build_info::BUILD_MARKER.replacen("weir-build:", "weir-build:0", 1);
        let (_dir, exe) = layout(Some((other.as_bytes(), 0o755)));
        assert_eq!(default_plugin_binary(&exe), exe);
        // This build's bytes, but writable by others: never installed.
        let (_dir, exe) = layout(Some((&this_build, 0o757)));
        assert_eq!(default_plugin_binary(&exe), exe);
        let (_dir, exe) = layout(Some((&this_build, 0o775)));
        assert_eq!(default_plugin_binary(&exe), exe);
    }

    use std::{
        sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        },
        time::Duration,
    };

    use super::*;

    fn options(ambient: bool, selector: &str) -> PluginOptions {
        PluginOptions {
            capture_mode: "auto".into(),
            native_nftables: false,
            exclude_namespaces: "kube-system".into(),
            ebpf_name: "cni-node".into(),
            ambient_enabled: ambient,
            ambient_enablement_selector: selector.into(),
            enable_ambient_detection_retry: false,
            pod_namespace: Some("kube-system".into()),
        }
    }

    #[test]
    fn the_plugins_config_carries_istios_ambient_fields() {
        let selector = "- podSelector: {matchLabels: {istio.io/dataplane-mode: ambient}}";
        let fields = Value::Object(options(true, selector).fields().unwrap());
        assert_eq!(fields["ambient_enabled"], true);
        assert_eq!(
            fields["enablement_selectors"],
            json!([{"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}, "namespaceSelector": {}}])
        );
        assert_eq!(fields["pod_namespace"], "kube-system");
        // The plugin reads back what install wrote.
        let mut conf = fields.clone();
        conf["cniVersion"] = json!("1.0.0");
        let parsed = crate::node::cni::spec::NetConf::parse(conf.to_string().as_bytes()).unwrap();
        assert!(parsed.ambient_enabled && parsed.enablement_selectors.len() == 1);
        let e = options(true, "- podSelector: {matchExpressions: [{key: k, operator: Near}]}")
            .fields()
            .unwrap_err();
        assert!(e.to_string().contains("AMBIENT_ENABLEMENT_SELECTOR"), "{e}");
    }

    /// A scrape whose bpffs read is stuck never holds the node agent's single-threaded
    /// runtime, where the loop that keeps the plugin chained runs: that loop (here, the
    /// test's own future on the same runtime) gets its turn while the read waits, and
    /// the scrape is answered once the read returns. Before, the read ran on the
    /// runtime and everything else waited for it (here, until the watchdog freed it).
    #[test]
    fn a_stuck_scrape_never_holds_the_loop_that_keeps_the_plugin_chained() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (release, stuck) = std::sync::mpsc::channel::<()>();
        let watchdog_fired = Arc::new(AtomicBool::new(false));
        let (fired, watchdog_release) = (watchdog_fired.clone(), release.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(10));
            fired.store(true, Ordering::SeqCst);
            let _ = watchdog_release.send(());
        });
        let cache = Arc::new(tokio::sync::Mutex::new(None));
        let (loop_ran_while_stuck, body) = runtime.block_on(async move {
            let scrape = tokio::spawn(monitoring("/metrics".into(), cache, move || {
                let _ = stuck.recv();
                bytes::Bytes::from_static(b"weir_up 1\n")
            }));
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            let ran = !watchdog_fired.load(Ordering::SeqCst);
            let _ = release.send(());
            let response = scrape.await.unwrap();
            let body = http_body_util::BodyExt::collect(response.into_body()).await.unwrap().to_bytes();
            (ran, body)
        });
        assert!(loop_ran_while_stuck, "the runtime waited for the scrape's read");
        assert_eq!(&body[..], b"weir_up 1\n");
    }
}
