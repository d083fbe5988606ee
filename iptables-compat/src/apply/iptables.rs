//! A run through iptables, Istio's way: both families' state read and verified
//! (clean / applied / drifted), then applied, left alone, reconciled behind Istio's
//! guardrails or refused; a failure part-way restores each family's snapshot
//! ([`super::rollback`]). Any executor (the system's binaries or a dry-run recorder)
//! and any plan (the ambient node agent's too).

use super::{error::CaptureError, report::Report, rollback::rollback_iptables};
use crate::{
    inputs::config::{CaptureConfig, RunOptions},
    iptables::{
        plan, render,
        state::{self, Verdict},
        xtables::Xtables,
    },
    kernel::netlink::Family,
    outcome::{Action, ApplyPath, Backend},
};

/// Programs Istio's iptables rules through `x` (the system's binaries, or a recorder
/// for a dry run). Routes are not touched here; see [`crate::apply::program`].
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
