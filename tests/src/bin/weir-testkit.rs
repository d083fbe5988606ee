//! weir-testkit: the traffic tool tests run inside pods (std + socket2, no runtime).
//! Servers print `listening <addr>` once bound, then serve until killed.
//!
//!   serve-echo <addr>                   TCP echo
//!   serve-hello <addr> <name> [--log <file>]
//!                                       replies `hello <name> local=<l> peer=<p>`
//!                                       (and appends that line to <file>: who connected)
//!   capture-listener <addr> [--transparent]
//!                                       replies `captured local=<l> peer=<p> orig=<o|none>`
//!                                       (orig from SO_ORIGINAL_DST; --transparent sets
//!                                       IP_TRANSPARENT, as Envoy's TPROXY listener)
//!   ask <addr>                          connects, prints the first line it receives
//!   connect <addr> [count]              connects `count` times, expects an echo
//!   transfer <addr> <bytes>             sends `bytes` pseudo-random bytes to an echo
//!                                       server and checks every byte comes back
//!   serve-http <addr>                   HTTP/1.1 keep-alive app: `/status/<code>`,
//!                                       `/redirect/same` (→ /ok), `/redirect/away`
//!                                       (→ another host), `/peer` (the client's
//!                                       address), `/headers` (the request's headers),
//!                                       `/require/peer/<ip>`, `/require/header/<n>/<v>`
//!                                       (200 when so, else 412),
//!                                       `/metrics` (Prometheus text), else 200 `ok`
//!   serve-https <addr>                  serve-http over TLS, with a self-signed
//!                                       certificate made at start
//!   serve-grpc-health <addr> <status>   gRPC health server answering every Check with
//!                                       <status> (SERVING, NOT_SERVING, ...)
//!   dns-serve <addr> <ipv4>             UDP DNS: answers every A query with <ipv4>
//!   dns-query <server> <name> [--connected]
//!                                       prints `answer <ip> from <server addr>`; with
//!                                       --connected, connect()s first (as glibc does)
//!   datapath-serve <addr> [--cpu N]     the data-path benchmark's acceptor (see
//!                                       weir_tests::datapath)
//!   sidecar                             a stand-in Envoy on 15001/15006 (see
//!                                       weir_tests::meshtraffic), as the proxy user
//!   mesh-app <addr> <log>               a meshed pod's app, logging each connection's
//!                                       verdict (ok, bypass-inbound, bypass-outbound)
//!   mesh-client <me> <meshed|plain> <interval-ms> <log> <targets...>
//!                                       connects to the targets in turn, forever
//!   serve-mark <addr> <extra>           first listens on `extra` more ports (21000 up),
//!                                       then on addr; replies `mark=<SO_MARK of the
//!                                       accepted socket, hex>`
//!   plant-orig <port> <busy> <target> <own15006>
//!                                       a connect to `target` the kernel fails after the
//!                                       connect hook (its local port in use towards
//!                                       `busy`), then the same socket to the pod's own
//!                                       ztunnel inbound port; prints `answer <line>` or
//!                                       `closed <why>`
//!   connect-storm <addr> <count> [<timeout-ms> [<max-other>]]
//!                                       `count` connects as fast as they fail or succeed
//!                                       (each bounded by timeout-ms, 100; stops after
//!                                       max-other neither connected nor refused); prints
//!                                       `connected N refused N other N <each error>`
//!   syn-probe <iface> <dst-mac> <src-ip> <dst-ip> <dport> <plain|hbh|dstopts|fragments>
//!                                       sends one crafted SYN as raw frames, prints what
//!                                       came back: syn-ack, rst or nothing (1 s)
//!   unix-post <socket> <path> <body> [<hold-ms>]
//!                                       HTTP/1.1 POST of <body> over a unix socket;
//!                                       prints the status line and body, or
//!                                       `connect: <error>`; with hold-ms, sends only
//!                                       the request line first and waits that long
//!                                       (a slow client)
//!   datapath-load <kind> <to> <expect|none> <count> <secs> <inflight> [<cgroup>] [--cpu N]
//!                                       one load run (connect, rr or bulk); prints its
//!                                       measurements as JSON
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    process::ExitCode,
    time::Duration,
};

