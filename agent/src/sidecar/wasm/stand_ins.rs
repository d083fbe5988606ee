//! The Wasm fetcher against local stand-ins of what it meets on the internet: a
//! release URL that answers 302 (GitHub's), a registry that wants an anonymous bearer
//! token from its token service (Docker Hub's, GHCR's), serves an image index and
//! sends blobs to storage elsewhere, a registry that fails once, and proxies (plain
//! HTTP, and CONNECT for https) named by `HTTP_PROXY`/`HTTPS_PROXY`/`NO_PROXY`.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::Response;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::{
    cache::{CacheOptions, ModuleCache},
    fetch::{Client, ProxySettings},
    rewrite::RemoteModule,
};

/// One request a stand-in saw.
#[derive(Debug, Clone)]
struct Seen {
    /// Path and query.
    path: String,
    authorization: Option<String>,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// An HTTP/1.1 server on loopback answering with `route`; returns its address and
/// what it saw.
async fn stand_in(
    route: impl Fn(&Seen) -> Response<Full<Bytes>> + Send + Sync + 'static,
) -> (SocketAddr, Log) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log: Log = Arc::default();
    let (route, seen) = (Arc::new(route), log.clone());
    tokio::spawn(crate::support::http1::serve(listener, move |request, _| {
        let (route, seen) = (route.clone(), seen.clone());
        async move {
            let request = Seen {
                path: request.uri().path_and_query().map(|p| p.to_string()).unwrap_or_default(),
                authorization: request
                    .headers()
                    .get(hyper::header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .map(String::from),
            };
            seen.lock().unwrap().push(request.clone());
            route(&request)
        }
    }));
    (addr, log)
}

fn answer(status: u16, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::builder().status(status);
    for (name, value) in headers {
        response = response.header(*name, *value);
    }
    response.body(Full::new(body.into())).unwrap()
}

/// A (tiny, valid-looking) Wasm module: the magic and version, then `tag`.
fn module_bytes(tag: &str) -> Vec<u8> {
    let mut bytes = b"\0asm\x01\0\0\0".to_vec();
    bytes.extend_from_slice(tag.as_bytes());
    bytes
}

fn sha256(bytes: &[u8]) -> String {
    super::fetch::hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref())
}

fn cache(dir: &tempfile::TempDir, insecure_registries: Vec<String>) -> std::sync::Arc<ModuleCache> {
    let options = CacheOptions {
        dir: dir.path().into(),
        insecure_registries,
        max_retries: 2,
        http_timeout: Duration::from_secs(5),
        ..Default::default()
    };
    std::sync::Arc::new(ModuleCache::new(options, Default::default()))
}

fn remote(uri: &str, sha256: &str) -> RemoteModule {
    RemoteModule { resource: "default.filter".into(), uri: uri.into(), sha256: sha256.into(), timeout: None }
}

/// A release download answers 302 to where the file is (another host): followed.
#[tokio::test]
async fn a_module_behind_a_302_is_fetched() {
    let module = module_bytes("released");
    let served = module.clone();
    let (storage, _) = stand_in(move |r| match r.path.as_str() {
        "/objects/filter.wasm?sig=abc" => answer(200, &[], served.clone()),
        _ => answer(404, &[], ""),
    })
    .await;
    let location = format!("http://{storage}/objects/filter.wasm?sig=abc");
    let (release, seen) = stand_in(move |_| answer(302, &[("location", location.as_str())], "")).await;
    let dir = tempfile::tempdir().unwrap();
    let uri = format!("http://{release}/org/filter/releases/download/v1/filter.wasm");
    let path = cache(&dir, vec![]).get(&remote(&uri, &sha256(&module))).await.unwrap();
    assert_eq!(std::fs::read(path).unwrap(), module);
    assert_eq!(seen.lock().unwrap().len(), 1);
}

