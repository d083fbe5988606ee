//! ZDS, the node agent's server side of the ztunnel protocol (Istio's ambient mode): the
//! agent tells the node's ztunnel which pods to proxy, handing over each pod's network
//! namespace so ztunnel can open its listeners inside it.
//!
//! # The protocol (`istio.workload.zds`, `proto/protos/istio/workload/zds/zds.proto`)
//! - The agent listens on an `AF_UNIX` `SOCK_SEQPACKET` socket, by default
//!   [`DEFAULT_SOCKET`] (ztunnel's `INPOD_UDS`); ztunnel connects. One protobuf message
//!   per datagram, no framing; every datagram the agent sends is at most
//!   [`MAX_MESSAGE_BYTES`] (ztunnel reads into a 1024-byte buffer and drops the
//!   connection on truncation), so a larger message is refused with
//!   [`ZdsError::MessageTooLarge`] before anything is cached or sent.
//! - ztunnel sends `ZdsHello` (read within the deadline; its version is logged, not
//!   checked, as Istio does). The agent then sends the **snapshot**: for every cached pod
//!   an `AddWorkload{uid, workload_info}` carrying the pod's netns fd (one `SCM_RIGHTS`
//!   message in the same `sendmsg`), or `KeepWorkload{uid}` with no fd for a pod known
//!   without a netns ([`ZdsHandle::keep_pod`]); then `SnapshotSent`. Each message waits
//!   for its `Ack` before the next; a nack during the snapshot is logged and the
//!   snapshot goes on.
//! - Then updates, one at a time, one ack each: Add goes to the **newest** connection,
//!   Del to **every** connection, oldest first. Acks carry no id, so each connection has
//!   one writer and one message in flight.
//! - ztunnel exits on three messages: an Add without `workload_info`, a Keep after
//!   `SnapshotSent`, a second `SnapshotSent`. None can be expressed here: the encoder
//!   always sets `workload_info`, and Keep and `SnapshotSent` can only be encoded with a
//!   `SnapshotPhase`, which `SnapshotSent` consumes and which only a
//!   connection's snapshot makes.
//!
//! # Connections
//! Connections are kept in arrival order and registered before their hello (as Istio
//! does), so a pod added while a new ztunnel takes its snapshot reaches it either in the
//! snapshot or as an Add right after (ztunnel treats the second as a no-op). When the
//! newest ztunnel disconnects during a rollout, the previous one is newest again. An
//! idle connection is watched for readability: EOF (ztunnel gone) closes it at once,
//! and a message ztunnel sends unprompted is a protocol error that closes it. Accepts
//! are rate-limited (5 a second, burst 1, as Istio) against a ztunnel that reconnects in
//! a loop. At bind, a socket file left at the path is removed (anything else there is
//! refused, [`ZdsError::NotASocket`]), and a missing directory is created `0750`.
//!
//! # Deliberate deviations from Istio's server (`cni/pkg/nodeagent/ztunnelserver*.go`)
//! - **A failed update closes the connection.** Istio keeps a connection whose ack
//!   timed out or could not be read; since acks are matched by order, a late ack would
//!   then be taken for the next message's. Weir closes it instead: ztunnel reconnects
//!   and gets a full snapshot, which is harmless (an Add with the same netns is a
//!   no-op). A nack (an ack with an error) keeps the connection, as in Istio.
//! - **Dead peers are noticed at once**, by watching the idle socket, rather than by a
//!   10 ms read every 5 s. The outcomes are Istio's.
//! - **Bad input names itself.** A datagram that does not decode, is truncated, or
//!   carries file descriptors (ztunnel never sends any; they are closed) closes that
//!   connection with a log naming the reason ([`ConnError::reason`]); a netns fd that
//!   is not a network namespace is refused ([`ZdsError::NotANetns`]).
//!
//! # API
//! ```no_run
//! # async fn example(netns: std::os::fd::OwnedFd) -> Result<(), weir_agent::node::zds::ZdsError> {
//! use weir_agent::node::zds::{WorkloadInfo, ZdsServer, DEFAULT_SOCKET};
//! let server = ZdsServer::bind(DEFAULT_SOCKET)?;
//! let zds = server.handle();
//! let stop = tokio_util::sync::CancellationToken::new();
//! tokio::spawn(server.run(stop.clone()));
//! let info = WorkloadInfo { name: "web-0".into(), namespace: "shop".into(), service_account: "web".into() };
//! // Cached, then sent to the newest ztunnel; Ok once it acked. With no ztunnel
//! // connected: Err(NoZtunnel), and the pod goes out with the next snapshot.
//! zds.add_pod("3f9c...", info, netns).await?;
//! assert!(zds.connected());
//! zds.del_pod("3f9c...").await?; // uncached, Del to every ztunnel
//! # Ok(()) }
//! ```
//! - [`ZdsServer::bind`] / [`ZdsServer::bind_with`] ([`ZdsConfig`]: the deadline for
//!   hello, writes and acks, 5 s; the accept interval; the queue per connection),
//!   [`ZdsServer::handle`], [`ZdsServer::run`] until the token is cancelled (then every
//!   connection is closed and the socket file removed).
//! - [`ZdsHandle::add_pod`], [`ZdsHandle::keep_pod`] (Istio's `Ensure`: known, netns
//!   not found: Keep in snapshots), [`ZdsHandle::del_pod`], [`ZdsHandle::pods`];
//!   [`ZdsHandle::status`] / [`ZdsHandle::watch`] ([`ZdsStatus`]: connections, as
//!   Istio's `ztunnel_connected` gauge, and how many have acked their snapshot) and
//!   [`ZdsHandle::connected`] for readiness.
//!
//! Logs carry `uid` and `pod` (`namespace/name`) for a pod and `conn` (a number per
//! ztunnel connection, in the span `ztunnel{conn=..}`) for a connection.

