//! The node's sets of ambient pod addresses the host-probe rule matches
//! (`istio-inpod-probes-v4` / `-v6`): ipsets (`hash:ip` with comments, over netlink:
//! [`crate::kernel::ipset`]) for iptables, sets in `inet istio-ambient-nat` for nftables. As
//! Istio keeps them: each address carries its pod's uid as the comment; adding is an
//! upsert (a newer pod with a reused address takes the entry over); removing deletes an
//! address only while its comment is still this pod's uid. Runs in the calling thread's
//! network namespace (the node's, for the agent).

use std::{collections::BTreeSet, net::IpAddr};

use super::{
    config::{AmbientBackend, AmbientConfig},
    constants::{PROBE_SET_V4, PROBE_SET_V6},
    nft as anft,
};
use crate::{
    kernel::ipset::{self, IpsetError},
    nft::exec::{self, NftError},
};

/// Why a probe-set change failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeSetError {
    #[error(transparent)]
    Ipset(#[from] IpsetError),
    #[error("nft probe set: {0}")]
    Nft(#[from] NftError),
    #[error("nft probe set {set}: the listing is not nft's JSON: {why}")]
    Listing { set: &'static str, why: String },
}

/// One address in a set, with the pod uid it was added for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProbeEntry {
    pub ip: IpAddr,
    pub uid: Option<String>,
}

/// The node's probe sets for one configuration.
#[derive(Debug, Clone)]
pub struct ProbeSets {
    backend: AmbientBackend,
    ipv6: bool,
}

fn set_of(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() { PROBE_SET_V4 } else { PROBE_SET_V6 }
}

/// A uid as it can stand in an nft comment (quoted): Kubernetes uids are UUIDs; anything
/// else keeps only such characters.
fn nft_comment(uid: &str) -> String {
    uid.chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')).collect()
}

impl ProbeSets {
    pub fn new(cfg: &AmbientConfig) -> Self {
        Self { backend: cfg.backend, ipv6: cfg.enable_ipv6 }
    }

    fn names(&self) -> Vec<&'static str> {
        if self.ipv6 { vec![PROBE_SET_V4, PROBE_SET_V6] } else { vec![PROBE_SET_V4] }
    }

    /// Creates the sets that are missing (existing ones keep their members).
    pub fn ensure(&self) -> Result<(), ProbeSetError> {
        match self.backend {
            AmbientBackend::Iptables => {
                for name in self.names() {
                    ipset::create_hash_ip(name, name == PROBE_SET_V6)?;
                }
            }
            AmbientBackend::Nftables => {
                exec::nft(&["-f", "-"], Some(&anft::render_probe_sets(self.ipv6)))?;
            }
        }
        Ok(())
    }

    /// Adds `ip` for pod `uid` (replacing whichever pod had it).
    pub fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), ProbeSetError> {
        match self.backend {
            AmbientBackend::Iptables => ipset::add(set_of(ip), ip, uid)?,
            AmbientBackend::Nftables => {
                let (t, s, c) = (anft::TABLE_NAT, set_of(ip), nft_comment(uid));
                let tx = format!(
                    "add element inet {t} {s} {{ {ip} }}\ndelete element inet {t} {s} {{ {ip} }}\n\
                     add element inet {t} {s} {{ {ip} comment \"{c}\" }}\n"
                );
                exec::nft(&["-f", "-"], Some(&tx))?;
            }
        }
        Ok(())
    }

    /// Removes `ip` if it is still pod `uid`'s; `Ok(Some(other))` names the pod that
    /// holds it now (then it stays).
    pub fn remove(&self, ip: IpAddr, uid: &str) -> Result<Option<String>, ProbeSetError> {
        let holder = self.entries()?.into_iter().find(|e| e.ip == ip);
        let Some(entry) = holder else { return Ok(None) };
        let ours = match self.backend {
            AmbientBackend::Iptables => entry.uid.as_deref() == Some(uid),
            AmbientBackend::Nftables => entry.uid.as_deref() == Some(nft_comment(uid).as_str()),
        };
        if !ours {
            return Ok(Some(entry.uid.unwrap_or_default()));
        }
        self.delete(ip)?;
        Ok(None)
    }

    fn delete(&self, ip: IpAddr) -> Result<(), ProbeSetError> {
        match self.backend {
            AmbientBackend::Iptables => ipset::del(set_of(ip), ip)?,
            AmbientBackend::Nftables => {
                let tx = format!("delete element inet {} {} {{ {ip} }}\n", anft::TABLE_NAT, set_of(ip));
                exec::nft(&["-f", "-"], Some(&tx))?;
            }
        }
        Ok(())
    }

    /// Every address in the sets (missing sets are empty).
    /// Flushes and destroys the sets (a node agent that cleans up when it stops for
    /// good, as Istio's `hostAddrSet.Flush()` and `DestroySet()`), after the probe rule
    /// that refers to them is removed; sets already gone are not an error.
    pub fn destroy(&self) -> Result<(), ProbeSetError> {
        for name in self.names() {
            match self.backend {
                AmbientBackend::Iptables => {
                    if ipset::list(name)?.is_some() {
                        ipset::flush(name)?;
                        ipset::destroy(name)?;
                    }
                }
                // `destroy` (nft 1.0.8) is not in every node's nft: a set that lists is
                // deleted (after the probe rule that refers to it).
                AmbientBackend::Nftables
                    if exec::nft(&["list", "set", "inet", anft::TABLE_NAT, name], None).is_ok() =>
                {
                    let tx = format!("delete set inet {} {name}\n", anft::TABLE_NAT);
                    exec::nft(&["-f", "-"], Some(&tx))?;
                }
                AmbientBackend::Nftables => {}
            }
        }
        Ok(())
    }

    pub fn entries(&self) -> Result<Vec<ProbeEntry>, ProbeSetError> {
        let mut out = Vec::new();
        for name in self.names() {
            match self.backend {
                AmbientBackend::Iptables => {
                    for m in ipset::list(name)?.unwrap_or_default() {
                        out.push(ProbeEntry { ip: m.ip, uid: m.comment });
                    }
                }
                AmbientBackend::Nftables => out.extend(nft_entries(name)?),
            }
        }
        out.sort();
        Ok(out)
    }

    /// Removes every address not in `keep` (a complete snapshot of the enrolled pods'
    /// addresses); returns what was removed.
    pub fn prune(&self, keep: &BTreeSet<IpAddr>) -> Result<Vec<IpAddr>, ProbeSetError> {
        let mut removed = Vec::new();
        for entry in self.entries()? {
            if !keep.contains(&entry.ip) {
                self.delete(entry.ip)?;
                removed.push(entry.ip);
            }
        }
        Ok(removed)
    }
}

