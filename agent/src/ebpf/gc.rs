//! Garbage collection of eBPF capture state: the registrations of pods that are gone
//! (init-container mode has nothing that unregisters a pod; a CNI DEL can fail or never
//! come), and list entries no registration owns (a registration cut short by a crash).
//! Run by the next `weir capture ebpf`, by `weir capture clean --gone`, and by the CNI
//! node agent on every pass. A pod is gone only when the kernel says so: its namespace
//! no longer exists under its cookie, or, for a pod registered from inside its own
//! namespace (no path recorded), its cgroup is gone. Node captures are never collected.

use std::path::Path;

use super::{EbpfError, netns::netns_cookie, record::PinRecord, set};

/// Why a registered pod's capture is gone (or `None`: it is not).
pub fn gone(record: &PinRecord) -> Option<String> {
    if record.netns_cookie == 0 {
        return None;
    }
    match &record.netns {
        Some(path) if path != Path::new("/proc/self/ns/net") => match netns_cookie(Some(path)) {
            Ok(cookie) if cookie == record.netns_cookie => None,
            Ok(cookie) => Some(format!("{} is another namespace now (cookie {cookie})", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(format!("{} is gone", path.display())),
            // A path that is no namespace any more (its bind mount went).
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                Some(format!("{} is no namespace", path.display()))
            }
            Err(_) => None,
        },
        _ => (!record.cgroup.as_os_str().is_empty() && !record.cgroup.exists())
            .then(|| format!("its cgroup {} is gone", record.cgroup.display())),
    }
}

/// Removes the captures of every pod that is gone; returns each capture's name and
/// whether its removal worked.
pub fn collect_gone() -> Vec<(String, Result<(), EbpfError>)> {
    let mut out = Vec::new();
    for record in PinRecord::load_all() {
        let Some(why) = gone(&record) else { continue };
        tracing::info!(capture = %record.pod, pod = %record.display_name(), reason = %why, "pod gone: removing its capture");
        out.push((record.pod.clone(), record.remove()));
    }
    out
}

/// Removes list entries no registration owns from this build's program set; returns
/// how many.
pub fn collect_orphans() -> Result<usize, EbpfError> {
    match set::NodePrograms::open_existing(&set::version_key())? {
        Some(set) => set.collect_orphans(),
        None => Ok(0),
    }
}
