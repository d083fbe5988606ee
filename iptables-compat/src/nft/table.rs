//! The model of Istio's native nftables rules: its three tables in family inet
//! ([`NftTable`]) with their chains, one rule ([`NftRule`]) and every rule of a
//! configuration in order ([`NftPlan`]).

/// An Istio nftables table (family inet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NftTable {
    Nat,
    Mangle,
    Raw,
}

impl NftTable {
    /// In the order Istio writes them.
    pub const ALL: [NftTable; 3] = [NftTable::Nat, NftTable::Mangle, NftTable::Raw];

    pub fn name(self) -> &'static str {
        match self {
            NftTable::Nat => "istio-proxy-nat",
            NftTable::Mangle => "istio-proxy-mangle",
            NftTable::Raw => "istio-proxy-raw",
        }
    }

    /// The table's chains in declaration order; base chains carry their hook spec.
    pub fn chains(self) -> &'static [(&'static str, Option<&'static str>)] {
        match self {
            NftTable::Nat => &[
                ("prerouting", Some("type nat hook prerouting priority -100 ;")),
                ("output", Some("type nat hook output priority -100 ;")),
                ("istio-inbound", None),
                ("istio-redirect", None),
                ("istio-in-redirect", None),
                ("istio-output", None),
                ("istio-output-dns", None),
            ],
            NftTable::Mangle => &[
                ("prerouting", Some("type filter hook prerouting priority -150 ;")),
                ("output", Some("type route hook output priority -150 ;")),
                ("istio-divert", None),
                ("istio-tproxy", None),
                ("istio-inbound", None),
                ("istio-drop", None),
            ],
            NftTable::Raw => &[
                ("prerouting", Some("type filter hook prerouting priority -300 ;")),
                ("output", Some("type filter hook output priority -300 ;")),
                ("istio-inbound", None),
                ("istio-output-dns", None),
            ],
        }
    }
}

/// One nft rule, with an insert position when Istio inserts rather than appends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftRule {
    pub table: NftTable,
    pub chain: &'static str,
    pub index: Option<usize>,
    pub expr: String,
}

/// Every rule Istio would program with `--native-nftables`, in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NftPlan {
    pub rules: Vec<NftRule>,
}

impl NftPlan {
    pub fn rules_in(&self, table: NftTable) -> impl Iterator<Item = &NftRule> {
        self.rules.iter().filter(move |r| r.table == table)
    }

    /// Tables this plan puts rules in.
    pub fn tables(&self) -> Vec<NftTable> {
        NftTable::ALL.into_iter().filter(|t| self.rules_in(*t).next().is_some()).collect()
    }
}