/// The elements of an nft set, from `nft -j list set`; a missing table or set is empty.
fn nft_entries(set: &'static str) -> Result<Vec<ProbeEntry>, ProbeSetError> {
    if !exec::inet_tables()?.iter().any(|t| t == anft::TABLE_NAT) {
        return Ok(Vec::new());
    }
    let listing = match exec::nft(&["-j", "list", "set", "inet", anft::TABLE_NAT, set], None) {
        Ok(l) => l,
        Err(NftError::Failed { .. }) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    parse_nft_set(set, &listing)
}

/// Elements of `nft -j list set`: plain addresses or `{"elem": {"val", "comment"}}`.
fn parse_nft_set(set: &'static str, listing: &str) -> Result<Vec<ProbeEntry>, ProbeSetError> {
    let value: serde_json::Value =
        serde_json::from_str(listing).map_err(|e| ProbeSetError::Listing { set, why: e.to_string() })?;
    let mut out = Vec::new();
    for item in value["nftables"].as_array().into_iter().flatten() {
        for elem in item["set"]["elem"].as_array().into_iter().flatten() {
            let (val, comment) = match elem {
                serde_json::Value::String(s) => (s.as_str(), None),
                other => (
                    other["elem"]["val"].as_str().unwrap_or_default(),
                    other["elem"]["comment"].as_str().map(String::from),
                ),
            };
            let ip =
                val.parse().map_err(|_| ProbeSetError::Listing { set, why: format!("element {elem}") })?;
            out.push(ProbeEntry { ip, uid: comment });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nft_listings_give_addresses_and_uids() {
        let listing = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"set": {"family": "inet",
            "name": "istio-inpod-probes-v4", "table": "istio-ambient-nat", "type": "ipv4_addr",
            "elem": [{"elem": {"val": "10.0.0.2", "comment": "uid-2"}}, "10.0.0.3"]}}]}"#;
        assert_eq!(
            parse_nft_set(PROBE_SET_V4, listing).unwrap(),
            [
                ProbeEntry { ip: "10.0.0.2".parse().unwrap(), uid: Some("uid-2".into()) },
                ProbeEntry { ip: "10.0.0.3".parse().unwrap(), uid: None },
            ]
        );
        assert!(parse_nft_set(PROBE_SET_V4, "nope").is_err());
        assert_eq!(nft_comment("6f1e2d3c-aa\"; flush ruleset"), "6f1e2d3c-aaflushruleset");
    }
}
