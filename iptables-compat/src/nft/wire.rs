//! An nft transaction as the nf_tables netlink messages `nft -f` sends for it, made
//! in process: the text [`crate::nft::render`] writes for a namespace with no Istio
//! table (add table, add chain, add/insert rule) compiled into one batch, with the
//! same expressions nft's compiler emits (its implicit `meta nfproto`/`meta l4proto`
//! dependencies, its shortened loads for byte-aligned prefixes, its anonymous sets).
//! A pure function: [`compile`] returns the bytes, [`crate::kernel::nft_batch`] sends them.
//! Only the forms Weir's sidecar plans use are known; anything else (user or group
//! names, wildcard interfaces, other sets, other statements) is [`Unsupported`] and
//! the transaction goes to `nft -f` as before, so nothing is ever guessed.

mod rule;

use rule::{PortSet, compile_rule};

pub use crate::kernel::nft_encode::{
    Batch, MAX_BATCH_BYTES, Message, NFT_MSG_NEWCHAIN, NFT_MSG_NEWRULE, NFT_MSG_NEWSET, NFT_MSG_NEWSETELEM,
    NFT_MSG_NEWTABLE, Unsupported,
};
use crate::kernel::{nf_probe::NFPROTO_INET, nft_encode::*};

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
    let (lines, rules) = parse_transaction(tx)?;
    encode_transaction(&lines, &rules)
}

/// The transaction's lines in order, and its rules: where each goes (an insert before
/// which rule), and which of them a later insert names.
fn parse_transaction(tx: &str) -> Result<(Vec<Line>, Vec<Rule<'_>>), Unsupported> {
    let mut lines: Vec<Line> = Vec::new();
    let mut rules: Vec<Rule> = Vec::new();
    let mut order = RuleOrder::default();
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
                let base = base_chain(rest, line)?;
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
    Ok((lines, rules))
}

/// Whether `lines` create `table` (with `chain`: that chain of it).
fn declared(lines: &[Line], table: &str, chain: Option<&str>) -> bool {
    lines.iter().any(|l| match l {
        Line::Table(t) => chain.is_none() && t == table,
        Line::Chain(c) => Some(c.name.as_str()) == chain && c.table == table,
        Line::Rule(_) => false,
    })
}

/// A base chain's `{ type <kind> hook <hook> priority <prio> ; }` (after `add chain
/// inet <table> <chain>`): type, hook number, priority; `None` for a regular chain.
fn base_chain(rest: &[&str], line: &str) -> Result<Option<(String, u32, i32)>, Unsupported> {
    match rest {
        [] => Ok(None),
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
            Ok(Some((kind.to_string(), hooknum, prio)))
        }
        _ => unsupported(format!("`{line}`")),
    }
}

/// The batch for parsed lines: a message per table, chain and rule in order, each
/// rule's anonymous sets right before it.
fn encode_transaction(lines: &[Line], rules: &[Rule]) -> Result<Batch, Unsupported> {
    let mut batch = Batch { family: NFPROTO_INET, messages: Vec::new() };
    let mut next_set_id = 1;
    for line in lines {
        match line {
            Line::Table(table) => batch.messages.push(table_message(table)),
            Line::Chain(chain) => batch.messages.push(chain_message(chain)),
            Line::Rule(n) => {
                let rule = &rules[*n];
                let what = rule.line.to_string();
                let (exprs, sets) = compile_rule(rule.expr, &mut next_set_id)?;
                for set in &sets {
                    batch.messages.extend(set_messages(rule.table, set, &what));
                }
                batch.messages.push(rule_message(*n, rule, &exprs, what));
            }
        }
    }
    within_size(batch)
}

/// `add table inet <table>`, created exclusively.
fn table_message(table: &str) -> Message {
    let mut a = Vec::new();
    put_str(&mut a, 1, table);
    put_u32(&mut a, 2, 0);
    Message {
        kind: NFT_MSG_NEWTABLE,
        flags: NLM_F_CREATE | NLM_F_EXCL,
        attrs: a,
        what: format!("add table inet {table}"),
    }
}

/// Rule number `n` of the transaction with its compiled expressions, placed as its
/// line says.
fn rule_message(n: usize, rule: &Rule, exprs: &[Expr], what: String) -> Message {
    let mut a = Vec::new();
    put_str(&mut a, 1, rule.table);
    put_str(&mut a, 2, rule.chain);
    nest(&mut a, 4, |list| {
        for e in exprs {
            encode(list, e);
        }
    });
    let flags = position(&mut a, n, rule.referenced, rule.before);
    Message { kind: NFT_MSG_NEWRULE, flags, attrs: a, what }
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

#[cfg(test)]
mod tests {
    use super::{rule::plain_interface, *};
    use crate::kernel::nf_probe::NFPROTO_IPV4;

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
