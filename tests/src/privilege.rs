//! Whether a privileged test can run here: root with the capabilities namespaces,
//! netfilter and eBPF need. A test that cannot run fails, naming what is missing: a
//! green run means every test ran (`scripts/test` also refuses to start without them).

use weir_agent::support::privileges::{self, Capability};

/// What the rig's privileged tests need.
pub const NEEDED: &[Capability] = &[Capability::SysAdmin, Capability::NetAdmin, Capability::Bpf];

/// Panics, naming the missing capabilities, unless this process has them all.
pub fn require(test: &str) {
    if let Err(e) = privileges::require(NEEDED, "this test") {
        panic!("{test} cannot run: {e} (run the suite as root with these capabilities: sudo scripts/test)")
    }
}
