//! Kubernetes probes rewritten by the injector (`ISTIO_KUBE_APP_PROBERS`): kubelet asks
//! `/app-health/<container>/livez|readyz|startupz` on the status port, and the agent
//! probes the app the way kubelet would have — HTTP GET (kubelet's redirect rules,
//! TLS unverified, the Host kubelet would send), a TCP connect, or the gRPC health
//! protocol — from 127.0.0.6 (or ::6), which the capture rules let through to the app
//! without Envoy. Only the status goes back: the status port answers anyone.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use bytes::Bytes;
use http_body_util::Empty;
use hyper::{HeaderMap, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpSocket, TcpStream};

/// kubelet's default probe timeout, used when `timeoutSeconds` is 0 or absent. Istio's
/// agent gives such an HTTP prober no timeout at all (`http.Client{Timeout: 0}` in
/// `pilot-agent/status/server.go`). In a cluster the entry always has one: the API
/// server defaults a probe's `timeoutSeconds` to 1 before the injector copies it, so
/// only a hand-written `ISTIO_KUBE_APP_PROBERS` can tell the two apart.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
/// kubelet follows at most this many redirects to the same host.
const MAX_REDIRECTS: usize = 10;

/// A port given as a number (Istio rejects named ports here: the injector resolves
/// them before writing the env).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProbePort(pub u16);

