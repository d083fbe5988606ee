//! The control plane's ADS server, SotW and Delta, over a snapshot.
//!
//! SotW: a response per subscribed type whenever the type's version changes, on the
//! first request for a type and when an ACK changes the resource names; requests with a
//! stale nonce are ignored, NACKs change nothing. Delta: per stream and type, the
//! versions sent are tracked and only changed resources (and removals) go out;
//! `initial_resource_versions` seed that state after a reconnect. Every push is sent to
//! every stream in order, unthrottled: a burst of pushes is a real flood.
//!
//! Streams are authenticated as istiod does when configured: the bearer token must
//! match and `ClusterID` must name the configured cluster, else UNAUTHENTICATED. The
//! server keeps no record of what it saw; an `AdsObserver` is told as it happens.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicU64, Ordering},
    },
};

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming, metadata::MetadataMap};
use weir_proto::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
    aggregated_discovery_service_server::AggregatedDiscoveryService,
};

use super::{
    observe::{AdsObserver, ObservedRequest, ObservedStream},
    snapshot::{Snapshot, TypeSnapshot},
};

/// What a stream must present, as istiod's authenticators check it.
#[derive(Debug, Clone, Default)]
pub struct AuthPolicy {
    /// The only accepted bearer token (`None`: no token needed).
    pub token: Option<String>,
    /// The only accepted `ClusterID` (`None`: any).
    pub cluster_id: Option<String>,
}

/// The ADS server. Clones share state.
#[derive(Clone)]
pub struct AdsServer {
    inner: Arc<Inner>,
}

struct Inner {
    snapshot: Mutex<Arc<Snapshot>>,
    streams: Mutex<HashMap<u64, StreamHandle>>,
    auth: AuthPolicy,
    observer: RwLock<Option<Arc<dyn AdsObserver>>>,
    next_stream: AtomicU64,
    nonce: AtomicU64,
}

struct StreamHandle {
    pushes: mpsc::UnboundedSender<Arc<Snapshot>>,
    kill: mpsc::UnboundedSender<Status>,
}

impl AdsServer {
    pub fn new(snapshot: Snapshot, auth: AuthPolicy) -> Self {
        Self {
            inner: Arc::new(Inner {
                snapshot: Mutex::new(Arc::new(snapshot)),
                streams: Mutex::new(HashMap::new()),
                auth,
                observer: RwLock::new(None),
                next_stream: AtomicU64::new(0),
                nonce: AtomicU64::new(0),
            }),
        }
    }

    /// Tells `observer` about every later stream and request (replacing any earlier
    /// observer).
    pub fn observe(&self, observer: Arc<dyn AdsObserver>) {
        *self.inner.observer.write().expect("observer lock") = Some(observer);
    }

    fn observer(&self) -> Option<Arc<dyn AdsObserver>> {
        self.inner.observer.read().expect("observer lock").clone()
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.inner.snapshot.lock().expect("snapshot lock").clone()
    }

    /// Installs `snapshot` and pushes it to every stream.
    pub fn push(&self, snapshot: Snapshot) {
        let snapshot = Arc::new(snapshot);
        *self.inner.snapshot.lock().expect("snapshot lock") = snapshot.clone();
        for handle in self.inner.streams.lock().expect("streams lock").values() {
            let _ = handle.pushes.send(snapshot.clone());
        }
    }

    /// Ends every open stream with `status` (at shutdown, so serving need not wait on
    /// them).
    pub(super) fn drop_streams(&self, status: Status) {
        for handle in self.inner.streams.lock().expect("streams lock").values() {
            let _ = handle.kill.send(status.clone());
        }
    }