use socket2::{Domain, Protocol, Socket, Type};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).map(String::as_str).ok_or_else(|| format!("missing argument {i}"));
    let result = (|| -> Result<(), String> {
        match arg(0)? {
            "serve-echo" => serve(addr(arg(1)?)?, false, |mut s, _| {
                let mut buf = [0u8; 64 * 1024];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    }
                }
            }),
            "serve-hello" => {
                let name = arg(2)?.to_string();
                let log = args.iter().position(|a| a == "--log").map(|i| arg(i + 1)).transpose()?;
                let log = log.map(std::path::PathBuf::from);
                serve(addr(arg(1)?)?, false, move |mut s, _| {
                    let line = format!("hello {name} local={} peer={}\n", local(&s), peer(&s));
                    if let Some(log) = &log {
                        append_line(log, &line);
                    }
                    let _ = s.write_all(line.as_bytes());
                })
            }
            "serve-http" => serve(addr(arg(1)?)?, false, |s, _| {
                let peer = peer(&s);
                serve_http(s, peer)
            }),
            "serve-https" => {
                let tls = tls_server_config()?;
                serve(addr(arg(1)?)?, false, move |s, _| {
                    let peer = peer(&s);
                    let Ok(conn) = tokio_rustls::rustls::ServerConnection::new(tls.clone()) else { return };
                    serve_http(tokio_rustls::rustls::StreamOwned::new(conn, s), peer)
                })
            }
            "serve-grpc-health" => serve_grpc_health(addr(arg(1)?)?, arg(2)?),
            "capture-listener" => {
                let transparent = args.iter().any(|a| a == "--transparent");
                serve(addr(arg(1)?)?, transparent, |mut s, v6| {
                    let orig = weir_iptables::validation::original_dst(s.as_raw_fd(), v6)
                        .map(|a| a.to_string())
                        .unwrap_or_else(|_| "none".into());
                    let line = format!("captured local={} peer={} orig={orig}\n", local(&s), peer(&s));
                    let _ = s.write_all(line.as_bytes());
                })
            }
            "ask" => {
                let s = TcpStream::connect_timeout(&addr(arg(1)?)?, Duration::from_secs(3))
                    .map_err(|e| format!("connect: {e}"))?;
                print_first_line(s)
            }
            "ask-peer" => {
                // As `ask`, first printing what getpeername() says the socket is connected to.
                let s = TcpStream::connect_timeout(&addr(arg(1)?)?, Duration::from_secs(3))
                    .map_err(|e| format!("connect: {e}"))?;
                println!("peer={}", peer(&s));
                print_first_line(s)
            }
            "ask-mptcp" => {
                // As `ask`, over a Multipath TCP socket (IPPROTO_MPTCP).
                let dst = addr(arg(1)?)?;
                let sock =
                    Socket::new(Domain::for_address(dst), Type::STREAM, Some(socket2::Protocol::from(262)))
                        .map_err(|e| format!("socket(IPPROTO_MPTCP): {e}"))?;
                sock.connect_timeout(&dst.into(), Duration::from_secs(3))
                    .map_err(|e| format!("connect: {e}"))?;
                print_first_line(sock.into())
            }
            "ask-from" => {
                // As `ask`, from a socket bound to the source address given first (Envoy's
                // inbound passthrough binds 127.0.0.6).
                let src: std::net::IpAddr =
                    arg(1)?.parse().map_err(|e| format!("source {:?}: {e}", arg(1)))?;
                let dst = addr(arg(2)?)?;
                let sock = Socket::new(Domain::for_address(dst), Type::STREAM, None)
                    .map_err(|e| format!("socket: {e}"))?;
                // IP(V6)_FREEBIND, as Envoy binds its passthrough source (`::6` is no
                // address of the pod's).
                let freebind = match src {
                    std::net::IpAddr::V4(_) => sock.set_freebind_v4(true),
                    std::net::IpAddr::V6(_) => sock.set_freebind_v6(true),
                };
                freebind.map_err(|e| format!("freebind: {e}"))?;
                sock.bind(&SocketAddr::new(src, 0).into()).map_err(|e| format!("bind {src}: {e}"))?;
                sock.connect_timeout(&dst.into(), Duration::from_secs(3))
                    .map_err(|e| format!("connect: {e}"))?;
                print_first_line(sock.into())
            }
            "connect" => {
                let count =
                    args.get(2).map(|c| c.parse::<u32>()).transpose().map_err(|e| format!("count: {e}"))?;
                connect(addr(arg(1)?)?, count.unwrap_or(1))
            }
            "transfer" => transfer(addr(arg(1)?)?, arg(2)?.parse().map_err(|e| format!("bytes: {e}"))?),
            "dns-serve" => dns_serve(addr(arg(1)?)?, arg(2)?.parse().map_err(|e| format!("ipv4: {e}"))?),
            "dns-query" => dns_query(addr(arg(1)?)?, arg(2)?, args.iter().any(|a| a == "--connected")),
            "datapath-serve" => {
                pin_flag(&args)?;
                weir_tests::datapath::serve(addr(arg(1)?)?)
            }
            "datapath-load" => {
                pin_flag(&args)?;
                datapath_load(&args)
            }
            "syn-probe" => syn_probe(&args),
            "unix-post" => unix_post(arg(1)?, arg(2)?, arg(3)?, args.get(4).map(|h| h.parse().unwrap_or(0))),
            "sidecar" => weir_tests::meshtraffic::sidecar(),
            "mesh-app" => weir_tests::meshtraffic::app(addr(arg(1)?)?, std::path::Path::new(arg(2)?)),
            "mesh-client" => {
                let interval = Duration::from_millis(arg(3)?.parse().map_err(|e| format!("interval: {e}"))?);
                let targets: Vec<SocketAddr> =
                    args.iter().skip(5).map(|t| addr(t)).collect::<Result<_, _>>()?;
                weir_tests::meshtraffic::client(
                    arg(1)?,
                    arg(2)?,
                    interval,
                    std::path::Path::new(arg(4)?),
                    &targets,
                )
            }
            "serve-mark" => {
                let extra: u16 = arg(2)?.parse().map_err(|e| format!("extra: {e}"))?;
                let _held: Vec<TcpListener> = (0..extra)
                    .map(|i| {
                        TcpListener::bind(("0.0.0.0", 21000 + i))
                            .map_err(|e| format!("listen {}: {e}", 21000 + i))
                    })
                    .collect::<Result<_, _>>()?;
                serve(addr(arg(1)?)?, false, |mut s, _| {
                    let mark = socket2::SockRef::from(&s)
                        .mark()
                        .map_or_else(|e| format!("error {e}"), |m| format!("{m:#x}"));
                    let _ = s.write_all(format!("mark={mark}\n").as_bytes());
                })
            }
            "plant-orig" => plant_orig(arg(1)?, addr(arg(2)?)?, addr(arg(3)?)?, addr(arg(4)?)?),
            "connect-storm" => {
                let timeout_ms: u64 = match args.get(3) {
                    Some(t) => t.parse().map_err(|e| format!("timeout_ms: {e}"))?,
                    None => 100,
                };
                let max_other: u32 = match args.get(4) {
                    Some(m) => m.parse().map_err(|e| format!("max_other: {e}"))?,
                    None => u32::MAX,
                };
                connect_storm(
                    addr(arg(1)?)?,
                    arg(2)?.parse().map_err(|e| format!("count: {e}"))?,
                    Duration::from_millis(timeout_ms),
                    max_other,
                )
            }
            other => Err(format!("unknown command {other:?}")),
        }
    })();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weir-testkit: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Prints the first line the server sends (waiting 5 s at most): `ask`'s answer.
