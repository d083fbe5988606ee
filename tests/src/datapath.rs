//! The capture data path's own load, without Envoy: an acceptor standing where Envoy's
//! outbound listener stands (15001) that asks every accepted connection for its
//! original destination (`SO_ORIGINAL_DST`, as Envoy's `original_dst` listener filter
//! does) and serves it, and the client load `weir-bench datapath` drives through each
//! capture mode. Every connection's answer carries the original destination the
//! acceptor saw, so a run that was not captured as it claims counts as failed.
//!
//! Wire: the client sends one kind byte (`c` connect probe, `r` request/response, `b`
//! bulk); the acceptor answers with an 8-byte header (found flag, 0, port, IPv4
//! address, network order), then: `c` closes; `r` echoes [`REQUEST`]-byte requests
//! until EOF; `b` reads to EOF and answers with the byte count (u64, big-endian).

use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    sync::{Arc, Barrier, Mutex},
    time::{Duration, Instant},
};

/// Bytes per request and per response in the request/response load.
pub const REQUEST: usize = 64;
/// Bytes per write in the bulk load.
const CHUNK: usize = 64 * 1024;

/// What one load run does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `count` connections one after another: connect, ask, read the answer, close.
    Connect,
    /// `inflight` kept connections, each a request/response loop, for `secs`.
    RequestResponse,
    /// One connection writing as fast as it can for `secs`.
    Bulk,
}

impl Kind {
    fn byte(self) -> u8 {
        match self {
            Kind::Connect => b'c',
            Kind::RequestResponse => b'r',
            Kind::Bulk => b'b',
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "connect" => Ok(Kind::Connect),
            "rr" => Ok(Kind::RequestResponse),
            "bulk" => Ok(Kind::Bulk),
            other => Err(format!("load kind {other:?}: expected connect, rr or bulk")),
        }
    }
}

/// One load run: where to connect and what the acceptor must report as the original
/// destination (`None`: nothing, the floor's direct connection).
#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub to: SocketAddrV4,
    pub expect: Option<SocketAddrV4>,
    /// Accept whatever the acceptor saw (`any`): an app behind a proxy that is not the
    /// acceptor (ztunnel), where the run is checked another way.
    pub any_orig: bool,
    pub kind: Kind,
    pub count: u64,
    pub secs: f64,
    pub inflight: usize,
    /// The pod's cgroup, whose `cpu.stat` is read around the run.
    pub cgroup: Option<PathBuf>,
}

/// What a run measured. CPU is microseconds over the timed part of the run.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct LoadResult {
    /// Connections (connect), round trips (rr) or 0 (bulk).
    pub ops: u64,
    pub secs: f64,
    /// Latency percentiles of connections (connect) or round trips (rr).
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    /// Bytes the acceptor received (bulk).
    pub bytes: u64,
    /// `usage_usec` of the pod's cgroup: every process of the pod, and the softirq work
    /// done in their context.
    pub cgroup_cpu_us: Option<f64>,
    /// Busy time of every CPU of the machine (`/proc/stat`, 10 ms ticks).
    pub host_cpu_us: f64,
    pub failed: u64,
    pub errors: Vec<String>,
}

/// Pins this process (and threads it starts later) to one CPU.
pub fn pin_to_cpu(cpu: usize) -> Result<(), String> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).map_err(|e| format!("cpu {cpu}: {e}"))?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .map_err(|e| format!("pin to cpu {cpu}: {e}"))
}

fn header(orig: Option<SocketAddrV4>) -> [u8; 8] {
    let mut h = [0u8; 8];
    if let Some(o) = orig {
        h[0] = 1;
        h[2..4].copy_from_slice(&o.port().to_be_bytes());
        h[4..8].copy_from_slice(&o.ip().octets());
    }
    h
}

fn parse_header(h: &[u8; 8]) -> Option<SocketAddrV4> {
    (h[0] == 1)
        .then(|| SocketAddrV4::new(Ipv4Addr::new(h[4], h[5], h[6], h[7]), u16::from_be_bytes([h[2], h[3]])))
}

