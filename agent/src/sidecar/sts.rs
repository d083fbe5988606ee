//! The Security Token Service on `--stsPort` (127.0.0.1 only), as pilot-agent served
//! it for Envoy's Google gRPC clients until Istio 1.22: `POST /token` takes an
//! OAuth 2.0 token exchange request (RFC 8693, form-encoded: `grant_type`
//! token-exchange, `subject_token` a JWT, `subject_token_type` jwt) and answers with
//! the exchanged token, `GET /stsStatus` shows what is cached. A request Istio would
//! refuse gets 400 `invalid_request`; a token manager failure 500 `invalid_target`,
//! each with an `error_description` (RFC 6749 §5.2).
//!
//! The token manager (`--tokenManagerPlugin`, `GoogleTokenExchange` as Istio) sends
//! the subject token to the federated token endpoint (Google's
//! `https://sts.googleapis.com/v1/token`, or `WEIR_STS_TOKEN_ENDPOINT`) with Istio's
//! audience `identitynamespace:<trust domain or the token's one audience>:<GKE_CLUSTER_URL>`,
//! retries transport errors and 5xx up to 5 times, and caches the token until 5
//! minutes before it expires.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::{Method, Request, Response, StatusCode, Uri, body::Incoming};
use serde::Serialize;
use tokio::net::TcpListener;

pub const TOKEN_PATH: &str = "/token";
pub const STATUS_PATH: &str = "/stsStatus";
pub const FORM: &str = "application/x-www-form-urlencoded";
pub const TOKEN_EXCHANGE: &str = "urn:ietf:params:oauth:grant-type:token-exchange";
pub const JWT: &str = "urn:ietf:params:oauth:token-type:jwt";
pub const ACCESS_TOKEN: &str = "urn:ietf:params:oauth:token-type:access_token";
/// Istio's only plugin, and the default.
pub const GOOGLE_TOKEN_EXCHANGE: &str = "GoogleTokenExchange";
pub const DEFAULT_ENDPOINT: &str = "https://sts.googleapis.com/v1/token";
const DEFAULT_SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";
const MAX_BODY: usize = 1 << 20;
const ATTEMPTS: usize = 5;
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);
/// A cached token is used until this long before it expires.
const GRACE: Duration = Duration::from_secs(300);

/// What the STS server needs, from the config.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StsSettings {
    pub port: u16,
    pub plugin: String,
    #[serde(serialize_with = "crate::support::text::serialize_display")]
    pub endpoint: Uri,
    pub trust_domain: String,
    /// `GKE_CLUSTER_URL`: the identity provider in the audience.
    pub identity_provider: String,
}

#[derive(Debug, thiserror::Error)]
pub enum StsError {
    #[error("STS server: cannot listen on {address}")]
    Bind {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("--tokenManagerPlugin {0:?}: expected {GOOGLE_TOKEN_EXCHANGE}")]
    Plugin(String),
}

/// The parameters of a valid token exchange request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StsRequest {
    pub grant_type: String,
    pub resource: String,
    pub audience: String,
    pub scope: String,
    pub requested_token_type: String,
    pub subject_token: String,
    pub subject_token_type: String,
    pub actor_token: String,
    pub actor_token_type: String,
}

/// Checks a request as Istio's STS server did; the error is the `error_description`.
pub fn parse_request(method: &Method, content_type: Option<&str>, body: &[u8]) -> Result<StsRequest, String> {
    if method != Method::POST {
        return Err(format!("request method is invalid, should be POST but get {method}"));
    }
    if content_type != Some(FORM) {
        return Err(format!(
            "request content type is invalid, should be {FORM} but get {}",
            content_type.unwrap_or("")
        ));
    }
    let mut form: HashMap<String, String> = HashMap::new();
    for (k, v) in form_urlencoded(body).map_err(|e| format!("failed to parse query from STS request: {e}"))? {
        form.entry(k).or_insert(v);
    }
    let get = |k: &str| form.get(k).cloned().unwrap_or_default();
    if get("grant_type") != TOKEN_EXCHANGE {
        return Err(format!(
            "request query grant_type is invalid, should be {TOKEN_EXCHANGE} but get {}",
            get("grant_type")
        ));
    }
    if get("subject_token").is_empty() {
        return Err("subject_token is empty".into());
    }
    if get("subject_token_type") != JWT {
        return Err(format!(
            "subject_token_type is invalid, should be {JWT} but get {}",
            get("subject_token_type")
        ));
    }
    Ok(StsRequest {
        grant_type: get("grant_type"),
        resource: get("resource"),
        audience: get("audience"),
        scope: get("scope"),
        requested_token_type: get("requested_token_type"),
        subject_token: get("subject_token"),
        subject_token_type: get("subject_token_type"),
        actor_token: get("actor_token"),
        actor_token_type: get("actor_token_type"),
    })
}

