//! What both generators (iptables and nft) decide the same way from a config: the
//! outbound ranges split by family, whether DNS capture is really on, whether loopback
//! is explicitly included; the fixed values both write into rules; and the order both
//! write the parts of Istio's rules in (`IstioOrder`, `in_istio_order`).

use super::config::{CaptureConfig, Cidr, InterceptionMode, IpRanges};

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

/// The parts of Istio's sidecar rules, each written by a generator (iptables, nft) in
/// its own tables and words; [`in_istio_order`] calls them in Istio's order on [`Steps`].
pub(crate) trait IstioOrder {
    /// Interfaces whose traffic is not captured: the excluded ones in neither
    /// direction (in mangle too for TPROXY), the virtual (VM) ones not as inbound.
    fn uncaptured_interfaces(&mut self);
    /// Conntrack-INVALID packets dropped (`--drop-invalid`).
    fn invalid_drop(&mut self);
    /// The tunnel port's exemption from inbound capture, and the two redirect chains'
    /// targets (Envoy's outbound and inbound ports).
    fn redirect_targets(&mut self);
    /// Inbound capture (none when no inbound port is captured): TPROXY's in mangle,
    /// REDIRECT's in nat, for all ports but the excluded or for the listed ones.
    fn inbound(&mut self);
    /// Output into Istio's output chain, the outbound ports never captured, and the
    /// inbound passthrough's own source address let through.
    fn output_entry(&mut self);
    /// One proxy uid's rules: the proxy's calls to itself through a service VIP go to
    /// Envoy's inbound, an app's calls to itself over lo are not captured (unless
    /// loopback was included), and the proxy's own traffic is never captured.
    fn proxy_uid(&mut self, uid: &str);
    /// One proxy gid's rules, as [`IstioOrder::proxy_uid`]'s for a group.
    fn proxy_gid(&mut self, gid: &str);
    /// ISTIO_OUTBOUND_OWNER_GROUPS\[_EXCLUDE\]: the groups whose traffic is not captured.
    fn owner_groups(&mut self);
    /// DNS redirection to the agent's 15053, and the conntrack zones that keep the
    /// agent's upstream queries apart from the app's.
    fn dns(&mut self);
    /// Outbound destinations: localhost and the excluded ranges let through, the
    /// included ports and ranges (per family) redirected to Envoy.
    fn outbound_destinations(&mut self);
    /// TPROXY's marks: Envoy's mark saved as the connection mark and restored on the
    /// workload's replies, and the proxy's loopback traffic to the workload marked.
    fn tproxy_marks(&mut self);
}

/// A generator's rules so far, and what each of its steps reads: the configuration
/// and the values both generators derive from it the same way.
pub(crate) struct Steps<'a, B> {
    /// The back end's rule builder.
    pub(crate) b: B,
    pub(crate) cfg: &'a CaptureConfig,
    pub(crate) d: Decisions,
    /// TPROXY inbound interception.
    pub(crate) tproxy: bool,
    /// The IPv4 loopback range (ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR).
    pub(crate) lo4: String,
    /// TPROXY's mark.
    pub(crate) mark: String,
    /// Envoy's inbound capture port.
    pub(crate) capture_port: String,
    /// The inbound tunnel port.
    pub(crate) tunnel_port: String,
}

impl<'a, B> Steps<'a, B> {
    pub(crate) fn new(cfg: &'a CaptureConfig, b: B) -> Self {
        Self {
            b,
            cfg,
            d: Decisions::of(cfg),
            tproxy: cfg.interception_mode == InterceptionMode::Tproxy,
            lo4: cfg.host_ipv4_loopback_cidr.to_string(),
            mark: cfg.tproxy_mark.to_string(),
            capture_port: cfg.inbound_capture_port.to_string(),
            tunnel_port: cfg.inbound_tunnel_port.to_string(),
        }
    }
}

/// Writes the parts of Istio's rules in Istio's order, each only where the
/// configuration asks for it; returns the builder.
pub(crate) fn in_istio_order<'a, B>(mut steps: Steps<'a, B>) -> B
where
    Steps<'a, B>: IstioOrder,
{
    let cfg = steps.cfg;
    steps.uncaptured_interfaces();
    if cfg.drop_invalid {
        steps.invalid_drop();
    }
    steps.redirect_targets();
    steps.inbound();
    steps.output_entry();
    for uid in &cfg.proxy_uids {
        steps.proxy_uid(uid);
    }
    for gid in &cfg.proxy_gids {
        steps.proxy_gid(gid);
    }
    steps.owner_groups();
    if steps.d.redirect_dns {
        steps.dns();
    }
    steps.outbound_destinations();
    if steps.tproxy {
        steps.tproxy_marks();
    }
    steps.b
}
