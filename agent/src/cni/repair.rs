//! Repair: pods that started on this node before the plugin was chained in (istio/istio#14327)
//! never went through ADD. The node agent lists the node's pods from the Kubernetes API,
//! finds each sidecar pod's network namespace by its pod IP among the runtime's named
//! namespaces (`/var/run/netns`), and captures the ones that are not captured yet, in
//! place, exactly as ADD would. Pods it cannot place are reported, never guessed at.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use weir_iptables::detect::HostFacts as _;

use super::{
    capture::{self, repair_container_id},
    kube::KubeClient,
    pod::{self, PodInfo},
    spec::NetConf,
};

/// What one pass did, per pod.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Captured now: `namespace/name` and the namespace it lives in.
    pub repaired: Vec<(String, PathBuf)>,
    pub already_captured: Vec<String>,
    /// Sidecar pods whose namespace was not found (not started yet, or another dir).
    pub not_found: Vec<String>,
    /// Pods that needed capture and could not get it: `namespace/name` and why.
    pub failed: Vec<(String, String)>,
}

/// Every named namespace under `dir` and its addresses.
fn namespaces(dir: &Path) -> Vec<(PathBuf, Vec<IpAddr>)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .map(|e| e.path())
        .filter_map(|path| {
            let facts = weir_iptables::detect::SystemFacts { netns: Some(path.clone()) };
            facts.addresses().ok().map(|a| (path, a))
        })
        .collect()
}

/// One pass over the node's pods (as the API listed them): captures the sidecar pods
/// found in `netns_dir` that are not captured yet. Synchronous: capture enters
/// namespaces and runs its own netlink runtime.
pub fn repair(conf: &NetConf, pods: Vec<PodInfo>, netns_dir: &Path) -> RepairReport {
    let mut report = RepairReport::default();
    let candidates: Vec<PodInfo> = pods
        .into_iter()
        .filter(|p| !p.host_network)
        .filter(|p| !conf.excluded_namespaces().any(|n| n == p.namespace))
        .filter(|p| pod::skip_reason(p).is_none())
        .collect();
    if candidates.is_empty() {
        return report;
    }
    let spaces = namespaces(netns_dir);
    for pod in candidates {
        let who = format!("{}/{}", pod.namespace, pod.name);
        let Some((netns, _)) = pod.pod_ip.and_then(|ip| spaces.iter().find(|(_, addrs)| addrs.contains(&ip)))
        else {
            report.not_found.push(who);
            continue;
        };
        let id = repair_container_id(&pod);
        let outcome = capture::missing_capture(conf, &pod, netns, &id).and_then(|missing| match missing {
            None => Ok(false),
            Some(_) => capture::capture(conf, &pod, netns, &id, "eth0").map(|()| true),
        });
        match outcome {
            Ok(true) => {
                tracing::info!(pod = %who, netns = %netns.display(), "repaired: captured a pod that started before the plugin");
                report.repaired.push((who, netns.clone()));
            }
            Ok(false) => report.already_captured.push(who),
            Err(e) => {
                tracing::error!(pod = %who, error = %e, "cannot repair");
                report.failed.push((who, e.to_string()));
            }
        }
    }
    report
}

/// Lists `node`'s pods (one API call).
pub fn list(client: &KubeClient, node: &str) -> Result<Vec<PodInfo>, super::kube::KubeError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| super::kube::KubeError::Request { url: "(runtime)".into(), message: e.to_string() })?;
    runtime.block_on(client.pods_on_node(node))
}
