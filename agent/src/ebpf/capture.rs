//! The capture programs in the kernel: load the `weir-capture` object, attach its
//! cgroup programs to one cgroup (a pod's, or a node's in CNI mode), register pods by
//! network-namespace cookie, read counters, pin everything so it outlives this process
//! (init-container use), and remove it again. The tc inbound classifier is
//! [`InboundProgram`], one per pod interface. [`MapSet`] gives the same operations on
//! maps held by a loader or opened from pins.

use std::{
    collections::BTreeMap,
    fs::File,
    net::IpAddr,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, LpmTrie, Map, MapData, PerCpuArray, SockHash, lpm_trie::Key},
    programs::{CgroupSockAddr, CgroupSockopt, SchedClassifier, SkMsg, SockOps, TcAttachType, links::FdLink},
};
use weir_ebpf_common::{
    capture::{CidrV4, CidrV6, NETNS_PREFIX_BITS, PairKey, PodConfig, control, counter, map, prog},
    inbound::{self, InboundConfig},
};
use weir_iptables::config::Cidr;

use super::{
    EbpfError,
    config::PodCapture,
    link::{CgroupLink, attach_type},
    objects,
};

/// Where pinned programs live: `<bpffs>/weir/<pod>/{maps,links}`.
pub const PIN_ROOT: &str = "/sys/fs/bpf/weir";

/// Trie value for `-x` prefixes, and for the pod's own addresses.
const EXCLUDED: u8 = 1;
const OWN_ADDRESS: u8 = 2;
/// A map the kernel side uses internally (sk_msg's reorder guard).
const NO_REDIRECT: &str = "NO_REDIRECT";

/// The socket-address hooks, in attach order: the hooks that rewrite connections last,
/// so a redirect never happens before the hooks that complete it are in place.
const CGROUP_SOCK_ADDR: &[(&str, u32)] = &[
    (prog::RECVMSG4, attach_type::UDP4_RECVMSG),
    (prog::RECVMSG6, attach_type::UDP6_RECVMSG),
    (prog::SENDMSG4, attach_type::UDP4_SENDMSG),
    (prog::SENDMSG6, attach_type::UDP6_SENDMSG),
    (prog::CONNECT4, attach_type::INET4_CONNECT),
    (prog::CONNECT6, attach_type::INET6_CONNECT),
];

/// Counter values, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters(pub Vec<(&'static str, u64)>);

impl Counters {
    pub fn get(&self, name: &str) -> u64 {
        self.0.iter().find(|(n, _)| *n == name).map(|(_, v)| *v).unwrap_or(0)
    }
}

fn map_err(map: &'static str) -> impl FnOnce(aya::maps::MapError) -> EbpfError {
    move |source| EbpfError::Map { map, source }
}

fn missing_map(map: &'static str) -> EbpfError {
    EbpfError::MissingMap { object: objects::CAPTURE_NAME, map }
}

fn pin_error(path: &Path) -> impl FnOnce(std::io::Error) -> EbpfError {
    let path = path.display().to_string();
    move |source| EbpfError::Pin { path, source }
}

/// The capture object's maps, by name.
pub struct MapSet {
    maps: BTreeMap<&'static str, Map>,
}

impl MapSet {
    fn take(ebpf: &mut Ebpf) -> Result<Self, EbpfError> {
        let mut maps = BTreeMap::new();
        for name in map::ALL.iter().copied().chain([NO_REDIRECT]) {
            maps.insert(name, ebpf.take_map(name).ok_or_else(|| missing_map(name))?);
        }
        Ok(Self { maps })
    }

    /// Opens the maps pinned under `<dir>/maps`.
    pub fn open_pinned(dir: &Path) -> Result<Self, EbpfError> {
        let mut maps = BTreeMap::new();
        for name in map::ALL.iter().copied() {
            let path = dir.join("maps").join(name);
            let data = MapData::from_pin(&path).map_err(map_err(name))?;
            maps.insert(name, Map::from_map_data(data).map_err(map_err(name))?);
        }
        Ok(Self { maps })
    }

