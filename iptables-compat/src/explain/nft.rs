//! A native nftables nat table read into chains of rules: `nft list table` blocks, or
//! the `add chain`/`add rule` lines Weir renders, each rule's statements in Istio's
//! vocabulary.

use std::collections::HashMap;

use super::model::{ExplainError, Match, Rule, Target, id_range, ports};
use crate::inputs::config::Cidr;

/// The chains of an nftables nat table, and its chain on `hook`: `nft list table`
/// blocks, or `add chain`/`add rule` lines (tables other than a nat one are skipped).
pub(super) fn nft_chains(
    text: &str,
    hook: &str,
) -> Result<(HashMap<String, Vec<Rule>>, String), ExplainError> {
    let hook_spec = format!("type nat hook {hook} ");
    let mut chains: HashMap<String, Vec<Rule>> = HashMap::new();
    let (mut entry, mut current) = (None, None::<String>);
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["add", "chain", _, table, name, ..] if table.ends_with("-nat") => {
                chains.entry(name.to_string()).or_default();
                if line.contains(&hook_spec) {
                    entry = Some(name.to_string());
                }
            }
            ["add", "rule", _, table, name, ..] if table.ends_with("-nat") => {
                let rule = line.splitn(6, ' ').nth(5).unwrap_or_default();
                chains.entry(name.to_string()).or_default().push(parse_nft_rule(rule)?);
            }
            ["add" | "flush" | "delete", ..] | ["table", ..] => {}
            ["chain", name, ..] => {
                current = Some(name.to_string());
                chains.entry(name.to_string()).or_default();
            }
            ["}"] => current = None,
            ["type", ..] => {
                if line.starts_with(&hook_spec) {
                    entry = current.clone();
                }
            }
            _ => {
                let Some(chain) = &current else { continue };
                let rule = parse_nft_rule(line)?;
                chains.entry(chain.clone()).or_default().push(rule);
            }
        }
    }
    // A table without a chain on the hook (Weir declares only chains with rules) lets
    // every packet through it: an empty entry chain.
    let entry = match entry {
        Some(entry) => entry,
        None if !chains.is_empty() => {
            let name = format!("(no {hook} chain)");
            chains.insert(name.clone(), Vec::new());
            name
        }
        None => return Err(ExplainError::NoNatTable),
    };
    Ok((chains, entry))
}

/// One nftables rule: its statements, Istio's vocabulary only.
fn parse_nft_rule(line: &str) -> Result<Rule, ExplainError> {
    let r = NftWords::of(line);
    let t = &r.t;
    let (mut matches, mut target, mut i) = (Vec::new(), Target::None, 0);
    while i < t.len() {
        let key = t[i].as_str();
        let next = t.get(i + 1).map(String::as_str).unwrap_or_default();
        match key {
            "counter" => i += if next == "packets" { 5 } else { 1 },
            "oifname" | "iifname" => {
                let (neg, v, n) = r.value(i + 1)?;
                let m =
                    if key == "oifname" { Match::OutIface(v.join(" ")) } else { Match::InIface(v.join(" ")) };
                matches.push((neg, m));
                i = n;
            }
            "ip" | "ip6" if next == "saddr" || next == "daddr" => {
                let (neg, v, n) = r.value(i + 2)?;
                let [addr] = v.as_slice() else { return Err(r.unsupported("a set of addresses".into())) };
                matches.push((false, Match::Family { v6: key == "ip6" }));
                matches.push((
                    neg,
                    if next == "saddr" { Match::Src(r.cidr(addr)?) } else { Match::Dst(r.cidr(addr)?) },
                ));
                i = n;
            }
            "meta" if next == "l4proto" => {
                let (neg, v, n) = r.value(i + 2)?;
                matches.push((neg, Match::Proto(v.join(" "))));
                i = n;
            }
            "meta" | "skuid" | "skgid" => {
                let (field, at) = if key == "meta" { (next, i + 2) } else { (key, i + 1) };
                let (neg, v, n) = r.value(at)?;
                let (lo, hi) = r.id(&v)?;
                match field {
                    "skuid" => matches.push((neg, Match::Uid(lo, hi))),
                    "skgid" => matches.push((neg, Match::Gid(lo, hi))),
                    other => return Err(r.unsupported(format!("meta {other}"))),
                }
                i = n;
            }
            "tcp" | "udp" if next == "dport" || next == "sport" => {
                let (neg, v, n) = r.value(i + 2)?;
                matches.push((false, Match::Proto(key.into())));
                let list = v
                    .iter()
                    .map(|p| ports(&p.replace('-', ":")).and_then(|range| range.first().copied()))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| r.bad(format!("ports {v:?}")))?;
                matches.push((neg, if next == "dport" { Match::DstPorts(list) } else { Match::SrcPorts }));
                i = n;
            }
            "return" | "accept" | "jump" | "redirect" => {
                target = r.target(i, key, next)?;
                break;
            }
            other => return Err(r.unsupported(format!("statement {other}"))),
        }
    }
    Ok(Rule { text: line.into(), matches, target })
}

