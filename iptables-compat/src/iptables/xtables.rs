//! Running iptables: choosing the binaries the way Istio does (legacy if it already
//! holds rules, else nft, else plain `iptables`; or what FORCE_IPTABLES_BINARY says),
//! the xtables lock (`lock`), and an executor interface with two implementations:
//! the system's binaries, and a recorder that writes Istio's dry-run transcript
//! instead.
//!
//! One job a module: `executor` is the interface, its error and the recorder;
//! `binaries` what detection finds and reads; `lock` how each command is confined;
//! `system` the detection and the runs on the system.

mod binaries;
mod executor;
mod lock;
mod system;

pub use binaries::{Binaries, has_rules, parse_version};
pub use executor::{Recorder, Xtables, XtablesError};
pub use lock::{Confinement, LOCK_WAIT_SECS, LOCKFILE_ENV_VERSION, Lock, NODE_LOCK};
pub use system::{SystemXtables, TEST_RULE};
