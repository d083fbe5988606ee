//! HTTP/1.1 for the agent's small clients and servers: one exchange on a stream the
//! caller opened (TCP, TLS) — the handshake, the connection driven in the background,
//! the request sent, the answer's body the caller's to read — and the serve loop of
//! the status and STS servers.

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

/// Connects to `target` and sends `request`; the answer's body is the caller's to
/// stream (a Kubernetes watch). Errors are text for the caller to name its URL in.
pub async fn open<B>(target: Target<'_>, request: Request<B>) -> Result<Response<Incoming>, String>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use hyper_util::rt::TokioIo;
    let stream = tokio::net::TcpStream::connect((target.host, target.port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let answer = match target.tls {
        Some(tls) => {
            let name = tokio_rustls::rustls::pki_types::ServerName::try_from(target.host.to_string())
                .map_err(|e| format!("server name {:?}: {e}", target.host))?;
            let stream = tls.connect(name, stream).await.map_err(|e| format!("TLS: {e}"))?;
            exchange(TokioIo::new(stream), request).await
        }
        None => exchange(TokioIo::new(stream), request).await,
    };
    answer.map_err(|e| e.to_string())
}

/// Serves HTTP/1.1 on `listener` until the task is dropped: one task per connection,
/// `handle(request, peer)` per request, 30 s to send the headers. Accept errors are
/// handled as `crate::support::accept` says (a pause when out of descriptors); it returns only
/// when the listener is broken (logged there). A peer reached over a dual-stack socket
/// is named as it connected: `127.0.0.1`, not `::ffff:127.0.0.1`.
pub async fn serve<F, Fut, B>(listener: tokio::net::TcpListener, handle: F)
where
    F: Fn(Request<hyper::body::Incoming>, std::net::SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let name = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    loop {
        let Ok((stream, peer)) = crate::support::accept::next(&name, || listener.accept()).await else {
            return;
        };
        let peer = std::net::SocketAddr::new(peer.ip().to_canonical(), peer.port());
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
