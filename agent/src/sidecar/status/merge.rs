//! The merged `/stats/prometheus`: the agent's metrics, Envoy's (from its 15090
//! listener) and the app's (`ISTIO_PROMETHEUS_ANNOTATIONS`, from the pod's
//! `prometheus.io/*` or `prometheus.istio.io/scrape-targets` annotations),
//! concatenated as pilot-agent does and streamed as it does: a few frames in memory,
//! whatever the sources send. A failing source is left out and counted
//! (`istio_agent_scrape_failures_total{type}`), never fails the whole scrape; the scrape
//! has one deadline (the caller's, at most `MAX_SCRAPE_TIMEOUT`), each source a size
//! cap (10 MiB, as pilot-agent's per target: a source declaring more is left out
//! whole, one streaming more is cut at the cap), and at most `MAX_CONCURRENT_SCRAPES`
//! run at once.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt as _;
use hyper::body::Body as _;
use hyper::{HeaderMap, Method, StatusCode};
use serde::{Deserialize, Serialize};
use tokio::sync::{Semaphore, mpsc};

use crate::sidecar::metrics::{Metrics, SCRAPE_APP, SCRAPE_ENVOY, ScrapeType};

/// What one source may send (Istio's cap for app metrics).
pub const MAX_SCRAPE_BYTES: usize = 10 * 1024 * 1024;
/// The whole scrape's deadline when Prometheus does not send
/// `X-Prometheus-Scrape-Timeout-Seconds`.
pub const DEFAULT_SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest deadline a caller may ask for: the header is anyone's to send, and a
/// scrape holds connections to Envoy and the apps until then.
pub const MAX_SCRAPE_TIMEOUT: Duration = Duration::from_secs(30);
/// Merged scrapes served at once (Prometheus and a replica, an operator's curl); one
/// more is answered 503 at once rather than queued.
pub const MAX_CONCURRENT_SCRAPES: usize = 4;

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
    /// Envoy's Prometheus listener (`None` without Envoy, or with
    /// `PILOT_AGENT_MERGE_ENVOY_STATS=false`).
    pub envoy: Option<SocketAddr>,
    pub apps: Arc<Vec<ScrapeTarget>>,
    /// One per merged scrape in progress.
    permits: Arc<Semaphore>,
}

/// The merged exposition as it is produced.
pub type MergedBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::convert::Infallible>;

impl MetricsMerge {
    pub fn new(metrics: Arc<Metrics>, envoy: Option<SocketAddr>, apps: Vec<ScrapeTarget>) -> Self {
        Self {
            metrics,
            envoy,
            apps: Arc::new(apps),
            permits: Arc::new(Semaphore::new(MAX_CONCURRENT_SCRAPES)),
        }
    }

