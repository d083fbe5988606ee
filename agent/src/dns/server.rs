//! The DNS proxy's servers: UDP and TCP on one address (127.0.0.1:15053 by default).
//! Known names come from the lookup table (authoritative, TTL 30, addresses shuffled);
//! the rest is forwarded as-is to the resolv.conf servers, in shuffled order, each with
//! a timeout, SERVFAIL when all fail. Replies are trimmed to the client's UDP size.

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
    net::{TcpListener, TcpStream, UdpSocket},
};
use weir_proto::istio::networking::nds::v1::NameTable;

use super::table::{LookupTable, ProxyScope};
use crate::metrics::Metrics;

/// Istio's default upstream timeout.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);
const MIN_UDP: usize = 512;
const MAX_TCP: usize = 65535;

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
        })
    }
}

/// The proxy's state: the current table (none until the first NDS push) and config.
pub struct DnsProxy {
    config: DnsConfig,
    table: RwLock<Option<Arc<LookupTable>>>,
    name_table: RwLock<Option<NameTable>>,
    metrics: Arc<Metrics>,
}

impl DnsProxy {
    pub fn new(config: DnsConfig, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self { config, table: RwLock::new(None), name_table: RwLock::new(None), metrics })
    }

    /// Installs a new NDS table.
    pub fn update(&self, table: &NameTable) {
        let built = LookupTable::build(table, &self.config.scope);
        tracing::debug!(hosts = built.len(), "DNS lookup table updated");
        *self.table.write().expect("table lock") = Some(Arc::new(built));
        *self.name_table.write().expect("table lock") = Some(table.clone());
    }

    /// The relay's handler for NDS responses: decodes the `NameTable` and installs it;
    /// a table that does not decode is NACKed with the decode error.
    pub fn nds_handler(self: &Arc<Self>) -> crate::xds::Handler {
        let me = self.clone();
        Arc::new(move |resource| {
            if resource.type_url != weir_proto::type_url::NAME_TABLE {
                return Err(format!(
                    "expected a {} resource, got {}",
                    weir_proto::type_url::NAME_TABLE,
                    resource.type_url
                ));
            }
            let table = <NameTable as prost::Message>::decode(resource.value.as_slice())
                .map_err(|e| format!("NameTable does not decode: {e}"))?;
            me.update(&table);
            Ok(())
        })
    }

    /// True once a table has arrived (readiness when DNS capture is on).
    pub fn is_ready(&self) -> bool {
        self.table.read().expect("table lock").is_some()
    }

    /// The last NDS table (for /debug/ndsz).
    pub fn name_table(&self) -> Option<NameTable> {
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

    pub async fn serve_on(self: Arc<Self>, udp: UdpSocket, tcp: TcpListener) -> std::io::Result<()> {
        let udp = Arc::new(udp);
        let me = self.clone();
        let udp_task = tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_TCP];
            loop {
                let Ok((n, from)) = udp.recv_from(&mut buf).await else { continue };
                let query = buf[..n].to_vec();
                let (me, udp) = (me.clone(), udp.clone());
                tokio::spawn(async move {
                    if let Some(reply) = me.answer(&query, false).await {
                        let _ = udp.send_to(&reply, from).await;
                    }
                });
            }
        });
        loop {
            let (stream, _) = match tcp.accept().await {
                Ok(c) => c,
                Err(e) => {
                    udp_task.abort();
                    return Err(e);
                }
            };
            let me = self.clone();
            tokio::spawn(async move { me.serve_tcp_connection(stream).await });
        }
    }

    /// Serves one TCP connection (or any byte stream): 2-byte length-prefixed queries
    /// in, length-prefixed replies out, until the peer closes or sends a short frame.
    pub async fn serve_tcp_connection<S: AsyncRead + AsyncWrite + Unpin>(&self, mut stream: S) {
        loop {
            let mut len = [0u8; 2];
            if stream.read_exact(&mut len).await.is_err() {
                return;
            }
            let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
            if stream.read_exact(&mut query).await.is_err() {
                return;
            }
            let Some(reply) = self.answer(&query, true).await else { return };
            let mut out = (reply.len() as u16).to_be_bytes().to_vec();
            out.extend_from_slice(&reply);
            if stream.write_all(&out).await.is_err() {
                return;
            }
        }
    }

    /// The reply bytes for one query (`None` for garbage that does not parse).
    pub async fn answer(&self, query: &[u8], tcp: bool) -> Option<Vec<u8>> {
        self.metrics.dns_requests.inc();
        let request = match Message::from_vec(query) {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "dropping a DNS message that does not parse");
                return None;
            }
        };
        let limit = if tcp {
            MAX_TCP
        } else {
            request.edns.as_ref().map(|e| usize::from(e.max_payload())).unwrap_or(MIN_UDP).max(MIN_UDP)
        };
        let Some(question) = request.queries.first() else {
            return reply(&request, ResponseCode::ServFail, false, vec![]).to_vec().ok();
        };
        let name = question.name().to_ascii().to_ascii_lowercase();
        let qtype = question.query_type();
        let table = self.table.read().expect("table lock").clone();
        let Some(table) = table else {
            if self.config.respond_before_sync {
                return encode_within(self.forward(&request, query, tcp).await, limit);
            }
            tracing::debug!(name, "DNS request before the lookup table arrived");
            return reply(&request, ResponseCode::ServFail, false, vec![]).to_vec().ok();
        };
        let response = match table.lookup(qtype, &name) {
            Some(mut answers) => {
                shuffle_addresses(&mut answers);
                reply(&request, ResponseCode::NoError, true, answers)
            }
            None => self.forward(&request, query, tcp).await,
        };
        encode_within(response, limit)
    }

    async fn forward(&self, request: &Message, raw: &[u8], tcp: bool) -> Message {
        self.metrics.dns_upstream_requests.inc();
        let started = Instant::now();
        let answer = if self.config.forward_parallel {
            let mut all = tokio::task::JoinSet::new();
            for server in self.config.upstreams.clone() {
                let (raw, timeout, id) = (raw.to_vec(), self.config.upstream_timeout, request.metadata.id);
                all.spawn(async move { ask(server, &raw, tcp, timeout, id).await });
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
            for server in &self.config.upstreams {
                if let Some(m) =
                    ask(*server, raw, tcp, self.config.upstream_timeout, request.metadata.id).await
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

/// One upstream exchange; `None` (logged) on failure, timeout or a mismatched reply.
async fn ask(server: SocketAddr, raw: &[u8], tcp: bool, timeout: Duration, id: u16) -> Option<Message> {
    match tokio::time::timeout(timeout, exchange(server, raw, tcp)).await {
        Ok(Ok(bytes)) => match Message::from_vec(&bytes) {
            Ok(m) if m.metadata.id == id => return Some(m),
            Ok(_) => tracing::info!(%server, "upstream DNS reply with a different id"),
            Err(e) => tracing::info!(%server, error = %e, "upstream DNS reply does not parse"),
        },
        Ok(Err(e)) => tracing::info!(%server, error = %e, "upstream failure"),
        Err(_) => tracing::info!(%server, "upstream DNS timeout"),
    }
    None
}

async fn exchange(server: SocketAddr, query: &[u8], tcp: bool) -> std::io::Result<Vec<u8>> {
    if tcp {
        let mut s = TcpStream::connect(server).await?;
        let mut out = (query.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(query);
        s.write_all(&out).await?;
        let mut len = [0u8; 2];
        s.read_exact(&mut len).await?;
        let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
        s.read_exact(&mut buf).await?;
        Ok(buf)
    } else {
        let bind: SocketAddr = if server.is_ipv4() {
            "0.0.0.0:0".parse().expect("addr")
        } else {
            "[::]:0".parse().expect("addr")
        };
        let s = UdpSocket::bind(bind).await?;
        s.connect(server).await?;
        s.send(query).await?;
        let mut buf = vec![0u8; MAX_TCP];
        let n = s.recv(&mut buf).await?;
        buf.truncate(n);
        Ok(buf)
    }
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
        };
        DnsProxy::new(config, Arc::new(Metrics::new()))
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
        p.update(&table(3));
        assert!(p.is_ready());
        let r = Message::from_vec(&p.answer(&query("big.app.", RecordType::A, None), false).await.unwrap())
            .unwrap();
        assert_eq!(r.metadata.response_code, ResponseCode::NoError);
        assert!(r.metadata.authoritative);
        assert_eq!(r.metadata.id, 0x4242);
        assert_eq!(r.answers.len(), 3);
        assert!(r.answers.iter().all(|a| a.ttl == 30 && matches!(a.data, RData::A(_))));
    }

    #[tokio::test]
    async fn udp_replies_fit_the_clients_size() {
        let p = proxy(vec![]);
        p.update(&table(100));
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
        p.update(&table(1));
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
