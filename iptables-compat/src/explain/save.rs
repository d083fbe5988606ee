//! The nat table of an `iptables-save` (or restore input) read into chains of rules:
//! `-A`/`-I` lines word by word, the matches and targets Istio's rules use.

use std::collections::HashMap;

use super::model::{ExplainError, Match, Rule, Target, id_range, ports};
use crate::inputs::config::Cidr;

/// A rule line's words, split at spaces outside double quotes.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            _ => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// A rule line (`-A CHAIN ...`, or `-I CHAIN [N] ...` as restore input has them): its
/// chain, its position for an insert (1-based), and the rule.
fn parse_rule(line: &str) -> Result<(String, Option<usize>, Rule), ExplainError> {
    let w = words(line);
    let bad = |what: &str| ExplainError::Malformed { rule: line.into(), what: what.into() };
    let unsupported = |what: String| ExplainError::Unsupported { rule: line.into(), what };
    let chain = w.get(1).ok_or_else(|| bad("no chain after -A"))?.clone();
    let insert_at = match w[0].as_str() {
        "-I" | "--insert" => Some(w.get(2).and_then(|n| n.parse().ok()).unwrap_or(1)),
        _ => None,
    };
    let (mut matches, mut target, mut negate) = (Vec::new(), Target::None, false);
    let mut i =
        if insert_at.is_some() && w.get(2).is_some_and(|n| n.parse::<usize>().is_ok()) { 3 } else { 2 };
    while i < w.len() {
        let arg = |k: usize| {
            w.get(k).map(String::as_str).ok_or_else(|| bad(&format!("{} needs a value", w[k - 1])))
        };
        let cidr = |v: &str| v.parse::<Cidr>().map_err(|e| bad(&format!("address {v:?}: {e}")));
        let m = match w[i].as_str() {
            "!" => {
                negate = true;
                i += 1;
                continue;
            }
            "-m" | "--match" => {
                i += 2;
                continue;
            }
            "-o" | "--out-interface" => Some(Match::OutIface(arg(i + 1)?.into())),
            "-i" | "--in-interface" => Some(Match::InIface(arg(i + 1)?.into())),
            "-s" | "--source" => Some(Match::Src(cidr(arg(i + 1)?)?)),
            "-d" | "--destination" => Some(Match::Dst(cidr(arg(i + 1)?)?)),
            "-p" | "--protocol" => Some(Match::Proto(arg(i + 1)?.into())),
            "--dport" | "--dports" | "--destination-port" | "--destination-ports" => {
                Some(Match::DstPorts(ports(arg(i + 1)?).ok_or_else(|| bad("bad port list"))?))
            }
            "--sport" | "--sports" | "--source-port" | "--source-ports" => Some(Match::SrcPorts),
            "--uid-owner" => {
                let (lo, hi) = id_range(arg(i + 1)?).ok_or_else(|| bad("bad uid"))?;
                Some(Match::Uid(lo, hi))
            }
            "--gid-owner" => {
                let (lo, hi) = id_range(arg(i + 1)?).ok_or_else(|| bad("bad gid"))?;
                Some(Match::Gid(lo, hi))
            }
            "-j" | "--jump" => {
                target = match arg(i + 1)? {
                    "RETURN" => Target::Return,
                    "ACCEPT" => Target::Accept,
                    "REDIRECT" => {
                        let port = w
                            .iter()
                            .position(|a| a == "--to-ports" || a == "--to-port")
                            .and_then(|k| w.get(k + 1))
                            .and_then(|p| p.split(['-', ':']).next()?.parse().ok())
                            .ok_or_else(|| bad("REDIRECT without --to-ports"))?;
                        Target::Redirect(port)
                    }
                    t if t.chars().all(|c| c.is_ascii_uppercase() || c == '_') && t.starts_with("ISTIO") => {
                        Target::Jump(t.into())
                    }
                    other => return Err(unsupported(format!("target {other}"))),
                };
                break;
            }
            other => return Err(unsupported(format!("option {other}"))),
        };
        if let Some(m) = m {
            matches.push((std::mem::take(&mut negate), m));
        }
        i += 2;
    }
    Ok((chain, insert_at, Rule { text: line.into(), matches, target }))
}

/// The nat table's chains, rule by rule.
pub(super) fn nat_chains(save: &str) -> Result<HashMap<String, Vec<Rule>>, ExplainError> {
    let mut chains: HashMap<String, Vec<Rule>> = HashMap::new();
    let (mut in_nat, mut seen) = (false, false);
    for line in save.lines() {
        let line = line.trim();
        if let Some(table) = line.strip_prefix('*') {
            in_nat = table.trim() == "nat";
            seen |= in_nat;
            continue;
        }
        // `iptables-save -c` prefixes rules with their counters.
        let line = if line.starts_with('[') { line.split_once(' ').map_or("", |(_, r)| r) } else { line };
        if in_nat && (line.starts_with("-A ") || line.starts_with("-I ")) {
            let (chain, insert_at, rule) = parse_rule(line)?;
            let rules = chains.entry(chain).or_default();
            match insert_at {
                Some(n) => rules.insert(n.saturating_sub(1).min(rules.len()), rule),
                None => rules.push(rule),
            }
        }
    }
    if !seen {
        return Err(ExplainError::NoNatTable);
    }
    Ok(chains)
}
