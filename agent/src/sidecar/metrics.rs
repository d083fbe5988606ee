//! The agent's own Prometheus metrics, with Istio's names (prefix `istio_agent_`), in one
//! registry the status server exposes (merged with Envoy's and the app's).

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use std::{
    collections::BTreeMap,
    sync::{Mutex, atomic::AtomicU64},
    time::SystemTime,
};

/// How a connection ended: Istio's `type` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Termination {
    pub r#type: &'static str,
}

/// Which outgoing request: Istio's `request_type` label (`csr` for the CA).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestType {
    pub request_type: &'static str,
}

pub const CSR: RequestType = RequestType { request_type: "csr" };

/// Which secret: Istio's `resource_name` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceName {
    pub resource_name: String,
}

/// Which scrape failed: Istio's `type` label (`envoy`, `application`, `agent`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScrapeType {
    pub r#type: &'static str,
}

pub const SCRAPE_ENVOY: ScrapeType = ScrapeType { r#type: "envoy" };
pub const SCRAPE_APP: ScrapeType = ScrapeType { r#type: "application" };

/// Istio's `result` label of `wasm_remote_fetch_count`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FetchResult {
    pub result: &'static str,
}

pub const CANCELLED: Termination = Termination { r#type: "cancelled" };
pub const ERROR: Termination = Termination { r#type: "error" };

/// Every agent metric.
pub struct Metrics {
    registry: Registry,
    pub xds_proxy_requests: Counter,
    pub xds_proxy_responses: Counter,
    pub istiod_connection_failures: Counter,
    pub istiod_connection_terminations: Family<Termination, Counter>,
    pub envoy_connection_terminations: Family<Termination, Counter>,
    pub dns_requests: Counter,
    pub dns_upstream_requests: Counter,
    pub dns_upstream_failures: Counter,
    pub dns_upstream_request_duration: Histogram,
    /// Derived at scrape time from `cert_expiries`, as Istio's derived gauge.
    cert_expiry_seconds: Family<ResourceName, Gauge<f64, AtomicU64>>,
    cert_expiries: Mutex<BTreeMap<String, SystemTime>>,
    /// Milliseconds, summed.
    pub outgoing_latency: Family<RequestType, Counter<f64, AtomicU64>>,
    pub num_outgoing_requests: Family<RequestType, Counter>,
    pub num_failed_outgoing_requests: Family<RequestType, Counter>,
    pub scrapes: Counter,
    pub scrape_failures: Family<ScrapeType, Counter>,
    pub wasm_remote_fetches: Family<FetchResult, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut root = Registry::with_prefix("istio_agent");
        let m = Self {
            registry: Registry::default(),
            xds_proxy_requests: Counter::default(),
            xds_proxy_responses: Counter::default(),
            istiod_connection_failures: Counter::default(),
            istiod_connection_terminations: Family::default(),
            envoy_connection_terminations: Family::default(),
            dns_requests: Counter::default(),
            dns_upstream_requests: Counter::default(),
            dns_upstream_failures: Counter::default(),
            dns_upstream_request_duration: Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
            cert_expiry_seconds: Family::default(),
            cert_expiries: Mutex::default(),
            outgoing_latency: Family::default(),
            num_outgoing_requests: Family::default(),
            num_failed_outgoing_requests: Family::default(),
            scrapes: Counter::default(),
            scrape_failures: Family::default(),
            wasm_remote_fetches: Family::default(),
        };
        root.register(
            "xds_proxy_requests",
            "The total number of Xds Proxy Requests",
            m.xds_proxy_requests.clone(),
        );
        root.register(
            "xds_proxy_responses",
            "The total number of Xds Proxy Responses",
            m.xds_proxy_responses.clone(),
        );
        root.register(
            "istiod_connection_failures",
            "The total number of connection failures to Istiod",
            m.istiod_connection_failures.clone(),
        );
        root.register(
            "istiod_connection_terminations",
            "The total number of connection errors to Istiod",
            m.istiod_connection_terminations.clone(),
        );
        root.register(
            "envoy_connection_terminations",
            "The total number of connection errors from envoy",
            m.envoy_connection_terminations.clone(),
        );
        root.register("dns_requests", "Total number of DNS requests.", m.dns_requests.clone());
        root.register(
            "dns_upstream_requests",
            "Total number of DNS requests forwarded to upstream DNS servers.",
            m.dns_upstream_requests.clone(),
        );
        root.register(
            "dns_upstream_failures",
            "Total number of DNS failures forwarding to upstream DNS servers.",
            m.dns_upstream_failures.clone(),
        );
        root.register(
            "dns_upstream_request_duration_seconds",
            "Total time in seconds Istio takes to get DNS response from upstream.",
            m.dns_upstream_request_duration.clone(),
        );
        root.register(
            "cert_expiry_seconds",
            "The time remaining, in seconds, before the certificate chain will expire. A negative value indicates the cert is expired.",
            m.cert_expiry_seconds.clone(),
        );
        root.register(
            "outgoing_latency",
            "The latency of outgoing requests (e.g. to a token exchange server, CA, etc.) in milliseconds.",
            m.outgoing_latency.clone(),
        );
        root.register(
            "num_outgoing_requests",
            "Number of total outgoing requests (e.g. to a token exchange server, CA, etc.)",
            m.num_outgoing_requests.clone(),
        );
        root.register(
            "num_failed_outgoing_requests",
            "Number of failed outgoing requests (e.g. to a token exchange server, CA, etc.)",
            m.num_failed_outgoing_requests.clone(),
        );
        root.register("scrapes", "The total number of scrapes.", m.scrapes.clone());
        root.register("scrape_failures", "The total number of failed scrapes.", m.scrape_failures.clone());
        root.register(
            "wasm_remote_fetch_count",
            "number of Wasm remote fetches and results, including success, download failure, and checksum mismatch",
            m.wasm_remote_fetches.clone(),
        );
        Self { registry: root, ..m }
    }

    /// Records when the certificate served as `resource` expires.
    pub fn set_cert_expiry(&self, resource: &str, not_after: SystemTime) {
        self.cert_expiries.lock().expect("metrics lock").insert(resource.into(), not_after);
    }

    /// Stops reporting `resource`'s expiry (a file resource no stream asks for).
    pub fn clear_cert_expiry(&self, resource: &str) {
        self.cert_expiries.lock().expect("metrics lock").remove(resource);
        self.cert_expiry_seconds.remove(&ResourceName { resource_name: resource.into() });
    }

    /// The metrics in Prometheus text format.
    pub fn encode(&self) -> String {
        let now = SystemTime::now();
        for (resource, not_after) in self.cert_expiries.lock().expect("metrics lock").iter() {
            let left = match not_after.duration_since(now) {
                Ok(d) => d.as_secs_f64(),
                Err(e) => -e.duration().as_secs_f64(),
            };
            self.cert_expiry_seconds
                .get_or_create(&ResourceName { resource_name: resource.clone() })
                .set(left);
        }
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_follow_istio() {
        let m = Metrics::new();
        m.xds_proxy_requests.inc();
        m.istiod_connection_terminations.get_or_create(&ERROR).inc();
        m.dns_requests.inc();
        let text = m.encode();
        assert!(text.contains("istio_agent_xds_proxy_requests_total 1"), "{text}");
        assert!(
            text.contains("istio_agent_istiod_connection_terminations_total{type=\"error\"} 1"),
            "{text}"
        );
        assert!(text.contains("istio_agent_dns_requests_total 1"), "{text}");
        assert!(text.contains("istio_agent_dns_upstream_failures_total 0"), "{text}");
        m.num_failed_outgoing_requests.get_or_create(&CSR).inc();
        m.set_cert_expiry("default", SystemTime::now() + std::time::Duration::from_secs(100));
        let text = m.encode();
        assert!(
            text.contains("istio_agent_num_failed_outgoing_requests_total{request_type=\"csr\"} 1"),
            "{text}"
        );
        let line = text.lines().find(|l| l.starts_with("istio_agent_cert_expiry_seconds{")).unwrap();
        assert!(line.starts_with("istio_agent_cert_expiry_seconds{resource_name=\"default\"} 99."), "{line}");
    }
}
