//! The HTTP client of the Wasm fetcher (module URLs and OCI registries alike), with the
//! behaviour of Go's default transport that pilot-agent's fetchers rely on: redirects
//! followed (10 at most; credentials dropped when one leaves the origin), `HTTP_PROXY`
//! and `HTTPS_PROXY` honoured unless `NO_PROXY` (or a loopback destination) says
//! otherwise, and a failed request retried with backoff on transport errors, 408, 429
//! and 5xx. TLS is the agent's one client configuration over the system's roots.

use std::time::Duration;

use bytes::Bytes;
use reqwest::{StatusCode, header::HeaderMap};
use serde::Serialize;

/// The largest module accepted (a URL's body or an OCI layer).
pub(super) const MAX_MODULE: usize = 64 << 20;

/// Lowercase hex, as digests are written in OCI references and the cache's names.
pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// How many redirects one request follows (Go's and kubelet's limit).
const MAX_REDIRECTS: usize = 10;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The proxies in the agent's environment, as Go's `httpproxy.FromEnvironment` reads
/// them (the upper-case name first).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxySettings {
    #[serde(serialize_with = "redacted")]
    pub http: Option<String>,
    #[serde(serialize_with = "redacted")]
    pub https: Option<String>,
    /// `NO_PROXY`: hosts, domains (`.example.com` or `example.com` with its
    /// subdomains), IPs, CIDRs, or `*`.
    pub no_proxy: String,
}

/// A proxy URL as printed: any password replaced.
fn redacted<S: serde::Serializer>(url: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match url {
        Some(u) => match u.split_once("://").and_then(|(scheme, rest)| Some((scheme, rest.split_once('@')?)))
        {
            Some((scheme, (user, host))) => {
                let user = user.split_once(':').map_or(user, |(name, _)| name);
                s.serialize_str(&format!("{scheme}://{user}:***@{host}"))
            }
            None => s.serialize_str(u),
        },
        None => s.serialize_none(),
    }
}

impl ProxySettings {
    /// Checks a proxy URL as the client will read it; the error is for the caller to
    /// name its variable in.
    pub fn check(url: &str) -> Result<(), String> {
        reqwest::Proxy::all(url).map(|_| ()).map_err(|e| e.to_string())
    }

    fn no_proxy(&self) -> Option<reqwest::NoProxy> {
        // Go never proxies a loopback destination.
        let mut list = String::from("localhost,127.0.0.0/8,::1");
        if !self.no_proxy.trim().is_empty() {
            list.push(',');
            list.push_str(&self.no_proxy);
        }
        reqwest::NoProxy::from_string(&list)
    }
}

/// One GET's answer: status, headers, and the body (read up to a limit).
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// Why a GET has no answer worth returning. The text names what failed; the URL is
/// the caller's to add.
#[derive(Debug, thiserror::Error)]
pub enum GetError {
    #[error("TLS: {0}")]
    Tls(String),
    #[error("{0}")]
    Transport(String),
    #[error("the answer is larger than {limit} bytes")]
    TooLarge { limit: usize },
}

/// The fetcher's HTTP client.
pub struct Client {
    http: reqwest::Client,
    max_retries: u32,
    /// Why there are no roots to verify servers with (https then fails saying so).
    no_roots: Option<String>,
}

impl Client {
    pub fn new(proxy: &ProxySettings, max_retries: u32) -> Result<Self, GetError> {
        Self::with_roots(proxy, max_retries, crate::support::tls::Roots::system())
    }

