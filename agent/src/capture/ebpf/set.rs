//! The node program set: Weir's capture programs loaded and verified once per node and
//! pinned under `/sys/fs/bpf/weir/programs/<key>/` (`progs/`, and the `maps/` they
//! share), so every later pod, in init-container mode or through the CNI plugin, only
//! opens the pins, creates links on its cgroup (or interface) and writes its cookie and
//! config. The key is Weir's version and a digest of the eBPF objects: another build's
//! programs are never reused, and its pods keep their own set until they go.
//!
//! A flock on the set's folder serialises loading, pinning, registering and removal, so
//! pods starting together load once and never see a half-pinned set. A set is removed
//! when nothing uses it: no pod registered in its maps and no pinned link to one of
//! its programs.

use std::{
    collections::BTreeMap,
    fs::File,
    os::{
        fd::{AsFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    path::{Path, PathBuf},
    sync::Mutex,
};

use aya::Ebpf;
use nix::fcntl::{Flock, FlockArg};

use super::{
    EbpfError,
    bpffs::{PIN_ROOT, create_dir, mount_bpffs, pin_error, remove_empty_parents},
    capture::{CapturePrograms, MapSet, SET_PROGRAMS, cgroup_hooks},
    config::PodCapture,
    inbound::{InboundProgram, NodeClassifier},
    link::{self, CgroupLink},
    netns,
    registration::Registration,
    sys,
};

/// The interface a pod's inbound classifier runs on, in the pod's namespace, and its
/// hardware address (the classifier's key) when the caller has read it already.
#[derive(Debug, Clone, Copy)]
pub struct PodInterface<'a> {
    pub netns: &'a Path,
    pub name: &'a str,
    pub mac: Option<[u8; 6]>,
}

impl PodInterface<'_> {
    fn mac(&self) -> std::io::Result<[u8; 6]> {
        match self.mac {
            Some(mac) => Ok(mac),
            None => netns::interface_mac(self.netns, self.name),
        }
    }
}

/// Where node program sets live, one folder per key.
pub const PROGRAMS_DIR: &str = "/sys/fs/bpf/weir/programs";

/// A suffix for the set's key, to keep separate sets side by side on one node (the
/// tests use it to own theirs). Empty or unset: the key alone.
pub const SET_ENV: &str = "WEIR_EBPF_PROGRAM_SET";

/// The key of a set of programs built from `objects` by Weir `version`: the version
/// (dots as underscores: bpffs refuses names with a dot), then the first 12 hex digits
/// of a SHA-256 over the objects.
pub fn key_of(version: &str, objects: &[&[u8]]) -> String {
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    for object in objects {
        digest.update(&(object.len() as u64).to_le_bytes());
        digest.update(object);
    }
    let hex: String = digest.finish().as_ref()[..6].iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{hex}", version.replace('.', "_"))
}

/// This binary's key ([`key_of`] its version and objects, the objects' digest taken by
/// build.rs: hashing them here cost every CNI plugin run a megabyte of SHA-256), with
/// [`SET_ENV`]'s suffix.
pub fn version_key() -> String {
    let key = built_key();
    let suffix: String = std::env::var(SET_ENV)
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
        .collect();
    if suffix.is_empty() { key } else { format!("{key}-{suffix}") }
}

/// [`key_of`] this binary's version and objects, from the digest build.rs took.
fn built_key() -> String {
    format!(
        "{}-{}",
        crate::support::build_info::BUILD_INFO.version.replace('.', "_"),
        env!("WEIR_EBPF_OBJECTS_DIGEST")
    )
}

/// The folder of the set `key`.
pub fn set_dir(key: &str) -> PathBuf {
    Path::new(PROGRAMS_DIR).join(key)
}

/// Whether the set `key` is pinned completely (every capture program, pinned last, and
/// every map; a set missing either is loaded again, not opened).
pub fn present(key: &str) -> bool {
    complete(&set_dir(key))
}

