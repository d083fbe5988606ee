//! The merged `/stats/prometheus`: the agent's metrics, Envoy's (from its 15090
//! listener) and the app's (`ISTIO_PROMETHEUS_ANNOTATIONS`, from the pod's
//! `prometheus.io/*` annotations), concatenated as pilot-agent does. A failing source
//! is left out and counted (`istio_agent_scrape_failures_total{type}`), never fails the
//! whole scrape; each source has a deadline and a size cap.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt as _;
use hyper::{HeaderMap, Method, StatusCode};
use serde::{Deserialize, Serialize};

use crate::metrics::{Metrics, SCRAPE_APP, SCRAPE_ENVOY};

/// What one source may send (Istio's cap for app metrics).
pub const MAX_SCRAPE_BYTES: usize = 10 * 1024 * 1024;
/// Deadline per source when Prometheus does not send `X-Prometheus-Scrape-Timeout-Seconds`.
pub const DEFAULT_SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// Ports the data plane owns: scraping them as "the app" would recurse or double count.
const RESERVED_PORTS: [(u16, &str); 9] = [
    (15000, "Envoy admin"),
    (15001, "outbound traffic capture"),
    (15004, "pilot debug"),
    (15006, "inbound traffic capture"),
    (15008, "HBONE tunnel"),
    (15020, "pilot-agent status / merged Prometheus"),
    (15021, "Envoy health"),
    (15053, "DNS proxy"),
    (15090, "Envoy Prometheus (already merged)"),
];

/// One app metrics endpoint on localhost.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScrapeTarget {
    pub port: u16,
    pub path: String,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ScrapeConfigError {
    #[error("not a JSON object with scrape, port, path and targets: {0}")]
    Json(String),
    #[error("invalid target port {0:?} (expected 1..65535)")]
    Port(String),
    #[error("target port {0} is the agent's own port, which would scrape itself in a loop")]
    Recursive(u16),
    #[error("target port {port} is reserved for Istio ({reason}) and cannot be scraped")]
    Reserved { port: u16, reason: &'static str },
}

#[derive(Deserialize)]
struct Annotations {
    #[serde(default)]
    scrape: String,
    #[serde(default)]
    path: String,
    #[serde(default)]
    port: String,
    #[serde(default)]
    targets: Vec<RawTarget>,
}

#[derive(Deserialize)]
struct RawTarget {
    port: String,
    #[serde(default)]
    path: String,
}

/// `ISTIO_PROMETHEUS_ANNOTATIONS` as pilot-agent reads it: `None` when unset or
/// `scrape: "false"`; port 80 and path `/metrics` by default.
pub fn parse_scrape_config(
    json: Option<&str>,
    status_port: u16,
) -> Result<Vec<ScrapeTarget>, ScrapeConfigError> {
    let Some(json) = json.filter(|j| !j.trim().is_empty()) else { return Ok(Vec::new()) };
    let a: Annotations = serde_json::from_str(json).map_err(|e| ScrapeConfigError::Json(e.to_string()))?;
    if a.scrape == "false" {
        return Ok(Vec::new());
    }
    let raw = if a.targets.is_empty() {
        vec![RawTarget { port: if a.port.is_empty() { "80".into() } else { a.port }, path: a.path }]
    } else {
        a.targets
    };
    raw.into_iter()
        .map(|t| {
            let port: u16 = t
                .port
                .trim()
                .parse()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| ScrapeConfigError::Port(t.port.clone()))?;
            if port == status_port {
                return Err(ScrapeConfigError::Recursive(port));
            }
            if let Some((_, reason)) = RESERVED_PORTS.iter().find(|(p, _)| *p == port) {
                return Err(ScrapeConfigError::Reserved { port, reason });
            }
            let path = if t.path.is_empty() { "/metrics".to_string() } else { t.path };
            Ok(ScrapeTarget { port, path })
        })
        .collect()
}

/// Builds the merged exposition.
#[derive(Clone)]
pub struct MetricsMerge {
    pub metrics: Arc<Metrics>,
    /// Envoy's Prometheus listener (`None` without Envoy).
    pub envoy: Option<SocketAddr>,
    pub apps: Arc<Vec<ScrapeTarget>>,
}

impl MetricsMerge {
    /// Agent, then Envoy, then the apps (an OpenMetrics `# EOF` must come last, so
    /// every part's is dropped). `query` is passed on to Envoy (e.g. `usedonly`).
    pub async fn scrape(&self, query: Option<&str>, headers: &HeaderMap) -> Bytes {
        self.metrics.scrapes.inc();
        let timeout = scrape_timeout(headers);
        let envoy = async {
            let address = self.envoy?;
            let path = match query {
                Some(q) if !q.is_empty() => format!("/stats/prometheus?{q}"),
                _ => "/stats/prometheus".into(),
            };
            match fetch(address, &path, timeout).await {
                Ok(body) => Some(body),
                Err(e) => {
                    tracing::warn!(error = %e, "failed scraping Envoy metrics");
                    self.metrics.scrape_failures.get_or_create(&SCRAPE_ENVOY).inc();
                    None
                }
            }
        };
        let apps = futures::future::join_all(self.apps.iter().map(|t| async move {
            let address = SocketAddr::from(([127, 0, 0, 1], t.port));
            match fetch(address, &t.path, timeout).await {
                Ok(body) => Some(body),
                Err(e) => {
                    tracing::warn!(port = t.port, path = %t.path, error = %e, "failed scraping application metrics");
                    self.metrics.scrape_failures.get_or_create(&SCRAPE_APP).inc();
                    None
                }
            }
        }));
        let (envoy, apps) = tokio::join!(envoy, apps);
        let mut out = BytesMut::new();
        push_part(&mut out, self.metrics.encode().as_bytes());
        for part in envoy.into_iter().chain(apps.into_iter().flatten()) {
            push_part(&mut out, &part);
        }
        out.freeze()
    }
}