    fn next_nonce(&self) -> String {
        format!("{:x}", self.inner.nonce.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// Checks the stream's credentials (and tells the observer what was decided).
    fn admit(&self, metadata: &MetadataMap, delta: bool) -> Result<u64, Status> {
        let stream = self.inner.next_stream.fetch_add(1, Ordering::Relaxed) + 1;
        let text = |k: &str| metadata.get(k).and_then(|v| v.to_str().ok());
        let mut refused = None;
        if let Some(token) = &self.inner.auth.token {
            let presented = text("authorization").and_then(|a| a.strip_prefix("Bearer "));
            if presented != Some(token.as_str()) {
                refused = Some(match presented {
                    None => "authentication failure: no bearer token".to_string(),
                    Some(_) => "authentication failure: the bearer token is not valid".to_string(),
                });
            }
        }
        if refused.is_none()
            && let Some(expected) = &self.inner.auth.cluster_id
            && text("clusterid") != Some(expected.as_str())
        {
            refused = Some(format!(
                "authentication failure: cluster {:?} is not known (expected {expected:?})",
                text("clusterid").unwrap_or("")
            ));
        }
        if let Some(observer) = self.observer() {
            observer.stream(ObservedStream { id: stream, delta, metadata, refused: refused.as_deref() });
        }
        match refused {
            Some(message) => Err(Status::unauthenticated(message)),
            None => Ok(stream),
        }
    }

    fn register(
        &self,
        stream: u64,
    ) -> (mpsc::UnboundedReceiver<Arc<Snapshot>>, mpsc::UnboundedReceiver<Status>) {
        let (pushes, push_rx) = mpsc::unbounded_channel();
        let (kill, kill_rx) = mpsc::unbounded_channel();
        self.inner.streams.lock().expect("streams lock").insert(stream, StreamHandle { pushes, kill });
        (push_rx, kill_rx)
    }

    fn unregister(&self, stream: u64) {
        self.inner.streams.lock().expect("streams lock").remove(&stream);
    }
}

/// Per-type SotW state of one stream.
#[derive(Default)]
struct SotwWatch {
    names: Vec<String>,
    nonce: String,
    version_sent: Option<String>,
}

/// Per-type Delta state of one stream.
#[derive(Default)]
struct DeltaWatch {
    wildcard: bool,
    names: BTreeSet<String>,
    /// name → version last sent (or reported by the client).
    sent: BTreeMap<String, String>,
}

type Out<T> = mpsc::Sender<Result<T, Status>>;

impl AdsServer {
    async fn run_sotw(
        self,
        stream: u64,
        mut requests: Streaming<DiscoveryRequest>,
        out: Out<DiscoveryResponse>,
    ) {
        let (mut pushes, mut kill) = self.register(stream);
        let mut watches: HashMap<String, SotwWatch> = HashMap::new();
        let mut snapshot = self.snapshot();
        'stream: loop {
            tokio::select! {
                Some(status) = kill.recv() => {
                    let _ = out.send(Err(status)).await;
                    break;
                }
                Some(next) = pushes.recv() => {
                    snapshot = next;
                    let mut ordered: Vec<_> = watches.iter_mut().collect();
                    ordered.sort_by_key(|(type_url, _)| push_order(type_url));
                    for (type_url, watch) in ordered {
                        if watch.version_sent.as_deref() != Some(snapshot.version(type_url))
                            && !self.send_sotw(&out, type_url, watch, &snapshot).await
                        {
                            break 'stream;
                        }
                    }
                }
                message = requests.message() => {
                    let Ok(Some(request)) = message else { break };
                    if let Some(observer) = self.observer() {
                        observer.request(ObservedRequest::Sotw { stream, request: &request });
                    }
                    let watch = watches.entry(request.type_url.clone()).or_default();
                    // A nonce on a type this stream has not answered yet is a client
                    // carrying state over a reconnect: answer it like a first request.
                    if !request.response_nonce.is_empty() && watch.version_sent.is_some() {
                        if request.response_nonce != watch.nonce || request.error_detail.is_some() {
                            // A stale nonce or a NACK: nothing to send.
                            continue;
                        }
                        if request.resource_names == watch.names {
                            continue;
                        }
                    }
                    watch.names = request.resource_names;
                    if !self.send_sotw(&out, &request.type_url, watch, &snapshot).await {
                        break;
                    }
                }
            }
        }
        self.unregister(stream);
    }

    async fn send_sotw(
        &self,
        out: &Out<DiscoveryResponse>,
        type_url: &str,
        watch: &mut SotwWatch,
        snapshot: &Snapshot,
    ) -> bool {
        let resources = match snapshot.get(type_url) {
            None => vec![],
            Some(t) if watch.names.is_empty() || watch.names.iter().any(|n| n == "*") => {
                t.resources.values().cloned().collect()
            }
            Some(t) => watch.names.iter().filter_map(|n| t.resources.get(n).cloned()).collect(),
        };
        let version = snapshot.version(type_url).to_string();
        watch.nonce = self.next_nonce();
        watch.version_sent = Some(version.clone());
        let response = DiscoveryResponse {
            version_info: version,
            resources,
            type_url: type_url.into(),
            nonce: watch.nonce.clone(),
            ..Default::default()
        };
        out.send(Ok(response)).await.is_ok()
    }

    async fn run_delta(
        self,
        stream: u64,
        mut requests: Streaming<DeltaDiscoveryRequest>,
        out: Out<DeltaDiscoveryResponse>,
    ) {
        let (mut pushes, mut kill) = self.register(stream);
        let mut watches: HashMap<String, DeltaWatch> = HashMap::new();
        let mut snapshot = self.snapshot();
        'stream: loop {
            tokio::select! {
                Some(status) = kill.recv() => {
                    let _ = out.send(Err(status)).await;
                    break;
                }
                Some(next) = pushes.recv() => {
                    snapshot = next;
                    let mut ordered: Vec<_> = watches.iter_mut().collect();
                    ordered.sort_by_key(|(type_url, _)| push_order(type_url));
                    for (type_url, watch) in ordered {
                        if !self.send_delta(&out, type_url, watch, &snapshot, false).await {
                            break 'stream;
                        }
                    }
                }
                message = requests.message() => {
                    let Ok(Some(request)) = message else { break };
                    if let Some(observer) = self.observer() {
                        observer.request(ObservedRequest::Delta { stream, request: &request });
                    }
                    let first = !watches.contains_key(&request.type_url);
                    let watch = watches.entry(request.type_url.clone()).or_default();
                    if first {
                        watch.wildcard = request.resource_names_subscribe.is_empty();
                        watch.sent = request.initial_resource_versions.clone().into_iter().collect();
                    }
                    for name in request.resource_names_subscribe {
                        if name == "*" {
                            watch.wildcard = true;
                        } else {
                            watch.names.insert(name);
                        }
                    }
                    for name in &request.resource_names_unsubscribe {
                        if name == "*" {
                            watch.wildcard = false;
                        } else {
                            watch.names.remove(name);
                        }
                        watch.sent.remove(name);
                    }
                    if !first && request.error_detail.is_some() {
                        // A NACK changes nothing.
                        continue;
                    }
                    if !self.send_delta(&out, &request.type_url, watch, &snapshot, first).await {
                        break;
                    }
                }
            }
        }
        self.unregister(stream);
    }

