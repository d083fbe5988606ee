//! Applying a plan to a namespace, Istio's way and then some: read the current state
//! and classify it (clean / applied / drifted); apply a clean namespace in one restore
//! per family (or one nft transaction); leave an applied one alone; repair drift only
//! with `--reconcile` (behind Istio's guardrails); and if anything fails part-way, put
//! the namespace back as it was before the run. Executors are passed in (the system's
//! tools or dry-run recorders); [`system`] runs it all on the system.

mod system;

pub use system::{in_netns, program, verify};

pub use crate::outcome::{Action, ApplyPath, Backend};
use crate::{
    config::{CaptureConfig, RunOptions},
    netlink::{Family, NetlinkError},
    nft::{self},
    nft_exec::{Nft, NftError},
    plan, render,
    state::{self, Verdict},
    xtables::{Xtables, XtablesError},
};

/// Why programming capture failed.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error(transparent)]
    Xtables(#[from] XtablesError),
    #[error(transparent)]
    Nft(#[from] NftError),
    #[error(
        "the {backend} capture rules in this namespace differ from the ones planned; \
         re-run with --reconcile to repair them or --cleanup-only to remove them (nothing was changed)"
    )]
    Drift { backend: &'static str },
    #[error("TPROXY policy routing")]
    Routes(#[source] NetlinkError),
    #[error("applying failed and the namespace was restored to its state before this run")]
    RolledBack {
        #[source]
        cause: Box<CaptureError>,
    },
    #[error("applying failed, and restoring the previous state also failed: {rollback}")]
    RollbackFailed {
        #[source]
        cause: Box<CaptureError>,
        rollback: String,
    },
    #[error("enter network namespace {path}")]
    Netns {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("tokio runtime for netlink")]
    Runtime(#[source] std::io::Error),
    #[error("write {path}")]
    Sysctl {
        path: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} (nothing was changed)")]
    Config(#[from] crate::config::ConfigError),
    #[error("{input} names {kind} {name:?}, which does not exist on this host (nothing was changed)")]
    UnknownName { input: &'static str, kind: &'static str, name: String },
}

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

/// Programs Istio's iptables rules through `x` (the system's binaries, or a recorder
/// for a dry run). Routes are not touched here; see [`program`].
pub fn program_iptables(
    cfg: &CaptureConfig,
    opts: &RunOptions,
    x: &mut dyn Xtables,
) -> Result<Report, CaptureError> {
    // Verify, as Istio's VerifyIptablesState: both families are always read.
    let saves = (x.save(Family::V4), x.save(Family::V6));
    program_iptables_from(cfg, opts, x, saves)
}

/// [`program_iptables`] with both families' `iptables-save` already read.
pub(crate) fn program_iptables_from(
    cfg: &CaptureConfig,
    opts: &RunOptions,
    x: &mut dyn Xtables,
    saves: (Option<String>, Option<String>),
) -> Result<Report, CaptureError> {
    let rollback = saves.clone();
    program_plan_from(&plan::plan(cfg), opts, x, saves, rollback, true)
}

/// [`program_iptables_from`] for any plan (the ambient node agent's too): verify,
/// reconcile or refuse, apply, roll back on failure. `log_final_state` reads each
/// programmed family's state afterwards, as istio-iptables logs it (the ambient node
/// agent does not). `rollback` is each family's whole state before the run, which a
/// failure restores (the verify's `saves` may leave out what the plan does not own).
pub(crate) fn program_plan_from(
    plan: &plan::RulePlan,
    opts: &RunOptions,
    x: &mut dyn Xtables,
    (save4, save6): (Option<String>, Option<String>),
    (rollback4, rollback6): (Option<String>, Option<String>),
    log_final_state: bool,
) -> Result<Report, CaptureError> {
    let restore4 = render::restore(&plan.v4);
    let restore6 = render::restore(&plan.v6);
    let checks4 = render::checks(&plan.v4);
    let checks6 = render::checks(&plan.v6);
    let v4 =
        state::verify_family(save4.as_deref(), &restore4, &checks4, |cmd| x.run(Family::V4, cmd).is_ok());
    let v6 =
        state::verify_family(save6.as_deref(), &restore6, &checks6, |cmd| x.run(Family::V6, cmd).is_ok());
    let verdict = state::combine(&[v4, v6]);
    tracing::info!(?verdict, "iptables state");

    if verdict == Verdict::Drifted && !opts.reconcile && !opts.force_apply && !opts.cleanup_only {
        return Err(CaptureError::Drift { backend: "iptables" });
    }
    let cleanup = opts.cleanup_only || (verdict == Verdict::Drifted && opts.reconcile);
    let apply = !opts.cleanup_only && (verdict != Verdict::Applied || opts.force_apply);
    let mut families = vec![Family::V4];
    if plan.ipv6 {
        families.push(Family::V6);
    }

    let mut guarded: Vec<Family> = Vec::new();
    let result = (|| -> Result<(), CaptureError> {
        if cleanup {
            if !opts.cleanup_only {
                tracing::info!("setting up guardrails");
                for family in &families {
                    for cmd in render::guardrails_cleanup() {
                        let _ = x.run(*family, &cmd);
                    }
                    for cmd in render::guardrails() {
                        x.run(*family, &cmd)?;
                    }
                    guarded.push(*family);
                }
            }
            tracing::info!("removing existing Istio rules");
            cleanup_family(x, Family::V4, &plan.v4, save4.as_deref());
            if plan.ipv6 || save6.is_some() {
                cleanup_family(x, Family::V6, &plan.v6, save6.as_deref());
            }
        }
        if apply {
            x.restore(Family::V4, &restore4, true)?;
            if plan.ipv6 && !restore6.is_empty() {
                x.restore(Family::V6, &restore6, true)?;
            }
        }
        Ok(())
    })();
    for family in guarded {
        for cmd in render::guardrails_cleanup() {
            let _ = x.run(family, &cmd);
        }
    }
    if let Err(cause) = result {
        if !x.is_real() {
            return Err(cause);
        }
        return Err(rollback_iptables(x, cause, &[(Family::V4, rollback4), (Family::V6, rollback6)]));
    }

    // Istio logs the final state of each family it programmed.
    for (family, name) in [(Family::V4, "IPv4"), (Family::V6, "IPv6")] {
        if log_final_state
            && (family == Family::V4 || plan.ipv6)
            && let Some(state) = x.save(family)
        {
            tracing::info!("Final iptables state ({name}):\n{state}");
        }
    }
    let action = match (opts.cleanup_only, verdict, opts.force_apply) {
        (true, _, _) => Action::Cleaned,
        (false, Verdict::Applied, false) => Action::AlreadyApplied,
        (false, Verdict::Drifted, _) if opts.reconcile => Action::Reconciled,
        (false, Verdict::Clean, _) => Action::Applied,
        (false, _, true) => Action::ForceApplied,
        (false, _, false) => Action::Applied,
    };
    Ok(Report {
        backend: Backend::Iptables,
        verdict: Some(verdict),
        action,
        path: ApplyPath::Full,
        transcript: None,
    })
}

/// Istio's plan-based cleanup, then whatever Istio chains or jumps are still in the
/// saved state (left by an earlier, different configuration). Errors are ignored: a
/// missing rule or chain is already clean.
fn cleanup_family(x: &mut dyn Xtables, family: Family, rules: &[plan::Rule], saved: Option<&str>) {
    for cmd in render::cleanup(rules) {
        let _ = x.run(family, &cmd);
    }
    if let Some(saved) = saved {
        for cmd in state::leftovers(saved).cleanup_commands() {
            let _ = x.run(family, &cmd);
        }
    }
}

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

/// Programs Istio's nftables rules through `n` as one transaction.
pub fn program_nft(cfg: &CaptureConfig, opts: &RunOptions, n: &mut dyn Nft) -> Result<Report, CaptureError> {
    let current = n.list()?;
    program_nft_from(cfg, opts, n, &current)
}

/// [`program_nft`] with the current Istio tables already listed. Removal where there
/// is no Istio table runs nothing.
pub(crate) fn program_nft_from(
    cfg: &CaptureConfig,
    opts: &RunOptions,
    n: &mut dyn Nft,
    current: &str,
) -> Result<Report, CaptureError> {
    let report = |verdict, action| Report {
        backend: Backend::Nftables,
        verdict,
        action,
        path: ApplyPath::Full,
        transcript: None,
    };
    if opts.cleanup_only {
        if !current.is_empty() || !n.is_real() {
            n.apply(&nft::render_cleanup())?;
        }
        return Ok(report(None, Action::Cleaned));
    }
    let plan = nft::plan(cfg);
    let tx = nft::render(&plan);
    let verdict = if current.is_empty() {
        Verdict::Clean
    } else if n.expected(&tx)? == current {
        Verdict::Applied
    } else {
        Verdict::Drifted
    };
    tracing::info!(?verdict, "nftables state");
    match verdict {
        Verdict::Clean => {
            let path = n.apply_new(&tx)?;
            Ok(Report { path, ..report(Some(verdict), Action::Applied) })
        }
        Verdict::Applied if !opts.force_apply => Ok(report(Some(verdict), Action::AlreadyApplied)),
        Verdict::Applied => {
            n.apply(&nft::render_replace(&plan))?;
            Ok(report(Some(verdict), Action::ForceApplied))
        }
        Verdict::Drifted if opts.reconcile || opts.force_apply => {
            n.apply(&nft::render_replace(&plan))?;
            let action = if opts.reconcile { Action::Reconciled } else { Action::ForceApplied };
            Ok(report(Some(verdict), action))
        }
        Verdict::Drifted => Err(CaptureError::Drift { backend: "nftables" }),
    }
}

/// User and group names in the rules are the kernel tools' to resolve when the rules
/// go in (a dry run prints them as given, as Istio's does); an unknown one is named
/// here, before anything changes, rather than failing the transaction.
pub fn check_names(cfg: &CaptureConfig, facts: &dyn crate::detect::HostFacts) -> Result<(), CaptureError> {
    let numeric = |n: &str| n.parse::<u32>().is_ok();
    for uid in cfg.proxy_uids.iter().filter(|u| !numeric(u)) {
        if facts.user_id(uid).is_none() {
            return Err(CaptureError::UnknownName {
                input: "-u/--proxy-uid",
                kind: "user",
                name: uid.clone(),
            });
        }
    }
    for gid in cfg.proxy_gids.iter().filter(|g| !numeric(g)) {
        if !facts.group_exists(gid) {
            return Err(CaptureError::UnknownName {
                input: "-g/--proxy-gid",
                kind: "group",
                name: gid.clone(),
            });
        }
    }
    let groups = match &cfg.owner_groups {
        crate::config::OwnerGroups::AllExcept(g) | crate::config::OwnerGroups::Only(g) => g,
    };
    for group in groups.iter().filter(|g| !numeric(g)) {
        if !facts.group_exists(group) {
            return Err(CaptureError::UnknownName {
                input: "ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE]",
                kind: "group",
                name: group.clone(),
            });
        }
    }
    Ok(())
}

/// A dry run: the same path with recorders; nothing is changed.
pub(crate) fn dry_run(cfg: &CaptureConfig, opts: &RunOptions) -> Result<Report, CaptureError> {
    if opts.native_nftables {
        let mut rec = crate::nft_exec::NftRecorder::default();
        let mut report = program_nft(cfg, opts, &mut rec)?;
        report.transcript = Some(rec.transactions.concat());
        return Ok(report);
    }
    let mut rec = crate::xtables::Recorder::default();
    let mut report = program_iptables(cfg, opts, &mut rec)?;
    report.transcript = Some(rec.transcript());
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

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
