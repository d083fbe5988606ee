//! Putting one pod into the mesh and taking it out, in Istio's order
//! (`meshDataplane.AddPodToMesh` / `RemovePodFromMesh`), but for where a removal
//! stops when the capture cannot be taken out:
//!
//! **Add**: the uid is known to ZDS first (so a snapshot keeps it as Keep even before
//! its namespace is found); the pod's network namespace is opened: the path the plugin
//! sent, under the node's root, or, when that path does not open there (a runtime
//! whose namespace folder the agent does not see, a `/proc/<pid>/ns/net` whose process
//! is gone), found through the node's /proc by the pod's UID; with no path, the one
//! cached, else found through /proc; what is found is checked to hold the pod's
//! address, and the add's log line says which way (`netns_from`). The in-pod rules
//! are applied in it (a failure here is final: no annotation, nothing cached); ztunnel
//! is sent the pod and must ack (failing that the pod is annotated `pending` and the
//! error is retryable: the rules stay, kubelet and the watch retry); its addresses
//! join the node's probe sets; last, `ambient.istio.io/redirection: enabled`.
//!
//! **Remove**: its capture is taken out (unless the pod is being deleted, its namespace
//! going with it, the in-pod rules are removed from its namespace); a failure here is
//! retryable and stops the removal, so the pod's addresses stay in the probe sets
//! (kubelet's probes still pass the rules left), ZDS keeps its namespace for the retry,
//! and it stays annotated; then its addresses leave the probe sets (only while they are
//! still this pod's); Del goes to every ztunnel; last, the annotation is removed
//! (NotFound and, for a deleted pod, any failure ignored). Istio drops the probe-set
//! entry first and lets go of the namespace before undoing the rules, so its retry of
//! a failed removal never undoes them; Weir's does.
//!
//! The pod's capture is the in-pod rules, or (`WEIR_AMBIENT_CAPTURE=ebpf|auto`) Weir's
//! eBPF programs registered with the node capture for ztunnel ([`Dataplane::add`]
//! logs which, and why).
//!
//! Work on one pod is serialised (the plugin's event and the watch may race); pods
//! proceed in parallel. Rule work runs on blocking threads (it enters namespaces).
//!
//! What the steps act on is behind the traits of [`effects`] (the pod's namespace and
//! capture, ZDS, the Kubernetes API, the probe sets); [`Dataplane::new`] gives them the
//! node's: [`inpod`] for the capture, the ZDS server's handle, the agent's Kubernetes
//! client, and the probe sets its caller builds (`run`: with the AWS branch-ENI rules
//! carried along, `branch_eni`).

pub mod effects;
pub mod inpod;

#[cfg(test)]
mod tests;

use std::{
    collections::HashMap,
    net::IpAddr,
    os::fd::OwnedFd,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use weir_iptables::ambient::{AmbientError, PodOverrides};

use super::{
    objects::{AmbientPod, REDIRECTION_ENABLED, REDIRECTION_PENDING, redirection_patch},
    settings::AmbientSettings,
};
use crate::node::{
    cni::kube::{KubeClient, KubeError},
    zds::{WorkloadInfo, ZdsError, ZdsHandle},
};
use effects::{Effects, HostProbeSet, PodCapture, PodStatusApi, ZtunnelPods};
use inpod::InpodCapture;

/// Why a pod could not be added or removed.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("pod {pod}: open its network namespace {path}")]
    OpenNetns {
        pod: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("pod {pod}: {message}")]
    FindNetns { pod: String, message: String },
    #[error("pod {pod}: the event's network namespace")]
    EventNetns {
        pod: String,
        #[source]
        source: crate::node::enroll::netns_path::NetnsPathError,
    },
    #[error("pod {pod}: bad annotation")]
    Annotation {
        pod: String,
        #[source]
        source: weir_iptables::config::ConfigError,
    },
    #[error("pod {pod}: in-pod rules")]
    Rules {
        pod: String,
        #[source]
        source: Box<AmbientError>,
    },
    #[error("pod {pod}: eBPF capture")]
    Ebpf {
        pod: String,
        #[source]
        source: crate::node::cni::ebpf::CniEbpfError,
    },
    #[error("pod {pod}: ztunnel")]
    Zds {
        pod: String,
        #[source]
        source: ZdsError,
    },
    #[error("pod {pod}: host probe set")]
    ProbeSet {
        pod: String,
        #[source]
        source: weir_iptables::ambient::probeset::ProbeSetError,
    },
    #[error("pod {pod}: annotate {REDIRECTION_ANNOTATION_NAME}")]
    Annotate {
        pod: String,
        #[source]
        source: KubeError,
    },
    #[error("pod {pod}: a blocking task failed: {message}")]
    Task { pod: String, message: String },
    /// Taking the pod's capture out failed; the removal stopped there, to be tried again.
    #[error("pod {pod}: its capture could not be taken out")]
    RemoveCapture {
        pod: String,
        #[source]
        source: Box<DataplaneError>,
    },
}

