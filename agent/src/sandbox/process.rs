//! Starting a process inside a pod: its network namespace, its cgroup and its user are
//! set in the child between fork and exec, before it can make a single connection.

use std::{
    fs::File,
    io,
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    process::{Child, Command, ExitStatus},
    time::{Duration, Instant},
};

use super::{Cgroup, NetNs, SandboxError};

/// Where and as whom a child process runs.
#[derive(Debug, Default, Clone, Copy)]
pub struct Placement<'a> {
    pub netns: Option<&'a NetNs>,
    pub cgroup: Option<&'a Cgroup>,
    /// (uid, gid); supplementary groups are cleared.
    pub user: Option<(u32, u32)>,
    /// Bind-mount this file over /etc/resolv.conf in a private mount namespace, as a
    /// pod's own resolv.conf (what `ip netns exec` does with /etc/netns/<name>/).
    pub resolv_conf: Option<&'a std::path::Path>,
    /// Deliver SIGKILL to the child when the spawning thread exits (PR_SET_PDEATHSIG),
    /// so a killed test or demo leaves no process behind. Spawn from a long-lived
    /// thread when this is set.
    pub die_with_parent: bool,
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
    let resolv = match placement.resolv_conf {
        Some(path) => Some(std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
            SandboxError::sys("resolv.conf path")(io::Error::from(io::ErrorKind::InvalidInput))
        })?),
        None => None,
    };
    // SAFETY: the closure makes only raw syscalls (write, setns, unshare, mount, prctl,
    // setgroups, setgid, setuid) on fds and strings prepared above; no allocation, no locks.
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
            if let Some(src) = &resolv
                && (libc::unshare(libc::CLONE_NEWNS) != 0
                    || libc::mount(
                        c"none".as_ptr(),
                        c"/".as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_PRIVATE,
                        std::ptr::null(),
                    ) != 0
                    || libc::mount(
                        src.as_ptr(),
                        c"/etc/resolv.conf".as_ptr(),
                        std::ptr::null(),
                        libc::MS_BIND,
                        std::ptr::null(),
                    ) != 0)
            {
                return Err(io::Error::last_os_error());
            }
            if die_with_parent && libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some((uid, gid)) = user
                && (libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0)
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(SandboxError::sys(format!("spawn {name}")))?;
    Ok(PodChild { name, child: Some(child) })
}
