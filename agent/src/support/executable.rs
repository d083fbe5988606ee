//! Executables handed to another user: opened while the opener can still reach them,
//! then executed through `/proc/self/fd/<n>`, so a child that has dropped to another
//! uid (Envoy as 1337, an app as 1000) never walks the original path. A `weir` or an
//! Envoy under a 0700 directory (a checkout in `/root`, an agent installed under a
//! private prefix) runs as any user the file's own mode allows.
//!
//! The kernel opens the file named by `/proc/self/fd/<n>` before it closes
//! close-on-exec descriptors, and a process may always follow its own descriptors, so
//! the descriptor stays close-on-exec and nothing leaks into the program.

use std::{
    ffi::OsString,
    fs::File,
    io,
    os::{
        fd::{AsRawFd as _, OwnedFd},
        unix::{
            fs::{OpenOptionsExt as _, PermissionsExt as _},
            process::CommandExt as _,
        },
    },
    path::{Path, PathBuf},
    process::Command,
};

#[derive(Debug, thiserror::Error)]
pub enum ExecutableError {
    #[error("open the executable {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is not an executable file (mode {mode:o})")]
    NotExecutable { path: PathBuf, mode: u32 },
}

/// An executable file held open by descriptor.
#[derive(Debug)]
pub struct Executable {
    fd: OwnedFd,
    path: PathBuf,
    arg0: OsString,
}

impl Executable {
    /// Opens `path` (`O_PATH`: no read is needed, only a handle), checking that it is a
    /// regular file with an execute bit.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, ExecutableError> {
        let path = path.as_ref().to_path_buf();
        let open_err = |source| ExecutableError::Open { path: path.clone(), source };
        let file = File::options()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_CLOEXEC)
            .open(&path)
            .map_err(open_err)?;
        let meta = file.metadata().map_err(open_err)?;
        let mode = meta.permissions().mode();
        if !meta.is_file() || mode & 0o111 == 0 {
            return Err(ExecutableError::NotExecutable { path, mode: mode & 0o7777 });
        }
        let arg0 = path.as_os_str().to_owned();
        Ok(Self { fd: file.into(), path, arg0 })
    }

    /// The same file with `argv[0]` set to `name` (e.g. `pilot-agent`, whose
    /// personality `weir` takes from its name).
    pub fn with_arg0(mut self, name: impl Into<OsString>) -> Self {
        self.arg0 = name.into();
        self
    }

    /// The path it was opened by (for messages; a child may not be able to reach it).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where this process reaches the file whatever its uid.
    pub fn fd_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
    }

    /// A command that runs the file, with `argv[0]` the original path (or the name
    /// given to [`Executable::with_arg0`]). Spawn it while `self` is alive.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(self.fd_path());
        cmd.arg0(&self.arg0);
        cmd
    }

    /// As [`Executable::command`], for Tokio.
    pub fn tokio_command(&self) -> tokio::process::Command {
        tokio::process::Command::from(self.command())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_file_is_a_named_error() {
        let e = Executable::open("/nonexistent/envoy").unwrap_err();
        assert!(e.to_string().contains("/nonexistent/envoy"), "{e}");
    }

    #[test]
    fn a_file_without_an_execute_bit_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("envoy");
        std::fs::write(&file, b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Executable::open(&file).unwrap_err();
        assert!(matches!(e, ExecutableError::NotExecutable { mode: 0o644, .. }), "{e}");
        assert!(e.to_string().contains("not an executable file"), "{e}");
        let e = Executable::open(dir.path()).unwrap_err();
        assert!(matches!(e, ExecutableError::NotExecutable { .. }), "{e}");
    }

    #[test]
    fn runs_through_its_descriptor_with_the_original_name() {
        let exe = Executable::open("/bin/sh").unwrap().with_arg0("my-shell");
        let out = exe.command().args(["-c", "echo \"$0\""]).output().unwrap();
        assert!(out.status.success());
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "my-shell");
    }
}
