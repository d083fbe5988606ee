//! The capture programs in the kernel: load and verify the `weir-capture` object,
//! attach its cgroup programs to one cgroup in process (foreground mode, tests), or pin
//! programs and maps for a node program set (`set`); register pods by
//! network-namespace cookie, read counters. [`MapSet`] gives the same operations on
//! maps held by a loader or opened from pins.

mod lists;

use std::{
    collections::BTreeMap,
    net::IpAddr,
    os::fd::{AsFd as _, BorrowedFd},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, LpmTrie, Map, MapData, PerCpuHashMap, PerCpuValues, SockHash, lpm_trie::Key},
    programs::{CgroupSkb, CgroupSock, CgroupSockAddr, CgroupSockopt, SkMsg, SockOps},
};
pub use lists::Staged;
use weir_ebpf_common::capture::{
    CidrV4, CidrV6, KEY_PREFIX_BITS, PairKey, PodConfig, PodCounters, control, counter, map, prog,
};

use super::{
    EbpfError,
    bpffs::{aya_pin_error, create_dir},
    config::PodCapture,
    link::{CgroupLink, attach_type},
    objects,
    registration::Registration,
};

/// Trie value for `-x` prefixes, and for the pod's own addresses.
pub const EXCLUDED: u8 = 1;
pub const OWN_ADDRESS: u8 = 2;
/// A map the kernel side uses internally (sk_msg's reorder guard).
const NO_REDIRECT: &str = "NO_REDIRECT";

/// The socket-address hooks, in attach order: the hooks that rewrite connections last,
/// so a redirect never happens before the hooks that complete it are in place.
pub const CGROUP_SOCK_ADDR: &[(&str, u32)] = &[
    (prog::RECVMSG4, attach_type::UDP4_RECVMSG),
    (prog::RECVMSG6, attach_type::UDP6_RECVMSG),
    (prog::SENDMSG4, attach_type::UDP4_SENDMSG),
    (prog::SENDMSG6, attach_type::UDP6_SENDMSG),
    (prog::GETPEERNAME4, attach_type::INET4_GETPEERNAME),
    (prog::GETPEERNAME6, attach_type::INET6_GETPEERNAME),
    (prog::CONNECT4, attach_type::INET4_CONNECT),
    (prog::CONNECT6, attach_type::INET6_CONNECT),
];

/// Counter values, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters(pub Vec<(&'static str, u64)>);

impl Counters {
    /// Per-CPU values of one pod, added up slot by slot.
    fn sum<'a>(per_cpu: impl Iterator<Item = &'a PodCounters>) -> Self {
        let mut total = [0u64; counter::COUNT as usize];
        for c in per_cpu {
            for (t, v) in total.iter_mut().zip(c.slots) {
                *t = t.wrapping_add(v);
            }
        }
        Counters(counter::NAMES.iter().copied().zip(total).collect())
    }

    pub fn get(&self, name: &str) -> u64 {
        self.0.iter().find(|(n, _)| *n == name).map(|(_, v)| *v).unwrap_or(0)
    }
}

fn map_err(map: &'static str) -> impl FnOnce(aya::maps::MapError) -> EbpfError {
    move |source| EbpfError::Map { map, source }
}

/// Inserts counters for `key`, zero on every CPU, unless it has some (BPF_NOEXIST): a pod
/// registered again keeps what it has counted. Returns whether it inserted them.
pub(super) fn add_zeroed<M, T>(
    counters: &mut PerCpuHashMap<M, u64, T>,
    name: &'static str,
    key: u64,
) -> Result<bool, EbpfError>
where
    M: std::borrow::BorrowMut<MapData>,
    T: aya::Pod + Default,
{
    const NO_EXIST: u64 = 1;
    let syscall = |call, io_error| EbpfError::Map {
        map: name,
        source: aya::maps::MapError::SyscallError(aya::sys::SyscallError { call, io_error }),
    };
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| syscall("nr_cpus", e))?;
    let zero = PerCpuValues::try_from(vec![T::default(); cpus]).map_err(|e| syscall("per-cpu values", e))?;
    match counters.insert(key, zero, NO_EXIST) {
        Ok(()) => Ok(true),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.kind() == std::io::ErrorKind::AlreadyExists =>
        {
            Ok(false)
        }
        Err(e) => Err(map_err(name)(e)),
    }
}

