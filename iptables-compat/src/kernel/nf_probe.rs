//! What netfilter tables and chains a network namespace has, read in process: the
//! nf_tables tables and chains of every family (one netlink dump each, no `nft` or
//! `iptables-save` process) and the legacy ip/ip6 tables (`/proc/thread-self/net/
//! ip{,6}_tables_names`). A namespace with no table at all is clean for every backend
//! without reading a rule, which is what a fresh pod's namespace is. A probe that
//! fails is an error, never "nothing there": callers then read the state the slow way.
//! A dump's replies are taken only when they answer it (its sequence number, its
//! message type, every length inside its datagram); one the kernel marks interrupted
//! (`NLM_F_DUMP_INTR`: the ruleset changed while it was read) is read again, and
//! reported if that keeps happening. Runs in the calling thread's network namespace.

use std::{
    io,
    os::fd::AsRawFd as _,
    sync::atomic::{AtomicU32, Ordering},
};

/// `NFPROTO_*` families of nf_tables tables.
pub const NFPROTO_INET: u8 = 1;
pub const NFPROTO_IPV4: u8 = 2;
pub const NFPROTO_IPV6: u8 = 10;

pub(crate) const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub(crate) const NLMSG_HDRLEN: usize = 16;
const NLMSG_NOOP: u16 = 1;
pub(crate) const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_OVERRUN: u16 = 4;
/// `NLM_F_DUMP_INTR`: the dump is inconsistent (the ruleset changed during it).
const NLM_F_DUMP_INTR: u16 = 0x10;
/// How many times an interrupted dump is read again before the probe gives up.
pub const DUMP_ATTEMPTS: u32 = 5;

/// Why the probe could not read the namespace.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("the kernel answered the nf_tables {dump} dump with an error")]
    Kernel {
        dump: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("malformed reply to the nf_tables {dump} dump: {why}")]
    Malformed { dump: &'static str, why: String },
    #[error("the nf_tables {dump} dump was interrupted by ruleset changes {attempts} times in a row")]
    Interrupted { dump: &'static str, attempts: u32 },
}

impl ProbeError {
    fn io(what: impl Into<String>) -> impl FnOnce(io::Error) -> Self {
        let what = what.into();
        move |source| Self::Io { what, source }
    }
}

/// One `NFT_MSG_GET*` dump: what is asked, what answers it, and where the answer's
/// names are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dump {
    pub name: &'static str,
    /// `NFT_MSG_GETTABLE`, ... (the request).
    request: u16,
    /// `NFT_MSG_NEWTABLE`, ... (each object of the reply).
    reply: u16,
    /// The attribute holding the object's table (absent for a table itself).
    table_attr: Option<u16>,
    /// The attribute holding the object's own name (a rule's: its chain).
    name_attr: u16,
}

impl Dump {
    /// Tables: `NFTA_TABLE_NAME` (1).
    pub const TABLES: Self = Self { name: "table", request: 1, reply: 0, table_attr: None, name_attr: 1 };
    /// Chains: `NFTA_CHAIN_TABLE` (1), `NFTA_CHAIN_NAME` (3); `NFTA_CHAIN_HOOK` marks a base chain.
    pub const CHAINS: Self = Self { name: "chain", request: 4, reply: 3, table_attr: Some(1), name_attr: 3 };
    /// Rules: `NFTA_RULE_TABLE` (1), `NFTA_RULE_CHAIN` (2).
    pub const RULES: Self = Self { name: "rule", request: 7, reply: 6, table_attr: Some(1), name_attr: 2 };

    fn message_type(msg: u16) -> u16 {
        (NFNL_SUBSYS_NFTABLES << 8) | msg
    }
}

/// `NFTA_CHAIN_HOOK`: present on base chains (iptables-nft's builtin ones), absent on
/// user chains.
const NFTA_CHAIN_HOOK: u16 = 4;

/// A table, chain or rule: its family, table and name (a rule's name is its chain).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    pub family: u8,
    pub table: String,
    pub name: String,
    /// A chain attached to a hook (a builtin chain, for iptables-nft); false for user
    /// chains, tables and rules.
    pub base_chain: bool,
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
pub fn tables() -> Result<Tables, ProbeError> {
    let mut legacy_in_use = Vec::new();
    for (file, family) in [("ip_tables_names", libc::AF_INET), ("ip6_tables_names", libc::AF_INET6)] {
        for table in legacy(file)? {
            if legacy_entries_beyond_policies(family, &table)? {
                legacy_in_use.push(format!("{}{table}", if family == libc::AF_INET { "" } else { "ip6 " }));
            }
        }
    }
    Ok(Tables { nft: dump(Dump::TABLES)?, legacy_in_use })
}

