//! The tc inbound classifier on pod interfaces. Per node: [`NodeClassifier`] loads
//! `weir_inbound` once (it finds each pod's config by the frame's destination MAC and
//! IP address), pins it with its maps, and attaches the pinned program to each pod's
//! interface. Per interface: [`InboundProgram`] loads its own copy (`weir_in_pod`) with
//! the config in its own map, for in-process use (foreground mode, tests) and should a
//! kernel refuse the node classifier.

use std::{
    net::IpAddr,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, Map, MapData, PerCpuArray, PerCpuHashMap},
    programs::{
        SchedClassifier, SkLookup, TcAttachType,
        links::FdLink,
        tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    },
};
use weir_ebpf_common::inbound::{self, InboundConfig, InboundCounters, InboundKey, InboundPod, counter};

use super::{
    EbpfError,
    bpffs::{aya_pin_error, create_dir, mount_bpffs, pin_error},
    capture::{Counters, add_zeroed, is_not_found},
    link::{self, CgroupLink},
    netns::in_netns,
    objects,
    registration::{Registration, bytes_of},
};

/// An inbound registration written (see [`NodeClassifier::stage`]).
#[derive(Debug)]
pub struct StagedInbound {
    cookie: u64,
    /// What the pod owns in the classifier's maps now.
    pub registration: Registration,
    /// Each entry written, with what it held before.
    undo: Vec<(InboundKey, Option<InboundPod>)>,
    counters_created: bool,
}

fn map_err(map: &'static str) -> impl FnOnce(aya::maps::MapError) -> EbpfError {
    move |source| EbpfError::Map { map, source }
}

fn missing_map(map: &'static str) -> EbpfError {
    EbpfError::MissingMap { object: objects::INBOUND_NAME, map }
}

fn load_object() -> Result<Ebpf, EbpfError> {
    let data = objects::bytes(objects::INBOUND_NAME, objects::INBOUND)?;
    Ebpf::load(data).map_err(|source| EbpfError::Load { object: objects::INBOUND_NAME, source })
}

fn classifier<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut SchedClassifier, EbpfError> {
    ebpf.program_mut(name)
        .ok_or(EbpfError::MissingProgram { object: objects::INBOUND_NAME, program: name })?
        .try_into()
        .map_err(|source| EbpfError::Verify { program: name, source })
}

fn reopen_hook(ebpf: &mut Ebpf) -> Result<&mut SkLookup, EbpfError> {
    let name = inbound::PROG_REOPEN;
    ebpf.program_mut(name)
        .ok_or(EbpfError::MissingProgram { object: objects::INBOUND_NAME, program: name })?
        .try_into()
        .map_err(|source| EbpfError::Verify { program: name, source })
}

/// Where a pod's socket lookup hook ([`inbound::PROG_REOPEN`]) is pinned: under the
/// pod's capture folder, beside (not in) its cgroup `links`.
pub fn reopen_pin(dir: &Path) -> PathBuf {
    dir.join("netns").join("inbound_reopen")
}

/// Attaches the socket lookup hook `program` to the network namespace at `netns`
/// (refused when `cookie` is given and the path now names another namespace): a
/// bpf_link to the namespace, detached when dropped unpinned and when the namespace
/// goes.
fn reopen_link(
    program: std::os::fd::BorrowedFd<'_>,
    netns: &Path,
    cookie: Option<u64>,
) -> Result<CgroupLink, EbpfError> {
    let attach = || {
        let here = std::fs::File::open("/proc/thread-self/ns/net")?;
        CgroupLink::create(program, here.as_fd(), link::attach_type::SK_LOOKUP)
    };
    let made = match cookie {
        Some(cookie) => super::netns::in_netns_of(netns, cookie, attach),
        None => in_netns(netns, attach),
    };
    made.map_err(|e| EbpfError::Attach {
        program: inbound::PROG_REOPEN,
        path: netns.to_path_buf(),
        source: aya::programs::ProgramError::IOError(e),
    })
}

