//! The agent's configuration: one struct, loaded once from flags > env > files >
//! defaults exactly where pilot-agent reads each, validated at start and printable
//! (`weir config`, and logged as "Effective config" when the agent starts).
//!
//! Each part resolves itself from the same [`Sources`] in its own module: the pod
//! (`pod`), ProxyConfig's layers (`proxy_config`), istiod (`xds`), the workload
//! certificate and its CA (`identity`), Envoy (`envoy`), the status server
//! (`status`), DNS (`dns`), Wasm (`wasm`), the node istiod sees (`node`) and the STS
//! server (`sts`). Every environment variable is an entry of `vars`.
//!
//! Paths stay relative as Istio writes them (`./etc/istio/proxy`,
//! `./var/run/secrets/...`): they resolve against the working directory, `/` in a pod.

pub mod args;
pub mod dns;
pub mod env;
pub mod envoy;
pub mod identity;
pub mod node;
pub mod pod;
pub mod proxy_config;
pub mod status;
pub mod sts;
pub mod vars;
pub mod wasm;
pub mod xds;

#[cfg(test)]
mod tests;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Serialize;

pub use args::{ProxyArgs, ProxyType};
pub use dns::DnsSettings;
pub use env::{Env, MapEnv, ProcessEnv};
pub use envoy::EnvoyMode;
pub use identity::{CaSettings, IdentitySettings};
pub use node::NodeSettings;
pub use pod::PodIdentity;
pub use proxy_config::{ControlPlaneAuthPolicy, ProxyConfig};
pub use status::StatusSettings;
pub use xds::XdsSettings;

use crate::envoy::EnvoySettings;

/// Where pilot-agent looks for things (relative to the working directory).
pub mod paths {
    pub const POD_ANNOTATIONS: &str = "./etc/istio/pod/annotations";
    /// The pod's labels (downward API), for the service cluster name.
    pub const POD_LABELS: &str = "./etc/istio/pod/labels";
    pub const TOKEN: &str = "./var/run/secrets/tokens/istio-token";
    /// The old mounted-certificate location, checked first for the XDS root.
    pub const MOUNTED_ROOT_CERT: &str = "./etc/certs/root-cert.pem";
    /// The `istio-ca-root-cert` ConfigMap mount.
    pub const CA_ROOT_CERT: &str = "./var/run/secrets/istio/root-cert.pem";
    pub const RESOLV_CONF: &str = "/etc/resolv.conf";
    /// Where Envoy dials SDS (`WORKLOAD_IDENTITY_SOCKET_FILE` renames the socket).
    pub const SDS_SOCKET_DIR: &str = "./var/run/secrets/workload-spiffe-uds";
    /// Mounted workload certificates (SPIFFE CSI drivers and the like).
    pub const WORKLOAD_CREDENTIALS: &str = "./var/run/secrets/workload-spiffe-credentials";
    /// The old mounted-certificate directory (`FILE_MOUNTED_CERTS`, `OUTPUT_CERTS` on VMs).
    pub const ETC_CERTS: &str = "./etc/certs";
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("environment variable {name}={value:?}: expected {expected}")]
    Env { name: String, value: String, expected: &'static str },
    #[error("flag {name} {value:?}: expected {expected}")]
    Flag { name: String, value: String, expected: &'static str },
    #[error("{source_name}: {message}")]
    ProxyConfig { source_name: String, message: String },
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "root CA file for XDS does not exist: {0} (set XDS_ROOT_CA to a file, or SYSTEM for the system roots)"
    )]
    XdsRootCa(PathBuf),
    #[error("root CA file for XDS required but PILOT_CERT_PROVIDER is none")]
    XdsRootCaRequired,
    #[error(
        "root CA file for the CA does not exist: {0} (set CA_ROOT_CA to a file, or SYSTEM for the system roots)"
    )]
    CaRootCa(PathBuf),
    #[error("root CA file for the CA required but PILOT_CERT_PROVIDER is none")]
    CaRootCaRequired,
    #[error("discovery address {0:?} is not host:port")]
    DiscoveryAddress(String),
    #[error("{name}: {message}")]
    Invalid { name: &'static str, message: String },
    #[error("help requested")]
    Help,
}

/// The files the loader reads, behind a trait so tests pass a map.
pub trait Files {
    /// The file's text; `Ok(None)` when it does not exist.
    fn read(&self, path: &Path) -> Result<Option<String>, ConfigError>;
    /// A regular file exists at `path`.
    fn is_file(&self, path: &Path) -> bool;
}

