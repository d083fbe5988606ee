//! istiod's CA as the tests need it: `IstioCertificateService/CreateCertificate` with
//! istiod's bearer-token check, signing through Weir's mesh CA
//! (`weir_agent::sidecar::controlplane::MeshCa`), and the switches no shipped CA may have: it can
//! be told to fail, to answer slowly, to send only the leaf, garbage or an expired root,
//! to force a short lifetime, and to rotate its root — the cases the agent's CA client
//! must survive. Every request is recorded.
//!
//! istiod signs the identity the caller's token names. The tests give every workload
//! one shared token, so this stand-in signs the workload SPIFFE ID the CSR names (its
//! first URI SAN), through the product's `SigningPolicy` for that identity: any other
//! SAN is refused as standalone mode refuses it, and lifetimes are capped at istiod's
//! default maximum (`MAX_WORKLOAD_CERT_TTL`, 90 days).

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tonic::{Request, Response, Status};
use weir_agent::{
    sidecar::controlplane::{MeshCa, SigningPolicy},
    sidecar::identity::WorkloadIdentity,
};
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

/// The lifetime of a certificate whose request names none (istiod's
/// `DEFAULT_WORKLOAD_CERT_TTL`).
const DEFAULT_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// The longest lifetime signed (istiod's `MAX_WORKLOAD_CERT_TTL`).
const MAX_LIFETIME: Duration = Duration::from_secs(90 * 24 * 3600);

struct State {
    root: MeshCa,
    behaviour: CaBehaviour,
    delay: Duration,
    /// When set, every certificate lives this long, whatever was asked.
    forced_lifetime: Option<Duration>,
    requests: Vec<CaRequest>,
}

/// The CA service. Clones share state.
#[derive(Clone)]
pub struct IstiodCa {
    org: Arc<str>,
    token: Option<Arc<str>>,
    state: Arc<Mutex<State>>,
}

impl IstiodCa {
    /// A CA with a fresh root named `org`, accepting only `token` (when given).
    pub fn new(org: &str, token: Option<&str>) -> anyhow::Result<Self> {
        Ok(Self {
            org: org.into(),
            token: token.map(Into::into),
            state: Arc::new(Mutex::new(State {
                root: MeshCa::generate(org)?,
                behaviour: CaBehaviour::Sign,
                delay: Duration::ZERO,
                forced_lifetime: None,
                requests: Vec::new(),
            })),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("ca state")
    }

    /// The root certificate (PEM).
    pub fn root_pem(&self) -> String {
        self.state().root.root_pem().to_string()
    }

    /// Replaces the root with a new one (a CA key rotation): later certificates are
    /// signed by, and chain to, the new root.
    pub fn rotate_root(&self) -> anyhow::Result<()> {
        self.state().root = MeshCa::generate(&self.org)?;
        Ok(())
    }

    pub fn set_behaviour(&self, behaviour: CaBehaviour) {
        self.state().behaviour = behaviour;
    }

    pub fn set_delay(&self, delay: Duration) {
        self.state().delay = delay;
    }

    /// Every later certificate lives `lifetime`, whatever was asked (`None`: as asked).
    pub fn force_lifetime(&self, lifetime: Option<Duration>) {
        self.state().forced_lifetime = lifetime;
    }

    pub fn requests(&self) -> Vec<CaRequest> {
        self.state().requests.clone()
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

/// `spiffe://<trust domain>/ns/<namespace>/sa/<account>`, parsed.
fn workload_identity(uri: &str) -> Option<WorkloadIdentity> {
    let rest = uri.strip_prefix("spiffe://")?;
    match rest.split('/').collect::<Vec<_>>().as_slice() {
        [trust_domain, "ns", namespace, "sa", account] => Some(WorkloadIdentity {
            trust_domain: trust_domain.to_string(),
            namespace: namespace.to_string(),
            service_account: account.to_string(),
        }),
        _ => None,
    }
}

/// A CA certificate that expired ten days ago (PEM).
fn expired_root(org: &str) -> Result<String, rcgen::Error> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.distinguished_name.push(rcgen::DnType::OrganizationName, org);
    let now = std::time::SystemTime::now();
    params.not_before = (now - Duration::from_secs(20 * 86_400)).into();
    params.not_after = (now - Duration::from_secs(10 * 86_400)).into();
    Ok(params.self_signed(&key)?.pem())
}

#[tonic::async_trait]
impl IstioCertificateService for IstiodCa {
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
        let uri_sans = uri_sans(&body.csr);
        let asked = uri_sans.first().and_then(|uri| workload_identity(uri));
        let (root, behaviour, delay, forced) = {
            let mut state = self.state();
            state.requests.push(CaRequest {
                authorization: authorization.clone(),
                validity_seconds: body.validity_duration,
                uri_sans,
                cert_signer,
                csr: body.csr.clone(),
            });
            (state.root.clone(), state.behaviour.clone(), state.delay, state.forced_lifetime)
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
            u64::try_from(body.validity_duration)
                .ok()
                .filter(|s| *s > 0)
                .map_or(DEFAULT_LIFETIME, Duration::from_secs)
        });
        let seconds = i64::try_from(lifetime.as_secs()).unwrap_or(i64::MAX);
        let leaf = || {
            let Some(identity) = &asked else {
                let e = rcgen::CertificateSigningRequestParams::from_pem(&body.csr).err();
                let why = e.map_or("no workload SPIFFE ID".to_string(), |e| format!("not a valid CSR: {e}"));
                return Err(Status::invalid_argument(format!("the CSR asks for {why}")));
            };
            let policy = SigningPolicy::new(identity, forced.unwrap_or(MAX_LIFETIME));
            root.sign(&body.csr, seconds, &policy).map(|s| s.leaf_pem).map_err(|e| e.to_status())
        };
        let chain = match behaviour {
            CaBehaviour::Fail(code, message) => return Err(Status::new(code, message)),
            CaBehaviour::Garbage => vec!["not a certificate".into(), "still not one".into()],
            CaBehaviour::LeafOnly => vec![leaf()?],
            CaBehaviour::Sign => vec![leaf()?, root.root_pem().to_string()],
            CaBehaviour::ExpiredRoot => {
                vec![leaf()?, expired_root(&self.org).map_err(|e| Status::internal(e.to_string()))?]
            }
        };
        Ok(Response::new(IstioCertificateResponse { cert_chain: chain }))
    }
}

#[cfg(test)]
mod tests {
    use weir_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateService as _;

