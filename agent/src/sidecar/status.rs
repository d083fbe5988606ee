//! The status server on `statusPort` (15020): what kubelet and Prometheus talk to.
//! `/healthz/ready` (Envoy configured and live, DNS table loaded when DNS capture is
//! on; 503 once draining), `/stats/prometheus` and `/metrics` (merged: `merge`),
//! `/app-health/...` (rewritten probes: `probes`), `POST /quitquitquit` and
//! `POST /drain`, and `/debug/ndsz` (these three from localhost only).

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
use http_body_util::{BodyExt as _, Full};
use hyper::{Request, Response, StatusCode, body::Incoming};
use tokio::net::TcpListener;

use crate::{
    sidecar::dns::DnsProxy,
    sidecar::envoy::{LifecycleControl, Readiness},
};
pub use merge::{MergedBody, MetricsMerge};
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
    /// One /debug/ndsz render at a time (each copies the whole table into JSON).
    ndsz_render: Arc<tokio::sync::Semaphore>,
}

#[derive(Debug, thiserror::Error)]
#[error("status server cannot listen on :{port}")]
pub struct StatusBindError {
    pub port: u16,
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
        Self {
            dns,
            readiness,
            lifecycle,
            merge,
            probes,
            last_ready: Arc::default(),
            ndsz_render: Arc::new(tokio::sync::Semaphore::new(1)),
        }
    }

    /// Listens on `port` as pilot-agent's `net.Listen("tcp", ":port")` does: one
    /// dual-stack socket on `[::]`, so kubelet reaches it in IPv4-only, IPv6-only and
    /// dual-stack pods alike; `0.0.0.0` only where the system has no IPv6.
    pub async fn bind(port: u16) -> Result<TcpListener, StatusBindError> {
        let error = |source| StatusBindError { port, source };
        match dual_stack(port) {
            Ok(listener) => Ok(listener),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL)) => {
                tracing::debug!(error = %e, "no IPv6 on this system: the status server listens on IPv4 only");
                TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, port)).await.map_err(error)
            }
            Err(e) => Err(error(e)),
        }
    }

    /// Serves HTTP/1.1 on `listener` until the task is dropped.
    pub async fn serve(self, listener: TcpListener) {
        crate::support::http1::serve(listener, move |req, peer| {
            let me = self.clone();
            async move { me.route(req, peer).await }
        })
        .await
    }

    async fn route(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<MergedBody> {
        let path = req.uri().path().to_string();
        let method = req.method().clone();
        match path.as_str() {
            "/healthz/ready" => self.ready().await,
            "/stats/prometheus" | "/metrics" => match self.merge.scrape(req.uri().query(), req.headers()) {
                Some(body) => Response::builder()
                    .status(StatusCode::OK)
                    .header("content-type", PROMETHEUS_TEXT)
                    .body(body)
                    .expect("static response parts are valid"),
                None => {
                    let mut busy =
                        text(StatusCode::SERVICE_UNAVAILABLE, "too many metrics scrapes at once\n".into());
                    busy.headers_mut().insert("retry-after", hyper::header::HeaderValue::from_static("1"));
                    busy
                }
            },
            // The pod's whole DNS name table is for its own debugging, as Istio's.
            "/quitquitquit" | "/drain" | "/debug/ndsz" if !peer.ip().is_loopback() => {
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
            "/debug/ndsz" => self.ndsz().await,
            _ => text(StatusCode::NOT_FOUND, "not found\n".into()),
        }
    }

    /// 200 when ready; else 503 with the reason (and a log line on each change).
    async fn ready(&self) -> Response<MergedBody> {
        let mut verdict = self.readiness.check().await;
        if verdict.is_ok() && self.dns.as_ref().is_some_and(|d| !d.is_ready()) {
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

    /// The whole name table as JSON; rendered on the blocking pool (a table of tens
    /// of thousands of services would otherwise hold the agent's one thread), one
    /// render at a time (503 while one runs, as for metrics scrapes).
    async fn ndsz(&self) -> Response<MergedBody> {
        let Some(dns) = &self.dns else { return text(StatusCode::NOT_FOUND, "DNS proxy is off\n".into()) };
        // The permit first: a refused request never holds (and so never frees) a table.
        let Ok(permit) = self.ndsz_render.clone().try_acquire_owned() else {
            let mut busy = text(StatusCode::SERVICE_UNAVAILABLE, "a name table render is running\n".into());
            busy.headers_mut().insert("retry-after", hyper::header::HeaderValue::from_static("1"));
            return busy;
        };
        let Some(table) = dns.name_table() else {
            return respond(StatusCode::OK, "application/json", Bytes::from_static(b"{}\n"));
        };
        let render = move || {
            // Held until the render ends, even if the client has gone.
            let _permit = permit;
            let hosts: serde_json::Map<String, serde_json::Value> = table
                .table
                .iter()
                .map(|(host, info)| {
                    let info = serde_json::json!({
                        "ips": info.ips,
                        "registry": info.registry,
                        "shortname": info.shortname,
                        "namespace": info.namespace,
                    });
                    (host.clone(), info)
                })
                .collect();
            serde_json::to_string_pretty(&serde_json::json!({ "table": hosts })).expect("json serializes")
        };
        match tokio::task::spawn_blocking(render).await {
            Ok(body) => respond(StatusCode::OK, "application/json", Bytes::from(body)),
            Err(e) => {
                text(StatusCode::INTERNAL_SERVER_ERROR, format!("rendering the name table failed: {e}\n"))
            }
        }
    }
}

fn text(status: StatusCode, body: String) -> Response<MergedBody> {
    respond(status, "text/plain; charset=utf-8", Bytes::from(body))
}

fn respond(status: StatusCode, content_type: &str, body: Bytes) -> Response<MergedBody> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(body).boxed_unsync())
        .expect("static response parts are valid")
}

/// `[::]:port` with `IPV6_V6ONLY` off (whatever `net.ipv6.bindv6only` says), as Go
/// listens.
fn dual_stack(port: u16) -> std::io::Result<TcpListener> {
    let socket = tokio::net::TcpSocket::new_v6()?;
    nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Ipv6V6Only, &false)?;
    socket.set_reuseaddr(true)?;
    socket.bind(SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)))?;
    socket.listen(1024)
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    async fn get(to: SocketAddr) -> String {
        let mut stream =
            tokio::net::TcpStream::connect(to).await.unwrap_or_else(|e| panic!("connect {to}: {e}"));
        stream.write_all(b"GET / HTTP/1.1\r\nHost: status\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer.rsplit("\r\n\r\n").next().unwrap().to_string()
    }

    /// An app whose metrics start (one line) and never end.
    async fn stalled_app() -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut conn, _)) = listener.accept().await {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.ends_with(b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let first = "app_metric_total 1\n";
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{first}\r\n",
                    first.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
                held.push(conn);
            }
        });
        port
    }

    fn merging(app_port: u16) -> MetricsMerge {
        let app = merge::ScrapeTarget { port: app_port, path: "/metrics".into() };
        MetricsMerge::new(Arc::new(crate::sidecar::metrics::Metrics::new()), None, vec![app])
    }

    async fn status_server(merge: MetricsMerge) -> SocketAddr {
        let server = StatusServer::new(
            None,
            Arc::new(Readiness::new(None)),
            LifecycleControl::new(None, false),
            merge,
            AppProber::new(AppProbers::default(), std::net::Ipv4Addr::LOCALHOST.into()),
        );
        let listener = StatusServer::bind(0).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(server.serve(listener));
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// A scrape asking for an hour's deadline; what arrived once `needle` did.
    async fn scrape_until(to: SocketAddr, needle: &str) -> (tokio::net::TcpStream, String) {
        let mut stream = tokio::net::TcpStream::connect(to).await.unwrap();
        let request = "GET /stats/prometheus HTTP/1.1\r\nHost: status\r\nX-Prometheus-Scrape-Timeout-Seconds: 3600\r\n\r\n";
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut seen = Vec::new();
        let read = async {
            let mut buf = [0u8; 4096];
            while !String::from_utf8_lossy(&seen).contains(needle) {
                let n = stream.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed before {needle:?}: {}", String::from_utf8_lossy(&seen));
                seen.extend_from_slice(&buf[..n]);
            }
        };
        let arrived = tokio::time::timeout(std::time::Duration::from_secs(10), read).await;
        let seen = String::from_utf8_lossy(&seen).into_owned();
        assert!(arrived.is_ok(), "no {needle:?} within 10 s, only {seen:?}");
        (stream, seen)
    }

    /// The merged metrics are streamed: what the agent has and the app's first line
    /// arrive while the app is still sending. Scrapes at once are bounded: past
    /// `MAX_CONCURRENT_SCRAPES` the answer is 503 at once, never a queue.
    #[tokio::test]
    async fn merged_metrics_stream_and_scrapes_at_once_are_bounded() {
        let status = status_server(merging(stalled_app().await)).await;
        let mut held = Vec::new();
        for _ in 0..merge::MAX_CONCURRENT_SCRAPES {
            let (conn, seen) = scrape_until(status, "app_metric_total 1").await;
            assert!(seen.starts_with("HTTP/1.1 200") && seen.contains("istio_agent_scrapes_total"), "{seen}");
            held.push(conn);
        }
        let (_, refused) = scrape_until(status, "\r\n\r\n").await;
        assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
        drop(held);
        let (_, again) = scrape_until(status, "app_metric_total 1").await;
        assert!(again.starts_with("HTTP/1.1 200"), "a permit is back once a scrape ends: {again}");
    }

    /// kubelet probes an IPv6-only pod on its IPv6 address and an IPv4 one on IPv4: the
    /// status port answers both; peers keep their own family (so `/quitquitquit` from
    /// 127.0.0.1 is still from localhost).
    #[tokio::test]
    async fn the_status_port_answers_over_ipv4_and_ipv6() {
        let listener = StatusServer::bind(0).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(crate::support::http1::serve(listener, |_, peer: SocketAddr| async move {
            let body = format!("{} {}", peer.ip(), peer.ip().is_loopback());
            Response::new(Full::new(Bytes::from(body)))
        }));
        assert_eq!(get(SocketAddr::from(([127, 0, 0, 1], port))).await, "127.0.0.1 true");
        assert_eq!(get(SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port))).await, "::1 true");
        // The port is taken for both families: a second agent is refused, naming it.
        let e = StatusServer::bind(port).await.unwrap_err();
        assert_eq!(e.to_string(), format!("status server cannot listen on :{port}"));
        assert_eq!(e.source.kind(), std::io::ErrorKind::AddrInUse);
    }

    /// /debug/ndsz renders the table off the thread, one render at a time: a second
    /// request while one runs is told to come back, not queued behind it.
    #[tokio::test]
    async fn ndsz_renders_the_table_and_one_render_at_a_time() {
        use http_body_util::BodyExt as _;
        use weir_proto::istio::networking::nds::v1::{NameTable, name_table::NameInfo};
        let config =
            crate::sidecar::dns::DnsConfig::resolve("", "app", "app.svc.cluster.local", "", false).unwrap();
        let dns = DnsProxy::new(config, Arc::new(crate::sidecar::metrics::Metrics::new()));
        let mut table = NameTable::default();
        let info =
            NameInfo { ips: vec!["10.0.0.7".into()], registry: "Kubernetes".into(), ..Default::default() };
        table.table.insert("reviews.app.svc.cluster.local".into(), info);
        dns.update(table);
        let server = StatusServer::new(
            Some(dns),
            Arc::new(Readiness::new(None)),
            LifecycleControl::new(None, false),
            merging(9),
            AppProber::new(AppProbers::default(), std::net::Ipv4Addr::LOCALHOST.into()),
        );
        let body = |r: Response<MergedBody>| async move {
            (
                r.status(),
                String::from_utf8(r.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap(),
            )
        };
        let (status, json) = body(server.ndsz().await).await;
        assert_eq!(status, StatusCode::OK);
        let json: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(json["table"]["reviews.app.svc.cluster.local"]["ips"][0], "10.0.0.7");
        let running = server.ndsz_render.clone().try_acquire_owned().unwrap();
        let busy = server.ndsz().await;
        assert_eq!(busy.headers()["retry-after"], "1");
        assert_eq!(body(busy).await.0, StatusCode::SERVICE_UNAVAILABLE);
        drop(running);
        assert_eq!(body(server.ndsz().await).await.0, StatusCode::OK);
    }
}