/// The namespace's nf_tables chains, every table and family.
pub fn chains() -> Result<Vec<Object>, ProbeError> {
    dump(Dump::CHAINS)
}

/// The namespace's nf_tables rules (each as its family, table and chain), every table
/// and family.
pub fn rules() -> Result<Vec<Object>, ProbeError> {
    dump(Dump::RULES)
}

/// Legacy tables this namespace has instantiated; none when x_tables is not loaded.
fn legacy(file: &str) -> Result<Vec<String>, ProbeError> {
    let path = format!("/proc/thread-self/net/{file}");
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(text.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(ProbeError::io(format!("read {path}"))(e)),
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
fn legacy_entries_beyond_policies(family: libc::c_int, table: &str) -> Result<bool, ProbeError> {
    let what = || format!("read legacy table {table}'s size");
    // SAFETY: a plain socket(2); the descriptor is owned below.
    let fd = unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::IPPROTO_RAW) };
    if fd < 0 {
        return Err(ProbeError::io(what())(io::Error::last_os_error()));
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
        return Err(ProbeError::io(what())(io::Error::new(
            io::ErrorKind::InvalidInput,
            "table name too long",
        )));
    }
    info.name[..name.len()].copy_from_slice(name);
    let level = if family == libc::AF_INET { libc::SOL_IP } else { libc::SOL_IPV6 };
    let mut len = std::mem::size_of::<GetInfo>() as libc::socklen_t;
    // SAFETY: getsockopt into a struct of the kernel's layout, with its size.
    let rc =
        unsafe { libc::getsockopt(socket.as_raw_fd(), level, SO_GET_INFO, (&raw mut info).cast(), &mut len) };
    if rc != 0 {
        return Err(ProbeError::io(what())(io::Error::last_os_error()));
    }
    Ok(info.num_entries > info.valid_hooks.count_ones() + 1)
}

/// One `NFT_MSG_GET*` dump over every family, read again while the kernel marks it
/// interrupted (at most [`DUMP_ATTEMPTS`] times).
fn dump(dump: Dump) -> Result<Vec<Object>, ProbeError> {
    for attempt in 1..=DUMP_ATTEMPTS {
        match dump_once(dump)? {
            Some(objects) => return Ok(objects),
            None => {
                tracing::debug!(dump = dump.name, attempt, "nf_tables dump interrupted; reading it again")
            }
        }
    }
    Err(ProbeError::Interrupted { dump: dump.name, attempts: DUMP_ATTEMPTS })
}

/// A NETLINK_NETFILTER socket of the calling thread's network namespace.
pub(crate) fn netfilter_socket() -> io::Result<std::os::fd::OwnedFd> {
    const NETLINK_NETFILTER: i32 = 12;
    // SAFETY: a plain socket(2); the descriptor is owned below.
    let fd =
        unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, NETLINK_NETFILTER) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Sequence numbers of this process's dumps: each request has its own.
static SEQUENCE: AtomicU32 = AtomicU32::new(1);

/// One dump on a socket of its own; `None` when the kernel marked it interrupted.
fn dump_once(dump: Dump) -> Result<Option<Vec<Object>>, ProbeError> {
    let what = |step: &str| format!("{step} for the nf_tables {} dump", dump.name);
    let socket = netfilter_socket().map_err(ProbeError::io(what("open a netfilter netlink socket")))?;
    let seq = SEQUENCE.fetch_add(1, Ordering::Relaxed);
    let request = request(dump, seq);
    // SAFETY: sending a buffer we own on our socket.
    let sent = unsafe { libc::send(socket.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) };
    if sent < 0 {
        return Err(ProbeError::io(what("send the request"))(io::Error::last_os_error()));
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: receiving into a buffer we own, of its length; MSG_TRUNC makes the
        // result the datagram's real length, so a cut one is seen.
        let n =
            unsafe { libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_TRUNC) };
        let n = usize::try_from(n)
            .map_err(|_| ProbeError::io(what("receive the reply"))(io::Error::last_os_error()))?;
        if n > buf.len() {
            return Err(malformed(
                dump,
                format!("a {n}-byte datagram does not fit the {}-byte buffer", buf.len()),
            ));
        }
        match read_datagram(&buf[..n], seq, dump, &mut out)? {
            Progress::More => {}
            Progress::Done => return Ok(Some(out)),
            Progress::Interrupted => return Ok(None),
        }
    }
}

