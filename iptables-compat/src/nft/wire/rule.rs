//! One nft rule's statements compiled into the expressions nft's compiler emits for
//! them: its implicit `meta nfproto`/`meta l4proto` dependencies, its shortened
//! prefix loads, its anonymous port sets; what it does not know is [`Unsupported`].

use std::net::IpAddr;

use crate::kernel::{
    nf_probe::{NFPROTO_IPV4, NFPROTO_IPV6},
    nft_encode::*,
};

/// An anonymous set of `tcp dport` values a rule looks up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PortSet {
    pub(super) id: u32,
    pub(super) ports: Vec<u16>,
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
pub(super) fn plain_interface(name: &str) -> bool {
    let chars_ok = crate::inputs::config::check_interface_name("", name).is_ok();
    let marked = name == "lo" || name.chars().any(|c| c.is_ascii_digit() || matches!(c, '.' | '_' | '-'));
    chars_ok && marked && !NFT_KEYWORDS_LIKE_NAMES.contains(&name)
}

/// One rule's statements (after `add rule inet <table> <chain>`) as nft's expressions,
/// and the anonymous sets they look up (numbered from `next_set_id`).
pub(super) fn compile_rule(
    expr: &str,
    next_set_id: &mut u32,
) -> Result<(Vec<Expr>, Vec<PortSet>), Unsupported> {
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
