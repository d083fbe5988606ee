//! The node Envoy (and a proxyless gRPC app) presents to istiod, as pilot-agent builds
//! it: the IPs (the pod IP, then the pod's own interface addresses), the id
//! `type~ip~pod.ns~domain`, the cluster as Istio names it, the locality, and the
//! metadata (`sidecar/node_metadata.rs`: pilot-agent's `GetNodeMetaData`, key for key).

use std::{
    collections::BTreeMap,
    net::IpAddr,
    path::{Path, PathBuf},
};

use serde::Serialize;
use serde_json::{Map, Value};

use crate::sidecar::node_metadata as metadata;
pub use crate::sidecar::node_metadata::{Locality, MetadataError, MetadataOptions, NodeMetadata};

use super::{ConfigError, ControlPlaneAuthPolicy, PodIdentity, ProxyConfig, ProxyType, Sources, vars};

/// The Istio release whose pilot-agent Weir speaks as (`ISTIO_VERSION` in node metadata,
/// which istiod gates generated config on); `ISTIO_META_ISTIO_VERSION` overrides it,
/// as in Istio, and `WEIR_ISTIO_VERSION` at build time sets it.
pub const ISTIO_VERSION: &str = match option_env!("WEIR_ISTIO_VERSION") {
    Some(v) => v,
    None => "1.32.0",
};

/// Envoy's node: id, cluster, locality and metadata.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSettings {
    pub id: String,
    pub cluster: String,
    /// The proxy's IPs, the pod IP first (`INSTANCE_IPS`).
    pub ips: Vec<String>,
    #[serde(skip_serializing_if = "is_default_locality")]
    pub locality: LocalityView,
    /// What istiod receives as the node's metadata.
    pub metadata: Map<String, Value>,
    /// The metadata's parts, for the bootstrap's options.
    #[serde(skip)]
    pub parts: NodeMetadata,
    /// `ISTIO_DELTA_XDS` (default true): Delta ADS, else state of the world.
    pub delta_xds: bool,
    /// `GRPC_XDS_BOOTSTRAP`: where proxyless gRPC applications find their bootstrap.
    pub grpc_bootstrap: PathBuf,
}

/// The locality, printable.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LocalityView {
    pub region: String,
    pub zone: String,
    pub sub_zone: String,
}

fn is_default_locality(l: &LocalityView) -> bool {
    *l == LocalityView::default()
}

impl NodeSettings {
    pub fn resolve(
        src: &Sources<'_>,
        pod: &PodIdentity,
        pc: &ProxyConfig,
        proxy_config_json: Value,
    ) -> Result<Self, ConfigError> {
        let env = src.env;
        let ips = instance_ips(src, pod);
        let proxy_type = match src.args.proxy_type {
            ProxyType::Sidecar => "sidecar",
            ProxyType::Router => "router",
        };
        let ip0 = ips.first().cloned().unwrap_or_default();
        let id = node_id(proxy_type, &ip0, &pod.name, &pod.namespace, &pod.domain);
        let pilot_san = match pc.control_plane_auth_policy {
            ControlPlaneAuthPolicy::MutualTls => vec![pilot_san(&pc.discovery_address)],
            ControlPlaneAuthPolicy::None => Vec::new(),
        };
        let port = |var: &vars::Var| -> Result<i64, ConfigError> { Ok(i64::from(var.count(env)?)) };
        let options = MetadataOptions {
            envs: env.vars(),
            proxy_metadata: pc.proxy_metadata.clone(),
            proxy_config: proxy_config_json,
            instance_ips: ips.clone(),
            sts_port: src.args.sts_port,
            pilot_san,
            outlier_log_path: src.args.outlier_log_path.clone(),
            envoy_status_port: port(&vars::ENVOY_STATUS_PORT)?,
            envoy_prometheus_port: port(&vars::ENVOY_PROMETHEUS_PORT)?,
            envoy_secure_metrics_port: port(&vars::ENVOY_SECURE_METRICS_PORT)?,
            envoy_secure_merged_metrics_port: port(&vars::ENVOY_SECURE_MERGED_METRICS_PORT)?,
            exit_on_zero_active_connections: vars::EXIT_ON_ZERO_ACTIVE_CONNECTIONS.bool(env)?,
            metadata_discovery: match vars::PEER_METADATA_DISCOVERY.value(env) {
                Some(_) => Some(vars::PEER_METADATA_DISCOVERY.bool(env)?),
                None => None,
            },
            envoy_skip_deprecated_logs: vars::ENVOY_SKIP_DEPRECATED_LOGS.bool(env)?,
            workload_identity_socket_file: vars::WORKLOAD_IDENTITY_SOCKET_FILE.text(env),
            labels_file: src.labels_file.clone(),
            annotations_file: src.annotations_file.clone(),
            dns_proxy_addr: vars::DNS_PROXY_ADDR.value(env),
            credential_socket_exists: src.host.credential_socket,
            custom_credentials_file_exists: src.host.external_sds,
            istio_version: ISTIO_VERSION.into(),
        };
        let parts = metadata::resolve(&options)
            .map_err(|e| ConfigError::Invalid { name: "node metadata", message: e.to_string() })?;
        let labels = parts.typed.map("LABELS");
        let workload = parts.typed.str("WORKLOAD_NAME");
        let tracing_name = pc.other.get("tracingServiceName").and_then(|v| v.as_str());
        let cluster = service_cluster(
            &pc.service_cluster,
            tracing_name,
            &src.args.service_cluster,
            &labels,
            workload,
            &pod.namespace,
        );
        let l = &parts.locality;
        Ok(Self {
            id,
            cluster,
            ips,
            locality: LocalityView {
                region: l.region.clone(),
                zone: l.zone.clone(),
                sub_zone: l.sub_zone.clone(),
            },
            metadata: parts.json.clone(),
            parts,
            delta_xds: vars::ISTIO_DELTA_XDS.bool(env)?,
            grpc_bootstrap: vars::GRPC_XDS_BOOTSTRAP
                .value(env)
                .map(PathBuf::from)
                .unwrap_or_else(|| Path::new(&pc.config_path).join("grpc-bootstrap.json")),
        })
    }

