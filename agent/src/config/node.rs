//! The node Envoy (and a proxyless gRPC app) presents to istiod: its id, its cluster
//! and its metadata (`ISTIO_META_*`, `ISTIO_METAJSON_*`, and what pilot-agent adds).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde::Serialize;
use serde_json::Value;

use super::{ConfigError, PodIdentity, ProxyConfig, ProxyType, Sources, vars};

/// Envoy's node: id, cluster and metadata.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSettings {
    pub id: String,
    pub cluster: String,
    pub metadata: BTreeMap<String, Value>,
    /// `ISTIO_DELTA_XDS` (default true): Delta ADS, else state of the world.
    pub delta_xds: bool,
    /// `GRPC_XDS_BOOTSTRAP`: where proxyless gRPC applications find their bootstrap.
    pub grpc_bootstrap: PathBuf,
}

impl NodeSettings {
    pub fn resolve(src: &Sources<'_>, pod: &PodIdentity, pc: &ProxyConfig) -> Result<Self, ConfigError> {
        let env = src.env;
        let mut metadata = BTreeMap::new();
        // proxyMetadata entries act as env vars (Istio applies them to the agent's env).
        let mut vars: Vec<(String, String)> =
            pc.proxy_metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        vars.extend(env.vars());
        for (name, value) in vars {
            if let Some(key) = name.strip_prefix(vars::ISTIO_METAJSON.prefix) {
                let parsed: Value = serde_json::from_str(&value).map_err(|_| ConfigError::Env {
                    name: name.clone(),
                    value: value.clone(),
                    expected: "a JSON value",
                })?;
                metadata.insert(key.to_string(), parsed);
            } else if let Some(key) = name.strip_prefix(vars::ISTIO_META.prefix) {
                metadata.insert(key.to_string(), Value::String(value));
            }
        }
        let ip = pod.instance_ip.clone().unwrap_or_else(|| "127.0.0.1".into());
        for (key, value) in [
            ("NAMESPACE", pod.namespace.clone()),
            ("NAME", pod.name.clone()),
            ("INSTANCE_IPS", ip.clone()),
            ("SERVICE_ACCOUNT", pod.service_account.clone()),
            ("CLUSTER_ID", pod.cluster_id.clone()),
            ("ISTIO_VERSION", crate::build_info::BUILD_INFO.version.to_string()),
        ] {
            if !value.is_empty() {
                metadata.entry(key.to_string()).or_insert(Value::String(value));
            }
        }
        let proxy_type = match src.args.proxy_type {
            ProxyType::Sidecar => "sidecar",
            ProxyType::Router => "router",
        };
        Ok(Self {
            id: crate::envoy::bootstrap::node_id(proxy_type, &ip, &pod.name, &pod.namespace, &pod.domain),
            cluster: service_cluster(&pc.service_cluster, &src.labels, &metadata, &pod.namespace),
            metadata,
            delta_xds: vars::ISTIO_DELTA_XDS.bool(env)?,
            grpc_bootstrap: vars::GRPC_XDS_BOOTSTRAP
                .value(env)
                .map(PathBuf::from)
                .unwrap_or_else(|| Path::new(&pc.config_path).join("grpc-bootstrap.json")),
        })
    }
}

/// Envoy's `--service-cluster` as Istio names it: ProxyConfig's `serviceCluster` when
/// set to something else than `istio-proxy`, else `<app label>.<ns>`, else
/// `<WORKLOAD_NAME>.<ns>`, else `istio-proxy.<ns>`.
fn service_cluster(
    configured: &str,
    labels: &BTreeMap<String, String>,
    metadata: &BTreeMap<String, Value>,
    namespace: &str,
) -> String {
    if !configured.is_empty() && configured != "istio-proxy" {
        return configured.to_string();
    }
    let app = labels.get("app").or_else(|| labels.get("app.kubernetes.io/name")).filter(|a| !a.is_empty());
    let workload = metadata.get("WORKLOAD_NAME").and_then(|w| w.as_str()).filter(|w| !w.is_empty());
    match (app.map(String::as_str).or(workload), namespace.is_empty()) {
        (Some(name), _) => format!("{name}.{namespace}"),
        (None, false) => format!("istio-proxy.{namespace}"),
        (None, true) => "istio-proxy".into(),
    }
}
