//! Renders an iptables [`RulePlan`](super::plan::RulePlan): the `iptables-restore
//! --noflush` input per family, the `-C` checks that verify a rule is present, and the
//! `-D`/`-F`/`-X` commands that undo it. Text only; nothing here runs a command.

use std::collections::{BTreeMap, HashSet};

use super::plan::{Rule, Table, chain, is_builtin};

/// `iptables-restore` input for one family, as Istio builds it: tables sorted by name
/// (`* <table>`), `-N` for each non-builtin chain in order of its first rule, then for
/// chains only jumped to, then the rules in order, then `COMMIT`. Empty tables are left
/// out. An empty plan renders as an empty string.
pub fn restore(rules: &[Rule]) -> String {
    let mut tables: BTreeMap<Table, Vec<String>> = BTreeMap::new();
    let mut seen: HashSet<(Table, &str)> = HashSet::new();
    for r in rules {
        if seen.insert((r.table, r.chain.as_str())) && !is_builtin(&r.chain) {
            tables.entry(r.table).or_default().push(format!("-N {}", r.chain));
        }
    }
    for r in rules {
        if let Some(target) = r.jump_target()
            && seen.insert((r.table, target))
            && !is_builtin(target)
        {
            tables.entry(r.table).or_default().push(format!("-N {target}"));
        }
    }
    for r in rules {
        tables.entry(r.table).or_default().push(r.params.join(" "));
    }
    let mut out = String::new();
    for (table, lines) in tables {
        if lines.is_empty() {
            continue;
        }
        out.push_str(&format!("* {table}\n"));
        for line in lines {
            out.push_str(&line);
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// `-t <table> -C ...` for every rule: each must exist for the plan to be in place.
pub fn checks(rules: &[Rule]) -> Vec<Vec<String>> {
    rules.iter().map(|r| with_table(r.table, &to_check_or_delete(&r.params, "-C"))).collect()
}

fn with_table(table: Table, params: &[String]) -> Vec<String> {
    let mut cmd = vec!["-t".to_string(), table.name().to_string()];
    cmd.extend(params.iter().cloned());
    cmd
}

/// `-A C x` / `-I C n x` → `<op> C x`.
fn to_check_or_delete(params: &[String], op: &str) -> Vec<String> {
    let mut out = Vec::with_capacity(params.len());
    let mut skip_position = false;
    for (i, p) in params.iter().enumerate() {
        if skip_position && i == 2 {
            continue;
        }
        match p.as_str() {
            "-A" | "--append" if i == 0 => out.push(op.to_string()),
            "-I" | "--insert" if i == 0 => {
                skip_position = true;
                out.push(op.to_string());
            }
            _ => out.push(p.clone()),
        }
    }
    out
}

/// Commands that remove a plan, as Istio's cleanup does: delete (in reverse) every rule
/// in a builtin chain, then flush and delete every Istio chain. Run each with errors
/// ignored: a missing rule is already clean.
pub fn cleanup(rules: &[Rule]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for r in rules.iter().rev() {
        // Rules inside Istio chains go away with the chain (unless they jump into one).
        let in_istio_chain = r.chain.starts_with(chain::PREFIX);
        let jumps_to_istio = r.jump_target().is_some_and(|t| t.starts_with(chain::PREFIX))
            || r.params.windows(2).any(|w| w[0] == "-j" && w[1].starts_with(chain::PREFIX));
        if in_istio_chain && !jumps_to_istio {
            continue;
        }
        out.push(with_table(r.table, &to_check_or_delete(&r.params, "-D")));
    }
    let mut seen = HashSet::new();
    for r in rules.iter().rev() {
        if !is_builtin(&r.chain) && seen.insert((r.table, r.chain.clone())) {
            out.push(with_table(r.table, &["-F".into(), r.chain.clone()]));
            out.push(with_table(r.table, &["-X".into(), r.chain.clone()]));
        }
    }
    out
}

/// [`cleanup`] as one `iptables-restore --noflush` input: per table, the rule
/// deletions, then every chain flushed, then every chain deleted (a chain another one
/// jumps to can go only once that one is flushed). Unlike the commands one by one, a
/// restore fails whole if any rule or chain is missing. Empty for an empty plan.
pub fn removal(rules: &[Rule]) -> String {
    let mut tables: BTreeMap<String, [Vec<String>; 3]> = BTreeMap::new();
    for cmd in cleanup(rules) {
        let stage = match cmd[2].as_str() {
            "-D" => 0,
            "-F" => 1,
            _ => 2,
        };
        tables.entry(cmd[1].clone()).or_default()[stage].push(cmd[2..].join(" "));
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

/// Istio's safety guardrails, inserted while rules are swapped during a reconcile:
/// drop all TCP and UDP in filter INPUT, FORWARD and OUTPUT.
pub fn guardrails() -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for chain in ["INPUT", "FORWARD", "OUTPUT"] {
        for proto in ["tcp", "udp"] {
            out.push(vec![
                "-t".into(),
                "filter".into(),
                "-I".into(),
                chain.into(),
                "1".into(),
                "-p".into(),
                proto.into(),
                "-j".into(),
                "DROP".into(),
            ]);
        }
    }
    out
}

/// The commands that remove [`guardrails`].
pub fn guardrails_cleanup() -> Vec<Vec<String>> {
    guardrails()
        .into_iter()
        .map(|cmd| {
            let mut out = vec![cmd[0].clone(), cmd[1].clone(), "-D".into(), cmd[3].clone()];
            out.extend(cmd[5..].iter().cloned());
            out
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{inputs::config::CaptureConfig, iptables::plan::plan};

    #[test]
    fn an_empty_rule_list_renders_nothing() {
        assert_eq!(restore(&[]), "");
    }

    #[test]
    fn checks_turn_appends_and_inserts_into_c() {
        let cfg = CaptureConfig {
            interception_mode: crate::inputs::config::InterceptionMode::Tproxy,
            ..Default::default()
        };
        let p = plan(&cfg);
        let checks = checks(&p.v4);
        assert!(checks.iter().all(|c| c[2] == "-C"), "{checks:?}");
        let insert =
            checks.iter().find(|c| c.contains(&"127.0.0.6/32".to_string()) && c[1] == "mangle").unwrap();
        assert_eq!(
            insert[..4],
            ["-t", "mangle", "-C", "ISTIO_INBOUND"].map(String::from),
            "position dropped"
        );
        assert_eq!(insert[4], "-p");
    }

    #[test]
    fn cleanup_deletes_builtin_rules_then_istio_chains() {
        let p = plan(&CaptureConfig::default());
        let cmds = cleanup(&p.v4);
        let has =
            |want: &[&str]| cmds.iter().any(|c| c == &want.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert!(has(&["-t", "nat", "-D", "OUTPUT", "-j", "ISTIO_OUTPUT"]));
        assert!(has(&["-t", "nat", "-X", "ISTIO_OUTPUT"]));
        // As Istio's UndoRules: rules inside Istio chains are deleted one by one only
        // when they jump to another Istio chain; the rest go with the chain flush.
        for c in cmds.iter().filter(|c| c[2] == "-D" && c[3].starts_with("ISTIO_")) {
            assert!(c.last().unwrap().starts_with("ISTIO_"), "{c:?}");
        }
        let deletes = cmds.iter().position(|c| c[2] == "-F").unwrap();
        assert!(cmds[..deletes].iter().all(|c| c[2] == "-D"), "deletes come before flushes");
    }

    #[test]
    fn guardrails_and_their_removal_pair_up() {
        let g = guardrails();
        let c = guardrails_cleanup();
        assert_eq!(g.len(), 6);
        assert_eq!(c[0], ["-t", "filter", "-D", "INPUT", "-p", "tcp", "-j", "DROP"].map(String::from));
    }
}
