//! Weir as Istio's `install-cni` container: the one process that Istio's istio-cni
//! chart runs on every node (`command: [install-cni]`), with the chart's mounts,
//! capabilities, ConfigMap and ports, and Weir's image in place of Istio's. It runs what
//! Weir's own DaemonSet runs in three containers, under one supervisor:
//! - the installer: the plugin binary as `/host/opt/cni/bin/istio-cni`, chained into the
//!   node's CNI config as `"type": "istio-cni"` (so that rolling the chart from Istio's
//!   image to Weir's and back replaces one plugin in place, never chains two), the
//!   kubeconfig in `/var/run/istio-cni`, checked and restored every interval;
//! - repair (`REPAIR_ENABLED`, `REPAIR_REPAIR_PODS`): sidecar pods that started before
//!   the plugin are captured in place, found through the node's `/host/proc`;
//! - the ambient node agent (`AMBIENT_ENABLED`): ZDS for ztunnel, the plugin's event
//!   socket, in-pod rules, the node's probe rule.
//!
//! Readiness is served on 8000 `/readyz` as Istio's: ready once the plugin is chained
//! and, with ambient, once the node agent has started every part (each named while it
//! has not). Metrics are served on `MONITORING_PORT` (15014) under Istio's names
//! ([`crate::node::metrics`]). Both ports are bound in the pod's own network namespace,
//! before the process moves to the node's (`ALLOW_SWITCH_TO_HOST_NS`, where Istio runs
//! its host-side operations: the probe rule and its sets), so that kubelet's probe and
//! Prometheus reach them at the pod's address. A part that ends while the others run
//! ends the process, naming it; stopping leaves the plugin chained and every pod
//! captured (the next agent, Weir's or Istio's, adopts them).

use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener},
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use tokio_util::sync::CancellationToken;

use crate::{
    node::{
        ambient::{run as ambient_run, settings::AmbientSettings},
        cni::{
            install::{self, InstallSettings},
            kube::KubeClient,
            repair,
            spec::NetConf,
        },
        metrics,
    },
    support::{
        readiness::{self, Readiness},
        services::{ServiceExit, Services},
    },
};

/// Istio's readiness port (`constants.ReadinessPort`).
pub const READINESS_PORT: u16 = 8000;
/// Istio's default `MONITORING_PORT`.
pub const MONITORING_PORT: u16 = 15014;
/// The node's network namespace as the chart mounts it (`/host/proc`, PID 1).
pub const HOST_NETNS: &str = "/host/proc/1/ns/net";
/// How often repair looks at the node's pods.
pub const REPAIR_EVERY: Duration = Duration::from_secs(30);
/// How long each part is given to stop.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Why the node agent could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum IstioCniError {
    #[error("{port_name} {port}: cannot listen on the pod's address")]
    Bind {
        port_name: &'static str,
        port: u16,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "ALLOW_SWITCH_TO_HOST_NS: cannot enter the node's network namespace {path}: {reason} (is the host's /proc mounted at /host/proc, with SYS_ADMIN?)"
    )]
    HostNetns { path: PathBuf, reason: String },
    #[error("the {0} of the node agent ended while it ran")]
    PartEnded(&'static str, #[source] ServiceExit),
}

/// The repair part: what the plugin does for a pod, and where the node's pods are found.
#[derive(Debug)]
pub struct RepairPart {
    pub conf: NetConf,
    pub node_name: String,
    pub proc_dir: PathBuf,
    /// The plugin's kubeconfig (as the installer writes it).
    pub kubeconfig: PathBuf,
    pub interval: Duration,
}

/// Everything the process runs.
pub struct Parts {
    pub install: InstallSettings,
    pub install_interval: Duration,
    pub repair: Option<RepairPart>,
    pub ambient: Option<(AmbientSettings, KubeClient)>,
    /// The client that asks, at stop, whether the DaemonSet is still there (ambient).
    pub stop_kube: Option<KubeClient>,
}

/// Istio's DaemonSet, whose presence at stop tells an upgrade from an uninstall.
pub const DAEMONSET: &str = "istio-cni-node";

