//! The control plane's certificate authority as standalone mode serves it:
//! `istio.v1.auth.IstioCertificateService/CreateCertificate`, answering with the leaf
//! the mesh root (`root`) signs and the root, as istiod's CA answers workloads. Nothing
//! about a request is kept; issuances are logged.

mod root;

use std::time::Duration;

use tonic::{Request, Response, Status};
use weir_proto::istio::v1::auth::{
    IstioCertificateRequest, IstioCertificateResponse,
    istio_certificate_service_server::IstioCertificateService,
};

pub use root::{CaError, MeshCa, ROOT_CERT_FILE, ROOT_KEY_FILE, SignError};

/// The lifetime of a certificate whose request names none.
const DEFAULT_LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// The CA service over a mesh root. Clones share the root.
#[derive(Clone)]
pub struct WorkloadCa {
    ca: MeshCa,
}

impl WorkloadCa {
    pub fn new(ca: MeshCa) -> Self {
        Self { ca }
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
        let body = request.into_inner();
        let lifetime = u64::try_from(body.validity_duration)
            .ok()
            .filter(|s| *s > 0)
            .map_or(DEFAULT_LIFETIME, Duration::from_secs);
        let leaf = self.ca.sign(&body.csr, lifetime).map_err(|e| e.to_status())?;
        tracing::info!(lifetime_seconds = lifetime.as_secs(), "workload certificate issued");
        Ok(Response::new(IstioCertificateResponse { cert_chain: vec![leaf, self.ca.root_pem().to_string()] }))
    }
}
