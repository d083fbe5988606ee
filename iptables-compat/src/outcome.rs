//! What a run did and which way it went: the backend that programmed the rules
//! ([`Backend`]), the change it made ([`Action`]) and how it read the namespace's state
//! ([`ApplyPath`]). The words both the back ends (an nft executor says which path its
//! transaction took) and the runs that drive them ([`crate::apply`]) use; it depends
//! on nothing.

/// Which backend programmed the rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Iptables,
    Nftables,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Iptables => "iptables",
            Backend::Nftables => "nftables",
        })
    }
}

/// What a run did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Rules installed into a clean namespace.
    Applied,
    /// The rules were already in place: nothing changed.
    AlreadyApplied,
    /// Drifted rules were replaced.
    Reconciled,
    /// Rules applied despite drift (`--force-apply`).
    ForceApplied,
    /// Every Istio chain, rule, table and route removed.
    Cleaned,
}

/// How a run read the namespace's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyPath {
    /// The state probed in process, the rules in with one step: for iptables
    /// ([`crate::apply::fast_path`]) one restore per family (or removal); for nftables, on a
    /// namespace with no Istio table, one nf_tables batch sent in process
    /// ([`crate::nft::wire`]), no `nft` run.
    Fast,
    /// Istio's way: the binaries detected, the state saved and verified, then the
    /// restore (or cleanup); for nftables, `nft -f`; every dry run.
    Full,
}

impl std::fmt::Display for ApplyPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ApplyPath::Fast => "fast",
            ApplyPath::Full => "full",
        })
    }
}
