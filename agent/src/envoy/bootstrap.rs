//! Envoy's bootstrap, rendered as pilot-agent renders `envoy-rev.json`: the node (id,
//! cluster, metadata), the admin listener on 127.0.0.1, ADS (Delta unless
//! `ISTIO_DELTA_XDS=false`) over the `xds-grpc` cluster to the agent's XDS socket,
//! `sds-grpc` to its SDS socket, and Istio's two static listeners: 15090 (Envoy's
//! Prometheus stats) and 15021 (readiness, answered by the agent's status server).
//! A pure function of `BootstrapParams`; writing it is the caller's step.

use std::{collections::BTreeMap, path::PathBuf};

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
}
