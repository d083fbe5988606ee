//! Istio's bootstrap template data: every key pilot-agent puts in the map its template
//! reads (`pkg/bootstrap/config.go`, `option/`), computed the same way from the node,
//! ProxyConfig, the pod's annotations and the environment. Values carry the Go type the
//! template sees (strings, ints, bools, lists; durations already in Go's text), so a
//! template prints them as pilot-agent's does. A key pilot-agent skips is absent.
//! Pure: the one file it implies (Lightstep's token) is returned, not written.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use serde_json::{Map, Value, json};

use super::sockets;
use crate::{sidecar::node_metadata::NodeMetadata, support::text::go_duration};

/// What the options are computed from.
#[derive(Debug, Clone)]
pub struct BootstrapInputs<'a> {
    pub node_id: &'a str,
    pub cluster: &'a str,
    pub metadata: &'a NodeMetadata,
    /// The effective ProxyConfig as protobuf JSON (`PROXY_CONFIG`).
    pub proxy_config: &'a Value,
    pub env: BootstrapEnv,
    /// `--stsPort`.
    pub sts_port: u16,
    /// `--outlierLogPath`.
    pub outlier_log_path: &'a str,
    /// `--log_as_json`.
    pub log_as_json: bool,
}

/// The environment the options read.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BootstrapEnv {
    /// `ISTIO_DELTA_XDS` (true: Delta ADS).
    pub delta_xds: bool,
    /// `ISTIO_DUAL_STACK`.
    pub dual_stack: bool,
    /// `ENVOY_STATUS_PORT_ENABLE_PROXY_PROTOCOL`.
    pub status_port_proxy_protocol: bool,
    /// `HTTP_STRIP_FRAGMENT_FROM_PATH_UNSAFE_IF_DISABLED` (default true).
    pub strip_fragment_from_path: bool,
    /// `COMPLIANCE_POLICY`.
    pub compliance_policy: String,
    /// `XDS_ROOT_CA`.
    pub xds_root_cert: String,
    /// `HOST_IP`, for `$(HOST_IP)` addresses.
    pub host_ip: Option<String>,
}

