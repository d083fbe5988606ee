//! The sidecar agent in this process, without root: configured for an injected pod
//! whose Envoy somebody else runs (`WEIR_ENVOY_MODE=external`, so no Envoy binary is
//! needed), its files and sockets in a temp dir, its upstreams unreachable. What it
//! serves once started, and how `/quitquitquit` stops it.

use std::{path::Path, time::Duration};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::Agent;
use crate::sidecar::config::{AgentConfig, MapEnv, ProxyArgs};

/// A liveness bound, not a timing assertion.
const PATIENCE: Duration = Duration::from_secs(10);

/// The configuration of a pod whose Envoy runs elsewhere, everything under `dir`,
/// the status server on `status_port`.
fn external_envoy_config(dir: &Path, status_port: u16) -> AgentConfig {
    external_envoy_config_with(dir, status_port, &[])
}

/// As `external_envoy_config`, with `extra` in the environment too.
fn external_envoy_config_with(dir: &Path, status_port: u16, extra: &[(&str, &str)]) -> AgentConfig {
    let args =
        ProxyArgs::parse(&["sidecar".into(), "--domain".into(), "default.svc.cluster.local".into()]).unwrap();
    // Upstreams (istiod, the CA) on a port nothing listens on: refused at once.
    let pc = format!(r#"{{"configPath": "{}", "discoveryAddress": "127.0.0.1:1"}}"#, dir.display());
    let mut env = MapEnv::from([
        ("XDS_ROOT_CA", "SYSTEM"),
        ("CA_ROOT_CA", "SYSTEM"),
        ("POD_NAME", "app-1"),
        ("POD_NAMESPACE", "default"),
        ("INSTANCE_IP", "127.0.0.1"),
        ("PROXY_CONFIG", pc.as_str()),
        ("WEIR_ENVOY_MODE", "external"),
    ]);
    env.0.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let mut config = AgentConfig::resolve(args, &env, &std::collections::BTreeMap::new()).unwrap();
    config.status.port = status_port;
    // The default is relative to the working directory, which tests share.
    config.identity.sds_socket = dir.join("sds.sock");
    config
}

/// A port free a moment ago, on both families (as the status server binds).
fn free_port() -> u16 {
    std::net::TcpListener::bind("[::]:0")
        .or_else(|_| std::net::TcpListener::bind("0.0.0.0:0"))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `method path` to the status server; its status code, or `None` while nothing
/// answers.
async fn status_code(port: u16, method: &str, path: &str) -> Option<u16> {
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let request = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).await.ok()?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.ok()?;
    answer.split(' ').nth(1)?.parse().ok()
}

#[tokio::test]
async fn a_sidecar_agent_without_its_envoy_serves_its_sockets_and_readiness_then_stops_on_quitquitquit() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = external_envoy_config(dir.path(), port);
    let (xds, sds) = (config.xds.uds_path.clone(), config.identity.sds_socket.clone());
    let running = tokio::spawn(Agent::new(config).unwrap().run());
    let ready = tokio::time::timeout(PATIENCE, async {
        loop {
            match status_code(port, "GET", "/healthz/ready").await {
                Some(code) => return code,
                None => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    });
    assert_eq!(ready.await.expect("the status server never answered"), 200, "no Envoy to wait for: ready");
    assert!(xds.exists() && sds.exists(), "the XDS and SDS sockets are served");
    assert!(dir.path().join("grpc-bootstrap.json").exists(), "the gRPC bootstrap is written");
    assert_eq!(status_code(port, "GET", "/quitquitquit").await, Some(405), "only POST stops the agent");
    assert_eq!(status_code(port, "POST", "/quitquitquit").await, Some(200));
    let stopped = tokio::time::timeout(PATIENCE, running).await.expect("the agent did not stop");
    stopped.unwrap().expect("the agent stops cleanly when asked");
    assert!(!xds.exists() && !sds.exists(), "the sockets are removed when it stops");
    assert_eq!(status_code(port, "GET", "/healthz/ready").await, None, "the status port is closed");
}

/// `PILOT_AGENT_MERGE_ENVOY_STATS` (Istio: default true): the status server's
/// `/stats/prometheus` carries Envoy's stats (read from `ENVOY_PROMETHEUS_PORT`, where
/// the bootstrap puts Envoy's Prometheus listener) next to
/// the agent's unless it is `false`, when only the agent's (and the app's) are served
/// and Envoy is not even asked.
#[tokio::test]
async fn envoy_stats_are_merged_into_the_agents_metrics_unless_pilot_agent_merge_envoy_stats_is_false() {
    use http_body_util::BodyExt as _;
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let envoy_port = listener.local_addr().unwrap().port();
    let count = asked.clone();
    tokio::spawn(crate::support::http1::serve(listener, move |_, _| {
        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async {
            hyper::Response::new(http_body_util::Full::new(bytes::Bytes::from_static(
                b"envoy_server_live 1\n",
            )))
        }
    }));
    let dir = tempfile::tempdir().unwrap();
    let envoy_port = envoy_port.to_string();
    let scrape = |merge_envoy: Option<&str>| {
        let mut extra = vec![("ENVOY_PROMETHEUS_PORT", envoy_port.as_str())];
        extra.extend(merge_envoy.map(|v| ("PILOT_AGENT_MERGE_ENVOY_STATS", v)));
        let config = external_envoy_config_with(dir.path(), free_port(), &extra);
        let agent = Agent::new(config).unwrap();
        let readiness = std::sync::Arc::new(crate::sidecar::envoy::Readiness::new(None));
        let lifecycle = crate::sidecar::envoy::LifecycleControl::new(None, true);
        let merge = agent.status_server(&readiness, &lifecycle, true).merge;
        async move {
            let body = merge.scrape(None, &hyper::HeaderMap::new()).expect("a scrape permit");
            String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap()
        }
    };
    let merged = tokio::time::timeout(PATIENCE, scrape(None)).await.unwrap();
    assert!(
        merged.contains("istio_agent_scrapes_total 1") && merged.contains("envoy_server_live 1"),
        "{merged}"
    );
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
    let alone = tokio::time::timeout(PATIENCE, scrape(Some("false"))).await.unwrap();
    assert!(alone.contains("istio_agent_scrapes_total 1"), "{alone}");
    assert!(!alone.contains("envoy_server_live"), "{alone}");
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1, "Envoy is not asked");
}

/// `ENVOY_SECURE_METRICS_PORT` and `ENVOY_SECURE_MERGED_METRICS_PORT` (Istio: 0, off):
/// each adds a bootstrap listener that requires the peer's mesh certificate (the
/// workload's SDS `default` and `ROOTCA`) and serves Envoy's stats, or the agent's
/// merged stats (the `agent` cluster, 15020), respectively; both are node metadata.
#[test]
fn secure_metrics_ports_add_mutual_tls_stats_listeners_to_the_bootstrap() {
    let dir = tempfile::tempdir().unwrap();
    let listeners = |extra: &[(&str, &str)]| {
        let config = external_envoy_config_with(dir.path(), 15020, extra);
        let (text, _) = super::render_bootstrap(&config).unwrap();
        let bootstrap: serde_json::Value = serde_json::from_str(&text).unwrap();
        let metadata = bootstrap["node"]["metadata"].clone();
        let ports: Vec<(u64, serde_json::Value)> = bootstrap["static_resources"]["listeners"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| (l["address"]["socket_address"]["port_value"].as_u64().unwrap(), l.clone()))
            .collect();
        (metadata, ports)
    };
    let (metadata, plain) = listeners(&[]);
    assert!(plain.iter().all(|(p, _)| ![15091, 15092].contains(p)), "no secure listener by default");
    assert_eq!(metadata.get("ENVOY_SECURE_METRICS_PORT"), None, "0 is omitted, as Istio's omitempty");
    let (metadata, secure) =
        listeners(&[("ENVOY_SECURE_METRICS_PORT", "15091"), ("ENVOY_SECURE_MERGED_METRICS_PORT", "15092")]);
    assert_eq!(
        (&metadata["ENVOY_SECURE_METRICS_PORT"], &metadata["ENVOY_SECURE_MERGED_METRICS_PORT"]),
        (&15091.into(), &15092.into())
    );
    for (port, cluster, stat_prefix) in
        [(15091, "prometheus_stats", "secure_stats"), (15092, "agent", "secure_merged_stats")]
    {
        let (_, l) =
            secure.iter().find(|(p, _)| *p == port).unwrap_or_else(|| panic!("no listener on {port}"));
        let chain = &l["filter_chains"][0];
        let tls = &chain["transport_socket"]["typed_config"];
        assert_eq!(tls["require_client_certificate"], true, "{port}: {l}");
        let sds = &tls["common_tls_context"];
        assert_eq!(sds["tls_certificate_sds_secret_configs"][0]["name"], "default", "{port}");
        assert_eq!(
            sds["combined_validation_context"]["validation_context_sds_secret_config"]["name"],
            "ROOTCA"
        );
        let hcm = &chain["filters"][0]["typed_config"];
        assert_eq!(hcm["stat_prefix"], stat_prefix);
        let routes = &hcm["route_config"]["virtual_hosts"][0]["routes"];
        assert_eq!(routes[0]["match"]["prefix"], "/stats/prometheus", "{port}");
        assert_eq!(routes[0]["route"]["cluster"], cluster, "{port}");
    }
}
