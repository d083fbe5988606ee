//! Putting one pod into the mesh and taking it out, in Istio's order
//! (`meshDataplane.AddPodToMesh` / `RemovePodFromMesh`):
//!
//! **Add**: the uid is known to ZDS first (so a snapshot keeps it as Keep even before
//! its namespace is found); the pod's network namespace is opened (the path the plugin
//! sent, under the node's root; else the one cached; else found through the node's
//! /proc and checked to hold the pod's address); the in-pod rules are applied in it
//! (a failure here is final: no annotation, nothing cached); ztunnel is sent the pod
//! and must ack (failing that the pod is annotated `pending` and the error is
//! retryable: the rules stay, kubelet and the watch retry); its addresses join the
//! node's probe sets; last, `ambient.istio.io/redirection: enabled`.
//!
//! **Remove**: its addresses leave the probe sets (only while they are still this
//! pod's); unless the pod is being deleted (its namespace goes with it), the in-pod
//! rules are removed from its namespace; Del goes to every ztunnel; the annotation is
//! removed (NotFound and, for a deleted pod, any failure ignored).
//!
//! The pod's capture is the in-pod rules, or (`WEIR_AMBIENT_CAPTURE=ebpf|auto`) Weir's
//! eBPF programs registered with the node capture for ztunnel ([`Dataplane::add`]
//! logs which, and why).
//!
//! Work on one pod is serialised (the plugin's event and the watch may race); pods
//! proceed in parallel. Rule work runs on blocking threads (it enters namespaces).

use std::{
    collections::HashMap,
    net::IpAddr,
    os::fd::{AsRawFd as _, OwnedFd},
    path::PathBuf,
    sync::{Arc, Mutex},
};

use weir_iptables::{
    ambient::{AmbientError, InpodConfig, PodOverrides, probeset::ProbeSets},
    detect::HostFacts as _,
};

use super::{
    objects::{AmbientPod, REDIRECTION_ENABLED, REDIRECTION_PENDING, redirection_patch},
    settings::{AmbientCapture, AmbientSettings},
};
use crate::node::{
    cni::{
        kube::{KubeClient, KubeError},
        podns,
    },
    enroll::netns_path,
    zds::{WorkloadInfo, ZdsError, ZdsHandle},
};

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
}

const REDIRECTION_ANNOTATION_NAME: &str = super::objects::REDIRECTION_ANNOTATION;
/// Multus's annotation naming a pod's additional networks.
const MULTUS_NETWORKS: &str = "k8s.v1.cni.cncf.io/networks";

impl DataplaneError {
    /// Whether trying again can help (Istio's retryable errors: ztunnel, annotations,
    /// probe sets); a namespace that cannot be found or rules that cannot be applied
    /// are final for this attempt.
    pub fn retryable(&self) -> bool {
        matches!(self, Self::Zds { .. } | Self::ProbeSet { .. } | Self::Annotate { .. } | Self::Task { .. })
    }
}

/// The ambient data plane of this node.
pub struct Dataplane {
    settings: Arc<AmbientSettings>,
    zds: ZdsHandle,
    kube: Arc<KubeClient>,
    probes: ProbeSets,
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

/// `/proc/self/fd/N`: a path through which `fd`'s namespace can be entered.
fn fd_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

impl Dataplane {
    pub fn new(settings: Arc<AmbientSettings>, zds: ZdsHandle, kube: Arc<KubeClient>) -> Self {
        let probes = ProbeSets::new(&settings.rules);
        Self { settings, zds, kube, probes, locks: Mutex::default() }
    }

    pub fn settings(&self) -> &AmbientSettings {
        &self.settings
    }

    pub fn zds(&self) -> &ZdsHandle {
        &self.zds
    }

