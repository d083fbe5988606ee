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
