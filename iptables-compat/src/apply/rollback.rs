//! Putting iptables back as a snapshot had it after a run failed part-way: the saved
//! tables restored whole, and from tables the snapshot did not have, only Istio's
//! chains and the jumps into them removed.

use super::error::CaptureError;
use crate::{
    iptables::{state, xtables::Xtables},
    kernel::netlink::Family,
};

/// Puts each family back to its snapshot: the saved tables restored whole; from tables
/// the snapshot did not have, Istio's chains and the jumps into them removed, and
/// nothing else (a chain or rule of another that appeared meanwhile stays: bare
/// `-F`/`-X` would take it too).
pub(crate) fn rollback_iptables(
    x: &mut dyn Xtables,
    cause: CaptureError,
    snapshots: &[(Family, Option<String>)],
) -> CaptureError {
    let mut failures = Vec::new();
    for (family, snapshot) in snapshots {
        // What was there before could not be read: removing Istio's chains could take
        // a capture this call did not make. Nothing is removed; the failure says so.
        let Some(before) = snapshot.as_deref() else {
            failures.push(format!(
                "{family:?}: the rules before this run could not be read (iptables-save failed): nothing removed"
            ));
            continue;
        };
        let Some(now) = x.save(*family) else { continue };
        if !before.trim().is_empty()
            && let Err(e) = x.restore(*family, before, false)
        {
            failures.push(e.to_string());
            continue;
        }
        let had = state::tables_in(before);
        for cmd in state::leftovers(&now).outside(&had).cleanup_commands() {
            if let Err(e) = x.run(*family, &cmd) {
                failures.push(e.to_string());
            }
        }
    }
    if failures.is_empty() {
        CaptureError::RolledBack { cause: Box::new(cause) }
    } else {
        CaptureError::RollbackFailed { cause: Box::new(cause), rollback: failures.join("; ") }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::xtables::XtablesError;

    /// An executor whose `save` answers with `now` and which records every change.
    struct Saved {
        now: String,
        changes: Vec<String>,
    }

    impl Xtables for Saved {
        fn save(&mut self, _family: Family) -> Option<String> {
            Some(self.now.clone())
        }
        fn restore(&mut self, _family: Family, input: &str, noflush: bool) -> Result<(), XtablesError> {
            self.changes.push(format!("restore noflush={noflush}: {}", input.trim()));
            Ok(())
        }
        fn run(&mut self, _family: Family, args: &[String]) -> Result<(), XtablesError> {
            self.changes.push(args.join(" "));
            Ok(())
        }
        fn is_real(&self) -> bool {
            true
        }
    }

    const NOW: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:FOREIGN - [0:0]\n\
                       :ISTIO_OUTPUT - [0:0]\n-A OUTPUT -j ISTIO_OUTPUT\n-A ISTIO_OUTPUT -j RETURN\nCOMMIT\n\
                       *filter\n:INPUT ACCEPT [0:0]\n:KEEP - [0:0]\n-A INPUT -j KEEP\nCOMMIT\n";

    fn rolled_back(snapshot: &str) -> Vec<String> {
        let mut x = Saved { now: NOW.into(), changes: Vec::new() };
        let cause = CaptureError::Drift { backend: "iptables" };
        let e = rollback_iptables(&mut x, cause, &[(Family::V4, Some(snapshot.into()))]);
        assert!(matches!(e, CaptureError::RolledBack { .. }), "{e}");
        x.changes
    }

    #[test]
    fn a_rollback_removes_istios_chains_and_nobody_elses() {
        // The fast path's snapshot: nothing was there (but a chain appeared meanwhile).
        let changes = rolled_back("");
        assert_eq!(
            changes,
            ["-t nat -D OUTPUT -j ISTIO_OUTPUT", "-t nat -F ISTIO_OUTPUT", "-t nat -X ISTIO_OUTPUT",]
        );
        // A snapshot of filter: restored whole; from nat, new since, only Istio's.
        let filter = "*filter\n:INPUT ACCEPT [0:0]\n:KEEP - [0:0]\n-A INPUT -j KEEP\nCOMMIT\n";
        let changes = rolled_back(filter);
        assert_eq!(changes[0], format!("restore noflush=false: {}", filter.trim()));
        assert_eq!(
            changes[1..],
            ["-t nat -D OUTPUT -j ISTIO_OUTPUT", "-t nat -F ISTIO_OUTPUT", "-t nat -X ISTIO_OUTPUT"]
        );
        for change in &changes {
            assert!(!change.contains("FOREIGN") && !change.contains("KEEP -X"), "{change}");
            assert!(change.split_whitespace().count() > 3, "a bare flush or delete of a table: {change}");
        }
    }

    /// A run whose `iptables-save` failed before it started cannot tell what it would
    /// take away: its rollback removes nothing and says so. Before, the unknown state
    /// was taken as empty and every ISTIO chain, a capture made before the run
    /// included, was removed.
    #[test]
    fn a_rollback_without_a_snapshot_removes_nothing() {
        let mut x = Saved { now: NOW.into(), changes: Vec::new() };
        let cause = CaptureError::Drift { backend: "iptables" };
        let e = rollback_iptables(&mut x, cause, &[(Family::V4, None)]);
        assert!(
            matches!(&e, CaptureError::RollbackFailed { rollback, .. } if rollback.contains("nothing removed")),
            "{e}"
        );
        assert!(x.changes.is_empty(), "{:?}", x.changes);
    }
}
