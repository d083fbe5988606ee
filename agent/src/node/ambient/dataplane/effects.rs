//! What the ambient dataplane acts on outside itself, one trait each, so that the
//! order of its steps does not depend on where they land:
//!
//! - [`PodCapture`]: a pod's network namespace found and opened, and its capture (the
//!   in-pod rules or Weir's eBPF programs) put in place there and taken out. On the
//!   node: `super::inpod::InpodCapture`.
//! - [`ZtunnelPods`]: the pods told to ztunnel over ZDS, and the namespaces cached for
//!   them. On the node: [`ZdsHandle`].
//! - [`PodStatusApi`]: the Kubernetes API's `pods/status`, which carries the
//!   redirection annotation. On the node: [`KubeClient`].
//! - [`HostProbeSet`]: the node's host-probe sets, which pod each address is for
//!   (blocking calls: the dataplane makes them on blocking threads). On the node:
//!   [`ProbeSets`].
//!
//! [`Effects`] is one of each, as a [`super::Dataplane`] is built from.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    os::fd::OwnedFd,
    path::PathBuf,
    sync::Arc,
};

use futures::future::BoxFuture;
use weir_iptables::ambient::{
    InpodConfig,
    probeset::{ProbeSetError, ProbeSets},
};

use super::DataplaneError;
use crate::node::{
    ambient::objects::AmbientPod,
    cni::kube::{KubeClient, KubeError},
    zds::{WorkloadInfo, ZdsError, ZdsHandle},
};

/// A pod's network namespace and its capture in it.
pub trait PodCapture: Send + Sync {
    /// The namespace the plugin's event names (`path`), opened and checked to be the
    /// pod's; `zds` says which namespaces pods are enrolled with.
    fn open_event_netns<'a>(
        &'a self,
        zds: &'a dyn ZtunnelPods,
        pod: &'a AmbientPod,
        ips: &'a [IpAddr],
        path: &'a str,
    ) -> BoxFuture<'a, Result<OwnedFd, DataplaneError>>;

    /// The namespace the running pod is in, found on the node and checked to hold one
    /// of `ips`.
    fn find_netns<'a>(
        &'a self,
        pod: &'a AmbientPod,
        ips: &'a [IpAddr],
    ) -> BoxFuture<'a, Result<OwnedFd, DataplaneError>>;

    /// The namespaces of running pods (uid → its addresses), each checked as
    /// [`Self::find_netns`] checks, or why it was not found.
    fn find_netns_of_pods(
        &self,
        pods: BTreeMap<String, Vec<IpAddr>>,
    ) -> BoxFuture<'_, BTreeMap<String, Result<OwnedFd, String>>>;

    /// Captures the pod in `netns` (`recorded`: the namespace's path as the plugin's
    /// event named it); returns the capture it got, `"rules"` or `"ebpf"`.
    fn apply<'a>(
        &'a self,
        pod: &'a AmbientPod,
        netns: &'a OwnedFd,
        recorded: Option<PathBuf>,
        cfg: InpodConfig,
    ) -> BoxFuture<'a, Result<&'static str, DataplaneError>>;

    /// Takes the pod's capture out: its eBPF registration, and what is in `netns` (none:
    /// the namespace goes with the pod, nothing in it is undone).
    fn remove<'a>(
        &'a self,
        pod: &'a AmbientPod,
        netns: Option<OwnedFd>,
    ) -> BoxFuture<'a, Result<(), DataplaneError>>;
}

/// The pods ztunnel is told about, as [`ZdsHandle`] documents each call.
pub trait ZtunnelPods: Send + Sync {
    fn add_pod<'a>(
        &'a self,
        uid: &'a str,
        info: WorkloadInfo,
        netns: OwnedFd,
    ) -> BoxFuture<'a, Result<(), ZdsError>>;
    fn cache_pod(&self, uid: &str, info: WorkloadInfo, netns: OwnedFd) -> Result<(), ZdsError>;
    fn keep_pod(&self, uid: &str);
    fn forget(&self, uid: &str);
    fn del_pod<'a>(&'a self, uid: &'a str) -> BoxFuture<'a, Result<(), ZdsError>>;
    fn netns(&self, uid: &str) -> Option<OwnedFd>;
    fn enrolled_with(&self, id: (u64, u64), uid: &str) -> Option<String>;
    fn pods(&self) -> Vec<String>;
}

impl ZtunnelPods for ZdsHandle {
    fn add_pod<'a>(
        &'a self,
        uid: &'a str,
        info: WorkloadInfo,
        netns: OwnedFd,
    ) -> BoxFuture<'a, Result<(), ZdsError>> {
        Box::pin(ZdsHandle::add_pod(self, uid, info, netns))
    }

    fn cache_pod(&self, uid: &str, info: WorkloadInfo, netns: OwnedFd) -> Result<(), ZdsError> {
        ZdsHandle::cache_pod(self, uid, info, netns)
    }

    fn keep_pod(&self, uid: &str) {
        ZdsHandle::keep_pod(self, uid);
    }

    fn forget(&self, uid: &str) {
        ZdsHandle::forget(self, uid);
    }

    fn del_pod<'a>(&'a self, uid: &'a str) -> BoxFuture<'a, Result<(), ZdsError>> {
        Box::pin(ZdsHandle::del_pod(self, uid))
    }

    fn netns(&self, uid: &str) -> Option<OwnedFd> {
        ZdsHandle::netns(self, uid)
    }

    fn enrolled_with(&self, id: (u64, u64), uid: &str) -> Option<String> {
        ZdsHandle::enrolled_with(self, id, uid)
    }

    fn pods(&self) -> Vec<String> {
        ZdsHandle::pods(self)
    }
}

/// The Kubernetes API's `pods/status`: a merge patch of one pod.
pub trait PodStatusApi: Send + Sync {
    fn patch_pod_status<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        patch: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<(), KubeError>>;
}

impl PodStatusApi for KubeClient {
    fn patch_pod_status<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        patch: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<(), KubeError>> {
        Box::pin(KubeClient::patch_pod_status(self, namespace, name, patch))
    }
}

/// The node's host-probe sets, as [`ProbeSets`] documents each call (blocking).
pub trait HostProbeSet: Send + Sync {
    fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), ProbeSetError>;
    fn remove(&self, ip: IpAddr, uid: &str) -> Result<Option<String>, ProbeSetError>;
    fn prune(&self, keep: &BTreeSet<IpAddr>) -> Result<Vec<IpAddr>, ProbeSetError>;
}

impl HostProbeSet for ProbeSets {
    fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), ProbeSetError> {
        ProbeSets::upsert(self, ip, uid)
    }

    fn remove(&self, ip: IpAddr, uid: &str) -> Result<Option<String>, ProbeSetError> {
        ProbeSets::remove(self, ip, uid)
    }

    fn prune(&self, keep: &BTreeSet<IpAddr>) -> Result<Vec<IpAddr>, ProbeSetError> {
        ProbeSets::prune(self, keep)
    }
}

/// One of each: what a [`super::Dataplane`] acts on.
pub struct Effects {
    pub capture: Box<dyn PodCapture>,
    pub zds: Box<dyn ZtunnelPods>,
    pub kube: Arc<dyn PodStatusApi>,
    pub probes: Arc<dyn HostProbeSet>,
}
