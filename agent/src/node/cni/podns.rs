//! A running pod's network namespace, found from the node's `/proc`: the processes
//! whose cgroup path names the pod's UID (the kubelet names every pod's cgroup after
//! its UID, `.../pod<uid>/...` with the cgroupfs driver, `...-pod<uid_with_underscores>.slice/...`
//! with systemd's), and the one network namespace they share. Nothing a pod controls
//! chooses the answer: not its IP (any pod with NET_ADMIN can claim one), not its
//! cgroup (the kubelet's). A pod whose processes are in more than one namespace (one of
//! them the node's: host-network) is reported, never guessed at.

use std::{
    collections::BTreeMap,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

/// Why a pod's namespace could not be told.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodNetnsError {
    #[error("read {path}: {message}")]
    Proc { path: PathBuf, message: String },
    #[error(
        "the processes of pod {uid} are in {count} network namespaces ({namespaces}): not guessing which is the pod's"
    )]
    Ambiguous { uid: String, count: usize, namespaces: String },
    #[error("pod {uid} runs in the node's network namespace (host network)")]
    HostNetwork { uid: String },
}

/// Whether a cgroup path (a line of /proc/<pid>/cgroup) is pod `uid`'s: the kubelet's
/// pod-level component (`pod<uid>`, with '-' or (systemd) '_' between the UID's groups)
/// right under the node's first `kubepods` component, or under its QoS class
/// (`burstable`, `besteffort`). Only there: a pod that may make cgroups of its own could
/// otherwise name a nested one after another pod and pass for it.
pub fn names_pod(cgroup_line: &str, uid: &str) -> bool {
    if uid.is_empty() {
        return false;
    }
    let systemd = uid.replace('-', "_");
    let is_pod = |part: &str| {
        let part = part.strip_suffix(".slice").unwrap_or(part);
        [uid, systemd.as_str()]
            .iter()
            .any(|u| part.strip_suffix(*u).is_some_and(|head| head == "pod" || head.ends_with("-pod")))
    };
    let path = cgroup_line.rsplit_once(':').map_or(cgroup_line, |(_, p)| p);
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let Some(root) = parts.iter().position(|p| p.contains("kubepods")) else { return false };
    let qos = |p: &&str| p.contains("burstable") || p.contains("besteffort");
    match (parts.get(root + 1), parts.get(root + 2)) {
        (Some(pod), _) if is_pod(pod) => true,
        (Some(class), Some(pod)) => qos(class) && is_pod(pod),
        _ => false,
    }
}

/// The network namespace of pod `uid`: a `<proc>/<pid>/ns/net` path of one of its
/// processes (valid while that process lives: open it at once). `Ok(None)`: no process
/// of the pod is running.
pub fn find(proc_root: &Path, uid: &str) -> Result<Option<PathBuf>, PodNetnsError> {
    let wanted = std::collections::BTreeSet::from([uid.to_string()]);
    find_many(proc_root, &wanted)?.remove(uid).unwrap_or(Ok(None))
}

/// [`find`] for several pods in one pass over `/proc` (the node agent's start, with
/// every enrolled pod): each uid's answer.
pub fn find_many(
    proc_root: &Path,
    uids: &std::collections::BTreeSet<String>,
) -> Result<BTreeMap<String, Result<Option<PathBuf>, PodNetnsError>>, PodNetnsError> {
    let proc_err =
        |path: &Path, e: std::io::Error| PodNetnsError::Proc { path: path.into(), message: e.to_string() };
    let node = std::fs::metadata(proc_root.join("self/ns/net"))
        .map_err(|e| proc_err(&proc_root.join("self/ns/net"), e))?;
    let node = (node.dev(), node.ino());
    let mut found: BTreeMap<&str, BTreeMap<(u64, u64), PathBuf>> = BTreeMap::new();
    let entries = std::fs::read_dir(proc_root).map_err(|e| proc_err(proc_root, e))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        // A process that exits meanwhile is skipped.
        let Ok(cgroups) = std::fs::read_to_string(entry.path().join("cgroup")) else { continue };
        let Some(uid) = uids.iter().find(|uid| cgroups.lines().any(|l| names_pod(l, uid))) else { continue };
        let ns = entry.path().join("ns/net");
        let Ok(meta) = std::fs::metadata(&ns) else { continue };
        found.entry(uid.as_str()).or_default().entry((meta.dev(), meta.ino())).or_insert(ns);
    }
    Ok(uids
        .iter()
        .map(|uid| (uid.clone(), one(uid, found.remove(uid.as_str()).unwrap_or_default(), node)))
        .collect())
}