/// An nftables rule's words (braces and commas apart, quotes off), and how
/// [`parse_nft_rule`] reads values from them and names what it cannot read.
struct NftWords<'a> {
    line: &'a str,
    t: Vec<String>,
}

impl<'a> NftWords<'a> {
    fn of(line: &'a str) -> Self {
        let t = line
            .replace('{', " { ")
            .replace('}', " } ")
            .replace(',', " ")
            .split_whitespace()
            .map(|w| w.trim_matches('"').to_string())
            .collect();
        Self { line, t }
    }

    fn bad(&self, what: String) -> ExplainError {
        ExplainError::Malformed { rule: self.line.into(), what }
    }

    fn unsupported(&self, what: String) -> ExplainError {
        ExplainError::Unsupported { rule: self.line.into(), what }
    }

    /// `[!=] value` or `[!=] { a b }` at `i`: (negated, values, next index).
    fn value(&self, i: usize) -> Result<(bool, Vec<String>, usize), ExplainError> {
        let t = &self.t;
        let (neg, i) = if t.get(i).is_some_and(|w| w == "!=") { (true, i + 1) } else { (false, i) };
        match t.get(i).map(String::as_str) {
            Some("{") => {
                let end =
                    t[i..].iter().position(|w| w == "}").ok_or_else(|| self.bad("a set without }".into()))?;
                Ok((neg, t[i + 1..i + end].to_vec(), i + end + 1))
            }
            Some(v) => Ok((neg, vec![v.to_string()], i + 1)),
            None => {
                let after = t.get(i.saturating_sub(1)).or(t.last()).map_or("a match", String::as_str);
                Err(self.bad(format!("{after} needs a value")))
            }
        }
    }

    /// An address, a host one without a prefix length.
    fn cidr(&self, v: &str) -> Result<Cidr, ExplainError> {
        let full = if v.contains('/') {
            v.to_string()
        } else {
            format!("{v}/{}", if v.contains(':') { 128 } else { 32 })
        };
        full.parse::<Cidr>().map_err(|e| self.bad(format!("address {v:?}: {e}")))
    }

    /// One uid or gid, or a range of them.
    fn id(&self, v: &[String]) -> Result<(u32, u32), ExplainError> {
        match v {
            [one] => id_range(one).ok_or_else(|| self.bad(format!("id {one:?}"))),
            _ => Err(self.unsupported("a set of uids or gids".into())),
        }
    }

    /// The rule's verdict from `key` at `i` (`next` the word after it).
    fn target(&self, i: usize, key: &str, next: &str) -> Result<Target, ExplainError> {
        Ok(match (key, next) {
            ("return", _) => Target::Return,
            ("accept", _) => Target::Accept,
            ("jump", chain) if !chain.is_empty() => Target::Jump(chain.into()),
            ("redirect", "to") => {
                let port =
                    self.t.get(i + 2).and_then(|p| p.trim_start_matches(':').split('-').next()?.parse().ok());
                Target::Redirect(port.ok_or_else(|| self.bad("redirect without a port".into()))?)
            }
            _ => return Err(self.bad(format!("{key} {next}"))),
        })
    }
}
