//! Whether a pinned capture is still live, from what the kernel keeps for it: bpffs
//! mounted, its cgroup links pinned (once the command that made them has exited, a
//! link lives exactly as long as its pin), its program set present and its namespace
//! registered in the set's maps. A pod registered with a CNI node capture has no links
//! of its own: the node capture's are its links. What `weir capture status` reports
//! and what `weir capture apply` repairs.

use std::path::Path;

use super::{bpffs::bpffs_mounted, capture::cgroup_hooks, pod, record::PinRecord, set};

/// One reason a recorded capture is not (wholly) live.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaptureFault {
    #[error("bpffs is not mounted at /sys/fs/bpf: the pins, and the cgroup links they held, are gone")]
    BpffsNotMounted,
    #[error("its pins ({0}) are gone, and the cgroup links they held with them")]
    PinsGone(String),
    #[error("links gone from {dir}: {names} (those hooks no longer run in the cgroup)")]
    LinksGone { dir: String, names: String },
    #[error("its program set {0} is gone (the programs may run on, but cannot be shown or changed)")]
    SetGone(String),
    #[error("its network namespace (cookie {0}) is not registered in the program set's maps")]
    NotRegistered(u64),
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

/// Everything wrong with `record`'s capture (`all`: every record on the node); empty
/// when it is live. Needs the privileges that read pinned maps (CAP_BPF, CAP_SYS_ADMIN).
pub fn faults(record: &PinRecord, all: &[PinRecord]) -> Vec<CaptureFault> {
    if !bpffs_mounted() {
        return vec![CaptureFault::BpffsNotMounted];
    }
    let mut faults = Vec::new();
    let dir = links_holder(record, all).pin_dir();
    if gone(&dir) {
        faults.push(CaptureFault::PinsGone(dir.display().to_string()));
    } else {
        let links = dir.join("links");
        let missing: Vec<&str> =
            cgroup_hooks().into_iter().map(|(name, _)| name).filter(|name| gone(&links.join(name))).collect();
        if !missing.is_empty() {
            faults.push(CaptureFault::LinksGone {
                dir: links.display().to_string(),
                names: missing.join(", "),
            });
        }
    }
    if let Some(key) = &record.programs
        && !set::present(key)
    {
        faults.push(CaptureFault::SetGone(key.clone()));
        return faults;
    }
    if record.netns_cookie != 0 {
        match pod::maps_of(record).and_then(|maps| maps.pods()) {
            Ok(pods) if pods.contains(&record.netns_cookie) => {}
            Ok(_) => faults.push(CaptureFault::NotRegistered(record.netns_cookie)),
            Err(_) => faults.push(CaptureFault::SetGone(
                record.programs.clone().unwrap_or_else(|| format!("of {}", record.pod)),
            )),
        }
    }
    faults
}

/// The faults as one line.
pub fn describe(faults: &[CaptureFault]) -> String {
    faults.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}
