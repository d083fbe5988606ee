//! The images the cluster runs besides Weir's own: each an OCI archive written here
//! (an image layout with one uncompressed layer, as `scripts/image` writes Weir's), from
//! binaries built by this workspace and the shared libraries they load (found with
//! `ldd`), imported into every node's containerd like Weir's. Nothing is pulled.
//!
//! - `weir-rig-pause`: the sandbox image (`weir-rig pause`: waits for a signal);
//! - `weir-rig`: the rig's own processes (`weir-rig app|client|istiod`);
//! - `weir-rig-ztunnel`: the real ztunnel, built from the peer tarball.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use serde_json::json;

/// An image to write: its reference, its files (machine path, path in the image) and
/// its config.
pub struct ImageSpec<'a> {
    pub reference: &'a str,
    pub files: Vec<(PathBuf, String)>,
    pub entrypoint: Vec<String>,
    pub env: Vec<String>,
    pub user: &'a str,
}

/// The shared libraries `binary` loads (and its loader), as `ldd` lists them.
fn libraries(binary: &Path) -> anyhow::Result<BTreeSet<PathBuf>> {
    let out = Command::new("ldd").arg(binary).output().context("run ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if text.contains("not a dynamic executable") || !out.status.success() {
        return Ok(BTreeSet::new());
    }
    let mut libs = BTreeSet::new();
    for line in text.lines() {
        let path = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.insert(PathBuf::from(p));
        }
    }
    Ok(libs)
}

fn sha256(bytes: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `spec` as an OCI archive at `archive`.
pub fn write(spec: &ImageSpec<'_>, archive: &Path) -> anyhow::Result<()> {
    let work = tempfile::Builder::new().prefix("weir-rig-image-").tempdir()?;
    let root = work.path().join("rootfs");
    let mut files: Vec<(PathBuf, String)> = spec.files.clone();
    for (src, _) in &spec.files {
        for lib in libraries(src)? {
            let into = lib.display().to_string();
            files.push((lib, into));
        }
    }
    for dir in ["tmp", "etc", "proc", "sys", "dev", "var/run", "run"] {
        std::fs::create_dir_all(root.join(dir))?;
    }
    std::fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/:/bin/false\nistio-proxy:x:1337:1337::/:/bin/false\n",
    )?;
    std::fs::write(root.join("etc/group"), "root:x:0:\nistio-proxy:x:1337:\n")?;
    for (src, into) in &files {
        let to = root.join(into.trim_start_matches('/'));
        std::fs::create_dir_all(to.parent().context("a path in the image")?)?;
        std::fs::copy(src, &to).with_context(|| format!("copy {} into the image", src.display()))?;
    }
    let layout = work.path().join("layout");
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs)?;
    let layer_tar = work.path().join("layer.tar");
    let out = Command::new("tar")
        .args(["--numeric-owner", "--owner=0", "--group=0", "--sort=name", "-C"])
        .arg(&root)
        .arg("-cf")
        .arg(&layer_tar)
        .arg(".")
        .output()?;
    if !out.status.success() {
        bail!("tar the layer of {}: {}", spec.reference, String::from_utf8_lossy(&out.stderr));
    }
    let layer = std::fs::read(&layer_tar)?;
    let layer_digest = sha256(&layer);
    std::fs::write(blobs.join(&layer_digest), &layer)?;
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": spec.entrypoint, "Env": spec.env, "User": spec.user, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]}
    }))?;
    let config_digest = sha256(&config);
    std::fs::write(blobs.join(&config_digest), &config)?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{config_digest}"), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": format!("sha256:{layer_digest}"), "size": layer.len()}]
    }))?;
    let manifest_digest = sha256(&manifest);
    std::fs::write(blobs.join(&manifest_digest), &manifest)?;
    std::fs::write(layout.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)?;
    std::fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": format!("sha256:{manifest_digest}"), "size": manifest.len(),
                "annotations": {"org.opencontainers.image.ref.name": spec.reference}
            }]
        }))?,
    )?;
    if let Some(dir) = archive.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let out = Command::new("tar").arg("-C").arg(&layout).arg("-cf").arg(archive).arg(".").output()?;
    if !out.status.success() {
        bail!("tar the archive of {}: {}", spec.reference, String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Where the rig's archives go.
pub fn rig_images_dir() -> PathBuf {
    crate::oci::images_dir().join("rig")
}

pub const RIG_IMAGE: &str = "localhost/weir-rig:dev";
pub const ZTUNNEL_IMAGE: &str = "localhost/weir-rig-ztunnel:dev";

/// Writes the rig's three images; returns their archives.
pub fn build_rig_images() -> anyhow::Result<Vec<PathBuf>> {
    let dir = rig_images_dir();
    let rig = crate::tools::binary("weir-rig");
    let ztunnel = crate::ztunnel::binary().context("the ztunnel peer")?;
    let env = vec!["PATH=/usr/local/bin:/usr/bin:/bin".to_string()];
    let images = [
        ImageSpec {
            reference: super::containerd::PAUSE_IMAGE,
            files: vec![(rig.clone(), "/usr/local/bin/weir-rig".into())],
            entrypoint: vec!["/usr/local/bin/weir-rig".into(), "pause".into()],
            env: env.clone(),
            user: "0:0",
        },
        ImageSpec {
            reference: RIG_IMAGE,
            files: vec![(rig, "/usr/local/bin/weir-rig".into())],
            entrypoint: vec!["/usr/local/bin/weir-rig".into()],
            env: env.clone(),
            user: "0:0",
        },
        ImageSpec {
            reference: ZTUNNEL_IMAGE,
            files: vec![(ztunnel, "/usr/local/bin/ztunnel".into())],
            entrypoint: vec!["/usr/local/bin/ztunnel".into()],
            env,
            user: "0:0",
        },
    ];
    let mut out = Vec::new();
    for spec in &images {
        let name = spec.reference.trim_start_matches("localhost/").replace([':', '/'], "-");
        let archive = dir.join(format!("{name}.tar"));
        write(spec, &archive).with_context(|| format!("write the image {}", spec.reference))?;
        out.push(archive);
    }
    Ok(out)
}
