//! The connection to istiod (for xDS, and for its CA), as pilot-agent dials it: one fresh gRPC channel per Envoy
//! stream, TLS (the agent's one client configuration, `crate::support::tls`) with the mesh
//! root or the system roots, the server name from
//! the address (`localhost` → `istiod.istio-system.svc`) or `ISTIOD_SAN`, an optional
//! client certificate, keepalive 30 s/10 s, 1 MiB windows, no receive limit; and the
//! per-stream metadata: `authorization: Bearer <token>` (the token file re-read on
//! every connect), `ClusterID` and every `XDS_HEADER_<name>`.

use std::{path::PathBuf, time::Duration};

use tokio_rustls::rustls::pki_types::ServerName;
use tonic::{
    metadata::{AsciiMetadataValue, MetadataKey},
    transport::{Channel, Endpoint},
};
use weir_proto::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;

/// gRPC keepalive, as Istio's `GRPC_KEEPALIVE_INTERVAL`/`GRPC_KEEPALIVE_TIMEOUT`.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Istio's initial stream and connection windows.
pub const WINDOW: u32 = 1024 * 1024;
/// How long pilot-agent waits to dial istiod.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Which roots verify istiod's certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCerts {
    /// A PEM bundle (`./var/run/secrets/istio/root-cert.pem`, `XDS_ROOT_CA`).
    File(PathBuf),
    /// The system's roots (`XDS_ROOT_CA=SYSTEM`).
    System,
}

/// The agent's own certificate for mutual TLS to istiod (file-mounted certificates).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    Tls {
        roots: RootCerts,
        identity: Option<ClientIdentity>,
    },
    /// `controlPlaneAuthPolicy: NONE` or port 15010.
    Plaintext,
}

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// `host:port` (`discoveryAddress`).
    pub address: String,
    pub transport: Transport,
    /// `ISTIOD_SAN`: overrides the TLS server name.
    pub san: Option<String>,
    /// The bearer token file; `None` sends no token.
    pub token_path: Option<PathBuf>,
    /// Sent as `ClusterID` metadata.
    pub cluster_id: String,
    /// `XDS_HEADER_<name>=<value>` pairs, sent as metadata.
    pub headers: Vec<(String, String)>,
    pub connect_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("discovery address {0:?} is not host:port")]
    Address(String),
    #[error("cannot read the XDS root certificate {path}")]
    RootCert {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the client certificate or key {path}")]
    Identity {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the istiod token {path}")]
    Token {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the istiod token {0} is empty or not a single line of ASCII")]
    TokenInvalid(PathBuf),
    #[error(
        "XDS header {0:?} is not valid gRPC metadata (names: lowercase letters, digits, '-', '_', '.'; values: ASCII)"
    )]
    Header(String),
    #[error("TLS setup for {address}")]
    Tls {
        address: String,
        #[source]
        source: crate::support::tls::TlsError,
    },
    #[error("{name:?} is not a TLS server name")]
    ServerName { name: String },
    #[error("connect to {address}")]
    Connect {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("connect to {address}: no answer within {timeout:?}")]
    ConnectTimeout { address: String, timeout: Duration },
}

/// The ADS client Weir uses upstream.
pub type AdsClient = AggregatedDiscoveryServiceClient<Channel>;