fn complete(dir: &Path) -> bool {
    // One listing per folder, not a lookup per pin (the CNI plugin asks once per pod).
    let names = |sub: &str| -> std::collections::BTreeSet<std::ffi::OsString> {
        std::fs::read_dir(dir.join(sub))
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default()
    };
    let (progs, maps) = (names("progs"), names("maps"));
    SET_PROGRAMS.iter().all(|p| progs.contains(std::ffi::OsStr::new(p)))
        && weir_ebpf_common::capture::map::ALL.iter().all(|m| maps.contains(std::ffi::OsStr::new(m)))
}

/// Programs loaded and verified but not pinned yet: what detection loaded, kept for the
/// set this process pins next, so one process never verifies the programs twice.
struct Loaded {
    capture: CapturePrograms,
    inbound: Option<Ebpf>,
}

static PRELOADED: Mutex<Option<Loaded>> = Mutex::new(None);

impl Loaded {
    fn load() -> Result<Self, EbpfError> {
        let capture = CapturePrograms::load()?;
        let inbound = NodeClassifier::load()?;
        tracing::info!(node_classifier = inbound.is_some(), "eBPF capture programs loaded and verified");
        Ok(Self { capture, inbound })
    }

    fn take_or_load() -> Result<Self, EbpfError> {
        match PRELOADED.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(loaded) => Ok(loaded),
            None => Self::load(),
        }
    }

    fn pin(self, dir: &Path) -> Result<(), EbpfError> {
        if let Some(inbound) = self.inbound {
            create_dir(&dir.join("maps"))?;
            create_dir(&dir.join("progs"))?;
            NodeClassifier::pin(inbound, dir)?;
        }
        self.capture.pin_set(dir)
    }
}

/// Whether this kernel runs the capture programs: true at once when this binary's set
/// is pinned (the kernel verified it already), else after loading them, which are then
/// kept for the set this process pins next.
pub fn verify_once() -> Result<(), EbpfError> {
    if present(&version_key()) {
        return Ok(());
    }
    let mut slot = PRELOADED.lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        *slot = Some(Loaded::load()?);
    }
    Ok(())
}

/// Locks the folder of set `key`, creating it when `create`; `None` when it does not
/// exist and is not to be created. A folder removed while we waited for it is not the
/// set any more: then we start over.
fn lock(key: &str, create: bool) -> Result<Option<(PathBuf, Flock<File>)>, EbpfError> {
    let dir = set_dir(key);
    loop {
        if create {
            mount_bpffs()?;
            create_dir(&dir)?;
        }
        let file = match File::open(&dir) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !create => return Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(pin_error(&dir)(e)),
        };
        let locked = Flock::lock(file, FlockArg::LockExclusive)
            .map_err(|(_, e)| pin_error(&dir)(std::io::Error::from(e)))?;
        let held = locked.metadata().map_err(pin_error(&dir))?;
        match std::fs::metadata(&dir) {
            Ok(now) if (now.dev(), now.ino()) == (held.dev(), held.ino()) => return Ok(Some((dir, locked))),
            Ok(_) => continue,
            Err(_) if create => continue,
            Err(_) => return Ok(None),
        }
    }
}

/// A program set's folder, locked while this value lives, whatever Weir build pinned
/// it: what removing a pod's registration, counting its pods and removing the set
/// need, through raw keys and whatever pins the folder holds. A newer build uses this
/// on an older build's set, whose layout it need not know.
pub struct LockedSet {
    key: String,
    dir: PathBuf,
    _lock: Flock<File>,
}

