//! The agent's start with pods already enrolled (a restart, a rollout): Istio's
//! `ConstructInitialSnapshot`. Every pod annotated `enabled` (not terminal, not a
//! ztunnel) is known to ZDS before ztunnel can connect; the namespaces of those running
//! are found in one pass over the node's /proc (each checked to hold the pod's address)
//! and cached with their fds, so the first ztunnel to connect gets every pod in its
//! snapshot and keeps every proxy (a pod whose namespace is not found goes as Keep);
//! with `AMBIENT_RECONCILE_POD_RULES_ON_STARTUP` each pod's capture is applied again,
//! the one it has (in-pod rules as they are: nothing; drifted: replaced; an eBPF
//! registration: registered again in place); the probe sets get every pod's addresses,
//! and stale addresses are pruned when every enrolled pod has one (Istio's rule: an
//! incomplete snapshot prunes nothing).

#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use super::{dataplane::Dataplane, objects::AmbientPod};
use crate::node::zds::WorkloadInfo;

/// What the start found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SnapshotReport {
    /// Enrolled pods cached with their namespace.
    pub found: usize,
    /// Enrolled pods whose namespace was not found (sent as Keep).
    pub kept: Vec<String>,
    /// Pods whose rules were applied again.
    pub reconciled: usize,
    /// Addresses pruned from the probe sets.
    pub pruned: Vec<IpAddr>,
}

/// Builds the ZDS cache and the probe sets from the enrolled pods (blocking work runs
/// on blocking threads).
pub async fn restore(dp: &Dataplane, pods: &[AmbientPod]) -> SnapshotReport {
    let system = dp.settings().system_namespace.clone();
    let enrolled: Vec<&AmbientPod> =
        pods.iter().filter(|p| p.fully_enrolled() && !p.terminal() && !p.is_ztunnel(&system)).collect();
    let mut report = SnapshotReport::default();
    for pod in &enrolled {
        dp.zds().keep_pod(&pod.uid);
    }
    let ips: BTreeMap<String, Vec<IpAddr>> =
        enrolled.iter().map(|p| (p.uid.clone(), p.ips.clone())).collect();
    let found = dp.capture().find_netns_of_pods(ips).await;
    for pod in &enrolled {
        let who = pod.key();
        let Some(fd) = found.get(&pod.uid).and_then(|r| r.as_ref().ok()) else {
            let why = found
                .get(&pod.uid)
                .and_then(|r| r.as_ref().err())
                .cloned()
                .unwrap_or_else(|| "not looked up".into());
            tracing::warn!(pod = %who, uid = %pod.uid, reason = %why, "enrolled pod's namespace not found: ztunnel is told to keep it");
            report.kept.push(who);
            continue;
        };
        let info = WorkloadInfo {
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
            service_account: pod.service_account().into(),
        };
        let Ok(fd) = fd.try_clone() else { continue };
        match dp.zds().cache_pod(&pod.uid, info, fd) {
            Ok(()) => report.found += 1,
            Err(e) => {
                tracing::warn!(pod = %who, uid = %pod.uid, error = %crate::error_chain(&e), "enrolled pod not cached")
            }
        }
    }
    if dp.settings().rules.reconcile {
        report.reconciled = reconcile_rules(dp, &enrolled).await;
    }
    report.pruned = sync_probes(dp, &enrolled).await;
    tracing::info!(
        enrolled = enrolled.len(),
        found = report.found,
        kept = report.kept.len(),
        reconciled = report.reconciled,
        pruned = report.pruned.len(),
        "ambient snapshot restored"
    );
    report
}

/// Applies every cached pod's capture again (its rules, or its eBPF registration);
/// returns how many succeeded.
async fn reconcile_rules(dp: &Dataplane, enrolled: &[&AmbientPod]) -> usize {
    let mut done = 0;
    for pod in enrolled {
        match dp.reconcile_capture(pod).await {
            Ok(None) => {}
            Ok(Some(capture)) => {
                done += 1;
                tracing::info!(pod = %pod.key(), uid = %pod.uid, capture, "pod capture reconciled at start");
            }
            Err(e) => {
                tracing::error!(pod = %pod.key(), uid = %pod.uid, error = %crate::error_chain(&e), "pod capture not reconciled at start")
            }
        }
    }
    done
}

/// Upserts every enrolled pod's addresses; prunes the rest when all have one.
async fn sync_probes(dp: &Dataplane, enrolled: &[&AmbientPod]) -> Vec<IpAddr> {
    let probes = dp.probes().clone();
    let pods: Vec<(String, Vec<IpAddr>)> = enrolled.iter().map(|p| (p.uid.clone(), p.ips.clone())).collect();
    let complete = pods.iter().all(|(_, ips)| !ips.is_empty());
    let result = tokio::task::spawn_blocking(move || {
        let mut keep = BTreeSet::new();
        for (uid, ips) in &pods {
            for ip in ips {
                probes.upsert(*ip, uid)?;
                keep.insert(*ip);
            }
        }
        if complete { probes.prune(&keep) } else { Ok(Vec::new()) }
    })
    .await;
    match result {
        Ok(Ok(pruned)) => pruned,
        Ok(Err(e)) => {
            tracing::error!(error = %crate::error_chain(&e), "host probe sets not synced at start");
            Vec::new()
        }
        Err(e) => {
            tracing::error!(error = %e, "host probe sets not synced at start");
            Vec::new()
        }
    }
}