    fn get(&self, name: &'static str) -> Result<&Map, EbpfError> {
        self.maps.get(name).ok_or_else(|| missing_map(name))
    }

    fn get_mut(&mut self, name: &'static str) -> Result<&mut Map, EbpfError> {
        self.maps.get_mut(name).ok_or_else(|| missing_map(name))
    }

    fn trie4(&mut self, name: &'static str) -> Result<LpmTrie<&mut MapData, CidrV4, u8>, EbpfError> {
        LpmTrie::try_from(self.get_mut(name)?).map_err(map_err(name))
    }

    fn trie6(&mut self, name: &'static str) -> Result<LpmTrie<&mut MapData, CidrV6, u8>, EbpfError> {
        LpmTrie::try_from(self.get_mut(name)?).map_err(map_err(name))
    }

    fn put(
        &mut self,
        v4: &'static str,
        v6: &'static str,
        netns: u64,
        cidr: Cidr,
        value: u8,
    ) -> Result<(), EbpfError> {
        let prefix = NETNS_PREFIX_BITS + u32::from(cidr.bits);
        match cidr.addr {
            IpAddr::V4(a) => self
                .trie4(v4)?
                .insert(&Key::new(prefix, CidrV4 { netns: netns.to_be_bytes(), addr: a.octets() }), value, 0)
                .map_err(map_err(v4)),
            IpAddr::V6(a) => self
                .trie6(v6)?
                .insert(&Key::new(prefix, CidrV6 { netns: netns.to_be_bytes(), addr: a.octets() }), value, 0)
                .map_err(map_err(v6)),
        }
    }

    /// Registers (or replaces) one pod: its lists first, its config last, so the
    /// programs never see a pod half configured.
    pub fn register(&mut self, netns: u64, pod: &PodCapture) -> Result<(), EbpfError> {
        self.remove_lists(netns)?;
        let host = |addr: IpAddr| Cidr { addr, bits: if addr.is_ipv4() { 32 } else { 128 } };
        for cidr in &pod.exclude {
            self.put(map::EXCLUDE_V4, map::EXCLUDE_V6, netns, *cidr, EXCLUDED)?;
        }
        for addr in &pod.own_addresses {
            self.put(map::EXCLUDE_V4, map::EXCLUDE_V6, netns, host(*addr), OWN_ADDRESS)?;
        }
        for cidr in &pod.include {
            self.put(map::INCLUDE_V4, map::INCLUDE_V6, netns, *cidr, 1)?;
        }
        for addr in &pod.dns_servers {
            self.put(map::DNS_V4, map::DNS_V6, netns, host(*addr), 1)?;
        }
        let mut configs: HashMap<_, u64, PodConfig> =
            HashMap::try_from(self.get_mut(map::POD_CONFIG)?).map_err(map_err(map::POD_CONFIG))?;
        configs.insert(netns, pod.config, 0).map_err(map_err(map::POD_CONFIG))
    }

