//! One ztunnel connection, from hello to close: read the hello, send the snapshot (each
//! cached pod as Add with its netns fd, or Keep; then `SnapshotSent`), then send queued
//! updates one at a time, each waiting for its ack, while watching the idle socket for
//! EOF or stray data. One task per connection is its only writer, so an ack always
//! answers the one message in flight. Every way it ends is a [`ConnError`] (or a clean
//! end), which names the reason for the log.

use std::time::Duration;

use nix::errno::Errno;
use tokio::sync::mpsc;

use super::{
    ZdsError,
    codec::{self, DecodeError, SnapshotPhase},
    pods::{CachedPod, PodCache},
    registry::{ConnId, Registry, Request, Update},
    wire::{Datagram, Seqpacket},
};

/// The receive buffer: larger than anything ztunnel sends (a nack carries its error
/// text), so a truncated datagram is a broken peer.
const RECV_BUFFER: usize = 64 * 1024;

/// Why a connection ended badly.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConnError {
    #[error("ztunnel sent no hello within {0:?}")]
    HelloTimeout(Duration),
    #[error("no ack for {message} within {deadline:?}")]
    AckTimeout { message: &'static str, deadline: Duration },
    #[error("could not write {message} within {deadline:?} (ztunnel is not reading)")]
    WriteTimeout { message: &'static str, deadline: Duration },
    #[error("send {message} to ztunnel")]
    Send {
        message: &'static str,
        #[source]
        source: Errno,
    },
    #[error("receive from ztunnel")]
    Recv(#[source] Errno),
    #[error("ztunnel closed the connection while {while_}")]
    Closed { while_: &'static str },
    #[error("ztunnel sent a datagram over {RECV_BUFFER} bytes (truncated)")]
    Truncated,
    #[error("ztunnel sent {count} file descriptor(s) (it never sends any); closed them")]
    UnexpectedFd { count: usize },
    #[error("ztunnel sent ancillary data that did not fit (control message truncated)")]
    ControlTruncated,
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("protocol error: ztunnel sent a {len}-byte message unprompted")]
    Unprompted { len: usize },
}

impl ConnError {
    /// A short name for the reason, for the log's `reason` field.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::HelloTimeout(_) => "hello_timeout",
            Self::AckTimeout { .. } => "ack_timeout",
            Self::WriteTimeout { .. } => "write_timeout",
            Self::Send { .. } => "send_failed",
            Self::Recv(_) => "recv_failed",
            Self::Closed { .. } => "peer_closed",
            Self::Truncated => "truncated_datagram",
            Self::UnexpectedFd { .. } => "unexpected_fd",
            Self::ControlTruncated => "truncated_control_message",
            Self::Decode(DecodeError::Undecodable { .. }) => "undecodable_message",
            Self::Decode(DecodeError::NoAck { .. }) => "response_without_ack",
            Self::Unprompted { .. } => "unprompted_message",
        }
    }
}

/// How a connection ended well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// ztunnel closed it while idle.
    PeerClosed,
    /// Its queue was closed (the server dropped it).
    Unregistered,
}

/// One connection's socket, deadline and number.
pub(super) struct Conn {
    sock: Seqpacket,
    id: ConnId,
    deadline: Duration,
    buf: Vec<u8>,
}

impl Conn {
    pub fn new(sock: Seqpacket, id: ConnId, deadline: Duration) -> Self {
        Self { sock, id, deadline, buf: vec![0; RECV_BUFFER] }
    }

    /// Serves the connection: hello, snapshot, then `updates` until it ends.
    pub async fn serve(
        mut self,
        pods: &PodCache,
        registry: &Registry,
        mut updates: mpsc::Receiver<Request>,
    ) -> Result<Ended, ConnError> {
        let version = self.read_hello().await?;
        tracing::info!(version = %codec::version_name(version), "received hello from ztunnel");
        self.send_snapshot(pods).await?;
        registry.mark_synced(self.id);
        loop {
            tokio::select! {
                request = updates.recv() => match request {
                    Some(request) => self.send_update(request).await?,
                    None => return Ok(Ended::Unregistered),
                },
                received = self.sock.recv(&mut self.buf) => {
                    let datagram = received.map_err(ConnError::Recv)?;
                    if datagram.eof {
                        return Ok(Ended::PeerClosed);
                    }
                    check(&datagram)?;
                    return Err(ConnError::Unprompted { len: datagram.len });
                }
            }
        }
    }

    async fn read_hello(&mut self) -> Result<i32, ConnError> {
        let datagram = tokio::time::timeout(self.deadline, self.sock.recv(&mut self.buf))
            .await
            .map_err(|_| ConnError::HelloTimeout(self.deadline))?
            .map_err(ConnError::Recv)?;
        if datagram.eof {
            return Err(ConnError::Closed { while_: "the agent waited for its hello" });
        }
        check(&datagram)?;
        Ok(codec::hello(&self.buf[..datagram.len])?)
    }

