//! The few `bpf(2)` commands Weir makes itself, by raw system call: open and make pins,
//! read a program's, link's or map's info, and delete or walk map keys as raw bytes;
//! list what a cgroup runs (`BPF_PROG_QUERY`), open a program by id, and load the
//! one-instruction probe that tells an ancestor's program order.
//! Raw keys let any Weir build remove what another build registered in its program
//! set (whose key layout it may not know), and count a map's entries without its
//! value type. aya covers everything else.

use std::{
    ffi::CString,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::Path,
};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_QUERY: libc::c_long = 16;

/// UAPI `enum bpf_link_type` values Weir reads.
pub mod link_type {
    pub const CGROUP: u32 = 3;
    /// A network namespace's link (sk_lookup); its target is the namespace's inode.
    pub const NETNS: u32 = 5;
    pub const TCX: u32 = 11;
}

pub(crate) fn bpf(cmd: libc::c_long, attr: &mut [u64; 16]) -> std::io::Result<i64> {
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

/// Pins the object open as `fd` at `path` (on bpffs).
pub fn pin_fd(fd: BorrowedFd<'_>, path: &Path) -> std::io::Result<()> {
    let c = c_path(path)?;
    let mut attr = [0u64; 16];
    // obj_pin: pathname (u64 pointer), bpf_fd (u32), file_flags (u32).
    attr[0] = c.as_ptr() as u64;
    attr[1] = u64::from(fd.as_raw_fd() as u32);
    bpf(BPF_OBJ_PIN, &mut attr).map(drop)
}

/// The first words of an object's info struct (`bpf_prog_info`, `bpf_link_info`,
/// `bpf_map_info` all start with type and id).
fn info<const N: usize>(fd: BorrowedFd<'_>) -> std::io::Result<[u32; N]> {
    let mut info = [0u32; N];
    let mut attr = [0u64; 16];
    // info: bpf_fd (u32), info_len (u32), info (u64 pointer).
    attr[0] = u64::from(fd.as_raw_fd() as u32) | ((std::mem::size_of_val(&info) as u64) << 32);
    attr[1] = info.as_mut_ptr() as u64;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info)
}

/// The kernel's id of a loaded program.
pub fn prog_id(program: BorrowedFd<'_>) -> std::io::Result<u32> {
    Ok(info::<2>(program)?[1])
}

/// What the kernel says of a link: `bpf_link_info`'s type, program, and target (a
/// cgroup link's cgroup id, 0 once the link was detached or its cgroup removed; a TCX
/// link's interface index, 0 once detached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkInfo {
    pub link_type: u32,
    pub prog_id: u32,
    pub target: u64,
}

/// What the kernel says of the link open as `link`; an error (`InvalidInput`) when the
/// descriptor is another kind of BPF object (a map or program pinned where a link was
/// expected, whose info would otherwise be read as a link's).
pub fn link_info(link: BorrowedFd<'_>) -> std::io::Result<LinkInfo> {
    let kind = std::fs::read_link(format!("/proc/self/fd/{}", link.as_raw_fd()))?;
    if kind.as_os_str() != "anon_inode:bpf-link" {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("not a BPF link ({})", kind.display()),
        ));
    }
    // type, id, prog_id, padding, then the union (8-aligned): cgroup_id (u64) or
    // tcx's ifindex (u32).
    let w = info::<8>(link)?;
    let target = match w[0] {
        link_type::CGROUP => u64::from(w[4]) | (u64::from(w[5]) << 32),
        _ => u64::from(w[4]),
    };
    Ok(LinkInfo { link_type: w[0], prog_id: w[2], target })
}

/// The id of the program a link attaches.
pub fn link_prog_id(link: BorrowedFd<'_>) -> std::io::Result<u32> {
    Ok(link_info(link)?.prog_id)
}

/// A map's shape: `bpf_map_info`'s type, key size, value size and capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapInfo {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
}

pub fn map_info(map: BorrowedFd<'_>) -> std::io::Result<MapInfo> {
    let w = info::<6>(map)?;
    Ok(MapInfo { map_type: w[0], key_size: w[2], value_size: w[3], max_entries: w[4] })
}

/// The value under `key` (raw bytes, the map's value size); `None` when absent. The key
/// must be the map's key size (see [`delete_raw`]).
pub fn lookup_raw(map: BorrowedFd<'_>, key: &[u8]) -> std::io::Result<Option<Vec<u8>>> {
    let info = map_info(map)?;
    if key.len() != info.key_size as usize {
        return Err(wrong_key_size(key.len(), info.key_size));
    }
    let mut value = vec![0u8; info.value_size as usize];
    let mut attr = [0u64; 16];
    attr[0] = u64::from(map.as_raw_fd() as u32);
    attr[1] = key.as_ptr() as u64;
    attr[2] = value.as_mut_ptr() as u64;
    match bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
        Ok(_) => Ok(Some(value)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

fn wrong_key_size(len: usize, key_size: u32) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("a key of {len} bytes for a map whose keys are {key_size} bytes"),
    )
}

