//! An nft transaction as the nf_tables netlink messages `nft -f` sends for it, made
//! in process: the text [`crate::nft::render`] writes for a namespace with no Istio
//! table (add table, add chain, add/insert rule) compiled into one batch, with the
//! same expressions nft's compiler emits (its implicit `meta nfproto`/`meta l4proto`
//! dependencies, its shortened loads for byte-aligned prefixes, its anonymous sets).
//! A pure function: [`compile`] returns the bytes, [`crate::kernel::nft_batch`] sends them.
//! Only the forms Weir's sidecar plans use are known; anything else (user or group
//! names, wildcard interfaces, other sets, other statements) is [`Unsupported`] and
//! the transaction goes to `nft -f` as before, so nothing is ever guessed.

use std::net::IpAddr;

pub use crate::kernel::nft_encode::{
    Batch, MAX_BATCH_BYTES, Message, NFT_MSG_NEWCHAIN, NFT_MSG_NEWRULE, NFT_MSG_NEWSET, NFT_MSG_NEWSETELEM,
    NFT_MSG_NEWTABLE, Unsupported,
};
use crate::kernel::{
    nf_probe::{NFPROTO_INET, NFPROTO_IPV4, NFPROTO_IPV6},
    nft_encode::*,
};

/// An anonymous set of `tcp dport` values a rule looks up.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PortSet {
    id: u32,
    ports: Vec<u16>,
}

/// A parsed `add chain` line.
struct Chain {
    table: String,
    name: String,
    /// type, hook number, priority.
    base: Option<(String, u32, i32)>,
}

/// A parsed `add rule` or `insert rule` line.
struct Rule<'a> {
    table: &'a str,
    chain: &'a str,
    expr: &'a str,
    /// The line as written (`add rule ...` or `insert rule ... index i ...`).
    line: &'a str,
    /// For an insert: the rule (by its number in the transaction) it goes before.
    before: Option<usize>,
    /// Whether a later insert names this rule's position (it then carries an id).
    referenced: bool,
}

/// One line of the transaction, in order.
enum Line {
    Table(String),
    Chain(Chain),
    Rule(usize),
}

