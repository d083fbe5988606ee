//! Builds the tests' kernel object, the socket load balancer stand-in (crate
//! `weir-lb-standin`, `tests/lb-standin`), for the bpf target with nightly,
//! `-Z build-std=core` and bpf-linker through aya-build, as `agent/build.rs` builds
//! Weir's own objects.
//!
//! `WEIR_EBPF_STUB=1` writes an empty object instead, so `cargo check` and clippy work
//! on a machine without the eBPF toolchain; `weir_tests::socket_lb` refuses to load it
//! with an error that says so.
use std::{env, fs, path::PathBuf};

use anyhow::{Context as _, anyhow, bail};

const PACKAGE: &str = "weir-lb-standin";
/// The object its one bin produces; keep in sync with its Cargo.toml.
const OBJECT: &str = "weir-lb-standin";
const STUB_ENV: &str = "WEIR_EBPF_STUB";

#[path = "../ebpf/build_toolchain.rs"]
mod ebpf_toolchain;

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

    ebpf_toolchain::prepare(&workspace, STUB_ENV)?;

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
