//! The xtables lock, per command: which lock an iptables command may take and how it
//! is kept off the node's. Only writes by iptables-legacy 1.6.2 and later lock; they
//! are given `--wait`. A command for a pod (the CNI plugin's, [`Lock::PodScoped`])
//! runs in a private mount namespace of its own, as Istio's sandbox runs it:
//! `/etc/nsswitch.conf` is hidden (a `-m owner` lookup cannot reach a network service
//! from a pod still being made), and the pod's lock file replaces the node's, through
//! `XTABLES_LOCKFILE` for iptables 1.8.6 and later, and for older ones (which ignore
//! that variable) bind-mounted over `/run/xtables.lock` there. The node's lock is
//! taken for a pod only if that namespace cannot be made at all, and a warning says so.

use std::{
    ffi::CString,
    io,
    os::unix::{ffi::OsStrExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::Command,
};

use super::binaries::Binaries;

/// Seconds to wait for the xtables lock, as Istio.
pub const LOCK_WAIT_SECS: u32 = 30;

/// The first iptables that reads `XTABLES_LOCKFILE`.
pub const LOCKFILE_ENV_VERSION: (u32, u32, u32) = (1, 8, 6);

/// The lock iptables-legacy takes (its compiled-in `XT_LOCK_NAME`).
pub const NODE_LOCK: &str = "/run/xtables.lock";

const NSSWITCH: &str = "/etc/nsswitch.conf";

/// How the xtables lock is taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lock {
    /// The host-wide /run/xtables.lock (init-container use: the pod's own).
    Global,
    /// A lock private to a pod's network namespace (CNI use): this file (the pod's
    /// namespace file, unique to it) is the lock, never the node's; see the module doc.
    PodScoped(PathBuf),
}

/// What one command is run with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    /// `--wait=30`: the command takes the lock and waits for it.
    pub wait: bool,
    /// `XTABLES_LOCKFILE` for the command.
    pub lock_env: Option<PathBuf>,
    /// A private mount namespace for the command, with nsswitch.conf hidden.
    pub private_mounts: bool,
    /// Bind-mounted over [`NODE_LOCK`] in that namespace.
    pub lock_mount: Option<PathBuf>,
}

impl Confinement {
    /// How `bin` runs under `lock`; `write` for commands that change rules (the only
    /// ones that lock).
    pub fn of(lock: &Lock, bin: &Binaries, write: bool) -> Self {
        let wait = write && bin.needs_lock();
        match lock {
            Lock::Global => Self { wait, lock_env: None, private_mounts: false, lock_mount: None },
            Lock::PodScoped(file) => {
                let env_read = bin.version >= LOCKFILE_ENV_VERSION;
                Self {
                    wait,
                    lock_env: (wait && env_read).then(|| file.clone()),
                    private_mounts: true,
                    lock_mount: (wait && !env_read).then(|| file.clone()),
                }
            }
        }
    }

    /// `program args` as this confinement runs it.
    pub fn command(&self, program: &str, args: &[String]) -> io::Result<Command> {
        let mut cmd = Command::new(program);
        cmd.args(args);
        if self.wait {
            cmd.arg(format!("--wait={LOCK_WAIT_SECS}"));
        }
        if let Some(file) = &self.lock_env {
            cmd.env("XTABLES_LOCKFILE", file);
        }
        if self.private_mounts {
            let sandbox = Sandbox::new(self.lock_mount.as_deref())?;
            // SAFETY: the hook runs between fork and exec and makes only raw system
            // calls (unshare, mount, open, close, access) on strings made before fork.
            unsafe { cmd.pre_exec(move || sandbox.enter()) };
        }
        Ok(cmd)
    }
}

/// The private mount namespace a pod's command runs in, every path made before fork.
struct Sandbox {
    root: CString,
    dev_null: CString,
    nsswitch: CString,
    node_lock: CString,
    /// The pod's lock file, to stand in for the node's.
    lock: Option<CString>,
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        io::Error::new(io::ErrorKind::InvalidInput, format!("{} holds a NUL byte", path.display()))
    })
}

impl Sandbox {
    fn new(lock: Option<&Path>) -> io::Result<Self> {
        Ok(Self {
            root: c"/".into(),
            dev_null: c"/dev/null".into(),
            nsswitch: c_path(Path::new(NSSWITCH))?,
            node_lock: c_path(Path::new(NODE_LOCK))?,
            lock: lock.map(c_path).transpose()?,
        })
    }

