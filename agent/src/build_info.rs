//! What this binary is: version, commit, toolchain and how its eBPF objects were built.

use serde::Serialize;

/// Build facts recorded by `build.rs`.
#[derive(Debug, Clone, Serialize)]
pub struct BuildInfo {
    pub version: &'static str,
    pub git_sha: &'static str,
    pub rustc: &'static str,
    pub profile: &'static str,
    /// `bpfel` when the kernel programs were compiled, `stub` when WEIR_EBPF_STUB was set.
    pub ebpf: &'static str,
    pub target: &'static str,
}

pub const BUILD_INFO: BuildInfo = BuildInfo {
    version: env!("CARGO_PKG_VERSION"),
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

/// `version` (pilot-agent's and weir's): prints the build as `args` asks.
pub fn print(args: &crate::cli::VersionArgs) -> u8 {
    if args.short {
        println!("{}", BUILD_INFO.version);
        return crate::exit::OK;
    }
    match args.output {
        Some(crate::cli::VersionFormat::Json) => {
            println!("{}", serde_json::to_string_pretty(&BUILD_INFO).expect("build info serializes"))
        }
        Some(crate::cli::VersionFormat::Yaml) => {
            let value = serde_json::to_value(BUILD_INFO).expect("build info serializes");
            for (k, v) in value.as_object().into_iter().flatten() {
                println!("{k}: {}", v.as_str().unwrap_or_default());
            }
        }
        None => println!("{BUILD_INFO}"),
    }
    crate::exit::OK
}
