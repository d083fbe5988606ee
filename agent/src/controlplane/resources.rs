//! Builders for the Envoy resources the local control plane serves: TCP and HTTP
//! listeners, static and EDS clusters, load assignments and route configurations,
//! and Istio-style mutual TLS over SDS for clusters and listeners, each wrapped as
//! `Any` under its type URL. Only the fields Envoy needs to carry
//! real traffic are set; the rest keep Envoy's defaults.

use std::{net::SocketAddr, time::Duration};

use prost_types::Any;
use weir_proto::{
    envoy::{
        config::{
            cluster::v3::{Cluster, cluster},
            core::v3::{
                AggregatedConfigSource, ApiConfigSource, ApiVersion, ConfigSource, DataSource, GrpcService,
                TransportSocket, address, api_config_source, config_source, data_source, grpc_service,
                socket_address, transport_socket,
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
        extensions::transport_sockets::tls::v3::{
            CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig,
            SubjectAltNameMatcher, UpstreamTlsContext, common_tls_context, subject_alt_name_matcher,
        },
        r#type::matcher::v3::{StringMatcher, string_matcher},
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
    to_any(type_url::LISTENER, &listener_message(name, bind, filter, None))
}

fn listener_message(name: &str, bind: SocketAddr, filter: Filter, tls: Option<TransportSocket>) -> Listener {
    Listener {
        name: name.to_string(),
        address: Some(socket(bind)),
        filter_chains: vec![FilterChain {
            filters: vec![filter],
            transport_socket: tls,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The cluster Istio's bootstrap defines for SDS (a pipe to the agent's SDS socket).
pub const SDS_CLUSTER: &str = "sds-grpc";
/// Istio's names for the workload certificate and the mesh root.
pub const WORKLOAD_SECRET: &str = "default";
pub const ROOT_SECRET: &str = "ROOTCA";
const UPSTREAM_TLS: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext";
const DOWNSTREAM_TLS: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext";

fn sds_secret(name: &str) -> SdsSecretConfig {
    SdsSecretConfig {
        name: name.into(),
        sds_config: Some(ConfigSource {
            config_source_specifier: Some(config_source::ConfigSourceSpecifier::ApiConfigSource(
                ApiConfigSource {
                    api_type: api_config_source::ApiType::Grpc as i32,
                    transport_api_version: ApiVersion::V3 as i32,
                    grpc_services: vec![GrpcService {
                        target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
                            grpc_service::EnvoyGrpc {
                                cluster_name: SDS_CLUSTER.into(),
                                ..Default::default()
                            },
                        )),
                        ..Default::default()
                    }],
                    set_node_on_first_message_only: true,
                    ..Default::default()
                },
            )),
            // Istio's: wait for the certificate as long as it takes.
            initial_fetch_timeout: Some(duration(Duration::ZERO)),
            resource_api_version: ApiVersion::V3 as i32,
        }),
    }
}

/// Istio's mutual TLS: the certificate `default` and the roots `ROOTCA` over SDS; the
/// peer's certificate must carry one of `peer_sans` (SPIFFE IDs) as a URI SAN.
fn istio_mtls(peer_sans: &[&str], cert_secret: &str, root_secret: &str) -> CommonTlsContext {
    CommonTlsContext {
        tls_certificate_sds_secret_configs: vec![sds_secret(cert_secret)],
        validation_context_type: Some(common_tls_context::ValidationContextType::CombinedValidationContext(
            common_tls_context::CombinedCertificateValidationContext {
                default_validation_context: Some(CertificateValidationContext {
                    match_typed_subject_alt_names: peer_sans
                        .iter()
                        .map(|san| SubjectAltNameMatcher {
                            san_type: subject_alt_name_matcher::SanType::Uri as i32,
                            matcher: Some(StringMatcher {
                                match_pattern: Some(string_matcher::MatchPattern::Exact(san.to_string())),
                                ..Default::default()
                            }),
                        })
                        .collect(),
                    ..Default::default()
                }),
                validation_context_sds_secret_config: Some(sds_secret(root_secret)),
            },
        )),
        ..Default::default()
    }
}

fn tls_socket(type_url: &str, config: &impl prost::Message) -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(to_any(type_url, config))),
    }
}

/// A static cluster whose connections originate Istio mutual TLS, accepting only a
/// server certificate for one of `peer_sans`.
pub fn mtls_static_cluster(
    name: &str,
    endpoints: &[SocketAddr],
    connect_timeout: Duration,
    peer_sans: &[&str],
) -> Any {
    tls_static_cluster(name, endpoints, connect_timeout, peer_sans, (WORKLOAD_SECRET, ROOT_SECRET))
}

/// As [`mtls_static_cluster`], with other SDS secret names for the certificate and
/// the roots (`file-cert:...`, `file-root:...`, as DestinationRules produce).
pub fn tls_static_cluster(
    name: &str,
    endpoints: &[SocketAddr],
    connect_timeout: Duration,
    peer_sans: &[&str],
    (cert_secret, root_secret): (&str, &str),
) -> Any {
    let tls = UpstreamTlsContext {
        common_tls_context: Some(istio_mtls(peer_sans, cert_secret, root_secret)),
        ..Default::default()
    };
    let cluster = Cluster {
        transport_socket: Some(tls_socket(UPSTREAM_TLS, &tls)),
        ..static_cluster_message(name, endpoints, connect_timeout)
    };
    to_any(type_url::CLUSTER, &cluster)
}

/// A TCP proxy listener that terminates Istio mutual TLS: a client certificate is
/// required and must be for one of `peer_sans`.
pub fn mtls_tcp_proxy_listener(name: &str, bind: SocketAddr, cluster: &str, peer_sans: &[&str]) -> Any {
    let tls = DownstreamTlsContext {
        common_tls_context: Some(istio_mtls(peer_sans, WORKLOAD_SECRET, ROOT_SECRET)),
        require_client_certificate: Some(true),
    };
    let listener =
        listener_message(name, bind, tcp_proxy_filter(name, cluster), Some(tls_socket(DOWNSTREAM_TLS, &tls)));
    to_any(type_url::LISTENER, &listener)
}

/// A listener on `bind` that proxies every connection to `cluster`.
pub fn tcp_proxy_listener(name: &str, bind: SocketAddr, cluster: &str) -> Any {
    listener(name, bind, tcp_proxy_filter(name, cluster))
}

fn tcp_proxy_filter(name: &str, cluster: &str) -> Filter {
    let proxy = TcpProxy {
        stat_prefix: name.to_string(),
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(cluster.to_string())),
        ..Default::default()
    };
    Filter {
        name: "envoy.filters.network.tcp_proxy".into(),
        config_type: Some(filter::ConfigType::TypedConfig(to_any(TCP_PROXY, &proxy))),
    }
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
    to_any(type_url::CLUSTER, &static_cluster_message(name, endpoints, connect_timeout))
}

fn static_cluster_message(name: &str, endpoints: &[SocketAddr], connect_timeout: Duration) -> Cluster {
    Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Static as i32,
        )),
        connect_timeout: Some(duration(connect_timeout)),
        load_assignment: Some(load_assignment_message(name, endpoints)),
        ..Default::default()
    }
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