impl<'de> Deserialize<'de> for ProbePort {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::Number(n) => n
                .as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .filter(|n| *n > 0)
                .map(ProbePort)
                .ok_or_else(|| serde::de::Error::custom(format!("port {n} is not in 1..65535"))),
            other => Err(serde::de::Error::custom(format!("the port must be an integer, not {other}"))),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpHeader {
    pub name: String,
    pub value: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpGetAction {
    #[serde(default)]
    pub path: String,
    pub port: ProbePort,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub http_headers: Vec<HttpHeader>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TcpSocketAction {
    pub port: ProbePort,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrpcAction {
    pub port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

/// One rewritten probe, as the injector writes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Prober {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_get: Option<HttpGetAction>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_socket: Option<TcpSocketAction>,
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "grpc")]
    pub grpc: Option<GrpcAction>,
    #[serde(default)]
    pub timeout_seconds: u32,
}

impl Prober {
    fn timeout(&self) -> Duration {
        match self.timeout_seconds {
            0 => DEFAULT_TIMEOUT,
            s => Duration::from_secs(s.into()),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProbersError {
    #[error("not a JSON object of probers: {0}")]
    Json(String),
    #[error(
        "{path:?} is not a prober path (expected /app-health/<container>/livez|readyz|startupz or /app-lifecycle/<container>/prestopz|poststartz)"
    )]
    Path { path: String },
    #[error("{path} must have exactly one of httpGet, tcpSocket or grpc")]
    Kind { path: String },
}

/// `ISTIO_KUBE_APP_PROBERS`: path → prober, validated as pilot-agent validates it
/// (errors name the path; the caller names the variable).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AppProbers(pub BTreeMap<String, Prober>);

impl AppProbers {
    pub fn parse(json: &str) -> Result<Self, ProbersError> {
        if json.trim().is_empty() {
            return Ok(Self::default());
        }
        let map: BTreeMap<String, Prober> =
            serde_json::from_str(json).map_err(|e| ProbersError::Json(e.to_string()))?;
        for (path, prober) in &map {
            if !is_prober_path(path) {
                return Err(ProbersError::Path { path: path.clone() });
            }
            let kinds = [prober.http_get.is_some(), prober.tcp_socket.is_some(), prober.grpc.is_some()];
            if kinds.iter().filter(|k| **k).count() != 1 {
                return Err(ProbersError::Kind { path: path.clone() });
            }
        }
        Ok(Self(map))
    }

    pub fn get(&self, path: &str) -> Option<&Prober> {
        self.0.get(path)
    }
}

/// `^/(app-health|app-lifecycle)/[^/]+/(livez|readyz|startupz|prestopz|poststartz)$`.
fn is_prober_path(path: &str) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    matches!(parts.as_slice(), ["", "app-health" | "app-lifecycle", container, "livez" | "readyz" | "startupz" | "prestopz" | "poststartz"] if !container.is_empty())
}

/// Why a probe has no answer from the app.
#[derive(Debug, PartialEq)]
pub enum CheckError {
    NoProber,
    Failed(String),
}

/// The probe's answer for kubelet: a status (and a reason of the agent's own when no
/// prober is configured for the path; never the app's words).
#[derive(Debug, PartialEq)]
pub struct ProbeOutcome {
    pub status: StatusCode,
    pub body: Bytes,
}

impl ProbeOutcome {
    fn status(status: StatusCode) -> Self {
        Self { status, body: Bytes::new() }
    }
}

/// Probes the app for kubelet.
#[derive(Clone)]
pub struct AppProber {
    probers: Arc<AppProbers>,
    /// The pod IP (`INSTANCE_IP`), as kubelet would have dialled it.
    destination: IpAddr,
    /// Where probes come from: 127.0.0.6 (or ::6), which capture lets through to the
    /// app. Only usable toward a local address (the pod IP, loopback); decided once.
    source: Option<SocketAddr>,
    tls: tokio_rustls::TlsConnector,
}

impl AppProber {
    pub fn new(probers: AppProbers, destination: IpAddr) -> Self {
        let local =
            destination.is_loopback() || std::net::UdpSocket::bind(SocketAddr::new(destination, 0)).is_ok();
        let source = local.then(|| match destination {
            IpAddr::V4(_) => SocketAddr::from((Ipv4Addr::new(127, 0, 0, 6), 0)),
            IpAddr::V6(_) => SocketAddr::from((Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6), 0)),
        });
        // kubelet does not verify an HTTPS probe's certificate; neither does the agent.
        let tls = crate::support::tls::http1_connector(crate::support::tls::ServerTrust::AnyCertificate)
            .expect("a configuration without client certificate or roots to load cannot fail");
        Self { probers: Arc::new(probers), destination, source, tls }
    }

    async fn connect(&self, port: u16, timeout: Duration) -> std::io::Result<TcpStream> {
        let target = SocketAddr::new(self.destination, port);
        let socket = if target.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        if let Some(source) = self.source {
            socket.bind(source)?;
        }
        tokio::time::timeout(timeout, socket.connect(target)).await.map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::TimedOut, format!("connect {target}: timed out"))
        })?
    }

    /// Answers kubelet's request for `path` (with kubelet's `host` and headers).
    pub async fn probe(&self, path: &str, headers: &HeaderMap) -> ProbeOutcome {
        match self.check(path, headers).await {
            Ok(outcome) => outcome,
            Err(CheckError::NoProber) => {
                tracing::error!(path, "no app prober configured for this path");
                ProbeOutcome {
                    status: StatusCode::BAD_REQUEST,
                    body: Bytes::from(format!("app prober config does not exists for {path}")),
                }
            }
            Err(CheckError::Failed(e)) => {
                tracing::warn!(path, error = %e, "app probe failed");
                ProbeOutcome::status(StatusCode::INTERNAL_SERVER_ERROR)
            }
        }
    }

    /// Probes the app for `path`: the app's answer (HTTP), or why there is none.
    pub async fn check(&self, path: &str, headers: &HeaderMap) -> Result<ProbeOutcome, CheckError> {
        let prober = self.probers.get(path).ok_or(CheckError::NoProber)?;
        let timeout = prober.timeout();
        let timed_out = |kind: &str| CheckError::Failed(format!("{kind} probe timed out after {timeout:?}"));
        if let Some(http) = &prober.http_get {
            tokio::time::timeout(timeout, self.http_get(http, headers, timeout))
                .await
                .map_err(|_| timed_out("HTTP"))?
                .map_err(|e| {
                    let at = SocketAddr::new(self.destination, http.port.0);
                    CheckError::Failed(format!("HTTP probe of {at}{}: {e}", http.path))
                })
        } else if let Some(tcp) = &prober.tcp_socket {
            self.connect(tcp.port.0, timeout).await.map(|_| ProbeOutcome::status(StatusCode::OK)).map_err(
                |e| {
                    let at = SocketAddr::new(self.destination, tcp.port.0);
                    CheckError::Failed(format!("TCP probe of {at}: {e}"))
                },
            )
        } else if let Some(grpc) = &prober.grpc {
            tokio::time::timeout(timeout, self.grpc(grpc, headers, timeout))
                .await
                .map_err(|_| timed_out("gRPC"))?
                .map(|()| ProbeOutcome::status(StatusCode::OK))
                .map_err(|e| CheckError::Failed(format!("gRPC probe of port {}: {e}", grpc.port)))
        } else {
            Err(CheckError::Failed("the prober has no action".into()))
        }
    }

    /// kubelet's HTTP probe: same-host redirects followed (10 at most), a redirect
    /// elsewhere or one that cannot be followed counts as success. Only the status
    /// goes back: the status port answers anyone who reaches it, the app's body is
    /// the app's (Istio has passed 10 KiB of it back since 1.21).
    async fn http_get(
        &self,
        action: &HttpGetAction,
        headers: &HeaderMap,
        timeout: Duration,
    ) -> Result<ProbeOutcome, String> {
        let https = action.scheme.as_deref().is_some_and(|s| s.eq_ignore_ascii_case("https"));
        let mut path =
            if action.path.starts_with('/') { action.path.clone() } else { format!("/{}", action.path) };
        let mut host = self.probe_host(action);
        let original_host = host.split(':').next().unwrap_or_default().to_string();
        for _ in 0..=MAX_REDIRECTS {
            let stream = self.connect(action.port.0, timeout).await.map_err(|e| e.to_string())?;
            let request = probe_request(&path, &host, headers, &action.http_headers)?;
            let (status, location) = if https {
                let server_name = rustls_name(&self.destination);
                let tls = self.tls.connect(server_name, stream).await.map_err(|e| format!("TLS: {e}"))?;
                send(TokioIo::new(tls), request).await?
            } else {
                send(TokioIo::new(stream), request).await?
            };
            if !status.is_redirection() {
                return Ok(ProbeOutcome::status(status));
            }
            let Some(location) = location.and_then(|l| l.parse::<Uri>().ok()) else {
                return Ok(ProbeOutcome::status(StatusCode::OK));
            };
            match location.host() {
                Some(h) if !h.eq_ignore_ascii_case(&original_host) => {
                    return Ok(ProbeOutcome::status(StatusCode::OK));
                }
                Some(_) => {
                    host = location.authority().map(|a| a.to_string()).unwrap_or(host);
                }
                None => {}
            }
            path = location.path_and_query().map(|p| p.to_string()).unwrap_or_else(|| "/".into());
        }
        Err(format!("stopped after {MAX_REDIRECTS} redirects"))
    }

    /// The Host kubelet sends when it probes the app itself: the probe's `Host`
    /// header, else the probe's host (the pod's address) and the app's port. The
    /// caller's Host is never used: anyone can send one to the status port.
    fn probe_host(&self, action: &HttpGetAction) -> String {
        if let Some(h) = action.http_headers.iter().find(|h| h.name.eq_ignore_ascii_case("host")) {
            return h.value.clone();
        }
        match action.host.as_deref().filter(|h| !h.is_empty()) {
            Some(h) if h.contains(':') => format!("[{h}]:{}", action.port.0),
            Some(h) => format!("{h}:{}", action.port.0),
            None => SocketAddr::new(self.destination, action.port.0).to_string(),
        }
    }
    async fn grpc(&self, action: &GrpcAction, headers: &HeaderMap, timeout: Duration) -> Result<(), String> {
        use weir_proto::grpc::health::v1::{
            HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
        };
        let me = self.clone();
        let port = action.port;
        let mut endpoint = tonic::transport::Endpoint::from_shared(format!(
            "http://{}",
            SocketAddr::new(self.destination, port)
        ))
        .map_err(|e| e.to_string())?
        .timeout(timeout)
        .connect_timeout(timeout);
        if let Some(agent) = headers.get(hyper::header::USER_AGENT).and_then(|v| v.to_str().ok()) {
            endpoint = endpoint.user_agent(agent).map_err(|e| e.to_string())?;
        }
        let channel = endpoint
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let me = me.clone();
                async move { me.connect(port, timeout).await.map(TokioIo::new) }
            }))
            .await
            .map_err(|e| format!("connect: {}", crate::error_chain(&e)))?;
        let response = HealthClient::new(channel)
            .check(HealthCheckRequest { service: action.service.clone().unwrap_or_default() })
            .await
            .map_err(|status| match status.code() {
                tonic::Code::Unimplemented => {
                    "the app does not implement the gRPC health protocol (grpc.health.v1.Health)".to_string()
                }
                tonic::Code::DeadlineExceeded => {
                    "gRPC health check not finished within the timeout".to_string()
                }
                _ => format!("gRPC health check: {}: {}", status.code(), status.message()),
            })?;
        match response.into_inner().status() {
            ServingStatus::Serving => Ok(()),
            other => Err(format!("service is {}", other.as_str_name())),
        }
    }
}

