//! What netfilter tables and chains a network namespace has, read in process: the
//! nf_tables tables and chains of every family (one netlink dump each, no `nft` or
//! `iptables-save` process) and the legacy ip/ip6 tables (`/proc/thread-self/net/
//! ip{,6}_tables_names`). A namespace with no table at all is clean for every backend
//! without reading a rule, which is what a fresh pod's namespace is. A probe that
//! fails is an error, never "nothing there": callers then read the state the slow way.
//! Runs in the calling thread's network namespace.

use std::{io, os::fd::AsRawFd as _};

/// `NFPROTO_*` families of nf_tables tables.
pub const NFPROTO_INET: u8 = 1;
pub const NFPROTO_IPV4: u8 = 2;
pub const NFPROTO_IPV6: u8 = 10;

const NETLINK_NETFILTER: i32 = 12;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_GETRULE: u16 = 7;
/// `NFTA_TABLE_NAME`, `NFTA_CHAIN_NAME` and `NFTA_RULE_CHAIN` (a rule's chain).
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_RULE_CHAIN: u16 = 2;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

/// A table or chain: its family and name (and, for a chain, its table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    pub family: u8,
    pub table: String,
    pub name: String,
}

/// Every netfilter table in the namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tables {
    /// nf_tables tables (iptables-nft's `nat`, ..., nft's `istio-proxy-*`).
    pub nft: Vec<Object>,
    /// Legacy (x_tables) tables, IPv4 and IPv6, that hold a rule or a user chain.
    pub legacy_in_use: Vec<String>,
}

impl Tables {
    /// nf_tables tables of `family`.
    pub fn nft_in(&self, family: u8) -> impl Iterator<Item = &Object> {
        self.nft.iter().filter(move |t| t.family == family)
    }
}

/// The namespace's tables.
pub fn tables() -> io::Result<Tables> {
    let mut legacy_in_use = Vec::new();
    for (file, family) in [("ip_tables_names", libc::AF_INET), ("ip6_tables_names", libc::AF_INET6)] {
        for table in legacy(file)? {
            if legacy_entries_beyond_policies(family, &table)? {
                legacy_in_use.push(format!("{}{table}", if family == libc::AF_INET { "" } else { "ip6 " }));
            }
        }
    }
    Ok(Tables { nft: dump(NFT_MSG_GETTABLE, NFTA_TABLE_NAME)?, legacy_in_use })
}

/// The namespace's nf_tables chains, every table and family.
pub fn chains() -> io::Result<Vec<Object>> {
    dump(NFT_MSG_GETCHAIN, NFTA_CHAIN_NAME)
}

/// The namespace's nf_tables rules (each as its family, table and chain), every table
/// and family.
pub fn rules() -> io::Result<Vec<Object>> {
    dump(NFT_MSG_GETRULE, NFTA_RULE_CHAIN)
}

