//! The relay: serves ADS (SotW and Delta) to Envoy and, for each Envoy stream, opens a
//! fresh stream to istiod. Three tasks per connection (four with Wasm conversion):
//! - the downstream reader queues Envoy's requests for istiod on an unbounded channel,
//!   so it never waits on the response path (the deadlock of istio/istio#39209);
//! - the upstream pump hands istiod's responses to Envoy one at a time (a channel of
//!   one: Envoy's flow control reaches istiod), consuming agent-internal types (NDS)
//!   itself and ACKing or NACKing them, and dropping anything that is not an Envoy type;
//!   ECDS responses go to a fourth task that fetches their Wasm modules, in order, so
//!   a slow module server never holds the other types back;
//! - tonic's request body drains the unbounded channel into the upstream stream.
//!
//! An upstream error ends Envoy's stream with that status, so Envoy reconnects and
//! resends everything; Envoy going away closes the upstream; a new Envoy stream
//! replaces the previous one. After Envoy's first LDS request the agent adds its own
//! subscriptions (one per handler) and the last health report.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use prost_types::Any;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Request, Response, Status, Streaming};
use tracing::Instrument as _;
use weir_proto::{
    envoy::service::discovery::v3::{
        DeltaDiscoveryRequest, DiscoveryRequest,
        aggregated_discovery_service_server::AggregatedDiscoveryService,
    },
    type_url,
};

use super::{
    flavor::{Delta, Flavor, Health, Sotw, internal, is_envoy_type, short_type},
    upstream::UpstreamConfig,
};
use crate::sidecar::metrics::{CANCELLED, ERROR, Metrics, Termination};

/// Consumes one agent-internal resource; an `Err` becomes the NACK's message. The
/// pump awaits it before reading the next response (pilot-agent handles these in its
/// receive loop too), so a handler with heavy work does it off the runtime's thread.
pub type Handler = Arc<dyn Fn(Any) -> futures::future::BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// The stream Envoy reads responses from.
pub type ResponseStream<F> = ReceiverStream<Result<<F as Flavor>::Response, Status>>;

/// The XDS proxy. Cheap to clone; all clones share one state.
#[derive(Clone)]
pub struct XdsProxy {
    inner: Arc<Inner>,
}

struct Inner {
    upstream: UpstreamConfig,
    handlers: HashMap<String, Handler>,
    /// Rewrites remote Wasm modules in ECDS responses (None: passed as they are).
    wasm: Option<Arc<crate::sidecar::wasm::WasmConverter>>,
    health: watch::Sender<Option<Health>>,
    active: Mutex<Option<(u64, CancellationToken)>>,
    next_id: AtomicU64,
    metrics: Arc<Metrics>,
}

impl XdsProxy {
    /// A relay to `upstream` that consumes the types in `handlers` itself.
    pub fn new(upstream: UpstreamConfig, handlers: HashMap<String, Handler>, metrics: Arc<Metrics>) -> Self {
        let inner = Inner {
            upstream,
            handlers,
            wasm: None,
            health: watch::channel(None).0,
            active: Mutex::new(None),
            next_id: AtomicU64::new(0),
            metrics,
        };
        Self { inner: Arc::new(inner) }
    }

    /// Rewrites remote Wasm modules in ECDS responses with `converter` (call right
    /// after `new`, before the relay is shared).
    pub fn with_wasm(mut self, converter: Arc<crate::sidecar::wasm::WasmConverter>) -> Self {
        Arc::get_mut(&mut self.inner).expect("with_wasm before the relay is shared").wasm = Some(converter);
        self
    }

    /// Reports the workload's readiness upstream (now, if connected, and on every
    /// future connection after its first LDS request).
    pub fn report_health(&self, health: Health) {
        self.inner.health.send_if_modified(|current| {
            let changed = current.as_ref() != Some(&health);
            *current = Some(health);
            changed
        });
    }

    /// Ends the current Envoy stream, if any (shutdown).
    pub fn close_active(&self) {
        if let Some((_, stop)) = self.inner.active.lock().expect("active lock").take() {
            stop.cancel();
        }
    }

    /// Whether an Envoy stream is currently relayed.
    pub fn is_connected(&self) -> bool {
        self.inner.active.lock().expect("active lock").is_some()
    }

    pub fn upstream(&self) -> &UpstreamConfig {
        &self.inner.upstream
    }
}

impl Inner {
    /// Makes `id` the active connection, closing the previous one.
    fn register(&self, id: u64) -> CancellationToken {
        let stop = CancellationToken::new();
        if let Some((old, previous)) = self.active.lock().expect("active lock").replace((id, stop.clone())) {
            tracing::warn!(previous = old, "registered overlapping stream; closing previous");
            previous.cancel();
        }
        stop
    }

    fn unregister(&self, id: u64) {
        let mut active = self.active.lock().expect("active lock");
        if active.as_ref().is_some_and(|(current, _)| *current == id) {
            *active = None;
        }
    }

