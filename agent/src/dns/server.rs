//! The DNS proxy's servers: UDP and TCP on one address (127.0.0.1:15053 by default).
//! Known names come from the lookup table (authoritative, TTL 30, addresses shuffled);
//! the rest is forwarded as-is to the resolv.conf servers, in shuffled order, each with
//! a timeout, SERVFAIL when all fail. Replies are trimmed to the client's UDP size.
//!
//! Any process in the pod can reach the proxy, so what it spends is bounded
//! ([`DnsLimits`]): table answers are made on the receiving task, without spawning;
//! at most `max_forwards` forwarded queries are in flight (beyond that a UDP query is
//! dropped, as an overloaded resolver drops, and the client asks again; a TCP one
//! waits); at most `max_tcp_connections` TCP connections per listener, each closed
//! when idle (miekg/dns's 8 s, which pilot-agent's proxy runs on) or slow to send a
//! query it started; the receive buffers are reused (one per UDP socket, one per TCP
//! connection, a small pool for upstream replies).

use std::{
    net::SocketAddr,
    sync::{Arc, RwLock},
    time::{Duration, Instant},
};

use hickory_proto::{
    op::{Edns, Message, MessageType, OpCode, ResponseCode},
    rr::RecordType,
};
use rand::seq::SliceRandom as _;
use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _},
    net::{TcpListener, UdpSocket},
    sync::Semaphore,
};
use weir_proto::istio::networking::nds::v1::NameTable;

use super::{
    forward::{Buffers, MAX_TCP, ask},
    table::{LookupTable, ProxyScope},
};
use crate::metrics::Metrics;

/// Istio's default upstream timeout.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);
const MIN_UDP: usize = 512;

/// Istio's `DNS_PROXY_ADDR` default.
pub const DEFAULT_ADDRESS: &str = "localhost:15053";

#[derive(Debug, Clone)]
pub struct DnsConfig {
    /// Where to listen (UDP and TCP on each).
    pub listen: Vec<SocketAddr>,
    pub scope: ProxyScope,
    /// resolv.conf nameservers, port 53.
    pub upstreams: Vec<SocketAddr>,
    pub upstream_timeout: Duration,
    /// `DNS_FORWARD_PARALLEL`: ask every upstream at once, take the first answer.
    pub forward_parallel: bool,
    /// Forward instead of SERVFAIL before the first NDS table (Istio does this when the
    /// proxy owns port 53, so the pod resolves while the agent starts).
    pub respond_before_sync: bool,
    pub limits: DnsLimits,
}

/// What the proxy may spend at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DnsLimits {
    /// Forwarded queries in flight, over every listener and both protocols.
    pub max_forwards: usize,
    /// TCP connections served at once, per listener (more wait in the backlog).
    pub max_tcp_connections: usize,
    /// A TCP connection with no query for this long is closed.
    pub tcp_idle: Duration,
    /// A TCP query (or its reply) that takes longer than this to cross ends the
    /// connection.
    pub tcp_io: Duration,
}

