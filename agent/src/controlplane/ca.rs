//! The control plane's certificate authority: `istio.v1.auth.IstioCertificateService`
//! `CreateCertificate`, signing CSRs with a root held in memory, as istiod's CA does for
//! workloads. It checks the bearer token, caps the validity at the requested duration
//! (or a forced short lifetime), and can be told to fail or to answer slowly — the
//! failure modes the agent's CA client must survive. Every request is recorded.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tonic::{Request, Response, Status};
use weir_proto::istio::v1::auth::{
    IstioCertificateRequest, IstioCertificateResponse,
    istio_certificate_service_server::IstioCertificateService,
};

/// What the CA does with the next requests.
#[derive(Debug, Clone, Default)]
pub enum CaBehaviour {
    /// Sign.
    #[default]
    Sign,
    /// Answer with this status.
    Fail(tonic::Code, String),
    /// Answer with only the leaf (a chain istiod would never send).
    LeafOnly,
    /// Answer with text that is not PEM.
    Garbage,
    /// Sign, but send an expired root as the chain's last element.
    ExpiredRoot,
}

/// One CreateCertificate call as received.
#[derive(Debug, Clone)]
pub struct CaRequest {
    pub authorization: Option<String>,
    pub validity_seconds: i64,
    /// The URI SANs the CSR asked for.
    pub uri_sans: Vec<String>,
    pub cert_signer: Option<String>,
    /// The CSR as sent (PEM).
    pub csr: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("create the CA root")]
    Root(#[source] rcgen::Error),
    #[error("the mesh CA in {path} is unusable")]
    Stored {
        path: std::path::PathBuf,
        #[source]
        source: rcgen::Error,
    },
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

struct State {
    behaviour: CaBehaviour,
    delay: Duration,
    /// When set, every certificate lives this long, whatever was asked.
    forced_lifetime: Option<Duration>,
    requests: Vec<CaRequest>,
}

struct Root {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
    /// The signing key, PEM (kept to persist the root).
    key_pem: String,
}

impl Root {
    /// A self-signed ECDSA P-256 CA named `org`, valid from `days_from` to `days_to`
    /// (days relative to now).
    fn new(org: &str, days_from: i64, days_to: i64) -> Result<Self, CaError> {
        let key = rcgen::KeyPair::generate().map_err(CaError::Root)?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(CaError::Root)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::OrganizationName, org);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now + time::Duration::days(days_from) - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(days_to);
        let cert = params.self_signed(&key).map_err(CaError::Root)?;
        Ok(Self { pem: cert.pem(), key_pem: key.serialize_pem(), issuer: rcgen::Issuer::new(params, key) })
    }

    /// A root kept in `dir` (`root-cert.pem`, `root-key.pem`).
    fn load(dir: &std::path::Path) -> Result<Self, CaError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(|source| CaError::Io { what: "read", path, source })
        };
        let (pem, key_pem) = (read(ROOT_CERT_FILE)?, read(ROOT_KEY_FILE)?);
        let stored = |source| CaError::Stored { path: dir.into(), source };
        let key = rcgen::KeyPair::from_pem(&key_pem).map_err(stored)?;
        let issuer = rcgen::Issuer::from_ca_cert_pem(&pem, key).map_err(stored)?;
        Ok(Self { issuer, pem, key_pem })
    }
}

/// The persisted root's files in a state directory.
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
pub const ROOT_KEY_FILE: &str = "root-key.pem";

/// The CA service. Clones share state.
#[derive(Clone)]
pub struct CaServer {
    org: Arc<str>,
    root: Arc<Mutex<Arc<Root>>>,
    token: Option<Arc<str>>,
    state: Arc<Mutex<State>>,
}

impl CaServer {
    /// A CA with a fresh self-signed ECDSA P-256 root named `org`, accepting only
    /// `token` (when given).
    pub fn new(org: &str, token: Option<String>) -> Result<Self, CaError> {
        Ok(Self {
            org: org.into(),
            root: Arc::new(Mutex::new(Arc::new(Root::new(org, 0, 3650)?))),
            token: token.map(Into::into),
            state: Arc::new(Mutex::new(State {
                behaviour: CaBehaviour::Sign,
                delay: Duration::ZERO,
                forced_lifetime: None,
                requests: Vec::new(),
            })),
        })
    }

