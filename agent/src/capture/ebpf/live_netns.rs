//! Which network namespaces exist on the node, read from the host's `/proc`: every
//! namespace some process is in, and every one bind-mounted in any mount namespace
//! (`ip netns`, a container runtime's `/var/run/netns`). The garbage collector's
//! evidence that a pod is gone: a namespace nothing holds is gone for good (cookies are
//! never reused). Only the host's PID namespace sees every process (a DaemonSet needs
//! `hostPID: true`); anywhere else [`LiveNamespaces::read`] says it cannot tell, and
//! nothing is collected on a path that merely cannot be seen.

use std::{
    collections::{HashMap, HashSet},
    io::ErrorKind,
    path::{Path, PathBuf},
};

use super::netns::netns_cookie;

/// Why the node's namespaces cannot be listed from here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CannotTell {
    #[error(
        "{proc} is not the host's PID namespace (no kthreadd at PID 2): the node's processes are not all visible"
    )]
    NotHostPids { proc: String },
    #[error("cannot read {path}: {error}")]
    Unreadable { path: String, error: String },
}

/// The network namespaces that exist on the node: each one's cookie, and one path
/// that holds it (a process's `ns/net`, or a bind mount seen through a process's root).
/// Processes more privileged than the reader (their `ns/net` cannot be read) are noted
/// with their cgroup: a namespace only they could hold is not known to be gone.
#[derive(Debug, Default)]
pub struct LiveNamespaces {
    cookies: HashMap<u64, PathBuf>,
    unread: Vec<UnreadProcess>,
    /// Bind-mounted namespaces whose cookie could not be read.
    unresolved_mounts: usize,
}

/// A process whose network namespace could not be read, and its cgroup v2 path.
#[derive(Debug)]
struct UnreadProcess {
    pid: String,
    cgroup: Option<String>,
}

/// Whether a namespace exists, as far as the node's processes and mounts show.
#[derive(Debug, PartialEq, Eq)]
pub enum Existence<'a> {
    HeldBy(&'a Path),
    CannotTell(String),
    Gone,
}

impl LiveNamespaces {
    /// Reads them from `proc` (the host's `/proc`). Fails when that is not the host's
    /// PID namespace, or `proc` itself cannot be listed.
    pub fn read(proc: &Path) -> Result<Self, CannotTell> {
        match std::fs::read_to_string(proc.join("2/comm")) {
            Ok(comm) if comm.trim() == "kthreadd" => {}
            _ => return Err(CannotTell::NotHostPids { proc: proc.display().to_string() }),
        }
        let mut paths: HashMap<u64, Vec<PathBuf>> = HashMap::new();
        let mut mount_namespaces = HashSet::new();
        let mut unread = Vec::new();
        for entry in std::fs::read_dir(proc).map_err(unreadable(proc))?.flatten() {
            if !entry.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let pid = entry.path();
            match inode(&pid.join("ns/net")) {
                Ok(Some(net)) => paths.entry(net).or_default().push(pid.join("ns/net")),
                // The process exited while we looked: it holds nothing any more.
                Ok(None) => continue,
                Err(_) => unread.push(UnreadProcess {
                    pid: entry.file_name().to_string_lossy().into_owned(),
                    cgroup: cgroup_v2_of(&pid),
                }),
            }
            // An unreadable mount namespace is read every time (it cannot be told apart).
            let first = match inode(&pid.join("ns/mnt")) {
                Ok(Some(mnt)) => mount_namespaces.insert(mnt),
                Ok(None) => continue,
                Err(_) => true,
            };
            if first {
                for (ino, path) in bind_mounted(&pid) {
                    paths.entry(ino).or_default().push(path);
                }
            }
        }
        let mut cookies = HashMap::new();
        let mut unresolved_mounts = 0;
        for candidates in paths.into_values() {
            match candidates.into_iter().find_map(|path| netns_cookie(Some(&path)).ok().map(|c| (c, path))) {
                Some((cookie, path)) => {
                    cookies.insert(cookie, path);
                }
                None => unresolved_mounts += 1,
            }
        }
        Ok(Self { cookies, unread, unresolved_mounts })
    }

    /// Whether the namespace with `cookie` exists; `cgroup` (a cgroup v2 path as this
    /// process sees it) holds the pod's processes.
    pub fn existence(&self, cookie: u64, cgroup: &Path) -> Existence<'_> {
        if let Some(path) = self.cookies.get(&cookie) {
            return Existence::HeldBy(path);
        }
        if self.unresolved_mounts > 0 {
            return Existence::CannotTell(format!(
                "{} network namespaces are held by mounts whose namespace could not be read",
                self.unresolved_mounts
            ));
        }
        let pod_cgroup = cgroup_v2_relative(cgroup);
        let inside = |p: &UnreadProcess| match (&p.cgroup, &pod_cgroup) {
            (Some(c), Some(pod)) => pod == "/" || c == pod || c.starts_with(&format!("{pod}/")),
            _ => true,
        };
        match self.unread.iter().find(|p| inside(p)) {
            Some(p) => Existence::CannotTell(format!(
                "process {} (cgroup {}) may be in it: its network namespace cannot be read",
                p.pid,
                p.cgroup.as_deref().unwrap_or("unknown")
            )),
            None => Existence::Gone,
        }
    }
}

