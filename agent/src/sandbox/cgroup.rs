//! cgroup v2 directories for pods: create one under the cgroup2 mount, place processes
//! in it, and on drop kill whatever is left inside and remove it. eBPF capture attaches
//! to such a directory, so only the processes in it are affected.

use std::{
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use super::SandboxError;
use crate::support::cgroup2::Cgroup2Error;

/// Finds the cgroup2 mount point from /proc/self/mountinfo (on hybrid systems it is
/// /sys/fs/cgroup/unified, on unified ones /sys/fs/cgroup).
pub fn cgroup2_mount() -> Result<PathBuf, SandboxError> {
    crate::support::cgroup2::mount().map_err(|e| match e {
        Cgroup2Error::Read(source) => SandboxError::io("read", "/proc/self/mountinfo")(source),
        Cgroup2Error::NotMounted => SandboxError::NoCgroup2,
    })
}

/// A cgroup v2 directory. Owned ones are emptied (processes killed) and removed on drop.
#[derive(Debug)]
pub struct Cgroup {
    path: PathBuf,
    owned: bool,
}

impl Cgroup {
    /// Creates `<cgroup2 mount>/<name>`.
    pub fn create(name: &str) -> Result<Self, SandboxError> {
        let path = cgroup2_mount()?.join(name);
        fs::create_dir(&path).map_err(SandboxError::io("create cgroup", &path))?;
        Ok(Self { path, owned: true })
    }

    /// Uses an existing cgroup directory; it is left in place on drop.
    pub fn open(path: &Path) -> Result<Self, SandboxError> {
        let meta = fs::metadata(path).map_err(SandboxError::io("open cgroup", path))?;
        if !meta.is_dir() || !path.join("cgroup.procs").exists() {
            return Err(SandboxError::Sys {
                what: format!("{} is not a cgroup v2 directory", path.display()),
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            });
        }
        Ok(Self { path: path.to_path_buf(), owned: false })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The cgroup's id, as `bpf_get_current_cgroup_id()` reports it (the inode).
    pub fn id(&self) -> Result<u64, SandboxError> {
        Ok(fs::metadata(&self.path).map_err(SandboxError::io("stat cgroup", &self.path))?.ino())
    }

    /// The path of `cgroup.procs`, for writing a pid into it from a pre-exec hook.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// Moves process `pid` (all its threads) into this cgroup.
    pub fn add_process(&self, pid: u32) -> Result<(), SandboxError> {
        fs::write(self.procs_file(), pid.to_string())
            .map_err(SandboxError::io("move process into cgroup", self.procs_file()))
    }

    /// Pids currently in this cgroup (not its children).
    pub fn procs(&self) -> Result<Vec<u32>, SandboxError> {
        read_procs(&self.path)
    }

    /// Kills every process in this cgroup and its descendants, and waits (up to 5 s)
    /// until they are gone.
    pub fn kill_all(&self) -> Result<(), SandboxError> {
        kill_all(&self.path)
    }

    /// Kills what is left and removes the directory now, reporting failure.
    pub fn remove(mut self) -> Result<(), SandboxError> {
        self.owned = false;
        remove(&self.path)
    }
}

fn read_procs(dir: &Path) -> Result<Vec<u32>, SandboxError> {
    let procs = dir.join("cgroup.procs");
    let text = fs::read_to_string(&procs).map_err(SandboxError::io("read", &procs))?;
    Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
}

/// Kills every process in `dir` (and below) and waits until they are gone.
pub fn kill_all(dir: &Path) -> Result<(), SandboxError> {
    let kill_file = dir.join("cgroup.kill");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut pids = Vec::new();
        collect_procs(dir, &mut pids)?;
        if pids.is_empty() {
            return Ok(());
        }
        if kill_file.exists() {
            fs::write(&kill_file, "1").map_err(SandboxError::io("write", &kill_file))?;
        } else {
            for pid in &pids {
                // SAFETY: plain syscall; the pid may already be gone, which is fine.
                unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
            }
        }
        if Instant::now() > deadline {
            return Err(SandboxError::Sys {
                what: format!("processes {pids:?} in cgroup {} did not exit", dir.display()),
                source: std::io::Error::from(std::io::ErrorKind::TimedOut),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn collect_procs(dir: &Path, out: &mut Vec<u32>) -> Result<(), SandboxError> {
    out.extend(read_procs(dir)?);
    for entry in fs::read_dir(dir).map_err(SandboxError::io("list cgroup", dir))?.flatten() {
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            collect_procs(&entry.path(), out)?;
        }
    }
    Ok(())
}

/// Kills what is in `dir`, then removes it and its child cgroups (deepest first).
pub fn remove(dir: &Path) -> Result<(), SandboxError> {
    if !dir.exists() {
        return Ok(());
    }
    kill_all(dir)?;
    remove_tree(dir)
}

fn remove_tree(dir: &Path) -> Result<(), SandboxError> {
    for entry in fs::read_dir(dir).map_err(SandboxError::io("list cgroup", dir))?.flatten() {
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            remove_tree(&entry.path())?;
        }
    }
    // rmdir can race with the exit of the last process: retry briefly.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() < deadline && e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(SandboxError::io("remove cgroup", dir)(e)),
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if self.owned
            && let Err(e) = remove(&self.path)
        {
            tracing::warn!(cgroup = %self.path.display(), error = %e, "could not remove cgroup");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_cgroup2_mount_in_a_hybrid_layout() {
        let info = "\
25 30 0:23 / /sys rw,nosuid shared:7 - sysfs sysfs rw
31 25 0:26 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
32 31 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
33 31 0:28 / /sys/fs/cgroup/systemd rw shared:11 - cgroup cgroup rw,name=systemd";
        assert_eq!(crate::support::cgroup2::parse_mount(info), Some(PathBuf::from("/sys/fs/cgroup/unified")));
    }

    #[test]
    fn no_cgroup2_means_none() {
        let info = "33 31 0:28 / /sys/fs/cgroup/cpu rw shared:11 - cgroup cgroup rw,cpu";
        assert_eq!(crate::support::cgroup2::parse_mount(info), None);
    }

    #[test]
    fn optional_fields_do_not_confuse_the_parser() {
        let info = "40 1 0:35 / /sys/fs/cgroup rw shared:5 master:2 - cgroup2 none rw";
        assert_eq!(crate::support::cgroup2::parse_mount(info), Some(PathBuf::from("/sys/fs/cgroup")));
    }
}
