//! A pod's volumes as the kubelet lays them out, and a container's mounts of them.
//!
//! Under one directory per pod (removed on drop): emptyDirs (0777; `medium: Memory` is
//! a tmpfs made in the container's own mount namespace), and ConfigMap, Secret,
//! downward-API and projected volumes written as the kubelet's atomic writer writes
//! them (`..<timestamp>/` with the files, `..data` → it, each file a symlink through
//! `..data`), downward-API maps as `key="value"` lines. `fsGroup` makes the volumes
//! group-owned and setgid, as `SetVolumeOwnership` does. CSI volumes are directories
//! a test publishes (a SPIRE agent's socket).
//!
//! A container sees each volume at its real path. Paths the host lacks (`/etc/istio`,
//! `/var/lib/istio`) appear through an overlay of their nearest existing ancestor whose
//! upper layer holds only the mount points, so the host's files stay visible and
//! untouched; with `readOnlyRootFilesystem` the root and overlays are read-only, as
//! the image is. Every mount is made in the container's private mount namespace.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    os::unix::fs::{PermissionsExt as _, lchown},
    path::{Component, Path, PathBuf},
};

use anyhow::{Context as _, bail};
use weir_agent::sandbox::process::Mount;

use super::{
    env::{PodStatus, field_value},
    manifest::{Container, DownwardApi, Manifest, ObjectVolume, VolumeSource},
};
use crate::envoy::tempfile_dir::Dir;

/// What the API server would hand the kubelet for the pod's volumes.
#[derive(Debug, Clone, Default)]
pub struct VolumeSources {
    /// ConfigMaps in the pod's namespace: name → key → content.
    pub config_maps: BTreeMap<String, BTreeMap<String, String>>,
    /// Secrets in the pod's namespace: name → key → content.
    pub secrets: BTreeMap<String, BTreeMap<String, String>>,
    /// The service account token (every audience gets it).
    pub token: String,
    /// Directories CSI drivers publish, by driver name.
    pub csi: BTreeMap<String, PathBuf>,
}

/// Where a volume's content lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeDir {
    /// A directory on the host, bound into containers.
    Host(PathBuf),
    /// A tmpfs made in each container's mount namespace, with these options.
    Tmpfs(String),
}

/// A file or directory the runtime or the image puts in a container (`/etc/hosts`,
/// the image's files), bound read-only unless asked.
#[derive(Debug, Clone)]
pub struct ExtraMount {
    pub target: PathBuf,
    pub source: PathBuf,
    pub read_only: bool,
}

/// A pod's volumes on disk.
pub struct PodVolumes {
    root: Dir,
    volumes: BTreeMap<String, VolumeDir>,
    overlays: usize,
}

impl PodVolumes {
    /// Lays out every volume of `manifest`'s pod.
    pub fn create(manifest: &Manifest, status: &PodStatus, sources: &VolumeSources) -> anyhow::Result<Self> {
        let root = Dir::new(&format!("pod-{}", manifest.name()))?;
        std::fs::create_dir(root.path().join("volumes"))?;
        let fs_group = manifest.spec.security_context.fs_group;
        let mut volumes = BTreeMap::new();
        for volume in &manifest.spec.volumes {
            let dir = root.path().join("volumes").join(&volume.name);
            let made = (|| -> anyhow::Result<VolumeDir> {
                let (made, read_only) = match volume.source()? {
                    VolumeSource::EmptyDir(e) if e.medium.as_deref() == Some("Memory") => {
                        let options = match fs_group {
                            Some(gid) => format!("mode=3777,gid={gid}"),
                            None => "mode=1777".into(),
                        };
                        return Ok(VolumeDir::Tmpfs(options));
                    }
                    VolumeSource::EmptyDir(_) => {
                        std::fs::create_dir(&dir)?;
                        set_mode(&dir, 0o777)?;
                        (VolumeDir::Host(dir.clone()), false)
                    }
                    VolumeSource::DownwardApi(d) => {
                        let files = downward_files(manifest, status, d, 0o644)?;
                        atomic_write(&dir, &files)?;
                        (VolumeDir::Host(dir.clone()), true)
                    }
                    VolumeSource::Projected(p) => {
                        let mode = p.default_mode.unwrap_or(0o644);
                        let mut files = Vec::new();
                        for source in &p.sources {
                            if let Some(token) = &source.service_account_token {
                                files.push((token.path.clone(), sources.token.clone().into_bytes(), mode));
                            }
                            if let Some(cm) = &source.config_map {
                                files.extend(keys(&sources.config_maps, cm, mode)?);
                            }
                            if let Some(secret) = &source.secret {
                                files.extend(keys(&sources.secrets, secret, mode)?);
                            }
                            if let Some(d) = &source.downward_api {
                                files.extend(downward_files(manifest, status, d, mode)?);
                            }
                        }
                        atomic_write(&dir, &files)?;
                        (VolumeDir::Host(dir.clone()), true)
                    }
                    VolumeSource::ConfigMap(cm) => {
                        let mode = cm.default_mode.unwrap_or(0o644);
                        let files = keys(&sources.config_maps, cm, mode)?;
                        atomic_write(&dir, &files)?;
                        (VolumeDir::Host(dir.clone()), true)
                    }
                    VolumeSource::Secret(s) => {
                        let mode = s.default_mode.unwrap_or(0o644);
                        let files = keys(&sources.secrets, s, mode)?;
                        atomic_write(&dir, &files)?;
                        (VolumeDir::Host(dir.clone()), true)
                    }
                    // The node's own path (the kubelet stand-in checks its `type` on the node).
                    VolumeSource::HostPath(h) => return Ok(VolumeDir::Host(PathBuf::from(&h.path))),
                    VolumeSource::Csi(csi) => {
                        let published = sources
                            .csi
                            .get(&csi.driver)
                            .with_context(|| format!("no CSI driver {:?}", csi.driver))?;
                        return Ok(VolumeDir::Host(published.clone()));
                    }
                };
                if let Some(gid) = fs_group {
                    set_volume_ownership(&dir, gid, read_only)?;
                }
                Ok(made)
            })()
            .with_context(|| format!("volume {}", volume.name))?;
            volumes.insert(volume.name.clone(), made);
        }
        Ok(Self { root, volumes, overlays: 0 })
    }

