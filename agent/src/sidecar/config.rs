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
pub mod proxy_json;
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
pub use xds::{RedactedHeaders, XdsSettings};

use crate::sidecar::envoy::EnvoySettings;

/// Where pilot-agent looks for things (relative to the working directory).
pub mod paths {
    pub const POD_ANNOTATIONS: &str = "./etc/istio/pod/annotations";
    /// The pod's labels (downward API), for the service cluster name.
    pub const POD_LABELS: &str = "./etc/istio/pod/labels";
    /// An SDS server for credentials other than the workload's (istio's `credential-uds`).
    pub const CREDENTIAL_SOCKET: &str = "./var/run/secrets/credential-uds/socket";
    /// Where the agent serves file-based secrets when another SDS server owns the
    /// workload socket (`sds-files-grpc` in the bootstrap).
    pub const FILES_SOCKET: &str = "./var/run/secrets/credential-uds/files-socket";
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
/// environment, the files, the pod's downward-API files read once, and what the agent
/// found on the host at start.
pub struct Sources<'a> {
    pub args: &'a ProxyArgs,
    pub env: &'a dyn Env,
    pub files: &'a dyn Files,
    /// `./etc/istio/pod/annotations`, parsed (empty when absent or invalid).
    pub annotations: BTreeMap<String, String>,
    /// The annotations and labels files' text, when present.
    pub annotations_file: Option<String>,
    pub labels_file: Option<String>,
    pub host: HostFacts,
}

/// What the agent finds on the host before resolving its configuration.
#[derive(Debug, Clone, Default)]
pub struct HostFacts {
    /// The pod's addresses by interface (up, not loopback, not link-local), as
    /// pilot-agent's `GetPrivateIPs` lists them.
    pub interface_ips: Vec<(String, std::net::IpAddr)>,
    /// An SDS server answers on `./var/run/secrets/credential-uds/socket`.
    pub credential_socket: bool,
    /// Another SDS server (SPIRE) owns the workload socket.
    pub external_sds: bool,
}

impl HostFacts {
    /// The real host: interface addresses and the two sockets pilot-agent probes.
    pub fn discover(sds_socket: &Path) -> Self {
        Self {
            interface_ips: private_ips(),
            credential_socket: answers(Path::new(paths::CREDENTIAL_SOCKET)),
            external_sds: answers(sds_socket),
        }
    }
}

/// `GetPrivateIPs`: addresses of up, non-loopback interfaces, without loopback and
/// link-local ones, IPv4-mapped ones unwrapped.
fn private_ips() -> Vec<(String, std::net::IpAddr)> {
    use nix::net::if_::InterfaceFlags;
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else { return Vec::new() };
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for ifa in addrs {
        if !ifa.flags.contains(InterfaceFlags::IFF_UP) || ifa.flags.contains(InterfaceFlags::IFF_LOOPBACK) {
            continue;
        }
        let Some(addr) = ifa.address else { continue };
        if let Some(sin) = addr.as_sockaddr_in() {
            let ip = sin.ip();
            if !ip.is_loopback() && !ip.is_link_local() && !ip.is_unspecified() {
                v4.push((ifa.interface_name.clone(), ip.into()));
            }
        } else if let Some(sin6) = addr.as_sockaddr_in6() {
            let ip = sin6.ip();
            match ip.to_ipv4_mapped() {
                Some(v) => v4.push((ifa.interface_name.clone(), v.into())),
                None if !ip.is_loopback() && !ip.is_unicast_link_local() && !ip.is_unspecified() => {
                    v6.push((ifa.interface_name.clone(), ip.into()))
                }
                None => {}
            }
        }
    }
    v4.extend(v6);
    v4
}

/// A Unix socket at `path` accepts a connection (pilot-agent's `checkSocket`).
fn answers(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt as _;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
        && std::os::unix::net::UnixStream::connect(path).is_ok()
}

impl<'a> Sources<'a> {
    pub fn read(
        args: &'a ProxyArgs,
        env: &'a dyn Env,
        files: &'a dyn Files,
        host: HostFacts,
    ) -> Result<Self, ConfigError> {
        let annotations_file = files.read(Path::new(paths::POD_ANNOTATIONS))?;
        let labels_file = files.read(Path::new(paths::POD_LABELS))?;
        let annotations = match annotations_file.as_deref().map(crate::sidecar::podinfo::parse) {
            Some(Ok(map)) => map,
            Some(Err(e)) => {
                tracing::warn!(error = %e, file = paths::POD_ANNOTATIONS, "pod annotations ignored");
                BTreeMap::new()
            }
            None => BTreeMap::new(),
        };
        Ok(Self { args, env, files, annotations, annotations_file, labels_file, host })
    }
}

pub(crate) use crate::support::text::serialize_duration;

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
    pub standalone: Option<crate::sidecar::standalone::StandaloneSettings>,
    /// The STS server (`--stsPort` above 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sts: Option<crate::sidecar::sts::StsSettings>,
    /// ProxyConfig `readinessProbe` (VMs): the workload health check.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_check: Option<crate::sidecar::health::HealthCheckSettings>,
    /// Where remote Wasm modules are fetched to, and how.
    pub wasm: crate::sidecar::wasm::CacheOptions,
}

impl AgentConfig {
    /// Loads the configuration from the process's flags, env and files, and the host.
    pub fn load(args: &[String]) -> Result<Self, ConfigError> {
        let args = ProxyArgs::parse(args)?;
        let socket = vars::WORKLOAD_IDENTITY_SOCKET_FILE.text(&ProcessEnv);
        let host = HostFacts::discover(&Path::new(paths::SDS_SOCKET_DIR).join(socket));
        Self::resolve_on(args, &ProcessEnv, &RealFiles, host)
    }

    /// Resolves the configuration from its sources (pure over `env` and `files`), on a
    /// host with nothing found on it.
    pub fn resolve(args: ProxyArgs, env: &dyn Env, files: &dyn Files) -> Result<Self, ConfigError> {
        Self::resolve_on(args, env, files, HostFacts::default())
    }

    /// Resolves the configuration, each part in the order the later ones need it.
    pub fn resolve_on(
        args: ProxyArgs,
        env: &dyn Env,
        files: &dyn Files,
        host: HostFacts,
    ) -> Result<Self, ConfigError> {
        let src = Sources::read(&args, env, files, host)?;
        let pod = PodIdentity::resolve(&src)?;
        let proxy_config = proxy_config::resolve(&src)?;
        let xds = XdsSettings::resolve(&src, &pod, &proxy_config)?;
        let dns = DnsSettings::resolve(&src)?;
        let identity = IdentitySettings::resolve(&src, &pod, &proxy_config)?;
        let pc_json = proxy_json::proxy_config_json(&proxy_config, &src.args.service_cluster);
        let node = NodeSettings::resolve(&src, &pod, &proxy_config, pc_json)?;
        let envoy = envoy::settings(&src, &node, &proxy_config)?;
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
