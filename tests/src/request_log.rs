//! What the test control plane saw, for tests to assert on: every stream the ADS server
//! accepted or refused (with the metadata that decided it) and every request on them,
//! with nonces and ACK/NACK, in arrival order; waiters are woken on each new entry. It
//! is the ADS server's observer (`weir_agent::sidecar::controlplane::AdsObserver`) and keeps
//! everything, which only a test may.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::Notify;
use weir_agent::sidecar::controlplane::{AdsObserver, AdsServer, ObservedRequest, ObservedStream};

/// One request as received.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordedRequest {
    pub stream: u64,
    pub delta: bool,
    pub type_url: String,
    /// SotW `version_info` (empty for Delta).
    pub version_info: String,
    pub nonce: String,
    /// SotW `resource_names` or Delta `resource_names_subscribe`.
    pub names: Vec<String>,
    pub unsubscribe: Vec<String>,
    /// `error_detail.message` when this is a NACK (or an unhealthy report).
    pub error: Option<String>,
    /// `error_detail.code`, with the message.
    pub error_code: Option<i32>,
    /// The node id, when the request carried a node.
    pub node_id: Option<String>,
    /// The node's `cluster`, when the request carried a node.
    pub node_cluster: Option<String>,
    /// The node's metadata as JSON (whole numbers as integers), when it carried one.
    pub node_metadata: Option<serde_json::Value>,
}

impl RecordedRequest {
    /// A record holding what `node` says (id, cluster, metadata); the rest default.
    fn from_node(node: Option<&weir_proto::envoy::config::core::v3::Node>) -> Self {
        Self {
            node_id: node.map(|n| n.id.clone()),
            node_cluster: node.map(|n| n.cluster.clone()),
            node_metadata: node.and_then(|n| n.metadata.as_ref()).map(struct_json),
            ..Self::default()
        }
    }

    pub fn is_nack(&self) -> bool {
        self.error.is_some()
    }

    /// An ACK: answers a nonce and carries no error.
    pub fn is_ack(&self) -> bool {
        !self.nonce.is_empty() && self.error.is_none()
    }
}

/// One stream open attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedStream {
    pub stream: u64,
    pub delta: bool,
    pub authorization: Option<String>,
    pub cluster_id: Option<String>,
    /// Every metadata entry, lowercase names.
    pub metadata: Vec<(String, String)>,
    /// Why it was refused, if it was.
    pub refused: Option<String>,
}

/// The log. Clones share it.
#[derive(Debug, Clone, Default)]
pub struct RequestLog {
    inner: Arc<(Mutex<Entries>, Notify)>,
}

#[derive(Debug, Default)]
struct Entries {
    requests: Vec<RecordedRequest>,
    streams: Vec<RecordedStream>,
}

impl RequestLog {
    /// A new log told about everything `ads` sees from now on.
    pub fn observing(ads: &AdsServer) -> Self {
        let log = Self::default();
        ads.observe(Arc::new(log.clone()));
        log
    }

    fn add(&self, f: impl FnOnce(&mut Entries)) {
        f(&mut self.inner.0.lock().expect("log lock"));
        self.inner.1.notify_waiters();
    }

    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.inner.0.lock().expect("log lock").requests.clone()
    }

    pub fn streams(&self) -> Vec<RecordedStream> {
        self.inner.0.lock().expect("log lock").streams.clone()
    }

    /// Waits until `check` (over requests and streams) returns `Some`, or `timeout`.
    pub async fn wait_for<T>(
        &self,
        timeout: Duration,
        mut check: impl FnMut(&[RecordedRequest], &[RecordedStream]) -> Option<T>,
    ) -> Option<T> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.inner.1.notified();
            {
                let entries = self.inner.0.lock().expect("log lock");
                if let Some(found) = check(&entries.requests, &entries.streams) {
                    return Some(found);
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }
}

impl AdsObserver for RequestLog {
    fn stream(&self, stream: ObservedStream<'_>) {
        let text = |k: &str| stream.metadata.get(k).and_then(|v| v.to_str().ok()).map(String::from);
        let metadata = stream
            .metadata
            .iter()
            .filter_map(|kv| match kv {
                tonic::metadata::KeyAndValueRef::Ascii(k, v) => {
                    Some((k.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
                }
                tonic::metadata::KeyAndValueRef::Binary(..) => None,
            })
            .collect();
        let recorded = RecordedStream {
            stream: stream.id,
            delta: stream.delta,
            authorization: text("authorization"),
            cluster_id: text("clusterid"),
            metadata,
            refused: stream.refused.map(String::from),
        };
        self.add(|e| e.streams.push(recorded));
    }

    fn request(&self, request: ObservedRequest<'_>) {
        let recorded = match request {
            ObservedRequest::Sotw { stream, request } => RecordedRequest {
                stream,
                delta: false,
                type_url: request.type_url.clone(),
                version_info: request.version_info.clone(),
                nonce: request.response_nonce.clone(),
                names: request.resource_names.clone(),
                unsubscribe: vec![],
                error: request.error_detail.as_ref().map(|e| e.message.clone()),
                error_code: request.error_detail.as_ref().map(|e| e.code),
                ..RecordedRequest::from_node(request.node.as_ref())
            },
            ObservedRequest::Delta { stream, request } => RecordedRequest {
                stream,
                delta: true,
                type_url: request.type_url.clone(),
                version_info: String::new(),
                nonce: request.response_nonce.clone(),
                names: request.resource_names_subscribe.clone(),
                unsubscribe: request.resource_names_unsubscribe.clone(),
                error: request.error_detail.as_ref().map(|e| e.message.clone()),
                error_code: request.error_detail.as_ref().map(|e| e.code),
                ..RecordedRequest::from_node(request.node.as_ref())
            },
        };
        self.add(|e| e.requests.push(recorded));
    }
}

fn struct_json(s: &prost_types::Struct) -> serde_json::Value {
    serde_json::Value::Object(s.fields.iter().map(|(k, v)| (k.clone(), value_json(v))).collect())
}

fn value_json(v: &prost_types::Value) -> serde_json::Value {
    use prost_types::value::Kind;
    use serde_json::Value;
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(*b),
        Some(Kind::StringValue(s)) => Value::String(s.clone()),
        #[expect(clippy::cast_possible_truncation, reason = "only whole numbers within i64 are cast")]
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 9.0e15 => Value::from(*n as i64),
        Some(Kind::NumberValue(n)) => serde_json::Number::from_f64(*n).map_or(Value::Null, Value::Number),
        Some(Kind::StructValue(s)) => struct_json(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value_json).collect()),
    }
}
