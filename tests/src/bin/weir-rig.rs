//! weir-rig: the processes of the cluster in a box (tests/src/cluster), run from the
//! `weir-rig` images by containerd.
//!
//!   pause                     the sandbox: waits for SIGTERM or SIGINT
//!   app <name> <port>…        an HTTP app on each port; each connection is logged with whether its
//!                             other end is a socket in the pod's own network namespace
//!                             (a proxy that took it: the sidecar's Envoy, ztunnel) or
//!                             not (it came straight from the network: a bypass for a
//!                             meshed pod), and each request's x-forwarded-client-cert;
//!                             `/slow` answers after 2 s (a request in flight)
//!   client <name> <ms> <file> asks each target the file lists (one `ip:port[/path]` a
//!                             line, read again each round) in turn, forever; logs per
//!                             request the answer and whether its own connection's other
//!                             end was a local socket (its proxy) or the network
//!   istiod <dir>              the test control plane as istiod serves it on 15012 (TLS
//!                             with `<dir>/serving.pem` and `serving-key.pem`, bearer
//!                             `<dir>/token`): ADS with one snapshot for every proxy
//!                             from `<dir>/mesh.yaml` (Weir's standalone services file)
//!                             and, for ztunnel, the workloads of `<dir>/workloads.json`
//!                             (each read again when it changes), and istiod's CA
//!
//! `app` and `client` end as an app that drains does: on SIGTERM they log `terminating`,
//! go on for [`DRAIN`], then exit 0 (as PID 1 of a container, a signal without a
//! handler would be ignored until the SIGKILL at the end of the grace period).
//!
//! Log lines (stdout, the container's log): `<ms> <kind> key=value ...`.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    process::ExitCode,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// How long `app` and `client` go on after SIGTERM.
const DRAIN: Duration = Duration::from_secs(3);

/// How long `/slow` takes to answer.
const SLOW: Duration = Duration::from_secs(2);

/// Blocks SIGTERM and SIGINT in this thread (so in every thread it starts) and waits
/// for one in a thread of its own: logs `terminating`, waits [`DRAIN`], exits 0.
fn exit_after_drain() -> Result<(), String> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    set.thread_block().map_err(|e| e.to_string())?;
    std::thread::spawn(move || {
        let signal = set.wait();
        log(&format!("terminating signal={signal:?} drain_ms={}", DRAIN.as_millis()));
        std::thread::sleep(DRAIN);
        log("exit");
        std::process::exit(0);
    });
    Ok(())
}

fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0)
}

fn log(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{} {line}", now_ms());
    let _ = out.flush();
}

/// `addr` as /proc/net/tcp writes it (`0100007F:1F90` for 127.0.0.1:8080), and for
/// an IPv4 address also its v4-mapped form in /proc/net/tcp6 (a dual-stack socket,
/// as ztunnel's listeners are, shows its IPv4 peers that way).
fn proc_net_forms(addr: SocketAddr) -> Vec<String> {
    let v6 = |o: [u8; 16], port: u16| {
        let words: String =
            o.chunks(4).map(|w| format!("{:08X}", u32::from_le_bytes([w[0], w[1], w[2], w[3]]))).collect();
        format!("{words}:{port:04X}")
    };
    match addr {
        SocketAddr::V4(a) => vec![
            format!("{:08X}:{:04X}", u32::from_le_bytes(a.ip().octets()), a.port()),
            v6(a.ip().to_ipv6_mapped().octets(), a.port()),
        ],
        SocketAddr::V6(a) => vec![v6(a.ip().octets(), a.port())],
    }
}

