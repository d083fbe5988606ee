//! Weir's built-in bootstrap: the document Istio's template makes from the same data
//! (`options.rs`), built as JSON values rather than text — used when neither a
//! `--templateFile`, `proxyBootstrapTemplatePath` nor the image's template is there.
//! Istio's 29 bootstrap goldens hold it to the template's output, key for key.

use serde_json::{Map, Value, json};

/// The data map, read as the template reads it (absent or zero is false).
struct Data<'a>(&'a Map<String, Value>);

impl Data<'_> {
    fn get(&self, k: &str) -> &Value {
        self.0.get(k).unwrap_or(&Value::Null)
    }
    fn str(&self, k: &str) -> &str {
        self.get(k).as_str().unwrap_or_default()
    }
    fn on(&self, k: &str) -> bool {
        match self.get(k) {
            Value::Null => false,
            Value::Bool(b) => *b,
            Value::Number(n) => n.as_f64() != Some(0.0),
            Value::String(s) => !s.is_empty(),
            Value::Array(a) => !a.is_empty(),
            Value::Object(o) => !o.is_empty(),
        }
    }
    fn list(&self, k: &str) -> Vec<&str> {
        self.get(k).as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default()
    }
    /// A value the template inserts as JSON text (`{{ .runtime_flags }}`).
    fn json(&self, k: &str) -> Result<Value, BuiltinError> {
        serde_json::from_str(self.str(k))
            .map_err(|e| BuiltinError { key: k.to_string(), message: e.to_string() })
    }
}

/// A data value that is not the JSON text the bootstrap needs there.
#[derive(Debug, Clone, thiserror::Error)]
#[error("bootstrap option {key} is not valid JSON: {message}")]
pub struct BuiltinError {
    pub key: String,
    pub message: String,
}

/// The bootstrap document for `data`.
pub fn render(data: &Map<String, Value>) -> Result<Value, BuiltinError> {
    let d = Data(data);
    let mut doc = json!({
        "application_log_config": {"log_format": if d.on("log_json") {
            json!({"json_format": {"time": "%Y-%m-%dT%T.%fZ", "level": "%l", "scope": "envoy %n", "msg": "%j", "caller": "%g:%#", "thread": "%t"}})
        } else {
            json!({"text_format": "%Y-%m-%dT%T.%fZ\t%l\tenvoy %n %g:%#\t%v\tthread=%t"})
        }},
        "node": {
            "id": d.str("nodeID"),
            "cluster": d.str("cluster"),
            "locality": locality(&d),
            "metadata": d.json("meta_json_str")?,
        },
        "layered_runtime": {"layers": [
            {"name": "global config", "static_layer": d.json("runtime_flags")?},
            {"name": "admin", "admin_layer": {}}
        ]},
        "bootstrap_extensions": bootstrap_extensions(&d),
        "stats_config": stats_config(&d),
        "admin": {
            "access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog", "path": "/dev/null"}}],
            "profile_path": "/var/lib/istio/data/envoy.prof",
            "address": {"socket_address": {"address": d.str("localhost"), "port_value": d.get("config")["ProxyAdminPort"]}}
        },
        "dynamic_resources": {
            "lds_config": ads_source(),
            "cds_config": ads_source(),
            "ads_config": {
                "api_type": d.str("xds_type"),
                "set_node_on_first_message_only": true,
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]
            }
        },
        "static_resources": {"clusters": clusters(&d)?, "listeners": listeners(&d)},
        "deferred_stat_options": {"enable_deferred_creation_stats": true},
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": d.get("global_downstream_max_connections")
            }
        }]}
    });
    for key in ["stats_flush_interval", "stats_eviction_interval"] {
        if d.on(key) {
            doc[key] = json!(d.str(key));
        }
    }
    if let Some(tracing) = tracing(&d) {
        doc["tracing"] = tracing;
    }
    let sinks = stats_sinks(&d)?;
    if !sinks.is_empty() {
        doc["stats_sinks"] = Value::Array(sinks);
    }
    if d.on("outlier_log_path") || d.on("load_stats_config_json_str") || d.on("enable_self_discovery") {
        let mut manager = json!({"enable_deferred_cluster_creation": true});
        if d.on("outlier_log_path") {
            manager["outlier_detection"] = json!({"event_log_path": d.str("outlier_log_path")});
        }
        if d.on("load_stats_config_json_str") {
            manager["load_stats_config"] = d.json("load_stats_config_json_str")?;
        }
        if d.on("enable_self_discovery") {
            manager["local_cluster_name"] = json!("local_cluster");
        }
        doc["cluster_manager"] = manager;
    }
    Ok(doc)
}

