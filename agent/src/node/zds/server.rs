//! The ZDS server: binds the socket, accepts ztunnel connections (rate-limited), and
//! runs each on its own task in the span `ztunnel{conn=..}`, registered from accept
//! until it ends; the reason it ended is logged. Stopping closes every connection
//! (ztunnel reconnects to the next agent) and removes the socket file.

use std::{os::fd::AsFd as _, path::Path, sync::Arc};

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::{
    ZdsConfig, ZdsError,
    conn::{Conn, Ended},
    handle::{Shared, ZdsHandle},
    wire::{Listener, Seqpacket},
};

/// A bound ZDS socket, ready to [`run`](ZdsServer::run).
#[derive(Debug)]
pub struct ZdsServer {
    listener: Listener,
    shared: Arc<Shared>,
}

impl ZdsServer {
    /// Binds `path` with the default [`ZdsConfig`].
    pub fn bind(path: impl AsRef<Path>) -> Result<Self, ZdsError> {
        Self::bind_with(path, ZdsConfig::default())
    }

    /// Binds `path`: a missing directory is created (`0750`), a socket file an earlier
    /// agent left is removed, anything else at the path is refused.
    pub fn bind_with(path: impl AsRef<Path>, config: ZdsConfig) -> Result<Self, ZdsError> {
        let listener = Listener::bind(path.as_ref())?;
        tracing::info!(path = %path.as_ref().display(), "ZDS server listening for ztunnel");
        let shared = Shared { config, ..Shared::default() };
        Ok(Self { listener, shared: Arc::new(shared) })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        self.listener.path()
    }

    /// A handle for the agent.
    pub fn handle(&self) -> ZdsHandle {
        ZdsHandle { shared: self.shared.clone() }
    }

    /// Accepts and serves ztunnel connections until `stop` is cancelled (then `Ok`) or
    /// the listener breaks.
    pub async fn run(self, stop: CancellationToken) -> Result<(), ZdsError> {
        let mut connections = JoinSet::new();
        let connections_stop = stop.child_token();
        let result = self.accept_loop(&connections_stop, &mut connections).await;
        connections_stop.cancel();
        while connections.join_next().await.is_some() {}
        self.listener.remove_file();
        result
    }

    async fn accept_loop(
        &self,
        stop: &CancellationToken,
        connections: &mut JoinSet<()>,
    ) -> Result<(), ZdsError> {
        loop {
            let accepted = tokio::select! {
                () = stop.cancelled() => return Ok(()),
                accepted = crate::support::accept::next("zds", || self.listener.accept()) => accepted,
            };
            let sock =
                accepted.map_err(|source| ZdsError::Accept { path: self.listener.path().into(), source })?;
            // Only ztunnel is sent pods and their namespaces: another peer is closed at once.
            match crate::node::local_socket::check_peer(sock.as_fd(), &self.shared.config.peer_uids, "ZDS") {
                Ok(_) => {
                    connections.spawn(serve(sock, self.shared.clone(), stop.child_token()));
                }
                Err(why) => tracing::warn!(reason = %why, "a ZDS connection refused"),
            }
            while connections.try_join_next().is_some() {}
            // At most one accept per interval: a ztunnel reconnecting in a loop costs
            // little.
            tokio::select! {
                () = stop.cancelled() => return Ok(()),
                () = tokio::time::sleep(self.shared.config.accept_interval) => {}
            }
        }
    }
}

/// One connection, registered while it lives; logs why it ended.
async fn serve(sock: Seqpacket, shared: Arc<Shared>, stop: CancellationToken) {
    let (entry, updates) = shared.registry.register(shared.config.queue);
    let span = tracing::info_span!("ztunnel", conn = entry.id);
    let conn = Conn::new(sock, entry.id, shared.config.deadline);
    let ended = async {
        tokio::select! {
            ended = conn.serve(&shared.pods, &shared.registry, updates) => Some(ended),
            () = stop.cancelled() => None,
        }
    }
    .instrument(span.clone())
    .await;
    shared.registry.remove(&entry);
    let _enter = span.enter();
    match ended {
        Some(Ok(Ended::PeerClosed)) => {
            tracing::info!(reason = "peer_closed", "ztunnel closed the connection")
        }
        Some(Ok(Ended::Unregistered)) => {
            tracing::info!(reason = "unregistered", "ztunnel connection dropped")
        }
        None => {
            tracing::info!(reason = "agent_stopping", "closed the ztunnel connection: the agent is stopping")
        }
        Some(Err(e)) => tracing::warn!(
            reason = e.reason(),
            error = %crate::error_chain(&e),
            "closed the ztunnel connection"
        ),
    }
}