/// Whether a map call failed only because the key was not there.
pub fn is_not_found(e: &aya::maps::MapError) -> bool {
    match e {
        aya::maps::MapError::KeyNotFound => true,
        aya::maps::MapError::SyscallError(s) => s.io_error.kind() == std::io::ErrorKind::NotFound,
        _ => false,
    }
}

/// The data of the map kinds the capture object has.
fn map_data(m: &Map) -> Option<&MapData> {
    match m {
        Map::HashMap(d)
        | Map::LruHashMap(d)
        | Map::LpmTrie(d)
        | Map::PerCpuArray(d)
        | Map::PerCpuHashMap(d)
        | Map::Array(d)
        | Map::SockHash(d) => Some(d),
        _ => None,
    }
}

fn missing_map(map: &'static str) -> EbpfError {
    EbpfError::MissingMap { object: objects::CAPTURE_NAME, map }
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

    pub(super) fn pod_counters_map_mut(
        &mut self,
    ) -> Result<PerCpuHashMap<&mut MapData, u64, PodCounters>, EbpfError> {
        PerCpuHashMap::try_from(self.get_mut(map::POD_COUNTERS)?).map_err(map_err(map::POD_COUNTERS))
    }

    fn pod_counters_map(&self) -> Result<PerCpuHashMap<&MapData, u64, PodCounters>, EbpfError> {
        PerCpuHashMap::try_from(self.get(map::POD_COUNTERS)?).map_err(map_err(map::POD_COUNTERS))
    }

    /// The descriptor of one of the set's maps, for raw operations (registrations).
    pub fn fd(&self, name: &str) -> Option<BorrowedFd<'_>> {
        self.maps.get(name).and_then(map_data).map(|d| d.fd().as_fd())
    }

    /// A registered pod's config (`None`: not registered).
    pub fn pod_config(&self, netns: u64) -> Result<Option<PodConfig>, EbpfError> {
        let configs: HashMap<_, u64, PodConfig> =
            HashMap::try_from(self.get(map::POD_CONFIG)?).map_err(map_err(map::POD_CONFIG))?;
        match configs.get(&netns, 0) {
            Ok(c) => Ok(Some(c)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(source) => Err(EbpfError::Map { map: map::POD_CONFIG, source }),
        }
    }

    /// What a pod's trie holds for `addr` (longest prefix), as the programs look it up
    /// (the entries of the generation the pod's config names): `v4`/`v6` is one of the
    /// `*_V4`/`*_V6` pairs, picked by the address's family. `None` also for a pod that
    /// is not registered.
    pub fn lookup(
        &self,
        v4: &'static str,
        v6: &'static str,
        netns: u64,
        addr: IpAddr,
    ) -> Result<Option<u8>, EbpfError> {
        let Some(config) = self.pod_config(netns)? else { return Ok(None) };
        let (cookie, generation) = (netns.to_be_bytes(), config.generation.to_be_bytes());
        let found = match addr {
            IpAddr::V4(a) => {
                let trie: LpmTrie<_, CidrV4, u8> = LpmTrie::try_from(self.get(v4)?).map_err(map_err(v4))?;
                let key =
                    Key::new(KEY_PREFIX_BITS + 32, CidrV4 { netns: cookie, generation, addr: a.octets() });
                trie.get(&key, 0).map_err(|e| (v4, e))
            }
            IpAddr::V6(a) => {
                let trie: LpmTrie<_, CidrV6, u8> = LpmTrie::try_from(self.get(v6)?).map_err(map_err(v6))?;
                let key =
                    Key::new(KEY_PREFIX_BITS + 128, CidrV6 { netns: cookie, generation, addr: a.octets() });
                trie.get(&key, 0).map_err(|e| (v6, e))
            }
        };
        match found {
            Ok(v) => Ok(Some(v)),
            Err((_, e)) if is_not_found(&e) => Ok(None),
            Err((map, source)) => Err(EbpfError::Map { map, source }),
        }
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

    /// Every registered pod's decision counters, summed over CPUs.
    pub fn counters_by_pod(&self) -> Result<Vec<(u64, Counters)>, EbpfError> {
        let map = self.pod_counters_map()?;
        let mut out = Vec::new();
        for entry in map.iter() {
            let (netns, per_cpu) = entry.map_err(map_err(map::POD_COUNTERS))?;
            out.push((netns, Counters::sum(per_cpu.iter())));
        }
        Ok(out)
    }

    /// One pod's counters (`None`: the pod has none, i.e. it is not registered).
    pub fn pod_counters(&self, netns: u64) -> Result<Option<Counters>, EbpfError> {
        match self.pod_counters_map()?.get(&netns, 0) {
            Ok(per_cpu) => Ok(Some(Counters::sum(per_cpu.iter()))),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(source) => Err(EbpfError::Map { map: map::POD_COUNTERS, source }),
        }
    }

    /// Every pod's counters added up: the program set's totals.
    pub fn counters(&self) -> Result<Counters, EbpfError> {
        let pods = self.counters_by_pod()?;
        Ok(Counters(
            counter::NAMES
                .iter()
                .enumerate()
                .map(|(i, name)| (*name, pods.iter().map(|(_, c)| c.0[i].1).sum()))
                .collect(),
        ))
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
            let Some(data) = map_data(m) else { continue };
            data.pin(&path).map_err(aya_pin_error(&path))?;
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
        let p: &mut CgroupSock = program(&mut ebpf, prog::SOCK_RELEASE)?;
        p.load().map_err(|source| EbpfError::Verify { program: prog::SOCK_RELEASE, source })?;
        let p: &mut CgroupSkb = program(&mut ebpf, prog::INBOUND_GUARD)?;
        p.load().map_err(|source| EbpfError::Verify { program: prog::INBOUND_GUARD, source })?;
        let p: &mut SkMsg = program(&mut ebpf, prog::SK_MSG)?;
        p.load().map_err(|source| EbpfError::Verify { program: prog::SK_MSG, source })?;
        let maps = MapSet::take(&mut ebpf)?;
        Ok(Self { ebpf, maps, cgroup: PathBuf::new(), links: Vec::new(), sk_msg: None, logger })
    }

    /// Attaches sk_msg to the sockhash (once; sockops registers sockets in the map it
    /// runs on, so this comes before any cgroup hook).
    fn attach_sk_msg(&mut self) -> Result<(), EbpfError> {
        if self.sk_msg.is_some() {
            return Ok(());
        }
        let sock_pairs: SockHash<_, PairKey> =
            SockHash::try_from(self.maps.get(map::SOCK_PAIRS)?).map_err(map_err(map::SOCK_PAIRS))?;
        let fd = sock_pairs
            .fd()
            .try_clone()
            .map_err(|source| EbpfError::Io { what: "duplicate the sockhash fd", source })?;
        let attach_err = |source| EbpfError::Attach {
            program: prog::SK_MSG,
            path: PathBuf::from(map::SOCK_PAIRS),
            source,
        };
        let p: &mut SkMsg = program(&mut self.ebpf, prog::SK_MSG)?;
        let id = p.attach(&fd).map_err(attach_err)?;
        self.sk_msg = Some(p.take_link(id).map_err(attach_err)?);
        Ok(())
    }

    /// Attaches every program: sk_msg to the sockhash, the cgroup hooks to `cgroup`
    /// (refused where the cgroup's ancestors make that unsafe, `ancestors`).
    pub fn attach(&mut self, cgroup: &Path) -> Result<(), EbpfError> {
        let dir = super::open_cgroup2(cgroup)?;
        super::check_ancestors(cgroup)?;
        self.attach_sk_msg()?;
        let attach_err = |program: &'static str| {
            let path = cgroup.to_path_buf();
            move |source| EbpfError::Attach { program, path, source }
        };
        for (name, kind) in cgroup_hooks() {
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
    pub fn register(
        &mut self,
        netns: u64,
        pod: &PodCapture,
        previous: Option<&Registration>,
    ) -> Result<Registration, EbpfError> {
        self.maps.register(netns, pod, previous)
    }

    pub fn unregister(&mut self, netns: u64, registration: Option<&Registration>) -> Result<(), EbpfError> {
        self.maps.unregister(netns, registration)
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

    /// Pins a node program set under `dir`: sk_msg attached to the sockhash, the maps at
    /// `dir/maps/<name>`, the programs at `dir/progs/<name>` (the cgroup hooks last, so
    /// their presence says the set is complete). Nothing is attached to a cgroup.
    pub fn pin_set(mut self, dir: &Path) -> Result<(), EbpfError> {
        self.attach_sk_msg()?;
        create_dir(&dir.join("maps"))?;
        create_dir(&dir.join("progs"))?;
        self.maps.pin(&dir.join("maps"))?;
        for name in SET_PROGRAMS {
            let path = dir.join("progs").join(name);
            self.ebpf
                .program_mut(name)
                .ok_or(EbpfError::MissingProgram { object: objects::CAPTURE_NAME, program: name })?
                .pin(&path)
                .map_err(aya_pin_error(&path))?;
        }
        // The sk_msg attachment lives as long as the (now pinned) sockhash; the log
        // ring buffer as long as the programs that write it.
        std::mem::forget(self.sk_msg.take());
        std::mem::forget(self.logger.take());
        Ok(())
    }
}

/// The capture programs a node program set pins, sk_msg first and the cgroup hooks in
/// attach order after it.
pub const SET_PROGRAMS: &[&str] = &[
    prog::SK_MSG,
    prog::SOCKOPS,
    prog::GETSOCKOPT,
    prog::SOCK_RELEASE,
    prog::INBOUND_GUARD,
    prog::RECVMSG4,
    prog::RECVMSG6,
    prog::SENDMSG4,
    prog::SENDMSG6,
    prog::GETPEERNAME4,
    prog::GETPEERNAME6,
    prog::CONNECT4,
    prog::CONNECT6,
];

/// The hooks a capture attaches to its cgroup besides the sock_addr ones.
const OTHER_CGROUP_HOOKS: [(&str, u32); 4] = [
    (prog::SOCKOPS, attach_type::SOCK_OPS),
    (prog::GETSOCKOPT, attach_type::GETSOCKOPT),
    (prog::SOCK_RELEASE, attach_type::SOCK_RELEASE),
    (prog::INBOUND_GUARD, attach_type::INET_INGRESS),
];

/// How many programs one capture attaches to its cgroup (each once).
pub const CGROUP_HOOKS: usize = OTHER_CGROUP_HOOKS.len() + CGROUP_SOCK_ADDR.len();

/// The attach types of every cgroup hook a capture attaches.
pub fn cgroup_hook_types() -> Vec<u32> {
    cgroup_hooks().into_iter().map(|(_, t)| t).collect()
}

/// The cgroup hooks with their attach types, in attach order: the hooks that rewrite
/// connections last.
pub fn cgroup_hooks() -> Vec<(&'static str, u32)> {
    let mut hooks: Vec<(&'static str, u32)> = OTHER_CGROUP_HOOKS.to_vec();
    hooks.extend_from_slice(CGROUP_SOCK_ADDR);
    hooks
}
