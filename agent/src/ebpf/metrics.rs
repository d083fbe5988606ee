//! Capture decisions as Prometheus metrics: every pinned capture's per-pod counters
//! (what the programs decided for each of the pod's connections, outbound and inbound,
//! and sk_msg's bytes)
//! read from the pinned maps at scrape time, as `weir_capture_decisions_total{pod,
//! decision}` and `weir_capture_skmsg_bytes_total{pod}`. Istio has no metric for this
//! (its capture is netfilter rules with packet counters), hence Weir's own names.

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
        out.push((record.pod, counters));
    }
    out
}

/// Prometheus text for `pods`, and how many captured pods could not be read
/// (`unreadable`: they are left out of the per-pod series).
pub fn exposition(pods: &[(String, Counters)], unreadable: usize) -> String {
    let mut registry = Registry::with_prefix("weir_capture");
    let (count, failed) = (Gauge::<i64>::default(), Gauge::<i64>::default());
    count.set(pods.len() as i64);
    failed.set(unreadable as i64);
    registry.register("pods", "Pods whose eBPF capture decisions are reported here", count);
    registry.register(
        "unreadable_pods",
        "Captured pods whose counters could not be read (see the node agent's log)",
        failed,
    );
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
        let text = exposition(&[("web-1".into(), c)], 1);
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
}
