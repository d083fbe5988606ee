//! The Kubernetes objects the ambient node agent reads, as it reads them: a Pod's
//! identity, labels, annotations, service account, host-network flag, phase and
//! addresses (`status.podIPs`, else `status.podIP`), and a Namespace's labels. Istio's
//! rules about them live here too: the redirection annotation's states, terminal
//! phases, ztunnel's own pods. Pure.

use std::{collections::BTreeMap, net::IpAddr};

use serde::Deserialize;

use crate::node::enroll::selector::PodFacts;

/// The annotation the agent writes on an ambient pod (`pods/status` merge patch).
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";
/// Captured: rules in place and ztunnel acked.
pub const REDIRECTION_ENABLED: &str = "enabled";
/// Rules in place, ztunnel has not acked yet: must be undone on removal.
pub const REDIRECTION_PENDING: &str = "pending";

/// The parts of a Pod the ambient agent uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AmbientPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub service_account: String,
    pub node_name: String,
    pub host_network: bool,
    /// `status.phase`.
    pub phase: String,
    /// `status.podIPs` (or `status.podIP`), unmapped.
    pub ips: Vec<IpAddr>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
}

/// The parts of a Namespace the ambient agent uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AmbientNamespace {
    pub name: String,
    pub resource_version: String,
    pub labels: BTreeMap<String, String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Meta {
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    uid: String,
    #[serde(default)]
    resource_version: String,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
    #[serde(default)]
    deletion_timestamp: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct PodSpec {
    #[serde(default)]
    service_account_name: String,
    #[serde(default)]
    node_name: String,
    #[serde(default)]
    host_network: bool,
}

#[derive(Deserialize)]
struct PodIp {
    ip: String,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct PodStatus {
    #[serde(default)]
    phase: String,
    #[serde(rename = "podIP", default)]
    pod_ip: String,
    #[serde(rename = "podIPs", default)]
    pod_ips: Option<Vec<PodIp>>,
}

#[derive(Deserialize)]
struct RawPod {
    #[serde(default)]
    metadata: Meta,
    #[serde(default)]
    spec: PodSpec,
    #[serde(default)]
    status: PodStatus,
}

#[derive(Deserialize)]
struct RawNamespace {
    #[serde(default)]
    metadata: Meta,
}

pub use crate::node::enroll::event::unmapped;

impl AmbientPod {
    /// From a `v1/Pod` JSON value.
    pub fn from_value(value: serde_json::Value) -> Result<Self, serde_json::Error> {
        let raw: RawPod = serde_json::from_value(value)?;
        let listed = raw.status.pod_ips.unwrap_or_default();
        let texts: Vec<&str> = if listed.is_empty() {
            Some(raw.status.pod_ip.as_str()).filter(|s| !s.is_empty()).into_iter().collect()
        } else {
            listed.iter().map(|p| p.ip.as_str()).collect()
        };
        Ok(Self {
            namespace: raw.metadata.namespace,
            name: raw.metadata.name,
            uid: raw.metadata.uid,
            resource_version: raw.metadata.resource_version,
            labels: raw.metadata.labels.unwrap_or_default(),
            annotations: raw.metadata.annotations.unwrap_or_default(),
            service_account: raw.spec.service_account_name,
            node_name: raw.spec.node_name,
            host_network: raw.spec.host_network,
            phase: raw.status.phase,
            ips: texts.iter().filter_map(|t| t.parse().ok()).map(unmapped).collect(),
            deleting: raw.metadata.deletion_timestamp.is_some(),
        })
    }

    /// `namespace/name`, as logs name a pod.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    pub fn facts(&self) -> PodFacts<'_> {
        PodFacts { labels: &self.labels, annotations: &self.annotations, host_network: self.host_network }
    }

    /// The service account ztunnel ties the pod's identity to (`default` when unset,
    /// as the API server fills it).
    pub fn service_account(&self) -> &str {
        if self.service_account.is_empty() { "default" } else { &self.service_account }
    }

    fn redirection(&self) -> Option<&str> {
        self.annotations.get(REDIRECTION_ANNOTATION).map(String::as_str)
    }

    /// Annotated `enabled`: fully captured.
    pub fn fully_enrolled(&self) -> bool {
        self.redirection() == Some(REDIRECTION_ENABLED)
    }

    /// Annotated `pending`: rules applied, ztunnel not (yet) acked.
    pub fn partially_enrolled(&self) -> bool {
        self.redirection() == Some(REDIRECTION_PENDING)
    }

    /// Succeeded or Failed: its sandbox is gone or going.
    pub fn terminal(&self) -> bool {
        matches!(self.phase.as_str(), "Succeeded" | "Failed")
    }

    /// A ztunnel pod (`app=ztunnel` in the system namespace): never enrolled.
    pub fn is_ztunnel(&self, system_namespace: &str) -> bool {
        self.namespace == system_namespace && self.labels.get("app").map(String::as_str) == Some("ztunnel")
    }
}

impl AmbientNamespace {
    pub fn from_value(value: serde_json::Value) -> Result<Self, serde_json::Error> {
        let raw: RawNamespace = serde_json::from_value(value)?;
        Ok(Self {
            name: raw.metadata.name,
            resource_version: raw.metadata.resource_version,
            labels: raw.metadata.labels.unwrap_or_default(),
        })
    }
}

/// The merge patch that sets (or, with `None`, removes) the redirection annotation.
pub fn redirection_patch(value: Option<&str>) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {REDIRECTION_ANNOTATION: value}}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_read_their_addresses_phase_and_enrollment() {
        let pod = AmbientPod::from_value(serde_json::json!({
            "metadata": {"name": "web-0", "namespace": "shop", "uid": "u-1", "resourceVersion": "42",
                         "labels": {"app": "web"}, "annotations": {REDIRECTION_ANNOTATION: "pending"},
                         "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"serviceAccountName": "web", "nodeName": "n1"},
            "status": {"phase": "Running", "podIP": "10.0.0.9",
                       "podIPs": [{"ip": "10.0.0.9"}, {"ip": "fd00::9"}, {"ip": "::ffff:10.0.0.10"}]}
        }))
        .unwrap();
        assert_eq!(pod.key(), "shop/web-0");
        assert_eq!(pod.ips, ["10.0.0.9", "fd00::9", "10.0.0.10"].map(|s| s.parse::<IpAddr>().unwrap()));
        assert!(pod.partially_enrolled() && !pod.fully_enrolled() && pod.deleting && !pod.terminal());
        let bare = AmbientPod::from_value(serde_json::json!({
            "metadata": {"name": "a", "namespace": "istio-system", "labels": {"app": "ztunnel"}},
            "status": {"podIP": "10.0.0.1", "phase": "Failed"}
        }))
        .unwrap();
        assert_eq!(bare.ips, ["10.0.0.1".parse::<IpAddr>().unwrap()]);
        assert_eq!(bare.service_account(), "default");
        assert!(bare.terminal() && bare.is_ztunnel("istio-system") && !bare.is_ztunnel("kube-system"));
    }

    #[test]
    fn the_patches_are_istios() {
        assert_eq!(
            redirection_patch(Some(REDIRECTION_ENABLED)).to_string(),
            r#"{"metadata":{"annotations":{"ambient.istio.io/redirection":"enabled"}}}"#
        );
        assert_eq!(
            redirection_patch(None).to_string(),
            r#"{"metadata":{"annotations":{"ambient.istio.io/redirection":null}}}"#
        );
    }
}
