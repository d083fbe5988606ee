//! Reading what a namespace already has: `iptables-save` text parsed into Istio chains
//! and rules, and the comparison Istio's VerifyIptablesState makes between that and a
//! plan (clean / applied / drifted).

use std::collections::{BTreeMap, BTreeSet};

use super::plan::{Table, chain};

/// Per table, per chain: the rules that matter to Istio. Istio chains are always
/// present (possibly empty); builtin chains appear only with rules in them.
pub type SaveState = BTreeMap<String, BTreeMap<String, Vec<String>>>;

/// Parses `iptables-save` (or `iptables-restore` input) as Istio's GetStateFromSave:
/// the filter, nat, mangle and raw tables; `:ISTIO*` chain declarations; every
/// `-A`/`-I` rule and every `-N ISTIO*`.
pub fn parse_save(text: &str) -> SaveState {
    let mut state: SaveState = Table::ALL.iter().map(|t| (t.name().to_string(), BTreeMap::new())).collect();
    let mut table = String::new();
    for line in text.lines() {
        if line.trim().is_empty() || line.starts_with('#') || line == "COMMIT" {
            continue;
        }
        if let Some(name) = line.strip_prefix('*') {
            table = name.trim().to_string();
            continue;
        }
        let Some(chains) = state.get_mut(&table) else { continue };
        if let Some(decl) = line.strip_prefix(':') {
            if decl.starts_with("ISTIO") {
                let name = decl.split(' ').next().unwrap_or_default().to_string();
                chains.entry(name).or_default();
            }
            continue;
        }
        let words: Vec<&str> = line.split(' ').collect();
        let mut rule_chain = None;
        let mut is_rule = false;
        for (i, w) in words.iter().enumerate() {
            let next = words.get(i + 1).map(|n| n.trim_matches(|c| c == '\'' || c == '"'));
            match *w {
                "--append" | "-A" | "--insert" | "-I" if next.is_some() => {
                    is_rule = true;
                    rule_chain = next;
                }
                "--new" | "-N" if next.is_some_and(|n| n.starts_with("ISTIO")) => rule_chain = next,
                _ => {}
            }
        }
        let Some(rule_chain) = rule_chain else { continue };
        let rules = chains.entry(rule_chain.to_string()).or_default();
        if is_rule {
            rules.push(line.to_string());
        }
    }
    state
}

fn is_empty(state: &SaveState) -> bool {
    state.values().all(|chains| chains.is_empty())
}

/// What one family's current state is, relative to the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FamilyVerdict {
    /// Istio chains or rules are present.
    pub residue: bool,
    /// Current and planned differ.
    pub delta: bool,
    /// The plan has rules for this family.
    pub planned: bool,
}

/// Compares current `iptables-save` text with the plan's restore text. `check` runs
/// one `iptables -C` command and says whether the rule exists; it is consulted only
/// when chain shapes already match.
pub fn verify_family(
    current: Option<&str>,
    expected_restore: &str,
    checks: &[Vec<String>],
    mut check: impl FnMut(&[String]) -> bool,
) -> FamilyVerdict {
    let expected = parse_save(expected_restore);
    let planned = !is_empty(&expected);
    let Some(current) = current else {
        // iptables-save failed: assume clean.
        return FamilyVerdict { residue: false, delta: planned, planned };
    };
    let current = parse_save(current);
    let residue = !is_empty(&current);
    if !residue {
        return FamilyVerdict { residue, delta: planned, planned };
    }
    let mut delta = false;
    'outer: for (table, chains) in &expected {
        let Some(have) = current.get(table) else {
            delta = true;
            break;
        };
        for (name, rules) in chains {
            match have.get(name) {
                None => {
                    delta = true;
                    break 'outer;
                }
                Some(have_rules) if name.starts_with(chain::PREFIX) && have_rules.len() != rules.len() => {
                    delta = true;
                    break 'outer;
                }
                _ => {}
            }
        }
    }
    if !delta {
        delta = current.iter().any(|(table, chains)| {
            chains.keys().any(|c| {
                c.starts_with(chain::PREFIX) && !expected.get(table).is_some_and(|e| e.contains_key(c))
            })
        });
    }
    if !delta {
        delta = checks.iter().any(|cmd| !check(cmd));
    }
    FamilyVerdict { residue, delta, planned }
}

/// The overall verdict across families, as Istio combines them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No Istio rules anywhere they are planned: apply.
    Clean,
    /// Istio rules present and equal to the plan: nothing to do.
    Applied,
    /// Istio rules present and different: reconcile (or refuse).
    Drifted,
}

pub fn combine(families: &[FamilyVerdict]) -> Verdict {
    let residue = families.iter().any(|f| f.residue && f.planned);
    let delta = families.iter().any(|f| f.delta);
    match (residue, delta) {
        (false, _) => Verdict::Clean,
        (true, false) => Verdict::Applied,
        (true, true) => Verdict::Drifted,
    }
}

/// Istio chains and rules jumping into them, from a save: everything a cleanup must
/// remove regardless of which configuration created it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// (table, chain)
    pub chains: BTreeSet<(String, String)>,
    /// (table, rule line as saved) for rules in builtin chains that jump to Istio chains.
    pub jumps: Vec<(String, String)>,
}

