//! The fast path: when the in-process probe ([`nf_probe`]) shows a namespace that
//! Istio's reads would find empty, or holding exactly what the plan put there, a run
//! skips what those reads would only confirm. A namespace with no rule and no user
//! chain in any ip/ip6 table and no legacy rule is clean for Istio's verify and makes
//! its binary detection choose iptables-nft; it is programmed with one
//! `iptables-restore --noflush` per planned family, nothing else spawned, or, for IPv4
//! rules [`crate::iptables::xt_wire`] knows, with one nf_tables batch written in process as
//! iptables-nft would write it, nothing spawned at all. Removal is
//! one restore per family of the plan's `-D`/`-F`/`-X` (Istio's chains by name, never
//! another's), done only where Istio's rules or chains exist and checked by the probe
//! afterwards. Whatever the probe cannot settle (it failed, legacy rules, other rules
//! or chains, a removal that did not match the plan) is [`Decline`]d to the full path.

use std::path::PathBuf;

use super::{error::CaptureError, rollback::rollback_iptables};
use crate::{
    inputs::config::{CaptureConfig, IptablesBackend, RunOptions},
    iptables::{
        plan::{RulePlan, chain},
        render,
        xtables::{Binaries, Lock, SystemXtables, Xtables as _},
    },
    kernel::{
        netlink::Family,
        nf_probe::{self, NFPROTO_IPV4, NFPROTO_IPV6},
    },
};

/// Why the fast path left a run to the full path (logged at debug).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decline(pub String);

/// What the probe read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Probe {
    /// nf_tables rules of the ip and ip6 families (iptables-nft's tables).
    rules: Vec<nf_probe::Object>,
    /// User chains (no hook) of the ip and ip6 families: Istio's, or anyone's.
    user_chains: Vec<nf_probe::Object>,
    /// Builtin chains (hooked) of the ip and ip6 families: an earlier run's, or anyone's.
    base_chains: Vec<nf_probe::Object>,
    legacy_in_use: Vec<String>,
}

impl Probe {
    /// Reads the current thread's namespace; a probe that fails is a decline, never
    /// "nothing there".
    pub fn read() -> Result<Self, Decline> {
        let tables = nf_probe::tables().map_err(|e| Decline(format!("netfilter probe failed: {e}")))?;
        if tables.nft_in(NFPROTO_IPV4).next().is_none() && tables.nft_in(NFPROTO_IPV6).next().is_none() {
            return Ok(Self { legacy_in_use: tables.legacy_in_use, ..Self::default() });
        }
        let rules =
            xt(nf_probe::rules()).map_err(|e| Decline(format!("nf_tables rule probe failed: {e}")))?;
        let chains =
            xt(nf_probe::chains()).map_err(|e| Decline(format!("nf_tables chain probe failed: {e}")))?;
        let (base_chains, user_chains) = chains.into_iter().partition(|c| c.base_chain);
        Ok(Self { rules, user_chains, base_chains, legacy_in_use: tables.legacy_in_use })
    }

    /// No legacy table holds a rule: Istio's detection would not pick legacy.
    pub fn legacy_unused(&self) -> bool {
        self.legacy_in_use.is_empty()
    }

    /// Neither family has a rule or a user chain: nothing there for Istio's verify to
    /// read.
    pub fn no_rules(&self) -> bool {
        self.legacy_unused()
            && [Family::V4, Family::V6].iter().all(|f| !self.has_rules(*f) && !self.has_chains(*f))
    }

    fn has_rules(&self, family: Family) -> bool {
        self.rules.iter().any(|r| r.family == nfproto(family))
    }

    /// `family` has a user chain (someone else's counts: an empty one is still there).
    fn has_chains(&self, family: Family) -> bool {
        self.user_chains.iter().any(|c| c.family == nfproto(family))
    }

    /// `family` has a rule or an Istio chain: something of Istio's to remove.
    fn has_istio_state(&self, family: Family) -> bool {
        self.has_rules(family)
            || self
                .user_chains
                .iter()
                .any(|c| c.family == nfproto(family) && c.name.starts_with(chain::PREFIX))
    }

    /// The user chains, as `<table> <chain>` (for a decline's reason).
    fn chain_names(&self) -> String {
        self.user_chains.iter().map(|c| format!("{} {}", c.table, c.name)).collect::<Vec<_>>().join(", ")
    }
}

fn nfproto(family: Family) -> u8 {
    if family == Family::V4 { NFPROTO_IPV4 } else { NFPROTO_IPV6 }
}

/// The objects of the ip and ip6 nf_tables families.
fn xt(
    objects: Result<Vec<nf_probe::Object>, nf_probe::ProbeError>,
) -> Result<Vec<nf_probe::Object>, nf_probe::ProbeError> {
    Ok(objects?.into_iter().filter(|o| o.family == NFPROTO_IPV4 || o.family == NFPROTO_IPV6).collect())
}