    /// Queues a request for istiod.
    fn send_upstream<F: Flavor>(&self, tx: &mpsc::UnboundedSender<F::Request>, request: F::Request) {
        tracing::trace!(r#type = short_type(F::request_type(&request)), "request to upstream");
        if tx.send(request).is_ok() {
            self.metrics.xds_proxy_requests.inc();
        }
    }
}

/// How a stream ended, in Istio's two buckets: graceful/expected vs unexpected.
fn termination(status: &Status) -> &'static Termination {
    const EXPECTED: [&str; 3] =
        ["client disconnected", "error reading from server: EOF", "transport is closing"];
    match status.code() {
        Code::Cancelled | Code::DeadlineExceeded => &CANCELLED,
        Code::Unavailable if EXPECTED.iter().any(|m| status.message().contains(m)) => &CANCELLED,
        _ => &ERROR,
    }
}

async fn open_stream<F: Flavor>(
    inner: Arc<Inner>,
    downstream: Streaming<F::Request>,
) -> Result<ResponseStream<F>, Status> {
    let id = inner.next_id.fetch_add(1, Ordering::Relaxed) + 1;
    let span = tracing::info_span!("xds", id, flavor = F::NAME);
    let address = inner.upstream.address.clone();
    async move {
        let stop = inner.register(id);
        tracing::debug!("accepted XDS connection from Envoy, forwarding to upstream");
        let fail = |inner: &Inner, e: &dyn std::error::Error| {
            inner.metrics.istiod_connection_failures.inc();
            inner.unregister(id);
            let message = format!("failed to connect to upstream {address}: {}", crate::error_chain(e));
            tracing::error!(upstream = %address, error = %crate::error_chain(e), "failed to connect to upstream");
            Status::unavailable(message)
        };
        let client = match inner.upstream.connect().await {
            Ok(c) => c,
            Err(e) => return Err(fail(&inner, &e)),
        };
        let (req_tx, req_rx) = mpsc::unbounded_channel();
        let request = match inner.upstream.request(UnboundedReceiverStream::new(req_rx)) {
            Ok(r) => r,
            Err(e) => return Err(fail(&inner, &e)),
        };
        // Envoy's requests queue for istiod while the upstream stream opens.
        tokio::spawn(
            read_downstream::<F>(inner.clone(), downstream, req_tx.clone(), stop.clone()).in_current_span(),
        );
        let upstream = match F::open(client, request).await {
            Ok(s) => s,
            Err(status) => {
                inner.metrics.istiod_connection_terminations.get_or_create(&ERROR).inc();
                tracing::warn!(
                    upstream = %address, code = ?status.code(), message = status.message(),
                    "upstream refused the XDS stream"
                );
                stop.cancel();
                inner.unregister(id);
                return Err(Status::new(
                    status.code(),
                    format!("upstream {address} refused the XDS stream: {}", status.message()),
                ));
            }
        };
        tracing::info!(upstream = %address, "connected to upstream XDS server");
        let (down_tx, down_rx) = mpsc::channel(1);
        tokio::spawn(pump_upstream::<F>(inner, id, upstream, req_tx, down_tx, stop).in_current_span());
        Ok(ReceiverStream::new(down_rx))
    }
    .instrument(span)
    .await
}

async fn read_downstream<F: Flavor>(
    inner: Arc<Inner>,
    mut downstream: Streaming<F::Request>,
    req_tx: mpsc::UnboundedSender<F::Request>,
    stop: CancellationToken,
) {
    let mut health = inner.health.subscribe();
    let mut initial_sent = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            changed = health.changed(), if initial_sent => {
                if changed.is_err() {
                    break;
                }
                let report = health.borrow_and_update().clone();
                if let Some(report) = report {
                    inner.send_upstream::<F>(&req_tx, F::health(&report));
                }
            }
            message = downstream.message() => match message {
                Ok(Some(request)) => {
                    let lds = F::request_type(&request) == type_url::LISTENER;
                    inner.send_upstream::<F>(&req_tx, request);
                    if lds && !initial_sent {
                        initial_sent = true;
                        for type_url in inner.handlers.keys() {
                            inner.send_upstream::<F>(&req_tx, F::subscribe(type_url));
                        }
                        let report = health.borrow_and_update().clone();
                        if let Some(report) = report {
                            inner.send_upstream::<F>(&req_tx, F::health(&report));
                        }
                    }
                }
                Ok(None) => {
                    inner.metrics.envoy_connection_terminations.get_or_create(&CANCELLED).inc();
                    tracing::debug!("Envoy closed the stream");
                    break;
                }
                Err(status) => {
                    let kind = termination(&status);
                    inner.metrics.envoy_connection_terminations.get_or_create(kind).inc();
                    if kind == &ERROR {
                        tracing::warn!(code = ?status.code(), message = status.message(), "downstream terminated with unexpected error");
                    } else {
                        tracing::debug!(code = ?status.code(), "downstream terminated");
                    }
                    break;
                }
            }
        }
    }
    stop.cancel();
}

