//! What a pinned capture is made of (a pod's in init-container mode, a CNI node
//! capture, a pod registered with it), recorded in /run/weir/capture so it can be
//! shown and removed later, after the pod's namespace may be gone; and its removal:
//! unregistered from its node program set (exactly the entries its registration
//! wrote, by raw key, whichever Weir build made the set), its links unpinned, the set
//! released when nothing else uses it.

use std::path::{Path, PathBuf};

use super::{
    EbpfError,
    bpffs::{PIN_ROOT, unpin},
    inbound::detach_inbound,
    registration::Registration,
    set::{LockedSet, NodePrograms},
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
    /// What the registration wrote in the set's maps (`None`: recorded by a build that
    /// did not keep it; removed then by the pod's cookie).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registration: Option<Registration>,
    /// The Kubernetes pod, when known (CNI mode): `namespace/name` and its UID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k8s_pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The container (sandbox) id it was registered for (CNI mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

/// Where pin records live (a tmpfs, like the pins themselves).
pub const RECORD_DIR: &str = "/run/weir/capture";

/// Why a capture name cannot name pins and records.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "capture name {name:?} cannot name pins under {PIN_ROOT} and a record under {RECORD_DIR}: {problem} \
     (printable ASCII without '/', '.' or spaces, at most 200 characters)"
)]
pub struct BadCaptureName {
    pub name: String,
    pub problem: &'static str,
}

/// Checks a capture name (`--pod`, a cgroup's basename): it becomes a folder under
/// bpffs and a file name, so nothing that could walk elsewhere (`/`, `..`), clash with
/// Weir's own folders (`programs`), or that bpffs refuses (`.`); printable ASCII only.
pub fn check_name(name: &str) -> Result<(), BadCaptureName> {
    let problem = if name.is_empty() {
        Some("it is empty")
    } else if name.len() > 200 {
        Some("it is too long")
    } else if name == "programs" {
        Some("`programs` is where the node's program sets live")
    } else if !name.chars().all(|c| c.is_ascii_graphic() && !matches!(c, '/' | '.')) {
        Some("it has '/', '.', a space or a character that is not printable ASCII")
    } else {
        None
    };
    match problem {
        Some(problem) => Err(BadCaptureName { name: name.to_string(), problem }),
        None => Ok(()),
    }
}

impl PinRecord {
    pub fn pin_dir(&self) -> PathBuf {
        pin_dir(&self.pod)
    }

    pub fn path(pod: &str) -> PathBuf {
        Path::new(RECORD_DIR).join(format!("{pod}.json"))
    }