    /// In the child: a mount namespace of its own, its mounts propagating nowhere
    /// (private, or slave where a security policy refuses private), then the mounts.
    fn enter(&self) -> io::Result<()> {
        let check = |rc: libc::c_int| if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) };
        let bind = |source: &CString, target: &CString| {
            // SAFETY: mount(2) on NUL-terminated strings owned by `self`.
            check(unsafe {
                libc::mount(
                    source.as_ptr(),
                    target.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                )
            })
        };
        // SAFETY: unshare(2) and mount(2) with valid arguments; this child is
        // single-threaded, and the namespace dies with it.
        unsafe {
            check(libc::unshare(libc::CLONE_NEWNS))?;
            let propagation = |flag| {
                libc::mount(
                    std::ptr::null(),
                    self.root.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | flag,
                    std::ptr::null(),
                )
            };
            if propagation(libc::MS_PRIVATE) != 0 {
                check(propagation(libc::MS_SLAVE))?;
            }
        }
        if let Some(lock) = &self.lock {
            // The node's lock file is what iptables itself would create; a bind
            // mount needs its target to exist.
            // SAFETY: open(2)/close(2) of a path owned by `self`.
            let fd = unsafe {
                libc::open(self.node_lock.as_ptr(), libc::O_RDONLY | libc::O_CREAT | libc::O_CLOEXEC, 0o600)
            };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` was opened just above and is not used again.
            unsafe { libc::close(fd) };
            bind(lock, &self.node_lock)?;
        }
        // SAFETY: access(2) of a path owned by `self`.
        if unsafe { libc::access(self.nsswitch.as_ptr(), libc::F_OK) } == 0 {
            bind(&self.dev_null, &self.nsswitch)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy(version: (u32, u32, u32)) -> Binaries {
        Binaries {
            iptables: "iptables-legacy".into(),
            save: "iptables-legacy-save".into(),
            restore: "iptables-legacy-restore".into(),
            version,
            legacy: true,
            existing_rules: false,
        }
    }

    #[test]
    fn a_pods_commands_never_name_the_nodes_lock() {
        let pod = Lock::PodScoped("/var/run/netns/cni-1".into());
        let file = || Some(PathBuf::from("/var/run/netns/cni-1"));
        // 1.8.6 and later read XTABLES_LOCKFILE.
        let new = Confinement::of(&pod, &legacy((1, 8, 9)), true);
        assert_eq!(new, Confinement { wait: true, lock_env: file(), private_mounts: true, lock_mount: None });
        // Older ones ignore it: the pod's file is mounted over the node's lock.
        for old in [(1, 8, 5), (1, 6, 2)] {
            let c = Confinement::of(&pod, &legacy(old), true);
            assert_eq!(
                c,
                Confinement { wait: true, lock_env: None, private_mounts: true, lock_mount: file() }
            );
        }
        // Before 1.6.2 there is no lock; reads never lock; nft never locks.
        let none = Confinement { wait: false, lock_env: None, private_mounts: true, lock_mount: None };
        assert_eq!(Confinement::of(&pod, &legacy((1, 6, 1)), true), none);
        assert_eq!(Confinement::of(&pod, &legacy((1, 8, 5)), false), none);
        let nft = Binaries { legacy: false, ..legacy((1, 8, 9)) };
        assert_eq!(Confinement::of(&pod, &nft, true), none);
    }

    #[test]
    fn an_init_containers_commands_take_their_pods_lock_with_wait() {
        let c = Confinement::of(&Lock::Global, &legacy((1, 8, 5)), true);
        assert_eq!(c, Confinement { wait: true, lock_env: None, private_mounts: false, lock_mount: None });
        let cmd = c.command("iptables-legacy", &["-t".into(), "nat".into()]).unwrap();
        let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(args, ["-t", "nat", "--wait=30"]);
        assert_eq!(cmd.get_envs().count(), 0);
    }

    #[test]
    fn the_lockfile_variable_is_set_only_where_it_is_read() {
        let pod = Lock::PodScoped("/proc/1/ns/net".into());
        let cmd =
            Confinement::of(&pod, &legacy((1, 8, 9)), true).command("iptables-legacy-restore", &[]).unwrap();
        let envs: Vec<_> = cmd.get_envs().collect();
        assert_eq!(
            envs,
            [(std::ffi::OsStr::new("XTABLES_LOCKFILE"), Some(std::ffi::OsStr::new("/proc/1/ns/net")))]
        );
        let cmd =
            Confinement::of(&pod, &legacy((1, 8, 5)), true).command("iptables-legacy-restore", &[]).unwrap();
        assert_eq!(cmd.get_envs().count(), 0);
        let bad = Lock::PodScoped(PathBuf::from("/run/netns/a\0b"));
        assert!(
            Confinement::of(&bad, &legacy((1, 8, 5)), true).command("x", &[]).is_err(),
            "a NUL is an error"
        );
    }
}
