//! AWS branch-ENI pods (EKS security groups for pods) kept reachable by kubelet's
//! probes, as Istio 1.30's node agent keeps them (`cni/pkg/nodeagent/brancheni_linux.go`,
//! `AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE`).
//!
//! aws-vpc-cni routes such a pod through the VPC: `iif <veth> lookup <table>` and, in
//! that table, a route to the pod's address via the same device. The node's probe SNAT
//! (169.254.7.127) does not survive the VPC, so kubelet's probes fail. When one of the
//! pod's addresses joins the node's probe set, this module finds that table and veth and
//! adds two rules on the node:
//! - `to <pod>/32 pref 512 lookup <table>`: the node reaches the pod through its veth;
//! - `iif <veth> pref <aws-vpc-cni's iif priority − 1> lookup local`: the pod's replies
//!   are delivered to the node (conntrack, kubelet) before aws-vpc-cni's rule sends them
//!   to the VPC.
//!
//! Only on a node whose `net.ipv4.tcp_early_demux` is 0 (read once, from the node's
//! /proc: `WEIR_HOST_PROC`), which AWS requires for security groups for pods; elsewhere
//! nothing is listed or added. The rules follow the address out of the probe set (not
//! while another pod holds it: the rules are the address's), and every rule this
//! process added is removed at a clean-up stop ([`flush`]), from what was added rather
//! than by looking again (aws-vpc-cni may have removed its rules by then).
//!
//! [`detect`] is pure, over the listed rules and routes; [`BranchEniProbes`] wraps the
//! node's probe sets so that the dataplane's upserts and removals carry the rules along.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::Path,
    sync::Mutex,
};

use weir_iptables::{
    ambient::probeset::ProbeSetError,
    netlink::{Family, Netlink, NetlinkError, PolicyRule},
};

use super::{dataplane::effects::HostProbeSet, settings::AmbientSettings};

/// The main routing table.
pub const MAIN_TABLE: u32 = 254;
/// The local routing table: the return rule's target.
pub const LOCAL_TABLE: u32 = 255;
/// The forward rule's priority: aws-vpc-cni's for its regular veth pods' `to` rules.
pub const TO_POD_PRIORITY: u32 = 512;

/// Why a branch-ENI pod's rules could not be read or set.
#[derive(Debug, thiserror::Error)]
pub enum BranchEniError {
    #[error("a runtime for netlink")]
    Runtime(#[source] std::io::Error),
    #[error("netlink")]
    Netlink(#[from] NetlinkError),
}

/// A branch-ENI pod's routing as aws-vpc-cni set it up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BranchEniRoute {
    /// The table its `iif` rule looks up.
    pub table: u32,
    /// The pod's host-side device (the `iif` rule's, and the route's).
    pub veth: String,
    /// The priority of aws-vpc-cni's `iif <veth> lookup <table>` rule.
    pub iif_priority: u32,
}

impl BranchEniRoute {
    /// The rules for `pod`: forward (`to <pod> pref 512 lookup <table>`), then return
    /// (`iif <veth> pref <iif_priority − 1, at least 0> lookup local`).
    pub fn rules(&self, pod: IpAddr) -> [PolicyRule; 2] {
        let full = if pod.is_ipv4() { 32 } else { 128 };
        [
            PolicyRule { priority: TO_POD_PRIORITY, table: self.table, iif: None, to: Some((pod, full)) },
            PolicyRule {
                priority: self.iif_priority.saturating_sub(1),
                table: LOCAL_TABLE,
                iif: Some(self.veth.clone()),
                to: None,
            },
        ]
    }
}

/// A route to one address, with the name of the device it leaves by (`None`: no
/// single device, or one that could not be named).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedHostRoute {
    pub table: u32,
    pub destination: IpAddr,
    pub device: Option<String>,
}

/// Whether `table` can be aws-vpc-cni's per-pod table (not unspecified, main or local).
fn pod_table(table: u32) -> bool {
    !matches!(table, 0 | MAIN_TABLE | LOCAL_TABLE)
}

