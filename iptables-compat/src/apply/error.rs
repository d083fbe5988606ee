//! Why programming capture failed ([`CaptureError`]): every back end's error, drift
//! refused, a rollback and how it went, and the namespace, runtime, sysctl and name
//! checks around a run.

use crate::{
    inputs::config::ConfigError, iptables::xtables::XtablesError, kernel::netlink::NetlinkError,
    nft::exec::NftError,
};

/// Why programming capture failed.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error(transparent)]
    Xtables(#[from] XtablesError),
    #[error(transparent)]
    Nft(#[from] NftError),
    #[error(
        "the {backend} capture rules in this namespace differ from the ones planned; \
         re-run with --reconcile to repair them or --cleanup-only to remove them (nothing was changed)"
    )]
    Drift { backend: &'static str },
    #[error("TPROXY policy routing")]
    Routes(#[source] NetlinkError),
    #[error("applying failed and the namespace was restored to its state before this run")]
    RolledBack {
        #[source]
        cause: Box<CaptureError>,
    },
    #[error("applying failed, and restoring the previous state also failed: {rollback}")]
    RollbackFailed {
        #[source]
        cause: Box<CaptureError>,
        rollback: String,
    },
    #[error("enter network namespace {path}")]
    Netns {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("tokio runtime for netlink")]
    Runtime(#[source] std::io::Error),
    #[error("write {path}")]
    Sysctl {
        path: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} (nothing was changed)")]
    Config(#[from] ConfigError),
    #[error("{input} names {kind} {name:?}, which does not exist on this host (nothing was changed)")]
    UnknownName { input: &'static str, kind: &'static str, name: String },
}
