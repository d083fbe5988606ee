//! A small HTTP/1.1 server for tests that need an upstream the agent calls (a token
//! exchange endpoint, a Wasm module server): it runs in a pod's network namespace,
//! answers each request with what the test's handler returns (the handler can be
//! swapped while it runs), and records every request it saw.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use tokio_util::sync::CancellationToken;
use weir_agent::sandbox::NetNs;

/// One request as received.
#[derive(Debug, Clone)]
pub struct SeenRequest {
    pub method: String,
    /// Path and query.
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl SeenRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// What to answer: (status, content type, body).
pub type Answer = (u16, &'static str, Vec<u8>);
type Handler = Arc<dyn Fn(&SeenRequest) -> Answer + Send + Sync>;

pub struct TestHttpServer {
    pub addr: SocketAddr,
    handler: Arc<Mutex<Handler>>,
    pub requests: Arc<Mutex<Vec<SeenRequest>>>,
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestHttpServer {
    /// Listens on `addr` (port 0: any) inside `netns`.
    pub fn start(
        netns: &NetNs,
        addr: SocketAddr,
        handler: impl Fn(&SeenRequest) -> Answer + Send + Sync + 'static,
    ) -> anyhow::Result<Self> {
        Self::start_tls(netns, addr, None, handler)
    }

    /// As `start`, over TLS with `tls` = (certificate chain, key) PEM when given.
    pub fn start_tls(
        netns: &NetNs,
        addr: SocketAddr,
        tls: Option<(String, String)>,
        handler: impl Fn(&SeenRequest) -> Answer + Send + Sync + 'static,
    ) -> anyhow::Result<Self> {
        let acceptor = match tls {
            Some((chain, key)) => Some(tls_acceptor(&chain, &key)?),
            None => None,
        };
        let handler: Arc<Mutex<Handler>> = Arc::new(Mutex::new(Arc::new(handler)));
        let requests: Arc<Mutex<Vec<SeenRequest>>> = Arc::default();
        let stop = CancellationToken::new();
        let (tx, rx) = std::sync::mpsc::channel();
        let (h, r, s) = (handler.clone(), requests.clone(), stop.clone());
        let thread = netns.spawn_thread(move || async move {
            let listener = match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => l,
                Err(e) => {
                    let _ = tx.send(Err(format!("bind {addr}: {e}")));
                    return;
                }
            };
            let _ = tx.send(Ok(listener.local_addr().expect("bound")));
            loop {
                let (stream, _) = tokio::select! {
                    _ = s.cancelled() => return,
                    accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => continue },
                };
                let (h, r, acceptor) = (h.clone(), r.clone(), acceptor.clone());
                tokio::spawn(async move {
                    let service =
                        hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                            let (h, r) = (h.clone(), r.clone());
                            async move {
                                let (parts, body) = req.into_parts();
                                let body =
                                    body.collect().await.map(|b| b.to_bytes().to_vec()).unwrap_or_default();
                                let seen = SeenRequest {
                                    method: parts.method.to_string(),
                                    path: parts
                                        .uri
                                        .path_and_query()
                                        .map(|p| p.to_string())
                                        .unwrap_or_default(),
                                    headers: parts
                                        .headers
                                        .iter()
                                        .map(|(n, v)| {
                                            (n.to_string(), v.to_str().unwrap_or_default().to_string())
                                        })
                                        .collect(),
                                    body,
                                };
                                let handler = h.lock().expect("handler lock").clone();
                                let (status, content_type, body) = handler(&seen);
                                r.lock().expect("requests lock").push(seen);
                                Ok::<_, std::convert::Infallible>(
                                    hyper::Response::builder()
                                        .status(status)
                                        .header("content-type", content_type)
                                        .body(Full::new(Bytes::from(body)))
                                        .expect("valid response"),
                                )
                            }
                        });
                    let builder = hyper::server::conn::http1::Builder::new();
                    match acceptor {
                        Some(a) => {
                            if let Ok(tls) = a.accept(stream).await {
                                let _ = builder
                                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                                    .await;
                            }
                        }
                        None => {
                            let _ =
                                builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
                        }
                    }
                });
            }
        })?;
        let addr = rx
            .recv_timeout(std::time::Duration::from_secs(10))?
            .map_err(|e| anyhow::anyhow!("test HTTP server: {e}"))?;
        Ok(Self { addr, handler, requests, stop, thread: Some(thread) })
    }

    /// Answers from now on with `handler`.
    pub fn answer_with(&self, handler: impl Fn(&SeenRequest) -> Answer + Send + Sync + 'static) {
        *self.handler.lock().expect("handler lock") = Arc::new(handler);
    }

    /// Every request so far.
    pub fn seen(&self) -> Vec<SeenRequest> {
        self.requests.lock().expect("requests lock").clone()
    }
}

impl Drop for TestHttpServer {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A TLS acceptor serving the certificate chain `chain` with `key` (PEM), no client
/// certificates asked.
pub fn tls_acceptor(chain: &str, key: &str) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
    let certs = CertificateDer::pem_slice_iter(chain.as_bytes()).collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes())?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
