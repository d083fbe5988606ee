//! pilot-agent's `proxy` command line, parsed as Go's pflag parses it
//! (`--name value`, `--name=value`, booleans bare or `=true|false`), including
//! Istio's logging flags. Unknown flags are skipped with a warning, as pilot-agent
//! whitelists them; the positional argument is the proxy type.

use serde::Serialize;

use super::ConfigError;

/// `sidecar` or `router` (a gateway).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ProxyType {
    #[default]
    Sidecar,
    Router,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxyArgs {
    pub proxy_type: ProxyType,
    pub domain: String,
    pub mesh_config: String,
    pub service_cluster: String,
    pub proxy_log_level: String,
    pub proxy_component_log_level: String,
    pub concurrency: u32,
    pub template_file: String,
    /// Deprecated `--trust-domain`: used when `TRUST_DOMAIN` is unset.
    pub trust_domain: Option<String>,
    /// Weir: `--discovery-address host:port` overrides ProxyConfig's; `embedded` runs
    /// the control plane inside the agent (standalone mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discovery_address: Option<String>,
    /// Weir, standalone: the services file and the mesh CA's state directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mesh_services: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_dir: Option<String>,
    pub outlier_log_path: String,
    pub sts_port: u16,
    pub token_manager_plugin: String,
    pub profiling: bool,
    /// `--log_output_level` (the agent's own log level, Istio scopes syntax).
    pub log_output_level: String,
    pub log_as_json: bool,
    /// Flags pilot-agent would accept and ignore.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ignored: Vec<String>,
}

impl Default for ProxyArgs {
    fn default() -> Self {
        Self {
            proxy_type: ProxyType::Sidecar,
            domain: String::new(),
            mesh_config: "./etc/istio/config/mesh".into(),
            service_cluster: "istio-proxy".into(),
            proxy_log_level: "warning".into(),
            proxy_component_log_level: String::new(),
            concurrency: 0,
            template_file: String::new(),
            trust_domain: None,
            discovery_address: None,
            mesh_services: None,
            state_dir: None,
            outlier_log_path: String::new(),
            sts_port: 0,
            token_manager_plugin: String::new(),
            profiling: true,
            log_output_level: "default:info".into(),
            log_as_json: false,
            ignored: Vec::new(),
        }
    }
}

const LOG_LEVELS: &[&str] = &["trace", "debug", "info", "warning", "warn", "error", "critical", "off"];

pub const USAGE: &str = "\
Usage: pilot-agent proxy [sidecar|router] [flags]

Flags (as pilot-agent's):
  --domain string                  DNS domain suffix (default ${POD_NAMESPACE}.svc.cluster.local)
  --meshConfig string              mesh config file (default ./etc/istio/config/mesh)
  --serviceCluster string          service cluster (default istio-proxy)
  --proxyLogLevel string           Envoy log level (default warning)
  --proxyComponentLogLevel string  Envoy component log levels
  --concurrency int                Envoy worker threads (legacy; prefer ProxyConfig)
  --templateFile string            bootstrap template
  --outlierLogPath string          outlier detection log path
  --stsPort int                    STS port (0: off)
  --tokenManagerPlugin string      token manager plugin
  --trust-domain string            deprecated (Istio 1.7): the trust domain when TRUST_DOMAIN is unset
  --discovery-address string       Weir: istiod's address (overrides ProxyConfig), or `embedded`:
                                   serve xDS and certificates from the agent (standalone mode)
  --mesh-services string           Weir, standalone: the services file (default ./etc/weir/mesh.yaml,
                                   env WEIR_MESH_SERVICES)
  --state-dir string               Weir, standalone: the mesh CA's directory (default ./var/lib/weir,
                                   env WEIR_STATE_DIR)
  --profiling                      enable profiling endpoints (default true)
  --log_output_level string        agent log level (default default:info)
  --log_as_json                    agent logs as JSON";

