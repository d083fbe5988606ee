//! `:authority` repair for gRPC clients on the agent's Unix sockets. gRPC C core
//! (Python, C++, Ruby ...), Java and Swift send the %-encoded socket path as the
//! HTTP/2 `:authority` of a `unix:` channel (grpc/grpc#38142); the h2 server under
//! tonic refuses such a request with `RST_STREAM(PROTOCOL_ERROR)` (hyperium/h2#487), so
//! proxyless gRPC applications could not reach the XDS socket. Envoy and grpc-go send
//! a valid authority and see no difference.
//!
//! [`AuthorityRepair`] sits on the read side of an accepted connection. It passes the
//! client preface and every frame through, except header blocks (HEADERS plus
//! CONTINUATION), which it decodes with the client's HPACK state and re-encodes as
//! literals without indexing (so h2's dynamic table stays empty and cannot drift from
//! ours), replacing an `:authority` that is not a valid URI authority with
//! `localhost`. A block it cannot decode ends the connection, as h2 itself would with
//! COMPRESSION_ERROR, and so does one that decodes to a header list past h2's own
//! limit or raises the dynamic table over HTTP/2's default: decoding is bounded before
//! anything is kept. The write side is untouched.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame a client may send before the server's SETTINGS say otherwise
/// (h2's default, which tonic keeps).
const MAX_FRAME: usize = 16_384;
/// A header block larger than this ends the connection.
const MAX_BLOCK: usize = 1 << 20;
/// The largest header list a block may decode to (each field counted as its name, its
/// value and 32 bytes, RFC 7540 §6.5.2). The h2 server behind advertises hyper's 16 KiB
/// `SETTINGS_MAX_HEADER_LIST_SIZE` and ends the connection past four times that;
/// decoding stops here at the same point, so a block of indexed references (one byte
/// each, naming a 4 KB table entry) cannot expand a thousandfold in memory first.
/// grpc-go's server allows 16 MiB; what is decoded here is handed to h2, not to it.
const MAX_HEADER_LIST: usize = 4 * 16 * 1024;
/// The dynamic table a client may use: HTTP/2's default `SETTINGS_HEADER_TABLE_SIZE`,
/// which the server never raises.
const MAX_TABLE: usize = 4096;
/// What replaces an invalid authority: what grpc-go sends on a `unix:` channel.
pub const REPLACEMENT: &str = "localhost";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Preface,
    FrameHeader,
    /// Bytes of a frame's payload still to pass through unchanged.
    Passthrough(usize),
    Failed,
}

/// A header block waiting for its CONTINUATION frames.
struct PendingBlock {
    stream: u32,
    end_stream: bool,
    fragment: Vec<u8>,
}

/// An accepted connection whose request headers are repaired on the way in.
pub struct AuthorityRepair<S> {
    io: S,
    raw: BytesMut,
    ready: BytesMut,
    state: State,
    decoder: loona_hpack::Decoder<'static>,
    pending: Option<PendingBlock>,
    repaired: bool,
}

