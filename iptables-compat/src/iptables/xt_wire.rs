//! iptables-nft's rules made in process: the IPv4 `iptables-restore` text Weir renders
//! for a namespace the probe found clean ([`crate::apply::fast_path`]) compiled into the
//! nf_tables messages `iptables-nft-restore --noflush` sends for it (family ip, table
//! nat): user chains created exclusively, builtin chains created as iptables-nft
//! creates them (hook, priority; a new one's policy is accept), each rule as iptables-nft encodes it
//! (interfaces, protocol, addresses, then the matches in order, a counter, the target;
//! `-m owner` and `-j REDIRECT` as x_tables structs, the rule's protocol in
//! `NFTA_RULE_COMPAT`), so `iptables-nft-save`, `-C` and `-D` read them as their own.
//! A pure function; [`crate::kernel::nft_batch`] sends the result. Only the nat table's forms
//! REDIRECT mode uses are known; the mangle and raw tables (TPROXY, DNS conntrack
//! zones), IPv6, multiport, marks and the rest are [`Unsupported`] and go to
//! `iptables-restore` as before.

use crate::kernel::{
    nf_probe::NFPROTO_IPV4,
    nft_encode::{
        Batch, Expr, IPPROTO_TCP, IPPROTO_UDP, Message, NF_ACCEPT, NF_DROP, NFT_CMP_EQ, NFT_CMP_NEQ,
        NFT_JUMP, NFT_META_IIFNAME, NFT_META_L4PROTO, NFT_META_OIFNAME, NFT_MSG_NEWCHAIN, NFT_MSG_NEWRULE,
        NFT_MSG_NEWTABLE, NFT_PAYLOAD_TRANSPORT_HEADER, NFT_RETURN, NLM_F_CREATE, NLM_F_EXCL, RuleOrder,
        Unsupported, decimal, encode, nest, position, prefix_match, put_str, put_u32, unsupported,
        within_size,
    },
};

/// The nat table's builtin chains: hook number and priority, as iptables-nft makes them.
fn nat_builtin(chain: &str) -> Option<(u32, i32)> {
    match chain {
        "PREROUTING" => Some((0, -100)),
        "INPUT" => Some((1, 100)),
        "OUTPUT" => Some((3, -100)),
        "POSTROUTING" => Some((4, 100)),
        _ => None,
    }
}

const TABLE: &str = "nat";
/// `NFTA_RULE_COMPAT`: the rule's `-p` for x_tables extensions.
const NFTA_RULE_COMPAT: u16 = 5;
/// `XT_OWNER_UID`, `XT_OWNER_GID`.
const XT_OWNER_UID: u8 = 1;
const XT_OWNER_GID: u8 = 2;
/// `NF_NAT_RANGE_PROTO_SPECIFIED`.
const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 2;

/// One rule line: its chain, arguments, and where it goes.
struct Rule<'a> {
    chain: &'a str,
    args: Vec<&'a str>,
    line: &'a str,
    before: Option<usize>,
    referenced: bool,
}

/// A restore's nat table, parsed.
struct Restore<'a> {
    lines: Vec<Line<'a>>,
    rules: Vec<Rule<'a>>,
    /// The user chains it creates, in order.
    user_chains: Vec<&'a str>,
}

enum Line<'a> {
    UserChain(&'a str),
    Rule(usize),
}

/// Compiles one family's restore text (IPv4) into the batch iptables-nft-restore
/// would send on a namespace without Istio's chains, whose nat table already holds the
/// builtin chains `existing` (none in a fresh namespace).
pub fn compile(text: &str, existing: &[&str]) -> Result<Batch, Unsupported> {
    let Restore { lines, rules, user_chains } = parse_restore(text)?;
    let mut batch = Batch { family: NFPROTO_IPV4, messages: Vec::new() };
    if rules.is_empty() && user_chains.is_empty() {
        return Ok(batch);
    }
    batch.messages.push(table_message());
    let mut builtins_made: Vec<&str> = existing.to_vec();
    for line in &lines {
        match line {
            Line::UserChain(chain) => batch.messages.push(user_chain_message(chain)),
            Line::Rule(n) => {
                let rule = &rules[*n];
                if let Some((hooknum, prio)) = nat_builtin(rule.chain)
                    && !builtins_made.contains(&rule.chain)
                {
                    builtins_made.push(rule.chain);
                    batch.messages.push(builtin_chain_message(rule.chain, hooknum, prio));
                }
                batch.messages.push(rule_message(*n, rule, &user_chains)?);
            }
        }
    }
    within_size(batch)
}