/// Attaches `classifier` to `interface`'s ingress inside the namespace at `netns`
/// (interface lookups and tc netlink calls happen inside the pod).
fn attach_in(
    classifier: &mut SchedClassifier,
    name: &'static str,
    netns: &Path,
    interface: &str,
) -> Result<SchedClassifierLink, EbpfError> {
    in_netns(netns, || {
        let _ = aya::programs::tc::qdisc_add_clsact(interface);
        let id = classifier.attach(interface, TcAttachType::Ingress).map_err(std::io::Error::other)?;
        classifier.take_link(id).map_err(std::io::Error::other)
    })
    .map_err(|e| EbpfError::Attach {
        program: name,
        path: PathBuf::from(interface),
        source: aya::programs::ProgramError::IOError(e),
    })
}

/// Keeps `link` after this process exits: a TCX link pinned at `path`; a legacy tc
/// filter stays on its own (removed by [`detach_inbound`]).
fn keep(link: SchedClassifierLink, path: &Path) -> Result<(), EbpfError> {
    if <&FdLink>::try_from(&link).is_err() {
        // Dropping a netlink link would detach the filter.
        std::mem::forget(link);
        return Ok(());
    }
    let fd = FdLink::try_from(link).map_err(|e| EbpfError::Pin {
        path: path.display().to_string(),
        source: std::io::Error::other(e.to_string()),
    })?;
    create_dir(path.parent().unwrap_or(path))?;
    fd.pin(path).map(drop).map_err(aya_pin_error(path))
}

/// Slot values added up over CPUs, by name.
fn sum<'a>(per_cpu: impl Iterator<Item = &'a [u64; counter::COUNT as usize]>) -> Counters {
    let mut total = [0u64; counter::COUNT as usize];
    for slots in per_cpu {
        for (t, v) in total.iter_mut().zip(slots) {
            *t = t.wrapping_add(*v);
        }
    }
    Counters(counter::NAMES.iter().copied().zip(total).collect())
}

/// The totals in an `INBOUND_COUNTERS` array (one classifier's, over every pod it serves).
fn totals(map: &Map) -> Result<Counters, EbpfError> {
    let counters: PerCpuArray<_, u64> = PerCpuArray::try_from(map).map_err(map_err(inbound::COUNTERS))?;
    let mut out = Vec::new();
    for (slot, name) in (0..).zip(counter::NAMES) {
        let per_cpu = counters.get(&slot, 0).map_err(map_err(inbound::COUNTERS))?;
        out.push((name, per_cpu.iter().fold(0u64, |t, v| t.wrapping_add(*v))));
    }
    Ok(Counters(out))
}

/// The per-node classifier, pinned in a node program set's folder
/// (`progs/weir_inbound`, `maps/INBOUND_PODS`, `maps/INBOUND_COUNTERS`,
/// `maps/INBOUND_POD_COUNTERS`).
pub struct NodeClassifier {
    set_dir: PathBuf,
}

impl NodeClassifier {
    /// Loads and verifies `weir_inbound`; `None` when this kernel refuses it, with the
    /// reason logged.
    pub fn load() -> Result<Option<Ebpf>, EbpfError> {
        let mut ebpf = load_object()?;
        let loaded = classifier(&mut ebpf, inbound::PROG)?.load();
        let loaded = match loaded {
            Ok(()) => reopen_hook(&mut ebpf)?.load(),
            Err(e) => Err(e),
        };
        match loaded {
            Ok(()) => Ok(Some(ebpf)),
            Err(e) => {
                tracing::info!(
                    program = inbound::PROG,
                    error = %crate::error_chain(&e),
                    "per-node inbound classifier refused; each pod interface gets its own copy"
                );
                Ok(None)
            }
        }
    }

