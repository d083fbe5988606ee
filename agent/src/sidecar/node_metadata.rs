//! Node metadata as pilot-agent computes it (`GetNodeMetaData`): a raw map from
//! proxyMetadata's and the environment's `ISTIO_META_*` (strings) and every
//! `ISTIO_METAJSON_*` object (merged at the top level, whatever the variable's name),
//! decoded into Istio's typed fields with Go's JSON rules (names matched ignoring case,
//! types strict: a mismatch stops the agent, naming the key), completed with what the
//! agent knows (ports, IPs, labels and annotations from the pod's files, locality,
//! PILOT_SAN, PROXY_CONFIG, ...), encoded back, and merged with the raw keys no typed
//! field took. The result is the object istiod receives, key for key.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::podinfo;

/// A typed field's Go type, which decides how it decodes and encodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `string`: omitted when empty.
    Str,
    /// `StringBool`: `"true"`, omitted when false.
    Bool,
    /// `*StringBool`: `"true"`/`"false"`, omitted when unset.
    OptBool,
    /// `StringList`: one comma-joined string.
    List,
    /// `PodPortList`: a string holding a JSON array.
    Ports,
    /// `int`: a number, omitted when 0.
    Int,
    /// `map[string]string`.
    Map,
    /// `[]string`: an array.
    Array,
    /// `*NodeMetaProxyConfig`: an object.
    Object,
}