impl Default for DnsLimits {
    fn default() -> Self {
        Self {
            max_forwards: 256,
            max_tcp_connections: 128,
            tcp_idle: Duration::from_secs(8),
            tcp_io: Duration::from_secs(2),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DnsConfigError {
    #[error("DNS_PROXY_ADDR {0:?} must be host:port (e.g. localhost:15053)")]
    Address(String),
}

/// What resolv.conf says: nameservers (port 53) and search domains.
pub fn parse_resolv_conf(text: &str) -> (Vec<SocketAddr>, Vec<String>) {
    let mut servers = Vec::new();
    let mut search = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => {
                if let Some(ip) = words.next().and_then(|w| w.parse::<std::net::IpAddr>().ok()) {
                    servers.push(SocketAddr::new(ip, 53));
                }
            }
            Some("search") | Some("domain") => search = words.map(String::from).collect(),
            _ => {}
        }
    }
    (servers, search)
}

impl DnsConfig {
    /// Istio's rules: `localhost:<port>` listens on 127.0.0.1 and/or ::1 depending on
    /// the families of the resolv.conf servers; a `:53` address is honoured only for
    /// root (else the default) and then answers before the first table.
    pub fn resolve(
        address: &str,
        namespace: &str,
        domain: &str,
        resolv_conf: &str,
        is_root: bool,
    ) -> Result<Self, DnsConfigError> {
        let (upstreams, search) = parse_resolv_conf(resolv_conf);
        let mut address = if address.is_empty() { DEFAULT_ADDRESS } else { address };
        let mut respond_before_sync = false;
        if address.ends_with(":53") {
            if is_root {
                respond_before_sync = true;
            } else {
                tracing::error!(address, "DNS address :53 and not running as root, using the default");
                address = DEFAULT_ADDRESS;
            }
        }
        let bad = || DnsConfigError::Address(address.to_string());
        let (host, port) = address.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let listen = if host == "localhost" {
            let mut out = Vec::new();
            if upstreams.iter().any(SocketAddr::is_ipv4) || upstreams.is_empty() {
                out.push(SocketAddr::from(([127, 0, 0, 1], port)));
            }
            if upstreams.iter().any(SocketAddr::is_ipv6) {
                out.push(SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)));
            }
            out
        } else {
            vec![SocketAddr::new(host.parse().map_err(|_| bad())?, port)]
        };
        Ok(Self {
            listen,
            scope: ProxyScope { namespace: namespace.into(), domain: domain.into(), search },
            upstreams,
            upstream_timeout: UPSTREAM_TIMEOUT,
            forward_parallel: false,
            respond_before_sync,
            limits: DnsLimits::default(),
        })
    }
}

/// The proxy's state: the current table (none until the first NDS push), config, and
/// what bounds the forwarding.
pub struct DnsProxy {
    config: DnsConfig,
    table: RwLock<Option<Arc<LookupTable>>>,
    name_table: RwLock<Option<Arc<NameTable>>>,
    metrics: Arc<Metrics>,
    forwards: Arc<Semaphore>,
    /// UDP queries dropped because `max_forwards` were in flight.
    dropped: std::sync::atomic::AtomicU64,
    buffers: Arc<Buffers>,
}

/// What to do with one query.
enum Handling {
    /// The reply, made locally.
    Reply(Vec<u8>),
    /// Ask the upstream servers; the reply must fit `limit`.
    Forward { request: Message, limit: usize },
    /// Garbage: no reply.
    Drop,
}

impl DnsProxy {
    pub fn new(config: DnsConfig, metrics: Arc<Metrics>) -> Arc<Self> {
        let forwards = Arc::new(Semaphore::new(config.limits.max_forwards));
        Arc::new(Self {
            config,
            table: RwLock::new(None),
            name_table: RwLock::new(None),
            metrics,
            forwards,
            dropped: Default::default(),
            buffers: Arc::default(),
        })
    }

    /// Installs a new NDS table.
    pub fn update(&self, table: NameTable) {
        let built = LookupTable::build(&table, &self.config.scope);
        tracing::debug!(hosts = built.len(), "DNS lookup table updated");
        *self.table.write().expect("table lock") = Some(Arc::new(built));
        *self.name_table.write().expect("table lock") = Some(Arc::new(table));
    }

    /// The relay's handler for NDS responses: decodes the `NameTable` and installs it;
    /// a table that does not decode is NACKed with the decode error. Decoding and
    /// building a table of tens of thousands of services takes long enough to stall
    /// the agent's one thread, so both run on the blocking pool.
    pub fn nds_handler(self: &Arc<Self>) -> crate::xds::Handler {
        let me = self.clone();
        Arc::new(move |resource| {
            let me = me.clone();
            Box::pin(async move {
                if resource.type_url != weir_proto::type_url::NAME_TABLE {
                    return Err(format!(
                        "expected a {} resource, got {}",
                        weir_proto::type_url::NAME_TABLE,
                        resource.type_url
                    ));
                }
                tokio::task::spawn_blocking(move || {
                    let table = <NameTable as prost::Message>::decode(resource.value.as_slice())
                        .map_err(|e| format!("NameTable does not decode: {e}"))?;
                    me.update(table);
                    Ok(())
                })
                .await
                .map_err(|e| format!("installing the NameTable failed: {e}"))?
            })
        })
    }