/// The acceptor: serves until killed. Prints `listening <addr>` once bound.
pub fn serve(addr: SocketAddr) -> Result<(), String> {
    let listener = TcpListener::bind(addr).map_err(|e| format!("bind {addr}: {e}"))?;
    println!("listening {addr}");
    let _ = std::io::stdout().flush();
    for conn in listener.incoming() {
        let Ok(mut s) = conn else { continue };
        let orig = match weir_iptables::validation::original_dst(s.as_raw_fd(), false) {
            Ok(SocketAddr::V4(o)) => Some(o),
            _ => None,
        };
        let _ = s.set_nodelay(true);
        let mut kind = [0u8];
        if s.read_exact(&mut kind).is_err() {
            continue;
        }
        let head = header(orig);
        match kind[0] {
            b'c' => {
                let _ = s.write_all(&head);
            }
            b'r' => {
                std::thread::spawn(move || {
                    let _ = s.write_all(&head);
                    let mut buf = [0u8; REQUEST];
                    while s.read_exact(&mut buf).is_ok() && s.write_all(&buf).is_ok() {}
                });
            }
            b'b' => {
                std::thread::spawn(move || {
                    let _ = s.write_all(&head);
                    let mut buf = vec![0u8; 256 * 1024];
                    let mut total = 0u64;
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        total += n as u64;
                    }
                    let _ = s.write_all(&total.to_be_bytes());
                });
            }
            _ => {}
        }
    }
    Ok(())
}

/// `usage_usec` from a cgroup v2 directory's `cpu.stat`.
pub fn cgroup_usage_us(cgroup: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(cgroup.join("cpu.stat")).ok()?;
    text.lines().find_map(|l| l.strip_prefix("usage_usec ")).and_then(|v| v.trim().parse().ok())
}

