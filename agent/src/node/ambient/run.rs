//! The ambient node agent (`weir cni ambient`), started in Istio's order: the ZDS
//! socket bound (ztunnel's connection waits in its backlog), the node's host-probe rule
//! and sets in place, the node's pods and every namespace listed and watched, the
//! snapshot of enrolled pods restored (each pod's namespace found, so the first
//! ztunnel keeps every proxy), the reconcile queue started, ztunnel served, and only
//! then the plugin's event socket opened (an ADD before that fails and kubelet retries
//! it). Every long-lived task (the two watches and what feeds their events to the
//! cache, the reconcile queue, the ZDS server, the plugin's event socket, the host
//! probe) runs supervised: one that ends or panics before the agent stops is named in
//! the error the agent then exits with, and its pod restarts it, never an agent that
//! looks alive with a watch gone. Stopping removes nothing: every pod keeps its rules
//! and ztunnel its proxies until the next agent takes over.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc, time::Duration};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{
    controller::{self, SharedCluster},
    dataplane::Dataplane,
    hostprobe, listener,
    objects::{AmbientNamespace, AmbientPod},
    settings::AmbientSettings,
    snapshot,
    watch::{self, Collection},
};
use crate::{
    node::{cni::kube::KubeClient, zds::ZdsServer},
    support::{
        readiness::Readiness,
        services::{ServiceExit, Services},
    },
};