    /// The metadata the typed fields alone give (what pilot-agent puts in the gRPC
    /// bootstrap for proxyless apps, which carries no raw keys).
    pub fn typed_metadata(&self) -> &Map<String, Value> {
        &self.parts.typed_json
    }
}

/// The proxy's IPs as pilot-agent lists them: `INSTANCE_IP` first, then the pod's
/// other addresses (up interfaces, no loopback or link-local, none of those on
/// interfaces in `traffic.sidecar.istio.io/excludeInterfaces`), else `127.0.0.1` and
/// `::1` when the pod has none.
fn instance_ips(src: &Sources<'_>, pod: &PodIdentity) -> Vec<String> {
    let mut ips: Vec<String> = pod.ip().map(|ip| ip.to_string()).into_iter().collect();
    let excluded: Vec<&str> = src
        .annotations
        .get("traffic.sidecar.istio.io/excludeInterfaces")
        .map(|v| v.split(',').map(str::trim).filter(|s| !s.is_empty()).collect())
        .unwrap_or_default();
    let mut found: Vec<(String, IpAddr)> = src.host.interface_ips.clone();
    if found.is_empty() {
        found = vec![
            ("lo".into(), IpAddr::from([127, 0, 0, 1])),
            ("lo".into(), IpAddr::from(std::net::Ipv6Addr::LOCALHOST)),
        ];
    }
    let excluded_ips: Vec<IpAddr> = src
        .host
        .interface_ips
        .iter()
        .filter(|(name, _)| excluded.contains(&name.as_str()))
        .map(|(_, ip)| *ip)
        .collect();
    for (_, ip) in found {
        let text = ip.to_string();
        if !excluded_ips.contains(&ip) && !ips.contains(&text) {
            ips.push(text);
        }
    }
    ips
}

/// `GetPilotSan`: the discovery address's host; `localhost` is istiod's in-cluster name.
fn pilot_san(discovery_address: &str) -> String {
    match discovery_address.split(':').next().unwrap_or_default() {
        "localhost" => "istiod.istio-system.svc".into(),
        host => host.into(),
    }
}

/// The node's cluster as Istio names it (`getServiceCluster`): ProxyConfig's
/// `serviceCluster` when set to something else than `istio-proxy`; with
/// `tracingServiceName` the canonical name (and namespace) it asks for; else the app
/// label (`app`, `app.kubernetes.io/name`, `service.istio.io/canonical-name`) or the
/// workload name, with the namespace; else `istio-proxy.<ns>`.
pub fn service_cluster(
    configured: &str,
    tracing_service_name: Option<&str>,
    flag: &str,
    labels: &BTreeMap<String, String>,
    workload: &str,
    namespace: &str,
) -> String {
    let or_default = |name: &str| -> String {
        if !name.is_empty() && name != "istio-proxy" {
            return name.to_string();
        }
        let app = ["app", "app.kubernetes.io/name", "service.istio.io/canonical-name"]
            .iter()
            .find_map(|k| labels.get(*k));
        match (app, workload.is_empty(), namespace.is_empty()) {
            (Some(app), ..) => format!("{app}.{namespace}"),
            (None, false, _) => format!("{workload}.{namespace}"),
            (None, true, false) => format!("istio-proxy.{namespace}"),
            (None, true, true) => "istio-proxy".into(),
        }
    };
    match tracing_service_name {
        // An empty serviceCluster takes `--serviceCluster` (default istio-proxy).
        None if configured.is_empty() => or_default(flag),
        None => or_default(configured),
        Some(mode @ ("CANONICAL_NAME_ONLY" | "CANONICAL_NAME_AND_NAMESPACE")) => {
            let canonical = ["service.istio.io/canonical-name", "app.kubernetes.io/name", "app"]
                .iter()
                .find_map(|k| labels.get(*k).cloned())
                .unwrap_or_else(|| if workload.is_empty() { "istio-proxy".into() } else { workload.into() });
            if mode == "CANONICAL_NAME_AND_NAMESPACE" && !namespace.is_empty() {
                format!("{canonical}.{namespace}")
            } else {
                or_default(&canonical)
            }
        }
        Some(_) => or_default("istio-proxy"),
    }
}

/// Istio's node id: `<type>~<ip>~<pod>.<namespace>~<namespace>.svc.cluster.local`.
pub fn node_id(proxy_type: &str, ip: &str, pod: &str, namespace: &str, domain: &str) -> String {
    format!("{proxy_type}~{ip}~{pod}.{namespace}~{domain}")
}
