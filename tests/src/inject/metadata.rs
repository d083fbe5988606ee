//! The node pilot-agent would present to istiod for an injected pod's `istio-proxy`
//! (`pkg/bootstrap/config.go:GetNodeMetaData`, `pilot/cmd/pilot-agent/config`),
//! computed from the pod: its resolved env, the labels and annotations of its podinfo
//! files, its IPs. Every key the rig checks is here, so switching one on or off is one
//! line; [`mismatches`] lists what a real node gets wrong.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use serde_json::{Map, Value, json};

/// The keys compared. Each is pilot-agent's (spec §3).
pub const CHECKED: [&str; 23] = [
    "NAME",
    "NAMESPACE",
    "SERVICE_ACCOUNT",
    "CLUSTER_ID",
    "NODE_NAME",
    "INSTANCE_IPS",
    "WORKLOAD_NAME",
    "OWNER",
    "MESH_ID",
    "INTERCEPTION_MODE",
    "APP_CONTAINERS",
    "POD_PORTS",
    "LABELS",
    "ANNOTATIONS",
    "PROXY_CONFIG",
    "ISTIO_VERSION",
    "ENVOY_STATUS_PORT",
    "ENVOY_PROMETHEUS_PORT",
    "PILOT_SAN",
    "WORKLOAD_IDENTITY_SOCKET_FILE",
    "METADATA_DISCOVERY",
    "ENVOY_SKIP_DEPRECATED_LOGS",
    "file-credential",
];

/// What the rig knows of the pod that decides its node.
pub struct NodeInputs<'a> {
    /// istio-proxy's environment as the kubelet made it.
    pub env: &'a BTreeMap<String, String>,
    /// The pod's labels and annotations (what its podinfo files say).
    pub labels: &'a BTreeMap<String, String>,
    pub annotations: &'a BTreeMap<String, String>,
    /// The pod's interface addresses.
    pub pod_ips: &'a [IpAddr],
    /// An SDS server other than the agent (SPIRE) owns the workload socket.
    pub external_sds: bool,
    /// The Istio release the agent speaks as (pilot-agent's build version).
    pub istio_version: &'a str,
}

/// pilot-agent's ProxyConfig defaults (`mesh.DefaultProxyConfig`), as protobuf JSON.
fn default_proxy_config() -> Value {
    json!({
        "binaryPath": "/usr/local/bin/envoy",
        "configPath": "./etc/istio/proxy",
        "controlPlaneAuthPolicy": "MUTUAL_TLS",
        "discoveryAddress": "istiod.istio-system.svc:15012",
        "drainDuration": "45s",
        "proxyAdminPort": 15000,
        "serviceCluster": "istio-proxy",
        "statNameLength": 189,
        "statusPort": 15020,
        "terminationDrainDuration": "5s",
    })
}

