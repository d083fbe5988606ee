//! Envoy's lifecycle: its bootstrap (`bootstrap`), its command line, launch,
//! supervision and graceful drain (`process`), its admin API (`admin`) and whether it
//! is ready to serve (`readiness`).

pub mod admin;
pub mod bootstrap;
pub mod process;
pub mod readiness;

pub use admin::EnvoyAdmin;
pub use process::{DrainPolicy, EnvoyProcess, EnvoySettings};
pub use readiness::Readiness;
