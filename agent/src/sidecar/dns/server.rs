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
use crate::sidecar::metrics::Metrics;

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
    /// The newest NDS push installed (none until the first).
    installed: RwLock<Option<Arc<Installed>>>,
    /// NDS pushes numbered as they arrive: a push built after a newer one (an older
    /// stream's, whose install outlived it) is not installed over it.
    pushes: std::sync::atomic::AtomicU64,
    /// Replaced installs that a query still held: freed by a later install, on the
    /// blocking pool, never by the query on the agent's thread.
    retired: std::sync::Mutex<Vec<Arc<Installed>>>,
    metrics: Arc<Metrics>,
    forwards: Arc<Semaphore>,
    /// UDP queries dropped because `max_forwards` were in flight.
    dropped: std::sync::atomic::AtomicU64,
    buffers: Arc<Buffers>,
}

/// One NDS push, installed: the table as istiod sent it (for /debug/ndsz) and the
/// lookup built from it, replaced together.
struct Installed {
    push: u64,
    lookup: LookupTable,
    names: Arc<NameTable>,
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
            installed: RwLock::new(None),
            pushes: Default::default(),
            retired: Default::default(),
            metrics,
            forwards,
            dropped: Default::default(),
            buffers: Arc::default(),
        })
    }

    /// Installs a new NDS table, as the newest push.
    pub fn update(&self, table: NameTable) {
        let push = self.next_push();
        self.install(push, table);
    }

    fn next_push(&self) -> u64 {
        self.pushes.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1
    }

    /// Installs push number `push` unless a newer push is already in (then the table
    /// is not even built); true if installed. The replaced install is retired, to be
    /// freed here or by a later install: never under the lock a query takes.
    fn install(&self, push: u64, table: NameTable) -> bool {
        let newer_in = |current: &Option<Arc<Installed>>| current.as_ref().is_some_and(|i| i.push > push);
        if newer_in(&self.installed.read().expect("table lock")) {
            return false;
        }
        let lookup = LookupTable::build(&table, &self.config.scope);
        let hosts = lookup.len();
        let new = Arc::new(Installed { push, lookup, names: Arc::new(table) });
        let replaced = {
            let mut current = self.installed.write().expect("table lock");
            if newer_in(&current) { Err(new) } else { Ok(current.replace(new)) }
        };
        let Ok(old) = replaced else {
            tracing::debug!(push, "NDS table not installed: a newer one is in");
            return false;
        };
        tracing::debug!(push, hosts, "DNS lookup table updated");
        let mut retired = self.retired.lock().expect("retired lock");
        retired.extend(old);
        // Nothing reaches a retired install but the queries that already held it.
        retired.retain(|i| Arc::strong_count(i) > 1);
        true
    }

    /// The relay's handler for NDS responses: decodes the `NameTable` and installs it;
    /// a table that does not decode is NACKed with the decode error. Decoding and
    /// building a table of tens of thousands of services takes long enough to stall
    /// the agent's one thread, so both run on the blocking pool. Each push is numbered
    /// when it arrives, so an install that outlives its stream never replaces a newer
    /// stream's.
    pub fn nds_handler(self: &Arc<Self>) -> crate::sidecar::xds::Handler {
        let me = self.clone();
        Arc::new(move |resource| {
            let me = me.clone();
            let push = me.next_push();
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
                    me.install(push, table);
                    Ok(())
                })
                .await
                .map_err(|e| format!("installing the NameTable failed: {e}"))?
            })
        })
    }

    /// True once a table has arrived (readiness when DNS capture is on).
    pub fn is_ready(&self) -> bool {
        self.installed.read().expect("table lock").is_some()
    }

    /// The last NDS table (for /debug/ndsz).
    pub fn name_table(&self) -> Option<Arc<NameTable>> {
        self.installed.read().expect("table lock").as_ref().map(|i| i.names.clone())
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
        use crate::support::accept::Failure;
        // One receive buffer for the socket's life: a datagram is handled (answered,
        // or copied into its forward) before the next is read.
        let mut buf = vec![0u8; MAX_TCP];
        let mut pause = crate::support::accept::FIRST_PAUSE;
        loop {
            let (n, from) = match udp.recv_from(&mut buf).await {
                Ok(received) => received,
                Err(e) => match Failure::of(&e) {
                    Failure::Broken => return Err(e),
                    Failure::Connection => continue,
                    Failure::Exhausted => {
                        tracing::warn!(error = %e, "DNS proxy cannot receive: retrying");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(crate::support::accept::MAX_PAUSE);
                        continue;
                    }
                },
            };
            pause = crate::support::accept::FIRST_PAUSE;
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
            let (stream, _) = crate::support::accept::next("DNS proxy (TCP)", || tcp.accept()).await?;
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
        let installed = self.installed.read().expect("table lock").clone();
        let Some(installed) = installed else {
            if self.config.respond_before_sync {
                return Handling::Forward { request, limit };
            }
            tracing::debug!(name, "DNS request before the lookup table arrived");
            return encoded(reply(&request, ResponseCode::ServFail, false, vec![]));
        };
        match installed.lookup.lookup(qtype, &name) {
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
mod tests;