    /// True once a table has arrived (readiness when DNS capture is on).
    pub fn is_ready(&self) -> bool {
        self.table.read().expect("table lock").is_some()
    }

    /// The last NDS table (for /debug/ndsz).
    pub fn name_table(&self) -> Option<Arc<NameTable>> {
        self.name_table.read().expect("table lock").clone()
    }

    /// Binds UDP and TCP on every listen address (all or nothing) and returns the
    /// task serving them until dropped/aborted.
    pub async fn bind(self: &Arc<Self>) -> Result<tokio::task::JoinSet<std::io::Result<()>>, DnsBindError> {
        let mut sockets = Vec::new();
        for address in &self.config.listen {
            let udp = UdpSocket::bind(address).await.map_err(|source| DnsBindError {
                address: *address,
                protocol: "udp",
                source,
            })?;
            let tcp = TcpListener::bind(address).await.map_err(|source| DnsBindError {
                address: *address,
                protocol: "tcp",
                source,
            })?;
            sockets.push((udp, tcp));
        }
        tracing::info!(addresses = ?self.config.listen, upstreams = ?self.config.upstreams, search = ?self.config.scope.search, "DNS proxy listening");
        let mut tasks = tokio::task::JoinSet::new();
        for (udp, tcp) in sockets {
            tasks.spawn(self.clone().serve_on(udp, tcp));
        }
        Ok(tasks)
    }

    /// Serves UDP on `udp` and TCP on `tcp` until either socket breaks (the error is
    /// returned) or the task is dropped.
    pub async fn serve_on(self: Arc<Self>, udp: UdpSocket, tcp: TcpListener) -> std::io::Result<()> {
        let mut udp = tokio::spawn(self.clone().serve_udp(Arc::new(udp)));
        let ended = tokio::select! {
            ended = self.serve_tcp(tcp) => ended,
            ended = &mut udp => ended.unwrap_or_else(|e| Err(std::io::Error::other(e))),
        };
        udp.abort();
        ended
    }

    async fn serve_udp(self: Arc<Self>, udp: Arc<UdpSocket>) -> std::io::Result<()> {
        use crate::accept::Failure;
        // One receive buffer for the socket's life: a datagram is handled (answered,
        // or copied into its forward) before the next is read.
        let mut buf = vec![0u8; MAX_TCP];
        let mut pause = crate::accept::FIRST_PAUSE;
        loop {
            let (n, from) = match udp.recv_from(&mut buf).await {
                Ok(received) => received,
                Err(e) => match Failure::of(&e) {
                    Failure::Broken => return Err(e),
                    Failure::Connection => continue,
                    Failure::Exhausted => {
                        tracing::warn!(error = %e, "DNS proxy cannot receive: retrying");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(crate::accept::MAX_PAUSE);
                        continue;
                    }
                },
            };
            pause = crate::accept::FIRST_PAUSE;
            let query = &buf[..n];
            match self.handle(query, false) {
                Handling::Reply(reply) => {
                    let _ = udp.send_to(&reply, from).await;
                }
                Handling::Drop => {}
                Handling::Forward { request, limit } => {
                    let Ok(permit) = self.forwards.clone().try_acquire_owned() else {
                        let dropped = self.dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if dropped.is_multiple_of(1000) {
                            tracing::warn!(
                                in_flight = self.config.limits.max_forwards,
                                dropped = dropped + 1,
                                "DNS proxy busy: dropping UDP queries it would forward"
                            );
                        }
                        continue;
                    };
                    let (me, udp, raw) = (self.clone(), udp.clone(), query.to_vec());
                    tokio::spawn(async move {
                        let reply = encode_within(me.forward(&request, &raw, false).await, limit);
                        drop(permit);
                        if let Some(reply) = reply {
                            let _ = udp.send_to(&reply, from).await;
                        }
                    });
                }
            }
        }
    }