/// `application/x-www-form-urlencoded` pairs (`+` is a space, `%XX` a byte).
fn form_urlencoded(body: &[u8]) -> Result<Vec<(String, String)>, String> {
    fn decode(s: &[u8]) -> Result<String, String> {
        let mut out = Vec::with_capacity(s.len());
        let mut i = 0;
        while i < s.len() {
            match s[i] {
                b'+' => out.push(b' '),
                b'%' => {
                    let hex = s.get(i + 1..i + 3).ok_or("truncated %-escape")?;
                    let hex = std::str::from_utf8(hex).map_err(|_| "invalid %-escape")?;
                    out.push(u8::from_str_radix(hex, 16).map_err(|_| format!("invalid %-escape %{hex}"))?);
                    i += 2;
                }
                b => out.push(b),
            }
            i += 1;
        }
        String::from_utf8(out).map_err(|_| "not UTF-8".into())
    }
    body.split(|b| *b == b'&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let mut kv = pair.splitn(2, |b| *b == b'=');
            let k = decode(kv.next().unwrap_or_default())?;
            let v = decode(kv.next().unwrap_or_default())?;
            Ok((k, v))
        })
        .collect()
}

/// RFC 6749 §5.2 error body.
#[derive(Debug, Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
    error_description: String,
}

/// The RFC 8693 §2.2.1 success body.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct TokenResponse {
    pub access_token: String,
    pub issued_token_type: String,
    pub token_type: String,
    pub expires_in: u64,
}

#[derive(Debug, Clone)]
struct Cached {
    token: String,
    issued: SystemTime,
    expires: SystemTime,
}

/// Exchanges subject tokens at the federated token endpoint, with a cache.
pub struct TokenManager {
    settings: StsSettings,
    /// Built on the first exchange over https, from the system's roots.
    tls: std::sync::OnceLock<Result<tokio_rustls::TlsConnector, String>>,
    cache: Mutex<HashMap<(String, String), Cached>>,
}

impl TokenManager {
    pub fn new(settings: StsSettings) -> Result<Self, StsError> {
        if !settings.plugin.is_empty() && settings.plugin != GOOGLE_TOKEN_EXCHANGE {
            return Err(StsError::Plugin(settings.plugin.clone()));
        }
        Ok(Self { settings, tls: std::sync::OnceLock::new(), cache: Mutex::default() })
    }

    /// Istio's audience: the token's single `aud` claim (else the trust domain) as the
    /// identity namespace, and the cluster URL as the provider.
    fn audience(&self, subject_token: &str) -> String {
        let namespace =
            jwt_single_audience(subject_token).unwrap_or_else(|| self.settings.trust_domain.clone());
        format!("identitynamespace:{namespace}:{}", self.settings.identity_provider)
    }