/// Istio's `NodeMetadata` fields: JSON name, Go name, type.
const FIELDS: &[(&str, &str, Kind)] = &[
    ("NAME", "InstanceName", Kind::Str),
    ("OWNER", "Owner", Kind::Str),
    ("PILOT_SAN", "PilotSubjectAltName", Kind::Array),
    ("OUTLIER_LOG_PATH", "OutlierLogPath", Kind::Str),
    ("APP_CONTAINERS", "AppContainers", Kind::Str),
    ("ISTIO_PROXY_SHA", "IstioProxySHA", Kind::Str),
    ("PROXY_CONFIG", "ProxyConfig", Kind::Object),
    ("ISTIO_VERSION", "IstioVersion", Kind::Str),
    ("ISTIO_REVISION", "IstioRevision", Kind::Str),
    ("LABELS", "Labels", Kind::Map),
    ("STATIC_LABELS", "StaticLabels", Kind::Map),
    ("ANNOTATIONS", "Annotations", Kind::Map),
    ("INSTANCE_IPS", "InstanceIPs", Kind::List),
    ("NAMESPACE", "Namespace", Kind::Str),
    ("NODE_NAME", "NodeName", Kind::Str),
    ("WORKLOAD_NAME", "WorkloadName", Kind::Str),
    ("INTERCEPTION_MODE", "InterceptionMode", Kind::Str),
    ("SERVICE_ACCOUNT", "ServiceAccount", Kind::Str),
    ("HTTP_PROXY_PORT", "HTTPProxyPort", Kind::Str),
    ("MESH_ID", "MeshID", Kind::Str),
    ("CLUSTER_ID", "ClusterID", Kind::Str),
    ("NETWORK", "Network", Kind::Str),
    ("REQUESTED_NETWORK_VIEW", "RequestedNetworkView", Kind::List),
    ("POD_PORTS", "PodPorts", Kind::Ports),
    ("TLS_SERVER_CERT_CHAIN", "TLSServerCertChain", Kind::Str),
    ("TLS_SERVER_KEY", "TLSServerKey", Kind::Str),
    ("TLS_SERVER_ROOT_CERT", "TLSServerRootCert", Kind::Str),
    ("TLS_CLIENT_CERT_CHAIN", "TLSClientCertChain", Kind::Str),
    ("TLS_CLIENT_KEY", "TLSClientKey", Kind::Str),
    ("TLS_CLIENT_ROOT_CERT", "TLSClientRootCert", Kind::Str),
    ("BASE", "CertBaseDir", Kind::Str),
    ("IDLE_TIMEOUT", "IdleTimeout", Kind::Str),
    ("HTTP10", "HTTP10", Kind::Str),
    ("GENERATOR", "Generator", Kind::Str),
    ("ENABLE_SELF_DISCOVERY", "EnableSelfDiscovery", Kind::Bool),
    ("DNS_CAPTURE", "DNSCapture", Kind::Bool),
    ("DNS_AUTO_ALLOCATE", "DNSAutoAllocate", Kind::Bool),
    ("DNS_PROXY_ADDR", "DNSProxyAddr", Kind::Str),
    ("ENABLE_HBONE", "EnableHBONE", Kind::Bool),
    ("DISABLE_HBONE_SEND", "DisableHBONESend", Kind::Bool),
    ("AUTO_REGISTER_GROUP", "AutoRegisterGroup", Kind::Str),
    ("WORKLOAD_ENTRY", "WorkloadEntry", Kind::Str),
    ("UNPRIVILEGED_POD", "UnprivilegedPod", Kind::Str),
    ("PLATFORM_METADATA", "PlatformMetadata", Kind::Map),
    ("STS_PORT", "StsPort", Kind::Str),
    ("ENVOY_STATUS_PORT", "EnvoyStatusPort", Kind::Int),
    ("ENVOY_PROMETHEUS_PORT", "EnvoyPrometheusPort", Kind::Int),
    ("ENVOY_SECURE_METRICS_PORT", "EnvoySecureMetricsPort", Kind::Int),
    ("ENVOY_SECURE_MERGED_METRICS_PORT", "EnvoySecureMergedMetricsPort", Kind::Int),
    ("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "ExitOnZeroActiveConnections", Kind::Bool),
    ("INBOUND_LISTENER_EXACT_BALANCE", "InboundListenerExactBalance", Kind::Bool),
    ("OUTBOUND_LISTENER_EXACT_BALANCE", "OutboundListenerExactBalance", Kind::Bool),
    ("CLOUDRUN_ADDR", "CloudrunAddr", Kind::Str),
    ("METADATA_DISCOVERY", "MetadataDiscovery", Kind::OptBool),
    ("ENVOY_SKIP_DEPRECATED_LOGS", "EnvoySkipDeprecatedLogs", Kind::Bool),
    ("WORKLOAD_IDENTITY_SOCKET_FILE", "WorkloadIdentitySocketFile", Kind::Str),
];

/// A metadata key whose value does not fit its typed field: pilot-agent does not
/// start with it, and neither does Weir.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("node metadata {key} ({origin}): {value} is not {expected}")]
pub struct MetadataError {
    pub key: String,
    /// Where such keys come from.
    pub origin: &'static str,
    pub value: String,
    pub expected: &'static str,
}

/// A `PodPortList` entry.
#[derive(Debug, Clone, PartialEq)]
struct PodPort {
    name: String,
    container_port: i64,
    protocol: String,
}

/// The typed fields' values (absent: Go's zero value).
#[derive(Debug, Clone, Default)]
pub struct Typed(BTreeMap<&'static str, Value>);

impl Typed {
    pub fn str(&self, key: &str) -> &str {
        self.0.get(key).and_then(Value::as_str).unwrap_or_default()
    }

    pub fn bool(&self, key: &str) -> bool {
        self.0.get(key).and_then(Value::as_bool).unwrap_or(false)
    }

    pub fn map(&self, key: &str) -> BTreeMap<String, String> {
        self.0
            .get(key)
            .and_then(Value::as_object)
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string())).collect())
            .unwrap_or_default()
    }

    fn set(&mut self, key: &'static str, value: Value) {
        self.0.insert(key, value);
    }

    fn set_map(&mut self, key: &'static str, map: &BTreeMap<String, String>) {
        self.set(
            key,
            Value::Object(map.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect()),
        );
    }

    /// The typed fields with Go's field names (`.metadata` in a bootstrap template).
    pub fn go_names(&self) -> Value {
        let mut out = Map::new();
        for (json, go, _) in FIELDS {
            if let Some(v) = self.0.get(json) {
                out.insert((*go).to_string(), v.clone());
            }
        }
        Value::Object(out)
    }
}

/// Where the metadata's locality comes from (the pod's labels).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Locality {
    pub region: String,
    pub zone: String,
    pub sub_zone: String,
}

