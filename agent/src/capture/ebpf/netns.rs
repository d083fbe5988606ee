//! Network namespaces as eBPF capture sees them: run code inside one, read its cookie
//! (the key every per-pod map uses), and tell whether a cgroup's processes are in a
//! given one (the guard against registering the wrong namespace for a pod).

use std::{
    fs::File,
    net::IpAddr,
    os::{
        fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    path::{Path, PathBuf},
};

/// The network-namespace cookie of the namespace at `netns` (or the caller's), as the
/// programs see it (`SO_NETNS_COOKIE`, Linux 5.14+).
pub fn netns_cookie(netns: Option<&Path>) -> std::io::Result<u64> {
    match netns {
        None => cookie_here(),
        Some(path) => in_netns(path, cookie_here),
    }
}

/// The cookie of the calling thread's network namespace.
fn cookie_here() -> std::io::Result<u64> {
    // An unbound socket: a fresh pod namespace may not have `lo` up yet.
    let sock = datagram_socket()?;
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
}

fn datagram_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: socket(2) returns a new descriptor or -1.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor we own from here on.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Moves the calling thread into the network namespace at `path`, for good: only for a
/// thread made for the visit.
pub fn enter(path: &Path) -> std::io::Result<()> {
    setns(&File::open(path)?)
}

/// Moves the calling thread into the network namespace `file` names.
fn setns(file: &File) -> std::io::Result<()> {
    nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)
}

/// Runs `f` inside the network namespace at `path`: on the calling thread, which
/// enters it and comes back (a network namespace is a thread's own; a few microseconds,
/// where a thread made for the visit takes about fifty), or, where this process cannot
/// come back to its namespace (no CAP_SYS_ADMIN over the namespace's owner), on a
/// thread made for the visit. `f` must not hand work to other threads that expects
/// the namespace, nor wait on async tasks.
pub fn in_netns<T: Send>(path: &Path, f: impl FnOnce() -> std::io::Result<T> + Send) -> std::io::Result<T> {
    let file = File::open(path)?;
    if !can_return() {
        return std::thread::scope(|s| {
            s.spawn(|| {
                setns(&file)?;
                f()
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("namespace thread panicked")))
        });
    }
    let home = File::open("/proc/thread-self/ns/net")?;
    setns(&file)?;
    let _back = Return(home);
    f()
}

/// [`in_netns`] for the namespace registered under `cookie`: refused, naming both,
/// when the path now names another namespace (the runtime re-pointed it since it was
/// read), so nothing meant for the pod lands in another namespace.
pub fn in_netns_of<T: Send>(
    path: &Path,
    cookie: u64,
    f: impl FnOnce() -> std::io::Result<T> + Send,
) -> std::io::Result<T> {
    in_netns(path, || {
        let here = cookie_here()?;
        if here != cookie {
            return Err(std::io::Error::other(format!(
                "{} now names another network namespace (cookie {here}) than the one registered (cookie {cookie})",
                path.display()
            )));
        }
        f()
    })
}

/// Takes the calling thread back to its namespace, also when `f` panics. A thread that
/// cannot go back would go on in a pod's namespace (the next rules it writes, the next
/// socket it opens, would be the pod's): the process stops instead.
struct Return(File);

impl Drop for Return {
    fn drop(&mut self) {
        if let Err(e) = setns(&self.0) {
            eprintln!("weir: cannot return to this thread's network namespace after entering a pod's: {e}");
            std::process::abort();
        }
    }
}

/// Whether this process may enter its own network namespace again (probed once, by
/// entering the one it is in): then [`in_netns`] returns the calling thread to it.
fn can_return() -> bool {
    static CAN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CAN.get_or_init(|| File::open("/proc/thread-self/ns/net").is_ok_and(|f| setns(&f).is_ok()))
}

/// What capturing a pod reads inside its network namespace, in one visit: its
/// addresses, its interfaces with their hardware addresses, and (for eBPF) the
/// namespace's cookie.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetnsFacts {
    /// `None` where the kernel has no `SO_NETNS_COOKIE` (before 5.14): only eBPF
    /// capture needs it, and it cannot run there.
    pub cookie: Option<u64>,
    /// Every address, loopback included, in the kernel's dump order with IPv4 first (as
    /// `weir_iptables::detect::SystemFacts` lists them).
    pub addresses: Vec<IpAddr>,
    pub interfaces: Vec<Interface>,
}

/// One interface of a namespace, as `getifaddrs` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub up: bool,
    pub mac: Option<[u8; 6]>,
    pub addresses: Vec<IpAddr>,
}

impl NetnsFacts {
    /// The facts of the namespace at `netns`.
    pub fn read(netns: &Path) -> std::io::Result<Self> {
        in_netns(netns, Self::read_here)
    }

    /// The facts of the calling thread's namespace.
    pub fn read_here() -> std::io::Result<Self> {
        let mut facts = Self { cookie: cookie_here().ok(), ..Self::default() };
        let mut v6 = Vec::new();
        for ifa in nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)? {
            let index = match facts.interfaces.iter().position(|i| i.name == ifa.interface_name) {
                Some(i) => i,
                None => {
                    facts.interfaces.push(Interface {
                        name: ifa.interface_name.clone(),
                        up: false,
                        mac: None,
                        addresses: Vec::new(),
                    });
                    facts.interfaces.len() - 1
                }
            };
            let interface = &mut facts.interfaces[index];
            interface.up |= ifa.flags.contains(nix::net::if_::InterfaceFlags::IFF_UP);
            let Some(addr) = ifa.address else { continue };
            if let Some(v4) = addr.as_sockaddr_in() {
                interface.addresses.push(IpAddr::V4(v4.ip()));
                facts.addresses.push(IpAddr::V4(v4.ip()));
            } else if let Some(v6_addr) = addr.as_sockaddr_in6() {
                interface.addresses.push(IpAddr::V6(v6_addr.ip()));
                v6.push(IpAddr::V6(v6_addr.ip()));
            } else if let Some(link) = addr.as_link_addr() {
                interface.mac = interface.mac.or(link.addr());
            }
        }
        facts.addresses.extend(v6);
        Ok(facts)
    }

    /// The addresses other than loopback (the pod's own).
    pub fn own_addresses(&self) -> Vec<IpAddr> {
        self.addresses.iter().copied().filter(|a| !a.is_loopback()).collect()
    }

    /// The hardware address of `interface`.
    pub fn mac(&self, interface: &str) -> std::io::Result<[u8; 6]> {
        self.interfaces.iter().find(|i| i.name == interface).and_then(|i| i.mac).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no interface {interface:?} with a hardware address in the namespace"),
            )
        })
    }
}

/// The MAC address of `interface` in the namespace at `netns`.
pub fn interface_mac(netns: &Path, interface: &str) -> std::io::Result<[u8; 6]> {
    in_netns(netns, || {
        let sock = datagram_socket()?;
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