/// Compiles `tx` (as [`crate::nft::render`] writes it) into the batch `nft -f` would
/// send on a namespace without these tables, message for message: tables, chains and
/// rules in the text's order, an anonymous set right before its rule, and an `insert
/// ... index i` placed before the rule then at position i by that rule's transaction
/// id (`NFTA_RULE_POSITION_ID`), as nft places it. Every table is created exclusively:
/// if one appeared since the caller looked, the kernel refuses the whole batch rather
/// than add to it (`nft -f`'s `flush table` is then the way).
pub fn compile(tx: &str) -> Result<Batch, Unsupported> {
    let mut lines: Vec<Line> = Vec::new();
    let mut rules: Vec<Rule> = Vec::new();
    let mut order = RuleOrder::default();
    let declared = |lines: &[Line], table: &str, chain: Option<&str>| {
        lines.iter().any(|l| match l {
            Line::Table(t) => chain.is_none() && t == table,
            Line::Chain(c) => Some(c.name.as_str()) == chain && c.table == table,
            Line::Rule(_) => false,
        })
    };
    for line in tx.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["add", "table", "inet", table] => lines.push(Line::Table(table.to_string())),
            ["flush", "table", "inet", table] if matches!(lines.last(), Some(Line::Table(t)) if t == table) =>
            {
                // A table this batch creates is empty: nothing to flush.
            }
            ["add", "chain", "inet", table, chain, rest @ ..] => {
                if !declared(&lines, table, None) {
                    return unsupported(format!("chain {chain} in table {table} this batch does not create"));
                }
                let base = match rest {
                    [] => None,
                    ["{", "type", kind, "hook", hook, "priority", prio, ";", "}"] => {
                        let hooknum = match *hook {
                            "prerouting" => 0,
                            "input" => 1,
                            "forward" => 2,
                            "output" => 3,
                            "postrouting" => 4,
                            other => return unsupported(format!("hook {other}")),
                        };
                        let Ok(prio) = prio.parse::<i32>() else {
                            return unsupported(format!("priority {prio}"));
                        };
                        Some((kind.to_string(), hooknum, prio))
                    }
                    _ => return unsupported(format!("`{line}`")),
                };
                lines.push(Line::Chain(Chain { table: table.to_string(), name: chain.to_string(), base }));
            }
            [verb @ ("add" | "insert"), "rule", "inet", table, chain, ..] => {
                if !declared(&lines, table, Some(chain)) {
                    return unsupported(format!("rule in chain {table} {chain} this batch does not create"));
                }
                let index = match *verb {
                    "insert" => match (words.get(5), words.get(6).and_then(|w| decimal::<usize>(w))) {
                        (Some(&"index"), Some(i)) => Some(i),
                        _ => return unsupported(format!("`{line}`")),
                    },
                    _ => None,
                };
                let expr = rest_after_words(line, if index.is_some() { 7 } else { 5 });
                let number = rules.len();
                // nft refuses an index at or past the chain's end; so does this.
                let before = order
                    .place((table.to_string(), chain.to_string()), number, index, false)
                    .map_err(|_| Unsupported(format!("`{line}`: index past the end of {table} {chain}")))?;
                if let Some(target) = before {
                    rules[target].referenced = true;
                }
                rules.push(Rule { table, chain, expr, line, before, referenced: false });
                lines.push(Line::Rule(number));
            }
            _ => return unsupported(format!("`{line}`")),
        }
    }
    let mut batch = Batch { family: NFPROTO_INET, messages: Vec::new() };
    let mut next_set_id = 1;
    for line in &lines {
        match line {
            Line::Table(table) => batch.messages.push(Message {
                kind: NFT_MSG_NEWTABLE,
                flags: NLM_F_CREATE | NLM_F_EXCL,
                attrs: {
                    let mut a = Vec::new();
                    put_str(&mut a, 1, table);
                    put_u32(&mut a, 2, 0);
                    a
                },
                what: format!("add table inet {table}"),
            }),
            Line::Chain(chain) => batch.messages.push(chain_message(chain)),
            Line::Rule(n) => {
                let rule = &rules[*n];
                let what = rule.line.to_string();
                let (exprs, sets) = compile_rule(rule.expr, &mut next_set_id)?;
                for set in &sets {
                    batch.messages.extend(set_messages(rule.table, set, &what));
                }
                let mut a = Vec::new();
                put_str(&mut a, 1, rule.table);
                put_str(&mut a, 2, rule.chain);
                nest(&mut a, 4, |list| {
                    for e in &exprs {
                        encode(list, e);
                    }
                });
                let flags = position(&mut a, *n, rule.referenced, rule.before);
                batch.messages.push(Message { kind: NFT_MSG_NEWRULE, flags, attrs: a, what });
            }
        }
    }
    within_size(batch)
}

/// `line` after its first `n` words.
pub(crate) fn rest_after_words(line: &str, n: usize) -> &str {
    let mut rest = line.trim_start();
    for _ in 0..n {
        rest = rest.trim_start();
        rest = rest.find(char::is_whitespace).map_or("", |i| &rest[i..]);
    }
    rest.trim()
}

fn chain_message(chain: &Chain) -> Message {
    let mut a = Vec::new();
    put_str(&mut a, 1, &chain.table);
    put_str(&mut a, 3, &chain.name);
    let mut what = format!("add chain inet {} {}", chain.table, chain.name);
    if let Some((kind, hooknum, prio)) = &chain.base {
        put_str(&mut a, 7, kind);
        nest(&mut a, 4, |h| {
            put_u32(h, 1, *hooknum);
            put_u32(h, 2, *prio as u32);
        });
        what.push_str(&format!(" {{ type {kind} hook {hooknum} priority {prio} ; }}"));
    }
    Message { kind: NFT_MSG_NEWCHAIN, flags: NLM_F_CREATE, attrs: a, what }
}

