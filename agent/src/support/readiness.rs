//! Readiness as named blockers: a process starts with the parts that must be up before
//! it is ready, each by name; a part clears its blocker once it is up (and sets it
//! again if it goes down), and the process is ready when none is left. What is not
//! ready yet is said by name, on `/readyz` (where Istio's istio-cni serves its
//! readiness) as kubelet's probe reads it: 200 `ready`, or 503 `not ready: <blockers>`;
//! `/healthz` answers 200 while the process serves at all.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Response, StatusCode};

/// The blockers still in the way, shared by the parts that clear them and the server.
#[derive(Debug, Clone, Default)]
pub struct Readiness {
    pending: Arc<Mutex<BTreeSet<&'static str>>>,
}

impl Readiness {
    /// Not ready until every one of `blockers` is cleared.
    pub fn new(blockers: &[&'static str]) -> Self {
        Self { pending: Arc::new(Mutex::new(blockers.iter().copied().collect())) }
    }

    /// `name` no longer holds readiness back.
    pub fn clear(&self, name: &'static str) {
        if self.lock().remove(name) {
            tracing::info!(blocker = name, pending = ?self.pending(), "readiness: cleared");
        }
    }

    /// `name` holds readiness back (again).
    pub fn block(&self, name: &'static str) {
        if self.lock().insert(name) {
            tracing::warn!(blocker = name, "readiness: not ready");
        }
    }

    /// The blockers still pending, in name order.
    pub fn pending(&self) -> Vec<&'static str> {
        self.lock().iter().copied().collect()
    }

    pub fn is_ready(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<&'static str>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The answer to a GET of `path`.
    pub fn answer(&self, path: &str) -> Response<Full<Bytes>> {
        let (status, body) = match path {
            "/readyz" => match self.pending() {
                p if p.is_empty() => (StatusCode::OK, "ready\n".to_string()),
                p => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {}\n", p.join(", "))),
            },
            "/healthz" => (StatusCode::OK, "ok\n".to_string()),
            _ => (StatusCode::NOT_FOUND, "not found\n".to_string()),
        };
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r
    }
}

/// Serves `readiness` on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, readiness: Readiness) {
    crate::support::http1::serve(listener, move |req, _| {
        let answer = readiness.answer(req.uri().path());
        async move { answer }
    })
    .await
}

/// Binds `address`:`port` (port 0: serves nothing) and serves `readiness` there; the
/// error names the port.
pub async fn serve_on(
    address: std::net::IpAddr,
    port: u16,
    readiness: Readiness,
) -> Result<(), std::io::Error> {
    if port == 0 {
        return Ok(());
    }
    let at = std::net::SocketAddr::new(address, port);
    let listener = tokio::net::TcpListener::bind(at).await.map_err(|e| {
        std::io::Error::new(e.kind(), format!("readiness port {port}: cannot listen on {at}: {e}"))
    })?;
    tracing::info!(address = %at, "serving readiness on /readyz");
    tokio::spawn(serve(listener, readiness));
    Ok(())
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;

    use super::*;

    async fn get(r: &Readiness, path: &str) -> (u16, String) {
        let answer = r.answer(path);
        let status = answer.status().as_u16();
        let body = answer.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn readyz_names_what_is_not_ready_until_nothing_is_left() {
        let r = Readiness::new(&["ZDS socket bound", "pods and namespaces listed"]);
        assert_eq!(
            get(&r, "/readyz").await,
            (503, "not ready: ZDS socket bound, pods and namespaces listed\n".into())
        );
        r.clear("ZDS socket bound");
        assert_eq!(get(&r, "/readyz").await, (503, "not ready: pods and namespaces listed\n".into()));
        r.clear("pods and namespaces listed");
        assert_eq!(get(&r, "/readyz").await, (200, "ready\n".into()));
        r.block("weir-cni chained into the CNI config");
        assert_eq!(
            get(&r, "/readyz").await,
            (503, "not ready: weir-cni chained into the CNI config\n".into())
        );
        assert_eq!(get(&r, "/healthz").await.0, 200);
        assert_eq!(get(&r, "/metrics").await.0, 404);
    }
}
