//! Traffic for the busy-node rig that tells every connection that got past a sidecar
//! from one that went through it, from both ends.
//!
//! - [`sidecar`]: a pod's stand-in for Envoy (run as the proxy user): 15001 takes the
//!   app's captured outbound connections, asks `SO_ORIGINAL_DST` and connects there
//!   (as the proxy user, so capture leaves it alone), sending a marker line first;
//!   15006 takes inbound connections handed to it and connects to the original
//!   destination from 127.0.0.6, as Envoy's inbound passthrough does.
//! - [`app`]: a meshed pod's server. A connection that arrives from anywhere but
//!   127.0.0.6 got past this pod's sidecar (an inbound bypass); one from a client that
//!   says it is meshed without the marker got past the client's sidecar (an outbound
//!   bypass). Each connection is logged: `<ms> ok|bypass-inbound|bypass-outbound ...`.
//! - [`client`]: connects to its targets in turn, forever, saying who it is; logs
//!   `<ms> ok <target>` or `<ms> fail <target> <error>`.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// The first line a sidecar sends upstream.
pub const MARKER: &str = "via-sidecar";

fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0)
}

fn log_line(path: &Path, line: &str) {
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "{} {line}", now_ms());
    }
}

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let sock = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
    if addr.is_ipv6() {
        sock.set_only_v6(true)?;
    }
    sock.set_reuse_address(true)?;
    sock.bind(&addr.into())?;
    sock.listen(1024)?;
    Ok(sock.into())
}

/// Copies both ways until either side closes.
fn splice(a: TcpStream, b: TcpStream) {
    let (a2, b2) = (a.try_clone(), b.try_clone());
    let (Ok(mut a2), Ok(mut b2)) = (a2, b2) else { return };
    let up = std::thread::spawn(move || {
        let mut a = a;
        let mut b = b;
        let _ = std::io::copy(&mut a, &mut b);
        let _ = b.shutdown(std::net::Shutdown::Write);
    });
    let _ = std::io::copy(&mut b2, &mut a2);
    let _ = a2.shutdown(std::net::Shutdown::Write);
    let _ = up.join();
}

/// The original destination of an accepted connection (SO_ORIGINAL_DST /
/// IP6T_SO_ORIGINAL_DST, which eBPF capture answers).
fn original_dst(s: &TcpStream) -> std::io::Result<SocketAddr> {
    let v6 = s.local_addr()?.is_ipv6();
    // SAFETY: sockaddr_storage is plain data; getsockopt fills at most its size.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let (level, name) = if v6 { (libc::SOL_IPV6, 80) } else { (libc::SOL_IP, 80) };
    // SAFETY: getsockopt into a buffer of `len` bytes.
    let rc = unsafe { libc::getsockopt(s.as_raw_fd(), level, name, (&raw mut storage).cast(), &mut len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel wrote a sockaddr of the family it says.
    unsafe {
        match i32::from(storage.ss_family) {
            libc::AF_INET => {
                let a = &*(&raw const storage).cast::<libc::sockaddr_in>();
                Ok(SocketAddr::new(
                    Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)).into(),
                    u16::from_be(a.sin_port),
                ))
            }
            _ => {
                let a = &*(&raw const storage).cast::<libc::sockaddr_in6>();
                Ok(SocketAddr::new(Ipv6Addr::from(a.sin6_addr.s6_addr).into(), u16::from_be(a.sin6_port)))
            }
        }
    }
}

