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
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream, UdpSocket},
};
use weir_proto::istio::networking::nds::v1::NameTable;

use super::table::{LookupTable, ProxyScope};
use crate::metrics::Metrics;

/// Istio's default upstream timeout.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);
const MIN_UDP: usize = 512;
const MAX_TCP: usize = 65535;

#[derive(Debug, Clone)]
pub struct DnsConfig {
    pub listen: SocketAddr,
    pub scope: ProxyScope,
    /// resolv.conf nameservers (port 53 unless given).
    pub upstreams: Vec<SocketAddr>,
    pub upstream_timeout: Duration,
}

impl DnsConfig {
    /// Reads nameservers and search domains from a resolv.conf text.
    pub fn from_resolv_conf(listen: SocketAddr, namespace: &str, domain: &str, resolv_conf: &str) -> Self {
        let mut upstreams = Vec::new();
        let mut search = Vec::new();
        for line in resolv_conf.lines() {
            let mut words = line.split_whitespace();
            match words.next() {
                Some("nameserver") => {
                    if let Some(ip) = words.next().and_then(|w| w.parse::<std::net::IpAddr>().ok()) {
                        upstreams.push(SocketAddr::new(ip, 53));
                    }
                }
                Some("search") | Some("domain") => search = words.map(String::from).collect(),
                _ => {}
            }
        }
        Self {
            listen,
            scope: ProxyScope { namespace: namespace.into(), domain: domain.into(), search },
            upstreams,
            upstream_timeout: UPSTREAM_TIMEOUT,
        }
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

    /// True once a table has arrived (readiness when DNS capture is on).
    pub fn is_ready(&self) -> bool {
        self.table.read().expect("table lock").is_some()
    }

    /// The last NDS table (for /debug/ndsz).
    pub fn name_table(&self) -> Option<NameTable> {
        self.name_table.read().expect("table lock").clone()
    }

    /// Binds UDP and TCP and serves until the task is dropped.
    pub async fn serve(self: Arc<Self>) -> std::io::Result<()> {
        let udp = UdpSocket::bind(self.config.listen).await?;
        let tcp = TcpListener::bind(self.config.listen).await?;
        tracing::info!(address = %self.config.listen, upstreams = ?self.config.upstreams, "DNS proxy listening");
        self.serve_on(udp, tcp).await
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

    async fn serve_tcp_connection(&self, mut stream: TcpStream) {
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
        let mut servers = self.config.upstreams.clone();
        servers.shuffle(&mut rand::rng());
        for server in servers {
            let result = tokio::time::timeout(self.config.upstream_timeout, exchange(server, raw, tcp)).await;
            match result {
                Ok(Ok(bytes)) => match Message::from_vec(&bytes) {
                    Ok(m) if m.metadata.id == request.metadata.id => {
                        self.metrics.dns_upstream_request_duration.observe(started.elapsed().as_secs_f64());
                        return m;
                    }
                    Ok(_) => tracing::info!(%server, "upstream DNS reply with a different id"),
                    Err(e) => tracing::info!(%server, error = %e, "upstream DNS reply does not parse"),
                },
                Ok(Err(e)) => tracing::info!(%server, error = %e, "upstream DNS failure"),
                Err(_) => tracing::info!(%server, "upstream DNS timeout"),
            }
        }
        self.metrics.dns_upstream_failures.inc();
        reply(request, ResponseCode::ServFail, false, vec![])
    }
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
            listen: "127.0.0.1:0".parse().unwrap(),
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
    fn resolv_conf_parsing() {
        let c = DnsConfig::from_resolv_conf(
            "127.0.0.1:15053".parse().unwrap(),
            "app",
            "app.svc.cluster.local",
            "nameserver 10.96.0.10\nsearch app.svc.cluster.local svc.cluster.local\noptions ndots:5\n",
        );
        assert_eq!(c.upstreams, vec!["10.96.0.10:53".parse().unwrap()]);
        assert_eq!(c.scope.search.len(), 2);
    }
}
