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

/// The flags pilot-agent takes without a value (`--profiling`, `--profiling=false`).
const BOOL_FLAGS: &[&str] = &["profiling", "log_as_json", "log_caller_enabled"];
/// pilot-agent's logging flags Weir accepts and ignores (its logs are `WEIR_LOG`'s).
const IGNORED_WITH_VALUE: &[&str] = &[
    "log_target",
    "log_caller",
    "log_stacktrace_level",
    "log_rotate",
    "log_rotate_max_age",
    "log_rotate_max_backups",
    "log_rotate_max_size",
    "vklog",
];

impl ProxyArgs {
    /// Parses the arguments after `proxy` as pflag does: `--name value`,
    /// `--name=value`, `-name`, `--` ending the flags; unknown flags are kept to be
    /// warned about, as pilot-agent's whitelist does.
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
            if BOOL_FLAGS.contains(&name) {
                out.set_bool(name, inline.as_deref())?;
                continue;
            }
            if matches!(name, "h" | "help") {
                return Err(ConfigError::Help);
            }
            let known = name_is_known(name);
            let value = match inline {
                Some(v) => Some(v),
                // pflag's whitelist: an unknown flag's next word is its value unless it
                // looks like a flag.
                None if !known && args.get(i).is_none_or(|a| a.starts_with('-')) => None,
                None => {
                    let v = args.get(i).cloned().ok_or_else(|| flag_error(name, "", "a value"))?;
                    i += 1;
                    Some(v)
                }
            };
            match value {
                Some(value) if known => out.set(name, value)?,
                _ => out.ignored.push(format!("--{name}")),
            }
        }
        out.proxy_type = match positional.first().map(String::as_str) {
            None | Some("sidecar") => ProxyType::Sidecar,
            Some("router") => ProxyType::Router,
            Some(other) => {
                return Err(ConfigError::Flag {
                    name: "proxy type".into(),
                    value: other.into(),
                    expected: "sidecar or router",
                });
            }
        };
        Ok(out)
    }

    fn set_bool(&mut self, name: &str, inline: Option<&str>) -> Result<(), ConfigError> {
        let value = match inline {
            None => true,
            Some(v) => super::env::parse_bool(v).ok_or_else(|| flag_error(name, v, "true or false"))?,
        };
        match name {
            "profiling" => self.profiling = value,
            "log_as_json" => self.log_as_json = value,
            _ => {}
        }
        Ok(())
    }

    /// Sets a known flag that takes a value.
    fn set(&mut self, name: &str, v: String) -> Result<(), ConfigError> {
        match name {
            "domain" => self.domain = v,
            "meshConfig" => self.mesh_config = v,
            "serviceCluster" => self.service_cluster = v,
            "proxyLogLevel" => {
                let level = v.split(',').next().unwrap_or_default();
                if !level.contains(':') && !LOG_LEVELS.contains(&level) {
                    return Err(flag_error(
                        name,
                        &v,
                        "one of trace, debug, info, warning, error, critical, off",
                    ));
                }
                self.proxy_log_level = v;
            }
            "proxyComponentLogLevel" => self.proxy_component_log_level = v,
            "concurrency" => {
                self.concurrency = v.parse().map_err(|_| flag_error(name, &v, "a non-negative integer"))?
            }
            "templateFile" => self.template_file = v,
            "outlierLogPath" => self.outlier_log_path = v,
            "stsPort" => self.sts_port = v.parse().map_err(|_| flag_error(name, &v, "a port number"))?,
            "tokenManagerPlugin" => self.token_manager_plugin = v,
            // Istio 1.7's injector still passes it (seed 003); later pilot-agents take
            // the trust domain from TRUST_DOMAIN / meshConfig instead.
            "trust-domain" => self.trust_domain = Some(v),
            "discovery-address" | "discoveryAddress" => self.discovery_address = Some(v),
            "mesh-services" => self.mesh_services = Some(v),
            "state-dir" => self.state_dir = Some(v),
            "log_output_level" => self.log_output_level = v,
            _ => {} // IGNORED_WITH_VALUE
        }
        Ok(())
    }
}

/// Flags `ProxyArgs::set` takes, and the ignored ones that still take a value.
fn name_is_known(name: &str) -> bool {
    const KNOWN: &[&str] = &[
        "domain",
        "meshConfig",
        "serviceCluster",
        "proxyLogLevel",
        "proxyComponentLogLevel",
        "concurrency",
        "templateFile",
        "outlierLogPath",
        "stsPort",
        "tokenManagerPlugin",
        "trust-domain",
        "discovery-address",
        "discoveryAddress",
        "mesh-services",
        "state-dir",
        "log_output_level",
    ];
    KNOWN.contains(&name) || IGNORED_WITH_VALUE.contains(&name)
}

fn flag_error(name: &str, value: &str, expected: &'static str) -> ConfigError {
    ConfigError::Flag { name: format!("--{name}"), value: value.to_string(), expected }
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
