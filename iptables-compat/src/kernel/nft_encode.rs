//! The pieces of nf_tables messages that Weir writes in process: netlink attributes,
//! rule expressions (as nft and iptables-nft encode them), rule positions within one
//! transaction, and the batch they make. [`crate::nft::wire`] (nft's text) and
//! [`crate::iptables::xt_wire`] (iptables-nft's) compile into these; [`crate::kernel::nft_batch`] sends
//! them.

/// Why a transaction is left to the kernel tool (`nft -f`, `iptables-restore`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not compiled in process ({0})")]
pub struct Unsupported(pub String);

pub(crate) fn unsupported<T>(why: impl Into<String>) -> Result<T, Unsupported> {
    Err(Unsupported(why.into()))
}

/// One message of the batch and what it is, for errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `NFT_MSG_*`.
    pub kind: u16,
    /// Netlink flags besides `NLM_F_REQUEST | NLM_F_ACK`.
    pub flags: u16,
    /// Attributes after the nfgenmsg header.
    pub attrs: Vec<u8>,
    /// What the message is, as the tool's text (`add rule inet t c ...`, `-t nat -A ...`).
    pub what: String,
}

/// A transaction's messages, in the order they go between batch begin and end, all of
/// one nf_tables family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    /// `NFPROTO_*` of every message.
    pub family: u8,
    pub messages: Vec<Message>,
}

pub const NFT_MSG_NEWTABLE: u16 = 0;
pub const NFT_MSG_NEWCHAIN: u16 = 3;
pub const NFT_MSG_NEWRULE: u16 = 6;
pub const NFT_MSG_NEWSET: u16 = 9;
pub const NFT_MSG_NEWSETELEM: u16 = 12;

pub(crate) const NLM_F_EXCL: u16 = 0x200;
pub(crate) const NLM_F_CREATE: u16 = 0x400;
pub(crate) const NLM_F_APPEND: u16 = 0x800;
pub(crate) const NLA_F_NESTED: u16 = 0x8000;

/// The largest batch sent in process; a bigger one goes to the kernel tool.
pub const MAX_BATCH_BYTES: usize = 128 * 1024;

// nft_data / verdicts
pub(crate) const NFTA_DATA_VALUE: u16 = 1;
pub(crate) const NFTA_DATA_VERDICT: u16 = 2;
pub(crate) const NFTA_VERDICT_CODE: u16 = 1;
pub(crate) const NFTA_VERDICT_CHAIN: u16 = 2;
pub(crate) const NFTA_LIST_ELEM: u16 = 1;
pub(crate) const NFTA_EXPR_NAME: u16 = 1;
pub(crate) const NFTA_EXPR_DATA: u16 = 2;

pub(crate) const NF_DROP: i32 = 0;
pub(crate) const NF_ACCEPT: i32 = 1;
pub(crate) const NFT_JUMP: i32 = -3;
pub(crate) const NFT_RETURN: i32 = -5;

pub(crate) const NFT_REG_VERDICT: u32 = 0;
/// nft's first 16-byte data register; every load and store here uses it.
pub(crate) const NFT_REG_1: u32 = 1;

// meta keys
pub(crate) const NFT_META_MARK: u32 = 3;
pub(crate) const NFT_META_IIFNAME: u32 = 6;
pub(crate) const NFT_META_OIFNAME: u32 = 7;
pub(crate) const NFT_META_SKUID: u32 = 10;
pub(crate) const NFT_META_SKGID: u32 = 11;
pub(crate) const NFT_META_NFPROTO: u32 = 15;
pub(crate) const NFT_META_L4PROTO: u32 = 16;
// ct keys
pub(crate) const NFT_CT_STATE: u32 = 0;
pub(crate) const NFT_CT_MARK: u32 = 3;
pub(crate) const NFT_CT_ZONE: u32 = 17;
// payload bases
pub(crate) const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
pub(crate) const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
pub(crate) const NFT_CMP_EQ: u32 = 0;
pub(crate) const NFT_CMP_NEQ: u32 = 1;
pub(crate) const NFT_LOOKUP_F_INV: u32 = 1;
/// `NF_NAT_RANGE_PROTO_SPECIFIED`.
pub(crate) const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 2;

pub(crate) const IPPROTO_TCP: u8 = 6;
pub(crate) const IPPROTO_UDP: u8 = 17;
pub(crate) const IFNAMSIZ: usize = 16;