/// Busy microseconds of all CPUs so far (`/proc/stat`: everything but idle and iowait).
pub fn host_busy_us() -> f64 {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<f64> = text
        .lines()
        .next()
        .map(|l| l.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_default();
    let busy: f64 =
        ticks.iter().enumerate().filter(|(i, _)| *i != 3 && *i != 4 && *i < 8).map(|(_, v)| v).sum();
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as f64;
    busy * 1e6 / hz
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    (!sorted.is_empty()).then(|| sorted[((sorted.len() - 1) as f64 * p).round() as usize])
}

/// Errors of one run, the first few kept with their text.
#[derive(Default)]
struct Failures {
    count: u64,
    kept: Vec<String>,
}

impl Failures {
    fn add(&mut self, what: String) {
        self.count += 1;
        if self.kept.len() < 5 {
            self.kept.push(what);
        }
    }
}

/// Connects, asks with `kind` and checks the acceptor's view of the original
/// destination.
fn open(spec: &LoadSpec, kind: Kind) -> Result<TcpStream, String> {
    let mut s = TcpStream::connect_timeout(&spec.to.into(), Duration::from_secs(3))
        .map_err(|e| format!("connect {}: {e}", spec.to))?;
    s.set_nodelay(true).map_err(|e| format!("nodelay: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| format!("timeout: {e}"))?;
    s.write_all(&[kind.byte()]).map_err(|e| format!("write: {e}"))?;
    let mut h = [0u8; 8];
    s.read_exact(&mut h).map_err(|e| format!("read the acceptor's answer: {e}"))?;
    let seen = parse_header(&h);
    if seen != spec.expect && !spec.any_orig {
        return Err(format!(
            "the acceptor saw original destination {} where {} was expected",
            seen.map_or("none".into(), |a| a.to_string()),
            spec.expect.map_or("none".into(), |a| a.to_string())
        ));
    }
    Ok(s)
}

/// Runs one load and measures it.
pub fn run(spec: &LoadSpec) -> LoadResult {
    let cpu_before = (spec.cgroup.as_deref().and_then(cgroup_usage_us), host_busy_us());
    let started = Instant::now();
    let mut failures = Failures::default();
    let mut latencies = Vec::new();
    let (mut ops, mut bytes) = (0u64, 0u64);
    match spec.kind {
        Kind::Connect => {
            for _ in 0..spec.count {
                let t = Instant::now();
                match open(spec, Kind::Connect) {
                    Ok(s) => {
                        latencies.push(t.elapsed().as_secs_f64() * 1e6);
                        ops += 1;
                        drop(s);
                    }
                    Err(e) => failures.add(e),
                }
                if failures.count >= 100 {
                    break;
                }
            }
        }
        Kind::RequestResponse => {
            let (n, lat) = request_response(spec, &mut failures);
            ops = n;
            latencies = lat;
        }
        Kind::Bulk => match bulk(spec) {
            Ok(n) => bytes = n,
            Err(e) => failures.add(e),
        },
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu_after = (spec.cgroup.as_deref().and_then(cgroup_usage_us), host_busy_us());
    latencies.sort_by(f64::total_cmp);
    LoadResult {
        ops,
        secs,
        p50_us: percentile(&latencies, 0.50),
        p99_us: percentile(&latencies, 0.99),
        bytes,
        cgroup_cpu_us: cpu_before.0.zip(cpu_after.0).map(|(b, a)| a - b),
        host_cpu_us: cpu_after.1 - cpu_before.1,
        failed: failures.count,
        errors: failures.kept,
    }
}

/// `inflight` connections, each its own thread doing request/response until the time
/// is up: (round trips, each round trip's latency in µs).
fn request_response(spec: &LoadSpec, failures: &mut Failures) -> (u64, Vec<f64>) {
    let streams: Vec<TcpStream> = (0..spec.inflight.max(1))
        .filter_map(|_| open(spec, Kind::RequestResponse).map_err(|e| failures.add(e)).ok())
        .collect();
    let barrier = Arc::new(Barrier::new(streams.len()));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let secs = spec.secs;
    let threads: Vec<_> = streams
        .into_iter()
        .map(|mut s| {
            let (barrier, errors) = (barrier.clone(), errors.clone());
            std::thread::spawn(move || {
                let mut lat = Vec::with_capacity(1 << 16);
                let (req, mut resp) = ([7u8; REQUEST], [0u8; REQUEST]);
                barrier.wait();
                let deadline = Instant::now() + Duration::from_secs_f64(secs);
                while Instant::now() < deadline {
                    let t = Instant::now();
                    if let Err(e) = s.write_all(&req).and_then(|()| s.read_exact(&mut resp)) {
                        errors.lock().unwrap_or_else(|e| e.into_inner()).push(format!("round trip: {e}"));
                        break;
                    }
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                }
                lat
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in threads {
        all.extend(t.join().unwrap_or_default());
    }
    for e in errors.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
        failures.add(e);
    }
    (all.len() as u64, all)
}

/// One connection writing for `secs`, then the acceptor's count of what it received.
fn bulk(spec: &LoadSpec) -> Result<u64, String> {
    let mut s = open(spec, Kind::Bulk)?;
    let chunk = vec![0x5au8; CHUNK];
    let deadline = Instant::now() + Duration::from_secs_f64(spec.secs);
    let mut sent = 0u64;
    while Instant::now() < deadline {
        s.write_all(&chunk).map_err(|e| format!("write after {sent} bytes: {e}"))?;
        sent += CHUNK as u64;
    }
    s.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))?;
    let mut count = [0u8; 8];
    s.read_exact(&mut count).map_err(|e| format!("read the acceptor's count: {e}"))?;
    let got = u64::from_be_bytes(count);
    if got != sent {
        return Err(format!("the acceptor received {got} of {sent} bytes"));
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_header_round_trips() {
        let a: SocketAddrV4 = "10.1.2.3:8080".parse().unwrap();
        assert_eq!(parse_header(&header(Some(a))), Some(a));
        assert_eq!(parse_header(&header(None)), None);
    }

    #[test]
    fn a_direct_connection_is_served_and_a_wrong_expectation_fails() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = match listener.local_addr().unwrap() {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(_) => unreachable!(),
        };
        drop(listener);
        std::thread::spawn(move || serve(addr.into()));
        let mut spec = LoadSpec {
            any_orig: false,
            to: addr,
            expect: None,
            kind: Kind::Connect,
            count: 20,
            secs: 0.2,
            inflight: 2,
            cgroup: None,
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(addr).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let r = run(&spec);
        assert_eq!((r.ops, r.failed), (20, 0), "{:?}", r.errors);
        assert!(r.p50_us.is_some_and(|p| p > 0.0) && r.p99_us >= r.p50_us, "{r:?}");
        spec.kind = Kind::RequestResponse;
        let r = run(&spec);
        assert!(r.ops > 0 && r.failed == 0, "{r:?}");
        spec.kind = Kind::Bulk;
        let r = run(&spec);
        assert!(r.bytes > 0 && r.failed == 0, "{r:?}");
        // An uncaptured connection reported as captured is a failure, named.
        spec.kind = Kind::Connect;
        spec.expect = Some("10.9.9.9:80".parse().unwrap());
        let r = run(&spec);
        assert_eq!(r.ops, 0);
        assert!(r.errors[0].contains("saw original destination none where 10.9.9.9:80"), "{:?}", r.errors);
    }
}
