//! The set of ztunnel connections, in arrival order: the newest gets Adds, all get Dels.
//! Each connection is reached through its queue of requests and a `closed` token; a
//! request waits for its answer or for `closed`, whichever comes first. The set's lock
//! is held only to change or copy the list, never while a request waits, so a delete
//! stuck on a dying connection cannot keep a new ztunnel from registering.

use std::sync::{
    Mutex, MutexGuard,
    atomic::{AtomicU64, Ordering},
};

use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::{WorkloadInfo, ZdsError, ZdsStatus, pods::Netns};

/// A number per ztunnel connection, in the order they came, for logs.
pub type ConnId = u64;

/// An update for one connection to send after its snapshot.
#[derive(Debug)]
pub(super) enum Update {
    Add { uid: String, info: WorkloadInfo, netns: Netns },
    Del { uid: String },
}

impl Update {
    pub fn uid(&self) -> &str {
        match self {
            Self::Add { uid, .. } | Self::Del { uid } => uid,
        }
    }

    pub fn message(&self) -> &'static str {
        match self {
            Self::Add { .. } => "Add",
            Self::Del { .. } => "Del",
        }
    }
}

/// An update and where its outcome goes.
#[derive(Debug)]
pub(super) struct Request {
    pub update: Update,
    pub reply: oneshot::Sender<Result<(), ZdsError>>,
}

/// One registered connection, as requesters see it.
#[derive(Debug, Clone)]
pub(super) struct ConnEntry {
    pub id: ConnId,
    tx: mpsc::Sender<Request>,
    closed: CancellationToken,
}

impl ConnEntry {
    /// Queues `update` on this connection and waits for ztunnel's answer; gives up as
    /// soon as the connection is closed.
    pub async fn send(&self, update: Update) -> Result<(), ZdsError> {
        let (message, uid) = (update.message(), update.uid().to_string());
        let closed = || ZdsError::ConnectionClosed { message, uid: uid.clone(), conn: self.id };
        let (reply, answer) = oneshot::channel();
        // Biased: an answer given before the connection closed is the answer.
        tokio::select! {
            biased;
            sent = self.tx.send(Request { update, reply }) => sent.map_err(|_| closed())?,
            () = self.closed.cancelled() => return Err(closed()),
        }
        tokio::select! {
            biased;
            answer = answer => answer.map_err(|_| closed())?,
            () = self.closed.cancelled() => Err(closed()),
        }
    }
}

#[derive(Debug, Default)]
struct Conns {
    /// Oldest first.
    list: Vec<ConnEntry>,
    synced: Vec<ConnId>,
}

/// The registered connections and the status they add up to.
#[derive(Debug)]
pub(super) struct Registry {
    conns: Mutex<Conns>,
    next: AtomicU64,
    status: watch::Sender<ZdsStatus>,
}

impl Default for Registry {
    fn default() -> Self {
        Self {
            conns: Mutex::default(),
            next: AtomicU64::new(1),
            status: watch::Sender::new(ZdsStatus::default()),
        }
    }
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn publish(&self, conns: &Conns) {
        let status = ZdsStatus { connections: conns.list.len(), synced: conns.synced.len() };
        crate::node::metrics::ztunnel_connected(status.connections);
        self.status.send_replace(status);
    }

    /// Registers a new connection as the newest, with a queue of `queue` requests.
    pub fn register(&self, queue: usize) -> (ConnEntry, mpsc::Receiver<Request>) {
        let (tx, rx) = mpsc::channel(queue.max(1));
        let entry =
            ConnEntry { id: self.next.fetch_add(1, Ordering::Relaxed), tx, closed: CancellationToken::new() };
        let mut conns = self.lock();
        conns.list.push(entry.clone());
        self.publish(&conns);
        tracing::info!(conn = entry.id, connected = conns.list.len(), "ztunnel connected");
        (entry, rx)
    }

    /// Marks a connection's snapshot as acked.
    pub fn mark_synced(&self, id: ConnId) {
        let mut conns = self.lock();
        if conns.list.iter().any(|c| c.id == id) && !conns.synced.contains(&id) {
            conns.synced.push(id);
            self.publish(&conns);
        }
    }

    /// Removes a connection: its requesters are released first (`closed`), then it
    /// leaves the list.
    pub fn remove(&self, entry: &ConnEntry) {
        entry.closed.cancel();
        let mut conns = self.lock();
        conns.list.retain(|c| c.id != entry.id);
        conns.synced.retain(|id| *id != entry.id);
        self.publish(&conns);
        tracing::info!(conn = entry.id, connected = conns.list.len(), "ztunnel disconnected");
    }

    /// The newest connection.
    pub fn latest(&self) -> Option<ConnEntry> {
        self.lock().list.last().cloned()
    }

    /// Every connection, oldest first (a copy: nothing is locked while it is used).
    pub fn all(&self) -> Vec<ConnEntry> {
        self.lock().list.clone()
    }

    pub fn status(&self) -> ZdsStatus {
        *self.status.borrow()
    }

    pub fn watch(&self) -> watch::Receiver<ZdsStatus> {
        self.status.subscribe()
    }
}