    pub fn probes(&self) -> &ProbeSets {
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
        let netns = match self.open_netns(pod, ips, netns_path).await {
            Ok(n) => n,
            Err(e) => {
                self.zds_forget(pod);
                return Err(e);
            }
        };
        let overrides =
            PodOverrides::from_annotations(pod.annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .map_err(|source| DataplaneError::Annotation { pod: who.clone(), source })?;
        let cfg = self.settings.rules.for_pod(overrides);
        steps.mark("netns");
        // The path as the node names it (records are read on the node, not in this
        // container).
        let recorded = netns_path.filter(|p| !p.is_empty()).map(PathBuf::from);
        if let Err(e) = self.apply_capture(pod, &netns, recorded, cfg).await {
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
        tracing::info!(pod = %who, uid = %pod.uid, ips = ?ips, steps_us = %steps, "pod added to the ambient mesh");
        Ok(())
    }

    /// Forgets a pod whose add failed before ztunnel saw it (Istio's `Take`), unless it
    /// was enrolled before: then ztunnel runs its proxy, and the cache keeps it.
    fn zds_forget(&self, pod: &AmbientPod) {
        if !pod.fully_enrolled() {
            self.zds.forget(&pod.uid);
        }
    }

    /// The pod's network namespace, opened.
    async fn open_netns(
        &self,
        pod: &AmbientPod,
        ips: &[IpAddr],
        path: Option<&str>,
    ) -> Result<OwnedFd, DataplaneError> {
        let who = pod.key();
        if let Some(path) = path.filter(|p| !p.is_empty()) {
            return self.open_event_netns(pod, ips, path).await;
        }
        if let Some(fd) = self.zds.netns(&pod.uid) {
            return Ok(fd);
        }
        let proc = self.settings.host_proc.clone();
        let (uid, ips) = (pod.uid.clone(), ips.to_vec());
        let found = tokio::task::spawn_blocking(move || find_owned_netns(&proc, &uid, &ips))
            .await
            .map_err(|e| DataplaneError::Task { pod: who.clone(), message: e.to_string() })?;
        found.map_err(|message| DataplaneError::FindNetns { pod: who, message })
    }

    /// The namespace the plugin's event names ([`netns_path`]: a runtime's form, under
    /// the node's root, opened non-blocking with a deadline, a network namespace that
    /// is not the node's or the agent's), checked to hold one of the event's addresses;
    /// and never in place of the namespace an enrolled pod's processes still run in.
    async fn open_event_netns(
        &self,
        pod: &AmbientPod,
        ips: &[IpAddr],
        path: &str,
    ) -> Result<OwnedFd, DataplaneError> {
        let who = pod.key();
        let (root, proc) = (&self.settings.host_root, &self.settings.host_proc);
        let (_, fd) = netns_path::open_with_deadline(path, root, proc)
            .await
            .map_err(|source| DataplaneError::EventNetns { pod: who.clone(), source })?;
        let cached = self.zds.netns(&pod.uid);
        // Another pod enrolled in this namespace: an event never binds a second pod to it.
        if let Ok(stat) = nix::sys::stat::fstat(std::os::fd::AsFd::as_fd(&fd))
            && let Some(other) = self.zds.enrolled_with((stat.st_dev, stat.st_ino), &pod.uid)
        {
            return Err(DataplaneError::FindNetns {
                pod: who,
                message: format!(
                    "{path}: the namespace is pod {other}'s (enrolled already): never two pods in one"
                ),
            });
        }
        let (checked, uid, ips, proc) = (fd.try_clone(), pod.uid.clone(), ips.to_vec(), proc.clone());
        let refused = tokio::task::spawn_blocking(move || -> Result<(), String> {
            let fd = checked.map_err(|e| format!("duplicate the namespace's descriptor: {e}"))?;
            if ips.is_empty() {
                return Err("the event names no address of the pod to check its namespace against".into());
            }
            check_owner(&fd, &ips)?;
            let id = |f: &OwnedFd| {
                nix::sys::stat::fstat(std::os::fd::AsFd::as_fd(f)).map(|s| (s.st_dev, s.st_ino))
            };
            if let Some(old) = cached
                && let (Ok(old_id), Ok(new_id)) = (id(&old), id(&fd))
                && old_id != new_id
            {
                match podns::pod_in_namespace(&proc, &uid, old_id) {
                    Ok(false) => {}
                    Ok(true) => {
                        return Err(format!(
                            "the pod is enrolled in namespace net:[{}] and its processes still run there: \
                             an event cannot move it to net:[{}]",
                            old_id.1, new_id.1
                        ));
                    }
                    Err(e) => {
                        return Err(format!(
                            "cannot tell whether the pod still runs in its enrolled namespace: {e}"
                        ));
                    }
                }
            }
            Ok(())
        })
        .await
        .map_err(|e| DataplaneError::Task { pod: who.clone(), message: e.to_string() })?;
        refused.map_err(|message| DataplaneError::FindNetns {
            pod: who,
            message: format!("{path}: {message}"),
        })?;
        Ok(fd)
    }

    /// Captures the pod as `WEIR_AMBIENT_CAPTURE` says: the in-pod rules, Weir's eBPF
    /// programs, or (`auto`) eBPF when the node capture is attached and takes the pod,
    /// else the rules. Under `auto` a pod that is captured already keeps the capture it
    /// has (changing it under running connections would break them). The choice and
    /// its reason are logged; whichever the pod gets, the other is taken out after it
    /// is in place.
    async fn apply_capture(
        &self,
        pod: &AmbientPod,
        netns: &OwnedFd,
        recorded: Option<PathBuf>,
        cfg: InpodConfig,
    ) -> Result<&'static str, DataplaneError> {
        use crate::node::cni::ebpf;
        let who = pod.key();
        let node = self.settings.ebpf_node_capture.clone();
        let has_ebpf = ebpf::ambient_record_exists(&node, &pod.uid);
        let mode = self.settings.capture;
        let (want_ebpf, mut reason) = match mode {
            AmbientCapture::Rules => (false, "WEIR_AMBIENT_CAPTURE=rules".to_string()),
            AmbientCapture::Ebpf => (true, "WEIR_AMBIENT_CAPTURE=ebpf".to_string()),
            AmbientCapture::Auto if has_ebpf => {
                (true, "auto: the pod is captured by eBPF already".to_string())
            }
            AmbientCapture::Auto if pod.fully_enrolled() || pod.partially_enrolled() => {
                (false, "auto: the pod is captured by the in-pod rules already".to_string())
            }
            AmbientCapture::Auto if !ebpf::node_capture_present(&node) => {
                (false, format!("auto: no eBPF node capture named {node} is attached"))
            }
            // Multus adds the pod's other networks after this chain's ADD: the classifier
            // would sit on one interface of several.
            AmbientCapture::Auto
                if pod.annotations.iter().any(|(k, v)| k == MULTUS_NETWORKS && !v.trim().is_empty()) =>
            {
                (
                    false,
                    format!(
                        "auto: the pod asks for more networks ({MULTUS_NETWORKS}); eBPF inbound capture sits on one interface"
                    ),
                )
            }
            // A pod enrolled while it runs has listeners that predate capture (the
            // inbound guard records a listener when it starts listening).
            AmbientCapture::Auto if recorded.is_none() => {
                (false, "auto: the pod was running before it was enrolled, not a new sandbox".to_string())
            }
            AmbientCapture::Auto => (true, format!("auto: node capture {node} is attached")),
        };
        if want_ebpf {
            match self.apply_ebpf(pod, netns, recorded, cfg.clone()).await {
                Ok(()) => {
                    tracing::info!(pod = %who, uid = %pod.uid, capture = "ebpf", reason = %reason, "ambient capture");
                    return Ok("ebpf");
                }
                Err(e) if mode == AmbientCapture::Ebpf || has_ebpf => return Err(e),
                Err(e) => {
                    reason = format!("auto: eBPF capture did not take the pod: {}", crate::error_chain(&e))
                }
            }
        }
        self.apply_rules(&who, netns, cfg).await?;
        tracing::info!(pod = %who, uid = %pod.uid, capture = "rules", reason = %reason, "ambient capture");
        if has_ebpf || ebpf::ambient_record_exists(&node, &pod.uid) {
            // Captured by eBPF before (WEIR_AMBIENT_CAPTURE changed), or registered by the
            // attempt `auto` fell back from: the registration goes.
            let (uid, path) = (pod.uid.clone(), fd_path(netns));
            let fd = netns.try_clone().ok();
            tokio::task::spawn_blocking(move || {
                let _hold = fd;
                ebpf::unregister_ambient(&node, &uid, Some(&path))
            })
            .await
            .map_err(|e| DataplaneError::Task { pod: who.clone(), message: e.to_string() })?
            .map_err(|source| DataplaneError::Ebpf { pod: who.clone(), source })?;
            let fd = netns.try_clone().ok();
            let path = fd_path(netns);
            tokio::task::spawn_blocking(move || {
                let _hold = fd;
                weir_iptables::ambient::clear_inpod_ebpf(&path)
            })
            .await
            .map_err(|e| DataplaneError::Task { pod: who.clone(), message: e.to_string() })?
            .map_err(|source| DataplaneError::Rules { pod: who.clone(), source: Box::new(source) })?;
            tracing::info!(pod = %who, uid = %pod.uid, "the pod's eBPF registration removed: the rules capture it now");
        }
        Ok("rules")
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
        self.apply_capture(pod, &fd, None, cfg).await.map(Some)
    }

    /// Registers the pod with the node capture for ztunnel and sets the in-pod part
    /// eBPF capture needs (`weir_iptables::ambient::apply_inpod_ebpf`: the reply route,
    /// `tcp_fwmark_accept`, no in-pod rules). If the in-pod part fails, the registration
    /// stays (the pod stays captured, its replies may not find ztunnel: closed) and the
    /// add fails.
    async fn apply_ebpf(
        &self,
        pod: &AmbientPod,
        netns: &OwnedFd,
        recorded: Option<PathBuf>,
        cfg: InpodConfig,
    ) -> Result<(), DataplaneError> {
        use crate::node::cni::ebpf;
        let who = pod.key();
        let fd = netns.try_clone().map_err(|source| DataplaneError::OpenNetns {
            pod: who.clone(),
            path: fd_path(netns),
            source,
        })?;
        let node = self.settings.ebpf_node_capture.clone();
        let identity = ebpf::PodIdentity { name: who.clone(), uid: pod.uid.clone() };
        let task_who = who.clone();
        tokio::task::spawn_blocking(move || {
            let path = fd_path(&fd);
            let started = std::time::Instant::now();
            ebpf::register_ambient(&node, &path, recorded.as_deref(), &cfg, &identity)
                .map_err(|source| Box::new(DataplaneError::Ebpf { pod: task_who.clone(), source }))?;
            let registered = started.elapsed();
            // A failure here keeps the registration: the pod stays captured (its
            // replies may not find ztunnel yet, which fails closed), never less
            // captured than before; the add fails and is tried again.
            if let Err(source) = weir_iptables::ambient::apply_inpod_ebpf(&path, &cfg) {
                return Err(Box::new(DataplaneError::Rules { pod: task_who, source: Box::new(source) }));
            }
            tracing::debug!(
                pod = %task_who,
                register_us = registered.as_micros(),
                inpod_us = (started.elapsed() - registered).as_micros(),
                "eBPF capture applied"
            );
            Ok(())
        })
        .await
        .map_err(|e| DataplaneError::Task { pod: who, message: e.to_string() })?
        .map_err(|e| *e)
    }

    async fn apply_rules(&self, who: &str, netns: &OwnedFd, cfg: InpodConfig) -> Result<(), DataplaneError> {
        let fd = netns.try_clone().map_err(|source| DataplaneError::OpenNetns {
            pod: who.to_string(),
            path: fd_path(netns),
            source,
        })?;
        let who_owned = who.to_string();
        let report =
            tokio::task::spawn_blocking(move || weir_iptables::ambient::apply_inpod(&fd_path(&fd), &cfg))
                .await
                .map_err(|e| DataplaneError::Task { pod: who_owned.clone(), message: e.to_string() })?
                .map_err(|source| DataplaneError::Rules { pod: who_owned, source: Box::new(source) })?;
        tracing::info!(pod = %who, action = ?report.action, backend = ?report.backend, path = %report.path, "in-pod rules");
        Ok(())
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
        let netns = if deleting { None } else { self.zds.netns(&pod.uid) };
        let (node, uid, who_owned) = (self.settings.ebpf_node_capture.clone(), pod.uid.clone(), who.clone());
        tokio::task::spawn_blocking(move || {
            let path = netns.as_ref().map(fd_path);
            // eBPF capture's registration (if the pod had one) goes first: the rules
            // it leaves behind are only the in-pod part.
            let ebpf = crate::node::cni::ebpf::unregister_ambient(&node, &uid, path.as_deref())
                .map_err(|source| Box::new(DataplaneError::Ebpf { pod: who_owned.clone(), source }))?;
            if let Some(path) = path {
                let removed = if ebpf {
                    weir_iptables::ambient::remove_inpod_ebpf(&path)
                } else {
                    weir_iptables::ambient::remove_inpod(&path)
                };
                removed.map_err(|source| {
                    Box::new(DataplaneError::Rules { pod: who_owned, source: Box::new(source) })
                })?;
            }
            Ok::<_, Box<DataplaneError>>(())
        })
        .await
        .map_err(|e| DataplaneError::Task { pod: who.clone(), message: e.to_string() })?
        .map_err(|e| *e)?;
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

/// The netns of a running pod found through the node's /proc, opened, and checked to
/// hold one of the pod's addresses (a pod with none is not placed yet).
pub fn find_owned_netns(proc: &std::path::Path, uid: &str, ips: &[IpAddr]) -> Result<OwnedFd, String> {
    if ips.is_empty() {
        return Err("the pod has no address yet: its namespace cannot be checked".into());
    }
    let path = podns::find(proc, uid)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("no process of pod {uid} runs on this node (per {})", proc.display()))?;
    let fd: OwnedFd = std::fs::File::open(&path).map_err(|e| format!("open {}: {e}", path.display()))?.into();
    check_owner(&fd, ips)?;
    Ok(fd)
}

/// Whether the namespace `fd` holds one of `ips`.
pub fn check_owner(fd: &OwnedFd, ips: &[IpAddr]) -> Result<(), String> {
    let facts = weir_iptables::detect::SystemFacts { netns: Some(fd_path(fd)) };
    let held: Vec<IpAddr> = facts
        .addresses()
        .map_err(|e| format!("read the addresses in {}: {e}", fd_path(fd).display()))?
        .into_iter()
        .map(super::objects::unmapped)
        .collect();
    if ips.iter().any(|ip| held.contains(ip)) {
        Ok(())
    } else {
        Err(format!("the namespace found holds {held:?}, none of the pod's addresses {ips:?}: not the pod's"))
    }
}