    /// Removes a pod: its config first (programs stop acting at once), then its lists.
    pub fn unregister(&mut self, netns: u64) -> Result<(), EbpfError> {
        let mut configs: HashMap<_, u64, PodConfig> =
            HashMap::try_from(self.get_mut(map::POD_CONFIG)?).map_err(map_err(map::POD_CONFIG))?;
        match configs.remove(&netns) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
            Err(source) => return Err(EbpfError::Map { map: map::POD_CONFIG, source }),
        }
        self.remove_lists(netns)
    }

    fn remove_lists(&mut self, netns: u64) -> Result<(), EbpfError> {
        let prefix = netns.to_be_bytes();
        for m in [map::EXCLUDE_V4, map::INCLUDE_V4, map::DNS_V4] {
            let mut trie = self.trie4(m)?;
            let keys: Vec<_> =
                trie.keys().filter_map(Result::ok).filter(|k| k.data().netns == prefix).collect();
            for k in keys {
                let _ = trie.remove(&k);
            }
        }
        for m in [map::EXCLUDE_V6, map::INCLUDE_V6, map::DNS_V6] {
            let mut trie = self.trie6(m)?;
            let keys: Vec<_> =
                trie.keys().filter_map(Result::ok).filter(|k| k.data().netns == prefix).collect();
            for k in keys {
                let _ = trie.remove(&k);
            }
        }
        Ok(())
    }

    /// Network-namespace cookies of the registered pods.
    pub fn pods(&self) -> Result<Vec<u64>, EbpfError> {
        let configs: HashMap<_, u64, PodConfig> =
            HashMap::try_from(self.get(map::POD_CONFIG)?).map_err(map_err(map::POD_CONFIG))?;
        Ok(configs.keys().filter_map(Result::ok).collect())
    }

    /// Connections redirected whose original destination Envoy has not asked for yet.
    pub fn pending_original_destinations(&self) -> Result<usize, EbpfError> {
        let pairs: HashMap<_, PairKey, weir_ebpf_common::capture::OrigDst> =
            HashMap::try_from(self.get(map::ORIG_BY_PAIR)?).map_err(map_err(map::ORIG_BY_PAIR))?;
        Ok(pairs.keys().filter_map(Result::ok).count())
    }

    pub fn counters(&self) -> Result<Counters, EbpfError> {
        let counters: PerCpuArray<_, u64> =
            PerCpuArray::try_from(self.get(map::COUNTERS)?).map_err(map_err(map::COUNTERS))?;
        let mut out = Vec::new();
        for (i, name) in counter::NAMES.iter().enumerate() {
            let v = counters.get(&(i as u32), 0).map_err(map_err(map::COUNTERS))?;
            out.push((*name, v.iter().sum()));
        }
        Ok(Counters(out))
    }

    /// Turns the programs' aya-log records on or off.
    pub fn set_logging(&mut self, on: bool) -> Result<(), EbpfError> {
        let mut control: Array<_, u32> =
            Array::try_from(self.get_mut(map::CONTROL)?).map_err(map_err(map::CONTROL))?;
        control.set(control::LOG, u32::from(on), 0).map_err(map_err(map::CONTROL))
    }

    /// Keys currently in the sockhash (registered local sockets).
    pub fn registered_pairs(&self) -> Result<Vec<PairKey>, EbpfError> {
        let hash: SockHash<_, PairKey> =
            SockHash::try_from(self.get(map::SOCK_PAIRS)?).map_err(map_err(map::SOCK_PAIRS))?;
        Ok(hash.keys().filter_map(Result::ok).collect())
    }

    fn pin(&self, dir: &Path) -> Result<(), EbpfError> {
        for (name, m) in &self.maps {
            let path = dir.join(name);
            let data = match m {
                Map::HashMap(d)
                | Map::LruHashMap(d)
                | Map::LpmTrie(d)
                | Map::PerCpuArray(d)
                | Map::Array(d)
                | Map::SockHash(d) => d,
                _ => continue,
            };
            data.pin(&path).map_err(|e| EbpfError::Pin {
                path: path.display().to_string(),
                source: std::io::Error::other(e.to_string()),
            })?;
        }
        Ok(())
    }
}

/// The capture object loaded and attached to one cgroup. Dropping it detaches
/// everything that was not pinned.
pub struct CapturePrograms {
    ebpf: Ebpf,
    maps: MapSet,
    cgroup: PathBuf,
    links: Vec<(&'static str, CgroupLink)>,
    /// sk_msg's attachment to the sockhash (not a bpf_link on every kernel).
    sk_msg: Option<aya::programs::sk_msg::SkMsgLink>,
    /// Reader of the programs' aya-log ring buffer (holds the map open).
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
}

fn program<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, EbpfError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(EbpfError::MissingProgram { object: objects::CAPTURE_NAME, program: name })?
        .try_into()
        .map_err(|source| EbpfError::Verify { program: name, source })
}