fn locality(d: &Data<'_>) -> Value {
    let mut l = Map::new();
    for key in ["region", "zone", "sub_zone"] {
        if d.on(key) {
            l.insert(key.into(), json!(d.str(key)));
        }
    }
    Value::Object(l)
}

fn ads_source() -> Value {
    json!({"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"})
}

fn bootstrap_extensions(d: &Data<'_>) -> Value {
    let mut extensions = Vec::new();
    if d.on("metadata_discovery") {
        extensions.push(json!({"name": "metadata_discovery", "typed_config": {
            "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
            "type_url": "type.googleapis.com/istio.workload.BootstrapExtension",
            "value": {"config_source": {"ads": {}}}}}));
    }
    extensions.push(json!({"name": "envoy.bootstrap.internal_listener", "typed_config": {
        "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
        "type_url": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener",
        "value": {"buffer_size_kb": 64}}}));
    Value::Array(extensions)
}

/// Istio's stat tags (the dashboards' dimensions), the extra tags, the matcher.
fn stats_config(d: &Data<'_>) -> Value {
    let tag = |name: &str, regex: &str| json!({"tag_name": name, "regex": regex});
    let mut tags = vec![
        tag("cluster_name", r"^cluster(\.(.+);)"),
        tag(
            "http_conn_manager_prefix",
            r"^http\.(((?:[_.[:digit:]\w]*|[_\[\]aAbBcCdDeEfF[:digit:]\w\:]*));\.)",
        ),
        tag("thread_name", r"^server(\.(.+))\.watchdog"),
        tag("tcp_prefix", r"^tcp\.((.*?)\.)\w+?$"),
        tag("response_code", r"_rq(_(\d{3}))$"),
        tag("response_code_class", r"_rq(_(\dxx))$"),
        tag(
            "http_conn_manager_listener_prefix",
            r"^listener(?=\.).*?\.http\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)",
        ),
        tag("listener_address", r"^listener\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)"),
        tag("mongo_prefix", r"^mongo\.(.+?)\.(collection|cmd|cx_|op_|delays_|decoding_)(.*?)$"),
    ];
    for extra in d.list("extraStatTags") {
        tags.push(tag(extra, &format!(r"({extra}=\.=(.*?);\.;)")));
    }
    tags.extend([
        tag("cache", r"(cache\.(.+?)\.)"),
        tag("component", r"(component\.(.+?)\.)"),
        tag("tag", r"(tag\.(.+?);\.)"),
        tag("wasm_filter", r"(wasm_filter\.(.+?)\.)"),
        tag("authz_enforce_result", r"rbac(\.(allowed|denied))"),
        tag("authz_dry_run_action", r"(\.istio_dry_run_(allow|deny)_)"),
        tag("authz_dry_run_result", r"(\.shadow_(allowed|denied))"),
    ]);
    let mut patterns = vec![json!({"prefix": "reporter="})];
    if d.on("metadata_discovery") {
        patterns.push(json!({"prefix": "workload_discovery"}));
    }
    patterns.extend(d.list("inclusionPrefix").into_iter().map(|p| json!({"prefix": p})));
    patterns.extend(d.list("inclusionSuffix").into_iter().map(|s| json!({"suffix": s})));
    patterns.extend(d.list("inclusionRegexps").into_iter().map(|r| json!({"safe_regex": {"regex": r}})));
    patterns.extend([json!({"prefix": "component"}), json!({"prefix": "istio"})]);
    let mut config = json!({
        "use_all_default_tags": false,
        "stats_tags": tags,
        "stats_matcher": {"inclusion_list": {"patterns": patterns}}
    });
    if d.on("histogram_buckets") {
        config["histogram_bucket_settings"] = d.get("histogram_buckets").clone();
    }
    config
}