/// `plant-orig`: see the usage. Two sockets share a local port (SO_REUSEADDR): the
/// first connects to `busy`, so the second's connect to `target`, redirected to the
/// same proxy port, fails in the kernel (EADDRNOTAVAIL) after the connect hook ran;
/// the second then connects to the pod's own ztunnel inbound port and asks.
fn plant_orig(port: &str, busy: SocketAddr, target: SocketAddr, own: SocketAddr) -> Result<(), String> {
    let port: u16 = port.parse().map_err(|e| format!("port: {e}"))?;
    let bound = || -> Result<Socket, String> {
        let s = Socket::new(Domain::IPV4, Type::STREAM, None).map_err(|e| format!("socket: {e}"))?;
        s.set_reuse_address(true).map_err(|e| format!("SO_REUSEADDR: {e}"))?;
        s.bind(&SocketAddr::from(([0, 0, 0, 0], port)).into()).map_err(|e| format!("bind {port}: {e}"))?;
        Ok(s)
    };
    let first = bound()?;
    first
        .connect_timeout(&busy.into(), Duration::from_secs(3))
        .map_err(|e| format!("connect {busy}: {e}"))?;
    let second = bound()?;
    if second.connect_timeout(&target.into(), Duration::from_secs(3)).is_ok() {
        return Err(format!("the connect to {target} was meant to fail and did not"));
    }
    second.connect_timeout(&own.into(), Duration::from_secs(3)).map_err(|e| format!("connect {own}: {e}"))?;
    let mut s: TcpStream = second.into();
    let _ = s.write_all(b"x\n");
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    let mut line = String::new();
    match BufReader::new(&mut s).read_line(&mut line) {
        Ok(n) if n > 0 => println!("answer {}", line.trim()),
        Ok(_) => println!("closed eof"),
        Err(e) => println!("closed {e}"),
    }
    drop(first);
    Ok(())
}

