//! Network namespaces as eBPF capture sees them: run code inside one, read its cookie
//! (the key every per-pod map uses), and tell whether a cgroup's processes are in a
//! given one (the guard against registering the wrong namespace for a pod).

use std::{
    fs::File,
    os::{fd::AsFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
};

/// The network-namespace cookie of the namespace at `netns` (or the caller's), as the
/// programs see it (`SO_NETNS_COOKIE`, Linux 5.14+).
pub fn netns_cookie(netns: Option<&Path>) -> std::io::Result<u64> {
    let read = || -> std::io::Result<u64> {
        // An unbound socket: a fresh pod namespace may not have `lo` up yet.
        use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
        // SAFETY: socket(2) returns a new descriptor or -1.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a descriptor we own from here on.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        // SAFETY: getsockopt into a u64 with its size.
        let rc = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                71, /* SO_NETNS_COOKIE */
                (&raw mut cookie).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(cookie)
    };
    match netns {
        None => read(),
        Some(path) => in_netns(path, read),
    }
}

/// Runs `f` on a thread inside the network namespace at `path`.
pub fn in_netns<T: Send>(path: &Path, f: impl FnOnce() -> std::io::Result<T> + Send) -> std::io::Result<T> {
    let file = File::open(path)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)?;
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("namespace thread panicked")))
    })
}

/// The MAC address of `interface` in the namespace at `netns`.
pub fn interface_mac(netns: &Path, interface: &str) -> std::io::Result<[u8; 6]> {
    in_netns(netns, || {
        use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
        // SAFETY: socket(2) returns a new descriptor or -1.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a descriptor we own from here on.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ifreq is plain data; zeroed is a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        let name = interface.as_bytes();
        if name.len() >= req.ifr_name.len() {
            return Err(std::io::Error::other(format!("interface name {interface:?} is too long")));
        }
        for (slot, b) in req.ifr_name.iter_mut().zip(name) {
            *slot = *b as libc::c_char;
        }
        // SAFETY: SIOCGIFHWADDR fills the ifreq we pass.
        if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFHWADDR as libc::Ioctl, &mut req) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the kernel filled the hardware address member of the union.
        let data = unsafe { req.ifr_ifru.ifru_hwaddr.sa_data };
        Ok(std::array::from_fn(|i| data[i] as u8))
    })
}

/// A network namespace's identity: (device, inode) of its nsfs file.
fn identity(path: &Path) -> std::io::Result<(u64, u64)> {
    let meta = std::fs::metadata(path)?;
    Ok((meta.dev(), meta.ino()))
}

/// How a namespace is named in errors: `net:[4026531840]`, as /proc shows it.
pub fn describe(path: &Path) -> String {
    match std::fs::read_link(path) {
        Ok(name) => format!("{} ({})", name.display(), path.display()),
        Err(_) => path.display().to_string(),
    }
}

/// What [`cgroup_members_in`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    /// Processes in the cgroup or below it.
    pub processes: usize,
    /// A process among them in the namespace, if any.
    pub in_namespace: Option<u32>,
}

/// Whether any process in `cgroup` (or a cgroup below it) is in the network namespace
/// at `netns`. Processes that exit while being looked at are skipped.
pub fn cgroup_members_in(cgroup: &Path, netns: &Path) -> std::io::Result<Membership> {
    let wanted = identity(netns)?;
    let mut found = Membership { processes: 0, in_namespace: None };
    let mut dirs: Vec<PathBuf> = vec![cgroup.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs"))?;
        for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            found.processes += 1;
            if identity(Path::new(&format!("/proc/{pid}/ns/net"))).is_ok_and(|id| id == wanted) {
                found.in_namespace = Some(pid);
                return Ok(found);
            }
        }
        for entry in std::fs::read_dir(&dir)?.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(entry.path());
            }
        }
    }
    Ok(found)
}

/// NS_GET_USERNS: the user namespace that owns a namespace.
const NS_GET_USERNS: libc::Ioctl = 0xb701;

/// Whether the network namespace at `netns` is owned by the user namespace this process
/// is in (for a node agent, the node's). A pod with `hostUsers: false` has its own: the
/// ids its processes run as are not the ids eBPF programs see.
pub fn owned_by_this_user_namespace(netns: &Path) -> std::io::Result<bool> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    let file = File::open(netns)?;
    // SAFETY: NS_GET_USERNS takes no argument and returns a new descriptor or -1.
    let fd = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_USERNS) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor we own from here on.
    let owner = unsafe { OwnedFd::from_raw_fd(fd) };
    let owner = nix::sys::stat::fstat(owner.as_fd()).map_err(std::io::Error::from)?;
    let ours = std::fs::metadata("/proc/self/ns/user")?;
    Ok((owner.st_dev, owner.st_ino) == (ours.dev(), ours.ino()))
}
