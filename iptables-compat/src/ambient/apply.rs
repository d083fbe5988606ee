//! Applying, verifying and removing the in-pod rules in a pod's network namespace.
//! iptables takes the sidecar path (the in-process probe's fast path into a clean
//! namespace, else Istio's verify → apply / leave / reconcile behind guardrails, with
//! the namespace restored from its snapshot if anything fails); nftables is one
//! transaction that replaces the `istio-ambient-*` tables. The policy route follows
//! the rules and their failure rolls the rules back. Rules of the other backend are
//! removed once the new ones are in, so a pod never keeps two sets.

use std::path::Path;

use super::{
    config::{AmbientBackend, AmbientConfig, InpodConfig},
    nft as anft, plan, routes,
};
use crate::{
    apply::{
        CaptureError, Report, fast_path, in_netns, iptables::program_plan_from, rollback::rollback_iptables,
    },
    inputs::config::{ConfigError, IptablesBackend, RunOptions},
    iptables::{
        plan::RulePlan,
        render,
        state::{self, Leftovers, Verdict},
        xtables::{Lock, SystemXtables, Xtables},
    },
    kernel::netlink::{Family, Netlink, NetlinkError},
    nft::exec::{self, Nft, NftError},
    outcome::{Action, ApplyPath, Backend},
};

/// Why an ambient run failed.
#[derive(Debug, thiserror::Error)]
pub enum AmbientError {
    #[error(
        "the ambient {backend} rules in {netns} differ from this pod's plan; nothing was changed \
         (AMBIENT_RECONCILE_POD_RULES_ON_STARTUP=true replaces them)"
    )]
    Drift { backend: &'static str, netns: String },
    #[error("ambient rules in {netns}")]
    Rules {
        netns: String,
        #[source]
        source: CaptureError,
    },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("kubelet's uid: {0}")]
    KubeletUid(String),
}

impl AmbientError {
    pub(crate) fn from_capture(netns: &str, e: CaptureError) -> Self {
        match e {
            CaptureError::Drift { backend } => AmbientError::Drift { backend, netns: netns.to_string() },
            source => AmbientError::Rules { netns: netns.to_string(), source },
        }
    }
}

/// The chains the in-pod rules own.
const INPOD_CHAINS: [&str; 2] = [plan::CHAIN_OUTPUT, plan::CHAIN_PREROUTING];

pub(crate) fn run_options(cfg: &AmbientConfig) -> RunOptions {
    RunOptions {
        reconcile: cfg.reconcile,
        force_iptables_binary: cfg.force_iptables_binary,
        ..Default::default()
    }
}

/// Istio's in-pod iptables run through `x`: read both families, then verify and apply
/// (or leave, or reconcile) as [`crate::apply::program_iptables`] does.
/// A namespace holding none of the in-pod chains or jumps is clean for the in-pod run,
/// whatever else its tables hold (a CNI's rules are not drift).
pub fn program_inpod_iptables(cfg: &InpodConfig, x: &mut dyn Xtables) -> Result<Report, CaptureError> {
    let whole = (x.save(Family::V4), x.save(Family::V6));
    let saves = owned_saves(whole.clone(), &INPOD_CHAINS);
    program_plan_from(&plan::inpod(cfg), &run_options(&cfg.ambient), x, saves, whole, false)
}

/// The saves as the verify should see them: an empty save for a family that holds
/// none of `owned`'s chains or jumps.
pub(crate) fn owned_saves(
    (v4, v6): (Option<String>, Option<String>),
    owned: &[&str],
) -> (Option<String>, Option<String>) {
    let keep = |save: Option<String>| match save {
        Some(s) if owned_leftovers(&s, owned).is_empty() => Some(String::new()),
        other => other,
    };
    (keep(v4), keep(v6))
}