impl CapturePrograms {
    /// Loads the object and every program into the kernel (the verifier runs here),
    /// without attaching anything.
    pub fn load() -> Result<Self, EbpfError> {
        let data = objects::bytes(objects::CAPTURE_NAME, objects::CAPTURE)?;
        let mut ebpf =
            Ebpf::load(data).map_err(|source| EbpfError::Load { object: objects::CAPTURE_NAME, source })?;
        // The reader must live as long as the programs reference its map; records go
        // to the `log` facade (and from there to tracing) when flushed.
        let logger = match aya_log::EbpfLogger::init(&mut ebpf) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::debug!(error = %e, "eBPF log reader not started");
                None
            }
        };
        for (name, _) in CGROUP_SOCK_ADDR {
            let p: &mut CgroupSockAddr = program(&mut ebpf, name)?;
            p.load().map_err(|source| EbpfError::Verify { program: name, source })?;
        }
        let p: &mut CgroupSockopt = program(&mut ebpf, prog::GETSOCKOPT)?;
        p.load().map_err(|source| EbpfError::Verify { program: prog::GETSOCKOPT, source })?;
        let p: &mut SockOps = program(&mut ebpf, prog::SOCKOPS)?;
        p.load().map_err(|source| EbpfError::Verify { program: prog::SOCKOPS, source })?;
        let p: &mut SkMsg = program(&mut ebpf, prog::SK_MSG)?;
        p.load().map_err(|source| EbpfError::Verify { program: prog::SK_MSG, source })?;
        let maps = MapSet::take(&mut ebpf)?;
        Ok(Self { ebpf, maps, cgroup: PathBuf::new(), links: Vec::new(), sk_msg: None, logger })
    }

    /// Attaches every program: the cgroup hooks to `cgroup`, sk_msg to the sockhash.
    pub fn attach(&mut self, cgroup: &Path) -> Result<(), EbpfError> {
        let dir = File::open(cgroup)
            .map_err(|source| EbpfError::OpenCgroup { path: cgroup.to_path_buf(), source })?;
        let attach_err = |program: &'static str| {
            let path = cgroup.to_path_buf();
            move |source| EbpfError::Attach { program, path, source }
        };
        // sk_msg first: sockops registers sockets in the map it runs on.
        let sock_pairs: SockHash<_, PairKey> =
            SockHash::try_from(self.maps.get(map::SOCK_PAIRS)?).map_err(map_err(map::SOCK_PAIRS))?;
        let fd = sock_pairs
            .fd()
            .try_clone()
            .map_err(|source| EbpfError::Io { what: "duplicate the sockhash fd", source })?;
        let p: &mut SkMsg = program(&mut self.ebpf, prog::SK_MSG)?;
        let id = p.attach(&fd).map_err(attach_err(prog::SK_MSG))?;
        self.sk_msg = Some(p.take_link(id).map_err(attach_err(prog::SK_MSG))?);

        let mut hooks: Vec<(&'static str, u32)> =
            vec![(prog::SOCKOPS, attach_type::SOCK_OPS), (prog::GETSOCKOPT, attach_type::GETSOCKOPT)];
        hooks.extend_from_slice(CGROUP_SOCK_ADDR);
        for (name, kind) in hooks {
            let prog_fd = self
                .ebpf
                .program(name)
                .ok_or(EbpfError::MissingProgram { object: objects::CAPTURE_NAME, program: name })?
                .fd()
                .map_err(attach_err(name))?;
            let link = CgroupLink::create(prog_fd.as_fd(), dir.as_fd(), kind)
                .map_err(|e| attach_err(name)(aya::programs::ProgramError::IOError(e)))?;
            self.links.push((name, link));
        }
        self.cgroup = cgroup.to_path_buf();
        Ok(())
    }

    pub fn maps(&self) -> &MapSet {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut MapSet {
        &mut self.maps
    }

    /// Registers (or replaces) one pod; see [`MapSet::register`].
    pub fn register(&mut self, netns: u64, pod: &PodCapture) -> Result<(), EbpfError> {
        self.maps.register(netns, pod)
    }

    pub fn unregister(&mut self, netns: u64) -> Result<(), EbpfError> {
        self.maps.unregister(netns)
    }

    pub fn counters(&self) -> Result<Counters, EbpfError> {
        self.maps.counters()
    }

    pub fn set_logging(&mut self, on: bool) -> Result<(), EbpfError> {
        self.maps.set_logging(on)
    }

    /// Writes pending program log records to the log (produced only while logging is on).
    pub fn flush_logs(&mut self) {
        if let Some(l) = &mut self.logger {
            l.flush();
        }
    }

    pub fn cgroup(&self) -> &Path {
        &self.cgroup
    }

    /// Pins maps and links under `dir` so the programs stay attached after this process
    /// exits; [`unpin`] removes them (which detaches the programs).
    pub fn pin(mut self, dir: &Path) -> Result<(), EbpfError> {
        mount_bpffs()?;
        for sub in ["maps", "links"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(pin_error(&dir.join(sub)))?;
        }
        self.maps.pin(&dir.join("maps"))?;
        for (name, link) in self.links.drain(..) {
            let path = dir.join("links").join(name);
            link.pin(&path).map_err(pin_error(&path))?;
        }
        // The sk_msg attachment lives as long as the (now pinned) sockhash; the log
        // ring buffer as long as the programs that write it.
        std::mem::forget(self.sk_msg.take());
        std::mem::forget(self.logger.take());
        Ok(())
    }
}