async fn pump_upstream<F: Flavor>(
    inner: Arc<Inner>,
    id: u64,
    mut upstream: Streaming<F::Response>,
    req_tx: mpsc::UnboundedSender<F::Request>,
    down_tx: mpsc::Sender<Result<F::Response, Status>>,
    stop: CancellationToken,
) {
    let extensions = inner.wasm.clone().map(|wasm| {
        let (tx, rx) = mpsc::unbounded_channel();
        let convert =
            convert_extensions::<F>(inner.clone(), wasm, rx, req_tx.clone(), down_tx.clone(), stop.clone());
        tokio::spawn(convert.in_current_span());
        tx
    });
    loop {
        let message = tokio::select! {
            _ = stop.cancelled() => break,
            m = upstream.message() => m,
        };
        let response = match message {
            Ok(Some(r)) => r,
            Ok(None) => {
                inner.metrics.istiod_connection_terminations.get_or_create(&CANCELLED).inc();
                tracing::info!("upstream closed the XDS stream");
                break;
            }
            Err(status) => {
                let kind = termination(&status);
                inner.metrics.istiod_connection_terminations.get_or_create(kind).inc();
                tracing::warn!(code = ?status.code(), message = status.message(), "upstream terminated the XDS stream");
                // Envoy sees the upstream's status and reconnects.
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = down_tx.send(Err(status)) => {}
                }
                break;
            }
        };
        inner.metrics.xds_proxy_responses.inc();
        let type_url = F::response_type(&response);
        tracing::debug!(
            r#type = short_type(type_url),
            resources = F::resource_count(&response),
            nonce = F::response_nonce(&response),
            "upstream response"
        );
        if let Some(handler) = inner.handlers.get(type_url) {
            let mut response = response;
            let Some(resource) = F::take_first_resource(&mut response) else {
                // Internal types are singletons: an empty response is nothing to do,
                // and pilot-agent does not ACK it either.
                let r#type = short_type(F::response_type(&response));
                tracing::debug!(r#type, "empty response of an agent-internal type");
                continue;
            };
            let outcome = tokio::select! {
                _ = stop.cancelled() => break,
                outcome = handler(resource) => outcome,
            };
            let error = outcome.err().map(|message| {
                let r#type = short_type(F::response_type(&response));
                tracing::warn!(r#type, error = %message, "NACK: agent rejected a resource");
                internal(message)
            });
            inner.send_upstream::<F>(&req_tx, F::ack(&response, error));
            continue;
        }
        // ECDS waits for its Wasm modules on its own task, in order; the rest flows on.
        if F::response_type(&response) == type_url::EXTENSION_CONFIG
            && let Some(extensions) = &extensions
        {
            let _ = extensions.send(response);
            continue;
        }
        if !is_envoy_type(type_url) {
            tracing::error!(
                type_url,
                "skipping forwarding type url to Envoy as it is not a valid Envoy type"
            );
            continue;
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            sent = down_tx.send(Ok(response)) => if sent.is_err() {
                break;
            }
        }
    }
    stop.cancel();
    inner.unregister(id);
    tracing::debug!("disconnected from upstream");
}

/// ECDS responses of one stream, one at a time in the order istiod sent them: remote
/// Wasm modules fetched and rewritten to local files, then the response forwarded to
/// Envoy, or NACKed to istiod with the reason (its ACK or NACK follows its own
/// conversion). A slow module server holds only this task (pilot-agent converts in its
/// own goroutine too); every other type keeps flowing through the pump.
async fn convert_extensions<F: Flavor>(
    inner: Arc<Inner>,
    wasm: Arc<crate::sidecar::wasm::WasmConverter>,
    mut responses: mpsc::UnboundedReceiver<F::Response>,
    req_tx: mpsc::UnboundedSender<F::Request>,
    down_tx: mpsc::Sender<Result<F::Response, Status>>,
    stop: CancellationToken,
) {
    loop {
        let mut response = tokio::select! {
            _ = stop.cancelled() => break,
            r = responses.recv() => match r {
                Some(r) => r,
                None => break,
            },
        };
        let converted = tokio::select! {
            _ = stop.cancelled() => break,
            c = wasm.convert(F::resources_mut(&mut response)) => c,
        };
        if let Err(message) = converted {
            tracing::warn!(error = %message, "NACK: Wasm module unavailable; nothing forwarded to Envoy");
            inner.send_upstream::<F>(&req_tx, F::ack(&response, Some(internal(message))));
            continue;
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            sent = down_tx.send(Ok(response)) => if sent.is_err() {
                break;
            }
        }
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for XdsProxy {
    type StreamAggregatedResourcesStream = ResponseStream<Sotw>;
    type DeltaAggregatedResourcesStream = ResponseStream<Delta>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        open_stream::<Sotw>(self.inner.clone(), request.into_inner()).await.map(Response::new)
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        open_stream::<Delta>(self.inner.clone(), request.into_inner()).await.map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminations_split_like_istio() {
        assert_eq!(termination(&Status::cancelled("x")), &CANCELLED);
        assert_eq!(termination(&Status::unavailable("transport is closing")), &CANCELLED);
        assert_eq!(termination(&Status::unavailable("connection refused")), &ERROR);
        assert_eq!(termination(&Status::unauthenticated("authentication failure")), &ERROR);
    }
}