fn socket_address(address: &str, port: &Value) -> Value {
    json!({"socket_address": {"protocol": "TCP", "address": address, "port_value": port}})
}

fn http2() -> Value {
    json!({"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}})
}

/// A static cluster of one endpoint at `address`.
fn static_cluster(name: &str, address: Value, connect_timeout: &str) -> Value {
    json!({
        "name": name,
        "alt_stat_name": format!("{name};"),
        "type": "STATIC",
        "connect_timeout": connect_timeout,
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}]}
    })
}

/// A STRICT_DNS cluster to a service's `{"address", "port_value"}`.
fn dns_cluster(d: &Data<'_>, name: &str, socket_address: Value) -> Value {
    json!({
        "name": name,
        "alt_stat_name": format!("{name};"),
        "type": "STRICT_DNS",
        "respect_dns_ttl": true,
        "dns_lookup_family": d.str("dns_lookup_family"),
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": socket_address}}}]}]}
    })
}

fn clusters(d: &Data<'_>) -> Result<Vec<Value>, BuiltinError> {
    let config = d.get("config");
    let localhost = d.str("localhost");
    let mut sds = static_cluster(
        "sds-grpc",
        json!({"pipe": {"path": format!("./var/run/secrets/workload-spiffe-uds/{}", d.str("workload_identity_socket_file"))}}),
        "1s",
    );
    sds["typed_extension_protocol_options"] = http2();
    let mut clusters = vec![
        static_cluster("prometheus_stats", socket_address(localhost, &config["ProxyAdminPort"]), "0.250s"),
        static_cluster("agent", socket_address(localhost, &config["StatusPort"]), "0.250s"),
        sds,
    ];
    if d.on("custom_file_path") {
        let mut files =
            static_cluster("sds-files-grpc", json!({"pipe": {"path": d.str("custom_file_path")}}), "1s");
        files["typed_extension_protocol_options"] = http2();
        clusters.push(files);
    }
    let config_path = config["ConfigPath"].as_str().unwrap_or_default();
    let mut xds = static_cluster("xds-grpc", json!({"pipe": {"path": format!("{config_path}/XDS")}}), "1s");
    let threshold = |priority| json!({"priority": priority, "max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000});
    xds["circuit_breakers"] = json!({"thresholds": [threshold("DEFAULT"), threshold("HIGH")]});
    xds["upstream_connection_options"] = json!({"tcp_keepalive": {"keepalive_time": 300}});
    xds["max_requests_per_connection"] = json!(1);
    xds["typed_extension_protocol_options"] = http2();
    clusters.push(xds);
    let tracer = [("zipkin", "zipkin"), ("lightstep", "lightstep"), ("datadog", "datadog_agent")]
        .into_iter()
        .find(|(key, _)| d.on(key));
    if let Some((key, name)) = tracer {
        let mut cluster = dns_cluster(d, name, d.json(key)?);
        match key {
            "zipkin" => cluster["dns_refresh_rate"] = json!("30s"),
            "lightstep" => cluster["typed_extension_protocol_options"] = http2(),
            _ => {}
        }
        if d.on("tracing_tls") {
            cluster["transport_socket"] = d.json("tracing_tls")?;
        }
        clusters.push(cluster);
    }
    for service in ["envoy_metrics_service", "envoy_accesslog_service"] {
        if !d.on(&format!("{service}_address")) {
            continue;
        }
        let mut cluster = dns_cluster(d, service, d.json(&format!("{service}_address"))?);
        cluster["typed_extension_protocol_options"] = http2();
        if d.on(&format!("{service}_tls")) {
            cluster["transport_socket"] = d.json(&format!("{service}_tls"))?;
        }
        if d.on(&format!("{service}_tcp_keepalive")) {
            cluster["upstream_connection_options"] = d.json(&format!("{service}_tcp_keepalive"))?;
        }
        clusters.push(cluster);
    }
    if d.on("enable_self_discovery") {
        clusters.push(json!({
            "name": "local_cluster",
            "alt_stat_name": "local_cluster;",
            "type": "EDS",
            "connect_timeout": "1s",
            "load_balancing_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.least_request",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
                    "locality_lb_config": {"zone_aware_lb_config": {"min_cluster_size": "1"}}
                }}}]},
            "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}, "service_name": "local_cluster"}
        }));
    }
    Ok(clusters)
}