/// Appends `line` to the file at `path` (made if missing), one write per line.
fn append_line(path: &std::path::Path, line: &str) {
    let file = std::fs::OpenOptions::new().create(true).append(true).open(path);
    if let Ok(mut file) = file {
        let _ = file.write_all(line.as_bytes());
    }
}

fn print_first_line(mut s: TcpStream) -> Result<(), String> {
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    let mut line = String::new();
    BufReader::new(&mut s).read_line(&mut line).map_err(|e| format!("read: {e}"))?;
    print!("{line}");
    Ok(())
}

fn addr(raw: &str) -> Result<SocketAddr, String> {
    raw.parse().map_err(|e| format!("address {raw:?}: {e}"))
}

fn local(s: &TcpStream) -> String {
    s.local_addr().map(|a| a.to_string()).unwrap_or_default()
}

fn peer(s: &TcpStream) -> String {
    s.peer_addr().map(|a| a.to_string()).unwrap_or_default()
}

fn listening(addr: impl std::fmt::Display) {
    println!("listening {addr}");
    std::io::stdout().flush().ok();
}

/// Binds (v6-only for IPv6, optionally IP_TRANSPARENT), then serves each connection
/// on a thread with `handle(stream, is_v6)`.
fn serve(
    addr: SocketAddr,
    transparent: bool,
    handle: impl Fn(TcpStream, bool) + Send + Sync + Clone + 'static,
) -> Result<(), String> {
    let domain = if addr.is_ipv6() { Domain::IPV6 } else { Domain::IPV4 };
    let socket = Socket::new(domain, Type::STREAM, Some(Protocol::TCP)).map_err(|e| e.to_string())?;
    socket.set_reuse_address(true).ok();
    if addr.is_ipv6() {
        socket.set_only_v6(true).map_err(|e| format!("IPV6_V6ONLY: {e}"))?;
    }
    if transparent {
        if addr.is_ipv6() { socket.set_ip_transparent_v6(true) } else { socket.set_ip_transparent_v4(true) }
            .map_err(|e| format!("IP_TRANSPARENT: {e}"))?;
    }
    socket.bind(&addr.into()).map_err(|e| format!("bind {addr}: {e}"))?;
    socket.listen(1024).map_err(|e| e.to_string())?;
    let listener: TcpListener = socket.into();
    listening(listener.local_addr().map_err(|e| e.to_string())?);
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let h = handle.clone();
        let v6 = addr.is_ipv6();
        std::thread::spawn(move || h(stream, v6));
    }
    Ok(())
}

