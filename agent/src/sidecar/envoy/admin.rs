//! Envoy's admin API on 127.0.0.1:15000, as the agent uses it: plain HTTP/1.1 requests
//! with a deadline (stats for readiness and draining, `drain_listeners`,
//! `quitquitquit`), and the text stats format parsed into name → value.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{method} http://{address}{path}: no answer within {timeout:?}")]
    Timeout { method: Method, address: SocketAddr, path: String, timeout: Duration },
    #[error("{method} http://{address}{path}")]
    Io {
        method: Method,
        address: SocketAddr,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{method} http://{address}{path}")]
    Http {
        method: Method,
        address: SocketAddr,
        path: String,
        #[source]
        source: hyper::Error,
    },
    #[error("{method} http://{address}{path}: HTTP {status}: {body}")]
    Status { method: Method, address: SocketAddr, path: String, status: StatusCode, body: String },
}

/// One HTTP/1.1 request to `address` (a local admin or status port); (status, body).
pub async fn request(
    address: SocketAddr,
    method: Method,
    path: &str,
    body: Option<Bytes>,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), AdminError> {
    let http = |source| AdminError::Http { method: method.clone(), address, path: path.into(), source };
    let attempt = async {
        let (status, incoming) = send(address, method.clone(), path, body).await?;
        let body = incoming.collect().await.map_err(http)?.to_bytes();
        Ok((status, body))
    };
    tokio::time::timeout(timeout, attempt).await.map_err(|_| AdminError::Timeout {
        method: method.clone(),
        address,
        path: path.into(),
        timeout,
    })?
}

/// Like `request`, but only the status line and headers are awaited within
/// `timeout`; the body is the caller's to read (and bound).
pub async fn request_stream(
    address: SocketAddr,
    method: Method,
    path: &str,
    timeout: Duration,
) -> Result<(StatusCode, hyper::body::Incoming), AdminError> {
    tokio::time::timeout(timeout, send(address, method.clone(), path, None))
        .await
        .map_err(|_| AdminError::Timeout { method, address, path: path.into(), timeout })?
}

async fn send(
    address: SocketAddr,
    method: Method,
    path: &str,
    body: Option<Bytes>,
) -> Result<(StatusCode, hyper::body::Incoming), AdminError> {
    let io = |source| AdminError::Io { method: method.clone(), address, path: path.into(), source };
    let http = |source| AdminError::Http { method: method.clone(), address, path: path.into(), source };
    let stream = tokio::net::TcpStream::connect(address).await.map_err(io)?;
    let uri: hyper::Uri = path
        .parse()
        .map_err(|_| io(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a valid request path")))?;
    let builder = Request::builder().method(method.clone()).uri(uri).header("host", address.to_string());
    let request = match body {
        Some(b) => builder.body(Full::new(b).boxed()),
        None => builder.body(Empty::<Bytes>::new().map_err(|e| match e {}).boxed()),
    }
    .expect("a method, a parsed URI and a host header make a valid request");
    let response = crate::support::http1::exchange(TokioIo::new(stream), request).await.map_err(http)?;
    Ok((response.status(), response.into_body()))
}

/// Envoy's admin API.
#[derive(Debug, Clone, Copy)]
pub struct EnvoyAdmin {
    pub address: SocketAddr,
}

pub const ADMIN_TIMEOUT: Duration = Duration::from_secs(2);

impl EnvoyAdmin {
    pub fn new(port: u16) -> Self {
        Self { address: SocketAddr::from(([127, 0, 0, 1], port)) }
    }

    async fn call(&self, method: Method, path: &str) -> Result<Bytes, AdminError> {
        let (status, body) = request(self.address, method.clone(), path, None, ADMIN_TIMEOUT).await?;
        if !status.is_success() {
            return Err(AdminError::Status {
                method,
                address: self.address,
                path: path.into(),
                status,
                body: String::from_utf8_lossy(&body).trim().chars().take(200).collect(),
            });
        }
        Ok(body)
    }

    /// `GET /stats?usedonly&filter=<regex>` as name → value (gauges and counters).
    pub async fn stats(&self, filter: &str) -> Result<BTreeMap<String, u64>, AdminError> {
        let body = self.call(Method::GET, &format!("/stats?usedonly&filter={}", encode(filter))).await?;
        Ok(parse_stats(&String::from_utf8_lossy(&body)))
    }

    /// `GET /stats` for exactly these names (0 for a stat Envoy has not created).
    pub async fn stats_named(&self, names: &[&str]) -> Result<BTreeMap<String, u64>, AdminError> {
        let alternation = names.iter().map(|n| n.replace('.', "\\.")).collect::<Vec<_>>().join("|");
        let body = self
            .call(Method::GET, &format!("/stats?filter={}", encode(&format!("^({alternation})$"))))
            .await?;
        let mut stats = parse_stats(&String::from_utf8_lossy(&body));
        for name in names {
            stats.entry(name.to_string()).or_insert(0);
        }
        Ok(stats)
    }

    /// Envoy's metrics in Prometheus text format.
    pub async fn prometheus(&self) -> Result<Bytes, AdminError> {
        self.call(Method::GET, "/stats/prometheus").await
    }

    /// Starts draining listeners gracefully: inbound only for a sidecar (Istio's
    /// termination drain); `skip_exit` keeps Envoy running once the drain period ends
    /// (`POST /drain` on the status port).
    pub async fn drain(&self, inbound_only: bool, skip_exit: bool) -> Result<(), AdminError> {
        let mut path = String::from("/drain_listeners?");
        if inbound_only {
            path.push_str("inboundonly&");
        }
        path.push_str("graceful");
        if skip_exit {
            path.push_str("&skip_exit");
        }
        self.call(Method::POST, &path).await.map(|_| ())
    }

    /// Asks Envoy to exit.
    pub async fn quit(&self) -> Result<(), AdminError> {
        self.call(Method::POST, "/quitquitquit").await.map(|_| ())
    }
}

/// Percent-encodes a query value (everything but RFC 3986's unreserved characters).
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Envoy's text stats (`name: value` per line; histograms and text stats skipped).
pub fn parse_stats(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter_map(|line| {
            let (name, value) = line.split_once(": ")?;
            Some((name.trim().to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_text_parses() {
        let s = parse_stats(
            "server.state: 0\nlistener_manager.workers_started: 1\ncluster.x.upstream_rq_time: P0(nan,1)\nbad line\n",
        );
        assert_eq!(s.get("server.state"), Some(&0));
        assert_eq!(s.get("listener_manager.workers_started"), Some(&1));
        assert_eq!(s.len(), 2);
        assert_eq!(encode("^(a\\.b|c)$"), "%5E%28a%5C.b%7Cc%29%24");
    }
}
