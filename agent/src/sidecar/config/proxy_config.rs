//! Istio's `ProxyConfig` (mesh.v1alpha1), layered as pilot-agent layers it: the
//! defaults, then the mesh config file's `defaultConfig`, then `PROXY_CONFIG`, then the
//! pod's `proxy.istio.io/config` annotation; then the `sidecar.istio.io/discoveryAddress`
//! and `status.sidecar.istio.io/port` annotations. Each layer merges into the previous
//! (objects field by field, `proxyMetadata` key by key). Fields Istio does not know
//! are an error naming the layer, as in Istio; fields Istio knows but Weir does not
//! use are kept (and printed) untouched.

use std::{collections::BTreeMap, time::Duration};

use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

use super::{
    ConfigError, Sources,
    env::{format_duration, parse_duration},
    vars,
};

/// `controlPlaneAuthPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ControlPlaneAuthPolicy {
    None,
    #[default]
    MutualTls,
}

/// `interceptionMode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum InterceptionMode {
    #[default]
    Redirect,
    Tproxy,
    None,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProxyConfig {
    pub config_path: String,
    pub binary_path: String,
    pub service_cluster: String,
    #[serde(with = "go_duration")]
    pub drain_duration: Duration,
    #[serde(with = "go_duration")]
    pub termination_drain_duration: Duration,
    pub discovery_address: String,
    pub proxy_admin_port: u16,
    pub control_plane_auth_policy: ControlPlaneAuthPolicy,
    pub stat_name_length: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    pub status_port: u16,
    pub interception_mode: InterceptionMode,
    pub proxy_metadata: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold_application_until_proxy_starts: Option<bool>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub custom_config_file: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub proxy_bootstrap_template_path: String,
    /// Istio fields Weir keeps but does not interpret.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

impl Default for ProxyConfig {
    /// Istio's `mesh.DefaultProxyConfig()`.
    fn default() -> Self {
        Self {
            config_path: "./etc/istio/proxy".into(),
            binary_path: "/usr/local/bin/envoy".into(),
            service_cluster: "istio-proxy".into(),
            drain_duration: Duration::from_secs(45),
            termination_drain_duration: Duration::from_secs(5),
            discovery_address: "istiod.istio-system.svc:15012".into(),
            proxy_admin_port: 15000,
            control_plane_auth_policy: ControlPlaneAuthPolicy::MutualTls,
            stat_name_length: 189,
            concurrency: None,
            status_port: 15020,
            interception_mode: InterceptionMode::Redirect,
            proxy_metadata: BTreeMap::new(),
            hold_application_until_proxy_starts: None,
            custom_config_file: String::new(),
            proxy_bootstrap_template_path: String::new(),
            other: BTreeMap::new(),
        }
    }
}

/// Every top-level `ProxyConfig` field in istio/api (camelCase), for Istio's strictness.
const ISTIO_FIELDS: &[&str] = &[
    "configPath",
    "binaryPath",
    "serviceCluster",
    "tracingServiceName",
    "drainDuration",
    "discoveryAddress",
    "discoveryRefreshDelay",
    "zipkinAddress",
    "statsdUdpAddress",
    "envoyMetricsServiceAddress",
    "proxyAdminPort",
    "availabilityZone",
    "controlPlaneAuthPolicy",
    "customConfigFile",
    "statNameLength",
    "concurrency",
    "proxyBootstrapTemplatePath",
    "interceptionMode",
    "tracing",
    "sds",
    "envoyAccessLogService",
    "envoyMetricsService",
    "proxyMetadata",
    "runtimeValues",
    "statusPort",
    "extraStatTags",
    "gatewayTopology",
    "terminationDrainDuration",
    "meshId",
    "readinessProbe",
    "proxyStatsMatcher",
    "holdApplicationUntilProxyStarts",
    "caCertificatesPem",
    "image",
    "privateKeyProvider",
    "proxyHeaders",
    "fileFlushInterval",
    "fileFlushMinSizeKb",
    "statsCompression",
    "connectionSettings",
];

/// One layer's text and where it came from (for errors).
pub struct Layer<'a> {
    pub source: String,
    pub yaml: &'a str,
}