    /// Sends what changed for `type_url` since the last response; with `always`, sends
    /// even when nothing did (the first answer for a type, so the client's init ends).
    async fn send_delta(
        &self,
        out: &Out<DeltaDiscoveryResponse>,
        type_url: &str,
        watch: &mut DeltaWatch,
        snapshot: &Snapshot,
        always: bool,
    ) -> bool {
        let empty = TypeSnapshot::default();
        let current = snapshot.get(type_url).map(|t| t.as_ref()).unwrap_or(&empty);
        let wanted = |name: &str| watch.wildcard || watch.names.contains(name);
        let mut resources = Vec::new();
        for (name, resource) in &current.resources {
            if !wanted(name) {
                continue;
            }
            let version = TypeSnapshot::resource_version(resource);
            if watch.sent.get(name) != Some(&version) {
                watch.sent.insert(name.clone(), version.clone());
                resources.push(Resource {
                    name: name.clone(),
                    version,
                    resource: Some(resource.clone()),
                    ..Default::default()
                });
            }
        }
        let removed: Vec<String> =
            watch.sent.keys().filter(|n| !current.resources.contains_key(*n)).cloned().collect();
        for name in &removed {
            watch.sent.remove(name);
        }
        if resources.is_empty() && removed.is_empty() && !always {
            return true;
        }
        let response = DeltaDiscoveryResponse {
            system_version_info: current.version.clone(),
            resources,
            type_url: type_url.into(),
            removed_resources: removed,
            nonce: self.next_nonce(),
            ..Default::default()
        };
        out.send(Ok(response)).await.is_ok()
    }
}

/// Output buffer per stream: small, so a slow client pushes back on the server.
const OUT_BUFFER: usize = 8;

#[tonic::async_trait]
impl AggregatedDiscoveryService for AdsServer {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let stream = self.admit(request.metadata(), false)?;
        let (tx, rx) = mpsc::channel(OUT_BUFFER);
        let me = self.clone();
        tokio::spawn(async move { me.run_sotw(stream, request.into_inner(), tx).await });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let stream = self.admit(request.metadata(), true)?;
        let (tx, rx) = mpsc::channel(OUT_BUFFER);
        let me = self.clone();
        tokio::spawn(async move { me.run_delta(stream, request.into_inner(), tx).await });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The order a push sends types in, as istiod does: clusters before the endpoints,
/// listeners and routes that name them (an Envoy that got a listener first would reject
/// it for a cluster it does not know yet, and keep rejecting that version), then the rest.
fn push_order(type_url: &str) -> (u8, &str) {
    let rank = match type_url {
        weir_proto::type_url::CLUSTER => 0,
        weir_proto::type_url::ENDPOINT => 1,
        weir_proto::type_url::LISTENER => 2,
        weir_proto::type_url::ROUTE => 3,
        _ => 4,
    };
    (rank, type_url)
}
