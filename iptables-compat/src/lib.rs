//! weir-iptables: Istio's capture rules (ISTIO_INBOUND, ISTIO_REDIRECT,
//! ISTIO_IN_REDIRECT, ISTIO_OUTPUT, ...) as a pure plan from a capture config
//! ([`plan::plan`], [`nft::plan`]), rendered for iptables-restore ([`render`]) and
//! native nftables ([`nft::render`]), then applied, verified, reconciled and cleaned
//! ([`apply`]) in one transaction per family. TPROXY's policy routes go over netlink
//! ([`routes`], [`netlink`]). [`flags`] is istio-iptables' command line.

pub mod ambient;
pub mod apply;
pub mod explain;
pub mod inputs;
pub mod iptables;
pub mod kernel;
pub mod nft;
pub mod nft_exec;
pub mod nft_wire;
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
