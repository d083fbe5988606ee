//! Accepting connections as a server in a busy pod must. An accept error is one of
//! three kinds: the process or the system ran out of something (file descriptors,
//! memory, socket buffers) — retried after a pause that doubles from 5 ms to 1 s, as
//! Go's net/http does, so a full descriptor table costs no core; one connection died
//! before it was taken (`accept(2)` passes its network error on) — the next one is
//! taken at once; anything else means the listener itself is broken — returned, so
//! the service ends and its supervisor sees why (tonic's own loop would retry it
//! forever, busy). A Unix listener that was shut down is broken too: Linux then
//! answers `accept` with EAGAIN while reporting it readable, which tokio's own accept
//! retries without end inside one poll, a worker thread lost to a busy loop.

use std::{
    future::Future,
    io,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::Stream;

/// The first pause after an exhausted accept, and the longest.
pub const FIRST_PAUSE: Duration = Duration::from_millis(5);
pub const MAX_PAUSE: Duration = Duration::from_secs(1);

/// What an accept error says about the listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Out of a resource: pause, then accept again.
    Exhausted,
    /// One pending connection failed: accept the next.
    Connection,
    /// The listener cannot accept any more.
    Broken,
}

impl Failure {
    pub fn of(e: &io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => Self::Exhausted,
            // accept(2): "should be treated like EAGAIN by retrying", and a firewall's
            // EPERM for one connection.
            Some(
                libc::EAGAIN
                | libc::EINTR
                | libc::ECONNABORTED
                | libc::ECONNRESET
                | libc::EPROTO
                | libc::EPERM
                | libc::ENETDOWN
                | libc::ENOPROTOOPT
                | libc::EHOSTDOWN
                | libc::ENONET
                | libc::EHOSTUNREACH
                | libc::EOPNOTSUPP
                | libc::ENETUNREACH
                | libc::ETIMEDOUT,
            ) => Self::Connection,
            Some(_) => Self::Broken,
            None => match e.kind() {
                io::ErrorKind::OutOfMemory => Self::Exhausted,
                io::ErrorKind::Interrupted
                | io::ErrorKind::WouldBlock
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::TimedOut => Self::Connection,
                _ => Self::Broken,
            },
        }
    }
}

/// The next connection from `accept` (a listener's accept, called again as needed);
/// an error only when the listener is broken. `listener` names it in logs.
pub async fn next<T, F, Fut>(listener: &str, mut accept: F) -> io::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = io::Result<T>>,
{
    let mut pause = FIRST_PAUSE;
    loop {
        let e = match accept().await {
            Ok(connection) => return Ok(connection),
            Err(e) => e,
        };
        match Failure::of(&e) {
            Failure::Exhausted => {
                tracing::warn!(listener, error = %e, retry_in = ?pause, "cannot accept a connection");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
            Failure::Connection => {
                tracing::debug!(listener, error = %e, "a connection failed before it was accepted")
            }
            Failure::Broken => {
                tracing::error!(listener, error = %e, "the listener is broken: no more connections");
                return Err(e);
            }
        }
    }
}

/// Where a stream of connections keeps the error that ended it.
#[derive(Clone, Default)]
pub struct Broken(Arc<Mutex<Option<io::Error>>>);

impl Broken {
    /// The listener's error, once the stream has ended on one.
    pub fn take(&self) -> Option<io::Error> {
        self.0.lock().expect("accept error lock").take()
    }
}

/// A Unix listener whose shutdown is seen: readable with the read side closed.
struct UnixAcceptor(tokio::io::unix::AsyncFd<std::os::unix::net::UnixListener>);

impl UnixAcceptor {
    fn new(listener: tokio::net::UnixListener) -> io::Result<Self> {
        let listener = listener.into_std()?;
        listener.set_nonblocking(true)?;
        // SAFETY: the listener owns its descriptor, open and the same for its life,
        // and the AsyncFd owns the listener.
        unsafe { tokio::io::unix::AsyncFd::register_with_interest(listener, tokio::io::Interest::READABLE) }
            .map(Self)
            .map_err(|e| e.into_parts().1)
    }

    async fn accept(&self) -> io::Result<tokio::net::UnixStream> {
        loop {
            let mut ready = self.0.readable().await?;
            if ready.ready().is_read_closed() {
                return Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    "the listening socket was shut down",
                ));
            }
            match ready.try_io(|listener| listener.get_ref().accept()) {
                Ok(accepted) => {
                    let (stream, _) = accepted?;
                    stream.set_nonblocking(true)?;
                    return tokio::net::UnixStream::from_std(stream);
                }
                Err(_would_block) => continue,
            }
        }
    }
}