/// Parses one `ProxyConfig` layer (YAML or JSON) and checks its field names.
fn parse_layer(layer: &Layer<'_>) -> Result<Value, ConfigError> {
    let value: Value = serde_yaml_ng::from_str(layer.yaml).map_err(|e| ConfigError::ProxyConfig {
        source_name: layer.source.clone(),
        message: e.to_string(),
    })?;
    let value = match value {
        Value::Null => Value::Mapping(Default::default()),
        Value::Mapping(m) => Value::Mapping(m),
        _ => {
            return Err(ConfigError::ProxyConfig {
                source_name: layer.source.clone(),
                message: "expected a mapping of ProxyConfig fields".into(),
            });
        }
    };
    if let Value::Mapping(m) = &value {
        for key in m.keys() {
            let key = key.as_str().unwrap_or_default();
            let camel = snake_to_camel(key);
            if !ISTIO_FIELDS.contains(&camel.as_str()) {
                return Err(ConfigError::ProxyConfig {
                    source_name: layer.source.clone(),
                    message: format!("unknown field {key:?} (not a ProxyConfig field)"),
                });
            }
        }
    }
    let value = normalize_keys(value);
    for field in ["drainDuration", "terminationDrainDuration"] {
        if let Some(v) = value.get(field) {
            let text = v.as_str().unwrap_or_default();
            if parse_duration(text).is_none() {
                return Err(ConfigError::ProxyConfig {
                    source_name: layer.source.clone(),
                    message: format!("{field}: {v:?} is not a duration (e.g. 45s, 1m30s)"),
                });
            }
        }
    }
    // Type-check the layer on its own so errors point at it.
    serde_yaml_ng::from_value::<ProxyConfig>(value.clone()).map_err(|e| ConfigError::ProxyConfig {
        source_name: layer.source.clone(),
        message: e.to_string(),
    })?;
    Ok(value)
}

