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
    let mut r = RuleWords {
        expr,
        words: expr.split_whitespace().collect(),
        i: 0,
        out: Vec::new(),
        sets: Vec::new(),
        cx: Context::default(),
    };
    while r.i < r.words.len() {
        let word = r.words[r.i];
        r.i += 1;
        match word {
            "meta" if matches!(r.at(0), "l4proto") => r.l4proto()?,
            "meta" | "mark" | "skuid" | "skgid" => r.meta(word)?,
            "iifname" | "oifname" => r.interface(word)?,
            "ip" | "ip6" if matches!(r.at(0), "saddr" | "daddr") => r.address(word)?,
            "tcp" | "udp" if matches!(r.at(0), "dport" | "sport") => r.port(word, next_set_id)?,
            "ct" => r.ct()?,
            "counter" => r.out.push(Expr::Counter),
            "return" => r.out.push(Expr::Verdict { code: NFT_RETURN, chain: None }),
            "accept" => r.out.push(Expr::Verdict { code: NF_ACCEPT, chain: None }),
            "drop" => r.out.push(Expr::Verdict { code: NF_DROP, chain: None }),
            "jump" => r.jump()?,
            "redirect" if r.at(0) == "to" => r.redirect()?,
            "tproxy" if matches!(r.at(0), "ip" | "ip6") && r.at(1) == "to" => r.tproxy()?,
            other => return unsupported(format!("`{other}` in `{expr}`")),
        }
    }
    Ok((r.out, r.sets))
}

/// One rule's words, read left to right: each statement read by the method for it
/// appends its expressions (and the anonymous sets its `{ ... }` port lists make).
struct RuleWords<'a> {
    expr: &'a str,
    words: Vec<&'a str>,
    /// The next word to read.
    i: usize,
    out: Vec<Expr>,
    sets: Vec<PortSet>,
    cx: Context,
}

