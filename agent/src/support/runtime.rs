//! The tokio runtimes Weir's processes and their helper threads run on, built in one
//! place: every runtime has its I/O and time drivers, and a runtime that cannot be
//! built is an error naming what was being started.

use tokio::runtime::{Builder, Runtime};

/// Why a runtime could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot start the runtime for {purpose}")]
pub struct RuntimeError {
    purpose: &'static str,
    #[source]
    source: std::io::Error,
}

/// A runtime on the calling thread, for `purpose` (named in the error).
pub fn current_thread(purpose: &'static str) -> Result<Runtime, RuntimeError> {
    Builder::new_current_thread().enable_all().build().map_err(|source| RuntimeError { purpose, source })
}

/// A runtime with `workers` worker threads, for `purpose`.
pub fn workers(purpose: &'static str, workers: usize) -> Result<Runtime, RuntimeError> {
    Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .map_err(|source| RuntimeError { purpose, source })
}