/// What `GetNodeMetaData` is given (pilot-agent's `MetadataOptions`).
#[derive(Debug, Clone, Default)]
pub struct MetadataOptions {
    /// The process environment, in its order.
    pub envs: Vec<(String, String)>,
    pub proxy_metadata: BTreeMap<String, String>,
    /// The effective ProxyConfig as protobuf JSON (`PROXY_CONFIG`).
    pub proxy_config: Value,
    pub instance_ips: Vec<String>,
    pub sts_port: u16,
    pub pilot_san: Vec<String>,
    pub outlier_log_path: String,
    pub envoy_status_port: i64,
    pub envoy_prometheus_port: i64,
    pub envoy_secure_metrics_port: i64,
    pub envoy_secure_merged_metrics_port: i64,
    pub exit_on_zero_active_connections: bool,
    /// `PEER_METADATA_DISCOVERY` when set.
    pub metadata_discovery: Option<bool>,
    pub envoy_skip_deprecated_logs: bool,
    pub workload_identity_socket_file: String,
    /// `./etc/istio/pod/labels` and `annotations`, when readable.
    pub labels_file: Option<String>,
    pub annotations_file: Option<String>,
    /// `DNS_PROXY_ADDR` of the process.
    pub dns_proxy_addr: Option<String>,
    /// An SDS server answers on `./var/run/secrets/credential-uds/socket`.
    pub credential_socket_exists: bool,
    /// Another SDS server owns the workload socket (Weir serves only files).
    pub custom_credentials_file_exists: bool,
    /// `ISTIO_VERSION` unless the environment gives one.
    pub istio_version: String,
}

/// The node metadata, as sent and as its parts are used elsewhere.
#[derive(Debug, Clone, Default)]
pub struct NodeMetadata {
    /// The object istiod receives (typed fields merged with the raw keys).
    pub json: Map<String, Value>,
    /// The raw map (proxyMetadata and env keys), as the bootstrap options read it.
    pub raw: Map<String, Value>,
    pub typed: Typed,
    /// The typed fields alone, encoded (the gRPC bootstrap's node metadata).
    pub typed_json: Map<String, Value>,
    pub locality: Locality,
}

/// `GetNodeMetaData`.
pub fn resolve(o: &MetadataOptions) -> Result<NodeMetadata, MetadataError> {
    let mut raw = Map::new();
    for (k, v) in &o.proxy_metadata {
        if let Some(key) = k.strip_prefix("ISTIO_META_") {
            raw.insert(key.to_string(), Value::String(v.clone()));
        }
    }
    for (k, v) in &o.envs {
        if let Some(key) = k.strip_prefix("ISTIO_META_") {
            raw.insert(key.to_string(), Value::String(v.clone()));
        }
    }
    for (k, v) in &o.envs {
        if k.starts_with("ISTIO_METAJSON_") {
            match serde_json::from_str::<Value>(v) {
                Ok(Value::Object(m)) => raw.extend(m),
                _ => tracing::warn!(variable = %k, "not a JSON object: ignored, as pilot-agent ignores it"),
            }
        }
    }
    if let Some(addr) = o.dns_proxy_addr.as_ref().filter(|a| !a.is_empty()) {
        raw.insert("DNS_PROXY_ADDR".into(), Value::String(addr.clone()));
    }
    let mut typed = decode(&raw)?;
    complete(&mut typed, o);
    let (labels_aliased, mut labels) = labels(&mut typed, o);
    annotations(&mut typed, o);
    let locality = locality(&mut typed, &mut labels, labels_aliased);
    typed.set_map("LABELS", &labels);
    if labels.is_empty() {
        typed.0.remove("LABELS");
    }
    if o.credential_socket_exists {
        raw.insert("credential".into(), Value::String("true".into()));
    }
    if o.custom_credentials_file_exists {
        raw.insert("file-credential".into(), Value::String("true".into()));
    }
    if !typed.0.contains_key("METADATA_DISCOVERY") {
        let hbone = typed.bool("ENABLE_HBONE");
        typed.set("METADATA_DISCOVERY", Value::Bool(hbone));
    }
    let typed_json = encode(&typed);
    let mut json = typed_json.clone();
    for (k, v) in &raw {
        json.entry(k.clone()).or_insert_with(|| v.clone());
    }
    Ok(NodeMetadata { json, raw, typed, typed_json, locality })
}

