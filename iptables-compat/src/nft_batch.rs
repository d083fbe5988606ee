//! Sending a compiled nf_tables batch ([`crate::nft_wire`]) as one kernel transaction:
//! batch begin, the messages (each asking for an acknowledgement), batch end, on one
//! NETLINK_NETFILTER socket of the calling thread's network namespace. The kernel
//! applies all of it or none of it; the first message it refuses is named with the
//! kernel's reason. Needs CAP_NET_ADMIN in the namespace's user namespace, as nft does.

use std::{io, os::fd::AsRawFd as _, time::Duration};

use crate::{
    nf_probe::{NFNL_SUBSYS_NFTABLES, NLMSG_ERROR, NLMSG_HDRLEN, netfilter_socket},
    nft_wire::{Batch, FAMILY},
};

const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_CAPPED: u16 = 0x100;
const NLM_F_ACK_TLVS: u16 = 0x200;
const SOL_NETLINK: i32 = 270;
const NETLINK_CAP_ACK: i32 = 10;
const NETLINK_EXT_ACK: i32 = 11;
const NLMSGERR_ATTR_MSG: u16 = 1;
/// How long the kernel may take to answer (it answers while the send is processed).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("{what}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the kernel refused {what}{}", reason.as_ref().map(|r| format!(" ({r})")).unwrap_or_default())]
    Refused {
        what: String,
        reason: Option<String>,
        #[source]
        source: io::Error,
    },
    #[error("malformed answer to the nf_tables batch: {0}")]
    Malformed(String),
}

impl BatchError {
    /// The errno of a refusal (`EEXIST` when a table appeared since it was looked for).
    pub fn errno(&self) -> Option<i32> {
        match self {
            BatchError::Refused { source, .. } | BatchError::Io { source, .. } => source.raw_os_error(),
            BatchError::Malformed(_) => None,
        }
    }
}

fn header(buf: &mut Vec<u8>, len: usize, kind: u16, flags: u16, seq: u32) {
    buf.extend((len as u32).to_ne_bytes());
    buf.extend(kind.to_ne_bytes());
    buf.extend(flags.to_ne_bytes());
    buf.extend(seq.to_ne_bytes());
    buf.extend(0u32.to_ne_bytes());
}

/// The datagram: begin, messages with sequence numbers `first + 1 ..`, end.
fn datagram(batch: &Batch, first: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let frame = |out: &mut Vec<u8>, kind: u16, seq: u32| {
        header(out, NLMSG_HDRLEN + 4, kind, NLM_F_REQUEST, seq);
        out.extend([0, 0]);
        out.extend(NFNL_SUBSYS_NFTABLES.to_be_bytes());
    };
    frame(&mut out, NFNL_MSG_BATCH_BEGIN, first);
    for (n, m) in batch.messages.iter().enumerate() {
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | m.kind;
        header(
            &mut out,
            NLMSG_HDRLEN + 4 + m.attrs.len(),
            kind,
            NLM_F_REQUEST | NLM_F_ACK | m.flags,
            first + 1 + n as u32,
        );
        out.extend([FAMILY, 0, 0, 0]);
        out.extend(&m.attrs);
    }
    frame(&mut out, NFNL_MSG_BATCH_END, first + 1 + batch.messages.len() as u32);
    out
}

/// Sends `batch` and waits for the kernel's answer to every message.
pub fn send(batch: &Batch) -> Result<(), BatchError> {
    let io = |what| move |source| BatchError::Io { what, source };
    let socket = netfilter_socket().map_err(io("open a netfilter netlink socket"))?;
    let fd = socket.as_raw_fd();
    let on: libc::c_int = 1;
    for opt in [NETLINK_CAP_ACK, NETLINK_EXT_ACK] {
        // SAFETY: setsockopt with an int of its size. Either may be missing on an old
        // kernel: answers are then longer, or carry no reason; both are read.
        unsafe {
            libc::setsockopt(
                fd,
                SOL_NETLINK,
                opt,
                (&on as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as u32,
            )
        };
    }
    let timeout =
        libc::timeval { tv_sec: ANSWER_TIMEOUT.as_secs() as libc::time_t, tv_usec: 0 as libc::suseconds_t };
    // SAFETY: setsockopt with a timeval of its size.
    if unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            size_of::<libc::timeval>() as u32,
        )
    } < 0
    {
        return Err(io("set the netlink socket's receive timeout")(io::Error::last_os_error()));
    }
    let first = std::process::id().wrapping_mul(0x9e37_79b9) ^ 0x5745_4952;
    let bytes = datagram(batch, first);
    // SAFETY: sending a buffer we own on our socket.
    let sent = unsafe { libc::send(socket.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) };
    if sent < 0 {
        return Err(io("send the nf_tables batch")(io::Error::last_os_error()));
    }
    if sent as usize != bytes.len() {
        return Err(BatchError::Malformed(format!("sent {sent} of {} bytes", bytes.len())));
    }
    let mut acked = vec![false; batch.messages.len()];
    let mut buf = vec![0u8; 64 * 1024];
    while acked.iter().any(|a| !a) {
        // SAFETY: receiving into a buffer we own, of its length; MSG_TRUNC makes the
        // result the datagram's real length, so a cut one is seen.
        let n =
            unsafe { libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_TRUNC) };
        let n = usize::try_from(n).map_err(|_| io("read the kernel's answer")(io::Error::last_os_error()))?;
        if n > buf.len() {
            return Err(BatchError::Malformed(format!("a {n}-byte answer")));
        }
        read_answer(&buf[..n], batch, first, &mut acked)?;
    }
    Ok(())
}