/// The data map and the files it implies.
#[derive(Debug, Clone, Default)]
pub struct TemplateData {
    pub values: Map<String, Value>,
    /// Files to write before Envoy starts (Lightstep's access token).
    pub files: Vec<(PathBuf, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    #[error("{what} {address:?} is not host:port")]
    Address { what: &'static str, address: String },
    #[error("Stackdriver tracing needs the GCP project in the platform metadata (gcp_project)")]
    StackdriverProject,
}

const REQUIRED_PREFIXES: &str = "cluster_manager,listener_manager,server,cluster.xds-grpc,wasm";
const RBAC_SUFFIXES: &str = "rbac.allowed,rbac.denied,shadow_allowed,shadow_denied";
const REQUIRED_REGEX: &str = r"vhost\..*\.route\..*";

/// The template data for `i` (`Config.toTemplateParams`).
pub fn template_data(i: &BootstrapInputs<'_>) -> Result<TemplateData, OptionsError> {
    let mut o = Map::new();
    let pc = i.proxy_config;
    let meta = &i.metadata.typed;
    let mut set = |k: &str, v: Value| {
        o.insert(k.to_string(), v);
    };
    set("nodeID", json!(i.node_id));
    set("nodeType", json!(i.node_id.split('~').next().unwrap_or_default()));
    set("pilot_SAN", json!(san_list(&pc_strings(&i.metadata.json, "PILOT_SAN"))));
    if !i.outlier_log_path.is_empty() {
        set("outlier_log_path", json!(i.outlier_log_path));
    }
    if i.metadata.raw.contains_key("file-credential") {
        set("custom_file_path", json!("./var/run/secrets/credential-uds/files-socket"));
    }
    set("log_json", json!(i.log_as_json));
    let discovery = pc_str(pc, "discoveryAddress");
    set("discovery_host", json!(discovery.split(':').next().unwrap_or_default()));
    set("metadata", meta.go_names());
    let waypoint = i.node_id.starts_with("waypoint~");
    let xds_type = if i.env.delta_xds || waypoint { "DELTA_GRPC" } else { "GRPC" };
    set("xds_type", json!(xds_type));
    let discovery_on = meta.bool("METADATA_DISCOVERY") || waypoint;
    set("metadata_discovery", json!(discovery_on && xds_type != "GRPC"));
    let proxy_metadata = pc.get("proxyMetadata").and_then(Value::as_object);
    let localhost_only = proxy_metadata
        .and_then(|m| m.get("METRICS_LOCALHOST_ACCESS_ONLY"))
        .is_some_and(|v| v.as_str() == Some("true"));
    set("metrics_localhost_access_only", json!(localhost_only));
    for (key, meta_key) in [
        ("secure_metrics_port", "ENVOY_SECURE_METRICS_PORT"),
        ("secure_merged_metrics_port", "ENVOY_SECURE_MERGED_METRICS_PORT"),
    ] {
        if let Some(port) = i.metadata.json.get(meta_key).and_then(Value::as_i64).filter(|p| *p != 0) {
            set(key, json!(port));
        }
    }
    if i.sts_port > 0 {
        set("sts", json!(true));
        set("sts_port", json!(i.sts_port));
    }
    set("workload_identity_socket_file", json!(meta.str("WORKLOAD_IDENTITY_SOCKET_FILE")));
    let l = &i.metadata.locality;
    for (key, value) in [("region", &l.region), ("zone", &l.zone), ("sub_zone", &l.sub_zone)] {
        if !value.is_empty() {
            set(key, json!(value));
        }
    }
    stats(i, &mut set);
    set("meta_json_str", json!(crate::support::gotemplate::to_json(&Value::Object(i.metadata.json.clone()))));
    set("runtime_flags", json!(runtime_flags(i)));
    for key in ["ENVOY_STATUS_PORT", "ENVOY_PROMETHEUS_PORT"] {
        let port = i.metadata.json.get(key).and_then(Value::as_i64).unwrap_or(0);
        set(&key.to_ascii_lowercase(), json!(port));
    }
    set("global_downstream_max_connections", json!(global_downstream_max_connections(pc)));
    ip_family(i, &mut set);
    if i.env.status_port_proxy_protocol {
        set("envoy_status_port_enable_proxy_protocol", json!(true));
    }
    if meta.bool("ENABLE_SELF_DISCOVERY") {
        set("enable_self_discovery", json!(true));
    }
    let files = proxy_config_options(i, &mut set)?;
    if let Some(Value::String(lrs)) = i.metadata.raw.get("LOAD_STATS_CONFIG_JSON") {
        set("load_stats_config_json_str", json!(lrs));
    }
    Ok(TemplateData { values: o, files })
}

fn pc_str<'a>(pc: &'a Value, key: &str) -> &'a str {
    pc.get(key).and_then(Value::as_str).unwrap_or_default()
}

fn pc_strings(meta: &Map<String, Value>, key: &str) -> Vec<String> {
    meta.get(key)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        .unwrap_or_default()
}

/// `sanConverter`: `[{"exact":"<san>"},...]`, unescaped.
fn san_list(sans: &[String]) -> String {
    format!("[{}]", sans.iter().map(|s| format!("{{\"exact\":\"{s}\"}}")).collect::<Vec<_>>().join(","))
}

