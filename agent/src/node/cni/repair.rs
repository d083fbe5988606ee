//! Repair: pods that started on this node before the plugin was chained in (istio/istio#14327)
//! never went through ADD. The node agent lists the node's pods from the Kubernetes API,
//! finds each sidecar pod's network namespace from its sandbox (the processes in the
//! pod's kubelet cgroup, through the node's /proc: `podns`), and captures the ones that
//! are not captured yet, in place, exactly as ADD would. What ADD captured (found by its
//! record, by container or pod UID) is never captured again. Pods it cannot place are
//! reported, never guessed at; a namespace that does not hold the pod's IP is not the
//! pod's.

use std::path::{Path, PathBuf};

use weir_iptables::detect::HostFacts as _;

use super::{
    capture::{self, repair_container_id},
    kube::KubeClient,
    pod::{self, PodInfo},
    podns,
    spec::NetConf,
};

/// What one pass did, per pod.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Captured now: `namespace/name` and the namespace it lives in.
    pub repaired: Vec<(String, PathBuf)>,
    pub already_captured: Vec<String>,
    /// Sidecar pods with no running process on this node (not started yet, or gone).
    pub not_found: Vec<String>,
    /// Pods that needed capture and could not get it: `namespace/name` and why.
    pub failed: Vec<(String, String)>,
}

/// The pod's namespace, checked against the IP the API gives it.
fn place(pod: &PodInfo, proc_root: &Path) -> Result<Option<PathBuf>, String> {
    let Some(netns) = podns::find(proc_root, &pod.uid).map_err(|e| e.to_string())? else { return Ok(None) };
    if let Some(ip) = pod.pod_ip {
        let facts = weir_iptables::detect::SystemFacts { netns: Some(netns.clone()) };
        let held =
            facts.addresses().map_err(|e| format!("read the addresses in {}: {e}", netns.display()))?;
        if !held.contains(&ip) {
            return Err(format!(
                "the pod's sandbox namespace {} does not hold its IP {ip} (it holds {held:?}): not capturing it",
                crate::capture::ebpf::netns::describe(&netns)
            ));
        }
    }
    Ok(Some(netns))
}

/// One pass over the node's pods (as the API listed them): captures the sidecar pods
/// running here (found under `proc_root`, the node's /proc) that are not captured yet.
/// Synchronous: capture enters namespaces and runs its own netlink runtime.
pub fn repair(conf: &NetConf, pods: Vec<PodInfo>, proc_root: &Path) -> RepairReport {
    let mut report = RepairReport::default();
    let candidates = pods
        .into_iter()
        .filter(|p| !p.host_network)
        .filter(|p| !conf.excluded_namespaces().any(|n| n == p.namespace))
        .filter(|p| pod::skip_reason(p).is_none());
    for pod in candidates {
        let who = format!("{}/{}", pod.namespace, pod.name);
        let netns = match place(&pod, proc_root) {
            Ok(Some(netns)) => netns,
            Ok(None) => {
                report.not_found.push(who);
                continue;
            }
            Err(e) => {
                tracing::error!(pod = %who, error = %e, "cannot repair");
                report.failed.push((who, e));
                continue;
            }
        };
        // A pod registered already (by ADD, or an earlier pass) is captured again under
        // its own record: one registration per pod, whatever broke.
        let id =
            capture::registered_container(conf, &pod, &netns).unwrap_or_else(|| repair_container_id(&pod));
        let outcome = capture::missing_capture(conf, &pod, &netns, &id).and_then(|missing| match missing {
            None => Ok(false),
            Some(_) => capture::capture(conf, &pod, &netns, &id, "eth0").map(|()| true),
        });
        match outcome {
            Ok(true) => {
                tracing::info!(pod = %who, netns = %netns.display(), "repaired: captured a pod that started before the plugin");
                crate::node::metrics::repaired(true);
                report.repaired.push((who, netns));
            }
            Ok(false) => report.already_captured.push(who),
            Err(e) => {
                tracing::error!(pod = %who, error = %e, "cannot repair");
                crate::node::metrics::repaired(false);
                report.failed.push((who, e.to_string()));
            }
        }
    }
    report
}

/// One pass as the node agent runs it: `node`'s pods listed through the kubeconfig at
/// `kubeconfig`, repaired, and what it did logged.
pub fn pass(
    conf: &NetConf,
    kubeconfig: &Path,
    node: &str,
    proc_root: &Path,
) -> Result<RepairReport, super::kube::KubeError> {
    let client = KubeClient::load(kubeconfig)?;
    let report = repair(conf, list(&client, node)?, proc_root);
    tracing::info!(
        node,
        repaired = report.repaired.len(),
        already_captured = report.already_captured.len(),
        not_found = report.not_found.len(),
        failed = report.failed.len(),
        "repair pass"
    );
    Ok(report)
}

/// Lists `node`'s pods (one API call).
pub fn list(client: &KubeClient, node: &str) -> Result<Vec<PodInfo>, super::kube::KubeError> {
    let runtime = crate::support::runtime::current_thread("the repair's pod list").map_err(|e| {
        super::kube::KubeError::Request {
            method: "GET",
            url: "(runtime)".into(),
            message: crate::error_chain(&e),
        }
    })?;
    runtime.block_on(client.pods_on_node(node))
}
