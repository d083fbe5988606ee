//! Garbage collection of eBPF capture state: the registrations of pods that are gone
//! (init-container mode has nothing that unregisters a pod; a CNI DEL can fail or never
//! come), and list entries no registration owns (a registration cut short by a crash).
//! Run by the next `weir capture ebpf`, by `weir capture clean --gone`, and by the CNI
//! node agent. Removing a live pod's registration lets its traffic past its sidecar, so
//! a pod is gone only on positive evidence, never because something cannot be seen:
//! from the host's PID namespace, no process is in its network namespace and no mount
//! holds it ([`LiveNamespaces`]); elsewhere, its recorded path now opens another
//! namespace or no namespace, or (registered from inside, no path) its cgroup is gone
//! and the kernel detached its links. Node captures are never collected.

use std::path::Path;

use super::{
    EbpfError,
    live_netns::{CannotTell, Existence, LiveNamespaces},
    netns::netns_cookie,
    record::PinRecord,
    set,
};

/// The node's namespaces as this process can see them, read once per collection.
pub type NodeView = Result<LiveNamespaces, CannotTell>;

/// Reads the node's namespaces from `proc` (the host's `/proc`, under `hostPID`).
pub fn node_view(proc: &Path) -> NodeView {
    LiveNamespaces::read(proc)
}

/// Why a registered pod's capture is gone (or `None`: it is not, or nothing here can
/// show that it is).
pub fn gone(record: &PinRecord, view: &NodeView) -> Option<String> {
    if record.netns_cookie == 0 {
        return None;
    }
    if let Ok(live) = view {
        return match live.existence(record.netns_cookie, &record.cgroup) {
            Existence::HeldBy(holder) => {
                tracing::debug!(capture = %record.pod, holder = %holder.display(), "pod's namespace still exists");
                None
            }
            Existence::CannotTell(why) => {
                tracing::debug!(capture = %record.pod, reason = %why, "cannot tell whether the pod is gone");
                None
            }
            Existence::Gone => Some(format!(
                "no process is in its network namespace (cookie {}) and no mount holds it",
                record.netns_cookie
            )),
        };
    }
    match recorded_path(record) {
        // Another PID namespace's /proc names other processes: no evidence there.
        Some(path) if path.starts_with("/proc") => None,
        Some(path) => match netns_cookie(Some(path)) {
            Ok(cookie) if cookie == record.netns_cookie => None,
            Ok(cookie) => Some(format!("{} is another namespace now (cookie {cookie})", path.display())),
            // The path stayed, its bind mount went.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                Some(format!("{} is no namespace", path.display()))
            }
            // Not found may only mean not mounted here: no evidence.
            Err(_) => None,
        },
        None => cgroup_gone(record),
    }
}

