//! List+watch of one Kubernetes collection on the agent's own small client, what
//! client-go's reflector does: LIST (the objects and the list's `resourceVersion`),
//! then WATCH from that version with bookmarks (`allowWatchBookmarks=true`, each
//! bookmark moves the version on without an object), a server-side timeout after which
//! the watch is opened again from the last version, and a new LIST when the version has
//! expired (`410 Gone`, as an HTTP status or as an `ERROR` event). Connection failures
//! back off (200 ms doubling to 30 s) and resume from the last version. The consumer
//! gets [`WatchEvent`]s: `Listed` with every object after each LIST (it replaces what it
//! held), then `Applied` and `Deleted`.

use std::time::Duration;

use bytes::BytesMut;
use http_body_util::BodyExt as _;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::node::cni::kube::{KubeClient, KubeError};

/// How long the API server keeps one watch open before the agent opens the next.
pub const WATCH_TIMEOUT: Duration = Duration::from_secs(290);
const BACKOFF_START: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A watch event line larger than this is refused (a Pod is a few KiB).
const MAX_LINE: usize = 16 * 1024 * 1024;

/// What a collection's watch yields.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchEvent<T> {
    /// Every object after a LIST: the full state.
    Listed(Vec<T>),
    Applied(T),
    Deleted(T),
}

/// Why one LIST or WATCH round failed.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error(transparent)]
    Kube(#[from] KubeError),
    #[error("the resource version expired (410 Gone): listing again")]
    Expired,
    #[error("watch {path}: {message}")]
    Stream { path: String, message: String },
}

/// One collection: its path (`/api/v1/pods`), a selector (`fieldSelector=spec.nodeName%3Dn1`,
/// or empty) and how its objects are read.
pub struct Collection<T> {
    pub path: String,
    pub selector: String,
    pub parse: fn(serde_json::Value) -> Result<T, serde_json::Error>,
    /// For logs: `pods`, `namespaces`.
    pub kind: &'static str,
}

impl<T> Collection<T> {
    fn url(&self, extra: &str) -> String {
        let mut query: Vec<&str> = Vec::new();
        if !self.selector.is_empty() {
            query.push(&self.selector);
        }
        if !extra.is_empty() {
            query.push(extra);
        }
        if query.is_empty() { self.path.clone() } else { format!("{}?{}", self.path, query.join("&")) }
    }
}

