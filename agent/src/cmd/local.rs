//! pilot-agent's two local commands, flags as pilot-agent's: `wait` polls Envoy's
//! readiness URL until it answers 200 (how `holdApplicationUntilProxyStarts` holds the
//! app container), and `request <method> <path> [body]` calls a local admin or status
//! port and prints the answer (what `istioctl proxy-config` runs in the pod).

use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::{Method, StatusCode};

use crate::{
    sidecar::envoy::admin::request,
    support::{exit, runtime},
};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LocalCmdError {
    #[error("flag {flag}: expected {expected}, got {value:?}")]
    Flag { flag: String, value: String, expected: &'static str },
    #[error("unknown flag {0} (see --help)")]
    UnknownFlag(String),
    #[error("{0}")]
    Usage(&'static str),
    #[error("debug port {port} is not in the allowed list [15000 15004 15020 15021]")]
    Port { port: u16 },
    #[error("{url} is not an http://host:port/path URL")]
    Url { url: String },
    #[error("timeout waiting for Envoy proxy to become ready. Last error: {0}")]
    Timeout(String),
    #[error("received unsuccessful status code {status}: {body}")]
    Status { status: u16, body: String },
    #[error("{0}")]
    Request(String),
}

pub const WAIT_USAGE: &str = "Waits until the Envoy proxy is ready

Usage:
  pilot-agent wait [flags]

Flags:
      --periodMillis int           number of milliseconds to wait between attempts (default 500)
      --requestTimeoutMillis int   number of milliseconds to wait for response (default 500)
      --timeoutSeconds int         maximum number of seconds to wait for Envoy to be ready (default 60)
      --url string                 URL to use in requests (default \"http://localhost:15021/healthz/ready\")";

pub const REQUEST_USAGE: &str = "Makes an HTTP request to the Envoy admin API

Usage:
  pilot-agent request <method> <path> [<body>] [flags]

Flags:
      --debug-port int32   Set the port to make a local request to. The default points to the Envoy admin API. (default 15000)";

/// `wait`'s flags.
#[derive(Debug, Clone, PartialEq)]
pub struct WaitArgs {
    pub timeout: Duration,
    pub request_timeout: Duration,
    pub period: Duration,
    pub url: String,
}

/// A command's flags (name, value) and its positional arguments.
type Split = (Vec<(String, String)>, Vec<String>);

/// Splits `--name=value` / `--name value` / `-name value` flags from positionals.
fn flags(args: &[String], known: &[&str]) -> Result<Split, LocalCmdError> {
    let mut out = Vec::new();
    let mut positional = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let Some(flag) = a.strip_prefix("--").or_else(|| a.strip_prefix('-').filter(|f| !f.is_empty()))
        else {
            positional.push(a.clone());
            continue;
        };
        let (name, value) = match flag.split_once('=') {
            Some((n, v)) => (n.to_string(), v.to_string()),
            None if flag == "help" || flag == "h" => (flag.to_string(), String::new()),
            None => {
                let v = it.next().ok_or(LocalCmdError::Flag {
                    flag: format!("--{flag}"),
                    value: String::new(),
                    expected: "a value",
                })?;
                (flag.to_string(), v.clone())
            }
        };
        if !known.contains(&name.as_str()) && name != "help" && name != "h" {
            return Err(LocalCmdError::UnknownFlag(format!("--{name}")));
        }
        out.push((name, value));
    }
    Ok((out, positional))
}

fn number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, LocalCmdError> {
    value.trim().parse().map_err(|_| LocalCmdError::Flag {
        flag: format!("--{flag}"),
        value: value.into(),
        expected: "a non-negative integer",
    })
}

/// `None`: help was asked for.
pub fn parse_wait(args: &[String]) -> Result<Option<WaitArgs>, LocalCmdError> {
    let (flags, positional) =
        flags(args, &["timeoutSeconds", "requestTimeoutMillis", "periodMillis", "url"])?;
    if !positional.is_empty() {
        return Err(LocalCmdError::Usage("wait takes no arguments"));
    }
    let mut w = WaitArgs {
        timeout: Duration::from_secs(60),
        request_timeout: Duration::from_millis(500),
        period: Duration::from_millis(500),
        url: "http://localhost:15021/healthz/ready".into(),
    };
    for (name, value) in flags {
        match name.as_str() {
            "timeoutSeconds" => w.timeout = Duration::from_secs(number(&name, &value)?),
            "requestTimeoutMillis" => w.request_timeout = Duration::from_millis(number(&name, &value)?),
            "periodMillis" => w.period = Duration::from_millis(number(&name, &value)?),
            "url" => w.url = value,
            _ => return Ok(None),
        }
    }
    Ok(Some(w))
}

/// `http://host:port/path` → (address, path); `localhost` is 127.0.0.1.
fn split_url(url: &str) -> Result<(std::net::SocketAddr, String), LocalCmdError> {
    let bad = || LocalCmdError::Url { url: url.into() };
    let rest = url.strip_prefix("http://").ok_or_else(bad)?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].to_string()),
        None => (rest, "/".to_string()),
    };
    let (host, port) = authority.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip: std::net::IpAddr = match host {
        "localhost" => std::net::Ipv4Addr::LOCALHOST.into(),
        h => h.parse().map_err(|_| bad())?,
    };
    Ok((std::net::SocketAddr::new(ip, port), path))
}