/// The nat table's lines in order, its rules (where each goes, which a later insert
/// names) and the user chains it creates; any other table, line or form is refused.
fn parse_restore(text: &str) -> Result<Restore<'_>, Unsupported> {
    let mut lines = Vec::new();
    let mut rules: Vec<Rule> = Vec::new();
    let mut user_chains: Vec<&str> = Vec::new();
    let mut order = RuleOrder::default();
    let mut in_nat = false;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["*", "nat"] | ["*nat"] if !in_nat => in_nat = true,
            ["COMMIT"] if in_nat => in_nat = false,
            ["-N", chain] if in_nat => {
                if nat_builtin(chain).is_some() || user_chains.contains(chain) {
                    return unsupported(format!("`{line}`"));
                }
                user_chains.push(chain);
                lines.push(Line::UserChain(chain));
            }
            [verb @ ("-A" | "-I"), chain, rest @ ..] if in_nat => {
                if nat_builtin(chain).is_none() && !user_chains.contains(chain) {
                    return unsupported(format!("rule in chain {chain} this batch does not create"));
                }
                let (index, args) = match (*verb, rest) {
                    ("-I", [n, args @ ..]) => match decimal::<usize>(n) {
                        Some(n) if n >= 1 => (Some(n - 1), args),
                        _ => return unsupported(format!("`{line}`")),
                    },
                    _ => (None, rest),
                };
                let number = rules.len();
                let before = order
                    .place(*chain, number, index, true)
                    .map_err(|()| Unsupported(format!("`{line}`: index past the chain's end")))?;
                if let Some(target) = before {
                    rules[target].referenced = true;
                }
                rules.push(Rule { chain, args: args.to_vec(), line, before, referenced: false });
                lines.push(Line::Rule(number));
            }
            _ => return unsupported(format!("`{line}`")),
        }
    }
    if in_nat {
        return unsupported("a table without COMMIT");
    }
    Ok(Restore { lines, rules, user_chains })
}

/// The nat table, created if missing.
fn table_message() -> Message {
    let mut table = Vec::new();
    put_str(&mut table, 1, TABLE);
    Message { kind: NFT_MSG_NEWTABLE, flags: NLM_F_CREATE, attrs: table, what: "table ip nat".into() }
}

/// `-N <chain>`, created exclusively.
fn user_chain_message(chain: &str) -> Message {
    let mut a = Vec::new();
    put_str(&mut a, 1, TABLE);
    put_str(&mut a, 3, chain);
    Message { kind: NFT_MSG_NEWCHAIN, flags: NLM_F_EXCL, attrs: a, what: format!("-t nat -N {chain}") }
}

/// A nat builtin chain as iptables-nft makes it on first use: hooked, at its priority.
fn builtin_chain_message(chain: &str, hooknum: u32, prio: i32) -> Message {
    let mut a = Vec::new();
    put_str(&mut a, 1, TABLE);
    put_str(&mut a, 3, chain);
    nest(&mut a, 4, |h| {
        put_u32(h, 1, hooknum);
        put_u32(h, 2, prio as u32);
    });
    // No policy: a new chain's is accept, as iptables-nft makes it, and
    // one already there (the probe allows builtin chains) keeps its own.
    put_str(&mut a, 7, TABLE);
    Message {
        kind: NFT_MSG_NEWCHAIN,
        flags: NLM_F_CREATE,
        attrs: a,
        what: format!("the builtin chain nat {chain}"),
    }
}

/// Rule number `n` of the restore: its expressions, its protocol for the x_tables
/// extensions (`NFTA_RULE_COMPAT`), placed as its line says.
fn rule_message(n: usize, rule: &Rule, user_chains: &[&str]) -> Result<Message, Unsupported> {
    let (exprs, proto) = compile_rule(rule.chain, &rule.args, user_chains)
        .map_err(|Unsupported(why)| Unsupported(format!("{why} in `{}`", rule.line)))?;
    let mut a = Vec::new();
    put_str(&mut a, 1, TABLE);
    put_str(&mut a, 2, rule.chain);
    nest(&mut a, 4, |list| {
        for e in &exprs {
            encode(list, e);
        }
    });
    nest(&mut a, NFTA_RULE_COMPAT, |c| {
        put_u32(c, 1, u32::from(proto));
        put_u32(c, 2, 0);
    });
    let flags = position(&mut a, n, rule.referenced, rule.before);
    Ok(Message { kind: NFT_MSG_NEWRULE, flags, attrs: a, what: format!("-t nat {}", rule.line) })
}

