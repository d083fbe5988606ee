//! The fast path: when the in-process probe ([`nf_probe`]) shows a namespace that
//! Istio's reads would find empty, or holding exactly what the plan put there, a run
//! skips what those reads would only confirm. A namespace with no rule in any ip/ip6
//! table and no legacy rule is clean for Istio's verify and makes its binary detection
//! choose iptables-nft; it is programmed with one `iptables-restore --noflush` per
//! planned family, nothing else spawned. Removal is one restore per family of the
//! plan's `-D`/`-F`/`-X`, done only where rules exist and checked by the probe
//! afterwards. Whatever the probe cannot settle (it failed, legacy rules, other rules,
//! a removal that did not match the plan) is [`Decline`]d to the full path.

use std::path::PathBuf;

use crate::{
    config::{CaptureConfig, IptablesBackend, RunOptions},
    netlink::Family,
    nf_probe::{self, NFPROTO_IPV4, NFPROTO_IPV6},
    plan::{RulePlan, chain},
    render,
    xtables::{Binaries, Lock, SystemXtables, Xtables as _},
};

/// Why the fast path left a run to the full path (logged at debug).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decline(pub String);

/// What the probe read.
pub struct Probe {
    /// nf_tables rules of the ip and ip6 families (iptables-nft's tables).
    rules: Vec<nf_probe::Object>,
    legacy_in_use: Vec<String>,
}

impl Probe {
    /// Reads the current thread's namespace; a probe that fails is a decline, never
    /// "nothing there".
    pub fn read() -> Result<Self, Decline> {
        let tables = nf_probe::tables().map_err(|e| Decline(format!("netfilter probe failed: {e}")))?;
        let rules =
            if tables.nft_in(NFPROTO_IPV4).next().is_none() && tables.nft_in(NFPROTO_IPV6).next().is_none() {
                Vec::new()
            } else {
                xt_rules().map_err(|e| Decline(format!("nf_tables rule probe failed: {e}")))?
            };
        Ok(Self { rules, legacy_in_use: tables.legacy_in_use })
    }

    /// No legacy table holds a rule: Istio's detection would not pick legacy.
    pub fn legacy_unused(&self) -> bool {
        self.legacy_in_use.is_empty()
    }

    /// Neither family has a rule: Istio's verify would find the namespace clean.
    pub fn no_rules(&self) -> bool {
        self.legacy_unused() && !self.has_rules(Family::V4) && !self.has_rules(Family::V6)
    }

    fn has_rules(&self, family: Family) -> bool {
        let nfproto = if family == Family::V4 { NFPROTO_IPV4 } else { NFPROTO_IPV6 };
        self.rules.iter().any(|r| r.family == nfproto)
    }
}

/// Rules in the ip and ip6 nf_tables families.
fn xt_rules() -> std::io::Result<Vec<nf_probe::Object>> {
    Ok(nf_probe::rules()?
        .into_iter()
        .filter(|r| r.family == NFPROTO_IPV4 || r.family == NFPROTO_IPV6)
        .collect())
}

/// Istio chains left in the ip and ip6 nf_tables families.
fn istio_chains() -> std::io::Result<Vec<String>> {
    Ok(nf_probe::chains()?
        .into_iter()
        .filter(|c| {
            (c.family == NFPROTO_IPV4 || c.family == NFPROTO_IPV6) && c.name.starts_with(chain::PREFIX)
        })
        .map(|c| format!("{} {}", c.table, c.name))
        .collect())
}

/// The iptables-nft binaries of both families, found on PATH without running them
/// (nf_tables answered the probe, so the kernel side is there). Only the families
/// the run touches must exist.
pub fn nft_binaries(need_v6: bool, lock: Lock) -> Result<SystemXtables, Decline> {
    let family = |base: &str| -> Option<Binaries> {
        let nft = format!("{base}-nft");
        let restore = format!("{nft}-restore");
        let resolve = |name: &str| on_path(name).map(|p| p.display().to_string());
        Some(Binaries {
            save: resolve(&format!("{nft}-save"))?,
            restore: resolve(&restore)?,
            iptables: resolve(&nft)?,
            // Only legacy binaries take the xtables lock, so their version is unused.
            version: (0, 0, 0),
            legacy: false,
            existing_rules: false,
        })
    };
    let v4 = family("iptables").ok_or_else(|| Decline("no iptables-nft binaries on PATH".into()))?;
    let v6 = family("ip6tables");
    if need_v6 && v6.is_none() {
        return Err(Decline("no ip6tables-nft binaries on PATH".into()));
    }
    Ok(SystemXtables { v4, v6, lock })
}