    pub fn save(&self) -> std::io::Result<()> {
        check_name(&self.pod).map_err(std::io::Error::other)?;
        std::fs::create_dir_all(RECORD_DIR)?;
        let path = Self::path(&self.pod);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)?;
        std::fs::rename(&tmp, &path)
    }

    pub fn load(pod: &str) -> Option<Self> {
        check_name(pod).ok()?;
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

    /// The pod's name for people and metrics: its Kubernetes `namespace/name` when
    /// known, else the capture's name.
    pub fn display_name(&self) -> &str {
        self.k8s_pod.as_deref().unwrap_or(&self.pod)
    }

    /// Removes the pod's registration from its program set: exactly what it wrote,
    /// whichever build made the set; this build's set is also cleaned by cookie for a
    /// record that kept no registration.
    fn unregister(&self) -> Result<(), EbpfError> {
        let Some(key) = &self.programs else { return Ok(()) };
        if self.netns_cookie == 0 {
            return Ok(());
        }
        match &self.registration {
            Some(registration) => match LockedSet::open(key)? {
                Some(set) => set.unregister(registration),
                None => Ok(()),
            },
            None => match NodePrograms::open_existing(key)? {
                Some(mut set) => set.unregister(self.netns_cookie, None),
                None => Ok(()),
            },
        }
    }

    /// Moves this capture to the name `to` (which must be free): every pin under its
    /// `links/`, `netns/` and `maps/` is pinned at the new place before its old pin goes, so what
    /// they hold stays attached; then the record. A failure part way moves back what
    /// was moved.
    pub fn move_to(&self, to: &str) -> Result<PinRecord, EbpfError> {
        check_name(to)
            .map_err(|e| EbpfError::Io { what: "name the capture", source: std::io::Error::other(e) })?;
        let moved = PinRecord { pod: to.to_string(), ..self.clone() };
        let (from_dir, to_dir) = (self.pin_dir(), moved.pin_dir());
        if to_dir.exists() || PinRecord::path(to).exists() {
            return Err(EbpfError::Pin {
                path: to_dir.display().to_string(),
                source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
            });
        }
        let mut done: Vec<(std::path::PathBuf, std::path::PathBuf)> = Vec::new();
        let step = |done: &mut Vec<_>| -> Result<(), EbpfError> {
            for sub in ["links", "netns", "maps"] {
                let Ok(entries) = std::fs::read_dir(from_dir.join(sub)) else { continue };
                super::bpffs::create_dir(&to_dir.join(sub))?;
                for entry in entries.flatten() {
                    let target = to_dir.join(sub).join(entry.file_name());
                    super::link::move_pin(&entry.path(), &target)
                        .map_err(super::bpffs::pin_error(&entry.path()))?;
                    done.push((entry.path(), target));
                }
            }
            moved.save().map_err(|source| EbpfError::Io { what: "write the moved capture's record", source })
        };
        if let Err(e) = step(&mut done) {
            for (from, target) in done.iter().rev() {
                let _ = super::link::move_pin(target, from);
            }
            let _ = unpin(&to_dir);
            return Err(e);
        }
        let _ = std::fs::remove_file(PinRecord::path(&self.pod));
        for sub in ["links", "netns", "maps"] {
            let _ = std::fs::remove_dir(from_dir.join(sub));
        }
        let _ = std::fs::remove_dir(&from_dir);
        Ok(moved)
    }

    /// Takes the pod's registration out of its program set (the set goes too if
    /// nothing uses it any more), leaving its pins and record.
    pub fn remove_registration(&self) -> Result<(), EbpfError> {
        self.unregister()?;
        if let Some(key) = &self.programs
            && let Some(set) = LockedSet::open(key)?
        {
            set.release()?;
        }
        Ok(())
    }

    /// Detaches and removes everything recorded for this capture; idempotent. Its
    /// namespace is unregistered from its program set first (the programs stop acting
    /// at once), then its links go, then the set if nothing else uses it.
    pub fn remove(&self) -> Result<(), EbpfError> {
        self.unregister()?;
        if let Some(interface) = &self.interface {
            detach_inbound(self.netns.as_deref(), interface, self.netns_cookie);
        }
        unpin(&self.pin_dir())?;
        match std::fs::remove_file(Self::path(&self.pod)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(EbpfError::Io { what: "remove the capture record", source }),
        }
        if let Some(key) = &self.programs
            && let Some(set) = LockedSet::open(key)?
        {
            set.release()?;
        }
        Ok(())
    }
}

/// The pin directory for a capture name.
pub fn pin_dir(pod: &str) -> PathBuf {
    Path::new(PIN_ROOT).join(pod)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capture_name_that_could_walk_elsewhere_or_clash_is_refused() {
        for bad in ["", "../etc", "a/b", "programs", "pod.1", "x y", "é"] {
            let e = check_name(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
        let long = "a".repeat(201);
        assert!(check_name(&long).is_err());
        for good in ["web-1", "cni-node-pod-0f3a5c9e", "kubepods-besteffort-pod1234_5678", "A_b-9", "t::x"] {
            check_name(good).unwrap();
        }
        assert!(PinRecord::load("../../etc/passwd").is_none());
    }
}