/// The stand-in sidecar: 15001 (outbound) and 15006 (inbound), IPv4 (the rig's pods
/// are IPv4).
pub fn sidecar() -> Result<(), String> {
    let bind = |addr: &str| listen(addr.parse().unwrap()).map_err(|e| format!("listen {addr}: {e}"));
    let outbound = [bind("0.0.0.0:15001")?];
    let inbound = [bind("0.0.0.0:15006")?];
    println!("listening 15001 15006");
    let _ = std::io::stdout().flush();
    let mut threads = Vec::new();
    for l in outbound {
        threads.push(std::thread::spawn(move || accept_loop(l, outbound_conn)));
    }
    for l in inbound {
        threads.push(std::thread::spawn(move || accept_loop(l, inbound_conn)));
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

/// A timeout of `secs` seconds, stretched `WEIR_TIMEOUT_SCALE` times (1 to 20; the
/// kernel matrix sets it in a software-emulated VM, where every instruction costs many
/// of the host's). A timeout is how a lost connection shows; it must not be how a slow
/// machine shows.
fn patience(secs: u64) -> Duration {
    let scale = std::env::var("WEIR_TIMEOUT_SCALE")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|s| (1..=20).contains(s))
        .unwrap_or(1);
    Duration::from_secs(secs * scale)
}

fn accept_loop(l: TcpListener, handle: fn(TcpStream)) {
    for conn in l.incoming().flatten() {
        std::thread::spawn(move || handle(conn));
    }
}

fn outbound_conn(app: TcpStream) {
    let Ok(orig) = original_dst(&app) else { return };
    let Ok(mut up) = TcpStream::connect_timeout(&orig, patience(2)) else { return };
    let me = app.peer_addr().map(|a| a.ip().to_string()).unwrap_or_default();
    if writeln!(up, "{MARKER} {me}").is_err() {
        return;
    }
    splice(app, up);
}

fn inbound_conn(from: TcpStream) {
    // sk_assign keeps the original destination as the local address.
    let Ok(orig) = from.local_addr() else { return };
    let source: IpAddr = Ipv4Addr::new(127, 0, 0, 6).into();
    let Ok(sock) = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None) else { return };
    if sock.bind(&SocketAddr::new(source, 0).into()).is_err() {
        return;
    }
    if sock.connect_timeout(&orig.into(), patience(2)).is_err() {
        return;
    }
    splice(from, sock.into());
}

/// A meshed pod's app server on `addr`, logging each connection's verdict to `log`.
pub fn app(addr: SocketAddr, log: &Path) -> Result<(), String> {
    let l = listen(addr).map_err(|e| format!("listen {addr}: {e}"))?;
    println!("listening {addr}");
    let _ = std::io::stdout().flush();
    for conn in l.incoming().flatten() {
        let log = log.to_path_buf();
        std::thread::spawn(move || serve_app(conn, &log));
    }
    Ok(())
}

fn serve_app(conn: TcpStream, log: &Path) {
    let _ = conn.set_read_timeout(Some(patience(5)));
    let peer = conn.peer_addr().map(|a| a.ip()).unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let mut reader = BufReader::new(match conn.try_clone() {
        Ok(c) => c,
        Err(_) => return,
    });
    let mut first = String::new();
    if reader.read_line(&mut first).is_err() {
        return;
    }
    let marked = first.starts_with(MARKER);
    let mut hello = first.clone();
    if marked {
        hello.clear();
        if reader.read_line(&mut hello).is_err() {
            return;
        }
    }
    // `hello <client> <meshed|plain>`
    let words: Vec<&str> = hello.split_whitespace().collect();
    let (client, kind) = (words.get(1).copied().unwrap_or("?"), words.get(2).copied().unwrap_or("?"));
    let through_sidecar =
        peer == IpAddr::V4(Ipv4Addr::new(127, 0, 0, 6)) || peer == "::6".parse::<IpAddr>().unwrap();
    let verdict = if !through_sidecar {
        format!("bypass-inbound {client} peer={peer}")
    } else if kind == "meshed" && !marked {
        format!("bypass-outbound {client}")
    } else {
        format!("ok {client}")
    };
    log_line(log, &verdict);
    let mut conn = conn;
    let _ = conn.write_all(b"ok\n");
    let mut rest = Vec::new();
    let _ = reader.read_to_end(&mut rest);
}

/// A client in pod `me` (`meshed` or `plain`) connecting to `targets` in turn, one
/// every `interval`, forever, logging each outcome to `log`.
pub fn client(
    me: &str,
    kind: &str,
    interval: Duration,
    log: &Path,
    targets: &[SocketAddr],
) -> Result<(), String> {
    if targets.is_empty() {
        return Err("no targets".into());
    }
    println!("listening (a client)");
    let _ = std::io::stdout().flush();
    for target in targets.iter().cycle() {
        let outcome = (|| -> std::io::Result<()> {
            let mut s = TcpStream::connect_timeout(target, patience(2))?;
            s.set_read_timeout(Some(patience(3)))?;
            writeln!(s, "hello {me} {kind}")?;
            let mut line = String::new();
            BufReader::new(&s).read_line(&mut line)?;
            if line.trim() != "ok" {
                return Err(std::io::Error::other(format!("answer {line:?}")));
            }
            Ok(())
        })();
        match outcome {
            Ok(()) => log_line(log, &format!("ok {target}")),
            Err(e) => log_line(log, &format!("fail {target} {e}")),
        }
        std::thread::sleep(interval);
    }
    Ok(())
}
