//! The Kubernetes API as the CNI plugin and the node agent use it: a kubeconfig (the
//! node agent's `istio-cni-kubeconfig`, or Istio's legacy `kubernetes.kubeconfig`) and
//! a few calls over HTTP or HTTPS (the cluster CA, or `insecure-skip-tls-verify`; a
//! bearer token, token file, or client certificate): a pod, a namespace, a list, a
//! merge patch of a pod's status, and a watch's open stream (the ambient agent's
//! list+watch, `node/ambient/watch.rs`). A small client of our own on hyper + rustls
//! instead of kube-rs: the measured reason is in ARCHITECTURE.md ("The Kubernetes
//! client").

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use super::pod::PodInfo;
use base64::Engine as _;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, StatusCode, Uri};
use serde::Deserialize;

/// Per request (connect + answer).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("read kubeconfig {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("kubeconfig {path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{method} {url}: {message}")]
    Request { method: &'static str, url: String, message: String },
    #[error("{method} {url}: no answer within {REQUEST_TIMEOUT:?}")]
    Timeout { method: &'static str, url: String },
    #[error("pod {namespace}/{name} not found")]
    NotFound { namespace: String, name: String },
    #[error("{method} {url}: HTTP {status}: {message}")]
    Status { method: &'static str, url: String, status: u16, message: String },
    #[error("GET {url}: the answer is not a {kind}: {message}")]
    Decode { url: String, kind: &'static str, message: String },
}

/// How the plugin authenticates.
#[derive(Clone, PartialEq, Eq)]
pub enum Credentials {
    None,
    Token(String),
    /// Re-read on every request (projected tokens rotate).
    TokenFile(PathBuf),
    ClientCertificate {
        cert_pem: Vec<u8>,
        key_pem: Vec<u8>,
    },
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::None => write!(f, "None"),
            Self::Token(_) => write!(f, "Token(<redacted>)"),
            Self::TokenFile(p) => write!(f, "TokenFile({})", p.display()),
            Self::ClientCertificate { .. } => write!(f, "ClientCertificate(<redacted>)"),
        }
    }
}

/// The current context of a kubeconfig, resolved.
#[derive(Debug, Clone)]
pub struct Kubeconfig {
    pub server: Uri,
    pub ca_pem: Option<Vec<u8>>,
    pub insecure: bool,
    pub credentials: Credentials,
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    clusters: Vec<Named<RawCluster>>,
    #[serde(default)]
    users: Vec<Named<RawUser>>,
    #[serde(default)]
    contexts: Vec<Named<RawContext>>,
    #[serde(rename = "current-context", default)]
    current_context: String,
}

#[derive(Deserialize)]
struct Named<T> {
    name: String,
    #[serde(alias = "cluster", alias = "user", alias = "context")]
    value: Option<T>,
}

#[derive(Deserialize, Default)]
struct RawCluster {
    server: String,
    #[serde(rename = "certificate-authority")]
    ca_file: Option<String>,
    #[serde(rename = "certificate-authority-data")]
    ca_data: Option<String>,
    #[serde(rename = "insecure-skip-tls-verify", default)]
    insecure: bool,
}

#[derive(Deserialize, Default)]
struct RawUser {
    token: Option<String>,
    #[serde(rename = "tokenFile")]
    token_file: Option<String>,
    #[serde(rename = "client-certificate")]
    cert_file: Option<String>,
    #[serde(rename = "client-certificate-data")]
    cert_data: Option<String>,
    #[serde(rename = "client-key")]
    key_file: Option<String>,
    #[serde(rename = "client-key-data")]
    key_data: Option<String>,
}

#[derive(Deserialize, Default)]
struct RawContext {
    cluster: String,
    #[serde(default)]
    user: String,
}

impl Kubeconfig {
    pub fn load(path: &Path) -> Result<Self, KubeError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| KubeError::Read { path: path.into(), source })?;
        Self::parse(path, &text)
    }

    /// Relative file paths are relative to the kubeconfig's folder, as kubectl's.
    pub fn parse(path: &Path, text: &str) -> Result<Self, KubeError> {
        let invalid = |message: String| KubeError::Invalid { path: path.into(), message };
        let raw: RawConfig = serde_yaml_ng::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let context_name = if raw.current_context.is_empty() {
            raw.contexts.first().map(|c| c.name.clone()).unwrap_or_default()
        } else {
            raw.current_context.clone()
        };
        let (cluster_name, user_name) = match raw.contexts.iter().find(|c| c.name == context_name) {
            Some(Named { value: Some(ctx), .. }) => (ctx.cluster.clone(), ctx.user.clone()),
            _ if raw.contexts.is_empty() && raw.clusters.len() == 1 => {
                (raw.clusters[0].name.clone(), raw.users.first().map(|u| u.name.clone()).unwrap_or_default())
            }
            _ => return Err(invalid(format!("current context {context_name:?} is not among its contexts"))),
        };
        let cluster = raw
            .clusters
            .into_iter()
            .find(|c| c.name == cluster_name)
            .and_then(|c| c.value)
            .ok_or_else(|| invalid(format!("cluster {cluster_name:?} is not defined")))?;
        let user =
            raw.users.into_iter().find(|u| u.name == user_name).and_then(|u| u.value).unwrap_or_default();
        let base = path.parent().unwrap_or(Path::new("."));
        let resolve = |p: &str| base.join(p);
        let read = |p: &str, what: &str| {
            std::fs::read(resolve(p)).map_err(|e| invalid(format!("{what} {}: {e}", resolve(p).display())))
        };
        let decode = |d: &str, what: &str| {
            base64::engine::general_purpose::STANDARD
                .decode(d.trim())
                .map_err(|e| invalid(format!("{what} is not base64: {e}")))
        };
        let server: Uri = cluster
            .server
            .parse()
            .map_err(|_| invalid(format!("server {:?} is not a URL", cluster.server)))?;
        match server.scheme_str() {
            Some("http") | Some("https") if server.host().is_some() => {}
            _ => return Err(invalid(format!("server {:?} is not an http(s)://host URL", cluster.server))),
        }
        let ca_pem = match (&cluster.ca_data, &cluster.ca_file) {
            (Some(d), _) => Some(decode(d, "certificate-authority-data")?),
            (None, Some(f)) => Some(read(f, "certificate-authority")?),
            (None, None) => None,
        };
        let cert = match (&user.cert_data, &user.cert_file) {
            (Some(d), _) => Some(decode(d, "client-certificate-data")?),
            (None, Some(f)) => Some(read(f, "client-certificate")?),
            _ => None,
        };
        let key = match (&user.key_data, &user.key_file) {
            (Some(d), _) => Some(decode(d, "client-key-data")?),
            (None, Some(f)) => Some(read(f, "client-key")?),
            _ => None,
        };
        let credentials = match (user.token, user.token_file, cert, key) {
            (Some(t), _, _, _) => Credentials::Token(t),
            (None, Some(f), _, _) => Credentials::TokenFile(resolve(&f)),
            (None, None, Some(cert_pem), Some(key_pem)) => {
                Credentials::ClientCertificate { cert_pem, key_pem }
            }
            (None, None, Some(_), None) | (None, None, None, Some(_)) => {
                return Err(invalid("a client certificate needs both the certificate and its key".into()));
            }
            _ => Credentials::None,
        };
        Ok(Self { server, ca_pem, insecure: cluster.insecure, credentials })
    }
}

