//! Which netfilter backend the ambient node agent really uses, decided once at start as
//! Istio 1.31's agent decides it (cni/pkg/nodeagent/server_linux.go): `NATIVE_NFTABLES`
//! asks for nftables, but
//! - a node whose iptables probe set exists (an iptables-mode agent, Weir's or
//!   Istio's, ran since the last boot) stays on iptables until it is rebooted
//!   (istio/istio#58353): switching at once would leave the running pods' iptables
//!   rules and the node's ipset behind, stale;
//! - an `nft` built without JSON support (needed to read the probe sets back) falls
//!   back to iptables (istio/istio#60328).
//!
//! A probe that cannot answer keeps what was asked, as Istio's does.

use weir_iptables::ambient::{AmbientBackend, PROBE_SET_V4, PROBE_SET_V6};

/// The backend this process's agent settled on (set once, at its start).
static CHOSEN: std::sync::OnceLock<AmbientBackend> = std::sync::OnceLock::new();

/// Records the backend the agent runs with, for what runs after it (the chart mode's
/// clean-up at stop).
pub fn record(backend: AmbientBackend) {
    let _ = CHOSEN.set(backend);
}

/// The backend the agent ran with, if it started.
pub fn chosen() -> Option<AmbientBackend> {
    CHOSEN.get().copied()
}

/// What nft prints when it was built without libjansson.
const NFT_NO_JSON: &str = "JSON support not compiled-in";

/// The backend to use for `requested`, and why when it is not the one asked for.
pub fn choose(
    requested: AmbientBackend,
    ipv6: bool,
    ipset_exists: impl Fn(&str) -> Result<bool, String>,
    nft_json: impl FnOnce() -> Result<bool, String>,
) -> (AmbientBackend, Option<String>) {
    if requested != AmbientBackend::Nftables {
        return (requested, None);
    }
    let sets = if ipv6 { vec![PROBE_SET_V4, PROBE_SET_V6] } else { vec![PROBE_SET_V4] };
    for set in sets {
        match ipset_exists(set) {
            Ok(true) => {
                return (
                    AmbientBackend::Iptables,
                    Some(format!(
                        "NATIVE_NFTABLES is true, but the node's iptables probe set {set} exists (an iptables-mode agent ran since the last boot): staying on iptables; reboot the node to complete the move to nftables"
                    )),
                );
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(set, error = %e, "cannot tell whether the iptables probe set exists: proceeding with nftables as configured")
            }
        }
    }
    match nft_json() {
        Ok(true) => (AmbientBackend::Nftables, None),
        Ok(false) => (
            AmbientBackend::Iptables,
            Some("NATIVE_NFTABLES is true, but this nft has no JSON support (needed to read the probe sets back): using iptables".into()),
        ),
        Err(e) => {
            tracing::warn!(error = %e, "cannot tell whether nft supports JSON: proceeding with nftables as configured");
            (AmbientBackend::Nftables, None)
        }
    }
}

/// Whether the ipset `name` exists in this thread's network namespace.
pub fn ipset_exists(name: &str) -> Result<bool, String> {
    weir_iptables::kernel::ipset::list(name).map(|l| l.is_some()).map_err(|e| e.to_string())
}

/// Whether the `nft` on PATH can print JSON (`nft --json list tables`).
pub fn nft_json_supported() -> Result<bool, String> {
    let out = std::process::Command::new("nft")
        .args(["--json", "list", "tables"])
        .output()
        .map_err(|e| format!("run nft: {e}"))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if text.contains(NFT_NO_JSON) {
        return Ok(false);
    }
    if !out.status.success() {
        return Err(format!("nft --json list tables: {}", text.trim()));
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nftables_is_kept_unless_the_iptables_set_exists_or_nft_lacks_json() {
        use AmbientBackend::*;
        let none = |_: &str| Ok(false);
        assert_eq!(choose(Nftables, true, none, || Ok(true)), (Nftables, None));
        let (b, why) = choose(Nftables, true, |s: &str| Ok(s == PROBE_SET_V6), || Ok(true));
        assert_eq!(b, Iptables);
        assert!(why.unwrap().contains(PROBE_SET_V6));
        // The v6 set is not looked for with IPv6 off.
        assert_eq!(choose(Nftables, false, |s: &str| Ok(s == PROBE_SET_V6), || Ok(true)).0, Nftables);
        assert_eq!(choose(Nftables, true, none, || Ok(false)).0, Iptables);
        // Probes that cannot answer keep what was asked.
        assert_eq!(
            choose(Nftables, true, |_: &str| Err("EPERM".into()), || Err("no nft".into())).0,
            Nftables
        );
        // iptables asked: nothing probed.
        let probed = |_: &str| -> Result<bool, String> { panic!("probed") };
        assert_eq!(choose(Iptables, true, probed, || panic!("probed")), (Iptables, None));
    }
}