/// Where `name` is found on PATH (as `execvp` would look).
fn on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = std::env::var_os("PATH")
        .unwrap_or_else(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Whether the run may take the fast path at all: iptables-nft (chosen or detected),
/// and not a dry run.
pub fn eligible(opts: &RunOptions) -> Result<(), Decline> {
    if opts.dry_run {
        return Err(Decline("dry run".into()));
    }
    match opts.force_iptables_binary {
        None | Some(IptablesBackend::Nft) => Ok(()),
        Some(IptablesBackend::Legacy) => Err(Decline("FORCE_IPTABLES_BINARY selects legacy".into())),
    }
}

/// What [`apply`] did.
pub enum Applied {
    /// The rules went in; the executor stays for a rollback.
    Done(SystemXtables),
    /// Not clean, or not iptables-nft: take the full path.
    Declined(Decline),
}

/// Installs the plan's restores into a namespace the probe shows clean. A restore
/// that fails is an error after the families already applied are rolled back.
pub fn apply(plan: &RulePlan, probe: &Probe, lock: Lock) -> Result<Applied, crate::apply::CaptureError> {
    if let Some(table) = probe.legacy_in_use.first() {
        return Ok(Applied::Declined(Decline(format!("legacy table {table} holds rules"))));
    }
    if probe.has_rules(Family::V4) || probe.has_rules(Family::V6) {
        return Ok(Applied::Declined(Decline("the namespace already has iptables rules".into())));
    }
    let restore4 = render::restore(&plan.v4);
    let restore6 = if plan.ipv6 { render::restore(&plan.v6) } else { String::new() };
    let mut x = match nft_binaries(!restore6.is_empty(), lock) {
        Ok(x) => x,
        Err(d) => return Ok(Applied::Declined(d)),
    };
    let mut applied = Vec::new();
    for (family, text) in [(Family::V4, &restore4), (Family::V6, &restore6)] {
        if text.is_empty() {
            continue;
        }
        if let Err(e) = x.restore(family, text, true) {
            // Nothing was there before: the snapshot of each applied family is empty. The
            // failing family too: iptables-nft-restore commits table by table, so the
            // tables before the one that failed are in.
            let snapshots: Vec<_> =
                applied.iter().chain([&family]).map(|f| (*f, Some(String::new()))).collect();
            return Err(crate::apply::rollback_iptables(&mut x, e.into(), &snapshots));
        }
        applied.push(family);
        // Istio logs the final state; here it is what went into an empty namespace.
        let name = if family == Family::V4 { "IPv4" } else { "IPv6" };
        tracing::info!("Final iptables state ({name}), restored into an empty namespace:\n{text}");
    }
    Ok(Applied::Done(x))
}

/// Removes the plan from the namespace: nothing to do where the probe finds no rule;
/// else one restore per family of the plan's removal, and the probe must then find no
/// Istio chain. `Ok(Some(decline))` hands the run to the full path (a restore that
/// did not match changed nothing: restores are atomic).
pub fn remove(
    plan: &RulePlan,
    probe: &Probe,
    lock: Lock,
) -> Result<Option<Decline>, crate::apply::CaptureError> {
    if let Some(table) = probe.legacy_in_use.first() {
        return Ok(Some(Decline(format!("legacy table {table} holds rules"))));
    }
    let families: Vec<Family> =
        [Family::V4, Family::V6].into_iter().filter(|f| probe.has_rules(*f)).collect();
    if families.is_empty() {
        return Ok(None);
    }
    let mut x = match nft_binaries(families.contains(&Family::V6), lock) {
        Ok(x) => x,
        Err(d) => return Ok(Some(d)),
    };
    for family in families {
        let rules = if family == Family::V4 { &plan.v4 } else { &plan.v6 };
        let text = render::removal(rules);
        if text.is_empty() {
            return Ok(Some(Decline(format!("{family:?} has rules the plan does not make"))));
        }
        if let Err(e) = x.restore(family, &text, true) {
            return Ok(Some(Decline(format!("the plan's removal did not match: {e}"))));
        }
    }
    match istio_chains() {
        Ok(left) if left.is_empty() => Ok(None),
        Ok(left) => Ok(Some(Decline(format!("Istio chains of another plan remain: {}", left.join(", "))))),
        Err(e) => Ok(Some(Decline(format!("netfilter probe failed: {e}")))),
    }
}

/// Whether `cfg` needs any route or address work when applying.
pub fn routes_needed(cfg: &CaptureConfig) -> bool {
    cfg.enable_ipv6 || crate::routes::tproxy_needed(cfg)
}
