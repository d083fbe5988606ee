//! The agent's long-running services (relay, SDS, status server, DNS proxy, ...), each
//! a named task with its own stop signal. They are started in the agent's order and
//! watched while it runs: a service that ends before shutdown — with an error, by
//! panicking, or by returning at all — is reported by name, and the agent stops. At
//! shutdown they are stopped one by one in reverse order, each given a grace period
//! before it is aborted.

use std::{future::Future, time::Duration};

use futures::future::{BoxFuture, FutureExt as _};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How a service ended: its own error, or a panic.
#[derive(Debug, thiserror::Error)]
pub enum ServiceExit {
    #[error("{name} stopped on its own")]
    Returned { name: &'static str },
    #[error("{name} failed")]
    Failed {
        name: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{name} panicked: {message}")]
    Panicked { name: &'static str, message: String },
}

impl ServiceExit {
    /// The service that ended.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Returned { name } | Self::Failed { name, .. } | Self::Panicked { name, .. } => name,
        }
    }
}

type Outcome = Result<(), Box<dyn std::error::Error + Send + Sync>>;

struct Running {
    name: &'static str,
    stop: CancellationToken,
    /// Stopping is bounded by the grace `stop` is given; else by the service's own
    /// drain.
    bounded: bool,
    task: JoinHandle<Outcome>,
}

/// The started services, in start order.
#[derive(Default)]
pub struct Services {
    running: Vec<Running>,
}

impl Services {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts `service` under `name`: it gets a token that is cancelled when it is to
    /// stop, and should return `Ok` soon after (within the grace `stop` is given).
    pub fn start<F, E>(&mut self, name: &'static str, service: impl FnOnce(CancellationToken) -> F)
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.spawn(name, true, service);
    }

    /// As [`Services::start`], for a service whose stopping is a drain it bounds
    /// itself (Envoy's `terminationDrainDuration`): it is waited for, never aborted.
    pub fn start_draining<F, E>(&mut self, name: &'static str, service: impl FnOnce(CancellationToken) -> F)
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.spawn(name, false, service);
    }

    fn spawn<F, E>(&mut self, name: &'static str, bounded: bool, service: impl FnOnce(CancellationToken) -> F)
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
        E: std::error::Error + Send + Sync + 'static,
    {
        let stop = CancellationToken::new();
        let future = service(stop.clone());
        let span = tracing::info_span!("service", name);
        let task = tokio::spawn(tracing::Instrument::instrument(
            async move { future.await.map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>) },
            span,
        ));
        tracing::debug!(service = name, "started");
        self.running.push(Running { name, stop, bounded, task });
    }

    /// As [`Services::start`], for a service that cannot fail (it runs until stopped).
    pub fn start_infallible<F>(&mut self, name: &'static str, service: impl FnOnce(CancellationToken) -> F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.start(name, |stop| service(stop).map(Ok::<(), std::convert::Infallible>));
    }

    /// Waits until one service ends (never, when none runs) and says how; that
    /// service is no longer watched.
    pub fn first_exit(&mut self) -> BoxFuture<'_, ServiceExit> {
        async move {
            if self.running.is_empty() {
                return std::future::pending().await;
            }
            let (result, index, _) =
                futures::future::select_all(self.running.iter_mut().map(|r| &mut r.task)).await;
            let ended = self.running.remove(index);
            exit(ended.name, result)
        }
        .boxed()
    }

    /// Stops every service, last started first: cancels its token, waits up to
    /// `grace` for it to return (a draining service as long as it takes), then aborts
    /// it. Failures while stopping are logged.
    pub async fn stop(self, grace: Duration) {
        for Running { name, stop, bounded, mut task } in self.running.into_iter().rev() {
            stop.cancel();
            let ended =
                if bounded { tokio::time::timeout(grace, &mut task).await } else { Ok((&mut task).await) };
            match ended {
                Ok(Ok(Ok(()))) => tracing::debug!(service = name, "stopped"),
                Ok(result) => {
                    let e = exit(name, result);
                    tracing::warn!(service = name, error = %crate::error_chain(&e), "failed while stopping");
                }
                Err(_) => {
                    tracing::warn!(service = name, grace = ?grace, "did not stop in time: aborted");
                    task.abort();
                }
            }
        }
    }
}

fn exit(name: &'static str, result: Result<Outcome, tokio::task::JoinError>) -> ServiceExit {
    match result {
        Ok(Ok(())) => ServiceExit::Returned { name },
        Ok(Err(source)) => ServiceExit::Failed { name, source },
        Err(join) => {
            let message = match join.try_into_panic() {
                Ok(payload) => payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-string payload".into()),
                Err(join) => join.to_string(),
            };
            ServiceExit::Panicked { name, message }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("socket closed")]
    struct Closed;

    #[tokio::test]
    async fn a_failure_after_another_service_returned_is_still_seen() {
        let mut services = Services::new();
        services.start_infallible("quiet", |_| async {});
        services.start("sds server", |_| async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Err::<(), _>(Closed)
        });
        services.start_infallible("status server", |stop| async move { stop.cancelled().await });
        let first = services.first_exit().await;
        assert!(matches!(first, ServiceExit::Returned { name: "quiet" }), "{first}");
        let second = services.first_exit().await;
        assert_eq!(crate::error_chain(&second), "sds server failed: socket closed");
        services.stop(Duration::from_secs(1)).await;
    }

    #[tokio::test]
    async fn a_panic_is_reported_by_name() {
        let mut services = Services::new();
        services.start_infallible("xds relay", |_| async { panic!("boom") });
        let e = services.first_exit().await;
        assert_eq!(e.to_string(), "xds relay panicked: boom");
        assert_eq!(e.name(), "xds relay");
    }

    #[tokio::test]
    async fn services_stop_in_reverse_order_and_a_stuck_one_is_aborted() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut services = Services::new();
        for name in ["first", "second", "third"] {
            let order = order.clone();
            services.start_infallible(name, move |stop| async move {
                stop.cancelled().await;
                order.lock().unwrap().push(name);
            });
        }
        services.start_infallible("stuck", |_| std::future::pending());
        tokio::time::timeout(Duration::from_secs(5), services.stop(Duration::from_millis(100)))
            .await
            .unwrap();
        assert_eq!(*order.lock().unwrap(), ["third", "second", "first"]);
    }

    #[tokio::test]
    async fn with_nothing_running_nothing_exits() {
        let mut services = Services::new();
        assert!(tokio::time::timeout(Duration::from_millis(50), services.first_exit()).await.is_err());
    }
}
