//! Which pods are ambient: Istio's enablement selector (`AMBIENT_ENABLEMENT_SELECTOR`, a
//! YAML list of `{podSelector, namespaceSelector}` Kubernetes label selectors) and its
//! matching rule. A pod is enrolled when it is not host-network, carries no
//! `sidecar.istio.io/status` (sidecar pods keep their sidecar), and some entry's pod
//! selector matches its labels while the same entry's namespace selector matches its
//! namespace's labels. An empty selector matches everything; an unset or empty list
//! matches no pod (Istio's binary default). Pure.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The label pods and namespaces use to choose their data plane.
pub const DATAPLANE_MODE_LABEL: &str = "istio.io/dataplane-mode";
/// Its value for ambient.
pub const DATAPLANE_MODE_AMBIENT: &str = "ambient";
/// Its value for "not in the mesh" (the opt-out).
pub const DATAPLANE_MODE_NONE: &str = "none";
/// The injector's mark on a pod with a sidecar.
pub const SIDECAR_STATUS_ANNOTATION: &str = "sidecar.istio.io/status";

/// One `matchExpressions` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requirement {
    pub key: String,
    pub operator: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

/// A Kubernetes `LabelSelector`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<Requirement>,
}

/// One entry of the enablement selector.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnablementSelector {
    #[serde(default)]
    pub pod_selector: LabelSelector,
    #[serde(default)]
    pub namespace_selector: LabelSelector,
}

/// A selector that cannot be used, naming the entry and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    #[error("AMBIENT_ENABLEMENT_SELECTOR is not a YAML list of {{podSelector, namespaceSelector}}: {0}")]
    Parse(String),
    #[error("AMBIENT_ENABLEMENT_SELECTOR entry {entry}: {which} requirement on {key:?}: {message}")]
    Requirement { entry: usize, which: &'static str, key: String, message: String },
}

/// The selector list, checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnablementSelectors(Vec<EnablementSelector>);

impl LabelSelector {
    /// Whether nothing is required (then everything matches).
    pub fn is_empty(&self) -> bool {
        self.match_labels.is_empty() && self.match_expressions.is_empty()
    }

    /// Kubernetes' matching: every label and every expression holds.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| {
                let value = labels.get(&r.key);
                match r.operator.as_str() {
                    "In" => value.is_some_and(|v| r.values.contains(v)),
                    "NotIn" => value.is_none_or(|v| !r.values.contains(v)),
                    "Exists" => value.is_some(),
                    "DoesNotExist" => value.is_none(),
                    _ => false,
                }
            })
    }

    /// Kubernetes' validation of the expressions (`LabelSelectorAsSelector`).
    fn check(&self, entry: usize, which: &'static str) -> Result<(), SelectorError> {
        for r in &self.match_expressions {
            let fail = |message: &str| SelectorError::Requirement {
                entry,
                which,
                key: r.key.clone(),
                message: message.into(),
            };
            match r.operator.as_str() {
                "In" | "NotIn" if r.values.is_empty() => return Err(fail("In and NotIn need values")),
                "Exists" | "DoesNotExist" if !r.values.is_empty() => {
                    return Err(fail("Exists and DoesNotExist take no values"));
                }
                "In" | "NotIn" | "Exists" | "DoesNotExist" => {}
                other => {
                    return Err(fail(&format!(
                        "operator {other:?}: expected In, NotIn, Exists or DoesNotExist"
                    )));
                }
            }
            if r.key.is_empty() {
                return Err(fail("the key is empty"));
            }
        }
        Ok(())
    }
}

impl EnablementSelectors {
    /// Checks a list (from the plugin's config, or parsed).
    pub fn new(list: Vec<EnablementSelector>) -> Result<Self, SelectorError> {
        for (i, s) in list.iter().enumerate() {
            s.pod_selector.check(i, "podSelector")?;
            s.namespace_selector.check(i, "namespaceSelector")?;
        }
        Ok(Self(list))
    }

    /// `AMBIENT_ENABLEMENT_SELECTOR` as Istio reads it: YAML (or JSON); empty is the
    /// empty list, which matches no pod.
    pub fn parse(yaml: &str) -> Result<Self, SelectorError> {
        if yaml.trim().is_empty() {
            return Ok(Self::default());
        }
        let list: Option<Vec<EnablementSelector>> =
            serde_yaml_ng::from_str(yaml).map_err(|e| SelectorError::Parse(e.to_string()))?;
        Self::new(list.unwrap_or_default())
    }

    /// The Helm chart's default: pods labelled ambient anywhere, and every pod of a
    /// namespace labelled ambient unless the pod is labelled `none`.
    pub fn istio_default() -> Self {
        let ambient: BTreeMap<String, String> =
            [(DATAPLANE_MODE_LABEL.to_string(), DATAPLANE_MODE_AMBIENT.to_string())].into();
        Self(vec![
            EnablementSelector {
                pod_selector: LabelSelector { match_labels: ambient.clone(), ..Default::default() },
                namespace_selector: LabelSelector::default(),
            },
            EnablementSelector {
                pod_selector: LabelSelector {
                    match_expressions: vec![Requirement {
                        key: DATAPLANE_MODE_LABEL.into(),
                        operator: "NotIn".into(),
                        values: vec![DATAPLANE_MODE_NONE.into()],
                    }],
                    ..Default::default()
                },
                namespace_selector: LabelSelector { match_labels: ambient, ..Default::default() },
            },
        ])
    }

