//! Starting a process inside a pod: its network namespace, its cgroup, its mounts and
//! its user are set in the child between fork and exec, before it can make a single
//! connection. Mounts are made only in the child's own mount namespace (unshared and
//! made private first), never in the host's.

use std::{
    ffi::CString,
    fs::File,
    io,
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus},
    time::{Duration, Instant},
};

use super::{Cgroup, NetNs, SandboxError};

/// Where and as whom a child process runs.
#[derive(Debug, Default, Clone, Copy)]
pub struct Placement<'a> {
    pub netns: Option<&'a NetNs>,
    pub cgroup: Option<&'a Cgroup>,
    /// (uid, gid); supplementary groups are set to `groups` (none by default).
    pub user: Option<(u32, u32)>,
    /// Supplementary groups with `user` (a pod's `fsGroup`).
    pub groups: &'a [u32],
    /// Bind-mount this file over /etc/resolv.conf in a private mount namespace, as a
    /// pod's own resolv.conf (what `ip netns exec` does with /etc/netns/<name>/).
    pub resolv_conf: Option<&'a std::path::Path>,
    /// Mounts made in the child's private mount namespace, in order (after
    /// `resolv_conf`): a container's view of the file system.
    pub mounts: &'a [Mount],
    /// The child's root directory (chroot, after the mounts): a container image's
    /// unpacked root file system. Mount targets are host paths, so a container's
    /// mounts name their places under this root.
    pub root: Option<&'a Path>,
    /// Deliver SIGKILL to the child when the spawning thread exits (PR_SET_PDEATHSIG),
    /// so a killed test or demo leaves no process behind. Spawn from a long-lived
    /// thread when this is set.
    pub die_with_parent: bool,
}

/// One mount in a child's private mount namespace. Targets must exist when the mount
/// is made (an earlier [`Mount::Overlay`] can provide them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mount {
    /// `source` (a file or a directory) bound over `target`; read-only when asked.
    Bind { source: PathBuf, target: PathBuf, read_only: bool },
    /// A new tmpfs on the directory `target`, with tmpfs options (`mode=1777`).
    Tmpfs { target: PathBuf, options: String },
    /// The existing directory `target` seen through an overlay: its content stays
    /// visible and untouched, with `upper`'s entries added (mount points for paths the
    /// host lacks). `work` is an empty directory on `upper`'s file system.
    Overlay { target: PathBuf, upper: PathBuf, work: PathBuf, read_only: bool },
    /// The mount at `target` (`/`: a container's `readOnlyRootFilesystem`) made
    /// read-only, in the child's namespace only.
    ReadOnly { target: PathBuf },
}

impl Mount {
    /// Where the mount is made.
    pub fn target(&self) -> &Path {
        match self {
            Self::Bind { target, .. }
            | Self::Tmpfs { target, .. }
            | Self::Overlay { target, .. }
            | Self::ReadOnly { target } => target,
        }
    }
}

/// One mount(2) call, every string made before fork.
struct MountCall {
    source: Option<CString>,
    target: CString,
    fstype: Option<CString>,
    flags: libc::c_ulong,
    data: Option<CString>,
}

impl MountCall {
    /// mount(2); async-signal-safe (a raw syscall on prepared strings).
    fn call(&self) -> bool {
        let ptr = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        // SAFETY: every pointer is a NUL-terminated string owned by `self`, or null.
        unsafe {
            libc::mount(
                ptr(&self.source),
                self.target.as_ptr(),
                ptr(&self.fstype),
                self.flags,
                ptr(&self.data).cast(),
            ) == 0
        }
    }
}

fn c_path(path: &Path) -> Result<CString, SandboxError> {
    CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
        SandboxError::sys(format!("mount path {} contains a NUL byte", path.display()))(io::Error::from(
            io::ErrorKind::InvalidInput,
        ))
    })
}

fn c_string(text: String) -> Result<CString, SandboxError> {
    CString::new(text).map_err(|e| {
        SandboxError::sys(format!("mount option {:?} contains a NUL byte", e.into_vec()))(io::Error::from(
            io::ErrorKind::InvalidInput,
        ))
    })
}

/// The mount(2) calls for `mounts`, in order.
fn mount_calls(mounts: &[Mount]) -> Result<Vec<MountCall>, SandboxError> {
    let mut calls = Vec::new();
    let remount_read_only = |target: &Path| -> Result<MountCall, SandboxError> {
        Ok(MountCall {
            source: None,
            target: c_path(target)?,
            fstype: None,
            flags: libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY,
            data: None,
        })
    };
    for mount in mounts {
        match mount {
            Mount::Bind { source, target, read_only } => {
                calls.push(MountCall {
                    source: Some(c_path(source)?),
                    target: c_path(target)?,
                    fstype: None,
                    flags: libc::MS_BIND,
                    data: None,
                });
                if *read_only {
                    calls.push(remount_read_only(target)?);
                }
            }
            Mount::Tmpfs { target, options } => calls.push(MountCall {
                source: Some(c"tmpfs".into()),
                target: c_path(target)?,
                fstype: Some(c"tmpfs".into()),
                flags: libc::MS_NOSUID | libc::MS_NODEV,
                data: Some(c_string(options.clone())?),
            }),
            Mount::Overlay { target, upper, work, read_only } => {
                // overlayfs splits its options on ',' and lower layers on ':'.
                for path in [target, upper, work] {
                    let text = path.to_string_lossy();
                    if text.contains([',', ':', '\\']) {
                        return Err(SandboxError::sys(format!(
                            "overlay path {text:?}: ',', ':' and '\\' are not allowed"
                        ))(io::Error::from(io::ErrorKind::InvalidInput)));
                    }
                }
                let options = format!(
                    "lowerdir={},upperdir={},workdir={}",
                    target.display(),
                    upper.display(),
                    work.display()
                );
                calls.push(MountCall {
                    source: Some(c"overlay".into()),
                    target: c_path(target)?,
                    fstype: Some(c"overlay".into()),
                    flags: if *read_only { libc::MS_RDONLY } else { 0 },
                    data: Some(c_string(options)?),
                });
            }
            Mount::ReadOnly { target } => calls.push(remount_read_only(target)?),
        }
    }
    Ok(calls)
}