/// Stats inclusions, tags, histogram buckets and intervals (`getStatsOptions`).
fn stats(i: &BootstrapInputs<'_>, set: &mut impl FnMut(&str, Value)) {
    let annotations = i.metadata.typed.map("ANNOTATIONS");
    let matcher = i.proxy_config.get("proxyStatsMatcher");
    let ips = pc_instance_ips(i);
    let exit_on_zero = i.metadata.typed.bool("EXIT_ON_ZERO_ACTIVE_CONNECTIONS");
    let suffixes =
        if exit_on_zero { format!("{RBAC_SUFFIXES},downstream_cx_active") } else { RBAC_SUFFIXES.into() };
    for (key, annotation, required, field) in [
        (
            "inclusionPrefix",
            "sidecar.istio.io/statsInclusionPrefixes",
            REQUIRED_PREFIXES.to_string(),
            "inclusionPrefixes",
        ),
        ("inclusionSuffix", "sidecar.istio.io/statsInclusionSuffixes", suffixes, "inclusionSuffixes"),
        (
            "inclusionRegexps",
            "sidecar.istio.io/statsInclusionRegexps",
            REQUIRED_REGEX.to_string(),
            "inclusionRegexps",
        ),
    ] {
        let configured = matcher.and_then(|m| m.get(field)).and_then(Value::as_array);
        let list = inclusions(annotations.get(annotation).map(String::as_str), configured, &required, &ips);
        set(key, json!(list));
    }
    let mut tags: Vec<String> = Vec::new();
    let configured = i.proxy_config.get("extraStatTags").and_then(Value::as_array);
    let from_config = configured.into_iter().flatten().filter_map(Value::as_str).map(String::from);
    let from_annotation = annotations
        .get("sidecar.istio.io/extraStatTags")
        .map(|a| a.split(',').map(String::from).collect::<Vec<_>>())
        .unwrap_or_default();
    for tag in from_config.chain(from_annotation).filter(|t| !t.is_empty()) {
        if !tags.contains(&tag) {
            tags.push(tag);
        }
    }
    if !tags.is_empty() {
        set("extraStatTags", json!(tags));
    }
    set("histogram_buckets", histogram_buckets(annotations.get("sidecar.istio.io/statsHistogramBuckets")));
    let flush = annotations
        .get("sidecar.istio.io/statsFlushInterval")
        .and_then(|v| crate::support::text::parse_duration(v));
    if let Some(d) = flush.filter(|d| !d.is_zero()) {
        set("stats_flush_interval", json!(go_duration(d)));
    }
    if let Some(text) = annotations.get("sidecar.istio.io/statsEvictionInterval") {
        let flush = flush.unwrap_or(Duration::from_secs(5));
        match crate::support::text::parse_duration(text) {
            None => {
                tracing::warn!(annotation = %text, "sidecar.istio.io/statsEvictionInterval is not a duration: ignored")
            }
            // Istio divides by the flush interval; a zero one leaves eviction out here.
            Some(e) if flush.is_zero() || e.as_nanos() % flush.as_nanos() != 0 => tracing::warn!(
                eviction = %text,
                flush = %go_duration(flush),
                "StatsEvictionInterval must be a multiple of the StatsFlushInterval: ignored"
            ),
            Some(e) => set("stats_eviction_interval", json!(format!("{}s", e.as_secs()))),
        }
    }
}

fn pc_instance_ips(i: &BootstrapInputs<'_>) -> Vec<String> {
    i.metadata
        .json
        .get("INSTANCE_IPS")
        .and_then(Value::as_str)
        .map(|s| s.split(',').filter(|p| !p.is_empty()).map(String::from).collect())
        .unwrap_or_default()
}

/// `parseOption`: the annotation (split on `,`, nothing trimmed) else ProxyConfig's
/// list, then the required entries; `{pod_ip}` repeated once per IP.
fn inclusions(
    annotation: Option<&str>,
    configured: Option<&Vec<Value>>,
    required: &str,
    ips: &[String],
) -> Vec<String> {
    let mut list: Vec<String> = match (annotation.filter(|a| !a.is_empty()), configured) {
        (Some(a), _) => a.split(',').map(String::from).collect(),
        (None, Some(c)) => c.iter().filter_map(Value::as_str).map(String::from).collect(),
        (None, None) => Vec::new(),
    };
    list.extend(required.split(',').map(String::from));
    list.into_iter()
        .flat_map(|p| {
            if p.contains("{pod_ip}") {
                ips.iter().map(|ip| p.replace("{pod_ip}", ip)).collect()
            } else {
                vec![p]
            }
        })
        .collect()
}

