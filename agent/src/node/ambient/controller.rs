//! Enrollment from the Kubernetes watches, as Istio's informers drive it: the node's
//! pods and every namespace are cached from their list+watch; each change queues the
//! pods it concerns (a pod's own change, every pod of a namespace whose labels changed)
//! and each queued pod is reconciled against the cache, level-based:
//!
//! - enrolled or pending, and terminal (Succeeded/Failed): removed as deleted;
//! - enrolled and still selected: its probe-set addresses refreshed if they changed;
//! - enrolled or pending and no longer selected (label, namespace, exclusion): removed,
//!   rules undone in its namespace;
//! - selected and not enrolled (or pending): added once it has an address (new pods come
//!   through the plugin's event first; this catches namespaces labelled later, pods
//!   labelled while running, and `pending` pods waiting for ztunnel);
//! - deleted: removed (probe set, ZDS Del, no rules to undo) if it was enrolled,
//!   pending or selected.
//!
//! A failed reconcile is retried with a per-pod backoff from 5 ms doubling to 5 s, for
//! as long as it keeps failing retryably (until a ztunnel connects, until a pod's
//! capture can be taken out); a final error is logged and left until the pod changes. Pods run in parallel, at most [`PARALLEL`].

#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    sync::{Arc, RwLock},
    time::Duration,
};

use tokio::sync::{Semaphore, mpsc};

use super::{
    dataplane::Dataplane,
    objects::{AmbientNamespace, AmbientPod},
    watch::WatchEvent,
};
use crate::node::metrics::{self, ReconcileEvent};

/// Pods reconciled at once.
pub const PARALLEL: usize = 8;
const RETRY_START: Duration = Duration::from_millis(5);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What the watches told: the node's pods and every namespace.
#[derive(Debug, Default)]
pub struct Cluster {
    pods: HashMap<String, AmbientPod>,
    /// Deleted pods not yet taken out.
    deleted: HashMap<String, AmbientPod>,
    /// The last addresses each pod had (kubelet strips them at termination).
    last_ips: HashMap<String, Vec<IpAddr>>,
    namespaces: HashMap<String, AmbientNamespace>,
}

impl Cluster {
    /// The cached pod `namespace/name`.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<AmbientPod> {
        self.pods.values().find(|p| p.namespace == namespace && p.name == name).cloned()
    }

    pub fn namespace_labels(&self, namespace: &str) -> BTreeMap<String, String> {
        self.namespaces.get(namespace).map(|n| n.labels.clone()).unwrap_or_default()
    }

    /// Every cached pod.
    pub fn pods(&self) -> Vec<AmbientPod> {
        self.pods.values().cloned().collect()
    }

    fn uids_in(&self, namespace: &str) -> Vec<String> {
        self.pods.values().filter(|p| p.namespace == namespace).map(|p| p.uid.clone()).collect()
    }
}

/// The shared cache.
pub type SharedCluster = Arc<RwLock<Cluster>>;

fn read(c: &SharedCluster) -> std::sync::RwLockReadGuard<'_, Cluster> {
    c.read().unwrap_or_else(|p| p.into_inner())
}

fn write(c: &SharedCluster) -> std::sync::RwLockWriteGuard<'_, Cluster> {
    c.write().unwrap_or_else(|p| p.into_inner())
}

/// Whether `pod` should be in the mesh (Istio's `shouldBeEnabled`, terminal aside).
pub fn selected(dataplane: &Dataplane, cluster: &Cluster, pod: &AmbientPod) -> bool {
    let s = dataplane.settings();
    !s.excluded(&pod.namespace)
        && !pod.is_ztunnel(&s.system_namespace)
        && s.selectors.matches(&pod.facts(), &cluster.namespace_labels(&pod.namespace))
}

/// Counts an object's event as Istio's informers do (`nodeagent_reconcile_events_total`):
/// `update` for one the cache held, else `add`.
fn counted(known: bool) {
    metrics::reconcile_event(if known { ReconcileEvent::Update } else { ReconcileEvent::Add });
}