/// A registry as Docker Hub and GHCR answer anonymous pulls: 401 with a Bearer
/// challenge, a token from the token service for the repository's pull scope, an
/// image index for the tag, the platform's manifest by digest, and the blob sent to
/// storage elsewhere (which must not get the registry's token). The first manifest
/// request fails with 503 and is retried.
#[tokio::test]
async fn a_module_is_pulled_from_a_token_protected_registry_through_an_index() {
    let module = module_bytes("from a registry");
    let layer = format!("sha256:{}", sha256(&module));
    let served = module.clone();
    let (storage, storage_seen) = stand_in(move |r| match r.path.as_str() {
        "/blobs/layer?expires=soon" => answer(200, &[], served.clone()),
        _ => answer(404, &[], ""),
    })
    .await;
    let (tokens, tokens_seen) = stand_in(|r| {
        if r.path == "/token?service=registry.test&scope=repository%3Aorg%2Ffilter%3Apull" {
            answer(200, &[("content-type", "application/json")], r#"{"token":"t0ken","expires_in":300}"#)
        } else {
            answer(400, &[], "")
        }
    })
    .await;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:c", "size": 2},
        "layers": [{"mediaType": super::oci::WASM_LAYER, "digest": layer, "size": module.len()}],
    })
    .to_string();
    let manifest_digest = format!("sha256:{}", sha256(manifest.as_bytes()));
    let arch = if cfg!(target_arch = "aarch64") { "arm64" } else { "amd64" };
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:other", "size": 1,
             "platform": {"os": "linux", "architecture": "s390x"}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest, "size": manifest.len(),
             "platform": {"os": "linux", "architecture": arch}},
        ],
    })
    .to_string();
    let challenge = format!(
        r#"Bearer realm="http://{tokens}/token",service="registry.test",scope="repository:org/filter:pull""#
    );
    let blob_location = format!("http://{storage}/blobs/layer?expires=soon");
    let blob_path = format!("blobs/{layer}");
    let failed_once = std::sync::atomic::AtomicBool::new(false);
    let (registry, registry_seen) = stand_in(move |r| {
        if r.authorization.as_deref() != Some("Bearer t0ken") {
            return answer(
                401,
                &[("www-authenticate", challenge.as_str())],
                r#"{"errors":[{"code":"UNAUTHORIZED"}]}"#,
            );
        }
        let index_type = [("content-type", "application/vnd.oci.image.index.v1+json")];
        let manifest_type = [("content-type", "application/vnd.oci.image.manifest.v1+json")];
        match r.path.strip_prefix("/v2/org/filter/") {
            Some("manifests/v1") if !failed_once.swap(true, std::sync::atomic::Ordering::Relaxed) => {
                answer(503, &[], "")
            }
            Some("manifests/v1") => answer(200, &index_type, index.clone()),
            Some(p) if p == format!("manifests/{manifest_digest}") => {
                answer(200, &manifest_type, manifest.clone())
            }
            Some(p) if p == blob_path => answer(307, &[("location", blob_location.as_str())], ""),
            _ => answer(404, &[], r#"{"errors":[{"code":"MANIFEST_UNKNOWN"}]}"#),
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let cache = cache(&dir, vec![registry.to_string()]);
    let path = cache.get(&remote(&format!("oci://{registry}/org/filter:v1"), "")).await.unwrap();
    assert_eq!(std::fs::read(path).unwrap(), module);
    assert_eq!(tokens_seen.lock().unwrap().len(), 1, "one token for the pull");
    let registry_seen = registry_seen.lock().unwrap();
    let paths: Vec<&str> = registry_seen.iter().map(|r| r.path.as_str()).collect();
    assert_eq!(paths[..3], ["/v2/org/filter/manifests/v1"; 3], "401, then 503, then the index");
    assert!(paths.iter().any(|p| p.ends_with(&layer)), "{paths:?}");
    let storage_seen = storage_seen.lock().unwrap();
    assert_eq!(storage_seen.len(), 1);
    assert_eq!(storage_seen[0].authorization, None, "the registry's token went to storage elsewhere");
}

/// A layer whose bytes do not hash to the digest its manifest gives is refused, naming
/// both digests, and nothing is stored.
#[tokio::test]
async fn a_layer_that_does_not_match_its_manifest_digest_is_refused() {
    let module = module_bytes("tampered on the way");
    let promised = sha256(&module_bytes("what the manifest promised"));
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:c", "size": 2},
        "layers": [{"mediaType": super::oci::WASM_LAYER, "digest": format!("sha256:{promised}"), "size": module.len()}],
    })
    .to_string();
    let blob_path = format!("/v2/org/filter/blobs/sha256:{promised}");
    let (registry, _) = stand_in(move |r| match r.path.as_str() {
        "/v2/org/filter/manifests/v1" => {
            answer(200, &[("content-type", "application/vnd.oci.image.manifest.v1+json")], manifest.clone())
        }
        p if p == blob_path => answer(200, &[], module.clone()),
        _ => answer(404, &[], ""),
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let err = cache(&dir, vec!["*".into()])
        .get(&remote(&format!("oci://{registry}/org/filter:v1"), ""))
        .await
        .unwrap_err()
        .to_string();
    let actual = sha256(&module_bytes("tampered on the way"));
    assert!(err.contains(&format!("has digest sha256:{actual}, not sha256:{promised}")), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).map(|d| d.count()).unwrap_or(0), 0, "something was stored");
}

/// A registry that wants credentials the agent does not have says so by name.
#[tokio::test]
async fn a_registry_refusing_the_token_is_named() {
    let (tokens, _) = stand_in(|_| answer(200, &[], r#"{"token":"useless"}"#)).await;
    let challenge = format!(r#"Bearer realm="http://{tokens}/token",service="registry.test""#);
    let (registry, _) = stand_in(move |_| {
        answer(401, &[("www-authenticate", challenge.as_str())], r#"{"errors":[{"code":"DENIED"}]}"#)
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let err = cache(&dir, vec!["*".into()])
        .get(&remote(&format!("oci://{registry}/private/filter:v1"), ""))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("HTTP status 401") && err.contains("DENIED"), "{err}");
}

/// A proxy stand-in: plain-HTTP requests (absolute form) are answered by the proxy
/// itself with `body`; CONNECT tunnels go to the same port on loopback. Records the
/// request lines.
async fn proxy(body: Vec<u8>) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let lines: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = lines.clone();
    tokio::spawn(async move {
        loop {
            let (mut client, _) = listener.accept().await.unwrap();
            let (seen, body) = (seen.clone(), body.clone());
            tokio::spawn(async move {
                let head = read_head(&mut client).await;
                let line = head.lines().next().unwrap_or_default().to_string();
                seen.lock().unwrap().push(line.clone());
                let mut words = line.split_whitespace();
                match (words.next(), words.next()) {
                    (Some("CONNECT"), Some(target)) => {
                        let port = target.rsplit_once(':').unwrap().1;
                        let mut upstream =
                            tokio::net::TcpStream::connect(format!("127.0.0.1:{port}")).await.unwrap();
                        client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await.unwrap();
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    }
                    _ => {
                        let head = format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                            body.len()
                        );
                        client.write_all(head.as_bytes()).await.unwrap();
                        client.write_all(&body).await.unwrap();
                    }
                }
            });
        }
    });
    (addr, lines)
}

async fn read_head(stream: &mut tokio::net::TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).await.unwrap() == 1 {
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// A TLS server for `name` (certificate from `ca`) answering any request with `body`.
async fn tls_server(
    name: &str,
    ca: &(rcgen::CertificateParams, rcgen::KeyPair),
    body: Vec<u8>,
) -> SocketAddr {
    use tokio_rustls::rustls::{
        self,
        pki_types::{CertificateDer, PrivateKeyDer},
    };
    let key = rcgen::KeyPair::generate().unwrap();
    let issuer = rcgen::Issuer::from_params(&ca.0, &ca.1);
    let cert = rcgen::CertificateParams::new(vec![name.into()]).unwrap().signed_by(&key, &issuer).unwrap();
    let config =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![CertificateDer::from(cert.der().to_vec())],
                PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
            )
            .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let (acceptor, body) = (acceptor.clone(), body.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && tls.read(&mut byte).await.unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let answer =
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len());
                let _ = tls.write_all(answer.as_bytes()).await;
                let _ = tls.write_all(&body).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    addr
}

/// `HTTP_PROXY` and `HTTPS_PROXY` are used, as Go's transport uses them: plain HTTP
/// through the proxy, https tunnelled with CONNECT (and verified end to end against
/// the roots); hosts in `NO_PROXY`, and loopback, are reached directly.
#[tokio::test]
async fn proxies_from_the_environment_are_used_unless_no_proxy_says_otherwise() {
    let via_proxy = module_bytes("via the proxy");
    let (proxy_addr, lines) = proxy(via_proxy.clone()).await;
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let ca = (ca_params, ca_key);
    let over_tls = module_bytes("over TLS");
    let tls_addr = tls_server("modules.example", &ca, over_tls.clone()).await;
    let (direct, direct_seen) = stand_in(|_| answer(200, &[], module_bytes("direct"))).await;
    let settings = ProxySettings {
        http: Some(format!("http://{proxy_addr}")),
        https: Some(format!("http://{proxy_addr}")),
        no_proxy: "skipped.example".into(),
    };
    let roots = crate::support::tls::Roots::from_pem(ca_cert.pem().as_bytes(), "the test CA");
    let client = Client::with_roots(&settings, 0, roots).unwrap();
    let get = |url: String| {
        let client = &client;
        async move { client.get(&url, &[], Duration::from_secs(5), 1 << 20).await }
    };

    // Plain HTTP to a name only the proxy knows.
    let a = get("http://modules.example/filter.wasm".into()).await.unwrap();
    assert_eq!((a.status.as_u16(), a.body.to_vec()), (200, via_proxy));
    // https through a CONNECT tunnel, the certificate checked for the name.
    let url = format!("https://modules.example:{}/filter.wasm", tls_addr.port());
    let a = get(url).await.unwrap();
    assert_eq!((a.status.as_u16(), a.body.to_vec()), (200, over_tls));
    // Loopback directly.
    let a = get(format!("http://{direct}/filter.wasm")).await.unwrap();
    assert_eq!(a.body.to_vec(), module_bytes("direct"));
    assert_eq!(direct_seen.lock().unwrap().len(), 1);
    // NO_PROXY: not sent to the proxy (and the name resolves nowhere).
    assert!(get("http://skipped.example/filter.wasm".into()).await.is_err());

    let lines = lines.lock().unwrap();
    assert_eq!(
        *lines,
        [
            "GET http://modules.example/filter.wasm HTTP/1.1".to_string(),
            format!("CONNECT modules.example:{} HTTP/1.1", tls_addr.port()),
        ]
    );
}
