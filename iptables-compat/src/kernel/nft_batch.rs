//! Sending a compiled nf_tables batch ([`crate::nft::wire`]) as one kernel transaction:
//! batch begin, the messages (each asking for an acknowledgement), batch end, on one
//! NETLINK_NETFILTER socket of the calling thread's network namespace. The kernel
//! applies all of it or none of it; the first message it refuses is named with the
//! kernel's reason. Needs CAP_NET_ADMIN in the namespace's user namespace, as nft does.

use std::{io, os::fd::AsRawFd as _, time::Duration};

use super::{
    nf_probe::{NFNL_SUBSYS_NFTABLES, NLMSG_ERROR, NLMSG_HDRLEN, netfilter_socket},
    nft_encode::Batch,
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

/// Why a batch did not go in, and whether anything of it can be in.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// Nothing reached the kernel: nothing was applied.
    #[error("{what}: {source}")]
    NotSent {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    /// The kernel refused a message and aborted the whole batch: nothing was applied.
    #[error("the kernel refused {what}{}: {source}", reason.as_ref().map(|r| format!(" ({r})")).unwrap_or_default())]
    Refused {
        what: String,
        reason: Option<String>,
        #[source]
        source: io::Error,
    },
    /// The batch was sent but its answer could not be read: it may be in.
    #[error(
        "the nf_tables batch was sent but its answer could not be read ({why}); whether it was applied is \
         unknown: run again, the next run reads the namespace"
    )]
    Unanswered { why: String },
}

impl BatchError {
    /// The errno of a refusal (`EEXIST` when a table appeared since it was looked for).
    pub fn errno(&self) -> Option<i32> {
        match self {
            BatchError::Refused { source, .. } | BatchError::NotSent { source, .. } => source.raw_os_error(),
            BatchError::Unanswered { .. } => None,
        }
    }

    /// Whether the kernel certainly applied none of the batch (another way may run).
    pub fn applied_nothing(&self) -> bool {
        !matches!(self, BatchError::Unanswered { .. })
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
        // Only the last message asks for an acknowledgement: the kernel answers after the
        // commit, every answer at once, and one per message would overflow the socket of
        // a large batch. A refused message is answered whether asked or not.
        let ack = if n + 1 == batch.messages.len() { NLM_F_ACK } else { 0 };
        header(
            &mut out,
            NLMSG_HDRLEN + 4 + m.attrs.len(),
            kind,
            NLM_F_REQUEST | ack | m.flags,
            first + 1 + n as u32,
        );
        out.extend([batch.family, 0, 0, 0]);
        out.extend(&m.attrs);
    }
    frame(&mut out, NFNL_MSG_BATCH_END, first + 1 + batch.messages.len() as u32);
    out
}

/// What the receive buffer is asked to hold: every refusal of a large batch.
const RECEIVE_BUFFER: libc::c_int = 4 << 20;