/// Applies a pod watch event to the cache; returns the uids to reconcile.
pub fn apply_pod_event(cluster: &SharedCluster, event: WatchEvent<AmbientPod>) -> Vec<String> {
    let mut c = write(cluster);
    let mut touched = Vec::new();
    fn store(c: &mut Cluster, pod: AmbientPod) -> String {
        counted(c.pods.contains_key(&pod.uid));
        if !pod.ips.is_empty() {
            c.last_ips.insert(pod.uid.clone(), pod.ips.clone());
        }
        c.deleted.remove(&pod.uid);
        let uid = pod.uid.clone();
        c.pods.insert(pod.uid.clone(), pod);
        uid
    }
    match event {
        WatchEvent::Listed(pods) => {
            let listed: std::collections::HashSet<&str> = pods.iter().map(|p| p.uid.as_str()).collect();
            let gone: Vec<String> = c.pods.keys().filter(|u| !listed.contains(u.as_str())).cloned().collect();
            for uid in gone {
                if let Some(pod) = c.pods.remove(&uid) {
                    c.deleted.insert(uid.clone(), pod);
                    touched.push(uid);
                }
            }
            for pod in pods {
                touched.push(store(&mut c, pod));
            }
        }
        WatchEvent::Applied(pod) => touched.push(store(&mut c, pod)),
        WatchEvent::Deleted(pod) => {
            metrics::reconcile_event(ReconcileEvent::Delete);
            c.pods.remove(&pod.uid);
            touched.push(pod.uid.clone());
            c.deleted.insert(pod.uid.clone(), pod);
        }
    }
    touched
}

/// Applies a namespace watch event; returns the uids of the pods it concerns.
pub fn apply_namespace_event(cluster: &SharedCluster, event: WatchEvent<AmbientNamespace>) -> Vec<String> {
    let mut c = write(cluster);
    let mut names = Vec::new();
    match event {
        WatchEvent::Listed(all) => {
            names.extend(c.namespaces.keys().cloned());
            for n in &all {
                counted(c.namespaces.contains_key(&n.name));
            }
            c.namespaces = all.into_iter().map(|n| (n.name.clone(), n)).collect();
            names.extend(c.namespaces.keys().cloned());
        }
        WatchEvent::Applied(ns) => {
            counted(c.namespaces.contains_key(&ns.name));
            let changed = c.namespaces.get(&ns.name).is_none_or(|old| old.labels != ns.labels);
            if changed {
                names.push(ns.name.clone());
            }
            c.namespaces.insert(ns.name.clone(), ns);
        }
        WatchEvent::Deleted(ns) => {
            metrics::reconcile_event(ReconcileEvent::Delete);
            c.namespaces.remove(&ns.name);
            names.push(ns.name);
        }
    }
    names.sort();
    names.dedup();
    names.iter().flat_map(|n| c.uids_in(n)).collect()
}

/// What one reconcile of a pod decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Nothing,
    Add(AmbientPod, Vec<IpAddr>),
    Remove(AmbientPod, bool),
    RefreshProbes(AmbientPod),
}

/// The step for `uid` (pure over the cache and what the pod's probe addresses were).
pub fn decide(dataplane: &Dataplane, cluster: &Cluster, uid: &str, probed: Option<&Vec<IpAddr>>) -> Step {
    if let Some(pod) = cluster.deleted.get(uid) {
        let mut pod = pod.clone();
        if pod.ips.is_empty() {
            pod.ips = cluster.last_ips.get(uid).cloned().unwrap_or_default();
        }
        let known = pod.fully_enrolled()
            || pod.partially_enrolled()
            || dataplane.zds().pods().iter().any(|u| u == uid);
        return if known || selected(dataplane, cluster, &pod) {
            Step::Remove(pod, true)
        } else {
            Step::Nothing
        };
    }
    let Some(pod) = cluster.pods.get(uid) else { return Step::Nothing };
    let enrolled = pod.fully_enrolled() || pod.partially_enrolled();
    if enrolled && pod.terminal() {
        let mut pod = pod.clone();
        if pod.ips.is_empty() {
            pod.ips = cluster.last_ips.get(uid).cloned().unwrap_or_default();
        }
        return Step::Remove(pod, true);
    }
    if pod.terminal() {
        return Step::Nothing;
    }
    let should = selected(dataplane, cluster, pod);
    match (should, pod.fully_enrolled(), pod.partially_enrolled()) {
        (true, true, _) if probed.is_some_and(|p| *p != pod.ips) && !pod.ips.is_empty() => {
            Step::RefreshProbes(pod.clone())
        }
        (true, true, _) => Step::Nothing,
        (false, _, _) if enrolled => Step::Remove(pod.clone(), false),
        (false, _, _) => Step::Nothing,
        (true, false, _) if pod.ips.is_empty() => Step::Nothing,
        (true, false, _) => Step::Add(pod.clone(), pod.ips.clone()),
    }
}

