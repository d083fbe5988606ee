//! The status server on `statusPort` (15020): what kubelet and Prometheus talk to.
//! `/healthz/ready` (Envoy configured and live, DNS table loaded when DNS capture is
//! on; 503 once draining), `/stats/prometheus` and `/metrics` (merged: `merge`),
//! `/app-health/...` (rewritten probes: `probes`), `POST /quitquitquit` and
//! `POST /drain` (localhost only), and `/debug/ndsz`.

pub mod merge;
pub mod probes;

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode, body::Incoming};
use tokio::net::TcpListener;

use crate::{
    dns::DnsProxy,
    envoy::{LifecycleControl, Readiness},
};
pub use merge::MetricsMerge;
pub use probes::{AppProber, AppProbers};

/// What the status server reads from and acts on.
#[derive(Clone)]
pub struct StatusServer {
    pub dns: Option<Arc<DnsProxy>>,
    pub readiness: Arc<Readiness>,
    pub lifecycle: LifecycleControl,
    pub merge: MetricsMerge,
    pub probes: AppProber,
    last_ready: Arc<AtomicBool>,
}

#[derive(Debug, thiserror::Error)]
#[error("status server cannot listen on {address}")]
pub struct StatusBindError {
    pub address: SocketAddr,
    #[source]
    pub source: std::io::Error,
}

const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

impl StatusServer {
    pub fn new(
        dns: Option<Arc<DnsProxy>>,
        readiness: Arc<Readiness>,
        lifecycle: LifecycleControl,
        merge: MetricsMerge,
        probes: AppProber,
    ) -> Self {
        Self { dns, readiness, lifecycle, merge, probes, last_ready: Arc::default() }
    }

    pub async fn bind(address: SocketAddr) -> Result<TcpListener, StatusBindError> {
        TcpListener::bind(address).await.map_err(|source| StatusBindError { address, source })
    }

    /// Serves HTTP/1.1 on `listener` until the task is dropped.
    pub async fn serve(self, listener: TcpListener) {
        crate::http1::serve(listener, move |req, peer| {
            let me = self.clone();
            async move { me.route(req, peer).await }
        })
        .await
    }

    async fn route(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Full<Bytes>> {
        let path = req.uri().path().to_string();
        let method = req.method().clone();
        match path.as_str() {
            "/healthz/ready" => self.ready().await,
            "/stats/prometheus" | "/metrics" => {
                let body = self.merge.scrape(req.uri().query(), req.headers()).await;
                respond(StatusCode::OK, PROMETHEUS_TEXT, body)
            }
            "/quitquitquit" | "/drain" if !peer.ip().is_loopback() => {
                text(StatusCode::FORBIDDEN, "Only requests from localhost are allowed\n".into())
            }
            "/quitquitquit" | "/drain" if method != hyper::Method::POST => {
                text(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed\n".into())
            }
            "/quitquitquit" => {
                tracing::info!(%peer, "/quitquitquit called: exiting without a drain period");
                self.lifecycle.quit();
                text(StatusCode::OK, "OK".into())
            }
            "/drain" => {
                tracing::info!(%peer, "/drain called: draining Envoy's listeners");
                if let Err(e) = self.lifecycle.drain_now().await {
                    tracing::warn!(error = %crate::error_chain(&e), "cannot drain Envoy's listeners");
                }
                text(StatusCode::OK, "OK".into())
            }
            p if p.starts_with("/app-health/") || p.starts_with("/app-lifecycle/") => {
                let outcome = self.probes.probe(p, req.headers()).await;
                respond(outcome.status, "text/plain; charset=utf-8", outcome.body)
            }
            "/debug/ndsz" => self.ndsz(),
            _ => text(StatusCode::NOT_FOUND, "not found\n".into()),
        }
    }

    /// 200 when ready; else 503 with the reason (and a log line on each change).
    async fn ready(&self) -> Response<Full<Bytes>> {
        let mut verdict = self.readiness.check().await;
        if verdict.is_ok() && self.dns.as_ref().is_some_and(|d| d.name_table().is_none()) {
            verdict = Err("DNS name table not received from XDS server (NDS) yet".into());
        }
        match verdict {
            Ok(()) => {
                if !self.last_ready.swap(true, Ordering::SeqCst) {
                    tracing::info!("Envoy proxy is ready");
                }
                text(StatusCode::OK, String::new())
            }
            Err(reason) => {
                self.last_ready.store(false, Ordering::SeqCst);
                tracing::warn!(reason = %reason, "Envoy proxy is NOT ready");
                text(StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n"))
            }
        }
    }

    fn ndsz(&self) -> Response<Full<Bytes>> {
        match self.dns.as_ref().map(|d| d.name_table()) {
            None => text(StatusCode::NOT_FOUND, "DNS proxy is off\n".into()),
            Some(None) => respond(StatusCode::OK, "application/json", Bytes::from_static(b"{}\n")),
            Some(Some(table)) => {
                let hosts: serde_json::Map<String, serde_json::Value> = table
                    .table
                    .iter()
                    .map(|(host, info)| {
                        (
                            host.clone(),
                            serde_json::json!({
                                "ips": info.ips,
                                "registry": info.registry,
                                "shortname": info.shortname,
                                "namespace": info.namespace,
                            }),
                        )
                    })
                    .collect();
                let body = serde_json::to_string_pretty(&serde_json::json!({ "table": hosts }))
                    .expect("json serializes");
                respond(StatusCode::OK, "application/json", Bytes::from(body))
            }
        }
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    respond(status, "text/plain; charset=utf-8", Bytes::from(body))
}

fn respond(status: StatusCode, content_type: &str, body: Bytes) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(body))
        .expect("static response parts are valid")
}