/// Deletes `key` (its raw bytes) from the map; `Ok(false)` when it was not there. A key
/// of another length than the map's (a damaged record) is refused: the kernel would
/// read the map's key size from it regardless.
pub fn delete_raw(map: BorrowedFd<'_>, key: &[u8]) -> std::io::Result<bool> {
    let key_size = map_info(map)?.key_size;
    if key.len() != key_size as usize {
        return Err(wrong_key_size(key.len(), key_size));
    }
    let mut attr = [0u64; 16];
    // map_elem: map_fd (u32, padded), key (u64 pointer).
    attr[0] = u64::from(map.as_raw_fd() as u32);
    attr[1] = key.as_ptr() as u64;
    match bpf(BPF_MAP_DELETE_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Every key of a map whose keys are `key_size` bytes, as raw bytes (a walk with
/// BPF_MAP_GET_NEXT_KEY; a map changing meanwhile may skip or repeat an entry).
pub fn keys_raw(map: BorrowedFd<'_>, key_size: u32) -> std::io::Result<Vec<Vec<u8>>> {
    let mut keys: Vec<Vec<u8>> = Vec::new();
    let mut next = vec![0u8; key_size as usize];
    loop {
        let mut attr = [0u64; 16];
        attr[0] = u64::from(map.as_raw_fd() as u32);
        // The first call passes no key (NULL): the first key.
        attr[1] = keys.last().map_or(0, |k| k.as_ptr() as u64);
        attr[2] = next.as_mut_ptr() as u64;
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) => keys.push(next.clone()),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(keys),
            Err(e) => return Err(e),
        }
    }
}

/// Runs `program` once on `data` (BPF_PROG_TEST_RUN; for a tc classifier, a whole
/// Ethernet frame) in the caller's network namespace; returns its return value (a tc
/// verdict). Nothing is sent: what the program would decide for that frame.
pub fn prog_test_run(program: BorrowedFd<'_>, data: &[u8]) -> std::io::Result<u32> {
    let mut attr = [0u64; 16];
    // test: prog_fd, retval (out); data_size_in, data_size_out; data_in; data_out;
    // repeat, duration.
    attr[0] = u64::from(program.as_raw_fd() as u32);
    attr[1] = data.len() as u64;
    attr[2] = data.as_ptr() as u64;
    attr[4] = 1;
    bpf(BPF_PROG_TEST_RUN, &mut attr)?;
    Ok((attr[0] >> 32) as u32)
}

/// UAPI `enum bpf_map_type` values whose entries always all exist.
pub mod map_type {
    pub const ARRAY: u32 = 2;
    pub const PERCPU_ARRAY: u32 = 6;
}

/// How many entries a map holds (see [`keys_raw`]).
pub fn count_entries(map: BorrowedFd<'_>) -> std::io::Result<u32> {
    let info = map_info(map)?;
    Ok(keys_raw(map, info.key_size)?.len() as u32)
}

/// What `BPF_PROG_QUERY` says of one attach type of one cgroup (its own programs, not
/// the effective list): the cgroup's attach flags for it, and its programs in the
/// cgroup's order with each one's attach flags. Every kernel that reports per-program
/// flags (6.0 on) reports the cgroup's flags for each (`__cgroup_bpf_query`), never
/// `BPF_F_PREORDER`; before 6.0 the field is refused, and the cgroup's flags stand in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupQuery {
    pub attach_flags: u32,
    pub programs: Vec<(u32, u32)>,
}

/// The most programs one cgroup holds for one attach type (the kernel's
/// `BPF_CGROUP_MAX_PROGS`); an effective list may hold more, one such list per level.
const MAX_PROGS: usize = 64;

