//! A network namespace named by a path from outside the agent (the plugin event's
//! `Netns`, `CNI_NETNS` in the plugin): accepted only in the forms container runtimes
//! send, resolved under the node's root without following a link out of it, opened
//! non-blocking (a FIFO or a device never holds the opener), and checked to be a
//! network namespace that is neither the node's nor the opener's own. Opening runs on
//! a blocking thread with a deadline ([`open_with_deadline`]): a path that stalls
//! costs that thread, never the agent's runtime.

use std::{
    os::{
        fd::{AsFd as _, AsRawFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    path::{Path, PathBuf},
    time::Duration,
};

use nix::{
    fcntl::{OFlag, OpenHow, ResolveFlag},
    sys::stat::Mode,
};

/// Folders of named namespaces: iproute2's and containerd's and CRI-O's
/// (`/var/run/netns`, `/run/netns`), and Docker's (cri-dockerd, minikube's profile).
pub const NETNS_DIRS: &[&str] =
    &["/var/run/netns", "/run/netns", "/var/run/docker/netns", "/run/docker/netns"];

/// How long opening and checking a namespace may take.
pub const OPEN_DEADLINE: Duration = Duration::from_secs(2);

/// A namespace path in one of the forms a runtime sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetnsPath {
    /// `<dir>/<name>` with `dir` one of [`NETNS_DIRS`].
    Named { dir: &'static str, name: String },
    /// `/proc/<pid>/ns/net` (cri-dockerd, some runtimes' sandboxes).
    Proc { pid: u32 },
}

/// Why a namespace path was refused.
#[derive(Debug, thiserror::Error)]
pub enum NetnsPathError {
    #[error(
        "network namespace path {path:?}: {problem} (expected {}/<name>, or /proc/<pid>/ns/net)",
        NETNS_DIRS.join("/<name>, ")
    )]
    Form { path: String, problem: &'static str },
    #[error("open the network namespace {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("opening and checking the network namespace {path} took longer than {OPEN_DEADLINE:?}")]
    Timeout { path: String },
    #[error("{path} is not a network namespace: {what}")]
    NotNetns { path: PathBuf, what: String },
    #[error("{path} is the {whose} network namespace, never a pod's")]
    NotAPods { path: PathBuf, whose: &'static str },
    #[error(
        "cannot tell whether {path} is the node's network namespace: {node} cannot be read (the agent needs the host's /proc and hostPID)"
    )]
    NodeUnknown {
        path: PathBuf,
        node: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl NetnsPath {
    /// Reads `path` as one of the accepted forms. Pure.
    pub fn parse(path: &str) -> Result<Self, NetnsPathError> {
        let form = |problem| NetnsPathError::Form { path: path.to_string(), problem };
        if !path.starts_with('/') {
            return Err(form("not absolute"));
        }
        if let Some(rest) = path.strip_prefix("/proc/") {
            let Some(pid) = rest.strip_suffix("/ns/net") else {
                return Err(form("a /proc path other than ns/net"));
            };
            if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) || pid.len() > 10 {
                return Err(form("a /proc path whose process is not a number"));
            }
            let pid: u32 = pid.parse().map_err(|_| form("a process id out of range"))?;
            if pid == 0 {
                return Err(form("process 0"));
            }
            return Ok(Self::Proc { pid });
        }
        for dir in NETNS_DIRS {
            if let Some(name) = path.strip_prefix(dir).and_then(|r| r.strip_prefix('/')) {
                let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
                if name.is_empty()
                    || name.len() > 255
                    || name == "."
                    || name == ".."
                    || !name.chars().all(plain)
                {
                    return Err(form("a name with '/', '..' or a character no runtime uses"));
                }
                return Ok(Self::Named { dir, name: name.to_string() });
            }
        }
        Err(form("not under a folder of named namespaces"))
    }

    /// The path as the node names it.
    pub fn node_path(&self) -> PathBuf {
        match self {
            Self::Named { dir, name } => Path::new(dir).join(name),
            Self::Proc { pid } => PathBuf::from(format!("/proc/{pid}/ns/net")),
        }
    }

    /// Opens the namespace (blocking; see [`open_with_deadline`]): a named one under
    /// `host_root` (the node's `/` as mounted; empty: this process's), resolved with
    /// every link taken as relative to that root and no magic link followed; a
    /// process's under `host_proc`. Then [`check_netns`].
    pub fn open(&self, host_root: &Path, host_proc: &Path) -> Result<OwnedFd, NetnsPathError> {
        let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
        let (base, relative, resolve) = match self {
            Self::Named { .. } => {
                let root = if host_root.as_os_str().is_empty() { Path::new("/") } else { host_root };
                let relative = self.node_path().strip_prefix("/").map(Path::to_path_buf).unwrap_or_default();
                (
                    root.to_path_buf(),
                    relative,
                    ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS,
                )
            }
            // ns/net is itself a magic link: only the process id was read from input.
            Self::Proc { pid } => {
                (host_proc.to_path_buf(), PathBuf::from(format!("{pid}/ns/net")), ResolveFlag::empty())
            }
        };
        let shown = base.join(&relative);
        let open_err = |source: std::io::Error| NetnsPathError::Open { path: shown.clone(), source };
        let dir =
            nix::fcntl::open(&base, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(|e| open_err(e.into()))?;
        let how = OpenHow::new().flags(flags).resolve(resolve);
        let fd = nix::fcntl::openat2(dir.as_fd(), relative.as_path(), how).map_err(|e| open_err(e.into()))?;
        check_netns(&fd, &shown, host_proc)?;
        Ok(fd)
    }
}

/// Refuses `fd` (opened from `path`) unless it is a network namespace that is neither
/// the node's (the kernel threads', `<host_proc>/2/ns/net`) nor this process's.
pub fn check_netns(fd: &OwnedFd, path: &Path, host_proc: &Path) -> Result<(), NetnsPathError> {
    let not = |what: String| NetnsPathError::NotNetns { path: path.to_path_buf(), what };
    let fs = nix::sys::statfs::fstatfs(fd.as_fd()).map_err(|e| not(format!("fstatfs: {e}")))?;
    if fs.filesystem_type() != nix::sys::statfs::NSFS_MAGIC {
        return Err(not(format!("a file of file system type {:#x}, not nsfs", fs.filesystem_type().0)));
    }
    // SAFETY: NS_GET_NSTYPE takes no argument and only reads the descriptor.
    let kind = unsafe { libc::ioctl(fd.as_raw_fd(), libc::NS_GET_NSTYPE) };
    if kind != libc::CLONE_NEWNET {
        return Err(not(format!("a namespace of another type ({kind:#x})")));
    }
    let stat = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| not(format!("fstat: {e}")))?;
    let id = (stat.st_dev, stat.st_ino);
    let same = |p: &Path| std::fs::metadata(p).is_ok_and(|m| (m.dev(), m.ino()) == id);
    // kthreadd's: the node's namespace. Unreadable is a refusal, never "not the node's".
    let node = host_proc.join("2/ns/net");
    let node_ns = std::fs::metadata(&node).map_err(|source| NetnsPathError::NodeUnknown {
        path: path.to_path_buf(),
        node: node.clone(),
        source,
    })?;
    if (node_ns.dev(), node_ns.ino()) == id {
        return Err(NetnsPathError::NotAPods { path: path.to_path_buf(), whose: "node's" });
    }
    if same(Path::new("/proc/self/ns/net")) {
        return Err(NetnsPathError::NotAPods { path: path.to_path_buf(), whose: "node agent's own" });
    }
    Ok(())
}

/// [`NetnsPath::parse`] and [`NetnsPath::open`] on a blocking thread, given up after
/// [`OPEN_DEADLINE`] (the thread may stay stuck; the caller does not).
pub async fn open_with_deadline(
    path: &str,
    host_root: &Path,
    host_proc: &Path,
) -> Result<(NetnsPath, OwnedFd), NetnsPathError> {
    let parsed = NetnsPath::parse(path)?;
    let (root, proc) = (host_root.to_path_buf(), host_proc.to_path_buf());
    let form = parsed.clone();
    let task = tokio::task::spawn_blocking(move || form.open(&root, &proc));
    match tokio::time::timeout(OPEN_DEADLINE, task).await {
        Ok(Ok(opened)) => opened.map(|fd| (parsed, fd)),
        Ok(Err(e)) => {
            Err(NetnsPathError::Open { path: path.into(), source: std::io::Error::other(e.to_string()) })
        }
        Err(_) => Err(NetnsPathError::Timeout { path: path.to_string() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_forms_runtimes_send_are_accepted() {
        for (path, want) in [
            ("/var/run/netns/cni-1f2e", NetnsPath::Named { dir: "/var/run/netns", name: "cni-1f2e".into() }),
            ("/run/netns/cni-1f2e", NetnsPath::Named { dir: "/run/netns", name: "cni-1f2e".into() }),
            (
                "/var/run/docker/netns/a1b2c3",
                NetnsPath::Named { dir: "/var/run/docker/netns", name: "a1b2c3".into() },
            ),
            ("/proc/4242/ns/net", NetnsPath::Proc { pid: 4242 }),
        ] {
            assert_eq!(NetnsPath::parse(path).unwrap(), want, "{path}");
            assert_eq!(NetnsPath::parse(path).unwrap().node_path(), Path::new(path));
        }
    }

    #[test]
    fn anything_that_could_walk_elsewhere_is_refused_naming_the_path() {
        for bad in [
            "/../../proc/1/ns/net",
            "/var/run/netns/../../../proc/1/ns/net",
            "/var/run/netns/a/b",
            "/var/run/netns/..",
            "/var/run/netns/",
            "var/run/netns/x",
            "/proc/self/ns/net",
            "/proc/1/ns/mnt",
            "/proc/1/root/run/netns/x",
            "/proc/0/ns/net",
            "/tmp/fifo",
            "/dev/sda",
            "/var/run/netns/x\0y",
            "/var/run/netnsx/y",
        ] {
            let e = NetnsPath::parse(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }
}
