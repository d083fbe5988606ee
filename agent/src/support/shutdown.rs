//! The process's one shutdown signal. [`Shutdown::watch`] installs the SIGTERM and
//! SIGINT handlers at once (a signal that arrives while the caller is still starting is
//! then never met by the default action, which would end it half way) and hands out a
//! token every task can wait on. The first signal cancels the token and is logged by
//! name; a second one while the process stops ends it at once with exit code 1, as an
//! operator who presses Ctrl-C twice expects.

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// The shutdown token of a process, cancelled by its first SIGTERM or SIGINT.
#[derive(Debug, Clone)]
pub struct Shutdown {
    token: CancellationToken,
}

impl Shutdown {
    /// Installs the handlers and starts watching them. Needs a tokio runtime entered
    /// (its task runs once the runtime does).
    pub fn watch() -> std::io::Result<Self> {
        let mut term = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        let token = CancellationToken::new();
        let cancel = token.clone();
        tokio::spawn(async move {
            let first = next(&mut term, &mut interrupt).await;
            tracing::info!(signal = first, "stopping");
            cancel.cancel();
            let second = next(&mut term, &mut interrupt).await;
            tracing::warn!(signal = second, "a second signal while stopping: exiting now");
            std::process::exit(i32::from(super::exit::FAILURE));
        });
        Ok(Self { token })
    }

    /// A token cancelled at the first signal (a child of the process's token).
    pub fn token(&self) -> CancellationToken {
        self.token.child_token()
    }

    /// Resolves at the first signal.
    pub async fn requested(&self) {
        self.token.cancelled().await;
    }

    /// Whether the first signal has come.
    pub fn is_requested(&self) -> bool {
        self.token.is_cancelled()
    }
}

/// The name of the next signal of the two.
async fn next(term: &mut Signal, interrupt: &mut Signal) -> &'static str {
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = interrupt.recv() => "SIGINT",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first SIGTERM cancels the token. (A second one ends the process, which a
    /// test in this process cannot watch.)
    #[tokio::test]
    async fn the_first_sigterm_cancels_every_token() {
        let shutdown = Shutdown::watch().unwrap();
        let token = shutdown.token();
        assert!(!shutdown.is_requested());
        // SAFETY: raise(3) of a signal whose handler tokio installed above.
        assert_eq!(unsafe { libc::raise(libc::SIGTERM) }, 0);
        tokio::time::timeout(std::time::Duration::from_secs(5), token.cancelled()).await.expect("cancelled");
        assert!(shutdown.is_requested());
    }
}