/// The real filesystem.
pub struct RealFiles;

impl Files for RealFiles {
    fn read(&self, path: &Path) -> Result<Option<String>, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(ConfigError::Read { path: path.into(), source }),
        }
    }
    fn is_file(&self, path: &Path) -> bool {
        path.is_file()
    }
}

impl Files for BTreeMap<PathBuf, String> {
    fn read(&self, path: &Path) -> Result<Option<String>, ConfigError> {
        Ok(self.get(path).cloned())
    }
    fn is_file(&self, path: &Path) -> bool {
        self.contains_key(path)
    }
}

/// What every part of the configuration is resolved from: the command line, the
/// environment and the files, plus the pod's downward-API files read once.
pub struct Sources<'a> {
    pub args: &'a ProxyArgs,
    pub env: &'a dyn Env,
    pub files: &'a dyn Files,
    /// `./etc/istio/pod/annotations`.
    pub annotations: BTreeMap<String, String>,
    /// `./etc/istio/pod/labels`.
    pub labels: BTreeMap<String, String>,
}

impl<'a> Sources<'a> {
    pub fn read(args: &'a ProxyArgs, env: &'a dyn Env, files: &'a dyn Files) -> Result<Self, ConfigError> {
        let podinfo = |path: &str| -> Result<_, ConfigError> {
            Ok(files.read(Path::new(path))?.map(|t| proxy_config::parse_annotations(&t)).unwrap_or_default())
        };
        Ok(Self {
            args,
            env,
            files,
            annotations: podinfo(paths::POD_ANNOTATIONS)?,
            labels: podinfo(paths::POD_LABELS)?,
        })
    }
}

pub(crate) fn serialize_duration<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&env::format_duration(*d))
}

pub(crate) fn serialize_display<S: serde::Serializer, T: std::fmt::Display>(
    v: &T,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentConfig {
    pub args: ProxyArgs,
    pub pod: PodIdentity,
    pub proxy_config: ProxyConfig,
    pub xds: XdsSettings,
    pub dns: DnsSettings,
    pub identity: IdentitySettings,
    pub envoy: EnvoySettings,
    pub status: StatusSettings,
    /// What Envoy tells istiod about itself.
    pub node: NodeSettings,
    /// Who runs Envoy: the agent, somebody else, or nobody (proxyless).
    pub envoy_mode: EnvoyMode,
    /// Standalone mode (`--discovery-address embedded`): the embedded control plane.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub standalone: Option<crate::standalone::StandaloneSettings>,
    /// The STS server (`--stsPort` above 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sts: Option<crate::sts::StsSettings>,
    /// ProxyConfig `readinessProbe` (VMs): the workload health check.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_check: Option<crate::health::HealthCheckSettings>,
    /// Where remote Wasm modules are fetched to, and how.
    pub wasm: crate::wasm::CacheOptions,
}

impl AgentConfig {
    /// Loads the configuration from the process's flags, env and files.
    pub fn load(args: &[String]) -> Result<Self, ConfigError> {
        Self::resolve(ProxyArgs::parse(args)?, &ProcessEnv, &RealFiles)
    }

    /// Resolves the configuration from its sources (pure over `env` and `files`), each
    /// part in the order the later ones need it.
    pub fn resolve(args: ProxyArgs, env: &dyn Env, files: &dyn Files) -> Result<Self, ConfigError> {
        let src = Sources::read(&args, env, files)?;
        let pod = PodIdentity::resolve(&src)?;
        let proxy_config = proxy_config::resolve(&src)?;
        let xds = XdsSettings::resolve(&src, &pod, &proxy_config)?;
        let dns = DnsSettings::resolve(&src)?;
        let identity = IdentitySettings::resolve(&src, &pod, &proxy_config)?;
        let envoy = envoy::settings(&src, &pod, &proxy_config)?;
        let node = NodeSettings::resolve(&src, &pod, &proxy_config)?;
        let status = StatusSettings::resolve(&src, &pod, &proxy_config)?;
        let envoy_mode = EnvoyMode::resolve(&src)?;
        let standalone = xds::standalone(&src);
        let sts = sts::resolve(&src, &identity)?;
        let health_check = status::health_check(&proxy_config)?;
        let wasm = wasm::resolve(&src)?;
        Ok(Self {
            args,
            pod,
            proxy_config,
            xds,
            dns,
            identity,
            envoy,
            status,
            node,
            envoy_mode,
            standalone,
            sts,
            health_check,
            wasm,
        })
    }

    /// The effective configuration as YAML.
    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(self).expect("config serializes")
    }
}