/// `sidecar.istio.io/statsHistogramBuckets`: `{"prefix": [bounds]}` as Envoy's
/// bucket settings, sorted by prefix; null when absent or not that shape.
fn histogram_buckets(annotation: Option<&String>) -> Value {
    let Some(text) = annotation else { return Value::Null };
    match serde_json::from_str::<BTreeMap<String, Vec<f64>>>(text) {
        Ok(map) => Value::Array(
            map.into_iter()
                .map(|(prefix, buckets)| json!({"match": {"prefix": prefix}, "buckets": buckets}))
                .collect(),
        ),
        Err(e) => {
            tracing::warn!(error = %e, "sidecar.istio.io/statsHistogramBuckets is not {{\"prefix\": [numbers]}}: ignored");
            Value::Null
        }
    }
}

/// The static runtime layer (`extractRuntimeFlags`), as compact Go JSON.
fn runtime_flags(i: &BootstrapInputs<'_>) -> String {
    let mut flags = Map::new();
    flags.insert("re2.max_program_size.error_level".into(), json!("32768"));
    flags.insert(
        "envoy.deprecated_features:envoy.config.listener.v3.Listener.hidden_envoy_deprecated_use_original_dst".into(),
        json!(true),
    );
    flags.insert("envoy.reloadable_features.http_reject_path_with_fragment".into(), json!(false));
    flags.insert("envoy.reloadable_features.fixed_heap_use_allocated".into(), json!(true));
    flags.insert("envoy.reloadable_features.coalesce_lb_rebuilds_on_batch_update".into(), json!(false));
    if i.env.compliance_policy == "fips-140-2" {
        flags.insert("envoy.reloadable_features.google_grpc_disable_tls_13".into(), json!(true));
    }
    if !i.env.strip_fragment_from_path {
        flags.insert(
            "envoy.reloadable_features.http_strip_fragment_from_path_unsafe_if_disabled".into(),
            json!("false"),
        );
    }
    if let Some(values) = i.proxy_config.get("runtimeValues").and_then(Value::as_object) {
        for (k, v) in values {
            let v = v.as_str().unwrap_or_default();
            match v {
                "" => drop(flags.remove(k)),
                "true" => drop(flags.insert(k.clone(), json!(true))),
                "false" => drop(flags.insert(k.clone(), json!(false))),
                other => drop(flags.insert(k.clone(), json!(other))),
            }
        }
    }
    crate::support::gotemplate::to_json(&Value::Object(flags))
}

/// connectionSettings' limit, else proxyMetadata's, else the runtime value, else 2^31-1.
fn global_downstream_max_connections(pc: &Value) -> i64 {
    let from_settings = pc
        .pointer("/connectionSettings/globalDownstreamConnectionLimit")
        .and_then(Value::as_i64)
        .filter(|n| *n > 0);
    let parse = |v: Option<&Value>| {
        v.and_then(Value::as_str).and_then(|s| s.trim_start_matches('+').parse::<i64>().ok())
    };
    from_settings
        .or_else(|| parse(pc.pointer("/proxyMetadata/ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS")))
        .or_else(|| parse(pc.pointer("/runtimeValues/overload.global_downstream_max_connections")))
        .unwrap_or(i64::from(i32::MAX))
}

