//! What this binary is: version, commit, toolchain and how its eBPF objects were built.

use serde::Serialize;

/// Build facts recorded by `build.rs`.
#[derive(Debug, Clone, Serialize)]
pub struct BuildInfo {
    /// The package's version, or `WEIR_VERSION` as the build was stamped.
    pub version: &'static str,
    pub git_sha: &'static str,
    pub rustc: &'static str,
    pub profile: &'static str,
    /// `bpfel` when the kernel programs were compiled, `stub` when WEIR_EBPF_STUB was set.
    pub ebpf: &'static str,
    pub target: &'static str,
}

pub const BUILD_INFO: BuildInfo = BuildInfo {
    version: env!("WEIR_VERSION"),
    git_sha: env!("WEIR_GIT_SHA"),
    rustc: env!("WEIR_RUSTC_VERSION"),
    profile: env!("WEIR_BUILD_PROFILE"),
    ebpf: env!("WEIR_EBPF_BUILD"),
    target: std::env::consts::ARCH,
};

impl std::fmt::Display for BuildInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "weir {} (commit {}, {} build, eBPF objects: {}, {}, {})",
            self.version, self.git_sha, self.profile, self.ebpf, self.rustc, self.target
        )
    }
}

/// What marks a binary as this build (version, commit, eBPF objects), NUL-delimited so
/// it is found whole in a binary's bytes. `weir cni install` installs the `weir-cni`
/// beside it only when that file carries this exact marker (the same build: the same
/// eBPF program set as the node capture it attaches); `weir-cni` keeps it referenced.
pub const BUILD_MARKER: &str = concat!(
    "\0weir-build:",
    env!("WEIR_VERSION"),
    ":",
    env!("WEIR_GIT_SHA"),
    ":",
    env!("WEIR_EBPF_OBJECTS_DIGEST"),
    "\0"
);

/// Whether `bytes` (a binary's) carry [`BUILD_MARKER`].
pub fn carries_build_marker(bytes: &[u8]) -> bool {
    let inner = BUILD_MARKER.trim_matches('\0').as_bytes();
    bytes.split(|&b| b == 0).any(|segment| segment == inner)
}

#[cfg(test)]
mod tests {
    use super::{BUILD_MARKER, carries_build_marker};

    #[test]
    fn the_build_marker_is_found_only_whole() {
        let mut binary = b"\x7fELF junk".to_vec();
        assert!(!carries_build_marker(&binary));
        binary.extend_from_slice(BUILD_MARKER.as_bytes());
        binary.extend_from_slice(b"more");
        assert!(carries_build_marker(&binary));
        // Another build's marker (one byte different), or this one cut short, is not it.
        let other = BUILD_MARKER.replacen("weir-build:", "weir-build:9", 1);
        assert!(!carries_build_marker(other.as_bytes()));
        assert!(!carries_build_marker(&BUILD_MARKER.as_bytes()[..BUILD_MARKER.len() - 3]));
    }
}
