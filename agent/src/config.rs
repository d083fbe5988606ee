//! The agent's configuration: one struct, loaded once from flags > env > files >
//! defaults exactly where pilot-agent reads each, validated at start and printable
//! (`weir config`, and logged as "Effective config" when the agent starts).
//!
//! Paths stay relative as Istio writes them (`./etc/istio/proxy`,
//! `./var/run/secrets/...`): they resolve against the working directory, `/` in a pod.

pub mod args;
pub mod env;
pub mod proxy_config;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Serialize;

pub use args::{ProxyArgs, ProxyType};
pub use env::{Env, MapEnv, ProcessEnv};
pub use proxy_config::{ControlPlaneAuthPolicy, ProxyConfig};

use crate::{
    envoy::{DrainPolicy, EnvoySettings},
    identity::{CertFiles, KeyAlgorithm, KeyOptions, RotationPolicy, WorkloadIdentity},
    xds::{ClientIdentity, RootCerts, Transport, UpstreamConfig},
};

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
    pub const SDS_SOCKET_FILE: &str = "socket";
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

/// The connection to istiod and the socket Envoy uses.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct XdsSettings {
    /// `<configPath>/XDS`.
    pub uds_path: PathBuf,
    pub discovery_address: String,
    pub plaintext: bool,
    /// `None`: the system roots (`XDS_ROOT_CA=SYSTEM`) or plaintext.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root_ca: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub istiod_san: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_key: Option<PathBuf>,
    pub token_path: PathBuf,
    /// `XDS_HEADER_<name>` → `<name>`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

/// The DNS proxy.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DnsSettings {
    /// `ISTIO_META_DNS_CAPTURE` for sidecars, or `ISTIO_META_ENABLE_DNS_SERVER`.
    pub enabled: bool,
    /// `DNS_PROXY_ADDR`.
    pub address: String,
    pub forward_parallel: bool,
    #[serde(serialize_with = "serialize_duration")]
    pub forward_timeout: Duration,
    pub resolv_conf: PathBuf,
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

/// The connection to the CA (istiod's, by default on the discovery address).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CaSettings {
    /// `CA_ADDR`, else the discovery address.
    pub address: String,
    /// Port 15010: no TLS, as pilot-agent.
    pub plaintext: bool,
    /// `None`: the system roots (`CA_ROOT_CA=SYSTEM`) or plaintext.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root_ca: Option<PathBuf>,
    /// `ISTIOD_SAN`, when the CA is istiod (no `CA_ADDR`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub san: Option<String>,
    /// `CA_HEADER_<name>` → `<name>`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// `ISTIO_META_CERT_SIGNER`, sent as `CertSigner` metadata.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_signer: Option<String>,
}

/// Workload certificates: whose, what key, from where, how long, served where.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IdentitySettings {
    pub identity: WorkloadIdentity,
    pub keys: KeyOptions,
    /// `None` when certificates are mounted (no CA client).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca: Option<CaSettings>,
    /// Mounted workload certificates, when present.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mounted: Option<CertFiles>,
    /// `SECRET_TTL`: the validity asked of the CA.
    #[serde(serialize_with = "serialize_duration")]
    pub secret_ttl: Duration,
    pub rotation: RotationPolicy,
    /// The SDS socket Envoy dials.
    pub sds_socket: PathBuf,
    /// `OUTPUT_CERTS`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_dir: Option<PathBuf>,
    /// `FILE_DEBOUNCE_DURATION`.
    #[serde(serialize_with = "serialize_duration")]
    pub file_debounce: Duration,
    pub token_path: PathBuf,
    pub cluster_id: String,
}

/// Envoy's `--service-cluster` as Istio names it: ProxyConfig's `serviceCluster` when
/// set to something else than `istio-proxy`, else `<app label>.<ns>`, else
/// `<WORKLOAD_NAME>.<ns>`, else `istio-proxy.<ns>`.
fn service_cluster(
    configured: &str,
    labels: &BTreeMap<String, String>,
    metadata: &BTreeMap<String, serde_json::Value>,
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

/// The status server (15020) and what it probes and merges.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusSettings {
    /// `statusPort`; 0 turns the server off.
    pub port: u16,
    /// Envoy's readiness listener (15021) and Prometheus listener (15090).
    pub readiness_port: u16,
    pub prometheus_port: u16,
    /// `ISTIO_KUBE_APP_PROBERS`.
    pub app_probers: crate::status::AppProbers,
    /// Where rewritten probes go: the pod IP (`INSTANCE_IP`), as kubelet's would;
    /// 127.0.0.1 without one or with `REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION`.
    pub probe_destination: std::net::IpAddr,
    /// `ISTIO_PROMETHEUS_ANNOTATIONS`: app metrics merged into `/stats/prometheus`.
    pub app_metrics: Vec<crate::status::merge::ScrapeTarget>,
}