/// Polls until ready or `timeout`. A timeout too far away to be a point in time
/// (`--timeoutSeconds 18446744073709551615`) means no deadline.
pub async fn wait(w: &WaitArgs) -> Result<(), LocalCmdError> {
    let (address, path) = split_url(&w.url)?;
    tracing::info!(timeout_seconds = w.timeout.as_secs(), "Waiting for Envoy proxy to be ready");
    let deadline = Instant::now().checked_add(w.timeout);
    let mut last = String::from("none");
    loop {
        tokio::time::sleep(w.period).await;
        if deadline.is_some_and(|d| Instant::now() > d) {
            return Err(LocalCmdError::Timeout(last));
        }
        match request(address, Method::GET, &path, None, w.request_timeout).await {
            Ok((StatusCode::OK, _)) => {
                tracing::info!("Envoy is ready!");
                return Ok(());
            }
            Ok((status, _)) => last = format!("HTTP status code {}", status.as_u16()),
            Err(e) => last = crate::error_chain(&e),
        }
        tracing::debug!(error = %last, "not ready yet");
    }
}

/// `request`'s arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestArgs {
    pub method: Method,
    pub path: String,
    pub body: Option<String>,
    pub port: u16,
}

/// `None`: help was asked for.
pub fn parse_request(args: &[String]) -> Result<Option<RequestArgs>, LocalCmdError> {
    let (flags, positional) = flags(args, &["debug-port"])?;
    let mut port = 15000u16;
    for (name, value) in flags {
        match name.as_str() {
            "debug-port" => port = number(&name, &value)?,
            _ => return Ok(None),
        }
    }
    if !matches!(port, 15000 | 15004 | 15020 | 15021) {
        return Err(LocalCmdError::Port { port });
    }
    let [method, path, rest @ ..] = positional.as_slice() else {
        return Err(LocalCmdError::Usage("request needs <method> <path> [<body>]"));
    };
    let method = Method::from_bytes(method.to_ascii_uppercase().as_bytes()).map_err(|_| {
        LocalCmdError::Flag { flag: "<method>".into(), value: method.clone(), expected: "an HTTP method" }
    })?;
    Ok(Some(RequestArgs {
        method,
        path: format!("/{}", path.trim_start_matches('/')),
        body: rest.first().cloned(),
        port,
    }))
}

/// Sends the request; the body of a successful (or 404) answer.
pub async fn send(r: &RequestArgs) -> Result<Bytes, LocalCmdError> {
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], r.port));
    let body = r.body.clone().map(Bytes::from);
    let (status, body) = request(address, r.method.clone(), &r.path, body, Duration::from_secs(60))
        .await
        .map_err(|e| LocalCmdError::Request(crate::error_chain(&e)))?;
    if status.as_u16() > 399 && status != StatusCode::NOT_FOUND {
        return Err(LocalCmdError::Status {
            status: status.as_u16(),
            body: String::from_utf8_lossy(&body).into(),
        });
    }
    Ok(body)
}

/// A local command's parsed arguments; else the exit code once help (0) or the error
/// (64) is printed.
fn parsed<T>(command: &str, usage: &str, parsed: Result<Option<T>, LocalCmdError>) -> Result<T, u8> {
    match parsed {
        Ok(Some(args)) => Ok(args),
        Ok(None) => {
            println!("{usage}");
            Err(exit::OK)
        }
        Err(e) => {
            eprintln!("weir {command}: {e}");
            Err(exit::USAGE)
        }
    }
}