/// How long each task is given to stop before it is aborted.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("ZDS")]
    Zds(#[from] crate::node::zds::ZdsError),
    #[error(transparent)]
    HostProbe(#[from] hostprobe::HostProbeError),
    #[error("plugin event socket")]
    Listener(#[from] crate::node::local_socket::LocalSocketError),
    #[error("the {0} watch ended before its first list")]
    NoList(&'static str),
    #[error("a start-up task failed: {0}")]
    Task(String),
    #[error("a task of the node agent ended while it ran")]
    TaskEnded(#[source] ServiceExit),
}

/// What the agent's readiness waits for, cleared in start-up order.
const ZDS_BOUND: &str = "ZDS socket bound";
const HOST_PROBE: &str = "host probe rule in place";
const LISTED: &str = "pods and namespaces listed";
const SNAPSHOT: &str = "ZDS snapshot restored";
const EVENTS: &str = "plugin event socket open";

/// Every part the agent's readiness waits for.
pub const BLOCKERS: [&str; 5] = [ZDS_BOUND, HOST_PROBE, LISTED, SNAPSHOT, EVENTS];

/// The agent's readiness: not ready until every part is started.
pub fn readiness() -> Readiness {
    Readiness::new(&BLOCKERS)
}

/// Runs the agent until `stop`, clearing `readiness`'s blockers as it starts.
pub async fn run(
    settings: AmbientSettings,
    kube: KubeClient,
    readiness: Readiness,
    stop: CancellationToken,
) -> Result<(), AgentError> {
    let settings = Arc::new(settle_backend(settings).await?);
    tracing::info!(settings = %settings.describe(), "ambient node agent starting");
    if settings.selectors.is_empty() {
        tracing::warn!(
            "AMBIENT_ENABLEMENT_SELECTOR is empty: no pod will be enrolled (Istio's chart sets two selectors)"
        );
    }
    let zds = crate::node::zds::ZdsConfig { peer_uids: settings.ztunnel_uids.clone(), ..Default::default() };
    let server = ZdsServer::bind_with(&settings.ztunnel_socket, zds)?;
    readiness.clear(ZDS_BOUND);
    let kube = Arc::new(kube);
    // The node's probe sets, with the AWS branch-ENI rules carried along.
    let probes = Arc::new(super::branch_eni::BranchEniProbes::new(
        weir_iptables::ambient::probeset::ProbeSets::new(&settings.rules),
        &settings,
    ));
    let dataplane = Arc::new(Dataplane::new(settings.clone(), server.handle(), kube.clone(), probes));
    let s = settings.clone();
    let kubelet_uid = tokio::task::spawn_blocking(move || {
        let uid = hostprobe::kubelet_uid(&s)?;
        hostprobe::ensure(&s, uid).map(|v| (uid, v))
    })
    .await
    .map_err(|e| AgentError::Task(e.to_string()))??;
    tracing::info!(verdict = ?kubelet_uid.1, "host probe rule in place");
    readiness.clear(HOST_PROBE);
    let cluster: SharedCluster = Arc::default();
    let (queue, incoming) = mpsc::unbounded_channel();
    let mut tasks = Services::new();
    watch_cluster(&settings, kube.clone(), cluster.clone(), queue.clone(), &mut tasks).await?;
    readiness.clear(LISTED);
    let pods = cluster.read().unwrap_or_else(|p| p.into_inner()).pods();
    let report = snapshot::restore(&dataplane, &pods).await;
    tracing::info!(found = report.found, kept = report.kept.len(), "ZDS snapshot ready");
    readiness.clear(SNAPSHOT);
    let (d, c, q) = (dataplane.clone(), cluster.clone(), queue.clone());
    tasks.start_infallible("reconcile queue", move |stop| async move {
        tokio::select! {
            () = stop.cancelled() => {}
            () = controller::run(d, c, q, incoming) => {}
        }
    });
    for pod in &pods {
        let _ = queue.send(pod.uid.clone());
    }
    tasks.start("ZDS server", |stop| server.run(stop));
    let events = listener::bind(&settings.event_socket())?;
    let (d, c) = (dataplane.clone(), cluster.clone());
    tasks.start_infallible("plugin event socket", move |stop| listener::serve(events, d, c, stop));
    let addresses = enrolled_addresses(cluster.clone());
    let s = settings.clone();
    tasks.start_infallible("host probe", move |stop| hostprobe::keep(s, kubelet_uid.0, addresses, stop));
    readiness.clear(EVENTS);
    tracing::info!(socket = %settings.event_socket().display(), ztunnel = %settings.ztunnel_socket.display(), "ambient node agent ready");
    let result = supervise(&mut tasks, &stop).await;
    readiness.block("stopping");
    tasks.stop(STOP_GRACE).await;
    if result.is_ok() {
        tracing::info!("ambient node agent stopped: pods keep their rules, ztunnel its proxies");
    }
    result
}

/// `settings` with the backend this node really gets ([`super::backend::choose`]),
/// probed in the node's namespace (this process's).
async fn settle_backend(mut settings: AmbientSettings) -> Result<AmbientSettings, AgentError> {
    let (requested, ipv6) = (settings.rules.backend, settings.rules.enable_ipv6);
    let (backend, why) = tokio::task::spawn_blocking(move || {
        super::backend::choose(
            requested,
            ipv6,
            super::backend::ipset_exists,
            super::backend::nft_json_supported,
        )
    })
    .await
    .map_err(|e| AgentError::Task(e.to_string()))?;
    if let Some(why) = why {
        tracing::warn!(backend = ?backend, "{why}");
    }
    settings.rules.backend = backend;
    super::backend::record(backend);
    Ok(settings)
}

/// Runs until `stop`, or until one of `tasks` ends first: that one is named in the
/// error (the agent exits non-zero and its pod's restart policy starts a new one).
async fn supervise(tasks: &mut Services, stop: &CancellationToken) -> Result<(), AgentError> {
    tokio::select! {
        () = stop.cancelled() => Ok(()),
        exit = tasks.first_exit() => {
            tracing::error!(task = exit.name(), error = %crate::error_chain(&exit), "a task of the node agent ended: stopping the agent");
            Err(AgentError::TaskEnded(exit))
        }
    }
}

/// Starts the pod and namespace watches feeding `cluster` and `queue`; returns once
/// both have listed.
async fn watch_cluster(
    s: &AmbientSettings,
    kube: Arc<KubeClient>,
    cluster: SharedCluster,
    queue: mpsc::UnboundedSender<String>,
    tasks: &mut Services,
) -> Result<(), AgentError> {
    let pods = Collection {
        path: "/api/v1/pods".into(),
        selector: format!("fieldSelector=spec.nodeName%3D{}", s.node_name),
        parse: AmbientPod::from_value,
        kind: "pods",
    };
    let namespaces = Collection {
        path: "/api/v1/namespaces".into(),
        selector: String::new(),
        parse: AmbientNamespace::from_value,
        kind: "namespaces",
    };
    let (pod_tx, mut pod_rx) = mpsc::channel(256);
    let (ns_tx, mut ns_rx) = mpsc::channel(64);
    let (k1, k2) = (kube.clone(), kube);
    tasks
        .start_infallible("pod watch", move |stop| async move { watch::run(&k1, &pods, pod_tx, stop).await });
    tasks.start_infallible("namespace watch", move |stop| async move {
        watch::run(&k2, &namespaces, ns_tx, stop).await
    });
    // The first lists fill the cache before anything is queued.
    let first_ns = ns_rx.recv().await.ok_or(AgentError::NoList("namespaces"))?;
    controller::apply_namespace_event(&cluster, first_ns);
    let first_pods = pod_rx.recv().await.ok_or(AgentError::NoList("pods"))?;
    controller::apply_pod_event(&cluster, first_pods);
    let (c1, q1) = (cluster.clone(), queue.clone());
    tasks.start_infallible("pod events into the cache", move |stop| async move {
        while let Some(event) = until(&stop, pod_rx.recv()).await.flatten() {
            for uid in controller::apply_pod_event(&c1, event) {
                let _ = q1.send(uid);
            }
        }
    });
    tasks.start_infallible("namespace events into the cache", move |stop| async move {
        while let Some(event) = until(&stop, ns_rx.recv()).await.flatten() {
            for uid in controller::apply_namespace_event(&cluster, event) {
                let _ = queue.send(uid);
            }
        }
    });
    Ok(())
}

/// `f`'s output, or `None` once `stop` is cancelled.
async fn until<T>(stop: &CancellationToken, f: impl std::future::Future<Output = T>) -> Option<T> {
    tokio::select! {
        () = stop.cancelled() => None,
        v = f => Some(v),
    }
}

/// The enrolled pods' addresses, read from the cache when asked.
fn enrolled_addresses(cluster: SharedCluster) -> impl Fn() -> BTreeMap<String, Vec<IpAddr>> + Send + 'static {
    move || {
        let c = cluster.read().unwrap_or_else(|p| p.into_inner());
        c.pods()
            .into_iter()
            .filter(|p| p.fully_enrolled() && !p.ips.is_empty())
            .map(|p| (p.uid, p.ips))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_watch_that_ends_while_the_agent_runs_is_named_and_stops_the_agent() {
        let mut tasks = Services::new();
        tasks.start_infallible("namespace watch", |stop| async move { stop.cancelled().await });
        let (end, ended) = tokio::sync::oneshot::channel::<()>();
        tasks.start_infallible("pod watch", move |_| async move {
            let _ = ended.await;
        });
        drop(end);
        let stop = CancellationToken::new();
        let e = supervise(&mut tasks, &stop).await.expect_err("the agent must stop");
        assert_eq!(
            crate::error_chain(&e),
            "a task of the node agent ended while it ran: pod watch stopped on its own"
        );
        tasks.stop(Duration::from_millis(100)).await;
    }

    #[tokio::test]
    async fn a_task_that_panics_is_named() {
        let mut tasks = Services::new();
        tasks.start_infallible("reconcile queue", |_| async { panic!("a bad pod") });
        let e = supervise(&mut tasks, &CancellationToken::new()).await.expect_err("the agent must stop");
        assert_eq!(
            crate::error_chain(&e),
            "a task of the node agent ended while it ran: reconcile queue panicked: a bad pod"
        );
    }

    #[tokio::test]
    async fn the_shutdown_signal_ends_supervision_cleanly() {
        let mut tasks = Services::new();
        tasks.start_infallible("pod watch", |stop| async move { stop.cancelled().await });
        let stop = CancellationToken::new();
        stop.cancel();
        assert!(supervise(&mut tasks, &stop).await.is_ok());
        tasks.stop(Duration::from_millis(100)).await;
    }
}
