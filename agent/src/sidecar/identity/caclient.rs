//! The client for istiod's CA (`istio.v1.auth.IstioCertificateService/CreateCertificate`),
//! as pilot-agent's Citadel client: the CSR, the requested validity (`SECRET_TTL`) and
//! `CertSigner` metadata in the request; bearer token, `ClusterID` and `CA_HEADER_*` as
//! gRPC metadata; one channel, redialled after a failure. Transient failures are
//! retried a few times with jittered backoff; the answer is checked (`chain`) before
//! anyone sees it.

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use prost_types::{Struct, Value, value::Kind};
use tokio::sync::Mutex;
use tonic::{Code, transport::Channel};
use weir_proto::istio::v1::auth::{
    IstioCertificateRequest, istio_certificate_service_client::IstioCertificateServiceClient,
};

use super::chain::{self, ChainError, LeafInfo};
use crate::{
    sidecar::metrics::{CSR, Metrics},
    sidecar::xds::{UpstreamConfig, UpstreamError},
};

/// Attempts per signing call for transient failures (the secret manager retries
/// whole issuances on its own, slower schedule).
pub const ATTEMPTS: u32 = 3;
const FIRST_RETRY: Duration = Duration::from_millis(100);
/// How long one CreateCertificate may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum CaClientError {
    #[error("CA at {address}")]
    Upstream {
        address: String,
        #[source]
        source: UpstreamError,
    },
    #[error("CA at {address}: CreateCertificate failed with {code:?}: {message}")]
    Status { address: String, code: Code, message: String },
    #[error("CA at {address} answered with a bad certificate chain")]
    Chain {
        address: String,
        #[source]
        source: ChainError,
    },
}

impl CaClientError {
    /// Worth another try soon (the CA or the path to it is briefly unwell).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Upstream { source, .. } => !matches!(
                source,
                UpstreamError::Address(_)
                    | UpstreamError::Header(_)
                    | UpstreamError::Tls { .. }
                    | UpstreamError::ServerName { .. }
            ),
            Self::Status { code, .. } => matches!(
                code,
                Code::Unavailable
                    | Code::DeadlineExceeded
                    | Code::ResourceExhausted
                    | Code::Aborted
                    | Code::Unknown
            ),
            Self::Chain { .. } => false,
        }
    }
}

/// A signed certificate as the CA returned it.
#[derive(Debug, Clone)]
pub struct Issued {
    /// Leaf first, root last (PEM each).
    pub chain: Vec<String>,
    pub leaf: LeafInfo,
}

/// Signs CSRs at the CA. Clones share the channel.
#[derive(Clone)]
pub struct CaClient {
    upstream: Arc<UpstreamConfig>,
    ttl: Duration,
    cert_signer: Option<String>,
    channel: Arc<Mutex<Option<Channel>>>,
    metrics: Arc<Metrics>,
}

impl CaClient {
    pub fn new(
        upstream: UpstreamConfig,
        ttl: Duration,
        cert_signer: Option<String>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self { upstream: Arc::new(upstream), ttl, cert_signer, channel: Arc::default(), metrics }
    }

    pub fn address(&self) -> &str {
        &self.upstream.address
    }

    /// Signs `csr_pem` for the key `public_key_der`, retrying transient failures.
    /// Every attempt counts in `istio_agent_num_outgoing_requests{request_type="csr"}`.
    pub async fn sign(&self, csr_pem: &str, public_key_der: &[u8]) -> Result<Issued, CaClientError> {
        let mut delay = FIRST_RETRY;
        let mut attempt = 1;
        loop {
            self.metrics.num_outgoing_requests.get_or_create(&CSR).inc();
            let started = Instant::now();
            let result = self.sign_once(csr_pem, public_key_der).await;
            self.metrics
                .outgoing_latency
                .get_or_create(&CSR)
                .inc_by(started.elapsed().as_secs_f64() * 1000.0);
            let Err(e) = result else { return result };
            self.metrics.num_failed_outgoing_requests.get_or_create(&CSR).inc();
            // Istio redials after any failure: a new channel re-reads the root file.
            *self.channel.lock().await = None;
            if attempt >= ATTEMPTS || !e.is_transient() {
                return Err(e);
            }
            tracing::warn!(ca = %self.upstream.address, attempt, error = %crate::error_chain(&e), "CSR failed; retrying");
            tokio::time::sleep(super::jitter(delay, 0.2)).await;
            delay *= 2;
            attempt += 1;
        }
    }

    async fn sign_once(&self, csr_pem: &str, public_key_der: &[u8]) -> Result<Issued, CaClientError> {
        let address = || self.upstream.address.clone();
        let upstream_error = |source| CaClientError::Upstream { address: address(), source };
        let channel = {
            let mut slot = self.channel.lock().await;
            match slot.as_ref() {
                Some(c) => c.clone(),
                None => {
                    let c = self.upstream.channel().await.map_err(upstream_error)?;
                    *slot = Some(c.clone());
                    c
                }
            }
        };
        // Always present, empty when unset, as pilot-agent sends it.
        let signer = self.cert_signer.clone().unwrap_or_default();
        let metadata = Some(Struct {
            fields: [("CertSigner".to_string(), Value { kind: Some(Kind::StringValue(signer)) })].into(),
        });
        let body = IstioCertificateRequest {
            csr: csr_pem.into(),
            validity_duration: self.ttl.as_secs() as i64,
            metadata,
        };
        let mut request = self.upstream.request(body).map_err(upstream_error)?;
        request.set_timeout(REQUEST_TIMEOUT);
        let response = IstioCertificateServiceClient::new(channel)
            .create_certificate(request)
            .await
            .map_err(|s| CaClientError::Status {
                address: address(),
                code: s.code(),
                message: s.message().into(),
            })?
            .into_inner();
        let leaf = chain::check_issued(&response.cert_chain, public_key_der, SystemTime::now())
            .map_err(|source| CaClientError::Chain { address: address(), source })?;
        Ok(Issued { chain: response.cert_chain, leaf })
    }
}
