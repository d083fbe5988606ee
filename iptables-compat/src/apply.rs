//! Applying a plan to a namespace, Istio's way and then some: read the current state
//! and classify it (clean / applied / drifted); apply a clean namespace in one restore
//! per family (or one nft transaction); leave an applied one alone; repair drift only
//! with `--reconcile` (behind Istio's guardrails); and if anything fails part-way, put
//! the namespace back as it was before the run. Executors are passed in (the system's
//! tools or dry-run recorders); `system` runs it all on the system.
//!
//! One job a module: [`CaptureError`] (`error`) and [`Report`] (`report`) are what a
//! run returns; `iptables` and `nft` are the runs through each backend's executor,
//! `rollback` puts iptables back after a failure, [`fast_path`] skips what the
//! in-process probe settles, `names` checks user and group names, `dry_run` runs with
//! recorders, and `system` is the whole run on the system (rules, then routes).

mod dry_run;
mod error;
pub mod fast_path;
pub(crate) mod iptables;
mod names;
mod nft;
mod report;
pub(crate) mod rollback;
mod system;

pub use error::CaptureError;
pub use iptables::program_iptables;
pub use names::check_names;
pub use nft::program_nft;
pub use report::Report;
pub use system::{in_netns, program, verify};

pub use crate::outcome::{Action, ApplyPath, Backend};
