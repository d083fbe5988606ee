//! eBPF in user space: the objects embedded at build time and the loaders that put
//! them in the kernel. Kernel-side code lives in `ebpf/programs`; the types both sides
//! share live in `weir-ebpf-common`.

pub mod bpffs;
pub mod capture;
pub mod config;
pub mod detect;
pub mod health;
pub mod inbound;
pub mod link;
pub mod netns;
pub mod objects;
pub mod pod;
pub mod probe;
pub mod record;
pub mod set;

use std::path::PathBuf;

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
    #[error("open cgroup {path}")]
    OpenCgroup {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
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
}