/// What the agent itself knows overrides the environment (steps 7 to 10 and 16).
fn complete(typed: &mut Typed, o: &MetadataOptions) {
    if typed.str("ISTIO_VERSION").is_empty() {
        typed.set("ISTIO_VERSION", Value::String(o.istio_version.clone()));
    }
    let mut ips: Vec<String> = Vec::new();
    for ip in &o.instance_ips {
        if !ips.contains(ip) {
            ips.push(ip.clone());
        }
    }
    typed.set("INSTANCE_IPS", Value::Array(ips.into_iter().map(Value::String).collect()));
    if o.sts_port != 0 {
        typed.set("STS_PORT", Value::String(o.sts_port.to_string()));
    }
    for (key, port) in [
        ("ENVOY_STATUS_PORT", o.envoy_status_port),
        ("ENVOY_PROMETHEUS_PORT", o.envoy_prometheus_port),
        ("ENVOY_SECURE_METRICS_PORT", o.envoy_secure_metrics_port),
        ("ENVOY_SECURE_MERGED_METRICS_PORT", o.envoy_secure_merged_metrics_port),
    ] {
        typed.set(key, Value::from(port));
    }
    typed.set("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", Value::Bool(o.exit_on_zero_active_connections));
    match o.metadata_discovery {
        Some(v) => typed.set("METADATA_DISCOVERY", Value::Bool(v)),
        None => drop(typed.0.remove("METADATA_DISCOVERY")),
    }
    typed.set("ENVOY_SKIP_DEPRECATED_LOGS", Value::Bool(o.envoy_skip_deprecated_logs));
    typed.set("WORKLOAD_IDENTITY_SOCKET_FILE", Value::String(o.workload_identity_socket_file.clone()));
    typed.set("PROXY_CONFIG", o.proxy_config.clone());
    for (name, value) in &o.envs {
        let key = match name.as_str() {
            "POD_NAME" => "NAME",
            "POD_NAMESPACE" => "NAMESPACE",
            "SERVICE_ACCOUNT" => "SERVICE_ACCOUNT",
            _ => continue,
        };
        typed.set(key, Value::String(value.clone()));
    }
    typed.set("PILOT_SAN", Value::Array(o.pilot_san.iter().cloned().map(Value::String).collect()));
    typed.set("OUTLIER_LOG_PATH", Value::String(o.outlier_log_path.clone()));
}

/// LABELS and STATIC_LABELS: `ISTIO_METAJSON_LABELS` sets both (one map, so a later
/// change to one shows in the other until the pod's labels file replaces LABELS with
/// a copy). Returns whether they are still one map, and LABELS.
fn labels(typed: &mut Typed, o: &MetadataOptions) -> (bool, BTreeMap<String, String>) {
    let mut labels = typed.map("LABELS");
    let mut aliased = false;
    for (name, value) in &o.envs {
        if name == "ISTIO_METAJSON_LABELS" {
            // Go keeps the entries that decoded before a type error.
            let m: BTreeMap<String, String> = match serde_json::from_str::<Value>(value) {
                Ok(Value::Object(m)) => {
                    m.into_iter().filter_map(|(k, v)| v.as_str().map(|s| (k, s.to_string()))).collect()
                }
                _ => BTreeMap::new(),
            };
            if !m.is_empty() {
                typed.set_map("STATIC_LABELS", &m);
                labels = m;
                aliased = true;
            }
        }
    }
    if let Some(text) = &o.labels_file {
        match podinfo::parse(text) {
            Ok(file) => {
                let mut merged = typed.map("STATIC_LABELS");
                merged.extend(file.into_iter().filter(|(k, _)| k != "pod-template-hash"));
                labels = merged;
                aliased = false;
            }
            Err(e) => tracing::warn!(error = %e, "pod labels file ./etc/istio/pod/labels ignored"),
        }
    }
    (aliased, labels)
}

fn annotations(typed: &mut Typed, o: &MetadataOptions) {
    let Some(text) = &o.annotations_file else { return };
    match podinfo::parse(text) {
        Ok(file) => {
            let mut annotations = typed.map("ANNOTATIONS");
            annotations.extend(file);
            if !annotations.is_empty() {
                typed.set_map("ANNOTATIONS", &annotations);
            }
        }
        Err(e) => tracing::warn!(error = %e, "pod annotations file ./etc/istio/pod/annotations ignored"),
    }
}

