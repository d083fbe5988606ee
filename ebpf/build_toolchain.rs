//! What a build script that builds eBPF objects needs before aya-build runs, shared by
//! `agent/build.rs` (Weir's objects) and `tests/build.rs` (the tests' stand-in) through
//! `#[path]`: the workspace's `.tools/bin` (where scripts/bootstrap puts bpf-linker)
//! first on PATH, and bpf-linker and the nightly toolchain found, or a clear error.

use std::{env, path::Path, process::Command};

use anyhow::{Context as _, bail};

/// Puts `<workspace>/.tools/bin` first on PATH and checks the eBPF toolchain; `stub_env`
/// is the variable that skips eBPF, named in the errors.
pub fn prepare(workspace: &Path, stub_env: &str) -> anyhow::Result<()> {
    let tools = workspace.join(".tools/bin");
    let path = env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![tools.clone()];
    paths.extend(env::split_paths(&path));
    let joined = env::join_paths(paths).context("join PATH")?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment.
    unsafe { env::set_var("PATH", &joined) };
    println!("cargo:rerun-if-changed={}", tools.join("bpf-linker").display());
    if !env::split_paths(&joined).any(|d| d.join("bpf-linker").is_file()) {
        bail!(
            "bpf-linker not found in .tools/bin or PATH: run scripts/bootstrap (or set {stub_env}=1 to build without eBPF)"
        );
    }
    match Command::new("rustup").args(["run", "nightly", "rustc", "--version"]).output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => bail!(
            "the nightly toolchain is missing: run scripts/bootstrap (or set {stub_env}=1 to build without eBPF)"
        ),
    }
}
