//! The relay in one process, on loopback and a Unix socket in a temp dir: a gRPC client
//! plays Envoy, Weir's ADS server plays istiod (plaintext). Checks what the real-Envoy
//! tests cannot trigger yet: the agent's own upstream requests (health reports, its
//! NDS subscription after the first LDS) and that a later stream replays the last health.

use std::{collections::HashMap, sync::Arc, time::Duration};

use hyper_util::rt::TokioIo;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use weir_agent::{
    sidecar::controlplane::{AdsServer, AuthPolicy, Snapshot},
    sidecar::metrics::Metrics,
    sidecar::xds::{XdsProxy, flavor::Health, relay::Handler, upstream::UpstreamConfig},
};
use weir_proto::{
    envoy::service::discovery::v3::{
        DiscoveryRequest, aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
    },
    type_url,
};
use weir_tests::request_log::{RecordedRequest, RequestLog};

const WAIT: Duration = Duration::from_secs(10);

struct Setup {
    ads: AdsServer,
    log: RequestLog,
    proxy: XdsProxy,
    socket: std::path::PathBuf,
    metrics: Arc<Metrics>,
    _dir: tempfile::TempDir,
    stop: CancellationToken,
}

async fn setup() -> Setup {
    let ads = AdsServer::new(Snapshot::new(), AuthPolicy::default());
    let log = RequestLog::observing(&ads);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(ads.clone().serve(listener, None, stop.clone().cancelled_owned()));
    let nds: Handler = Arc::new(|_| Box::pin(async { Ok(()) }));
    let metrics = Arc::new(Metrics::new());
    let proxy = XdsProxy::new(
        UpstreamConfig::plaintext(addr.to_string()),
        HashMap::from([(type_url::NAME_TABLE.to_string(), nds)]),
        metrics.clone(),
    );
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("XDS");
    let uds = weir_agent::sidecar::xds::uds::bind(&socket, None).unwrap();
    tokio::spawn(proxy.clone().serve(uds, stop.clone().cancelled_owned()));
    Setup { ads, log, proxy, socket, metrics, _dir: dir, stop }
}

async fn envoy_client(
    socket: &std::path::Path,
) -> AggregatedDiscoveryServiceClient<tonic::transport::Channel> {
    let path = socket.to_path_buf();
    let channel = tonic::transport::Endpoint::from_static("http://envoy.local")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .unwrap();
    AggregatedDiscoveryServiceClient::new(channel)
}

fn request(type_url: &str) -> DiscoveryRequest {
    DiscoveryRequest { type_url: type_url.into(), ..Default::default() }
}

async fn wait_for_request(log: &RequestLog, what: impl Fn(&RecordedRequest) -> bool) -> RecordedRequest {
    log.wait_for(WAIT, |reqs, _| reqs.iter().find(|r| what(r)).cloned())
        .await
        .unwrap_or_else(|| panic!("request never reached the control plane: {:?}", log.requests()))
}