/// Lists and watches `c` until `stop`, sending events to `out`. Returns when `stop` is
/// cancelled or `out` is closed.
pub async fn run<T: Send>(
    client: &KubeClient,
    c: &Collection<T>,
    out: mpsc::Sender<WatchEvent<T>>,
    stop: CancellationToken,
) {
    let mut version: Option<String> = None;
    let mut backoff = BACKOFF_START;
    loop {
        let round = async {
            if version.is_none() {
                let (items, listed) = list(client, c).await?;
                version = Some(listed);
                if out.send(WatchEvent::Listed(items)).await.is_err() {
                    return Ok(false);
                }
            }
            watch(client, c, &mut version, &out).await
        };
        let result = tokio::select! {
            () = stop.cancelled() => return,
            r = round => r,
        };
        match result {
            Ok(true) => backoff = BACKOFF_START,
            Ok(false) => return,
            Err(WatchError::Expired) => {
                tracing::info!(kind = c.kind, "watch version expired: listing again");
                version = None;
            }
            Err(e) => {
                tracing::warn!(kind = c.kind, error = %crate::error_chain(&e), retry_in = ?backoff, "list/watch failed");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// LIST: the objects and the list's resource version.
async fn list<T>(client: &KubeClient, c: &Collection<T>) -> Result<(Vec<T>, String), WatchError> {
    let url = c.url("");
    let value = client.get_json(&url).await?;
    let version = value["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_string();
    // The items are moved out, never copied: a list can be tens of MiB.
    let listed = match value {
        serde_json::Value::Object(mut fields) => match fields.remove("items") {
            Some(serde_json::Value::Array(items)) => items,
            _ => Vec::new(),
        },
        _ => Vec::new(),
    };
    let mut items = Vec::new();
    for item in listed {
        match (c.parse)(item) {
            Ok(t) => items.push(t),
            Err(e) => tracing::warn!(kind = c.kind, error = %e, "listed object left out: it does not parse"),
        }
    }
    Ok((items, version))
}

/// One WATCH from `version` until the server ends it (`Ok(true)`), the consumer is gone
/// (`Ok(false)`), or it fails.
async fn watch<T>(
    client: &KubeClient,
    c: &Collection<T>,
    version: &mut Option<String>,
    out: &mpsc::Sender<WatchEvent<T>>,
) -> Result<bool, WatchError> {
    let from = version.clone().unwrap_or_default();
    let url = c.url(&format!(
        "watch=1&allowWatchBookmarks=true&timeoutSeconds={}&resourceVersion={from}",
        WATCH_TIMEOUT.as_secs()
    ));
    let response = client.open_stream(&url).await?;
    match response.status().as_u16() {
        200 => {}
        410 => return Err(WatchError::Expired),
        status => {
            let body = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let message: String = String::from_utf8_lossy(&body).chars().take(300).collect();
            return Err(WatchError::Stream { path: url, message: format!("HTTP {status}: {message}") });
        }
    }
    let mut body = response.into_body();
    let mut lines = Lines::default();
    loop {
        let frame = match body.frame().await {
            None => return Ok(true),
            Some(Err(e)) => return Err(WatchError::Stream { path: url, message: e.to_string() }),
            Some(Ok(frame)) => frame,
        };
        let Ok(data) = frame.into_data() else { continue };
        lines.push(&data);
        while let Some(line) = lines.next_line() {
            if !handle_line(c, &line[..line.len() - 1], version, out).await? {
                return Ok(false);
            }
        }
        if lines.pending() > MAX_LINE {
            return Err(WatchError::Stream { path: url, message: format!("an event over {MAX_LINE} bytes") });
        }
    }
}

/// A watch stream cut into lines, each byte looked at once however the stream is cut
/// into frames (a line sent a byte at a time is not scanned again from its start at
/// every byte).
#[derive(Default)]
struct Lines {
    buf: BytesMut,
    /// How much of `buf` holds no newline (already looked at).
    scanned: usize,
    /// Bytes looked at for a newline, in all (for the test).
    examined: usize,
}

impl Lines {
    fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole line, with its newline.
    fn next_line(&mut self) -> Option<BytesMut> {
        let fresh = &self.buf[self.scanned..];
        match fresh.iter().position(|b| *b == b'\n') {
            Some(at) => {
                self.examined += at + 1;
                let line = self.buf.split_to(self.scanned + at + 1);
                self.scanned = 0;
                Some(line)
            }
            None => {
                self.examined += fresh.len();
                self.scanned = self.buf.len();
                None
            }
        }
    }

    /// Bytes of a line not ended yet.
    fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// One event line; `Ok(false)` when the consumer is gone.
async fn handle_line<T>(
    c: &Collection<T>,
    line: &[u8],
    version: &mut Option<String>,
    out: &mpsc::Sender<WatchEvent<T>>,
) -> Result<bool, WatchError> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(true);
    }
    let event: serde_json::Value = serde_json::from_slice(line).map_err(|e| WatchError::Stream {
        path: c.path.clone(),
        message: format!("an event is not JSON: {e}"),
    })?;
    let object = event["object"].clone();
    let kind = event["type"].as_str().unwrap_or_default();
    if kind == "ERROR" {
        if object["code"].as_u64() == Some(410) {
            return Err(WatchError::Expired);
        }
        let message = object["message"].as_str().unwrap_or("(no message)").to_string();
        return Err(WatchError::Stream { path: c.path.clone(), message: format!("ERROR event: {message}") });
    }
    if let Some(v) = object["metadata"]["resourceVersion"].as_str() {
        *version = Some(v.to_string());
    }
    let parsed = match kind {
        "BOOKMARK" => return Ok(true),
        "ADDED" | "MODIFIED" | "DELETED" => (c.parse)(object),
        other => {
            tracing::warn!(kind = c.kind, event = other, "unknown watch event type: ignored");
            return Ok(true);
        }
    };
    let object = match parsed {
        Ok(o) => o,
        Err(e) => {
            tracing::warn!(kind = c.kind, error = %e, "watched object left out: it does not parse");
            return Ok(true);
        }
    };
    let event = if kind == "DELETED" { WatchEvent::Deleted(object) } else { WatchEvent::Applied(object) };
    Ok(out.send(event).await.is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collection() -> Collection<serde_json::Value> {
        Collection {
            path: "/api/v1/pods".into(),
            selector: "fieldSelector=spec.nodeName%3Dn1".into(),
            parse: Ok,
            kind: "pods",
        }
    }

    #[tokio::test]
    async fn lines_move_the_version_and_become_events() {
        let c = collection();
        let (tx, mut rx) = mpsc::channel(8);
        let mut version = Some("1".to_string());
        let added = br#"{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"5"}}}"#;
        assert!(handle_line(&c, added, &mut version, &tx).await.unwrap());
        assert_eq!(version.as_deref(), Some("5"));
        assert!(matches!(rx.recv().await, Some(WatchEvent::Applied(v)) if v["metadata"]["name"] == "a"));
        let bookmark = br#"{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"9"}}}"#;
        assert!(handle_line(&c, bookmark, &mut version, &tx).await.unwrap());
        assert_eq!(version.as_deref(), Some("9"), "a bookmark moves the version on");
        assert!(rx.try_recv().is_err(), "and yields no event");
        let gone = br#"{"type":"ERROR","object":{"kind":"Status","code":410,"message":"too old"}}"#;
        assert!(matches!(handle_line(&c, gone, &mut version, &tx).await, Err(WatchError::Expired)));
        let deleted = br#"{"type":"DELETED","object":{"metadata":{"name":"a","resourceVersion":"10"}}}"#;
        assert!(handle_line(&c, deleted, &mut version, &tx).await.unwrap());
        assert!(matches!(rx.recv().await, Some(WatchEvent::Deleted(_))));
        let e = handle_line(&c, b"{nope", &mut version, &tx).await.unwrap_err().to_string();
        assert!(e.contains("not JSON"), "{e}");
    }

    /// A 1 MiB line sent a byte at a time is looked at once, not once per byte again
    /// from its start (before: 1 MiB²/2 bytes scanned; a 16 MiB line, ~10^14).
    #[test]
    fn a_long_line_in_tiny_frames_is_scanned_once() {
        let mut lines = Lines::default();
        let line = vec![b'x'; 1 << 20];
        for byte in &line {
            lines.push(std::slice::from_ref(byte));
            assert!(lines.next_line().is_none());
        }
        lines.push(b"\n{}\n");
        assert_eq!(lines.next_line().map(|l| l.len()), Some(line.len() + 1));
        assert_eq!(lines.next_line().as_deref(), Some(&b"{}\n"[..]));
        assert!(lines.next_line().is_none() && lines.pending() == 0);
        let total = line.len() + 4;
        assert!(lines.examined <= total, "{} bytes examined for {total}", lines.examined);
    }

    #[test]
    fn urls_carry_the_selector() {
        let c = collection();
        assert_eq!(c.url(""), "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1");
        assert_eq!(c.url("watch=1"), "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1&watch=1");
        let all = Collection::<serde_json::Value> { selector: String::new(), ..c };
        assert_eq!(all.url(""), "/api/v1/pods");
    }
}