    /// The pod's directory (volumes, overlays; the rig keeps logs and files there too).
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// Where a volume's content is on the host (`None` for a tmpfs one).
    pub fn host_dir(&self, volume: &str) -> Option<&Path> {
        match self.volumes.get(volume)? {
            VolumeDir::Host(path) => Some(path),
            VolumeDir::Tmpfs(_) => None,
        }
    }

    /// The tmpfs options of a `medium: Memory` emptyDir (`None` for any other volume).
    pub fn tmpfs_options(&self, volume: &str) -> Option<&str> {
        match self.volumes.get(volume)? {
            VolumeDir::Tmpfs(options) => Some(options),
            VolumeDir::Host(_) => None,
        }
    }

    /// `container`'s mounts: overlays for mount points the host lacks, its volumes
    /// (parents before children), `extra`, and the root made read-only when the
    /// container asks.
    pub fn mounts(&mut self, container: &Container, extra: &[ExtraMount]) -> anyhow::Result<Vec<Mount>> {
        let wanted = self.wanted(container, extra)?;

        // Mount points: inside an earlier host-directory mount (made there, as a
        // runtime would), on the host already, or in an overlay of the nearest
        // ancestor the host has.
        let mut skeleton: BTreeMap<PathBuf, Vec<(PathBuf, bool)>> = BTreeMap::new();
        for (i, w) in wanted.iter().enumerate() {
            if let Some(parent) = wanted[..i].iter().rev().find(|p| w.target.starts_with(&p.target)) {
                let rel = w.target.strip_prefix(&parent.target).expect("starts_with");
                match &parent.source {
                    VolumeDir::Host(dir) => make_mount_point(&dir.join(rel), w.file)?,
                    VolumeDir::Tmpfs(_) => {
                        bail!("{} is inside a Memory emptyDir mount", w.target.display())
                    }
                }
                continue;
            }
            if w.target.exists() {
                continue;
            }
            let mut ancestor = w.target.parent().expect("absolute");
            while !ancestor.exists() {
                ancestor = ancestor.parent().expect("/ exists");
            }
            let real = ancestor.canonicalize().with_context(|| format!("resolve {}", ancestor.display()))?;
            let rel = w.target.strip_prefix(ancestor).expect("ancestor").to_path_buf();
            skeleton.entry(real).or_default().push((rel, w.file));
        }
        // One overlay per outermost ancestor.
        let outer: Vec<PathBuf> = skeleton.keys().cloned().collect();
        let mut merged: BTreeMap<PathBuf, Vec<(PathBuf, bool)>> = BTreeMap::new();
        for (dir, entries) in skeleton {
            let top = outer.iter().find(|o| dir.starts_with(o)).expect("itself at least").clone();
            let prefix = dir.strip_prefix(&top).expect("starts_with").to_path_buf();
            merged
                .entry(top)
                .or_default()
                .extend(entries.into_iter().map(|(rel, file)| (prefix.join(rel), file)));
        }
        let read_only_root = container.read_only_root();
        let mut mounts = Vec::new();
        for (target, entries) in merged {
            self.overlays += 1;
            let base = self.root.path().join(format!("overlay-{}", self.overlays));
            let (upper, work) = (base.join("upper"), base.join("work"));
            for dir in [&base, &upper, &work] {
                std::fs::create_dir(dir)?;
                set_mode(dir, 0o755)?;
            }
            for (rel, file) in entries {
                make_mount_point(&upper.join(rel), file)?;
            }
            mounts.push(Mount::Overlay { target, upper, work, read_only: read_only_root });
        }
        for w in wanted {
            mounts.push(match w.source {
                VolumeDir::Host(source) => Mount::Bind { source, target: w.target, read_only: w.read_only },
                VolumeDir::Tmpfs(options) => Mount::Tmpfs { target: w.target, options },
            });
        }
        if read_only_root {
            mounts.push(Mount::ReadOnly { target: PathBuf::from("/") });
        }
        Ok(mounts)
    }

