//! A pod's capture on this node, as the agent does it ([`PodCapture`] for the
//! dataplane): the pod's network namespace opened (the path the plugin sent, under the
//! node's root, checked; or found through the node's /proc and checked to hold the
//! pod's address), and the in-pod rules or Weir's eBPF programs (`WEIR_AMBIENT_CAPTURE`)
//! applied in it and taken out. Work in namespaces runs on blocking threads.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    os::fd::{AsRawFd as _, OwnedFd},
    path::PathBuf,
    sync::Arc,
};

use futures::future::BoxFuture;
use weir_iptables::{ambient::InpodConfig, detect::HostFacts as _};

use super::{
    DataplaneError,
    effects::{PodCapture, ZtunnelPods},
};
use crate::node::{
    ambient::{
        objects::{AmbientPod, unmapped},
        settings::{AmbientCapture, AmbientSettings},
    },
    cni::podns,
    enroll::netns_path,
};

/// Multus's annotation naming a pod's additional networks.
const MULTUS_NETWORKS: &str = "k8s.v1.cni.cncf.io/networks";

/// The capture of pods on this node, as `settings` say (the node's root and /proc,
/// the capture mode, the eBPF node capture).
pub struct InpodCapture {
    settings: Arc<AmbientSettings>,
}

impl PodCapture for InpodCapture {
    fn open_event_netns<'a>(
        &'a self,
        zds: &'a dyn ZtunnelPods,
        pod: &'a AmbientPod,
        ips: &'a [IpAddr],
        path: &'a str,
    ) -> BoxFuture<'a, Result<OwnedFd, DataplaneError>> {
        Box::pin(self.open_event_netns(zds, pod, ips, path))
    }

    fn find_netns<'a>(
        &'a self,
        pod: &'a AmbientPod,
        ips: &'a [IpAddr],
    ) -> BoxFuture<'a, Result<OwnedFd, DataplaneError>> {
        Box::pin(self.find_netns(pod, ips))
    }

    fn find_netns_of_pods(
        &self,
        pods: BTreeMap<String, Vec<IpAddr>>,
    ) -> BoxFuture<'_, BTreeMap<String, Result<OwnedFd, String>>> {
        let proc = self.settings.host_proc.clone();
        let uids: BTreeSet<String> = pods.keys().cloned().collect();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || open_all(&proc, &uids, &pods)).await.unwrap_or_default()
        })
    }

    fn apply<'a>(
        &'a self,
        pod: &'a AmbientPod,
        netns: &'a OwnedFd,
        recorded: Option<PathBuf>,
        cfg: InpodConfig,
    ) -> BoxFuture<'a, Result<&'static str, DataplaneError>> {
        Box::pin(self.apply_capture(pod, netns, recorded, cfg))
    }

    fn remove<'a>(
        &'a self,
        pod: &'a AmbientPod,
        netns: Option<OwnedFd>,
    ) -> BoxFuture<'a, Result<(), DataplaneError>> {
        Box::pin(self.remove_capture(pod, netns))
    }
}

impl InpodCapture {
    pub fn new(settings: Arc<AmbientSettings>) -> Self {
        Self { settings }
    }

    /// The namespace of the running pod `pod`, found through the node's /proc.
    async fn find_netns(&self, pod: &AmbientPod, ips: &[IpAddr]) -> Result<OwnedFd, DataplaneError> {
        let who = pod.key();
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
        zds: &dyn ZtunnelPods,
        pod: &AmbientPod,
        ips: &[IpAddr],
        path: &str,
    ) -> Result<OwnedFd, DataplaneError> {
        let who = pod.key();
        let (root, proc) = (&self.settings.host_root, &self.settings.host_proc);
        let (_, fd) = netns_path::open_with_deadline(path, root, proc)
            .await
            .map_err(|source| DataplaneError::EventNetns { pod: who.clone(), source })?;
        let cached = zds.netns(&pod.uid);
        // Another pod enrolled in this namespace: an event never binds a second pod to it.
        if let Ok(stat) = nix::sys::stat::fstat(std::os::fd::AsFd::as_fd(&fd))
            && let Some(other) = zds.enrolled_with((stat.st_dev, stat.st_ino), &pod.uid)
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

    /// The pod's eBPF registration (if it had one) and, with `netns`, what its capture
    /// left in its namespace: the in-pod rules, or eBPF capture's in-pod part.
    async fn remove_capture(&self, pod: &AmbientPod, netns: Option<OwnedFd>) -> Result<(), DataplaneError> {
        let (node, uid, who) = (self.settings.ebpf_node_capture.clone(), pod.uid.clone(), pod.key());
        let who_owned = who.clone();
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
        .map_err(|e| DataplaneError::Task { pod: who, message: e.to_string() })?
        .map_err(|e| *e)
    }
}

/// `/proc/self/fd/N`: a path through which `fd`'s namespace can be entered.
fn fd_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
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
        .map(unmapped)
        .collect();
    if ips.iter().any(|ip| held.contains(ip)) {
        Ok(())
    } else {
        Err(format!("the namespace found holds {held:?}, none of the pod's addresses {ips:?}: not the pod's"))
    }
}

/// Opens each pod's namespace (one /proc pass), checked against its addresses.
fn open_all(
    proc: &std::path::Path,
    uids: &BTreeSet<String>,
    ips: &BTreeMap<String, Vec<IpAddr>>,
) -> BTreeMap<String, Result<OwnedFd, String>> {
    let paths = match podns::find_many(proc, uids) {
        Ok(p) => p,
        Err(e) => return uids.iter().map(|u| (u.clone(), Err(e.to_string()))).collect(),
    };
    paths
        .into_iter()
        .map(|(uid, found)| {
            let opened = found.map_err(|e| e.to_string()).and_then(|path| {
                let path = path.ok_or_else(|| {
                    format!("no process of the pod runs on this node (per {})", proc.display())
                })?;
                let fd: OwnedFd =
                    std::fs::File::open(&path).map_err(|e| format!("open {}: {e}", path.display()))?.into();
                let pod_ips = ips.get(&uid).cloned().unwrap_or_default();
                if pod_ips.is_empty() {
                    return Err("the pod has no address: its namespace cannot be checked".into());
                }
                check_owner(&fd, &pod_ips)?;
                Ok(fd)
            });
            (uid, opened)
        })
        .collect()
}
