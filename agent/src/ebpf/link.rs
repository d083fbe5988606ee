//! Cgroup attachments as bpf_links made with `BPF_LINK_CREATE` directly: one link type
//! for every cgroup hook (aya cannot pin its getsockopt link), closed to detach, pinned
//! with `BPF_OBJ_PIN` to outlive this process. Links to one cgroup coexist with other
//! programs on it (link semantics are multi-attach). Also the few raw object calls the
//! node program set needs: open a pin, and the ids of a program or of a link's program.

use std::{
    ffi::CString,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::Path,
};

/// UAPI `enum bpf_attach_type` values Weir attaches with.
pub mod attach_type {
    pub const SOCK_OPS: u32 = 3;
    pub const INET4_CONNECT: u32 = 10;
    pub const INET6_CONNECT: u32 = 11;
    pub const UDP4_SENDMSG: u32 = 14;
    pub const UDP6_SENDMSG: u32 = 15;
    pub const UDP4_RECVMSG: u32 = 19;
    pub const UDP6_RECVMSG: u32 = 20;
    pub const GETSOCKOPT: u32 = 21;
}

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_CREATE: libc::c_long = 28;

/// An attached program; dropping it detaches (unless it was pinned).
#[derive(Debug)]
pub struct CgroupLink {
    fd: OwnedFd,
}

fn bpf(cmd: libc::c_long, attr: &mut [u64; 16]) -> std::io::Result<i64> {
    // SAFETY: `attr` is a zero-initialised union bpf_attr large enough for the command.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), std::mem::size_of_val(attr)) };
    if rc < 0 { Err(std::io::Error::last_os_error()) } else { Ok(rc) }
}

fn c_path(path: &Path) -> std::io::Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)
}

/// Opens the object pinned at `path` (a program, map or link).
pub fn obj_get(path: &Path) -> std::io::Result<OwnedFd> {
    let c = c_path(path)?;
    let mut attr = [0u64; 16];
    // obj_get: pathname (u64 pointer), bpf_fd (u32), file_flags (u32).
    attr[0] = c.as_ptr() as u64;
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: the kernel returned a new descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The first two u32 words of the object's info (`bpf_prog_info`: type, id;
/// `bpf_link_info`: type, id, prog_id).
fn info_words(fd: BorrowedFd<'_>) -> std::io::Result<[u32; 4]> {
    let mut info = [0u32; 4];
    let mut attr = [0u64; 16];
    // info: bpf_fd (u32), info_len (u32), info (u64 pointer).
    attr[0] = u64::from(fd.as_raw_fd() as u32) | ((std::mem::size_of_val(&info) as u64) << 32);
    attr[1] = info.as_mut_ptr() as u64;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info)
}

/// The kernel's id of a loaded program.
pub fn prog_id(program: BorrowedFd<'_>) -> std::io::Result<u32> {
    Ok(info_words(program)?[1])
}

/// The id of the program a link attaches.
pub fn link_prog_id(link: BorrowedFd<'_>) -> std::io::Result<u32> {
    Ok(info_words(link)?[2])
}

/// Pins the object open as `fd` at `path` (on bpffs).
pub fn pin_fd(fd: BorrowedFd<'_>, path: &Path) -> std::io::Result<()> {
    let c = c_path(path)?;
    let mut attr = [0u64; 16];
    // obj_pin: pathname (u64 pointer), bpf_fd (u32), file_flags (u32).
    attr[0] = c.as_ptr() as u64;
    attr[1] = u64::from(fd.as_raw_fd() as u32);
    bpf(BPF_OBJ_PIN, &mut attr).map(drop)
}

impl CgroupLink {
    /// Attaches `program` to the cgroup open as `cgroup` with `attach_type`.
    pub fn create(
        program: BorrowedFd<'_>,
        cgroup: BorrowedFd<'_>,
        attach_type: u32,
    ) -> std::io::Result<Self> {
        let mut attr = [0u64; 16];
        // link_create: prog_fd (u32), target_fd (u32), attach_type (u32), flags (u32).
        attr[0] = u64::from(program.as_raw_fd() as u32) | (u64::from(cgroup.as_raw_fd() as u32) << 32);
        attr[1] = u64::from(attach_type);
        let fd = bpf(BPF_LINK_CREATE, &mut attr)?;
        // SAFETY: the kernel returned a new link fd that we now own.
        Ok(Self { fd: unsafe { OwnedFd::from_raw_fd(fd as i32) } })
    }

    /// Pins the link at `path` (on bpffs); the attachment then outlives this process.
    pub fn pin(self, path: &Path) -> std::io::Result<()> {
        pin_fd(self.fd.as_fd(), path)
    }
}
