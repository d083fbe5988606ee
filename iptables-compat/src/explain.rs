//! Which of Istio's nat rules a connection meets, walked as the kernel walks them for
//! its first packet, for `weir capture explain`: from the nat output hook for one the
//! pod makes, from the nat prerouting hook for one arriving at the pod (REDIRECT
//! inbound capture; TPROXY's mangle rules are refused by name). The rules: the `nat`
//! table of an `iptables-save` (or `ip6tables-save`), or
//! the native nftables table (`nft list table inet istio-proxy-nat`, or the `add rule`
//! lines Weir renders). Pure: the caller reads the rules from the pod's namespace and
//! says how the packet leaves (loopback or not). It understands the matches and targets
//! Istio's rules use; a rule with anything else is an error naming it, never a guess.

use std::{collections::HashMap, net::IpAddr};

use crate::inputs::config::Cidr;

/// The connection's first packet, as the nat OUTPUT hook (made by the pod) or
/// PREROUTING hook (arriving at the pod) sees it.
#[derive(Debug, Clone)]
pub struct Connection {
    pub dst: IpAddr,
    pub dst_port: u16,
    pub udp: bool,
    pub uid: u32,
    pub gid: u32,
    /// The address the socket is bound to (`None`: unbound, the kernel picks one, never
    /// 127.0.0.6).
    pub src: Option<IpAddr>,
    /// Whether the packet leaves through `lo` (a loopback destination or one of the
    /// pod's own addresses).
    pub through_lo: bool,
    /// The interface an arriving packet came in on (`None`: made by the pod).
    pub in_iface: Option<String>,
}

/// Where the walk ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// `REDIRECT --to-ports <port>`: to Envoy (15001 outbound, 15006 inbound) or the
    /// DNS proxy (15053).
    Redirect(u16),
    /// Left alone: a `RETURN` out of `OUTPUT`, an `ACCEPT`, or the end of `OUTPUT`.
    NotCaptured,
}

/// The outcome and the rules that decided it: every jump taken, then the deciding rule
/// (a redirect, or the last `RETURN` before `OUTPUT` ended; `None` when no rule
/// matched at all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explanation {
    pub outcome: Outcome,
    pub jumps: Vec<String>,
    pub decided_by: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExplainError {
    #[error("the saved rules have no nat table")]
    NoNatTable,
    #[error("rule `{rule}`: {what} is not something `weir capture explain` evaluates")]
    Unsupported { rule: String, what: String },
    #[error("rule `{rule}`: {what}")]
    Malformed { rule: String, what: String },
    #[error("rule `{rule}` jumps to chain {chain}, which the saved rules do not have")]
    NoChain { rule: String, chain: String },
    #[error("more than {MAX_DEPTH} nested jumps (a loop?) at rule `{rule}`")]
    TooDeep { rule: String },
    #[error(
        "inbound capture here is TPROXY (rule `{rule}` in the mangle table), which is not walked; the pod's nat rules do not decide its inbound connections"
    )]
    Tproxy { rule: String },
}

const MAX_DEPTH: usize = 16;

/// One `-A` rule: its matches (each possibly negated) and its target.
#[derive(Debug, Clone)]
struct Rule {
    text: String,
    matches: Vec<(bool, Match)>,
    target: Target,
}

#[derive(Debug, Clone)]
enum Match {
    /// nftables' `ip`/`ip6` payload matches imply the family (never negated).
    Family {
        v6: bool,
    },
    OutIface(String),
    InIface(String),
    Src(Cidr),
    Dst(Cidr),
    Proto(String),
    DstPorts(Vec<(u16, u16)>),
    SrcPorts,
    Uid(u32, u32),
    Gid(u32, u32),
}

#[derive(Debug, Clone)]
enum Target {
    Return,
    Accept,
    Redirect(u16),
    Jump(String),
    /// No `-j`: counts and goes on.
    None,
}

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

fn ports(raw: &str) -> Option<Vec<(u16, u16)>> {
    raw.split(',')
        .map(|p| match p.split_once(':') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => p.parse().ok().map(|n| (n, n)),
        })
        .collect()
}