/// `pod`'s branch-ENI routing, if `rules` and `routes` (the node's, of the pod's
/// family) say it has one: an `iif <dev> lookup <table>` rule (not main or local) whose
/// table holds a route to `pod` alone via `dev`. The first such rule in `rules`' order
/// (the kernel's: by priority) wins. A regular veth pod has `to` rules only, and its
/// route in main: `None`.
pub fn detect(pod: IpAddr, rules: &[PolicyRule], routes: &[NamedHostRoute]) -> Option<BranchEniRoute> {
    rules.iter().find_map(|rule| {
        let dev = rule.iif.as_deref()?;
        let via_dev = routes
            .iter()
            .any(|r| r.table == rule.table && r.destination == pod && r.device.as_deref() == Some(dev));
        (pod_table(rule.table) && via_dev).then(|| BranchEniRoute {
            table: rule.table,
            veth: dev.to_string(),
            iif_priority: rule.priority,
        })
    })
}

fn family(ip: IpAddr) -> Family {
    if ip.is_ipv4() { Family::V4 } else { Family::V6 }
}

/// Lists the node's rules and, when some `iif` rule could be aws-vpc-cni's, its host
/// routes to `pod` in those tables; then [`detect`].
async fn look_up(nl: &Netlink, pod: IpAddr) -> Result<Option<BranchEniRoute>, NetlinkError> {
    let family = family(pod);
    let rules = nl.policy_rules(family).await?;
    let tables: BTreeSet<u32> =
        rules.iter().filter(|r| r.iif.is_some() && pod_table(r.table)).map(|r| r.table).collect();
    if tables.is_empty() {
        return Ok(None);
    }
    let mut routes = Vec::new();
    for route in nl.host_routes(family).await? {
        if route.destination != pod || !tables.contains(&route.table) {
            continue;
        }
        let device = match route.oif {
            Some(index) => match nl.link_name(index).await {
                Ok(name) => Some(name),
                Err(e) => {
                    tracing::debug!(%pod, table = route.table, index, error = %e, "a route's device has no name: skipped");
                    None
                }
            },
            None => None,
        };
        routes.push(NamedHostRoute { table: route.table, destination: pod, device });
    }
    Ok(detect(pod, &rules, &routes))
}

/// Adds both rules; a forward rule this call added is taken out again if the return
/// rule cannot be added.
async fn add_rules(nl: &Netlink, pod: IpAddr, route: &BranchEniRoute) -> Result<(), NetlinkError> {
    let family = family(pod);
    let [forward, back] = route.rules(pod);
    let added = nl.ensure_policy_rule(family, &forward).await?;
    if let Err(e) = nl.ensure_policy_rule(family, &back).await {
        if added && let Err(undo) = nl.delete_policy_rule(family, &forward).await {
            tracing::warn!(%pod, rule = %forward, error = %crate::error_chain(&undo), "branch-ENI forward rule left behind");
        }
        return Err(e);
    }
    Ok(())
}

/// Removes both rules (each tried); the first error.
async fn delete_rules(nl: &Netlink, pod: IpAddr, route: &BranchEniRoute) -> Result<(), NetlinkError> {
    let family = family(pod);
    let mut first = Ok(());
    for rule in route.rules(pod) {
        if let Err(e) = nl.delete_policy_rule(family, &rule).await {
            first = first.and(Err(e));
        }
    }
    first
}

/// One netlink conversation on a small runtime of its own, on this (blocking) thread,
/// in its network namespace.
fn netlink<T, F>(f: impl FnOnce(Netlink) -> F) -> Result<T, BranchEniError>
where
    F: std::future::Future<Output = Result<T, NetlinkError>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(BranchEniError::Runtime)?;
    Ok(runtime.block_on(async { f(Netlink::open()?).await })?)
}

/// The rules this process added, by pod address (Istio's `branchENIRules`).
/// Process-wide: the chart's clean-up at stop runs after the dataplane is gone.
static ADDED: Mutex<BTreeMap<IpAddr, BranchEniRoute>> = Mutex::new(BTreeMap::new());

fn added() -> std::sync::MutexGuard<'static, BTreeMap<IpAddr, BranchEniRoute>> {
    ADDED.lock().unwrap_or_else(|p| p.into_inner())
}

