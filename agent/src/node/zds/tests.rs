//! ZDS against a fake ztunnel on real `SOCK_SEQPACKET` sockets with real netns fds:
//! every scenario of Istio's `cni/pkg/nodeagent/ztunnelserver_linux_test.go` (S1–S11,
//! named after Istio's test), the ones that follow from ztunnel's side (S12–S16), bad
//! input from a peer, and binding.

pub(crate) mod fake;

use std::{sync::Arc, time::Duration};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{
    ConnError, DecodeError, WorkloadInfo, ZdsConfig, ZdsError, ZdsHandle, ZdsServer, ZdsStatus,
    conn::{Conn, Ended},
    pods::{Netns, PodCache},
    registry::{Registry, Update},
    wire::Seqpacket,
};
use fake::{FakeZtunnel, PATIENCE, netns_id, own_netns};

fn info(name: &str) -> WorkloadInfo {
    WorkloadInfo { name: name.into(), namespace: "default".into(), service_account: format!("sa-{name}") }
}

/// A running server on a socket in a temp dir.
struct Server {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    zds: ZdsHandle,
    stop: CancellationToken,
    task: JoinHandle<Result<(), ZdsError>>,
}

/// The default config with this process's uid as ztunnel's (the tests' fake ztunnel
/// runs as whoever runs the tests).
fn own() -> ZdsConfig {
    ZdsConfig { peer_uids: vec![nix::unistd::geteuid().as_raw()], ..ZdsConfig::default() }
}

impl Server {
    fn start() -> Self {
        Self::start_with(own())
    }

    fn start_with(config: ZdsConfig) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ztunnel.sock");
        let server = ZdsServer::bind_with(&path, config).unwrap();
        let zds = server.handle();
        let stop = CancellationToken::new();
        let task = tokio::spawn(server.run(stop.clone()));
        Self { _dir: dir, path, zds, stop, task }
    }

    /// Caches pods while no ztunnel is connected (each add answers NoZtunnel).
    async fn cache(&self, uids: &[&str]) {
        for uid in uids {
            let e = self.zds.add_pod(uid, info(uid), own_netns()).await.unwrap_err();
            assert!(matches!(e, ZdsError::NoZtunnel { .. }), "{e}");
        }
    }

    async fn wait_status(&self, what: &str, check: impl Fn(ZdsStatus) -> bool) {
        let mut watch = self.zds.watch();
        tokio::time::timeout(PATIENCE, watch.wait_for(|s| check(*s)))
            .await
            .unwrap_or_else(|_| panic!("{what}: status stayed {:?}", self.zds.status()))
            .unwrap();
    }

    async fn wait_connections(&self, n: usize) {
        self.wait_status(&format!("{n} connection(s)"), |s| s.connections == n).await;
    }

    async fn wait_synced(&self, n: usize) {
        self.wait_status(&format!("{n} synced"), |s| s.synced == n && s.connections == n).await;
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
    }
}

fn sorted(mut uids: Vec<String>) -> Vec<String> {
    uids.sort();
    uids
}

/// Reads a snapshot of Adds: their uids, sorted, each checked to carry one fd that is
/// this process's netns.
async fn snapshot_adds(fake: &mut FakeZtunnel) -> Vec<String> {
    let own = netns_id(std::os::fd::AsFd::as_fd(&own_netns()));
    let items = fake.take_snapshot().await;
    let uids = items
        .iter()
        .map(|r| {
            assert_eq!(r.netns_id(), own, "the Add carries the pod's netns");
            r.add_uid().to_string()
        })
        .collect();
    sorted(uids)
}

/// A connection served directly (S1–S3 and bad input), with the fake on the other end.
struct Direct {
    fake: FakeZtunnel,
    registry: Arc<Registry>,
    entry: super::registry::ConnEntry,
    task: JoinHandle<Result<Ended, ConnError>>,
}

fn serve_direct(pods: PodCache, deadline: Duration) -> Direct {
    let (ours, theirs) = Seqpacket::pair().unwrap();
    let (pods, registry) = (Arc::new(pods), Arc::new(Registry::default()));
    let (entry, updates) = registry.register(100);
    let conn = Conn::new(ours, entry.id, deadline);
    let task = {
        let (pods, registry) = (pods.clone(), registry.clone());
        tokio::spawn(async move { conn.serve(&pods, &registry, updates).await })
    };
    Direct { fake: FakeZtunnel::over(theirs), registry, entry, task }
}

