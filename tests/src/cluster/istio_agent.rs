//! Istio's node agent on a node during a chart swap's gap, played by the test: no
//! Istio binary can run here (no Go, no network), so its side of ztunnel's socket is
//! reproduced from its code at 86c9f01 (cni/pkg/nodeagent/ztunnelserver*.go): the
//! socket left by the agent before it is removed, then listened on as `unixpacket`
//! (`newZtunnelServer`); each ztunnel connection's hello read, then its snapshot sent
//! (`sendSnapshot`: one `AddWorkload` per pod in its cache, the pod's netns passed as
//! SCM_RIGHTS, with `podToWorkload`'s name, namespace and service account; then
//! `SnapshotSent`), each request waiting for ztunnel's ack. Stopping closes the
//! listener and the connection and unlinks the socket, as Go's `UnixListener.Close`
//! does. What it was told is recorded, for the test to check the handover.

use std::{
    io::IoSlice,
    os::fd::{AsRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, bail};
use nix::sys::socket::{self, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr};
use prost::Message as _;
use weir_proto::istio::workload::zds as pb;

/// A pod in the agent's cache: what `podToWorkload` takes from it, and its netns.
pub struct CachedPod {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub netns: OwnedFd,
}

/// The running stand-in; [`IstioNodeAgent::stop`] (or dropping it) ends it.
pub struct IstioNodeAgent {
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl IstioNodeAgent {
    /// Removes what is at `socket`, listens there, and serves every ztunnel that
    /// connects with a snapshot of `pods`.
    pub fn start(socket: &Path, pods: Vec<CachedPod>) -> anyhow::Result<Self> {
        match std::fs::remove_file(socket) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("remove {}", socket.display())),
        }
        let listener = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )?;
        // The node's folder may be deeper than a socket address holds (108 bytes): bind
        // through the folder's descriptor.
        let dir = socket.parent().context("the socket's folder")?;
        let name = socket.file_name().context("the socket's name")?;
        let folder = std::fs::File::open(dir).with_context(|| format!("open {}", dir.display()))?;
        let short = Path::new("/proc/self/fd").join(folder.as_raw_fd().to_string()).join(name);
        socket::bind(listener.as_raw_fd(), &UnixAddr::new(&short)?)
            .with_context(|| format!("bind {}", socket.display()))?;
        drop(folder);
        socket::listen(&listener, socket::Backlog::new(8)?)?;
        let stop = Arc::new(AtomicBool::new(false));
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let (s, l) = (stop.clone(), log.clone());
        let thread = std::thread::spawn(move || accept_loop(&listener, &pods, &s, &l));
        Ok(Self { socket: socket.to_path_buf(), stop, log, thread: Some(thread) })
    }

    /// What happened, in order (`hello`, `Add <uid>: ack`, `SnapshotSent: ack`, errors).
    pub fn log(&self) -> Vec<String> {
        self.log.lock().expect("log").clone()
    }

    /// Waits until a ztunnel acked a whole snapshot.
    pub fn wait_snapshot(&self, limit: Duration) -> anyhow::Result<()> {
        let done = crate::control_plane::eventually(limit, || {
            self.log().iter().any(|l| l == "SnapshotSent: ack").then_some(())
        });
        done.with_context(|| format!("no snapshot acked by ztunnel within {limit:?}: {:?}", self.log()))
    }

    /// Closes the listener and connection, and unlinks the socket.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Drop for IstioNodeAgent {
    fn drop(&mut self) {
        self.halt();
    }
}

fn accept_loop(listener: &OwnedFd, pods: &[CachedPod], stop: &AtomicBool, log: &Mutex<Vec<String>>) {
    let note = |s: String| log.lock().expect("log").push(s);
    let mut conn: Option<OwnedFd> = None;
    while !stop.load(Ordering::SeqCst) {
        match socket::accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
            Ok(fd) => {
                // SAFETY: a descriptor accept4 just returned to this process.
                let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
                match converse(&fd, pods, &note) {
                    Ok(()) => conn = Some(fd),
                    Err(e) => note(format!("error: {e:#}")),
                }
            }
            Err(nix::errno::Errno::EAGAIN) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                note(format!("error: accept: {e}"));
                return;
            }
        }
    }
    drop(conn);
}

/// Hello, then the snapshot, each request acked.
fn converse(fd: &OwnedFd, pods: &[CachedPod], note: &dyn Fn(String)) -> anyhow::Result<()> {
    let timeout = nix::sys::time::TimeVal::new(5, 0);
    socket::setsockopt(fd, socket::sockopt::ReceiveTimeout, &timeout)?;
    let mut buf = vec![0u8; 4096];
    let n = socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).context("read ztunnel's hello")?;
    let hello = pb::ZdsHello::decode(&buf[..n]).context("ztunnel's hello")?;
    note(format!("hello version {}", hello.version));
    for pod in pods {
        let add = pb::AddWorkload {
            uid: pod.uid.clone(),
            workload_info: Some(pb::WorkloadInfo {
                name: pod.name.clone(),
                namespace: pod.namespace.clone(),
                service_account: pod.service_account.clone(),
            }),
        };
        let request = pb::WorkloadRequest { payload: Some(pb::workload_request::Payload::Add(add)) };
        let ack = send_and_ack(fd, &request, Some(&pod.netns), &mut buf)?;
        note(format!("Add {}: {ack}", pod.uid));
    }
    let sent = pb::WorkloadRequest {
        payload: Some(pb::workload_request::Payload::SnapshotSent(pb::SnapshotSent {})),
    };
    let ack = send_and_ack(fd, &sent, None, &mut buf)?;
    note(format!("SnapshotSent: {ack}"));
    Ok(())
}

/// Sends `request` (with `netns` attached) and reads the ack: `ack`, or the error.
fn send_and_ack(
    fd: &OwnedFd,
    request: &pb::WorkloadRequest,
    netns: Option<&OwnedFd>,
    buf: &mut [u8],
) -> anyhow::Result<String> {
    let bytes = request.encode_to_vec();
    let iov = [IoSlice::new(&bytes)];
    let fds = netns.map(|f| [f.as_raw_fd()]);
    let cmsgs: Vec<ControlMessage> = fds.as_ref().map(|f| ControlMessage::ScmRights(f)).into_iter().collect();
    socket::sendmsg::<()>(fd.as_raw_fd(), &iov, &cmsgs, MsgFlags::empty(), None)
        .context("send to ztunnel")?;
    let n = socket::recv(fd.as_raw_fd(), buf, MsgFlags::empty()).context("read ztunnel's ack")?;
    match pb::WorkloadResponse::decode(&buf[..n]).context("ztunnel's response")?.payload {
        Some(pb::workload_response::Payload::Ack(a)) if a.error.is_empty() => Ok("ack".into()),
        Some(pb::workload_response::Payload::Ack(a)) => Ok(format!("ack error {}", a.error)),
        None => bail!("a response with no payload"),
    }
}
