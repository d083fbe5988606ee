//! A stand-in ztunnel for the ambient agent's integration tests that do not need the
//! real one (named as such): a `SOCK_SEQPACKET` client of the agent's ZDS socket that
//! says hello, acks every request (closing the namespace fds it is handed) and records
//! what it was told (`Add <uid>`, `Keep <uid>`, `Del <uid>`, `SnapshotSent`). It
//! reconnects when the agent goes away, as ztunnel does (20 ms backoff, doubling to
//! 1 s). The real ztunnel's rig is `ztunnel.rs`.

use std::{
    io::IoSliceMut,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use nix::sys::socket::{self, AddressFamily, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr};
use prost::Message as _;
use weir_proto::istio::workload::zds as pb;

/// The fake; dropping it disconnects.
pub struct FakeZtunnel {
    log: Arc<Mutex<Vec<String>>>,
    connections: Arc<Mutex<u32>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for FakeZtunnel {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl FakeZtunnel {
    /// Connects to `socket` (retrying until the agent listens) on a thread of its own.
    pub fn start(socket: &Path) -> Self {
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let connections: Arc<Mutex<u32>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (l, c, s, path) = (log.clone(), connections.clone(), stop.clone(), socket.to_path_buf());
        let thread = std::thread::spawn(move || serve(&path, &l, &c, &s));
        Self { log, connections, stop, thread: Some(thread) }
    }

    /// Everything it was told, in order.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().expect("log").clone()
    }

    /// How many connections it has made.
    pub fn connections(&self) -> u32 {
        *self.connections.lock().expect("connections")
    }
}

fn serve(path: &Path, log: &Mutex<Vec<String>>, connections: &Mutex<u32>, stop: &AtomicBool) {
    let mut backoff = Duration::from_millis(20);
    while !stop.load(Ordering::SeqCst) {
        match connect(path) {
            Ok(fd) => {
                backoff = Duration::from_millis(20);
                *connections.lock().expect("connections") += 1;
                converse(&fd, log, stop);
            }
            Err(_) => {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

fn connect(path: &Path) -> nix::Result<OwnedFd> {
    let fd = socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)?;
    socket::connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    let timeout = nix::sys::time::TimeVal::new(0, 100_000);
    socket::setsockopt(&fd, socket::sockopt::ReceiveTimeout, &timeout)?;
    let hello = pb::ZdsHello { version: pb::Version::V1 as i32 }.encode_to_vec();
    socket::send(fd.as_raw_fd(), &hello, MsgFlags::empty())?;
    Ok(fd)
}

/// Reads requests and acks each until the agent closes or the test stops.
fn converse(fd: &OwnedFd, log: &Mutex<Vec<String>>, stop: &AtomicBool) {
    let mut buf = vec![0u8; 4096];
    while !stop.load(Ordering::SeqCst) {
        let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 4]);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = match socket::recvmsg::<()>(
            fd.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(m) => m,
            Err(nix::errno::Errno::EAGAIN) => continue,
            Err(_) => return,
        };
        let n = msg.bytes;
        for c in msg.cmsgs().into_iter().flatten() {
            if let ControlMessageOwned::ScmRights(fds) = c {
                // SAFETY: descriptors the kernel just gave this process.
                fds.into_iter().for_each(|f| drop(unsafe { OwnedFd::from_raw_fd(f) }));
            }
        }
        if n == 0 {
            return;
        }
        let entry = match pb::WorkloadRequest::decode(&buf[..n]).ok().and_then(|r| r.payload) {
            Some(pb::workload_request::Payload::Add(a)) => format!("Add {}", a.uid),
            Some(pb::workload_request::Payload::Keep(k)) => format!("Keep {}", k.uid),
            Some(pb::workload_request::Payload::Del(d)) => format!("Del {}", d.uid),
            Some(pb::workload_request::Payload::SnapshotSent(_)) => "SnapshotSent".into(),
            None => "undecodable".into(),
        };
        log.lock().expect("log").push(entry);
        let ack = pb::WorkloadResponse {
            payload: Some(pb::workload_response::Payload::Ack(pb::Ack { error: String::new() })),
        }
        .encode_to_vec();
        if socket::send(fd.as_raw_fd(), &ack, MsgFlags::empty()).is_err() {
            return;
        }
    }
}
