//! The kernel's ipsets over netfilter netlink (`NFNL_SUBSYS_IPSET`), in process, as
//! Istio's node agent drives them for the ambient host-probe rule: `hash:ip` sets with
//! comments, created if missing (an existing set of the same type is kept, members and
//! all), members added with a comment (re-adding replaces the comment), deleted, listed
//! with their comments, flushed, destroyed. Each call is one request on a socket of its
//! own, in the calling thread's network namespace; replies are taken only when they
//! answer it (sequence number, message type, lengths), and the kernel's ipset error
//! codes are named. No `ipset` binary is needed.

use std::{
    io,
    net::IpAddr,
    os::fd::{AsRawFd as _, OwnedFd},
    sync::atomic::{AtomicU32, Ordering},
};

const NFNL_SUBSYS_IPSET: u16 = 6;
const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;
const NLA_F_NET_BYTEORDER: u16 = 0x4000;
const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

/// The ipset netlink protocol version spoken (the kernel accepts 6 and 7).
const PROTOCOL: u8 = 7;
const CMD_CREATE: u16 = 2;
const CMD_DESTROY: u16 = 3;
const CMD_FLUSH: u16 = 4;
const CMD_LIST: u16 = 7;
const CMD_ADD: u16 = 9;
const CMD_DEL: u16 = 10;

const ATTR_PROTOCOL: u16 = 1;
const ATTR_SETNAME: u16 = 2;
const ATTR_TYPENAME: u16 = 3;
const ATTR_REVISION: u16 = 4;
const ATTR_FAMILY: u16 = 5;
const ATTR_DATA: u16 = 7;
const ATTR_ADT: u16 = 8;
/// Inside DATA.
const ATTR_IP: u16 = 1;
const ATTR_CADT_FLAGS: u16 = 8;
const ATTR_COMMENT: u16 = 26;
/// Inside IP.
const ATTR_IPADDR_IPV4: u16 = 1;
const ATTR_IPADDR_IPV6: u16 = 2;
/// `IPSET_FLAG_WITH_COMMENT` (a CADT flag at create).
const FLAG_WITH_COMMENT: u32 = 1 << 4;

/// The largest set name the kernel takes (`IPSET_MAXNAMELEN` with its NUL).
pub const MAX_NAME: usize = 31;
/// The largest comment (`IPSET_MAX_COMMENT_SIZE`).
pub const MAX_COMMENT: usize = 255;

/// ipset's own error numbers (`enum ipset_errno`), as the kernel returns them.
fn ipset_errno(code: i32) -> Option<&'static str> {
    Some(match code {
        4097 => "protocol error (the kernel's ipset speaks another version)",
        4098 => "set type not supported by the kernel",
        4099 => "the maximum number of sets is reached",
        4100 => "the set is busy",
        4102 => "a set of this name exists with another type",
        4103 => "the set (or element) exists",
        4104 => "invalid CIDR",
        4106 => "invalid family",
        4108 => "the set is referenced by a rule",
        4109 => "invalid IPv4 address",
        4110 => "invalid IPv6 address",
        4112 => "comment not supported by the set",
        4352 => "the set is full",
        _ => return None,
    })
}

/// Why an ipset request failed.
#[derive(Debug, thiserror::Error)]
pub enum IpsetError {
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{what}: {reason}")]
    Kernel { what: String, code: i32, reason: String },
    #[error("{what}: malformed reply: {why}")]
    Malformed { what: String, why: String },
    #[error("ipset name {0:?}: expected 1 to {MAX_NAME} bytes")]
    Name(String),
}

impl IpsetError {
    /// The set (or element) does not exist (`ENOENT`) .
    pub fn is_missing(&self) -> bool {
        matches!(self, Self::Kernel { code, .. } if *code == libc::ENOENT)
    }
}

/// One member of a set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub ip: IpAddr,
    pub comment: Option<String>,
}

/// Builds netlink attributes.
#[derive(Default)]
struct Attrs(Vec<u8>);

