//! Envoy's lifecycle: its bootstrap (`bootstrap`), what its user must reach (`access`), its command line, launch,
//! graceful drain (`process`), supervision (`supervisor`), its admin API (`admin`) and whether it
//! is ready to serve (`readiness`).

pub mod access;
pub mod admin;
pub mod bootstrap;
pub mod process;
pub mod readiness;
pub mod supervisor;

pub use admin::EnvoyAdmin;
pub use process::{DrainPolicy, EnvoyProcess, EnvoySettings};
pub use readiness::Readiness;
pub use supervisor::{LifecycleControl, Supervisor};
