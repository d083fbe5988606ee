//! Forwarding to the pod's resolv.conf servers: one exchange over UDP or TCP with a
//! deadline and a reply-id check ([`ask`]), into reply buffers that are reused
//! ([`Buffers`]) rather than allocated per query.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use hickory_proto::op::Message;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpStream, UdpSocket},
};

/// The largest DNS message (TCP's two-byte length).
pub(super) const MAX_TCP: usize = 65535;

/// One upstream exchange, the reply read into `buf`; `None` (logged) on failure,
/// timeout or a mismatched reply.
pub(super) async fn ask(
    server: SocketAddr,
    raw: &[u8],
    tcp: bool,
    timeout: Duration,
    id: u16,
    buf: &mut Vec<u8>,
) -> Option<Message> {
    match tokio::time::timeout(timeout, exchange(server, raw, tcp, buf)).await {
        Ok(Ok(n)) => match Message::from_vec(&buf[..n]) {
            Ok(m) if m.metadata.id == id => return Some(m),
            Ok(_) => tracing::info!(%server, "upstream DNS reply with a different id"),
            Err(e) => tracing::info!(%server, error = %e, "upstream DNS reply does not parse"),
        },
        Ok(Err(e)) => tracing::info!(%server, error = %e, "upstream failure"),
        Err(_) => tracing::info!(%server, "upstream DNS timeout"),
    }
    None
}

/// Sends `query` to `server` and reads its reply into `buf` (resized as needed);
/// returns the reply's length.
async fn exchange(server: SocketAddr, query: &[u8], tcp: bool, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    if tcp {
        let mut s = TcpStream::connect(server).await?;
        let len = u16::try_from(query.len()).map_err(|_| std::io::Error::other("query over 64 KiB"))?;
        s.write_all(&len.to_be_bytes()).await?;
        s.write_all(query).await?;
        let mut len = [0u8; 2];
        s.read_exact(&mut len).await?;
        let n = usize::from(u16::from_be_bytes(len));
        buf.resize(n, 0);
        s.read_exact(buf).await?;
        Ok(n)
    } else {
        let bind: SocketAddr = if server.is_ipv4() {
            "0.0.0.0:0".parse().expect("addr")
        } else {
            "[::]:0".parse().expect("addr")
        };
        let s = UdpSocket::bind(bind).await?;
        s.connect(server).await?;
        s.send(query).await?;
        // Into the buffer's spare capacity: only what the reply fills is touched.
        buf.clear();
        buf.reserve(MAX_TCP);
        s.recv_buf(buf).await
    }
}

/// Reply buffers for upstream exchanges, reused: at most `KEPT` wait for the next
/// forward (the rest of those in use are freed when done).
#[derive(Default)]
pub(super) struct Buffers {
    free: std::sync::Mutex<Vec<Vec<u8>>>,
}

/// A buffer from [`Buffers`], back in the pool when dropped.
pub(super) struct Buffer {
    buf: Vec<u8>,
    pool: Arc<Buffers>,
}

impl Buffers {
    const KEPT: usize = 16;

    pub(super) fn take(self: &Arc<Self>) -> Buffer {
        let buf = self.free.lock().expect("buffer pool lock").pop().unwrap_or_default();
        Buffer { buf, pool: self.clone() }
    }
}

impl std::ops::Deref for Buffer {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.buf
    }
}

impl std::ops::DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock().expect("buffer pool lock");
        if free.len() < Buffers::KEPT {
            free.push(std::mem::take(&mut self.buf));
        }
    }
}
