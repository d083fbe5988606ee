//! TPROXY's policy routing, over netlink: `ip rule add fwmark <mark> lookup <table>`
//! and `ip route add local default dev lo table <table>` for each family, plus the
//! `::6/128` address on `lo` that IPv6 inbound passthrough binds to (as Istio does).

use std::net::{IpAddr, Ipv6Addr};

use super::netlink::{Family, Netlink, NetlinkError};
use crate::inputs::config::{CaptureConfig, InterceptionMode};

/// The IPv6 source address of Envoy's inbound passthrough (127.0.0.6's counterpart).
pub const INBOUND_PASSTHROUGH_V6: Ipv6Addr = Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6);

/// Whether `cfg` needs TPROXY routes: TPROXY mode with some inbound capture.
pub fn tproxy_needed(cfg: &CaptureConfig) -> bool {
    cfg.interception_mode == InterceptionMode::Tproxy && !cfg.inbound_ports.is_none()
}

fn families(ipv6: bool) -> &'static [Family] {
    if ipv6 { &[Family::V4, Family::V6] } else { &[Family::V4] }
}

/// Sets up what `cfg` needs; idempotent.
pub async fn configure(nl: &Netlink, cfg: &CaptureConfig) -> Result<(), NetlinkError> {
    if cfg.enable_ipv6 {
        nl.ensure_address("lo", IpAddr::V6(INBOUND_PASSTHROUGH_V6), 128).await?;
    }
    if !tproxy_needed(cfg) {
        return Ok(());
    }
    for family in families(cfg.enable_ipv6) {
        nl.ensure_fwmark_rule(*family, cfg.tproxy_mark, cfg.tproxy_route_table).await?;
        nl.ensure_local_default_route(*family, cfg.tproxy_route_table).await?;
    }
    Ok(())
}

/// Whether every route `cfg` needs is present.
pub async fn present(nl: &Netlink, cfg: &CaptureConfig) -> Result<bool, NetlinkError> {
    if !tproxy_needed(cfg) {
        return Ok(true);
    }
    for family in families(cfg.enable_ipv6) {
        if !nl.has_fwmark_rule(*family, cfg.tproxy_mark, cfg.tproxy_route_table).await?
            || !nl.has_local_default_route(*family, cfg.tproxy_route_table).await?
        {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Which of `cfg`'s fwmark rules and local routes a removal took away, per family
/// (rule, route), so that a removal failing later can put them back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Removed {
    pub v4: (bool, bool),
    pub v6: (bool, bool),
}

/// Removes the fwmark rules and local routes for `cfg`'s mark and table, both
/// families, whether or not TPROXY is configured now; idempotent. Says what was there.
pub async fn remove(nl: &Netlink, cfg: &CaptureConfig) -> Result<Removed, NetlinkError> {
    let mut removed = Removed::default();
    for family in [Family::V4, Family::V6] {
        let rule = nl.has_fwmark_rule(family, cfg.tproxy_mark, cfg.tproxy_route_table).await?;
        let route = nl.has_local_default_route(family, cfg.tproxy_route_table).await?;
        if rule {
            nl.delete_fwmark_rule(family, cfg.tproxy_mark, cfg.tproxy_route_table).await?;
        }
        if route {
            nl.delete_local_default_route(family, cfg.tproxy_route_table).await?;
        }
        *(if family == Family::V4 { &mut removed.v4 } else { &mut removed.v6 }) = (rule, route);
    }
    Ok(removed)
}

/// Puts back what [`remove`] took away.
pub async fn restore(nl: &Netlink, cfg: &CaptureConfig, removed: Removed) -> Result<(), NetlinkError> {
    for (family, (rule, route)) in [(Family::V4, removed.v4), (Family::V6, removed.v6)] {
        if rule {
            nl.ensure_fwmark_rule(family, cfg.tproxy_mark, cfg.tproxy_route_table).await?;
        }
        if route {
            nl.ensure_local_default_route(family, cfg.tproxy_route_table).await?;
        }
    }
    Ok(())
}