const REDIRECTION_ANNOTATION_NAME: &str = super::objects::REDIRECTION_ANNOTATION;

impl DataplaneError {
    /// Whether trying again can help (Istio's retryable errors: ztunnel, annotations,
    /// probe sets, and anything failing a removal); a namespace that cannot be found or
    /// rules that cannot be applied are final for this attempt of an add.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            Self::Zds { .. }
                | Self::ProbeSet { .. }
                | Self::Annotate { .. }
                | Self::Task { .. }
                | Self::RemoveCapture { .. }
        )
    }

    /// Whether this is the event's namespace path failing to open (rather than being
    /// refused: a form no runtime sends, a file that is no pod's namespace).
    fn event_path_does_not_open(&self) -> bool {
        matches!(
            self,
            Self::EventNetns { source: crate::node::enroll::netns_path::NetnsPathError::Open { .. }, .. }
        )
    }
}

/// Which way a pod's network namespace was found, as the add's log line says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NetnsSource {
    /// The path the plugin's event sent, under the node's root.
    EventPath,
    /// The one ZDS has cached for the pod.
    Cache,
    /// Through the node's /proc, by the pod's UID.
    HostProc,
}

impl std::fmt::Display for NetnsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::EventPath => "event_path",
            Self::Cache => "cache",
            Self::HostProc => "host_proc",
        })
    }
}

/// The ambient data plane of this node.
pub struct Dataplane {
    settings: Arc<AmbientSettings>,
    capture: Box<dyn PodCapture>,
    zds: Box<dyn ZtunnelPods>,
    kube: Arc<dyn PodStatusApi>,
    probes: Arc<dyn HostProbeSet>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// How long each step of one add took, for the log line operators and `weir-bench
/// ambient` read: `netns=<µs> rules=<µs> ztunnel=<µs> probes=<µs> annotate=<µs>`.
struct StepClock {
    last: std::time::Instant,
    steps: Vec<(&'static str, u128)>,
}

impl StepClock {
    fn start() -> Self {
        Self { last: std::time::Instant::now(), steps: Vec::with_capacity(5) }
    }

    fn mark(&mut self, step: &'static str) {
        let now = std::time::Instant::now();
        self.steps.push((step, now.duration_since(self.last).as_micros()));
        self.last = now;
    }
}

impl std::fmt::Display for StepClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (step, us)) in self.steps.iter().enumerate() {
            write!(f, "{}{step}={us}", if i == 0 { "" } else { " " })?;
        }
        Ok(())
    }
}

impl Dataplane {
    /// The node's dataplane: pods captured in their namespaces on this node, told to
    /// ztunnel through `zds`, annotated through `kube`, probed through the node's sets.
    pub fn new(
        settings: Arc<AmbientSettings>,
        zds: ZdsHandle,
        kube: Arc<KubeClient>,
        probes: Arc<dyn HostProbeSet>,
    ) -> Self {
        let effects = Effects {
            capture: Box::new(InpodCapture::new(settings.clone())),
            zds: Box::new(zds),
            kube,
            probes,
        };
        Self::with_effects(settings, effects)
    }

    /// A dataplane acting on `effects`.
    pub fn with_effects(settings: Arc<AmbientSettings>, effects: Effects) -> Self {
        let Effects { capture, zds, kube, probes } = effects;
        Self { settings, capture, zds, kube, probes, locks: Mutex::default() }
    }

    pub fn settings(&self) -> &AmbientSettings {
        &self.settings
    }

    pub fn capture(&self) -> &dyn PodCapture {
        self.capture.as_ref()
    }

    pub fn zds(&self) -> &dyn ZtunnelPods {
        self.zds.as_ref()
    }

    pub fn probes(&self) -> &Arc<dyn HostProbeSet> {
        &self.probes
    }