impl UpstreamConfig {
    /// Plaintext to `address` with no token: for tests and local control planes.
    pub fn plaintext(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            transport: Transport::Plaintext,
            san: None,
            token_path: None,
            cluster_id: "Kubernetes".into(),
            headers: Vec::new(),
            connect_timeout: CONNECT_TIMEOUT,
        }
    }

    /// The host part of the address.
    pub fn host(&self) -> Result<&str, UpstreamError> {
        let (host, port) =
            self.address.rsplit_once(':').ok_or_else(|| UpstreamError::Address(self.address.clone()))?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(UpstreamError::Address(self.address.clone()));
        }
        Ok(host.trim_start_matches('[').trim_end_matches(']'))
    }

    /// The name istiod's certificate must carry, as pilot-agent picks it.
    pub fn server_name(&self) -> Result<String, UpstreamError> {
        if let Some(san) = &self.san {
            return Ok(san.clone());
        }
        let host = self.host()?;
        Ok(if host.contains("localhost") { "istiod.istio-system.svc".into() } else { host.into() })
    }

    /// Checks what can be checked without connecting (address, header syntax).
    pub fn validate(&self) -> Result<(), UpstreamError> {
        self.host()?;
        for (name, value) in &self.headers {
            header(name, value)?;
        }
        Ok(())
    }

    fn endpoint(&self) -> Result<Endpoint, UpstreamError> {
        self.host()?;
        // The connector below makes the TLS connection, so the channel itself dials
        // "http"; requests still say https (the origin), as they do over TLS.
        let endpoint = Endpoint::from_shared(format!("http://{}", self.address))
            .map_err(|_| UpstreamError::Address(self.address.clone()))?
            .connect_timeout(self.connect_timeout)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .initial_stream_window_size(WINDOW)
            .initial_connection_window_size(WINDOW)
            .tcp_nodelay(true);
        if self.transport == Transport::Plaintext {
            return Ok(endpoint);
        }
        let origin = format!("https://{}", self.address)
            .parse()
            .map_err(|_| UpstreamError::Address(self.address.clone()))?;
        Ok(endpoint.origin(origin))
    }

    /// The TLS connector for istiod: the agent's one client configuration with the
    /// roots and client certificate this transport names, offering `h2`.
    fn tls(&self) -> Result<Option<(tokio_rustls::TlsConnector, ServerName<'static>)>, UpstreamError> {
        let Transport::Tls { roots, identity } = &self.transport else { return Ok(None) };
        let tls_error = |source| UpstreamError::Tls { address: self.address.clone(), source };
        let roots = match roots {
            RootCerts::System => crate::support::tls::Roots::system().map_err(tls_error)?,
            RootCerts::File(path) => {
                let pem = std::fs::read(path)
                    .map_err(|source| UpstreamError::RootCert { path: path.clone(), source })?;
                crate::support::tls::Roots::from_pem(
                    &pem,
                    &format!("XDS root certificate {}", path.display()),
                )
                .map_err(tls_error)?
            }
        };
        let identity = match identity {
            Some(id) => {
                let read = |path: &PathBuf| {
                    std::fs::read(path)
                        .map_err(|source| UpstreamError::Identity { path: path.clone(), source })
                };
                let what = id.cert.display().to_string();
                Some(
                    crate::support::tls::Identity::from_pem(&read(&id.cert)?, &read(&id.key)?, &what)
                        .map_err(tls_error)?,
                )
            }
            None => None,
        };
        let config = crate::support::tls::client_config(
            crate::support::tls::ServerTrust::Roots(roots),
            identity,
            &[crate::support::tls::ALPN_H2],
        )
        .map_err(tls_error)?;
        let name = self.server_name()?;
        let server_name =
            ServerName::try_from(name.clone()).map_err(|_| UpstreamError::ServerName { name })?;
        Ok(Some((tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)), server_name)))
    }

    /// Dials the address: a new HTTP/2 connection (TLS handshake included).
    pub async fn channel(&self) -> Result<Channel, UpstreamError> {
        let endpoint = self.endpoint()?;
        let connect = async {
            match self.tls()? {
                None => endpoint.connect().await,
                Some((tls, server_name)) => {
                    let address = self.address.clone();
                    endpoint
                        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
                            let (tls, server_name, address) =
                                (tls.clone(), server_name.clone(), address.clone());
                            async move {
                                let tcp = tokio::net::TcpStream::connect(address.as_str()).await?;
                                tcp.set_nodelay(true)?;
                                let stream = tls.connect(server_name, tcp).await?;
                                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                            }
                        }))
                        .await
                }
            }
            .map_err(|source| UpstreamError::Connect { address: self.address.clone(), source })
        };
        tokio::time::timeout(self.connect_timeout + Duration::from_secs(1), connect).await.map_err(|_| {
            UpstreamError::ConnectTimeout { address: self.address.clone(), timeout: self.connect_timeout }
        })?
    }

    /// Dials istiod for ADS.
    pub async fn connect(&self) -> Result<AdsClient, UpstreamError> {
        let channel = self.channel().await?;
        Ok(AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX))
    }

    /// Wraps a request stream with the per-stream metadata (token read now).
    pub fn request<T>(&self, body: T) -> Result<tonic::Request<T>, UpstreamError> {
        let mut request = tonic::Request::new(body);
        let md = request.metadata_mut();
        if let Some(path) = &self.token_path {
            let token = std::fs::read_to_string(path)
                .map_err(|source| UpstreamError::Token { path: path.clone(), source })?;
            let value = AsciiMetadataValue::try_from(format!("Bearer {}", token.trim()))
                .ok()
                .filter(|_| !token.trim().is_empty())
                .ok_or_else(|| UpstreamError::TokenInvalid(path.clone()))?;
            md.insert("authorization", value);
        }
        let (k, v) = header("ClusterID", &self.cluster_id)?;
        md.insert(k, v);
        for (name, value) in &self.headers {
            let (k, v) = header(name, value)?;
            md.append(k, v);
        }
        Ok(request)
    }
}

