//! Cgroup attachments as bpf_links made with `BPF_LINK_CREATE` directly: one link type
//! for every cgroup hook (aya cannot pin its getsockopt link), closed to detach, pinned
//! with `BPF_OBJ_PIN` to outlive this process. Links to one cgroup coexist with other
//! programs on it (link semantics are multi-attach). Whether a pinned link still acts
//! is [`attached_to`]: a link survives its cgroup's removal and `bpftool link detach`,
//! pinned but detached.

use std::{
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::Path,
};

use super::sys;
pub use super::sys::{link_prog_id, obj_get, prog_id};

/// UAPI `enum bpf_attach_type` values Weir attaches with.
pub mod attach_type {
    pub const INET_INGRESS: u32 = 0;
    pub const SOCK_OPS: u32 = 3;
    pub const INET4_CONNECT: u32 = 10;
    pub const INET6_CONNECT: u32 = 11;
    pub const UDP4_SENDMSG: u32 = 14;
    pub const UDP6_SENDMSG: u32 = 15;
    pub const UDP4_RECVMSG: u32 = 19;
    pub const UDP6_RECVMSG: u32 = 20;
    pub const GETSOCKOPT: u32 = 21;
    pub const INET4_GETPEERNAME: u32 = 29;
    pub const INET6_GETPEERNAME: u32 = 30;
    pub const SOCK_RELEASE: u32 = 34;
    /// A network namespace's socket lookup (its target is the namespace, not a cgroup).
    pub const SK_LOOKUP: u32 = 36;
}

const BPF_LINK_CREATE: libc::c_long = 28;

/// An attached program; dropping it detaches (unless it was pinned).
#[derive(Debug)]
pub struct CgroupLink {
    fd: OwnedFd,
}

impl CgroupLink {
    /// Attaches `program` to the cgroup open as `cgroup` with `attach_type` (with
    /// [`attach_type::SK_LOOKUP`], `cgroup` is a network namespace instead).
    pub fn create(
        program: BorrowedFd<'_>,
        cgroup: BorrowedFd<'_>,
        attach_type: u32,
    ) -> std::io::Result<Self> {
        let mut attr = [0u64; 16];
        // link_create: prog_fd (u32), target_fd (u32), attach_type (u32), flags (u32).
        attr[0] = u64::from(program.as_raw_fd() as u32) | (u64::from(cgroup.as_raw_fd() as u32) << 32);
        attr[1] = u64::from(attach_type);
        let fd = sys::bpf(BPF_LINK_CREATE, &mut attr)?;
        // SAFETY: the kernel returned a new link fd that we now own.
        Ok(Self { fd: unsafe { OwnedFd::from_raw_fd(fd as i32) } })
    }

    /// Pins the link at `path` (on bpffs); the attachment then outlives this process.
    pub fn pin(self, path: &Path) -> std::io::Result<()> {
        sys::pin_fd(self.fd.as_fd(), path)
    }
}

/// The id the kernel gives the cgroup v2 directory at `path` (its inode number on the
/// cgroup2 file system), as link info reports it.
pub fn cgroup_id(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    Ok(std::fs::metadata(path)?.ino())
}

/// Whether the link pinned at `pin` still attaches its program to the cgroup `cgroup_id`
/// (`Ok(false)`: detached, or attached elsewhere).
pub fn attached_to(pin: &Path, cgroup_id: u64) -> std::io::Result<bool> {
    let fd = sys::obj_get(pin)?;
    let info = sys::link_info(fd.as_fd())?;
    Ok(info.link_type == sys::link_type::CGROUP && info.target == cgroup_id)
}

/// Whether the link pinned at `pin` is attached to anything (a TCX link: an interface).
pub fn attached(pin: &Path) -> std::io::Result<bool> {
    let fd = sys::obj_get(pin)?;
    Ok(sys::link_info(fd.as_fd())?.target != 0)
}

/// Moves the pin at `from` to `to` (the object stays: it is pinned at `to` first).
pub fn move_pin(from: &Path, to: &Path) -> std::io::Result<()> {
    let fd = sys::obj_get(from)?;
    sys::pin_fd(fd.as_fd(), to)?;
    std::fs::remove_file(from)
}
