//! Envoy as pilot-agent starts it: binary, bootstrap (written, templated or custom),
//! drain, log levels, concurrency, the capabilities it keeps, and who runs it at all.

use std::path::{Path, PathBuf};

use super::{ConfigError, PodIdentity, ProxyConfig, Sources, vars};
use crate::envoy::{DrainPolicy, EnvoySettings};

/// Who runs Envoy, and so which of the agent's services Envoy needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub enum EnvoyMode {
    /// The agent launches, supervises and drains Envoy (the default).
    Launch,
    /// `WEIR_ENVOY_MODE=external`: Envoy is run by somebody else (systemd on a VM, a
    /// test); the agent serves the XDS and SDS sockets it connects to.
    External,
    /// `DISABLE_ENVOY=true`: no Envoy at all (proxyless gRPC). As pilot-agent, no SDS
    /// server either; the workload certificate is still issued, rotated and written
    /// to `OUTPUT_CERTS`, and the XDS socket serves the application's gRPC library.
    Disabled,
}

impl EnvoyMode {
    pub fn resolve(src: &Sources<'_>) -> Result<Self, ConfigError> {
        if vars::DISABLE_ENVOY.bool(src.env)? {
            return Ok(Self::Disabled);
        }
        match vars::WEIR_ENVOY_MODE.text(src.env).as_str() {
            "launch" => Ok(Self::Launch),
            "external" => Ok(Self::External),
            other => Err(vars::WEIR_ENVOY_MODE.invalid(other.into(), "launch or external")),
        }
    }

    /// Whether the agent starts Envoy itself.
    pub fn launches(self) -> bool {
        self == Self::Launch
    }

    /// Whether an Envoy (the agent's or another's) reads secrets from the SDS socket.
    pub fn serves_sds(self) -> bool {
        self != Self::Disabled
    }
}

/// What Envoy is started with.
pub fn settings(
    src: &Sources<'_>,
    pod: &PodIdentity,
    pc: &ProxyConfig,
) -> Result<EnvoySettings, ConfigError> {
    let (env, args) = (src.env, src.args);
    let (log_level, component_log_level) =
        crate::envoy::process::log_levels(&args.proxy_log_level, &args.proxy_component_log_level);
    let drain = if vars::EXIT_ON_ZERO_ACTIVE_CONNECTIONS.bool(env)? {
        DrainPolicy::UntilIdle { minimum: vars::MINIMUM_DRAIN_DURATION.duration(env)? }
    } else {
        DrainPolicy::Fixed { wait: pc.termination_drain_duration }
    };
    let v6 = pod.ip().is_some_and(|ip| ip.is_ipv6());
    let custom = !pc.custom_config_file.is_empty();
    Ok(EnvoySettings {
        binary: pc.binary_path.clone().into(),
        bootstrap: if custom {
            pc.custom_config_file.clone().into()
        } else {
            Path::new(&pc.config_path).join("envoy-rev.json")
        },
        custom_bootstrap: custom,
        template: [args.template_file.as_str(), pc.proxy_bootstrap_template_path.as_str()]
            .into_iter()
            .find(|t| !t.is_empty())
            .map(PathBuf::from),
        bootstrap_override: vars::ISTIO_BOOTSTRAP_OVERRIDE.value(env).map(PathBuf::from),
        drain_duration: pc.drain_duration,
        drain,
        log_level,
        component_log_level,
        concurrency: pc.concurrency,
        local_address_ip_version: if v6 { "v6" } else { "v4" },
        admin_port: pc.proxy_admin_port,
        capabilities: if vars::ISTIO_META_INTERCEPTION_MODE.text(env) == "TPROXY" {
            &[crate::privileges::Capability::NetAdmin]
        } else {
            &[]
        },
        restart: vars::WEIR_RESTART_ENVOY.bool(env)?,
    })
}