/// A Kubernetes API client for one call at a time.
pub struct KubeClient {
    config: Kubeconfig,
    tls: Option<tokio_rustls::TlsConnector>,
    path: PathBuf,
}

impl KubeClient {
    /// `path` is named in errors.
    pub fn new(path: &Path, config: Kubeconfig) -> Result<Self, KubeError> {
        let invalid = |message: String| KubeError::Invalid { path: path.into(), message };
        let tls = if config.server.scheme_str() == Some("https") {
            use crate::support::tls::{Identity, Roots, ServerTrust};
            let tls_error = |e: crate::support::tls::TlsError| invalid(e.to_string());
            let trust = match (&config.insecure, &config.ca_pem) {
                (true, _) => ServerTrust::AnyCertificate,
                (false, Some(pem)) => {
                    ServerTrust::Roots(Roots::from_pem(pem, "the certificate authority").map_err(tls_error)?)
                }
                // No CA in the kubeconfig: the system's roots, as client-go.
                (false, None) => ServerTrust::Roots(Roots::system().map_err(tls_error)?),
            };
            let identity = match &config.credentials {
                Credentials::ClientCertificate { cert_pem, key_pem } => {
                    Some(Identity::from_pem(cert_pem, key_pem, "of the kubeconfig user").map_err(tls_error)?)
                }
                _ => None,
            };
            let client =
                crate::support::tls::client_config(trust, identity, &[crate::support::tls::ALPN_HTTP1])
                    .map_err(tls_error)?;
            Some(tokio_rustls::TlsConnector::from(Arc::new(client)))
        } else {
            None
        };
        Ok(Self { config, tls, path: path.into() })
    }