/// Istio chains left in the ip and ip6 nf_tables families.
fn istio_chains() -> Result<Vec<String>, nf_probe::ProbeError> {
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
pub fn apply(plan: &RulePlan, probe: &Probe, lock: Lock) -> Result<Applied, CaptureError> {
    if let Some(table) = probe.legacy_in_use.first() {
        return Ok(Applied::Declined(Decline(format!("legacy table {table} holds rules"))));
    }
    if probe.has_rules(Family::V4) || probe.has_rules(Family::V6) {
        return Ok(Applied::Declined(Decline("the namespace already has iptables rules".into())));
    }
    if probe.has_chains(Family::V4) || probe.has_chains(Family::V6) {
        let chains = probe.chain_names();
        return Ok(Applied::Declined(Decline(format!(
            "the namespace already has iptables chains: {chains}"
        ))));
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
        if family == Family::V4 && in_process(text, probe)? {
            applied.push(family);
            tracing::info!(
                "Final iptables state (IPv4), written in process into an empty namespace:\n{text}"
            );
            continue;
        }
        if let Err(e) = x.restore(family, text, true) {
            // Nothing was there before: the snapshot of each applied family is empty. The
            // failing family too: iptables-nft-restore commits table by table, so the
            // tables before the one that failed are in.
            let snapshots: Vec<_> =
                applied.iter().chain([&family]).map(|f| (*f, Some(String::new()))).collect();
            return Err(rollback_iptables(&mut x, e.into(), &snapshots));
        }
        applied.push(family);
        // Istio logs the final state; here it is what went into an empty namespace.
        let name = if family == Family::V4 { "IPv4" } else { "IPv6" };
        tracing::info!("Final iptables state ({name}), restored into an empty namespace:\n{text}");
    }
    Ok(Applied::Done(x))
}

/// Writes one family's restore text as iptables-nft would, in process
/// ([`crate::iptables::xt_wire`]): true when the kernel took it. A text it does not know, or a
/// batch the kernel refused (it changed nothing), is left to `iptables-restore`; a
/// batch whose answer was lost may be in, and is an error.
fn in_process(text: &str, probe: &Probe) -> Result<bool, CaptureError> {
    // iptables-nft leaves a builtin chain it finds alone (sending it again re-registers
    // its hook: a kernel round of synchronisation, milliseconds); so does this.
    let existing: Vec<&str> = probe
        .base_chains
        .iter()
        .filter(|c| c.family == NFPROTO_IPV4 && c.table == "nat")
        .map(|c| c.name.as_str())
        .collect();
    let batch = match crate::iptables::xt_wire::compile(text, &existing) {
        Ok(batch) => batch,
        Err(why) => {
            tracing::debug!(%why, "running iptables-restore");
            return Ok(false);
        }
    };
    match crate::kernel::nft_batch::send(&batch) {
        Ok(()) => Ok(true),
        Err(e) if e.applied_nothing() => {
            tracing::warn!(error = %e, "the in-process iptables-nft batch did not go in; running iptables-restore");
            Ok(false)
        }
        Err(e) => Err(crate::nft::exec::NftError::from(e).into()),
    }
}

/// Removes the plan from the namespace: nothing to do where the probe finds no rule
/// and no Istio chain (another's chains are not Istio's to remove); else one restore
/// per family of the plan's removal, and the probe must then find no Istio chain. `Ok(Some(decline))` hands the run to the full path (a restore that
/// did not match changed nothing: restores are atomic).
pub fn remove(plan: &RulePlan, probe: &Probe, lock: Lock) -> Result<Option<Decline>, CaptureError> {
    if let Some(table) = probe.legacy_in_use.first() {
        return Ok(Some(Decline(format!("legacy table {table} holds rules"))));
    }
    let families: Vec<Family> =
        [Family::V4, Family::V6].into_iter().filter(|f| probe.has_istio_state(*f)).collect();
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
    cfg.enable_ipv6 || crate::kernel::routes::tproxy_needed(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::config::CaptureConfig;

    fn chain(family: u8, table: &str, name: &str) -> nf_probe::Object {
        nf_probe::Object { family, table: table.into(), name: name.into(), base_chain: false }
    }

    #[test]
    fn another_s_empty_chain_is_not_a_clean_namespace() {
        let probe = Probe { user_chains: vec![chain(NFPROTO_IPV4, "nat", "FOREIGN")], ..Probe::default() };
        assert!(!probe.no_rules(), "an empty user chain is still there");
        let plan = crate::iptables::plan::plan(&CaptureConfig::default());
        match apply(&plan, &probe, Lock::Global).unwrap() {
            Applied::Declined(Decline(why)) => assert!(why.contains("nat FOREIGN"), "{why}"),
            Applied::Done(_) => panic!("the fast path took a namespace holding another's chain"),
        }
        // Nothing of Istio's is there to remove (and nothing runs).
        assert_eq!(remove(&plan, &probe, Lock::Global).unwrap(), None);
        assert!(Probe::default().no_rules());
    }

    #[test]
    fn istio_chains_alone_are_istio_state_to_remove() {
        let probe =
            Probe { user_chains: vec![chain(NFPROTO_IPV6, "nat", "ISTIO_OUTPUT")], ..Probe::default() };
        assert!(probe.has_istio_state(Family::V6));
        assert!(!probe.has_istio_state(Family::V4));
        let foreign =
            Probe { user_chains: vec![chain(NFPROTO_IPV4, "filter", "KUBE-FW")], ..Probe::default() };
        assert!(!foreign.has_istio_state(Family::V4));
        assert!(foreign.has_chains(Family::V4));
    }
}
