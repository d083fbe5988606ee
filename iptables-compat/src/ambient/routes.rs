//! The in-pod policy route Istio's node agent sets beside the rules, over netlink:
//! `ip rule add fwmark 0x111/0xfff pref 32764 lookup 100` and `ip route add local
//! default dev lo table 100`, per family (IPv6 only when enabled, and its route only
//! when `lo` has IPv6). Connections ztunnel accepted (connmark 0x111) route their
//! replies back to the local stack.

use super::constants::{INPOD_RULE_PRIORITY, INPOD_TPROXY_MARK, INPOD_TPROXY_MASK, ROUTE_TABLE_INBOUND};
use crate::kernel::netlink::{Family, MarkRule, Netlink, NetlinkError};

/// `fwmark 0x111/0xfff pref 32764 lookup 100`.
pub const INPOD_ROUTE_RULE: MarkRule = MarkRule {
    mark: INPOD_TPROXY_MARK,
    mask: INPOD_TPROXY_MASK,
    priority: INPOD_RULE_PRIORITY,
    table: ROUTE_TABLE_INBOUND,
};

fn families(ipv6: bool) -> &'static [Family] {
    if ipv6 { &[Family::V4, Family::V6] } else { &[Family::V4] }
}

/// Whether this namespace's `lo` has IPv6 turned off (then Istio sets no v6 route).
/// Read from the calling thread's namespace; unreadable counts as on, as Istio tries.
fn lo_ipv6_disabled() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv6/conf/lo/disable_ipv6").is_ok_and(|v| v.trim() == "1")
}

fn wants_route(family: Family) -> bool {
    family == Family::V4 || !lo_ipv6_disabled()
}

/// Sets the rule and route for each family; idempotent. If one fails, those this call
/// added are taken out again before the error is returned.
pub(crate) async fn configure(nl: &Netlink, ipv6: bool) -> Result<(), NetlinkError> {
    let mut added = Removed::default();
    let result = add_missing(nl, ipv6, &mut added).await;
    if result.is_err() {
        for (family, (rule, route)) in [(Family::V4, added.v4), (Family::V6, added.v6)] {
            if rule {
                let _ = nl.delete_mark_rule(family, INPOD_ROUTE_RULE).await;
            }
            if route {
                let _ = nl.delete_local_default_route(family, ROUTE_TABLE_INBOUND).await;
            }
        }
    }
    result
}

async fn add_missing(nl: &Netlink, ipv6: bool, added: &mut Removed) -> Result<(), NetlinkError> {
    for family in families(ipv6) {
        let slot = if *family == Family::V4 { &mut added.v4 } else { &mut added.v6 };
        if wants_route(*family) && !nl.has_local_default_route(*family, ROUTE_TABLE_INBOUND).await? {
            nl.ensure_local_default_route(*family, ROUTE_TABLE_INBOUND).await?;
            slot.1 = true;
        }
        if !nl.has_mark_rule(*family, INPOD_ROUTE_RULE).await? {
            nl.ensure_mark_rule(*family, INPOD_ROUTE_RULE).await?;
            slot.0 = true;
        }
    }
    Ok(())
}

/// Whether the rule and route are in place for each family `ipv6` asks for.
pub(crate) async fn present(nl: &Netlink, ipv6: bool) -> Result<bool, NetlinkError> {
    for family in families(ipv6) {
        if !nl.has_mark_rule(*family, INPOD_ROUTE_RULE).await? {
            return Ok(false);
        }
        if wants_route(*family) && !nl.has_local_default_route(*family, ROUTE_TABLE_INBOUND).await? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether anything of ours is there, in either family.
pub(crate) async fn any_present(nl: &Netlink) -> Result<bool, NetlinkError> {
    for family in [Family::V4, Family::V6] {
        if nl.has_mark_rule(family, INPOD_ROUTE_RULE).await?
            || nl.has_local_default_route(family, ROUTE_TABLE_INBOUND).await?
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// What [`remove`] took away (or [`configure`] added), per family: (rule, route).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Removed {
    v4: (bool, bool),
    v6: (bool, bool),
}

/// Removes the rule and route of both families, whatever is there.
pub(crate) async fn remove(nl: &Netlink) -> Result<Removed, NetlinkError> {
    let mut removed = Removed::default();
    for family in [Family::V4, Family::V6] {
        let route = nl.has_local_default_route(family, ROUTE_TABLE_INBOUND).await?;
        if route {
            nl.delete_local_default_route(family, ROUTE_TABLE_INBOUND).await?;
        }
        let rule = nl.delete_mark_rule(family, INPOD_ROUTE_RULE).await?;
        *(if family == Family::V4 { &mut removed.v4 } else { &mut removed.v6 }) = (rule, route);
    }
    Ok(removed)
}

/// Puts back what [`remove`] took away.
pub(crate) async fn restore(nl: &Netlink, removed: Removed) -> Result<(), NetlinkError> {
    for (family, (rule, route)) in [(Family::V4, removed.v4), (Family::V6, removed.v6)] {
        if route {
            nl.ensure_local_default_route(family, ROUTE_TABLE_INBOUND).await?;
        }
        if rule {
            nl.ensure_mark_rule(family, INPOD_ROUTE_RULE).await?;
        }
    }
    Ok(())
}