/// A child placed in a pod; killed (SIGKILL) and reaped on drop unless waited for.
#[derive(Debug)]
pub struct PodChild {
    pub name: String,
    child: Option<Child>,
}

impl PodChild {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    pub fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("child present until drop")
    }

    /// Waits for exit, up to `timeout`; `None` if it is still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> io::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child_mut().try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends `signal` (e.g. SIGTERM) without waiting.
    pub fn signal(&self, signal: i32) -> io::Result<()> {
        // SAFETY: plain kill(2) on our own child's pid.
        if unsafe { libc::kill(self.pid() as i32, signal) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Takes the std child out; the caller becomes responsible for it.
    pub fn into_inner(mut self) -> Child {
        self.child.take().expect("child present until drop")
    }
}

impl Drop for PodChild {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

/// Spawns `cmd` placed as `placement` says.
pub fn spawn(cmd: &mut Command, placement: Placement<'_>) -> Result<PodChild, SandboxError> {
    let name = cmd.get_program().to_string_lossy().into_owned();
    // Everything the child needs is opened here, before fork: between fork and exec
    // only async-signal-safe calls are allowed.
    let cgroup_procs = match placement.cgroup {
        Some(cg) => Some(
            File::options()
                .write(true)
                .open(cg.procs_file())
                .map_err(SandboxError::io("open", cg.procs_file()))?,
        ),
        None => None,
    };
    let netns = match placement.netns {
        Some(ns) => Some(ns.fd().try_clone_to_owned().map_err(SandboxError::sys("dup netns fd"))?),
        None => None,
    };
    let user = placement.user;
    let die_with_parent = placement.die_with_parent;
    // SAFETY: getpid(2) cannot fail.
    let parent = unsafe { libc::getpid() };
    let resolv = placement.resolv_conf.map(|path| Mount::Bind {
        source: path.to_path_buf(),
        target: PathBuf::from("/etc/resolv.conf"),
        read_only: false,
    });
    let mounts =
        mount_calls(&resolv.into_iter().chain(placement.mounts.iter().cloned()).collect::<Vec<_>>())?;
    let groups: Vec<libc::gid_t> = placement.groups.to_vec();
    let root = placement.root.map(c_path).transpose()?;
    if placement.root.is_some() && placement.resolv_conf.is_some() {
        // resolv_conf binds over the host's /etc/resolv.conf, which a chrooted child
        // does not see: a caller must mount it under the root instead.
        return Err(SandboxError::sys(format!(
            "spawn {name}: resolv_conf with a root; mount it at <root>/etc/resolv.conf"
        ))(io::Error::from(io::ErrorKind::InvalidInput)));
    }
    // SAFETY: the closure makes only raw syscalls (write, setns, unshare, mount, chroot,
    // chdir, prctl, setgroups, setgid, setuid) on fds and strings prepared above; no allocation, no locks.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(procs) = &cgroup_procs
                && libc::write(procs.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1
            {
                return Err(io::Error::last_os_error());
            }
            if let Some(ns) = &netns
                && libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // A private mount namespace first: nothing below propagates to the host's.
            if !mounts.is_empty()
                && (libc::unshare(libc::CLONE_NEWNS) != 0
                    || libc::mount(
                        c"none".as_ptr(),
                        c"/".as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_PRIVATE,
                        std::ptr::null(),
                    ) != 0
                    || !mounts.iter().all(MountCall::call))
            {
                return Err(io::Error::last_os_error());
            }
            if let Some(root) = &root
                && (libc::chroot(root.as_ptr()) != 0 || libc::chdir(c"/".as_ptr()) != 0)
            {
                return Err(io::Error::last_os_error());
            }
            if let Some((uid, gid)) = user
                && (libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0)
            {
                return Err(io::Error::last_os_error());
            }
            // After the credential change, which clears the parent-death signal; and
            // a parent that died before it was set means now.
            if die_with_parent
                && (libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 || libc::getppid() != parent)
            {
                libc::_exit(137);
            }
            Ok(())
        });
    }
    let what = if placement.mounts.is_empty() {
        format!("spawn {name}")
    } else {
        let targets: Vec<String> =
            placement.mounts.iter().map(|m| m.target().display().to_string()).collect();
        format!("spawn {name} with mounts on {}", targets.join(", "))
    };
    let child = cmd.spawn().map_err(SandboxError::sys(what))?;
    Ok(PodChild { name, child: Some(child) })
}
