//! Whether a privileged test can run here: root with the capabilities namespaces,
//! netfilter and eBPF need. Skips loudly outside CI; fails inside CI.

use weir_agent::privileges::{self, Capability};

/// What the rig's privileged tests need.
pub const NEEDED: &[Capability] = &[Capability::SysAdmin, Capability::NetAdmin, Capability::Bpf];

/// True if the test may proceed. Prints a skip line otherwise, or panics when the `CI`
/// environment variable is set.
pub fn privileged(test: &str) -> bool {
    match privileges::require(NEEDED, "this test") {
        Ok(()) => true,
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("{test}: cannot run in CI: {e}")
        }
        Err(e) => {
            eprintln!("SKIP {test}: {e} (run the suite as root)");
            false
        }
    }
}
