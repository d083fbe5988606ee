//! The status server (15020) and what it answers from: the app probes it rewrites,
//! the app metrics it merges, where probes are sent; and, on VMs, ProxyConfig's
//! `readinessProbe` for the workload health check.

use serde::Serialize;

use super::{ConfigError, PodIdentity, ProxyConfig, ProxyType, Sources, vars};

/// The status server (15020) and what it probes and merges.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusSettings {
    /// `statusPort`; 0 turns the server off.
    pub port: u16,
    /// Envoy's readiness listener (15021) and Prometheus listener
    /// (`ENVOY_PROMETHEUS_PORT`, 15090), which the merged scrape reads.
    pub readiness_port: u16,
    pub prometheus_port: u16,
    /// `ISTIO_KUBE_APP_PROBERS`.
    pub app_probers: crate::sidecar::status::AppProbers,
    /// Where rewritten probes go: the pod IP (`INSTANCE_IP`), as kubelet's would;
    /// 127.0.0.1 without one or with `REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION`.
    pub probe_destination: std::net::IpAddr,
    /// `ISTIO_PROMETHEUS_ANNOTATIONS`: app metrics merged into `/stats/prometheus`.
    pub app_metrics: Vec<crate::sidecar::status::merge::ScrapeTarget>,
    /// `PILOT_AGENT_MERGE_ENVOY_STATS`: Envoy's metrics merged too (Istio 1.31).
    pub merge_envoy_stats: bool,
}

impl StatusSettings {
    pub fn resolve(src: &Sources<'_>, pod: &PodIdentity, pc: &ProxyConfig) -> Result<Self, ConfigError> {
        let env = src.env;
        let invalid = |name, e: &dyn std::error::Error| ConfigError::Invalid { name, message: e.to_string() };
        let app_probers = crate::sidecar::status::AppProbers::parse(&vars::ISTIO_KUBE_APP_PROBERS.text(env))
            .map_err(|e| invalid("ISTIO_KUBE_APP_PROBERS", &e))?;
        // Istio merges app metrics for sidecars only (15020 is exposed on gateways).
        let app_metrics = if src.args.proxy_type == ProxyType::Sidecar {
            crate::sidecar::status::merge::parse_scrape_config(
                vars::ISTIO_PROMETHEUS_ANNOTATIONS.value(env).as_deref(),
                pc.status_port,
            )
            .map_err(|e| invalid("ISTIO_PROMETHEUS_ANNOTATIONS", &e))?
        } else {
            Vec::new()
        };
        let legacy = vars::REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION.bool(env)?;
        let probe_destination = match pod.ip() {
            Some(ip) if !legacy => ip,
            Some(std::net::IpAddr::V6(_)) => std::net::Ipv6Addr::LOCALHOST.into(),
            _ => std::net::Ipv4Addr::LOCALHOST.into(),
        };
        Ok(Self {
            port: pc.status_port,
            readiness_port: 15021,
            // The merged scrape asks Envoy where the bootstrap put its listener.
            prometheus_port: u16::try_from(vars::ENVOY_PROMETHEUS_PORT.count(env)?).map_err(|e| {
                ConfigError::Invalid { name: vars::ENVOY_PROMETHEUS_PORT.name, message: e.to_string() }
            })?,
            app_probers,
            probe_destination,
            app_metrics,
            merge_envoy_stats: vars::PILOT_AGENT_MERGE_ENVOY_STATS.bool(env)?,
        })
    }
}

/// ProxyConfig `readinessProbe` (a WorkloadGroup's, on a VM): the workload health check.
pub fn health_check(
    pc: &ProxyConfig,
) -> Result<Option<crate::sidecar::health::HealthCheckSettings>, ConfigError> {
    let Some(value) = pc.other.get("readinessProbe") else { return Ok(None) };
    let invalid = |message: String| ConfigError::ProxyConfig {
        source_name: "ProxyConfig readinessProbe".into(),
        message,
    };
    let json = serde_json::to_value(value).map_err(|e| invalid(e.to_string()))?;
    Ok(Some(crate::sidecar::health::HealthCheckSettings::from_json(&json).map_err(invalid)?))
}