/// What the process does to the node when it stops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopPolicy {
    /// Leave the plugin chained and the node's probe rule: the next agent (Weir's or
    /// Istio's) adopts them, and pods that start meanwhile wait for it.
    Keep(&'static str),
    /// Take the plugin, its kubeconfig and binary out of the node's CNI folders, and the
    /// probe rule and sets out of the node's netfilter.
    CleanUp(&'static str),
}

/// istio-cni's decision at stop (cni/pkg/cmd/root.go's deferred cleanup and the node
/// agent's `ShouldStopCleanup`), from what the API said about [`DAEMONSET`]. Where the
/// API cannot answer (no answer, 429, 5xx), Istio cleans up; Weir keeps (pods then wait
/// for the next agent rather than start uncaptured). A DaemonSet whose required node
/// affinity no longer matches this node is, as for Istio, not an upgrade.
pub fn stop_policy(ambient: bool, disable_safe_upgrade: bool, daemonset: DaemonSetState) -> StopPolicy {
    if !ambient {
        return StopPolicy::CleanUp(
            "ambient is off: istio-cni's installer takes its plugin out on every stop",
        );
    }
    if disable_safe_upgrade {
        return StopPolicy::CleanUp("AMBIENT_DISABLE_SAFE_UPGRADE is true");
    }
    match daemonset {
        DaemonSetState::Present { deleting: false } => {
            StopPolicy::Keep("the DaemonSet is still there: an upgrade or a node reboot")
        }
        DaemonSetState::NotForThisNode => StopPolicy::CleanUp(
            "the DaemonSet's node affinity no longer takes this node: it will not come back here",
        ),
        DaemonSetState::Present { deleting: true } => {
            StopPolicy::CleanUp("the DaemonSet is being deleted: an uninstall")
        }
        DaemonSetState::Gone => StopPolicy::CleanUp("the DaemonSet is gone: an uninstall"),
        // `helm uninstall` deletes the agent's ServiceAccount and role with the
        // DaemonSet: a refused token is an uninstall too. Kept, the plugin would carry
        // a dead token and fail every pod's ADD on the node.
        DaemonSetState::Refused => StopPolicy::CleanUp(
            "the API refuses the agent's token (401/403): its account is gone, an uninstall",
        ),
        DaemonSetState::Unknown(_) => StopPolicy::Keep("the API cannot say whether the DaemonSet is there"),
    }
}

/// What the API says about [`DAEMONSET`] at stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DaemonSetState {
    Present {
        deleting: bool,
    },
    Gone,
    /// There, but its template's required node affinity no longer matches this node.
    NotForThisNode,
    /// 401 or 403: the agent's token or its role is no longer accepted.
    Refused,
    /// No answer, 429, 5xx, or one that does not parse: nothing can be told.
    Unknown(String),
}

/// What the API says about [`DAEMONSET`] in `namespace`, for node `node`: with a
/// required node affinity, the node is read and matched as Istio's
/// `ShouldStopCleanup` does.
async fn daemonset_state(kube: &KubeClient, namespace: &str, node: &str) -> DaemonSetState {
    use crate::node::{cni::kube::KubeError, node_affinity};
    let path = format!("/apis/apps/v1/namespaces/{namespace}/daemonsets/{DAEMONSET}");
    let ds = match kube.get_json(&path).await {
        Ok(ds) => ds,
        Err(KubeError::Status { status: 404, .. }) => return DaemonSetState::Gone,
        Err(KubeError::Status { status: 401 | 403, .. }) => return DaemonSetState::Refused,
        Err(e) => return DaemonSetState::Unknown(crate::error_chain(&e)),
    };
    let deleting = !ds["metadata"]["deletionTimestamp"].is_null();
    let Some(selector) = node_affinity::required_selector(&ds).filter(|_| !deleting) else {
        return DaemonSetState::Present { deleting };
    };
    let node_object = match kube.get_json(&format!("/api/v1/nodes/{node}")).await {
        Ok(n) => n,
        Err(e) => return DaemonSetState::Unknown(format!("node {node}: {}", crate::error_chain(&e))),
    };
    match node_affinity::matches(selector, &node_object) {
        Ok(true) => DaemonSetState::Present { deleting },
        Ok(false) => DaemonSetState::NotForThisNode,
        Err(e) => DaemonSetState::Unknown(e.to_string()),
    }
}

/// Takes Weir out of the node (blocking): the plugin's chain entry, kubeconfig and
/// binary; with ambient, the probe rule, then its sets, then the AWS branch-ENI rules
/// this process added.
fn clean_up(install: &InstallSettings, ambient: Option<&AmbientSettings>) {
    match install::uninstall(install, false) {
        Ok(_) => tracing::info!("the plugin is out of the CNI config"),
        Err(e) => {
            tracing::error!(error = %crate::error_chain(&e), "cannot take the plugin out of the CNI config")
        }
    }
    if let Some(a) = ambient {
        crate::node::ambient::hostprobe::remove_for_good(a);
    }
}