/// Istio's in-pod nftables run through `n`: the transaction into a namespace without
/// ambient tables; nothing where the tables already list as the transaction makes
/// them; else every ambient table deleted and the transaction applied, in one
/// transaction.
pub fn program_inpod_nft(cfg: &InpodConfig, n: &mut dyn Nft) -> Result<Report, CaptureError> {
    let tx = anft::render(&anft::inpod(cfg));
    let current = n.list()?;
    let report = |verdict, action| Report {
        backend: Backend::Nftables,
        verdict: Some(verdict),
        action,
        path: ApplyPath::Full,
        transcript: None,
    };
    if current.is_empty() {
        n.apply(&tx)?;
        return Ok(report(Verdict::Clean, Action::Applied));
    }
    if n.expected(&tx)? == current {
        return Ok(report(Verdict::Applied, Action::AlreadyApplied));
    }
    n.apply(&format!("{}{tx}", anft::render_delete(&anft::INPOD_TABLES)))?;
    Ok(report(Verdict::Drifted, Action::Reconciled))
}

/// The system's nft over a fixed set of ambient tables.
pub(crate) struct AmbientNft(pub(crate) &'static [&'static str]);

impl Nft for AmbientNft {
    fn list(&mut self) -> Result<String, NftError> {
        exec::list_tables(self.0)
    }
    fn expected(&mut self, tx: &str) -> Result<String, NftError> {
        let tables = self.0;
        exec::in_scratch_netns(|| {
            exec::nft(&["-f", "-"], Some(tx))?;
            exec::list_tables(tables)
        })
    }
    fn apply(&mut self, tx: &str) -> Result<(), NftError> {
        tracing::info!("nft -f:\n{}", tx.trim());
        exec::nft(&["-f", "-"], Some(tx)).map(drop)
    }
    fn is_real(&self) -> bool {
        true
    }
}

/// Runs one netlink conversation on a small runtime of its own, on this thread.
pub(crate) fn netlink<T, F>(f: impl FnOnce(Netlink) -> F) -> Result<T, CaptureError>
where
    F: std::future::Future<Output = Result<T, NetlinkError>>,
{
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(CaptureError::Runtime)?;
    runtime.block_on(async { f(Netlink::open()?).await }).map_err(CaptureError::Routes)
}

fn add_routes(ipv6: bool) -> Result<(), CaptureError> {
    netlink(|nl| async move { routes::configure(&nl, ipv6).await })
}

/// Programs the pod's rules and policy route in the namespace at `netns`.
pub fn apply_inpod(netns: &Path, cfg: &InpodConfig) -> Result<Report, AmbientError> {
    cfg.pod.validate()?;
    let name = netns.display().to_string();
    in_netns(netns, || {
        let was_on = fwmark_accept_off()?;
        let applied = apply_rules_here(cfg, netns);
        // Rules that did not go in leave the pod as it was (an eBPF capture needs the
        // switch on).
        if applied.is_err() && was_on {
            let _ = set_fwmark_accept(true);
        }
        applied
    })
    .map_err(|e| AmbientError::from_capture(&name, e))
}

/// `tcp_fwmark_accept` off under the rules: with it on, the app's accepted socket for a
/// connection ztunnel delivers would take ztunnel's mark 0x539, and its later connects
/// would pass the rules' `! --mark 0x539` exemption (left on by eBPF capture, which
/// needs it, or set by the pod). Written only when on; returns whether it was.
fn fwmark_accept_off() -> Result<bool, CaptureError> {
    if std::fs::read_to_string(FWMARK_ACCEPT).is_ok_and(|v| v.trim() != "0") {
        tracing::warn!(
            "net.ipv4.tcp_fwmark_accept was on in the pod: turned off (the in-pod rules need it off)"
        );
        set_fwmark_accept(false)?;
        return Ok(true);
    }
    Ok(false)
}

fn apply_rules_here(cfg: &InpodConfig, netns: &Path) -> Result<Report, CaptureError> {
    match cfg.ambient.backend {
        AmbientBackend::Iptables => {
            let report = apply_iptables_here(cfg, netns)?;
            remove_nft_here()?;
            Ok(report)
        }
        AmbientBackend::Nftables => {
            let report = apply_nft_here(cfg)?;
            remove_iptables_here(&cfg.ambient, netns)?;
            Ok(report)
        }
    }
}

/// `net.ipv4.tcp_fwmark_accept` (it covers IPv6 TCP too): an accepted socket takes
/// the mark of the SYN that made it.
const FWMARK_ACCEPT: &str = "/proc/sys/net/ipv4/tcp_fwmark_accept";

fn set_fwmark_accept(on: bool) -> Result<(), CaptureError> {
    std::fs::write(FWMARK_ACCEPT, if on { "1" } else { "0" })
        .map_err(|source| CaptureError::Sysctl { path: FWMARK_ACCEPT, source })
}