impl Attrs {
    fn put(&mut self, kind: u16, value: &[u8]) -> &mut Self {
        let len = 4 + value.len();
        self.0.extend_from_slice(&(len as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(value);
        self.0.resize(self.0.len().next_multiple_of(4), 0);
        self
    }
    fn string(&mut self, kind: u16, value: &str) -> &mut Self {
        let mut bytes = value.as_bytes().to_vec();
        bytes.push(0);
        self.put(kind, &bytes)
    }
    fn nested(&mut self, kind: u16, inner: &Attrs) -> &mut Self {
        self.put(kind | NLA_F_NESTED, &inner.0)
    }
}

fn ip_attrs(ip: IpAddr) -> Attrs {
    let mut a = Attrs::default();
    match ip {
        IpAddr::V4(v4) => a.put(ATTR_IPADDR_IPV4 | NLA_F_NET_BYTEORDER, &v4.octets()),
        IpAddr::V6(v6) => a.put(ATTR_IPADDR_IPV6 | NLA_F_NET_BYTEORDER, &v6.octets()),
    };
    a
}

fn check_name(name: &str) -> Result<(), IpsetError> {
    if name.is_empty() || name.len() > MAX_NAME || name.contains('\0') {
        return Err(IpsetError::Name(name.into()));
    }
    Ok(())
}

static SEQUENCE: AtomicU32 = AtomicU32::new(1);

/// One message: nlmsghdr + nfgenmsg (`family`, version 0, res_id 0) + `attrs`.
fn message(cmd: u16, flags: u16, family: u8, attrs: &Attrs, seq: u32) -> Vec<u8> {
    let len = NLMSG_HDRLEN + 4 + attrs.0.len();
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&((NFNL_SUBSYS_IPSET << 8) | cmd).to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&[family, 0, 0, 0]);
    m.extend_from_slice(&attrs.0);
    m
}

fn socket(what: &str) -> Result<OwnedFd, IpsetError> {
    crate::kernel::nf_probe::netfilter_socket()
        .map_err(|source| IpsetError::Io { what: format!("{what}: open a netfilter netlink socket"), source })
}

/// Sends one request and reads its answer: the ack (`Ok(vec![])`) or, for a dump, every
/// reply message's attributes until `NLMSG_DONE`.
fn exchange(what: &str, cmd: u16, dump: bool, family: u8, attrs: &Attrs) -> Result<Vec<Vec<u8>>, IpsetError> {
    let sock = socket(what)?;
    let seq = SEQUENCE.fetch_add(1, Ordering::Relaxed);
    let flags =
        libc::NLM_F_REQUEST as u16 | if dump { libc::NLM_F_DUMP as u16 } else { libc::NLM_F_ACK as u16 };
    let request = message(cmd, flags, family, attrs, seq);
    // SAFETY: sending a buffer we own on our socket.
    let sent = unsafe { libc::send(sock.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) };
    if sent < 0 {
        return Err(IpsetError::Io { what: format!("{what}: send"), source: io::Error::last_os_error() });
    }
    let malformed = |why: String| IpsetError::Malformed { what: what.to_string(), why };
    let mut replies = Vec::new();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        // SAFETY: receiving into a buffer we own, of its length; MSG_TRUNC reports the
        // datagram's real length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_TRUNC) };
        let n = usize::try_from(n).map_err(|_| IpsetError::Io {
            what: format!("{what}: receive"),
            source: io::Error::last_os_error(),
        })?;
        if n > buf.len() {
            return Err(malformed(format!("a {n}-byte datagram does not fit the buffer")));
        }
        if n == 0 {
            return Err(malformed("the socket closed before the answer".into()));
        }
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            let field =
                |at: usize| rest.get(at..at + 4).map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")));
            let (Some(len), Some(got_seq)) = (field(0), field(8)) else {
                return Err(malformed("a message header cut short".into()));
            };
            let len = len as usize;
            let kind = u16::from_ne_bytes([rest[4], rest[5]]);
            if len < NLMSG_HDRLEN || len > rest.len() {
                return Err(malformed(format!("a message of {len} bytes in {} remaining", rest.len())));
            }
            if got_seq != seq {
                return Err(malformed(format!("a reply to request {got_seq}, not to this one ({seq})")));
            }
            let payload = &rest[NLMSG_HDRLEN..len];
            match kind {
                NLMSG_ERROR => {
                    let code = payload.get(..4).map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")));
                    match code {
                        Some(0) if !dump => return Ok(replies),
                        Some(0) => {}
                        Some(code) => {
                            let code = -code;
                            let reason = ipset_errno(code)
                                .map(String::from)
                                .unwrap_or_else(|| io::Error::from_raw_os_error(code).to_string());
                            return Err(IpsetError::Kernel { what: what.to_string(), code, reason });
                        }
                        None => return Err(malformed("an error message cut short".into())),
                    }
                }
                NLMSG_DONE => return Ok(replies),
                k if k == (NFNL_SUBSYS_IPSET << 8) | cmd => {
                    replies.push(payload.get(4..).unwrap_or_default().to_vec());
                }
                other => return Err(malformed(format!("an unexpected message type {other:#x}"))),
            }
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        }
    }
}