fn router() -> Value {
    json!({"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
}

/// An HTTP connection manager routing `routes` (prefix → cluster).
fn http_manager(stat_prefix: &str, routes: &[(&str, &str)], filters: Vec<Value>) -> Value {
    let routes: Vec<Value> = routes
        .iter()
        .map(|(prefix, cluster)| json!({"match": {"prefix": prefix}, "route": {"cluster": cluster}}))
        .collect();
    json!({
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "codec_type": "AUTO",
            "stat_prefix": stat_prefix,
            "route_config": {"virtual_hosts": [{"name": "backend", "domains": ["*"], "routes": routes}]},
            "http_filters": filters
        }
    })
}

fn compressor(name: &str, library: &str, type_url: &str) -> Value {
    json!({
        "name": format!("envoy.filters.http.compressor.{name}"),
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.compressor.v3.Compressor",
            "compressor_library": {"name": library, "typed_config": {"@type": type_url}},
            "response_direction_config": {"common_config": {"content_type": [
                "text/plain", "application/vnd.google.protobuf", "application/openmetrics-text", "application/openmetrics-protobuf"
            ]}}
        }
    })
}

/// A listener on `address:port` that ignores the global connection limit.
fn listener(name: String, address: &str, port: &Value) -> Value {
    json!({
        "name": name,
        "address": socket_address(address, port),
        "ignore_global_conn_limit": true,
        "bypass_overload_manager": true
    })
}