    async fn serve_tcp(self: &Arc<Self>, tcp: TcpListener) -> std::io::Result<()> {
        let connections = Arc::new(Semaphore::new(self.config.limits.max_tcp_connections));
        loop {
            let permit = connections.clone().acquire_owned().await.expect("the semaphore is never closed");
            let (stream, _) = crate::accept::next("DNS proxy (TCP)", || tcp.accept()).await?;
            let me = self.clone();
            tokio::spawn(async move {
                me.serve_tcp_connection(stream).await;
                drop(permit);
            });
        }
    }

    /// Queries and replies on one connection (or any byte stream) until the client
    /// closes it, stays idle for `tcp_idle`, or is slower than `tcp_io` with a query or
    /// a reply. Needs a runtime with time enabled.
    pub async fn serve_tcp_connection<S: AsyncRead + AsyncWrite + Unpin>(&self, mut stream: S) {
        let DnsLimits { tcp_idle, tcp_io, .. } = self.config.limits;
        let mut query = Vec::new();
        loop {
            let mut len = [0u8; 2];
            match tokio::time::timeout(tcp_idle, stream.read_exact(&mut len)).await {
                Ok(Ok(_)) => {}
                Ok(Err(_)) => return,
                Err(_) => {
                    tracing::debug!(idle = ?tcp_idle, "closing an idle DNS TCP connection");
                    return;
                }
            }
            query.resize(usize::from(u16::from_be_bytes(len)), 0);
            if !matches!(tokio::time::timeout(tcp_io, stream.read_exact(&mut query)).await, Ok(Ok(_))) {
                return;
            }
            let reply = match self.handle(&query, true) {
                Handling::Reply(reply) => reply,
                Handling::Drop => return,
                Handling::Forward { request, limit } => {
                    let Ok(_permit) = self.forwards.acquire().await else { return };
                    match encode_within(self.forward(&request, &query, true).await, limit) {
                        Some(reply) => reply,
                        None => return,
                    }
                }
            };
            let Ok(len) = u16::try_from(reply.len()) else { return };
            let write = async {
                stream.write_all(&len.to_be_bytes()).await?;
                stream.write_all(&reply).await
            };
            if !matches!(tokio::time::timeout(tcp_io, write).await, Ok(Ok(()))) {
                return;
            }
        }
    }

    /// The reply bytes for one query (`None` for garbage that does not parse),
    /// forwarding within the proxy's bound when the table does not answer.
    pub async fn answer(&self, query: &[u8], tcp: bool) -> Option<Vec<u8>> {
        match self.handle(query, tcp) {
            Handling::Reply(reply) => Some(reply),
            Handling::Drop => None,
            Handling::Forward { request, limit } => {
                let _permit = self.forwards.acquire().await.ok()?;
                encode_within(self.forward(&request, query, tcp).await, limit)
            }
        }
    }