fn two_pods() -> PodCache {
    let pods = PodCache::default();
    for uid in ["uid-1", "uid-2"] {
        pods.upsert(uid, info(uid), Netns::new(own_netns()).unwrap());
    }
    pods
}

async fn ended(task: JoinHandle<Result<Ended, ConnError>>) -> Result<Ended, ConnError> {
    tokio::time::timeout(PATIENCE, task).await.expect("the connection did not end").unwrap()
}

// S1: TestZtunnelServerHandleConn. Snapshot (an Add with uid, info and fd per pod, then
// SnapshotSent with none), each queued update forwarded and its requester answered;
// an unprompted message while idle is a protocol error that closes the connection.
#[tokio::test]
async fn s1_handle_conn_snapshot_updates_then_an_unprompted_message_closes() {
    let mut d = serve_direct(two_pods(), Duration::from_secs(5));
    d.fake.hello().await;
    let items = d.fake.take_snapshot().await;
    let own = netns_id(std::os::fd::AsFd::as_fd(&own_netns()));
    let mut uids = Vec::new();
    for item in &items {
        let weir_proto::istio::workload::zds::workload_request::Payload::Add(add) = &item.payload else {
            panic!("expected Add, got {:?}", item.payload)
        };
        let name = add.uid.clone();
        let workload = add.workload_info.clone().expect("workload_info");
        assert_eq!((workload.name, workload.service_account), (name.clone(), format!("sa-{name}")));
        assert_eq!(item.netns_id(), own);
        uids.push(name);
    }
    assert_eq!(sorted(uids), ["uid-1", "uid-2"]);
    for uid in ["uid-1", "uid-2"] {
        let entry = d.entry.clone();
        let request = tokio::spawn(async move { entry.send(Update::Del { uid: uid.into() }).await });
        let received = d.fake.read().await;
        assert_eq!(received.del_uid(), uid);
        assert!(received.fds.is_empty());
        d.fake.ack().await;
        request.await.unwrap().unwrap();
    }
    d.fake.hello().await; // ztunnel never speaks unprompted
    assert_eq!(ended(d.task).await, Err(ConnError::Unprompted { len: 2 }));
    d.fake.expect_closed().await;
}

// S2: TestZtunnelServerHandleConnWhenConnDies. The write of an update fails (broken
// pipe): its requester gets the error, and the connection is closed.
#[tokio::test]
async fn s2_a_failed_write_answers_the_requester_and_closes() {
    let mut d = serve_direct(two_pods(), Duration::from_secs(5));
    d.fake.hello().await;
    assert_eq!(d.fake.take_snapshot().await.len(), 2);
    // ztunnel stops reading: the agent's next sendmsg gets EPIPE.
    nix::sys::socket::shutdown(d.fake.sock.raw_fd(), nix::sys::socket::Shutdown::Read).unwrap();
    let e = d.entry.send(Update::Del { uid: "uid-1".into() }).await.unwrap_err();
    let ZdsError::Connection { message: "Del", uid, source, .. } = &e else { panic!("{e}") };
    assert_eq!(uid, "uid-1");
    assert_eq!(*source, ConnError::Send { message: "Del", source: nix::errno::Errno::EPIPE });
    assert_eq!(ended(d.task).await, Err(source.clone()));
}

// S3: TestZtunnelServerHandleConnWhenKeepaliveFails. A failed read while idle (here a
// datagram too large for any ztunnel message) closes the connection, once.
#[tokio::test]
async fn s3_a_failed_idle_read_closes() {
    let mut d = serve_direct(two_pods(), Duration::from_secs(5));
    d.fake.hello().await;
    assert_eq!(d.fake.take_snapshot().await.len(), 2);
    d.fake.send(&vec![0u8; 70_000]).await;
    assert_eq!(ended(d.task).await, Err(ConnError::Truncated));
    d.fake.expect_closed().await;
    assert_eq!(d.registry.status().synced, 1, "the server, not the connection, unregisters it");
}

