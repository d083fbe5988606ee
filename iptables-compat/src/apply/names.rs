//! The user and group names a configuration puts in rules, checked against the host
//! before anything changes ([`check_names`]).

use super::error::CaptureError;
use crate::inputs::{
    config::{CaptureConfig, OwnerGroups},
    detect::HostFacts,
};

/// User and group names in the rules are the kernel tools' to resolve when the rules
/// go in (a dry run prints them as given, as Istio's does); an unknown one is named
/// here, before anything changes, rather than failing the transaction.
pub fn check_names(cfg: &CaptureConfig, facts: &dyn HostFacts) -> Result<(), CaptureError> {
    let numeric = |n: &str| n.parse::<u32>().is_ok();
    for uid in cfg.proxy_uids.iter().filter(|u| !numeric(u)) {
        if facts.user_id(uid).is_none() {
            return Err(CaptureError::UnknownName {
                input: "-u/--proxy-uid",
                kind: "user",
                name: uid.clone(),
            });
        }
    }
    for gid in cfg.proxy_gids.iter().filter(|g| !numeric(g)) {
        if !facts.group_exists(gid) {
            return Err(CaptureError::UnknownName {
                input: "-g/--proxy-gid",
                kind: "group",
                name: gid.clone(),
            });
        }
    }
    let groups = match &cfg.owner_groups {
        OwnerGroups::AllExcept(g) | OwnerGroups::Only(g) => g,
    };
    for group in groups.iter().filter(|g| !numeric(g)) {
        if !facts.group_exists(group) {
            return Err(CaptureError::UnknownName {
                input: "ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE]",
                kind: "group",
                name: group.clone(),
            });
        }
    }
    Ok(())
}
