//! Envoy's bootstrap, rendered as pilot-agent renders `envoy-rev.json`: the node (id,
//! cluster, metadata), the admin listener on 127.0.0.1, ADS (Delta unless
//! `ISTIO_DELTA_XDS=false`) over the `xds-grpc` cluster to the agent's XDS socket,
//! `sds-grpc` to its SDS socket, and Istio's two static listeners: 15090 (Envoy's
//! Prometheus stats) and 15021 (readiness, answered by the agent's status server).
//! `render` is a pure function of `BootstrapParams`; `render_template` fills a
//! `--templateFile` (the `{{ .name }}` subset of Istio's Go template); `write` puts
//! the result where Envoy reads it; `override_json` reads `ISTIO_BOOTSTRAP_OVERRIDE`.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde_json::{Value, json};

/// Everything the bootstrap says.
#[derive(Debug, Clone, PartialEq)]
pub struct BootstrapParams {
    pub node_id: String,
    pub cluster: String,
    pub metadata: BTreeMap<String, Value>,
    pub admin_port: u16,
    pub status_port: u16,
    pub prometheus_port: u16,
    pub readiness_port: u16,
    pub xds_socket: PathBuf,
    pub sds_socket: PathBuf,
    /// Delta ADS (Istio's default) or state of the world.
    pub delta: bool,
}

fn socket_address(address: &str, port: u16) -> Value {
    json!({ "socket_address": { "protocol": "TCP", "address": address, "port_value": port } })
}

fn endpoint_cluster(name: &str, address: Value, http2: bool) -> Value {
    let mut cluster = json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{ "lb_endpoints": [{ "endpoint": { "address": address } }] }]
        }
    });
    if http2 {
        cluster["typed_extension_protocol_options"] = json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": { "http2_protocol_options": {} }
            }
        });
    }
    cluster
}

/// An HTTP listener on 0.0.0.0:`port` routing `prefix` to `cluster` (Istio's static
/// 15090 and 15021 listeners).
fn static_http_listener(name: &str, port: u16, prefix: &str, cluster: &str) -> Value {
    json!({
        "name": name,
        "address": socket_address("0.0.0.0", port),
        "filter_chains": [{
            "filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "codec_type": "AUTO",
                    "stat_prefix": name,
                    "route_config": {
                        "virtual_hosts": [{
                            "name": "backend",
                            "domains": ["*"],
                            "routes": [{ "match": { "prefix": prefix }, "route": { "cluster": cluster } }]
                        }]
                    },
                    "http_filters": [{
                        "name": "envoy.filters.http.router",
                        "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" }
                    }]
                }
            }]
        }]
    })
}

/// The bootstrap document.
pub fn render(p: &BootstrapParams) -> Value {
    let ads_source = json!({ "ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3" });
    json!({
        "node": { "id": p.node_id, "cluster": p.cluster, "metadata": p.metadata },
        "stats_config": { "stats_matcher": { "reject_all": false } },
        "layered_runtime": {
            "layers": [
                { "name": "global config", "static_layer": {
                    "overload.global_downstream_max_connections": 2147483647,
                    "re2.max_program_size.error_level": 32768
                } },
                { "name": "admin", "admin_layer": {} }
            ]
        },
        "admin": { "address": socket_address("127.0.0.1", p.admin_port) },
        "dynamic_resources": {
            "lds_config": ads_source,
            "cds_config": ads_source,
            "ads_config": {
                "api_type": if p.delta { "DELTA_GRPC" } else { "GRPC" },
                "set_node_on_first_message_only": true,
                "transport_api_version": "V3",
                "grpc_services": [{ "envoy_grpc": { "cluster_name": "xds-grpc" } }]
            }
        },
        "static_resources": {
            "clusters": [
                endpoint_cluster("prometheus_stats", socket_address("127.0.0.1", p.admin_port), false),
                endpoint_cluster("agent", socket_address("127.0.0.1", p.status_port), false),
                endpoint_cluster("sds-grpc", json!({ "pipe": { "path": p.sds_socket } }), true),
                endpoint_cluster("xds-grpc", json!({ "pipe": { "path": p.xds_socket } }), true),
            ],
            "listeners": [
                static_http_listener("stats", p.prometheus_port, "/stats/prometheus", "prometheus_stats"),
                static_http_listener("agent", p.readiness_port, "/healthz/ready", "agent"),
            ]
        },
        "stats_flush_interval": "5s"
    })
}