/// `BPF_PROG_QUERY` on the cgroup open as `cgroup` for `attach_type`: its own
/// programs. An error is the kernel's, never an empty answer.
pub fn query_cgroup(cgroup: BorrowedFd<'_>, attach_type: u32) -> std::io::Result<CgroupQuery> {
    let mut ids = [0u32; MAX_PROGS];
    let mut flags = [0u32; MAX_PROGS];
    let mut ask = |per_program: bool| {
        let mut attr = [0u64; 16];
        // query: target_fd, attach_type; query_flags, attach_flags (out); prog_ids;
        // prog_cnt (in/out), padding; prog_attach_flags (6.0 on).
        attr[0] = u64::from(cgroup.as_raw_fd() as u32) | (u64::from(attach_type) << 32);
        attr[2] = ids.as_mut_ptr() as u64;
        attr[3] = MAX_PROGS as u64;
        if per_program {
            attr[4] = flags.as_mut_ptr() as u64;
        }
        bpf(BPF_PROG_QUERY, &mut attr).map(|_| ((attr[1] >> 32) as u32, attr[3] as u32 as usize))
    };
    let (attach_flags, count, per_program) = match ask(true) {
        Ok((f, n)) => (f, n, true),
        // Before 6.0 the kernel refuses the field it does not know.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            let (f, n) = ask(false)?;
            (f, n, false)
        }
        Err(e) => return Err(e),
    };
    let count = count.min(MAX_PROGS);
    let programs = (0..count).map(|i| (ids[i], if per_program { flags[i] } else { attach_flags })).collect();
    Ok(CgroupQuery { attach_flags, programs })
}

/// The ids of the programs that run for a socket in the cgroup open as `cgroup` on
/// `attach_type`, in the order they run (`BPF_F_QUERY_EFFECTIVE`: its own and its
/// ancestors' that reach it).
pub fn query_effective(cgroup: BorrowedFd<'_>, attach_type: u32) -> std::io::Result<Vec<u32>> {
    const BPF_F_QUERY_EFFECTIVE: u64 = 1;
    // An effective list holds one cgroup's list per level: a deep tree may hold more.
    let mut ids = vec![0u32; MAX_PROGS * 16];
    let mut attr = [0u64; 16];
    attr[0] = u64::from(cgroup.as_raw_fd() as u32) | (u64::from(attach_type) << 32);
    attr[1] = BPF_F_QUERY_EFFECTIVE;
    attr[2] = ids.as_mut_ptr() as u64;
    attr[3] = ids.len() as u64;
    bpf(BPF_PROG_QUERY, &mut attr)?;
    ids.truncate((attr[3] as u32 as usize).min(ids.len()));
    Ok(ids)
}

/// Opens the loaded program whose id is `id` (needs CAP_SYS_ADMIN); `NotFound` when it
/// is gone.
pub fn prog_fd_by_id(id: u32) -> std::io::Result<OwnedFd> {
    let mut attr = [0u64; 16];
    // prog_id (u32), next_id (u32), open_flags (u32).
    attr[0] = u64::from(id);
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)?;
    // SAFETY: the kernel returned a new descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A loaded program's type and name (`bpf_prog_info`'s `type` and `name`).
pub fn prog_type_and_name(program: BorrowedFd<'_>) -> std::io::Result<(u32, String)> {
    // type, id, tag (8 bytes), ..., then name (16 bytes) at byte 64.
    let w = info::<20>(program)?;
    let bytes: Vec<u8> = w[16..20].iter().flat_map(|word| word.to_ne_bytes()).collect();
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    Ok((w[0], String::from_utf8_lossy(&bytes[..end]).into_owned()))
}

/// Loads a `cgroup_sock_addr` program for `attach_type` that lets every call through
/// unchanged (`r0 = 1; exit`), named `name` (at most 15 bytes): the probe whose place
/// in a cgroup's effective list shows which ancestor programs run before a program
/// attached there.
pub fn load_pass_sock_addr(attach_type: u32, name: &str) -> std::io::Result<OwnedFd> {
    const CGROUP_SOCK_ADDR: u64 = 18;
    // mov64 r0, 1 ; exit
    let insns: [u64; 2] =
        [u64::from_le_bytes([0xb7, 0, 0, 0, 1, 0, 0, 0]), u64::from_le_bytes([0x95, 0, 0, 0, 0, 0, 0, 0])];
    let license = c"GPL";
    let mut attr = [0u64; 16];
    // prog_type, insn_cnt; insns; license; log_level, log_size; log_buf; kern_version,
    // prog_flags; prog_name[16]; prog_ifindex, expected_attach_type.
    attr[0] = CGROUP_SOCK_ADDR | ((insns.len() as u64) << 32);
    attr[1] = insns.as_ptr() as u64;
    attr[2] = license.as_ptr() as u64;
    let mut prog_name = [0u8; 16];
    let take = name.len().min(15);
    prog_name[..take].copy_from_slice(&name.as_bytes()[..take]);
    attr[6] = u64::from_ne_bytes(prog_name[..8].try_into().expect("8 bytes"));
    attr[7] = u64::from_ne_bytes(prog_name[8..].try_into().expect("8 bytes"));
    attr[8] = u64::from(attach_type) << 32;
    let fd = bpf(BPF_PROG_LOAD, &mut attr)?;
    // SAFETY: the kernel returned a new program descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