    /// Pins a loaded classifier and its maps under `set_dir`.
    pub fn pin(mut ebpf: Ebpf, set_dir: &Path) -> Result<(), EbpfError> {
        for name in [inbound::PODS, inbound::COUNTERS, inbound::POD_COUNTERS, inbound::REOPENING] {
            let path = set_dir.join("maps").join(name);
            let data = match ebpf.map_mut(name).ok_or_else(|| missing_map(name))? {
                Map::HashMap(d) | Map::PerCpuArray(d) | Map::PerCpuHashMap(d) | Map::SockHash(d) => d,
                _ => return Err(missing_map(name)),
            };
            data.pin(&path).map_err(aya_pin_error(&path))?;
        }
        // The classifier last: its pin is what says the set has one.
        let path = set_dir.join("progs").join(inbound::PROG_REOPEN);
        reopen_hook(&mut ebpf)?.pin(&path).map_err(aya_pin_error(&path))?;
        let path = set_dir.join("progs").join(inbound::PROG);
        classifier(&mut ebpf, inbound::PROG)?.pin(&path).map_err(aya_pin_error(&path))
    }

    /// The classifier pinned under `set_dir`, if the set has one.
    pub fn pinned(set_dir: &Path) -> Option<Self> {
        set_dir.join("progs").join(inbound::PROG).exists().then(|| Self { set_dir: set_dir.to_path_buf() })
    }

    pub fn program_pin(&self) -> PathBuf {
        self.set_dir.join("progs").join(inbound::PROG)
    }