/// `wait`: exit 0 once Envoy is ready, 1 on timeout, 64 on bad flags.
pub fn run_wait(args: &[String]) -> u8 {
    let w = match parsed("wait", WAIT_USAGE, parse_wait(args)) {
        Ok(w) => w,
        Err(code) => return code,
    };
    let runtime = match runtime::current_thread("weir wait") {
        Ok(r) => r,
        Err(e) => {
            eprintln!("weir wait: {}", crate::error_chain(&e));
            return exit::FAILURE;
        }
    };
    match runtime.block_on(wait(&w)) {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("weir wait: {e}");
            exit::FAILURE
        }
    }
}

/// `request`: the answer's body on stdout, nothing else (istioctl parses it).
pub fn run_request(args: &[String]) -> u8 {
    let r = match parsed("request", REQUEST_USAGE, parse_request(args)) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let runtime = match runtime::current_thread("weir request") {
        Ok(r) => r,
        Err(e) => {
            eprintln!("weir request: {}", crate::error_chain(&e));
            return exit::FAILURE;
        }
    };
    match runtime.block_on(send(&r)) {
        Ok(body) => {
            use std::io::Write as _;
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(&body);
            let _ = out.write_all(b"\n");
            exit::OK
        }
        Err(e) => {
            eprintln!("weir request: {e}");
            exit::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn wait_flags_are_pilot_agents() {
        let w = parse_wait(&[]).unwrap().unwrap();
        assert_eq!(
            (w.timeout, w.period, w.request_timeout),
            (Duration::from_secs(60), Duration::from_millis(500), Duration::from_millis(500))
        );
        assert_eq!(w.url, "http://localhost:15021/healthz/ready");
        let w =
            parse_wait(&s(&["--timeoutSeconds=5", "--periodMillis", "100", "--url", "http://127.0.0.1:9/x"]))
                .unwrap()
                .unwrap();
        assert_eq!((w.timeout, w.period), (Duration::from_secs(5), Duration::from_millis(100)));
        assert_eq!(split_url(&w.url).unwrap(), ("127.0.0.1:9".parse().unwrap(), "/x".into()));
        assert_eq!(parse_wait(&s(&["--help"])).unwrap(), None);
        let e = parse_wait(&s(&["--timeoutSeconds=soon"])).unwrap_err().to_string();
        assert!(e.contains("--timeoutSeconds") && e.contains("soon"), "{e}");
        assert_eq!(parse_wait(&s(&["--bogus=1"])).unwrap_err(), LocalCmdError::UnknownFlag("--bogus".into()));
        assert!(matches!(split_url("https://x:1/"), Err(LocalCmdError::Url { .. })));
    }

    #[test]
    fn request_takes_method_path_body_and_an_allowed_port() {
        let r = parse_request(&s(&["GET", "config_dump"])).unwrap().unwrap();
        assert_eq!((r.method, r.path.as_str(), r.body, r.port), (Method::GET, "/config_dump", None, 15000));
        let r =
            parse_request(&s(&["post", "/logging?level=debug", "x", "--debug-port=15020"])).unwrap().unwrap();
        assert_eq!((r.method, r.body.as_deref(), r.port), (Method::POST, Some("x"), 15020));
        assert_eq!(
            parse_request(&s(&["GET", "/", "--debug-port", "22"])).unwrap_err(),
            LocalCmdError::Port { port: 22 }
        );
        assert!(matches!(parse_request(&s(&["GET"])), Err(LocalCmdError::Usage(_))));
    }

    /// A server answering every connection with one `200 OK`.
    async fn ready_server() -> std::net::SocketAddr {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
            }
        });
        address
    }

    #[tokio::test]
    async fn a_timeout_past_any_instant_waits_without_a_deadline() {
        let address = ready_server().await;
        let w = parse_wait(&s(&[
            "--timeoutSeconds",
            "18446744073709551615",
            "--periodMillis=1",
            "--requestTimeoutMillis=18446744073709551615",
            &format!("--url=http://{address}/healthz/ready"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(w.timeout, Duration::from_secs(u64::MAX));
        wait(&w).await.expect("ready at the first poll, with no deadline to overflow");
    }
}