/// nft's user data for a set keyed by `tcp dport`: the key's byte order (big endian)
/// and its `typeof` (the transport header's destination port), as nft 1.0 writes it.
const TCP_DPORT_SET_USERDATA: [u8; 28] = [
    0x00, 0x04, 0x02, 0x00, 0x00, 0x00, // NFTNL_UDATA_SET_KEYBYTEORDER: big endian
    0x03, 0x14, // NFTNL_UDATA_SET_KEY_TYPEOF, 20 bytes:
    0x00, 0x04, 0x07, 0x00, 0x00, 0x00, //   the expression: payload
    0x01, 0x0c, 0x00, 0x04, 0x08, 0x00, 0x00, 0x00, //   its protocol: tcp
    0x01, 0x04, 0x02, 0x00, 0x00, 0x00, //   its field: dport
];

/// `inet_service`, nft's datatype for ports.
const TYPE_INET_SERVICE: u32 = 13;
const NFT_SET_ANONYMOUS: u32 = 0x1;
const NFT_SET_CONSTANT: u32 = 0x2;

fn set_messages(table: &str, set: &PortSet, what: &str) -> [Message; 2] {
    let mut s = Vec::new();
    put_str(&mut s, 1, table);
    put_str(&mut s, 2, "__set%d");
    put_u32(&mut s, 3, NFT_SET_ANONYMOUS | NFT_SET_CONSTANT);
    put_u32(&mut s, 4, TYPE_INET_SERVICE);
    put_u32(&mut s, 5, 2);
    put_u32(&mut s, 10, set.id);
    nest(&mut s, 9, |d| put_u32(d, 1, set.ports.len() as u32));
    put(&mut s, 13, &TCP_DPORT_SET_USERDATA);
    let mut e = Vec::new();
    put_str(&mut e, 1, table);
    put_str(&mut e, 2, "__set%d");
    put_u32(&mut e, 4, set.id);
    nest(&mut e, 3, |elems| {
        for port in &set.ports {
            nest(elems, NFTA_LIST_ELEM, |elem| {
                nest(elem, 1, |key| put(key, NFTA_DATA_VALUE, &port.to_be_bytes()));
            });
        }
    });
    [
        Message {
            kind: NFT_MSG_NEWSET,
            flags: NLM_F_CREATE,
            attrs: s,
            what: format!("the anonymous set of {what}"),
        },
        Message {
            kind: NFT_MSG_NEWSETELEM,
            flags: NLM_F_CREATE,
            attrs: e,
            what: format!("the anonymous set's elements of {what}"),
        },
    ]
}

/// What earlier expressions of a rule established, as nft's dependency tracking sees it.
#[derive(Default)]
struct Context {
    nfproto: Option<u8>,
    l4proto: Option<u8>,
}

/// A mark, uid or gid: [`decimal`], or `0x` and lowercase hex digits as nft reads them.
fn number(word: &str) -> Option<u32> {
    match word.strip_prefix("0x") {
        Some(hex) if !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            u32::from_str_radix(hex, 16).ok()
        }
        Some(_) => None,
        None => decimal(word),
    }
}

/// nft's own words that hold a digit, a dash, a dot or an underscore: unquoted, as the
/// rendered text writes interface names, nft reads them as keywords and refuses the
/// rule, so such a name is left to it.
const NFT_KEYWORDS_LIKE_NAMES: &[&str] = &[
    "cgroupv2",
    "ip6",
    "icmpv6",
    "sack0",
    "sack1",
    "sack2",
    "sack3",
    "md5sig",
    "rt0",
    "rt2",
    "reserved2",
    "l3proto",
    "l4proto",
    "ipv4",
    "ipv6",
    "auto-merge",
    "gc-interval",
    "frag-off",
    "param-problem",
    "max-delay",
    "sack-permitted",
    "init-ack",
    "heartbeat-ack",
    "shutdown-ack",
    "cookie-echo",
    "cookie-ack",
    "shutdown-complete",
    "asconf-ack",
    "forward-tsn",
    "init-tag",
    "a-rwnd",
    "num-outbound-streams",
    "num-inbound-streams",
    "initial-tsn",
    "cum-tsn-ack",
    "num-gap-ack-blocks",
    "num-dup-tsns",
    "lowest-tsn",
    "new-cum-tsn",
    "seg-left",
    "last-entry",
    "more-fragments",
    "proto-src",
    "proto-dst",
    "queue-threshold",
    "fully-random",
];