    /// Attaches the set's socket lookup hook to the pod's namespace at `netns` (the one
    /// registered as `cookie`) and pins it at [`reopen_pin`]`(dir)`. A pin there whose
    /// link hooks this namespace is kept; any other is replaced. Returns whether this call attached it (what an undo
    /// may take away again, with [`detach_reopen`]).
    pub fn attach_reopen(&self, netns: &Path, cookie: u64, dir: &Path) -> Result<bool, EbpfError> {
        let pin = reopen_pin(dir);
        // Kept only when it hooks this very namespace (a repair record's folder outlives
        // a sandbox; a link left on the old namespace would serve nothing here).
        let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(netns).map_err(pin_error(netns))?);
        let hooks_this = link::obj_get(&pin)
            .and_then(|fd| super::sys::link_info(fd.as_fd()))
            .is_ok_and(|info| info.link_type == super::sys::link_type::NETNS && info.target == ino);
        if hooks_this {
            return Ok(false);
        }
        let path = self.set_dir.join("progs").join(inbound::PROG_REOPEN);
        let program = link::obj_get(&path).map_err(pin_error(&path))?;
        let made = reopen_link(program.as_fd(), netns, Some(cookie))?;
        create_dir(pin.parent().unwrap_or(dir))?;
        // A pin whose namespace is gone holds a detached link: replaced.
        let _ = std::fs::remove_file(&pin);
        made.pin(&pin).map_err(pin_error(&pin))?;
        Ok(true)
    }

    fn pinned_map(&self, name: &'static str) -> Result<Map, EbpfError> {
        let data = MapData::from_pin(self.set_dir.join("maps").join(name)).map_err(map_err(name))?;
        Map::from_map_data(data).map_err(map_err(name))
    }

    fn pods(&self) -> Result<Map, EbpfError> {
        self.pinned_map(inbound::PODS)
    }

    /// Writes the pod's config for each of its `addresses` on the interface with `mac`
    /// (an entry it had is replaced in place, one update each: never a moment without
    /// one) and gives it counters (kept, with their counts, when it has some). Returns
    /// what the pod owns now and how to take the writes back; entries of a previous
    /// registration that this one lacks are the caller's to remove (after its switch).
    pub fn stage(
        &self,
        cookie: u64,
        mac: [u8; 6],
        addresses: &[IpAddr],
        config: &InboundConfig,
    ) -> Result<StagedInbound, EbpfError> {
        let mut staged = StagedInbound {
            cookie,
            registration: Registration::default(),
            undo: Vec::new(),
            counters_created: false,
        };
        staged.registration.add(inbound::POD_COUNTERS, &cookie.to_ne_bytes());
        let written = (|| {
            staged.counters_created = self.add_counters(cookie)?;
            let mut map = self.pods()?;
            let mut pods: HashMap<_, InboundKey, InboundPod> =
                HashMap::try_from(&mut map).map_err(map_err(inbound::PODS))?;
            for addr in addresses {
                let mut key = InboundKey { mac, _pad: [0; 2], addr: [0; 16] };
                match addr {
                    IpAddr::V4(a) => key.addr[..4].copy_from_slice(&a.octets()),
                    IpAddr::V6(a) => key.addr = a.octets(),
                }
                let before = match pods.get(&key, 0) {
                    Ok(v) => Some(v),
                    Err(e) if is_not_found(&e) => None,
                    Err(source) => return Err(EbpfError::Map { map: inbound::PODS, source }),
                };
                // Another registered pod's entry is not ours to take (its inbound would
                // then follow our config); a gone pod's leftover is.
                if let Some(owner) = before.map(|v| v.netns).filter(|o| *o != cookie)
                    && self.pod_counters(owner)?.is_some()
                {
                    return Err(EbpfError::AddressTaken {
                        address: *addr,
                        mac: mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":"),
                        owner,
                    });
                }
                pods.insert(key, InboundPod { netns: cookie, config: *config }, 0)
                    .map_err(map_err(inbound::PODS))?;
                staged.undo.push((key, before));
                staged.registration.add(inbound::PODS, &bytes_of(&key));
            }
            Ok(())
        })();
        match written {
            Ok(()) => Ok(staged),
            Err(e) => {
                self.abort(staged);
                Err(e)
            }
        }
    }

    /// Takes back what [`NodeClassifier::stage`] wrote: entries as they were, counters
    /// created by it removed.
    pub fn abort(&self, staged: StagedInbound) {
        let restored = (|| {
            let mut map = self.pods()?;
            let mut pods: HashMap<_, InboundKey, InboundPod> =
                HashMap::try_from(&mut map).map_err(map_err(inbound::PODS))?;
            for (key, before) in staged.undo.iter().rev() {
                let r = match before {
                    Some(v) => pods.insert(*key, *v, 0),
                    None => pods.remove(key),
                };
                if let Err(e) = r.or_else(|e| if is_not_found(&e) { Ok(()) } else { Err(e) }) {
                    return Err(EbpfError::Map { map: inbound::PODS, source: e });
                }
            }
            if staged.counters_created {
                let mut map = self.pinned_map(inbound::POD_COUNTERS)?;
                let mut counters: PerCpuHashMap<_, u64, InboundCounters> =
                    PerCpuHashMap::try_from(&mut map).map_err(map_err(inbound::POD_COUNTERS))?;
                let _ = counters.remove(&staged.cookie);
            }
            Ok(())
        })();
        if let Err(e) = restored {
            tracing::error!(netns_cookie = staged.cookie, error = %crate::error_chain(&e), "inbound registration not taken back");
        }
    }

    /// The descriptor of one of the classifier's pinned maps (raw operations).
    pub fn map_fd(&self, name: &str) -> Option<std::os::fd::OwnedFd> {
        crate::capture::ebpf::sys::obj_get(&self.set_dir.join("maps").join(name)).ok()
    }

    fn add_counters(&self, cookie: u64) -> Result<bool, EbpfError> {
        let mut map = self.pinned_map(inbound::POD_COUNTERS)?;
        let mut counters: PerCpuHashMap<_, u64, InboundCounters> =
            PerCpuHashMap::try_from(&mut map).map_err(map_err(inbound::POD_COUNTERS))?;
        add_zeroed(&mut counters, inbound::POD_COUNTERS, cookie)
    }

    /// Removes what was registered for `cookie`, its counters included (missing is
    /// fine).
    pub fn unregister(&self, cookie: u64) -> Result<(), EbpfError> {
        self.remove_keys(cookie)?;
        let mut map = self.pinned_map(inbound::POD_COUNTERS)?;
        let mut counters: PerCpuHashMap<_, u64, InboundCounters> =
            PerCpuHashMap::try_from(&mut map).map_err(map_err(inbound::POD_COUNTERS))?;
        match counters.remove(&cookie) {
            Err(e) if !is_not_found(&e) => Err(EbpfError::Map { map: inbound::POD_COUNTERS, source: e }),
            _ => Ok(()),
        }
    }

    /// One pod's inbound decisions (`None`: it has no counters here, i.e. it is not
    /// registered with this classifier).
    pub fn pod_counters(&self, cookie: u64) -> Result<Option<Counters>, EbpfError> {
        let map = self.pinned_map(inbound::POD_COUNTERS)?;
        let counters: PerCpuHashMap<_, u64, InboundCounters> =
            PerCpuHashMap::try_from(&map).map_err(map_err(inbound::POD_COUNTERS))?;
        match counters.get(&cookie, 0) {
            Ok(per_cpu) => Ok(Some(sum(per_cpu.iter().map(|c| &c.slots)))),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(source) => Err(EbpfError::Map { map: inbound::POD_COUNTERS, source }),
        }
    }

    /// One pod's inbound config (`None`: it has no inbound registration here).
    pub fn pod_config(&self, cookie: u64) -> Result<Option<InboundConfig>, EbpfError> {
        let map = self.pods()?;
        let pods: HashMap<_, InboundKey, InboundPod> =
            HashMap::try_from(&map).map_err(map_err(inbound::PODS))?;
        for entry in pods.iter() {
            let (_, pod) = entry.map_err(map_err(inbound::PODS))?;
            if pod.netns == cookie {
                return Ok(Some(pod.config));
            }
        }
        Ok(None)
    }

    /// The pod's config entries (one per address) go; its counters stay. A scan of the
    /// node-wide map: only for pods recorded without a registration (older records).
    fn remove_keys(&self, cookie: u64) -> Result<(), EbpfError> {
        let mut map = self.pods()?;
        let mut pods: HashMap<_, InboundKey, InboundPod> =
            HashMap::try_from(&mut map).map_err(map_err(inbound::PODS))?;
        let keys: Vec<InboundKey> =
            pods.iter().filter_map(Result::ok).filter(|(_, v)| v.netns == cookie).map(|(k, _)| k).collect();
        for key in keys {
            match pods.remove(&key) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(source) => return Err(EbpfError::Map { map: inbound::PODS, source }),
            }
        }
        Ok(())
    }

    /// Attaches the pinned classifier to `interface` in `netns` and keeps it there: a tc
    /// filter (netlink, no grace period to wait for) at Weir's own priority and handle,
    /// removed with [`detach_inbound`] or with the interface. Idempotent: a filter of
    /// this program already there is kept; one of another Weir program at Weir's
    /// handle is replaced in one netlink call; Weir filters elsewhere (from builds that
    /// let the kernel choose) go once this one is in place, so the interface is never
    /// without one and never runs two.
    ///
    /// `cookie`: the namespace the pod was registered under; the visit is refused if
    /// `netns` names another one by now.
    /// Returns whether the interface had no Weir filter before (one this call added,
    /// which an undo may take away again).
    pub fn attach(&self, netns: &Path, cookie: u64, interface: &str) -> Result<bool, EbpfError> {
        // Through its info, not `SchedClassifier::from_pin`: that reads the program's
        // name as a string, which makes aya probe the kernel's features first (nine BTF
        // loads, five program loads, three maps and a link: about a fifth of a pod's
        // registration in the CNI plugin, which runs once per pod). The program is then
        // reopened by its id, which takes CAP_SYS_ADMIN: every caller has it (the plugin,
        // the node agent, `weir capture`), as entering the pod's namespace needs it too.
        let path = self.program_pin();
        let open = |source| EbpfError::OpenPinned { program: inbound::PROG, path: path.clone(), source };
        let info = aya::programs::ProgramInfo::from_pin(&path).map_err(open)?;
        let prog_id = info.id();
        let mut program = SchedClassifier::from_program_info(info, std::borrow::Cow::Borrowed(inbound::PROG))
            .map_err(open)?;
        let attach_err = |e: std::io::Error| EbpfError::Attach {
            program: inbound::PROG,
            path: PathBuf::from(interface),
            source: aya::programs::ProgramError::IOError(e),
        };
        // One visit to the namespace reads its filters and attaches.
        let attached = super::netns::in_netns_of(netns, cookie, || {
            // Filters hang off the clsact (or ingress) qdisc: when this call creates it
            // (exclusively), the interface had none, so no filter to keep or replace
            // (every new pod), and the listing is spared.
            let filters = match aya::programs::tc::qdisc_add_clsact(interface) {
                Ok(()) => Vec::new(),
                Err(aya::programs::tc::TcError::NetlinkError(e))
                    if e.raw_os_error() == Some(libc::EEXIST) =>
                {
                    weir_filters(interface)?
                }
                Err(e) => return Err(std::io::Error::other(e)),
            };
            let ours = |f: &&weir_iptables::netlink::BpfFilter| {
                (f.priority, f.handle) == (FILTER_PRIORITY, FILTER_HANDLE)
            };
            if filters.iter().filter(ours).any(|f| f.prog_id == prog_id) {
                return Ok(false);
            }
            let ours_taken = filters.iter().any(|f| ours(&f));
            let id = if ours_taken {
                let link = SchedClassifierLink::attached(
                    interface,
                    TcAttachType::Ingress,
                    FILTER_PRIORITY,
                    TcHandle::from(FILTER_HANDLE),
                    None,
                )?;
                program.attach_to_link(link)
            } else {
                program.attach_with_options(
                    interface,
                    TcAttachType::Ingress,
                    TcAttachOptions::Netlink(NlOptions {
                        priority: FILTER_PRIORITY,
                        handle: TcHandle::from(FILTER_HANDLE),
                        ..NlOptions::default()
                    }),
                )
            }
            .map_err(std::io::Error::other)?;
            // Dropping a netlink link would detach the filter: it stays on its own.
            std::mem::forget(program.take_link(id).map_err(std::io::Error::other)?);
            // Filters of Weir's programs at other places (kernel-chosen) go now.
            for f in filters.iter().filter(|f| (f.priority, f.handle) != (FILTER_PRIORITY, FILTER_HANDLE)) {
                let stale = SchedClassifierLink::attached(
                    interface,
                    TcAttachType::Ingress,
                    f.priority,
                    TcHandle::from(f.handle),
                    None,
                )?;
                if let Err(e) = aya::programs::links::Link::detach(stale) {
                    tracing::warn!(interface, priority = f.priority, error = %e, "an older Weir inbound filter not removed");
                }
            }
            Ok(filters.is_empty())
        });
        // A legacy filter holds the program itself; the handle must not detach it.
        std::mem::forget(program);
        attached.map_err(attach_err)
    }
}

