//! The workload certificate: whose it is, what key it has, where it comes from (the
//! CA, found as pilot-agent finds it, or mounted files), how long it lives, when it
//! rotates and where it is served and written.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Serialize;

use super::{
    ConfigError, PodIdentity, ProxyConfig, Sources, env::format_duration, paths, serialize_duration, vars,
    xds::RedactedHeaders,
};
use crate::{
    sidecar::identity::{CertFiles, KeyAlgorithm, KeyOptions, RotationPolicy, WorkloadIdentity},
    sidecar::xds::{RootCerts, Transport, UpstreamConfig},
};

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
    #[serde(skip_serializing_if = "RedactedHeaders::is_empty")]
    pub headers: RedactedHeaders,
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

impl IdentitySettings {
    pub fn resolve(src: &Sources<'_>, pod: &PodIdentity, pc: &ProxyConfig) -> Result<Self, ConfigError> {
        let env = src.env;
        let keys = key_options(src)?;
        let rotation = RotationPolicy {
            grace_ratio: vars::SECRET_GRACE_PERIOD_RATIO.ratio(env)?,
            grace_ratio_jitter: vars::SECRET_GRACE_PERIOD_RATIO_JITTER.ratio(env)?,
        };
        let secret_ttl = vars::SECRET_TTL.duration(env)?;
        if secret_ttl < Duration::from_secs(1) {
            return Err(vars::SECRET_TTL.invalid(format_duration(secret_ttl), "at least 1s"));
        }
        let socket_file = vars::WORKLOAD_IDENTITY_SOCKET_FILE.text(env);
        if socket_file.contains('/') {
            return Err(vars::WORKLOAD_IDENTITY_SOCKET_FILE.invalid(
                socket_file,
                "a file name (the socket lives in ./var/run/secrets/workload-spiffe-uds)",
            ));
        }
        let output_dir = vars::OUTPUT_CERTS.value(env).map(PathBuf::from);
        let mounted = mounted_certificates(src, output_dir.as_deref())?;
        let ca = if mounted.is_some() { None } else { Some(CaSettings::resolve(src, pod, pc)?) };
        Ok(Self {
            identity: WorkloadIdentity {
                trust_domain: vars::TRUST_DOMAIN
                    .value(env)
                    .or_else(|| src.args.trust_domain.clone().filter(|t| !t.is_empty()))
                    .unwrap_or_else(|| vars::TRUST_DOMAIN.default.into()),
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
            file_debounce: vars::FILE_DEBOUNCE_DURATION.duration(env)?,
            token_path: paths::TOKEN.into(),
            cluster_id: pod.cluster_id.clone(),
        })
    }
}

fn key_options(src: &Sources<'_>) -> Result<KeyOptions, ConfigError> {
    let env = src.env;
    let algorithm = match vars::ECC_SIGNATURE_ALGORITHM.value(env).as_deref() {
        None => KeyAlgorithm::Rsa(vars::WORKLOAD_RSA_KEY_SIZE.count(env)?),
        Some("ECDSA") => match vars::ECC_CURVE.text(env).as_str() {
            "P256" => KeyAlgorithm::EcdsaP256,
            other => return Err(vars::ECC_CURVE.invalid(other.into(), "P256")),
        },
        Some(other) => {
            return Err(vars::ECC_SIGNATURE_ALGORITHM.invalid(other.into(), "ECDSA, or unset for RSA"));
        }
    };
    let keys = KeyOptions { algorithm, pkcs8: vars::PKCS8_KEY.bool(env)? };
    keys.validate()
        .map_err(|e| ConfigError::Invalid { name: "WORKLOAD_RSA_KEY_SIZE", message: e.to_string() })?;
    Ok(keys)
}

/// Mounted certificates: the SPIFFE credentials directory, else ./etc/certs (unless
/// the agent itself writes there, or it would never rotate).
fn mounted_certificates(
    src: &Sources<'_>,
    output_dir: Option<&Path>,
) -> Result<Option<CertFiles>, ConfigError> {
    let spiffe = CertFiles::in_dir(Path::new(paths::WORKLOAD_CREDENTIALS));
    let etc = CertFiles::in_dir(Path::new(paths::ETC_CERTS));
    let exists = |c: &CertFiles| {
        src.files.is_file(&c.cert_chain) && src.files.is_file(&c.key) && src.files.is_file(&c.root)
    };
    let writes_etc = output_dir.is_some_and(|d| d.components().eq(Path::new(paths::ETC_CERTS).components()));
    Ok(if exists(&spiffe) {
        Some(spiffe)
    } else if vars::FILE_MOUNTED_CERTS.bool(src.env)? || (exists(&etc) && !writes_etc) {
        Some(etc)
    } else {
        None
    })
}

impl CaSettings {
    fn resolve(src: &Sources<'_>, pod: &PodIdentity, pc: &ProxyConfig) -> Result<Self, ConfigError> {
        let env = src.env;
        let provider = vars::CA_PROVIDER.text(env);
        if provider != vars::CA_PROVIDER.default {
            return Err(vars::CA_PROVIDER.invalid(provider, "Citadel (the only CA provider Weir speaks)"));
        }
        let ca_addr = vars::CA_ADDR.value(env);
        let address = ca_addr.clone().unwrap_or_else(|| pc.discovery_address.clone());
        let plaintext = address.ends_with(":15010");
        let root_ca = if plaintext { None } else { ca_root_ca(src)? };
        let settings = Self {
            address,
            plaintext,
            root_ca,
            san: if ca_addr.is_none() { vars::ISTIOD_SAN.value(env) } else { None },
            headers: RedactedHeaders(vars::CA_HEADER.members(env).into_iter().collect()),
            cert_signer: vars::ISTIO_META_CERT_SIGNER.value(env),
        };
        settings
            .upstream(Path::new(paths::TOKEN), &pod.cluster_id)
            .validate()
            .map_err(|e| ConfigError::Invalid { name: "CA_ADDR", message: crate::error_chain(&e) })?;
        Ok(settings)
    }

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
            headers: self.headers.pairs(),
            connect_timeout: crate::sidecar::xds::upstream::CONNECT_TIMEOUT,
        }
    }
}

/// pilot-agent's `FindRootCAForCA`.
fn ca_root_ca(src: &Sources<'_>) -> Result<Option<PathBuf>, ConfigError> {
    let env = src.env;
    let path = match vars::CA_ROOT_CA.value(env) {
        Some(v) if v == "SYSTEM" => return Ok(None),
        Some(v) => PathBuf::from(v),
        None => match vars::PILOT_CERT_PROVIDER.text(env).as_str() {
            "custom" => PathBuf::from(paths::MOUNTED_ROOT_CERT),
            // Provisioned VMs: the file may appear later; pilot-agent does not check.
            _ if vars::PROV_CERT.value(env).is_some() => {
                return Ok(Some(Path::new(&vars::PROV_CERT.text(env)).join("root-cert.pem")));
            }
            "none" => return Err(ConfigError::CaRootCaRequired),
            _ => PathBuf::from(paths::CA_ROOT_CERT),
        },
    };
    if src.files.is_file(&path) { Ok(Some(path)) } else { Err(ConfigError::CaRootCa(path)) }
}
