//! The walk: a connection's first packet through the nat chains from the hook's entry
//! chain, as the kernel takes it (jumps, returns, the first rule that decides), for
//! each kind of rules and direction.

use std::collections::HashMap;

use super::{
    model::{Connection, ExplainError, Explanation, MAX_DEPTH, Match, Outcome, Rule, Target},
    nft::nft_chains,
    save::nat_chains,
};

/// Walks `save`'s nat `OUTPUT` for `conn`.
pub fn explain(save: &str, conn: &Connection) -> Result<Explanation, ExplainError> {
    walk(&nat_chains(save)?, "OUTPUT", conn)
}

/// Walks the native nftables nat table's output chain for `conn`.
pub fn explain_nft(table: &str, conn: &Connection) -> Result<Explanation, ExplainError> {
    let (chains, entry) = nft_chains(table, "output")?;
    walk(&chains, &entry, conn)
}

/// Walks `save`'s nat `PREROUTING` for `conn`, arriving at the pod; refused when the
/// mangle table holds Istio's TPROXY inbound rules (they decide instead).
pub fn explain_inbound(save: &str, conn: &Connection) -> Result<Explanation, ExplainError> {
    let mut in_mangle = false;
    for line in save.lines().map(str::trim) {
        if let Some(table) = line.strip_prefix('*') {
            in_mangle = table.trim() == "mangle";
        } else if in_mangle && (line.contains("-j ISTIO_INBOUND") || line.contains("-j ISTIO_TPROXY")) {
            return Err(ExplainError::Tproxy { rule: line.into() });
        }
    }
    walk(&nat_chains(save)?, "PREROUTING", conn)
}

/// Walks the native nftables nat table's prerouting chain for `conn`, arriving at the
/// pod (the caller checks that the namespace has no TPROXY mangle table).
pub fn explain_nft_inbound(table: &str, conn: &Connection) -> Result<Explanation, ExplainError> {
    let (chains, entry) = nft_chains(table, "prerouting")?;
    walk(&chains, &entry, conn)
}

fn walk(
    chains: &HashMap<String, Vec<Rule>>,
    entry: &str,
    conn: &Connection,
) -> Result<Explanation, ExplainError> {
    let mut jumps = Vec::new();
    // The last RETURN out of a user chain: what decided when OUTPUT then ends.
    let mut returned: Option<String> = None;
    // (chain, next rule index) of each chain entered.
    let mut stack: Vec<(&str, usize)> = vec![(entry, 0)];
    while let Some((chain, at)) = stack.pop() {
        let rules = chains.get(chain).map(Vec::as_slice).unwrap_or_default();
        let Some((i, rule)) = rules
            .iter()
            .enumerate()
            .skip(at)
            .find(|(_, r)| r.matches.iter().all(|(neg, m)| holds(m, conn) != *neg))
        else {
            // End of a user chain: back to the caller; end of OUTPUT: its ACCEPT policy.
            if stack.is_empty() {
                return Ok(Explanation { outcome: Outcome::NotCaptured, jumps, decided_by: returned });
            }
            continue;
        };
        let decided =
            |outcome| Ok(Explanation { outcome, jumps: jumps.clone(), decided_by: Some(rule.text.clone()) });
        match &rule.target {
            Target::Redirect(port) => return decided(Outcome::Redirect(*port)),
            Target::Accept => return decided(Outcome::NotCaptured),
            Target::Return if stack.is_empty() => return decided(Outcome::NotCaptured),
            Target::Return => returned = Some(rule.text.clone()),
            Target::None => stack.push((chain, i + 1)),
            Target::Jump(to) => {
                let to = chains
                    .get_key_value(to.as_str())
                    .map(|(k, _)| k.as_str())
                    .ok_or_else(|| ExplainError::NoChain { rule: rule.text.clone(), chain: to.clone() })?;
                if stack.len() >= MAX_DEPTH {
                    return Err(ExplainError::TooDeep { rule: rule.text.clone() });
                }
                jumps.push(rule.text.clone());
                stack.push((chain, i + 1));
                stack.push((to, 0));
            }
        }
    }
    Ok(Explanation { outcome: Outcome::NotCaptured, jumps, decided_by: None })
}

fn holds(m: &Match, c: &Connection) -> bool {
    let within = |(lo, hi): (u32, u32), v: u32| lo <= v && v <= hi;
    match m {
        Match::Family { v6 } => c.dst.is_ipv6() == *v6,
        Match::OutIface(name) => (name == "lo") == c.through_lo,
        Match::InIface(name) => c.in_iface.as_deref().is_some_and(|i| iface_matches(name, i)),
        Match::Src(cidr) => c.src.is_some_and(|s| cidr.contains(s)),
        Match::Dst(cidr) => cidr.contains(c.dst),
        Match::Proto(p) => p == if c.udp { "udp" } else { "tcp" },
        Match::DstPorts(list) => list.iter().any(|&(lo, hi)| lo <= c.dst_port && c.dst_port <= hi),
        // An app's source port is an ephemeral one, never the DNS proxy's 15053.
        Match::SrcPorts => false,
        Match::Uid(lo, hi) => within((*lo, *hi), c.uid),
        Match::Gid(lo, hi) => within((*lo, *hi), c.gid),
    }
}

/// An interface name against a rule's: exact, or a prefix ending in `+` (iptables) or
/// `*` (nftables).
fn iface_matches(pattern: &str, name: &str) -> bool {
    let pattern = pattern.trim_matches('"');
    match pattern.strip_suffix(['+', '*']) {
        Some(prefix) => name.starts_with(prefix),
        None => pattern == name,
    }
}