/// The locality from `topology.istio.io/locality` or `istio-locality`
/// (`region.zone.sub_zone` or with `/`), written back as `istio-locality` with `/`.
fn locality(typed: &mut Typed, labels: &mut BTreeMap<String, String>, aliased: bool) -> Locality {
    let label = labels.get("topology.istio.io/locality").or_else(|| labels.get("istio-locality")).cloned();
    let Some(label) = label.filter(|l| !l.is_empty()) else { return Locality::default() };
    let sanitized = if label.contains('/') { label } else { label.replace('.', "/") };
    labels.insert("istio-locality".into(), sanitized.clone());
    if aliased {
        let mut statics = typed.map("STATIC_LABELS");
        statics.insert("istio-locality".into(), sanitized.clone());
        typed.set_map("STATIC_LABELS", &statics);
    }
    let mut parts = sanitized.split('/').map(String::from);
    Locality {
        region: parts.next().unwrap_or_default(),
        zone: parts.next().unwrap_or_default(),
        sub_zone: parts.next().unwrap_or_default(),
    }
}

/// The raw map decoded into the typed fields as Go's `json.Unmarshal` decodes it: keys
/// in order, each to the field with its exact name or else one equal to it ignoring
/// case; a value of the wrong type is an error.
fn decode(raw: &Map<String, Value>) -> Result<Typed, MetadataError> {
    let mut typed = Typed::default();
    for (key, value) in raw {
        let Some((name, _, kind)) = FIELDS
            .iter()
            .find(|(name, ..)| name == key)
            .or_else(|| FIELDS.iter().find(|(name, ..)| name.eq_ignore_ascii_case(key)))
        else {
            continue;
        };
        let bad = |expected| MetadataError {
            key: key.clone(),
            origin: "ISTIO_META_* / ISTIO_METAJSON_*",
            value: value.to_string(),
            expected,
        };
        let decoded = match (kind, value) {
            (Kind::Array | Kind::Map | Kind::Object | Kind::OptBool, Value::Null) => None,
            (Kind::Str | Kind::Int, Value::Null) => continue,
            (Kind::Str, Value::String(_)) => Some(value.clone()),
            (Kind::Str, _) => return Err(bad("a string")),
            (Kind::Bool | Kind::OptBool, Value::String(s)) => {
                Some(Value::Bool(weir_iptables::flags::parse_bool(s).ok_or_else(|| bad("a boolean string"))?))
            }
            (Kind::Bool | Kind::OptBool, _) => return Err(bad("a boolean string (\"true\"/\"false\")")),
            (Kind::List, Value::Null) => Some(Value::Array(Vec::new())),
            (Kind::List, Value::String(s)) => Some(Value::Array(if s.is_empty() {
                Vec::new()
            } else {
                s.split(',').map(|p| Value::String(p.to_string())).collect()
            })),
            (Kind::List, _) => return Err(bad("a comma-separated string")),
            (Kind::Ports, Value::String(s)) => {
                Some(ports_value(&pod_ports(s).ok_or_else(|| bad("a JSON list of ports"))?))
            }
            (Kind::Ports, _) => return Err(bad("a string holding a JSON list of ports")),
            (Kind::Int, Value::Number(n)) => Some(Value::from(
                n.as_i64()
                    .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9.0e18).map(|f| f as i64))
                    .ok_or_else(|| bad("a whole number"))?,
            )),
            (Kind::Int, _) => return Err(bad("a number")),
            (Kind::Map, Value::Object(m)) if m.values().all(|v| v.is_string() || v.is_null()) => {
                Some(value.clone())
            }
            (Kind::Map, _) => return Err(bad("an object of strings")),
            (Kind::Array, Value::Array(a)) if a.iter().all(Value::is_string) => Some(value.clone()),
            (Kind::Array, _) => return Err(bad("a list of strings")),
            (Kind::Object, Value::Object(_)) => Some(value.clone()),
            (Kind::Object, _) => return Err(bad("an object")),
        };
        match decoded {
            Some(v) => typed.set(name, v),
            None => drop(typed.0.remove(name)),
        }
    }
    Ok(typed)
}

/// A `PodPortList` string: a JSON array of `{name, containerPort, protocol}`.
fn pod_ports(text: &str) -> Option<Vec<PodPort>> {
    let Value::Array(items) = serde_json::from_str::<Value>(text).ok()? else { return None };
    items
        .into_iter()
        .map(|item| {
            let Value::Object(fields) = item else { return None };
            let mut port = PodPort { name: String::new(), container_port: 0, protocol: String::new() };
            for (k, v) in fields {
                match k.to_ascii_lowercase().as_str() {
                    "name" => port.name = v.as_str()?.to_string(),
                    "containerport" => port.container_port = v.as_i64()?,
                    "protocol" => port.protocol = v.as_str()?.to_string(),
                    _ => {}
                }
            }
            Some(port)
        })
        .collect()
}