/// Takes a pod's socket lookup hook away (its pin under `dir`; missing is fine).
pub fn detach_reopen(dir: &Path) {
    let _ = std::fs::remove_file(reopen_pin(dir));
    let _ = std::fs::remove_dir(dir.join("netns"));
}

/// Weir's tc filter on a pod interface: its priority and handle ('WE' and 'WEIR').
pub const FILTER_PRIORITY: u16 = 0x5745;
pub const FILTER_HANDLE: u32 = 0x5745_4952;

/// Weir's bpf filters on `interface`'s ingress (programs named as Weir's classifiers),
/// in the calling thread's namespace.
pub fn weir_filters(interface: &str) -> std::io::Result<Vec<weir_iptables::netlink::BpfFilter>> {
    let filters =
        weir_iptables::netlink::ingress_bpf_filters_blocking(interface).map_err(std::io::Error::other)?;
    Ok(filters.into_iter().filter(|f| inbound::PROGS.iter().any(|p| f.name == *p)).collect())
}

/// The tc inbound classifier attached to one pod interface (its own loaded copy and
/// config). Dropping it detaches the classifier.
pub struct InboundProgram {
    ebpf: Option<Ebpf>,
    netns: PathBuf,
    link: Option<SchedClassifierLink>,
    /// The namespace's socket lookup hook (see [`NodeClassifier::attach_reopen`]).
    reopen: Option<CgroupLink>,
}

