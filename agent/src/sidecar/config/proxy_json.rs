//! The effective ProxyConfig as Istio writes it into node metadata (`PROXY_CONFIG`):
//! protobuf JSON — lowerCamelCase names, fields at their default value left out (empty
//! strings, zeros, false, the zero enum value, empty lists and maps; wrapper types and
//! set messages kept even when zero or empty), enums by name, durations in protobuf's
//! form (`2s`, `0.500s`), the unset `serviceCluster` filled from `--serviceCluster` as
//! pilot-agent fills it.

use serde_json::{Map, Value};

use super::{ProxyConfig, env::parse_duration};

/// Fields whose zero value is their enum's first value, and that value.
const ZERO_ENUMS: &[(&str, &str)] = &[
    ("controlPlaneAuthPolicy", "NONE"),
    ("interceptionMode", "REDIRECT"),
    ("tracingServiceName", "APP_LABEL_AND_NAMESPACE"),
    ("mode", "DISABLE"),
];

/// Wrapper-typed fields (`google.protobuf.*Value`): present means set, even at zero.
const WRAPPERS: &[&str] = &[
    "concurrency",
    "holdApplicationUntilProxyStarts",
    "statsCompression",
    "globalDownstreamConnectionLimit",
    "fileFlushMinSizeKb",
    "maxNumberOfAttributes",
    "maxNumberOfAnnotations",
    "maxNumberOfMessageEvents",
    "numTrustedProxies",
];

/// `google.protobuf.Duration` fields.
const DURATIONS: &[&str] = &[
    "drainDuration",
    "terminationDrainDuration",
    "discoveryRefreshDelay",
    "fileFlushInterval",
    "time",
    "interval",
];

/// Map-typed fields: their keys are data, not field names.
pub const MAPS: &[&str] = &["proxyMetadata", "runtimeValues", "customTags"];

/// The protobuf JSON of `pc`, as `PROXY_CONFIG` carries it.
pub fn proxy_config_json(pc: &ProxyConfig, service_cluster_flag: &str) -> Value {
    let mut value = serde_json::to_value(pc).expect("ProxyConfig serializes");
    if let Value::Object(top) = &mut value
        && pc.service_cluster.is_empty()
        && !top.contains_key("tracingServiceName")
    {
        top.insert("serviceCluster".into(), Value::String(service_cluster_flag.into()));
    }
    canonical_json(value)
}

/// A ProxyConfig's JSON (camelCase, as merged from its layers) in protobuf JSON's
/// canonical form: defaults left out, durations and the cluster-name oneof as
/// protobuf writes them.
pub fn canonical_json(mut value: Value) -> Value {
    if let Value::Object(top) = &mut value {
        // `clusterName` is a oneof: tracingServiceName replaces serviceCluster.
        if top.contains_key("tracingServiceName") {
            top.remove("serviceCluster");
        }
        canonical(top);
    }
    value
}

fn canonical(object: &mut Map<String, Value>) {
    let keys: Vec<String> = object.keys().cloned().collect();
    for key in keys {
        let Some(value) = object.get_mut(&key) else { continue };
        if MAPS.contains(&key.as_str()) {
            if value.as_object().is_some_and(Map::is_empty) {
                object.remove(&key);
            }
            continue;
        }
        if DURATIONS.contains(&key.as_str())
            && let Some(d) = value.as_str().and_then(parse_duration)
        {
            *value = Value::String(protobuf_duration(d));
            continue;
        }
        if let Value::Object(inner) = value {
            canonical(inner);
            continue;
        }
        let zero = match value {
            Value::String(s) => s.is_empty() || ZERO_ENUMS.iter().any(|(f, z)| *f == key && s == z),
            Value::Number(n) => n.as_f64() == Some(0.0),
            Value::Bool(b) => !*b,
            Value::Array(a) => a.is_empty(),
            Value::Null => true,
            Value::Object(_) => false,
        };
        if zero && (!WRAPPERS.contains(&key.as_str()) || value.is_null()) {
            object.remove(&key);
        }
    }
}

/// A duration as protobuf JSON writes it: seconds with 0, 3, 6 or 9 fractional digits.
pub fn protobuf_duration(d: std::time::Duration) -> String {
    let (secs, nanos) = (d.as_secs(), d.subsec_nanos());
    match nanos {
        0 => format!("{secs}s"),
        n if n % 1_000_000 == 0 => format!("{secs}.{:03}s", n / 1_000_000),
        n if n % 1_000 == 0 => format!("{secs}.{:06}s", n / 1_000),
        n => format!("{secs}.{n:09}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sidecar::config::proxy_config::{Layer, layered};

    fn json(yaml: &str) -> Value {
        let pc = layered(&[Layer { source: "test".into(), yaml }]).unwrap();
        proxy_config_json(&pc, "istio-proxy")
    }

    #[test]
    fn istios_defaults_serialize_as_pilot_agent_sends_them() {
        assert_eq!(
            json("{}"),
            serde_json::json!({
                "binaryPath": "/usr/local/bin/envoy",
                "configPath": "./etc/istio/proxy",
                "controlPlaneAuthPolicy": "MUTUAL_TLS",
                "discoveryAddress": "istiod.istio-system.svc:15012",
                "drainDuration": "45s",
                "proxyAdminPort": 15000,
                "serviceCluster": "istio-proxy",
                "statNameLength": 189,
                "statusPort": 15020,
                "terminationDrainDuration": "5s"
            })
        );
    }

    #[test]
    fn zero_values_go_and_wrappers_and_set_messages_stay() {
        let v = json(
            "controlPlaneAuthPolicy: NONE\nconcurrency: 0\nstatNameLength: 0\ntracing: {}\n\
             drainDuration: 0.5s\nstatsCompression: false\nproxyMetadata: {}\n\
             envoyMetricsService: {address: \"m:1\", tlsSettings: {mode: DISABLE}}\n",
        );
        assert!(v.get("controlPlaneAuthPolicy").is_none() && v.get("statNameLength").is_none(), "{v}");
        assert_eq!(v["concurrency"], 0, "a set wrapper is sent at zero");
        assert_eq!(v["statsCompression"], false);
        assert_eq!(v["tracing"], serde_json::json!({}), "a set message is sent empty");
        assert_eq!(v["drainDuration"], "0.500s");
        assert!(v.get("proxyMetadata").is_none());
        assert_eq!(v["envoyMetricsService"], serde_json::json!({"address": "m:1", "tlsSettings": {}}));
    }

    #[test]
    fn durations_take_protobufs_form() {
        use std::time::Duration;
        assert_eq!(protobuf_duration(Duration::from_secs(2)), "2s");
        assert_eq!(protobuf_duration(Duration::from_millis(1500)), "1.500s");
        assert_eq!(protobuf_duration(Duration::from_micros(1)), "0.000001s");
        assert_eq!(protobuf_duration(Duration::from_nanos(5)), "0.000000005s");
    }
}