impl<S> AuthorityRepair<S> {
    pub fn new(io: S) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(MAX_TABLE);
        Self {
            io,
            raw: BytesMut::with_capacity(MAX_FRAME),
            ready: BytesMut::new(),
            state: State::Preface,
            decoder,
            pending: None,
            repaired: false,
        }
    }

    /// Moves as much of `raw` to `ready` as complete input allows.
    fn process(&mut self) -> io::Result<()> {
        loop {
            match self.state {
                State::Failed => return Err(invalid("connection already failed".into())),
                State::Preface => {
                    if self.raw.len() < PREFACE.len() {
                        return Ok(());
                    }
                    let preface = self.raw.split_to(PREFACE.len());
                    // Not HTTP/2: hand it over as it is and let h2 say why.
                    self.state = if preface[..] == *PREFACE {
                        State::FrameHeader
                    } else {
                        State::Passthrough(usize::MAX)
                    };
                    self.ready.extend_from_slice(&preface);
                }
                State::FrameHeader => {
                    if self.raw.len() < FRAME_HEADER {
                        return Ok(());
                    }
                    let h = &self.raw[..FRAME_HEADER];
                    let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
                    let (kind, flags) = (h[3], h[4]);
                    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                    if kind != HEADERS && kind != CONTINUATION {
                        let header = self.raw.split_to(FRAME_HEADER);
                        self.ready.extend_from_slice(&header);
                        self.state = State::Passthrough(len);
                        continue;
                    }
                    if len > MAX_BLOCK {
                        // Bounded before buffering: h2 refuses such a frame anyway.
                        self.state = State::Failed;
                        return Err(invalid(format!("header frame of {len} bytes (over {MAX_BLOCK})")));
                    }
                    if self.raw.len() < FRAME_HEADER + len {
                        return Ok(());
                    }
                    self.raw.advance(FRAME_HEADER);
                    let payload = self.raw.split_to(len);
                    if let Err(e) = self.header_frame(kind, flags, stream, &payload) {
                        self.state = State::Failed;
                        tracing::warn!(error = %e, "closing a connection whose request headers cannot be read");
                        return Err(e);
                    }
                }
                State::Passthrough(left) => {
                    if left == 0 {
                        self.state = State::FrameHeader;
                        continue;
                    }
                    if self.raw.is_empty() {
                        return Ok(());
                    }
                    let n = left.min(self.raw.len());
                    let bytes = self.raw.split_to(n);
                    self.ready.extend_from_slice(&bytes);
                    self.state = State::Passthrough(left - n);
                }
            }
        }
    }

    fn header_frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> io::Result<()> {
        let fragment = if kind == HEADERS {
            if self.pending.is_some() {
                return Err(invalid("HEADERS frame while a header block awaits CONTINUATION".into()));
            }
            let mut body = payload;
            let mut padding = 0;
            if flags & PADDED != 0 {
                let (&pad, rest) =
                    body.split_first().ok_or_else(|| invalid("PADDED HEADERS frame is empty".into()))?;
                padding = usize::from(pad);
                body = rest;
            }
            if flags & PRIORITY != 0 {
                body = body
                    .get(5..)
                    .ok_or_else(|| invalid("HEADERS frame too short for its PRIORITY".into()))?;
            }
            let end = body
                .len()
                .checked_sub(padding)
                .ok_or_else(|| invalid("HEADERS padding longer than the frame".into()))?;
            self.pending =
                Some(PendingBlock { stream, end_stream: flags & END_STREAM != 0, fragment: Vec::new() });
            &body[..end]
        } else {
            match &self.pending {
                Some(p) if p.stream == stream => payload,
                _ => {
                    return Err(invalid(format!(
                        "CONTINUATION frame on stream {stream} without a header block"
                    )));
                }
            }
        };
        let pending = self.pending.as_mut().expect("set above");
        if pending.fragment.len() + fragment.len() > MAX_BLOCK {
            return Err(invalid(format!("header block over {MAX_BLOCK} bytes")));
        }
        pending.fragment.extend_from_slice(fragment);
        if flags & END_HEADERS == 0 {
            return Ok(());
        }
        let block = self.pending.take().expect("set above");
        let mut fields = self.decode(&block.fragment)?;
        for (name, value) in &mut fields {
            if name.as_slice() == b":authority" && http::uri::Authority::try_from(value.as_slice()).is_err() {
                if !self.repaired {
                    tracing::debug!(
                        authority = %String::from_utf8_lossy(value),
                        replacement = REPLACEMENT,
                        "client sent a socket path as :authority (gRPC on a unix: channel); replacing it"
                    );
                    self.repaired = true;
                }
                *value = REPLACEMENT.as_bytes().to_vec();
            }
        }
        let encoded = encode_literals(&fields);
        write_frames(&mut self.ready, block.stream, block.end_stream, &encoded);
        Ok(())
    }
}

impl<S> AuthorityRepair<S> {
    /// The block's fields, refused past `MAX_HEADER_LIST`: the rest of the block is
    /// still decoded (the table must stay in step) but nothing more is kept.
    fn decode(&mut self, block: &[u8]) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut fields = Vec::new();
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(block, |name, value| {
                size = size.saturating_add(name.len() + value.len() + 32);
                if size <= MAX_HEADER_LIST {
                    fields.push((name.into_owned(), value.into_owned()));
                }
            })
            .map_err(|e| invalid(format!("HPACK: {e}")))?;
        if size > MAX_HEADER_LIST {
            return Err(invalid(format!(
                "request header list decodes to {size} bytes (over {MAX_HEADER_LIST}, where h2 ends the connection)"
            )));
        }
        Ok(fields)
    }
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// HPACK integer with an `n`-bit prefix (RFC 7541 §5.1) after the `flags` bits.
fn put_integer(out: &mut Vec<u8>, n: u8, flags: u8, value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | max as u8);
    let mut rest = value - max;
    while rest >= 0x80 {
        out.push((rest & 0x7f) as u8 | 0x80);
        rest >>= 7;
    }
    out.push(rest as u8);
}

/// Every field as "literal header field without indexing, new name", no Huffman
/// (RFC 7541 §6.2.2): the decoder's dynamic table is never touched.
fn encode_literals(fields: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(fields.iter().map(|(n, v)| n.len() + v.len() + 8).sum());
    for (name, value) in fields {
        out.push(0x00);
        for s in [name, value] {
            put_integer(&mut out, 7, 0x00, s.len());
            out.extend_from_slice(s);
        }
    }
    out
}