    /// What `container` mounts where: its volumes and `extra`, parents first, as
    /// runtimes order them.
    fn wanted(&self, container: &Container, extra: &[ExtraMount]) -> anyhow::Result<Vec<Wanted>> {
        let mut wanted = Vec::new();
        for m in &container.volume_mounts {
            let dir = self
                .volumes
                .get(&m.name)
                .with_context(|| format!("container {} mounts unknown volume {}", container.name, m.name))?;
            let source = match (dir, &m.sub_path) {
                (VolumeDir::Host(path), Some(sub)) if !sub.is_empty() => VolumeDir::Host(path.join(sub)),
                (VolumeDir::Tmpfs(_), Some(sub)) if !sub.is_empty() => {
                    bail!("container {}: subPath in Memory emptyDir {}", container.name, m.name)
                }
                (dir, _) => dir.clone(),
            };
            wanted.push(Wanted {
                target: clean(&m.mount_path)?,
                source,
                read_only: m.read_only,
                file: false,
            });
        }
        for e in extra {
            let file = e.source.is_file();
            wanted.push(Wanted {
                target: clean(&e.target.to_string_lossy())?,
                source: VolumeDir::Host(e.source.clone()),
                read_only: e.read_only,
                file,
            });
        }
        wanted.sort_by_key(|w| w.target.components().count());
        Ok(wanted)
    }

    /// `container`'s mounts when it runs in an image's unpacked `root` (chrooted): the
    /// host's /proc and /dev, its volumes and `extra` at their paths under `root`
    /// (mount points made in the root, as a runtime makes them in a container's), and
    /// the root made read-only when the container asks. `root` is bound onto itself
    /// first, so that it is a mount of its own.
    pub fn mounts_under(
        &mut self,
        root: &Path,
        container: &Container,
        extra: &[ExtraMount],
    ) -> anyhow::Result<Vec<Mount>> {
        let mut mounts = vec![Mount::Bind { source: root.into(), target: root.into(), read_only: false }];
        for system in ["/proc", "/dev"] {
            let target = mount_point_under(root, Path::new(system), false)?;
            mounts.push(Mount::Bind { source: system.into(), target, read_only: false });
        }
        let wanted = self.wanted(container, extra)?;
        for (i, w) in wanted.iter().enumerate() {
            // Inside an earlier host-directory mount: the mount point is made there.
            match wanted[..i].iter().rev().find(|p| w.target.starts_with(&p.target)) {
                Some(parent) => match &parent.source {
                    VolumeDir::Host(dir) => make_mount_point(
                        &dir.join(w.target.strip_prefix(&parent.target).expect("inside")),
                        w.file,
                    )?,
                    VolumeDir::Tmpfs(_) => bail!("{} is inside a Memory emptyDir mount", w.target.display()),
                },
                None => drop(mount_point_under(root, &w.target, w.file)?),
            }
        }
        for w in wanted {
            let target = root.join(w.target.strip_prefix("/").expect("clean paths are absolute"));
            mounts.push(match w.source {
                VolumeDir::Host(source) => Mount::Bind { source, target, read_only: w.read_only },
                VolumeDir::Tmpfs(options) => Mount::Tmpfs { target, options },
            });
        }
        if container.read_only_root() {
            mounts.push(Mount::ReadOnly { target: root.into() });
        }
        Ok(mounts)
    }
}