    /// The mesh CA kept in `dir`: loaded when it is there, else created (self-signed,
    /// ten years) and written (key 0600). Agents sharing `dir` share the CA; a lock
    /// file makes concurrent first starts agree on one root.
    pub fn load_or_create(org: &str, dir: &std::path::Path) -> Result<Self, CaError> {
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        let io = |what, path: &std::path::Path| {
            let path = path.to_path_buf();
            move |source| CaError::Io { what, path, source }
        };
        std::fs::create_dir_all(dir).map_err(io("create", dir))?;
        let lock_path = dir.join(".lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .map_err(io("open", &lock_path))?;
        let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| CaError::Io { what: "lock", path: lock_path.clone(), source: e.into() })?;
        let root = if dir.join(ROOT_KEY_FILE).exists() {
            Root::load(dir)?
        } else {
            let root = Root::new(org, 0, 3650)?;
            for (name, text, mode) in
                [(ROOT_KEY_FILE, &root.key_pem, 0o600), (ROOT_CERT_FILE, &root.pem, 0o644)]
            {
                let path = dir.join(name);
                let tmp = dir.join(format!(".{name}.tmp"));
                std::fs::write(&tmp, text).map_err(io("write", &tmp))?;
                std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
                    .map_err(io("chmod", &tmp))?;
                std::fs::rename(&tmp, &path).map_err(io("rename into place", &path))?;
            }
            root
        };
        let ca = Self::new(org, None)?;
        *ca.root.lock().expect("ca root") = Arc::new(root);
        Ok(ca)
    }

    /// The root certificate (PEM).
    pub fn root_pem(&self) -> String {
        self.root.lock().expect("ca root").pem.clone()
    }

    /// Replaces the root with a new one (a CA key rotation): later certificates are
    /// signed by, and chain to, the new root.
    pub fn rotate_root(&self) -> Result<(), CaError> {
        *self.root.lock().expect("ca root") = Arc::new(Root::new(&self.org, 0, 3650)?);
        Ok(())
    }

    pub fn set_behaviour(&self, behaviour: CaBehaviour) {
        self.state.lock().expect("ca state").behaviour = behaviour;
    }

    pub fn set_delay(&self, delay: Duration) {
        self.state.lock().expect("ca state").delay = delay;
    }

    pub fn force_lifetime(&self, lifetime: Option<Duration>) {
        self.state.lock().expect("ca state").forced_lifetime = lifetime;
    }

    pub fn requests(&self) -> Vec<CaRequest> {
        self.state.lock().expect("ca state").requests.clone()
    }

    /// Signs `csr_pem` for `lifetime`; returns the leaf PEM.
    fn sign(&self, csr_pem: &str, lifetime: Duration) -> Result<String, Status> {
        let mut csr = rcgen::CertificateSigningRequestParams::from_pem(csr_pem).map_err(|e| {
            Status::invalid_argument(format!("CSR is not a valid PEM certificate request: {e}"))
        })?;
        let now = time::OffsetDateTime::now_utc();
        csr.params.not_before = now - time::Duration::minutes(1);
        csr.params.not_after = now + time::Duration::try_from(lifetime).unwrap_or(time::Duration::days(1));
        csr.params.is_ca = rcgen::IsCa::ExplicitNoCa;
        csr.params.key_usages =
            vec![rcgen::KeyUsagePurpose::DigitalSignature, rcgen::KeyUsagePurpose::KeyEncipherment];
        csr.params.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        csr.params.serial_number = Some(rcgen::SerialNumber::from_slice(&rand::random::<[u8; 16]>()));
        let root = self.root.lock().expect("ca root").clone();
        let cert =
            csr.signed_by(&root.issuer).map_err(|e| Status::internal(format!("signing failed: {e}")))?;
        Ok(cert.pem())
    }
}