    /// The lock serialising work on `uid`.
    fn lock(&self, uid: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.retain(|_, l| Arc::strong_count(l) > 1);
        locks.entry(uid.to_string()).or_default().clone()
    }

    /// Adds `pod` (with `ips`, and the netns path the plugin sent, if any).
    pub async fn add(
        &self,
        pod: &AmbientPod,
        ips: &[IpAddr],
        netns_path: Option<&str>,
    ) -> Result<(), DataplaneError> {
        let lock = self.lock(&pod.uid);
        let _held = lock.lock().await;
        let mut steps = StepClock::start();
        let who = pod.key();
        self.zds.keep_pod(&pod.uid);
        let (netns, netns_from) = match self.open_netns(pod, ips, netns_path).await {
            Ok(n) => n,
            Err(e) => {
                self.zds_forget(pod);
                return Err(e);
            }
        };
        let overrides = match PodOverrides::from_annotations(
            pod.annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        ) {
            Ok(o) => o,
            Err(source) => {
                self.zds_forget(pod);
                return Err(DataplaneError::Annotation { pod: who.clone(), source });
            }
        };
        let cfg = self.settings.rules.for_pod(overrides);
        steps.mark("netns");
        // The path as the node names it (records are read on the node, not in this
        // container).
        let recorded = netns_path.filter(|p| !p.is_empty()).map(PathBuf::from);
        if let Err(e) = self.capture.apply(pod, &netns, recorded, cfg).await {
            self.zds_forget(pod);
            return Err(e);
        }
        steps.mark("rules");
        let info = WorkloadInfo {
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
            service_account: pod.service_account().to_string(),
        };
        if let Err(source) = self.zds.add_pod(&pod.uid, info, netns).await {
            tracing::warn!(pod = %who, uid = %pod.uid, error = %crate::error_chain(&source), "ztunnel did not take the pod: annotating it pending");
            if !pod.partially_enrolled() {
                self.annotate(pod, Some(REDIRECTION_PENDING)).await?;
            }
            return Err(DataplaneError::Zds { pod: who, source });
        }
        steps.mark("ztunnel");
        self.probe_upsert(pod, ips).await?;
        steps.mark("probes");
        if !pod.fully_enrolled() {
            self.annotate(pod, Some(REDIRECTION_ENABLED)).await?;
        }
        steps.mark("annotate");
        tracing::info!(pod = %who, uid = %pod.uid, ips = ?ips, netns_from = %netns_from, steps_us = %steps, "pod added to the ambient mesh");
        Ok(())
    }

    /// Forgets a pod whose add failed before ztunnel saw it (Istio's `Take`), unless it
    /// was enrolled before: then ztunnel runs its proxy, and the cache keeps it.
    fn zds_forget(&self, pod: &AmbientPod) {
        if !pod.fully_enrolled() {
            self.zds.forget(&pod.uid);
        }
    }

    /// The pod's network namespace, opened, and which way it was found. The event's
    /// path that does not open under the node's root is searched around through the
    /// node's /proc; one refused (no runtime's form, the node's namespace) is not.
    async fn open_netns(
        &self,
        pod: &AmbientPod,
        ips: &[IpAddr],
        path: Option<&str>,
    ) -> Result<(OwnedFd, NetnsSource), DataplaneError> {
        if let Some(path) = path.filter(|p| !p.is_empty()) {
            let unopened = match self.capture.open_event_netns(self.zds.as_ref(), pod, ips, path).await {
                Ok(fd) => return Ok((fd, NetnsSource::EventPath)),
                Err(e) if e.event_path_does_not_open() => e,
                Err(e) => return Err(e),
            };
            let fd = self.capture.find_netns(pod, ips).await.map_err(|found| DataplaneError::FindNetns {
                pod: pod.key(),
                message: format!(
                    "{}; nor found through the node's /proc: {}",
                    crate::error_chain(&unopened),
                    crate::error_chain(&found)
                ),
            })?;
            tracing::info!(pod = %pod.key(), uid = %pod.uid, netns = path, netns_from = %NetnsSource::HostProc, reason = %crate::error_chain(&unopened), "the event's network namespace path does not open under the node's root: the pod's was found through the node's /proc");
            return Ok((fd, NetnsSource::HostProc));
        }
        if let Some(fd) = self.zds.netns(&pod.uid) {
            return Ok((fd, NetnsSource::Cache));
        }
        Ok((self.capture.find_netns(pod, ips).await?, NetnsSource::HostProc))
    }