/// The mount point for the absolute container `path` in an image's unpacked `root`
/// (a directory, or an empty file), made from the host's side; its host path. Fails when
/// `path`, or a directory on the way to it, is a symlink in the image: an absolute
/// symlink would lead the mount point out of the root, onto the host.
pub fn mount_point_under(root: &Path, path: &Path, file: bool) -> anyhow::Result<PathBuf> {
    let rel =
        path.strip_prefix("/").with_context(|| format!("mount path {} is not absolute", path.display()))?;
    let mut at = root.to_path_buf();
    for part in rel.components() {
        at.push(part);
        if std::fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
            bail!("mount point {} goes through the image's symlink {}", path.display(), at.display());
        }
    }
    make_mount_point(&at, file)?;
    Ok(at)
}

/// One mount a container wants.
struct Wanted {
    target: PathBuf,
    source: VolumeDir,
    read_only: bool,
    file: bool,
}

/// An absolute path without `.`, `..` or a trailing `/`.
fn clean(path: &str) -> anyhow::Result<PathBuf> {
    let p = Path::new(path);
    if !p.is_absolute() || p.components().any(|c| matches!(c, Component::ParentDir | Component::CurDir)) {
        bail!("mount path {path:?} is not a clean absolute path");
    }
    Ok(p.components().collect())
}

/// A directory (each new level 0755) or an empty file (0644) to mount over.
fn make_mount_point(path: &Path, file: bool) -> anyhow::Result<()> {
    let dir = if file { path.parent().expect("absolute") } else { path };
    let mut missing = Vec::new();
    let mut at = dir;
    while !at.exists() {
        missing.push(at.to_path_buf());
        at = at.parent().expect("root exists");
    }
    for d in missing.iter().rev() {
        std::fs::create_dir(d).with_context(|| format!("create mount point {}", d.display()))?;
        set_mode(d, 0o755)?;
    }
    if file && !path.exists() {
        std::fs::write(path, b"").with_context(|| format!("create mount point {}", path.display()))?;
        set_mode(path, 0o644)?;
    }
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

type File = (String, Vec<u8>, u32);

/// The files of a ConfigMap or Secret: all keys, or `items`' keys at their paths. A
/// missing object is empty when optional, else the pod cannot start.
fn keys(
    objects: &BTreeMap<String, BTreeMap<String, String>>,
    volume: &ObjectVolume,
    mode: u32,
) -> anyhow::Result<Vec<File>> {
    let (name, items) = (&volume.name, &volume.items);
    let Some(data) = objects.get(name) else {
        if volume.optional {
            return Ok(Vec::new());
        }
        bail!("{name:?} does not exist and is not optional: the kubelet would not start the pod");
    };
    if items.is_empty() {
        return Ok(data.iter().map(|(k, v)| (k.clone(), v.clone().into_bytes(), mode)).collect());
    }
    items
        .iter()
        .map(|i| {
            let value = data.get(&i.key).with_context(|| format!("{name:?} has no key {:?}", i.key))?;
            Ok((i.path.clone(), value.clone().into_bytes(), i.mode.unwrap_or(mode)))
        })
        .collect()
}

/// A downward-API volume's files.
fn downward_files(
    manifest: &Manifest,
    status: &PodStatus,
    d: &DownwardApi,
    mode: u32,
) -> anyhow::Result<Vec<File>> {
    let mode = d.default_mode.unwrap_or(mode);
    d.items
        .iter()
        .map(|item| {
            let field = item
                .field_ref
                .as_ref()
                .with_context(|| format!("downward API item {}: only fieldRef", item.path))?;
            Ok((
                item.path.clone(),
                field_value(manifest, status, field)?.into_bytes(),
                item.mode.unwrap_or(mode),
            ))
        })
        .collect()
}

/// Writes `files` as the kubelet's `AtomicWriter`: into `dir/..<timestamp>/`, linked
/// as `dir/..data`, each top-level entry a symlink through `..data`.
fn atomic_write(dir: &Path, files: &[File]) -> anyhow::Result<()> {
    std::fs::create_dir(dir)?;
    set_mode(dir, 0o755)?;
    let payload = format!("..{}", kubelet_timestamp());
    let data = dir.join(&payload);
    std::fs::create_dir(&data)?;
    set_mode(&data, 0o755)?;
    let mut top = std::collections::BTreeSet::new();
    for (path, content, mode) in files {
        let rel = Path::new(path);
        if rel.is_absolute() || rel.components().any(|c| matches!(c, Component::ParentDir)) {
            bail!("volume file path {path:?} must be relative and inside the volume");
        }
        let target = data.join(rel);
        make_mount_point(target.parent().expect("inside the payload"), false)?;
        std::fs::write(&target, content)?;
        set_mode(&target, *mode)?;
        if let Some(Component::Normal(first)) = rel.components().next() {
            top.insert(first.to_os_string());
        }
    }
    std::os::unix::fs::symlink(&payload, dir.join("..data"))?;
    for first in top {
        std::os::unix::fs::symlink(Path::new("..data").join(&first), dir.join(&first))?;
    }
    Ok(())
}

/// `..2006_01_02_15_04_05.<n>`, UTC, as the kubelet names its payload directories.
fn kubelet_timestamp() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = now.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = i64::try_from(days).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}_{month:02}_{day:02}_{:02}_{:02}_{:02}.{}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        now.subsec_nanos()
    )
}

