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
    let args =
        ProxyArgs::parse(&["sidecar".into(), "--domain".into(), "default.svc.cluster.local".into()]).unwrap();
    // Upstreams (istiod, the CA) on a port nothing listens on: refused at once.
    let pc = format!(r#"{{"configPath": "{}", "discoveryAddress": "127.0.0.1:1"}}"#, dir.display());
    let env = MapEnv::from([
        ("XDS_ROOT_CA", "SYSTEM"),
        ("CA_ROOT_CA", "SYSTEM"),
        ("POD_NAME", "app-1"),
        ("POD_NAMESPACE", "default"),
        ("INSTANCE_IP", "127.0.0.1"),
        ("PROXY_CONFIG", pc.as_str()),
        ("WEIR_ENVOY_MODE", "external"),
    ]);
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
