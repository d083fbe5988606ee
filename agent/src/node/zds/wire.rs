//! The wire under ZDS: `AF_UNIX` `SOCK_SEQPACKET` sockets on Tokio. Binding (a stale
//! socket file removed, a missing directory made `0750`), accepting, sending one
//! datagram with at most one file descriptor (`SCM_RIGHTS`, `MSG_NOSIGNAL`), and
//! receiving one datagram with whatever descriptors came with it (taken as `OwnedFd`
//! with close-on-exec, so none leaks) and its truncation flags. No protobuf here.

use std::{
    fs,
    io::{self, IoSlice, IoSliceMut},
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd},
        unix::fs::{FileTypeExt as _, MetadataExt as _},
    },
    path::{Path, PathBuf},
};

use nix::{
    cmsg_space,
    errno::Errno,
    sys::socket::{
        self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
        UnixAddr,
    },
};
use tokio::io::unix::AsyncFd;

use super::ZdsError;

/// The most descriptors one datagram can carry (the kernel's `SCM_MAX_FD`); the
/// control buffer has room for them all, so any that arrive are received and closed.
const SCM_MAX_FD: usize = 253;

/// One connected `SOCK_SEQPACKET` socket.
#[derive(Debug)]
pub(super) struct Seqpacket {
    fd: AsyncFd<OwnedFd>,
}

/// One datagram received.
#[derive(Debug)]
pub(super) struct Datagram {
    /// Bytes received (at most the buffer's length).
    pub len: usize,
    /// Descriptors that came with it; closed when dropped.
    pub fds: Vec<OwnedFd>,
    /// The datagram was longer than the buffer (`MSG_TRUNC`).
    pub truncated: bool,
    /// Ancillary data did not fit (`MSG_CTRUNC`).
    pub control_truncated: bool,
    /// Nothing was received because the peer closed its end (EOF).
    pub eof: bool,
}

impl std::os::fd::AsFd for Seqpacket {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.get_ref().as_fd()
    }
}