/// One metadata entry; gRPC metadata names are lowercase on the wire.
fn header(
    name: &str,
    value: &str,
) -> Result<(MetadataKey<tonic::metadata::Ascii>, AsciiMetadataValue), UpstreamError> {
    let key = MetadataKey::from_bytes(name.to_ascii_lowercase().as_bytes())
        .map_err(|_| UpstreamError::Header(name.into()))?;
    if name.to_ascii_lowercase().ends_with("-bin") {
        return Err(UpstreamError::Header(name.into()));
    }
    let value = AsciiMetadataValue::try_from(value).map_err(|_| UpstreamError::Header(name.into()))?;
    Ok((key, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(address: &str) -> UpstreamConfig {
        UpstreamConfig {
            transport: Transport::Tls { roots: RootCerts::System, identity: None },
            ..UpstreamConfig::plaintext(address)
        }
    }

    #[test]
    fn server_name_follows_pilot_agent() {
        assert_eq!(tls("istiod.istio-system.svc:15012").server_name().unwrap(), "istiod.istio-system.svc");
        assert_eq!(tls("localhost:15012").server_name().unwrap(), "istiod.istio-system.svc");
        assert_eq!(tls("[::1]:15012").host().unwrap(), "::1");
        let mut c = tls("10.0.0.1:15012");
        c.san = Some("istiod.example".into());
        assert_eq!(c.server_name().unwrap(), "istiod.example");
        assert!(matches!(tls("istiod").validate(), Err(UpstreamError::Address(_))));
        assert!(matches!(tls("istiod:http").validate(), Err(UpstreamError::Address(_))));
    }

    #[test]
    fn metadata_carries_token_cluster_and_headers() {
        let dir = std::env::temp_dir().join(format!("weir-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token = dir.join("istio-token");
        std::fs::write(&token, "abc.def.ghi\n").unwrap();
        let mut c = UpstreamConfig::plaintext("istiod:15010");
        c.token_path = Some(token.clone());
        c.cluster_id = "east".into();
        c.headers = vec![("X-Team".into(), "payments".into())];
        let r = c.request(()).unwrap();
        assert_eq!(r.metadata().get("authorization").unwrap(), "Bearer abc.def.ghi");
        assert_eq!(r.metadata().get("clusterid").unwrap(), "east");
        assert_eq!(r.metadata().get("x-team").unwrap(), "payments");

        std::fs::write(&token, "").unwrap();
        assert!(matches!(c.request(()), Err(UpstreamError::TokenInvalid(_))));
        std::fs::remove_file(&token).unwrap();
        let e = c.request(()).unwrap_err();
        assert!(matches!(e, UpstreamError::Token { .. }), "{e}");
        assert!(e.to_string().contains("istio-token"));
        c.token_path = None;
        c.headers = vec![("bad header".into(), "x".into())];
        assert!(matches!(c.request(()), Err(UpstreamError::Header(_))));
        let _ = std::fs::remove_dir_all(dir);
    }
}
