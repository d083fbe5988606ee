//! What a pinned capture is made of (a pod's in init-container mode, a CNI node
//! capture, a pod registered with it), recorded in /run/weir/capture so it can be
//! shown and removed later, after the pod's namespace may be gone; and its removal:
//! unregistered from its node program set, its links unpinned, the set released.

use std::path::{Path, PathBuf};

use super::{
    EbpfError,
    bpffs::{PIN_ROOT, unpin},
    inbound::detach_inbound,
    set::NodePrograms,
};

/// What a pinned capture is made of.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PinRecord {
    pub pod: String,
    pub cgroup: PathBuf,
    pub netns: Option<PathBuf>,
    /// The registered namespace (0: a node capture, which registers none itself).
    pub netns_cookie: u64,
    pub interface: Option<String>,
    /// The key of the node program set whose programs and maps this capture uses;
    /// `None`: pins of its own under its folder (captures made before program sets).
    #[serde(default)]
    pub programs: Option<String>,
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
        let path = Self::path(&self.pod);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)?;
        std::fs::rename(&tmp, &path)
    }

    pub fn load(pod: &str) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(Self::path(pod)).ok()?).ok()
    }

    pub fn load_all() -> Vec<Self> {
        let Ok(dir) = std::fs::read_dir(RECORD_DIR) else { return Vec::new() };
        let mut all: Vec<Self> = dir
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice(&b).ok())
            .collect();
        all.sort_by(|a, b| a.pod.cmp(&b.pod));
        all
    }

    /// Detaches and removes everything recorded for this capture; idempotent. Its
    /// namespace is unregistered from its program set first (the programs stop acting
    /// at once), then its links go, then the set if nothing else uses it.
    pub fn remove(&self) -> Result<(), EbpfError> {
        let mut set = match &self.programs {
            Some(key) => NodePrograms::open_existing(key)?,
            None => None,
        };
        if let Some(set) = &mut set
            && self.netns_cookie != 0
        {
            set.unregister(self.netns_cookie)?;
        }
        if let Some(interface) = &self.interface {
            detach_inbound(self.netns.as_deref(), interface);
        }
        unpin(&self.pin_dir())?;
        match std::fs::remove_file(Self::path(&self.pod)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(EbpfError::Io { what: "remove the capture record", source }),
        }
        if let Some(set) = set {
            set.release()?;
        }
        Ok(())
    }
}

/// The pin directory for a capture name.
pub fn pin_dir(pod: &str) -> PathBuf {
    Path::new(PIN_ROOT).join(pod)
}