impl Leftovers {
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty() && self.jumps.is_empty()
    }

    /// Only those in tables not in `tables`.
    pub fn outside(self, tables: &BTreeSet<String>) -> Self {
        Self {
            chains: self.chains.into_iter().filter(|(t, _)| !tables.contains(t)).collect(),
            jumps: self.jumps.into_iter().filter(|(t, _)| !tables.contains(t)).collect(),
        }
    }

    /// `iptables` commands removing them: jumps first, then flush and delete chains.
    pub fn cleanup_commands(&self) -> Vec<Vec<String>> {
        let mut out = Vec::new();
        for (table, line) in &self.jumps {
            let mut cmd = vec!["-t".to_string(), table.clone()];
            let mut words = line.split_whitespace();
            let _ = words.next(); // -A
            cmd.push("-D".into());
            cmd.extend(words.map(String::from));
            out.push(cmd);
        }
        for (table, chain) in &self.chains {
            out.push(vec!["-t".into(), table.clone(), "-F".into(), chain.clone()]);
        }
        for (table, chain) in &self.chains {
            out.push(vec!["-t".into(), table.clone(), "-X".into(), chain.clone()]);
        }
        out
    }
}

/// Finds Istio chains, and rules in other chains that jump to them, in a save.
pub fn leftovers(save: &str) -> Leftovers {
    let mut out = Leftovers::default();
    for (table, chains) in parse_save(save) {
        for (name, rules) in chains {
            if name.starts_with(chain::PREFIX) {
                out.chains.insert((table.clone(), name.clone()));
                continue;
            }
            for rule in rules {
                let words: Vec<&str> = rule.split_whitespace().collect();
                let jumps = words.windows(2).any(|w| {
                    (w[0] == "-j" || w[0] == "--jump") && w[1].trim_matches('"').starts_with(chain::PREFIX)
                });
                if jumps {
                    out.jumps.push((table.clone(), rule));
                }
            }
        }
    }
    out
}

/// Tables present in a save (`*name` lines).
pub fn tables_in(save: &str) -> BTreeSet<String> {
    save.lines().filter_map(|l| l.strip_prefix('*')).map(|t| t.trim().to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        inputs::config::CaptureConfig,
        iptables::{plan::plan, render},
    };

    const SAVED: &str = "\
# Generated by iptables-nft-save v1.8.9 (nf_tables) on Sun Nov 22 12:00:00 2026
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:ISTIO_INBOUND - [0:0]
:ISTIO_IN_REDIRECT - [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_REDIRECT - [0:0]
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp -m tcp --dport 15008 -j RETURN
COMMIT
";

    #[test]
    fn parse_save_keeps_istio_chains_and_their_rules() {
        let s = parse_save(SAVED);
        assert_eq!(s["nat"]["ISTIO_INBOUND"].len(), 1);
        assert!(s["nat"]["ISTIO_REDIRECT"].is_empty());
        assert_eq!(s["nat"]["OUTPUT"], vec!["-A OUTPUT -j ISTIO_OUTPUT"]);
        assert!(!s["nat"].contains_key("PREROUTING"), "builtin chains appear only with rules");
        assert!(s["filter"].is_empty() && s["raw"].is_empty());
    }

    #[test]
    fn a_clean_namespace_needs_the_plan() {
        let p = plan(&CaptureConfig::default());
        let v = verify_family(Some("# empty\n"), &render::restore(&p.v4), &[], |_| true);
        assert_eq!(v, FamilyVerdict { residue: false, delta: true, planned: true });
        assert_eq!(combine(&[v]), Verdict::Clean);
    }

    #[test]
    fn the_applied_plan_is_recognised_only_if_every_check_passes() {
        let p = plan(&CaptureConfig::default());
        let restore = render::restore(&p.v4);
        // Our own restore text, read back as a save, has the same shape.
        let same = verify_family(Some(&restore), &restore, &render::checks(&p.v4), |_| true);
        assert_eq!(combine(&[same]), Verdict::Applied);
        let changed = verify_family(Some(&restore), &restore, &render::checks(&p.v4), |cmd| {
            !cmd.contains(&"lo".to_string())
        });
        assert_eq!(combine(&[changed]), Verdict::Drifted);
    }

    #[test]
    fn a_missing_or_extra_istio_chain_is_drift() {
        let p = plan(&CaptureConfig::default());
        let restore = render::restore(&p.v4);
        let v = verify_family(Some(SAVED), &restore, &[], |_| true);
        assert_eq!(combine(&[v]), Verdict::Drifted);
        let extra = format!("{restore}* mangle\n-N ISTIO_DIVERT\nCOMMIT\n");
        assert_eq!(combine(&[verify_family(Some(&extra), &restore, &[], |_| true)]), Verdict::Drifted);
    }

    #[test]
    fn residue_where_nothing_is_planned_is_ignored() {
        let planned_v4 = FamilyVerdict { residue: false, delta: true, planned: true };
        let stray_v6 = FamilyVerdict { residue: true, delta: true, planned: false };
        assert_eq!(combine(&[planned_v4, stray_v6]), Verdict::Clean);
    }

    #[test]
    fn leftovers_find_chains_and_jumps() {
        let l = leftovers(SAVED);
        assert_eq!(l.chains.len(), 4);
        assert_eq!(l.jumps, vec![("nat".to_string(), "-A OUTPUT -j ISTIO_OUTPUT".to_string())]);
        let cmds = l.cleanup_commands();
        assert_eq!(cmds[0], ["-t", "nat", "-D", "OUTPUT", "-j", "ISTIO_OUTPUT"].map(String::from));
        assert_eq!(cmds.len(), 1 + 4 + 4);
    }
}
