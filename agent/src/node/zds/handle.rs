//! The agent's side of ZDS: add, keep and delete pods, and see whether ztunnel is
//! connected. A [`ZdsHandle`] is cheap to clone; every clone drives the same cache and
//! connections as the server it came from.

use std::{os::fd::OwnedFd, sync::Arc};

use tokio::sync::watch;

use super::{
    WorkloadInfo, ZdsConfig, ZdsError, ZdsStatus, codec,
    pods::{Netns, PodCache},
    registry::{Registry, Update},
};

/// What the server and its handles share.
#[derive(Debug, Default)]
pub(super) struct Shared {
    pub pods: PodCache,
    pub registry: Registry,
    pub config: ZdsConfig,
}

/// Drives a [`super::ZdsServer`]: see the module doc for the protocol.
#[derive(Debug, Clone)]
pub struct ZdsHandle {
    pub(super) shared: Arc<Shared>,
}

impl ZdsHandle {
    /// Caches the pod (uid, `info`, its network namespace) and sends it as Add to the
    /// newest ztunnel; `Ok` once that ztunnel acked. The pod stays cached whatever the
    /// outcome, so every later snapshot carries it: with no ztunnel connected the
    /// answer is [`ZdsError::NoZtunnel`] (as Istio, a retryable error: the pod goes out
    /// with the next snapshot). Refused before anything is cached: an empty uid, a
    /// message over 1024 bytes, an fd that is not a network namespace.
    pub async fn add_pod(&self, uid: &str, info: WorkloadInfo, netns: OwnedFd) -> Result<(), ZdsError> {
        if uid.is_empty() {
            return Err(ZdsError::EmptyUid);
        }
        codec::add(uid, &info)?;
        let netns =
            Netns::new(netns).map_err(|problem| ZdsError::NotANetns { uid: uid.to_string(), problem })?;
        let netns = self.shared.pods.upsert(uid, info.clone(), netns);
        let pod = info.pod();
        let Some(conn) = self.shared.registry.latest() else {
            tracing::warn!(uid, pod, "no ztunnel connected: pod cached for the next snapshot");
            return Err(ZdsError::NoZtunnel { uid: uid.to_string() });
        };
        tracing::info!(uid, pod, conn = conn.id, "sending pod to ztunnel");
        conn.send(Update::Add { uid: uid.to_string(), info, netns }).await
    }

    /// Caches the pod without sending anything (the agent's start, before ztunnel
    /// connects: the snapshot carries it). Refused as [`Self::add_pod`] refuses.
    pub fn cache_pod(&self, uid: &str, info: WorkloadInfo, netns: OwnedFd) -> Result<(), ZdsError> {
        if uid.is_empty() {
            return Err(ZdsError::EmptyUid);
        }
        codec::add(uid, &info)?;
        let netns =
            Netns::new(netns).map_err(|problem| ZdsError::NotANetns { uid: uid.to_string(), problem })?;
        self.shared.pods.upsert(uid, info, netns);
        Ok(())
    }

    /// The other pod enrolled with the namespace `id` ((st_dev, st_ino)), if any.
    pub fn enrolled_with(&self, id: (u64, u64), uid: &str) -> Option<String> {
        self.shared.pods.enrolled_with(id, uid)
    }

    /// A new descriptor of the network namespace cached for `uid`, if one is.
    pub fn netns(&self, uid: &str) -> Option<OwnedFd> {
        self.shared.pods.netns(uid)
    }

    /// Uncaches `uid` without telling ztunnel (Istio's `Take` after a failed add that
    /// never reached ztunnel).
    pub fn forget(&self, uid: &str) {
        self.shared.pods.take(uid);
    }

    /// Caches `uid` as enrolled with its netns not found (Istio's `Ensure`): snapshots
    /// send it as Keep, so ztunnel keeps a proxy it already runs for it. Sends nothing
    /// now (Keep is allowed only within a snapshot). A pod cached with its netns stays
    /// as it is.
    pub fn keep_pod(&self, uid: &str) {
        if !uid.is_empty() {
            self.shared.pods.ensure(uid);
        }
    }

    /// Uncaches the pod (its netns fd closes) and sends Del to every connected ztunnel,
    /// oldest first, each waiting for its ack. `Ok` with no ztunnel connected; the
    /// failures of several connections are returned together.
    pub async fn del_pod(&self, uid: &str) -> Result<(), ZdsError> {
        if uid.is_empty() {
            return Err(ZdsError::EmptyUid);
        }
        self.shared.pods.take(uid);
        let mut errors = Vec::new();
        for conn in self.shared.registry.all() {
            tracing::info!(uid, conn = conn.id, "sending pod delete to ztunnel");
            if let Err(e) = conn.send(Update::Del { uid: uid.to_string() }).await {
                errors.push(e);
            }
        }
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(ZdsError::DelIncomplete { uid: uid.to_string(), errors }),
        }
    }

    /// The cached pod uids, sorted.
    pub fn pods(&self) -> Vec<String> {
        self.shared.pods.uids()
    }

    /// How many ztunnels are connected, and how many hold the snapshot.
    pub fn status(&self) -> ZdsStatus {
        self.shared.registry.status()
    }

    /// The status as it changes.
    pub fn watch(&self) -> watch::Receiver<ZdsStatus> {
        self.shared.registry.watch()
    }

    /// Whether any ztunnel is connected (Istio's `ztunnel_connected` > 0).
    pub fn connected(&self) -> bool {
        self.status().connections > 0
    }
}