/// `pod` joined the probe set: its branch-ENI rules added if it is one. Rules added
/// before for this address and another routing (the address moved) are removed first.
/// Failures are logged: the address is in the probe set either way.
fn follow_in(pod: IpAddr) {
    let mut added = added();
    let found = match netlink(|nl| async move { look_up(&nl, pod).await }) {
        Ok(found) => found,
        Err(e) => {
            tracing::warn!(%pod, error = %crate::error_chain(&e), "cannot tell whether the pod is an AWS branch-ENI pod");
            return;
        }
    };
    let stale = added.get(&pod).filter(|old| found.as_ref() != Some(*old)).cloned();
    if let Some(old) = stale {
        added.remove(&pod);
        match netlink(|nl| async move { delete_rules(&nl, pod, &old).await }) {
            Ok(()) => tracing::info!(%pod, "branch-ENI rules of the address's previous routing removed"),
            Err(e) => {
                tracing::warn!(%pod, error = %crate::error_chain(&e), "branch-ENI rules of the address's previous routing not removed")
            }
        }
    }
    let Some(route) = found else { return };
    let adding = route.clone();
    match netlink(|nl| async move { add_rules(&nl, pod, &adding).await }) {
        Ok(()) if added.get(&pod) == Some(&route) => {
            tracing::debug!(%pod, table = route.table, veth = %route.veth, "AWS branch-ENI pod: probe rules in place");
        }
        Ok(()) => {
            tracing::info!(%pod, table = route.table, veth = %route.veth, iif_priority = route.iif_priority, "AWS branch-ENI pod: probe rules added");
            added.insert(pod, route);
        }
        Err(e) => {
            tracing::error!(%pod, table = route.table, veth = %route.veth, error = %crate::error_chain(&e), "AWS branch-ENI pod: probe rules not added; kubelet's probes to it will fail")
        }
    }
}

/// `pod` left the probe set: the rules added for it removed (from what was added).
fn follow_out(pod: IpAddr) {
    let mut added = added();
    let Some(route) = added.remove(&pod) else { return };
    match netlink(|nl| async move { delete_rules(&nl, pod, &route).await }) {
        Ok(()) => tracing::info!(%pod, "AWS branch-ENI pod: probe rules removed"),
        Err(e) => {
            tracing::warn!(%pod, error = %crate::error_chain(&e), "AWS branch-ENI pod: probe rules not removed")
        }
    }
}

/// Removes every rule this process added (a clean-up stop; blocking, in the node's
/// namespace).
pub fn flush() {
    let all = std::mem::take(&mut *added());
    if all.is_empty() {
        return;
    }
    let count = all.len();
    match netlink(|nl| async move {
        let mut first = Ok(());
        for (pod, route) in &all {
            first = first.and(delete_rules(&nl, *pod, route).await);
        }
        first
    }) {
        Ok(()) => tracing::info!(pods = count, "AWS branch-ENI probe rules removed"),
        Err(e) => {
            tracing::error!(pods = count, error = %crate::error_chain(&e), "AWS branch-ENI probe rules not all removed")
        }
    }
}

/// Whether the node's `net.ipv4.tcp_early_demux` is 0 (under `host_proc`); unreadable
/// counts as the kernel's default, 1.
pub fn tcp_early_demux_disabled(host_proc: &Path) -> bool {
    let path = host_proc.join("sys/net/ipv4/tcp_early_demux");
    match std::fs::read(&path) {
        Ok(v) => v.first() == Some(&b'0'),
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "tcp_early_demux unreadable: taken as 1");
            false
        }
    }
}

/// The node's probe sets, with branch-ENI rules following each address in and out
/// (when `AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE` and `tcp_early_demux=0`).
pub struct BranchEniProbes<P> {
    sets: P,
    active: bool,
}

impl<P: HostProbeSet> BranchEniProbes<P> {
    /// `sets`, with the rules when the settings and the node call for them (read now).
    pub fn new(sets: P, settings: &AmbientSettings) -> Self {
        let active = settings.aws_branch_eni_probe && tcp_early_demux_disabled(&settings.host_proc);
        if active {
            tracing::info!(
                host_proc = %settings.host_proc.display(),
                "net.ipv4.tcp_early_demux=0: AWS branch-ENI pods get host rules for kubelet's probes"
            );
        } else {
            tracing::debug!(
                enabled = settings.aws_branch_eni_probe,
                "AWS branch-ENI probe rules off (AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE, or tcp_early_demux is not 0)"
            );
        }
        Self { sets, active }
    }

    pub fn active(&self) -> bool {
        self.active
    }
}