/// One probe request: kubelet's headers (not those about this hop or its body), the
/// probe's own `httpHeaders` in place of any the caller sent by those names, `host`.
fn probe_request(
    path: &str,
    host: &str,
    caller: &HeaderMap,
    probe: &[HttpHeader],
) -> Result<Request<Empty<Bytes>>, String> {
    use hyper::header::{CONNECTION, CONTENT_LENGTH, HOST, HeaderName, HeaderValue, TRANSFER_ENCODING};
    let mut headers = HeaderMap::new();
    for (name, value) in caller {
        if ![HOST, CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING].contains(name) {
            headers.append(name, value.clone());
        }
    }
    for h in probe.iter().filter(|h| !h.name.eq_ignore_ascii_case("host")) {
        let name =
            HeaderName::from_bytes(h.name.as_bytes()).map_err(|e| format!("header {:?}: {e}", h.name))?;
        let value = HeaderValue::from_str(&h.value).map_err(|e| format!("header {:?}: {e}", h.name))?;
        headers.insert(name, value);
    }
    let host = HeaderValue::from_str(host).map_err(|e| format!("Host {host:?}: {e}"))?;
    headers.insert(HOST, host);
    headers.insert(CONNECTION, HeaderValue::from_static("close"));
    let mut request =
        Request::builder().method("GET").uri(path).body(Empty::<Bytes>::new()).map_err(|e| e.to_string())?;
    *request.headers_mut() = headers;
    Ok(request)
}