fn merge(base: &mut Value, layer: &Value) {
    match (base, layer) {
        (Value::Object(b), Value::Object(l)) => {
            for (k, v) in l {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, l) => *b = l.clone(),
    }
}

/// The effective ProxyConfig (`ConstructProxyConfig`): defaults, `PROXY_CONFIG`, the
/// `proxy.istio.io/config` annotation, concurrency from `ISTIO_CPU_LIMIT` when none is
/// set, then the discovery-address and status-port annotations.
pub fn proxy_config(env: &BTreeMap<String, String>, annotations: &BTreeMap<String, String>) -> Value {
    let mut pc = default_proxy_config();
    for layer in [env.get("PROXY_CONFIG"), annotations.get("proxy.istio.io/config")].into_iter().flatten() {
        if !layer.trim().is_empty() {
            let parsed: Value = serde_json::from_str(layer).expect("the rig's ProxyConfig layers are JSON");
            merge(&mut pc, &parsed);
        }
    }
    if pc.get("concurrency").is_none()
        && let Some(limit) =
            env.get("ISTIO_CPU_LIMIT").and_then(|v| v.parse::<i64>().ok()).filter(|n| *n != 0)
    {
        pc["concurrency"] = json!(limit);
    }
    if let Some(address) = annotations.get("sidecar.istio.io/discoveryAddress") {
        pc["discoveryAddress"] = json!(address);
    }
    if let Some(port) = annotations.get("status.sidecar.istio.io/port").and_then(|p| p.parse::<i64>().ok()) {
        pc["statusPort"] = json!(port);
    }
    pc
}

/// `ISTIO_META_POD_PORTS` as `PodPortList` re-encodes it: a string of compact JSON
/// with `name` (when set), `containerPort` and `protocol` (always); an empty list is
/// omitted from the typed metadata, so the raw env value comes back instead.
fn pod_ports(raw: &str) -> Value {
    let ports: Vec<Value> = serde_json::from_str(raw).unwrap_or_default();
    if ports.is_empty() {
        return json!(raw);
    }
    let encoded: Vec<String> = ports
        .iter()
        .map(|p| {
            let mut fields = Vec::new();
            if let Some(name) = p["name"].as_str().filter(|n| !n.is_empty()) {
                fields.push(format!("\"name\":{}", json!(name)));
            }
            fields.push(format!("\"containerPort\":{}", p["containerPort"].as_i64().unwrap_or(0)));
            fields.push(format!("\"protocol\":{}", json!(p["protocol"].as_str().unwrap_or(""))));
            format!("{{{}}}", fields.join(","))
        })
        .collect();
    json!(format!("[{}]", encoded.join(",")))
}

/// Every checked key with the value pilot-agent would send (keys it would omit are
/// absent).
pub fn expected(inputs: &NodeInputs<'_>) -> BTreeMap<&'static str, Value> {
    let env = |k: &str| inputs.env.get(k).cloned().unwrap_or_default();
    let mut out = BTreeMap::new();
    let mut put = |k: &'static str, v: Value| {
        out.insert(k, v);
    };
    put("NAME", json!(env("POD_NAME")));
    put("NAMESPACE", json!(env("POD_NAMESPACE")));
    put("SERVICE_ACCOUNT", json!(env("SERVICE_ACCOUNT")));
    for (key, var) in [
        ("CLUSTER_ID", "ISTIO_META_CLUSTER_ID"),
        ("NODE_NAME", "ISTIO_META_NODE_NAME"),
        ("WORKLOAD_NAME", "ISTIO_META_WORKLOAD_NAME"),
        ("OWNER", "ISTIO_META_OWNER"),
        ("MESH_ID", "ISTIO_META_MESH_ID"),
        ("INTERCEPTION_MODE", "ISTIO_META_INTERCEPTION_MODE"),
        ("APP_CONTAINERS", "ISTIO_META_APP_CONTAINERS"),
    ] {
        if !env(var).is_empty() {
            put(key, json!(env(var)));
        }
    }
    // INSTANCE_IP first, then the pod's other addresses, each once.
    let mut ips: Vec<String> = Vec::new();
    let instance = env("INSTANCE_IP");
    if let Ok(ip) = instance.parse::<IpAddr>() {
        ips.push(ip.to_string());
    }
    for ip in inputs.pod_ips {
        if !ips.contains(&ip.to_string()) {
            ips.push(ip.to_string());
        }
    }
    put("INSTANCE_IPS", json!(ips.join(",")));
    if let Some(raw) = inputs.env.get("ISTIO_META_POD_PORTS") {
        put("POD_PORTS", pod_ports(raw));
    }
    let labels: Map<String, Value> = inputs
        .labels
        .iter()
        .filter(|(k, _)| k.as_str() != "pod-template-hash")
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    put("LABELS", Value::Object(labels));
    if !inputs.annotations.is_empty() {
        put("ANNOTATIONS", json!(inputs.annotations));
    }
    let pc = proxy_config(inputs.env, inputs.annotations);
    if pc["controlPlaneAuthPolicy"] == "MUTUAL_TLS" {
        let address = pc["discoveryAddress"].as_str().unwrap_or_default();
        let host = address.split(':').next().unwrap_or_default();
        let san = if host == "localhost" { "istiod.istio-system.svc" } else { host };
        put("PILOT_SAN", json!([san]));
    }
    put("PROXY_CONFIG", pc);
    let version = env("ISTIO_META_ISTIO_VERSION");
    put("ISTIO_VERSION", json!(if version.is_empty() { inputs.istio_version.to_string() } else { version }));
    let port = |var: &str, default: i64| env(var).parse::<i64>().unwrap_or(default);
    put("ENVOY_STATUS_PORT", json!(port("ENVOY_STATUS_PORT", 15021)));
    put("ENVOY_PROMETHEUS_PORT", json!(port("ENVOY_PROMETHEUS_PORT", 15090)));
    put("WORKLOAD_IDENTITY_SOCKET_FILE", json!("socket"));
    put("METADATA_DISCOVERY", json!("false"));
    put("ENVOY_SKIP_DEPRECATED_LOGS", json!("true"));
    if inputs.external_sds {
        put("file-credential", json!("true"));
    }
    out
}

/// The node's `cluster` (`getServiceCluster` with the default `istio-proxy`): the app
/// label (`app`, `app.kubernetes.io/name`, `service.istio.io/canonical-name`) or the
/// workload name, with the namespace.
pub fn expected_cluster(inputs: &NodeInputs<'_>) -> String {
    let namespace = inputs.env.get("POD_NAMESPACE").cloned().unwrap_or_default();
    let app = ["app", "app.kubernetes.io/name", "service.istio.io/canonical-name"]
        .iter()
        .find_map(|k| inputs.labels.get(*k))
        .cloned()
        .or_else(|| inputs.env.get("ISTIO_META_WORKLOAD_NAME").filter(|w| !w.is_empty()).cloned());
    match app {
        Some(app) => format!("{app}.{namespace}"),
        None if !namespace.is_empty() => format!("istio-proxy.{namespace}"),
        None => "istio-proxy".into(),
    }
}

/// The node id: `sidecar~<first IP>~<pod>.<namespace>~<namespace>.svc.cluster.local`.
pub fn expected_id(inputs: &NodeInputs<'_>) -> String {
    let env = |k: &str| inputs.env.get(k).cloned().unwrap_or_default();
    let ip = env("INSTANCE_IP");
    let ns = env("POD_NAMESPACE");
    format!("sidecar~{ip}~{}.{ns}~{ns}.svc.cluster.local", env("POD_NAME"))
}

/// One line per checked key whose value in `actual` is not `expected`'s (or is
/// present where pilot-agent would omit it).
pub fn mismatches(actual: &Value, expected: &BTreeMap<&'static str, Value>) -> Vec<String> {
    let checked: BTreeSet<&str> = CHECKED.into_iter().collect();
    let mut out = Vec::new();
    for key in &checked {
        let got = actual.get(*key);
        match (expected.get(key), got) {
            (Some(want), Some(got)) if want == got => {}
            (Some(want), got) => out.push(format!("{key}: expected {want}, got {}", show(got))),
            (None, Some(got)) => out.push(format!("{key}: expected absent, got {got}")),
            (None, None) => {}
        }
    }
    out
}

fn show(v: Option<&Value>) -> String {
    v.map_or_else(|| "nothing".into(), Value::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn proxy_config_layers_as_pilot_agent_does() {
        let annotations: BTreeMap<String, String> =
            [("status.sidecar.istio.io/port".into(), "123".into())].into();
        let pc = proxy_config(&env(&[("PROXY_CONFIG", "{}\n"), ("ISTIO_CPU_LIMIT", "2")]), &annotations);
        assert_eq!(pc["statusPort"], 123);
        assert_eq!(pc["concurrency"], 2);
        assert_eq!(pc["drainDuration"], "45s");
        let pc = proxy_config(
            &env(&[("PROXY_CONFIG", r#"{"concurrency": 0, "drainDuration": "2s"}"#)]),
            &BTreeMap::new(),
        );
        assert_eq!(pc["concurrency"], 0, "an explicit concurrency is kept");
        assert_eq!(pc["drainDuration"], "2s");
    }

    #[test]
    fn pod_ports_are_reencoded_or_kept_raw_when_empty() {
        assert_eq!(
            pod_ports(
                "[\n    {\"name\":\"http\",\"containerPort\":80}\n    ,{\"containerPort\":90,\"protocol\":\"TCP\"}\n]"
            ),
            json!(
                r#"[{"name":"http","containerPort":80,"protocol":""},{"containerPort":90,"protocol":"TCP"}]"#
            )
        );
        assert_eq!(pod_ports("[\n]"), json!("[\n]"));
    }

    #[test]
    fn mismatches_name_each_wrong_or_missing_key() {
        let vars = env(&[("POD_NAME", "p"), ("POD_NAMESPACE", "ns"), ("INSTANCE_IP", "10.0.0.2")]);
        let empty = BTreeMap::new();
        let inputs = NodeInputs {
            env: &vars,
            labels: &empty,
            annotations: &empty,
            pod_ips: &["10.0.0.2".parse().unwrap(), "fd00::2".parse().unwrap()],
            external_sds: false,
            istio_version: "1.2.3",
        };
        let want = expected(&inputs);
        assert_eq!(want["INSTANCE_IPS"], "10.0.0.2,fd00::2");
        assert_eq!(expected_id(&inputs), "sidecar~10.0.0.2~p.ns~ns.svc.cluster.local");
        assert_eq!(expected_cluster(&inputs), "istio-proxy.ns");
        let mut actual = Value::Object(want.iter().map(|(k, v)| (k.to_string(), v.clone())).collect());
        assert!(mismatches(&actual, &want).is_empty());
        actual["NAME"] = json!("q");
        actual.as_object_mut().unwrap().remove("ISTIO_VERSION");
        actual["file-credential"] = json!("true");
        assert_eq!(
            mismatches(&actual, &want),
            [
                "ISTIO_VERSION: expected \"1.2.3\", got nothing",
                "NAME: expected \"p\", got \"q\"",
                "file-credential: expected absent, got \"true\""
            ]
        );
    }
}
