//! Readiness as pilot-agent's probe decides it: Envoy has accepted at least one CDS
//! and one LDS update (with distinct messages for "nothing received" and "rejected"),
//! and it is LIVE with its workers started and no listener still warming (one waits
//! there for a secret or route it cannot get: an SDS socket Envoy's user cannot reach
//! keeps the inbound listener warming, and the pod must not look ready); both are
//! cached once true, as pilot-agent caches them. After SIGTERM the answer is
//! "draining".

use std::sync::atomic::{AtomicBool, Ordering};

use super::admin::EnvoyAdmin;

const CDS_SUCCESS: &str = "cluster_manager.cds.update_success";
const CDS_REJECTED: &str = "cluster_manager.cds.update_rejected";
const LDS_SUCCESS: &str = "listener_manager.lds.update_success";
const LDS_REJECTED: &str = "listener_manager.lds.update_rejected";
const SERVER_STATE: &str = "server.state";
const WORKERS_STARTED: &str = "listener_manager.workers_started";
const LISTENERS_WARMING: &str = "listener_manager.total_listeners_warming";

/// Shared by the status server and the lifecycle.
pub struct Readiness {
    /// `None`: no Envoy (`DISABLE_ENVOY`): ready while not draining.
    admin: Option<EnvoyAdmin>,
    config_received: AtomicBool,
    envoy_ready: AtomicBool,
    draining: AtomicBool,
}

impl Readiness {
    pub fn new(admin: Option<EnvoyAdmin>) -> Self {
        Self {
            admin,
            config_received: AtomicBool::new(false),
            envoy_ready: AtomicBool::new(false),
            draining: AtomicBool::new(false),
        }
    }

    /// From now on, not ready.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// A new Envoy (restarted): its config and state are checked afresh.
    pub fn reset(&self) {
        self.config_received.store(false, Ordering::SeqCst);
        self.envoy_ready.store(false, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// `Ok` when ready; otherwise why not, in words for `kubectl describe`.
    pub async fn check(&self) -> Result<(), String> {
        if self.is_draining() {
            return Err("the proxy is draining (termination in progress)".into());
        }
        let Some(admin) = self.admin else { return Ok(()) };
        let admin_error = |e: super::admin::AdminError| format!("Envoy admin: {}", crate::error_chain(&e));
        if !self.config_received.load(Ordering::SeqCst) {
            let s = admin
                .stats_named(&[CDS_SUCCESS, CDS_REJECTED, LDS_SUCCESS, LDS_REJECTED])
                .await
                .map_err(admin_error)?;
            let summary = format!(
                "cds updates: {} successful, {} rejected; lds updates: {} successful, {} rejected",
                s[CDS_SUCCESS], s[CDS_REJECTED], s[LDS_SUCCESS], s[LDS_REJECTED]
            );
            match (s[CDS_SUCCESS] > 0, s[LDS_SUCCESS] > 0) {
                (true, true) => self.config_received.store(true, Ordering::SeqCst),
                (false, false) if s[CDS_REJECTED] + s[LDS_REJECTED] == 0 => {
                    return Err(format!(
                        "config not received from XDS server (is Istiod running?): {summary}"
                    ));
                }
                _ if s[CDS_REJECTED] + s[LDS_REJECTED] > 0 => {
                    return Err(format!("config received from XDS server, but was rejected: {summary}"));
                }
                _ => return Err(format!("config not fully received from XDS server: {summary}")),
            }
        }
        if !self.envoy_ready.load(Ordering::SeqCst) {
            let s = admin
                .stats_named(&[SERVER_STATE, WORKERS_STARTED, LISTENERS_WARMING])
                .await
                .map_err(admin_error)?;
            // server.state: 0 LIVE, 1 DRAINING, 2 PRE_INITIALIZING, 3 INITIALIZING.
            if s[SERVER_STATE] != 0 || s[WORKERS_STARTED] != 1 {
                return Err(format!(
                    "Envoy is not ready: server.state {} (0 is LIVE), workers started {}",
                    s[SERVER_STATE], s[WORKERS_STARTED]
                ));
            }
            if s[LISTENERS_WARMING] > 0 {
                return Err(format!(
                    "Envoy is not ready: {} listeners still warming (waiting for a secret or route)",
                    s[LISTENERS_WARMING]
                ));
            }
            self.envoy_ready.store(true, Ordering::SeqCst);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// An Envoy admin stand-in answering `/stats` with `stats`, whatever the filter.
    async fn fake_admin(stats: Arc<Mutex<String>>) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let body = stats.lock().unwrap().clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = conn.read(&mut buf).await;
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = conn.write_all(reply.as_bytes()).await;
                });
            }
        });
        port
    }

    #[tokio::test]
    async fn a_warming_listener_keeps_envoy_unready() {
        let config = "cluster_manager.cds.update_success: 1\nlistener_manager.lds.update_success: 1\n";
        let live = "server.state: 0\nlistener_manager.workers_started: 1\n";
        let stats =
            Arc::new(Mutex::new(format!("{config}{live}listener_manager.total_listeners_warming: 1\n")));
        let readiness = Readiness::new(Some(EnvoyAdmin::new(fake_admin(stats.clone()).await)));
        let e = readiness.check().await.unwrap_err();
        assert!(e.contains("1 listeners still warming"), "{e}");
        *stats.lock().unwrap() = format!("{config}{live}listener_manager.total_listeners_warming: 0\n");
        readiness.check().await.unwrap();
    }
}
