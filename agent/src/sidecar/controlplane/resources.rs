//! Builders for the Envoy resources the local control plane serves: TCP and HTTP
//! listeners, static and EDS clusters, load assignments and route configurations,
//! and Istio-style mutual TLS over SDS for clusters and listeners, each wrapped as
//! `Any` under its type URL. Only the fields Envoy needs to carry
//! real traffic are set; the rest keep Envoy's defaults.

use std::{net::SocketAddr, time::Duration};

use prost_types::Any;
use weir_proto::{
    envoy::extensions::filters::listener::original_dst::v3::OriginalDst,
    envoy::{
        config::{
            cluster::v3::{Cluster, cluster},
            core::v3::{
                AggregatedConfigSource, ApiConfigSource, ApiVersion, CidrRange, ConfigSource, DataSource,
                ExtensionConfigSource, GrpcService, Locality, TrafficDirection, TransportSocket, address,
                api_config_source, config_source, data_source, grpc_service, socket_address,
                transport_socket,
            },
            endpoint::v3::{ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint},
            listener::v3::{
                ApiListener, Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter, filter,
                listener_filter,
            },
            route::v3::{
                DirectResponseAction, RetryPolicy, Route, RouteAction, RouteConfiguration, RouteMatch,
                VirtualHost, route, route_action, route_match,
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
    http_listener_with_ecds(name, bind, route_config, &[])
}

/// An HTTP listener whose filters before the router come over ECDS by name, as
/// istiod configures WasmPlugins.
pub fn http_listener_with_ecds(
    name: &str,
    bind: SocketAddr,
    route_config: &str,
    ecds: &[(&str, &str)],
) -> Any {
    let mut http_filters: Vec<HttpFilter> = ecds
        .iter()
        .map(|(filter, type_url)| HttpFilter {
            name: filter.to_string(),
            config_type: Some(http_filter::ConfigType::ConfigDiscovery(ExtensionConfigSource {
                config_source: Some(ads()),
                type_urls: vec![type_url.to_string()],
                ..Default::default()
            })),
            ..Default::default()
        })
        .collect();
    http_filters.push(HttpFilter {
        name: "envoy.filters.http.router".into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(to_any(ROUTER, &Router {}))),
        ..Default::default()
    });
    let hcm = HttpConnectionManager {
        stat_prefix: name.to_string(),
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: route_config.to_string(),
        })),
        http_filters,
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

/// What a proxyless gRPC client asks for by the name of its `xds:///` target
/// (`host:port`): an API listener whose HTTP connection manager takes its routes
/// from RDS, as istiod's gRPC generator builds it.
pub fn grpc_api_listener(name: &str, route_config: &str) -> Any {
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
    let listener = Listener {
        name: name.to_string(),
        api_listener: Some(ApiListener { api_listener: Some(to_any(HCM, &hcm)) }),
        ..Default::default()
    };
    to_any(type_url::LISTENER, &listener)
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
            // gRPC clients refuse a locality that is absent and skip one without a
            // weight; Envoy ignores the weight unless locality-weighted balancing is on.
            locality: Some(Locality::default()),
            load_balancing_weight: Some(1),
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

/// How a mesh service's traffic is carried by the sidecars.
#[derive(Debug, Clone, PartialEq)]
pub enum ChainFilter {
    /// TCP proxy to a cluster.
    Tcp { cluster: String },
    /// HTTP to a cluster, with a per-request timeout and retries.
    Http { cluster: String, timeout: Duration, retries: u32 },
}

/// One filter chain of a virtual listener: traffic for `destination` (`ip`/`port`,
/// either optional) handled by `filter`, with Istio mutual TLS terminated when `mtls`.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainSpec {
    pub name: String,
    pub destination_ip: Option<std::net::IpAddr>,
    pub destination_port: Option<u16>,
    pub filter: ChainFilter,
    /// Terminate Istio mutual TLS (inbound), accepting these SPIFFE IDs (empty: any
    /// certificate of the mesh CA).
    pub mtls: Option<Vec<String>>,
    /// Match only connections of this transport (`tls` or `raw_buffer`, as the TLS
    /// inspector tells them apart): PERMISSIVE inbound has one chain of each.
    pub transport_protocol: Option<&'static str>,
}

fn chain_filter(stat: &str, f: &ChainFilter) -> Filter {
    match f {
        ChainFilter::Tcp { cluster } => tcp_proxy_filter(stat, cluster),
        ChainFilter::Http { cluster, timeout, retries } => {
            let route = RouteConfiguration {
                name: stat.to_string(),
                virtual_hosts: vec![VirtualHost {
                    name: stat.to_string(),
                    domains: vec!["*".into()],
                    routes: vec![Route {
                        name: "default".into(),
                        r#match: Some(RouteMatch { path_specifier: Some(route_match::PathSpecifier::Prefix("/".into())) }),
                        action: Some(route::Action::Route(RouteAction {
                            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster.clone())),
                            timeout: Some(duration(*timeout)),
                            retry_policy: (*retries > 0).then(|| RetryPolicy {
                                // Istio's default retry conditions.
                                retry_on: "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes".into(),
                                num_retries: Some(*retries),
                                ..Default::default()
                            }),
                            ..Default::default()
                        })),
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            };
            let hcm = HttpConnectionManager {
                stat_prefix: stat.to_string(),
                route_specifier: Some(http_connection_manager::RouteSpecifier::RouteConfig(route)),
                http_filters: vec![HttpFilter {
                    name: "envoy.filters.http.router".into(),
                    config_type: Some(http_filter::ConfigType::TypedConfig(to_any(ROUTER, &Router {}))),
                    ..Default::default()
                }],
                ..Default::default()
            };
            Filter {
                name: "envoy.filters.network.http_connection_manager".into(),
                config_type: Some(filter::ConfigType::TypedConfig(to_any(HCM, &hcm))),
            }
        }
    }
}

/// Istio's virtual listener (`virtualOutbound` on 15001, `virtualInbound` on 15006):
/// it finds each connection's original destination and picks the chain for it; the
/// default chain proxies to `default_cluster`.
pub fn virtual_listener(
    name: &str,
    port: u16,
    inbound: bool,
    chains: &[ChainSpec],
    default_cluster: Option<&str>,
) -> Any {
    let filter_chains = chains
        .iter()
        .map(|c| FilterChain {
            name: c.name.clone(),
            filter_chain_match: Some(FilterChainMatch {
                destination_port: c.destination_port.map(u32::from),
                prefix_ranges: c
                    .destination_ip
                    .map(|ip| CidrRange {
                        address_prefix: ip.to_string(),
                        prefix_len: Some(if ip.is_ipv4() { 32 } else { 128 }),
                    })
                    .into_iter()
                    .collect(),
                transport_protocol: c.transport_protocol.unwrap_or_default().to_string(),
                ..Default::default()
            }),
            filters: vec![chain_filter(&c.name, &c.filter)],
            transport_socket: c.mtls.as_ref().map(|sans| {
                let sans: Vec<&str> = sans.iter().map(String::as_str).collect();
                let tls = DownstreamTlsContext {
                    common_tls_context: Some(istio_mtls(&sans, WORKLOAD_SECRET, ROOT_SECRET)),
                    require_client_certificate: Some(true),
                };
                tls_socket(DOWNSTREAM_TLS, &tls)
            }),
        })
        .collect();
    let listener = Listener {
        name: name.to_string(),
        address: Some(socket(SocketAddr::from(([0, 0, 0, 0], port)))),
        filter_chains,
        default_filter_chain: default_cluster.map(|cluster| FilterChain {
            name: format!("{name}-passthrough"),
            filters: vec![tcp_proxy_filter(&format!("{name}-passthrough"), cluster)],
            ..Default::default()
        }),
        use_original_dst: Some(true),
        listener_filters: std::iter::once(ListenerFilter {
            name: "envoy.filters.listener.original_dst".into(),
            config_type: Some(listener_filter::ConfigType::TypedConfig(to_any(
                ORIGINAL_DST,
                &OriginalDst {},
            ))),
        })
        // Chains told apart by transport need the TLS inspector (Istio's PERMISSIVE).
        .chain(chains.iter().any(|c| c.transport_protocol.is_some()).then(|| ListenerFilter {
            name: "envoy.filters.listener.tls_inspector".into(),
            config_type: Some(listener_filter::ConfigType::TypedConfig(prost_types::Any {
                type_url: TLS_INSPECTOR.into(),
                value: Vec::new(),
            })),
        }))
        .collect(),
        traffic_direction: if inbound { TrafficDirection::Inbound } else { TrafficDirection::Outbound }
            as i32,
        ..Default::default()
    };
    to_any(type_url::LISTENER, &listener)
}

const ORIGINAL_DST: &str =
    "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst";
const TLS_INSPECTOR: &str =
    "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector";

/// Istio's `PassthroughCluster`: connections go to their original destination.
pub fn passthrough_cluster(name: &str, connect_timeout: Duration) -> Any {
    let cluster = Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::OriginalDst as i32,
        )),
        lb_policy: cluster::LbPolicy::ClusterProvided as i32,
        connect_timeout: Some(duration(connect_timeout)),
        ..Default::default()
    };
    to_any(type_url::CLUSTER, &cluster)
}

