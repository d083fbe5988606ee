//! Who this proxy is: the pod's name, namespace, IPs, service account and cluster, from
//! the downward-API variables the injector sets.

use serde::Serialize;

use super::{ConfigError, Sources, vars};

/// Who this proxy is.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodIdentity {
    pub name: String,
    pub namespace: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance_ip: Option<String>,
    /// `HOST_IP`: the node's address (`$(HOST_IP)` in a bootstrap override).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_ip: Option<String>,
    pub service_account: String,
    /// `ISTIO_META_CLUSTER_ID`, sent to istiod as `ClusterID`.
    pub cluster_id: String,
    /// The DNS domain (`--domain`, default `<ns>.svc.cluster.local`).
    pub domain: String,
}

impl PodIdentity {
    pub fn resolve(src: &Sources<'_>) -> Result<Self, ConfigError> {
        let env = src.env;
        let namespace = vars::POD_NAMESPACE.text(env);
        let pod = Self {
            name: vars::POD_NAME.text(env),
            instance_ip: vars::INSTANCE_IP.value(env),
            host_ip: vars::HOST_IP.value(env),
            service_account: vars::SERVICE_ACCOUNT.text(env),
            cluster_id: vars::ISTIO_META_CLUSTER_ID.text(env),
            domain: if src.args.domain.is_empty() {
                format!("{namespace}.svc.cluster.local")
            } else {
                src.args.domain.clone()
            },
            namespace,
        };
        if let Some(ip) = &pod.instance_ip
            && ip.parse::<std::net::IpAddr>().is_err()
        {
            return Err(vars::INSTANCE_IP.invalid(ip.clone(), "an IP address"));
        }
        Ok(pod)
    }

    /// The pod IP, when it is one.
    pub fn ip(&self) -> Option<std::net::IpAddr> {
        self.instance_ip.as_deref().and_then(|ip| ip.parse().ok())
    }
}