/// One HTTP/1.1 connection: requests (no bodies) answered until the client closes.
fn serve_http(stream: impl std::io::Read + std::io::Write, peer: String) {
    let mut reader = BufReader::new(stream);
    loop {
        let mut head = Vec::new();
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) if line == "\r\n" || line == "\n" => break,
                Ok(_) => head.push(line.trim_end().to_string()),
            }
        }
        let path = head.first().and_then(|l| l.split_whitespace().nth(1)).unwrap_or("/").to_string();
        let close = head.iter().any(|h| h.eq_ignore_ascii_case("connection: close"));
        let (status, location, body) = match path.as_str() {
            "/redirect/same" => (302, Some("/ok".to_string()), String::new()),
            "/redirect/away" => (302, Some("http://elsewhere.invalid/ok".to_string()), String::new()),
            "/peer" => (200, None, format!("{peer}\n")),
            "/headers" => (200, None, head[1..].join("\n") + "\n"),
            "/metrics" => {
                (200, None, "# TYPE app_requests_total counter\napp_requests_total 7\n".to_string())
            }
            p if p.starts_with("/require/") => require(&p["/require/".len()..], &peer, &head[1..]),
            p => match p.strip_prefix("/status/").and_then(|c| c.parse::<u16>().ok()) {
                Some(code) => (code, None, format!("status {code}\n")),
                None => (200, None, "ok\n".to_string()),
            },
        };
        let mut response = format!("HTTP/1.1 {status} X\r\nContent-Length: {}\r\n", body.len());
        if let Some(l) = location {
            response.push_str(&format!("Location: {l}\r\n"));
        }
        if close {
            response.push_str("Connection: close\r\n");
        }
        response.push_str("\r\n");
        response.push_str(&body);
        let out = reader.get_mut();
        if out.write_all(response.as_bytes()).and_then(|()| out.flush()).is_err() || close {
            return;
        }
    }
}

/// `/require/<what>`: 200 when the request is as asked, else 412 saying what it was;
/// for callers that see only the status (rewritten probes). `peer/<ip>`: from that
/// address; `header/<name>/<value>`: that header exactly once, with that value, and
/// no `content-length`.
fn require(what: &str, peer: &str, headers: &[String]) -> (u16, Option<String>, String) {
    let field = |name: &str| -> Vec<String> {
        headers
            .iter()
            .filter_map(|h| h.split_once(':'))
            .filter(|(n, _)| n.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
            .collect()
    };
    let ok = match what.split('/').collect::<Vec<_>>().as_slice() {
        ["peer", ip] => peer.rsplit_once(':').is_some_and(|(host, _)| host.trim_matches(['[', ']']) == *ip),
        ["header", name, value] => field(name) == [value.to_string()] && field("content-length").is_empty(),
        _ => false,
    };
    if ok {
        (200, None, "ok\n".into())
    } else {
        (412, None, format!("not {what}: peer {peer}, headers {headers:?}\n"))
    }
}

/// TLS with a certificate for `app.local` signed by itself (probes do not verify it).
fn tls_server_config() -> Result<std::sync::Arc<tokio_rustls::rustls::ServerConfig>, String> {
    use tokio_rustls::rustls;
    let cert =
        rcgen::generate_simple_self_signed(vec!["app.local".to_string()]).map_err(|e| e.to_string())?;
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into());
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_no_client_auth()
    .with_single_cert(vec![cert.cert.der().clone()], key)
    .map_err(|e| format!("TLS certificate: {e}"))?;
    Ok(std::sync::Arc::new(config))
}