/// Istio's TLS stats listener (client certificates required, the workload's own).
fn secure_listener(d: &Data<'_>, port_key: &str, stat_prefix: &str, routes: &[(&str, &str)]) -> Value {
    let port = d.get(port_key);
    let mut l = listener(format!("{}_{}", d.str("wildcard"), port), d.str("wildcard"), port);
    let sds = |name: &str| {
        json!({"name": name, "sds_config": {"api_config_source": {
            "api_type": "GRPC", "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}],
            "set_node_on_first_message_only": true, "transport_api_version": "V3"}, "resource_api_version": "V3"}})
    };
    l["listener_filters"] = json!([{"name": "envoy.filters.listener.tls_inspector", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"}}]);
    l["filter_chains"] = json!([{
        "filter_chain_match": {"transport_protocol": "tls"},
        "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": true,
            "common_tls_context": {
                "tls_certificate_sds_secret_configs": [sds("default")],
                "combined_validation_context": {"default_validation_context": {}, "validation_context_sds_secret_config": sds("ROOTCA")}
            }}},
        "filters": [http_manager(stat_prefix, routes, vec![router()])]
    }]);
    l
}

fn listeners(d: &Data<'_>) -> Vec<Value> {
    let local = d.on("metrics_localhost_access_only");
    let (address, extra) =
        if local { ("localhost", "additional_localhost") } else { ("wildcard", "additional_wildcard") };
    let prometheus_port = d.get("envoy_prometheus_port");
    let mut prometheus =
        listener(format!("{}_{}", d.str(address), prometheus_port), d.str(address), prometheus_port);
    if d.on("dual_stack") {
        prometheus["additionalAddresses"] =
            json!([{"address": socket_address(d.str(extra), prometheus_port)}]);
    }
    let mut filters = Vec::new();
    if d.on("envoy_metrics_stats_compression") {
        filters.extend([
            compressor(
                "brotli",
                "stats_brotli",
                "type.googleapis.com/envoy.extensions.compression.brotli.compressor.v3.Brotli",
            ),
            compressor(
                "zstd",
                "stats_zstd",
                "type.googleapis.com/envoy.extensions.compression.zstd.compressor.v3.Zstd",
            ),
            compressor(
                "gzip",
                "stats_gzip",
                "type.googleapis.com/envoy.extensions.compression.gzip.compressor.v3.Gzip",
            ),
        ]);
    }
    filters.push(router());
    prometheus["filter_chains"] =
        json!([{"filters": [http_manager("stats", &[("/stats/prometheus", "prometheus_stats")], filters)]}]);
    let mut listeners = vec![prometheus];
    if d.on("secure_metrics_port") {
        listeners.push(secure_listener(
            d,
            "secure_metrics_port",
            "secure_stats",
            &[("/stats/prometheus", "prometheus_stats")],
        ));
    }
    if d.on("secure_merged_metrics_port") {
        let routes = [("/stats/prometheus", "agent"), ("/metrics", "agent")];
        listeners.push(secure_listener(d, "secure_merged_metrics_port", "secure_merged_stats", &routes));
    }
    let status_port = d.get("envoy_status_port");
    let mut status =
        listener(format!("{}_{}", d.str("wildcard"), status_port), d.str("wildcard"), status_port);
    if d.on("dual_stack") {
        status["additionalAddresses"] =
            json!([{"address": socket_address(d.str("additional_wildcard"), status_port)}]);
    }
    if d.on("envoy_status_port_enable_proxy_protocol") {
        status["listener_filters"] = json!([{"name": "envoy.listener.proxy_protocol", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.listener.proxy_protocol.v3.ProxyProtocol",
            "allow_requests_without_proxy_protocol": true}}]);
    }
    status["filter_chains"] =
        json!([{"filters": [http_manager("agent", &[("/healthz/ready", "agent")], vec![router()])]}]);
    listeners.push(status);
    listeners
}

fn tracing(d: &Data<'_>) -> Option<Value> {
    let (name, config) = if d.on("zipkin") {
        (
            "envoy.tracers.zipkin",
            json!({
                "@type": "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
                "collector_cluster": "zipkin",
                "collector_endpoint": "/api/v2/spans",
                "collector_endpoint_version": "HTTP_JSON",
                "trace_id_128bit": true,
                "shared_span_context": false
            }),
        )
    } else if d.on("lightstep") {
        (
            "envoy.tracers.lightstep",
            json!({
                "@type": "type.googleapis.com/envoy.config.trace.v3.LightstepConfig",
                "collector_cluster": "lightstep",
                "access_token_file": d.str("lightstepToken")
            }),
        )
    } else if d.on("datadog") {
        (
            "envoy.tracers.datadog",
            json!({
                "@type": "type.googleapis.com/envoy.config.trace.v3.DatadogConfig",
                "collector_cluster": "datadog_agent",
                "service_name": d.str("cluster")
            }),
        )
    } else {
        return None;
    };
    Some(json!({"http": {"name": name, "typed_config": config}}))
}

fn stats_sinks(d: &Data<'_>) -> Result<Vec<Value>, BuiltinError> {
    let mut sinks = Vec::new();
    if d.on("envoy_metrics_service_address") {
        sinks.push(json!({"name": "envoy.stat_sinks.metrics_service", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.metrics.v3.MetricsServiceConfig",
            "transport_api_version": "V3",
            "grpc_service": {"envoy_grpc": {"cluster_name": "envoy_metrics_service"}}}}));
    }
    if d.on("statsd") {
        sinks.push(json!({"name": "envoy.stat_sinks.statsd", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.metrics.v3.StatsdSink",
            "address": {"socket_address": d.json("statsd")?}}}));
    }
    Ok(sinks)
}