#[tokio::test]
async fn the_agent_subscribes_nds_after_lds_and_reports_health_upstream() {
    let s = setup().await;
    let mut envoy = envoy_client(&s.socket).await;
    let (tx, rx) = mpsc::channel(8);
    tx.send(request(type_url::CLUSTER)).await.unwrap();
    let _responses = envoy.stream_aggregated_resources(ReceiverStream::new(rx)).await.unwrap();
    wait_for_request(&s.log, |r| r.type_url == type_url::CLUSTER).await;
    assert!(
        !s.log.requests().iter().any(|r| r.type_url == type_url::NAME_TABLE),
        "no NDS subscription before Envoy's first LDS request"
    );
    tx.send(request(type_url::LISTENER)).await.unwrap();
    wait_for_request(&s.log, |r| r.type_url == type_url::NAME_TABLE).await;

    s.proxy.report_health(Health::Unhealthy("readiness probe failed".into()));
    let unhealthy = wait_for_request(&s.log, |r| r.type_url == type_url::HEALTH_INFO).await;
    assert_eq!(unhealthy.error.as_deref(), Some("readiness probe failed"));
    s.proxy.report_health(Health::Healthy);
    wait_for_request(&s.log, |r| r.type_url == type_url::HEALTH_INFO && r.error.is_none()).await;

    // A new Envoy stream replaces the old one and carries the last health state.
    s.proxy.report_health(Health::Unhealthy("still starting".into()));
    let streams_before = s.log.requests().iter().map(|r| r.stream).max().unwrap();
    let (tx2, rx2) = mpsc::channel(8);
    tx2.send(request(type_url::LISTENER)).await.unwrap();
    let mut envoy2 = envoy_client(&s.socket).await;
    let _responses2 = envoy2.stream_aggregated_resources(ReceiverStream::new(rx2)).await.unwrap();
    let replayed =
        wait_for_request(&s.log, |r| r.stream > streams_before && r.type_url == type_url::HEALTH_INFO).await;
    assert_eq!(replayed.error.as_deref(), Some("still starting"));
    drop(tx);
    s.stop.cancel();
}

#[tokio::test]
async fn agent_internal_types_never_reach_envoy_and_are_acked_by_the_agent() {
    let s = setup().await;
    let table = weir_proto::istio::networking::nds::v1::NameTable::default();
    s.ads.push(Snapshot::new().with(
        type_url::NAME_TABLE,
        "7",
        [("", weir_proto::to_any(type_url::NAME_TABLE, &table))],
    ));
    let mut envoy = envoy_client(&s.socket).await;
    let (tx, rx) = mpsc::channel(8);
    tx.send(request(type_url::LISTENER)).await.unwrap();
    let mut responses =
        envoy.stream_aggregated_resources(ReceiverStream::new(rx)).await.unwrap().into_inner();
    let ack = wait_for_request(&s.log, |r| r.type_url == type_url::NAME_TABLE && r.is_ack()).await;
    assert_eq!(ack.version_info, "7", "the agent ACKs NDS with its version");
    // An empty response of an internal type is nothing to do, and not ACKed (as
    // pilot-agent): the relay receives version 8 with no table, then ACKs only 9.
    let received = s.metrics.xds_proxy_responses.get();
    s.ads.push(Snapshot::new().with(type_url::NAME_TABLE, "8", std::iter::empty::<(&str, _)>()));
    let deadline = tokio::time::Instant::now() + WAIT;
    while s.metrics.xds_proxy_responses.get() == received {
        assert!(tokio::time::Instant::now() < deadline, "the empty NDS response never reached the relay");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    s.ads.push(Snapshot::new().with(
        type_url::NAME_TABLE,
        "9",
        [("", weir_proto::to_any(type_url::NAME_TABLE, &table))],
    ));
    wait_for_request(&s.log, |r| r.type_url == type_url::NAME_TABLE && r.is_ack() && r.version_info == "9")
        .await;
    let acked: Vec<String> = s
        .log
        .requests()
        .iter()
        .filter(|r| r.type_url == type_url::NAME_TABLE && !r.nonce.is_empty())
        .map(|r| r.version_info.clone())
        .collect();
    assert_eq!(acked, ["7", "9"], "NDS versions the agent answered");
    // Envoy gets its (empty) listener response and nothing of the agent's types.
    let mut seen = Vec::new();
    while let Ok(Ok(Some(response))) =
        tokio::time::timeout(Duration::from_millis(500), responses.message()).await
    {
        seen.push(response.type_url);
    }
    assert!(seen.iter().any(|t| t == type_url::LISTENER), "no listener response reached Envoy: {seen:?}");
    assert!(seen.iter().all(|t| t.starts_with("type.googleapis.com/envoy.")), "Envoy received {seen:?}");
    drop(tx);
    s.stop.cancel();
}
