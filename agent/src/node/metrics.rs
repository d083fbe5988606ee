//! The node agent's own metrics under istio-cni's names, so that the dashboards and
//! alerts a platform team runs for istio-cni keep working when Weir takes its place:
//! - `istio_cni_installs_total{result}`: install passes that changed something
//!   (`SUCCESS`) or failed (`COPY_BINARIES_FAILURE`, `CREATE_KUBECONFIG_FAILURE`,
//!   `CREATE_CNI_CONFIG_FAILURE`), as `cni/pkg/install/monitoring.go`;
//! - `istio_cni_install_ready`: 1 while the plugin is chained into the CNI config;
//! - `istio_cni_repair_pods_repaired_total{type,result}` (`type="repair"`,
//!   `result="success|fail"`), as `cni/pkg/repair/monitoring.go`;
//! - `ztunnel_connected`: ztunnel connections to the ZDS socket;
//! - `nodeagent_reconcile_events_total{type}`: `add`, `update`, `delete` events of pods
//!   and namespaces handled by the ambient agent;
//! - `istio_cni_plugin_requests_total{response_code}`: the plugin's add events, by the
//!   HTTP code they were answered with (Istio 1.31).
//!
//! The values live in one process-wide registry (the agent is one process per node, as
//! Istio's package-level metrics are); [`exposition`] renders it for `/metrics`.

use std::sync::LazyLock;

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

/// Which step of an install pass failed (Istio's `result` label values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstallStep {
    Binary,
    Kubeconfig,
    CniConfig,
}

impl InstallStep {
    fn result(self) -> &'static str {
        match self {
            Self::Binary => "COPY_BINARIES_FAILURE",
            Self::Kubeconfig => "CREATE_KUBECONFIG_FAILURE",
            Self::CniConfig => "CREATE_CNI_CONFIG_FAILURE",
        }
    }
}

/// A pod or namespace event the ambient agent handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReconcileEvent {
    Add,
    Update,
    Delete,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RepairLabels {
    r#type: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TypeLabel {
    r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResponseCode {
    response_code: String,
}

struct NodeMetrics {
    registry: Registry,
    installs: Family<ResultLabel, Counter>,
    install_ready: Gauge,
    repaired: Family<RepairLabels, Counter>,
    ztunnel_connected: Gauge,
    reconcile_events: Family<TypeLabel, Counter>,
    plugin_requests: Family<ResponseCode, Counter>,
}

static METRICS: LazyLock<NodeMetrics> = LazyLock::new(|| {
    let mut registry = Registry::default();
    let m = NodeMetrics {
        registry: Registry::default(),
        installs: Family::default(),
        install_ready: Gauge::default(),
        repaired: Family::default(),
        ztunnel_connected: Gauge::default(),
        reconcile_events: Family::default(),
        plugin_requests: Family::default(),
    };
    registry.register(
        "istio_cni_installs",
        "Total number of CNI plugins installed by the Istio CNI installer",
        m.installs.clone(),
    );
    registry.register(
        "istio_cni_install_ready",
        "Whether the CNI plugin installation is ready or not",
        m.install_ready.clone(),
    );
    registry.register(
        "istio_cni_repair_pods_repaired",
        "Total number of pods repaired by repair controller",
        m.repaired.clone(),
    );
    registry.register("ztunnel_connected", "number of connections to ztunnel", m.ztunnel_connected.clone());
    registry.register(
        "nodeagent_reconcile_events",
        "The total number of node agent reconcile events",
        m.reconcile_events.clone(),
    );
    registry.register(
        "istio_cni_plugin_requests",
        "The total number of CNI plugin requests handled by the node agent",
        m.plugin_requests.clone(),
    );
    NodeMetrics { registry, ..m }
});

/// An install pass that changed the node (`SUCCESS`).
pub fn installed() {
    METRICS.installs.get_or_create(&ResultLabel { result: "SUCCESS" }).inc();
}

/// An install pass that failed at `step`.
pub fn install_failed(step: InstallStep) {
    METRICS.installs.get_or_create(&ResultLabel { result: step.result() }).inc();
}

/// Whether the plugin is chained (`istio_cni_install_ready`).
pub fn install_ready(ready: bool) {
    METRICS.install_ready.set(i64::from(ready));
}

/// A pod the repair pass captured (or failed to).
pub fn repaired(ok: bool) {
    let result = if ok { "success" } else { "fail" };
    METRICS.repaired.get_or_create(&RepairLabels { r#type: "repair", result }).inc();
}

/// The number of ztunnel connections now.
pub fn ztunnel_connected(connections: usize) {
    METRICS.ztunnel_connected.set(i64::try_from(connections).unwrap_or(i64::MAX));
}

/// A pod or namespace event handled by the ambient agent.
pub fn reconcile_event(event: ReconcileEvent) {
    let kind = match event {
        ReconcileEvent::Add => "add",
        ReconcileEvent::Update => "update",
        ReconcileEvent::Delete => "delete",
    };
    METRICS.reconcile_events.get_or_create(&TypeLabel { r#type: kind }).inc();
}

/// A plugin add event answered with HTTP `code`.
pub fn plugin_request(code: u16) {
    METRICS.plugin_requests.get_or_create(&ResponseCode { response_code: code.to_string() }).inc();
}

/// The registry in Prometheus' text format, without OpenMetrics' `# EOF` line (the
/// caller may append other families, then ends the exposition).
pub fn exposition() -> String {
    let mut out = String::new();
    let _ = encode(&mut out, &METRICS.registry);
    strip_eof(out)
}

/// `text` without its trailing `# EOF` line.
pub fn strip_eof(mut text: String) -> String {
    if let Some(at) = text.rfind("# EOF") {
        text.truncate(at);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_istio_name_is_served_with_its_labels() {
        installed();
        install_failed(InstallStep::CniConfig);
        install_ready(true);
        repaired(true);
        ztunnel_connected(2);
        reconcile_event(ReconcileEvent::Update);
        plugin_request(503);
        let text = exposition();
        for line in [
            "istio_cni_installs_total{result=\"SUCCESS\"}",
            "istio_cni_installs_total{result=\"CREATE_CNI_CONFIG_FAILURE\"}",
            "istio_cni_install_ready 1",
            "istio_cni_repair_pods_repaired_total{type=\"repair\",result=\"success\"}",
            "ztunnel_connected 2",
            "nodeagent_reconcile_events_total{type=\"update\"}",
            "istio_cni_plugin_requests_total{response_code=\"503\"}",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
        assert!(!text.contains("# EOF"), "{text}");
    }
}