fn id_range(raw: &str) -> Option<(u32, u32)> {
    match raw.split_once('-') {
        Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
        None => raw.parse().ok().map(|n| (n, n)),
    }
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

/// The nat table's chains, rule by rule.
fn nat_chains(save: &str) -> Result<HashMap<String, Vec<Rule>>, ExplainError> {
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

/// The chains of an nftables nat table, and its chain on `hook`: `nft list table`
/// blocks, or `add chain`/`add rule` lines (tables other than a nat one are skipped).
fn nft_chains(text: &str, hook: &str) -> Result<(HashMap<String, Vec<Rule>>, String), ExplainError> {
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
    let t: Vec<String> = line
        .replace('{', " { ")
        .replace('}', " } ")
        .replace(',', " ")
        .split_whitespace()
        .map(|w| w.trim_matches('"').to_string())
        .collect();
    let bad = |what: String| ExplainError::Malformed { rule: line.into(), what };
    let unsupported = |what: String| ExplainError::Unsupported { rule: line.into(), what };
    // `[!=] value` or `[!=] { a b }` at `i`: (negated, values, next index).
    let value = |i: usize| -> Result<(bool, Vec<String>, usize), ExplainError> {
        let (neg, i) = if t.get(i).is_some_and(|w| w == "!=") { (true, i + 1) } else { (false, i) };
        match t.get(i).map(String::as_str) {
            Some("{") => {
                let end =
                    t[i..].iter().position(|w| w == "}").ok_or_else(|| bad("a set without }".into()))?;
                Ok((neg, t[i + 1..i + end].to_vec(), i + end + 1))
            }
            Some(v) => Ok((neg, vec![v.to_string()], i + 1)),
            None => {
                let after = t.get(i.saturating_sub(1)).or(t.last()).map_or("a match", String::as_str);
                Err(bad(format!("{after} needs a value")))
            }
        }
    };
    let cidr = |v: &str| {
        let full = if v.contains('/') {
            v.to_string()
        } else {
            format!("{v}/{}", if v.contains(':') { 128 } else { 32 })
        };
        full.parse::<Cidr>().map_err(|e| bad(format!("address {v:?}: {e}")))
    };
    let id = |v: &[String]| match v {
        [one] => id_range(one).ok_or_else(|| bad(format!("id {one:?}"))),
        _ => Err(unsupported("a set of uids or gids".into())),
    };
    let (mut matches, mut target, mut i) = (Vec::new(), Target::None, 0);
    while i < t.len() {
        let key = t[i].as_str();
        let next = t.get(i + 1).map(String::as_str).unwrap_or_default();
        match key {
            "counter" => i += if next == "packets" { 5 } else { 1 },
            "oifname" | "iifname" => {
                let (neg, v, n) = value(i + 1)?;
                let m =
                    if key == "oifname" { Match::OutIface(v.join(" ")) } else { Match::InIface(v.join(" ")) };
                matches.push((neg, m));
                i = n;
            }
            "ip" | "ip6" if next == "saddr" || next == "daddr" => {
                let (neg, v, n) = value(i + 2)?;
                let [addr] = v.as_slice() else { return Err(unsupported("a set of addresses".into())) };
                matches.push((false, Match::Family { v6: key == "ip6" }));
                matches.push((
                    neg,
                    if next == "saddr" { Match::Src(cidr(addr)?) } else { Match::Dst(cidr(addr)?) },
                ));
                i = n;
            }
            "meta" if next == "l4proto" => {
                let (neg, v, n) = value(i + 2)?;
                matches.push((neg, Match::Proto(v.join(" "))));
                i = n;
            }
            "meta" | "skuid" | "skgid" => {
                let (field, at) = if key == "meta" { (next, i + 2) } else { (key, i + 1) };
                let (neg, v, n) = value(at)?;
                let (lo, hi) = id(&v)?;
                match field {
                    "skuid" => matches.push((neg, Match::Uid(lo, hi))),
                    "skgid" => matches.push((neg, Match::Gid(lo, hi))),
                    other => return Err(unsupported(format!("meta {other}"))),
                }
                i = n;
            }
            "tcp" | "udp" if next == "dport" || next == "sport" => {
                let (neg, v, n) = value(i + 2)?;
                matches.push((false, Match::Proto(key.into())));
                let list = v
                    .iter()
                    .map(|p| ports(&p.replace('-', ":")).and_then(|r| r.first().copied()))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad(format!("ports {v:?}")))?;
                matches.push((neg, if next == "dport" { Match::DstPorts(list) } else { Match::SrcPorts }));
                i = n;
            }
            "return" | "accept" | "jump" | "redirect" => {
                target = match (key, next) {
                    ("return", _) => Target::Return,
                    ("accept", _) => Target::Accept,
                    ("jump", chain) if !chain.is_empty() => Target::Jump(chain.into()),
                    ("redirect", "to") => {
                        let port = t
                            .get(i + 2)
                            .and_then(|p| p.trim_start_matches(':').split('-').next()?.parse().ok());
                        Target::Redirect(port.ok_or_else(|| bad("redirect without a port".into()))?)
                    }
                    _ => return Err(bad(format!("{key} {next}"))),
                };
                break;
            }
            other => return Err(unsupported(format!("statement {other}"))),
        }
    }
    Ok(Rule { text: line.into(), matches, target })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        inputs::{detect::HostFacts, flags::IstioIptablesArgs},
        iptables::render,
    };
    use clap::Parser;

    #[derive(Parser)]
    #[command(args_override_self = true)]
    struct Cli {
        #[command(flatten)]
        args: IstioIptablesArgs,
    }

    struct Pod;

    impl HostFacts for Pod {
        fn addresses(&self) -> std::io::Result<Vec<IpAddr>> {
            Ok(vec!["127.0.0.1".parse().unwrap(), "10.0.0.5".parse().unwrap()])
        }
        fn resolv_conf(&self) -> std::io::Result<String> {
            Ok("nameserver 10.96.0.10\n".into())
        }
        fn user_id(&self, _: &str) -> Option<u32> {
            None
        }
        fn group_exists(&self, _: &str) -> bool {
            false
        }
    }

    /// The injector's IPv4 rules (plus `extra` flags) as restore input.
    fn injector_save(extra: &[&str]) -> String {
        let mut argv = vec![
            "istio-iptables",
            "-p",
            "15001",
            "-z",
            "15006",
            "-u",
            "1337",
            "-m",
            "REDIRECT",
            "-i",
            "*",
            "-x",
            "",
            "-b",
            "*",
            "-d",
            "15090,15021,15020",
        ];
        argv.extend(extra);
        let cli = Cli::try_parse_from(argv).unwrap();
        let (cfg, _) = cli.args.resolve(&|_| None, &Pod).unwrap();
        render::restore(&crate::iptables::plan::plan(&cfg).v4)
    }

    fn app(dst: &str, port: u16) -> Connection {
        let dst: IpAddr = dst.parse().unwrap();
        Connection {
            dst,
            dst_port: port,
            udp: false,
            uid: 1000,
            gid: 1000,
            src: None,
            through_lo: dst.is_loopback(),
            in_iface: None,
        }
    }

    /// A new connection from a peer to the pod's `port`, arriving on eth0.
    fn peer(port: u16) -> Connection {
        Connection {
            in_iface: Some("eth0".into()),
            src: Some("10.0.0.7".parse().unwrap()),
            uid: 0,
            gid: 0,
            ..app("10.0.0.5", port)
        }
    }

    #[test]
    fn inbound_connections_are_walked_from_prerouting() {
        let save = injector_save(&[]);
        let e = explain_inbound(&save, &peer(8080)).unwrap();
        assert_eq!(e.outcome, Outcome::Redirect(15006), "{e:?}");
        assert_eq!(
            e.jumps,
            ["-A PREROUTING -p tcp -j ISTIO_INBOUND", "-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT"]
        );
        assert_eq!(e.decided_by.as_deref(), Some("-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006"));
        let e = explain_inbound(&save, &peer(15021)).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured);
        assert_eq!(e.decided_by.as_deref(), Some("-A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN"));
        let e = explain_inbound(&save, &peer(15008)).unwrap();
        assert_eq!(e.decided_by.as_deref(), Some("-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN"));
        // An excluded interface (-c) is named by its rule; others still captured. Weir's
        // flags take names only, as Istio's injector does; rules another tool made may
        // use iptables' wildcard, and explain reads them too.
        let save = injector_save(&["-c", "vethx"]).replace(" vethx ", " veth+ ");
        let on = |iface: &str| Connection { in_iface: Some(iface.into()), ..peer(8080) };
        let e = explain_inbound(&save, &on("veth7")).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured, "{save}");
        assert!(e.decided_by.as_deref().is_some_and(|r| r.contains("-i veth+")), "{e:?}");
        assert_eq!(explain_inbound(&save, &on("eth0")).unwrap().outcome, Outcome::Redirect(15006));
        // No inbound capture at all: nothing in PREROUTING decides.
        let none = explain_inbound(&injector_save(&["-b", ""]), &peer(8080)).unwrap();
        assert_eq!((none.outcome, none.decided_by), (Outcome::NotCaptured, None));
    }

    #[test]
    fn tproxy_inbound_capture_is_refused_by_its_rule() {
        let save = injector_save(&["-m", "TPROXY"]);
        let err = explain_inbound(&save, &peer(8080)).unwrap_err();
        assert!(matches!(err, ExplainError::Tproxy { .. }), "{err}");
        assert!(err.to_string().contains("TPROXY"), "{err}");
    }

    #[test]
    fn the_injectors_rules_send_apps_to_envoy_and_leave_envoy_alone() {
        let save = injector_save(&[]);
        let e = explain(&save, &app("10.0.0.9", 80)).unwrap();
        assert_eq!(e.outcome, Outcome::Redirect(15001), "{e:?}");
        assert_eq!(e.jumps, ["-A OUTPUT -j ISTIO_OUTPUT", "-A ISTIO_OUTPUT -j ISTIO_REDIRECT"]);
        let proxy = Connection { uid: 1337, gid: 1337, ..app("10.0.0.9", 80) };
        let e = explain(&save, &proxy).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured);
        assert_eq!(e.decided_by.as_deref(), Some("-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN"));
        let e = explain(&save, &app("127.0.0.1", 8080)).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured, "{e:?}");
        // Envoy calling its own pod through lo goes to the inbound side.
        let own = Connection { uid: 1337, gid: 1337, through_lo: true, ..app("10.0.0.5", 8080) };
        assert_eq!(explain(&save, &own).unwrap().outcome, Outcome::Redirect(15006));
        // Envoy's inbound passthrough, bound to 127.0.0.6.
        let passthrough =
            Connection { uid: 1337, gid: 1337, src: Some("127.0.0.6".parse().unwrap()), ..own.clone() };
        let e = explain(&save, &passthrough).unwrap();
        assert_eq!(e.decided_by.as_deref(), Some("-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN"), "{e:?}");
    }

    #[test]
    fn excluded_ports_and_cidrs_are_named_by_their_rule() {
        let save = injector_save(&["-o", "3306", "-x", "10.96.0.0/12"]);
        let e = explain(&save, &app("10.0.0.9", 3306)).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured);
        assert!(e.decided_by.as_deref().unwrap().contains("3306"), "{e:?}");
        let e = explain(&save, &app("10.96.0.10", 443)).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured);
        assert!(e.decided_by.as_deref().unwrap().contains("10.96.0.0/12"), "{e:?}");
    }

    #[test]
    fn a_live_native_nftables_table_is_walked_too() {
        // `nft list table inet istio-proxy-nat` in a namespace after `weir
        // istio-iptables ... -x 10.96.0.0/12 -o 9090 -q 3306 --redirect-dns
        // --native-nftables` (pod address 10.0.0.5, DNS server 10.255.255.53).
        let table = include_str!("../testdata/explain/nft-list-injector.txt");
        let e = explain_nft(table, &app("10.1.2.3", 80)).unwrap();
        assert_eq!(e.outcome, Outcome::Redirect(15001), "{e:?}");
        assert_eq!(
            e.jumps,
            [
                "counter packets 0 bytes 0 jump istio-output",
                "counter packets 0 bytes 0 jump istio-output-dns",
                "counter packets 0 bytes 0 jump istio-redirect"
            ]
        );
        let e = explain_nft(table, &app("10.96.1.1", 443)).unwrap();
        assert_eq!(e.decided_by.as_deref(), Some("ip daddr 10.96.0.0/12 counter packets 0 bytes 0 return"));
        let e = explain_nft(table, &app("10.1.2.3", 9090)).unwrap();
        assert_eq!(e.decided_by.as_deref(), Some("tcp dport 9090 counter packets 0 bytes 0 return"));
        let proxy = Connection { uid: 1337, gid: 1337, ..app("10.1.2.3", 80) };
        assert_eq!(
            explain_nft(table, &proxy).unwrap().decided_by.as_deref(),
            Some("meta skuid 1337 counter packets 0 bytes 0 return")
        );
        let dns = explain_nft(table, &app("10.255.255.53", 53)).unwrap();
        assert_eq!(dns.outcome, Outcome::Redirect(15053));
        // IPv6 skips every `ip` rule: an app's connection is captured all the same.
        let v6 = explain_nft(table, &app("fd00::9", 80)).unwrap();
        assert_eq!(v6.outcome, Outcome::Redirect(15001));
        let own = Connection { uid: 1337, gid: 1337, through_lo: true, ..app("10.0.0.5", 8080) };
        assert_eq!(explain_nft(table, &own).unwrap().outcome, Outcome::Redirect(15006));
        // Truncated statements are errors, never a panic (found by the fuzz target).
        for cut in ["ip daddr", "ip daddr !=", "tcp dport", "meta skuid", "oifname !=", "tcp dport { 53"] {
            let table = format!(
                "add chain inet istio-proxy-nat output {{ type nat hook output ; }}\nadd rule inet istio-proxy-nat output {cut}\n"
            );
            assert!(
                matches!(explain_nft(&table, &app("10.1.2.3", 80)), Err(ExplainError::Malformed { .. })),
                "{cut}"
            );
        }
        let odd = "table inet istio-proxy-nat {\n chain output {\n type nat hook output priority -100; policy accept;\n fib daddr type local counter return\n }\n}\n";
        assert!(explain_nft(odd, &app("10.1.2.3", 80)).unwrap_err().to_string().contains("statement fib"));
    }

    #[test]
    fn rules_it_does_not_understand_are_refused_by_name() {
        let save =
            "*nat\n-A OUTPUT -m statistic --probability 0.5 -j DNAT --to-destination 1.2.3.4\nCOMMIT\n";
        let err = explain(save, &app("10.0.0.9", 80)).unwrap_err();
        assert!(err.to_string().contains("option --probability"), "{err}");
        assert_eq!(explain("*filter\nCOMMIT\n", &app("10.0.0.9", 80)).unwrap_err(), ExplainError::NoNatTable);
        // Positions out of range and odd lines are read, not trusted.
        let save =
            "*nat\n-I OUTPUT 0 -p tcp -j REDIRECT --to-ports 15001\n-I OUTPUT 99 -j RETURN\n-A OUTPUT -j\n";
        assert!(matches!(explain(save, &app("10.0.0.9", 80)), Err(ExplainError::Malformed { .. })));
        let save = "*nat\n-I OUTPUT 0 -p tcp -j REDIRECT --to-ports 15001\n-I OUTPUT 99 -j RETURN\n";
        assert_eq!(explain(save, &app("10.0.0.9", 80)).unwrap().outcome, Outcome::Redirect(15001));
        let save = "*nat\n-A OUTPUT -j ISTIO_NOWHERE\nCOMMIT\n";
        assert!(matches!(explain(save, &app("10.0.0.9", 80)), Err(ExplainError::NoChain { .. })));
    }
}