    pub async fn exchange(&self, request: &StsRequest) -> Result<TokenResponse, String> {
        let scope = if request.scope.is_empty() { DEFAULT_SCOPE.to_string() } else { request.scope.clone() };
        let key = (request.subject_token.clone(), scope.clone());
        let now = SystemTime::now();
        if let Some(c) = self.cache.lock().expect("cache lock").get(&key)
            && let Ok(left) = c.expires.duration_since(now)
            && left > GRACE
        {
            return Ok(response(&c.token, left));
        }
        let body = serde_json::json!({
            "audience": self.audience(&request.subject_token),
            "grantType": request.grant_type,
            "requestedTokenType": ACCESS_TOKEN,
            "subjectTokenType": request.subject_token_type,
            "subjectToken": request.subject_token,
            "scope": scope,
        })
        .to_string();
        let endpoint = &self.settings.endpoint;
        let tls = match endpoint.scheme_str() {
            Some("https") => Some(
                self.tls
                    .get_or_init(|| {
                        crate::support::tls::Roots::system()
                            .and_then(|roots| {
                                crate::support::tls::http1_connector(crate::support::tls::ServerTrust::Roots(
                                    roots,
                                ))
                            })
                            .map_err(|e| e.to_string())
                    })
                    .as_ref()
                    .map_err(|e| format!("TLS to {endpoint}: {e}"))?,
            ),
            _ => None,
        };
        let mut last = String::new();
        for attempt in 1..=ATTEMPTS {
            let req = Request::post(endpoint.path_and_query().map(|p| p.as_str()).unwrap_or("/"))
                .header(hyper::header::HOST, endpoint.authority().map(|a| a.as_str()).unwrap_or_default())
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body.clone())))
                .map_err(|e| e.to_string())?;
            let target = crate::support::http1::Target::of(endpoint, tls);
            let answer =
                tokio::time::timeout(UPSTREAM_TIMEOUT, crate::support::http1::fetch(target, req, MAX_BODY))
                    .await
                    .unwrap_or_else(|_| Err(format!("no answer in {UPSTREAM_TIMEOUT:?}")));
            match answer {
                Ok((status, body)) if status == StatusCode::OK => {
                    let parsed: serde_json::Value = serde_json::from_slice(&body)
                        .map_err(|e| format!("federated token response from {endpoint} is not JSON: {e}"))?;
                    let token = parsed["access_token"].as_str().unwrap_or_default().to_string();
                    if token.is_empty() {
                        return Err(format!("federated token response from {endpoint} has no access_token"));
                    }
                    let ttl = Duration::from_secs(parsed["expires_in"].as_u64().unwrap_or(0));
                    tracing::info!(endpoint = %endpoint, ttl = ?ttl, attempt, "fetched federated token");
                    let issued = SystemTime::now();
                    self.cache
                        .lock()
                        .expect("cache lock")
                        .insert(key, Cached { token: token.clone(), issued, expires: issued + ttl });
                    return Ok(response(&token, ttl));
                }
                Ok((status, body)) => {
                    last =
                        format!("HTTP status {}, body: {}", status.as_u16(), String::from_utf8_lossy(&body));
                    if status.is_client_error() {
                        break;
                    }
                }
                Err(e) => last = e,
            }
            tracing::warn!(endpoint = %endpoint, attempt, error = %last, "federated token request failed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(format!("failed to exchange federated token at {endpoint}: {last}"))
    }

    fn status(&self) -> serde_json::Value {
        let cache = self.cache.lock().expect("cache lock");
        let rfc3339 = |t: SystemTime| {
            time::OffsetDateTime::from(t)
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default()
        };
        serde_json::json!(
            cache
                .values()
                .map(|c| serde_json::json!({
                    "token_type": "federated token",
                    "issue_time": rfc3339(c.issued),
                    "expire_time": rfc3339(c.expires),
                }))
                .collect::<Vec<_>>()
        )
    }
}

fn response(token: &str, ttl: Duration) -> TokenResponse {
    TokenResponse {
        access_token: token.into(),
        issued_token_type: ACCESS_TOKEN.into(),
        token_type: "Bearer".into(),
        expires_in: ttl.as_secs(),
    }
}

/// The `aud` claim of a JWT when it names exactly one audience (the signature is the
/// upstream's to check).
fn jwt_single_audience(token: &str) -> Option<String> {
    use base64::Engine as _;
    let payload = token.split('.').nth(1)?;
    let bytes =
        base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload.trim_end_matches('=')).ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    match &claims["aud"] {
        serde_json::Value::String(a) if !a.is_empty() => Some(a.clone()),
        serde_json::Value::Array(a) if a.len() == 1 => {
            a[0].as_str().filter(|s| !s.is_empty()).map(String::from)
        }
        _ => None,
    }
}

/// The server: one [`TokenManager`] behind `/token` and `/stsStatus`.
#[derive(Clone)]
pub struct StsServer {
    manager: Arc<TokenManager>,
}

impl StsServer {
    pub fn new(manager: TokenManager) -> Self {
        Self { manager: Arc::new(manager) }
    }

    /// Binds 127.0.0.1:`port` (pilot-agent's "localhost").
    pub async fn bind(port: u16) -> Result<TcpListener, StsError> {
        let address = SocketAddr::from(([127, 0, 0, 1], port));
        TcpListener::bind(address).await.map_err(|source| StsError::Bind { address, source })
    }

    /// Serves HTTP/1.1 on `listener` until the task is dropped.
    pub async fn serve(self, listener: TcpListener) {
        crate::support::http1::serve(listener, move |req, _| {
            let me = self.clone();
            async move { me.route(req).await }
        })
        .await
    }

    async fn route(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        match req.uri().path() {
            TOKEN_PATH => self.token(req).await,
            STATUS_PATH => json(StatusCode::OK, &self.manager.status()),
            _ => Response::builder()
                .status(StatusCode::NOT_FOUND)
                .body(Full::new(Bytes::from_static(b"404 page not found\n")))
                .expect("static response"),
        }
    }