/// An interface name nft reads as a name when written bare: `lo`, or letters first
/// with a digit, dash, dot or underscore in it (`eth0`, `net1`, `not-istio-nic`), and
/// none of nft's words. A bare word without one (`counter`, `tcp`, `docker`) may be a
/// keyword; nft decides those.
pub(crate) fn plain_interface(name: &str) -> bool {
    let chars_ok = crate::inputs::config::check_interface_name("", name).is_ok();
    let marked = name == "lo" || name.chars().any(|c| c.is_ascii_digit() || matches!(c, '.' | '_' | '-'));
    chars_ok && marked && !NFT_KEYWORDS_LIKE_NAMES.contains(&name)
}

fn compile_rule(expr: &str, next_set_id: &mut u32) -> Result<(Vec<Expr>, Vec<PortSet>), Unsupported> {
    let words: Vec<&str> = expr.split_whitespace().collect();
    let mut out = Vec::new();
    let mut sets = Vec::new();
    let mut cx = Context::default();
    let mut i = 0;
    let at = |i: usize| words.get(i).copied().unwrap_or("");
    // An optional `!=` before a value.
    let op_at = |i: &mut usize| {
        if at(*i) == "!=" {
            *i += 1;
            NFT_CMP_NEQ
        } else {
            NFT_CMP_EQ
        }
    };
    while i < words.len() {
        let word = words[i];
        i += 1;
        match word {
            "meta" if matches!(at(i), "l4proto") => {
                i += 1;
                let op = op_at(&mut i);
                let proto = l4(at(i))?;
                i += 1;
                if op != NFT_CMP_EQ || cx.l4proto.is_some() {
                    return unsupported(format!("`{expr}`"));
                }
                out.push(Expr::MetaLoad(NFT_META_L4PROTO));
                out.push(Expr::Cmp { op, data: vec![proto] });
                cx.l4proto = Some(proto);
            }
            "meta" | "mark" | "skuid" | "skgid" => {
                let key_word = if word == "meta" {
                    i += 1;
                    at(i - 1)
                } else {
                    word
                };
                let key = match key_word {
                    "mark" => NFT_META_MARK,
                    "skuid" => NFT_META_SKUID,
                    "skgid" => NFT_META_SKGID,
                    other => return unsupported(format!("meta {other}")),
                };
                if at(i) == "set" {
                    // `meta mark set N` / `meta mark set ct mark`
                    i += 1;
                    if key != NFT_META_MARK {
                        return unsupported(format!("`{expr}`"));
                    }
                    if at(i) == "ct" && at(i + 1) == "mark" {
                        i += 2;
                        out.push(Expr::CtLoad(NFT_CT_MARK));
                    } else {
                        let v = number(at(i)).ok_or_else(|| Unsupported(format!("mark {}", at(i))))?;
                        i += 1;
                        out.push(Expr::Data(v.to_ne_bytes().to_vec()));
                    }
                    out.push(Expr::MetaSet(NFT_META_MARK));
                    continue;
                }
                let op = op_at(&mut i);
                let v = number(at(i)).ok_or_else(|| Unsupported(format!("{key_word} {}", at(i))))?;
                i += 1;
                out.push(Expr::MetaLoad(key));
                out.push(Expr::Cmp { op, data: v.to_ne_bytes().to_vec() });
            }
            "iifname" | "oifname" => {
                let op = op_at(&mut i);
                let name = at(i);
                i += 1;
                if !plain_interface(name) {
                    return unsupported(format!("interface {name:?}"));
                }
                let mut data = name.as_bytes().to_vec();
                data.resize(IFNAMSIZ, 0);
                let key = if word == "iifname" { NFT_META_IIFNAME } else { NFT_META_OIFNAME };
                out.push(Expr::MetaLoad(key));
                out.push(Expr::Cmp { op, data });
            }
            "ip" | "ip6" if matches!(at(i), "saddr" | "daddr") => {
                let v6 = word == "ip6";
                let field = at(i);
                i += 1;
                let op = op_at(&mut i);
                let (addr, prefix) = address(at(i), v6)?;
                i += 1;
                let family = if v6 { NFPROTO_IPV6 } else { NFPROTO_IPV4 };
                depend(&mut out, &mut cx.nfproto, NFT_META_NFPROTO, family, expr)?;
                let offset = match (v6, field) {
                    (false, "saddr") => 12,
                    (false, _) => 16,
                    (true, "saddr") => 8,
                    (true, _) => 24,
                };
                out.extend(prefix_match(&addr, prefix, offset, op)?);
            }
            "tcp" | "udp" if matches!(at(i), "dport" | "sport") => {
                let proto = if word == "tcp" { IPPROTO_TCP } else { IPPROTO_UDP };
                let offset = if at(i) == "sport" { 0 } else { 2 };
                i += 1;
                depend(&mut out, &mut cx.l4proto, NFT_META_L4PROTO, proto, expr)?;
                let op = op_at(&mut i);
                out.push(Expr::Payload { base: NFT_PAYLOAD_TRANSPORT_HEADER, offset, len: 2 });
                if at(i) == "{" {
                    let close = words[i..].iter().position(|w| *w == "}").map(|p| p + i);
                    let Some(close) = close else { return unsupported(format!("`{expr}`")) };
                    let ports: Option<Vec<u16>> =
                        words[i + 1..close].join(" ").split(',').map(|p| decimal(p.trim())).collect();
                    i = close + 1;
                    match ports {
                        Some(ports) if proto == IPPROTO_TCP && offset == 2 && ports.len() >= 2 => {
                            let id = *next_set_id;
                            *next_set_id += 1;
                            out.push(Expr::Lookup { set_id: id, invert: op == NFT_CMP_NEQ });
                            sets.push(PortSet { id, ports });
                        }
                        _ => return unsupported(format!("the set in `{expr}`")),
                    }
                } else {
                    let port: u16 = decimal(at(i)).ok_or_else(|| Unsupported(format!("port {}", at(i))))?;
                    i += 1;
                    out.push(Expr::Cmp { op, data: port.to_be_bytes().to_vec() });
                }
            }
            "ct" => {
                let key = at(i);
                i += 1;
                match key {
                    "state" => {
                        let mut mask = 0u32;
                        for state in at(i).split(',') {
                            mask |= match state {
                                "invalid" => 1,
                                "established" => 2,
                                "related" => 4,
                                "new" => 8,
                                "untracked" => 64,
                                other => return unsupported(format!("ct state {other}")),
                            };
                        }
                        i += 1;
                        out.push(Expr::CtLoad(NFT_CT_STATE));
                        out.push(Expr::Bitwise { mask: mask.to_ne_bytes().to_vec() });
                        out.push(Expr::Cmp { op: NFT_CMP_NEQ, data: vec![0; 4] });
                    }
                    "mark" if at(i) == "set" && at(i + 1) == "mark" => {
                        i += 2;
                        out.push(Expr::MetaLoad(NFT_META_MARK));
                        out.push(Expr::CtSet(NFT_CT_MARK));
                    }
                    "mark" => {
                        let op = op_at(&mut i);
                        let v = number(at(i)).ok_or_else(|| Unsupported(format!("ct mark {}", at(i))))?;
                        i += 1;
                        out.push(Expr::CtLoad(NFT_CT_MARK));
                        out.push(Expr::Cmp { op, data: v.to_ne_bytes().to_vec() });
                    }
                    "zone" if at(i) == "set" => {
                        let zone: u16 = decimal(at(i + 1))
                            .ok_or_else(|| Unsupported(format!("ct zone {}", at(i + 1))))?;
                        i += 2;
                        out.push(Expr::Data(zone.to_ne_bytes().to_vec()));
                        out.push(Expr::CtSet(NFT_CT_ZONE));
                    }
                    other => return unsupported(format!("ct {other}")),
                }
            }
            "counter" => out.push(Expr::Counter),
            "return" => out.push(Expr::Verdict { code: NFT_RETURN, chain: None }),
            "accept" => out.push(Expr::Verdict { code: NF_ACCEPT, chain: None }),
            "drop" => out.push(Expr::Verdict { code: NF_DROP, chain: None }),
            "jump" => {
                let chain = at(i);
                i += 1;
                if chain.is_empty() {
                    return unsupported(format!("`{expr}`"));
                }
                out.push(Expr::Verdict { code: NFT_JUMP, chain: Some(chain.to_string()) });
            }
            "redirect" if at(i) == "to" => {
                let port = port_after_colon(at(i + 1))?;
                i += 2;
                out.push(Expr::Data(port.to_be_bytes().to_vec()));
                out.push(Expr::Redirect);
            }
            "tproxy" if matches!(at(i), "ip" | "ip6") && at(i + 1) == "to" => {
                let family = if at(i) == "ip6" { NFPROTO_IPV6 } else { NFPROTO_IPV4 };
                if cx.nfproto != Some(family) {
                    return unsupported(format!("`{expr}`"));
                }
                let port = port_after_colon(at(i + 2))?;
                i += 3;
                out.push(Expr::Data(port.to_be_bytes().to_vec()));
                out.push(Expr::Tproxy { family });
            }
            other => return unsupported(format!("`{other}` in `{expr}`")),
        }
    }
    Ok((out, sets))
}

