//! Whether a pinned capture is still live, from what the kernel says rather than what
//! bpffs shows: bpffs mounted, its cgroup links pinned *and attached to its cgroup* (a
//! pinned link survives `bpftool link detach` and its cgroup's removal, attached to
//! nothing), its cgroup and network namespace still there, its inbound tc filter on
//! its interface, its program set present and its namespace registered in the set's
//! maps. A pod registered with a CNI node capture has no links of its own: the node
//! capture's are its links. What `weir capture status` reports and what `weir capture
//! apply` repairs.

use std::{os::fd::AsFd as _, path::Path};

use super::{
    bpffs::bpffs_mounted, capture::cgroup_hooks, gc, inbound, link, pod, record::PinRecord, set, sys,
};

/// One reason a recorded capture is not (wholly) live.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaptureFault {
    #[error("bpffs is not mounted at /sys/fs/bpf: the pins, and the cgroup links they held, are gone")]
    BpffsNotMounted,
    #[error("its pins ({0}) are gone, and the cgroup links they held with them")]
    PinsGone(String),
    #[error("links gone from {dir}: {names} (those hooks no longer run in the cgroup)")]
    LinksGone { dir: String, names: String },
    #[error("links in {dir} pinned but detached from the cgroup: {names} (those hooks no longer run)")]
    LinksDetached { dir: String, names: String },
    #[error("its cgroup {0} is gone")]
    CgroupGone(String),
    #[error("its network namespace is gone: {0}")]
    NetnsGone(String),
    #[error("no Weir inbound filter on {interface} in {netns}: inbound connections are not captured")]
    FilterGone { interface: String, netns: String },
    #[error("its program set {0} is gone (the programs may run on, but cannot be shown or changed)")]
    SetGone(String),
    #[error("its network namespace (cookie {0}) is not registered in the program set's maps")]
    NotRegistered(u64),
    /// A check that could not be made: reported, never read as "nothing wrong" (a
    /// capture is live only when every check says so).
    #[error("cannot check {what}: {error}")]
    Unchecked { what: String, error: String },
}

impl CaptureFault {
    /// A check that could not be made, not a fault found.
    pub fn is_unchecked(&self) -> bool {
        matches!(self, Self::Unchecked { .. })
    }
}

fn unchecked(what: impl Into<String>, error: impl std::fmt::Display) -> CaptureFault {
    CaptureFault::Unchecked { what: what.into(), error: error.to_string() }
}

/// The record whose pins hold `record`'s cgroup links: its own, or, for a pod registered
/// with a node capture (CNI mode), the node capture's (same cgroup and set, no cookie).
fn links_holder<'a>(record: &'a PinRecord, all: &'a [PinRecord]) -> &'a PinRecord {
    if record.netns_cookie == 0 {
        return record;
    }
    all.iter()
        .find(|r| r.netns_cookie == 0 && r.cgroup == record.cgroup && r.programs == record.programs)
        .unwrap_or(record)
}

/// Whether `path` is gone. Only "not found" says so: a pin that cannot be looked at
/// (no permission) is not reported as gone.
fn gone(path: &Path) -> bool {
    matches!(std::fs::symlink_metadata(path), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
}

/// What is wrong with the cgroup links held under `holder`'s pins.
fn link_faults(holder: &PinRecord) -> Vec<CaptureFault> {
    let dir = holder.pin_dir();
    if gone(&dir) {
        return vec![CaptureFault::PinsGone(dir.display().to_string())];
    }
    let links = dir.join("links");
    // The hooks its program set has (another build's set may have fewer than this one).
    let progs = holder.programs.as_deref().map(|key| set::set_dir(key).join("progs"));
    let names: Vec<&str> = cgroup_hooks()
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| progs.as_ref().is_none_or(|p| !p.exists() || p.join(name).exists()))
        .collect();
    let missing: Vec<&str> = names.iter().copied().filter(|name| gone(&links.join(name))).collect();
    let mut faults = Vec::new();
    if !missing.is_empty() {
        faults.push(CaptureFault::LinksGone { dir: links.display().to_string(), names: missing.join(", ") });
    }
    let cgroup_id = match link::cgroup_id(&holder.cgroup) {
        Ok(id) => id,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            faults.push(CaptureFault::CgroupGone(holder.cgroup.display().to_string()));
            return faults;
        }
        Err(e) => {
            faults.push(unchecked(format!("its cgroup {}", holder.cgroup.display()), e));
            return faults;
        }
    };
    let mut detached = Vec::new();
    for name in names.iter().copied().filter(|name| !missing.contains(name)) {
        let pin = links.join(name);
        match link::attached_to(&pin, cgroup_id) {
            Ok(true) => {}
            Ok(false) => detached.push(name),
            Err(e) => faults.push(unchecked(format!("the link pinned at {}", pin.display()), e)),
        }
    }
    if !detached.is_empty() {
        faults.push(CaptureFault::LinksDetached {
            dir: links.display().to_string(),
            names: detached.join(", "),
        });
    }
    faults
}