/// One expression of a rule; every load and store uses [`NFT_REG_1`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Expr {
    MetaLoad(u32),
    MetaSet(u32),
    CtLoad(u32),
    CtSet(u32),
    Payload {
        base: u32,
        offset: u32,
        len: u32,
    },
    Cmp {
        op: u32,
        data: Vec<u8>,
    },
    /// `reg & mask ^ 0`.
    Bitwise {
        mask: Vec<u8>,
    },
    /// A lookup in the anonymous set with this batch id.
    Lookup {
        set_id: u32,
        invert: bool,
    },
    Counter,
    /// Data into the register.
    Data(Vec<u8>),
    Verdict {
        code: i32,
        chain: Option<String>,
    },
    /// `redirect to :port` (the port already in the register).
    Redirect,
    /// `tproxy ip|ip6 to :port` (the port already in the register).
    Tproxy {
        family: u8,
    },
    /// A counter with its packets and bytes given (zero), as iptables-nft sends it.
    CounterZeroed,
    /// An x_tables match (`-m owner`) by name, revision and its kernel struct.
    XtMatch {
        name: &'static str,
        rev: u32,
        info: Vec<u8>,
    },
    /// An x_tables target (`-j REDIRECT`) by name, revision and its kernel struct.
    XtTarget {
        name: &'static str,
        rev: u32,
        info: Vec<u8>,
    },
}

/// `batch` if one send can carry it; a bigger one is left to the kernel tool.
pub(crate) fn within_size(batch: Batch) -> Result<Batch, Unsupported> {
    let bytes: usize = batch.messages.iter().map(|m| m.attrs.len() + 20).sum();
    if bytes > MAX_BATCH_BYTES {
        return unsupported(format!("a batch of {bytes} bytes, over {MAX_BATCH_BYTES}"));
    }
    Ok(batch)
}

pub(crate) const NFTA_RULE_ID: u16 = 9;
pub(crate) const NFTA_RULE_POSITION_ID: u16 = 10;

/// Each chain's rules, by their number in the transaction, in the order the lines so
/// far leave them: where an insert goes, as the kernel tools place it.
#[derive(Default)]
pub(crate) struct RuleOrder<K> {
    chains: Vec<(K, Vec<usize>)>,
}

impl<K: PartialEq> RuleOrder<K> {
    /// Places rule `number` in `chain`: appended without `index`; with it, before the
    /// rule now at that position (returned), or appended at the end when
    /// `index_may_append` (iptables' `-I` one past the last). Err: past the end.
    pub(crate) fn place(
        &mut self,
        chain: K,
        number: usize,
        index: Option<usize>,
        index_may_append: bool,
    ) -> Result<Option<usize>, ()> {
        let slot = match self.chains.iter().position(|(k, _)| *k == chain) {
            Some(i) => i,
            None => {
                self.chains.push((chain, Vec::new()));
                self.chains.len() - 1
            }
        };
        let list = &mut self.chains[slot].1;
        match index {
            Some(i) if i < list.len() => {
                let target = list[i];
                list.insert(i, number);
                Ok(Some(target))
            }
            Some(i) if i > list.len() || !index_may_append => Err(()),
            _ => {
                list.push(number);
                Ok(None)
            }
        }
    }
}

/// A new rule's place, as the tools send it: an id when a later insert names it
/// (`NFTA_RULE_ID`, the rule's number + 1), and for an insert the id of the rule it
/// goes before (`NFTA_RULE_POSITION_ID`, no append). Returns the message's flags.
pub(crate) fn position(attrs: &mut Vec<u8>, number: usize, referenced: bool, before: Option<usize>) -> u16 {
    let rule_id = |n: usize| n as u32 + 1;
    if referenced {
        put_u32(attrs, NFTA_RULE_ID, rule_id(number));
    }
    match before {
        Some(target) => {
            put_u32(attrs, NFTA_RULE_POSITION_ID, rule_id(target));
            NLM_F_CREATE
        }
        None => NLM_F_CREATE | NLM_F_APPEND,
    }
}

/// A number written one way only: plain decimal digits, no sign and no leading zero
/// (nft and iptables read `010` as octal, Rust as ten; such text is left to them).
pub(crate) fn decimal<T: std::str::FromStr>(word: &str) -> Option<T> {
    let digits = !word.is_empty() && word.bytes().all(|b| b.is_ascii_digit());
    (digits && (word == "0" || !word.starts_with('0'))).then(|| word.parse().ok()).flatten()
}

/// An address match as nft compiles it: a byte-aligned prefix loads only its bytes; any
/// other loads the whole address and masks it.
pub(crate) fn prefix_match(addr: &[u8], prefix: u32, offset: u32, op: u32) -> Result<Vec<Expr>, Unsupported> {
    let full = addr.len() as u32;
    if prefix.is_multiple_of(8) {
        let len = prefix / 8;
        return Ok(vec![
            Expr::Payload { base: NFT_PAYLOAD_NETWORK_HEADER, offset, len },
            Expr::Cmp { op, data: addr[..len as usize].to_vec() },
        ]);
    }
    let mut mask = vec![0u8; full as usize];
    for (bit, byte) in (0..prefix).map(|b| (b % 8, b / 8)) {
        mask[byte as usize] |= 0x80 >> bit;
    }
    let masked: Vec<u8> = addr.iter().zip(&mask).map(|(a, m)| a & m).collect();
    Ok(vec![
        Expr::Payload { base: NFT_PAYLOAD_NETWORK_HEADER, offset, len: full },
        Expr::Bitwise { mask },
        Expr::Cmp { op, data: masked },
    ])
}

