//! The status server on `statusPort` (15020): what kubelet and Prometheus scrape.
//! Serves the agent's own metrics at `/stats/prometheus` (Istio's path) and the DNS
//! table at `/debug/ndsz`; readiness and the merge with Envoy's and the app's metrics
//! are added by the Envoy lifecycle.

use std::{convert::Infallible, net::SocketAddr, sync::Arc};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::{dns::DnsProxy, metrics::Metrics};

/// What the status server reads from.
#[derive(Clone)]
pub struct StatusServer {
    pub metrics: Arc<Metrics>,
    pub dns: Option<Arc<DnsProxy>>,
}

#[derive(Debug, thiserror::Error)]
#[error("status server cannot listen on {address}")]
pub struct StatusBindError {
    pub address: SocketAddr,
    #[source]
    pub source: std::io::Error,
}

impl StatusServer {
    pub async fn bind(address: SocketAddr) -> Result<TcpListener, StatusBindError> {
        TcpListener::bind(address).await.map_err(|source| StatusBindError { address, source })
    }

    /// Serves HTTP/1.1 on `listener` until the task is dropped.
    pub async fn serve(self, listener: TcpListener) {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let me = self.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let me = me.clone();
                    async move { Ok::<_, Infallible>(me.route(&req)) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    }

    fn route(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        match (req.method().as_str(), req.uri().path()) {
            ("GET", "/stats/prometheus") => {
                text(StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", self.metrics.encode())
            }
            ("GET", "/debug/ndsz") => match self.dns.as_ref().map(|d| d.name_table()) {
                None => text(StatusCode::NOT_FOUND, "text/plain", "DNS proxy is off\n".into()),
                Some(None) => text(StatusCode::OK, "application/json", "{}\n".into()),
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
                    text(StatusCode::OK, "application/json", body)
                }
            },
            _ => text(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
        }
    }
}

fn text(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}
