//! A run on the system, in the current or a given network namespace: the backend's
//! rules, then TPROXY's routes, with the fast path ([`fast_path`]) taken where the
//! in-process probe settles the state. Applying puts rules in first and rolls them
//! back if routes fail; removing takes routes out first (remembering what was there)
//! and puts them back if the rules cannot be removed. Also [`verify`] (CNI CHECK).

use std::path::Path;

use super::{
    dry_run::dry_run,
    error::CaptureError,
    fast_path,
    iptables::{program_iptables, program_iptables_from},
    names::check_names,
    nft::program_nft_from,
    report::Report,
    rollback::rollback_iptables,
};
use crate::{
    inputs::config::{CaptureConfig, RunOptions},
    iptables::{
        plan::{self, RulePlan},
        render,
        state::{self, Verdict},
        xtables::{Lock, SystemXtables, Xtables as _},
    },
    kernel::{
        netlink::{Family, Netlink, NetlinkError},
        routes,
    },
    nft,
    nft::exec::{Nft as _, SystemNft},
    outcome::{Action, ApplyPath, Backend},
};

/// The whole run on the system: rules with the chosen backend, and routes. Runs in
/// `opts.network_namespace` when set.
pub fn program(cfg: &CaptureConfig, opts: &RunOptions) -> Result<Report, CaptureError> {
    cfg.validate()?;
    match &opts.network_namespace {
        Some(path) => in_netns(path, || program_here(cfg, opts)),
        None => program_here(cfg, opts),
    }
}

fn program_here(cfg: &CaptureConfig, opts: &RunOptions) -> Result<Report, CaptureError> {
    if opts.dry_run {
        return dry_run(cfg, opts);
    }
    if opts.cleanup_only {
        return remove_here(cfg, opts);
    }
    check_names(cfg, &crate::inputs::detect::SystemFacts::default())?;
    if opts.native_nftables {
        return apply_nft(cfg, opts);
    }
    apply_iptables(cfg, opts)
}

/// The probe, when this run may use it; why not otherwise (logged).
fn probe(opts: &RunOptions) -> Option<fast_path::Probe> {
    match fast_path::eligible(opts).and_then(|()| fast_path::Probe::read()) {
        Ok(p) => Some(p),
        Err(decline) => {
            tracing::info!(reason = %decline.0, path = %ApplyPath::Full, "iptables fast path declined");
            None
        }
    }
}

/// Istio's binaries, detected (legacy is not run when the probe shows it unused).
fn detect(
    cfg: &CaptureConfig,
    opts: &RunOptions,
    probe: Option<&fast_path::Probe>,
) -> Result<SystemXtables, CaptureError> {
    Ok(SystemXtables::detect_with(
        opts.force_iptables_binary,
        cfg.enable_ipv6,
        lock(opts),
        probe.is_some_and(fast_path::Probe::legacy_unused),
    )?)
}

fn apply_iptables(cfg: &CaptureConfig, opts: &RunOptions) -> Result<Report, CaptureError> {
    let probe = probe(opts);
    if let Some(p) = &probe {
        match fast_path::apply(&plan::plan(cfg), p, lock(opts))? {
            fast_path::Applied::Done(mut x) => {
                tracing::info!(verdict = ?Verdict::Clean, path = %ApplyPath::Fast, "iptables state (probed in process)");
                if let Err(e) = add_routes(cfg) {
                    let empty = [(Family::V4, Some(String::new())), (Family::V6, Some(String::new()))];
                    return Err(rollback_iptables(&mut x, e, &empty));
                }
                return Ok(Report {
                    backend: Backend::Iptables,
                    verdict: Some(Verdict::Clean),
                    action: Action::Applied,
                    path: ApplyPath::Fast,
                    transcript: None,
                });
            }
            fast_path::Applied::Declined(decline) => {
                tracing::info!(reason = %decline.0, path = %ApplyPath::Full, "iptables fast path declined");
            }
        }
    }
    let mut x = detect(cfg, opts, probe.as_ref())?;
    let saves = (x.save(Family::V4), x.save(Family::V6));
    let snapshots = [(Family::V4, saves.0.clone()), (Family::V6, saves.1.clone())];
    let report = program_iptables_from(cfg, opts, &mut x, saves)?;
    match add_routes(cfg) {
        Ok(()) => Ok(report),
        Err(e) => Err(rollback_iptables(&mut x, e, &snapshots)),
    }
}

/// Native nftables: one listing (in process when there is no Istio table), one
/// transaction, then routes; the tables are put back if routes fail.
fn apply_nft(cfg: &CaptureConfig, opts: &RunOptions) -> Result<Report, CaptureError> {
    let mut n = SystemNft;
    let before = n.list()?;
    let report = program_nft_from(cfg, opts, &mut n, &before)?;
    if let Err(cause) = add_routes(cfg) {
        let restore = format!("{}{}", nft::render_cleanup(), before);
        return Err(match n.apply(&restore) {
            Ok(()) => CaptureError::RolledBack { cause: Box::new(cause) },
            Err(e) => CaptureError::RollbackFailed { cause: Box::new(cause), rollback: e.to_string() },
        });
    }
    Ok(report)
}

