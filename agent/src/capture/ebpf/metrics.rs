//! Capture decisions as Prometheus metrics: every pinned capture's per-pod counters
//! (what the programs decided for each of the pod's connections, outbound and inbound,
//! and sk_msg's bytes)
//! read from the pinned maps at scrape time, as `weir_capture_decisions_total{pod,
//! decision}` and `weir_capture_skmsg_bytes_total{pod}`. Istio has no metric for this
//! (its capture is netfilter rules with packet counters), hence Weir's own names.
//! Pods are labelled with their Kubernetes `namespace/name` where the capture knows it
//! (CNI mode), else the capture's name.
//!
//! Also how full each program set's node-wide maps are
//! (`weir_capture_map_entries{program_set,map}` against `weir_capture_map_capacity`),
//! and a warning in the log when one passes [`WARN_PERCENT`].

use std::collections::BTreeMap;

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::{
    EbpfError,
    capture::{Counters, MapSet},
    pod,
    record::PinRecord,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Decision {
    pod: String,
    decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodLabel {
    pod: String,
}

/// The counter that is a byte count rather than a decision.
const BYTES: &str = "skmsg_bytes";

/// Each registered pod's counters, by its capture's name: every pin record with a
/// registered namespace, read from the maps its capture uses (a node set's maps are
/// opened once for all its pods), its inbound classifier's decisions after its outbound
/// ones. Pods whose maps cannot be read are returned as errors next to the others.
pub fn pod_counters() -> Vec<(String, Result<Counters, EbpfError>)> {
    let mut maps: BTreeMap<std::path::PathBuf, Result<MapSet, String>> = BTreeMap::new();
    let mut out = Vec::new();
    for record in PinRecord::load_all().into_iter().filter(|r| r.netns_cookie != 0) {
        let dir = pod::maps_dir(&record);
        let set =
            maps.entry(dir).or_insert_with(|| pod::maps_of(&record).map_err(|e| crate::error_chain(&e)));
        let counters = match set {
            Ok(set) => set.pod_counters(record.netns_cookie).and_then(|c| {
                c.ok_or(EbpfError::NotRegistered { pod: record.pod.clone(), cookie: record.netns_cookie })
            }),
            Err(e) => Err(EbpfError::MapsUnreadable { pod: record.pod.clone(), reason: e.clone() }),
        };
        let inbound =
            super::inbound::pod_counters(&pod::maps_dir(&record), &record.pin_dir(), record.netns_cookie);
        let counters = match (counters, inbound) {
            (Ok(mut c), Some(Ok(i))) => {
                c.0.extend(i.0);
                Ok(c)
            }
            (Ok(_), Some(Err(e))) => Err(e),
            (c, _) => c,
        };
        out.push((record.display_name().to_string(), counters));
    }
    out
}

/// A map's fill level: entries against capacity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapFill {
    pub program_set: String,
    pub map: String,
    pub entries: u32,
    pub capacity: u32,
}

/// Share of a map's capacity past which the node agent warns.
pub const WARN_PERCENT: u64 = 80;

/// How full every pinned program set's maps are (arrays, always full, left out).
pub fn map_fill() -> Vec<MapFill> {
    use std::os::fd::AsFd as _;
    let mut out = Vec::new();
    for key in super::set::pinned_keys() {
        let Ok(maps) = std::fs::read_dir(super::set::set_dir(&key).join("maps")) else { continue };
        for entry in maps.flatten() {
            let Ok(fd) = super::sys::obj_get(&entry.path()) else { continue };
            let Ok(info) = super::sys::map_info(fd.as_fd()) else { continue };
            if matches!(info.map_type, super::sys::map_type::ARRAY | super::sys::map_type::PERCPU_ARRAY) {
                continue;
            }
            let Ok(keys) = super::sys::keys_raw(fd.as_fd(), info.key_size) else { continue };
            out.push(MapFill {
                program_set: key.clone(),
                map: entry.file_name().to_string_lossy().into_owned(),
                entries: keys.len() as u32,
                capacity: info.max_entries,
            });
        }
    }
    out
}

/// Logs a warning for every map past [`WARN_PERCENT`] of its capacity.
pub fn warn_on_full_maps() {
    for fill in map_fill() {
        if u64::from(fill.entries) * 100 >= u64::from(fill.capacity) * WARN_PERCENT {
            tracing::warn!(
                program_set = %fill.program_set,
                map = %fill.map,
                entries = fill.entries,
                capacity = fill.capacity,
                "an eBPF capture map is nearly full: registrations or connection tracking will fail when it is"
            );
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabel {
    program_set: String,
    map: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeDecision {
    decision: &'static str,
}

/// Which series name pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodLabels {
    /// Each pod's own series, labelled `pod="<namespace>/<name>"`.
    Named,
    /// The node's totals only: no pod is named (the node agent's default; its port is
    /// reachable by anything that reaches the node).
    NodeTotals,
}

/// Prometheus text for `pods`, and how many captured pods could not be read
/// (`unreadable`: they are left out of the per-pod series).
pub fn exposition(pods: &[(String, Counters)], unreadable: usize, fills: &[MapFill]) -> String {
    exposition_with(pods, unreadable, fills, PodLabels::Named)
}

/// [`exposition`], with pods named or only the node's totals (`labels`).
pub fn exposition_with(
    pods: &[(String, Counters)],
    unreadable: usize,
    fills: &[MapFill],
    labels: PodLabels,
) -> String {
    if labels == PodLabels::NodeTotals {
        return node_totals(pods, unreadable, fills);
    }
    let mut registry = counts_registry(pods.len(), unreadable);
    let decisions = Family::<Decision, Counter>::default();
    let bytes = Family::<PodLabel, Counter>::default();
    for (pod, counters) in pods {
        for (name, value) in &counters.0 {
            if *name == BYTES {
                bytes.get_or_create(&PodLabel { pod: pod.clone() }).inc_by(*value);
            } else {
                decisions.get_or_create(&Decision { pod: pod.clone(), decision: name }).inc_by(*value);
            }
        }
    }
    registry.register(
        "decisions",
        "Connections and events by what Weir's eBPF capture decided for them (redirected, bypass_<reason>, ...), per pod",
        decisions,
    );
    registry.register("skmsg_bytes", "Bytes sk_msg passed directly between local sockets, per pod", bytes);
    register_fills(&mut registry, fills);
    let mut out = String::new();
    let _ = encode(&mut out, &registry);
    out
}

/// A registry with how many pods are reported and how many could not be read.
fn counts_registry(pods: usize, unreadable: usize) -> Registry {
    let mut registry = Registry::with_prefix("weir_capture");
    let (count, failed) = (Gauge::<i64>::default(), Gauge::<i64>::default());
    count.set(pods as i64);
    failed.set(unreadable as i64);
    registry.register("pods", "Pods whose eBPF capture decisions are reported here", count);
    registry.register(
        "unreadable_pods",
        "Captured pods whose counters could not be read (see the node agent's log)",
        failed,
    );
    registry
}

fn register_fills(registry: &mut Registry, fills: &[MapFill]) {
    let (entries, capacity) =
        (Family::<MapLabel, Gauge<i64>>::default(), Family::<MapLabel, Gauge<i64>>::default());
    for fill in fills {
        let label = MapLabel { program_set: fill.program_set.clone(), map: fill.map.clone() };
        entries.get_or_create(&label).set(i64::from(fill.entries));
        capacity.get_or_create(&label).set(i64::from(fill.capacity));
    }
    registry.register("map_entries", "Entries in each node-wide eBPF capture map", entries);
    registry.register("map_capacity", "Capacity of each node-wide eBPF capture map", capacity);
}

/// The series of [`exposition`] summed over the node's pods, no pod named.
fn node_totals(pods: &[(String, Counters)], unreadable: usize, fills: &[MapFill]) -> String {
    let mut registry = counts_registry(pods.len(), unreadable);
    let decisions = Family::<NodeDecision, Counter>::default();
    let bytes = Counter::<u64>::default();
    for (_, counters) in pods {
        for (name, value) in &counters.0 {
            if *name == BYTES {
                bytes.inc_by(*value);
            } else {
                decisions.get_or_create(&NodeDecision { decision: name }).inc_by(*value);
            }
        }
    }
    registry.register(
        "decisions",
        "Connections and events by what Weir's eBPF capture decided for them (redirected, bypass_<reason>, ...), summed over the node's pods",
        decisions,
    );
    registry.register(
        "skmsg_bytes",
        "Bytes sk_msg passed directly between local sockets, the node's pods together",
        bytes,
    );
    register_fills(&mut registry, fills);
    let mut out = String::new();
    let _ = encode(&mut out, &registry);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_become_labelled_series() {
        let mut c = Counters(weir_ebpf_common::capture::counter::NAMES.iter().map(|n| (*n, 0)).collect());
        c.0[0].1 = 5;
        c.0.iter_mut().find(|(n, _)| *n == "skmsg_bytes").unwrap().1 = 4096;
        c.0.iter_mut().find(|(n, _)| *n == "bypass_proxy").unwrap().1 = 2;
        let fill = MapFill { program_set: "k".into(), map: "POD_CONFIG".into(), entries: 3, capacity: 4096 };
        let text = exposition(&[("web-1".into(), c)], 1, &[fill]);
        assert!(
            text.contains("weir_capture_map_entries{program_set=\"k\",map=\"POD_CONFIG\"} 3")
                && text.contains("weir_capture_map_capacity{program_set=\"k\",map=\"POD_CONFIG\"} 4096"),
            "{text}"
        );
        assert!(
            text.contains("weir_capture_pods 1") && text.contains("weir_capture_unreadable_pods 1"),
            "{text}"
        );
        assert!(
            text.contains("weir_capture_decisions_total{pod=\"web-1\",decision=\"redirected\"} 5"),
            "{text}"
        );
        assert!(
            text.contains("weir_capture_decisions_total{pod=\"web-1\",decision=\"bypass_proxy\"} 2"),
            "{text}"
        );
        assert!(text.contains("weir_capture_skmsg_bytes_total{pod=\"web-1\"} 4096"), "{text}");
        assert!(!text.contains("decision=\"skmsg_bytes\""), "{text}");
        assert!(text.contains("# TYPE weir_capture_decisions counter"), "{text}");
    }

    /// The node agent's default: the node's totals, no pod named (before, every pod's
    /// `namespace/name` and its bypass counters were on a port any node address reaches).
    #[test]
    fn node_totals_name_no_pod() {
        let one = |redirected| {
            let mut c = Counters(weir_ebpf_common::capture::counter::NAMES.iter().map(|n| (*n, 0)).collect());
            c.0.iter_mut().find(|(n, _)| *n == "redirected").unwrap().1 = redirected;
            c
        };
        let pods = [("shop/web-1".to_string(), one(5)), ("shop/web-2".to_string(), one(2))];
        let text = exposition_with(&pods, 0, &[], PodLabels::NodeTotals);
        assert!(text.contains("weir_capture_decisions_total{decision=\"redirected\"} 7"), "{text}");
        assert!(!text.contains("web-1") && !text.contains("pod="), "{text}");
        assert!(text.contains("weir_capture_pods 2"), "{text}");
    }
}