impl ProxyArgs {
    /// Parses the arguments after `proxy`.
    pub fn parse(args: &[String]) -> Result<Self, ConfigError> {
        let mut out = Self::default();
        let mut positional = Vec::new();
        let mut i = 0;
        while i < args.len() {
            let arg = &args[i];
            i += 1;
            let Some(flag) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-').filter(|f| f.len() > 1))
            else {
                positional.push(arg.clone());
                continue;
            };
            if flag.is_empty() {
                positional.extend(args[i..].iter().cloned());
                break;
            }
            let (name, inline) = match flag.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (flag, None),
            };
            let bad = |expected: &'static str, value: &str| ConfigError::Flag {
                name: format!("--{name}"),
                value: value.to_string(),
                expected,
            };
            if matches!(name, "profiling" | "log_as_json" | "log_caller_enabled") {
                let value = match inline.as_deref() {
                    None => true,
                    Some(v) => super::env::parse_bool(v).ok_or_else(|| bad("true or false", v))?,
                };
                match name {
                    "profiling" => out.profiling = value,
                    "log_as_json" => out.log_as_json = value,
                    _ => {}
                }
                continue;
            }
            let mut value = || -> Result<String, ConfigError> {
                if let Some(v) = &inline {
                    return Ok(v.clone());
                }
                let v = args.get(i).cloned().ok_or_else(|| ConfigError::Flag {
                    name: format!("--{name}"),
                    value: String::new(),
                    expected: "a value",
                })?;
                i += 1;
                Ok(v)
            };
            match name {
                "domain" => out.domain = value()?,
                "meshConfig" => out.mesh_config = value()?,
                "serviceCluster" => out.service_cluster = value()?,
                "proxyLogLevel" => {
                    let v = value()?;
                    let level = v.split(',').next().unwrap_or_default();
                    if !level.contains(':') && !LOG_LEVELS.contains(&level) {
                        return Err(bad("one of trace, debug, info, warning, error, critical, off", &v));
                    }
                    out.proxy_log_level = v;
                }
                "proxyComponentLogLevel" => out.proxy_component_log_level = value()?,
                "concurrency" => {
                    let v = value()?;
                    out.concurrency = v.parse().map_err(|_| bad("a non-negative integer", &v))?;
                }
                "templateFile" => out.template_file = value()?,
                "outlierLogPath" => out.outlier_log_path = value()?,
                "stsPort" => {
                    let v = value()?;
                    out.sts_port = v.parse().map_err(|_| bad("a port number", &v))?;
                }
                "tokenManagerPlugin" => out.token_manager_plugin = value()?,
                // Istio 1.7's injector still passes it (seed 003); later pilot-agents
                // take the trust domain from TRUST_DOMAIN / meshConfig instead.
                "trust-domain" => out.trust_domain = Some(value()?),
                "discovery-address" | "discoveryAddress" => out.discovery_address = Some(value()?),
                "mesh-services" => out.mesh_services = Some(value()?),
                "state-dir" => out.state_dir = Some(value()?),
                "log_output_level" => out.log_output_level = value()?,
                "log_target"
                | "log_caller"
                | "log_stacktrace_level"
                | "log_rotate"
                | "log_rotate_max_age"
                | "log_rotate_max_backups"
                | "log_rotate_max_size"
                | "vklog" => {
                    let _ = value()?;
                }
                "h" | "help" => return Err(ConfigError::Help),
                unknown => {
                    // pflag's whitelist: the next word is this flag's value unless it
                    // looks like a flag.
                    if inline.is_none() && args.get(i).is_some_and(|a| !a.starts_with('-')) {
                        i += 1;
                    }
                    out.ignored.push(format!("--{unknown}"));
                }
            }
        }
        match positional.first().map(String::as_str) {
            None | Some("sidecar") => out.proxy_type = ProxyType::Sidecar,
            Some("router") => out.proxy_type = ProxyType::Router,
            Some(other) => {
                return Err(ConfigError::Flag {
                    name: "proxy type".into(),
                    value: other.into(),
                    expected: "sidecar or router",
                });
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<ProxyArgs, ConfigError> {
        ProxyArgs::parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn the_injectors_command_line() {
        let a = parse(&[
            "sidecar",
            "--domain",
            "app.svc.cluster.local",
            "--proxyLogLevel=warning",
            "--proxyComponentLogLevel=misc:error",
            "--log_output_level=default:info",
        ])
        .unwrap();
        assert_eq!(a.proxy_type, ProxyType::Sidecar);
        assert_eq!(a.domain, "app.svc.cluster.local");
        assert_eq!(a.proxy_component_log_level, "misc:error");
        assert_eq!(a.mesh_config, "./etc/istio/config/mesh");
        assert!(a.profiling);
    }

    #[test]
    fn gateways_booleans_and_unknown_flags() {
        let a = parse(&[
            "router",
            "--profiling=false",
            "--concurrency",
            "2",
            "--futureFlag",
            "x",
            "--log_as_json",
        ])
        .unwrap();
        assert_eq!(a.proxy_type, ProxyType::Router);
        assert!(!a.profiling && a.log_as_json);
        assert_eq!(a.concurrency, 2);
        assert_eq!(a.ignored, vec!["--futureFlag"]);
    }

    #[test]
    fn bad_input_names_the_flag() {
        let e = parse(&["waypoint"]).unwrap_err().to_string();
        assert!(e.contains("proxy type") && e.contains("waypoint"), "{e}");
        let e = parse(&["--concurrency=lots"]).unwrap_err().to_string();
        assert!(e.contains("--concurrency") && e.contains("lots"), "{e}");
        let e = parse(&["--proxyLogLevel", "loud"]).unwrap_err().to_string();
        assert!(e.contains("--proxyLogLevel"), "{e}");
        assert!(parse(&["--domain"]).unwrap_err().to_string().contains("--domain"));
        assert!(parse(&["--profiling=maybe"]).is_err());
    }
}