/// The variables a `--templateFile` may use, named as in Istio's template.
pub fn template_vars(p: &BootstrapParams) -> BTreeMap<&'static str, String> {
    [
        ("nodeID", p.node_id.clone()),
        ("cluster", p.cluster.clone()),
        ("meta_json_str", serde_json::to_string(&p.metadata).expect("metadata serializes")),
        ("localhost", "127.0.0.1".into()),
        ("wildcard", "0.0.0.0".into()),
        ("dns_lookup_family", "V4_ONLY".into()),
        ("envoy_prometheus_port", p.prometheus_port.to_string()),
        ("envoy_status_port", p.readiness_port.to_string()),
        ("config.ProxyAdminPort", p.admin_port.to_string()),
        ("config.StatusPort", p.status_port.to_string()),
        ("xds_socket", p.xds_socket.display().to_string()),
        ("sds_socket", p.sds_socket.display().to_string()),
    ]
    .into()
}

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error(
        "bootstrap template {path} line {line}: `{action}` is not supported (Weir fills only \
         `{{{{ .name }}}}` with one of: {known})"
    )]
    TemplateAction { path: PathBuf, line: usize, action: String, known: String },
    #[error("bootstrap template {path} line {line}: `{{{{` is never closed")]
    TemplateUnclosed { path: PathBuf, line: usize },
    #[error("bootstrap template {path} is not valid JSON once filled in")]
    TemplateJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("read {what} {path}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("ISTIO_BOOTSTRAP_OVERRIDE {path} is neither YAML nor JSON")]
    OverrideSyntax {
        path: PathBuf,
        #[source]
        source: serde_yaml_ng::Error,
    },
    #[error("write the Envoy bootstrap {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Fills `template` (read from `path`): every `{{ .name }}` (or `{{ .config.Field }}`)
/// becomes its value from `vars`; any other action is an error naming it, so a Go
/// template that needs conditionals fails loudly instead of rendering wrong.
pub fn render_template(
    path: &Path,
    template: &str,
    vars: &BTreeMap<&str, String>,
) -> Result<Value, BootstrapError> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let line = template[..template.len() - rest.len() + start].matches('\n').count() + 1;
        let Some(len) = rest[start..].find("}}") else {
            return Err(BootstrapError::TemplateUnclosed { path: path.into(), line });
        };
        let action = &rest[start + 2..start + len];
        let name = action.trim().trim_start_matches('-').trim_end_matches('-').trim();
        match name.strip_prefix('.').and_then(|n| vars.get(n)) {
            Some(value) => out.push_str(value),
            None => {
                return Err(BootstrapError::TemplateAction {
                    path: path.into(),
                    line,
                    action: format!("{{{{{action}}}}}"),
                    known: vars.keys().map(|k| format!(".{k}")).collect::<Vec<_>>().join(", "),
                });
            }
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    serde_json::from_str(&out).map_err(|source| BootstrapError::TemplateJson { path: path.into(), source })
}

/// Writes the bootstrap atomically (a temporary file renamed over `path`), readable
/// by the proxy user.
pub fn write(path: &Path, document: &Value) -> Result<(), BootstrapError> {
    use std::os::unix::fs::PermissionsExt as _;
    let err = |source| BootstrapError::Write { path: path.into(), source };
    let text = serde_json::to_string_pretty(document).expect("bootstrap serializes");
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// `ISTIO_BOOTSTRAP_OVERRIDE`: the file (YAML or JSON) as one line of JSON for
/// Envoy's `--config-yaml`, with `$(HOST_IP)` replaced as pilot-agent does.
pub fn override_json(path: &Path, host_ip: Option<&str>) -> Result<String, BootstrapError> {
    let text = std::fs::read_to_string(path).map_err(|source| BootstrapError::Read {
        what: "ISTIO_BOOTSTRAP_OVERRIDE",
        path: path.into(),
        source,
    })?;
    let host = host_ip.unwrap_or_default();
    let text = if host.contains(':') {
        text.replace("[$(HOST_IP)]", &format!("[{host}]")).replace("$(HOST_IP)", &format!("[{host}]"))
    } else {
        text.replace("$(HOST_IP)", host)
    };
    let value: Value = serde_yaml_ng::from_str(&text)
        .map_err(|source| BootstrapError::OverrideSyntax { path: path.into(), source })?;
    Ok(value.to_string())
}

/// Istio's node id: `<type>~<ip>~<pod>.<namespace>~<namespace>.svc.cluster.local`.
pub fn node_id(proxy_type: &str, ip: &str, pod: &str, namespace: &str, domain: &str) -> String {
    format!("{proxy_type}~{ip}~{pod}.{namespace}~{domain}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> BootstrapParams {
        BootstrapParams {
            node_id: node_id("sidecar", "10.1.2.3", "echo-1", "app", "app.svc.cluster.local"),
            cluster: "echo.app".into(),
            metadata: [("NAMESPACE".to_string(), json!("app"))].into(),
            admin_port: 15000,
            status_port: 15020,
            prometheus_port: 15090,
            readiness_port: 15021,
            xds_socket: "/pod/etc/istio/proxy/XDS".into(),
            sds_socket: "/pod/var/run/secrets/workload-spiffe-uds/socket".into(),
            delta: true,
        }
    }

    #[test]
    fn the_bootstrap_says_what_istios_does() {
        let b = render(&params());
        assert_eq!(b["node"]["id"], "sidecar~10.1.2.3~echo-1.app~app.svc.cluster.local");
        assert_eq!(b["node"]["metadata"]["NAMESPACE"], "app");
        assert_eq!(b["admin"]["address"]["socket_address"]["address"], "127.0.0.1");
        assert_eq!(b["dynamic_resources"]["ads_config"]["api_type"], "DELTA_GRPC");
        let clusters = b["static_resources"]["clusters"].as_array().unwrap();
        let names: Vec<_> = clusters.iter().map(|c| c["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["prometheus_stats", "agent", "sds-grpc", "xds-grpc"]);
        let xds = &clusters[3]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"];
        assert_eq!(xds["pipe"]["path"], "/pod/etc/istio/proxy/XDS");
        let ports: Vec<_> = b["static_resources"]["listeners"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["address"]["socket_address"]["port_value"].as_u64().unwrap())
            .collect();
        assert_eq!(ports, [15090, 15021]);
        let sotw = render(&BootstrapParams { delta: false, ..params() });
        assert_eq!(sotw["dynamic_resources"]["ads_config"]["api_type"], "GRPC");
    }

    #[test]
    fn templates_fill_names_and_refuse_logic() {
        let vars = template_vars(&params());
        let path = Path::new("/t.json");
        let t = "{\"node\": {\"id\": \"{{ .nodeID }}\", \"metadata\": {{ .meta_json_str }}},\n \"admin\": {{- .config.ProxyAdminPort -}}}";
        let v = render_template(path, t, &vars).unwrap();
        assert_eq!(v["node"]["id"], "sidecar~10.1.2.3~echo-1.app~app.svc.cluster.local");
        assert_eq!(v["node"]["metadata"]["NAMESPACE"], "app");
        assert_eq!(v["admin"], 15000);
        let e = render_template(path, "{\n\n{{- if .zipkin }}}", &vars).unwrap_err().to_string();
        assert!(e.contains("line 3") && e.contains("{{- if .zipkin }}") && e.contains(".nodeID"), "{e}");
        let e = render_template(path, "{{ .unknown }}", &vars).unwrap_err().to_string();
        assert!(e.contains(".unknown"), "{e}");
        let e = render_template(path, "{ {{ .cluster", &vars).unwrap_err().to_string();
        assert!(e.contains("never closed"), "{e}");
        assert!(matches!(
            render_template(path, "{ \"a\": {{ .cluster }} }", &vars),
            Err(BootstrapError::TemplateJson { .. })
        ));
    }

    #[test]
    fn overrides_become_json_with_the_host_ip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("override.yaml");
        std::fs::write(&path, "tracing:\n  address: \"$(HOST_IP):8126\"\n").unwrap();
        assert_eq!(
            override_json(&path, Some("10.0.0.7")).unwrap(),
            r#"{"tracing":{"address":"10.0.0.7:8126"}}"#
        );
        assert_eq!(
            override_json(&path, Some("fd00::7")).unwrap(),
            r#"{"tracing":{"address":"[fd00::7]:8126"}}"#
        );
        std::fs::write(&path, "a: [unclosed").unwrap();
        let e = override_json(&path, None).unwrap_err().to_string();
        assert!(e.contains("ISTIO_BOOTSTRAP_OVERRIDE") && e.contains("override.yaml"), "{e}");
        let e = override_json(&dir.path().join("missing"), None).unwrap_err();
        assert!(matches!(e, BootstrapError::Read { .. }));
    }
}
