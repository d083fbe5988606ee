//! Named network namespaces, made the way `ip netns add` makes them: a file under
//! /run/netns bind-mounted over a thread's new namespace. Code runs inside one on a
//! thread of its own ([`NetNs::run`]), never on a shared runtime worker.

use std::{
    fs::{self, File},
    future::Future,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd},
        unix::fs::MetadataExt as _,
    },
    path::{Path, PathBuf},
};

use super::SandboxError;

/// Where named namespaces live, as with iproute2.
pub const NETNS_RUN_DIR: &str = "/run/netns";

/// A network namespace, held open by fd. Owned ones are unmounted and deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    name: String,
    path: PathBuf,
    file: File,
    owned: bool,
}

/// Makes /run/netns a shared mount, as `ip netns add` does: a namespace bound under it
/// later then shows in mount namespaces made before (a container's `HostToContainer`
/// mount of it, a private mount namespace a test runs a command in). Without it, such
/// a path is an empty file there and entering it fails with EINVAL.
fn shared_run_dir() -> Result<(), SandboxError> {
    use nix::mount::{MsFlags, mount};
    let shared = || {
        mount(None::<&str>, NETNS_RUN_DIR, Some("none"), MsFlags::MS_SHARED | MsFlags::MS_REC, None::<&str>)
    };
    match shared() {
        Ok(()) => Ok(()),
        // Not a mount point yet: bound onto itself first.
        Err(nix::errno::Errno::EINVAL) => {
            mount(
                Some(NETNS_RUN_DIR),
                NETNS_RUN_DIR,
                Some("none"),
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .map_err(|e| SandboxError::sys(format!("bind-mount {NETNS_RUN_DIR} on itself"))(e.into()))?;
            shared().map_err(|e| SandboxError::sys(format!("make {NETNS_RUN_DIR} shared"))(e.into()))
        }
        Err(e) => Err(SandboxError::sys(format!("make {NETNS_RUN_DIR} shared"))(e.into())),
    }
}

impl NetNs {
    /// Creates `/run/netns/<name>` holding a fresh, empty network namespace (only `lo`,
    /// down).
    pub fn create(name: &str) -> Result<Self, SandboxError> {
        fs::create_dir_all(NETNS_RUN_DIR).map_err(SandboxError::io("create", NETNS_RUN_DIR))?;
        shared_run_dir()?;
        let path = Path::new(NETNS_RUN_DIR).join(name);
        File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(SandboxError::io("create netns file", &path))?;
        // unshare() changes only the calling thread's namespace: do it on a scratch
        // thread so the caller's thread stays where it was.
        let target = path.clone();
        let made = std::thread::spawn(move || -> Result<(), SandboxError> {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| SandboxError::sys("unshare(CLONE_NEWNET)")(e.into()))?;
            let tid = nix::unistd::gettid();
            let own = format!("/proc/self/task/{tid}/ns/net");
            nix::mount::mount(
                Some(own.as_str()),
                &target,
                None::<&str>,
                nix::mount::MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(|e| SandboxError::sys(format!("bind-mount {own} on {}", target.display()))(e.into()))
        })
        .join()
        .map_err(|_| SandboxError::ThreadPanicked { netns: name.to_string() })?;
        if let Err(e) = made {
            let _ = fs::remove_file(&path);
            return Err(e);
        }
        let file = File::open(&path).map_err(SandboxError::io("open netns", &path))?;
        Ok(Self { name: name.to_string(), path, file, owned: true })
    }

    /// Opens an existing namespace by path (e.g. a CNI runtime's `CNI_NETNS`); it is not
    /// deleted on drop.
    pub fn open(path: &Path) -> Result<Self, SandboxError> {
        let file = File::open(path).map_err(SandboxError::io("open netns", path))?;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(Self { name, path: path.to_path_buf(), file, owned: false })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The namespace's inode: equal to `stat /proc/<pid>/ns/net` of processes inside it.
    pub fn inode(&self) -> u64 {
        self.file.metadata().map(|m| m.ino()).unwrap_or(0)
    }

    /// Moves the calling thread into this namespace. Prefer [`NetNs::run`]; call this
    /// only on a thread that is yours alone.
    pub fn enter_current_thread(&self) -> Result<(), SandboxError> {
        nix::sched::setns(self.file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| SandboxError::sys(format!("setns into {}", self.name))(e.into()))
    }

    /// Runs `f`'s future to completion inside this namespace, on a new thread with a
    /// current-thread Tokio runtime, and returns its output.
    pub fn run<F, Fut, R>(&self, f: F) -> Result<R, SandboxError>
    where
        F: FnOnce() -> Fut + Send,
        Fut: Future<Output = R>,
        R: Send,
    {
        std::thread::scope(|scope| {
            scope
                .spawn(|| -> Result<R, SandboxError> {
                    self.enter_current_thread()?;
                    let runtime = crate::support::runtime::current_thread("a namespace's thread")
                        .map_err(|e| SandboxError::sys("build a tokio runtime")(std::io::Error::other(e)))?;
                    Ok(runtime.block_on(f()))
                })
                .join()
                .map_err(|_| SandboxError::ThreadPanicked { netns: self.name.clone() })?
        })
    }

    /// Runs `f`'s future inside this namespace on a detached thread; the handle yields
    /// its output. For servers that live while the caller goes on.
    pub fn spawn_thread<F, Fut, R>(&self, f: F) -> Result<std::thread::JoinHandle<R>, SandboxError>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = R>,
        R: Send + 'static,
    {
        let file = self.file.try_clone().map_err(SandboxError::io("dup netns fd", &self.path))?;
        let name = self.name.clone();
        let handle = std::thread::Builder::new()
            .name(format!("netns-{name}"))
            .spawn(move || {
                nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .unwrap_or_else(|e| panic!("setns into {name}: {e}"));
                let runtime = crate::support::runtime::current_thread("a namespace's thread")
                    .unwrap_or_else(|e| panic!("tokio runtime in {name}: {}", crate::error_chain(&e)));
                runtime.block_on(f())
            })
            .map_err(SandboxError::sys("spawn a namespace thread"))?;
        Ok(handle)
    }

    /// Raw fd, for APIs that take one (netlink's IFLA_NET_NS_FD).
    pub fn raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    /// Unmounts and deletes the namespace file now, reporting failure.
    pub fn delete(mut self) -> Result<(), SandboxError> {
        self.owned = false;
        remove(&self.path)
    }
}

/// Unmounts and removes a namespace file under /run/netns.
pub fn remove(path: &Path) -> Result<(), SandboxError> {
    match nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => return Err(SandboxError::sys(format!("umount {}", path.display()))(e.into())),
    }
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SandboxError::io("remove netns file", path)(e)),
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if self.owned
            && let Err(e) = remove(&self.path)
        {
            tracing::warn!(netns = %self.name, error = %e, "could not remove network namespace");
        }
    }
}