fn uri_sans(csr_pem: &str) -> Vec<String> {
    rcgen::CertificateSigningRequestParams::from_pem(csr_pem)
        .map(|csr| {
            csr.params
                .subject_alt_names
                .iter()
                .filter_map(|san| match san {
                    rcgen::SanType::URI(uri) => Some(uri.as_str().to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tonic::async_trait]
impl IstioCertificateService for CaServer {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let authorization =
            request.metadata().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
        let body = request.into_inner();
        let cert_signer =
            body.metadata.as_ref().and_then(|m| m.fields.get("CertSigner")).and_then(|v| match &v.kind {
                Some(prost_types::value::Kind::StringValue(s)) if !s.is_empty() => Some(s.clone()),
                _ => None,
            });
        let (behaviour, delay, forced) = {
            let mut state = self.state.lock().expect("ca state");
            state.requests.push(CaRequest {
                authorization: authorization.clone(),
                validity_seconds: body.validity_duration,
                uri_sans: uri_sans(&body.csr),
                cert_signer,
                csr: body.csr.clone(),
            });
            (state.behaviour.clone(), state.delay, state.forced_lifetime)
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if let Some(token) = &self.token
            && authorization.as_deref() != Some(&format!("Bearer {token}"))
        {
            return Err(Status::unauthenticated("authenticate failure: the bearer token is not valid"));
        }
        let lifetime = forced.unwrap_or_else(|| {
            Duration::from_secs(
                u64::try_from(body.validity_duration).ok().filter(|s| *s > 0).unwrap_or(86_400),
            )
        });
        match behaviour {
            CaBehaviour::Fail(code, message) => Err(Status::new(code, message)),
            CaBehaviour::Garbage => Ok(Response::new(IstioCertificateResponse {
                cert_chain: vec!["not a certificate".into(), "still not one".into()],
            })),
            CaBehaviour::LeafOnly => Ok(Response::new(IstioCertificateResponse {
                cert_chain: vec![self.sign(&body.csr, lifetime)?],
            })),
            CaBehaviour::Sign => Ok(Response::new(IstioCertificateResponse {
                cert_chain: vec![self.sign(&body.csr, lifetime)?, self.root_pem()],
            })),
            CaBehaviour::ExpiredRoot => {
                let expired = Root::new(&self.org, -20, -10).map_err(|e| Status::internal(e.to_string()))?;
                Ok(Response::new(IstioCertificateResponse {
                    cert_chain: vec![self.sign(&body.csr, lifetime)?, expired.pem],
                }))
            }
        }
    }
}

#[cfg(test)]
mod persisted {
    use super::*;

    #[test]
    fn a_stored_root_is_reused() {
        let dir = tempfile::tempdir().unwrap();
        let first = CaServer::load_or_create("mesh", dir.path()).unwrap();
        let again = CaServer::load_or_create("mesh", dir.path()).unwrap();
        assert_eq!(first.root_pem(), again.root_pem());
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join(ROOT_KEY_FILE)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(dir.path().join(ROOT_KEY_FILE), "garbage").unwrap();
        let e = CaServer::load_or_create("mesh", dir.path()).err().unwrap().to_string();
        assert!(e.contains("unusable") && e.contains(&dir.path().display().to_string()), "{e}");
    }
}

#[cfg(test)]
mod tests {
    use weir_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateService as _;

    use super::*;

    fn csr(spiffe: &str) -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![rcgen::SanType::URI(spiffe.try_into().unwrap())];
        params.serialize_request(&key).unwrap().pem().unwrap()
    }

    fn request(csr: String, token: &str) -> Request<IstioCertificateRequest> {
        let mut r = Request::new(IstioCertificateRequest { csr, validity_duration: 3600, metadata: None });
        r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        r
    }

    #[tokio::test]
    async fn signs_a_csr_into_a_leaf_and_root_chain_for_the_asked_lifetime() {
        let ca = CaServer::new("test", Some("t".into())).unwrap();
        let id = "spiffe://cluster.local/ns/default/sa/app";
        let chain = ca.create_certificate(request(csr(id), "t")).await.unwrap().into_inner().cert_chain;
        assert_eq!(chain.len(), 2);
        assert_eq!(chain[1], ca.root_pem());
        let (_, pem) = x509_parser::pem::parse_x509_pem(chain[0].as_bytes()).unwrap();
        let leaf = pem.parse_x509().unwrap();
        let san = leaf.subject_alternative_name().unwrap().unwrap();
        assert!(format!("{:?}", san.value.general_names).contains(id));
        let lifetime = leaf.validity().not_after.timestamp() - leaf.validity().not_before.timestamp();
        assert_eq!(lifetime, 3600 + 60, "asked validity plus the minute of back-dating");
        assert_eq!(ca.requests()[0].uri_sans, vec![id.to_string()]);
    }

    #[tokio::test]
    async fn refuses_bad_tokens_and_csrs_and_obeys_its_failure_modes() {
        let ca = CaServer::new("test", Some("t".into())).unwrap();
        let e = ca.create_certificate(request(csr("spiffe://a/b"), "wrong")).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = ca.create_certificate(request("junk".into(), "t")).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        ca.set_behaviour(CaBehaviour::LeafOnly);
        let chain =
            ca.create_certificate(request(csr("spiffe://a/b"), "t")).await.unwrap().into_inner().cert_chain;
        assert_eq!(chain.len(), 1);
        ca.set_behaviour(CaBehaviour::Fail(tonic::Code::Unavailable, "down".into()));
        let e = ca.create_certificate(request(csr("spiffe://a/b"), "t")).await.unwrap_err();
        assert_eq!((e.code(), e.message()), (tonic::Code::Unavailable, "down"));
        ca.set_behaviour(CaBehaviour::Sign);
        ca.force_lifetime(Some(Duration::from_secs(10)));
        let chain =
            ca.create_certificate(request(csr("spiffe://a/b"), "t")).await.unwrap().into_inner().cert_chain;
        let (_, pem) = x509_parser::pem::parse_x509_pem(chain[0].as_bytes()).unwrap();
        let leaf = pem.parse_x509().unwrap();
        assert_eq!(leaf.validity().not_after.timestamp() - leaf.validity().not_before.timestamp(), 70);
    }
}