/// Legacy tables this namespace has instantiated; none when x_tables is not loaded.
fn legacy(file: &str) -> io::Result<Vec<String>> {
    match std::fs::read_to_string(format!("/proc/thread-self/net/{file}")) {
        Ok(text) => Ok(text.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// `IPT_SO_GET_INFO` / `IP6T_SO_GET_INFO`.
const SO_GET_INFO: libc::c_int = 64;

/// `struct ipt_getinfo` (and `ip6t_getinfo`, the same layout).
#[repr(C)]
struct GetInfo {
    name: [u8; 32],
    valid_hooks: u32,
    hook_entry: [u32; 5],
    underflow: [u32; 5],
    num_entries: u32,
    size: u32,
}

/// Whether a legacy table holds more than its builtin chains' policies: an untouched
/// table has one entry per hook plus the closing error entry; every rule and every
/// user chain adds entries. What `iptables-legacy-save` would show, read in process.
fn legacy_entries_beyond_policies(family: libc::c_int, table: &str) -> io::Result<bool> {
    // SAFETY: a plain socket(2); the descriptor is owned below.
    let fd = unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::IPPROTO_RAW) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut info = GetInfo {
        name: [0; 32],
        valid_hooks: 0,
        hook_entry: [0; 5],
        underflow: [0; 5],
        num_entries: 0,
        size: 0,
    };
    let name = table.as_bytes();
    if name.len() >= info.name.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("table name {table:?} too long")));
    }
    info.name[..name.len()].copy_from_slice(name);
    let level = if family == libc::AF_INET { libc::SOL_IP } else { libc::SOL_IPV6 };
    let mut len = std::mem::size_of::<GetInfo>() as libc::socklen_t;
    // SAFETY: getsockopt into a struct of the kernel's layout, with its size.
    let rc =
        unsafe { libc::getsockopt(socket.as_raw_fd(), level, SO_GET_INFO, (&raw mut info).cast(), &mut len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(info.num_entries > info.valid_hooks.count_ones() + 1)
}

/// One `NFT_MSG_GET*` dump over every family: each object's family, table and name.
fn dump(msg: u16, name_attr: u16) -> io::Result<Vec<Object>> {
    // SAFETY: a plain socket(2); the descriptor is owned below.
    let fd =
        unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, NETLINK_NETFILTER) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // nlmsghdr (16) + nfgenmsg (4): family UNSPEC, version 0, res_id 0.
    let mut request = [0u8; 20];
    request[0..4].copy_from_slice(&20u32.to_ne_bytes());
    request[4..6].copy_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | msg).to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    request[6..8].copy_from_slice(&flags.to_ne_bytes());
    request[8..12].copy_from_slice(&1u32.to_ne_bytes());
    // SAFETY: sending a buffer we own on our socket.
    let sent = unsafe { libc::send(socket.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: receiving into a buffer we own.
        let n = unsafe { libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut rest = &buf[..n as usize];
        while rest.len() >= 16 {
            let len = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
            let kind = u16::from_ne_bytes(rest[4..6].try_into().expect("2 bytes"));
            if len < 16 || len > rest.len() {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "truncated netlink message"));
            }
            match kind {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let code = i32::from_ne_bytes(rest[16..20].try_into().expect("4 bytes"));
                    if code != 0 {
                        return Err(io::Error::from_raw_os_error(-code));
                    }
                }
                _ => out.push(object(&rest[16..len], name_attr)?),
            }
            rest = &rest[align(len).min(rest.len())..];
        }
    }
}

fn align(n: usize) -> usize {
    (n + 3) & !3
}

/// An `NFT_MSG_NEW*` payload: nfgenmsg, then attributes (table name is attribute 1 of
/// both tables and chains; a chain's own name is `name_attr`).
fn object(payload: &[u8], name_attr: u16) -> io::Result<Object> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "malformed nf_tables message");
    let family = *payload.first().ok_or_else(bad)?;
    let mut attrs = payload.get(4..).ok_or_else(bad)?;
    let (mut table, mut name) = (String::new(), String::new());
    while attrs.len() >= 4 {
        let len = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
        let kind = u16::from_ne_bytes([attrs[2], attrs[3]]) & 0x3fff;
        if len < 4 || len > attrs.len() {
            return Err(bad());
        }
        let text = || String::from_utf8_lossy(&attrs[4..len]).trim_end_matches('\0').to_string();
        if kind == name_attr {
            name = text();
        }
        if kind == 1 {
            table = text();
        }
        attrs = &attrs[align(len).min(attrs.len())..];
    }
    Ok(Object { family, table, name })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_read_from_a_chain_message() {
        // nfgenmsg (inet), NFTA_CHAIN_TABLE "nat", NFTA_CHAIN_HANDLE (skipped), NFTA_CHAIN_NAME "ISTIO_OUTPUT".
        let mut p = vec![NFPROTO_INET, 0, 0, 0];
        let attr = |p: &mut Vec<u8>, kind: u16, value: &[u8]| {
            let len = 4 + value.len();
            p.extend((len as u16).to_ne_bytes());
            p.extend(kind.to_ne_bytes());
            p.extend(value);
            while !p.len().is_multiple_of(4) {
                p.push(0);
            }
        };
        attr(&mut p, 1, b"nat\0");
        attr(&mut p, 2, &[0; 8]);
        attr(&mut p, NFTA_CHAIN_NAME, b"ISTIO_OUTPUT\0");
        let o = object(&p, NFTA_CHAIN_NAME).unwrap();
        assert_eq!(o, Object { family: NFPROTO_INET, table: "nat".into(), name: "ISTIO_OUTPUT".into() });
        assert!(
            object(&[2, 0, 0, 0, 9, 0, 1, 0], NFTA_CHAIN_NAME).is_err(),
            "an attribute longer than its message"
        );
    }
}