    use super::*;

    const ID: &str = "spiffe://cluster.local/ns/default/sa/app";

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

    fn lifetime(leaf_pem: &str) -> i64 {
        let (_, pem) = x509_parser::pem::parse_x509_pem(leaf_pem.as_bytes()).unwrap();
        let leaf = pem.parse_x509().unwrap();
        leaf.validity().not_after.timestamp() - leaf.validity().not_before.timestamp()
    }

    #[tokio::test]
    async fn signs_a_csr_into_a_leaf_and_root_chain_for_the_asked_lifetime() {
        let ca = IstiodCa::new("test", Some("t")).unwrap();
        let chain = ca.create_certificate(request(csr(ID), "t")).await.unwrap().into_inner().cert_chain;
        assert_eq!(chain.len(), 2);
        assert_eq!(chain[1], ca.root_pem());
        let (_, pem) = x509_parser::pem::parse_x509_pem(chain[0].as_bytes()).unwrap();
        let leaf = pem.parse_x509().unwrap();
        let san = leaf.subject_alternative_name().unwrap().unwrap();
        assert!(format!("{:?}", san.value.general_names).contains(ID));
        assert_eq!(lifetime(&chain[0]), 3600 + 60, "asked validity plus the minute of back-dating");
        assert_eq!(ca.requests()[0].uri_sans, vec![ID.to_string()]);
    }

    #[tokio::test]
    async fn refuses_bad_tokens_and_csrs_and_obeys_its_failure_modes() {
        let ca = IstiodCa::new("test", Some("t")).unwrap();
        let e = ca.create_certificate(request(csr(ID), "wrong")).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = ca.create_certificate(request("junk".into(), "t")).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        ca.set_behaviour(CaBehaviour::LeafOnly);
        let chain = ca.create_certificate(request(csr(ID), "t")).await.unwrap().into_inner().cert_chain;
        assert_eq!(chain.len(), 1);
        ca.set_behaviour(CaBehaviour::Fail(tonic::Code::Unavailable, "down".into()));
        let e = ca.create_certificate(request(csr(ID), "t")).await.unwrap_err();
        assert_eq!((e.code(), e.message()), (tonic::Code::Unavailable, "down"));
        ca.set_behaviour(CaBehaviour::Sign);
        ca.force_lifetime(Some(Duration::from_secs(10)));
        let chain = ca.create_certificate(request(csr(ID), "t")).await.unwrap().into_inner().cert_chain;
        assert_eq!(lifetime(&chain[0]), 70);
    }
}