    /// What the table says about one query, without waiting for anything.
    fn handle(&self, query: &[u8], tcp: bool) -> Handling {
        self.metrics.dns_requests.inc();
        let request = match Message::from_vec(query) {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "dropping a DNS message that does not parse");
                return Handling::Drop;
            }
        };
        let limit = if tcp {
            MAX_TCP
        } else {
            request.edns.as_ref().map(|e| usize::from(e.max_payload())).unwrap_or(MIN_UDP).max(MIN_UDP)
        };
        let encoded = |m: Message| m.to_vec().map_or(Handling::Drop, Handling::Reply);
        let Some(question) = request.queries.first() else {
            return encoded(reply(&request, ResponseCode::ServFail, false, vec![]));
        };
        let name = question.name().to_ascii().to_ascii_lowercase();
        let qtype = question.query_type();
        let table = self.table.read().expect("table lock").clone();
        let Some(table) = table else {
            if self.config.respond_before_sync {
                return Handling::Forward { request, limit };
            }
            tracing::debug!(name, "DNS request before the lookup table arrived");
            return encoded(reply(&request, ResponseCode::ServFail, false, vec![]));
        };
        match table.lookup(qtype, &name) {
            Some(mut answers) => {
                shuffle_addresses(&mut answers);
                encode_within(reply(&request, ResponseCode::NoError, true, answers), limit)
                    .map_or(Handling::Drop, Handling::Reply)
            }
            None => Handling::Forward { request, limit },
        }
    }

    async fn forward(&self, request: &Message, raw: &[u8], tcp: bool) -> Message {
        self.metrics.dns_upstream_requests.inc();
        let started = Instant::now();
        let answer = if self.config.forward_parallel {
            let mut all = tokio::task::JoinSet::new();
            let raw: Arc<[u8]> = raw.into();
            for server in self.config.upstreams.clone() {
                let (raw, timeout, id) = (raw.clone(), self.config.upstream_timeout, request.metadata.id);
                let mut buf = self.buffers.take();
                all.spawn(async move { ask(server, &raw, tcp, timeout, id, &mut buf).await });
            }
            let mut first = None;
            while let Some(result) = all.join_next().await {
                if let Ok(Some(m)) = result {
                    first = Some(m);
                    break;
                }
            }
            first
        } else {
            let mut first = None;
            let mut buf = self.buffers.take();
            for server in &self.config.upstreams {
                if let Some(m) =
                    ask(*server, raw, tcp, self.config.upstream_timeout, request.metadata.id, &mut buf).await
                {
                    first = Some(m);
                    break;
                }
            }
            first
        };
        match answer {
            Some(m) => {
                self.metrics.dns_upstream_request_duration.observe(started.elapsed().as_secs_f64());
                m
            }
            None => {
                self.metrics.dns_upstream_failures.inc();
                reply(request, ResponseCode::ServFail, false, vec![])
            }
        }
    }
}

/// A DNS listener that could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("DNS proxy cannot listen on {protocol} {address}")]
pub struct DnsBindError {
    pub address: SocketAddr,
    pub protocol: &'static str,
    #[source]
    pub source: std::io::Error,
}

/// A reply to `request` carrying `answers`.
fn reply(
    request: &Message,
    code: ResponseCode,
    authoritative: bool,
    answers: Vec<hickory_proto::rr::Record>,
) -> Message {
    let mut m = Message::new(request.metadata.id, MessageType::Response, OpCode::Query);
    m.metadata.recursion_desired = request.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.metadata.authoritative = authoritative;
    m.metadata.response_code = code;
    m.add_queries(request.queries.iter().cloned());
    m.add_answers(answers);
    if let Some(edns) = &request.edns {
        let mut e = Edns::new();
        e.set_max_payload(edns.max_payload().max(MIN_UDP as u16));
        m.set_edns(e);
    }
    m
}

/// Shuffles the A/AAAA records, keeping CNAMEs first (DNS load balancing for headless
/// services, as kube-dns and Istio do).
fn shuffle_addresses(answers: &mut Vec<hickory_proto::rr::Record>) {
    let (mut cnames, mut addrs): (Vec<_>, Vec<_>) =
        answers.drain(..).partition(|r| r.record_type() == RecordType::CNAME);
    addrs.shuffle(&mut rand::rng());
    cnames.extend(addrs);
    *answers = cnames;
}

