//! Builds the tests' kernel object, the socket load balancer stand-in (crate
//! `weir-lb-standin`, `tests/lb-standin`), for the bpf target with nightly,
//! `-Z build-std=core` and bpf-linker through aya-build, as `agent/build.rs` builds
//! Weir's own objects.
//!
//! `WEIR_EBPF_STUB=1` writes an empty object instead, so `cargo check` and clippy work
//! on a machine without the eBPF toolchain; `weir_tests::socket_lb` refuses to load it
//! with an error that says so.
use std::{env, fs, path::PathBuf, process::Command};

use anyhow::{Context as _, anyhow, bail};

const PACKAGE: &str = "weir-lb-standin";
/// The object its one bin produces; keep in sync with its Cargo.toml.
const OBJECT: &str = "weir-lb-standin";
const STUB_ENV: &str = "WEIR_EBPF_STUB";

fn main() -> anyhow::Result<()> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?);
    let workspace = manifest_dir.parent().context("tests/ has no parent")?.to_path_buf();

    println!("cargo:rerun-if-env-changed={STUB_ENV}");
    let stub = env::var(STUB_ENV).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    if stub {
        println!("cargo:warning={STUB_ENV}=1: writing an empty stand-in object; the tests cannot load it");
        fs::write(out_dir.join(OBJECT), b"").context("write the stub object")?;
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

    let root = manifest_dir.join("lb-standin");
    let root = root.to_str().ok_or_else(|| anyhow!("{} is not UTF-8", root.display()))?;
    aya_build::build_ebpf(
        [aya_build::Package { name: PACKAGE, root_dir: root, features: &["kernel"], ..Default::default() }],
        aya_build::Toolchain::default(),
    )
    .context("building the socket-LB stand-in (run scripts/bootstrap, or set WEIR_EBPF_STUB=1 to skip)")?;
    if !out_dir.join(OBJECT).exists() {
        bail!("aya-build produced no object named {OBJECT}");
    }
    Ok(())
}

/// Fails early, naming what is missing, instead of letting a nested cargo fail obscurely.
fn preflight(path: &std::ffi::OsStr) -> anyhow::Result<()> {
    if !env::split_paths(path).any(|d| d.join("bpf-linker").is_file()) {
        bail!(
            "bpf-linker not found in .tools/bin or PATH: run scripts/bootstrap \
             (or set {STUB_ENV}=1 to build without eBPF)"
        );
    }
    match Command::new("rustup").args(["run", "nightly", "rustc", "--version"]).output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => bail!(
            "the nightly toolchain is missing: run scripts/bootstrap \
             (or set {STUB_ENV}=1 to build without eBPF)"
        ),
    }
}
