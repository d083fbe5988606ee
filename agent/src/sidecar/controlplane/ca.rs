//! The control plane's certificate authority as standalone mode serves it, for one
//! workload: `istio.v1.auth.IstioCertificateService/CreateCertificate`, answering with
//! the leaf the mesh root (`root`) signs and the root, as istiod's CA answers workloads.
//! With a token (standalone mode's, see `crate::sidecar::standalone`) only callers presenting
//! it are answered (UNAUTHENTICATED otherwise); every CSR then goes through the
//! workload's `SigningPolicy` (`policy`): its own SPIFFE ID only, for at most its TTL.
//! A refusal is PERMISSION_DENIED (another identity) or INVALID_ARGUMENT (no identity,
//! not a CSR) naming what was asked and what is allowed. Nothing about a request is
//! kept; issuances and refusals are logged.

mod policy;
mod root;

use tonic::{Request, Response, Status};
use weir_proto::istio::v1::auth::{
    IstioCertificateRequest, IstioCertificateResponse,
    istio_certificate_service_server::IstioCertificateService,
};

pub use policy::{Approved, Refusal, SigningPolicy};
pub use root::{CaError, MeshCa, ROOT_CERT_FILE, ROOT_KEY_FILE, SignError, Signed};

/// The CA service for one workload. Clones share the root.
#[derive(Clone)]
pub struct WorkloadCa {
    ca: MeshCa,
    policy: SigningPolicy,
    /// The bearer token callers must present (`None`: anyone).
    token: Option<String>,
}

impl WorkloadCa {
    pub fn new(ca: MeshCa, policy: SigningPolicy) -> Self {
        Self { ca, policy, token: None }
    }

    /// Answers only callers presenting `authorization: Bearer <token>`.
    pub fn with_token(mut self, token: String) -> Self {
        self.token = Some(token);
        self
    }

    fn admit<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let Some(token) = &self.token else { return Ok(()) };
        let presented = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|a| a.strip_prefix("Bearer "));
        if presented == Some(token.as_str()) {
            return Ok(());
        }
        let why = if presented.is_some() { "the bearer token is not valid" } else { "no bearer token" };
        tracing::warn!(reason = why, "CSR refused: the caller is not this agent");
        Err(Status::unauthenticated(format!("authentication failure: {why}")))
    }

    /// What it signs.
    pub fn policy(&self) -> &SigningPolicy {
        &self.policy
    }

    pub fn root_pem(&self) -> &str {
        self.ca.root_pem()
    }
}

#[tonic::async_trait]
impl IstioCertificateService for WorkloadCa {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        self.admit(&request)?;
        let body = request.into_inner();
        let signed = self.ca.sign(&body.csr, body.validity_duration, &self.policy).map_err(|e| {
            tracing::warn!(error = %crate::error_chain(&e), allowed = self.policy.identity(), "CSR refused");
            e.to_status()
        })?;
        tracing::info!(
            identity = %signed.approved.identity,
            lifetime_seconds = signed.approved.lifetime.as_secs(),
            requested_seconds = body.validity_duration,
            capped = signed.approved.capped,
            "workload certificate issued"
        );
        Ok(Response::new(IstioCertificateResponse {
            cert_chain: vec![signed.leaf_pem, self.ca.root_pem().to_string()],
        }))
    }
}
