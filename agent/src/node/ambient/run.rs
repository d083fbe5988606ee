//! The ambient node agent (`weir cni ambient`), started in Istio's order: the ZDS
//! socket bound (ztunnel's connection waits in its backlog), the node's host-probe rule
//! and sets in place, the node's pods and every namespace listed and watched, the
//! snapshot of enrolled pods restored (each pod's namespace found, so the first
//! ztunnel keeps every proxy), the reconcile queue started, ztunnel served, and only
//! then the plugin's event socket opened (an ADD before that fails and kubelet retries
//! it). Then it runs until SIGTERM; stopping removes nothing: every pod keeps its rules
//! and ztunnel its proxies until the next agent takes over.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

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
use crate::node::{cni::kube::KubeClient, zds::ZdsServer};

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
}

/// Runs the agent until `stop`.
pub async fn run(
    settings: AmbientSettings,
    kube: KubeClient,
    stop: CancellationToken,
) -> Result<(), AgentError> {
    let settings = Arc::new(settings);
    tracing::info!(settings = %settings.describe(), "ambient node agent starting");
    if settings.selectors.is_empty() {
        tracing::warn!(
            "AMBIENT_ENABLEMENT_SELECTOR is empty: no pod will be enrolled (Istio's chart sets two selectors)"
        );
    }
    let zds = crate::node::zds::ZdsConfig { peer_uids: settings.ztunnel_uids.clone(), ..Default::default() };
    let server = ZdsServer::bind_with(&settings.ztunnel_socket, zds)?;
    let kube = Arc::new(kube);
    let dataplane = Arc::new(Dataplane::new(settings.clone(), server.handle(), kube.clone()));
    let s = settings.clone();
    let kubelet_uid = tokio::task::spawn_blocking(move || {
        let uid = hostprobe::kubelet_uid(&s)?;
        hostprobe::ensure(&s, uid).map(|v| (uid, v))
    })
    .await
    .map_err(|e| AgentError::Task(e.to_string()))??;
    tracing::info!(verdict = ?kubelet_uid.1, "host probe rule in place");
    let cluster: SharedCluster = Arc::default();
    let (queue, incoming) = mpsc::unbounded_channel();
    watch_cluster(&settings, kube.clone(), cluster.clone(), queue.clone(), stop.clone()).await?;
    let pods = cluster.read().unwrap_or_else(|p| p.into_inner()).pods();
    let report = snapshot::restore(&dataplane, &pods).await;
    tracing::info!(found = report.found, kept = report.kept.len(), "ZDS snapshot ready");
    tokio::spawn(controller::run(dataplane.clone(), cluster.clone(), queue.clone(), incoming));
    for pod in &pods {
        let _ = queue.send(pod.uid.clone());
    }
    let zds_stop = stop.child_token();
    let zds = tokio::spawn(server.run(zds_stop.clone()));
    let events = listener::bind(&settings.event_socket())?;
    tokio::spawn(listener::serve(events, dataplane.clone(), cluster.clone(), stop.clone()));
    let addresses = enrolled_addresses(cluster.clone());
    tokio::spawn(hostprobe::keep(settings.clone(), kubelet_uid.0, addresses, stop.clone()));
    tracing::info!(socket = %settings.event_socket().display(), ztunnel = %settings.ztunnel_socket.display(), "ambient node agent ready");
    stop.cancelled().await;
    zds_stop.cancel();
    if let Ok(Err(e)) = zds.await {
        tracing::warn!(error = %crate::error_chain(&e), "ZDS server ended with an error");
    }
    tracing::info!("ambient node agent stopped: pods keep their rules, ztunnel its proxies");
    Ok(())
}

/// Starts the pod and namespace watches feeding `cluster` and `queue`; returns once
/// both have listed.
async fn watch_cluster(
    s: &AmbientSettings,
    kube: Arc<KubeClient>,
    cluster: SharedCluster,
    queue: mpsc::UnboundedSender<String>,
    stop: CancellationToken,
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
    let (k1, k2, s1, s2) = (kube.clone(), kube, stop.clone(), stop.clone());
    tokio::spawn(async move { watch::run(&k1, &pods, pod_tx, s1).await });
    tokio::spawn(async move { watch::run(&k2, &namespaces, ns_tx, s2).await });
    // The first lists fill the cache before anything is queued.
    let first_ns = ns_rx.recv().await.ok_or(AgentError::NoList("namespaces"))?;
    controller::apply_namespace_event(&cluster, first_ns);
    let first_pods = pod_rx.recv().await.ok_or(AgentError::NoList("pods"))?;
    controller::apply_pod_event(&cluster, first_pods);
    let (c1, q1) = (cluster.clone(), queue.clone());
    tokio::spawn(async move {
        while let Some(event) = pod_rx.recv().await {
            for uid in controller::apply_pod_event(&c1, event) {
                let _ = q1.send(uid);
            }
        }
    });
    tokio::spawn(async move {
        while let Some(event) = ns_rx.recv().await {
            for uid in controller::apply_namespace_event(&cluster, event) {
                let _ = queue.send(uid);
            }
        }
    });
    Ok(())
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