/// Each socket in this namespace as (local, remote) in /proc/net form.
fn sockets_here() -> Vec<(String, String)> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|file| std::fs::read_to_string(file).ok())
        .flat_map(|t| {
            t.lines()
                .skip(1)
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    (f.len() > 2).then(|| (f[1].to_string(), f[2].to_string()))
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Whether this namespace holds a socket whose local end is `local` and remote end
/// `remote`: the other end of a connection that never left the pod.
fn local_socket(local: SocketAddr, remote: SocketAddr) -> bool {
    let (locals, remotes) = (proc_net_forms(local), proc_net_forms(remote));
    sockets_here().iter().any(|(l, r)| locals.contains(l) && remotes.contains(r))
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
            log(&format!("request via={via} peer={peer} client={client} path={path} xfcc={xfcc}"));
        }
        if path == "/slow" {
            std::thread::sleep(SLOW);
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
    let (host, path) = match target.find('/') {
        Some(i) => (&target[..i], &target[i..]),
        None => (target, "/"),
    };
    let addr: SocketAddr = host.parse().map_err(|e| format!("{target}: {e}"))?;
    let before = proxy_port_sockets();
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(3)).map_err(|e| format!("connect: {e}"))?;
    let local = stream.local_addr().map_err(|e| e.to_string())?;
    // Whatever took this connection in the pod (its proxy) has a socket whose remote
    // end is this one's local address; nothing here does when it went to the network.
    // Netfilter's REDIRECT may give the connection another source port (when this
    // port's earlier connection elsewhere, redirected too, is still in conntrack: the
    // two would share a reply tuple), so a socket on the proxy's port 15001 that was not
    // there before the connect, from this address, is this connection's too. It is made
    // when the handshake's last ACK reaches the proxy's listener, which on a loaded node
    // may be a moment after connect() returned here: looked for up to half a second (a
    // connection to the network never shows one).
    let deadline = std::time::Instant::now() + Duration::from_millis(500);
    let via = loop {
        if proxy_here(local) || proxy_port_sockets().difference(&before).any(|(_, r)| same_ip(r, local)) {
            break "proxy";
        }
        if std::time::Instant::now() > deadline {
            break "network";
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let req =
        format!("GET {path} HTTP/1.1\r\nhost: {host}\r\nx-rig-client: {me}\r\nconnection: close\r\n\r\n");
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

/// The sockets in this namespace on the proxies' outbound port (15001), as (local,
/// remote) in /proc/net form.
fn proxy_port_sockets() -> std::collections::BTreeSet<(String, String)> {
    sockets_here().into_iter().filter(|(l, _)| l.ends_with(":3A99")).collect()
}

/// Whether `remote` (/proc/net form) is an address of `local`'s IP, any port.
fn same_ip(remote: &str, local: SocketAddr) -> bool {
    let ip = |form: &str| form.rsplit_once(':').map(|(ip, _)| ip.to_string()).unwrap_or_default();
    proc_net_forms(local).iter().any(|f| ip(f) == ip(remote))
}

/// Whether a socket in this namespace has `local` as its remote end.
fn proxy_here(local: SocketAddr) -> bool {
    let forms = proc_net_forms(local);
    sockets_here().iter().any(|(l, r)| forms.contains(r) && !forms.contains(l))
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
        sidecar::controlplane::{AdsServer, AuthPolicy, ServerTls, Snapshot},
        sidecar::standalone::mesh::MeshFile,
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
        let mut snapshot = file.snapshot_for_all(&version.to_string());
        let workloads = std::fs::read(dir.join("workloads.json")).unwrap_or_else(|_| b"[]".to_vec());
        let workloads: Vec<serde_json::Value> =
            serde_json::from_slice(&workloads).map_err(|e| format!("workloads.json: {e}"))?;
        snapshot.set(ADDRESS, version.to_string(), workloads.iter().filter_map(address).collect::<Vec<_>>());
        snapshot.set(AUTHORIZATION, version.to_string(), Vec::<(String, prost_types::Any)>::new());
        Ok(snapshot)
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
            let read_all = || {
                [
                    std::fs::read(dir.join("mesh.yaml")).unwrap_or_default(),
                    std::fs::read(dir.join("workloads.json")).unwrap_or_default(),
                ]
            };
            let mut last = read_all();
            let mut version = 1;
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let now = read_all();
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
        weir_agent::sidecar::controlplane::serve(listener, Some(tls), ads, Some(ca), std::future::pending())
            .await
            .map_err(|e| e.to_string())
    })
}

const ADDRESS: &str = "type.googleapis.com/istio.workload.Address";
const AUTHORIZATION: &str = "type.googleapis.com/istio.security.Authorization";

/// A workload of workloads.json (`{"name", "namespace", "ip", "node", "serviceAccount"}`)
/// as the Address resource istiod sends ztunnel: a pod reached over HBONE.
fn address(w: &serde_json::Value) -> Option<(String, prost_types::Any)> {
    use prost::Message as _;
    use weir_proto::istio::workload::api::{Address, TunnelProtocol, Workload, WorkloadType, address};
    let (name, namespace) = (w["name"].as_str()?, w["namespace"].as_str()?);
    let ip: std::net::IpAddr = w["ip"].as_str()?.parse().ok()?;
    let uid = format!("Kubernetes//Pod/{namespace}/{name}");
    let octets = match ip {
        std::net::IpAddr::V4(v4) => v4.octets().to_vec(),
        std::net::IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    let workload = Workload {
        uid: uid.clone(),
        name: name.into(),
        namespace: namespace.into(),
        addresses: vec![octets],
        tunnel_protocol: TunnelProtocol::Hbone as i32,
        trust_domain: "cluster.local".into(),
        service_account: w["serviceAccount"].as_str().unwrap_or("default").into(),
        node: w["node"].as_str().unwrap_or_default().into(),
        workload_type: WorkloadType::Pod as i32,
        workload_name: name.into(),
        cluster_id: "Kubernetes".into(),
        ..Default::default()
    };
    let resource = Address { r#type: Some(address::Type::Workload(workload)) };
    Some((uid, prost_types::Any { type_url: ADDRESS.into(), value: resource.encode_to_vec() }))
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
                exit_after_drain()?;
                let ports: Vec<u16> = args[2..]
                    .iter()
                    .map(|p| p.parse().map_err(|e| format!("port {p}: {e}")))
                    .collect::<Result<_, _>>()?;
                app(&arg(1)?, &ports)
            }
            "client" => {
                exit_after_drain()?;
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