/// Protobuf JSON accepts both `snake_case` and `camelCase` field names.
fn snake_to_camel(key: &str) -> String {
    let mut out = String::new();
    let mut upper = false;
    for c in key.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.push(c.to_ascii_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

/// Field names in `camelCase` at every level of nested messages; the keys of map
/// fields (`proxyMetadata`, `runtimeValues`, `customTags`) are data and stay.
fn normalize_keys(value: Value) -> Value {
    match value {
        Value::Mapping(m) => Value::Mapping(
            m.into_iter()
                .map(|(k, v)| {
                    let Some(name) = k.as_str().map(snake_to_camel) else { return (k, v) };
                    let v =
                        if super::proxy_json::MAPS.contains(&name.as_str()) { v } else { normalize_keys(v) };
                    (Value::String(name), v)
                })
                .collect(),
        ),
        Value::Sequence(items) => Value::Sequence(items.into_iter().map(normalize_keys).collect()),
        other => other,
    }
}

/// Merges `top` into `base`: mappings field by field (recursively), everything else
/// replaced.
fn merge(base: &mut Value, top: Value) {
    match (base, top) {
        (Value::Mapping(b), Value::Mapping(t)) => {
            for (k, v) in t {
                match b.get_mut(&k) {
                    Some(existing) if existing.is_mapping() && v.is_mapping() => merge(existing, v),
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, t) => *b = t,
    }
}

/// The effective `ProxyConfig` from its layers, lowest first.
pub fn layered(layers: &[Layer<'_>]) -> Result<ProxyConfig, ConfigError> {
    let mut merged = serde_yaml_ng::to_value(ProxyConfig::default()).expect("defaults serialize");
    for layer in layers {
        let value = parse_layer(layer)?;
        merge(&mut merged, value);
    }
    serde_yaml_ng::from_value(merged).map_err(|e| ConfigError::ProxyConfig {
        source_name: "merged ProxyConfig".into(),
        message: e.to_string(),
    })
}

/// The effective ProxyConfig: the layers as Istio stacks them, then the flags and
/// annotations that override single fields.
pub fn resolve(src: &Sources<'_>) -> Result<ProxyConfig, ConfigError> {
    let args = src.args;
    let mesh_text = src.files.read(std::path::Path::new(&args.mesh_config))?;
    let mesh_default = match &mesh_text {
        Some(text) => mesh_default_config(&args.mesh_config, text)?,
        None => None,
    };
    let proxy_env = vars::PROXY_CONFIG.value(src.env);
    let mut layers = Vec::new();
    if let Some(text) = &mesh_default {
        layers.push(Layer { source: format!("mesh config {} defaultConfig", args.mesh_config), yaml: text });
    }
    if let Some(text) = &proxy_env {
        layers.push(Layer { source: "PROXY_CONFIG".into(), yaml: text });
    }
    if let Some(text) = src.annotations.get("proxy.istio.io/config") {
        layers.push(Layer { source: "annotation proxy.istio.io/config".into(), yaml: text });
    }
    let mut config = layered(&layers)?;
    // No concurrency configured: the container's CPU limit, as pilot-agent reads it.
    if config.concurrency.is_none() {
        let limit = vars::ISTIO_CPU_LIMIT.count(src.env)?;
        if limit != 0 {
            config.concurrency = Some(limit);
        }
    }
    if args.concurrency != 0 {
        tracing::warn!(
            concurrency = args.concurrency,
            "legacy --concurrency flag detected; prefer ProxyConfig"
        );
        config.concurrency = Some(args.concurrency);
    }
    // `--templateFile` is ProxyConfig's template (and so shows in PROXY_CONFIG),
    // unless a custom bootstrap is used instead.
    if !args.template_file.is_empty() && config.custom_config_file.is_empty() {
        config.proxy_bootstrap_template_path = args.template_file.clone();
    }
    // `--serviceCluster` only fills a ProxyConfig that names the serviceCluster
    // variant with no value; Istio's default naming (tracingServiceName
    // APP_LABEL_AND_NAMESPACE) ignores it, and so does Weir.
    if let Some(address) = src.annotations.get("sidecar.istio.io/discoveryAddress") {
        config.discovery_address = address.clone();
    }
    match args.discovery_address.as_deref() {
        Some("embedded") => config.discovery_address = crate::sidecar::standalone::EMBEDDED_ADDRESS.into(),
        Some(address) => config.discovery_address = address.into(),
        None => {}
    }
    if let Some(port) = src.annotations.get("status.sidecar.istio.io/port") {
        config.status_port = port.parse().map_err(|_| ConfigError::ProxyConfig {
            source_name: "annotation status.sidecar.istio.io/port".into(),
            message: format!("{port:?} is not a port number"),
        })?;
    }
    Ok(config)
}

/// The `defaultConfig` of a mesh config file, as YAML text (other mesh fields are not
/// the agent's business).
pub fn mesh_default_config(path: &str, text: &str) -> Result<Option<String>, ConfigError> {
    let mesh: Value = serde_yaml_ng::from_str(text).map_err(|e| ConfigError::ProxyConfig {
        source_name: format!("mesh config {path}"),
        message: e.to_string(),
    })?;
    // A value that parses need not serialize again (a tagged value such as
    // `defaultConfig: !tag ...` fails in the emitter): an error, never a panic.
    mesh.get("defaultConfig")
        .filter(|v| !v.is_null())
        .map(|v| {
            serde_yaml_ng::to_string(v).map_err(|e| ConfigError::ProxyConfig {
                source_name: format!("mesh config {path}"),
                message: format!("defaultConfig cannot be read back as YAML: {e}"),
            })
        })
        .transpose()
}

/// The downward-API annotations file: `key="value"` lines, values Go-quoted.
pub fn parse_annotations(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some((key, raw)) = line.split_once('=') else { continue };
        let value = raw
            .strip_prefix('"')
            .and_then(|r| r.strip_suffix('"'))
            .map(unquote)
            .unwrap_or_else(|| raw.to_string());
        out.insert(key.trim().to_string(), value);
    }
    out
}

fn unquote(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

/// Serde for Go/protobuf-JSON duration strings ("45s").
mod go_duration {
    use super::*;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(*d))
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        parse_duration(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("{text:?} is not a duration (e.g. 45s, 1m30s)")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tagged_default_config_that_cannot_be_written_back_is_an_error() {
        // Found by the proxy_config fuzz target: parsed, then refused by the emitter.
        let input =
            "defaultConfig:\n !wasmoryveAderdss: aultConfisystem.svc:150r.locerception_mode: TPROX-\n";
        let e = mesh_default_config("mesh.yaml", input).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("mesh.yaml") && text.contains("cannot be read back as YAML"), "{text}");
    }

    fn layer<'a>(source: &str, yaml: &'a str) -> Layer<'a> {
        Layer { source: source.into(), yaml }
    }

    #[test]
    fn defaults_are_istios() {
        let c = layered(&[]).unwrap();
        assert_eq!(c.discovery_address, "istiod.istio-system.svc:15012");
        assert_eq!((c.proxy_admin_port, c.status_port, c.stat_name_length), (15000, 15020, 189));
        assert_eq!(c.drain_duration, Duration::from_secs(45));
        assert_eq!(c.control_plane_auth_policy, ControlPlaneAuthPolicy::MutualTls);
    }

    #[test]
    fn layers_merge_in_order_and_metadata_key_by_key() {
        let mesh = "discoveryAddress: istiod.mesh:15012\nproxyMetadata:\n  A: mesh\n  B: mesh\n";
        let env = r#"{"proxyMetadata": {"B": "env"}, "drainDuration": "10s", "tracing": {"zipkin": {"address": "z:9411"}}}"#;
        let annotation = "discovery_address: istiod.pod:15012\nconcurrency: 2\n";
        let c = layered(&[layer("mesh", mesh), layer("PROXY_CONFIG", env), layer("annotation", annotation)])
            .unwrap();
        assert_eq!(c.discovery_address, "istiod.pod:15012");
        assert_eq!(c.proxy_metadata.get("A").unwrap(), "mesh");
        assert_eq!(c.proxy_metadata.get("B").unwrap(), "env");
        assert_eq!(c.drain_duration, Duration::from_secs(10));
        assert_eq!(c.concurrency, Some(2));
        assert!(c.other.contains_key("tracing"), "Istio fields Weir does not use are kept");
    }

    #[test]
    fn errors_name_the_layer_and_field() {
        let e = layered(&[layer("PROXY_CONFIG", "discoveryAdress: x:1\n")]).unwrap_err().to_string();
        assert!(e.contains("PROXY_CONFIG") && e.contains("discoveryAdress"), "{e}");
        let e = layered(&[layer("annotation proxy.istio.io/config", "drainDuration: soon\n")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("annotation") && e.contains("soon") && e.contains("drainDuration"), "{e}");
        let e =
            layered(&[layer("PROXY_CONFIG", "controlPlaneAuthPolicy: SOMETIMES\n")]).unwrap_err().to_string();
        assert!(e.contains("SOMETIMES") || e.contains("unknown variant"), "{e}");
        assert!(layered(&[layer("PROXY_CONFIG", "[1, 2]")]).is_err());
    }

    #[test]
    fn mesh_files_and_annotations() {
        let mesh = "accessLogFile: /dev/stdout\ndefaultConfig:\n  discoveryAddress: istiod.x:15012\n";
        let dc = mesh_default_config("mesh", mesh).unwrap().unwrap();
        assert!(dc.contains("istiod.x:15012"));
        assert_eq!(mesh_default_config("mesh", "accessLogFile: x\n").unwrap(), None);
        let a = parse_annotations(
            "proxy.istio.io/config=\"concurrency: 2\\nholdApplicationUntilProxyStarts: true\\n\"\nsidecar.istio.io/status=\"{\\\"x\\\":1}\"\n",
        );
        assert_eq!(a["proxy.istio.io/config"], "concurrency: 2\nholdApplicationUntilProxyStarts: true\n");
        assert_eq!(a["sidecar.istio.io/status"], "{\"x\":1}");
    }
}