/// nft's implicit dependency: `meta <key> <value>` before the first match that needs
/// it (`ip daddr` needs nfproto ipv4, `tcp dport` l4proto tcp), nothing once the rule
/// has it, and a conflicting one (nft's error) left to nft.
fn depend(
    out: &mut Vec<Expr>,
    have: &mut Option<u8>,
    key: u32,
    value: u8,
    expr: &str,
) -> Result<(), Unsupported> {
    match *have {
        None => {
            out.push(Expr::MetaLoad(key));
            out.push(Expr::Cmp { op: NFT_CMP_EQ, data: vec![value] });
            *have = Some(value);
            Ok(())
        }
        Some(v) if v == value => Ok(()),
        Some(_) => unsupported(format!("`{expr}`")),
    }
}

fn l4(word: &str) -> Result<u8, Unsupported> {
    match word {
        "tcp" => Ok(IPPROTO_TCP),
        "udp" => Ok(IPPROTO_UDP),
        other => unsupported(format!("l4proto {other}")),
    }
}

fn port_after_colon(word: &str) -> Result<u16, Unsupported> {
    word.strip_prefix(':').and_then(decimal).ok_or_else(|| Unsupported(format!("port {word}")))
}

fn address(word: &str, v6: bool) -> Result<(Vec<u8>, u32), Unsupported> {
    let (addr, prefix) = match word.split_once('/') {
        Some((a, p)) => (a, decimal::<u32>(p)),
        None => (word, None),
    };
    let bad = || Unsupported(format!("address {word}"));
    let addr: IpAddr = addr.parse().map_err(|_| bad())?;
    let bytes = match (addr, v6) {
        (IpAddr::V4(a), false) => a.octets().to_vec(),
        (IpAddr::V6(a), true) => a.octets().to_vec(),
        _ => return Err(bad()),
    };
    let full = bytes.len() as u32 * 8;
    let prefix = match word.contains('/') {
        true => prefix.ok_or_else(bad)?,
        false => full,
    };
    if prefix == 0 || prefix > full {
        return Err(bad());
    }
    Ok((bytes, prefix))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exprs(rule: &str) -> Vec<Expr> {
        compile_rule(rule, &mut 1).unwrap().0
    }

    #[test]
    fn dependencies_are_added_where_nft_adds_them() {
        // `ip daddr` in family inet needs `meta nfproto ipv4`, `tcp dport` needs `meta
        // l4proto tcp`, each right before its load, and only once.
        assert_eq!(
            exprs("ip daddr 127.0.0.53/32 tcp dport 53 counter return")[..4],
            [
                Expr::MetaLoad(NFT_META_NFPROTO),
                Expr::Cmp { op: NFT_CMP_EQ, data: vec![NFPROTO_IPV4] },
                Expr::Payload { base: NFT_PAYLOAD_NETWORK_HEADER, offset: 16, len: 4 },
                Expr::Cmp { op: NFT_CMP_EQ, data: vec![127, 0, 0, 53] },
            ]
        );
        let explicit = exprs("meta l4proto tcp tcp dport 15008 counter return");
        assert_eq!(explicit.iter().filter(|e| **e == Expr::MetaLoad(NFT_META_L4PROTO)).count(), 1);
    }

    #[test]
    fn prefixes_load_what_nft_loads() {
        let p = |a: &str| exprs(&format!("ip daddr {a} counter return"))[2..].to_vec();
        assert_eq!(p("10.0.0.0/8")[0], Expr::Payload { base: 1, offset: 16, len: 1 });
        assert_eq!(
            p("10.96.0.0/12")[..2],
            [Expr::Payload { base: 1, offset: 16, len: 4 }, Expr::Bitwise { mask: vec![0xff, 0xf0, 0, 0] }]
        );
    }

    #[test]
    fn what_it_does_not_know_is_left_to_nft() {
        for rule in [
            "skgid ftp counter return",
            "iifname eth* counter return",
            "udp dport { 53, 54 } counter return",
            "meta mark & 0xfff == 0x539 counter return",
            "ip daddr @istio-inpod-probes-v4 counter accept",
            "meta l4proto tcp udp dport 53 counter return",
            "ip daddr ::1 counter return",
        ] {
            assert!(compile_rule(rule, &mut 1).is_err(), "{rule}");
        }
        assert!(compile("add table inet t\nlist ruleset\n").is_err());
        assert!(compile("add rule inet t c counter\n").is_err(), "a chain the batch does not create");
    }

    #[test]
    fn numbers_and_names_nft_could_read_otherwise_are_left_to_it() {
        // nft reads 01337 as octal and refuses +1337; Rust would read both as 1337.
        for rule in [
            "skuid 01337 counter return",
            "skuid +1337 counter return",
            "meta mark set 0x counter",
            "tcp dport 015008 counter return",
            "oifname counter counter return",
            "oifname docker counter return",
            "oifname ip6 counter return",
            "oifname fully-random counter return",
            "oifname 1eth counter return",
        ] {
            assert!(compile_rule(rule, &mut 1).is_err(), "{rule}");
        }
        for rule in ["skuid 0 counter return", "meta mark set 0x539", "oifname eth0 counter return"] {
            assert!(compile_rule(rule, &mut 1).is_ok(), "{rule}");
        }
        assert!(plain_interface("lo") && plain_interface("not-istio-nic") && plain_interface("net1"));
    }

    #[test]
    fn inserts_land_where_nft_puts_them() {
        let tx = "add table inet t\nadd chain inet t c\nadd rule inet t c counter return\n\
                  add rule inet t c counter accept\ninsert rule inet t c index 1 counter drop\n";
        let b = compile(tx).unwrap();
        let rules: Vec<&Message> = b.messages.iter().filter(|m| m.kind == NFT_MSG_NEWRULE).collect();
        // In the text's order; the insert names the rule it goes before by its id.
        assert_eq!(rules[2].what, "insert rule inet t c index 1 counter drop");
        let mut id = Vec::new();
        put_u32(&mut id, NFTA_RULE_ID, 2);
        assert!(rules[1].attrs.ends_with(&id), "the rule an insert names carries an id");
        let mut position = Vec::new();
        put_u32(&mut position, NFTA_RULE_POSITION_ID, 2);
        assert!(rules[2].attrs.ends_with(&position));
        assert_eq!(rules[2].flags & NLM_F_APPEND, 0, "inserted, not appended");
        assert!(!rules[0].attrs.ends_with(&id[..4]), "an id only where one is named");
    }
}
