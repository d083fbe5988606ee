//! Builders for the Envoy resources the local control plane serves: TCP and HTTP
//! listeners, static and EDS clusters, load assignments and route configurations,
//! each wrapped as `Any` under its type URL. Only the fields Envoy needs to carry
//! real traffic are set; the rest keep Envoy's defaults.

use std::{net::SocketAddr, time::Duration};

use prost_types::Any;
use weir_proto::{
    envoy::{
        config::{
            cluster::v3::{Cluster, cluster},
            core::v3::{
                AggregatedConfigSource, ApiVersion, ConfigSource, DataSource, address, config_source,
                data_source, socket_address,
            },
            endpoint::v3::{ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint},
            listener::v3::{Filter, FilterChain, Listener, filter},
            route::v3::{
                DirectResponseAction, Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route,
                route_action, route_match,
            },
        },
        extensions::filters::{
            http::router::v3::Router,
            network::{
                http_connection_manager::v3::{
                    HttpConnectionManager, HttpFilter, Rds, http_connection_manager, http_filter,
                },
                tcp_proxy::v3::{TcpProxy, tcp_proxy},
            },
        },
    },
    to_any, type_url,
};

const TCP_PROXY: &str = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy";
const HCM: &str =
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const ROUTER: &str = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";

fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 }
}

fn socket(addr: SocketAddr) -> weir_proto::envoy::config::core::v3::Address {
    weir_proto::envoy::config::core::v3::Address {
        address: Some(address::Address::SocketAddress(weir_proto::envoy::config::core::v3::SocketAddress {
            address: addr.ip().to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(addr.port()))),
            ..Default::default()
        })),
    }
}

fn ads() -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(AggregatedConfigSource {})),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

fn listener(name: &str, bind: SocketAddr, filter: Filter) -> Any {
    let listener = Listener {
        name: name.to_string(),
        address: Some(socket(bind)),
        filter_chains: vec![FilterChain { filters: vec![filter], ..Default::default() }],
        ..Default::default()
    };
    to_any(type_url::LISTENER, &listener)
}

/// A listener on `bind` that proxies every connection to `cluster`.
pub fn tcp_proxy_listener(name: &str, bind: SocketAddr, cluster: &str) -> Any {
    let proxy = TcpProxy {
        stat_prefix: name.to_string(),
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(cluster.to_string())),
        ..Default::default()
    };
    listener(
        name,
        bind,
        Filter {
            name: "envoy.filters.network.tcp_proxy".into(),
            config_type: Some(filter::ConfigType::TypedConfig(to_any(TCP_PROXY, &proxy))),
        },
    )
}

/// An HTTP listener on `bind` whose routes come over ADS as `route_config`.
pub fn http_listener(name: &str, bind: SocketAddr, route_config: &str) -> Any {
    let hcm = HttpConnectionManager {
        stat_prefix: name.to_string(),
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: route_config.to_string(),
        })),
        http_filters: vec![HttpFilter {
            name: "envoy.filters.http.router".into(),
            config_type: Some(http_filter::ConfigType::TypedConfig(to_any(ROUTER, &Router {}))),
            ..Default::default()
        }],
        ..Default::default()
    };
    listener(
        name,
        bind,
        Filter {
            name: "envoy.filters.network.http_connection_manager".into(),
            config_type: Some(filter::ConfigType::TypedConfig(to_any(HCM, &hcm))),
        },
    )
}

fn load_assignment_message(cluster: &str, endpoints: &[SocketAddr]) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: cluster.to_string(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints: endpoints
                .iter()
                .map(|e| LbEndpoint {
                    host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                        address: Some(socket(*e)),
                        ..Default::default()
                    })),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
    }
}

/// A cluster whose endpoints are inline.
pub fn static_cluster(name: &str, endpoints: &[SocketAddr], connect_timeout: Duration) -> Any {
    let cluster = Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Static as i32,
        )),
        connect_timeout: Some(duration(connect_timeout)),
        load_assignment: Some(load_assignment_message(name, endpoints)),
        ..Default::default()
    };
    to_any(type_url::CLUSTER, &cluster)
}

