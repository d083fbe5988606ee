//! Finding and removing sandbox objects whose creator died without unwinding: network
//! namespaces under /run/netns, cgroups under the cgroup2 mount, and the processes
//! still running inside those namespaces.

use std::{
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use super::{NAME_PREFIX, SandboxError, cgroup, netns, owner_pid};

/// Something a sandbox left behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leftover {
    Netns {
        path: PathBuf,
        owner: u32,
    },
    Cgroup {
        path: PathBuf,
        owner: u32,
    },
    /// Pinned eBPF capture (/sys/fs/bpf/weir/<name>).
    Capture {
        name: String,
        owner: u32,
    },
}

impl std::fmt::Display for Leftover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Leftover::Netns { path, owner } => write!(f, "netns {} (pid {owner})", path.display()),
            Leftover::Cgroup { path, owner } => write!(f, "cgroup {} (pid {owner})", path.display()),
            Leftover::Capture { name, owner } => write!(f, "pinned eBPF capture {name} (pid {owner})"),
        }
    }
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Every sandbox object on this machine; with `only_orphans`, those whose creating
/// process is gone.
pub fn leftovers(only_orphans: bool) -> Vec<Leftover> {
    let mut out = Vec::new();
    let keep = |pid: u32| !only_orphans || !alive(pid);
    if let Ok(dir) = fs::read_dir(netns::NETNS_RUN_DIR) {
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(owner) = owner_pid(&name).filter(|p| keep(*p)) {
                out.push(Leftover::Netns { path: entry.path(), owner });
            }
        }
    }
    if let Ok(root) = cgroup::cgroup2_mount()
        && let Ok(dir) = fs::read_dir(root)
    {
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with(NAME_PREFIX) {
                continue;
            }
            if let Some(owner) = owner_pid(&name).filter(|p| keep(*p)) {
                out.push(Leftover::Cgroup { path: entry.path(), owner });
            }
        }
    }
    if let Ok(dir) = fs::read_dir(crate::capture::ebpf::bpffs::PIN_ROOT) {
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(owner) = owner_pid(&name).filter(|p| keep(*p)) {
                out.push(Leftover::Capture { name, owner });
            }
        }
    }
    out
}

/// Removes every orphaned sandbox object; returns what was removed. Pinned captures go
/// first: their classifiers live in the namespaces removed after them.
pub fn reap() -> Result<Vec<Leftover>, SandboxError> {
    let mut found = leftovers(true);
    found.sort_by_key(|l| !matches!(l, Leftover::Capture { .. }));
    for item in &found {
        match item {
            Leftover::Netns { path, .. } => {
                if let Ok(meta) = fs::metadata(path) {
                    kill_processes_in_netns(meta.ino());
                }
                netns::remove(path)?;
            }
            Leftover::Cgroup { path, .. } => cgroup::remove(path)?,
            Leftover::Capture { name, .. } => {
                let removed = match crate::capture::ebpf::record::PinRecord::load(name) {
                    Some(record) => record.remove(),
                    None => crate::capture::ebpf::bpffs::unpin(&crate::capture::ebpf::record::pin_dir(name)),
                };
                removed.map_err(|e| SandboxError::Sys {
                    what: format!("remove pinned capture {name}"),
                    source: std::io::Error::other(crate::error_chain(&e)),
                })?;
            }
        }
        tracing::info!(leftover = %item, "reaped");
    }
    // Program sets the removed captures were the last users of went with them; one a
    // crash left without users goes too.
    if found.iter().any(|l| matches!(l, Leftover::Capture { .. })) {
        let _ = crate::capture::ebpf::set::remove_unused();
    }
    Ok(found)
}

/// Pids whose network namespace has inode `inode`.
pub fn processes_in_netns(inode: u64) -> Vec<u32> {
    let Ok(proc) = fs::read_dir("/proc") else { return Vec::new() };
    proc.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| fs::metadata(format!("/proc/{pid}/ns/net")).map(|m| m.ino() == inode).unwrap_or(false))
        .collect()
}

/// SIGKILLs every process in the namespace with inode `inode` and waits (up to 5 s)
/// for them to disappear.
pub fn kill_processes_in_netns(inode: u64) {
    if inode == 0 {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pids = processes_in_netns(inode);
        if pids.is_empty() || Instant::now() > deadline {
            if !pids.is_empty() {
                tracing::warn!(?pids, "processes survived SIGKILL");
            }
            return;
        }
        for pid in pids {
            // SAFETY: kill(2) with a pid read from /proc; it may be gone already.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            // Reap it if it is our own child, so it does not linger as a zombie.
            // SAFETY: waitpid on a specific pid with WNOHANG.
            unsafe { libc::waitpid(pid as i32, std::ptr::null_mut(), libc::WNOHANG) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
