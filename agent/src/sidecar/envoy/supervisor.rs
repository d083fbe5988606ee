//! Envoy supervised for the agent's whole life: started, watched, and on exit either
//! reported (Istio's behaviour: the agent exits and the kubelet restarts the
//! container) or started again with backoff (`WEIR_RESTART_ENVOY`, for VMs); on stop,
//! drained and ended per the `DrainPolicy`. `LifecycleControl` is what the status
//! server's `/drain` and `/quitquitquit` may ask of it.

use std::{
    os::unix::process::ExitStatusExt as _,
    process::ExitStatus,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use tokio_util::sync::CancellationToken;

use super::{
    EnvoyProcess, EnvoySettings, Readiness,
    admin::{AdminError, EnvoyAdmin},
    process::{EnvoyError, RunAs},
};

/// First restart delay; doubles per quick failure up to `MAX_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// An Envoy that ran this long before exiting resets the backoff.
const STABLE_RUN: Duration = Duration::from_secs(60);

/// Requests the status server passes on: drain now, or quit.
#[derive(Clone)]
pub struct LifecycleControl {
    admin: Option<EnvoyAdmin>,
    inbound_only: bool,
    drained: Arc<AtomicBool>,
    quit: CancellationToken,
}

impl LifecycleControl {
    /// `admin`: `None` when no Envoy runs (`DISABLE_ENVOY`).
    pub fn new(admin: Option<EnvoyAdmin>, inbound_only: bool) -> Self {
        Self { admin, inbound_only, drained: Arc::default(), quit: CancellationToken::new() }
    }

    /// `POST /drain`: drain Envoy's listeners now and keep it running; termination
    /// later skips the drain period.
    pub async fn drain_now(&self) -> Result<(), AdminError> {
        self.drained.store(true, Ordering::SeqCst);
        match self.admin {
            Some(admin) => admin.drain(self.inbound_only, true).await,
            None => Ok(()),
        }
    }

    /// `POST /quitquitquit`: exit now, without a drain period.
    pub fn quit(&self) {
        self.drained.store(true, Ordering::SeqCst);
        self.quit.cancel();
    }

    pub fn already_drained(&self) -> bool {
        self.drained.load(Ordering::SeqCst)
    }

    /// Resolves once `/quitquitquit` was called.
    pub async fn quit_requested(&self) {
        self.quit.cancelled().await
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error(transparent)]
    Envoy(#[from] EnvoyError),
    #[error("Envoy exited on its own ({}){}", describe(*.status), oom_hint(*.status))]
    Exited { status: ExitStatus },
}

/// "exit code 1", "killed by signal 9 (SIGKILL)".
pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => {
            let name = nix::sys::signal::Signal::try_from(sig).map(|s| s.as_str()).unwrap_or("unknown");
            format!("killed by signal {sig} ({name})")
        }
        _ => status.to_string(),
    }
}

fn oom_hint(status: ExitStatus) -> &'static str {
    if status.signal() == Some(libc::SIGKILL) {
        "; SIGKILL often means the out-of-memory killer: check the container's memory limit"
    } else {
        ""
    }
}

/// One Envoy, started by `run`.
pub struct Supervisor {
    pub settings: EnvoySettings,
    pub args: Vec<String>,
    /// Who Envoy runs as (the proxy user when the agent is root).
    pub run_as: Option<RunAs>,
    pub readiness: Arc<Readiness>,
    /// Sidecars drain inbound listeners only, gateways all of them.
    pub inbound_only: bool,
    /// `downstream_cx_active` stats of Istio's own listeners, not counted as user
    /// connections when waiting for zero.
    pub ignored_listeners: Vec<String>,
}

impl Supervisor {
    /// Runs Envoy until `stop` (then drains and ends it: `Ok` with its status) or
    /// until it exits on its own without restarts (`Err(Exited)`).
    pub async fn run(
        self,
        stop: CancellationToken,
        control: LifecycleControl,
    ) -> Result<ExitStatus, SupervisorError> {
        let mut backoff = FIRST_BACKOFF;
        let mut restarts = 0u32;
        loop {
            let mut envoy = EnvoyProcess::spawn(&self.settings, &self.args, self.run_as)?;
            let started = Instant::now();
            let exited = tokio::select! {
                status = envoy.wait() => Some(status?),
                _ = stop.cancelled() => None,
            };
            let Some(status) = exited else {
                self.readiness.set_draining();
                let policy = (!control.already_drained()).then_some(self.settings.drain);
                let status = envoy.terminate(policy, self.inbound_only, &self.ignored_listeners).await;
                tracing::info!(status = %describe(status), "Envoy stopped");
                return Ok(status);
            };
            self.readiness.reset();
            if !self.settings.restart {
                return Err(SupervisorError::Exited { status });
            }
            if started.elapsed() >= STABLE_RUN {
                backoff = FIRST_BACKOFF;
            }
            restarts += 1;
            tracing::error!(
                status = %describe(status),
                restarts,
                backoff = ?backoff,
                "Envoy exited on its own; starting it again (WEIR_RESTART_ENVOY)"
            );
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.cancelled() => return Ok(status),
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_read_as_operators_expect() {
        assert_eq!(describe(ExitStatus::from_raw(1 << 8)), "exit code 1");
        assert_eq!(describe(ExitStatus::from_raw(libc::SIGKILL)), "killed by signal 9 (SIGKILL)");
        let e = SupervisorError::Exited { status: ExitStatus::from_raw(libc::SIGKILL) }.to_string();
        assert!(e.contains("out-of-memory"), "{e}");
        let e = SupervisorError::Exited { status: ExitStatus::from_raw(0) }.to_string();
        assert_eq!(e, "Envoy exited on its own (exit code 0)");
    }
}