impl InboundProgram {
    /// Loads a copy of the classifier with `config` and attaches it to `interface`'s
    /// ingress inside the namespace at `netns`.
    pub fn attach(netns: &Path, interface: &str, config: &InboundConfig) -> Result<Self, EbpfError> {
        let mut ebpf = load_object()?;
        {
            let mut cfg: Array<_, InboundConfig> =
                Array::try_from(ebpf.map_mut(inbound::CONFIG).ok_or_else(|| missing_map(inbound::CONFIG))?)
                    .map_err(map_err(inbound::CONFIG))?;
            cfg.set(0, config, 0).map_err(map_err(inbound::CONFIG))?;
        }
        let hook = reopen_hook(&mut ebpf)?;
        hook.load().map_err(|source| EbpfError::Verify { program: inbound::PROG_REOPEN, source })?;
        let hook_fd =
            hook.fd().map_err(|source| EbpfError::Verify { program: inbound::PROG_REOPEN, source })?;
        // The lookup hook first: the classifier relies on it from its first SYN.
        let reopen = reopen_link(hook_fd.as_fd(), netns, None)?;
        let program = classifier(&mut ebpf, inbound::PROG_POD)?;
        program.load().map_err(|source| EbpfError::Verify { program: inbound::PROG_POD, source })?;
        let link = attach_in(program, inbound::PROG_POD, netns, interface)?;
        Ok(Self { ebpf: Some(ebpf), netns: netns.to_path_buf(), link: Some(link), reopen: Some(reopen) })
    }

