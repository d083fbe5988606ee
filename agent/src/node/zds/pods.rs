//! The pod cache ZDS snapshots are taken from: pod uid → the pod's network namespace
//! (an open fd, kept for as long as the pod is cached, since every new ztunnel gets it
//! again) and its [`WorkloadInfo`], or "known, netns not found" (sent as Keep). As
//! Istio's cache: upserting a uid with the same netns (device, inode) keeps the fd
//! already held and closes the new one; a different netns replaces it.

use std::{
    collections::HashMap,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd},
    sync::{Arc, Mutex},
};

use nix::{errno::Errno, sys::stat::fstat};

use super::WorkloadInfo;

/// A pod's network namespace: the fd and its identity. Clones share the fd.
#[derive(Debug, Clone)]
pub(super) struct Netns {
    fd: Arc<OwnedFd>,
    /// (st_dev, st_ino): how ztunnel tells namespaces apart.
    id: (u64, u64),
}

impl Netns {
    /// Takes `fd` if it is a network namespace; else says what it is.
    pub fn new(fd: OwnedFd) -> Result<Self, String> {
        check_network_namespace(fd.as_fd())?;
        let stat = fstat(&fd).map_err(|e| format!("fstat: {e}"))?;
        Ok(Self { fd: Arc::new(fd), id: (stat.st_dev, stat.st_ino) })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn same_as(&self, other: &Netns) -> bool {
        self.id == other.id
    }
}

/// `ioctl(NS_GET_NSTYPE)` (Linux 4.11+): the `CLONE_NEW*` type of a namespace fd.
const NS_GET_NSTYPE: libc::c_ulong = 0xb7 << 8 | 0x3;
/// `statfs` type of the nsfs filesystem namespace files live on.
const NSFS_MAGIC: u64 = 0x6e73_6673;

/// Ok when `fd` is a network namespace (on kernels before 4.11, any namespace).
fn check_network_namespace(fd: BorrowedFd<'_>) -> Result<(), String> {
    // SAFETY: NS_GET_NSTYPE takes no argument and only reads the descriptor.
    let kind = unsafe { libc::ioctl(fd.as_raw_fd(), NS_GET_NSTYPE as _) };
    if kind >= 0 {
        return match kind {
            libc::CLONE_NEWNET => Ok(()),
            other => Err(format!("a namespace of another type (CLONE_NEW* {other:#x})")),
        };
    }
    let err = Errno::last();
    let stat = nix::sys::statfs::fstatfs(fd).map_err(|e| format!("fstatfs: {e}"))?;
    // The statfs type is signed in glibc and unsigned in musl: compare it as unsigned.
    #[allow(clippy::unnecessary_cast)]
    let fs_type = stat.filesystem_type().0 as u64;
    match err {
        // Older kernels have no NS_GET_NSTYPE: a file on nsfs is a namespace.
        Errno::ENOTTY | Errno::EINVAL if fs_type == NSFS_MAGIC => Ok(()),
        e => Err(format!("not a namespace file (filesystem type {fs_type:#x}, NS_GET_NSTYPE: {e})")),
    }
}

/// One cached pod.
#[derive(Debug, Clone)]
pub(super) enum CachedPod {
    /// Sent as Add with its netns.
    Enrolled { info: WorkloadInfo, netns: Netns },
    /// Known to be enrolled, netns not found: sent as Keep.
    NetnsUnknown,
}

/// The cache: shared by the handle (writes) and every connection (snapshots).
#[derive(Debug, Default)]
pub(super) struct PodCache {
    pods: Mutex<HashMap<String, CachedPod>>,
}

impl PodCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, CachedPod>> {
        self.pods.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Caches `uid` with `info` and `netns`; returns the netns now cached (the one
    /// held before when it is the same namespace).
    pub fn upsert(&self, uid: &str, info: WorkloadInfo, netns: Netns) -> Netns {
        let mut pods = self.lock();
        let kept = match pods.get(uid) {
            Some(CachedPod::Enrolled { netns: held, .. }) if held.same_as(&netns) => held.clone(),
            _ => netns,
        };
        pods.insert(uid.to_string(), CachedPod::Enrolled { info, netns: kept.clone() });
        kept
    }

    /// The uid, other than `uid`, enrolled with the namespace whose (st_dev, st_ino) is
    /// `id`, if any: two pods never share one.
    pub fn enrolled_with(&self, id: (u64, u64), uid: &str) -> Option<String> {
        self.lock().iter().find_map(|(other, pod)| match pod {
            CachedPod::Enrolled { netns, .. } if netns.id == id && other != uid => Some(other.clone()),
            _ => None,
        })
    }

    /// Makes sure `uid` is cached, with no netns if it had none.
    pub fn ensure(&self, uid: &str) {
        self.lock().entry(uid.to_string()).or_insert(CachedPod::NetnsUnknown);
    }

    /// A duplicate of `uid`'s netns fd, if it is cached with one.
    pub fn netns(&self, uid: &str) -> Option<OwnedFd> {
        match self.lock().get(uid) {
            Some(CachedPod::Enrolled { netns, .. }) => netns.fd().try_clone_to_owned().ok(),
            _ => None,
        }
    }

    /// Removes `uid`; its netns fd closes once no message in flight holds it.
    pub fn take(&self, uid: &str) -> Option<CachedPod> {
        self.lock().remove(uid)
    }

    /// A copy of the cache, for one snapshot.
    pub fn snapshot(&self) -> Vec<(String, CachedPod)> {
        self.lock().iter().map(|(uid, pod)| (uid.clone(), pod.clone())).collect()
    }

    /// The cached uids, sorted.
    pub fn uids(&self) -> Vec<String> {
        let mut uids: Vec<String> = self.lock().keys().cloned().collect();
        uids.sort();
        uids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own_netns() -> OwnedFd {
        std::fs::File::open("/proc/self/ns/net").unwrap().into()
    }

    #[test]
    fn a_network_namespace_is_taken_and_anything_else_refused() {
        assert!(Netns::new(own_netns()).is_ok());
        let e = Netns::new(std::fs::File::open("/dev/null").unwrap().into()).unwrap_err();
        assert!(e.starts_with("not a namespace file"), "{e}");
        let e = Netns::new(std::fs::File::open("/proc/self/ns/uts").unwrap().into()).unwrap_err();
        assert!(e.contains("another type"), "{e}");
    }

    #[test]
    fn the_same_namespace_keeps_the_fd_held_and_another_replaces_it() {
        let cache = PodCache::default();
        let first = Netns::new(own_netns()).unwrap();
        let first_raw = first.fd().as_raw_fd();
        let kept = cache.upsert("u", WorkloadInfo::default(), first);
        assert_eq!(kept.fd().as_raw_fd(), first_raw);
        let again = Netns::new(own_netns()).unwrap();
        let info = WorkloadInfo { name: "renamed".into(), ..WorkloadInfo::default() };
        let kept = cache.upsert("u", info.clone(), again);
        assert_eq!(kept.fd().as_raw_fd(), first_raw, "same inode: the fd held before stays");
        match &cache.snapshot()[..] {
            [(uid, CachedPod::Enrolled { info: cached, netns })] => {
                assert_eq!(uid, "u");
                assert_eq!(cached, &info, "the info is replaced");
                assert_eq!(netns.fd().as_raw_fd(), first_raw);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ensure_keeps_a_known_netns_and_take_removes() {
        let cache = PodCache::default();
        cache.ensure("unknown");
        cache.upsert("known", WorkloadInfo::default(), Netns::new(own_netns()).unwrap());
        cache.ensure("known");
        let snapshot = cache.snapshot();
        let find = |uid: &str| snapshot.iter().find(|(u, _)| u == uid).map(|(_, p)| p.clone());
        assert!(matches!(find("unknown"), Some(CachedPod::NetnsUnknown)));
        assert!(matches!(find("known"), Some(CachedPod::Enrolled { .. })));
        assert_eq!(cache.uids(), ["known", "unknown"]);
        assert!(cache.take("known").is_some());
        assert!(cache.take("known").is_none());
        assert_eq!(cache.uids(), ["unknown"]);
    }
}