/// A gRPC health server whose every answer is `status`.
fn serve_grpc_health(addr: SocketAddr, status: &str) -> Result<(), String> {
    use weir_proto::grpc::health::v1::{
        HealthCheckRequest, HealthCheckResponse,
        health_check_response::ServingStatus,
        health_server::{Health, HealthServer},
    };
    let status = ServingStatus::from_str_name(status)
        .ok_or_else(|| format!("status {status:?}: not a ServingStatus"))?;
    struct Fixed(ServingStatus);
    #[tonic::async_trait]
    impl Health for Fixed {
        async fn check(
            &self,
            _: tonic::Request<HealthCheckRequest>,
        ) -> Result<tonic::Response<HealthCheckResponse>, tonic::Status> {
            Ok(tonic::Response::new(HealthCheckResponse { status: self.0 as i32 }))
        }
        type WatchStream = std::pin::Pin<
            Box<dyn tokio_stream::Stream<Item = Result<HealthCheckResponse, tonic::Status>> + Send>,
        >;
        async fn watch(
            &self,
            _: tonic::Request<HealthCheckRequest>,
        ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
            Err(tonic::Status::unimplemented("watch"))
        }
    }
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("bind {addr}: {e}"))?;
        listening(listener.local_addr().map_err(|e| e.to_string())?);
        tonic::transport::Server::builder()
            .add_service(HealthServer::new(Fixed(status)))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .map_err(|e| e.to_string())
    })
}

fn connect(addr: SocketAddr, count: u32) -> Result<(), String> {
    for i in 0..count {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .map_err(|e| format!("connect {addr} (#{i}): {e}"))?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok();
        let line = format!("ping {i}\n");
        stream.write_all(line.as_bytes()).map_err(|e| format!("write: {e}"))?;
        let mut echoed = String::new();
        BufReader::new(&stream).read_line(&mut echoed).map_err(|e| format!("read: {e}"))?;
        if echoed != line {
            return Err(format!("echo mismatch: sent {line:?}, got {echoed:?}"));
        }
    }
    println!("ok {count}");
    Ok(())
}

/// xorshift bytes, so corruption or reordering anywhere shows.
fn pattern(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn transfer(addr: SocketAddr, bytes: usize) -> Result<(), String> {
    let data = pattern(bytes);
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).ok();
    let mut writer = stream.try_clone().map_err(|e| e.to_string())?;
    let to_send = data.clone();
    let sender = std::thread::spawn(move || {
        writer.write_all(&to_send).map(|_| writer.shutdown(std::net::Shutdown::Write))
    });
    // A socket in a sockmap can return EAGAIN from a *blocking* read when another
    // thread's writes wake it without data (tcp_bpf_recvmsg); retry those, and say so.
    let mut back = Vec::with_capacity(bytes);
    let mut reader = stream;
    let mut buf = vec![0u8; 256 * 1024];
    let mut spurious = 0u64;
    loop {
        match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => back.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => spurious += 1,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("read: {e}")),
        }
    }
    sender.join().map_err(|_| "sender panicked")?.map_err(|e| format!("write: {e}"))?.ok();
    if back != data {
        let at = back.iter().zip(&data).position(|(a, b)| a != b).unwrap_or(back.len().min(data.len()));
        return Err(format!("data differs at byte {at} (got {} of {bytes} bytes)", back.len()));
    }
    if spurious > 0 {
        eprintln!("weir-testkit: {spurious} spurious EAGAIN on a blocking read (retried)");
    }
    println!("ok {bytes}");
    Ok(())
}

