//! Weir's built images as a container runtime sees them: an OCI archive from
//! `scripts/image` (under `target/images/`) unpacked into a root file system, with the
//! image's config (entrypoint, command, environment, user). Tests run an image's
//! entrypoint chrooted in that root inside a test namespace: containers cannot run on
//! this host, but the root, the binaries and the config are the image's own.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use serde_json::Value;

/// Where `scripts/image` writes its archives.
pub fn images_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/images")
}

/// An unpacked image. The root is removed on drop.
pub struct UnpackedImage {
    pub name: String,
    /// The unpacked root file system (owned by the test).
    pub root: PathBuf,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `KEY=value` entries of the image's config.
    pub env: Vec<(String, String)>,
    /// The config's `User` (`uid:gid`), empty for root.
    pub user: String,
    _dir: TempDir,
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl UnpackedImage {
    /// Unpacks `target/images/<name>.tar`; fails naming the archive and how to build it
    /// when there is none.
    pub fn unpack(name: &str) -> anyhow::Result<Self> {
        let archive = images_dir().join(format!("{name}.tar"));
        if !archive.is_file() {
            bail!(
                "no image archive {} (scripts/image builds it; scripts/test runs it first)",
                archive.display()
            );
        }
        let dir = std::env::temp_dir().join(format!("weir-image-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let guard = TempDir(dir.clone());
        let layout = dir.join("oci");
        let root = dir.join("rootfs");
        std::fs::create_dir_all(&layout)?;
        std::fs::create_dir_all(&root)?;
        untar(&archive, &layout, false)?;
        let index = read_json(&layout.join("index.json"))?;
        let manifest = blob(&layout, &index["manifests"][0]["digest"])?;
        let config = blob(&layout, &manifest["config"]["digest"])?;
        let layers = manifest["layers"].as_array().context("manifest has no layers")?;
        for layer in layers {
            let media = layer["mediaType"].as_str().unwrap_or_default();
            let path = blob_path(&layout, &layer["digest"])?;
            untar(&path, &root, media.ends_with("+gzip"))?;
        }
        std::fs::remove_dir_all(&layout)?;
        let strings = |v: &Value| -> Vec<String> {
            v.as_array().into_iter().flatten().filter_map(|s| s.as_str().map(String::from)).collect()
        };
        let c = &config["config"];
        let env = strings(&c["Env"])
            .into_iter()
            .filter_map(|e| e.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect();
        Ok(Self {
            name: name.into(),
            root,
            entrypoint: strings(&c["Entrypoint"]),
            cmd: strings(&c["Cmd"]),
            env,
            user: c["User"].as_str().unwrap_or_default().into(),
            _dir: guard,
        })
    }

    /// `path` (absolute, as the container sees it) on the host.
    pub fn path(&self, path: &str) -> PathBuf {
        self.root.join(path.trim_start_matches('/'))
    }
}

fn untar(archive: &Path, into: &Path, gzip: bool) -> anyhow::Result<()> {
    let mut cmd = Command::new("tar");
    cmd.arg(if gzip { "-xzf" } else { "-xf" }).arg(archive).arg("-C").arg(into).args([
        "--numeric-owner",
        "--same-owner",
        "--same-permissions",
    ]);
    let out = cmd.output().with_context(|| format!("run tar on {}", archive.display()))?;
    if !out.status.success() {
        bail!("tar -x {}: {}", archive.display(), String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

fn read_json(path: &Path) -> anyhow::Result<Value> {
    let text = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    serde_json::from_slice(&text).with_context(|| format!("parse {}", path.display()))
}

fn blob_path(layout: &Path, digest: &Value) -> anyhow::Result<PathBuf> {
    let digest = digest.as_str().context("digest is not a string")?;
    let (algo, hex) = digest.split_once(':').with_context(|| format!("digest {digest:?}"))?;
    if algo != "sha256" || hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("digest {digest:?} is not sha256:<64 hex>");
    }
    Ok(layout.join("blobs/sha256").join(hex))
}

fn blob(layout: &Path, digest: &Value) -> anyhow::Result<Value> {
    read_json(&blob_path(layout, digest)?)
}