/// An interface match as iptables-nft makes it: the name and its terminating NUL.
fn interface(key: u32, name: &str, invert: bool) -> Result<[Expr; 2], Unsupported> {
    // Istio's form (the one the flags were checked against); the wildcard `+` is not in it.
    if crate::inputs::config::check_interface_name("", name).is_err() {
        return unsupported(format!("interface {name:?}"));
    }
    let mut data = name.as_bytes().to_vec();
    data.push(0);
    Ok([Expr::MetaLoad(key), Expr::Cmp { op: if invert { NFT_CMP_NEQ } else { NFT_CMP_EQ }, data }])
}

fn address(word: &str, offset: u32, invert: bool) -> Result<Vec<Expr>, Unsupported> {
    let (addr, prefix) = match word.split_once('/') {
        Some((a, p)) => (a, decimal::<u32>(p).ok_or_else(|| Unsupported(format!("address {word}")))?),
        None => (word, 32),
    };
    let addr: std::net::Ipv4Addr = addr.parse().map_err(|_| Unsupported(format!("address {word}")))?;
    if prefix == 0 || prefix > 32 {
        return unsupported(format!("address {word}"));
    }
    prefix_match(&addr.octets(), prefix, offset, if invert { NFT_CMP_NEQ } else { NFT_CMP_EQ })
}

/// `struct xt_owner_match_info` (XT_ALIGNed to 24 bytes).
fn owner_info(uid: Option<u32>, gid: Option<u32>, invert: bool) -> Vec<u8> {
    let mut info = Vec::with_capacity(24);
    for v in [uid, uid, gid, gid] {
        info.extend(v.unwrap_or(0).to_ne_bytes());
    }
    let kind = if uid.is_some() { XT_OWNER_UID } else { XT_OWNER_GID };
    info.push(kind);
    info.push(if invert { kind } else { 0 });
    info.resize(24, 0);
    info
}

/// `struct nf_nat_ipv4_multi_range_compat` with one port (XT_ALIGNed to 24 bytes).
fn redirect_info(port: u16) -> Vec<u8> {
    let mut info = Vec::with_capacity(24);
    info.extend(1u32.to_ne_bytes());
    info.extend(NF_NAT_RANGE_PROTO_SPECIFIED.to_ne_bytes());
    info.extend([0u8; 8]);
    info.extend(port.to_be_bytes());
    info.extend(port.to_be_bytes());
    info.resize(24, 0);
    info
}

/// One rule's arguments (after `-A CHAIN` / `-I CHAIN N`) as iptables-nft's
/// expressions, and the rule's protocol (0 without `-p`).
fn compile_rule(chain: &str, args: &[&str], user_chains: &[&str]) -> Result<(Vec<Expr>, u8), Unsupported> {
    Ok(RuleParts::read(chain, args, user_chains)?.expressions())
}

/// The word at `i` of a rule's arguments (`""` past the end).
fn word<'a>(args: &[&'a str], i: usize) -> &'a str {
    args.get(i).copied().unwrap_or("")
}

/// What one rule's arguments say, each part kept for its place in iptables-nft's
/// encoding.
#[derive(Default)]
struct RuleParts {
    iif: Option<[Expr; 2]>,
    oif: Option<[Expr; 2]>,
    /// `-p`'s protocol; 0 without.
    proto: u8,
    saddr: Option<Vec<Expr>>,
    daddr: Option<Vec<Expr>>,
    /// Ports and `-m` matches, in the order given.
    matches: Vec<Expr>,
    target: Option<Expr>,
}

