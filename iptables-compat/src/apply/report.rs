//! What a run returns when it succeeds ([`Report`]): its backend, the state it found,
//! what it did, which way it went, and a dry run's transcript.

use crate::{
    iptables::state::Verdict,
    outcome::{Action, ApplyPath, Backend},
};

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct Report {
    pub backend: Backend,
    pub verdict: Option<Verdict>,
    pub action: Action,
    /// Which path the run took (logged as `path`).
    pub path: ApplyPath,
    /// Dry run: what would have run (Istio's transcript, or the nft transaction).
    pub transcript: Option<String>,
}