/// A cluster whose endpoints come over ADS (EDS) under its own name.
pub fn eds_cluster(name: &str, connect_timeout: Duration) -> Any {
    let cluster = Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(cluster::DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ads()),
            service_name: String::new(),
        }),
        connect_timeout: Some(duration(connect_timeout)),
        ..Default::default()
    };
    to_any(type_url::CLUSTER, &cluster)
}

/// The endpoints of an EDS cluster.
pub fn load_assignment(cluster: &str, endpoints: &[SocketAddr]) -> Any {
    to_any(type_url::ENDPOINT, &load_assignment_message(cluster, endpoints))
}

/// What a route does with a request.
#[derive(Debug, Clone)]
pub enum RouteTarget {
    /// Forward to a cluster.
    Cluster(String),
    /// Answer directly with a status and body.
    Direct { status: u32, body: String },
}

/// A route configuration with one virtual host (`*`) sending every path to `target`.
pub fn route_config(name: &str, target: RouteTarget) -> Any {
    let action = match target {
        RouteTarget::Cluster(cluster) => route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster)),
            ..Default::default()
        }),
        RouteTarget::Direct { status, body } => route::Action::DirectResponse(DirectResponseAction {
            status,
            body: Some(DataSource { specifier: Some(data_source::Specifier::InlineString(body)) }),
        }),
    };
    let config = RouteConfiguration {
        name: name.to_string(),
        virtual_hosts: vec![VirtualHost {
            name: format!("{name}-all"),
            domains: vec!["*".into()],
            routes: vec![Route {
                name: "all".into(),
                r#match: Some(RouteMatch {
                    path_specifier: Some(route_match::PathSpecifier::Prefix("/".into())),
                }),
                action: Some(action),
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    to_any(type_url::ROUTE, &config)
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;

    #[test]
    fn http_listener_points_its_routes_at_ads() {
        let any = http_listener("http", "0.0.0.0:8080".parse().unwrap(), "routes");
        assert_eq!(any.type_url, type_url::LISTENER);
        let listener = Listener::decode(any.value.as_slice()).unwrap();
        let Some(filter::ConfigType::TypedConfig(hcm)) = &listener.filter_chains[0].filters[0].config_type
        else {
            panic!("no typed config")
        };
        assert_eq!(hcm.type_url, HCM);
        let hcm = HttpConnectionManager::decode(hcm.value.as_slice()).unwrap();
        let Some(http_connection_manager::RouteSpecifier::Rds(rds)) = hcm.route_specifier else {
            panic!("not RDS")
        };
        assert_eq!(rds.route_config_name, "routes");
        assert!(matches!(
            rds.config_source.unwrap().config_source_specifier,
            Some(config_source::ConfigSourceSpecifier::Ads(_))
        ));
    }

    #[test]
    fn static_cluster_carries_its_endpoints() {
        let any = static_cluster("backend", &["10.0.0.1:80".parse().unwrap()], Duration::from_millis(1500));
        let cluster = Cluster::decode(any.value.as_slice()).unwrap();
        assert_eq!(cluster.connect_timeout, Some(prost_types::Duration { seconds: 1, nanos: 500_000_000 }));
        let la = cluster.load_assignment.unwrap();
        let Some(lb_endpoint::HostIdentifier::Endpoint(e)) = &la.endpoints[0].lb_endpoints[0].host_identifier
        else {
            panic!()
        };
        let Some(address::Address::SocketAddress(sa)) = &e.address.as_ref().unwrap().address else {
            panic!()
        };
        assert_eq!(
            (sa.address.as_str(), sa.port_specifier.clone()),
            ("10.0.0.1", Some(socket_address::PortSpecifier::PortValue(80)))
        );
    }
}
