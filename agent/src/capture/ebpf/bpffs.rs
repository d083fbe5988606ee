//! bpffs, where pinned eBPF objects live: mounting it, the folder Weir pins under, a
//! temporary user's claim on it ([`BpffsUse`]), and removing a folder of pins.

use std::{
    fs::File,
    path::{Path, PathBuf},
};

use super::EbpfError;

/// Where Weir pins: `<bpffs>/weir/<capture>/{maps,links}` per capture, and the node
/// program sets under `<bpffs>/weir/programs/`.
pub const PIN_ROOT: &str = "/sys/fs/bpf/weir";

/// An I/O failure on a pin path, as an [`EbpfError::Pin`].
pub fn pin_error(path: &Path) -> impl FnOnce(std::io::Error) -> EbpfError {
    let path = path.display().to_string();
    move |source| EbpfError::Pin { path, source }
}

/// An aya pin failure at `path`, as an [`EbpfError::Pin`].
pub fn aya_pin_error(path: &Path) -> impl FnOnce(aya::pin::PinError) -> EbpfError {
    let path = path.display().to_string();
    move |e| EbpfError::Pin { path, source: std::io::Error::other(e.to_string()) }
}

/// Creates `dir` (and its parents) on bpffs. A parent another process removes at the
/// same moment (its last capture went) is made again.
pub fn create_dir(dir: &Path) -> Result<(), EbpfError> {
    let mut tries = 0;
    loop {
        match std::fs::create_dir_all(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < 10 => tries += 1,
            other => return other.map_err(pin_error(dir)),
        }
    }
}

/// Whether bpffs is mounted at /sys/fs/bpf.
pub fn bpffs_mounted() -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts.lines().any(|l| {
        let mut f = l.split_whitespace();
        f.nth(1) == Some("/sys/fs/bpf") && f.next() == Some("bpf")
    })
}

/// Mounts bpffs at /sys/fs/bpf if nothing is mounted there yet.
pub fn mount_bpffs() -> Result<(), EbpfError> {
    if bpffs_mounted() {
        return Ok(());
    }
    nix::mount::mount(Some("bpf"), "/sys/fs/bpf", Some("bpf"), nix::mount::MsFlags::empty(), None::<&str>)
        .map_err(|e| EbpfError::Pin { path: "/sys/fs/bpf (mount bpffs)".into(), source: e.into() })
}

/// A temporary user of bpffs (`weir demo`, tests that pin): bpffs is mounted for it
/// when nothing is, and when the last such user leaves, a bpffs one of them mounted is
/// unmounted again if nothing but the kernel's own `*.debug` iterators is in it. Users
/// coordinate through locks in /run/weir: each holds a shared "users" lock; mounting
/// and unmounting happen under an exclusive "mount" lock, unmounting only when no one
/// holds "users".
pub struct BpffsUse {
    users: Option<nix::fcntl::Flock<File>>,
}

const BPFFS_LOCK_DIR: &str = "/run/weir";
/// Present while bpffs is mounted by a temporary user (not by the node or the admin).
const BPFFS_MARKER: &str = "/run/weir/bpffs-mounted-temporarily";

fn lock_file(name: &str) -> Result<File, EbpfError> {
    let io = |source| EbpfError::Io { what: "open a bpffs lock in /run/weir", source };
    std::fs::create_dir_all(BPFFS_LOCK_DIR).map_err(io)?;
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(Path::new(BPFFS_LOCK_DIR).join(name))
        .map_err(io)
}

fn flock(file: File, arg: nix::fcntl::FlockArg) -> Result<nix::fcntl::Flock<File>, EbpfError> {
    nix::fcntl::Flock::lock(file, arg)
        .map_err(|(_, e)| EbpfError::Io { what: "lock a bpffs lock in /run/weir", source: e.into() })
}

impl BpffsUse {
    pub fn acquire() -> Result<Self, EbpfError> {
        let users = flock(lock_file("bpffs-users.lock")?, nix::fcntl::FlockArg::LockShared)?;
        let _mount = flock(lock_file("bpffs-mount.lock")?, nix::fcntl::FlockArg::LockExclusive)?;
        if !bpffs_mounted() {
            mount_bpffs()?;
            std::fs::write(BPFFS_MARKER, b"")
                .map_err(|source| EbpfError::Io { what: "mark bpffs as mounted", source })?;
        }
        Ok(Self { users: Some(users) })
    }
}

/// Whether /sys/fs/bpf holds nothing but the kernel's `*.debug` iterators (and an
/// empty `weir` folder, which it removes).
fn bpffs_unused() -> bool {
    let _ = std::fs::remove_dir(Path::new(PIN_ROOT).join("programs"));
    let _ = std::fs::remove_dir(PIN_ROOT);
    std::fs::read_dir("/sys/fs/bpf")
        .map(|d| d.flatten().all(|e| e.file_name().to_string_lossy().ends_with(".debug")))
        .unwrap_or(false)
}

impl Drop for BpffsUse {
    fn drop(&mut self) {
        drop(self.users.take());
        let Ok(mount) = lock_file("bpffs-mount.lock") else { return };
        let Ok(_mount) = flock(mount, nix::fcntl::FlockArg::LockExclusive) else { return };
        let Ok(users) = lock_file("bpffs-users.lock") else { return };
        // Another user still holds it: the last one unmounts.
        let Ok(_last) = flock(users, nix::fcntl::FlockArg::LockExclusiveNonblock) else { return };
        if Path::new(BPFFS_MARKER).exists() && bpffs_mounted() && bpffs_unused() {
            match nix::mount::umount("/sys/fs/bpf") {
                Ok(()) => {
                    let _ = std::fs::remove_file(BPFFS_MARKER);
                }
                Err(e) => tracing::warn!(error = %e, "cannot unmount /sys/fs/bpf"),
            }
        } else if !bpffs_mounted() {
            let _ = std::fs::remove_file(BPFFS_MARKER);
        }
    }
}

/// Removes every pin under `dir` (links first, which detaches the programs) and the
/// directory itself. Missing pins are fine.
pub fn unpin(dir: &Path) -> Result<(), EbpfError> {
    if !dir.exists() {
        return Ok(());
    }
    for sub in ["links", "netns", "maps"] {
        if let Ok(entries) = std::fs::read_dir(dir.join(sub)) {
            for e in entries.flatten() {
                match std::fs::remove_file(e.path()) {
                    Ok(()) => {}
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                    Err(err) => return Err(pin_error(&e.path())(err)),
                }
            }
        }
        let _ = std::fs::remove_dir(dir.join(sub));
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(pin_error(dir)(e)),
    }
    // The shared root goes when its last capture does (fails harmlessly otherwise).
    if let Some(root) = dir.parent().filter(|p| *p == Path::new(PIN_ROOT)) {
        let _ = std::fs::remove_dir(root);
    }
    Ok(())
}

/// Removes the empty folders between `dir` and [`PIN_ROOT`] (inclusive), innermost
/// first; a folder something else still uses stays.
pub fn remove_empty_parents(dir: &Path) {
    let mut at: Option<PathBuf> = Some(dir.to_path_buf());
    while let Some(d) = at {
        if !d.starts_with(PIN_ROOT) || std::fs::remove_dir(&d).is_err() {
            return;
        }
        at = d.parent().map(Path::to_path_buf);
    }
}