/// Envoy's node: id, cluster and metadata (`ISTIO_META_*`, `ISTIO_METAJSON_*`, and
/// what pilot-agent adds itself).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSettings {
    pub id: String,
    pub cluster: String,
    pub metadata: BTreeMap<String, serde_json::Value>,
    /// `ISTIO_DELTA_XDS` (default true): Delta ADS, else state of the world.
    pub delta_xds: bool,
    /// `GRPC_XDS_BOOTSTRAP`: where proxyless gRPC applications find their bootstrap.
    pub grpc_bootstrap: PathBuf,
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
    fn from_env(env: &dyn Env) -> Result<Self, ConfigError> {
        if env.bool_or("DISABLE_ENVOY", false)? {
            return Ok(Self::Disabled);
        }
        match env.text("WEIR_ENVOY_MODE").as_deref() {
            None | Some("" | "launch") => Ok(Self::Launch),
            Some("external") => Ok(Self::External),
            Some(other) => Err(ConfigError::Env {
                name: "WEIR_ENVOY_MODE".into(),
                value: other.into(),
                expected: "launch or external",
            }),
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

impl AgentConfig {
    /// Loads the configuration from the process's flags, env and files.
    pub fn load(args: &[String]) -> Result<Self, ConfigError> {
        Self::resolve(ProxyArgs::parse(args)?, &ProcessEnv, &RealFiles)
    }

    /// Resolves the configuration from its sources (pure over `env` and `files`).
    pub fn resolve(args: ProxyArgs, env: &dyn Env, files: &dyn Files) -> Result<Self, ConfigError> {
        let pod = PodIdentity {
            name: env.text("POD_NAME").unwrap_or_default(),
            namespace: env.text("POD_NAMESPACE").unwrap_or_default(),
            instance_ip: env.text("INSTANCE_IP"),
            host_ip: env.text("HOST_IP"),
            service_account: env.text("SERVICE_ACCOUNT").unwrap_or_default(),
            cluster_id: env.text("ISTIO_META_CLUSTER_ID").unwrap_or_default(),
            domain: if args.domain.is_empty() {
                format!("{}.svc.cluster.local", env.text("POD_NAMESPACE").unwrap_or_default())
            } else {
                args.domain.clone()
            },
        };
        if let Some(ip) = &pod.instance_ip
            && ip.parse::<std::net::IpAddr>().is_err()
        {
            return Err(ConfigError::Env {
                name: "INSTANCE_IP".into(),
                value: ip.clone(),
                expected: "an IP address",
            });
        }

        let proxy_config = Self::proxy_config(&args, env, files)?;

        let address = proxy_config.discovery_address.clone();
        let port = address
            .rsplit_once(':')
            .and_then(|(h, p)| (!h.is_empty()).then_some(p))
            .and_then(|p| p.parse::<u16>().ok())
            .ok_or_else(|| ConfigError::DiscoveryAddress(address.clone()))?;
        let plaintext =
            proxy_config.control_plane_auth_policy == ControlPlaneAuthPolicy::None || port == 15010;
        let (root_ca, client) = if plaintext {
            (None, None)
        } else {
            (Self::xds_root_ca(env, files, &proxy_config)?, Self::xds_client_cert(env, &proxy_config)?)
        };
        let headers = env
            .vars()
            .into_iter()
            .filter_map(|(k, v)| k.strip_prefix("XDS_HEADER_").map(|name| (name.to_string(), v)))
            .collect();
        let xds = XdsSettings {
            uds_path: Path::new(&proxy_config.config_path).join("XDS"),
            discovery_address: address,
            plaintext,
            root_ca,
            istiod_san: env.text("ISTIOD_SAN"),
            client_cert: client.as_ref().map(|c| c.cert.clone()),
            client_key: client.map(|c| c.key),
            token_path: paths::TOKEN.into(),
            headers,
        };
        xds.upstream(&pod.cluster_id)
            .validate()
            .map_err(|e| ConfigError::Invalid { name: "XDS upstream", message: crate::error_chain(&e) })?;

        let dns_capture = env.bool_or("ISTIO_META_DNS_CAPTURE", false)?;
        let dns_server = env.bool_or("ISTIO_META_ENABLE_DNS_SERVER", false)?;
        let dns = DnsSettings {
            enabled: (dns_capture && args.proxy_type == ProxyType::Sidecar) || dns_server,
            address: env.text("DNS_PROXY_ADDR").unwrap_or_else(|| crate::dns::server::DEFAULT_ADDRESS.into()),
            forward_parallel: env.bool_or("DNS_FORWARD_PARALLEL", false)?,
            forward_timeout: env.duration_or("DNS_FORWARD_TIMEOUT", crate::dns::server::UPSTREAM_TIMEOUT)?,
            resolv_conf: paths::RESOLV_CONF.into(),
        };
        let identity = Self::identity(env, files, &pod, &proxy_config, args.trust_domain.as_deref())?;
        let envoy = Self::envoy(env, &args, &pod, &proxy_config)?;
        let labels = files
            .read(Path::new(paths::POD_LABELS))?
            .map(|t| proxy_config::parse_annotations(&t))
            .unwrap_or_default();
        let node = Self::node(env, &args, &pod, &proxy_config, &labels)?;
        let status = Self::status(env, &args, &pod, &proxy_config)?;
        let envoy_mode = EnvoyMode::from_env(env)?;
        let standalone = (args.discovery_address.as_deref() == Some("embedded")).then(|| {
            crate::standalone::StandaloneSettings {
                services: args
                    .mesh_services
                    .clone()
                    .or_else(|| env.text("WEIR_MESH_SERVICES"))
                    .unwrap_or_else(|| "./etc/weir/mesh.yaml".into())
                    .into(),
                state_dir: args
                    .state_dir
                    .clone()
                    .or_else(|| env.text("WEIR_STATE_DIR"))
                    .unwrap_or_else(|| "./var/lib/weir".into())
                    .into(),
            }
        });
        let sts = Self::sts(env, &args, &identity)?;
        let health_check = match proxy_config.other.get("readinessProbe") {
            Some(value) => {
                let invalid = |message: String| ConfigError::ProxyConfig {
                    source_name: "ProxyConfig readinessProbe".into(),
                    message,
                };
                let json = serde_json::to_value(value).map_err(|e| invalid(e.to_string()))?;
                Some(crate::health::HealthCheckSettings::from_json(&json).map_err(invalid)?)
            }
            None => None,
        };
        let wasm = Self::wasm(env)?;
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

    fn wasm(env: &dyn Env) -> Result<crate::wasm::CacheOptions, ConfigError> {
        let d = crate::wasm::CacheOptions::default();
        Ok(crate::wasm::CacheOptions {
            dir: env.text("WEIR_WASM_CACHE_DIR").map(PathBuf::from).unwrap_or(d.dir),
            module_expiry: env.duration_or("WASM_MODULE_EXPIRY", d.module_expiry)?,
            purge_interval: env.duration_or("WASM_PURGE_INTERVAL", d.purge_interval)?,
            insecure_registries: env
                .text("WASM_INSECURE_REGISTRIES")
                .map(|v| v.split(',').map(|r| r.trim().to_string()).filter(|r| !r.is_empty()).collect())
                .unwrap_or_default(),
            http_timeout: env.duration_or("WASM_HTTP_REQUEST_TIMEOUT", d.http_timeout)?,
            max_retries: env.u32_or("WASM_HTTP_REQUEST_MAX_RETRIES", d.max_retries)?,
            max_bytes: d.max_bytes,
        })
    }

    fn sts(
        env: &dyn Env,
        args: &ProxyArgs,
        identity: &IdentitySettings,
    ) -> Result<Option<crate::sts::StsSettings>, ConfigError> {
        if args.sts_port == 0 {
            return Ok(None);
        }
        let plugin = args.token_manager_plugin.clone();
        if !plugin.is_empty() && plugin != crate::sts::GOOGLE_TOKEN_EXCHANGE {
            return Err(ConfigError::Flag {
                name: "--tokenManagerPlugin".into(),
                value: plugin,
                expected: "GoogleTokenExchange",
            });
        }
        let text = env.text("WEIR_STS_TOKEN_ENDPOINT").unwrap_or_else(|| crate::sts::DEFAULT_ENDPOINT.into());
        let endpoint = text
            .parse::<hyper::Uri>()
            .ok()
            .filter(|u| matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some())
            .ok_or_else(|| ConfigError::Env {
                name: "WEIR_STS_TOKEN_ENDPOINT".into(),
                value: text.clone(),
                expected: "an http:// or https:// URL",
            })?;
        Ok(Some(crate::sts::StsSettings {
            port: args.sts_port,
            plugin: if plugin.is_empty() { crate::sts::GOOGLE_TOKEN_EXCHANGE.into() } else { plugin },
            endpoint,
            trust_domain: identity.identity.trust_domain.clone(),
            identity_provider: env.text("GKE_CLUSTER_URL").unwrap_or_default(),
        }))
    }

    fn proxy_config(args: &ProxyArgs, env: &dyn Env, files: &dyn Files) -> Result<ProxyConfig, ConfigError> {
        let annotations = files
            .read(Path::new(paths::POD_ANNOTATIONS))?
            .map(|t| proxy_config::parse_annotations(&t))
            .unwrap_or_default();
        let mesh_text = files.read(Path::new(&args.mesh_config))?;
        let mesh_default = match &mesh_text {
            Some(text) => proxy_config::mesh_default_config(&args.mesh_config, text)?,
            None => None,
        };
        let proxy_env = env.text("PROXY_CONFIG");
        let mut layers = Vec::new();
        if let Some(text) = &mesh_default {
            layers.push(proxy_config::Layer {
                source: format!("mesh config {} defaultConfig", args.mesh_config),
                yaml: text,
            });
        }
        if let Some(text) = &proxy_env {
            layers.push(proxy_config::Layer { source: "PROXY_CONFIG".into(), yaml: text });
        }
        if let Some(text) = annotations.get("proxy.istio.io/config") {
            layers
                .push(proxy_config::Layer { source: "annotation proxy.istio.io/config".into(), yaml: text });
        }
        let mut config = proxy_config::layered(&layers)?;
        if args.concurrency != 0 {
            tracing::warn!(
                concurrency = args.concurrency,
                "legacy --concurrency flag detected; prefer ProxyConfig"
            );
            config.concurrency = Some(args.concurrency);
        }
        // `--serviceCluster` only fills a ProxyConfig that names the serviceCluster
        // variant with no value; Istio's default naming (tracingServiceName
        // APP_LABEL_AND_NAMESPACE) ignores it, and so does Weir.
        if let Some(address) = annotations.get("sidecar.istio.io/discoveryAddress") {
            config.discovery_address = address.clone();
        }
        match args.discovery_address.as_deref() {
            Some("embedded") => config.discovery_address = crate::standalone::EMBEDDED_ADDRESS.into(),
            Some(address) => config.discovery_address = address.into(),
            None => {}
        }
        if let Some(port) = annotations.get("status.sidecar.istio.io/port") {
            config.status_port = port.parse().map_err(|_| ConfigError::ProxyConfig {
                source_name: "annotation status.sidecar.istio.io/port".into(),
                message: format!("{port:?} is not a port number"),
            })?;
        }
        Ok(config)
    }

    fn identity(
        env: &dyn Env,
        files: &dyn Files,
        pod: &PodIdentity,
        pc: &ProxyConfig,
        trust_domain_flag: Option<&str>,
    ) -> Result<IdentitySettings, ConfigError> {
        let invalid = |name: &'static str, value: String, expected: &'static str| ConfigError::Env {
            name: name.into(),
            value,
            expected,
        };
        let algorithm = match env.text("ECC_SIGNATURE_ALGORITHM").as_deref() {
            None => KeyAlgorithm::Rsa(env.u32_or("WORKLOAD_RSA_KEY_SIZE", 2048)?),
            Some("ECDSA") => match env.text("ECC_CURVE").as_deref() {
                None | Some("P256") => KeyAlgorithm::EcdsaP256,
                Some(other) => return Err(invalid("ECC_CURVE", other.into(), "P256")),
            },
            Some(other) => {
                return Err(invalid("ECC_SIGNATURE_ALGORITHM", other.into(), "ECDSA, or unset for RSA"));
            }
        };
        let keys = KeyOptions { algorithm, pkcs8: env.bool_or("PKCS8_KEY", false)? };
        keys.validate()
            .map_err(|e| ConfigError::Invalid { name: "WORKLOAD_RSA_KEY_SIZE", message: e.to_string() })?;
        let rotation = RotationPolicy {
            grace_ratio: env.f64_in("SECRET_GRACE_PERIOD_RATIO", 0.5, 0.0..=1.0)?,
            grace_ratio_jitter: env.f64_in("SECRET_GRACE_PERIOD_RATIO_JITTER", 0.01, 0.0..=1.0)?,
        };
        let secret_ttl = env.duration_or("SECRET_TTL", Duration::from_secs(24 * 3600))?;
        if secret_ttl < Duration::from_secs(1) {
            return Err(invalid("SECRET_TTL", env::format_duration(secret_ttl), "at least 1s"));
        }
        let socket_file =
            env.text("WORKLOAD_IDENTITY_SOCKET_FILE").unwrap_or_else(|| paths::SDS_SOCKET_FILE.into());
        if socket_file.contains('/') {
            return Err(invalid(
                "WORKLOAD_IDENTITY_SOCKET_FILE",
                socket_file,
                "a file name (the socket lives in ./var/run/secrets/workload-spiffe-uds)",
            ));
        }
        let output_dir = env.text("OUTPUT_CERTS").map(PathBuf::from);

        // Mounted certificates: the SPIFFE credentials directory, else ./etc/certs
        // (unless the agent itself writes there, or it would never rotate).
        let spiffe = CertFiles::in_dir(Path::new(paths::WORKLOAD_CREDENTIALS));
        let etc = CertFiles::in_dir(Path::new(paths::ETC_CERTS));
        let exists =
            |c: &CertFiles| files.is_file(&c.cert_chain) && files.is_file(&c.key) && files.is_file(&c.root);
        let writes_etc = output_dir
            .as_deref()
            .is_some_and(|d| d.components().eq(Path::new(paths::ETC_CERTS).components()));
        let mounted = if exists(&spiffe) {
            Some(spiffe)
        } else if env.bool_or("FILE_MOUNTED_CERTS", false)? || (exists(&etc) && !writes_etc) {
            Some(etc)
        } else {
            None
        };

        let ca = if mounted.is_some() {
            None
        } else {
            if let Some(provider) = env.text("CA_PROVIDER").filter(|p| p != "Citadel") {
                return Err(invalid("CA_PROVIDER", provider, "Citadel (the only CA provider Weir speaks)"));
            }
            let ca_addr = env.text("CA_ADDR");
            let address = ca_addr.clone().unwrap_or_else(|| pc.discovery_address.clone());
            let plaintext = address.ends_with(":15010");
            let root_ca = if plaintext { None } else { Self::ca_root_ca(env, files)? };
            let headers = env
                .vars()
                .into_iter()
                .filter_map(|(k, v)| k.strip_prefix("CA_HEADER_").map(|name| (name.to_string(), v)))
                .collect();
            let settings = CaSettings {
                address,
                plaintext,
                root_ca,
                san: if ca_addr.is_none() { env.text("ISTIOD_SAN") } else { None },
                headers,
                cert_signer: env.text("ISTIO_META_CERT_SIGNER"),
            };
            settings
                .upstream(Path::new(paths::TOKEN), &pod.cluster_id)
                .validate()
                .map_err(|e| ConfigError::Invalid { name: "CA_ADDR", message: crate::error_chain(&e) })?;
            Some(settings)
        };
        Ok(IdentitySettings {
            identity: WorkloadIdentity {
                trust_domain: env
                    .text("TRUST_DOMAIN")
                    .or_else(|| trust_domain_flag.filter(|t| !t.is_empty()).map(String::from))
                    .unwrap_or_else(|| "cluster.local".into()),
                namespace: pod.namespace.clone(),
                service_account: pod.service_account.clone(),
            },
            keys,
            ca,
            mounted,
            secret_ttl,
            rotation,
            sds_socket: Path::new(paths::SDS_SOCKET_DIR).join(socket_file),
            output_dir,
            file_debounce: env.duration_or("FILE_DEBOUNCE_DURATION", Duration::from_millis(100))?,
            token_path: paths::TOKEN.into(),
            cluster_id: pod.cluster_id.clone(),
        })
    }

    fn envoy(
        env: &dyn Env,
        args: &ProxyArgs,
        pod: &PodIdentity,
        pc: &ProxyConfig,
    ) -> Result<EnvoySettings, ConfigError> {
        let (log_level, component_log_level) =
            crate::envoy::process::log_levels(&args.proxy_log_level, &args.proxy_component_log_level);
        let drain = if env.bool_or("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", false)? {
            DrainPolicy::UntilIdle {
                minimum: env.duration_or("MINIMUM_DRAIN_DURATION", Duration::from_secs(5))?,
            }
        } else {
            DrainPolicy::Fixed { wait: pc.termination_drain_duration }
        };
        let v6 = pod
            .instance_ip
            .as_deref()
            .and_then(|ip| ip.parse::<std::net::IpAddr>().ok())
            .is_some_and(|ip| ip.is_ipv6());
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
            bootstrap_override: env.text("ISTIO_BOOTSTRAP_OVERRIDE").map(PathBuf::from),
            drain_duration: pc.drain_duration,
            drain,
            log_level,
            component_log_level,
            concurrency: pc.concurrency,
            local_address_ip_version: if v6 { "v6" } else { "v4" },
            admin_port: pc.proxy_admin_port,
            capabilities: if env.text("ISTIO_META_INTERCEPTION_MODE").as_deref() == Some("TPROXY") {
                &[crate::privileges::Capability::NetAdmin]
            } else {
                &[]
            },
            restart: env.bool_or("WEIR_RESTART_ENVOY", false)?,
        })
    }

    fn status(
        env: &dyn Env,
        args: &ProxyArgs,
        pod: &PodIdentity,
        pc: &ProxyConfig,
    ) -> Result<StatusSettings, ConfigError> {
        let invalid = |name, e: &dyn std::error::Error| ConfigError::Invalid { name, message: e.to_string() };
        let app_probers =
            crate::status::AppProbers::parse(&env.text("ISTIO_KUBE_APP_PROBERS").unwrap_or_default())
                .map_err(|e| invalid("ISTIO_KUBE_APP_PROBERS", &e))?;
        // Istio merges app metrics for sidecars only (15020 is exposed on gateways).
        let app_metrics = if args.proxy_type == ProxyType::Sidecar {
            crate::status::merge::parse_scrape_config(
                env.text("ISTIO_PROMETHEUS_ANNOTATIONS").as_deref(),
                pc.status_port,
            )
            .map_err(|e| invalid("ISTIO_PROMETHEUS_ANNOTATIONS", &e))?
        } else {
            Vec::new()
        };
        let pod_ip = pod.instance_ip.as_deref().and_then(|ip| ip.parse::<std::net::IpAddr>().ok());
        let legacy = env.bool_or("REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION", false)?;
        let probe_destination = match pod_ip {
            Some(ip) if !legacy => ip,
            Some(std::net::IpAddr::V6(_)) => std::net::Ipv6Addr::LOCALHOST.into(),
            _ => std::net::Ipv4Addr::LOCALHOST.into(),
        };
        Ok(StatusSettings {
            port: pc.status_port,
            readiness_port: 15021,
            prometheus_port: 15090,
            app_probers,
            probe_destination,
            app_metrics,
        })
    }

    fn node(
        env: &dyn Env,
        args: &ProxyArgs,
        pod: &PodIdentity,
        pc: &ProxyConfig,
        labels: &BTreeMap<String, String>,
    ) -> Result<NodeSettings, ConfigError> {
        use serde_json::Value;
        let mut metadata = BTreeMap::new();
        // proxyMetadata entries act as env vars (Istio applies them to the agent's env).
        let mut vars: Vec<(String, String)> =
            pc.proxy_metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        vars.extend(env.vars());
        for (name, value) in vars {
            if let Some(key) = name.strip_prefix("ISTIO_METAJSON_") {
                let parsed: Value = serde_json::from_str(&value).map_err(|_| ConfigError::Env {
                    name: name.clone(),
                    value: value.clone(),
                    expected: "a JSON value",
                })?;
                metadata.insert(key.to_string(), parsed);
            } else if let Some(key) = name.strip_prefix("ISTIO_META_") {
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
        let proxy_type = match args.proxy_type {
            ProxyType::Sidecar => "sidecar",
            ProxyType::Router => "router",
        };
        Ok(NodeSettings {
            id: crate::envoy::bootstrap::node_id(proxy_type, &ip, &pod.name, &pod.namespace, &pod.domain),
            cluster: service_cluster(&pc.service_cluster, labels, &metadata, &pod.namespace),
            metadata,
            delta_xds: env.bool_or("ISTIO_DELTA_XDS", true)?,
            grpc_bootstrap: env
                .text("GRPC_XDS_BOOTSTRAP")
                .map(PathBuf::from)
                .unwrap_or_else(|| Path::new(&pc.config_path).join("grpc-bootstrap.json")),
        })
    }

    /// pilot-agent's `FindRootCAForCA`.
    fn ca_root_ca(env: &dyn Env, files: &dyn Files) -> Result<Option<PathBuf>, ConfigError> {
        let path = match env.text("CA_ROOT_CA") {
            Some(v) if v == "SYSTEM" => return Ok(None),
            Some(v) => PathBuf::from(v),
            None => match env.text("PILOT_CERT_PROVIDER").as_deref() {
                Some("custom") => PathBuf::from(paths::MOUNTED_ROOT_CERT),
                _ if env.text("PROV_CERT").is_some() => {
                    // Provisioned VMs: the file may appear later; pilot-agent does not check.
                    return Ok(Some(
                        Path::new(&env.text("PROV_CERT").unwrap_or_default()).join("root-cert.pem"),
                    ));
                }
                Some("none") => return Err(ConfigError::CaRootCaRequired),
                _ => PathBuf::from(paths::CA_ROOT_CERT),
            },
        };
        if files.is_file(&path) { Ok(Some(path)) } else { Err(ConfigError::CaRootCa(path)) }
    }

    /// pilot-agent's `FindRootCAForXDS`.
    fn xds_root_ca(
        env: &dyn Env,
        files: &dyn Files,
        pc: &ProxyConfig,
    ) -> Result<Option<PathBuf>, ConfigError> {
        let path = match env.text("XDS_ROOT_CA") {
            Some(v) if v == "SYSTEM" => return Ok(None),
            Some(v) => PathBuf::from(v),
            None if files.is_file(Path::new(paths::MOUNTED_ROOT_CERT)) => {
                return Ok(Some(paths::MOUNTED_ROOT_CERT.into()));
            }
            None => {
                if let Some(prov) = env.text("PROV_CERT") {
                    return Ok(Some(Path::new(&prov).join("root-cert.pem")));
                }
                if env.bool_or("FILE_MOUNTED_CERTS", false)? {
                    PathBuf::from(
                        pc.proxy_metadata.get("ISTIO_META_TLS_CLIENT_ROOT_CERT").cloned().unwrap_or_default(),
                    )
                } else if env.text("PILOT_CERT_PROVIDER").as_deref() == Some("none") {
                    return Err(ConfigError::XdsRootCaRequired);
                } else {
                    PathBuf::from(paths::CA_ROOT_CERT)
                }
            }
        };
        if files.is_file(&path) { Ok(Some(path)) } else { Err(ConfigError::XdsRootCa(path)) }
    }

    /// pilot-agent's `GetKeyCertsForXDS`.
    fn xds_client_cert(env: &dyn Env, pc: &ProxyConfig) -> Result<Option<ClientIdentity>, ConfigError> {
        if let Some(prov) = env.text("PROV_CERT") {
            let dir = Path::new(&prov);
            return Ok(Some(ClientIdentity { cert: dir.join("cert-chain.pem"), key: dir.join("key.pem") }));
        }
        if env.bool_or("FILE_MOUNTED_CERTS", false)? {
            let get = |k: &str| pc.proxy_metadata.get(k).filter(|v| !v.is_empty()).map(PathBuf::from);
            if let (Some(cert), Some(key)) =
                (get("ISTIO_META_TLS_CLIENT_CERT_CHAIN"), get("ISTIO_META_TLS_CLIENT_KEY"))
            {
                return Ok(Some(ClientIdentity { cert, key }));
            }
        }
        Ok(None)
    }

    /// The effective configuration as YAML.
    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(self).expect("config serializes")
    }
}

impl CaSettings {
    /// The CA client's connection (the token and cluster id as for xDS).
    pub fn upstream(&self, token_path: &Path, cluster_id: &str) -> UpstreamConfig {
        UpstreamConfig {
            address: self.address.clone(),
            transport: if self.plaintext {
                Transport::Plaintext
            } else {
                Transport::Tls {
                    roots: self.root_ca.clone().map(RootCerts::File).unwrap_or(RootCerts::System),
                    identity: None,
                }
            },
            san: self.san.clone(),
            token_path: Some(token_path.into()),
            cluster_id: cluster_id.into(),
            headers: self.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            connect_timeout: crate::xds::upstream::CONNECT_TIMEOUT,
        }
    }
}

impl XdsSettings {
    /// The relay's upstream.
    pub fn upstream(&self, cluster_id: &str) -> UpstreamConfig {
        let transport = if self.plaintext {
            Transport::Plaintext
        } else {
            Transport::Tls {
                roots: self.root_ca.clone().map(RootCerts::File).unwrap_or(RootCerts::System),
                identity: match (&self.client_cert, &self.client_key) {
                    (Some(cert), Some(key)) => Some(ClientIdentity { cert: cert.clone(), key: key.clone() }),
                    _ => None,
                },
            }
        };
        UpstreamConfig {
            address: self.discovery_address.clone(),
            transport,
            san: self.istiod_san.clone(),
            token_path: Some(self.token_path.clone()),
            cluster_id: cluster_id.into(),
            headers: self.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            connect_timeout: crate::xds::upstream::CONNECT_TIMEOUT,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(entries: &[(&str, &str)]) -> BTreeMap<PathBuf, String> {
        entries.iter().map(|(p, t)| (PathBuf::from(p), t.to_string())).collect()
    }

    fn resolve(args: &[&str], env: &[(&str, &str)], fs: &[(&str, &str)]) -> Result<AgentConfig, ConfigError> {
        let args = ProxyArgs::parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())?;
        let env = MapEnv(env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        AgentConfig::resolve(args, &env, &files(fs))
    }

    const ROOT: (&str, &str) = (paths::CA_ROOT_CERT, "-----BEGIN CERTIFICATE-----\n");

    #[test]
    fn a_kubernetes_sidecar() {
        let c = resolve(
            &["sidecar", "--domain", "app.svc.cluster.local"],
            &[
                ("POD_NAME", "echo-1"),
                ("POD_NAMESPACE", "app"),
                ("INSTANCE_IP", "10.1.2.3"),
                ("ISTIO_META_CLUSTER_ID", "Kubernetes"),
                ("ISTIO_META_DNS_CAPTURE", "true"),
                ("XDS_HEADER_X-Team", "payments"),
            ],
            &[ROOT],
        )
        .unwrap();
        assert_eq!(c.xds.uds_path, PathBuf::from("./etc/istio/proxy/XDS"));
        assert_eq!(c.xds.root_ca, Some(PathBuf::from(paths::CA_ROOT_CERT)));
        assert!(!c.xds.plaintext);
        assert_eq!(c.xds.headers.get("X-Team").unwrap(), "payments");
        assert!(c.dns.enabled);
        assert_eq!(c.dns.address, "localhost:15053");
        let up = c.xds.upstream(&c.pod.cluster_id);
        assert_eq!(up.server_name().unwrap(), "istiod.istio-system.svc");
        assert!(c.to_yaml().contains("discoveryAddress: istiod.istio-system.svc:15012"));
    }

    #[test]
    fn root_ca_lookup_follows_pilot_agent() {
        let e = resolve(&[], &[], &[]).unwrap_err();
        assert!(matches!(e, ConfigError::XdsRootCa(_)), "{e}");
        assert!(e.to_string().contains("root-cert.pem"));
        let c = resolve(&[], &[("XDS_ROOT_CA", "SYSTEM"), ("CA_ROOT_CA", "SYSTEM")], &[]).unwrap();
        assert_eq!(c.xds.root_ca, None);
        let e = resolve(&[], &[("XDS_ROOT_CA", "SYSTEM")], &[]).unwrap_err();
        assert!(matches!(e, ConfigError::CaRootCa(_)), "the CA's root is looked up on its own: {e}");
        let c = resolve(&[], &[], &[ROOT, (paths::MOUNTED_ROOT_CERT, "x")]).unwrap();
        assert_eq!(c.xds.root_ca, Some(PathBuf::from(paths::MOUNTED_ROOT_CERT)));
        let e = resolve(&[], &[("PILOT_CERT_PROVIDER", "none")], &[]).unwrap_err();
        assert!(matches!(e, ConfigError::XdsRootCaRequired));
        let c = resolve(&[], &[("PROV_CERT", "/etc/prov")], &[]).unwrap();
        assert_eq!(c.xds.client_cert, Some(PathBuf::from("/etc/prov/cert-chain.pem")));
    }

    #[test]
    fn plaintext_by_policy_or_port() {
        let c = resolve(&[], &[("PROXY_CONFIG", "discoveryAddress: istiod.istio-system.svc:15010")], &[])
            .unwrap();
        assert!(c.xds.plaintext);
        assert!(c.identity.ca.as_ref().unwrap().plaintext, "the CA on 15010 is plaintext too");
        let c =
            resolve(&[], &[("PROXY_CONFIG", "controlPlaneAuthPolicy: NONE"), ("CA_ROOT_CA", "SYSTEM")], &[])
                .unwrap();
        assert!(c.xds.plaintext);
    }

    #[test]
    fn mesh_file_env_and_annotations_layer() {
        let c = resolve(
            &["--meshConfig", "/etc/mesh"],
            &[
                ("PROXY_CONFIG", "{\"drainDuration\": \"20s\"}"),
                ("XDS_ROOT_CA", "SYSTEM"),
                ("CA_ROOT_CA", "SYSTEM"),
            ],
            &[
                (
                    "/etc/mesh",
                    "defaultConfig:\n  discoveryAddress: istiod.mesh:15012\n  drainDuration: 30s\n",
                ),
                (paths::POD_ANNOTATIONS, "sidecar.istio.io/discoveryAddress=\"istiod.pod:15012\"\n"),
            ],
        )
        .unwrap();
        assert_eq!(c.proxy_config.drain_duration, Duration::from_secs(20));
        assert_eq!(c.xds.discovery_address, "istiod.pod:15012");
    }

    #[test]
    fn workload_certificates_follow_pilot_agent() {
        let env = [("POD_NAMESPACE", "app"), ("SERVICE_ACCOUNT", "echo"), ("ISTIO_META_CLUSTER_ID", "east")];
        let c = resolve(&[], &env, &[ROOT]).unwrap();
        let id = &c.identity;
        assert_eq!(id.identity.to_string(), "spiffe://cluster.local/ns/app/sa/echo");
        assert_eq!(id.keys, KeyOptions { algorithm: KeyAlgorithm::Rsa(2048), pkcs8: false });
        assert_eq!(id.secret_ttl, Duration::from_secs(86400));
        assert_eq!(id.rotation, RotationPolicy::default());
        assert_eq!(id.sds_socket, PathBuf::from("./var/run/secrets/workload-spiffe-uds/socket"));
        let ca = id.ca.as_ref().unwrap();
        assert_eq!(ca.address, "istiod.istio-system.svc:15012");
        assert_eq!(ca.root_ca, Some(PathBuf::from(paths::CA_ROOT_CERT)));
        assert!(c.to_yaml().contains("spiffe") || c.to_yaml().contains("serviceAccount: echo"));

        let mut env = env.to_vec();
        env.extend([
            ("TRUST_DOMAIN", "example.org"),
            ("ECC_SIGNATURE_ALGORITHM", "ECDSA"),
            ("PKCS8_KEY", "true"),
            ("CA_ADDR", "ca.example:443"),
            ("CA_ROOT_CA", "SYSTEM"),
            ("CA_HEADER_X-Tenant", "a"),
            ("SECRET_TTL", "1h"),
            ("SECRET_GRACE_PERIOD_RATIO", "0.25"),
            ("ISTIOD_SAN", "ignored.for.ca"),
            ("OUTPUT_CERTS", "/out"),
        ]);
        let c = resolve(&[], &env, &[ROOT]).unwrap();
        let id = &c.identity;
        assert_eq!(id.identity.trust_domain, "example.org");
        assert_eq!(id.keys, KeyOptions { algorithm: KeyAlgorithm::EcdsaP256, pkcs8: true });
        assert_eq!(id.secret_ttl, Duration::from_secs(3600));
        assert_eq!(id.rotation.grace_ratio, 0.25);
        let ca = id.ca.as_ref().unwrap();
        assert_eq!(
            (ca.address.as_str(), ca.root_ca.as_ref(), ca.san.as_ref()),
            ("ca.example:443", None, None)
        );
        assert_eq!(ca.headers.get("X-Tenant").unwrap(), "a");
        assert_eq!(id.output_dir, Some(PathBuf::from("/out")));

        // Mounted SPIFFE credentials: no CA client, and no CA root needed.
        let spiffe = CertFiles::in_dir(Path::new(paths::WORKLOAD_CREDENTIALS));
        let fs = [
            (spiffe.cert_chain.to_str().unwrap(), "x"),
            (spiffe.key.to_str().unwrap(), "x"),
            (spiffe.root.to_str().unwrap(), "x"),
        ];
        let c = resolve(&[], &[("XDS_ROOT_CA", "SYSTEM")], &fs).unwrap();
        assert!(c.identity.ca.is_none());
        assert_eq!(c.identity.mounted, Some(spiffe.clone()));
        // ./etc/certs is not "mounted" when the agent writes its own certificates there.
        let etc = CertFiles::in_dir(Path::new(paths::ETC_CERTS));
        let fs = [
            (etc.cert_chain.to_str().unwrap(), "x"),
            (etc.key.to_str().unwrap(), "x"),
            (etc.root.to_str().unwrap(), "x"),
            ROOT,
        ];
        assert_eq!(resolve(&[], &[], &fs).unwrap().identity.mounted, Some(etc.clone()));
        assert_eq!(resolve(&[], &[("OUTPUT_CERTS", "./etc/certs")], &fs).unwrap().identity.mounted, None);
    }

    #[test]
    fn envoy_and_node_settings_follow_pilot_agent() {
        let c = resolve(
            &["sidecar", "--serviceCluster", "ignored.default", "--proxyLogLevel=info,upstream:debug", "--concurrency", "2"],
            &[
                ("XDS_ROOT_CA", "SYSTEM"),
                ("CA_ROOT_CA", "SYSTEM"),
                ("POD_NAME", "echo-1"),
                ("POD_NAMESPACE", "app"),
                ("INSTANCE_IP", "fd00::5"),
                ("ISTIO_META_WORKLOAD_NAME", "echo"),
                ("ISTIO_METAJSON_LABELS", r#"{"app":"echo"}"#),
                ("PROXY_CONFIG", r#"{"proxyMetadata": {"ISTIO_META_FROM_PROXY_CONFIG": "yes"}, "terminationDrainDuration": "7s"}"#),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(c.node.id, "sidecar~fd00::5~echo-1.app~app.svc.cluster.local");
        assert_eq!(c.node.cluster, "echo.app", "WORKLOAD_NAME.namespace; the flag is ignored as in Istio");
        assert_eq!(c.identity.identity.trust_domain, "cluster.local");
        assert_eq!(c.node.metadata["LABELS"]["app"], "echo");
        assert_eq!(c.node.metadata["FROM_PROXY_CONFIG"], "yes");
        assert_eq!(c.node.metadata["NAMESPACE"], "app");
        assert!(c.node.delta_xds);
        assert_eq!(c.envoy.bootstrap, PathBuf::from("./etc/istio/proxy/envoy-rev.json"));
        assert_eq!(
            (c.envoy.log_level.as_str(), c.envoy.component_log_level.as_str()),
            ("info", "upstream:debug")
        );
        assert_eq!(c.envoy.concurrency, Some(2));
        assert_eq!(c.envoy.local_address_ip_version, "v6");
        assert_eq!(c.envoy.drain, DrainPolicy::Fixed { wait: Duration::from_secs(7) });
        assert!(c.envoy.capabilities.is_empty());
        assert_eq!(c.status.probe_destination, "fd00::5".parse::<std::net::IpAddr>().unwrap());

        let c = resolve(
            &[],
            &[
                ("XDS_ROOT_CA", "SYSTEM"),
                ("CA_ROOT_CA", "SYSTEM"),
                ("POD_NAMESPACE", "app"),
                ("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true"),
                ("ISTIO_META_INTERCEPTION_MODE", "TPROXY"),
                ("ISTIO_DELTA_XDS", "false"),
                ("REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION", "true"),
                ("INSTANCE_IP", "10.0.0.9"),
            ],
            &[(paths::POD_LABELS, "app=\"reviews\"\nversion=\"v1\"\n")],
        )
        .unwrap();
        assert_eq!(c.node.cluster, "reviews.app", "the app label wins");
        let td = resolve(
            &["--trust-domain=corp.example"],
            &[("XDS_ROOT_CA", "SYSTEM"), ("CA_ROOT_CA", "SYSTEM")],
            &[],
        )
        .unwrap();
        assert_eq!(
            td.identity.identity.trust_domain, "corp.example",
            "Istio 1.7's flag, when TRUST_DOMAIN is unset"
        );
        assert!(!c.node.delta_xds);
        assert_eq!(c.envoy.drain, DrainPolicy::UntilIdle { minimum: Duration::from_secs(5) });
        assert_eq!(c.envoy.capabilities, &[crate::privileges::Capability::NetAdmin]);
        assert_eq!(c.status.probe_destination, std::net::IpAddr::from([127, 0, 0, 1]));
        let yaml = c.to_yaml();
        assert!(yaml.contains("CAP_NET_ADMIN") && yaml.contains("mode: untilIdle"), "{yaml}");
    }

    #[test]
    fn bad_input_is_named() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("ISTIO_META_DNS_CAPTURE", "yes")], "ISTIO_META_DNS_CAPTURE"),
            (&[("DNS_FORWARD_TIMEOUT", "5")], "DNS_FORWARD_TIMEOUT"),
            (&[("INSTANCE_IP", "10.1.2")], "INSTANCE_IP"),
            (&[("PROXY_CONFIG", "discoveryAddress: istiod")], "istiod"),
            (&[("PROXY_CONFIG", "nope: 1")], "PROXY_CONFIG"),
            (&[("XDS_HEADER_bad name", "x")], "bad name"),
            (&[("CA_HEADER_bad name", "x")], "bad name"),
            (&[("ECC_SIGNATURE_ALGORITHM", "ED25519")], "ECC_SIGNATURE_ALGORITHM"),
            (&[("ECC_SIGNATURE_ALGORITHM", "ECDSA"), ("ECC_CURVE", "P384")], "ECC_CURVE"),
            (&[("WORKLOAD_RSA_KEY_SIZE", "1024")], "1024"),
            (&[("WORKLOAD_RSA_KEY_SIZE", "big")], "WORKLOAD_RSA_KEY_SIZE"),
            (&[("SECRET_GRACE_PERIOD_RATIO", "1.5")], "SECRET_GRACE_PERIOD_RATIO"),
            (&[("SECRET_TTL", "24")], "SECRET_TTL"),
            (&[("CA_PROVIDER", "GoogleCA")], "CA_PROVIDER"),
            (&[("WORKLOAD_IDENTITY_SOCKET_FILE", "../x")], "WORKLOAD_IDENTITY_SOCKET_FILE"),
            (&[("ISTIO_KUBE_APP_PROBERS", r#"{"/x":{}}"#)], "ISTIO_KUBE_APP_PROBERS: \"/x\""),
            (
                &[("ISTIO_PROMETHEUS_ANNOTATIONS", r#"{"port":"15090"}"#)],
                "ISTIO_PROMETHEUS_ANNOTATIONS: target port 15090",
            ),
            (&[("ISTIO_METAJSON_LABELS", "{")], "ISTIO_METAJSON_LABELS"),
            (&[("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "maybe")], "EXIT_ON_ZERO_ACTIVE_CONNECTIONS"),
            (
                &[("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true"), ("MINIMUM_DRAIN_DURATION", "5")],
                "MINIMUM_DRAIN_DURATION",
            ),
            (&[("WEIR_RESTART_ENVOY", "y")], "WEIR_RESTART_ENVOY"),
            (&[("ISTIO_DELTA_XDS", "no")], "ISTIO_DELTA_XDS"),
        ];
        for (env, needle) in cases {
            let mut env = env.to_vec();
            env.push(("XDS_ROOT_CA", "SYSTEM"));
            env.push(("CA_ROOT_CA", "SYSTEM"));
            let e = resolve(&[], &env, &[]).unwrap_err();
            let text = crate::error_chain(&e);
            assert!(text.contains(needle), "{needle}: {text}");
        }
    }
    #[test]
    fn who_runs_envoy() {
        let mode = |env: &[(&str, &str)]| resolve(&[], env, &[ROOT]).map(|c| c.envoy_mode);
        assert_eq!(mode(&[]).unwrap(), EnvoyMode::Launch);
        assert_eq!(mode(&[("DISABLE_ENVOY", "true")]).unwrap(), EnvoyMode::Disabled);
        assert_eq!(mode(&[("WEIR_ENVOY_MODE", "external")]).unwrap(), EnvoyMode::External);
        // DISABLE_ENVOY wins: with no Envoy at all, nobody reads SDS.
        let both = [("DISABLE_ENVOY", "1"), ("WEIR_ENVOY_MODE", "external")];
        assert_eq!(mode(&both).unwrap(), EnvoyMode::Disabled);
        assert!(!EnvoyMode::Disabled.serves_sds() && EnvoyMode::External.serves_sds());
        assert!(EnvoyMode::Launch.launches() && !EnvoyMode::External.launches());
        let err = mode(&[("WEIR_ENVOY_MODE", "systemd")]).unwrap_err().to_string();
        assert!(err.contains("WEIR_ENVOY_MODE") && err.contains("launch or external"), "{err}");
        assert!(mode(&[("DISABLE_ENVOY", "maybe")]).unwrap_err().to_string().contains("DISABLE_ENVOY"));
    }
    #[test]
    fn wasm_settings_read_pilot_agents_variables() {
        let c = resolve(&[], &[], &[ROOT]).unwrap();
        assert_eq!(c.wasm, crate::wasm::CacheOptions::default());
        let env = [
            ("WASM_MODULE_EXPIRY", "2h"),
            ("WASM_PURGE_INTERVAL", "10m"),
            ("WASM_INSECURE_REGISTRIES", "localhost:5000, registry.local"),
            ("WASM_HTTP_REQUEST_TIMEOUT", "3s"),
            ("WASM_HTTP_REQUEST_MAX_RETRIES", "2"),
        ];
        let w = resolve(&[], &env, &[ROOT]).unwrap().wasm;
        assert_eq!(w.module_expiry, Duration::from_secs(7200));
        assert_eq!(w.purge_interval, Duration::from_secs(600));
        assert_eq!(w.insecure_registries, ["localhost:5000", "registry.local"]);
        assert_eq!((w.http_timeout, w.max_retries), (Duration::from_secs(3), 2));
        let err =
            resolve(&[], &[("WASM_HTTP_REQUEST_MAX_RETRIES", "many")], &[ROOT]).unwrap_err().to_string();
        assert!(err.contains("WASM_HTTP_REQUEST_MAX_RETRIES"), "{err}");
    }
}