/// Ports kept as a list of objects until encoding.
fn ports_value(ports: &[PodPort]) -> Value {
    Value::Array(
        ports
            .iter()
            .map(|p| {
                serde_json::json!({"name": p.name, "containerPort": p.container_port, "protocol": p.protocol})
            })
            .collect(),
    )
}

/// The typed fields as `json.Marshal` writes them (`omitempty` on each).
fn encode(typed: &Typed) -> Map<String, Value> {
    let mut out = Map::new();
    for (key, _, kind) in FIELDS {
        let Some(value) = typed.0.get(key) else { continue };
        let encoded = match kind {
            Kind::Str => value.as_str().filter(|s| !s.is_empty()).map(|s| Value::String(s.into())),
            Kind::Bool => value.as_bool().filter(|b| *b).map(|_| Value::String("true".into())),
            Kind::OptBool => value.as_bool().map(|b| Value::String(b.to_string())),
            Kind::List => value.as_array().filter(|a| !a.is_empty()).map(|a| {
                Value::String(a.iter().map(|v| v.as_str().unwrap_or_default()).collect::<Vec<_>>().join(","))
            }),
            Kind::Ports => {
                value.as_array().filter(|a| !a.is_empty()).map(|a| Value::String(go_ports_json(a)))
            }
            Kind::Int => value.as_i64().filter(|n| *n != 0).map(Value::from),
            Kind::Map => value.as_object().filter(|m| !m.is_empty()).map(|_| value.clone()),
            Kind::Object => value.is_object().then(|| value.clone()),
            Kind::Array => value.as_array().filter(|a| !a.is_empty()).map(|_| value.clone()),
        };
        if let Some(v) = encoded {
            out.insert((*key).to_string(), v);
        }
    }
    out
}

