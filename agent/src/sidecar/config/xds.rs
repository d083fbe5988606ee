//! The connection to istiod (or to the embedded control plane in standalone mode)
//! and the socket Envoy dials for xDS: address, TLS roots and client certificate as
//! pilot-agent finds them, SAN, token and `XDS_HEADER_*` metadata.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde::Serialize;

use super::{ConfigError, ControlPlaneAuthPolicy, PodIdentity, ProxyConfig, Sources, paths, vars};
use crate::sidecar::xds::{ClientIdentity, RootCerts, Transport, UpstreamConfig};

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
    #[serde(skip_serializing_if = "RedactedHeaders::is_empty")]
    pub headers: RedactedHeaders,
}

/// Headers sent to istiod or the CA (`XDS_HEADER_*`, `CA_HEADER_*`): their values are
/// often bearer tokens, so the configuration printed (`weir config`) and logged at
/// start shows only the names, as pilot-agent never logs them.
#[derive(Clone, Default, PartialEq)]
pub struct RedactedHeaders(pub BTreeMap<String, String>);

impl RedactedHeaders {
    const SHOWN: &str = "<redacted>";

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The headers, values included, for the connection.
    pub fn pairs(&self) -> Vec<(String, String)> {
        self.0.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

impl std::ops::Deref for RedactedHeaders {
    type Target = BTreeMap<String, String>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::fmt::Debug for RedactedHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.0.keys().map(|k| (k, Self::SHOWN))).finish()
    }
}

impl Serialize for RedactedHeaders {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.keys().map(|k| (k, Self::SHOWN)))
    }
}

impl XdsSettings {
    pub fn resolve(src: &Sources<'_>, pod: &PodIdentity, pc: &ProxyConfig) -> Result<Self, ConfigError> {
        let address = pc.discovery_address.clone();
        let port = address
            .rsplit_once(':')
            .and_then(|(h, p)| (!h.is_empty()).then_some(p))
            .and_then(|p| p.parse::<u16>().ok())
            .ok_or_else(|| ConfigError::DiscoveryAddress(address.clone()))?;
        let plaintext = pc.control_plane_auth_policy == ControlPlaneAuthPolicy::None || port == 15010;
        let (root_ca, client) =
            if plaintext { (None, None) } else { (xds_root_ca(src, pc)?, xds_client_cert(src, pc)?) };
        let xds = Self {
            uds_path: Path::new(&pc.config_path).join("XDS"),
            discovery_address: address,
            plaintext,
            root_ca,
            istiod_san: vars::ISTIOD_SAN.value(src.env),
            client_cert: client.as_ref().map(|c| c.cert.clone()),
            client_key: client.map(|c| c.key),
            token_path: paths::TOKEN.into(),
            headers: RedactedHeaders(vars::XDS_HEADER.members(src.env).into_iter().collect()),
        };
        xds.upstream(&pod.cluster_id)
            .validate()
            .map_err(|e| ConfigError::Invalid { name: "XDS upstream", message: crate::error_chain(&e) })?;
        Ok(xds)
    }

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
            headers: self.headers.pairs(),
            connect_timeout: crate::sidecar::xds::upstream::CONNECT_TIMEOUT,
        }
    }
}

/// pilot-agent's `FindRootCAForXDS`.
fn xds_root_ca(src: &Sources<'_>, pc: &ProxyConfig) -> Result<Option<PathBuf>, ConfigError> {
    let (env, files) = (src.env, src.files);
    let path = match vars::XDS_ROOT_CA.value(env) {
        Some(v) if v == "SYSTEM" => return Ok(None),
        Some(v) => PathBuf::from(v),
        None if files.is_file(Path::new(paths::MOUNTED_ROOT_CERT)) => {
            return Ok(Some(paths::MOUNTED_ROOT_CERT.into()));
        }
        None => {
            if let Some(prov) = vars::PROV_CERT.value(env) {
                return Ok(Some(Path::new(&prov).join("root-cert.pem")));
            }
            if vars::FILE_MOUNTED_CERTS.bool(env)? {
                PathBuf::from(
                    pc.proxy_metadata.get("ISTIO_META_TLS_CLIENT_ROOT_CERT").cloned().unwrap_or_default(),
                )
            } else if vars::PILOT_CERT_PROVIDER.text(env) == "none" {
                return Err(ConfigError::XdsRootCaRequired);
            } else {
                PathBuf::from(paths::CA_ROOT_CERT)
            }
        }
    };
    if files.is_file(&path) { Ok(Some(path)) } else { Err(ConfigError::XdsRootCa(path)) }
}

/// pilot-agent's `GetKeyCertsForXDS`.
fn xds_client_cert(src: &Sources<'_>, pc: &ProxyConfig) -> Result<Option<ClientIdentity>, ConfigError> {
    if let Some(prov) = vars::PROV_CERT.value(src.env) {
        let dir = Path::new(&prov);
        return Ok(Some(ClientIdentity { cert: dir.join("cert-chain.pem"), key: dir.join("key.pem") }));
    }
    if vars::FILE_MOUNTED_CERTS.bool(src.env)? {
        let get = |k: &str| pc.proxy_metadata.get(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        if let (Some(cert), Some(key)) =
            (get("ISTIO_META_TLS_CLIENT_CERT_CHAIN"), get("ISTIO_META_TLS_CLIENT_KEY"))
        {
            return Ok(Some(ClientIdentity { cert, key }));
        }
    }
    Ok(None)
}

/// Standalone mode (`--discovery-address embedded`): where the embedded control plane
/// reads its services and keeps its CA.
pub fn standalone(src: &Sources<'_>) -> Option<crate::sidecar::standalone::StandaloneSettings> {
    let args = src.args;
    (args.discovery_address.as_deref() == Some("embedded")).then(|| {
        crate::sidecar::standalone::StandaloneSettings {
            services: args
                .mesh_services
                .clone()
                .unwrap_or_else(|| vars::WEIR_MESH_SERVICES.text(src.env))
                .into(),
            state_dir: args.state_dir.clone().unwrap_or_else(|| vars::WEIR_STATE_DIR.text(src.env)).into(),
        }
    })
}