/// Runs the reconcile queue: uids arrive on `queue`, each is reconciled against
/// `cluster`, failures are retried with backoff.
pub async fn run(
    dataplane: Arc<Dataplane>,
    cluster: SharedCluster,
    queue: mpsc::UnboundedSender<String>,
    mut incoming: mpsc::UnboundedReceiver<String>,
) {
    let permits = Arc::new(Semaphore::new(PARALLEL));
    let retries: Arc<std::sync::Mutex<HashMap<String, u32>>> = Arc::default();
    let probed: Arc<std::sync::Mutex<HashMap<String, Vec<IpAddr>>>> = Arc::default();
    while let Some(uid) = incoming.recv().await {
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let (dp, cl, q, r, p) =
            (dataplane.clone(), cluster.clone(), queue.clone(), retries.clone(), probed.clone());
        tokio::spawn(async move {
            let permit = permit;
            let step = {
                let c = read(&cl);
                let seen = p.lock().unwrap_or_else(|e| e.into_inner()).get(&uid).cloned();
                decide(&dp, &c, &uid, seen.as_ref())
            };
            let outcome = execute(&dp, &cl, &step).await;
            match outcome {
                Ok(()) => {
                    r.lock().unwrap_or_else(|e| e.into_inner()).remove(&uid);
                    let mut seen = p.lock().unwrap_or_else(|e| e.into_inner());
                    match &step {
                        Step::Add(_, ips) => drop(seen.insert(uid.clone(), ips.clone())),
                        Step::RefreshProbes(pod) => drop(seen.insert(uid.clone(), pod.ips.clone())),
                        Step::Remove(..) => drop(seen.remove(&uid)),
                        Step::Nothing => {}
                    }
                }
                Err(e) if e.retryable() => {
                    let attempt = {
                        let mut r = r.lock().unwrap_or_else(|e| e.into_inner());
                        let n = r.entry(uid.clone()).or_insert(0);
                        *n += 1;
                        *n
                    };
                    let delay = RETRY_START.saturating_mul(1 << attempt.min(20)).min(RETRY_MAX);
                    tracing::warn!(uid = %uid, attempt, retry_in = ?delay, error = %crate::error_chain(&e), "ambient reconcile failed: retrying");
                    // The backoff holds no permit: pods that keep failing never hold up
                    // another pod's reconcile (as Istio's rate-limited queue).
                    drop(permit);
                    tokio::time::sleep(delay).await;
                    let _ = q.send(uid);
                }
                Err(e) => {
                    r.lock().unwrap_or_else(|e| e.into_inner()).remove(&uid);
                    tracing::error!(uid = %uid, error = %crate::error_chain(&e), "ambient reconcile failed: not retried until the pod changes");
                }
            }
        });
    }
}

async fn execute(
    dp: &Dataplane,
    cluster: &SharedCluster,
    step: &Step,
) -> Result<(), super::dataplane::DataplaneError> {
    match step {
        Step::Nothing => Ok(()),
        Step::Add(pod, ips) => dp.add(pod, ips, None).await,
        Step::RefreshProbes(pod) => dp.refresh_probes(pod).await,
        Step::Remove(pod, deleting) => {
            dp.remove(pod, *deleting).await?;
            if *deleting {
                let mut c = write(cluster);
                c.deleted.remove(&pod.uid);
                c.last_ips.remove(&pod.uid);
            }
            Ok(())
        }
    }
}