    pub fn load(path: &Path) -> Result<Self, KubeError> {
        Self::new(path, Kubeconfig::load(path)?)
    }

    /// `GET /api/v1/namespaces/<ns>/pods/<name>`.
    pub async fn pod(&self, namespace: &str, name: &str) -> Result<PodInfo, KubeError> {
        let (url, status, body) = self.get(&format!("/api/v1/namespaces/{namespace}/pods/{name}")).await?;
        match status {
            StatusCode::OK => PodInfo::from_json(&body).map_err(|e| KubeError::Decode {
                url,
                kind: "Pod",
                message: e.to_string(),
            }),
            StatusCode::NOT_FOUND => {
                Err(KubeError::NotFound { namespace: namespace.into(), name: name.into() })
            }
            other => Err(status_error("GET", url, other, &body)),
        }
    }

    /// `GET <path>` (a list, an object) as JSON.
    pub async fn get_json(&self, path: &str) -> Result<serde_json::Value, KubeError> {
        let (url, status, body) = self.get(path).await?;
        if status != StatusCode::OK {
            return Err(status_error("GET", url, status, &body));
        }
        serde_json::from_slice(&body).map_err(|e| KubeError::Decode {
            url,
            kind: "JSON object",
            message: e.to_string(),
        })
    }

    /// A namespace's labels (`GET /api/v1/namespaces/<name>`).
    pub async fn namespace_labels(
        &self,
        name: &str,
    ) -> Result<std::collections::BTreeMap<String, String>, KubeError> {
        let value = self.get_json(&format!("/api/v1/namespaces/{name}")).await?;
        Ok(serde_json::from_value(value["metadata"]["labels"].clone()).unwrap_or_default())
    }

    /// `PATCH /api/v1/namespaces/<ns>/pods/<name>/status` with a JSON merge patch (the
    /// status subresource: metadata changes need only `pods/status: patch`).
    pub async fn patch_pod_status(
        &self,
        namespace: &str,
        name: &str,
        patch: &serde_json::Value,
    ) -> Result<(), KubeError> {
        let path = format!("/api/v1/namespaces/{namespace}/pods/{name}/status");
        let (url, status, body) =
            self.call("PATCH", &path, Some(("application/merge-patch+json", patch.to_string()))).await?;
        match status {
            StatusCode::OK => Ok(()),
            StatusCode::NOT_FOUND => {
                Err(KubeError::NotFound { namespace: namespace.into(), name: name.into() })
            }
            other => Err(status_error("PATCH", url, other, &body)),
        }
    }

    /// `GET <path>` whose answer is streamed (a watch): the response once its headers
    /// arrived (within [`REQUEST_TIMEOUT`]); the body has no deadline.
    pub async fn open_stream(&self, path: &str) -> Result<hyper::Response<hyper::body::Incoming>, KubeError> {
        let (url, request) = self.request("GET", path, None)?;
        let target = crate::support::http1::Target::of(&self.config.server, self.tls.as_ref());
        tokio::time::timeout(REQUEST_TIMEOUT, crate::support::http1::open(target, request))
            .await
            .map_err(|_| KubeError::Timeout { method: "GET", url: url.clone() })?
            .map_err(|message| KubeError::Request { method: "GET", url, message })
    }

    /// `GET /api/v1/pods?fieldSelector=spec.nodeName=<node>`: the pods on a node.
    pub async fn pods_on_node(&self, node: &str) -> Result<Vec<PodInfo>, KubeError> {
        let (url, status, body) =
            self.get(&format!("/api/v1/pods?fieldSelector=spec.nodeName%3D{node}")).await?;
        if status != StatusCode::OK {
            return Err(status_error("GET", url, status, &body));
        }
        PodInfo::list_from_json(&body).map_err(|e| KubeError::Decode {
            url,
            kind: "PodList",
            message: e.to_string(),
        })
    }

    fn authority(&self) -> String {
        self.config.server.authority().map(|a| a.to_string()).unwrap_or_default()
    }

    /// GETs `path` within `REQUEST_TIMEOUT`; returns the full URL (for errors), the
    /// status and the body.
    async fn get(&self, path: &str) -> Result<(String, StatusCode, Bytes), KubeError> {
        self.call("GET", path, None).await
    }