    /// As [`Client::new`], trusting `roots` (the system's, or a test's CA).
    pub(crate) fn with_roots(
        proxy: &ProxySettings,
        max_retries: u32,
        roots: Result<std::sync::Arc<tokio_rustls::rustls::RootCertStore>, crate::support::tls::TlsError>,
    ) -> Result<Self, GetError> {
        let (roots, no_roots) = match roots {
            Ok(roots) => (roots, None),
            // Plain-HTTP modules and registries still work.
            Err(e) => {
                (std::sync::Arc::new(tokio_rustls::rustls::RootCertStore::empty()), Some(e.to_string()))
            }
        };
        let tls = crate::support::tls::client_config(
            crate::support::tls::ServerTrust::Roots(roots),
            None,
            &[crate::support::tls::ALPN_HTTP1],
        )
        .map_err(|e| GetError::Tls(e.to_string()))?;
        // The environment is read by the configuration (and validated there), not here.
        let mut builder = reqwest::Client::builder()
            .no_proxy()
            .tls_backend_preconfigured(tls)
            .redirect(reqwest::redirect::Policy::limited(MAX_REDIRECTS))
            .user_agent(concat!("weir/", env!("WEIR_VERSION")));
        for (url, scheme) in [(&proxy.http, "http"), (&proxy.https, "https")] {
            let Some(url) = url else { continue };
            let p = if scheme == "http" { reqwest::Proxy::http(url) } else { reqwest::Proxy::https(url) };
            let p = p.map_err(|e| GetError::Transport(format!("proxy {url}: {e}")))?;
            builder = builder.proxy(p.no_proxy(proxy.no_proxy()));
        }
        let http = builder.build().map_err(|e| GetError::Transport(crate::error_chain(&e)))?;
        Ok(Self { http, max_retries, no_roots })
    }

    /// GETs `url` with `headers`, following redirects, each attempt bounded by
    /// `timeout`; retried on transport errors, 408, 429 and 5xx (the last answer is
    /// returned when retries run out). The body is read up to `limit` bytes.
    pub async fn get(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        timeout: Duration,
        limit: usize,
    ) -> Result<Answer, GetError> {
        let mut backoff = FIRST_BACKOFF;
        let mut attempt = 0;
        loop {
            let answer = self.get_once(url, headers, timeout, limit).await;
            let retry = match &answer {
                Ok(a) => {
                    a.status.is_server_error()
                        || a.status == StatusCode::TOO_MANY_REQUESTS
                        || a.status == StatusCode::REQUEST_TIMEOUT
                }
                Err(GetError::Transport(_)) => true,
                Err(_) => false,
            };
            if !retry || attempt >= self.max_retries {
                return answer;
            }
            attempt += 1;
            let why = match &answer {
                Ok(a) => format!("HTTP status {}", a.status.as_u16()),
                Err(e) => e.to_string(),
            };
            tracing::warn!(url, attempt, error = %why, "Wasm fetch failed, retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    async fn get_once(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        timeout: Duration,
        limit: usize,
    ) -> Result<Answer, GetError> {
        if let Some(why) = self.no_roots.as_ref().filter(|_| url.starts_with("https:")) {
            return Err(GetError::Tls(why.clone()));
        }
        let mut request = self.http.get(url).timeout(timeout);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let transport = |e: reqwest::Error| GetError::Transport(describe(&e));
        let mut response = request.send().await.map_err(transport)?;
        let status = response.status();
        let headers = response.headers().clone();
        if response.content_length().is_some_and(|n| n > limit as u64) {
            return Err(GetError::TooLarge { limit });
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(transport)? {
            if body.len() + chunk.len() > limit {
                return Err(GetError::TooLarge { limit });
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Answer { status, headers, body: Bytes::from(body) })
    }
}

/// reqwest's error with its causes ("error sending request: client error (Connect):
/// tcp connect error: Connection refused"), and "timed out" said plainly.
fn describe(e: &reqwest::Error) -> String {
    let chain = crate::error_chain(e);
    if e.is_timeout() { format!("no answer in time: {chain}") } else { chain }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_proxies_hide_their_password() {
        let p = ProxySettings {
            http: Some("http://proxy:3128".into()),
            https: Some("http://alice:s3cret@proxy:3128".into()),
            no_proxy: ".svc".into(),
        };
        let json = serde_json::to_string(&p).unwrap();
        assert!(json.contains("http://alice:***@proxy:3128") && !json.contains("s3cret"), "{json}");
        assert!(json.contains("\"http\":\"http://proxy:3128\""), "{json}");
    }

    #[test]
    fn proxy_urls_are_checked() {
        assert!(ProxySettings::check("http://proxy:3128").is_ok());
        assert!(ProxySettings::check("proxy.corp:3128").is_ok(), "Go takes a bare host:port as http");
        assert!(ProxySettings::check("http://[::1").is_err());
    }
}
