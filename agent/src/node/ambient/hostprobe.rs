//! The node's host-probe rule kept in place while the agent runs: the probe sets
//! created (ipsets or nft sets), the rule applied (`nat POSTROUTING → ISTIO_POSTRT`,
//! or the nft `istio-ambient-nat` postrouting chain), then checked every interval and
//! restored when someone flushed or changed it; a set that vanished is created again
//! and refilled with the enrolled pods' addresses. Istio sets the rule once at start;
//! keeping it is Weir's. Nothing is removed when the agent stops (pods stay probed
//! through restarts) unless the stop is for good ([`remove_for_good`]: an uninstall, or
//! `AMBIENT_DISABLE_SAFE_UPGRADE`); `weir cni uninstall` also takes the node's rules out.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;
use weir_iptables::{
    ambient::{AmbientBackend, apply_host_probe, kubelet_uid_in, probeset::ProbeSets, verify_host_probe},
    state::Verdict,
};

use super::settings::AmbientSettings;

/// How often the rule is checked.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// Why the rule could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum HostProbeError {
    #[error("kubelet's uid (for the nftables probe rule) is unknown: {0}; set WEIR_KUBELET_UID")]
    KubeletUid(String),
    #[error("host probe sets")]
    Sets(#[from] weir_iptables::ambient::probeset::ProbeSetError),
    #[error("host probe rule")]
    Rule(#[from] weir_iptables::ambient::AmbientError),
}

/// kubelet's uid: `WEIR_KUBELET_UID`, else found in the node's /proc (nftables only;
/// 0 for iptables, which does not use it).
pub fn kubelet_uid(s: &AmbientSettings) -> Result<u32, HostProbeError> {
    if s.rules.backend == AmbientBackend::Iptables {
        return Ok(0);
    }
    match s.kubelet_uid {
        Some(uid) => Ok(uid),
        None => kubelet_uid_in(&s.host_proc).map_err(|e| HostProbeError::KubeletUid(e.to_string())),
    }
}

/// Creates the sets and applies the rule (in this thread's namespace: the node's).
pub fn ensure(s: &AmbientSettings, uid: u32) -> Result<Verdict, HostProbeError> {
    let sets = ProbeSets::new(&s.rules);
    sets.ensure()?;
    let before = verify_host_probe(None, &s.rules, uid)?;
    if before != Verdict::Applied {
        apply_host_probe(None, &s.rules, uid)?;
    }
    Ok(before)
}

/// Keeps the rule and sets in place until `stop`; `addresses` gives the enrolled
/// pods' addresses (uid → addresses) to refill a set that was destroyed.
pub async fn keep(
    s: Arc<AmbientSettings>,
    uid: u32,
    addresses: impl Fn() -> BTreeMap<String, Vec<IpAddr>> + Send + 'static,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(CHECK_INTERVAL) => {}
        }
        let s = s.clone();
        let pods = addresses();
        let checked = tokio::task::spawn_blocking(move || check_once(&s, uid, &pods)).await;
        match checked {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::error!(error = %crate::error_chain(&e), "host probe rule could not be restored")
            }
            Err(e) => tracing::error!(error = %e, "host probe check failed"),
        }
    }
}

/// One check: sets present (refilled if they were gone), rule as planned.
fn check_once(
    s: &AmbientSettings,
    uid: u32,
    pods: &BTreeMap<String, Vec<IpAddr>>,
) -> Result<(), HostProbeError> {
    let sets = ProbeSets::new(&s.rules);
    let present: Vec<IpAddr> = sets.entries()?.into_iter().map(|e| e.ip).collect();
    let missing: Vec<(&String, &IpAddr)> = pods
        .iter()
        .flat_map(|(u, ips)| ips.iter().map(move |ip| (u, ip)))
        .filter(|(_, ip)| !present.contains(ip))
        .collect();
    let verdict = verify_host_probe(None, &s.rules, uid)?;
    if verdict != Verdict::Applied || !missing.is_empty() {
        sets.ensure()?;
        for (pod_uid, ip) in &missing {
            sets.upsert(**ip, pod_uid)?;
        }
        if verdict != Verdict::Applied {
            apply_host_probe(None, &s.rules, uid)?;
        }
        tracing::warn!(
            ?verdict,
            refilled = missing.len(),
            "host probe rule or sets were changed on the node: restored"
        );
    }
    Ok(())
}

/// Takes the node's part out for good, as Istio's dataplane `Stop(cleanup)` does: the
/// probe rule, then the probe sets, then the branch-ENI rules the agent added. Uses the
/// backend the agent ran with (`NATIVE_NFTABLES` may have been held on iptables), not
/// the one asked for. Each failure is logged with what is left; nothing stops on it.
pub fn remove_for_good(s: &AmbientSettings) {
    let mut rules = s.rules.clone();
    rules.backend = super::backend::chosen().unwrap_or(rules.backend);
    let removed = weir_iptables::ambient::remove_host_probe(None, &rules)
        .map(drop)
        .map_err(|e| crate::error_chain(&e))
        .and_then(|()| ProbeSets::new(&rules).destroy().map_err(|e| crate::error_chain(&e)));
    match removed {
        Ok(()) => tracing::info!(backend = ?rules.backend, "the node's probe rule and sets are removed"),
        Err(e) => tracing::error!(error = %e, "cannot remove the node's probe rule and sets"),
    }
    // Istio's `flushBranchENIRules`: what was added, not what is found now.
    super::branch_eni::flush();
}