/// The attributes of a buffer: (type without flags, value).
fn attributes(mut bytes: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if bytes.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([bytes[0], bytes[1]]) as usize;
        let kind = u16::from_ne_bytes([bytes[2], bytes[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > bytes.len() {
            return None;
        }
        let value = &bytes[4..len];
        bytes = &bytes[len.next_multiple_of(4).min(bytes.len())..];
        Some((kind, value))
    })
}

fn base(name: &str) -> Attrs {
    let mut a = Attrs::default();
    a.put(ATTR_PROTOCOL, &[PROTOCOL]).string(ATTR_SETNAME, name);
    a
}

/// Creates `name` as `hash:ip` with comments for IPv4 or IPv6 if it does not exist;
/// an existing set of that type is kept as it is (with its members). A set of the name
/// with another type is an error.
pub fn create_hash_ip(name: &str, ipv6: bool) -> Result<(), IpsetError> {
    check_name(name)?;
    let family = if ipv6 { libc::AF_INET6 } else { libc::AF_INET } as u8;
    let what = format!("create ipset {name} (hash:ip, {})", if ipv6 { "inet6" } else { "inet" });
    let mut data = Attrs::default();
    data.put(ATTR_CADT_FLAGS | NLA_F_NET_BYTEORDER, &FLAG_WITH_COMMENT.to_be_bytes());
    // The newest revision the kernel has: 6 (5.8+) down to 2, the first with comments.
    let mut last = None;
    for revision in (2..=6u8).rev() {
        let mut a = base(name);
        a.string(ATTR_TYPENAME, "hash:ip")
            .put(ATTR_REVISION, &[revision])
            .put(ATTR_FAMILY, &[family])
            .nested(ATTR_DATA, &data);
        match exchange(&what, CMD_CREATE, false, family, &a) {
            Ok(_) => return Ok(()),
            Err(IpsetError::Kernel { code: 4098, .. }) if revision > 2 => last = Some(revision),
            Err(e) => return Err(e),
        }
    }
    Err(IpsetError::Kernel {
        what,
        code: 4098,
        reason: format!("no hash:ip revision from {} down to 2", last.unwrap_or(6)),
    })
}

/// Adds `ip` with `comment`; a member already there gets the new comment.
pub fn add(name: &str, ip: IpAddr, comment: &str) -> Result<(), IpsetError> {
    check_name(name)?;
    let comment: String = comment.chars().filter(|c| *c != '\0').take(MAX_COMMENT).collect();
    let mut data = Attrs::default();
    data.nested(ATTR_IP, &ip_attrs(ip)).string(ATTR_COMMENT, &comment);
    let mut a = base(name);
    a.nested(ATTR_DATA, &data);
    exchange(&format!("add {ip} to ipset {name}"), CMD_ADD, false, family_of(ip), &a).map(drop)
}

/// Deletes `ip`; a member that is not there is fine.
pub fn del(name: &str, ip: IpAddr) -> Result<(), IpsetError> {
    check_name(name)?;
    let mut data = Attrs::default();
    data.nested(ATTR_IP, &ip_attrs(ip));
    let mut a = base(name);
    a.nested(ATTR_DATA, &data);
    exchange(&format!("delete {ip} from ipset {name}"), CMD_DEL, false, family_of(ip), &a).map(drop)
}

fn family_of(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { libc::AF_INET as u8 } else { libc::AF_INET6 as u8 }
}

/// Empties the set.
pub fn flush(name: &str) -> Result<(), IpsetError> {
    check_name(name)?;
    exchange(&format!("flush ipset {name}"), CMD_FLUSH, false, libc::AF_INET as u8, &base(name)).map(drop)
}

/// Destroys the set (it must not be referenced by a rule).
pub fn destroy(name: &str) -> Result<(), IpsetError> {
    check_name(name)?;
    exchange(&format!("destroy ipset {name}"), CMD_DESTROY, false, libc::AF_INET as u8, &base(name)).map(drop)
}

/// The set's members with their comments; `Ok(None)` when there is no such set.
pub fn list(name: &str) -> Result<Option<Vec<Member>>, IpsetError> {
    check_name(name)?;
    let what = format!("list ipset {name}");
    let replies = match exchange(&what, CMD_LIST, true, libc::AF_INET as u8, &base(name)) {
        Ok(r) => r,
        Err(e) if e.is_missing() => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut members = Vec::new();
    for reply in &replies {
        for (kind, adt) in attributes(reply) {
            if kind != ATTR_ADT {
                continue;
            }
            for (kind, data) in attributes(adt) {
                if kind == ATTR_DATA {
                    members.push(member(data).ok_or_else(|| IpsetError::Malformed {
                        what: what.clone(),
                        why: "a member without an address".into(),
                    })?);
                }
            }
        }
    }
    Ok(Some(members))
}

/// One `DATA` of a list reply.
fn member(data: &[u8]) -> Option<Member> {
    let mut ip = None;
    let mut comment = None;
    for (kind, value) in attributes(data) {
        match kind {
            ATTR_IP => {
                for (family, addr) in attributes(value) {
                    ip = match (family, addr.len()) {
                        (ATTR_IPADDR_IPV4, 4) => Some(IpAddr::from(<[u8; 4]>::try_from(addr).ok()?)),
                        (ATTR_IPADDR_IPV6, 16) => Some(IpAddr::from(<[u8; 16]>::try_from(addr).ok()?)),
                        _ => ip,
                    };
                }
            }
            ATTR_COMMENT => {
                let text = value.split(|b| *b == 0).next().unwrap_or_default();
                comment = Some(String::from_utf8_lossy(text).into_owned());
            }
            _ => {}
        }
    }
    Some(Member { ip: ip?, comment })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_add_encodes_as_the_kernel_reads_it() {
        let mut data = Attrs::default();
        data.nested(ATTR_IP, &ip_attrs("10.1.2.3".parse().unwrap())).string(ATTR_COMMENT, "uid");
        let mut a = base("istio-inpod-probes-v4");
        a.nested(ATTR_DATA, &data);
        let m = message(CMD_ADD, 5, 2, &a, 9);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()) as usize, m.len());
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), 0x0609, "NFNL_SUBSYS_IPSET << 8 | IPSET_CMD_ADD");
        let attrs: Vec<(u16, Vec<u8>)> = attributes(&m[20..]).map(|(k, v)| (k, v.to_vec())).collect();
        assert_eq!(attrs[0], (ATTR_PROTOCOL, vec![7]));
        assert_eq!(attrs[1], (ATTR_SETNAME, b"istio-inpod-probes-v4\0".to_vec()));
        assert_eq!(attrs[2].0, ATTR_DATA);
        // The nested and byte-order flags the kernel checks for.
        let data_at = 20 + 8 + (4 + "istio-inpod-probes-v4\0".len()).next_multiple_of(4);
        let raw_data_kind = u16::from_ne_bytes([m[data_at + 2], m[data_at + 3]]);
        assert_eq!(raw_data_kind, ATTR_DATA | NLA_F_NESTED);
        let parsed = member(&attrs[2].1).unwrap();
        assert_eq!(parsed, Member { ip: "10.1.2.3".parse().unwrap(), comment: Some("uid".into()) });
        let v6 = ip_attrs("fd00::1".parse().unwrap());
        assert_eq!(u16::from_ne_bytes([v6.0[2], v6.0[3]]), ATTR_IPADDR_IPV6 | NLA_F_NET_BYTEORDER);
    }

    #[test]
    fn names_are_checked_and_errors_named() {
        assert!(matches!(create_hash_ip("", false), Err(IpsetError::Name(_))));
        assert!(matches!(add(&"x".repeat(32), "10.0.0.1".parse().unwrap(), "c"), Err(IpsetError::Name(_))));
        assert_eq!(ipset_errno(4103), Some("the set (or element) exists"));
        // A truncated attribute ends the walk instead of reading past it.
        assert_eq!(attributes(&[8, 0, 1, 0, 1]).count(), 0);
    }
}