// S4: TestZtunnelSendsPodSnapshot.
#[tokio::test]
async fn s4_sends_the_pod_snapshot() {
    let server = Server::start();
    server.cache(&["uid-a"]).await;
    let mut fake = FakeZtunnel::connect_hello(&server.path).await;
    server.wait_connections(1).await;
    let add = fake.read().await;
    assert_eq!(add.fds.len(), 1, "the Add carries exactly one fd");
    assert_eq!(add.add_uid(), "uid-a");
    fake.ack().await;
    let sent = fake.read().await;
    assert!(sent.is_snapshot_sent(), "{:?}", sent.payload);
    assert!(sent.fds.is_empty());
    fake.ack().await;
    server.wait_synced(1).await;
    drop(fake);
    server.wait_connections(0).await;
    server.stop().await;
}

// S5: TestZtunnelWriteErrorCausesConnToDrop. ztunnel goes away without acking: the
// connection is dropped and the server goes on serving.
#[tokio::test]
async fn s5_a_peer_gone_mid_snapshot_is_dropped_and_the_server_goes_on() {
    let server = Server::start();
    server.cache(&["uid-a"]).await;
    let fake = FakeZtunnel::connect_hello(&server.path).await;
    server.wait_connections(1).await;
    drop(fake);
    server.wait_connections(0).await;
    let mut again = FakeZtunnel::connect_hello(&server.path).await;
    assert_eq!(snapshot_adds(&mut again).await, ["uid-a"]);
    server.wait_synced(1).await;
    server.stop().await;
}

/// Two ztunnels, each with its snapshot of `uids` taken.
async fn two_synced(server: &Server, uids: &[&str]) -> (FakeZtunnel, FakeZtunnel) {
    let mut first = FakeZtunnel::connect_hello(&server.path).await;
    server.wait_connections(1).await;
    assert_eq!(snapshot_adds(&mut first).await, uids);
    let mut second = FakeZtunnel::connect_hello(&server.path).await;
    assert_eq!(snapshot_adds(&mut second).await, uids);
    server.wait_synced(2).await;
    (first, second)
}

// S6: TestMultipleConnectedZtunnelsGetEvents. Add goes to the newest only; Del to both,
// oldest first (the test reads the first one's Del before answering anything on the
// second).
#[tokio::test]
async fn s6_adds_go_to_the_newest_ztunnel_and_deletes_to_all_oldest_first() {
    let server = Server::start();
    server.cache(&["uid-1", "uid-2"]).await;
    let (mut first, mut second) = two_synced(&server, &["uid-1", "uid-2"]).await;
    let zds = server.zds.clone();
    let add = tokio::spawn(async move { zds.add_pod("new-pod", info("new-pod"), own_netns()).await });
    let received = second.read().await;
    assert_eq!(received.add_uid(), "new-pod");
    assert_eq!(received.fds.len(), 1);
    second.ack().await;
    add.await.unwrap().unwrap();
    let zds = server.zds.clone();
    let del = tokio::spawn(async move { zds.del_pod("new-pod").await });
    let received = first.read().await;
    assert_eq!(
        received.del_uid(),
        "new-pod",
        "the oldest ztunnel gets the Del first (and no Add came before it)"
    );
    assert!(received.fds.is_empty());
    first.ack().await;
    let received = second.read().await;
    assert_eq!(received.del_uid(), "new-pod");
    assert!(received.fds.is_empty());
    second.ack().await;
    del.await.unwrap().unwrap();
    drop(first);
    server.wait_connections(1).await;
    drop(second);
    server.wait_connections(0).await;
    server.stop().await;
}

// S7: TestZtunnelLatestConnFallsBackToPreviousIfNewestDisconnects.
#[tokio::test]
async fn s7_when_the_newest_ztunnel_leaves_the_previous_one_gets_adds() {
    let server = Server::start();
    server.cache(&["uid-1", "uid-2"]).await;
    let (mut first, second) = two_synced(&server, &["uid-1", "uid-2"]).await;
    drop(second);
    server.wait_connections(1).await;
    assert!(server.zds.connected());
    let zds = server.zds.clone();
    let add = tokio::spawn(async move { zds.add_pod("new-pod", info("new-pod"), own_netns()).await });
    let received = first.read().await;
    assert_eq!(received.add_uid(), "new-pod");
    assert_eq!(received.fds.len(), 1);
    first.ack().await;
    add.await.unwrap().unwrap();
    let zds = server.zds.clone();
    let del = tokio::spawn(async move { zds.del_pod("new-pod").await });
    let received = first.read().await;
    assert_eq!(received.del_uid(), "new-pod");
    assert!(received.fds.is_empty());
    first.ack().await;
    del.await.unwrap().unwrap();
    drop(first);
    server.wait_connections(0).await;
    server.stop().await;
}