/// `block` as one HEADERS frame and as many CONTINUATION frames as it needs.
fn write_frames(out: &mut BytesMut, stream: u32, end_stream: bool, block: &[u8]) {
    let mut chunks: Vec<&[u8]> = block.chunks(MAX_FRAME).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let last = chunks.len() - 1;
    for (i, chunk) in chunks.into_iter().enumerate() {
        let kind = if i == 0 { HEADERS } else { CONTINUATION };
        let mut flags = if i == last { END_HEADERS } else { 0 };
        if i == 0 && end_stream {
            flags |= END_STREAM;
        }
        let len = chunk.len();
        out.put_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
        out.put_u32(stream);
        out.put_slice(chunk);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityRepair<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.ready.is_empty() {
                let n = this.ready.len().min(buf.remaining());
                buf.put_slice(&this.ready.split_to(n));
                return Poll::Ready(Ok(()));
            }
            this.process()?;
            if !this.ready.is_empty() {
                continue;
            }
            this.raw.reserve(MAX_FRAME);
            let read = ready!(tokio_util::io::poll_read_buf(Pin::new(&mut this.io), cx, &mut this.raw))?;
            if read == 0 {
                // End of input; whatever is incomplete is h2's to notice.
                return Poll::Ready(Ok(()));
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityRepair<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for AuthorityRepair<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// The accepted connections of `listener` (as `crate::support::accept` accepts: the stream ends
/// when the listener breaks, its error kept in the [`crate::support::accept::Broken`]), each
/// wrapped in [`AuthorityRepair`].
pub fn incoming(
    listener: tokio::net::UnixListener,
    name: &'static str,
) -> (
    impl futures::Stream<Item = io::Result<AuthorityRepair<tokio::net::UnixStream>>>,
    crate::support::accept::Broken,
) {
    use futures::StreamExt as _;
    let (stream, broken) = crate::support::accept::unix_incoming(listener, name);
    (stream.map(|conn| conn.map(AuthorityRepair::new)), broken)
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt as _;

    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Splits a byte stream into (type, flags, stream, payload) frames after the preface.
    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert!(b.starts_with(PREFACE));
        b = &b[PREFACE.len()..];
        let mut out = Vec::new();
        while !b.is_empty() {
            let len = (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]);
            out.push((b[3], b[4], u32::from_be_bytes([b[5], b[6], b[7], b[8]]), b[9..9 + len].to_vec()));
            b = &b[9 + len..];
        }
        out
    }

    async fn repaired(input: Vec<u8>) -> io::Result<Vec<u8>> {
        // Delivered in 7-byte pieces: frames split across reads must still parse.
        let mut builder = tokio_test_io(input);
        let mut out = Vec::new();
        AuthorityRepair::new(&mut builder).read_to_end(&mut out).await?;
        Ok(out)
    }

    fn tokio_test_io(input: Vec<u8>) -> impl AsyncRead + Unpin {
        let chunks: Vec<Vec<u8>> = input.chunks(7).map(<[u8]>::to_vec).collect();
        let stream =
            futures::stream::iter(chunks.into_iter().map(|c| Ok::<_, io::Error>(bytes::Bytes::from(c))));
        tokio_util::io::StreamReader::new(stream)
    }

    fn request(encoder: &mut loona_hpack::Encoder<'_>, authority: &[u8]) -> Vec<u8> {
        encoder.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"),
            (b":authority", authority),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc"),
        ])
    }

    #[tokio::test]
    async fn a_socket_path_authority_becomes_localhost_and_the_rest_is_unchanged() {
        let mut enc = loona_hpack::Encoder::new();
        let path = b"tmp%2Fpod%2Fetc%2Fistio%2Fproxy%2FXDS";
        // Stream 1: one HEADERS frame, padded and with priority. Stream 3: the same
        // fields again (now indexed from the client's dynamic table), split over a
        // CONTINUATION. Between them a DATA frame and a SETTINGS frame pass untouched.
        let first = request(&mut enc, path);
        let second = request(&mut enc, path);
        assert!(second.len() < first.len(), "the client's second block uses its dynamic table");
        let mut padded = vec![3u8, 0, 0, 0, 0, 16];
        padded.extend_from_slice(&first);
        padded.extend_from_slice(&[0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100]));
        input.extend(frame(HEADERS, END_HEADERS | PADDED | PRIORITY, 1, &padded));
        input.extend(frame(0x0, END_STREAM, 1, b"grpc message bytes"));
        input.extend(frame(HEADERS, 0, 3, &second[..4]));
        input.extend(frame(CONTINUATION, END_HEADERS, 3, &second[4..]));
        let out = repaired(input).await.unwrap();

        let got = frames(&out);
        assert_eq!(got.len(), 4, "{got:?}");
        assert_eq!((got[0].0, got[0].3.clone()), (0x4, vec![0, 3, 0, 0, 0, 100]));
        assert_eq!((got[2].0, got[2].1, got[2].3.as_slice()), (0x0, END_STREAM, &b"grpc message bytes"[..]));
        let mut server = loona_hpack::Decoder::new();
        for (i, stream) in [(1usize, 1u32), (3, 3)] {
            let (kind, flags, id, block) = &got[i];
            assert_eq!((*kind, *flags, *id), (HEADERS, END_HEADERS, stream));
            let fields = server.decode(block).unwrap();
            let authority = fields.iter().find(|(n, _)| n == b":authority").unwrap();
            assert_eq!(authority.1, b"localhost");
            assert_eq!(fields.len(), 6);
            assert!(fields.contains(&(b"te".to_vec(), b"trailers".to_vec())));
        }
    }

    #[tokio::test]
    async fn a_valid_authority_is_kept_and_end_stream_survives() {
        let mut enc = loona_hpack::Encoder::new();
        let block = request(&mut enc, b"xds-grpc");
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 5, &block));
        let got = frames(&repaired(input).await.unwrap());
        assert_eq!((got[0].0, got[0].1), (HEADERS, END_HEADERS | END_STREAM));
        let fields = loona_hpack::Decoder::new().decode(&got[0].3).unwrap();
        assert!(fields.contains(&(b":authority".to_vec(), b"xds-grpc".to_vec())));
    }

    #[tokio::test]
    async fn a_large_block_is_split_into_continuations() {
        let long = vec![b'a'; 40_000];
        let mut enc = loona_hpack::Encoder::new();
        let block = enc.encode([(&b":authority"[..], &b"/a/path"[..]), (b"x-big", &long[..])]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, 0, 1, &block[..MAX_FRAME]));
        input.extend(frame(CONTINUATION, 0, 1, &block[MAX_FRAME..2 * MAX_FRAME]));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, &block[2 * MAX_FRAME..]));
        let got = frames(&repaired(input).await.unwrap());
        assert!(got.len() >= 3 && got.iter().all(|f| f.3.len() <= MAX_FRAME));
        assert_eq!(got[0].0, HEADERS);
        assert!(got[1..].iter().all(|f| f.0 == CONTINUATION));
        assert_eq!(got.iter().filter(|f| f.1 & END_HEADERS != 0).count(), 1);
        let block: Vec<u8> = got.iter().flat_map(|f| f.3.clone()).collect();
        let fields = loona_hpack::Decoder::new().decode(&block).unwrap();
        assert_eq!(fields[0], (b":authority".to_vec(), b"localhost".to_vec()));
        assert_eq!(fields[1].1.len(), 40_000);
    }

    #[tokio::test]
    async fn garbage_header_blocks_and_stray_continuations_end_the_connection() {
        for bad in [
            frame(HEADERS, END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
            frame(CONTINUATION, END_HEADERS, 1, &[0x82]),
            frame(HEADERS, END_HEADERS | PADDED, 1, &[9, 0x82]),
            frame(HEADERS, END_HEADERS | PRIORITY, 1, &[0, 0]),
            // A 2 MiB header frame announced: refused from its 9-byte header alone.
            vec![0x20, 0, 0, HEADERS, END_HEADERS, 0, 0, 0, 1],
        ] {
            let mut input = PREFACE.to_vec();
            input.extend(bad);
            let err = repaired(input).await.unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        }
    }

    /// HPACK lets a small block name a big dynamic-table entry over and over: 16,000
    /// one-byte references to a 4 KB entry decode to 64 MB. Decoding stops at the
    /// header list bound and the connection ends, naming why.
    #[tokio::test]
    async fn a_block_expanding_past_the_header_list_bound_ends_the_connection() {
        let mut block = vec![0x40, 5];
        block.extend_from_slice(b"x-big");
        put_integer(&mut block, 7, 0x00, 4000);
        block.extend(std::iter::repeat_n(b'v', 4000));
        // Index 62: the first entry of the dynamic table, the one just added.
        block.extend(std::iter::repeat_n(0x80 | 62, 16_000));
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, 0, 1, &block[..MAX_FRAME]));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, &block[MAX_FRAME..]));
        let err = repaired(input).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        assert!(err.to_string().contains("header list"), "{err}");
    }

    /// The dynamic table is bounded by what the server allows (4096 bytes, HTTP/2's
    /// default): a client raising it is refused, as h2 would refuse it.
    #[tokio::test]
    async fn a_table_size_update_over_the_default_ends_the_connection() {
        let mut block = Vec::new();
        put_integer(&mut block, 5, 0x20, 1 << 20);
        block.push(0x82);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &block));
        let err = repaired(input).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
    }

    #[tokio::test]
    async fn not_http2_passes_through_for_h2_to_refuse() {
        let input = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n and more bytes".to_vec();
        assert_eq!(repaired(input.clone()).await.unwrap(), input);
    }
}
