//! A full disk on purpose: a size-limited tmpfs mounted for one test (unmounted when
//! dropped, also on a failed assertion) and a file that fills it.

use std::path::{Path, PathBuf};

/// A tmpfs mounted at a test's folder.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs with `options` (e.g. `size=64k,uid=1337`) at `dir`, made first.
    pub fn mount(dir: &Path, options: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "weir-test-tmpfs"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mount a tmpfs at {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// Writes `dir/filler` until the file system is full; returns its path (remove it to
/// make room again). Panics if the disk never filled.
pub fn fill(dir: &Path) -> PathBuf {
    use std::io::Write as _;
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let block = vec![0u8; 4096];
    let mut written = 0u64;
    let error = loop {
        match f.write_all(&block) {
            Ok(()) => written += 4096,
            Err(e) => break e,
        }
        assert!(written < 1 << 30, "{} never filled", dir.display());
    };
    assert_eq!(error.raw_os_error(), Some(libc::ENOSPC), "filling {}: {error}", dir.display());
    let _ = f.sync_all();
    path
}