/// nlmsghdr (16) + nfgenmsg (4): a dump request of every family.
fn request(dump: Dump, seq: u32) -> [u8; 20] {
    let mut request = [0u8; 20];
    request[0..4].copy_from_slice(&20u32.to_ne_bytes());
    request[4..6].copy_from_slice(&Dump::message_type(dump.request).to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    request[6..8].copy_from_slice(&flags.to_ne_bytes());
    request[8..12].copy_from_slice(&seq.to_ne_bytes());
    request
}

/// Where a dump stands after one datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Progress {
    More,
    Done,
    /// A message carried `NLM_F_DUMP_INTR`: what was read is not one state.
    Interrupted,
}

fn malformed(dump: Dump, why: impl Into<String>) -> ProbeError {
    ProbeError::Malformed { dump: dump.name, why: why.into() }
}

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(bytes.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

/// The messages of one datagram, each checked against the request before it is read:
/// whole inside the datagram, `seq` its sequence number, and an object of the dump's
/// type, `NLMSG_DONE`, a no-op, or an error (which ends the dump).
fn read_datagram(
    datagram: &[u8],
    seq: u32,
    dump: Dump,
    out: &mut Vec<Object>,
) -> Result<Progress, ProbeError> {
    if datagram.is_empty() {
        return Err(malformed(dump, "the socket closed before NLMSG_DONE"));
    }
    let mut rest = datagram;
    while !rest.is_empty() {
        let header = |at| u32_at(rest, at).ok_or_else(|| malformed(dump, "a message header cut short"));
        let len = header(0)? as usize;
        let kind = u16_at(rest, 4).ok_or_else(|| malformed(dump, "a message header cut short"))?;
        let flags = u16_at(rest, 6).ok_or_else(|| malformed(dump, "a message header cut short"))?;
        let got_seq = header(8)?;
        if len < NLMSG_HDRLEN || len > rest.len() {
            return Err(malformed(dump, format!("a message of {len} bytes in {} remaining", rest.len())));
        }
        if got_seq != seq {
            return Err(malformed(dump, format!("a reply to request {got_seq}, not to this one ({seq})")));
        }
        if flags & NLM_F_DUMP_INTR != 0 {
            return Ok(Progress::Interrupted);
        }
        let payload = &rest[NLMSG_HDRLEN..len];
        match kind {
            NLMSG_NOOP => {}
            NLMSG_DONE => {
                // The dump's own status follows NLMSG_DONE (0 when it completed).
                return match u32_at(payload, 0).map(|c| c as i32) {
                    None | Some(0) => Ok(Progress::Done),
                    Some(code) => Err(kernel_error(dump, code)),
                };
            }
            NLMSG_ERROR => {
                let code =
                    u32_at(payload, 0).ok_or_else(|| malformed(dump, "an error message without its code"))?;
                if code != 0 {
                    return Err(kernel_error(dump, code as i32));
                }
            }
            NLMSG_OVERRUN => return Err(malformed(dump, "the kernel reported an overrun")),
            k if k == Dump::message_type(dump.reply) => out.push(object(payload, dump)?),
            other => return Err(malformed(dump, format!("a message of type {other:#06x}"))),
        }
        rest = rest.get(align(len)..).unwrap_or_default();
    }
    Ok(Progress::More)
}

fn kernel_error(dump: Dump, code: i32) -> ProbeError {
    // Netlink sends -errno; anything else is not an errno at all.
    match code.checked_neg().filter(|e| *e > 0) {
        Some(errno) => ProbeError::Kernel { dump: dump.name, source: io::Error::from_raw_os_error(errno) },
        None => malformed(dump, format!("an error code of {code}")),
    }
}

fn align(n: usize) -> usize {
    (n + 3) & !3
}

/// An `NFT_MSG_NEW*` payload: nfgenmsg (its family first), then attributes, each
/// inside the payload.
fn object(payload: &[u8], dump: Dump) -> Result<Object, ProbeError> {
    let bad = |why: &str| malformed(dump, format!("a {} message {why}", dump.name));
    let family = *payload.first().ok_or_else(|| bad("without its nfgenmsg"))?;
    let mut attrs = payload.get(4..).ok_or_else(|| bad("without its nfgenmsg"))?;
    let mut object = Object { family, table: String::new(), name: String::new(), base_chain: false };
    while !attrs.is_empty() {
        let (Some(len), Some(kind)) = (u16_at(attrs, 0), u16_at(attrs, 2)) else {
            return Err(bad("with an attribute header cut short"));
        };
        let (len, kind) = (usize::from(len), kind & 0x3fff);
        let Some(value) = attrs.get(4..len).filter(|_| len >= 4) else {
            return Err(bad("with an attribute longer than the message"));
        };
        let text = || String::from_utf8_lossy(value).trim_end_matches('\0').to_string();
        if kind == dump.name_attr {
            object.name = text();
        }
        if Some(kind) == dump.table_attr {
            object.table = text();
        }
        if dump == Dump::CHAINS && kind == NFTA_CHAIN_HOOK {
            object.base_chain = true;
        }
        attrs = attrs.get(align(len)..).unwrap_or_default();
    }
    if dump == Dump::TABLES {
        object.table = object.name.clone();
    }
    Ok(object)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEQ: u32 = 7;

    use crate::kernel::nft_encode::put as attr;

    /// A chain message's payload: nfgenmsg, table, handle, name, and a hook if `base`.
    fn chain(family: u8, table: &str, name: &str, base: bool) -> Vec<u8> {
        let mut p = vec![family, 0, 0, 0];
        attr(&mut p, 1, format!("{table}\0").as_bytes());
        attr(&mut p, 2, &[0; 8]);
        attr(&mut p, 3, format!("{name}\0").as_bytes());
        if base {
            attr(&mut p, NFTA_CHAIN_HOOK | 0x8000, &[0; 16]);
        }
        p
    }

    fn message(kind: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend(((NLMSG_HDRLEN + payload.len()) as u32).to_ne_bytes());
        m.extend(kind.to_ne_bytes());
        m.extend(flags.to_ne_bytes());
        m.extend(seq.to_ne_bytes());
        m.extend(4242u32.to_ne_bytes());
        m.extend(payload);
        while !m.len().is_multiple_of(4) {
            m.push(0);
        }
        m
    }

    fn new_chain(payload: &[u8]) -> Vec<u8> {
        message(Dump::message_type(Dump::CHAINS.reply), libc::NLM_F_MULTI as u16, SEQ, payload)
    }

    fn done(code: i32) -> Vec<u8> {
        message(NLMSG_DONE, libc::NLM_F_MULTI as u16, SEQ, &code.to_ne_bytes())
    }

    fn read(datagram: &[u8]) -> (Result<Progress, ProbeError>, Vec<Object>) {
        let mut out = Vec::new();
        (read_datagram(datagram, SEQ, Dump::CHAINS, &mut out), out)
    }

    /// A user chain and a base chain, then NLMSG_DONE, in one datagram.
    fn a_whole_dump() -> Vec<u8> {
        [
            new_chain(&chain(NFPROTO_IPV4, "nat", "FOREIGN", false)),
            new_chain(&chain(NFPROTO_IPV4, "nat", "OUTPUT", true)),
            done(0),
        ]
        .concat()
    }

    #[test]
    fn a_dump_is_read_with_user_and_base_chains_told_apart() {
        let (progress, out) = read(&a_whole_dump());
        assert_eq!(progress.unwrap(), Progress::Done);
        let object = |name: &str, base_chain| Object {
            family: NFPROTO_IPV4,
            table: "nat".into(),
            name: name.into(),
            base_chain,
        };
        assert_eq!(out, [object("FOREIGN", false), object("OUTPUT", true)]);
        // Objects alone are part of a dump still going.
        let (progress, out) = read(&new_chain(&chain(NFPROTO_INET, "istio-proxy-nat", "prerouting", true)));
        assert_eq!(progress.unwrap(), Progress::More);
        assert_eq!(out[0].table, "istio-proxy-nat");
    }

    #[test]
    fn an_interrupted_dump_is_reported_as_such() {
        let intr = (libc::NLM_F_MULTI as u16) | NLM_F_DUMP_INTR;
        let flagged =
            message(Dump::message_type(Dump::CHAINS.reply), intr, SEQ, &chain(2, "nat", "X", false));
        let (progress, _) = read(&[new_chain(&chain(2, "nat", "A", false)), flagged, done(0)].concat());
        assert_eq!(progress.unwrap(), Progress::Interrupted);
        // Also when only NLMSG_DONE carries the flag (the kernel checks there too).
        let (progress, _) = read(&message(NLMSG_DONE, intr, SEQ, &0i32.to_ne_bytes()));
        assert_eq!(progress.unwrap(), Progress::Interrupted);
    }

    #[test]
    fn replies_to_another_request_or_of_another_type_are_refused() {
        let other_seq =
            message(Dump::message_type(Dump::CHAINS.reply), 0, SEQ + 1, &chain(2, "nat", "X", false));
        let e = read(&other_seq).0.unwrap_err().to_string();
        assert!(e.contains("a reply to request 8, not to this one (7)"), "{e}");
        let a_rule = message(Dump::message_type(Dump::RULES.reply), 0, SEQ, &chain(2, "nat", "X", false));
        let e = read(&a_rule).0.unwrap_err().to_string();
        assert!(e.contains("a message of type 0x0a06"), "{e}");
        let e = read(&message(NLMSG_OVERRUN, 0, SEQ, &[])).0.unwrap_err().to_string();
        assert!(e.contains("overrun"), "{e}");
        // A no-op is skipped.
        let (progress, out) = read(&[message(NLMSG_NOOP, 0, SEQ, &[]), done(0)].concat());
        assert_eq!((progress.unwrap(), out.len()), (Progress::Done, 0));
    }

    #[test]
    fn errors_are_the_kernels_errno_and_never_read_past_the_message() {
        let eperm = message(NLMSG_ERROR, 0, SEQ, &(-libc::EPERM).to_ne_bytes());
        match read(&eperm).0 {
            Err(ProbeError::Kernel { source, .. }) => assert_eq!(source.raw_os_error(), Some(libc::EPERM)),
            other => panic!("{other:?}"),
        }
        // An error message with no room for its code (the old check read 4 bytes past it).
        let bare = message(NLMSG_ERROR, 0, SEQ, &[]);
        assert!(read(&bare).0.unwrap_err().to_string().contains("an error message without its code"));
        // An acknowledgement (code 0) is not an error.
        assert_eq!(
            read(&[message(NLMSG_ERROR, 0, SEQ, &0i32.to_ne_bytes()), done(0)].concat()).0.unwrap(),
            Progress::Done
        );
        // A dump that ended in an error says so in NLMSG_DONE.
        match read(&done(-libc::EINTR)).0 {
            Err(ProbeError::Kernel { source, .. }) => assert_eq!(source.raw_os_error(), Some(libc::EINTR)),
            other => panic!("{other:?}"),
        }
        assert!(read(&done(5)).0.is_err(), "a positive code is no errno");
        assert!(read(&done(i32::MIN)).0.is_err(), "nor is one that cannot be negated");
    }

    #[test]
    fn truncated_or_garbled_input_is_an_error_never_a_panic() {
        let whole = a_whole_dump();
        let done_at = whole.len() - done(0).len();
        for cut in 0..whole.len() {
            let (progress, _) = read(&whole[..cut]);
            match progress {
                Ok(Progress::Done) => panic!("a dump cut at {cut} bytes cannot be done"),
                Ok(Progress::More) => assert!(cut > 0 && cut <= done_at, "{cut}"),
                Ok(Progress::Interrupted) => panic!("nothing here is interrupted"),
                Err(_) => {}
            }
        }
        let header_only = |len: u32| {
            let mut m = message(NLMSG_DONE, 0, SEQ, &[]);
            m[0..4].copy_from_slice(&len.to_ne_bytes());
            m
        };
        for len in [0, 1, 15, 17, u32::MAX] {
            assert!(read(&header_only(len)).0.is_err(), "length {len}");
        }
        // Attributes that overrun their message, or are shorter than their own header.
        for bad_len in [0u16, 3, 200] {
            let mut p = vec![2, 0, 0, 0];
            p.extend(bad_len.to_ne_bytes());
            p.extend(3u16.to_ne_bytes());
            p.extend(b"abcd");
            let e = read(&new_chain(&p)).0.unwrap_err().to_string();
            assert!(e.contains("attribute"), "{bad_len}: {e}");
        }
        assert!(read(&new_chain(&[2, 0])).0.is_err(), "a payload shorter than nfgenmsg");
        assert!(read(&new_chain(&[2, 0, 0, 0, 8, 0])).0.is_err(), "an attribute header cut short");
        // Pseudo-random bytes, valid header lengths among them: an answer, never a panic.
        let mut state = 0x2545_f491_u32;
        for round in 0..2000 {
            let mut bytes: Vec<u8> = (0..(round % 97))
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    state as u8
                })
                .collect();
            if bytes.len() >= 12 {
                let len = (bytes.len() as u32).min(u32::from(bytes[0]));
                bytes[0..4].copy_from_slice(&len.to_ne_bytes());
                bytes[8..12].copy_from_slice(&SEQ.to_ne_bytes());
            }
            let _ = read(&bytes);
        }
    }

    #[test]
    fn requests_carry_their_own_sequence_number() {
        let r = request(Dump::RULES, 99);
        assert_eq!(u32_at(&r, 0), Some(20));
        assert_eq!(u16_at(&r, 4), Some(0x0a07));
        assert_eq!(u32_at(&r, 8), Some(99));
        assert_eq!(u16_at(&r, 6), Some((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16));
    }
}
