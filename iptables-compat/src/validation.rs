//! Istio's validation probe (`--run-validation`): listen on the outbound and inbound
//! capture ports, connect as the proxy user to 127.0.0.6:<probe port> (::6 on IPv6
//! pods), and pass when a listener sees that address as the connection's original
//! destination, which only happens if the capture rules are in place.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd as _, RawFd},
    time::{Duration, Instant},
};

use crate::inputs::config::{CaptureConfig, RunOptions};

/// `SO_ORIGINAL_DST` (netfilter), also `IP6T_SO_ORIGINAL_DST` at SOL_IPV6.
pub const SO_ORIGINAL_DST: libc::c_int = 80;

#[derive(Debug, thiserror::Error)]
pub enum ValidationError {
    #[error("no listener could be opened on {0}")]
    NoListener(String),
    #[error("validation timed out after {0:?}: connections to {1} never reached Envoy's capture ports")]
    Timeout(Duration, SocketAddr),
    #[error("proxy uid {0:?} is not a number or a known user")]
    ProxyUid(String),
}

/// The destination a redirected TCP connection was originally addressed to, read with
/// `getsockopt(SO_ORIGINAL_DST)` on the accepted socket `fd`.
pub fn original_dst(fd: RawFd, ipv6: bool) -> std::io::Result<SocketAddr> {
    // SAFETY: getsockopt with a correctly sized, zeroed output buffer for the family.
    unsafe {
        if ipv6 {
            let mut addr: libc::sockaddr_in6 = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
            if libc::getsockopt(fd, libc::SOL_IPV6, SO_ORIGINAL_DST, (&raw mut addr).cast(), &mut len) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(SocketAddr::new(
                IpAddr::V6(Ipv6Addr::from(addr.sin6_addr.s6_addr)),
                u16::from_be(addr.sin6_port),
            ))
        } else {
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            if libc::getsockopt(fd, libc::SOL_IP, SO_ORIGINAL_DST, (&raw mut addr).cast(), &mut len) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr))),
                u16::from_be(addr.sin_port),
            ))
        }
    }
}

/// Runs the probe in the current network namespace.
pub fn validate(cfg: &CaptureConfig, opts: &RunOptions, proxy_uid: u32) -> Result<(), ValidationError> {
    let ipv6 = opts.host_ip.is_some_and(|ip| ip.is_ipv6());
    let (listen_ip, server_ip, client_ip): (IpAddr, IpAddr, IpAddr) = if ipv6 {
        (Ipv6Addr::LOCALHOST.into(), Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6).into(), Ipv6Addr::LOCALHOST.into())
    } else {
        (Ipv4Addr::LOCALHOST.into(), Ipv4Addr::new(127, 0, 0, 6).into(), Ipv4Addr::LOCALHOST.into())
    };
    let target = SocketAddr::new(server_ip, opts.probe_port);
    let done = std::sync::atomic::AtomicBool::new(false);
    let mut listening = Vec::new();
    for port in [cfg.proxy_port, cfg.inbound_capture_port] {
        let addr = SocketAddr::new(listen_ip, port);
        match TcpListener::bind(addr) {
            Ok(l) => {
                tracing::info!(%addr, "validation: listening");
                l.set_nonblocking(true).ok();
                listening.push(l);
            }
            Err(e) => tracing::error!(%addr, error = %e, "validation: cannot listen"),
        }
    }
    if listening.is_empty() {
        return Err(ValidationError::NoListener(format!(
            "{listen_ip} ports {} and {}",
            cfg.proxy_port, cfg.inbound_capture_port
        )));
    }
    let deadline = Instant::now() + opts.probe_timeout;
    let probe_port = opts.probe_port;
    std::thread::scope(|s| {
        // The client, as the proxy user: only then do the owner-match rules capture it.
        s.spawn(|| {
            // SAFETY: raw setresgid/setresuid change only this thread's credentials
            // (glibc's wrappers would change the whole process); this thread ends here.
            unsafe {
                if libc::geteuid() != proxy_uid {
                    libc::syscall(libc::SYS_setresgid, proxy_uid, proxy_uid, proxy_uid);
                    libc::syscall(libc::SYS_setresuid, proxy_uid, proxy_uid, proxy_uid);
                }
            }
            while Instant::now() < deadline {
                if done.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                let socket = socket2_connect(client_ip, target);
                if let Err(e) = socket {
                    tracing::debug!(%target, error = %e, "validation: connect");
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        // The servers: accept, read the original destination, echo its port.
        let result = loop {
            if Instant::now() >= deadline {
                break Err(ValidationError::Timeout(opts.probe_timeout, target));
            }
            let mut passed = false;
            for l in &listening {
                if let Ok((mut conn, _)) = l.accept() {
                    match original_dst(conn.as_raw_fd(), ipv6) {
                        Ok(orig) => {
                            let _ = conn.write_all(orig.port().to_string().as_bytes());
                            tracing::info!(original = %orig, "validation: connection captured");
                            passed |= orig.port() == probe_port;
                        }
                        Err(e) => tracing::debug!(error = %e, "validation: no original destination"),
                    }
                    let mut sink = [0u8; 16];
                    let _ = conn.set_nonblocking(true);
                    let _ = conn.read(&mut sink);
                }
            }
            if passed {
                tracing::info!("validation passed, capture rules established");
                break Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        result
    })
}

/// Connects from `local` (port 0) to `target` with a short timeout.
fn socket2_connect(local: IpAddr, target: SocketAddr) -> std::io::Result<()> {
    // std cannot bind before connect; a plain connect from loopback picks a loopback
    // source for a loopback target anyway, which is what Istio's explicit bind does.
    let _ = local;
    let stream = TcpStream::connect_timeout(&target, Duration::from_millis(500))?;
    drop(stream);
    Ok(())
}

/// The proxy uid as a number (for the probe's client thread).
pub fn proxy_uid_number(cfg: &CaptureConfig) -> Result<u32, ValidationError> {
    let first = cfg.proxy_uids.first().cloned().unwrap_or_else(|| "1337".into());
    first
        .parse()
        .ok()
        .or_else(|| nix::unistd::User::from_name(&first).ok().flatten().map(|u| u.uid.as_raw()))
        .ok_or(ValidationError::ProxyUid(first))
}