    /// The request for `method path` with the credentials, and its full URL.
    fn request(
        &self,
        method: &'static str,
        path: &str,
        body: Option<(&'static str, String)>,
    ) -> Result<(String, Request<Full<Bytes>>), KubeError> {
        let url =
            format!("{}://{}{path}", self.config.server.scheme_str().unwrap_or("https"), self.authority());
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, self.authority())
            .header(hyper::header::ACCEPT, "application/json")
            .header(hyper::header::USER_AGENT, concat!("weir-cni/", env!("WEIR_VERSION")));
        match &self.config.credentials {
            Credentials::Token(t) => {
                request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"))
            }
            Credentials::TokenFile(p) => {
                let t = std::fs::read_to_string(p).map_err(|e| KubeError::Invalid {
                    path: self.path.clone(),
                    message: format!("tokenFile {}: {e}", p.display()),
                })?;
                request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {}", t.trim()));
            }
            _ => {}
        }
        let body = match body {
            Some((content_type, text)) => {
                request = request.header(hyper::header::CONTENT_TYPE, content_type);
                Bytes::from(text)
            }
            None => Bytes::new(),
        };
        let request = request.body(Full::new(body)).map_err(|e| KubeError::Request {
            method,
            url: url.clone(),
            message: e.to_string(),
        })?;
        Ok((url, request))
    }

    /// `method path` within `REQUEST_TIMEOUT`; the full URL, the status and the body
    /// (lists up to 64 MiB).
    async fn call(
        &self,
        method: &'static str,
        path: &str,
        body: Option<(&'static str, String)>,
    ) -> Result<(String, StatusCode, Bytes), KubeError> {
        let (url, request) = self.request(method, path, body)?;
        let target = crate::support::http1::Target::of(&self.config.server, self.tls.as_ref());
        let (status, body) = tokio::time::timeout(
            REQUEST_TIMEOUT,
            crate::support::http1::fetch(target, request, 64 * 1024 * 1024),
        )
        .await
        .map_err(|_| KubeError::Timeout { method, url: url.clone() })?
        .map_err(|message| KubeError::Request { method, url: url.clone(), message })?;
        Ok((url, status, body))
    }
}

/// A failed call, with the API server's own explanation (its Status object's message).
fn status_error(method: &'static str, url: String, status: StatusCode, body: &[u8]) -> KubeError {
    let message = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(String::from))
        .unwrap_or_else(|| String::from_utf8_lossy(body).chars().take(200).collect());
    KubeError::Status { method, url, status: status.as_u16(), message }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubeconfigs_resolve_their_current_context() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "abc\n").unwrap();
        let text = r#"
apiVersion: v1
kind: Config
clusters:
- name: other
  cluster: {server: "https://other:6443"}
- name: local
  cluster:
    server: https://10.96.0.1:443
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==
users:
- name: istio-cni
  user: {tokenFile: token}
contexts:
- name: istio-cni-context
  context: {cluster: local, user: istio-cni}
current-context: istio-cni-context
"#;
        let path = dir.path().join("istio-cni-kubeconfig");
        let c = Kubeconfig::parse(&path, text).unwrap();
        assert_eq!(c.server, "https://10.96.0.1:443".parse::<Uri>().unwrap());
        assert_eq!(c.ca_pem.as_deref(), Some(&b"-----BEGIN CERTIFICATE-----\n"[..]));
        assert_eq!(c.credentials, Credentials::TokenFile(dir.path().join("token")));

        for (bad, needle) in [
            ("clusters: [{name: a, cluster: {server: 'ftp://x'}}]", "http(s)://host"),
            ("current-context: nope\ncontexts: [{name: x, context: {cluster: a}}]", "\"nope\""),
            ("contexts: [{name: x, context: {cluster: missing}}]", "cluster \"missing\""),
            (
                "clusters: [{name: a, cluster: {server: 'https://x', certificate-authority-data: '%%'}}]",
                "base64",
            ),
            (
                "clusters: [{name: a, cluster: {server: 'https://x'}}]\nusers: [{name: u, user: {client-key-data: 'eA=='}}]",
                "both",
            ),
            ("[1, 2", "istio-cni-kubeconfig"),
        ] {
            let e = Kubeconfig::parse(&path, bad).unwrap_err().to_string();
            assert!(e.contains(needle) && e.contains("istio-cni-kubeconfig"), "{bad}: {e}");
        }
    }
}
