//! Ambient mode's rules, as Istio's node agent (istio-cni ≥ 1.22) programs them: the
//! in-pod rules that hand a pod's traffic to ztunnel inside the pod's own network
//! namespace, and the node's host-probe rule that SNATs kubelet's probes so the pod
//! can tell them apart. Pure plans ([`plan`] for iptables, [`nft`] for native
//! nftables) reproduce Istio's 14 + 14 goldens; the apply step reuses the sidecar
//! machinery (the renderer, verify, reconcile behind guardrails, rollback) and sets the
//! in-pod policy route over netlink.
//!
//! The node agent calls:
//! - [`apply_inpod`]`(netns, &InpodConfig) -> Report`: rules, `ip rule fwmark
//!   0x111/0xfff pref 32764 lookup 100` and `local default dev lo table 100` (per
//!   family) in the pod's namespace, all or nothing. A namespace already holding
//!   exactly these rules is left alone (`Action::AlreadyApplied`); one holding other
//!   ambient rules is replaced with no leftovers (`Action::Reconciled`; for iptables
//!   only with `AmbientConfig::reconcile`, else [`AmbientError::Drift`] and nothing
//!   changes).
//! - [`remove_inpod`]`(netns)`: every ambient chain, jump and table (both backends,
//!   whatever configuration made them), the ip rule and the route; nothing there is
//!   fine.
//! - [`verify_inpod`]`(netns, &InpodConfig) -> Verdict`: `Applied` (rules, ip rule and
//!   route as planned), `Clean` (no ambient rules) or `Drifted`.
//! - [`apply_host_probe`]`(netns, &AmbientConfig, kubelet_uid)`,
//!   [`remove_host_probe`], [`verify_host_probe`]: the node's probe SNAT (`None` is the
//!   calling thread's namespace, the node's for the agent). nftables needs kubelet's
//!   uid ([`kubelet_uid`] finds it in `/proc`); iptables matches `--socket-exists`
//!   and needs the `istio-inpod-probes-v4`/`-v6` ipsets to exist; for nftables the
//!   sets are created in the table if missing. [`probeset::ProbeSets`] creates them
//!   and keeps the pods' addresses in them (ipsets over netlink, [`crate::kernel::ipset`]).
//!
//! [`program_inpod_iptables`], [`program_inpod_nft`], [`program_host_iptables`] and
//! [`program_host_nft`] are the same runs through any executor (a recorder writes
//! Istio's golden transcripts).

pub mod config;
mod constants;
pub mod nft;
pub mod plan;
pub mod probeset;

mod apply;
mod host;
mod routes;

pub use apply::{
    AmbientError, apply_inpod, apply_inpod_ebpf, clear_inpod_ebpf, program_inpod_iptables, program_inpod_nft,
    remove_inpod, remove_inpod_ebpf, verify_inpod,
};
pub use config::{AmbientBackend, AmbientConfig, InpodConfig, PodDns, PodOverrides};
pub use constants::{
    INPOD_MARK, INPOD_MASK, INPOD_RESTORE_MASK, INPOD_RULE_PRIORITY, INPOD_TPROXY_MARK, INPOD_TPROXY_MASK,
    PROBE_SET_V4, PROBE_SET_V6, ROUTE_TABLE_INBOUND, ZTUNNEL_DNS_PORT, ZTUNNEL_INBOUND_PLAINTEXT_PORT,
    ZTUNNEL_INBOUND_PORT, ZTUNNEL_OUTBOUND_PORT,
};
pub use host::{
    apply_host_probe, kubelet_uid, kubelet_uid_in, program_host_iptables, program_host_nft,
    remove_host_probe, verify_host_probe,
};
pub use routes::INPOD_ROUTE_RULE;
