//! The node agent's Unix sockets, which only their one peer may drive (the CNI plugin,
//! run as root by the container runtime; ztunnel): each lives in a directory only root
//! can write, is bound under a private name and renamed into place once it is `0600`
//! (never reachable with looser modes, whatever the umask), and every connection's
//! `SO_PEERCRED` is checked against the uids allowed before anything it sends is read.

use std::{
    os::{
        fd::BorrowedFd,
        unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _},
    },
    path::{Path, PathBuf},
};

/// Why a socket could not be made private.
#[derive(Debug, thiserror::Error)]
#[error("{what} {path}")]
pub struct LocalSocketError {
    pub what: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

fn fail<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> LocalSocketError + 'a {
    move |source| LocalSocketError { what, path: path.to_path_buf(), source }
}

/// Makes `dir` a directory only its owner, root, can write: created `0700` when
/// missing; an existing one that others could write (or that root does not own) has
/// group and other write taken away and its owner set to root, with a warning naming
/// what it was.
pub fn private_dir(dir: &Path) -> Result<(), LocalSocketError> {
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(fail("create the socket directory", dir)),
        Err(e) => Err(fail("stat the socket directory", dir)(e)),
        Ok(m) if !m.is_dir() => Err(fail("refusing a socket directory that is not a directory:", dir)(
            std::io::Error::from(std::io::ErrorKind::AlreadyExists),
        )),
        Ok(m) => {
            let mode = m.mode() & 0o7777;
            if m.uid() != 0 || mode & 0o022 != 0 {
                tracing::warn!(dir = %dir.display(), owner = m.uid(), mode = format!("{mode:o}"), "the socket directory could be written by others than root: made root's alone");
                std::os::unix::fs::lchown(dir, Some(0), Some(0))
                    .map_err(fail("chown the socket directory", dir))?;
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & !0o022))
                    .map_err(fail("chmod the socket directory", dir))?;
            }
            Ok(())
        }
    }
}

/// Binds a socket at `path` through `bind` (given a private name beside it), `0600`,
/// then renames it into place, replacing a socket an earlier agent left there;
/// anything else at `path` is refused. The directory is made [`private_dir`] first.
pub fn bind_private<T>(
    path: &Path,
    bind: impl FnOnce(&Path) -> std::io::Result<T>,
) -> Result<T, LocalSocketError> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    private_dir(dir)?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if !std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            return Err(fail("refusing to replace a file that is not a socket:", path)(
                std::io::Error::from(std::io::ErrorKind::AlreadyExists),
            ));
        }
        _ => {}
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let private = dir.join(format!(".{name}.{}.binding", std::process::id()));
    let _ = std::fs::remove_file(&private);
    let bound = bind(&private).map_err(fail("bind", &private))?;
    let placed = std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600))
        .map_err(fail("chmod", &private))
        .and_then(|()| std::fs::rename(&private, path).map_err(fail("rename into place", path)));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&private);
        return Err(e);
    }
    Ok(bound)
}

/// The uid of the process at the other end of the connected Unix socket `fd`.
pub fn peer_uid(fd: BorrowedFd<'_>) -> std::io::Result<u32> {
    let cred = nix::sys::socket::getsockopt(&fd, nix::sys::socket::sockopt::PeerCredentials)?;
    Ok(cred.uid())
}

/// `Ok` when the peer on `fd` runs as one of `allowed`; else why not, for the log.
pub fn check_peer(fd: BorrowedFd<'_>, allowed: &[u32], socket: &str) -> Result<u32, String> {
    match peer_uid(fd) {
        Ok(uid) if allowed.contains(&uid) => Ok(uid),
        Ok(uid) => Err(format!("{socket}: a peer running as uid {uid} refused (allowed: {allowed:?})")),
        Err(e) => Err(format!("{socket}: the peer's credentials cannot be read: {e}")),
    }
}
