//! What the control plane saw: every stream it accepted or refused (with the metadata
//! that decided it) and every request on them, with nonces and ACK/NACK, in arrival
//! order; waiters are woken on each new entry.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::Notify;

/// One request as received.
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

impl RecordedRequest {
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
    pub(crate) fn record(&self, request: RecordedRequest) {
        self.inner.0.lock().expect("log lock").requests.push(request);
        self.inner.1.notify_waiters();
    }

    pub(crate) fn record_stream(&self, stream: RecordedStream) {
        self.inner.0.lock().expect("log lock").streams.push(stream);
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