    async fn token(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let method = req.method().clone();
        let content_type = req
            .headers()
            .get(hyper::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or(v).trim().to_string());
        let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_request", format!("request body: {e}")),
        };
        let request = match parse_request(&method, content_type.as_deref(), &body) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "STS request is invalid");
                return error(StatusCode::BAD_REQUEST, "invalid_request", e);
            }
        };
        match self.manager.exchange(&request).await {
            Ok(token) => json(StatusCode::OK, &token),
            Err(e) => {
                tracing::warn!(error = %e, "token manager failed to generate a token");
                error(StatusCode::INTERNAL_SERVER_ERROR, "invalid_target", e)
            }
        }
    }
}

fn json(status: StatusCode, value: &impl Serialize) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec_pretty(value).expect("JSON serializes"))))
        .expect("valid response")
}

fn error(status: StatusCode, code: &str, description: String) -> Response<Full<Bytes>> {
    json(status, &ErrorBody { error: code, error_description: description })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(pairs: &[(&str, &str)]) -> Vec<u8> {
        pairs
            .iter()
            .map(|(k, v)| format!("{k}={}", v.replace(':', "%3A").replace(' ', "+")))
            .collect::<Vec<_>>()
            .join("&")
            .into_bytes()
    }

    #[test]
    fn requests_are_checked_as_istio_checked_them() {
        let good = form(&[
            ("grant_type", TOKEN_EXCHANGE),
            ("subject_token", "eyJ.x.y"),
            ("subject_token_type", JWT),
            ("scope", "a b"),
        ]);
        let r = parse_request(&Method::POST, Some(FORM), &good).unwrap();
        assert_eq!((r.subject_token.as_str(), r.scope.as_str()), ("eyJ.x.y", "a b"));

        let cases: [(Method, Option<&str>, Vec<u8>, &str); 6] = [
            (Method::GET, Some(FORM), good.clone(), "should be POST but get GET"),
            (Method::POST, Some("application/json"), good.clone(), "content type is invalid"),
            (Method::POST, Some(FORM), form(&[("grant_type", "password")]), "grant_type is invalid"),
            (
                Method::POST,
                Some(FORM),
                form(&[("grant_type", TOKEN_EXCHANGE), ("subject_token_type", JWT)]),
                "subject_token is empty",
            ),
            (
                Method::POST,
                Some(FORM),
                form(&[
                    ("grant_type", TOKEN_EXCHANGE),
                    ("subject_token", "t"),
                    ("subject_token_type", "saml"),
                ]),
                "subject_token_type is invalid",
            ),
            (Method::POST, Some(FORM), b"grant_type=%zz".to_vec(), "failed to parse query"),
        ];
        for (method, ct, body, needle) in cases {
            let err = parse_request(&method, ct, &body).unwrap_err();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }

    #[test]
    fn the_audience_names_the_tokens_single_audience_or_the_trust_domain() {
        use base64::Engine as _;
        let settings = StsSettings {
            port: 0,
            plugin: GOOGLE_TOKEN_EXCHANGE.into(),
            endpoint: DEFAULT_ENDPOINT.parse().unwrap(),
            trust_domain: "proj.svc.id.goog".into(),
            identity_provider: "https://container.googleapis.com/v1/projects/p/locations/l/clusters/c".into(),
        };
        let m = TokenManager::new(settings).unwrap();
        let jwt =
            |claims: &str| format!("h.{}.s", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(claims));
        assert_eq!(
            m.audience(&jwt(r#"{"aud":["other.svc.id.goog"]}"#)),
            "identitynamespace:other.svc.id.goog:https://container.googleapis.com/v1/projects/p/locations/l/clusters/c"
        );
        assert!(m.audience(&jwt(r#"{"aud":["a","b"]}"#)).starts_with("identitynamespace:proj.svc.id.goog:"));
        assert!(m.audience("not a jwt").starts_with("identitynamespace:proj.svc.id.goog:"));
    }

    #[test]
    fn only_istios_plugin_is_known() {
        let settings = StsSettings {
            port: 0,
            plugin: "Vault".into(),
            endpoint: DEFAULT_ENDPOINT.parse().unwrap(),
            trust_domain: String::new(),
            identity_provider: String::new(),
        };
        let err = TokenManager::new(settings).err().unwrap().to_string();
        assert!(
            err.contains("--tokenManagerPlugin \"Vault\"") && err.contains(GOOGLE_TOKEN_EXCHANGE),
            "{err}"
        );
    }
}