impl<'a> RuleWords<'a> {
    /// The word `ahead` words past the next one to read (`""` past the end).
    fn at(&self, ahead: usize) -> &'a str {
        self.words.get(self.i + ahead).copied().unwrap_or("")
    }

    /// An optional `!=` before a value.
    fn op(&mut self) -> u32 {
        if self.at(0) == "!=" {
            self.i += 1;
            NFT_CMP_NEQ
        } else {
            NFT_CMP_EQ
        }
    }

    /// The whole rule, unsupported as written.
    fn whole<T>(&self) -> Result<T, Unsupported> {
        unsupported(format!("`{}`", self.expr))
    }

    /// `meta l4proto [!=] tcp|udp`: only once, only equal.
    fn l4proto(&mut self) -> Result<(), Unsupported> {
        self.i += 1;
        let op = self.op();
        let proto = l4(self.at(0))?;
        self.i += 1;
        if op != NFT_CMP_EQ || self.cx.l4proto.is_some() {
            return self.whole();
        }
        self.out.push(Expr::MetaLoad(NFT_META_L4PROTO));
        self.out.push(Expr::Cmp { op, data: vec![proto] });
        self.cx.l4proto = Some(proto);
        Ok(())
    }

    /// `[meta] mark|skuid|skgid [!=] N`, or `meta mark set N` / `meta mark set ct mark`.
    fn meta(&mut self, word: &'a str) -> Result<(), Unsupported> {
        let key_word = if word == "meta" {
            let key = self.at(0);
            self.i += 1;
            key
        } else {
            word
        };
        let key = match key_word {
            "mark" => NFT_META_MARK,
            "skuid" => NFT_META_SKUID,
            "skgid" => NFT_META_SKGID,
            other => return unsupported(format!("meta {other}")),
        };
        if self.at(0) == "set" {
            // `meta mark set N` / `meta mark set ct mark`
            self.i += 1;
            if key != NFT_META_MARK {
                return self.whole();
            }
            if self.at(0) == "ct" && self.at(1) == "mark" {
                self.i += 2;
                self.out.push(Expr::CtLoad(NFT_CT_MARK));
            } else {
                let v = number(self.at(0)).ok_or_else(|| Unsupported(format!("mark {}", self.at(0))))?;
                self.i += 1;
                self.out.push(Expr::Data(v.to_ne_bytes().to_vec()));
            }
            self.out.push(Expr::MetaSet(NFT_META_MARK));
            return Ok(());
        }
        let op = self.op();
        let v = number(self.at(0)).ok_or_else(|| Unsupported(format!("{key_word} {}", self.at(0))))?;
        self.i += 1;
        self.out.push(Expr::MetaLoad(key));
        self.out.push(Expr::Cmp { op, data: v.to_ne_bytes().to_vec() });
        Ok(())
    }

    /// `iifname|oifname [!=] <name>`: a plain name only.
    fn interface(&mut self, word: &str) -> Result<(), Unsupported> {
        let op = self.op();
        let name = self.at(0);
        self.i += 1;
        if !plain_interface(name) {
            return unsupported(format!("interface {name:?}"));
        }
        let mut data = name.as_bytes().to_vec();
        data.resize(IFNAMSIZ, 0);
        let key = if word == "iifname" { NFT_META_IIFNAME } else { NFT_META_OIFNAME };
        self.out.push(Expr::MetaLoad(key));
        self.out.push(Expr::Cmp { op, data });
        Ok(())
    }

    /// `ip|ip6 saddr|daddr [!=] <address>[/<prefix>]`, after its family dependency.
    fn address(&mut self, word: &str) -> Result<(), Unsupported> {
        let v6 = word == "ip6";
        let field = self.at(0);
        self.i += 1;
        let op = self.op();
        let (addr, prefix) = address(self.at(0), v6)?;
        self.i += 1;
        let family = if v6 { NFPROTO_IPV6 } else { NFPROTO_IPV4 };
        depend(&mut self.out, &mut self.cx.nfproto, NFT_META_NFPROTO, family, self.expr)?;
        let offset = match (v6, field) {
            (false, "saddr") => 12,
            (false, _) => 16,
            (true, "saddr") => 8,
            (true, _) => 24,
        };
        self.out.extend(prefix_match(&addr, prefix, offset, op)?);
        Ok(())
    }

    /// `tcp|udp dport|sport [!=] <port>`, or `tcp dport [!=] { a, b, ... }` (an anonymous
    /// set), after its protocol dependency.
    fn port(&mut self, word: &str, next_set_id: &mut u32) -> Result<(), Unsupported> {
        let proto = if word == "tcp" { IPPROTO_TCP } else { IPPROTO_UDP };
        let offset = if self.at(0) == "sport" { 0 } else { 2 };
        self.i += 1;
        depend(&mut self.out, &mut self.cx.l4proto, NFT_META_L4PROTO, proto, self.expr)?;
        let op = self.op();
        self.out.push(Expr::Payload { base: NFT_PAYLOAD_TRANSPORT_HEADER, offset, len: 2 });
        if self.at(0) == "{" {
            let i = self.i;
            let close = self.words[i..].iter().position(|w| *w == "}").map(|p| p + i);
            let Some(close) = close else { return self.whole() };
            let ports: Option<Vec<u16>> =
                self.words[i + 1..close].join(" ").split(',').map(|p| decimal(p.trim())).collect();
            self.i = close + 1;
            match ports {
                Some(ports) if proto == IPPROTO_TCP && offset == 2 && ports.len() >= 2 => {
                    let id = *next_set_id;
                    *next_set_id += 1;
                    self.out.push(Expr::Lookup { set_id: id, invert: op == NFT_CMP_NEQ });
                    self.sets.push(PortSet { id, ports });
                }
                _ => return unsupported(format!("the set in `{}`", self.expr)),
            }
        } else {
            let port: u16 = decimal(self.at(0)).ok_or_else(|| Unsupported(format!("port {}", self.at(0))))?;
            self.i += 1;
            self.out.push(Expr::Cmp { op, data: port.to_be_bytes().to_vec() });
        }
        Ok(())
    }

    /// `ct state <states>`, `ct mark set mark`, `ct mark [!=] N`, `ct zone set N`.
    fn ct(&mut self) -> Result<(), Unsupported> {
        let key = self.at(0);
        self.i += 1;
        match key {
            "state" => {
                let mut mask = 0u32;
                for state in self.at(0).split(',') {
                    mask |= match state {
                        "invalid" => 1,
                        "established" => 2,
                        "related" => 4,
                        "new" => 8,
                        "untracked" => 64,
                        other => return unsupported(format!("ct state {other}")),
                    };
                }
                self.i += 1;
                self.out.push(Expr::CtLoad(NFT_CT_STATE));
                self.out.push(Expr::Bitwise { mask: mask.to_ne_bytes().to_vec() });
                self.out.push(Expr::Cmp { op: NFT_CMP_NEQ, data: vec![0; 4] });
            }
            "mark" if self.at(0) == "set" && self.at(1) == "mark" => {
                self.i += 2;
                self.out.push(Expr::MetaLoad(NFT_META_MARK));
                self.out.push(Expr::CtSet(NFT_CT_MARK));
            }
            "mark" => {
                let op = self.op();
                let v = number(self.at(0)).ok_or_else(|| Unsupported(format!("ct mark {}", self.at(0))))?;
                self.i += 1;
                self.out.push(Expr::CtLoad(NFT_CT_MARK));
                self.out.push(Expr::Cmp { op, data: v.to_ne_bytes().to_vec() });
            }
            "zone" if self.at(0) == "set" => {
                let zone: u16 =
                    decimal(self.at(1)).ok_or_else(|| Unsupported(format!("ct zone {}", self.at(1))))?;
                self.i += 2;
                self.out.push(Expr::Data(zone.to_ne_bytes().to_vec()));
                self.out.push(Expr::CtSet(NFT_CT_ZONE));
            }
            other => return unsupported(format!("ct {other}")),
        }
        Ok(())
    }

    /// `jump <chain>`.
    fn jump(&mut self) -> Result<(), Unsupported> {
        let chain = self.at(0);
        self.i += 1;
        if chain.is_empty() {
            return self.whole();
        }
        self.out.push(Expr::Verdict { code: NFT_JUMP, chain: Some(chain.to_string()) });
        Ok(())
    }

    /// `redirect to :<port>`.
    fn redirect(&mut self) -> Result<(), Unsupported> {
        let port = port_after_colon(self.at(1))?;
        self.i += 2;
        self.out.push(Expr::Data(port.to_be_bytes().to_vec()));
        self.out.push(Expr::Redirect);
        Ok(())
    }

    /// `tproxy ip|ip6 to :<port>`, where the rule already matches that family.
    fn tproxy(&mut self) -> Result<(), Unsupported> {
        let family = if self.at(0) == "ip6" { NFPROTO_IPV6 } else { NFPROTO_IPV4 };
        if self.cx.nfproto != Some(family) {
            return self.whole();
        }
        let port = port_after_colon(self.at(2))?;
        self.i += 3;
        self.out.push(Expr::Data(port.to_be_bytes().to_vec()));
        self.out.push(Expr::Tproxy { family });
        Ok(())
    }
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