    /// The tc verdict this classifier gives `frame` (a whole Ethernet frame), run in
    /// the caller's namespace and sent nowhere: `TC_ACT_OK` (0) passes, `TC_ACT_SHOT`
    /// (2) drops.
    pub fn verdict(&self, frame: &[u8]) -> Result<u32, EbpfError> {
        let ebpf = self.ebpf.as_ref().expect("loaded until pinned");
        let program: &SchedClassifier = ebpf
            .program(inbound::PROG_POD)
            .and_then(|p| p.try_into().ok())
            .ok_or(EbpfError::MissingProgram { object: objects::INBOUND_NAME, program: inbound::PROG_POD })?;
        let fd = program.fd().map_err(|source| EbpfError::Verify { program: inbound::PROG_POD, source })?;
        super::sys::prog_test_run(fd.as_fd(), frame)
            .map_err(|source| EbpfError::Io { what: "run the inbound classifier on a frame", source })
    }

    /// This interface's inbound decisions so far (its one pod's).
    pub fn counters(&self) -> Result<Counters, EbpfError> {
        let ebpf = self.ebpf.as_ref().expect("loaded until pinned");
        totals(ebpf.map(inbound::COUNTERS).ok_or_else(|| missing_map(inbound::COUNTERS))?)
    }

    /// Keeps the classifier attached after this process exits: a TCX link is pinned at
    /// `dir/links/inbound` (and its counters and config at `dir/maps/INBOUND_COUNTERS`
    /// and `dir/maps/INBOUND_CONFIG`); a legacy tc filter simply stays (removed by
    /// [`detach_inbound`]).
    pub fn pin(mut self, dir: &Path) -> Result<(), EbpfError> {
        mount_bpffs()?;
        create_dir(&dir.join("maps"))?;
        let mut ebpf = self.ebpf.take().expect("loaded until pinned");
        for name in [inbound::COUNTERS, inbound::CONFIG] {
            if let Some(Map::PerCpuArray(data) | Map::Array(data)) = ebpf.map_mut(name) {
                let path = dir.join("maps").join(name);
                data.pin(&path).map_err(aya_pin_error(&path))?;
            }
        }
        if let Some(reopen) = self.reopen.take() {
            let pin = reopen_pin(dir);
            create_dir(pin.parent().unwrap_or(dir))?;
            reopen.pin(&pin).map_err(pin_error(&pin))?;
        }
        let link = self.link.take().expect("attached until pinned");
        keep(link, &dir.join("links").join("inbound"))?;
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

/// Removes a legacy (netlink) inbound classifier from `interface` in `netns`, only when
/// that namespace is still the pod's (cookie `cookie`): a recorded path may name another
/// pod's namespace by now, whose filter is not ours to take. A pinned TCX link is
/// removed with the pin directory.
pub fn detach_inbound(netns: Option<&Path>, interface: &str, cookie: u64) {
    let detach = || {
        if super::netns::netns_cookie(None)? != cookie {
            tracing::warn!(interface, netns = ?netns, cookie, "inbound filter left alone: the namespace is another pod's now");
            return Ok(());
        }
        for name in inbound::PROGS {
            let _ = aya::programs::tc::qdisc_detach_program(interface, TcAttachType::Ingress, name);
        }
        Ok(())
    };
    let _ = match netns {
        Some(path) if path.exists() => in_netns(path, detach),
        Some(_) => Ok(()),
        None => detach(),
    };
}

/// The totals of the inbound classifier pinned under `dir` (a node set's, or a pod's
/// own copy, whose totals are its pod's); `None` when none is pinned there.
pub fn pinned_totals(dir: &Path) -> Option<Result<Counters, EbpfError>> {
    let path = dir.join("maps").join(inbound::COUNTERS);
    if !path.exists() {
        return None;
    }
    Some(
        MapData::from_pin(&path)
            .and_then(Map::from_map_data)
            .map_err(map_err(inbound::COUNTERS))
            .and_then(|m| totals(&m)),
    )
}

/// One pod's inbound config: registered with the node classifier in its program set
/// (`set_dir`), or its own copy's under `pin_dir`. `None`: the pod has no inbound
/// capture.
pub fn pod_config(set_dir: &Path, pin_dir: &Path, cookie: u64) -> Result<Option<InboundConfig>, EbpfError> {
    if let Some(classifier) = NodeClassifier::pinned(set_dir)
        && let Some(config) = classifier.pod_config(cookie)?
    {
        return Ok(Some(config));
    }
    let path = pin_dir.join("maps").join(inbound::CONFIG);
    if !path.exists() {
        return Ok(None);
    }
    let map = MapData::from_pin(&path).and_then(Map::from_map_data).map_err(map_err(inbound::CONFIG))?;
    let config: Array<_, InboundConfig> = Array::try_from(&map).map_err(map_err(inbound::CONFIG))?;
    config.get(&0, 0).map(Some).map_err(map_err(inbound::CONFIG))
}

/// One pod's inbound decisions: from the node classifier in its program set
/// (`set_dir`), by its netns `cookie`, or else from its own copy's totals under
/// `pin_dir`. `None`: the pod has no inbound capture.
pub fn pod_counters(set_dir: &Path, pin_dir: &Path, cookie: u64) -> Option<Result<Counters, EbpfError>> {
    let node = NodeClassifier::pinned(set_dir);
    if let Some(classifier) = &node
        && set_dir.join("maps").join(inbound::POD_COUNTERS).exists()
    {
        match classifier.pod_counters(cookie) {
            Ok(Some(c)) => return Some(Ok(c)),
            Ok(None) => {}
            Err(e) => return Some(Err(e)),
        }
    }
    // A node classifier's totals are every pod's, never one pod's.
    if node.is_some() && set_dir == pin_dir {
        return None;
    }
    pinned_totals(pin_dir)
}
