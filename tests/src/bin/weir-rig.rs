//! weir-rig: the processes of the cluster in a box (tests/src/cluster), run from the
//! `weir-rig` images by containerd.
//!
//!   pause                     the sandbox: waits for SIGTERM or SIGINT
//!   app <name> <port>…        an HTTP app on each port; each connection is logged with whether its
//!                             other end is a socket in the pod's own network namespace
//!                             (a proxy that took it: the sidecar's Envoy, ztunnel) or
//!                             not (it came straight from the network: a bypass for a
//!                             meshed pod), and each request's x-forwarded-client-cert
//!   client <name> <ms> <file> asks each target the file lists (one `ip:port` a line,
//!                             read again each round) in turn, forever; logs per request the
//!                             answer and whether its own connection's other end was a
//!                             local socket (its proxy) or the network
//!   istiod <dir>              the test control plane as istiod serves it on 15012 (TLS
//!                             with `<dir>/serving.pem` and `serving-key.pem`, bearer
//!                             `<dir>/token`): ADS with one snapshot for every proxy
//!                             from `<dir>/mesh.yaml` (Weir's standalone services file,
//!                             read again when it changes), and istiod's CA
//!
//! Log lines (stdout, the container's log): `<ms> <kind> key=value ...`.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    process::ExitCode,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0)
}

fn log(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{} {line}", now_ms());
    let _ = out.flush();
}

/// `addr` as /proc/net/tcp writes it (`0100007F:1F90` for 127.0.0.1:8080).
fn proc_net_form(addr: SocketAddr) -> String {
    match addr {
        SocketAddr::V4(a) => format!("{:08X}:{:04X}", u32::from_le_bytes(a.ip().octets()), a.port()),
        SocketAddr::V6(a) => {
            let o = a.ip().octets();
            let words: String = o
                .chunks(4)
                .map(|w| format!("{:08X}", u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
                .collect();
            format!("{words}:{:04X}", a.port())
        }
    }
}

/// Whether this namespace holds a socket whose local end is `local` and remote end
/// `remote`: the other end of a connection that never left the pod.
fn local_socket(local: SocketAddr, remote: SocketAddr) -> bool {
    let want = (proc_net_form(local), proc_net_form(remote));
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|file| {
        std::fs::read_to_string(file).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 2 && f[1] == want.0 && f[2] == want.1
            })
        })
    })
}

fn app(name: &str, ports: &[u16]) -> Result<(), String> {
    let mut listeners = Vec::new();
    for port in ports {
        listeners.push(TcpListener::bind(("0.0.0.0", *port)).map_err(|e| format!("bind {port}: {e}"))?);
        log(&format!("listening name={name} port={port}"));
    }
    let threads: Vec<_> = listeners
        .into_iter()
        .map(|listener| {
            let name = name.to_string();
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    let name = name.clone();
                    std::thread::spawn(move || serve(&name, stream));
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

fn serve(name: &str, mut stream: TcpStream) {
    let (Ok(local), Ok(peer)) = (stream.local_addr(), stream.peer_addr()) else { return };
    // The other end of this connection as a socket here: local = peer, remote = local.
    let via = if local_socket(peer, local) { "proxy" } else { "network" };
    log(&format!("conn via={via} peer={peer}"));
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    });
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
        let mut xfcc = String::from("-");
        let mut client = String::from("-");
        let mut close = false;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                match k.trim().to_ascii_lowercase().as_str() {
                    "x-forwarded-client-cert" => xfcc = v.trim().to_string(),
                    "x-rig-client" => client = v.trim().to_string(),
                    "connection" => close = v.trim().eq_ignore_ascii_case("close"),
                    _ => {}
                }
            }
        }
        if path != "/healthz" {
            log(&format!("request via={via} peer={peer} client={client} xfcc={xfcc}"));
        }
        let body = format!("{name} via={via}\n");
        let reply = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: text/plain\r\n\r\n{body}",
            body.len()
        );
        if stream.write_all(reply.as_bytes()).is_err() || close {
            return;
        }
    }
}

/// One request to `target` (`host:port`), on a new connection: the answer and whether
/// this connection's other end was a local socket.
fn ask(me: &str, target: &str) -> Result<(String, &'static str), String> {
    let addr: SocketAddr = target.parse().map_err(|e| format!("{target}: {e}"))?;
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(3)).map_err(|e| format!("connect: {e}"))?;
    let local = stream.local_addr().map_err(|e| e.to_string())?;
    // Whatever took this connection in the pod (its proxy) has a socket whose remote
    // end is this one's local address; nothing here does when it went to the network.
    let via = if proxy_here(local) { "proxy" } else { "network" };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let req = format!("GET / HTTP/1.1\r\nhost: {target}\r\nx-rig-client: {me}\r\nconnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).map_err(|e| format!("send: {e}"))?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).map_err(|e| format!("read: {e}"))?;
    let status = answer.lines().next().unwrap_or_default().to_string();
    if !status.contains(" 200 ") {
        return Err(format!("answer {status:?}"));
    }
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.trim().to_string()).unwrap_or_default();
    Ok((body, via))
}