/// The answer's status and `Location`; its body is never read (the connection closes).
async fn send<IO>(io: IO, request: Request<Empty<Bytes>>) -> Result<(StatusCode, Option<String>), String>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let response = crate::support::http1::exchange(io, request).await.map_err(|e| e.to_string())?;
    let location =
        response.headers().get(hyper::header::LOCATION).and_then(|l| l.to_str().ok()).map(String::from);
    Ok((response.status(), location))
}

fn rustls_name(ip: &IpAddr) -> tokio_rustls::rustls::pki_types::ServerName<'static> {
    tokio_rustls::rustls::pki_types::ServerName::IpAddress((*ip).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probers_parse_as_the_injector_writes_them() {
        let p = AppProbers::parse(
            r#"{"/app-health/web/livez":{"httpGet":{"path":"/healthz","port":8080,"scheme":"HTTP","httpHeaders":[{"name":"X-A","value":"1"}]},"timeoutSeconds":3},
                "/app-health/web/readyz":{"tcpSocket":{"port":8080}},
                "/app-health/grpc/startupz":{"grpc":{"port":9090,"service":"x"}}}"#,
        )
        .unwrap();
        assert_eq!(p.0.len(), 3);
        let live = p.get("/app-health/web/livez").unwrap();
        assert_eq!(live.http_get.as_ref().unwrap().port, ProbePort(8080));
        assert_eq!(live.timeout(), Duration::from_secs(3));
        assert_eq!(p.get("/app-health/web/readyz").unwrap().timeout(), DEFAULT_TIMEOUT);
        assert_eq!(AppProbers::parse("{}").unwrap(), AppProbers::default());
        assert_eq!(AppProbers::parse("").unwrap(), AppProbers::default());
    }

    /// An app on loopback that records each request's head and answers 200 with a
    /// body of its own.
    async fn recording_app() -> (u16, Arc<std::sync::Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let heads = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = heads.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.ends_with(b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                seen.lock().unwrap().push(String::from_utf8_lossy(&head).to_ascii_lowercase());
                let body = "app internals: db=up secret=hunter2\n";
                let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len());
                let _ = s.write_all(answer.as_bytes()).await;
            }
        });
        (port, heads)
    }

    /// Anyone who reaches the status port may ask for a probe: they get the app's
    /// status and nothing it wrote, and the app sees the Host kubelet would have sent
    /// (the probe's own, else the pod's address and the app's port), never the
    /// caller's.
    #[tokio::test]
    async fn a_probe_answers_with_the_status_only_and_never_forwards_the_callers_host() {
        let (port, heads) = recording_app().await;
        let probers = AppProbers::parse(&format!(
            r#"{{"/app-health/web/livez": {{"httpGet": {{"path": "/healthz", "port": {port}}}}},
                "/app-health/web/readyz": {{"httpGet": {{"path": "/ready", "port": {port},
                    "httpHeaders": [{{"name": "Host", "value": "web.internal"}}, {{"name": "X-Probe", "value": "yes"}}]}}}}}}"#
        ))
        .unwrap();
        let prober = AppProber::new(probers, IpAddr::from([127, 0, 0, 1]));
        let mut caller = HeaderMap::new();
        caller.insert(hyper::header::HOST, "attacker.example:15020".parse().unwrap());
        caller.insert(hyper::header::USER_AGENT, "kube-probe/1.31".parse().unwrap());
        caller.insert("x-probe", "forged".parse().unwrap());

        let live = prober.probe("/app-health/web/livez", &caller).await;
        assert_eq!((live.status, live.body), (StatusCode::OK, Bytes::new()));
        let ready = prober.probe("/app-health/web/readyz", &caller).await;
        assert_eq!((ready.status, ready.body), (StatusCode::OK, Bytes::new()));

        let heads = heads.lock().unwrap().clone();
        assert!(heads[0].contains(&format!("\r\nhost: 127.0.0.1:{port}\r\n")), "{}", heads[0]);
        assert!(heads[0].contains("user-agent: kube-probe/1.31"), "kubelet's headers go on: {}", heads[0]);
        assert!(heads[1].contains("\r\nhost: web.internal\r\n"), "the probe's own Host: {}", heads[1]);
        assert!(heads[1].contains("x-probe: yes") && !heads[1].contains("forged"), "{}", heads[1]);
        assert!(heads.iter().all(|h| !h.contains("attacker")), "{heads:?}");
    }

    #[test]
    fn bad_probers_are_named() {
        let e = AppProbers::parse(r#"{"/healthz":{"tcpSocket":{"port":1}}}"#).unwrap_err().to_string();
        assert!(e.contains("\"/healthz\"") && e.contains("/app-health/<container>"), "{e}");
        let e = AppProbers::parse(r#"{"/app-health/a/livez":{}}"#).unwrap_err().to_string();
        assert!(e.contains("exactly one"), "{e}");
        let e = AppProbers::parse(r#"{"/app-health/a/livez":{"tcpSocket":{"port":"http"}}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("must be an integer"), "{e}");
        let e = AppProbers::parse("[1]").unwrap_err().to_string();
        assert!(e.starts_with("not a JSON object"), "{e}");
        assert!(!is_prober_path("/app-health//livez"));
        assert!(!is_prober_path("/app-health/a/b/livez"));
        assert!(is_prober_path("/app-lifecycle/a/prestopz"));
    }
}