/// The in-pod part of eBPF capture for an ambient pod (its rules are Weir's programs,
/// registered by the agent): Istio's policy route (`fwmark 0x111/0xfff lookup 100`,
/// `local default dev lo table 100`), `tcp_fwmark_accept` on (the app's socket for a
/// connection ztunnel delivered takes the 0x111 the inbound guard gives it, so its
/// replies take that route back to ztunnel), and no in-pod rules of either backend (a
/// pod moved from the rules keeps none). Idempotent.
pub fn apply_inpod_ebpf(netns: &Path, cfg: &InpodConfig) -> Result<(), AmbientError> {
    let name = netns.display().to_string();
    in_netns(netns, || {
        add_routes(cfg.ambient.enable_ipv6)?;
        set_fwmark_accept(true)?;
        remove_iptables_here(&AmbientConfig::default(), netns)?;
        remove_nft_here()?;
        Ok(())
    })
    .map_err(|e| AmbientError::from_capture(&name, e))
}

/// Takes eBPF capture's in-pod part out of `netns` (and any in-pod rules, as
/// [`remove_inpod`]): `tcp_fwmark_accept` back to the kernel's default.
pub fn remove_inpod_ebpf(netns: &Path) -> Result<Action, AmbientError> {
    let action = remove_inpod(netns)?;
    let name = netns.display().to_string();
    in_netns(netns, || set_fwmark_accept(false)).map_err(|e| AmbientError::from_capture(&name, e))?;
    Ok(action)
}

/// eBPF capture's own part of the in-pod setup out of `netns` (the pod moves to the
/// rules, which keep the route): `tcp_fwmark_accept` back to the kernel's default, or
/// the app's accepted sockets would take ztunnel's mark and pass the rules' exemption.
pub fn clear_inpod_ebpf(netns: &Path) -> Result<(), AmbientError> {
    let name = netns.display().to_string();
    in_netns(netns, || set_fwmark_accept(false)).map_err(|e| AmbientError::from_capture(&name, e))
}

/// The probe, unless legacy iptables is forced (the fast path is iptables-nft's).
fn probe(cfg: &AmbientConfig) -> Option<fast_path::Probe> {
    if cfg.force_iptables_binary == Some(IptablesBackend::Legacy) {
        return None;
    }
    fast_path::Probe::read().map_err(|d| tracing::debug!(reason = %d.0, "probe declined")).ok()
}

pub(crate) fn detect(
    cfg: &AmbientConfig,
    lock: Lock,
    probe: Option<&fast_path::Probe>,
) -> Result<SystemXtables, CaptureError> {
    Ok(SystemXtables::detect_with(
        cfg.force_iptables_binary,
        cfg.enable_ipv6,
        lock,
        probe.is_some_and(fast_path::Probe::legacy_unused),
    )?)
}

fn apply_iptables_here(cfg: &InpodConfig, netns: &Path) -> Result<Report, CaptureError> {
    let plan = plan::inpod(cfg);
    let lock = cfg.ambient.inpod_lock(netns);
    let probe = probe(&cfg.ambient);
    if let Some(p) = &probe {
        match fast_path::apply(&plan, p, lock.clone())? {
            fast_path::Applied::Done(mut x) => {
                if let Err(e) = add_routes(cfg.ambient.enable_ipv6) {
                    let empty = [(Family::V4, Some(String::new())), (Family::V6, Some(String::new()))];
                    return Err(rollback_iptables(&mut x, e, &empty));
                }
                let verdict = Some(Verdict::Clean);
                tracing::info!(?verdict, path = %ApplyPath::Fast, "in-pod iptables state (probed in process)");
                return Ok(Report {
                    backend: Backend::Iptables,
                    verdict,
                    action: Action::Applied,
                    path: ApplyPath::Fast,
                    transcript: None,
                });
            }
            fast_path::Applied::Declined(d) => {
                tracing::info!(reason = %d.0, path = %ApplyPath::Full, "iptables fast path declined")
            }
        }
    }
    let mut x = detect(&cfg.ambient, lock, probe.as_ref())?;
    let saves = (x.save(Family::V4), x.save(Family::V6));
    let snapshots = [(Family::V4, saves.0.clone()), (Family::V6, saves.1.clone())];
    let owned = owned_saves(saves.clone(), &INPOD_CHAINS);
    let report = program_plan_from(&plan, &run_options(&cfg.ambient), &mut x, owned, saves, false)?;
    match add_routes(cfg.ambient.enable_ipv6) {
        Ok(()) => Ok(report),
        Err(e) => Err(rollback_iptables(&mut x, e, &snapshots)),
    }
}

