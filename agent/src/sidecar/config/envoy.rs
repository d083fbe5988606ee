//! Envoy as pilot-agent starts it: binary, bootstrap (written, templated or custom),
//! drain, log levels, concurrency, the capabilities it keeps, and who runs it at all.

use std::path::{Path, PathBuf};

use super::{ConfigError, NodeSettings, ProxyConfig, Sources, vars};
use crate::sidecar::envoy::{DrainPolicy, EnvoySettings};

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
    node: &NodeSettings,
    pc: &ProxyConfig,
) -> Result<EnvoySettings, ConfigError> {
    let (env, args) = (src.env, src.args);
    let (log_level, component_log_level) =
        crate::sidecar::envoy::process::log_levels(&args.proxy_log_level, &args.proxy_component_log_level);
    let drain = if vars::EXIT_ON_ZERO_ACTIVE_CONNECTIONS.bool(env)? {
        DrainPolicy::UntilIdle { minimum: vars::MINIMUM_DRAIN_DURATION.duration(env)? }
    } else {
        DrainPolicy::Fixed { wait: pc.termination_drain_duration }
    };
    // IPv6 only when every IP the proxy has is IPv6, as pilot-agent decides.
    let v6 = !node.ips.is_empty()
        && node.ips.iter().all(|ip| ip.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_ipv6()));
    let custom = !pc.custom_config_file.is_empty();
    // The template pilot-agent renders: ISTIO_BOOTSTRAP, else ProxyConfig's (or
    // --templateFile), else the image's; Weir's built-in bootstrap when there is none.
    let template = vars::ISTIO_BOOTSTRAP
        .value(env)
        .or_else(|| Some(pc.proxy_bootstrap_template_path.clone()).filter(|t| !t.is_empty()))
        .map(PathBuf::from)
        .or_else(|| {
            let image = Path::new(crate::sidecar::envoy::bootstrap::IMAGE_TEMPLATE);
            src.files.is_file(image).then(|| image.to_path_buf())
        });
    let yaml = template.as_ref().is_some_and(|t| {
        let name = t.to_string_lossy();
        name.ends_with(".yaml") || name.ends_with(".yaml.tmpl")
    });
    Ok(EnvoySettings {
        binary: pc.binary_path.clone().into(),
        bootstrap: if custom {
            pc.custom_config_file.clone().into()
        } else {
            Path::new(&pc.config_path).join(if yaml { "envoy-rev.yaml" } else { "envoy-rev.json" })
        },
        custom_bootstrap: custom,
        template,
        bootstrap_env: crate::sidecar::envoy::bootstrap::BootstrapEnv {
            delta_xds: vars::ISTIO_DELTA_XDS.bool(env)?,
            dual_stack: vars::ISTIO_DUAL_STACK.bool(env)?,
            status_port_proxy_protocol: vars::ENVOY_STATUS_PORT_ENABLE_PROXY_PROTOCOL.bool(env)?,
            strip_fragment_from_path: vars::HTTP_STRIP_FRAGMENT_FROM_PATH_UNSAFE_IF_DISABLED.bool(env)?,
            compliance_policy: {
                let policy = vars::COMPLIANCE_POLICY.text(env);
                crate::support::tls::Compliance::parse(&policy).map_err(|message| ConfigError::Invalid {
                    name: vars::COMPLIANCE_POLICY.name,
                    message,
                })?;
                policy
            },
            xds_root_cert: vars::XDS_ROOT_CA.value(env).unwrap_or_default(),
            host_ip: vars::HOST_IP.value(env),
        },
        skip_deprecated_logs: vars::ENVOY_SKIP_DEPRECATED_LOGS.bool(env)?,
        bootstrap_override: vars::ISTIO_BOOTSTRAP_OVERRIDE.value(env).map(PathBuf::from),
        drain_duration: pc.drain_duration,
        drain,
        log_level,
        component_log_level,
        concurrency: pc.concurrency,
        local_address_ip_version: if v6 { "v6" } else { "v4" },
        admin_port: pc.proxy_admin_port,
        capabilities: if vars::ISTIO_META_INTERCEPTION_MODE.text(env) == "TPROXY" {
            &[crate::support::privileges::Capability::NetAdmin]
        } else {
            &[]
        },
        restart: vars::WEIR_RESTART_ENVOY.bool(env)?,
    })
}
