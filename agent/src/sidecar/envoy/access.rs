//! Whether Envoy, as the user a root agent runs it as, can reach what it needs: its
//! bootstrap (read), the XDS and SDS sockets (connect), and any other file the
//! bootstrap names. Checked for real, not from the modes: a short-lived thread takes
//! Envoy's filesystem uid and gid (`setfsuid`/`setfsgid`, which drop the thread's
//! filesystem capabilities) and no supplementary groups, and opens each path — so
//! ACLs and every directory on the way count, exactly as they will for Envoy.

use std::path::{Path, PathBuf};

/// One thing Envoy will open.
#[derive(Debug, Clone)]
pub enum Need {
    /// A file Envoy reads (its bootstrap, a token file).
    Read { what: &'static str, path: PathBuf },
    /// A Unix socket Envoy connects to.
    Connect { what: &'static str, path: PathBuf },
}

#[derive(Debug, thiserror::Error)]
#[error(
    "Envoy runs as uid {uid} gid {gid} and cannot {verb} {what} {path}: make it and every directory above it \
     reachable by that user (or run the agent as that user)"
)]
pub struct AccessError {
    pub uid: u32,
    pub gid: u32,
    pub verb: &'static str,
    pub what: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Checks every need as `uid`/`gid`; the first one that fails is named.
pub fn check(uid: u32, gid: u32, needs: &[Need]) -> Result<(), AccessError> {
    let needs = needs.to_vec();
    std::thread::spawn(move || {
        // SAFETY: plain system calls on this thread's own credentials (raw setgroups
        // is per-thread on Linux; glibc's wrapper would change every thread's).
        let dropped = unsafe {
            libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) == 0 && {
                libc::setfsgid(gid);
                libc::setfsuid(uid);
                libc::setfsuid(uid) as u32 == uid && libc::setfsgid(gid) as u32 == gid
            }
        };
        let fail = |need: &Need, source: std::io::Error| {
            let (verb, what, path) = match need {
                Need::Read { what, path } => ("read", *what, path.clone()),
                Need::Connect { what, path } => ("connect to", *what, path.clone()),
            };
            AccessError { uid, gid, verb, what, path, source }
        };
        if !dropped {
            let e = std::io::Error::other("could not take Envoy's filesystem credentials to check");
            return needs.first().map_or(Ok(()), |n| Err(fail(n, e)));
        }
        for need in &needs {
            let result = match need {
                Need::Read { path, .. } => std::fs::File::open(path).map(drop),
                Need::Connect { path, .. } => std::os::unix::net::UnixStream::connect(path).map(drop),
            };
            result.map_err(|e| fail(need, e))?;
        }
        Ok(())
    })
    .join()
    .unwrap_or_else(|_| {
        Err(AccessError {
            uid,
            gid,
            verb: "check",
            what: "the paths it needs",
            path: PathBuf::new(),
            source: std::io::Error::other("the checking thread panicked"),
        })
    })
}

/// Creates `dir` (and its parents) as pilot-agent does (0750), handing the
/// directories it makes to `owner` (Envoy's user) so the proxy can reach the sockets
/// and files the agent puts there. Existing directories are left as they are.
pub fn create_dir(dir: &Path, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let mut missing = Vec::new();
    let mut at = Some(dir);
    while let Some(d) = at.filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        missing.push(d.to_path_buf());
        at = d.parent();
    }
    for d in missing.iter().rev() {
        std::fs::create_dir(d).or_else(|e| if d.is_dir() { Ok(()) } else { Err(e) })?;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o750))?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(d, Some(uid), Some(gid))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn a_directory_only_root_can_walk_is_named_with_the_uid() {
        assert!(nix::unistd::geteuid().is_root(), "checking as another uid needs root (sudo scripts/test)");
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let private = dir.path().join("private");
        std::fs::create_dir(&private).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o750)).unwrap();
        let file = private.join("envoy-rev.json");
        std::fs::write(&file, "{}").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let need = [Need::Read { what: "the Envoy bootstrap", path: file.clone() }];
        let e = check(1337, 1337, &need).unwrap_err();
        assert_eq!(e.source.kind(), std::io::ErrorKind::PermissionDenied);
        let text = e.to_string();
        assert!(text.contains("uid 1337") && text.contains("envoy-rev.json"), "{text}");
        std::os::unix::fs::chown(&private, Some(1337), Some(1337)).unwrap();
        check(1337, 1337, &need).unwrap();
        check(0, 0, &need).unwrap();
    }

    #[test]
    fn directories_made_for_envoy_belong_to_it() {
        use std::os::unix::fs::MetadataExt as _;
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("etc/istio/proxy");
        let me = (nix::unistd::geteuid().as_raw(), nix::unistd::getegid().as_raw());
        create_dir(&target, Some(me)).unwrap();
        let meta = std::fs::metadata(&target).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o750);
        assert_eq!((meta.uid(), meta.gid()), me);
        create_dir(&target, Some(me)).unwrap();
    }
}
