//! Files replaced whole or not at all, and never readable beyond their final mode: the
//! content goes into a fresh temporary file next to the target, created with the final
//! mode (`O_CREAT|O_EXCL|O_NOFOLLOW`, so never a file or symlink that was there before,
//! which someone may hold open), synced, then renamed over the target. For credentials
//! (a kubeconfig with its token, a CA key) as much as for any other file.

use std::{
    io::Write as _,
    os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

#[derive(Debug, thiserror::Error)]
#[error("{what} {path}")]
pub struct WriteError {
    pub what: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// The temporary file `write` uses for `path`: `.<name>.weir-tmp` beside it.
pub fn temporary(path: &Path) -> PathBuf {
    path.with_file_name(format!(".{}.weir-tmp", path.file_name().unwrap_or_default().to_string_lossy()))
}

/// Replaces `path` with `bytes`, mode `mode` (exactly: the umask does not narrow it).
pub fn write(path: &Path, bytes: &[u8], mode: u32) -> Result<(), WriteError> {
    let tmp = temporary(path);
    let result = write_new(&tmp, bytes, mode).and_then(|()| {
        std::fs::rename(&tmp, path).map_err(|source| WriteError {
            what: "rename into place",
            path: path.into(),
            source,
        })
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Writes a new file at `tmp`; a leftover there (a crash's, or planted) is removed
/// first, never written into.
fn write_new(tmp: &Path, bytes: &[u8], mode: u32) -> Result<(), WriteError> {
    let err = |what| move |source| WriteError { what, path: tmp.into(), source };
    match std::fs::remove_file(tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err("remove the leftover")(e)),
        _ => {}
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(tmp)
        .map_err(err("create"))?;
    // The umask may have taken bits `mode` asks for (0644 under umask 077).
    file.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(err("chmod"))?;
    file.write_all(bytes).and_then(|()| file.sync_data()).map_err(err("write"))
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;

    use super::*;

    fn mode_of(path: &Path) -> u32 {
        std::fs::symlink_metadata(path).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn a_file_gets_its_mode_and_content_and_no_leftover() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key.pem");
        write(&path, b"secret", 0o600).unwrap();
        assert_eq!((std::fs::read(&path).unwrap(), mode_of(&path)), (b"secret".to_vec(), 0o600));
        write(&path, b"public", 0o644).unwrap();
        assert_eq!((std::fs::read(&path).unwrap(), mode_of(&path)), (b"public".to_vec(), 0o644));
        assert!(!temporary(&path).exists());
    }

    /// Someone holding a leftover temporary file open (or a symlink planted in its
    /// place) never sees what is written.
    #[test]
    fn a_leftover_temporary_file_or_symlink_is_never_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        let tmp = temporary(&path);
        std::fs::write(&tmp, b"").unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut held = std::fs::File::open(&tmp).unwrap();
        write(&path, b"token: secret", 0o600).unwrap();
        let mut seen = String::new();
        held.read_to_string(&mut seen).unwrap();
        assert_eq!(seen, "");

        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"").unwrap();
        std::os::unix::fs::symlink(&target, &tmp).unwrap();
        write(&path, b"token: secret", 0o600).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"");
        assert_eq!((std::fs::read(&path).unwrap(), mode_of(&path)), (b"token: secret".to_vec(), 0o600));
    }

    /// A failed rename leaves nothing behind (the target here is a directory).
    #[test]
    fn a_failure_removes_the_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("taken");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("inside"), b"x").unwrap();
        let e = write(&path, b"x", 0o600).unwrap_err();
        assert_eq!((e.what, e.path.as_path()), ("rename into place", path.as_path()));
        assert!(!temporary(&path).exists());
    }
}