/// `fsGroup` on a volume: every entry group-owned by `gid`, group-readable (and
/// writable unless the volume is read-only), directories setgid.
fn set_volume_ownership(dir: &Path, gid: u32, read_only: bool) -> anyhow::Result<()> {
    let mask = if read_only { 0o440 } else { 0o660 };
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        lchown(&path, None, Some(gid)).with_context(|| format!("chgrp {}", path.display()))?;
        let meta = std::fs::symlink_metadata(&path)?;
        if meta.file_type().is_symlink() {
            continue;
        }
        let mut mode = meta.permissions().mode() & 0o7777 | mask;
        if meta.is_dir() {
            mode |= 0o2000 | 0o110;
            stack.extend(std::fs::read_dir(&path)?.flatten().map(|e| e.path()));
        }
        set_mode(&path, mode)?;
    }
    Ok(())
}

/// The pod's `/etc/hosts` as the kubelet writes it, with `aliases` (IP, names) as
/// `hostAliases` entries.
pub fn hosts_file(pod_ip: IpAddr, hostname: &str, aliases: &[(IpAddr, &str)]) -> String {
    let mut text = String::from(
        "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n\
         fe00::0\tip6-localnet\nfe00::0\tip6-mcastprefix\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n",
    );
    text.push_str(&format!("{pod_ip}\t{hostname}\n"));
    if !aliases.is_empty() {
        text.push_str("\n# Entries added by HostAliases.\n");
        for (ip, name) in aliases {
            text.push_str(&format!("{ip}\t{name}\n"));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kubelet_timestamp_is_a_utc_date() {
        let t = kubelet_timestamp();
        let (date, nanos) = t.split_once('.').unwrap();
        let parts: Vec<u32> = date.split('_').map(|p| p.parse().unwrap()).collect();
        assert_eq!(parts.len(), 6, "{t}");
        assert!(parts[0] >= 2025 && (1..=12).contains(&parts[1]) && (1..=31).contains(&parts[2]), "{t}");
        assert!(parts[3] < 24 && parts[4] < 60 && parts[5] < 60, "{t}");
        assert!(nanos.parse::<u32>().is_ok(), "{t}");
    }

    #[test]
    fn atomic_writes_are_read_through_data_symlinks() {
        let dir = Dir::new("atomic").unwrap();
        let vol = dir.path().join("vol");
        atomic_write(
            &vol,
            &[("labels".into(), b"app=\"x\"".to_vec(), 0o644), ("sub/key.pem".into(), b"k".to_vec(), 0o600)],
        )
        .unwrap();
        assert_eq!(std::fs::read_to_string(vol.join("labels")).unwrap(), "app=\"x\"");
        assert_eq!(std::fs::read_link(vol.join("labels")).unwrap(), Path::new("..data/labels"));
        assert_eq!(std::fs::read_link(vol.join("sub")).unwrap(), Path::new("..data/sub"));
        let payload = std::fs::read_link(vol.join("..data")).unwrap();
        assert!(payload.to_string_lossy().starts_with("..20"), "{payload:?}");
        let mode = std::fs::metadata(vol.join("sub/key.pem")).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let escape = atomic_write(&dir.path().join("bad"), &[("../x".into(), vec![], 0o644)]);
        assert!(escape.is_err());
    }

    #[test]
    fn hosts_files_carry_the_pod_and_its_aliases() {
        let text = hosts_file(
            "10.66.0.12".parse().unwrap(),
            "web",
            &[("10.66.0.10".parse().unwrap(), "istiod.istio-system.svc")],
        );
        assert!(text.starts_with("# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n"), "{text}");
        assert!(text.contains("\n10.66.0.12\tweb\n"), "{text}");
        assert!(
            text.ends_with("# Entries added by HostAliases.\n10.66.0.10\tistiod.istio-system.svc\n"),
            "{text}"
        );
    }

    #[test]
    fn mount_paths_must_be_clean_and_absolute() {
        assert_eq!(clean("/etc/certs/").unwrap(), Path::new("/etc/certs"));
        assert!(clean("etc/certs").is_err());
        assert!(clean("/etc/../root").is_err());
    }
}