fn dns_serve(addr: SocketAddr, answer: std::net::Ipv4Addr) -> Result<(), String> {
    let socket = UdpSocket::bind(addr).map_err(|e| format!("bind {addr}: {e}"))?;
    listening(addr);
    let mut buf = [0u8; 512];
    loop {
        let Ok((n, from)) = socket.recv_from(&mut buf) else { continue };
        if n < 12 {
            continue;
        }
        // Question section ends after the name's zero byte and 4 bytes of type/class.
        let mut end = 12;
        while end < n && buf[end] != 0 {
            end += usize::from(buf[end]) + 1;
        }
        end += 5;
        if end > n {
            continue;
        }
        let mut reply = Vec::with_capacity(end + 16);
        reply.extend_from_slice(&buf[..2]); // id
        reply.extend_from_slice(&[0x81, 0x80, 0, 1, 0, 1, 0, 0, 0, 0]);
        reply.extend_from_slice(&buf[12..end]);
        reply.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4]);
        reply.extend_from_slice(&answer.octets());
        let _ = socket.send_to(&reply, from);
    }
}

fn dns_query(server: SocketAddr, name: &str, connected: bool) -> Result<(), String> {
    let bind: SocketAddr =
        if server.is_ipv6() { "[::]:0".parse().unwrap() } else { "0.0.0.0:0".parse().unwrap() };
    let socket = UdpSocket::bind(bind).map_err(|e| e.to_string())?;
    socket.set_read_timeout(Some(Duration::from_secs(3))).ok();
    let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.trim_end_matches('.').split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    if connected {
        socket.connect(server).map_err(|e| format!("connect {server}: {e}"))?;
        socket.send(&q).map_err(|e| format!("send to {server}: {e}"))?;
    } else {
        socket.send_to(&q, server).map_err(|e| format!("send to {server}: {e}"))?;
    }
    let mut buf = [0u8; 512];
    let (n, from) = socket.recv_from(&mut buf).map_err(|e| format!("no reply from {server}: {e}"))?;
    if n < 4 || buf[..2] != [0x12, 0x34] {
        return Err("malformed reply".into());
    }
    let ip = IpAddr::from([buf[n - 4], buf[n - 3], buf[n - 2], buf[n - 1]]);
    println!("answer {ip} from {from}");
    Ok(())
}

/// `--cpu N`: pin this process to CPU N.
fn pin_flag(args: &[String]) -> Result<(), String> {
    match args.iter().position(|a| a == "--cpu") {
        Some(i) => {
            let cpu = args.get(i + 1).and_then(|v| v.parse().ok()).ok_or("--cpu needs a CPU number")?;
            weir_tests::datapath::pin_to_cpu(cpu)
        }
        None => Ok(()),
    }
}

fn datapath_load(args: &[String]) -> Result<(), String> {
    use weir_tests::datapath::{Kind, LoadSpec, run};
    let positional: Vec<&str> = args
        .iter()
        .enumerate()
        .filter(|(i, a)| *a != "--cpu" && (*i == 0 || args[i - 1] != "--cpu"))
        .map(|(_, a)| a.as_str())
        .collect();
    let at =
        |i: usize| positional.get(i).copied().ok_or_else(|| format!("datapath-load: missing argument {i}"));
    let v4 = |raw: &str| {
        raw.parse::<std::net::SocketAddrV4>().map_err(|e| format!("{raw:?}: {e} (expected ipv4:port)"))
    };
    let spec = LoadSpec {
        kind: Kind::parse(at(1)?)?,
        to: v4(at(2)?)?,
        expect: match at(3)? {
            "none" | "any" => None,
            a => Some(v4(a)?),
        },
        any_orig: at(3)? == "any",
        count: at(4)?.parse().map_err(|e| format!("count: {e}"))?,
        secs: at(5)?.parse().map_err(|e| format!("secs: {e}"))?,
        inflight: at(6)?.parse().map_err(|e| format!("inflight: {e}"))?,
        cgroup: positional.get(7).map(std::path::PathBuf::from),
    };
    let result = run(&spec);
    println!("{}", serde_json::to_string(&result).map_err(|e| e.to_string())?);
    Ok(())
}