pub(crate) fn put(buf: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = 4 + value.len();
    buf.extend((len as u16).to_ne_bytes());
    buf.extend(kind.to_ne_bytes());
    buf.extend(value);
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

pub(crate) fn put_str(buf: &mut Vec<u8>, kind: u16, value: &str) {
    let mut v = value.as_bytes().to_vec();
    v.push(0);
    put(buf, kind, &v);
}

/// A netlink u32 of nf_tables: big endian.
pub(crate) fn put_u32(buf: &mut Vec<u8>, kind: u16, value: u32) {
    put(buf, kind, &value.to_be_bytes());
}

pub(crate) fn nest(buf: &mut Vec<u8>, kind: u16, f: impl FnOnce(&mut Vec<u8>)) {
    let mut inner = Vec::new();
    f(&mut inner);
    let len = 4 + inner.len();
    buf.extend((len as u16).to_ne_bytes());
    buf.extend((kind | NLA_F_NESTED).to_ne_bytes());
    buf.extend(inner);
}

pub(crate) fn data(buf: &mut Vec<u8>, kind: u16, value: &[u8]) {
    nest(buf, kind, |d| put(d, NFTA_DATA_VALUE, value));
}

pub(crate) fn expression(list: &mut Vec<u8>, name: &str, f: impl FnOnce(&mut Vec<u8>)) {
    nest(list, NFTA_LIST_ELEM, |e| {
        put_str(e, NFTA_EXPR_NAME, name);
        nest(e, NFTA_EXPR_DATA, f);
    });
}

pub(crate) fn encode(list: &mut Vec<u8>, e: &Expr) {
    match e {
        Expr::MetaLoad(key) => expression(list, "meta", |d| {
            put_u32(d, 2, *key);
            put_u32(d, 1, NFT_REG_1);
        }),
        Expr::MetaSet(key) => expression(list, "meta", |d| {
            put_u32(d, 2, *key);
            put_u32(d, 3, NFT_REG_1);
        }),
        Expr::CtLoad(key) => expression(list, "ct", |d| {
            put_u32(d, 2, *key);
            put_u32(d, 1, NFT_REG_1);
        }),
        Expr::CtSet(key) => expression(list, "ct", |d| {
            put_u32(d, 2, *key);
            put_u32(d, 4, NFT_REG_1);
        }),
        Expr::Payload { base, offset, len } => expression(list, "payload", |d| {
            put_u32(d, 1, NFT_REG_1);
            put_u32(d, 2, *base);
            put_u32(d, 3, *offset);
            put_u32(d, 4, *len);
        }),
        Expr::Cmp { op, data: value } => expression(list, "cmp", |d| {
            put_u32(d, 1, NFT_REG_1);
            put_u32(d, 2, *op);
            data(d, 3, value);
        }),
        Expr::Bitwise { mask } => expression(list, "bitwise", |d| {
            put_u32(d, 1, NFT_REG_1);
            put_u32(d, 2, NFT_REG_1);
            put_u32(d, 3, mask.len() as u32);
            data(d, 4, mask);
            data(d, 5, &vec![0; mask.len()]);
        }),
        Expr::Lookup { set_id, invert } => expression(list, "lookup", |d| {
            put_u32(d, 2, NFT_REG_1);
            put_str(d, 1, "__set%d");
            put_u32(d, 4, *set_id);
            if *invert {
                put_u32(d, 5, NFT_LOOKUP_F_INV);
            }
        }),
        Expr::Counter => expression(list, "counter", |_| {}),
        Expr::Data(value) => expression(list, "immediate", |d| {
            put_u32(d, 1, NFT_REG_1);
            data(d, 2, value);
        }),
        Expr::Verdict { code, chain } => expression(list, "immediate", |d| {
            put_u32(d, 1, NFT_REG_VERDICT);
            nest(d, 2, |v| {
                nest(v, NFTA_DATA_VERDICT, |v| {
                    put_u32(v, NFTA_VERDICT_CODE, *code as u32);
                    if let Some(chain) = chain {
                        put_str(v, NFTA_VERDICT_CHAIN, chain);
                    }
                });
            });
        }),
        Expr::Redirect => expression(list, "redir", |d| {
            put_u32(d, 1, NFT_REG_1);
            put_u32(d, 3, NF_NAT_RANGE_PROTO_SPECIFIED);
        }),
        Expr::Tproxy { family } => expression(list, "tproxy", |d| {
            put_u32(d, 1, u32::from(*family));
            put_u32(d, 3, NFT_REG_1);
        }),
        Expr::CounterZeroed => expression(list, "counter", |d| {
            put(d, 1, &0u64.to_be_bytes());
            put(d, 2, &0u64.to_be_bytes());
        }),
        Expr::XtMatch { name, rev, info } => expression(list, "match", |d| {
            put_str(d, 1, name);
            put_u32(d, 2, *rev);
            put(d, 3, info);
        }),
        Expr::XtTarget { name, rev, info } => expression(list, "target", |d| {
            put_str(d, 1, name);
            put_u32(d, 2, *rev);
            put(d, 3, info);
        }),
    }
}