impl<P: HostProbeSet> HostProbeSet for BranchEniProbes<P> {
    fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), ProbeSetError> {
        let result = self.sets.upsert(ip, uid);
        if self.active {
            follow_in(ip);
        }
        result
    }

    fn remove(&self, ip: IpAddr, uid: &str) -> Result<Option<String>, ProbeSetError> {
        let holder = self.sets.remove(ip, uid)?;
        if holder.is_none() {
            follow_out(ip);
        }
        Ok(holder)
    }

    fn prune(&self, keep: &BTreeSet<IpAddr>) -> Result<Vec<IpAddr>, ProbeSetError> {
        let pruned = self.sets.prune(keep)?;
        for ip in &pruned {
            follow_out(*ip);
        }
        Ok(pruned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 1, 7));

    fn iif(dev: &str, table: u32, priority: u32) -> PolicyRule {
        PolicyRule { priority, table, iif: Some(dev.into()), to: None }
    }

    fn route(table: u32, to: IpAddr, dev: &str) -> NamedHostRoute {
        NamedHostRoute { table, destination: to, device: Some(dev.into()) }
    }

    /// aws-vpc-cni's rules on an SGP node: the local and main rules, a regular veth
    /// pod's `to` rule, and the branch-ENI pod's `iif` rule.
    fn node_rules() -> Vec<PolicyRule> {
        vec![
            PolicyRule { priority: 0, table: LOCAL_TABLE, iif: None, to: None },
            iif("vlan.eth.1", 101, 10),
            PolicyRule {
                priority: 512,
                table: MAIN_TABLE,
                iif: None,
                to: Some(("10.0.1.9".parse().unwrap(), 32)),
            },
            PolicyRule { priority: 32766, table: MAIN_TABLE, iif: None, to: None },
        ]
    }

    #[test]
    fn a_pod_routed_in_an_iif_rules_table_via_that_rules_device_is_a_branch_eni_pod() {
        let routes = [route(101, POD, "vlan.eth.1"), route(MAIN_TABLE, "10.0.1.9".parse().unwrap(), "eni1")];
        let found = detect(POD, &node_rules(), &routes);
        let want = BranchEniRoute { table: 101, veth: "vlan.eth.1".into(), iif_priority: 10 };
        assert_eq!(found, Some(want.clone()));
        let [forward, back] = want.rules(POD);
        assert_eq!(forward.to_string(), "to 10.0.1.7/32 pref 512 lookup 101");
        assert_eq!(back.to_string(), "iif vlan.eth.1 pref 9 lookup 255");
        let v6: IpAddr = "2600:1f14::7".parse().unwrap();
        let found = detect(v6, &[iif("vlan.eth.2", 102, 0)], &[route(102, v6, "vlan.eth.2")]).unwrap();
        let [forward, back] = found.rules(v6);
        assert_eq!((forward.to, back.priority), (Some((v6, 128)), 0), "priority 0 stays 0");
    }

    #[test]
    fn a_regular_pod_or_a_route_through_another_device_or_table_is_not_a_branch_eni_pod() {
        // A regular veth pod: its route is in main, no iif rule looks it up.
        assert_eq!(detect(POD, &node_rules(), &[route(MAIN_TABLE, POD, "eni1")]), None);
        // The iif rule's table routes the pod, but through another device.
        assert_eq!(detect(POD, &node_rules(), &[route(101, POD, "vlan.eth.2")]), None);
        // The route names the device, but in a table no iif rule of that device reads.
        assert_eq!(detect(POD, &node_rules(), &[route(102, POD, "vlan.eth.1")]), None);
        // Another pod's route.
        assert_eq!(
            detect(POD, &node_rules(), &[route(101, "10.0.1.8".parse().unwrap(), "vlan.eth.1")]),
            None
        );
        // An iif rule into main or local is never aws-vpc-cni's per-pod table.
        for table in [MAIN_TABLE, LOCAL_TABLE] {
            assert_eq!(
                detect(POD, &[iif("vlan.eth.1", table, 10)], &[route(table, POD, "vlan.eth.1")]),
                None
            );
        }
        // A route without a single device.
        let unnamed = NamedHostRoute { table: 101, destination: POD, device: None };
        assert_eq!(detect(POD, &node_rules(), &[unnamed]), None);
    }
}
