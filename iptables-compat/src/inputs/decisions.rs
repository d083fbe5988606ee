//! What both generators (iptables and nft) decide the same way from a config: the
//! outbound ranges split by family, whether DNS capture is really on, whether loopback
//! is explicitly included; and the fixed values both write into rules.

use super::config::{CaptureConfig, Cidr, IpRanges};

/// The agent's DNS listener port.
pub const DNS_PROXY_PORT: &str = "15053";
/// The mark Envoy's outbound traffic to the workload gets in TPROXY mode.
pub const OUTBOUND_MARK: &str = "1338";

/// Prefixes of one family to capture outbound.
#[derive(Debug, Clone, Default)]
pub struct FamilyRanges {
    pub wildcard: bool,
    pub cidrs: Vec<Cidr>,
    pub has_loopback: bool,
}

/// Derived facts both generators need.
#[derive(Debug, Clone)]
pub struct Decisions {
    pub include_v4: FamilyRanges,
    pub include_v6: FamilyRanges,
    pub exclude_v4: Vec<Cidr>,
    pub exclude_v6: Vec<Cidr>,
    /// `--redirect-dns`, unless there is nothing to redirect: not capturing all DNS
    /// and no resolv.conf servers means DNS capture is off (Istio warns and goes on).
    pub redirect_dns: bool,
}

impl Decisions {
    pub fn of(cfg: &CaptureConfig) -> Self {
        let (include_v4, include_v6) = match &cfg.outbound_ip_ranges_include {
            IpRanges::All => (
                FamilyRanges { wildcard: true, ..Default::default() },
                FamilyRanges { wildcard: true, ..Default::default() },
            ),
            IpRanges::Only(cidrs) => {
                let mut v4 = FamilyRanges::default();
                let mut v6 = FamilyRanges::default();
                for cidr in cidrs {
                    let family = if cidr.is_ipv4() { &mut v4 } else { &mut v6 };
                    family.has_loopback |= cidr.is_loopback();
                    family.cidrs.push(*cidr);
                }
                (v4, v6)
            }
        };
        let (exclude_v4, exclude_v6) = cfg.outbound_ip_ranges_exclude.iter().partition(|c| c.is_ipv4());
        let no_servers = cfg.dns_servers_v4.is_empty() && cfg.dns_servers_v6.is_empty();
        let redirect_dns = cfg.redirect_dns && (cfg.capture_all_dns || !no_servers);
        if cfg.redirect_dns && !redirect_dns {
            tracing::warn!(
                "REDIRECT_DNS is set, but CAPTURE_ALL_DNS is false, and no DNS servers provided. DNS capture disabled."
            );
        }
        Self { include_v4, include_v6, exclude_v4, exclude_v6, redirect_dns }
    }

    /// Loopback explicitly included in `-i` (then app→app over lo is captured too).
    pub fn includes_loopback(&self) -> bool {
        self.include_v4.has_loopback || self.include_v6.has_loopback
    }
}