/// Encodes `m`, dropping trailing records and setting TC until it fits in `limit`.
fn encode_within(mut m: Message, limit: usize) -> Option<Vec<u8>> {
    loop {
        let bytes = m.to_vec().ok()?;
        if bytes.len() <= limit {
            return Some(bytes);
        }
        m.metadata.truncation = true;
        if m.additionals.pop().is_none() && m.authorities.pop().is_none() && m.answers.pop().is_none() {
            return Some(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use hickory_proto::{
        op::Query,
        rr::{Name, RData},
    };
    use tokio::net::TcpStream;
    use weir_proto::istio::networking::nds::v1::name_table::NameInfo;

    use super::*;

    fn query(name: &str, qtype: RecordType, edns: Option<u16>) -> Vec<u8> {
        let mut m = Message::new(0x4242, MessageType::Query, OpCode::Query);
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
        if let Some(size) = edns {
            let mut e = Edns::new();
            e.set_max_payload(size);
            m.set_edns(e);
        }
        m.to_vec().unwrap()
    }

    fn proxy(upstreams: Vec<SocketAddr>) -> Arc<DnsProxy> {
        let config = DnsConfig {
            listen: vec!["127.0.0.1:0".parse().unwrap()],
            forward_parallel: false,
            respond_before_sync: false,
            scope: ProxyScope {
                namespace: "app".into(),
                domain: "app.svc.cluster.local".into(),
                search: vec![],
            },
            upstreams,
            upstream_timeout: Duration::from_millis(200),
            limits: DnsLimits::default(),
        };
        DnsProxy::new(config, Arc::new(Metrics::new()))
    }

    /// `proxy` with `config` changed, serving on 127.0.0.1 (UDP and TCP, one port).
    async fn serving(
        upstreams: Vec<SocketAddr>,
        change: impl FnOnce(&mut DnsConfig),
    ) -> (Arc<DnsProxy>, SocketAddr) {
        let mut config = proxy(upstreams).config.clone();
        change(&mut config);
        let p = DnsProxy::new(config, Arc::new(Metrics::new()));
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let udp = UdpSocket::bind(addr).await.unwrap();
        tokio::spawn(p.clone().serve_on(udp, tcp));
        (p, addr)
    }

    /// One status line of this process: `VmRSS` in KiB, say.
    fn self_status_kib(field: &str) -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find_map(|l| l.strip_prefix(field)).unwrap();
        line.trim().trim_end_matches("kB").trim().parse().unwrap()
    }

    fn open_fds() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    }

    /// Any app in the pod can flood 15053. Under a flood of queries the proxy must
    /// forward (to an upstream that never answers, the worst case), its memory and
    /// sockets stay bounded, and a name from the table is still answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_udp_flood_leaves_memory_bounded_and_real_queries_answered() {
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let (p, addr) = serving(vec![silent.local_addr().unwrap()], |c| {
            c.upstream_timeout = Duration::from_secs(3);
        })
        .await;
        p.update(table(3));
        let (rss_before, fds_before) = (self_status_kib("VmRSS:"), open_fds());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let floods: Vec<_> = (0..2u16)
            .map(|t| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
                    let mut sent = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let name = format!("n{t}x{sent}.flood.example.");
                        let _ = socket.send_to(&query(&name, RecordType::A, None), addr);
                        sent += 1;
                    }
                    sent
                })
            })
            .collect();
        // Sample while the flood runs: the peak is what a pod's memory limit meets.
        let (mut rss_peak, mut fds_peak) = (rss_before, fds_before);
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let mut answered = 0;
        let flood_for = Instant::now() + Duration::from_secs(2);
        while Instant::now() < flood_for {
            // A resolver's retries: up to 10 tries, 100 ms apart.
            for _ in 0..10 {
                client.send_to(&query("big.app.", RecordType::A, None), addr).await.unwrap();
                let mut buf = [0u8; 512];
                let got = tokio::time::timeout(Duration::from_millis(100), client.recv(&mut buf)).await;
                if let Ok(Ok(n)) = got {
                    let m = Message::from_vec(&buf[..n]).unwrap();
                    if m.metadata.response_code == ResponseCode::NoError && m.answers.len() == 3 {
                        answered += 1;
                        break;
                    }
                }
            }
            rss_peak = rss_peak.max(self_status_kib("VmRSS:"));
            fds_peak = fds_peak.max(open_fds());
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let sent: u64 = floods.into_iter().map(|f| f.join().unwrap()).sum();
        let dropped = p.dropped.load(std::sync::atomic::Ordering::Relaxed);
        assert!(dropped > 0, "the flood ({sent} queries) never reached the bound");
        assert!(answered >= 5, "{answered} table answers during the flood of {sent} queries");
        let limit = p.config.limits.max_forwards;
        assert!(
            fds_peak <= fds_before + limit + 16,
            "{fds_peak} descriptors open under the flood (from {fds_before}; {limit} forwards allowed)"
        );
        let grown = rss_peak.saturating_sub(rss_before);
        assert!(grown < 32 * 1024, "RSS grew by {grown} KiB under a flood of {sent} queries");
    }

    #[tokio::test]
    async fn an_idle_tcp_connection_is_closed() {
        let (_p, addr) = serving(vec![], |c| c.limits.tcp_idle = Duration::from_millis(200)).await;
        let mut conn = TcpStream::connect(addr).await.unwrap();
        // A query answered, then silence: the connection is closed, not kept forever.
        let q = query("big.app.", RecordType::A, None);
        conn.write_all(&(q.len() as u16).to_be_bytes()).await.unwrap();
        conn.write_all(&q).await.unwrap();
        let mut len = [0u8; 2];
        conn.read_exact(&mut len).await.unwrap();
        let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
        conn.read_exact(&mut reply).await.unwrap();
        assert_eq!(Message::from_vec(&reply).unwrap().metadata.id, 0x4242);
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(3), conn.read_to_end(&mut rest)).await;
        assert!(matches!(closed, Ok(Ok(0))), "the idle connection is still open: {closed:?}");
    }

    /// A client that sends a length and then stalls holds the connection no longer
    /// than the read bound.
    #[tokio::test]
    async fn a_stalled_tcp_query_ends_the_connection() {
        let (_p, addr) = serving(vec![], |c| c.limits.tcp_io = Duration::from_millis(200)).await;
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(&[0, 40, 1, 2]).await.unwrap();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(3), conn.read_to_end(&mut rest)).await;
        assert!(matches!(closed, Ok(Ok(0))), "{closed:?}");
    }

    fn table(n: usize) -> NameTable {
        let mut nt = NameTable::default();
        nt.table.insert(
            "big.app.svc.cluster.local".into(),
            NameInfo {
                ips: (0..n).map(|i| format!("10.1.{}.{}", i / 250, i % 250 + 1)).collect(),
                registry: "Kubernetes".into(),
                shortname: "big".into(),
                namespace: "app".into(),
                ..Default::default()
            },
        );
        nt
    }

    #[tokio::test]
    async fn servfail_before_the_table_then_local_answers() {
        let p = proxy(vec![]);
        let r = Message::from_vec(&p.answer(&query("big.app.", RecordType::A, None), false).await.unwrap())
            .unwrap();
        assert_eq!(r.metadata.response_code, ResponseCode::ServFail);
        p.update(table(3));
        assert!(p.is_ready());
        let r = Message::from_vec(&p.answer(&query("big.app.", RecordType::A, None), false).await.unwrap())
            .unwrap();
        assert_eq!(r.metadata.response_code, ResponseCode::NoError);
        assert!(r.metadata.authoritative);
        assert_eq!(r.metadata.id, 0x4242);
        assert_eq!(r.answers.len(), 3);
        assert!(r.answers.iter().all(|a| a.ttl == 30 && matches!(a.data, RData::A(_))));
    }

    /// The agent runs on one thread: installing an NDS table must let the queries (and
    /// the relay, SDS, probes) waiting on that thread run while the table is decoded
    /// and built, instead of after it.
    #[tokio::test(flavor = "current_thread")]
    async fn an_nds_table_is_installed_off_the_agents_thread() {
        let p = proxy(vec![]);
        let mut nt = NameTable::default();
        for i in 0..20_000 {
            let info = NameInfo {
                ips: vec![format!("10.{}.{}.1", i / 250, i % 250)],
                registry: "Kubernetes".into(),
                shortname: format!("s{i}"),
                namespace: "app".into(),
                ..Default::default()
            };
            nt.table.insert(format!("s{i}.app.svc.cluster.local"), info);
        }
        let resource = prost_types::Any {
            type_url: weir_proto::type_url::NAME_TABLE.into(),
            value: prost::Message::encode_to_vec(&nt),
        };
        // Ready before the push arrives; it can run only when the handler yields.
        let query_task = {
            let p = p.clone();
            tokio::spawn(async move { p.answer(&query("s7.app.", RecordType::A, None), false).await })
        };
        p.nds_handler()(resource).await.unwrap();
        assert!(query_task.is_finished(), "a query waited for the whole table to be built");
        let r =
            Message::from_vec(&p.answer(&query("s19999.app.", RecordType::A, None), false).await.unwrap())
                .unwrap();
        assert_eq!(r.metadata.response_code, ResponseCode::NoError);
        assert_eq!(r.answers.len(), 1);
        assert_eq!(p.name_table().unwrap().table.len(), 20_000);
        let wrong = prost_types::Any { type_url: "type.googleapis.com/other".into(), value: vec![] };
        assert!(p.nds_handler()(wrong).await.unwrap_err().contains("expected a"));
        let garbage =
            prost_types::Any { type_url: weir_proto::type_url::NAME_TABLE.into(), value: vec![0xff; 3] };
        assert!(p.nds_handler()(garbage).await.unwrap_err().contains("NameTable does not decode"));
    }

    #[tokio::test]
    async fn udp_replies_fit_the_clients_size() {
        let p = proxy(vec![]);
        p.update(table(100));
        let small = p.answer(&query("big.app.", RecordType::A, None), false).await.unwrap();
        assert!(small.len() <= 512);
        let r = Message::from_vec(&small).unwrap();
        assert!(r.metadata.truncation && r.answers.len() < 100);
        let big = p.answer(&query("big.app.", RecordType::A, Some(4096)), false).await.unwrap();
        assert_eq!(Message::from_vec(&big).unwrap().answers.len(), 100);
        let tcp = p.answer(&query("big.app.", RecordType::A, None), true).await.unwrap();
        assert_eq!(Message::from_vec(&tcp).unwrap().answers.len(), 100);
    }

    #[tokio::test]
    async fn unknown_names_fail_over_to_servfail_when_no_upstream_answers() {
        // A bound but silent UDP socket: the upstream times out.
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let p = proxy(vec![silent.local_addr().unwrap()]);
        p.update(table(1));
        let r = Message::from_vec(
            &p.answer(&query("www.example.org.", RecordType::A, None), false).await.unwrap(),
        )
        .unwrap();
        assert_eq!(r.metadata.response_code, ResponseCode::ServFail);
        assert!(p.metrics.encode().contains("istio_agent_dns_upstream_failures_total 1"));
    }

    #[tokio::test]
    async fn garbage_is_dropped_not_answered() {
        let p = proxy(vec![]);
        assert!(p.answer(b"\x01\x02garbage", false).await.is_none());
    }

    #[test]
    fn listen_addresses_follow_istio() {
        let rc = "nameserver 10.96.0.10\nnameserver fd00::10\nsearch app.svc.cluster.local svc.cluster.local\noptions ndots:5\n";
        let c = DnsConfig::resolve("localhost:15053", "app", "app.svc.cluster.local", rc, false).unwrap();
        assert_eq!(c.listen, vec!["127.0.0.1:15053".parse().unwrap(), "[::1]:15053".parse().unwrap()]);
        assert_eq!(c.upstreams, vec!["10.96.0.10:53".parse().unwrap(), "[fd00::10]:53".parse().unwrap()]);
        assert_eq!(c.scope.search.len(), 2);
        let v4 = DnsConfig::resolve("", "app", "", "nameserver 10.96.0.10\n", false).unwrap();
        assert_eq!(v4.listen, vec!["127.0.0.1:15053".parse().unwrap()]);
        // :53 only for root.
        let c = DnsConfig::resolve("127.0.0.1:53", "app", "", rc, false).unwrap();
        assert_eq!(c.listen[0].port(), 15053);
        assert!(!c.respond_before_sync);
        let c = DnsConfig::resolve("127.0.0.1:53", "app", "", rc, true).unwrap();
        assert_eq!(c.listen, vec!["127.0.0.1:53".parse().unwrap()]);
        assert!(c.respond_before_sync);
        assert_eq!(
            DnsConfig::resolve("15053", "app", "", rc, false).unwrap_err(),
            DnsConfigError::Address("15053".into())
        );
        assert!(DnsConfig::resolve("dns.local:15053", "app", "", rc, false).is_err());
    }
}