    /// At the agent's start (`AMBIENT_RECONCILE_POD_RULES_ON_STARTUP`): the capture of
    /// an enrolled pod whose namespace is cached, applied again as it is (its rules, or
    /// its eBPF registration and in-pod part). Returns which it has.
    pub async fn reconcile_capture(&self, pod: &AmbientPod) -> Result<Option<&'static str>, DataplaneError> {
        let Some(fd) = self.zds.netns(&pod.uid) else { return Ok(None) };
        let overrides =
            PodOverrides::from_annotations(pod.annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .map_err(|source| DataplaneError::Annotation { pod: pod.key(), source })?;
        let cfg = self.settings.rules.for_pod(overrides);
        let lock = self.lock(&pod.uid);
        let _held = lock.lock().await;
        self.capture.apply(pod, &fd, None, cfg).await.map(Some)
    }

    async fn probe_upsert(&self, pod: &AmbientPod, ips: &[IpAddr]) -> Result<(), DataplaneError> {
        let (probes, uid, ips, who) = (self.probes.clone(), pod.uid.clone(), ips.to_vec(), pod.key());
        tokio::task::spawn_blocking(move || ips.iter().try_for_each(|ip| probes.upsert(*ip, &uid)))
            .await
            .map_err(|e| DataplaneError::Task { pod: who.clone(), message: e.to_string() })?
            .map_err(|source| {
                tracing::error!(pod = %who, error = %crate::error_chain(&source), "kubelet probes to this pod will be captured: its address is not in the host probe set");
                DataplaneError::ProbeSet { pod: who, source }
            })
    }

    /// Re-adds the pod's addresses to the probe sets (its addresses changed).
    pub async fn refresh_probes(&self, pod: &AmbientPod) -> Result<(), DataplaneError> {
        self.probe_upsert(pod, &pod.ips).await
    }

    async fn annotate(&self, pod: &AmbientPod, value: Option<&str>) -> Result<(), DataplaneError> {
        match self.kube.patch_pod_status(&pod.namespace, &pod.name, &redirection_patch(value)).await {
            Ok(()) => Ok(()),
            Err(KubeError::NotFound { .. }) if value.is_none() => Ok(()),
            Err(source) => Err(DataplaneError::Annotate { pod: pod.key(), source }),
        }
    }

    /// Takes `pod` out of the mesh; `deleting`: the pod is gone (its namespace with it).
    pub async fn remove(&self, pod: &AmbientPod, deleting: bool) -> Result<(), DataplaneError> {
        let lock = self.lock(&pod.uid);
        let _held = lock.lock().await;
        let who = pod.key();
        let netns = if deleting { None } else { self.zds.netns(&pod.uid) };
        if let Err(e) = self.capture.remove(pod, netns).await {
            tracing::warn!(pod = %who, uid = %pod.uid, deleting, error = %crate::error_chain(&e), "the pod's capture could not be taken out: its probe-set entry, ZDS entry and annotation stay until a retry succeeds");
            return Err(DataplaneError::RemoveCapture { pod: who, source: Box::new(e) });
        }
        let (probes, uid, ips) = (self.probes.clone(), pod.uid.clone(), pod.ips.clone());
        let held_by_others = tokio::task::spawn_blocking(move || {
            ips.iter()
                .map(|ip| probes.remove(*ip, &uid).map(|other| (*ip, other)))
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .map_err(|e| DataplaneError::Task { pod: who.clone(), message: e.to_string() })?
        .map_err(|source| DataplaneError::ProbeSet { pod: who.clone(), source })?;
        for (ip, other) in held_by_others {
            if let Some(other) = other {
                tracing::warn!(pod = %who, uid = %pod.uid, %ip, holder = %other, "probe set entry left: another pod holds the address now");
            }
        }
        self.zds
            .del_pod(&pod.uid)
            .await
            .map_err(|source| DataplaneError::Zds { pod: who.clone(), source })?;
        match self.annotate(pod, None).await {
            Err(e) if !deleting => return Err(e),
            Err(e) => {
                tracing::debug!(pod = %who, error = %crate::error_chain(&e), "annotation not removed from a deleted pod")
            }
            Ok(()) => {}
        }
        tracing::info!(pod = %who, uid = %pod.uid, deleting, "pod removed from the ambient mesh");
        Ok(())
    }
}