/// Loopback, wildcard and DNS family from the proxy's IPs (`AllIPv4`, `AllIPv6`).
fn ip_family(i: &BootstrapInputs<'_>, set: &mut impl FnMut(&str, Value)) {
    let ips: Vec<std::net::IpAddr> = pc_instance_ips(i).iter().filter_map(|s| s.parse().ok()).collect();
    let all_v4 = ips.iter().all(|ip| ip.is_ipv4());
    let all_v6 = ips.iter().all(|ip| ip.is_ipv6());
    let (v4, v6) = (("127.0.0.1", "0.0.0.0"), ("::1", "::"));
    let (main, extra, family) = if all_v4 {
        (v4, None, "V4_ONLY")
    } else if all_v6 {
        (v6, None, "V6_ONLY")
    } else if !i.env.dual_stack {
        (v4, None, "V4_ONLY")
    } else if ips
        .first()
        .is_some_and(|ip| matches!(ip, std::net::IpAddr::V6(a) if !a.is_unicast_link_local()))
    {
        (v6, Some(v4), "ALL")
    } else {
        (v4, Some(v6), "ALL")
    };
    set("localhost", json!(main.0));
    set("wildcard", json!(main.1));
    set("dns_lookup_family", json!(family));
    if let Some((localhost, wildcard)) = extra {
        set("additional_localhost", json!(localhost));
        set("additional_wildcard", json!(wildcard));
        set("dual_stack", json!(true));
    }
}

/// ProxyConfig's parts (`getProxyConfigOptions`): config, cluster, addresses, tracing,
/// metrics and access-log services, stats compression.
fn proxy_config_options(
    i: &BootstrapInputs<'_>,
    set: &mut impl FnMut(&str, Value),
) -> Result<Vec<(PathBuf, String)>, OptionsError> {
    let pc = i.proxy_config;
    let host_ip = i.env.host_ip.as_deref();
    set("config", go_proxy_config(pc));
    set("cluster", json!(i.cluster));
    let discovery = pc_str(pc, "discoveryAddress");
    set("discovery_address", json!(discovery));
    if !discovery.is_empty() {
        set("pilot_grpc_address", json!(address("discoveryAddress", discovery, host_ip)?));
    }
    let statsd = pc_str(pc, "statsdUdpAddress");
    if !statsd.is_empty() {
        set("statsd", json!(address("statsdUdpAddress", statsd, host_ip)?));
    }
    set("xds_root_cert", json!(i.env.xds_root_cert));
    let tls_meta = sockets::TlsMetadata::from(&i.metadata.typed);
    let mut files = Vec::new();
    if let Some(tracing) = pc.get("tracing").and_then(Value::as_object) {
        let tracer_address =
            |name: &str| tracing.get(name).and_then(|t| t.get("address")).and_then(Value::as_str);
        let mut h2 = false;
        if let Some(a) = tracer_address("zipkin").filter(|a| !a.is_empty()) {
            set("zipkin", json!(address("tracing.zipkin.address", a, host_ip)?));
        } else if let Some(lightstep) = tracing.get("lightstep") {
            let token_file = PathBuf::from(pc_str(pc, "configPath")).join("lightstep_access_token.txt");
            let token = lightstep.get("accessToken").and_then(Value::as_str).unwrap_or_default();
            files.push((token_file.clone(), token.to_string()));
            if let Some(a) = tracer_address("lightstep").filter(|a| !a.is_empty()) {
                set("lightstep", json!(address("tracing.lightstep.address", a, host_ip)?));
            }
            set("lightstepToken", json!(token_file.display().to_string()));
            h2 = true;
        } else if let Some(a) = tracer_address("datadog").filter(|a| !a.is_empty()) {
            set("datadog", json!(address("tracing.datadog.address", a, host_ip)?));
        } else if tracing.contains_key("stackdriver") {
            return Err(OptionsError::StackdriverProject);
        }
        if let Some(tls) = tracing.get("tlsSettings") {
            set("tracing_tls", json!(sockets::transport_socket(tls, "tracer", &tls_meta, h2)));
        }
    }
    for (service, prefix, sni) in [
        ("envoyMetricsService", "envoy_metrics_service", "envoy_metrics_service"),
        ("envoyAccessLogService", "envoy_accesslog_service", "envoy_accesslog_service"),
    ] {
        let Some(svc) = pc.get(service) else { continue };
        let Some(a) = svc.get("address").and_then(Value::as_str).filter(|a| !a.is_empty()) else { continue };
        set(&format!("{prefix}_address"), json!(address(service, a, host_ip)?));
        if let Some(tls) = svc.get("tlsSettings") {
            set(&format!("{prefix}_tls"), json!(sockets::transport_socket(tls, sni, &tls_meta, true)));
        }
        if let Some(keepalive) = svc.get("tcpKeepalive") {
            set(&format!("{prefix}_tcp_keepalive"), json!(sockets::keepalive(keepalive)));
        }
    }
    let compression = pc.get("statsCompression").and_then(Value::as_bool).unwrap_or(true);
    set("envoy_metrics_stats_compression", json!(compression));
    Ok(files)
}

