//! eBPF capture from the CNI plugin. The node side (`weir cni install
//! --ebpf-cgroup`) attaches Weir's capture programs once to the cgroup that holds the
//! node's pods and pins them (`<bpffs>/weir/<node capture>`); each ADD then registers
//! the pod's network-namespace cookie with its capture config in those pinned maps
//! (and attaches the inbound classifier to the pod's interface), DEL unregisters it
//! (from a record, so it works after the namespace is gone), CHECK looks it up.
//! Nothing is loaded per pod but the small inbound classifier.

use std::path::{Path, PathBuf};

use weir_iptables::CaptureConfig;

use crate::ebpf::{
    capture::{self, CapturePrograms, InboundProgram, MapSet, PinRecord, netns_cookie},
    config::{EbpfOptions, PodCapture, own_addresses},
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
    PinRecord::load(name).is_some_and(|r| r.pin_dir().join("maps").exists())
}

/// Attaches and pins the node capture on `cgroup`; an existing one on the same cgroup
/// is kept. Returns whether it was attached now.
pub fn attach_node(name: &str, cgroup: &Path) -> Result<bool, CniEbpfError> {
    if let Some(record) = PinRecord::load(name).filter(|r| r.pin_dir().exists()) {
        if record.cgroup != cgroup {
            return Err(CniEbpfError::OtherCgroup {
                name: name.into(),
                existing: record.cgroup,
                wanted: cgroup.into(),
            });
        }
        return Ok(false);
    }
    let mut programs = CapturePrograms::load()?;
    programs.attach(cgroup)?;
    let record =
        PinRecord { pod: name.into(), cgroup: cgroup.into(), netns: None, netns_cookie: 0, interface: None };
    programs.pin(&record.pin_dir())?;
    record.save().map_err(io("write the node capture record"))?;
    Ok(true)
}

/// Detaches the node capture and every pod record made against it.
pub fn detach_node(name: &str) -> Result<(), CniEbpfError> {
    for record in PinRecord::load_all().into_iter().filter(|r| r.pod.starts_with(&pod_prefix(name))) {
        record.remove()?;
    }
    match PinRecord::load(name) {
        Some(record) => record.remove()?,
        None => capture::unpin(&capture::pin_dir(name))?,
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

/// ADD: registers the pod in the node capture's maps and attaches inbound capture to
/// `ifname` in `netns`.
pub fn register(
    node: &str,
    container_id: &str,
    netns: &Path,
    ifname: &str,
    cfg: &CaptureConfig,
) -> Result<u64, CniEbpfError> {
    let node_record = PinRecord::load(node)
        .filter(|r| r.pin_dir().join("maps").exists())
        .ok_or_else(|| CniEbpfError::NoNodeCapture { name: node.into() })?;
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
    };
    // A retried ADD replaces its own earlier registration.
    if let Some(old) = PinRecord::load(&record.pod) {
        old.remove()?;
    }
    let mut maps = MapSet::open_pinned(&node_record.pin_dir())?;
    maps.register(cookie, &pod)?;
    if let Some(inbound) = &pod.inbound {
        let program = match InboundProgram::attach(netns, ifname, inbound) {
            Ok(p) => p,
            Err(e) => {
                let _ = maps.unregister(cookie);
                return Err(e.into());
            }
        };
        program.pin(&record.pin_dir())?;
    }
    record.save().map_err(io("write the pod's capture record"))?;
    Ok(cookie)
}

/// DEL: unregisters the container's pod (idempotent; works without the namespace).
pub fn unregister(node: &str, container_id: &str) -> Result<(), CniEbpfError> {
    let Some(record) = PinRecord::load(&pod_record_name(node, container_id)) else { return Ok(()) };
    if let Some(node_record) = PinRecord::load(node).filter(|r| r.pin_dir().join("maps").exists()) {
        MapSet::open_pinned(&node_record.pin_dir())?.unregister(record.netns_cookie)?;
    }
    record.remove()?;
    Ok(())
}

/// CHECK: the container's pod is registered under its namespace's cookie.
pub fn registered(node: &str, container_id: &str, netns: &Path) -> Result<bool, CniEbpfError> {
    let Some(record) = PinRecord::load(&pod_record_name(node, container_id)) else { return Ok(false) };
    let Some(node_record) = PinRecord::load(node).filter(|r| r.pin_dir().join("maps").exists()) else {
        return Ok(false);
    };
    let cookie = netns_cookie(Some(netns))
        .map_err(io(format!("read the network namespace cookie of {}", netns.display())))?;
    Ok(cookie == record.netns_cookie
        && MapSet::open_pinned(&node_record.pin_dir())?.pods()?.contains(&cookie))
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