/// An ECDS resource for an HTTP Wasm filter (V8) whose code is fetched from `uri`
/// (`sha256` hex, or empty), as istiod writes it for a WasmPlugin.
pub fn remote_wasm_filter(name: &str, uri: &str, sha256: &str) -> Any {
    remote_wasm_filter_with_timeout(name, uri, sha256, Duration::from_secs(10))
}

/// As `remote_wasm_filter`, with the fetch's own `timeout` (a WasmPlugin's).
pub fn remote_wasm_filter_with_timeout(name: &str, uri: &str, sha256: &str, timeout: Duration) -> Any {
    use weir_proto::envoy::{
        config::core::v3::{
            AsyncDataSource, HttpUri, RemoteDataSource, TypedExtensionConfig, async_data_source,
        },
        extensions::{
            filters::http::wasm::v3::Wasm,
            wasm::v3::{PluginConfig, VmConfig, plugin_config},
        },
    };
    let wasm = Wasm {
        config: Some(PluginConfig {
            name: name.into(),
            vm: Some(plugin_config::Vm::VmConfig(VmConfig {
                vm_id: name.into(),
                runtime: "envoy.wasm.runtime.v8".into(),
                code: Some(AsyncDataSource {
                    specifier: Some(async_data_source::Specifier::Remote(RemoteDataSource {
                        http_uri: Some(HttpUri {
                            uri: uri.into(),
                            http_upstream_type: Some(
                                weir_proto::envoy::config::core::v3::http_uri::HttpUpstreamType::Cluster(
                                    uri.into(),
                                ),
                            ),
                            timeout: Some(duration(timeout)),
                        }),
                        sha256: sha256.into(),
                    })),
                }),
                ..Default::default()
            })),
            ..Default::default()
        }),
    };
    to_any(
        type_url::EXTENSION_CONFIG,
        &TypedExtensionConfig {
            name: name.into(),
            typed_config: Some(to_any(crate::sidecar::wasm::rewrite::HTTP_WASM, &wasm)),
        },
    )
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