/// One datagram of answers: acknowledgements are recorded; the first error is returned,
/// named by the message it answers.
fn read_answer(mut rest: &[u8], batch: &Batch, first: u32, acked: &mut [bool]) -> Result<(), BatchError> {
    let bad = |why: String| BatchError::Malformed(why);
    let u32_at = |b: &[u8], at: usize| b.get(at..at + 4).map(|s| u32::from_ne_bytes(s.try_into().unwrap()));
    let u16_at = |b: &[u8], at: usize| b.get(at..at + 2).map(|s| u16::from_ne_bytes(s.try_into().unwrap()));
    if rest.is_empty() {
        return Err(bad("the socket closed before every message was answered".into()));
    }
    while !rest.is_empty() {
        let (Some(len), Some(kind), Some(flags), Some(seq)) =
            (u32_at(rest, 0), u16_at(rest, 4), u16_at(rest, 6), u32_at(rest, 8))
        else {
            return Err(bad("a message header cut short".into()));
        };
        let len = len as usize;
        if len < NLMSG_HDRLEN || len > rest.len() {
            return Err(bad(format!("a message of {len} bytes in {} remaining", rest.len())));
        }
        if kind != NLMSG_ERROR {
            return Err(bad(format!("a message of type {kind:#06x}")));
        }
        let payload = &rest[NLMSG_HDRLEN..len];
        let code = u32_at(payload, 0).ok_or_else(|| bad("an answer without its code".into()))? as i32;
        let index = seq.wrapping_sub(first).wrapping_sub(1) as usize;
        let what =
            match seq.wrapping_sub(first) {
                0 => "the batch".to_string(),
                _ => batch.messages.get(index).map(|m| format!("`{}`", m.what)).ok_or_else(|| {
                    bad(format!("an answer to message {seq}, which this batch did not send"))
                })?,
            };
        if code != 0 {
            let Some(errno) = code.checked_neg().filter(|e| *e > 0) else {
                return Err(bad(format!("an error code of {code}")));
            };
            return Err(BatchError::Refused {
                what,
                reason: ext_ack_message(payload, flags),
                source: io::Error::from_raw_os_error(errno),
            });
        }
        match acked.get_mut(index) {
            Some(a) => *a = true,
            None => return Err(bad(format!("an acknowledgement of {what}, which asked for none"))),
        }
        rest = rest.get((len + 3) & !3..).unwrap_or_default();
    }
    Ok(())
}

/// The kernel's own words for an error (`NLMSGERR_ATTR_MSG`), when it gave them.
fn ext_ack_message(payload: &[u8], flags: u16) -> Option<String> {
    if flags & NLM_F_ACK_TLVS == 0 {
        return None;
    }
    // The error code, then the request's header (and its body, unless capped).
    let request_len = u32::from_ne_bytes(payload.get(4..8)?.try_into().ok()?) as usize;
    let skip = 4 + if flags & NLM_F_CAPPED != 0 { NLMSG_HDRLEN } else { (request_len + 3) & !3 };
    let mut tlvs = payload.get(skip..)?;
    while tlvs.len() >= 4 {
        let len = u16::from_ne_bytes(tlvs[0..2].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(tlvs[2..4].try_into().ok()?);
        let value = tlvs.get(4..len)?;
        if kind == NLMSGERR_ATTR_MSG {
            return Some(String::from_utf8_lossy(value).trim_end_matches('\0').to_string());
        }
        tlvs = tlvs.get((len + 3) & !3..)?;
    }
    None
}
