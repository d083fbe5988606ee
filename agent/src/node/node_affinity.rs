//! Whether a node satisfies a pod template's required node affinity
//! (`requiredDuringSchedulingIgnoredDuringExecution`), as Kubernetes'
//! `nodeaffinity.NewNodeSelector(...).Match(node)` answers it: the terms are ORed; a
//! term's `matchExpressions` (on labels) and `matchFields` (`metadata.name`) are ANDed;
//! an empty term matches no node. Istio's node agent asks it at stop
//! (`ShouldStopCleanup`): a DaemonSet that no longer schedules to this node is not an
//! upgrade, so the node is cleaned up. Pure: the objects come as JSON.

use serde_json::Value;

/// An affinity that cannot be evaluated (as Kubernetes' selector refuses to build it).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("node affinity: {0}")]
pub struct AffinityError(String);

/// The template's required node selector (`spec.template.spec.affinity.nodeAffinity.
/// requiredDuringSchedulingIgnoredDuringExecution`), if it has one.
pub fn required_selector(daemonset: &Value) -> Option<&Value> {
    let s = &daemonset["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"];
    (!s.is_null()).then_some(s)
}

/// Whether `node` matches `selector` (a `NodeSelector`).
pub fn matches(selector: &Value, node: &Value) -> Result<bool, AffinityError> {
    let terms = selector["nodeSelectorTerms"].as_array().map(Vec::as_slice).unwrap_or_default();
    for term in terms {
        if term_matches(term, node)? {
            return Ok(true);
        }
    }
    Ok(false)
}

fn term_matches(term: &Value, node: &Value) -> Result<bool, AffinityError> {
    let list = |key: &str| term[key].as_array().map(Vec::as_slice).unwrap_or_default();
    let (labels, fields) = (list("matchExpressions"), list("matchFields"));
    if labels.is_empty() && fields.is_empty() {
        return Ok(false);
    }
    for r in labels {
        let key = r["key"].as_str().unwrap_or_default();
        if !requirement(r, node["metadata"]["labels"][key].as_str())? {
            return Ok(false);
        }
    }
    for r in fields {
        let key = r["key"].as_str().unwrap_or_default();
        if key != "metadata.name" {
            return Err(AffinityError(format!("matchFields key {key:?}: only metadata.name is supported")));
        }
        if !requirement(r, node["metadata"]["name"].as_str())? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// One requirement against the node's value for its key (`None`: the node has none).
fn requirement(r: &Value, value: Option<&str>) -> Result<bool, AffinityError> {
    let values: Vec<&str> = r["values"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    let operator = r["operator"].as_str().unwrap_or_default();
    let number = |s: &str| {
        s.parse::<i64>().map_err(|_| AffinityError(format!("{operator} needs an integer, not {s:?}")))
    };
    Ok(match operator {
        "In" => value.is_some_and(|v| values.contains(&v)),
        "NotIn" => value.is_none_or(|v| !values.contains(&v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let [bound] = values[..] else {
                return Err(AffinityError(format!("{operator} needs exactly one value, not {values:?}")));
            };
            let bound = number(bound)?;
            match value.map(|v| v.parse::<i64>()) {
                Some(Ok(v)) if operator == "Gt" => v > bound,
                Some(Ok(v)) => v < bound,
                _ => false,
            }
        }
        other => return Err(AffinityError(format!("unknown operator {other:?}"))),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn node(name: &str, labels: Value) -> Value {
        json!({"metadata": {"name": name, "labels": labels}})
    }

    #[test]
    fn terms_are_ored_and_requirements_anded_as_kubernetes_matches_them() {
        let sel = json!({"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]},
                                  {"key": "istio-cni", "operator": "NotIn", "values": ["off"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["special"]}]}]});
        assert_eq!(matches(&sel, &node("a", json!({"kubernetes.io/os": "linux"}))), Ok(true));
        assert_eq!(
            matches(&sel, &node("a", json!({"kubernetes.io/os": "linux", "istio-cni": "off"}))),
            Ok(false)
        );
        assert_eq!(matches(&sel, &node("special", json!({"kubernetes.io/os": "windows"}))), Ok(true));
        assert_eq!(matches(&sel, &node("b", json!({}))), Ok(false));
        assert_eq!(
            matches(&json!({"nodeSelectorTerms": [{}]}), &node("a", json!({}))),
            Ok(false),
            "empty term"
        );
        let num = |op: &str, v: &str| json!({"nodeSelectorTerms": [{"matchExpressions": [{"key": "gen", "operator": op, "values": [v]}]}]});
        assert_eq!(matches(&num("Gt", "3"), &node("a", json!({"gen": "4"}))), Ok(true));
        assert_eq!(matches(&num("Lt", "3"), &node("a", json!({"gen": "4"}))), Ok(false));
        assert_eq!(matches(&num("Gt", "3"), &node("a", json!({}))), Ok(false));
        assert!(matches(&num("Gt", "x"), &node("a", json!({"gen": "4"}))).is_err());
        let bad = json!({"nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "Near"}]}]});
        assert!(matches(&bad, &node("a", json!({}))).unwrap_err().to_string().contains("Near"));
        let ex =
            json!({"nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "DoesNotExist"}]}]});
        assert_eq!(matches(&ex, &node("a", json!({}))), Ok(true));
    }

    #[test]
    fn the_required_selector_is_found_in_the_daemonsets_template() {
        let ds = json!({"spec": {"template": {"spec": {"affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}}}}});
        assert!(required_selector(&ds).is_some());
        assert!(required_selector(&json!({"spec": {}})).is_none());
    }
}