/// A process's cgroup v2 path (`0::/kubepods.slice/...`).
fn cgroup_v2_of(pid: &Path) -> Option<String> {
    let text = std::fs::read_to_string(pid.join("cgroup")).ok()?;
    text.lines().find_map(|l| l.strip_prefix("0::")).map(str::to_string)
}

/// The cgroup v2 path of the directory `dir` (under a cgroup2 mount of this process).
fn cgroup_v2_relative(dir: &Path) -> Option<String> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (right.split(' ').next()? == "cgroup2").then_some(())?;
            let fields: Vec<&str> = left.split(' ').collect();
            Some((unescape(fields.get(3)?), PathBuf::from(unescape(fields.get(4)?))))
        })
        .filter_map(|(root, mount_point)| {
            let rest = dir.strip_prefix(&mount_point).ok()?;
            Some((mount_point.as_os_str().len(), Path::new(&root).join(rest)))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, path)| path.to_string_lossy().trim_end_matches('/').to_string())
        .map(|p| if p.is_empty() { "/".to_string() } else { p })
}

fn unreadable(path: &Path) -> impl Fn(std::io::Error) -> CannotTell + '_ {
    move |e| CannotTell::Unreadable { path: path.display().to_string(), error: e.to_string() }
}

/// The process (or its namespace file) went between listing and reading.
fn gone_while_looking(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::NotFound) || e.raw_os_error() == Some(libc::ESRCH)
}

/// The inode of a namespace file; `None` when its process is gone.
fn inode(path: &Path) -> Result<Option<u64>, CannotTell> {
    use std::os::unix::fs::MetadataExt as _;
    match std::fs::metadata(path) {
        Ok(m) => Ok(Some(m.ino())),
        Err(e) if gone_while_looking(&e) => Ok(None),
        Err(e) => Err(unreadable(path)(e)),
    }
}

/// The network namespaces bind-mounted in `pid`'s mount namespace: their inodes, and a
/// path that opens each from here (through the process's root). A process that exits
/// meanwhile has none.
fn bind_mounted(pid: &Path) -> Vec<(u64, PathBuf)> {
    let text = std::fs::read_to_string(pid.join("mountinfo")).unwrap_or_default();
    text.lines()
        .filter_map(nsfs_net_mount)
        .map(|(ino, mount_point)| (ino, pid.join("root").join(mount_point.trim_start_matches('/'))))
        .collect()
}

/// A mountinfo line of a bind-mounted network namespace: its inode and mount point.
fn nsfs_net_mount(line: &str) -> Option<(u64, String)> {
    // id parent major:minor root mount-point options [optional fields] - fstype source super
    let (left, right) = line.split_once(" - ")?;
    if right.split(' ').next()? != "nsfs" {
        return None;
    }
    let fields: Vec<&str> = left.split(' ').collect();
    let root = fields.get(3)?;
    let ino = root.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()?;
    Some((ino, unescape(fields.get(4)?)))
}

/// Undoes mountinfo's octal escapes (`\040` for a space, and so on).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_mounted_network_namespaces_are_read_from_mountinfo() {
        let lines = [
            "612 29 0:4 net:[4026532561] /run/netns/cni-1a2b rw shared:5 - nsfs nsfs rw",
            "613 29 0:4 net:[4026532600] /var/run/netns/with\\040space rw - nsfs nsfs rw",
            "614 29 0:4 mnt:[4026532700] /run/weir/mnt rw - nsfs nsfs rw",
            "25 1 0:22 / /sys/fs/bpf rw,nosuid - bpf bpf rw",
            "garbage",
        ];
        let found: Vec<_> = lines.iter().filter_map(|l| nsfs_net_mount(l)).collect();
        assert_eq!(
            found,
            vec![
                (4026532561, "/run/netns/cni-1a2b".to_string()),
                (4026532600, "/var/run/netns/with space".to_string())
            ]
        );
    }

    #[test]
    fn a_proc_without_kthreadd_cannot_tell() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("2")).unwrap();
        std::fs::write(dir.path().join("2/comm"), "sh\n").unwrap();
        let e = LiveNamespaces::read(dir.path()).unwrap_err();
        assert!(matches!(e, CannotTell::NotHostPids { .. }), "{e}");
    }
}