/// Whether bpffs is mounted at /sys/fs/bpf.
pub fn bpffs_mounted() -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts.lines().any(|l| {
        let mut f = l.split_whitespace();
        f.nth(1) == Some("/sys/fs/bpf") && f.next() == Some("bpf")
    })
}

/// Mounts bpffs at /sys/fs/bpf if nothing is mounted there yet.
pub fn mount_bpffs() -> Result<(), EbpfError> {
    if bpffs_mounted() {
        return Ok(());
    }
    nix::mount::mount(Some("bpf"), "/sys/fs/bpf", Some("bpf"), nix::mount::MsFlags::empty(), None::<&str>)
        .map_err(|e| EbpfError::Pin { path: "/sys/fs/bpf (mount bpffs)".into(), source: e.into() })
}

/// A temporary user of bpffs (`weir demo`, tests that pin): bpffs is mounted for it
/// when nothing is, and when the last such user leaves, a bpffs one of them mounted is
/// unmounted again if nothing but the kernel's own `*.debug` iterators is in it. Users
/// coordinate through locks in /run/weir: each holds a shared "users" lock; mounting
/// and unmounting happen under an exclusive "mount" lock, unmounting only when no one
/// holds "users".
pub struct BpffsUse {
    users: Option<nix::fcntl::Flock<File>>,
}

const BPFFS_LOCK_DIR: &str = "/run/weir";
/// Present while bpffs is mounted by a temporary user (not by the node or the admin).
const BPFFS_MARKER: &str = "/run/weir/bpffs-mounted-temporarily";

fn lock_file(name: &str) -> Result<File, EbpfError> {
    let io = |source| EbpfError::Io { what: "open a bpffs lock in /run/weir", source };
    std::fs::create_dir_all(BPFFS_LOCK_DIR).map_err(io)?;
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(Path::new(BPFFS_LOCK_DIR).join(name))
        .map_err(io)
}

fn flock(file: File, arg: nix::fcntl::FlockArg) -> Result<nix::fcntl::Flock<File>, EbpfError> {
    nix::fcntl::Flock::lock(file, arg)
        .map_err(|(_, e)| EbpfError::Io { what: "lock a bpffs lock in /run/weir", source: e.into() })
}