    /// Every cached pod as Add (with its netns) or Keep, then `SnapshotSent`. A nack is
    /// logged and the snapshot goes on.
    async fn send_snapshot(&mut self, pods: &PodCache) -> Result<(), ConnError> {
        let phase = SnapshotPhase::begin();
        let snapshot = pods.snapshot();
        tracing::info!(pods = snapshot.len(), "sending the pod snapshot to ztunnel");
        for (uid, pod) in snapshot {
            let (message, encoded, netns) = match &pod {
                CachedPod::Enrolled { info, netns } => ("Add", codec::add(&uid, info), Some(netns)),
                CachedPod::NetnsUnknown => ("Keep", codec::keep(&phase, &uid), None),
            };
            let pod_name = match &pod {
                CachedPod::Enrolled { info, .. } => info.pod(),
                CachedPod::NetnsUnknown => String::new(),
            };
            let bytes = match encoded {
                Ok(bytes) => bytes,
                Err(e) => {
                    tracing::error!(uid, pod = pod_name, error = %e, "pod left out of the snapshot");
                    continue;
                }
            };
            tracing::debug!(uid, pod = pod_name, message, "snapshot: sending");
            let nack = self.exchange(message, &bytes, netns.map(|n| n.fd())).await?;
            if let Some(error) = nack {
                tracing::warn!(
                    uid,
                    pod = pod_name,
                    message,
                    error,
                    "snapshot: ztunnel answered with an error"
                );
            }
        }
        let nack = self.exchange("SnapshotSent", &codec::snapshot_sent(phase), None).await?;
        if let Some(error) = nack {
            tracing::warn!(error, "snapshot: ztunnel answered SnapshotSent with an error");
        }
        tracing::info!("snapshot acked by ztunnel");
        Ok(())
    }

    /// Sends one update and gives its requester the outcome. A nack is the requester's
    /// error and the connection goes on; a failed write or ack closes the connection
    /// (acks are matched by order only: after a missed one, nothing can be trusted).
    async fn send_update(&mut self, request: Request) -> Result<(), ConnError> {
        let Request { update, reply } = request;
        let (message, uid) = (update.message(), update.uid().to_string());
        let (encoded, pod) = match &update {
            Update::Add { uid, info, .. } => (codec::add(uid, info), info.pod()),
            Update::Del { uid } => (codec::del(uid), String::new()),
        };
        let bytes = match encoded {
            Ok(bytes) => bytes,
            Err(e) => {
                let _ = reply.send(Err(e));
                return Ok(());
            }
        };
        let netns = match &update {
            Update::Add { netns, .. } => Some(netns.fd()),
            Update::Del { .. } => None,
        };
        let outcome = self.exchange(message, &bytes, netns).await;
        let (answer, result) = match outcome {
            Ok(None) => {
                tracing::info!(uid, pod, message, "ztunnel acked");
                (Ok(()), Ok(()))
            }
            Ok(Some(error)) => {
                tracing::warn!(uid, pod, message, error, "ztunnel answered with an error");
                (Err(ZdsError::Nack { message, uid, conn: self.id, error }), Ok(()))
            }
            Err(e) => (Err(ZdsError::Connection { message, uid, conn: self.id, source: e.clone() }), Err(e)),
        };
        let _ = reply.send(answer);
        result
    }

    /// Sends one message (with `fd`) and reads its answer: `Ok(None)` ack, `Ok(Some)`
    /// nack.
    async fn exchange(
        &mut self,
        message: &'static str,
        bytes: &[u8],
        fd: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<Option<String>, ConnError> {
        let deadline = self.deadline;
        tokio::time::timeout(deadline, self.sock.send(bytes, fd))
            .await
            .map_err(|_| ConnError::WriteTimeout { message, deadline })?
            .map_err(|source| ConnError::Send { message, source })?;
        let datagram = tokio::time::timeout(deadline, self.sock.recv(&mut self.buf))
            .await
            .map_err(|_| ConnError::AckTimeout { message, deadline })?
            .map_err(ConnError::Recv)?;
        if datagram.eof {
            return Err(ConnError::Closed { while_: "the agent waited for an ack" });
        }
        check(&datagram)?;
        Ok(codec::ack(&self.buf[..datagram.len])?)
    }
}

/// What no datagram from ztunnel may have: descriptors (closed here), truncation.
fn check(datagram: &Datagram) -> Result<(), ConnError> {
    if !datagram.fds.is_empty() {
        return Err(ConnError::UnexpectedFd { count: datagram.fds.len() });
    }
    if datagram.control_truncated {
        return Err(ConnError::ControlTruncated);
    }
    if datagram.truncated {
        return Err(ConnError::Truncated);
    }
    Ok(())
}