/// Removal: routes first, then the rules (nothing run where there are none); if the
/// rules cannot be removed, the routes that were there are put back.
fn remove_here(cfg: &CaptureConfig, opts: &RunOptions) -> Result<Report, CaptureError> {
    let removed = netlink(|nl| async move { routes::remove(&nl, cfg).await })?;
    let result = if opts.native_nftables { remove_nft() } else { remove_iptables(cfg, opts) };
    result.map_err(|cause| match netlink(|nl| async move { routes::restore(&nl, cfg, removed).await }) {
        Ok(()) => match cause {
            CaptureError::RolledBack { .. } | CaptureError::RollbackFailed { .. } => cause,
            other => CaptureError::RolledBack { cause: Box::new(other) },
        },
        Err(e) => CaptureError::RollbackFailed { cause: Box::new(cause), rollback: e.to_string() },
    })
}

fn remove_nft() -> Result<Report, CaptureError> {
    if crate::nft::exec::istio_tables_present()? {
        SystemNft.apply(&nft::render_cleanup())?;
    }
    Ok(Report {
        backend: Backend::Nftables,
        verdict: None,
        action: Action::Cleaned,
        path: ApplyPath::Full,
        transcript: None,
    })
}

fn remove_iptables(cfg: &CaptureConfig, opts: &RunOptions) -> Result<Report, CaptureError> {
    let probe = probe(opts);
    if let Some(p) = &probe {
        match fast_path::remove(&plan::plan(cfg), p, lock(opts))? {
            None => {
                tracing::info!(path = %ApplyPath::Fast, "iptables rules removed (probed in process)");
                return Ok(Report {
                    backend: Backend::Iptables,
                    verdict: None,
                    action: Action::Cleaned,
                    path: ApplyPath::Fast,
                    transcript: None,
                });
            }
            Some(decline) => {
                tracing::info!(reason = %decline.0, path = %ApplyPath::Full, "iptables fast removal declined")
            }
        }
    }
    let mut x = detect(cfg, opts, probe.as_ref())?;
    program_iptables(cfg, opts, &mut x)
}

/// A CNI plugin working on a pod namespace never takes the node's xtables lock.
fn lock(opts: &RunOptions) -> Lock {
    match (&opts.network_namespace, opts.cni_mode) {
        (Some(ns), true) => Lock::PodScoped(ns.clone()),
        _ => Lock::Global,
    }
}

/// Runs one netlink conversation on a small runtime of its own.
fn netlink<T, F>(f: impl FnOnce(Netlink) -> F) -> Result<T, CaptureError>
where
    F: std::future::Future<Output = Result<T, NetlinkError>>,
{
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(CaptureError::Runtime)?;
    runtime.block_on(async { f(Netlink::open()?).await }).map_err(CaptureError::Routes)
}

/// The routes and addresses `cfg` needs (no netlink at all when it needs none).
fn add_routes(cfg: &CaptureConfig) -> Result<(), CaptureError> {
    if !fast_path::routes_needed(cfg) {
        return Ok(());
    }
    netlink(|nl| async move { routes::configure(&nl, cfg).await })
}

/// Runs `f` on a thread that has entered the network namespace at `path`; processes it
/// spawns and netlink sockets it opens belong to that namespace.
pub fn in_netns<T: Send>(
    path: &Path,
    f: impl FnOnce() -> Result<T, CaptureError> + Send,
) -> Result<T, CaptureError> {
    let file = std::fs::File::open(path)
        .map_err(|source| CaptureError::Netns { path: path.display().to_string(), source })?;
    std::thread::scope(|s| {
        s.spawn(|| {
            use std::os::fd::AsFd as _;
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| CaptureError::Netns { path: path.display().to_string(), source: e.into() })?;
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Whether a plan's rules and routes are in place in the current namespace (for
/// `CHECK`-style callers). `Ok(Verdict::Applied)` means complete.
pub fn verify(cfg: &CaptureConfig, opts: &RunOptions) -> Result<Verdict, CaptureError> {
    cfg.validate()?;
    let check = || -> Result<Verdict, CaptureError> {
        let rules = if opts.native_nftables {
            let mut n = SystemNft;
            let plan = nft::plan(cfg);
            let current = n.list()?;
            if current.is_empty() {
                Verdict::Clean
            } else if n.expected(&nft::render(&plan))? == current {
                Verdict::Applied
            } else {
                Verdict::Drifted
            }
        } else {
            let probe = probe(opts);
            if probe.as_ref().is_some_and(fast_path::Probe::no_rules) {
                return Ok(Verdict::Clean);
            }
            let mut x = detect(cfg, opts, probe.as_ref())?;
            let plan: RulePlan = plan::plan(cfg);
            let families = [(Family::V4, &plan.v4), (Family::V6, &plan.v6)];
            let mut verdicts = Vec::new();
            for (family, rules) in families {
                let saved = x.save(family);
                let restore = render::restore(rules);
                let checks = render::checks(rules);
                verdicts.push(state::verify_family(saved.as_deref(), &restore, &checks, |c| {
                    x.run(family, c).is_ok()
                }));
            }
            state::combine(&verdicts)
        };
        if rules != Verdict::Applied {
            return Ok(rules);
        }
        let routes_ok = netlink(|nl| async move { routes::present(&nl, cfg).await })?;
        Ok(if routes_ok { Verdict::Applied } else { Verdict::Drifted })
    };
    match &opts.network_namespace {
        Some(path) => in_netns(path, check),
        None => check(),
    }
}