fn apply_nft_here(cfg: &InpodConfig) -> Result<Report, CaptureError> {
    let mut n = AmbientNft(&anft::INPOD_TABLES);
    let before = n.list()?;
    let report = program_inpod_nft(cfg, &mut n)?;
    if let Err(cause) = add_routes(cfg.ambient.enable_ipv6) {
        let restore = format!("{}{before}", anft::render_delete(&anft::INPOD_TABLES));
        return Err(match n.apply(&restore) {
            Ok(()) => CaptureError::RolledBack { cause: Box::new(cause) },
            Err(e) => CaptureError::RollbackFailed { cause: Box::new(cause), rollback: e.to_string() },
        });
    }
    Ok(report)
}

/// The `iptables-restore --noflush` input that removes `l`: per table, the jumps into
/// the chains, then every chain flushed, then deleted. Empty when there is nothing.
pub(crate) fn removal_restore(l: &Leftovers) -> String {
    let mut tables: std::collections::BTreeMap<&str, [Vec<String>; 3]> = Default::default();
    for (table, line) in &l.jumps {
        let rest = line.split_once(' ').map_or("", |(_, r)| r);
        tables.entry(table).or_default()[0].push(format!("-D {rest}"));
    }
    for (table, chain) in &l.chains {
        tables.entry(table).or_default()[1].push(format!("-F {chain}"));
        tables.entry(table).or_default()[2].push(format!("-X {chain}"));
    }
    let mut out = String::new();
    for (table, stages) in tables {
        out.push_str(&format!("* {table}\n"));
        for line in stages.iter().flatten() {
            out.push_str(line);
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// The chains among `owned` in a save, and the jumps into them.
pub(crate) fn owned_leftovers(save: &str, owned: &[&str]) -> Leftovers {
    let all = state::leftovers(save);
    let owns = |rule: &str| {
        rule.split_whitespace()
            .collect::<Vec<_>>()
            .windows(2)
            .any(|w| (w[0] == "-j" || w[0] == "--jump") && owned.contains(&w[1].trim_matches('"')))
    };
    Leftovers {
        chains: all.chains.into_iter().filter(|(_, c)| owned.contains(&c.as_str())).collect(),
        jumps: all.jumps.into_iter().filter(|(_, rule)| owns(rule)).collect(),
    }
}

/// Removes the in-pod iptables chains and jumps, one restore per family that has any.
fn remove_iptables_here(cfg: &AmbientConfig, netns: &Path) -> Result<bool, CaptureError> {
    let probe = probe(cfg);
    if probe.as_ref().is_some_and(fast_path::Probe::no_rules) {
        return Ok(false);
    }
    let cfg = AmbientConfig { enable_ipv6: false, ..cfg.clone() };
    let mut x = detect(&cfg, cfg.inpod_lock(netns), probe.as_ref())?;
    let mut removed = false;
    for family in [Family::V4, Family::V6] {
        let Some(save) = x.save(family) else { continue };
        let text = removal_restore(&owned_leftovers(&save, &INPOD_CHAINS));
        if !text.is_empty() {
            x.restore(family, &text, true)?;
            removed = true;
        }
    }
    Ok(removed)
}

/// Deletes the in-pod nft tables, in one transaction, if there are any.
fn remove_nft_here() -> Result<bool, CaptureError> {
    let present = exec::inet_tables()?;
    let ours: Vec<&str> = anft::INPOD_TABLES.into_iter().filter(|t| present.iter().any(|p| p == t)).collect();
    if ours.is_empty() {
        return Ok(false);
    }
    AmbientNft(&anft::INPOD_TABLES).apply(&anft::render_delete(&ours))?;
    Ok(true)
}

/// Removes every in-pod rule (both backends), the ip rule and the route from the
/// namespace at `netns`. If the rules cannot be removed the route is put back.
pub fn remove_inpod(netns: &Path) -> Result<Action, AmbientError> {
    let name = netns.display().to_string();
    in_netns(netns, || {
        let removed = netlink(|nl| async move { routes::remove(&nl).await })?;
        let rules = remove_iptables_here(&AmbientConfig::default(), netns).and_then(|_| remove_nft_here());
        if let Err(cause) = rules {
            return Err(match netlink(|nl| async move { routes::restore(&nl, removed).await }) {
                Ok(()) => CaptureError::RolledBack { cause: Box::new(cause) },
                Err(e) => CaptureError::RollbackFailed { cause: Box::new(cause), rollback: e.to_string() },
            });
        }
        Ok(Action::Cleaned)
    })
    .map_err(|e| AmbientError::from_capture(&name, e))
}

/// Whether the pod's namespace holds exactly `cfg`'s rules, ip rule and route
/// (`Applied`), no ambient rules at all (`Clean`), or something else (`Drifted`).
pub fn verify_inpod(netns: &Path, cfg: &InpodConfig) -> Result<Verdict, AmbientError> {
    let name = netns.display().to_string();
    in_netns(netns, || {
        let (own, other) = match cfg.ambient.backend {
            AmbientBackend::Iptables => (verify_iptables_here(cfg, netns)?, nft_verdict_here(None)?),
            AmbientBackend::Nftables => {
                (nft_verdict_here(Some(cfg))?, verify_iptables_here(cfg, netns)?.empty())
            }
        };
        let routes_ok = netlink(|nl| async move { routes::present(&nl, cfg.ambient.enable_ipv6).await })?;
        let any_route = netlink(|nl| async move { routes::any_present(&nl).await })?;
        Ok(match (own, other) {
            (Verdict::Clean, Verdict::Clean) if !any_route => Verdict::Clean,
            (Verdict::Applied, Verdict::Clean) if routes_ok => Verdict::Applied,
            _ => Verdict::Drifted,
        })
    })
    .map_err(|e| AmbientError::from_capture(&name, e))
}

trait AsOther {
    /// As the other backend's verdict: any rule at all is drift.
    fn empty(self) -> Verdict;
}

impl AsOther for Verdict {
    fn empty(self) -> Verdict {
        if self == Verdict::Clean { Verdict::Clean } else { Verdict::Drifted }
    }
}

/// The iptables verdict for `cfg` (Istio's VerifyIptablesState over both families).
fn verify_iptables_here(cfg: &InpodConfig, netns: &Path) -> Result<Verdict, CaptureError> {
    let probe = probe(&cfg.ambient);
    if probe.as_ref().is_some_and(fast_path::Probe::no_rules) {
        return Ok(Verdict::Clean);
    }
    let mut x = detect(&cfg.ambient, cfg.ambient.inpod_lock(netns), probe.as_ref())?;
    let saves = owned_saves((x.save(Family::V4), x.save(Family::V6)), &INPOD_CHAINS);
    Ok(iptables_verdict(&plan::inpod(cfg), &mut x, saves))
}

/// Istio's VerifyIptablesState over both families' saves.
pub(crate) fn iptables_verdict(
    plan: &RulePlan,
    x: &mut dyn Xtables,
    (save4, save6): (Option<String>, Option<String>),
) -> Verdict {
    let mut verdicts = Vec::new();
    for (family, rules, saved) in [(Family::V4, &plan.v4, save4), (Family::V6, &plan.v6, save6)] {
        let restore = render::restore(rules);
        let checks = render::checks(rules);
        verdicts
            .push(state::verify_family(saved.as_deref(), &restore, &checks, |c| x.run(family, c).is_ok()));
    }
    state::combine(&verdicts)
}

/// The nft verdict: against `cfg`'s transaction, or (`None`) just whether any ambient
/// table is there.
fn nft_verdict_here(cfg: Option<&InpodConfig>) -> Result<Verdict, CaptureError> {
    let mut n = AmbientNft(&anft::INPOD_TABLES);
    let current = n.list()?;
    Ok(match cfg {
        _ if current.is_empty() => Verdict::Clean,
        None => Verdict::Drifted,
        Some(cfg) if n.expected(&anft::render(&anft::inpod(cfg)))? == current => Verdict::Applied,
        Some(_) => Verdict::Drifted,
    })
}