/// A Unix listener's connections as a stream for a gRPC server: accepted as [`next`]
/// accepts, the stream ending when the listener breaks (the error is kept in the
/// returned [`Broken`], for the server's caller to return).
pub fn unix_incoming(
    listener: tokio::net::UnixListener,
    name: &'static str,
) -> (impl Stream<Item = io::Result<tokio::net::UnixStream>>, Broken) {
    let broken = Broken::default();
    let keep = broken.clone();
    let acceptor = UnixAcceptor::new(listener);
    let stream = futures::stream::unfold(Some(acceptor), move |acceptor| {
        let keep = keep.clone();
        async move {
            let acceptor = match acceptor? {
                Ok(acceptor) => acceptor,
                Err(e) => {
                    *keep.0.lock().expect("accept error lock") = Some(e);
                    return None;
                }
            };
            match next(name, || acceptor.accept()).await {
                Ok(stream) => Some((Ok(stream), Some(Ok(acceptor)))),
                Err(e) => {
                    *keep.0.lock().expect("accept error lock") = Some(e);
                    None
                }
            }
        }
    });
    (stream, broken)
}

/// Why a gRPC server on a Unix socket stopped before it was asked to.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
    #[error("its socket no longer accepts connections")]
    Listener(#[source] io::Error),
}

impl ServeError {
    /// The outcome of a server that served the stream `broken` belongs to.
    pub fn check(served: Result<(), tonic::transport::Error>, broken: &Broken) -> Result<(), Self> {
        served?;
        broken.take().map_or(Ok(()), |e| Err(Self::Listener(e)))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn os(code: i32) -> io::Error {
        io::Error::from_raw_os_error(code)
    }

    #[test]
    fn errors_are_told_apart() {
        assert_eq!(Failure::of(&os(libc::EMFILE)), Failure::Exhausted);
        assert_eq!(Failure::of(&os(libc::ENFILE)), Failure::Exhausted);
        assert_eq!(Failure::of(&os(libc::ENOBUFS)), Failure::Exhausted);
        assert_eq!(Failure::of(&os(libc::ECONNABORTED)), Failure::Connection);
        assert_eq!(Failure::of(&os(libc::EPROTO)), Failure::Connection);
        assert_eq!(Failure::of(&os(libc::EINVAL)), Failure::Broken);
        assert_eq!(Failure::of(&os(libc::EBADF)), Failure::Broken);
        assert_eq!(Failure::of(&io::Error::other("?")), Failure::Broken);
    }

    /// Out of file descriptors: the loop pauses instead of spinning (a spinning loop
    /// makes hundreds of thousands of attempts in the same time), and takes the
    /// connection once one is to be had.
    #[tokio::test]
    async fn an_exhausted_accept_backs_off_and_recovers() {
        let attempts = AtomicUsize::new(0);
        let started = tokio::time::Instant::now();
        let accept = || {
            let n = attempts.fetch_add(1, Ordering::Relaxed);
            async move {
                if started.elapsed() < Duration::from_millis(300) { Err(os(libc::EMFILE)) } else { Ok(n) }
            }
        };
        let got = next("test", accept).await.unwrap();
        let made = attempts.load(Ordering::Relaxed);
        // 5 + 10 + 20 + 40 + 80 + 160 ms: about 7 attempts in 300 ms.
        assert!(made <= 10, "{made} accept attempts in 300 ms");
        assert_eq!(got, made - 1);
    }

    #[tokio::test]
    async fn a_failed_connection_is_skipped_and_a_broken_listener_ends_the_loop() {
        let mut errors = vec![os(libc::EINVAL), os(libc::ECONNABORTED)];
        let e = next("test", || {
            let e = errors.pop();
            async move { e.map_or(Ok(()), Err) }
        })
        .await
        .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    }

    /// A Unix listener shut down under the server ends the stream with its error
    /// (tokio's own accept spins on it, and tonic's loop never returns).
    #[tokio::test]
    async fn a_unix_listener_shut_down_ends_the_stream_with_its_error() {
        use std::os::fd::AsRawFd as _;

        use futures::StreamExt as _;
        let dir = tempfile::tempdir().unwrap();
        let listener = tokio::net::UnixListener::bind(dir.path().join("socket")).unwrap();
        let fd = listener.as_raw_fd();
        let (incoming, broken) = unix_incoming(listener, "test");
        let mut incoming = std::pin::pin!(incoming);
        let _client = tokio::net::UnixStream::connect(dir.path().join("socket")).await.unwrap();
        assert!(incoming.next().await.unwrap().is_ok());
        // SAFETY: the listener's descriptor is open (the stream owns it).
        assert_eq!(unsafe { libc::shutdown(fd, libc::SHUT_RDWR) }, 0);
        let ended = tokio::time::timeout(Duration::from_secs(5), incoming.next()).await.unwrap();
        assert!(ended.is_none());
        let e = ServeError::check(Ok(()), &broken).unwrap_err();
        assert_eq!(
            crate::error_chain(&e),
            "its socket no longer accepts connections: the listening socket was shut down"
        );
    }
}