/// The ports, bound before anything else (and before the switch to the node's
/// namespace): readiness, and metrics unless its port is 0.
pub struct Ports {
    pub readiness: TcpListener,
    pub metrics: Option<TcpListener>,
}

/// Binds `port` on every address of the pod (IPv6 and IPv4 where the pod has IPv6;
/// IPv4 alone where it has not), as Go's `:port` does.
fn bind_all(port_name: &'static str, port: u16) -> Result<TcpListener, IstioCniError> {
    let listener = TcpListener::bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)))
        .or_else(|_| TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))))
        .map_err(|source| IstioCniError::Bind { port_name, port, source })?;
    listener.set_nonblocking(true).map_err(|source| IstioCniError::Bind { port_name, port, source })?;
    Ok(listener)
}

/// Binds the readiness port (8000) and `monitoring_port` (0: none).
pub fn bind_ports(monitoring_port: u16) -> Result<Ports, IstioCniError> {
    let readiness = bind_all("readiness port", READINESS_PORT)?;
    let metrics = match monitoring_port {
        0 => None,
        port => Some(bind_all("MONITORING_PORT", port)?),
    };
    Ok(Ports { readiness, metrics })
}

/// Moves this process into the network namespace at `path` (the node's). Only a
/// process with one thread moves whole (a namespace is per thread): it is called before
/// any runtime starts, and refuses otherwise. `Ok(false)` when the process is in it
/// already (a chart with `shareHostNetworkNamespace`).
pub fn enter_host_netns(path: &Path) -> Result<bool, IstioCniError> {
    use std::os::unix::fs::MetadataExt as _;
    let fail = |reason: String| IstioCniError::HostNetns { path: path.to_path_buf(), reason };
    let threads = std::fs::read_dir("/proc/self/task").map(|d| d.count()).map_err(|e| fail(e.to_string()))?;
    if threads != 1 {
        return Err(fail(format!("the process already runs {threads} threads")));
    }
    let target = std::fs::File::open(path).map_err(|e| fail(e.to_string()))?;
    let ours = std::fs::metadata("/proc/self/ns/net").map_err(|e| fail(format!("/proc/self/ns/net: {e}")))?;
    let theirs = target.metadata().map_err(|e| fail(e.to_string()))?;
    if (ours.dev(), ours.ino()) == (theirs.dev(), theirs.ino()) {
        return Ok(false);
    }
    nix::sched::setns(target.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
        .map_err(|e| fail(e.to_string()))?;
    Ok(true)
}

/// The blockers of the process's readiness: the plugin chained, and with ambient the
/// node agent's parts.
fn readiness_for(ambient: bool) -> Readiness {
    let mut blockers = vec![install::CHAINED];
    if ambient {
        blockers.extend_from_slice(&ambient_run::BLOCKERS);
    }
    Readiness::new(&blockers)
}

/// `/metrics`: the node agent's metrics under Istio's names.
async fn serve_metrics(listener: tokio::net::TcpListener) {
    crate::support::http1::serve(listener, |req, _| async move {
        use hyper::{Response, StatusCode, header::CONTENT_TYPE};
        if req.uri().path() != "/metrics" {
            let mut r = Response::new(http_body_util::Full::new(bytes::Bytes::from_static(b"not found\n")));
            *r.status_mut() = StatusCode::NOT_FOUND;
            return r;
        }
        let text = metrics::exposition() + "# EOF\n";
        let mut r = Response::new(http_body_util::Full::new(bytes::Bytes::from(text)));
        r.headers_mut().insert(
            CONTENT_TYPE,
            hyper::header::HeaderValue::from_static(
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            ),
        );
        r
    })
    .await
}

/// One repair pass (blocking: it lists through its own runtime and enters namespaces);
/// a pass that cannot list is logged and tried again at the next interval.
fn repair_pass(r: &RepairPart) {
    if let Err(e) = repair::pass(&r.conf, &r.kubeconfig, &r.node_name, &r.proc_dir) {
        tracing::warn!(kubeconfig = %r.kubeconfig.display(), error = %crate::error_chain(&e), "repair pass: cannot list the node's pods");
    }
}

/// Runs every part until `stop` (or until one ends, which is the error).
pub async fn run(parts: Parts, ports: Ports, stop: CancellationToken) -> Result<(), IstioCniError> {
    let Parts { install: settings, install_interval, repair, ambient, stop_kube } = parts;
    let ambient_settings = ambient.as_ref().map(|(a, _)| a.clone());
    let readiness = readiness_for(ambient.is_some());
    let bound = |port_name, port, source| IstioCniError::Bind { port_name, port, source };
    let r = tokio::net::TcpListener::from_std(ports.readiness)
        .map_err(|e| bound("readiness port", READINESS_PORT, e))?;
    let mut tasks = Services::new();
    let ready = readiness.clone();
    tasks.start_infallible("readiness server", move |stop| async move {
        tokio::select! { () = stop.cancelled() => {}, () = readiness::serve(r, ready) => {} }
    });
    if let Some(m) = ports.metrics {
        let port = m.local_addr().map(|a| a.port()).unwrap_or_default();
        let m = tokio::net::TcpListener::from_std(m).map_err(|e| bound("MONITORING_PORT", port, e))?;
        tasks.start_infallible("metrics server", move |stop| async move {
            tokio::select! { () = stop.cancelled() => {}, () = serve_metrics(m) => {} }
        });
    }
    if let Some((settings, kube)) = ambient {
        let ready = readiness.clone();
        tasks.start("ambient node agent", move |stop| ambient_run::run(settings, kube, ready, stop));
    }
    let ready = readiness.clone();
    let settings = Arc::new(settings);
    let installer = settings.clone();
    tasks.start("installer", move |stop| async move {
        install::watch(&installer, install_interval, &ready, stop.cancelled()).await
    });
    if let Some(part) = repair {
        let part = Arc::new(part);
        tasks.start_infallible("repair", move |stop| async move {
            loop {
                let p = part.clone();
                let _ = tokio::task::spawn_blocking(move || repair_pass(&p)).await;
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(part.interval) => {}
                }
            }
        });
    }
    let result = tokio::select! {
        () = stop.cancelled() => Ok(()),
        exit = tasks.first_exit() => {
            tracing::error!(part = exit.name(), error = %crate::error_chain(&exit), "a part of the node agent ended: stopping");
            Err(IstioCniError::PartEnded(exit.name(), exit))
        }
    };
    readiness.block("stopping");
    metrics::install_ready(false);
    tasks.stop(STOP_GRACE).await;
    let daemonset = match (&stop_kube, &ambient_settings) {
        (Some(kube), Some(a)) => daemonset_state(kube, &a.pod_namespace, &a.node_name).await,
        _ => DaemonSetState::Gone,
    };
    let disable = ambient_settings.as_ref().is_some_and(|a| a.disable_safe_upgrade);
    match stop_policy(ambient_settings.is_some(), disable, daemonset) {
        StopPolicy::Keep(why) => {
            tracing::info!(reason = why, "stopped: the plugin stays chained, every pod keeps its capture")
        }
        StopPolicy::CleanUp(why) => {
            tracing::info!(reason = why, "stopping for good: taking Weir out of the node");
            let _ = tokio::task::spawn_blocking(move || clean_up(&settings, ambient_settings.as_ref())).await;
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_cleans_up_as_istio_cni_does_and_keeps_where_the_api_cannot_say() {
        use DaemonSetState::*;
        use StopPolicy::*;
        let present = || Present { deleting: false };
        assert!(matches!(stop_policy(false, false, present()), CleanUp(_)), "sidecar-only: always");
        assert!(matches!(stop_policy(true, true, present()), CleanUp(_)), "safe upgrade disabled");
        assert!(matches!(stop_policy(true, false, present()), Keep(_)), "an upgrade");
        assert!(matches!(stop_policy(true, false, Present { deleting: true }), CleanUp(_)), "being deleted");
        assert!(matches!(stop_policy(true, false, Gone), CleanUp(_)), "gone");
        assert!(matches!(stop_policy(true, false, NotForThisNode), CleanUp(_)), "moved off this node");
        assert!(matches!(stop_policy(true, false, Refused), CleanUp(_)), "the account deleted with it");
        assert!(matches!(stop_policy(true, false, Unknown("503".into())), Keep(_)), "cannot tell");
    }

    #[test]
    fn readiness_waits_for_the_chain_and_with_ambient_for_the_node_agent() {
        let sidecar = readiness_for(false);
        assert_eq!(sidecar.pending(), vec![install::CHAINED]);
        let ambient = readiness_for(true);
        assert!(ambient.pending().contains(&install::CHAINED));
        for part in ambient_run::BLOCKERS {
            assert!(ambient.pending().contains(&part), "{part}");
        }
    }
}
