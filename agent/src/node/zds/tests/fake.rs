//! A fake ztunnel for the ZDS tests: a real `SOCK_SEQPACKET` client that sends the
//! hello, reads the agent's requests with the descriptors that came with them, and
//! answers with acks, nacks or whatever a test needs it to misbehave with.

use std::{
    os::fd::{AsFd as _, BorrowedFd, OwnedFd},
    path::Path,
    time::Duration,
};

use prost::Message as _;
use weir_proto::istio::workload::zds as pb;

use super::super::wire::Seqpacket;

/// How long the fake waits for the agent before the test fails (a liveness bound,
/// not a timing assertion).
pub const PATIENCE: Duration = Duration::from_secs(10);

/// One request the agent sent.
#[derive(Debug)]
pub struct Received {
    pub payload: pb::workload_request::Payload,
    pub fds: Vec<OwnedFd>,
}

impl Received {
    pub fn add_uid(&self) -> &str {
        match &self.payload {
            pb::workload_request::Payload::Add(add) => &add.uid,
            other => panic!("expected an Add, got {other:?}"),
        }
    }

    pub fn del_uid(&self) -> &str {
        match &self.payload {
            pb::workload_request::Payload::Del(del) => &del.uid,
            other => panic!("expected a Del, got {other:?}"),
        }
    }

    pub fn keep_uid(&self) -> &str {
        match &self.payload {
            pb::workload_request::Payload::Keep(keep) => &keep.uid,
            other => panic!("expected a Keep, got {other:?}"),
        }
    }

    pub fn is_snapshot_sent(&self) -> bool {
        matches!(self.payload, pb::workload_request::Payload::SnapshotSent(_))
    }

    /// The (device, inode) of the one descriptor that came with it.
    pub fn netns_id(&self) -> (u64, u64) {
        assert_eq!(self.fds.len(), 1, "expected exactly one fd with {:?}", self.payload);
        netns_id(self.fds[0].as_fd())
    }
}

/// The (device, inode) ztunnel identifies a namespace by.
pub fn netns_id(fd: BorrowedFd<'_>) -> (u64, u64) {
    let stat = nix::sys::stat::fstat(fd).expect("fstat");
    (stat.st_dev, stat.st_ino)
}

/// This process's network namespace, opened anew.
pub fn own_netns() -> OwnedFd {
    std::fs::File::open("/proc/self/ns/net").expect("open /proc/self/ns/net").into()
}

pub struct FakeZtunnel {
    pub(in crate::node::zds) sock: Seqpacket,
    buf: Vec<u8>,
}

impl FakeZtunnel {
    pub(in crate::node::zds) fn over(sock: Seqpacket) -> Self {
        Self { sock, buf: vec![0; 64 * 1024] }
    }

    pub fn connect(path: &Path) -> Self {
        Self::over(Seqpacket::connect(path).expect("connect to the ZDS socket"))
    }

    /// Connects and says hello (V1).
    pub async fn connect_hello(path: &Path) -> Self {
        let fake = Self::connect(path);
        fake.hello().await;
        fake
    }

    pub async fn send(&self, bytes: &[u8]) {
        self.sock.send(bytes, None).await.expect("fake ztunnel: send");
    }

    pub async fn hello(&self) {
        self.send(&pb::ZdsHello { version: pb::Version::V1.into() }.encode_to_vec()).await;
    }

    pub async fn ack(&self) {
        self.nack("").await;
    }

    pub async fn nack(&self, error: &str) {
        let ack = pb::Ack { error: error.to_string() };
        let response = pb::WorkloadResponse { payload: Some(pb::workload_response::Payload::Ack(ack)) };
        self.send(&response.encode_to_vec()).await;
    }

    /// The next request; fails the test if none comes, or the agent closed.
    pub async fn read(&mut self) -> Received {
        let datagram = tokio::time::timeout(PATIENCE, self.sock.recv(&mut self.buf))
            .await
            .expect("the agent sent nothing")
            .expect("fake ztunnel: recv");
        assert!(!datagram.eof, "the agent closed the connection");
        assert!(!datagram.truncated && datagram.len <= 1024, "a datagram over 1024 bytes");
        let request =
            pb::WorkloadRequest::decode(&self.buf[..datagram.len]).expect("decode a WorkloadRequest");
        Received { payload: request.payload.expect("a request with a payload"), fds: datagram.fds }
    }

    /// Reads the snapshot, acking each message: the requests before `SnapshotSent`
    /// (which must carry no fd).
    pub async fn take_snapshot(&mut self) -> Vec<Received> {
        let mut items = Vec::new();
        loop {
            let received = self.read().await;
            self.ack().await;
            if received.is_snapshot_sent() {
                assert!(received.fds.is_empty(), "SnapshotSent carried an fd");
                return items;
            }
            items.push(received);
        }
    }

    /// Waits for the agent to close the connection (EOF, or a reset when it closed
    /// with a message of ours unread).
    pub async fn expect_closed(&mut self) {
        let received = tokio::time::timeout(PATIENCE, self.sock.recv(&mut self.buf))
            .await
            .expect("the agent did not close the connection");
        match received {
            Ok(datagram) => assert!(datagram.eof, "expected the agent to close, got {} bytes", datagram.len),
            Err(e) => assert_eq!(e, nix::errno::Errno::ECONNRESET, "fake ztunnel: recv"),
        }
    }
}
