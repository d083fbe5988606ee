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

use crate::xds::{ClientIdentity, RootCerts, Transport, UpstreamConfig};

/// Where pilot-agent looks for things (relative to the working directory).
pub mod paths {
    pub const POD_ANNOTATIONS: &str = "./etc/istio/pod/annotations";
    pub const TOKEN: &str = "./var/run/secrets/tokens/istio-token";
    /// The old mounted-certificate location, checked first for the XDS root.
    pub const MOUNTED_ROOT_CERT: &str = "./etc/certs/root-cert.pem";
    /// The `istio-ca-root-cert` ConfigMap mount.
    pub const CA_ROOT_CERT: &str = "./var/run/secrets/istio/root-cert.pem";
    pub const RESOLV_CONF: &str = "/etc/resolv.conf";
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

fn serialize_duration<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&env::format_duration(*d))
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentConfig {
    pub args: ProxyArgs,
    pub pod: PodIdentity,
    pub proxy_config: ProxyConfig,
    pub xds: XdsSettings,
    pub dns: DnsSettings,
    /// `DISABLE_ENVOY`: run the agent's services without starting Envoy.
    pub disable_envoy: bool,
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
        let disable_envoy = env.bool_or("DISABLE_ENVOY", false)?;
        Ok(Self { args, pod, proxy_config, xds, dns, disable_envoy })
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
        if config.service_cluster.is_empty() {
            config.service_cluster = args.service_cluster.clone();
        }
        if let Some(address) = annotations.get("sidecar.istio.io/discoveryAddress") {
            config.discovery_address = address.clone();
        }
        if let Some(port) = annotations.get("status.sidecar.istio.io/port") {
            config.status_port = port.parse().map_err(|_| ConfigError::ProxyConfig {
                source_name: "annotation status.sidecar.istio.io/port".into(),
                message: format!("{port:?} is not a port number"),
            })?;
        }
        Ok(config)
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
        let c = resolve(&[], &[("XDS_ROOT_CA", "SYSTEM")], &[]).unwrap();
        assert_eq!(c.xds.root_ca, None);
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
        let c = resolve(&[], &[("PROXY_CONFIG", "controlPlaneAuthPolicy: NONE")], &[]).unwrap();
        assert!(c.xds.plaintext);
    }

    #[test]
    fn mesh_file_env_and_annotations_layer() {
        let c = resolve(
            &["--meshConfig", "/etc/mesh"],
            &[("PROXY_CONFIG", "{\"drainDuration\": \"20s\"}"), ("XDS_ROOT_CA", "SYSTEM")],
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
    fn bad_input_is_named() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("ISTIO_META_DNS_CAPTURE", "yes")], "ISTIO_META_DNS_CAPTURE"),
            (&[("DNS_FORWARD_TIMEOUT", "5")], "DNS_FORWARD_TIMEOUT"),
            (&[("INSTANCE_IP", "10.1.2")], "INSTANCE_IP"),
            (&[("PROXY_CONFIG", "discoveryAddress: istiod")], "istiod"),
            (&[("PROXY_CONFIG", "nope: 1")], "PROXY_CONFIG"),
            (&[("XDS_HEADER_bad name", "x")], "bad name"),
        ];
        for (env, needle) in cases {
            let mut env = env.to_vec();
            env.push(("XDS_ROOT_CA", "SYSTEM"));
            let e = resolve(&[], &env, &[]).unwrap_err();
            let text = crate::error_chain(&e);
            assert!(text.contains(needle), "{needle}: {text}");
        }
    }
}