    pub fn entries(&self) -> &[EnablementSelector] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Istio's `Matches`: whether a pod should be ambient.
    pub fn matches(&self, pod: &PodFacts<'_>, namespace_labels: &BTreeMap<String, String>) -> bool {
        if pod.host_network || pod.annotations.contains_key(SIDECAR_STATUS_ANNOTATION) {
            return false;
        }
        self.0
            .iter()
            .any(|s| s.pod_selector.matches(pod.labels) && s.namespace_selector.matches(namespace_labels))
    }

    /// Istio's `MatchesNamespace`: some non-empty namespace selector matches (decides
    /// whether a namespace's label change re-examines its pods).
    pub fn matches_namespace(&self, namespace_labels: &BTreeMap<String, String>) -> bool {
        self.0
            .iter()
            .any(|s| !s.namespace_selector.is_empty() && s.namespace_selector.matches(namespace_labels))
    }
}

/// What matching reads of a pod.
#[derive(Debug, Clone, Copy)]
pub struct PodFacts<'a> {
    pub labels: &'a BTreeMap<String, String>,
    pub annotations: &'a BTreeMap<String, String>,
    pub host_network: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// The chart's value, as the configmap renders it.
    const CHART: &str = r#"
- podSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
- podSelector:
    matchExpressions:
      - { key: istio.io/dataplane-mode, operator: NotIn, values: [none] }
  namespaceSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
"#;

    #[test]
    fn the_charts_selector_is_istios_default() {
        assert_eq!(EnablementSelectors::parse(CHART).unwrap(), EnablementSelectors::istio_default());
    }

    #[test]
    fn pods_are_ambient_by_label_or_namespace_with_the_none_opt_out() {
        let s = EnablementSelectors::istio_default();
        let none = BTreeMap::new();
        let ambient_ns = map(&[(DATAPLANE_MODE_LABEL, "ambient")]);
        let check = |labels: &[(&str, &str)],
                     annotations: &[(&str, &str)],
                     host: bool,
                     ns: &BTreeMap<String, String>| {
            let (l, a) = (map(labels), map(annotations));
            s.matches(&PodFacts { labels: &l, annotations: &a, host_network: host }, ns)
        };
        assert!(
            check(&[(DATAPLANE_MODE_LABEL, "ambient")], &[], false, &none),
            "labelled pod, any namespace"
        );
        assert!(check(&[], &[], false, &ambient_ns), "an unlabelled pod of an ambient namespace");
        assert!(check(&[(DATAPLANE_MODE_LABEL, "other")], &[], false, &ambient_ns));
        assert!(!check(&[(DATAPLANE_MODE_LABEL, "none")], &[], false, &ambient_ns), "the opt-out");
        assert!(!check(&[], &[], false, &none), "neither");
        assert!(!check(&[(DATAPLANE_MODE_LABEL, "ambient")], &[], true, &none), "host network");
        assert!(
            !check(
                &[(DATAPLANE_MODE_LABEL, "ambient")],
                &[(SIDECAR_STATUS_ANNOTATION, "{}")],
                false,
                &ambient_ns
            ),
            "a sidecar pod keeps its sidecar"
        );
        assert!(s.matches_namespace(&ambient_ns));
        assert!(!s.matches_namespace(&none), "the empty namespace selector is skipped");
    }

    #[test]
    fn an_unset_selector_matches_no_pod_and_an_empty_entry_every_pod() {
        let unset = EnablementSelectors::parse("").unwrap();
        let labels = map(&[(DATAPLANE_MODE_LABEL, "ambient")]);
        let facts = PodFacts { labels: &labels, annotations: &BTreeMap::new(), host_network: false };
        assert!(!unset.matches(&facts, &labels));
        let all = EnablementSelectors::parse("- {}").unwrap();
        assert!(all.matches(&PodFacts { labels: &BTreeMap::new(), ..facts }, &BTreeMap::new()));
        assert!(!all.matches_namespace(&labels));
    }

    #[test]
    fn expressions_follow_kubernetes() {
        let sel = |op: &str, values: &[&str]| LabelSelector {
            match_expressions: vec![Requirement {
                key: "k".into(),
                operator: op.into(),
                values: values.iter().map(|v| v.to_string()).collect(),
            }],
            ..Default::default()
        };
        let with = map(&[("k", "a")]);
        let without = BTreeMap::new();
        assert!(sel("In", &["a", "b"]).matches(&with) && !sel("In", &["a"]).matches(&without));
        assert!(!sel("NotIn", &["a"]).matches(&with) && sel("NotIn", &["a"]).matches(&without));
        assert!(sel("Exists", &[]).matches(&with) && !sel("Exists", &[]).matches(&without));
        assert!(!sel("DoesNotExist", &[]).matches(&with) && sel("DoesNotExist", &[]).matches(&without));
    }

    #[test]
    fn bad_selectors_are_named() {
        for (yaml, needle) in [
            (
                "- podSelector: {matchExpressions: [{key: k, operator: Near, values: [a]}]}",
                "operator \"Near\"",
            ),
            ("- podSelector: {matchExpressions: [{key: k, operator: In}]}", "need values"),
            (
                "- namespaceSelector: {matchExpressions: [{key: k, operator: Exists, values: [a]}]}",
                "entry 0: namespaceSelector",
            ),
            ("podSelector: {}", "not a YAML list"),
            ("- podSelector: [1", "not a YAML list"),
        ] {
            let e = EnablementSelectors::parse(yaml).unwrap_err().to_string();
            assert!(e.contains(needle), "{yaml}: {e}");
        }
    }
}
