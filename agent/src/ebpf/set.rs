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
    bpffs::{PIN_ROOT, create_dir, mount_bpffs, pin_error, remove_empty_parents, unpin},
    capture::{CapturePrograms, MapSet, SET_PROGRAMS, cgroup_hooks},
    config::PodCapture,
    inbound::{InboundProgram, NodeClassifier},
    link::{self, CgroupLink},
    netns, objects,
};

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

/// This binary's key ([`key_of`] its version and objects), with [`SET_ENV`]'s suffix.
pub fn version_key() -> String {
    let key = key_of(crate::build_info::BUILD_INFO.version, &[objects::CAPTURE, objects::INBOUND]);
    let suffix: String = std::env::var(SET_ENV)
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
        .collect();
    if suffix.is_empty() { key } else { format!("{key}-{suffix}") }
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
    SET_PROGRAMS.iter().all(|p| dir.join("progs").join(p).exists())
        && weir_ebpf_common::capture::map::ALL.iter().all(|m| dir.join("maps").join(m).exists())
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

/// One node program set, open and locked while this value lives.
pub struct NodePrograms {
    key: String,
    dir: PathBuf,
    maps: MapSet,
    programs: BTreeMap<&'static str, OwnedFd>,
    inbound: Option<NodeClassifier>,
    _lock: Flock<File>,
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
        if complete(&dir) {
            tracing::debug!(program_set = key, "eBPF program set reused");
        } else {
            clear(&dir)?;
            if let Err(e) = Loaded::take_or_load().and_then(|loaded| loaded.pin(&dir)) {
                // Nothing half pinned stays behind, nor an empty folder.
                let _ = clear(&dir);
                let _ = std::fs::remove_dir(&dir);
                return Err(e);
            }
            tracing::info!(program_set = key, dir = %dir.display(), "eBPF program set loaded, verified and pinned");
        }
        Self::open(key, dir, lock)
    }

    /// The set `key` if it is pinned; never loads anything.
    pub fn open_existing(key: &str) -> Result<Option<Self>, EbpfError> {
        match lock(key, false)? {
            Some((dir, lock)) if complete(&dir) => Self::open(key, dir, lock).map(Some),
            _ => Ok(None),
        }
    }

    fn open(key: &str, dir: PathBuf, lock: Flock<File>) -> Result<Self, EbpfError> {
        let mut programs = BTreeMap::new();
        for name in SET_PROGRAMS {
            let path = dir.join("progs").join(name);
            programs.insert(*name, link::obj_get(&path).map_err(pin_error(&path))?);
        }
        let maps = MapSet::open_pinned(&dir)?;
        let inbound = NodeClassifier::pinned(&dir);
        Ok(Self { key: key.to_string(), dir, maps, programs, inbound, _lock: lock })
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn maps(&self) -> &MapSet {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut MapSet {
        &mut self.maps
    }

    /// Kernel ids of the set's capture programs, by name.
    pub fn program_ids(&self) -> Result<BTreeMap<&'static str, u32>, EbpfError> {
        let mut out = BTreeMap::new();
        for (name, fd) in &self.programs {
            let id = link::prog_id(fd.as_fd())
                .map_err(|source| EbpfError::Io { what: "read a program's id", source })?;
            out.insert(*name, id);
        }
        Ok(out)
    }

    /// Attaches the cgroup hooks to `cgroup` and pins the links at `dir/links/<program>`
    /// (which keeps them after this process exits). On failure nothing stays attached.
    pub fn attach_cgroup(&self, cgroup: &Path, dir: &Path) -> Result<(), EbpfError> {
        let target = super::open_cgroup2(cgroup)?;
        let mut links: Vec<(&'static str, CgroupLink)> = Vec::new();
        for (name, kind) in cgroup_hooks() {
            let program = self.programs.get(name).expect("every hook is in the set");
            let link =
                CgroupLink::create(program.as_fd(), target.as_fd(), kind).map_err(|e| EbpfError::Attach {
                    program: name,
                    path: cgroup.to_path_buf(),
                    source: aya::programs::ProgramError::IOError(e),
                })?;
            links.push((name, link));
        }
        create_dir(&dir.join("links"))?;
        for (name, link) in links {
            let path = dir.join("links").join(name);
            if let Err(e) = link.pin(&path) {
                let _ = unpin(dir);
                return Err(pin_error(&path)(e));
            }
        }
        Ok(())
    }

    /// Registers (or replaces) a pod: its lists and config.
    pub fn register(&mut self, cookie: u64, pod: &PodCapture) -> Result<(), EbpfError> {
        self.maps.register(cookie, pod)
    }

    /// Removes a pod's registration, inbound included (missing is fine).
    pub fn unregister(&mut self, cookie: u64) -> Result<(), EbpfError> {
        self.maps.unregister(cookie)?;
        if let Some(classifier) = &self.inbound {
            classifier.unregister(cookie)?;
        }
        Ok(())
    }

    /// Writes (or replaces) the pod's inbound config for the node classifier: keyed by
    /// `interface`'s MAC address in `netns` and each of the pod's own addresses. A
    /// set without a node classifier has nothing to write.
    pub fn register_inbound(
        &self,
        netns: &Path,
        interface: &str,
        cookie: u64,
        pod: &PodCapture,
    ) -> Result<(), EbpfError> {
        let Some(classifier) = &self.inbound else { return Ok(()) };
        let Some(config) = &pod.inbound else { return classifier.unregister(cookie) };
        let mac = netns::interface_mac(netns, interface).map_err(|e| EbpfError::Attach {
            program: weir_ebpf_common::inbound::PROG,
            path: PathBuf::from(interface),
            source: aya::programs::ProgramError::IOError(e),
        })?;
        classifier.register(cookie, mac, &pod.own_addresses, config)
    }

    /// Attaches inbound capture to `interface` in `netns` and keeps it: the node
    /// classifier as a tc filter, with the pod's config registered for it; or, in a set
    /// without one, a copy of its own (a TCX link pinned at `dir/links/inbound`).
    pub fn attach_inbound(
        &self,
        netns: &Path,
        interface: &str,
        cookie: u64,
        pod: &PodCapture,
        dir: &Path,
    ) -> Result<(), EbpfError> {
        let Some(config) = &pod.inbound else { return Ok(()) };
        match &self.inbound {
            Some(classifier) => {
                self.register_inbound(netns, interface, cookie, pod)?;
                classifier.attach(netns, interface, &dir.join("links").join("inbound"))
            }
            None => InboundProgram::attach(netns, interface, config)?.pin(dir),
        }
    }

    /// Whether anything uses the set: a pod registered in its maps, or a pinned link
    /// (under any capture's `links/`) to one of its programs.
    pub fn in_use(&self) -> Result<bool, EbpfError> {
        if !self.maps.pods()?.is_empty() {
            return Ok(true);
        }
        let mut ids: Vec<u32> = self.program_ids()?.into_values().collect();
        if let Some(classifier) = &self.inbound
            && let Ok(fd) = link::obj_get(&classifier.program_pin())
            && let Ok(id) = link::prog_id(fd.as_fd())
        {
            ids.push(id);
        }
        let Ok(captures) = std::fs::read_dir(PIN_ROOT) else { return Ok(false) };
        for capture in captures.flatten().filter(|e| e.file_name() != "programs") {
            let Ok(links) = std::fs::read_dir(capture.path().join("links")) else { continue };
            for pin in links.flatten() {
                let Ok(fd) = link::obj_get(&pin.path()) else { continue };
                if link::link_prog_id(fd.as_fd()).is_ok_and(|id| ids.contains(&id)) {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Removes the set if nothing uses it (see [`NodePrograms::in_use`]); returns
    /// whether it did. The lock is released either way.
    pub fn release(self) -> Result<bool, EbpfError> {
        if self.in_use()? {
            return Ok(false);
        }
        let Self { key, dir, maps, programs, inbound, _lock } = self;
        drop((maps, programs, inbound));
        clear(&dir)?;
        std::fs::remove_dir(&dir).map_err(pin_error(&dir))?;
        tracing::info!(program_set = %key, "eBPF program set removed: no pod uses it");
        drop(_lock);
        remove_empty_parents(Path::new(PROGRAMS_DIR));
        Ok(true)
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
/// one); returns the keys removed.
pub fn remove_unused() -> Result<Vec<String>, EbpfError> {
    let mut removed = Vec::new();
    for key in pinned_keys() {
        match NodePrograms::open_existing(&key)? {
            Some(set) => {
                if set.release()? {
                    removed.push(key);
                }
            }
            None => {
                // Half pinned and not being loaded (we would have waited for the lock).
                if let Some((dir, _lock)) = lock(&key, false)?
                    && !complete(&dir)
                {
                    clear(&dir)?;
                    let _ = std::fs::remove_dir(&dir);
                    removed.push(key);
                }
            }
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
}