/// `syn-probe`: see `weir_tests::synprobe`.
fn syn_probe(args: &[String]) -> Result<(), String> {
    let arg = |i: usize| args.get(i).cloned().ok_or_else(|| format!("syn-probe: argument {i} missing"));
    let interface = arg(1)?;
    let mac = |text: &str| -> Result<[u8; 6], String> {
        let parts: Vec<u8> = text
            .split(':')
            .map(|p| u8::from_str_radix(p, 16))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("mac {text}: {e}"))?;
        parts.try_into().map_err(|_| format!("mac {text}: expected 6 bytes"))
    };
    let src_mac = weir_agent::capture::ebpf::netns::interface_mac(
        std::path::Path::new("/proc/self/ns/net"),
        &interface,
    )
    .map_err(|e| format!("read the MAC of {interface}: {e}"))?;
    let probe = weir_tests::synprobe::Probe {
        interface,
        src_mac,
        dst_mac: mac(&arg(2)?)?,
        src: arg(3)?.parse().map_err(|e| format!("src: {e}"))?,
        dst: arg(4)?.parse().map_err(|e| format!("dst: {e}"))?,
        sport: 40000 + (std::process::id() % 20000) as u16,
        dport: arg(5)?.parse().map_err(|e| format!("dport: {e}"))?,
        shape: arg(6)?.parse()?,
    };
    let answer = probe.run(Duration::from_secs(1)).map_err(|e| format!("syn-probe: {e}"))?;
    println!("{answer}");
    Ok(())
}

/// `connect-storm`: connects `count` times, closing each socket at once.
/// `count` connects to `to`, each bounded by `timeout`; stops early after `max_other`
/// that neither connect nor are refused. Prints the counts and each other error.
fn connect_storm(to: SocketAddr, count: u32, timeout: Duration, max_other: u32) -> Result<(), String> {
    let (mut connected, mut refused, mut other) = (0u32, 0u32, 0u32);
    let mut kinds: std::collections::BTreeMap<String, u32> = std::collections::BTreeMap::new();
    for _ in 0..count {
        match TcpStream::connect_timeout(&to, timeout) {
            Ok(_) => connected += 1,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => refused += 1,
            Err(e) => {
                other += 1;
                *kinds.entry(e.to_string()).or_default() += 1;
                if other >= max_other {
                    break;
                }
            }
        }
    }
    let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{n}× {k}")).collect();
    println!("connected {connected} refused {refused} other {other} {}", kinds.join("; "));
    Ok(())
}

/// `unix-post`: one HTTP/1.1 POST over a unix socket; prints what came back.
fn unix_post(socket: &str, path: &str, body: &str, hold_ms: Option<u64>) -> Result<(), String> {
    let mut stream = match std::os::unix::net::UnixStream::connect(socket) {
        Ok(s) => s,
        Err(e) => {
            println!("connect: {e}");
            return Ok(());
        }
    };
    stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: unix\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    if let Some(ms) = hold_ms {
        let _ = stream.write_all(&head.as_bytes()[..10]);
        std::thread::sleep(Duration::from_millis(ms));
        let _ = stream.write_all(&head.as_bytes()[10..]);
    } else {
        let _ = stream.write_all(head.as_bytes());
    }
    let _ = stream.write_all(body.as_bytes());
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let status = answer.lines().next().unwrap_or("no answer").to_string();
    let reply = answer.split_once("\r\n\r\n").map(|(_, b)| b.trim().to_string()).unwrap_or_default();
    println!("{status}\n{reply}");
    Ok(())
}
