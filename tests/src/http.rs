//! A minimal HTTP/1.1 client for tests (admin endpoints, status server): one request per
//! connection, `Connection: close`, body read to EOF.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// GETs `path` from `addr`; returns (status, body).
pub async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    request(addr, "GET", path, None).await
}

/// Sends one request and returns (status, body).
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    request_with(addr, method, path, &[], body).await
}

/// Sends one request with extra `headers` and returns (status, body).
pub async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let extra: String = headers.iter().map(|(n, v)| format!("{n}: {v}\r\n")).collect();
    let mut stream =
        tokio::time::timeout(std::time::Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
            .await??;
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(10), stream.read_to_end(&mut raw)).await??;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no HTTP status line in {head:?}"))?;
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let body = if chunked { dechunk(body) } else { body.to_string() };
    Ok((status, body))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// An HTTPS GET as kubelet's HTTPS probe sends it (any certificate accepted): the status.
pub async fn https_status(addr: SocketAddr, path: &str) -> anyhow::Result<u16> {
    let connector =
        weir_agent::support::tls::http1_connector(weir_agent::support::tls::ServerTrust::AnyCertificate)?;
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = tokio_rustls::rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    let mut tls = connector.connect(name, tcp).await?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: kube-probe/1.33\r\nConnection: close\r\n\r\n"
    );
    tls.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    let _ = tls.read_to_end(&mut raw).await;
    let text = String::from_utf8_lossy(&raw);
    text.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no HTTP status from {addr}"))
}

/// The gRPC health protocol's answer at `addr` for `service`: whether it is SERVING.
pub async fn grpc_health(addr: SocketAddr, service: &str) -> anyhow::Result<bool> {
    use weir_proto::grpc::health::v1::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?.connect().await?;
    let response = HealthClient::new(channel).check(HealthCheckRequest { service: service.into() }).await?;
    Ok(response.into_inner().status() == ServingStatus::Serving)
}
