//! Builds Weir's eBPF objects (crate `weir-ebpf`, bins) for the bpf target with nightly,
//! `-Z build-std=core` and bpf-linker, through aya-build; and records build info.
//!
//! `WEIR_EBPF_STUB=1` writes empty objects instead, so `cargo check`, clippy and the
//! pure unit tests work on a machine without the eBPF toolchain. The agent refuses to
//! load a stub object with an error that says so.
use std::{env, fs, path::PathBuf, process::Command};

use anyhow::{Context as _, anyhow, bail};

/// Every object the `weir-ebpf` crate's bins produce; keep in sync with its Cargo.toml.
const OBJECTS: &[&str] = &["weir-probe", "weir-capture", "weir-inbound"];
const STUB_ENV: &str = "WEIR_EBPF_STUB";

fn main() -> anyhow::Result<()> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?);
    let workspace = manifest_dir.parent().context("agent/ has no parent")?.to_path_buf();
    build_info(&workspace);

    println!("cargo:rerun-if-env-changed={STUB_ENV}");
    let stub = env::var(STUB_ENV).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    if stub {
        println!("cargo:warning={STUB_ENV}=1: writing empty eBPF objects; the agent cannot load them");
        for name in OBJECTS {
            fs::write(out_dir.join(name), b"").with_context(|| format!("write stub {name}"))?;
        }
        println!("cargo:rustc-env=WEIR_EBPF_BUILD=stub");
        return Ok(());
    }

    // bpf-linker is installed by scripts/bootstrap into <workspace>/.tools/bin.
    let tools = workspace.join(".tools/bin");
    let path = env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![tools.clone()];
    paths.extend(env::split_paths(&path));
    let joined = env::join_paths(paths).context("join PATH")?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment.
    unsafe { env::set_var("PATH", &joined) };
    println!("cargo:rerun-if-changed={}", tools.join("bpf-linker").display());
    preflight(&joined)?;

    let metadata = cargo_metadata::MetadataCommand::new().no_deps().exec().context("cargo metadata")?;
    let ebpf = metadata
        .packages
        .iter()
        .find(|p| p.name.as_str() == "weir-ebpf")
        .ok_or_else(|| anyhow!("package weir-ebpf not found in the workspace"))?;
    let root = ebpf.manifest_path.parent().ok_or_else(|| anyhow!("no parent for {}", ebpf.manifest_path))?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "weir-ebpf",
            root_dir: root.as_str(),
            features: &["kernel"],
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
    .context("building the eBPF objects (run scripts/bootstrap, or set WEIR_EBPF_STUB=1 to skip)")?;
    for name in OBJECTS {
        if !out_dir.join(name).exists() {
            bail!("aya-build produced no object named {name}");
        }
    }
    println!("cargo:rustc-env=WEIR_EBPF_BUILD=bpfel");
    Ok(())
}

/// Fails early, naming what is missing, instead of letting a nested cargo fail obscurely.
fn preflight(path: &std::ffi::OsStr) -> anyhow::Result<()> {
    let found = env::split_paths(path).any(|d| d.join("bpf-linker").is_file());
    if !found {
        bail!(
            "bpf-linker not found in .tools/bin or PATH: run scripts/bootstrap \
             (or set {STUB_ENV}=1 to build without eBPF)"
        );
    }
    let nightly = Command::new("rustup").args(["run", "nightly", "rustc", "--version"]).output();
    match nightly {
        Ok(o) if o.status.success() => Ok(()),
        _ => bail!(
            "the nightly toolchain is missing: run scripts/bootstrap \
             (or set {STUB_ENV}=1 to build without eBPF)"
        ),
    }
}

/// Version and provenance for `weir version`.
fn build_info(workspace: &std::path::Path) {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(workspace)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let sha = git(&["rev-parse", "--short=12", "HEAD"]);
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"]).is_empty();
    let sha = match (sha.is_empty(), dirty) {
        (true, _) => "unknown".to_string(),
        (false, true) => format!("{sha}-dirty"),
        (false, false) => sha,
    };
    println!("cargo:rustc-env=WEIR_GIT_SHA={sha}");
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    println!("cargo:rustc-env=WEIR_RUSTC_VERSION={rustc_version}");
    println!("cargo:rustc-env=WEIR_BUILD_PROFILE={}", env::var("PROFILE").unwrap_or_default());
    let head = workspace.join(".git/HEAD");
    if head.exists() {
        println!("cargo:rerun-if-changed={}", head.display());
    }
}