mod codec;
mod conn;
mod handle;
mod pods;
mod registry;
mod server;
mod wire;

#[cfg(test)]
mod tests;
/// The fake ztunnel, for tests of what drives ZDS (the ambient agent's snapshot).
#[cfg(test)]
pub(crate) use tests::fake;

use std::{path::PathBuf, time::Duration};

pub use codec::DecodeError;
pub use conn::ConnError;
pub use handle::ZdsHandle;
pub use registry::ConnId;
pub use server::ZdsServer;

/// Where Istio's node agent serves ZDS, and where ztunnel looks (`INPOD_UDS`).
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

/// The largest datagram the agent sends: ztunnel's receive buffer.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// What ztunnel learns of a pod besides its uid; it ties the pod to a workload by
/// (namespace, service account, name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkloadInfo {
    pub name: String,
    pub namespace: String,
    pub service_account: String,
}

impl WorkloadInfo {
    /// `namespace/name`, as logs name a pod.
    pub fn pod(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The server's timing and sizes.
#[derive(Debug, Clone)]
pub struct ZdsConfig {
    /// For ztunnel's hello, each write, and each ack (Istio's `readWriteDeadline`).
    pub deadline: Duration,
    /// The least time between two accepts (Istio: 5 a second, burst 1).
    pub accept_interval: Duration,
    /// Updates queued per connection (Istio's channel of 100).
    pub queue: usize,
    /// The uids ztunnel may connect as (`WEIR_ZTUNNEL_UIDS`; ztunnel's chart runs it as
    /// root): any other peer is closed before it is sent a pod.
    pub peer_uids: Vec<u32>,
}

impl Default for ZdsConfig {
    fn default() -> Self {
        Self {
            deadline: Duration::from_secs(5),
            accept_interval: Duration::from_millis(200),
            queue: 100,
            peer_uids: vec![0],
        }
    }
}

/// How many ztunnels are connected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZdsStatus {
    /// Registered connections (from accept until closed), as Istio's
    /// `ztunnel_connected` gauge.
    pub connections: usize,
    /// Connections whose `SnapshotSent` was acked: ztunnels that hold the pod set.
    pub synced: usize,
}

/// What went wrong serving ZDS or handling one pod.
#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    #[error("no ztunnel connection: pod {uid} is cached and goes out with the next snapshot")]
    NoZtunnel { uid: String },
    #[error("pod uid is empty")]
    EmptyUid,
    #[error("{message} for pod {uid} encodes to {size} bytes, over ztunnel's {limit}-byte datagram")]
    MessageTooLarge { message: &'static str, uid: String, size: usize, limit: usize },
    #[error("netns fd for pod {uid} is not a network namespace: {problem}")]
    NotANetns { uid: String, problem: String },
    #[error("got ack error from ztunnel (conn {conn}) for {message} of pod {uid}: {error}")]
    Nack { message: &'static str, uid: String, conn: ConnId, error: String },
    #[error("{message} of pod {uid} failed on ztunnel connection {conn}, which was closed")]
    Connection {
        message: &'static str,
        uid: String,
        conn: ConnId,
        #[source]
        source: ConnError,
    },
    #[error("ztunnel connection {conn} closed before it answered {message} of pod {uid}")]
    ConnectionClosed { message: &'static str, uid: String, conn: ConnId },
    #[error("delete of pod {uid} failed on {} ztunnel connection(s): {}", errors.len(), join(errors))]
    DelIncomplete { uid: String, errors: Vec<ZdsError> },
    #[error("{path} exists and is {found}, not a socket: refusing to replace it")]
    NotASocket { path: PathBuf, found: &'static str },
    #[error("{what} {path}")]
    Socket {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("accept a ztunnel connection on {path}")]
    Accept {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn join(errors: &[ZdsError]) -> String {
    errors.iter().map(|e| crate::error_chain(e)).collect::<Vec<_>>().join("; ")
}
