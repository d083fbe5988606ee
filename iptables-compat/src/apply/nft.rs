//! A run through native nftables: the Istio tables listed and compared with what the
//! plan's transaction makes (clean / applied / drifted), then one transaction that
//! installs, replaces or removes them. Any executor (the system's nft or a recorder).

use super::{error::CaptureError, report::Report};
use crate::{
    inputs::config::{CaptureConfig, RunOptions},
    iptables::state::Verdict,
    nft,
    nft::exec::Nft,
    outcome::{Action, ApplyPath, Backend},
};

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
