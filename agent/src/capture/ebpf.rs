//! eBPF in user space: the objects embedded at build time and the loaders that put
//! them in the kernel. Kernel-side code lives in `ebpf/programs`; the types both sides
//! share live in `weir-ebpf-common`.

pub mod ancestors;
pub mod bpffs;
pub mod capture;
pub mod config;
pub mod detect;
pub mod gc;
pub mod health;
pub mod inbound;
pub mod link;
pub mod live_netns;
pub mod metrics;
pub mod netns;
pub mod objects;
pub mod pins;
pub mod pod;
pub mod probe;
pub mod record;
pub mod registration;
pub mod set;
pub mod sys;

use std::{
    fs::File,
    path::{Path, PathBuf},
};

/// Failures while loading or attaching Weir's eBPF programs.
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error(
        "the eBPF object {object} is a stub (this binary was built with WEIR_EBPF_STUB=1); \
         rebuild after scripts/bootstrap to get real programs"
    )]
    Stub { object: &'static str },
    #[error("load eBPF object {object}")]
    Load {
        object: &'static str,
        #[source]
        source: aya::EbpfError,
    },
    #[error("eBPF object {object} has no program {program}")]
    MissingProgram { object: &'static str, program: &'static str },
    #[error("eBPF object {object} has no map {map}")]
    MissingMap { object: &'static str, map: &'static str },
    #[error("load program {program} into the kernel")]
    Verify {
        program: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    /// A pinned program opened by its info, then by its id (which takes CAP_SYS_ADMIN).
    #[error("open the pinned program {program} at {path} (by its id: needs CAP_SYS_ADMIN)")]
    OpenPinned {
        program: &'static str,
        path: PathBuf,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("open cgroup {path}")]
    OpenCgroup {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path} is not a cgroup v2 directory (its file system is {fs}): eBPF capture attaches \
         only to cgroup v2; on a cgroup v1 host use `weir capture apply` (nftables or iptables)"
    )]
    NotCgroup2 { path: PathBuf, fs: String },
    #[error(
        "the capture {pod} has no counters in its maps: its namespace (cookie {cookie}) is not registered"
    )]
    NotRegistered { pod: String, cookie: u64 },
    #[error("the maps of capture {pod} cannot be read: {reason}")]
    MapsUnreadable { pod: String, reason: String },
    #[error("attach {program} to cgroup {path}")]
    Attach {
        program: &'static str,
        path: PathBuf,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("{what}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("pin {path}")]
    Pin {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("map {map}")]
    Map {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error(
        "address {address} on an interface with MAC address {mac} is registered for inbound capture by another \
         pod (network namespace cookie {owner}): two pods on a node cannot share an address and a MAC address"
    )]
    AddressTaken { address: std::net::IpAddr, mac: String, owner: u64 },
    /// What the capture cgroup's ancestors run makes eBPF capture unsafe there, or could
    /// not be read (`ancestors`).
    #[error("refused to attach eBPF capture: {0}")]
    Ancestors(Box<ancestors::AncestorError>),
    #[error(
        "{path} holds a link this capture did not make ({what}); it is left attached. Remove it with \
         `weir capture clean` (or `weir cni uninstall --detach-running-pods` for a node capture) if it is no longer wanted"
    )]
    ForeignPin { path: PathBuf, what: String },
}

/// Refuses attaching Weir's hooks to `cgroup` where its ancestors' programs make eBPF
/// capture unsafe, naming the program, its cgroup and why (`ancestors`).
pub(crate) fn check_ancestors(cgroup: &Path) -> Result<(), EbpfError> {
    let hooks = capture::cgroup_hook_types();
    ancestors::check(cgroup, &hooks, ancestors::Probe::Attach).map_err(|e| EbpfError::Ancestors(Box::new(e)))
}

/// Opens `path` for attaching cgroup programs, refusing anything that is not a cgroup v2
/// directory: a cgroup v1 hierarchy (or a plain directory) would otherwise fail deep in
/// the kernel with EBADF, or on a hybrid host be mistaken for the pod's cgroup.
pub(crate) fn open_cgroup2(path: &Path) -> Result<File, EbpfError> {
    let open_err = |source| EbpfError::OpenCgroup { path: path.to_path_buf(), source };
    let dir = File::open(path).map_err(open_err)?;
    let fs = nix::sys::statfs::fstatfs(&dir).map_err(|e| open_err(e.into()))?;
    let kind = fs.filesystem_type();
    if kind != nix::sys::statfs::CGROUP2_SUPER_MAGIC {
        let fs = match kind {
            nix::sys::statfs::CGROUP_SUPER_MAGIC => "cgroup (v1)".to_string(),
            nix::sys::statfs::TMPFS_MAGIC => "tmpfs".to_string(),
            other => format!("type {:#x}", other.0),
        };
        return Err(EbpfError::NotCgroup2 { path: path.to_path_buf(), fs });
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_that_is_not_cgroup2_is_refused_naming_its_file_system() {
        let dir = std::env::temp_dir();
        let e = open_cgroup2(&dir).unwrap_err();
        assert!(matches!(e, EbpfError::NotCgroup2 { .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.contains(&dir.display().to_string()) && text.contains("not a cgroup v2 directory"),
            "{text}"
        );
        let missing = open_cgroup2(Path::new("/nonexistent/weir-cgroup")).unwrap_err();
        assert!(matches!(missing, EbpfError::OpenCgroup { .. }), "{missing}");
    }
}
