//! weir-iptables: Istio's capture rules (ISTIO_INBOUND, ISTIO_REDIRECT,
//! ISTIO_IN_REDIRECT, ISTIO_OUTPUT, ...) as a pure plan from a capture config
//! ([`plan::plan`], [`nft::plan`]), rendered for iptables-restore ([`render`]) and
//! native nftables ([`nft::render`]), then applied, verified, reconciled and cleaned
//! ([`apply`]) in one transaction per family. TPROXY's policy routes go over netlink
//! ([`kernel::routes`], [`netlink`]). [`flags`] is istio-iptables' command line.
//!
//! Laid out by job, each folder importing only those listed before it:
//! - [`inputs`]: the capture configuration, the command line, detected facts;
//! - [`kernel`]: rtnetlink and netfilter netlink, in process;
//! - [`iptables`], [`nft`]: each back end's plan, text, state and executors;
//! - [`outcome`]: what a run did (shared by [`nft`] and [`apply`]);
//! - [`apply`]: runs that take a plan into a namespace, the fast path among them;
//! - [`ambient`]: ambient mode's rules and runs;
//! - [`explain`] and [`validation`]: which rule a connection meets, and Istio's
//!   validation probe.

pub mod ambient;
pub mod apply;
pub mod explain;
pub mod inputs;
pub mod iptables;
pub mod kernel;
pub mod nft;
pub mod outcome;
pub mod validation;

pub use apply::{CaptureError, Report, program};
pub use inputs::config::{CaptureConfig, ConfigError, RunOptions};
pub use outcome::{Action, ApplyPath, Backend};

// The paths other crates (the agent, the tests) use, from before the modules were
// laid out in folders by job.
pub use inputs::{config, decisions, detect, flags};
pub use iptables::{plan, render, state, xt_wire, xtables};
pub use kernel::{ipset, netlink, nft_batch};
pub use nft::{exec as nft_exec, wire as nft_wire};