impl BpffsUse {
    pub fn acquire() -> Result<Self, EbpfError> {
        let users = flock(lock_file("bpffs-users.lock")?, nix::fcntl::FlockArg::LockShared)?;
        let _mount = flock(lock_file("bpffs-mount.lock")?, nix::fcntl::FlockArg::LockExclusive)?;
        if !bpffs_mounted() {
            mount_bpffs()?;
            std::fs::write(BPFFS_MARKER, b"")
                .map_err(|source| EbpfError::Io { what: "mark bpffs as mounted", source })?;
        }
        Ok(Self { users: Some(users) })
    }
}

/// Whether /sys/fs/bpf holds nothing but the kernel's `*.debug` iterators (and an
/// empty `weir` folder, which it removes).
fn bpffs_unused() -> bool {
    let _ = std::fs::remove_dir(PIN_ROOT);
    std::fs::read_dir("/sys/fs/bpf")
        .map(|d| d.flatten().all(|e| e.file_name().to_string_lossy().ends_with(".debug")))
        .unwrap_or(false)
}

impl Drop for BpffsUse {
    fn drop(&mut self) {
        drop(self.users.take());
        let Ok(mount) = lock_file("bpffs-mount.lock") else { return };
        let Ok(_mount) = flock(mount, nix::fcntl::FlockArg::LockExclusive) else { return };
        let Ok(users) = lock_file("bpffs-users.lock") else { return };
        // Another user still holds it: the last one unmounts.
        let Ok(_last) = flock(users, nix::fcntl::FlockArg::LockExclusiveNonblock) else { return };
        if Path::new(BPFFS_MARKER).exists() && bpffs_mounted() && bpffs_unused() {
            match nix::mount::umount("/sys/fs/bpf") {
                Ok(()) => {
                    let _ = std::fs::remove_file(BPFFS_MARKER);
                }
                Err(e) => tracing::warn!(error = %e, "cannot unmount /sys/fs/bpf"),
            }
        } else if !bpffs_mounted() {
            let _ = std::fs::remove_file(BPFFS_MARKER);
        }
    }
}

/// Removes every pin under `dir` (links first, which detaches the programs) and the
/// directory itself. Missing pins are fine.
pub fn unpin(dir: &Path) -> Result<(), EbpfError> {
    if !dir.exists() {
        return Ok(());
    }
    for sub in ["links", "maps"] {
        if let Ok(entries) = std::fs::read_dir(dir.join(sub)) {
            for e in entries.flatten() {
                match std::fs::remove_file(e.path()) {
                    Ok(()) => {}
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                    Err(err) => return Err(pin_error(&e.path())(err)),
                }
            }
        }
        let _ = std::fs::remove_dir(dir.join(sub));
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(pin_error(dir)(e)),
    }
    // The shared root goes when its last capture does (fails harmlessly otherwise).
    if let Some(root) = dir.parent().filter(|p| *p == Path::new(PIN_ROOT)) {
        let _ = std::fs::remove_dir(root);
    }
    Ok(())
}

