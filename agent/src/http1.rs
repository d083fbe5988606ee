//! One HTTP/1.1 exchange on a stream the caller opened (TCP, TLS): the handshake, the
//! connection driven in the background, the request sent. What to do with the answer's
//! body (read it whole, cut it, cap it) is the caller's.

use hyper::{Request, Response, body::Incoming};

/// Sends `request` over `io` and returns the answer with its body still to be read.
pub async fn exchange<IO, B>(io: IO, request: Request<B>) -> Result<Response<Incoming>, hyper::Error>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(conn);
    sender.send_request(request).await
}

/// Where a one-off request goes: a URL's host and port, over TLS when given.
pub struct Target<'a> {
    pub host: &'a str,
    pub port: u16,
    pub tls: Option<&'a tokio_rustls::TlsConnector>,
}

impl<'a> Target<'a> {
    /// `url`'s host and port (the scheme's default when absent); `tls` is used when
    /// the scheme is https.
    pub fn of(url: &'a hyper::Uri, tls: Option<&'a tokio_rustls::TlsConnector>) -> Self {
        let https = url.scheme_str() == Some("https");
        let host = url.host().unwrap_or_default().trim_start_matches('[').trim_end_matches(']');
        Self {
            host,
            port: url.port_u16().unwrap_or(if https { 443 } else { 80 }),
            tls: tls.filter(|_| https),
        }
    }
}

/// Connects to `target`, sends `request` and reads the answer's body up to `limit`
/// bytes. Errors are text for the caller to name its URL in.
pub async fn fetch<B>(
    target: Target<'_>,
    request: Request<B>,
    limit: usize,
) -> Result<(hyper::StatusCode, bytes::Bytes), String>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use http_body_util::BodyExt as _;
    use hyper_util::rt::TokioIo;
    async fn send<IO, B>(
        io: IO,
        request: Request<B>,
        limit: usize,
    ) -> Result<(hyper::StatusCode, bytes::Bytes), String>
    where
        IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let response = exchange(io, request).await.map_err(|e| e.to_string())?;
        let status = response.status();
        let body = http_body_util::Limited::new(response.into_body(), limit)
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        Ok((status, body))
    }
    let stream = tokio::net::TcpStream::connect((target.host, target.port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    match target.tls {
        Some(tls) => {
            let name = tokio_rustls::rustls::pki_types::ServerName::try_from(target.host.to_string())
                .map_err(|e| format!("server name {:?}: {e}", target.host))?;
            let stream = tls.connect(name, stream).await.map_err(|e| format!("TLS: {e}"))?;
            send(TokioIo::new(stream), request, limit).await
        }
        None => send(TokioIo::new(stream), request, limit).await,
    }
}

/// The system's trusted roots (Debian's and Red Hat's bundle paths), as Go reads them.
pub fn system_roots() -> tokio_rustls::rustls::RootCertStore {
    use tokio_rustls::rustls::pki_types::{CertificateDer, pem::PemObject as _};
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    for bundle in ["/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt"] {
        if let Ok(pem) = std::fs::read(bundle) {
            roots.add_parsable_certificates(CertificateDer::pem_slice_iter(&pem).flatten());
            break;
        }
    }
    roots
}

/// A TLS client trusting `roots`, with no client certificate.
pub fn tls_client(roots: tokio_rustls::rustls::RootCertStore) -> tokio_rustls::TlsConnector {
    use std::sync::Arc;
    use tokio_rustls::rustls;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// Serves HTTP/1.1 on `listener` until the task is dropped: one task per connection,
/// `handle(request, peer)` per request, 30 s to send the headers.
pub async fn serve<F, Fut>(listener: tokio::net::TcpListener, handle: F)
where
    F: Fn(Request<hyper::body::Incoming>, std::net::SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<http_body_util::Full<bytes::Bytes>>> + Send + 'static,
{
    loop {
        let Ok((stream, peer)) = listener.accept().await else { continue };
        let handle = handle.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let answer = handle(req, peer);
                async move { Ok::<_, std::convert::Infallible>(answer.await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(30))
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}