impl LockedSet {
    /// The set `key` if its folder exists (complete or not); never creates it.
    pub fn open(key: &str) -> Result<Option<Self>, EbpfError> {
        Ok(lock(key, false)?.map(|(dir, lock)| Self { key: key.to_string(), dir, _lock: lock }))
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// One of the set's pinned maps, opened (`None`: the set has no such map).
    pub fn map_fd(&self, name: &str) -> Option<OwnedFd> {
        link::obj_get(&self.dir.join("maps").join(name)).ok()
    }

    /// Removes exactly what `registration` wrote in this set.
    pub fn unregister(&self, registration: &Registration) -> Result<(), EbpfError> {
        let fds: BTreeMap<String, OwnedFd> =
            registration.keys.keys().filter_map(|name| Some((name.clone(), self.map_fd(name)?))).collect();
        registration.remove(|name| fds.get(name).map(|fd| fd.as_fd()))
    }

    /// How many pods are registered in the set's maps (its POD_CONFIG's entries).
    pub fn pod_count(&self) -> Result<usize, EbpfError> {
        let name = weir_ebpf_common::capture::map::POD_CONFIG;
        let Some(fd) = self.map_fd(name) else { return Ok(0) };
        let count = sys::count_entries(fd.as_fd())
            .map_err(|source| EbpfError::Io { what: "count the pods registered in a program set", source })?;
        Ok(count as usize)
    }

    /// The network-namespace cookies registered in the set's maps (its POD_CONFIG's
    /// keys, read raw: any build's set).
    pub fn pod_cookies(&self) -> Result<Vec<u64>, EbpfError> {
        let Some(fd) = self.map_fd(weir_ebpf_common::capture::map::POD_CONFIG) else { return Ok(Vec::new()) };
        let keys = sys::keys_raw(fd.as_fd(), 8)
            .map_err(|source| EbpfError::Io { what: "list the pods registered in a program set", source })?;
        Ok(keys.iter().filter_map(|k| Some(u64::from_ne_bytes(k.as_slice().try_into().ok()?))).collect())
    }

    /// Kernel ids of every program pinned in the set; `None` when a pin cannot be read
    /// (then whether a link runs one of them cannot be told).
    fn program_ids(&self) -> Option<Vec<u32>> {
        let Ok(entries) = std::fs::read_dir(self.dir.join("progs")) else { return Some(Vec::new()) };
        entries
            .flatten()
            .map(|e| link::obj_get(&e.path()).ok().and_then(|fd| link::prog_id(fd.as_fd()).ok()))
            .collect()
    }

    /// Whether anything uses the set: a pod registered in its maps, or a pinned link
    /// (under any capture's `links/`) to one of its programs. What cannot be read
    /// counts as a use: a set is removed only when it is known unused.
    pub fn in_use(&self) -> Result<bool, EbpfError> {
        if self.pod_count()? > 0 {
            return Ok(true);
        }
        let Some(ids) = self.program_ids() else { return Ok(true) };
        let Ok(captures) = std::fs::read_dir(PIN_ROOT) else { return Ok(false) };
        for capture in captures.flatten().filter(|e| e.file_name() != "programs") {
            let Ok(links) = std::fs::read_dir(capture.path().join("links")) else { continue };
            for pin in links.flatten() {
                let fd = match link::obj_get(&pin.path()) {
                    Ok(fd) => fd,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(_) => return Ok(true),
                };
                // A pin that is no link (a map put there by hand) runs no program.
                if link::link_prog_id(fd.as_fd()).is_ok_and(|id| ids.contains(&id)) {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Removes the set if nothing uses it (see [`LockedSet::in_use`]); returns whether it
    /// did. The lock is released either way.
    pub fn release(self) -> Result<bool, EbpfError> {
        if self.in_use()? {
            return Ok(false);
        }
        clear(&self.dir)?;
        std::fs::remove_dir(&self.dir).map_err(pin_error(&self.dir))?;
        tracing::info!(program_set = %self.key, "eBPF program set removed: no pod uses it");
        drop(self);
        remove_empty_parents(Path::new(PROGRAMS_DIR));
        Ok(true)
    }
}

/// One node program set of this Weir build, open and locked while this value lives.
pub struct NodePrograms {
    set: LockedSet,
    maps: MapSet,
    inbound: Option<NodeClassifier>,
    /// The node classifier's maps, open for raw operations (registrations).
    inbound_maps: BTreeMap<&'static str, OwnedFd>,
}

impl NodePrograms {
    /// This binary's set, loaded and pinned first if the node does not have it.
    pub fn acquire() -> Result<Self, EbpfError> {
        Self::acquire_key(&version_key())
    }

    /// The set `key`, with this binary's programs loaded and pinned under it first if
    /// it is not there (or only half there, after a crash).
    pub fn acquire_key(key: &str) -> Result<Self, EbpfError> {
        let (dir, lock) = lock(key, true)?.expect("created");
        let held = LockedSet { key: key.to_string(), dir, _lock: lock };
        if complete(&held.dir) {
            tracing::debug!(program_set = key, "eBPF program set reused");
        } else {
            // A half-pinned set is cleared and pinned again only when nothing uses it:
            // the programs attached links run, and the maps registered pods are in,
            // would otherwise be cut off from every later change.
            if held.in_use()? {
                return Err(EbpfError::Pin {
                    path: held.dir.display().to_string(),
                    source: std::io::Error::other(
                        "the program set is missing pins while captures still use it: not loaded again \
                         (remove those captures, e.g. `weir capture clean --all`, then capture again)",
                    ),
                });
            }
            let dir = &held.dir;
            clear(dir)?;
            if let Err(e) = Loaded::take_or_load().and_then(|loaded| loaded.pin(dir)) {
                // Nothing half pinned stays behind, nor an empty folder.
                let _ = clear(dir);
                let _ = std::fs::remove_dir(dir);
                return Err(e);
            }
            tracing::info!(program_set = key, dir = %dir.display(), "eBPF program set loaded, verified and pinned");
        }
        let LockedSet { dir, _lock: lock, .. } = held;
        Self::open(key, dir, lock)
    }

    /// The set `key` if it is pinned; never loads anything.
    pub fn open_existing(key: &str) -> Result<Option<Self>, EbpfError> {
        match lock(key, false)? {
            Some((dir, lock)) if complete(&dir) => Self::open(key, dir, lock).map(Some),
            _ => Ok(None),
        }
    }

    /// Opens the set's maps (its programs are opened when used: registering a pod, what
    /// the CNI plugin does once per pod, needs none of them).
    fn open(key: &str, dir: PathBuf, lock: Flock<File>) -> Result<Self, EbpfError> {
        let maps = MapSet::open_pinned(&dir)?;
        let inbound = NodeClassifier::pinned(&dir);
        let mut inbound_maps = BTreeMap::new();
        if inbound.is_some() {
            for name in [weir_ebpf_common::inbound::PODS, weir_ebpf_common::inbound::POD_COUNTERS] {
                let path = dir.join("maps").join(name);
                inbound_maps.insert(name, link::obj_get(&path).map_err(pin_error(&path))?);
            }
        }
        let set = LockedSet { key: key.to_string(), dir, _lock: lock };
        Ok(Self { set, maps, inbound, inbound_maps })
    }

    pub fn key(&self) -> &str {
        &self.set.key
    }

    pub fn dir(&self) -> &Path {
        &self.set.dir
    }

    /// Any of the set's maps by name, for raw operations.
    fn fd(&self, name: &str) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.maps.fd(name).or_else(|| self.inbound_maps.get(name).map(|fd| fd.as_fd()))
    }

    pub fn maps(&self) -> &MapSet {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut MapSet {
        &mut self.maps
    }

    /// One of the set's capture programs, opened from its pin.
    fn program(&self, name: &str) -> Result<OwnedFd, EbpfError> {
        let path = self.set.dir.join("progs").join(name);
        link::obj_get(&path).map_err(pin_error(&path))
    }

    /// Kernel ids of the set's capture programs, by name.
    pub fn program_ids(&self) -> Result<BTreeMap<&'static str, u32>, EbpfError> {
        let mut out = BTreeMap::new();
        for name in SET_PROGRAMS {
            let id = link::prog_id(self.program(name)?.as_fd())
                .map_err(|source| EbpfError::Io { what: "read a program's id", source })?;
            out.insert(*name, id);
        }
        Ok(out)
    }

    /// Makes every cgroup hook of the set run on `cgroup` through a link pinned at
    /// `dir/links/<hook>`, and returns the hooks attached now. A pin already there that
    /// attaches this set's program to `cgroup` is kept (a hook that runs never stops);
    /// one whose link is detached (`bpftool link detach`, its cgroup removed) captures
    /// nothing and is replaced; one holding anything else is refused before anything is
    /// attached ([`EbpfError::ForeignPin`]). On failure only what this call attached
    /// and pinned goes: a pin it found is never removed.
    pub fn ensure_cgroup(&self, cgroup: &Path, dir: &Path) -> Result<Vec<&'static str>, EbpfError> {
        let (target, wanted) = self.cgroup_plan(cgroup, dir)?;
        // Hooks to attach: what the cgroup's ancestors run must leave that safe.
        if !wanted.is_empty() {
            super::check_ancestors(cgroup)?;
        }
        let links_dir = dir.join("links");
        // Every link first (dropped unpinned on failure: detached again), then the pins.
        let mut links: Vec<(&'static str, bool, CgroupLink)> = Vec::new();
        for (name, kind, program, replaces_dead) in wanted {
            let link =
                CgroupLink::create(program.as_fd(), target.as_fd(), kind).map_err(|e| EbpfError::Attach {
                    program: name,
                    path: cgroup.to_path_buf(),
                    source: aya::programs::ProgramError::IOError(e),
                })?;
            links.push((name, replaces_dead, link));
        }
        if links.is_empty() {
            return Ok(Vec::new());
        }
        let (made_parent, made_dir) = (!dir.exists(), !links_dir.exists());
        create_dir(&links_dir)?;
        let mut pinned: Vec<&'static str> = Vec::new();
        let undo = |pinned: &[&'static str]| {
            for name in pinned {
                let _ = std::fs::remove_file(links_dir.join(name));
            }
            if made_dir {
                let _ = std::fs::remove_dir(&links_dir);
            }
            if made_parent {
                let _ = std::fs::remove_dir(dir);
            }
        };
        for (name, replaces_dead, link) in links {
            let path = links_dir.join(name);
            if replaces_dead {
                // A detached link runs nothing: its pin gives way to the new one.
                match std::fs::remove_file(&path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        undo(&pinned);
                        return Err(pin_error(&path)(e));
                    }
                    _ => {}
                }
            }
            if let Err(e) = link.pin(&path) {
                undo(&pinned);
                return Err(pin_error(&path)(e));
            }
            pinned.push(name);
        }
        Ok(pinned)
    }

    /// Refuses pins at `dir/links` that this set cannot take as its hooks on `cgroup`
    /// ([`EbpfError::ForeignPin`]), and hooks to attach where the cgroup's ancestors
    /// make that unsafe ([`EbpfError::Ancestors`]), before anything is registered or
    /// attached.
    pub fn check_cgroup_pins(&self, cgroup: &Path, dir: &Path) -> Result<(), EbpfError> {
        let (_, wanted) = self.cgroup_plan(cgroup, dir)?;
        if !wanted.is_empty() {
            super::check_ancestors(cgroup)?;
        }
        Ok(())
    }

    /// The cgroup, open, and the hooks [`Self::ensure_cgroup`] must attach (program,
    /// attach type, and whether a detached link's pin gives way); a pin it cannot take
    /// is an error.
    #[expect(clippy::type_complexity, reason = "one private step of ensure_cgroup")]
    fn cgroup_plan(
        &self,
        cgroup: &Path,
        dir: &Path,
    ) -> Result<(File, Vec<(&'static str, u32, OwnedFd, bool)>), EbpfError> {
        let target = super::open_cgroup2(cgroup)?;
        let id = link::cgroup_id(cgroup)
            .map_err(|e| EbpfError::OpenCgroup { path: cgroup.to_path_buf(), source: e })?;
        let links_dir = dir.join("links");
        let mut wanted = Vec::new();
        for (name, kind) in cgroup_hooks() {
            let path = links_dir.join(name);
            let program = self.program(name)?;
            let prog_id = link::prog_id(program.as_fd())
                .map_err(|source| EbpfError::Io { what: "read a program's id", source })?;
            let found = match sys::obj_get(&path) {
                Ok(fd) => match sys::link_info(fd.as_fd()) {
                    Ok(info) => Some(info),
                    Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                        return Err(EbpfError::ForeignPin { path, what: e.to_string() });
                    }
                    Err(e) => return Err(pin_error(&path)(e)),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(pin_error(&path)(e)),
            };
            match found {
                None => wanted.push((name, kind, program, false)),
                Some(info) if info.link_type == sys::link_type::CGROUP && info.target == 0 => {
                    wanted.push((name, kind, program, true))
                }
                Some(info)
                    if info.link_type == sys::link_type::CGROUP
                        && info.target == id
                        && info.prog_id == prog_id => {}
                Some(info) => {
                    return Err(EbpfError::ForeignPin {
                        path,
                        what: format!(
                            "link type {}, program id {} (this set's {name} is {prog_id}), target {} (the cgroup's id is {id})",
                            info.link_type, info.prog_id, info.target
                        ),
                    });
                }
            }
        }
        Ok((target, wanted))
    }

    /// Registers (or replaces) a pod in one switch: its lists and, for the node
    /// classifier, its inbound config keyed by `inbound`'s interface MAC (in its
    /// namespace) and each of its addresses are written first, then its config is
    /// switched; then what `previous` (its last registration, from its record) wrote
    /// and this one did not goes. All or nothing: on failure a pod keeps its previous
    /// registration, a new pod has none. Returns the registration, for the record.
    pub fn register(
        &mut self,
        cookie: u64,
        pod: &PodCapture,
        inbound: Option<PodInterface<'_>>,
        previous: Option<&Registration>,
    ) -> Result<Registration, EbpfError> {
        let staged = self.maps.stage(cookie, pod)?;
        let staged_inbound = match (&self.inbound, &pod.inbound, inbound) {
            (Some(classifier), Some(config), Some(interface)) => {
                let mac = interface.mac().map_err(|e| EbpfError::Attach {
                    program: weir_ebpf_common::inbound::PROG,
                    path: PathBuf::from(interface.name),
                    source: aya::programs::ProgramError::IOError(e),
                });
                match mac.and_then(|mac| classifier.stage(cookie, mac, &pod.own_addresses, config)) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        self.maps.abort(staged);
                        return Err(e);
                    }
                }
            }
            _ => None,
        };
        if let Err(e) = self.maps.commit(&staged) {
            if let (Some(classifier), Some(s)) = (&self.inbound, staged_inbound) {
                classifier.abort(s);
            }
            self.maps.abort(staged);
            return Err(e);
        }
        let mut registration = staged.registration().clone();
        for (map, keys) in staged_inbound.map(|s| s.registration.keys).into_iter().flatten() {
            registration.keys.entry(map).or_default().extend(keys);
        }
        if let Some(previous) = previous
            && let Err(e) = previous.minus(&registration).remove(|name| self.fd(name))
        {
            tracing::warn!(netns_cookie = cookie, error = %crate::error_chain(&e), "a pod's previous capture entries not all removed (garbage collection takes them)");
        }
        Ok(registration)
    }

    /// Removes a pod's registration, inbound included (missing is fine): exactly what
    /// `registration` wrote, or, for a pod recorded without one, everything under its
    /// cookie (a scan of the node-wide maps).
    pub fn unregister(&mut self, cookie: u64, registration: Option<&Registration>) -> Result<(), EbpfError> {
        if let Some(registration) = registration {
            return registration.remove(|name| self.fd(name));
        }
        self.maps.unregister(cookie, None)?;
        if let Some(classifier) = &self.inbound {
            classifier.unregister(cookie)?;
        }
        Ok(())
    }

    /// Whether the set has a node classifier (else each pod gets a copy of its own,
    /// pinned under the pod's folder).
    pub fn has_node_classifier(&self) -> bool {
        self.inbound.is_some()
    }

    /// Attaches inbound capture to `interface` in `netns` and keeps it: the namespace's
    /// socket lookup hook (pinned under `dir`, see [`NodeClassifier::attach_reopen`]),
    /// then the node classifier as a tc filter (the pod's config was written by
    /// [`Self::register`]);
    /// or, in a set without one, a copy of its own (a TCX link pinned at
    /// `dir/links/inbound`, kept when one is attached there already). Returns whether
    /// the interface had no Weir inbound capture before (what an undo may take away).
    pub fn attach_inbound(
        &self,
        netns: &Path,
        cookie: u64,
        interface: &str,
        pod: &PodCapture,
        dir: &Path,
    ) -> Result<bool, EbpfError> {
        let Some(config) = &pod.inbound else { return Ok(false) };
        match &self.inbound {
            Some(classifier) => {
                // The lookup hook first: the classifier relies on it from its first SYN.
                let hooked = classifier.attach_reopen(netns, cookie, dir)?;
                classifier.attach(netns, cookie, interface).inspect_err(|_| {
                    if hooked {
                        super::inbound::detach_reopen(dir);
                    }
                })
            }
            None => {
                let pin = dir.join("links").join("inbound");
                if link::attached(&pin).unwrap_or(false) {
                    return Ok(false);
                }
                InboundProgram::attach(netns, interface, config)?.pin(dir)?;
                Ok(true)
            }
        }
    }

    /// List entries no registered pod's config names (see [`MapSet::orphans`]), removed.
    pub fn collect_orphans(&self) -> Result<usize, EbpfError> {
        self.maps.collect_orphans()
    }

    pub fn in_use(&self) -> Result<bool, EbpfError> {
        self.set.in_use()
    }

    /// Removes the set if nothing uses it; returns whether it did.
    pub fn release(self) -> Result<bool, EbpfError> {
        let Self { set, maps, inbound, inbound_maps } = self;
        drop((maps, inbound, inbound_maps));
        set.release()
    }
}

/// Removes every pin in a set's folder (a half-pinned set, or one being removed),
/// keeping the folder itself.
fn clear(dir: &Path) -> Result<(), EbpfError> {
    for sub in ["progs", "maps"] {
        let path = dir.join(sub);
        if let Ok(entries) = std::fs::read_dir(&path) {
            for e in entries.flatten() {
                match std::fs::remove_file(e.path()) {
                    Ok(()) => {}
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                    Err(err) => return Err(pin_error(&e.path())(err)),
                }
            }
        }
        match std::fs::remove_dir(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(pin_error(&path)(e)),
        }
    }
    Ok(())
}

/// Keys of the sets pinned on this node.
pub fn pinned_keys() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(PROGRAMS_DIR) else { return Vec::new() };
    let mut keys: Vec<String> = dir.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    keys.sort();
    keys
}

/// Removes every set nothing uses (a crash between pinning and registering leaves
/// one, half pinned or whole; another build's set goes with its last pod); returns the
/// keys removed. Sets in use, of any build, stay.
pub fn remove_unused() -> Result<Vec<String>, EbpfError> {
    let mut removed = Vec::new();
    for key in pinned_keys() {
        if let Some(set) = LockedSet::open(&key)?
            && set.release()?
        {
            removed.push(key);
        }
    }
    remove_empty_parents(Path::new(PROGRAMS_DIR));
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_names_the_version_and_changes_with_the_objects() {
        let a = key_of("1.2.3", &[b"capture", b"inbound"]);
        assert!(a.starts_with("1_2_3-") && a.len() == "1_2_3-".len() + 12, "{a}");
        assert_eq!(a, key_of("1.2.3", &[b"capture", b"inbound"]), "stable");
        assert_ne!(a, key_of("1.2.4", &[b"capture", b"inbound"]), "another version");
        assert_ne!(a, key_of("1.2.3", &[b"capture!", b"inbound"]), "other programs");
        assert_ne!(a, key_of("1.2.3", &[b"captur", b"einbound"]), "object boundaries count");
    }

    #[test]
    fn the_digest_taken_at_build_is_the_objects_key() {
        use crate::capture::ebpf::objects;
        let hashed_now =
            key_of(crate::support::build_info::BUILD_INFO.version, &[objects::CAPTURE, objects::INBOUND]);
        assert_eq!(built_key(), hashed_now);
    }
}