impl Seqpacket {
    /// Wraps a connected, non-blocking socket.
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        Ok(Self { fd: register(fd)? })
    }

    /// A connected pair (tests, and a peer in-process).
    #[cfg(test)]
    pub fn pair() -> io::Result<(Self, Self)> {
        let (a, b) = socket::socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        )?;
        Ok((Self::new(a)?, Self::new(b)?))
    }

    /// Connects to the listener at `path` (a client: tests, a fake ztunnel).
    #[cfg(test)]
    pub fn connect(path: &Path) -> io::Result<Self> {
        let fd = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        socket::connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
        Self::new(fd)
    }

    /// The socket, for socket options (a peer's `shutdown` in tests).
    #[cfg(test)]
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Sends `bytes` as one datagram, with `fd` in an `SCM_RIGHTS` message when given.
    pub async fn send(&self, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<(), Errno> {
        let rights: Vec<RawFd> = fd.iter().map(|f| f.as_raw_fd()).collect();
        let cmsgs: Vec<ControlMessage<'_>> =
            if rights.is_empty() { Vec::new() } else { vec![ControlMessage::ScmRights(&rights)] };
        loop {
            let mut ready = self.fd.writable().await.map_err(errno)?;
            let sent = ready.try_io(|inner| {
                socket::sendmsg::<()>(
                    inner.as_raw_fd(),
                    &[IoSlice::new(bytes)],
                    &cmsgs,
                    MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
                    None,
                )
                .map_err(io::Error::from)
            });
            match sent {
                Ok(result) => return result.map(drop).map_err(errno),
                Err(_would_block) => continue,
            }
        }
    }

    /// Receives one datagram into `buf`. Cancel-safe: nothing is consumed until a
    /// datagram is taken whole.
    pub async fn recv(&self, buf: &mut [u8]) -> Result<Datagram, Errno> {
        loop {
            let mut ready = self.fd.readable().await.map_err(errno)?;
            let closed = ready.ready().is_read_closed();
            let received = ready.try_io(|inner| receive(inner.as_raw_fd(), buf).map_err(io::Error::from));
            match received {
                Ok(Ok(mut datagram)) => {
                    // A 0-byte read is EOF or an empty datagram: the peer is gone when
                    // the reactor saw the read side closed, or when it is closed now.
                    datagram.eof = datagram.len == 0
                        && !datagram.truncated
                        && (closed || read_side_closed(self.fd.as_raw_fd()));
                    return Ok(datagram);
                }
                Ok(Err(e)) => return Err(errno(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

/// One `recvmsg` without blocking, descriptors taken as owned.
fn receive(fd: RawFd, buf: &mut [u8]) -> Result<Datagram, Errno> {
    let mut control = cmsg_space!([RawFd; SCM_MAX_FD]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = socket::recvmsg::<()>(
        fd,
        &mut iov,
        Some(&mut control),
        MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
    )?;
    let mut fds = Vec::new();
    let control_truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
    if let Ok(cmsgs) = msg.cmsgs() {
        for cmsg in cmsgs {
            if let ControlMessageOwned::ScmRights(raw) = cmsg {
                // SAFETY: the kernel installed these descriptors in this process for
                // this message; nothing else refers to them.
                fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
            }
        }
    }
    Ok(Datagram {
        len: msg.bytes,
        fds,
        truncated: msg.flags.contains(MsgFlags::MSG_TRUNC),
        control_truncated,
        eof: false,
    })
}

/// `fd` on the runtime's reactor.
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the AsyncFd owns the descriptor, which stays open and the same for its
    // whole life.
    unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}

/// Whether the peer has closed: after EOF every read returns 0 bytes at once, while
/// after an empty datagram the next one is not there yet (or has bytes).
fn read_side_closed(fd: RawFd) -> bool {
    matches!(socket::recv(fd, &mut [0u8; 1], MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT), Ok(0))
}

fn errno(e: io::Error) -> Errno {
    e.raw_os_error().map(Errno::from_raw).unwrap_or(Errno::EIO)
}

/// The listening socket.
#[derive(Debug)]
pub(super) struct Listener {
    fd: AsyncFd<OwnedFd>,
    path: PathBuf,
    /// The socket file's (device, inode), to remove it at the end only if it is ours.
    file: (u64, u64),
}

impl Listener {
    /// Binds `path` `0600` in a directory only root writes
    /// ([`crate::node::local_socket::bind_private`]): a socket file left there is
    /// removed, anything else there refused.
    pub fn bind(path: &Path) -> Result<Self, ZdsError> {
        remove_stale(path)?;
        let fd = crate::node::local_socket::bind_private(path, |at| {
            let fd = socket::socket(
                AddressFamily::Unix,
                SockType::SeqPacket,
                SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
                None,
            )?;
            socket::bind(fd.as_raw_fd(), &UnixAddr::new(at)?)?;
            socket::listen(&fd, Backlog::new(128).unwrap_or(Backlog::MAXCONN))?;
            Ok(fd)
        })
        .map_err(|e| ZdsError::Socket { what: e.what, path: e.path, source: e.source })?;
        let meta = fs::symlink_metadata(path).map_err(|source| ZdsError::Socket {
            what: "stat the bound socket",
            path: path.into(),
            source,
        })?;
        let fd = register(fd).map_err(|source| ZdsError::Socket {
            what: "register with the runtime",
            path: path.into(),
            source,
        })?;
        Ok(Self { fd, path: path.into(), file: (meta.dev(), meta.ino()) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next connection, non-blocking and close-on-exec.
    pub async fn accept(&self) -> io::Result<Seqpacket> {
        loop {
            let mut ready = self.fd.readable().await?;
            let accepted = ready.try_io(|inner| {
                socket::accept4(inner.as_raw_fd(), SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC)
                    .map_err(io::Error::from)
            });
            match accepted {
                // SAFETY: accept4 returned a new descriptor that nothing else owns.
                Ok(result) => return Seqpacket::new(unsafe { OwnedFd::from_raw_fd(result?) }),
                Err(_would_block) => continue,
            }
        }
    }

    /// Removes the socket file if it is still the one this listener bound.
    pub fn remove_file(&self) {
        let ours = fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.file);
        if ours && let Err(e) = fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), error = %e, "could not remove the ZDS socket");
        }
    }
}

/// Removes a socket file left at `path` by an earlier agent; refuses anything else.
fn remove_stale(path: &Path) -> Result<(), ZdsError> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(ZdsError::Socket { what: "stat", path: path.into(), source }),
    };
    let kind = meta.file_type();
    if !kind.is_socket() {
        let found = match () {
            _ if kind.is_dir() => "a directory",
            _ if kind.is_symlink() => "a symbolic link",
            _ if kind.is_file() => "a regular file",
            _ => "a special file",
        };
        return Err(ZdsError::NotASocket { path: path.into(), found });
    }
    tracing::info!(path = %path.display(), "removing the ZDS socket an earlier agent left");
    fs::remove_file(path).map_err(|source| ZdsError::Socket {
        what: "remove the stale socket",
        path: path.into(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd as _;

    use super::*;

    #[tokio::test]
    async fn an_empty_datagram_is_not_eof_and_a_close_is() {
        let (a, b) = Seqpacket::pair().unwrap();
        let mut buf = [0u8; 16];
        b.send(&[], None).await.unwrap();
        let empty = a.recv(&mut buf).await.unwrap();
        assert_eq!((empty.len, empty.eof), (0, false));
        drop(b);
        let closed = a.recv(&mut buf).await.unwrap();
        assert_eq!((closed.len, closed.eof), (0, true));
    }

    #[tokio::test]
    async fn one_fd_travels_with_its_datagram_and_truncation_is_flagged() {
        let (a, b) = Seqpacket::pair().unwrap();
        let netns = fs::File::open("/proc/self/ns/net").unwrap();
        b.send(b"add", Some(netns.as_fd())).await.unwrap();
        let mut buf = [0u8; 16];
        let got = a.recv(&mut buf).await.unwrap();
        assert_eq!((&buf[..got.len], got.fds.len(), got.truncated), (&b"add"[..], 1, false));
        let ino = |fd: BorrowedFd<'_>| nix::sys::stat::fstat(fd).unwrap().st_ino;
        assert_eq!(ino(got.fds[0].as_fd()), ino(netns.as_fd()));
        b.send(&[7; 32], None).await.unwrap();
        let got = a.recv(&mut buf).await.unwrap();
        assert!(got.truncated && got.len == 16);
    }
}
