//! The DNS proxy against real sockets on loopback: local answers from NDS tables,
//! installs off the agent's thread and in push order, sizes, floods, stalls and garbage.
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
        scope: ProxyScope { namespace: "app".into(), domain: "app.svc.cluster.local".into(), search: vec![] },
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
    let r =
        Message::from_vec(&p.answer(&query("big.app.", RecordType::A, None), false).await.unwrap()).unwrap();
    assert_eq!(r.metadata.response_code, ResponseCode::ServFail);
    p.update(table(3));
    assert!(p.is_ready());
    let r =
        Message::from_vec(&p.answer(&query("big.app.", RecordType::A, None), false).await.unwrap()).unwrap();
    assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    assert!(r.metadata.authoritative);
    assert_eq!(r.metadata.id, 0x4242);
    assert_eq!(r.answers.len(), 3);
    assert!(r.answers.iter().all(|a| a.ttl == 30 && matches!(a.data, RData::A(_))));
}

/// An NDS push of `n` services `<prefix><i>` in namespace `app`, one address each.
fn nds_push(n: usize, prefix: &str) -> prost_types::Any {
    let mut nt = NameTable::default();
    for i in 0..n {
        let info = NameInfo {
            ips: vec![format!("10.{}.{}.1", i / 250, i % 250)],
            registry: "Kubernetes".into(),
            shortname: format!("{prefix}{i}"),
            namespace: "app".into(),
            ..Default::default()
        };
        nt.table.insert(format!("{prefix}{i}.app.svc.cluster.local"), info);
    }
    prost_types::Any {
        type_url: weir_proto::type_url::NAME_TABLE.into(),
        value: prost::Message::encode_to_vec(&nt),
    }
}

/// The agent runs on one thread: installing an NDS table must let the queries (and
/// the relay, SDS, probes) waiting on that thread run while the table is decoded
/// and built, instead of after it.
#[tokio::test(flavor = "current_thread")]
async fn an_nds_table_is_installed_off_the_agents_thread() {
    let p = proxy(vec![]);
    let resource = nds_push(20_000, "s");
    // Ready before the push arrives; it can run only when the handler yields.
    let query_task = {
        let p = p.clone();
        tokio::spawn(async move { p.answer(&query("s7.app.", RecordType::A, None), false).await })
    };
    p.nds_handler()(resource).await.unwrap();
    assert!(query_task.is_finished(), "a query waited for the whole table to be built");
    let r = Message::from_vec(&p.answer(&query("s19999.app.", RecordType::A, None), false).await.unwrap())
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

/// A push whose install outlives its stream (a reconnect while a big table is
/// built) must not replace the newer stream's table, in the lookup or in ndsz.
#[tokio::test(flavor = "current_thread")]
async fn an_older_push_built_last_does_not_replace_a_newer_one() {
    let p = proxy(vec![]);
    let handler = p.nds_handler();
    let mut older = handler(nds_push(20_000, "old"));
    let newer = handler(nds_push(2, "new"));
    // The older push's build starts first and runs on while the newer one is installed.
    assert!(futures::poll!(&mut older).is_pending());
    newer.await.unwrap();
    older.await.unwrap();
    let answer = |name: &str| {
        let p = p.clone();
        let q = query(name, RecordType::A, None);
        async move { Message::from_vec(&p.answer(&q, false).await.unwrap()).unwrap().answers.len() }
    };
    assert_eq!(answer("new1.app.").await, 1);
    assert_eq!(answer("old1.app.").await, 0, "the older table replaced the newer one");
    assert_eq!(p.name_table().unwrap().table.len(), 2);
    // Installed directly, the same rule: push 1 after push 3 is refused.
    assert!(!p.install(1, NameTable::default()));
    assert_eq!(p.name_table().unwrap().table.len(), 2);
    p.update(NameTable::default());
    assert!(p.name_table().unwrap().table.is_empty());
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
    let r =
        Message::from_vec(&p.answer(&query("www.example.org.", RecordType::A, None), false).await.unwrap())
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
