//! Builds Weir's eBPF objects (crate `weir-ebpf`, bins) for the bpf target with nightly,
//! `-Z build-std=core` and bpf-linker, through aya-build; and records build info.
//!
//! `WEIR_EBPF_STUB=1` writes empty objects instead, so `cargo check`, clippy and the
//! pure unit tests work on a machine without the eBPF toolchain. The agent refuses to
//! load a stub object with an error that says so.
//!
//! The node program set's key needs a SHA-256 of the capture and inbound objects; it
//! is taken here, once, rather than by every CNI plugin run at start (a megabyte
//! hashed per ADD and DEL).
use std::{env, fs, path::Path, path::PathBuf, process::Command};

use anyhow::{Context as _, anyhow, bail};

/// Every object the `weir-ebpf` crate's bins produce; keep in sync with its Cargo.toml.
const OBJECTS: &[&str] = &["weir-probe", "weir-capture", "weir-inbound"];
const STUB_ENV: &str = "WEIR_EBPF_STUB";

#[path = "../ebpf/build_toolchain.rs"]
mod ebpf_toolchain;

fn main() -> anyhow::Result<()> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?);
    let workspace = manifest_dir.parent().context("agent/ has no parent")?.to_path_buf();
    build_info(&workspace);
    version()?;

    println!("cargo:rerun-if-env-changed={STUB_ENV}");
    let stub = env::var(STUB_ENV).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    if stub {
        println!("cargo:warning={STUB_ENV}=1: writing empty eBPF objects; the agent cannot load them");
        for name in OBJECTS {
            fs::write(out_dir.join(name), b"").with_context(|| format!("write stub {name}"))?;
        }
        println!("cargo:rustc-env=WEIR_EBPF_BUILD=stub");
        return objects_digest(&out_dir);
    }

    ebpf_toolchain::prepare(&workspace, STUB_ENV)?;

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
    objects_digest(&out_dir)
}

/// `WEIR_EBPF_OBJECTS_DIGEST`: the first 12 hex digits of a SHA-256 over the capture
/// then the inbound object, each preceded by its length (u64, little-endian), as
/// `ebpf::set::key_of` takes it (a unit test there holds the two equal).
fn objects_digest(out_dir: &Path) -> anyhow::Result<()> {
    let mut input = Vec::new();
    for name in ["weir-capture", "weir-inbound"] {
        let object = fs::read(out_dir.join(name)).with_context(|| format!("read {name}"))?;
        input.extend_from_slice(&(object.len() as u64).to_le_bytes());
        input.extend_from_slice(&object);
    }
    let hex: String = sha256(&input)[..6].iter().map(|b| format!("{b:02x}")).collect();
    println!("cargo:rustc-env=WEIR_EBPF_OBJECTS_DIGEST={hex}");
    Ok(())
}

/// SHA-256 (FIPS 180-4), for the digest above: build scripts have no crypto library.
fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
    ];
    let mut h: [u32; 8] =
        [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];
    let mut message = data.to_vec();
    message.push(0x80);
    while message.len() % 64 != 56 {
        message.push(0);
    }
    message.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in message.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16].wrapping_add(s0).wrapping_add(w[i - 7]).wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh.wrapping_add(s1).wrapping_add(ch).wrapping_add(K[i]).wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (state, v) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *state = state.wrapping_add(v);
        }
    }
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(h) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

/// The version this build reports (`weir version`, the program set's key, the build
/// marker): `WEIR_VERSION` when a release pipeline stamps one, else the package's.
fn version() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=WEIR_VERSION");
    let version = match env::var("WEIR_VERSION") {
        Ok(v) if !v.is_empty() => {
            let valid = v.starts_with(|c: char| c.is_ascii_digit())
                && v.len() <= 64
                && v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '+'));
            if !valid {
                bail!(
                    "WEIR_VERSION={v:?}: expected a version such as 1.2.3 or 1.2.3-rc.1 (a digit \
                     first, then letters, digits, '.', '-' or '+'; at most 64)"
                );
            }
            v
        }
        _ => env::var("CARGO_PKG_VERSION").context("CARGO_PKG_VERSION not set")?,
    };
    println!("cargo:rustc-env=WEIR_VERSION={version}");
    Ok(())
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