/// Appends one exposition without its `# EOF`, ending in a newline.
pub fn push_part(out: &mut BytesMut, part: &[u8]) {
    for line in part.split_inclusive(|b| *b == b'\n') {
        if line.trim_ascii() == b"# EOF" {
            continue;
        }
        out.extend_from_slice(line);
    }
    if !out.is_empty() && !out.ends_with(b"\n") {
        out.extend_from_slice(b"\n");
    }
}

#[derive(Debug, thiserror::Error)]
enum FetchError {
    #[error(transparent)]
    Request(#[from] crate::envoy::admin::AdminError),
    #[error("http://{address}{path}: HTTP {status}")]
    Status { address: SocketAddr, path: String, status: StatusCode },
    #[error("http://{address}{path}: more than {MAX_SCRAPE_BYTES} bytes")]
    TooLarge { address: SocketAddr, path: String },
    #[error("http://{address}{path}: {source}")]
    Body { address: SocketAddr, path: String, source: Box<dyn std::error::Error + Send + Sync> },
}

/// GET with a deadline, reading at most `MAX_SCRAPE_BYTES`.
async fn fetch(address: SocketAddr, path: &str, timeout: Duration) -> Result<Bytes, FetchError> {
    let (status, body) = crate::envoy::admin::request_stream(address, Method::GET, path, timeout).await?;
    if status != StatusCode::OK {
        return Err(FetchError::Status { address, path: path.into(), status });
    }
    let limited = http_body_util::Limited::new(body, MAX_SCRAPE_BYTES);
    match tokio::time::timeout(timeout, limited.collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(FetchError::TooLarge { address, path: path.into() })
        }
        Ok(Err(source)) => Err(FetchError::Body { address, path: path.into(), source }),
        Err(_) => Err(FetchError::Body {
            address,
            path: path.into(),
            source: "body not read within the deadline".into(),
        }),
    }
}

/// Prometheus's `X-Prometheus-Scrape-Timeout-Seconds`, else the default; a value no
/// duration can hold (any client can send one) is the default too, not a panic.
fn scrape_timeout(headers: &HeaderMap) -> Duration {
    headers
        .get("x-prometheus-scrape-timeout-seconds")
        .and_then(|v| v.to_str().ok()?.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .unwrap_or(DEFAULT_SCRAPE_TIMEOUT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrape_timeouts_come_from_prometheus_and_never_overflow() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert("x-prometheus-scrape-timeout-seconds", value.parse().unwrap());
            scrape_timeout(&headers)
        };
        assert_eq!(with("2.5"), Duration::from_millis(2500));
        for odd in ["1e30", "inf", "NaN", "-3", "0", "soon"] {
            assert_eq!(with(odd), DEFAULT_SCRAPE_TIMEOUT, "{odd}");
        }
        assert_eq!(scrape_timeout(&HeaderMap::new()), DEFAULT_SCRAPE_TIMEOUT);
    }

    #[test]
    fn scrape_config_follows_pilot_agent() {
        assert_eq!(parse_scrape_config(None, 15020), Ok(vec![]));
        assert_eq!(parse_scrape_config(Some(r#"{"scrape":"false","port":"8080"}"#), 15020), Ok(vec![]));
        assert_eq!(
            parse_scrape_config(Some(r#"{"scrape":"true"}"#), 15020),
            Ok(vec![ScrapeTarget { port: 80, path: "/metrics".into() }])
        );
        assert_eq!(
            parse_scrape_config(
                Some(r#"{"scrape":"true","targets":[{"port":"9000","path":"/m"},{"port":"9001"}]}"#),
                15020
            ),
            Ok(vec![
                ScrapeTarget { port: 9000, path: "/m".into() },
                ScrapeTarget { port: 9001, path: "/metrics".into() }
            ])
        );
        assert_eq!(
            parse_scrape_config(Some(r#"{"port":"15020"}"#), 15020),
            Err(ScrapeConfigError::Recursive(15020))
        );
        let e = parse_scrape_config(Some(r#"{"port":"15090"}"#), 15020).unwrap_err().to_string();
        assert!(e.contains("15090") && e.contains("already merged"), "{e}");
        let e = parse_scrape_config(Some(r#"{"port":"http"}"#), 15020).unwrap_err().to_string();
        assert!(e.contains("\"http\""), "{e}");
        assert!(matches!(parse_scrape_config(Some("nope"), 15020), Err(ScrapeConfigError::Json(_))));
    }

    #[test]
    fn parts_lose_their_eof_and_end_in_newlines() {
        let mut out = BytesMut::new();
        push_part(&mut out, b"a_total 1\n# EOF\n");
        push_part(&mut out, b"b 2");
        push_part(&mut out, b"c 3\n# EOF");
        assert_eq!(&out[..], b"a_total 1\nb 2\nc 3\n");
    }
}