/// The network-namespace cookie of the namespace at `netns` (or the caller's), as the
/// programs see it (`SO_NETNS_COOKIE`, Linux 5.14+).
pub fn netns_cookie(netns: Option<&Path>) -> std::io::Result<u64> {
    let read = || -> std::io::Result<u64> {
        // An unbound socket: a fresh pod namespace may not have `lo` up yet.
        use std::os::fd::{FromRawFd as _, OwnedFd};
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
            use std::os::fd::AsRawFd as _;
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

/// The tc inbound classifier attached to one pod interface (its own loaded copy and
/// config). Dropping it detaches the classifier.
pub struct InboundProgram {
    ebpf: Option<Ebpf>,
    netns: PathBuf,
    link: Option<aya::programs::tc::SchedClassifierLink>,
}

impl InboundProgram {
    /// Loads a copy of the classifier with `config` and attaches it to `interface`'s
    /// ingress inside the namespace at `netns`.
    pub fn attach(netns: &Path, interface: &str, config: &InboundConfig) -> Result<Self, EbpfError> {
        let data = objects::bytes(objects::INBOUND_NAME, objects::INBOUND)?;
        let mut ebpf =
            Ebpf::load(data).map_err(|source| EbpfError::Load { object: objects::INBOUND_NAME, source })?;
        let missing = |map| EbpfError::MissingMap { object: objects::INBOUND_NAME, map };
        {
            let mut cfg: Array<_, InboundConfig> =
                Array::try_from(ebpf.map_mut(inbound::CONFIG).ok_or_else(|| missing(inbound::CONFIG))?)
                    .map_err(map_err(inbound::CONFIG))?;
            cfg.set(0, config, 0).map_err(map_err(inbound::CONFIG))?;
        }
        let classifier: &mut SchedClassifier = ebpf
            .program_mut(inbound::PROG)
            .ok_or(EbpfError::MissingProgram { object: objects::INBOUND_NAME, program: inbound::PROG })?
            .try_into()
            .map_err(|source| EbpfError::Verify { program: inbound::PROG, source })?;
        classifier.load().map_err(|source| EbpfError::Verify { program: inbound::PROG, source })?;
        // Interface lookups and (legacy) tc netlink calls happen inside the pod.
        let link = in_netns(netns, || {
            let _ = aya::programs::tc::qdisc_add_clsact(interface);
            let id = classifier.attach(interface, TcAttachType::Ingress).map_err(std::io::Error::other)?;
            classifier.take_link(id).map_err(std::io::Error::other)
        })
        .map_err(|e| EbpfError::Attach {
            program: inbound::PROG,
            path: PathBuf::from(interface),
            source: aya::programs::ProgramError::IOError(e),
        })?;
        Ok(Self { ebpf: Some(ebpf), netns: netns.to_path_buf(), link: Some(link) })
    }

    /// New connections assigned to Envoy so far.
    pub fn assigned(&self) -> Result<u64, EbpfError> {
        let ebpf = self.ebpf.as_ref().expect("loaded until pinned");
        let m = ebpf
            .map(inbound::COUNTERS)
            .ok_or(EbpfError::MissingMap { object: objects::INBOUND_NAME, map: inbound::COUNTERS })?;
        let counters: PerCpuArray<_, u64> = PerCpuArray::try_from(m).map_err(map_err(inbound::COUNTERS))?;
        Ok(counters.get(&inbound::counter::ASSIGNED, 0).map_err(map_err(inbound::COUNTERS))?.iter().sum())
    }

    /// Keeps the classifier attached after this process exits: a TCX link is pinned at
    /// `dir/links/inbound` (and its counters at `dir/maps/INBOUND_COUNTERS`); a legacy tc
    /// filter simply stays (removed by [`detach_inbound`]).
    pub fn pin(mut self, dir: &Path) -> Result<(), EbpfError> {
        mount_bpffs()?;
        for sub in ["maps", "links"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(pin_error(&dir.join(sub)))?;
        }
        let mut ebpf = self.ebpf.take().expect("loaded until pinned");
        if let Some(Map::PerCpuArray(data)) = ebpf.map_mut(inbound::COUNTERS) {
            let path = dir.join("maps").join(inbound::COUNTERS);
            data.pin(&path).map_err(|e| EbpfError::Pin {
                path: path.display().to_string(),
                source: std::io::Error::other(e.to_string()),
            })?;
        }
        let link = self.link.take().expect("attached until pinned");
        if let Ok(fd) = FdLink::try_from(link) {
            let path = dir.join("links").join("inbound");
            fd.pin(&path).map_err(|e| EbpfError::Pin {
                path: path.display().to_string(),
                source: std::io::Error::other(e.to_string()),
            })?;
        }
        // A legacy netlink filter persists on its own; keep the program loaded for it.
        std::mem::forget(ebpf);
        Ok(())
    }
}

impl Drop for InboundProgram {
    fn drop(&mut self) {
        if let Some(link) = self.link.take() {
            // A netlink detach must run inside the pod's namespace.
            let _ = in_netns(&self.netns, move || {
                drop(link);
                Ok(())
            });
        }
    }
}

/// Names of the programs attached to `interface`'s ingress in `netns` through TCX
/// (Linux 6.6+); older kernels use a tc filter, which `tc filter show` lists.
pub fn inbound_programs(netns: &Path, interface: &str) -> std::io::Result<Vec<String>> {
    in_netns(netns, || {
        let (_, programs) =
            SchedClassifier::query_tcx(interface, TcAttachType::Ingress).map_err(std::io::Error::other)?;
        Ok(programs.iter().filter_map(|p| p.name_as_str().map(String::from)).collect())
    })
}

/// Removes a legacy (netlink) inbound classifier from `interface` in `netns`; a pinned
/// TCX link is removed with the pin directory.
pub fn detach_inbound(netns: Option<&Path>, interface: &str) {
    let detach = || {
        let _ = aya::programs::tc::qdisc_detach_program(interface, TcAttachType::Ingress, inbound::PROG);
        Ok(())
    };
    let _ = match netns {
        Some(path) if path.exists() => in_netns(path, detach),
        Some(_) => Ok(()),
        None => detach(),
    };
}

/// Inbound assignments counted by a pinned classifier, if it has pinned counters.
pub fn pinned_inbound_assigned(dir: &Path) -> Option<u64> {
    let data = MapData::from_pin(dir.join("maps").join(inbound::COUNTERS)).ok()?;
    let m = Map::from_map_data(data).ok()?;
    let counters: PerCpuArray<_, u64> = PerCpuArray::try_from(&m).ok()?;
    Some(counters.get(&inbound::counter::ASSIGNED, 0).ok()?.iter().sum())
}

/// What a pod's pinned capture is made of, recorded next to the pins.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PinRecord {
    pub pod: String,
    pub cgroup: PathBuf,
    pub netns: Option<PathBuf>,
    pub netns_cookie: u64,
    pub interface: Option<String>,
}

/// Where pin records live (a tmpfs, like the pins themselves).
pub const RECORD_DIR: &str = "/run/weir/capture";

impl PinRecord {
    pub fn pin_dir(&self) -> PathBuf {
        pin_dir(&self.pod)
    }

    pub fn path(pod: &str) -> PathBuf {
        Path::new(RECORD_DIR).join(format!("{pod}.json"))
    }

    pub fn save(&self) -> std::io::Result<()> {
        std::fs::create_dir_all(RECORD_DIR)?;
        std::fs::write(Self::path(&self.pod), serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)
    }

    pub fn load(pod: &str) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(Self::path(pod)).ok()?).ok()
    }

    pub fn load_all() -> Vec<Self> {
        let Ok(dir) = std::fs::read_dir(RECORD_DIR) else { return Vec::new() };
        let mut all: Vec<Self> = dir
            .flatten()
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice(&b).ok())
            .collect();
        all.sort_by(|a, b| a.pod.cmp(&b.pod));
        all
    }

    /// Detaches and removes everything recorded for this pod; idempotent.
    pub fn remove(&self) -> Result<(), EbpfError> {
        if let Some(interface) = &self.interface {
            detach_inbound(self.netns.as_deref(), interface);
        }
        unpin(&self.pin_dir())?;
        match std::fs::remove_file(Self::path(&self.pod)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(EbpfError::Io { what: "remove the capture record", source }),
        }
    }
}

/// The pin directory for a pod name.
pub fn pin_dir(pod: &str) -> PathBuf {
    Path::new(PIN_ROOT).join(pod)
}
