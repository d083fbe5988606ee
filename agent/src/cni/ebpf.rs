//! eBPF capture from the CNI plugin. The node side (`weir cni install
//! --ebpf-cgroup`) links the node program set (`ebpf::set`, loaded once per node) to
//! the cgroup that holds the node's pods and pins the links (`<bpffs>/weir/<node
//! capture>/links`); each ADD then registers the pod's network-namespace cookie with
//! its capture config in the set's maps and attaches the set's inbound classifier to
//! the pod's interface, DEL unregisters it (from a record, so it works after the
//! namespace is gone), CHECK looks it up. Nothing is loaded per pod.

use std::path::{Path, PathBuf};

use weir_iptables::CaptureConfig;

use crate::ebpf::{
    bpffs,
    capture::MapSet,
    config::{EbpfOptions, PodCapture, own_addresses},
    netns::netns_cookie,
    record::{PinRecord, pin_dir},
    set::{self, NodePrograms},
};

/// The node capture's default name (its pins and record).
pub const DEFAULT_NODE_CAPTURE: &str = "cni-node";

#[derive(Debug, thiserror::Error)]
pub enum CniEbpfError {
    #[error(
        "no eBPF node capture named {name} is attached (run `weir cni install --ebpf-cgroup <the pods' cgroup>` on this node)"
    )]
    NoNodeCapture { name: String },
    #[error("the node capture {name} is attached to {existing}, not {wanted}")]
    OtherCgroup { name: String, existing: PathBuf, wanted: PathBuf },
    #[error(
        "the node capture {name} runs the eBPF programs of another Weir build ({attached}; this one is {this}): \
         they are not reused; detach it (`weir cni uninstall --ebpf-cgroup ...`) once its pods are gone, then install again"
    )]
    OtherVersion { name: String, attached: String, this: String },
    #[error(transparent)]
    Ebpf(Box<crate::ebpf::EbpfError>),
    #[error(transparent)]
    Config(#[from] crate::ebpf::config::EbpfConfigError),
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl From<crate::ebpf::EbpfError> for CniEbpfError {
    fn from(e: crate::ebpf::EbpfError) -> Self {
        Self::Ebpf(Box::new(e))
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CniEbpfError {
    let what = what.into();
    move |source| CniEbpfError::Io { what, source }
}

/// Whether the node capture `name` is pinned (what `auto` mode looks for).
pub fn node_capture_present(name: &str) -> bool {
    PinRecord::load(name).is_some_and(|r| r.pin_dir().join("links").exists())
}

/// The node capture `name`, pinned and made by this Weir build (its program set's key).
fn node_record(name: &str) -> Result<(PinRecord, String), CniEbpfError> {
    let record = PinRecord::load(name)
        .filter(|r| r.pin_dir().join("links").exists())
        .ok_or_else(|| CniEbpfError::NoNodeCapture { name: name.into() })?;
    let this = set::version_key();
    match &record.programs {
        Some(key) if *key == this => Ok((record, this)),
        other => Err(CniEbpfError::OtherVersion {
            name: name.into(),
            attached: other.clone().unwrap_or_else(|| "programs of its own".into()),
            this,
        }),
    }
}

/// Links the node program set to `cgroup` and pins the links; an existing node
/// capture on the same cgroup is kept. Returns whether it was attached now.
pub fn attach_node(name: &str, cgroup: &Path) -> Result<bool, CniEbpfError> {
    if let Some(record) = PinRecord::load(name).filter(|r| r.pin_dir().exists()) {
        if record.cgroup != cgroup {
            return Err(CniEbpfError::OtherCgroup {
                name: name.into(),
                existing: record.cgroup,
                wanted: cgroup.into(),
            });
        }
        node_record(name)?;
        return Ok(false);
    }
    let set = NodePrograms::acquire()?;
    let record = PinRecord {
        pod: name.into(),
        cgroup: cgroup.into(),
        netns: None,
        netns_cookie: 0,
        interface: None,
        programs: Some(set.key().to_string()),
    };
    set.attach_cgroup(cgroup, &record.pin_dir())?;
    if let Err(e) = record.save() {
        let _ = bpffs::unpin(&record.pin_dir());
        let _ = set.release();
        return Err(io("write the node capture record")(e));
    }
    Ok(true)
}

/// Detaches the node capture and every pod record made against it.
pub fn detach_node(name: &str) -> Result<(), CniEbpfError> {
    for record in PinRecord::load_all().into_iter().filter(|r| r.pod.starts_with(&pod_prefix(name))) {
        record.remove()?;
    }
    match PinRecord::load(name) {
        Some(record) => record.remove()?,
        None => bpffs::unpin(&pin_dir(name))?,
    }
    Ok(())
}

fn pod_prefix(node: &str) -> String {
    format!("{node}-pod-")
}

/// The record name for a container's registration.
fn pod_record_name(node: &str, container_id: &str) -> String {
    let short: String = container_id.chars().filter(char::is_ascii_alphanumeric).take(32).collect();
    format!("{}{short}", pod_prefix(node))
}

/// ADD: registers the pod in the node program set's maps and attaches inbound
/// capture to `ifname` in `netns`.
pub fn register(
    node: &str,
    container_id: &str,
    netns: &Path,
    ifname: &str,
    cfg: &CaptureConfig,
) -> Result<u64, CniEbpfError> {
    let (node_record, key) = node_record(node)?;
    let facts = weir_iptables::detect::SystemFacts { netns: Some(netns.into()) };
    let own = own_addresses(&facts).map_err(io(format!("read the addresses in {}", netns.display())))?;
    let pod = PodCapture::new(cfg, own, EbpfOptions::for_running_kernel(false))?;
    let cookie = netns_cookie(Some(netns))
        .map_err(io(format!("read the network namespace cookie of {}", netns.display())))?;
    let record = PinRecord {
        pod: pod_record_name(node, container_id),
        cgroup: node_record.cgroup.clone(),
        netns: Some(netns.into()),
        netns_cookie: cookie,
        interface: pod.inbound.map(|_| ifname.to_string()),
        programs: Some(key.clone()),
    };
    // A retried ADD replaces its own earlier registration (before the set is locked).
    if let Some(old) = PinRecord::load(&record.pod) {
        old.remove()?;
    }
    let mut set = NodePrograms::open_existing(&key)?
        .ok_or_else(|| CniEbpfError::NoNodeCapture { name: node.into() })?;
    set.register(cookie, &pod)?;
    let attached = set.attach_inbound(netns, ifname, cookie, &pod, &record.pin_dir());
    if let Err(e) = attached {
        let _ = set.unregister(cookie);
        return Err(e.into());
    }
    record.save().map_err(io("write the pod's capture record"))?;
    Ok(cookie)
}

/// DEL: unregisters the container's pod (idempotent; works without the namespace).
pub fn unregister(node: &str, container_id: &str) -> Result<(), CniEbpfError> {
    let Some(record) = PinRecord::load(&pod_record_name(node, container_id)) else { return Ok(()) };
    record.remove()?;
    Ok(())
}

/// CHECK: the container's pod is registered under its namespace's cookie.
pub fn registered(node: &str, container_id: &str, netns: &Path) -> Result<bool, CniEbpfError> {
    let Some(record) = PinRecord::load(&pod_record_name(node, container_id)) else { return Ok(false) };
    let Some(key) = record.programs.as_deref().filter(|k| set::present(k)) else { return Ok(false) };
    let cookie = netns_cookie(Some(netns))
        .map_err(io(format!("read the network namespace cookie of {}", netns.display())))?;
    Ok(cookie == record.netns_cookie && MapSet::open_pinned(&set::set_dir(key))?.pods()?.contains(&cookie))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_records_are_named_after_the_node_capture_and_container() {
        let name = pod_record_name("cni-node", "0f3a5c9e-77/../x");
        assert_eq!(name, "cni-node-pod-0f3a5c9e77x");
        assert!(name.starts_with(&pod_prefix("cni-node")));
    }
}