impl RuleParts {
    /// Reads `args` left to right; each option at most once, `!` only before one that
    /// takes it, nothing after the target.
    fn read(chain: &str, args: &[&str], user_chains: &[&str]) -> Result<Self, Unsupported> {
        let mut r = Self::default();
        let mut invert = false;
        let mut i = 0;
        let at = |i: usize| word(args, i);
        while i < args.len() {
            let word = args[i];
            i += 1;
            if r.target.is_some() {
                return unsupported(format!("`{word}` after the target"));
            }
            let inv = std::mem::take(&mut invert);
            match word {
                "!" if !inv => invert = true,
                "-p" if !inv && r.proto == 0 => {
                    r.proto = match at(i) {
                        "tcp" => IPPROTO_TCP,
                        "udp" => IPPROTO_UDP,
                        other => return unsupported(format!("-p {other}")),
                    };
                    i += 1;
                }
                // iptables refuses an input interface where packets have none yet, and an
                // output one where they have none yet.
                "-i" if r.iif.is_none() && !matches!(chain, "OUTPUT" | "POSTROUTING") => {
                    r.iif = Some(interface(NFT_META_IIFNAME, at(i), inv)?);
                    i += 1;
                }
                "-o" if r.oif.is_none() && !matches!(chain, "PREROUTING" | "INPUT") => {
                    r.oif = Some(interface(NFT_META_OIFNAME, at(i), inv)?);
                    i += 1;
                }
                "-s" if r.saddr.is_none() => {
                    r.saddr = Some(address(at(i), 12, inv)?);
                    i += 1;
                }
                "-d" if r.daddr.is_none() => {
                    r.daddr = Some(address(at(i), 16, inv)?);
                    i += 1;
                }
                "--dport" | "--sport" if r.proto != 0 => {
                    let port: u16 = decimal(at(i)).ok_or_else(|| Unsupported(format!("{word} {}", at(i))))?;
                    i += 1;
                    let offset = if word == "--sport" { 0 } else { 2 };
                    r.matches.push(Expr::Payload { base: NFT_PAYLOAD_TRANSPORT_HEADER, offset, len: 2 });
                    let op = if inv { NFT_CMP_NEQ } else { NFT_CMP_EQ };
                    r.matches.push(Expr::Cmp { op, data: port.to_be_bytes().to_vec() });
                }
                "-m" if !inv && at(i) == "owner" => {
                    let (owner, next) = owner_match(args, i)?;
                    r.matches.push(owner);
                    i = next;
                }
                "-j" if !inv => {
                    let (target, next) = jump_target(args, i, r.proto, user_chains)?;
                    r.target = Some(target);
                    i = next;
                }
                other => return unsupported(format!("`{other}`")),
            }
        }
        if invert {
            return unsupported("a trailing `!`");
        }
        Ok(r)
    }

    /// The expressions in iptables-nft's order (interfaces, protocol, addresses, the
    /// matches, a counter, the target), and the rule's protocol.
    fn expressions(self) -> (Vec<Expr>, u8) {
        let mut out = Vec::new();
        for part in [self.iif, self.oif].into_iter().flatten() {
            out.extend(part);
        }
        if self.proto != 0 {
            out.push(Expr::MetaLoad(NFT_META_L4PROTO));
            out.push(Expr::Cmp { op: NFT_CMP_EQ, data: vec![self.proto] });
        }
        for part in [self.saddr, self.daddr].into_iter().flatten() {
            out.extend(part);
        }
        out.extend(self.matches);
        out.push(Expr::CounterZeroed);
        out.extend(self.target);
        (out, self.proto)
    }
}

/// `-m owner [!] --uid-owner N` or `... --gid-owner N` from `owner` at `i`: the match,
/// and the index after it.
fn owner_match(args: &[&str], i: usize) -> Result<(Expr, usize), Unsupported> {
    let at = |i: usize| word(args, i);
    // Exactly one [!] --uid-owner N or --gid-owner N.
    let mut j = i + 1;
    let negated = at(j) == "!";
    if negated {
        j += 1;
    }
    let id: u32 = decimal(at(j + 1)).ok_or_else(|| Unsupported(format!("owner {}", at(j + 1))))?;
    let info = match at(j) {
        "--uid-owner" => owner_info(Some(id), None, negated),
        "--gid-owner" => owner_info(None, Some(id), negated),
        other => return unsupported(format!("-m owner {other}")),
    };
    Ok((Expr::XtMatch { name: "owner", rev: 1, info }, j + 2))
}