/// `json.Marshal([]PodPort)`: fields in struct order, `name` omitted when empty.
fn go_ports_json(ports: &[Value]) -> String {
    let quote = |v: &Value| crate::support::gotemplate::to_json(v);
    let items: Vec<String> = ports
        .iter()
        .map(|p| {
            let name = p["name"].as_str().unwrap_or_default();
            let mut fields = Vec::new();
            if !name.is_empty() {
                fields.push(format!("\"name\":{}", quote(&p["name"])));
            }
            fields.push(format!("\"containerPort\":{}", p["containerPort"].as_i64().unwrap_or(0)));
            fields.push(format!("\"protocol\":{}", quote(&p["protocol"])));
            format!("{{{}}}", fields.join(","))
        })
        .collect();
    format!("[{}]", items.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(env: &[(&str, &str)]) -> MetadataOptions {
        MetadataOptions {
            envs: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            instance_ips: vec!["10.0.0.5".into()],
            istio_version: "1.32.0".into(),
            envoy_status_port: 15021,
            envoy_prometheus_port: 15090,
            workload_identity_socket_file: "socket".into(),
            envoy_skip_deprecated_logs: true,
            proxy_config: serde_json::json!({"discoveryAddress": "istiod.istio-system.svc:15012"}),
            ..MetadataOptions::default()
        }
    }

    #[test]
    fn an_injected_sidecars_metadata_is_pilot_agents() {
        let mut o = options(&[
            ("POD_NAME", "hello-1"),
            ("POD_NAMESPACE", "default"),
            ("SERVICE_ACCOUNT", "hello"),
            ("ISTIO_META_CLUSTER_ID", "Kubernetes"),
            ("ISTIO_META_POD_PORTS", "[\n    {\"name\":\"http\",\"containerPort\":80}\n]"),
            ("ISTIO_META_APP_CONTAINERS", "hello"),
            ("ISTIO_META_INTERCEPTION_MODE", "REDIRECT"),
            ("ISTIO_META_WORKLOAD_NAME", "hello"),
            ("ISTIO_META_OWNER", "kubernetes://apis/apps/v1/namespaces/default/deployments/hello"),
            ("ISTIO_META_MESH_ID", "cluster.local"),
        ]);
        o.labels_file = Some(
            "app=\"hello\"\npod-template-hash=\"abc\"\ntopology.istio.io/locality=\"us.east.a\"\n".into(),
        );
        o.annotations_file = Some("kubectl.kubernetes.io/default-container=\"hello\"\n".into());
        o.pilot_san = vec!["istiod.istio-system.svc".into()];
        let m = resolve(&o).unwrap();
        let j = &m.json;
        assert_eq!(j["NAME"], "hello-1");
        assert_eq!(j["NAMESPACE"], "default");
        assert_eq!(j["CLUSTER_ID"], "Kubernetes");
        assert_eq!(
            j["POD_PORTS"], r#"[{"name":"http","containerPort":80,"protocol":""}]"#,
            "Go's re-encoding"
        );
        assert_eq!(
            j["LABELS"],
            serde_json::json!({"app": "hello", "istio-locality": "us/east/a", "topology.istio.io/locality": "us.east.a"})
        );
        assert!(j.get("STATIC_LABELS").is_none(), "no ISTIO_METAJSON_LABELS");
        assert_eq!(j["ANNOTATIONS"]["kubectl.kubernetes.io/default-container"], "hello");
        assert_eq!(j["ISTIO_VERSION"], "1.32.0");
        assert_eq!(j["METADATA_DISCOVERY"], "false");
        assert_eq!(j["ENVOY_SKIP_DEPRECATED_LOGS"], "true");
        assert_eq!(j["ENVOY_STATUS_PORT"], 15021);
        assert_eq!(j["PILOT_SAN"], serde_json::json!(["istiod.istio-system.svc"]));
        assert_eq!(m.locality, Locality { region: "us".into(), zone: "east".into(), sub_zone: "a".into() });
        assert!(j.get("OUTLIER_LOG_PATH").is_none(), "empty strings are left out");
    }

    #[test]
    fn raw_keys_fill_what_typed_fields_leave_out() {
        let m = resolve(&options(&[
            ("ISTIO_META_DNS_CAPTURE", "false"),
            ("ISTIO_META_CUSTOM", "x"),
            ("ISTIO_METAJSON_EXTRA", r#"{"app": "top-level", "n": 1.0}"#),
        ]))
        .unwrap();
        assert_eq!(
            m.json["DNS_CAPTURE"], "false",
            "a false StringBool is omitted, so the raw string comes back"
        );
        assert_eq!(m.json["CUSTOM"], "x");
        assert_eq!(m.json["app"], "top-level", "ISTIO_METAJSON_* merges at the top level, whatever its name");
        assert_eq!(crate::support::gotemplate::to_json(&m.json["n"]), "1");
    }

    #[test]
    fn names_match_ignoring_case_and_types_are_strict() {
        let m = resolve(&options(&[("ISTIO_META_namespace", "lower")])).unwrap();
        assert_eq!(m.json["NAMESPACE"], "lower");
        assert_eq!(m.json["namespace"], "lower", "and the raw key stays, as in Go");
        let e = resolve(&options(&[("ISTIO_META_ENABLE_HBONE", "yes")])).unwrap_err();
        assert_eq!(e.key, "ENABLE_HBONE");
        let e = resolve(&options(&[("ISTIO_METAJSON_X", r#"{"LABELS": ["a"]}"#)])).unwrap_err();
        assert!(e.to_string().contains("LABELS") && e.to_string().contains("object of strings"), "{e}");
        assert!(resolve(&options(&[("ISTIO_META_POD_PORTS", "not json")])).is_err());
    }

    #[test]
    fn metajson_labels_set_static_labels_as_one_map_until_the_labels_file_arrives() {
        let env = [("ISTIO_METAJSON_LABELS", r#"{"app": "a", "istio-locality": "r.z"}"#)];
        let m = resolve(&options(&env)).unwrap();
        assert_eq!(
            m.json["STATIC_LABELS"]["istio-locality"], "r/z",
            "aliased: the sanitised locality shows in both"
        );
        assert_eq!(m.json["LABELS"]["istio-locality"], "r/z");
        let mut o = options(&env);
        o.labels_file = Some("app=\"b\"\n".into());
        let m = resolve(&o).unwrap();
        assert_eq!(m.json["LABELS"], serde_json::json!({"app": "b", "istio-locality": "r/z"}));
        assert_eq!(
            m.json["STATIC_LABELS"]["istio-locality"], "r.z",
            "a copy: the file's labels do not reach it"
        );
    }

    #[test]
    fn an_invalid_pod_file_is_ignored_whole() {
        let mut o = options(&[]);
        o.labels_file = Some("app=\"a\"\nbad=value\n".into());
        assert!(resolve(&o).unwrap().json.get("LABELS").is_none());
    }
}
