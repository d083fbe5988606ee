//! What `weir capture explain` reads and answers: the connection asked about
//! ([`Connection`]), the answer ([`Explanation`], [`Outcome`]) or why there is none
//! ([`ExplainError`]), and the rules as both readers (`iptables-save`, nftables) hand
//! them to the walk: matches and targets in Istio's vocabulary, with the port lists
//! and id ranges they carry.

use std::net::IpAddr;

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

/// The deepest chain of jumps walked.
pub(super) const MAX_DEPTH: usize = 16;

/// One `-A` rule: its matches (each possibly negated) and its target.
#[derive(Debug, Clone)]
pub(super) struct Rule {
    pub(super) text: String,
    pub(super) matches: Vec<(bool, Match)>,
    pub(super) target: Target,
}

/// One match of a rule, as both readers understand it.
#[derive(Debug, Clone)]
pub(super) enum Match {
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

/// Where a rule sends a packet that matches it.
#[derive(Debug, Clone)]
pub(super) enum Target {
    Return,
    Accept,
    Redirect(u16),
    Jump(String),
    /// No `-j`: counts and goes on.
    None,
}

/// A port list (`80,443`, ranges `a:b`).
pub(super) fn ports(raw: &str) -> Option<Vec<(u16, u16)>> {
    raw.split(',')
        .map(|p| match p.split_once(':') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => p.parse().ok().map(|n| (n, n)),
        })
        .collect()
}

/// A uid or gid, or a range `a-b`.
pub(super) fn id_range(raw: &str) -> Option<(u32, u32)> {
    match raw.split_once('-') {
        Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
        None => raw.parse().ok().map(|n| (n, n)),
    }
}
