//! The cgroup v2 hierarchy's mount point, as `/proc/self/mountinfo` names it
//! (`/sys/fs/cgroup/unified` on hybrid systems, `/sys/fs/cgroup` on unified ones):
//! where eBPF capture attaches and where sandbox pods get their cgroups.

use std::path::PathBuf;

/// Why no cgroup v2 mount was found.
#[derive(Debug, thiserror::Error)]
pub enum Cgroup2Error {
    #[error("read /proc/self/mountinfo")]
    Read(#[source] std::io::Error),
    #[error("no cgroup v2 (cgroup2) mount found in /proc/self/mountinfo")]
    NotMounted,
}

/// This process's cgroup2 mount point.
pub fn mount() -> Result<PathBuf, Cgroup2Error> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(Cgroup2Error::Read)?;
    parse_mount(&info).ok_or(Cgroup2Error::NotMounted)
}

/// The mount point of the first `cgroup2` entry in a mountinfo text.
pub fn parse_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // <id> <parent> <maj:min> <root> <mount point> <opts> [optional...] - <fstype> <source> <super opts>
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split_whitespace().next()?;
        (fstype == "cgroup2").then(|| left.split_whitespace().nth(4).map(PathBuf::from))?
    })
}