fn set_option<T>(fd: i32, level: i32, name: i32, value: &T) -> io::Result<()> {
    // SAFETY: setsockopt with a value of its own size.
    let rc = unsafe { libc::setsockopt(fd, level, name, (value as *const T).cast(), size_of::<T>() as u32) };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Sends `batch` and waits for the kernel's answer: the acknowledgement of its last
/// message (sent after the commit), or the first refusal.
pub fn send(batch: &Batch) -> Result<(), BatchError> {
    if batch.messages.is_empty() {
        return Ok(());
    }
    let not_sent = |what| move |source| BatchError::NotSent { what, source };
    let socket = netfilter_socket().map_err(not_sent("open a netfilter netlink socket"))?;
    let fd = socket.as_raw_fd();
    // Either may be missing on an old kernel: answers are then longer, or carry no
    // reason; both are read. A smaller buffer than asked is the kernel's cap.
    let _ = set_option(fd, SOL_NETLINK, NETLINK_CAP_ACK, &1);
    let _ = set_option(fd, SOL_NETLINK, NETLINK_EXT_ACK, &1);
    let _ = set_option(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, &RECEIVE_BUFFER);
    let timeout = libc::timeval { tv_sec: ANSWER_TIMEOUT.as_secs() as _, tv_usec: 0 };
    set_option(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, &timeout)
        .map_err(not_sent("set the netlink socket's receive timeout"))?;
    let first = std::process::id().wrapping_mul(0x9e37_79b9) ^ 0x5745_4952;
    let bytes = datagram(batch, first);
    // SAFETY: sending a buffer we own on our socket.
    let sent = unsafe { libc::send(fd, bytes.as_ptr().cast(), bytes.len(), 0) };
    if sent < 0 {
        // The kernel processes a batch inside the send: a failed send ran none of it.
        return Err(not_sent("send the nf_tables batch")(io::Error::last_os_error()));
    }
    let unanswered = |why: String| BatchError::Unanswered { why };
    if sent as usize != bytes.len() {
        return Err(unanswered(format!("sent {sent} of {} bytes", bytes.len())));
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: receiving into a buffer we own, of its length; MSG_TRUNC makes the
        // result the datagram's real length, so a cut one is seen.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_TRUNC) };
        let n = usize::try_from(n)
            .map_err(|_| unanswered(format!("read the kernel's answer: {}", io::Error::last_os_error())))?;
        if n > buf.len() {
            return Err(unanswered(format!("a {n}-byte answer")));
        }
        if read_answer(&buf[..n], batch, first)? {
            return Ok(());
        }
    }
}

/// One datagram of answers: true once the last message is acknowledged; the first
/// refusal is returned, named by the message it answers.
fn read_answer(rest: &[u8], batch: &Batch, first: u32) -> Result<bool, BatchError> {
    let bad = |why: String| BatchError::Unanswered { why };
    let u32_at = |b: &[u8], at: usize| b.get(at..at + 4).map(|s| u32::from_ne_bytes(s.try_into().unwrap()));
    let u16_at = |b: &[u8], at: usize| b.get(at..at + 2).map(|s| u16::from_ne_bytes(s.try_into().unwrap()));
    if rest.is_empty() {
        return Err(bad("the socket closed before the batch was answered".into()));
    }
    let last = batch.messages.len();
    // Only refusals and the last message's acknowledgement are ever sent: the first
    // message of the datagram decides.
    {
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
        let index = seq.wrapping_sub(first) as usize;
        let what = match index {
            0 => "the batch".to_string(),
            i if i <= last => format!("`{}`", batch.messages[i - 1].what),
            _ => return Err(bad(format!("an answer to message {seq}, which this batch did not send"))),
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
        if index != last {
            return Err(bad(format!("an acknowledgement of {what}, which asked for none")));
        }
        Ok(true)
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::nft_encode::Message;

    const FIRST: u32 = 100;

    fn batch(n: usize) -> Batch {
        let messages = (0..n)
            .map(|i| Message { kind: 6, flags: 0, attrs: Vec::new(), what: format!("rule {i}") })
            .collect();
        Batch { family: 1, messages }
    }

    /// An NLMSG_ERROR answering `seq` with `code` (capped, no TLVs).
    fn answer(seq: u32, code: i32) -> Vec<u8> {
        let mut m = Vec::new();
        header(&mut m, NLMSG_HDRLEN + 4 + NLMSG_HDRLEN, NLMSG_ERROR, NLM_F_CAPPED, seq);
        m.extend(code.to_ne_bytes());
        header(&mut m, NLMSG_HDRLEN, 0, 0, seq);
        m
    }

    #[test]
    fn only_the_last_message_asks_for_an_answer() {
        let bytes = datagram(&batch(3), FIRST);
        let flags: Vec<u16> =
            (0..5).map(|i| u16::from_ne_bytes([bytes[i * 20 + 6], bytes[i * 20 + 7]])).collect();
        assert_eq!(flags.iter().filter(|f| *f & NLM_F_ACK != 0).count(), 1);
        assert_ne!(flags[3] & NLM_F_ACK, 0, "the last message before the batch end");
    }

    #[test]
    fn the_last_acknowledgement_ends_it_and_a_refusal_names_its_message() {
        let b = batch(3);
        assert!(read_answer(&answer(FIRST + 3, 0), &b, FIRST).unwrap());
        let refused = read_answer(&answer(FIRST + 2, -libc::EEXIST), &b, FIRST).unwrap_err();
        assert!(refused.applied_nothing());
        assert_eq!(refused.errno(), Some(libc::EEXIST));
        assert!(refused.to_string().contains("`rule 1`"), "{refused}");
        let whole = read_answer(&answer(FIRST, -libc::EPERM), &b, FIRST).unwrap_err();
        assert!(whole.to_string().contains("the batch"), "{whole}");
        // Anything else is an answer not understood: the batch may be in.
        for odd in
            [answer(FIRST + 1, 0), answer(FIRST + 9, 0), answer(FIRST + 3, 5), Vec::new(), vec![1, 2, 3]]
        {
            let e = read_answer(&odd, &b, FIRST).unwrap_err();
            assert!(!e.applied_nothing(), "{e}");
        }
    }
}