    /// Starts a merged scrape and returns its body, streamed as the parts arrive: the
    /// agent's metrics, then Envoy's, then the apps' (an OpenMetrics `# EOF` must come
    /// last, so every part's is dropped); `query` is passed on to Envoy (e.g.
    /// `usedonly`). Memory stays a few frames, whatever a source sends. `None` when
    /// `MAX_CONCURRENT_SCRAPES` are already running (the caller answers 503).
    pub fn scrape(&self, query: Option<&str>, headers: &HeaderMap) -> Option<MergedBody> {
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            tracing::warn!(limit = MAX_CONCURRENT_SCRAPES, "merged metrics scrape refused: too many at once");
            return None;
        };
        self.metrics.scrapes.inc();
        let deadline = tokio::time::Instant::now() + scrape_timeout(headers);
        let (tx, rx) = mpsc::channel::<Bytes>(4);
        let me = self.clone();
        let query = query.filter(|q| !q.is_empty()).map(String::from);
        tokio::spawn(async move {
            let _permit = permit;
            // A caller that goes away ends the scrape (and frees its permit) at once.
            let gone = tx.clone();
            tokio::select! {
                _ = gone.closed() => {}
                _ = tokio::time::timeout_at(deadline, me.produce(query, deadline, tx)) => {}
            }
        });
        let frames = tokio_stream::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), |chunk| {
            Ok(hyper::body::Frame::data(chunk))
        });
        Some(http_body_util::StreamBody::new(frames).boxed_unsync())
    }

    /// Connects to every source at once, then copies each part in order into `tx`.
    async fn produce(self, query: Option<String>, deadline: tokio::time::Instant, tx: mpsc::Sender<Bytes>) {
        let envoy = async {
            let address = self.envoy?;
            let path = match &query {
                Some(q) => format!("/stats/prometheus?{q}"),
                None => "/stats/prometheus".into(),
            };
            self.open(address, path, deadline, &SCRAPE_ENVOY).await
        };
        let apps = futures::future::join_all(self.apps.iter().map(|t| {
            self.open(SocketAddr::from(([127, 0, 0, 1], t.port)), t.path.clone(), deadline, &SCRAPE_APP)
        }));
        let (envoy, apps) = tokio::join!(envoy, apps);
        let mut agent = LineFilter::default();
        let mut own = agent.push(self.metrics.encode().as_bytes());
        own.extend_from_slice(&agent.finish());
        if tx.send(own.freeze()).await.is_err() {
            return;
        }
        for source in envoy.into_iter().chain(apps.into_iter().flatten()) {
            if !self.copy(source, &tx).await {
                return;
            }
        }
    }

    /// A source's answer, headers received (its body still to read), or `None` (logged
    /// and counted).
    async fn open(
        &self,
        address: SocketAddr,
        path: String,
        deadline: tokio::time::Instant,
        kind: &'static ScrapeType,
    ) -> Option<Source> {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let failed = |error: String| {
            tracing::warn!(source = kind.r#type, url = %format!("http://{address}{path}"), error = %error, "failed scraping metrics");
            self.metrics.scrape_failures.get_or_create(kind).inc();
            None
        };
        match crate::sidecar::envoy::admin::request_stream(address, Method::GET, &path, left).await {
            // A body declared larger than the cap is left out whole, as pilot-agent
            // drops an oversized target; one that only turns out larger is cut there.
            Ok((StatusCode::OK, body)) if body.size_hint().lower() > MAX_SCRAPE_BYTES as u64 => {
                failed(format!("{} bytes declared, more than {MAX_SCRAPE_BYTES}", body.size_hint().lower()))
            }
            Ok((StatusCode::OK, body)) => Some(Source { address, path, kind, body }),
            Ok((status, _)) => failed(format!("HTTP {status}")),
            Err(e) => failed(crate::error_chain(&e)),
        }
    }

    /// Copies `source`'s body into `tx` without its `# EOF` lines, whole lines only,
    /// up to `MAX_SCRAPE_BYTES`. False when the caller went away.
    async fn copy(&self, mut source: Source, tx: &mpsc::Sender<Bytes>) -> bool {
        let mut lines = LineFilter::default();
        let mut read = 0usize;
        let mut failure = None;
        while let Some(frame) = source.body.frame().await {
            let data = match frame.map(hyper::body::Frame::into_data) {
                Ok(Ok(data)) => data,
                Ok(Err(_)) => continue,
                Err(e) => {
                    failure = Some(e.to_string());
                    break;
                }
            };
            read += data.len();
            if read > MAX_SCRAPE_BYTES {
                failure = Some(format!("more than {MAX_SCRAPE_BYTES} bytes; the rest is left out"));
                break;
            }
            let out = lines.push(&data);
            if !out.is_empty() && tx.send(out.freeze()).await.is_err() {
                return false;
            }
        }
        if let Some(error) = failure {
            let url = format!("http://{}{}", source.address, source.path);
            tracing::warn!(source = source.kind.r#type, url = %url, error = %error, "failed scraping metrics");
            self.metrics.scrape_failures.get_or_create(source.kind).inc();
        }
        let rest = lines.finish();
        rest.is_empty() || tx.send(rest.freeze()).await.is_ok()
    }
}

/// One source being read.
struct Source {
    address: SocketAddr,
    path: String,
    kind: &'static ScrapeType,
    body: hyper::body::Incoming,
}

/// Passes whole lines through, except OpenMetrics' `# EOF`; a line split across frames
/// waits for its end.
#[derive(Default)]
struct LineFilter {
    partial: BytesMut,
}

impl LineFilter {
    fn push(&mut self, data: &[u8]) -> BytesMut {
        let mut out = BytesMut::new();
        self.partial.extend_from_slice(data);
        let Some(last) = self.partial.iter().rposition(|b| *b == b'\n') else { return out };
        let complete = self.partial.split_to(last + 1);
        for line in complete.split_inclusive(|b| *b == b'\n') {
            if line.trim_ascii() != b"# EOF" {
                out.extend_from_slice(line);
            }
        }
        out
    }

    /// The last line, ended with a newline (unless it is `# EOF` or there is none).
    fn finish(&mut self) -> BytesMut {
        let mut rest = std::mem::take(&mut self.partial);
        if rest.trim_ascii() == b"# EOF" || rest.is_empty() {
            return BytesMut::new();
        }
        rest.extend_from_slice(b"\n");
        rest
    }
}

/// Appends one exposition without its `# EOF`, ending in a newline.
pub fn push_part(out: &mut BytesMut, part: &[u8]) {
    let mut lines = LineFilter::default();
    out.extend_from_slice(&lines.push(part));
    out.extend_from_slice(&lines.finish());
}

/// Prometheus's `X-Prometheus-Scrape-Timeout-Seconds`, else the default; at most
/// `MAX_SCRAPE_TIMEOUT` (any client can send a larger one), and a value no duration
/// can hold is the default too, not a panic.
fn scrape_timeout(headers: &HeaderMap) -> Duration {
    headers
        .get("x-prometheus-scrape-timeout-seconds")
        .and_then(|v| v.to_str().ok()?.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .map_or(DEFAULT_SCRAPE_TIMEOUT, |t| t.min(MAX_SCRAPE_TIMEOUT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sidecar::metrics::Metrics;

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

    /// The header is anyone's to send: a scrape never waits on its sources longer
    /// than 30 s.
    #[test]
    fn a_callers_scrape_timeout_is_capped() {
        let mut headers = HeaderMap::new();
        headers.insert("x-prometheus-scrape-timeout-seconds", "3600".parse().unwrap());
        assert_eq!(scrape_timeout(&headers), Duration::from_secs(30));
        headers.insert("x-prometheus-scrape-timeout-seconds", "12".parse().unwrap());
        assert_eq!(scrape_timeout(&headers), Duration::from_secs(12));
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

    /// A localhost server answering `GET <path>` with `body(path)`, or, for a path
    /// the closure leaves out, a 404.
    async fn serving(body: impl Fn(&str) -> Option<Bytes> + Clone + Send + Sync + 'static) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(crate::support::http1::serve(listener, move |req: hyper::Request<_>, _| {
            let answer = body(req.uri().path());
            async move {
                let mut r =
                    hyper::Response::new(http_body_util::Full::new(answer.clone().unwrap_or_default()));
                if answer.is_none() {
                    *r.status_mut() = StatusCode::NOT_FOUND;
                }
                r
            }
        }));
        port
    }

    /// A port nothing listens on.
    fn closed_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    async fn merged(merge: &MetricsMerge) -> String {
        let body = merge.scrape(None, &HeaderMap::new()).expect("a scrape permit");
        String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap()
    }

    fn position(text: &str, needle: &str) -> usize {
        text.find(needle).unwrap_or_else(|| panic!("no {needle:?} in {text}"))
    }

    /// `prometheus.istio.io/scrape-targets: "A:/metrics,B,C:/custom"`, as the injector
    /// writes it into `ISTIO_PROMETHEUS_ANNOTATIONS`: every target's path is scraped
    /// and merged after the agent's and Envoy's metrics, in the annotation's order; a
    /// target that is down is left out and counted as an application scrape failure
    /// in the same scrape; no `# EOF` survives the merge.
    #[tokio::test]
    async fn scrape_targets_merge_in_order_and_a_failing_one_is_counted_and_left_out() {
        let by_path = |name: &'static str| {
            move |path: &str| Some(Bytes::from(format!("{name}{{path=\"{path}\"}} 1\n# EOF\n")))
        };
        let (a, c, envoy) = (
            serving(by_path("app_a")).await,
            serving(by_path("app_c")).await,
            serving(by_path("envoy_x")).await,
        );
        let down = closed_port();
        let json = format!(
            r#"{{"scrape":"true","port":"{a}","path":"/metrics","targets":[{{"port":"{a}","path":"/metrics"}},{{"port":"{down}"}},{{"port":"{c}","path":"/custom"}}]}}"#
        );
        let targets = parse_scrape_config(Some(&json), 15020).unwrap();
        let merge = MetricsMerge::new(
            Arc::new(Metrics::new()),
            Some(SocketAddr::from(([127, 0, 0, 1], envoy))),
            targets,
        );
        let text = merged(&merge).await;
        let order = [
            position(&text, "istio_agent_scrapes_total 1"),
            position(&text, "envoy_x{path=\"/stats/prometheus\"} 1"),
            position(&text, "app_a{path=\"/metrics\"} 1"),
            position(&text, "app_c{path=\"/custom\"} 1"),
        ];
        assert!(order.is_sorted(), "{order:?}: {text}");
        assert!(text.contains("istio_agent_scrape_failures_total{type=\"application\"} 1\n"), "{text}");
        assert!(!text.contains("type=\"envoy\"} 1"), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
    }

    /// pilot-agent caps each target at 10 MiB and drops one that sends more, counting
    /// it: a target declaring a larger body contributes nothing (not its first 10 MiB),
    /// the others are still merged.
    #[tokio::test]
    async fn a_scrape_target_declaring_more_than_10_mib_is_left_out_whole_and_counted() {
        let line = "big_metric_total 1\n";
        let big = Bytes::from(line.repeat(MAX_SCRAPE_BYTES / line.len() + 1));
        assert!(big.len() > MAX_SCRAPE_BYTES);
        let huge = serving(move |_: &str| Some(big.clone())).await;
        let small = serving(|_: &str| Some(Bytes::from_static(b"small_metric 1\n"))).await;
        let targets = vec![
            ScrapeTarget { port: huge, path: "/metrics".into() },
            ScrapeTarget { port: small, path: "/metrics".into() },
        ];
        let merge = MetricsMerge::new(Arc::new(Metrics::new()), None, targets);
        let text = merged(&merge).await;
        assert!(text.contains("small_metric 1\n"), "{}", &text[..text.len().min(2000)]);
        assert!(!text.contains("big_metric_total"), "{} bytes merged", text.len());
        assert!(text.contains("istio_agent_scrape_failures_total{type=\"application\"} 1\n"));
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