/// ProxyConfig's fields as the template's `.config` (a Go struct) names them.
fn go_proxy_config(pc: &Value) -> Value {
    let mut out = Map::new();
    for (json_name, go_name) in [
        ("configPath", "ConfigPath"),
        ("binaryPath", "BinaryPath"),
        ("serviceCluster", "ServiceCluster"),
        ("discoveryAddress", "DiscoveryAddress"),
        ("statsdUdpAddress", "StatsdUdpAddress"),
        ("controlPlaneAuthPolicy", "ControlPlaneAuthPolicy"),
        ("customConfigFile", "CustomConfigFile"),
        ("proxyBootstrapTemplatePath", "ProxyBootstrapTemplatePath"),
    ] {
        out.insert(go_name.into(), pc.get(json_name).cloned().unwrap_or(json!("")));
    }
    for (json_name, go_name) in [
        ("proxyAdminPort", "ProxyAdminPort"),
        ("statusPort", "StatusPort"),
        ("statNameLength", "StatNameLength"),
    ] {
        out.insert(go_name.into(), pc.get(json_name).cloned().unwrap_or(json!(0)));
    }
    Value::Object(out)
}

/// `addressConverter`: `{"address": "<host>", "port_value": <port>}` for `host:port`,
/// `$(HOST_IP)` replaced; an address without a port stops the bootstrap.
fn address(what: &'static str, addr: &str, host_ip: Option<&str>) -> Result<String, OptionsError> {
    let bad = || OptionsError::Address { what, address: addr.to_string() };
    let (host, port) = match addr.strip_prefix('[') {
        Some(rest) => {
            let (host, port) = rest.split_once("]:").ok_or_else(bad)?;
            (host, port)
        }
        None => {
            let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
            if host.contains(':') {
                return Err(bad());
            }
            (host, port)
        }
    };
    let host = match host_ip.filter(|h| !h.is_empty()) {
        Some(ip) if host == "$(HOST_IP)" => ip,
        _ => host,
    };
    Ok(format!("{{\"address\": \"{host}\", \"port_value\": {port}}}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_convert_as_istios_and_refuse_a_missing_port() {
        assert_eq!(
            address("x", "10.1.1.1:9125", None).unwrap(),
            r#"{"address": "10.1.1.1", "port_value": 9125}"#
        );
        assert_eq!(address("x", "[::1]:15012", None).unwrap(), r#"{"address": "::1", "port_value": 15012}"#);
        assert_eq!(
            address("x", "$(HOST_IP):8126", Some("10.0.0.7")).unwrap(),
            r#"{"address": "10.0.0.7", "port_value": 8126}"#
        );
        assert_eq!(
            address("statsdUdpAddress", "statsd", None).unwrap_err().to_string(),
            "statsdUdpAddress \"statsd\" is not host:port"
        );
        assert!(address("x", "::1:80", None).is_err());
    }

    #[test]
    fn inclusions_expand_pod_ips_and_append_required_entries() {
        let ips = vec!["10.0.0.1".to_string(), "10.0.0.2".to_string()];
        let list = inclusions(Some("a,http.{pod_ip}_"), None, "x,y", &ips);
        assert_eq!(list, ["a", "http.10.0.0.1_", "http.10.0.0.2_", "x", "y"]);
        let configured = vec![json!("c")];
        assert_eq!(inclusions(None, Some(&configured), "x", &ips), ["c", "x"]);
        assert_eq!(
            inclusions(Some("a"), Some(&configured), "x", &ips),
            ["a", "x"],
            "the annotation replaces"
        );
    }
}