/// What status reports (nothing is removed on it): the recorded namespace path is gone
/// or names another namespace, or, registered from inside, the cgroup is gone.
pub fn looks_gone(record: &PinRecord) -> Option<String> {
    if record.netns_cookie == 0 {
        return None;
    }
    match recorded_path(record) {
        Some(path) => match netns_cookie(Some(path)) {
            Ok(cookie) if cookie == record.netns_cookie => None,
            Ok(cookie) => Some(format!("{} is another namespace now (cookie {cookie})", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(format!("{} is gone", path.display())),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                Some(format!("{} is no namespace", path.display()))
            }
            Err(_) => None,
        },
        None => (!record.cgroup.as_os_str().is_empty() && !record.cgroup.exists())
            .then(|| format!("its cgroup {} is gone", record.cgroup.display())),
    }
}

fn recorded_path(record: &PinRecord) -> Option<&Path> {
    record.netns.as_deref().filter(|p| *p != Path::new("/proc/self/ns/net"))
}

/// A pod registered from inside its namespace: its cgroup path is gone *and* the kernel
/// detached its pinned links (which it does when their cgroup is destroyed), so the
/// path is not merely another cgroup namespace's view.
fn cgroup_gone(record: &PinRecord) -> Option<String> {
    if record.cgroup.as_os_str().is_empty() || !matches!(record.cgroup.try_exists(), Ok(false)) {
        return None;
    }
    let links = record.pin_dir().join("links");
    let pins: Vec<_> = std::fs::read_dir(&links).ok()?.flatten().map(|e| e.path()).collect();
    let all_detached = !pins.is_empty() && pins.iter().all(|p| matches!(super::link::attached(p), Ok(false)));
    all_detached.then(|| format!("its cgroup {} is gone (its links detached)", record.cgroup.display()))
}

/// What a pass of the gone-pod collector saw and did: the view it judged on, and each
/// removed capture's name with whether its removal worked.
pub type GonePass = (NodeView, Vec<(String, Result<(), EbpfError>)>);

/// One pass of the gone-pod collector over `proc`: the view it judged on, and each
/// removed capture's name with whether its removal worked. The records are read before
/// the namespaces: a pod registered while the view is read is not among them and waits
/// for the next pass. Read the other way round, a pod added in between was judged on a
/// view older than its namespace, and its capture removed while it ran.
pub fn collect_gone_pods(proc: &Path) -> GonePass {
    collect_gone_pods_with(proc, || {})
}

/// [`collect_gone_pods`], running `between` after the records are read and before the
/// namespaces are (a test's window for a pod that starts meanwhile).
#[doc(hidden)]
pub fn collect_gone_pods_with(proc: &Path, between: impl FnOnce()) -> GonePass {
    let records = PinRecord::load_all();
    between();
    let view = node_view(proc);
    let removed = collect_gone(records, &view);
    (view, removed)
}

/// Removes the captures among `records` of pods that are gone (judged on `view`, read
/// after the records); returns each capture's name and whether its removal worked.
pub fn collect_gone(records: Vec<PinRecord>, view: &NodeView) -> Vec<(String, Result<(), EbpfError>)> {
    let mut out = Vec::new();
    for record in records {
        let Some(why) = gone(&record, view) else { continue };
        tracing::info!(capture = %record.pod, pod = %record.display_name(), reason = %why, "pod gone: removing its capture");
        out.push((record.pod.clone(), record.remove()));
    }
    out
}

/// Whether the namespace registered as `cookie` is gone, on positive evidence only
/// (the view of the whole node says no process or mount holds it; a process under
/// `cgroup`, where the pod's processes run, whose namespace cannot be read may).
pub fn cookie_gone(view: &NodeView, cookie: u64, cgroup: &Path) -> bool {
    match view.as_ref().map(|live| live.existence(cookie, cgroup)) {
        Ok(Existence::Gone) => true,
        Ok(Existence::CannotTell(why)) => {
            tracing::debug!(netns_cookie = cookie, reason = %why, "cannot tell whether a registered namespace is gone");
            false
        }
        _ => false,
    }
}

/// The namespaces registered in this build's set that no record names (a record lost
/// with the pod still registered): those shown gone are unregistered by cookie, so a
/// lost record never keeps a gone pod in the node's maps. Returns how many went.
pub fn collect_unrecorded(view: &NodeView) -> Result<usize, EbpfError> {
    let Some(mut set) = set::NodePrograms::open_existing(&set::version_key())? else { return Ok(0) };
    let records = PinRecord::load_all();
    let recorded: std::collections::HashSet<u64> = records.iter().map(|r| r.netns_cookie).collect();
    // Where pods registered in this set run: its node captures' cgroups (or anywhere).
    let key = set.key().to_string();
    let mut cgroups: Vec<&Path> = records
        .iter()
        .filter(|r| r.netns_cookie == 0 && r.programs.as_deref() == Some(key.as_str()))
        .map(|r| r.cgroup.as_path())
        .collect();
    if cgroups.is_empty() {
        cgroups.push(Path::new("/"));
    }
    let mut removed = 0;
    for cookie in set.maps().pods()? {
        if !recorded.contains(&cookie) && cgroups.iter().all(|cg| cookie_gone(view, cookie, cg)) {
            tracing::info!(
                netns_cookie = cookie,
                "a registration without a record whose namespace is gone: removed"
            );
            set.unregister(cookie, None)?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// Removes list entries no registration owns from this build's program set; returns
/// how many.
pub fn collect_orphans() -> Result<usize, EbpfError> {
    match set::NodePrograms::open_existing(&set::version_key())? {
        Some(set) => set.collect_orphans(),
        None => Ok(0),
    }
}