// S8: TestZtunnelRemovePod. Istio's last check (gauge = 1 after the client closed)
// passes only until the server notices the close; here: the close is noticed (0).
#[tokio::test]
async fn s8_removing_a_pod_sends_del_and_uncaches_it() {
    let server = Server::start();
    server.cache(&["uid-a"]).await;
    let mut fake = FakeZtunnel::connect_hello(&server.path).await;
    assert_eq!(snapshot_adds(&mut fake).await, ["uid-a"]);
    let zds = server.zds.clone();
    let del = tokio::spawn(async move { zds.del_pod("uid-a").await });
    let received = fake.read().await;
    assert_eq!(received.del_uid(), "uid-a");
    assert!(received.fds.is_empty());
    fake.ack().await;
    del.await.unwrap().unwrap();
    assert!(server.zds.pods().is_empty());
    drop(fake);
    server.wait_connections(0).await;
    server.stop().await;
}

// S9: TestZtunnelPodDeletedDoesNotDeadlockOnDisconnectingConn. A delete stuck on a
// connection nobody serves holds no lock: a new ztunnel registers and takes its
// snapshot meanwhile; once the stuck connection is reaped, the delete returns.
#[tokio::test]
async fn s9_a_delete_stuck_on_a_dying_connection_blocks_nothing_else() {
    let server = Server::start();
    let registry = &server.zds.shared.registry;
    let (stuck, _never_read) = registry.register(100);
    let zds = server.zds.clone();
    let del = tokio::spawn(async move { zds.del_pod("some-deleted-pod-uid").await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!del.is_finished(), "the delete waits for the stuck connection");
    let mut fake = FakeZtunnel::connect_hello(&server.path).await;
    assert!(fake.take_snapshot().await.is_empty());
    server.wait_status("the new ztunnel synced", |s| s == ZdsStatus { connections: 2, synced: 1 }).await;
    registry.remove(&stuck);
    let e = tokio::time::timeout(PATIENCE, del).await.expect("the delete returns once reaped").unwrap();
    assert!(matches!(e, Err(ZdsError::ConnectionClosed { message: "Del", .. })), "{e:?}");
    server.stop().await;
}

// S10: TestZtunnelPodAdded.
#[tokio::test]
async fn s10_an_added_pod_goes_to_ztunnel_with_its_netns() {
    let server = Server::start();
    server.cache(&["uid-a"]).await;
    let mut fake = FakeZtunnel::connect_hello(&server.path).await;
    assert_eq!(snapshot_adds(&mut fake).await, ["uid-a"]);
    let netns = own_netns();
    let id = netns_id(std::os::fd::AsFd::as_fd(&netns));
    let zds = server.zds.clone();
    let add = tokio::spawn(async move { zds.add_pod("uid-b", info("uid-b"), netns).await });
    let received = fake.read().await;
    assert_eq!(received.add_uid(), "uid-b");
    assert_eq!(received.netns_id(), id);
    fake.ack().await;
    add.await.unwrap().unwrap();
    assert_eq!(server.zds.pods(), ["uid-a", "uid-b"]);
    drop(fake);
    server.wait_connections(0).await;
    server.stop().await;
}

// S11: TestZtunnelPodKept. A pod known without a netns goes out as Keep, with no fd.
#[tokio::test]
async fn s11_a_pod_without_netns_is_kept() {
    let server = Server::start();
    server.zds.keep_pod("uid-kept");
    let mut fake = FakeZtunnel::connect_hello(&server.path).await;
    let keep = fake.read().await;
    assert_eq!(keep.keep_uid(), "uid-kept");
    assert!(keep.fds.is_empty());
    fake.ack().await;
    let sent = fake.read().await;
    assert!(sent.is_snapshot_sent() && sent.fds.is_empty());
    fake.ack().await;
    server.wait_synced(1).await;
    drop(fake);
    server.wait_connections(0).await;
    server.stop().await;
}

// S12: a nack answers the requester ("got ack error") and keeps the connection; in a
// snapshot it is logged and the snapshot goes on.
#[tokio::test]
async fn s12_nacks_reach_the_requester_and_do_not_stop_a_snapshot() {
    let server = Server::start();
    server.cache(&["uid-1", "uid-2"]).await;
    let mut fake = FakeZtunnel::connect_hello(&server.path).await;
    fake.read().await;
    fake.nack("failure to start proxy : bind").await;
    assert!(!fake.read().await.is_snapshot_sent(), "the second pod still comes");
    fake.ack().await;
    assert!(fake.read().await.is_snapshot_sent());
    fake.ack().await;
    server.wait_synced(1).await;
    let zds = server.zds.clone();
    let add = tokio::spawn(async move { zds.add_pod("uid-3", info("uid-3"), own_netns()).await });
    fake.read().await;
    fake.nack("failure to start proxy : no route").await;
    let e = add.await.unwrap().unwrap_err();
    assert!(e.to_string().contains("got ack error"), "{e}");
    assert!(
        matches!(&e, ZdsError::Nack { error, .. } if error == "failure to start proxy : no route"),
        "{e}"
    );
    let zds = server.zds.clone();
    let add = tokio::spawn(async move { zds.add_pod("uid-4", info("uid-4"), own_netns()).await });
    assert_eq!(fake.read().await.add_uid(), "uid-4", "the connection goes on");
    fake.ack().await;
    add.await.unwrap().unwrap();
    server.stop().await;
}

// S13: no ack within the deadline: the requester gets a timeout and the connection is
// closed (Weir's deviation: a late ack would answer the wrong message); ztunnel
// reconnects and gets the full snapshot, the timed-out pod in it.
#[tokio::test]
async fn s13_an_ack_timeout_closes_the_connection_and_a_reconnect_gets_everything() {
    let deadline = Duration::from_millis(300);
    let server = Server::start_with(ZdsConfig { deadline, ..own() });
    let mut fake = FakeZtunnel::connect_hello(&server.path).await;
    assert!(fake.take_snapshot().await.is_empty());
    let e = {
        let zds = server.zds.clone();
        let add = tokio::spawn(async move { zds.add_pod("uid-slow", info("uid-slow"), own_netns()).await });
        assert_eq!(fake.read().await.add_uid(), "uid-slow");
        add.await.unwrap().unwrap_err()
    };
    let ZdsError::Connection { source, .. } = &e else { panic!("{e}") };
    assert_eq!(*source, ConnError::AckTimeout { message: "Add", deadline });
    fake.expect_closed().await;
    server.wait_connections(0).await;
    let mut again = FakeZtunnel::connect_hello(&server.path).await;
    assert_eq!(snapshot_adds(&mut again).await, ["uid-slow"]);
    server.stop().await;
}

// S14: with no ztunnel, an add fails at once (the pod stays cached for the next
// snapshot) and a delete succeeds.
#[tokio::test]
async fn s14_with_no_ztunnel_add_fails_and_caches_and_delete_succeeds() {
    let server = Server::start();
    let e = server.zds.add_pod("uid-a", info("uid-a"), own_netns()).await.unwrap_err();
    assert!(e.to_string().starts_with("no ztunnel connection"), "{e}");
    assert_eq!(server.zds.pods(), ["uid-a"]);
    server.zds.del_pod("uid-gone").await.unwrap();
    assert!(!server.zds.connected());
    let mut fake = FakeZtunnel::connect_hello(&server.path).await;
    assert_eq!(snapshot_adds(&mut fake).await, ["uid-a"]);
    server.stop().await;
}

// S15: after the snapshot nothing but Add and Del goes out: a pod kept later is not
// sent as Keep (the next message is the next Add) but is in the next snapshot; a pod
// too large for a datagram is refused before it is cached or sent.
#[tokio::test]
async fn s15_no_keep_or_snapshot_sent_after_the_snapshot_and_no_oversized_add() {
    let server = Server::start();
    let mut fake = FakeZtunnel::connect_hello(&server.path).await;
    assert!(fake.take_snapshot().await.is_empty());
    server.zds.keep_pod("uid-kept");
    let huge = WorkloadInfo { name: "n".repeat(1100), ..info("x") };
    let e = server.zds.add_pod("uid-huge", huge, own_netns()).await.unwrap_err();
    assert!(matches!(e, ZdsError::MessageTooLarge { size, limit: 1024, .. } if size > 1100), "{e}");
    let zds = server.zds.clone();
    let add = tokio::spawn(async move { zds.add_pod("uid-b", info("uid-b"), own_netns()).await });
    assert_eq!(fake.read().await.add_uid(), "uid-b", "neither Keep nor the huge Add went out");
    fake.ack().await;
    add.await.unwrap().unwrap();
    assert_eq!(server.zds.pods(), ["uid-b", "uid-kept"]);
    drop(fake);
    server.wait_connections(0).await;
    let mut again = FakeZtunnel::connect_hello(&server.path).await;
    let mut seen: Vec<String> = again
        .take_snapshot()
        .await
        .iter()
        .map(|r| match &r.payload {
            weir_proto::istio::workload::zds::workload_request::Payload::Keep(k) => format!("keep {}", k.uid),
            _ => format!("add {}", r.add_uid()),
        })
        .collect();
    seen.sort();
    assert_eq!(seen, ["add uid-b", "keep uid-kept"]);
    server.stop().await;
}

// S16: an idle ztunnel that goes away is noticed without any poll: with an hour's
// deadline, the connection still goes as soon as ztunnel closes.
#[tokio::test]
async fn s16_an_idle_peer_closing_is_noticed_at_once() {
    let server = Server::start_with(ZdsConfig { deadline: Duration::from_secs(3600), ..own() });
    let mut fake = FakeZtunnel::connect_hello(&server.path).await;
    assert!(fake.take_snapshot().await.is_empty());
    server.wait_synced(1).await;
    drop(fake);
    server.wait_connections(0).await;
    server.stop().await;
}

// Bad input from a peer: never a panic; the connection closes, naming why.
#[tokio::test]
async fn a_garbage_hello_closes_the_connection() {
    let mut d = serve_direct(PodCache::default(), Duration::from_secs(5));
    d.fake.send(&[0xff, 0xff, 0xff]).await;
    let e = ended(d.task).await.unwrap_err();
    assert!(matches!(&e, ConnError::Decode(DecodeError::Undecodable { what: "hello", len: 3, .. })), "{e}");
    assert_eq!(e.reason(), "undecodable_message");
    d.fake.expect_closed().await;
}

#[tokio::test]
async fn a_truncated_ack_fails_the_request_and_closes() {
    let mut d = serve_direct(PodCache::default(), Duration::from_secs(5));
    d.fake.hello().await;
    assert!(d.fake.take_snapshot().await.is_empty());
    let entry = d.entry.clone();
    let request = tokio::spawn(async move { entry.send(Update::Del { uid: "uid-1".into() }).await });
    d.fake.read().await;
    d.fake.send(&[0x0a, 0x05, 0x0a]).await; // an Ack whose length says 5, cut after 1
    let e = request.await.unwrap().unwrap_err();
    assert!(matches!(&e, ZdsError::Connection { source: ConnError::Decode(_), .. }), "{e}");
    let e = ended(d.task).await.unwrap_err();
    assert!(matches!(&e, ConnError::Decode(DecodeError::Undecodable { what: "ack", .. })), "{e}");
}

#[tokio::test]
async fn a_response_without_an_ack_closes() {
    let mut d = serve_direct(two_pods(), Duration::from_secs(5));
    d.fake.hello().await;
    d.fake.read().await;
    d.fake.send(&[]).await; // an empty WorkloadResponse: no ack in it
    assert_eq!(ended(d.task).await, Err(ConnError::Decode(DecodeError::NoAck { len: 0 })));
}

#[tokio::test]
async fn an_fd_from_ztunnel_is_closed_and_closes_the_connection() {
    let mut d = serve_direct(PodCache::default(), Duration::from_secs(5));
    let hello = [0x08, 0x01];
    let netns = own_netns();
    d.fake.sock.send(&hello, Some(std::os::fd::AsFd::as_fd(&netns))).await.unwrap();
    let e = ended(d.task).await.unwrap_err();
    assert_eq!(e, ConnError::UnexpectedFd { count: 1 });
    assert_eq!(e.reason(), "unexpected_fd");
    d.fake.expect_closed().await;
}

#[tokio::test]
async fn an_oversized_hello_and_a_silent_peer_close_the_connection() {
    let d = serve_direct(PodCache::default(), Duration::from_secs(5));
    d.fake.send(&vec![0x08; 70_000]).await;
    assert_eq!(ended(d.task).await, Err(ConnError::Truncated));
    let d = serve_direct(PodCache::default(), Duration::from_millis(200));
    assert_eq!(ended(d.task).await, Err(ConnError::HelloTimeout(Duration::from_millis(200))));
    drop(d.fake);
    let d = serve_direct(PodCache::default(), Duration::from_secs(5));
    drop(d.fake);
    let e = ended(d.task).await.unwrap_err();
    assert!(matches!(e, ConnError::Closed { .. }), "{e}");
}

#[tokio::test]
async fn a_bad_peer_leaves_the_server_serving_others() {
    let server = Server::start();
    server.cache(&["uid-a"]).await;
    let bad = FakeZtunnel::connect(&server.path);
    bad.send(&[0xff, 0xff]).await;
    let mut good = FakeZtunnel::connect_hello(&server.path).await;
    assert_eq!(snapshot_adds(&mut good).await, ["uid-a"]);
    server.wait_synced(1).await;
    server.stop().await;
}

#[tokio::test]
async fn add_refuses_an_empty_uid_and_an_fd_that_is_not_a_netns() {
    let server = Server::start();
    let e = server.zds.add_pod("", info("a"), own_netns()).await.unwrap_err();
    assert!(matches!(e, ZdsError::EmptyUid), "{e}");
    let dev_null = std::fs::File::open("/dev/null").unwrap().into();
    let e = server.zds.add_pod("uid-a", info("a"), dev_null).await.unwrap_err();
    assert!(matches!(&e, ZdsError::NotANetns { uid, .. } if uid == "uid-a"), "{e}");
    assert!(server.zds.pods().is_empty(), "nothing cached");
    server.stop().await;
}

// Accepts are rate-limited: with an hour between accepts, a second ztunnel is not
// taken, so an Add still goes to the first.
#[tokio::test]
async fn accepts_are_rate_limited() {
    let server = Server::start_with(ZdsConfig { accept_interval: Duration::from_secs(3600), ..own() });
    let mut first = FakeZtunnel::connect_hello(&server.path).await;
    assert!(first.take_snapshot().await.is_empty());
    let _second = FakeZtunnel::connect_hello(&server.path).await;
    let zds = server.zds.clone();
    let add = tokio::spawn(async move { zds.add_pod("uid-a", info("uid-a"), own_netns()).await });
    assert_eq!(first.read().await.add_uid(), "uid-a");
    first.ack().await;
    add.await.unwrap().unwrap();
    assert_eq!(server.zds.status().connections, 1);
    server.stop().await;
}

#[tokio::test]
async fn bind_replaces_a_stale_socket_refuses_other_files_and_makes_the_directory() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run/ztunnel/ztunnel.sock");
    let server = ZdsServer::bind_with(&path, own()).unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(path.parent().unwrap()), 0o700, "only root reaches the socket's directory");
    assert_eq!(mode(&path), 0o600, "nor the socket");
    drop(server); // the socket file stays, as after an agent that was killed
    assert!(path.exists());
    let server = ZdsServer::bind_with(&path, own()).unwrap();
    let mut status = server.handle().watch();
    let stop = CancellationToken::new();
    let task = tokio::spawn(server.run(stop.clone()));
    let mut fake = FakeZtunnel::connect_hello(&path).await;
    assert!(fake.take_snapshot().await.is_empty());
    tokio::time::timeout(PATIENCE, status.wait_for(|s| s.synced == 1)).await.unwrap().unwrap();
    stop.cancel();
    task.await.unwrap().unwrap();
    fake.expect_closed().await;
    assert!(!path.exists(), "a stopped server removes its socket");
    std::fs::write(&path, "not a socket").unwrap();
    let e = ZdsServer::bind(&path).unwrap_err();
    assert!(matches!(e, ZdsError::NotASocket { found: "a regular file", .. }), "{e}");
    assert!(e.to_string().contains("refusing to replace it"), "{e}");
}

/// A peer that is not ztunnel's uid is closed before it is sent anything: no snapshot,
/// no pod, no namespace. Before, any process that reached the socket was served every
/// pod's namespace and identity.
#[tokio::test]
async fn a_peer_running_as_another_uid_is_closed_before_it_is_sent_a_pod() {
    let me = nix::unistd::geteuid().as_raw();
    let server = Server::start_with(ZdsConfig { peer_uids: vec![me.wrapping_add(4242)], ..own() });
    server.cache(&["uid-a"]).await;
    let mut fake = FakeZtunnel::connect(&server.path);
    fake.expect_closed().await;
    assert_eq!(server.zds.watch().borrow().connections, 0, "never registered");
}