/// Whether a socket in this namespace has `local` as its remote end.
fn proxy_here(local: SocketAddr) -> bool {
    let want = proc_net_form(local);
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|file| {
        std::fs::read_to_string(file).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 2 && f[2] == want && f[1] != want
            })
        })
    })
}

fn client(me: &str, interval: Duration, file: &str) -> Result<(), String> {
    log(&format!("client name={me} targets={file}"));
    loop {
        let targets: Vec<String> = std::fs::read_to_string(file)
            .unwrap_or_default()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect();
        if targets.is_empty() {
            std::thread::sleep(interval);
        }
        for t in &targets {
            match ask(me, t) {
                Ok((body, via)) => log(&format!("ok target={t} via={via} answer={}", body.replace(' ', ","))),
                Err(e) => log(&format!("fail target={t} error={}", e.replace(' ', "_"))),
            }
            std::thread::sleep(interval);
        }
    }
}

fn istiod(dir: &str) -> Result<(), String> {
    use weir_agent::{
        controlplane::{AdsServer, AuthPolicy, ServerTls, Snapshot},
        standalone::mesh::MeshFile,
    };
    let dir: &'static std::path::Path = Box::leak(std::path::PathBuf::from(dir).into_boxed_path());
    let read = |name: &str| {
        std::fs::read(dir.join(name)).map_err(|e| format!("read {}: {e}", dir.join(name).display()))
    };
    let token = String::from_utf8_lossy(&read("token")?).trim().to_string();
    let tls =
        ServerTls { cert_chain: read("serving.pem")?, key: read("serving-key.pem")?, client_roots: None };
    let load = |version: u64| -> Result<Snapshot, String> {
        let file = MeshFile::load(&dir.join("mesh.yaml")).map_err(|e| weir_agent::error_chain(&e))?;
        Ok(file.snapshot_for_all(&version.to_string()))
    };
    let ads = AdsServer::new(
        load(1)?,
        AuthPolicy {
            token: Some(token.clone()),
            cluster_id: Some(weir_tests::control_plane::CLUSTER_ID.into()),
        },
    );
    let ca =
        weir_tests::istiod_ca::IstiodCa::new("weir-rig mesh CA", Some(&token)).map_err(|e| e.to_string())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind("0.0.0.0:15012").await.map_err(|e| format!("bind 15012: {e}"))?;
        log("istiod listening on 15012");
        let pusher = ads.clone();
        tokio::spawn(async move {
            let mut last = std::fs::read(dir.join("mesh.yaml")).unwrap_or_default();
            let mut version = 1;
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let now = std::fs::read(dir.join("mesh.yaml")).unwrap_or_default();
                if now != last {
                    version += 1;
                    match load(version) {
                        Ok(snapshot) => {
                            pusher.push(snapshot);
                            log(&format!("pushed version={version}"));
                            last = now;
                        }
                        Err(e) => log(&format!("mesh.yaml refused error={}", e.replace(' ', "_"))),
                    }
                }
            }
        });
        weir_agent::controlplane::serve(listener, Some(tls), ads, Some(ca), std::future::pending())
            .await
            .map_err(|e| e.to_string())
    })
}

fn pause() -> Result<(), String> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    set.thread_block().map_err(|e| e.to_string())?;
    let _ = set.wait();
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).cloned().ok_or_else(|| format!("missing argument {i}"));
    let result = (|| -> Result<(), String> {
        match arg(0)?.as_str() {
            "pause" => pause(),
            "istiod" => istiod(&arg(1)?),
            "app" => {
                let ports: Vec<u16> = args[2..]
                    .iter()
                    .map(|p| p.parse().map_err(|e| format!("port {p}: {e}")))
                    .collect::<Result<_, _>>()?;
                app(&arg(1)?, &ports)
            }
            "client" => {
                let ms: u64 = arg(2)?.parse().map_err(|e| format!("interval: {e}"))?;
                client(&arg(1)?, Duration::from_millis(ms), &arg(3)?)
            }
            other => Err(format!("unknown command {other:?}: pause, app, client or istiod")),
        }
    })();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weir-rig: {e}");
            ExitCode::FAILURE
        }
    }
}