/// Whether a pod's inbound classifier is on its interface: a filter of its set's node
/// classifier, or its own copy (a TCX link, or a filter).
fn filter_fault(record: &PinRecord) -> Option<CaptureFault> {
    let interface = record.interface.as_deref()?;
    // A pod registered from inside its namespace (no path): nowhere to look from here.
    let netns = record.netns.as_deref().filter(|p| *p != Path::new("/proc/self/ns/net"))?;
    let own_link = record.pin_dir().join("links").join("inbound");
    if !gone(&own_link) {
        return match link::attached(&own_link) {
            Ok(true) => None,
            Ok(false) => Some(CaptureFault::FilterGone {
                interface: interface.into(),
                netns: netns.display().to_string(),
            }),
            Err(e) => Some(unchecked(format!("the inbound link pinned at {}", own_link.display()), e)),
        };
    }
    let filters = match super::netns::in_netns(netns, || inbound::weir_filters(interface)) {
        Ok(filters) => filters,
        Err(e) => {
            let what = format!("the inbound filters on {interface} in {}", netns.display());
            return Some(unchecked(what, e));
        }
    };
    let node_classifier = pod::maps_dir(record).join("progs").join(weir_ebpf_common::inbound::PROG);
    let expected = sys::obj_get(&node_classifier).ok().and_then(|fd| sys::prog_id(fd.as_fd()).ok());
    let present = match expected {
        Some(id) => filters.iter().any(|f| f.prog_id == id),
        None => !filters.is_empty(),
    };
    (!present)
        .then(|| CaptureFault::FilterGone { interface: interface.into(), netns: netns.display().to_string() })
}

/// Everything wrong with `record`'s capture (`all`: every record on the node); empty
/// when it is live. Needs the privileges that read pinned maps (CAP_BPF, CAP_SYS_ADMIN).
pub fn faults(record: &PinRecord, all: &[PinRecord]) -> Vec<CaptureFault> {
    if !bpffs_mounted() {
        return vec![CaptureFault::BpffsNotMounted];
    }
    let mut faults = link_faults(links_holder(record, all));
    if let Some(why) = gc::looks_gone(record) {
        faults.push(CaptureFault::NetnsGone(why));
        return faults;
    }
    if let Some(key) = &record.programs
        && !set::present(key)
        && !set::pinned_keys().contains(key)
    {
        faults.push(CaptureFault::SetGone(key.clone()));
        return faults;
    }
    if record.netns_cookie != 0 {
        match pod::maps_of(record).and_then(|maps| maps.pods()) {
            Ok(pods) if pods.contains(&record.netns_cookie) => {}
            Ok(_) => faults.push(CaptureFault::NotRegistered(record.netns_cookie)),
            // Another build's set, whose maps this build cannot read typed: counted raw.
            Err(_) => match record.programs.as_deref().map(set::LockedSet::open) {
                Some(Ok(Some(_))) => {}
                _ => faults.push(CaptureFault::SetGone(
                    record.programs.clone().unwrap_or_else(|| format!("of {}", record.pod)),
                )),
            },
        }
        faults.extend(filter_fault(record));
    }
    faults
}

/// The faults as one line.
pub fn describe(faults: &[CaptureFault]) -> String {
    faults.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}