/// Whether a process of pod `uid` is in the network namespace `(dev, ino)`: the
/// evidence that a namespace is still the pod's.
pub fn pod_in_namespace(proc_root: &Path, uid: &str, ns: (u64, u64)) -> Result<bool, PodNetnsError> {
    let entries = std::fs::read_dir(proc_root)
        .map_err(|e| PodNetnsError::Proc { path: proc_root.into(), message: e.to_string() })?;
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(cgroups) = std::fs::read_to_string(entry.path().join("cgroup")) else { continue };
        if !cgroups.lines().any(|l| names_pod(l, uid)) {
            continue;
        }
        if std::fs::metadata(entry.path().join("ns/net")).is_ok_and(|m| (m.dev(), m.ino()) == ns) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The answer for one pod from the namespaces its processes are in.
fn one(
    uid: &str,
    mut found: BTreeMap<(u64, u64), PathBuf>,
    node: (u64, u64),
) -> Result<Option<PathBuf>, PodNetnsError> {
    if found.contains_key(&node) {
        if found.len() == 1 {
            return Err(PodNetnsError::HostNetwork { uid: uid.into() });
        }
        found.remove(&node);
        return Err(PodNetnsError::Ambiguous {
            uid: uid.into(),
            count: found.len() + 1,
            namespaces: "the node's and others".into(),
        });
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.into_values().next()),
        n => Err(PodNetnsError::Ambiguous {
            uid: uid.into(),
            count: n,
            namespaces: found.keys().map(|(_, ino)| format!("net:[{ino}]")).collect::<Vec<_>>().join(", "),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_paths_of_both_kubelet_drivers_name_the_pod() {
        let uid = "6f1e2d3c-aaaa-bbbb-cccc-0123456789ab";
        let systemd = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod6f1e2d3c_aaaa_bbbb_cccc_0123456789ab.slice/cri-containerd-f00.scope";
        let cgroupfs = "0::/kubepods/burstable/pod6f1e2d3c-aaaa-bbbb-cccc-0123456789ab/f00";
        let guaranteed =
            "0::/kubepods.slice/kubepods-pod6f1e2d3c_aaaa_bbbb_cccc_0123456789ab.slice/crio-1.scope";
        for line in [systemd, cgroupfs, guaranteed] {
            assert!(names_pod(line, uid), "{line}");
        }
        assert!(!names_pod(cgroupfs, "6f1e2d3c-aaaa-bbbb-cccc-0123456789ac"));
        assert!(!names_pod("0::/kubepods/burstable/xpod6f1e2d3c-aaaa-bbbb-cccc-0123456789ab", uid));
        assert!(!names_pod(cgroupfs, ""));
        // A UID that merely ends a longer component is not this pod.
        assert!(!names_pod("0::/kubepods/pod16f1e2d3c-aaaa-bbbb-cccc-0123456789ab", uid));
        // Another pod's nested cgroup named after this pod is not this pod.
        let nested = "0::/kubepods/besteffort/pod0000aaaa-1111-2222-3333-444455556666/c1/pod6f1e2d3c-aaaa-bbbb-cccc-0123456789ab";
        assert!(!names_pod(nested, uid));
        let nested_systemd = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0000aaaa_1111.slice/cri-containerd-1.scope/kubepods-besteffort-pod6f1e2d3c_aaaa_bbbb_cccc_0123456789ab.slice";
        assert!(!names_pod(nested_systemd, uid));
        assert!(!names_pod("0::/pod6f1e2d3c-aaaa-bbbb-cccc-0123456789ab", uid), "no kubepods above it");
    }
}