/// `-j`'s target from its name at `i`: a verdict, `REDIRECT --to-ports N` (with a
/// protocol), or a jump to a chain this restore creates; and the index after it.
fn jump_target(
    args: &[&str],
    i: usize,
    proto: u8,
    user_chains: &[&str],
) -> Result<(Expr, usize), Unsupported> {
    let at = |i: usize| word(args, i);
    let name = at(i);
    let i = i + 1;
    Ok(match name {
        "RETURN" => (Expr::Verdict { code: NFT_RETURN, chain: None }, i),
        "ACCEPT" => (Expr::Verdict { code: NF_ACCEPT, chain: None }, i),
        "DROP" => (Expr::Verdict { code: NF_DROP, chain: None }, i),
        // A port needs a protocol, as iptables says.
        "REDIRECT" if at(i) == "--to-ports" && proto != 0 => {
            let port: u16 =
                decimal(at(i + 1)).ok_or_else(|| Unsupported(format!("--to-ports {}", at(i + 1))))?;
            (Expr::XtTarget { name: "REDIRECT", rev: 0, info: redirect_info(port) }, i + 2)
        }
        chain if user_chains.contains(&chain) => {
            (Expr::Verdict { code: NFT_JUMP, chain: Some(chain.to_string()) }, i)
        }
        other => return unsupported(format!("-j {other}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(args: &str) -> Result<(Vec<Expr>, u8), Unsupported> {
        let args: Vec<&str> = args.split_whitespace().collect();
        compile_rule("ISTIO_OUTPUT", &args, &["ISTIO_IN_REDIRECT"])
    }

    #[test]
    fn fields_go_in_iptables_nft_order_whatever_the_argument_order() {
        let (e, proto) = rule(
            "-o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT",
        )
        .unwrap();
        assert_eq!(proto, IPPROTO_TCP);
        assert_eq!(e[0], Expr::MetaLoad(NFT_META_OIFNAME));
        assert_eq!(e[1], Expr::Cmp { op: NFT_CMP_EQ, data: b"lo\0".to_vec() });
        assert_eq!(e[2], Expr::MetaLoad(NFT_META_L4PROTO));
        assert_eq!(e[5], Expr::Cmp { op: NFT_CMP_NEQ, data: vec![127, 0, 0, 1] });
        assert_eq!(e[7], Expr::Cmp { op: NFT_CMP_NEQ, data: 15008u16.to_be_bytes().to_vec() });
        assert!(
            matches!(&e[8], Expr::XtMatch { name: "owner", info, .. } if info[16] == XT_OWNER_UID && info[17] == 0)
        );
        assert_eq!(e[9], Expr::CounterZeroed);
    }

    #[test]
    fn what_it_does_not_know_is_left_to_iptables_restore() {
        for args in [
            "-p tcp -m multiport --dports 1,2 -j RETURN",
            "-o eth+ -j RETURN",
            "-m owner --uid-owner envoy -j RETURN",
            "-p tcp -j TPROXY --on-port 15006",
            "-j MARK --set-mark 1337",
            "! -p tcp -j RETURN",
            "-j NOT_A_CHAIN",
            "-d ::1/128 -j RETURN",
            "-j RETURN -o lo",
            "-j REDIRECT --to-ports 15001",
        ] {
            assert!(rule(args).is_err(), "{args}");
        }
        let args = ["-i", "eth0", "-j", "RETURN"];
        assert!(
            compile_rule("OUTPUT", &args, &[]).is_err() && compile_rule("PREROUTING", &args, &[]).is_ok()
        );
        let args = ["-o", "lo", "-j", "RETURN"];
        assert!(
            compile_rule("PREROUTING", &args, &[]).is_err() && compile_rule("OUTPUT", &args, &[]).is_ok()
        );
        assert!(compile("* mangle\n-N ISTIO_DIVERT\nCOMMIT\n", &[]).is_err());
        assert!(compile("* nat\n-A ISTIO_OUTPUT -j RETURN\nCOMMIT\n", &[]).is_err(), "an undeclared chain");
        assert!(compile("* nat\n-N X\n-I X 2 -j RETURN\nCOMMIT\n", &[]).is_err(), "past the end");
        assert!(compile("", &[]).unwrap().messages.is_empty());
    }
}
