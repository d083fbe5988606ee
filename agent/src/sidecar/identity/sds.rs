//! The SDS server Envoy dials on `./var/run/secrets/workload-spiffe-uds/socket`:
//! `StreamSecrets` (state of the world) for the names `SecretName` knows; a response
//! per new subscription and per change, each with its own version and nonce; ACKs
//! and stale nonces answered with silence, NACKs logged. An unknown name or an
//! unreadable file ends that stream with a status naming it, as Istio's does (Envoy
//! opens one SDS stream per secret, so the others are untouched). The names a stream
//! asks for are held in the manager's watch list until it stops asking or ends. `DeltaSecrets` and
//! `FetchSecrets` are Unimplemented, as in Istio.

use std::{
    collections::BTreeSet,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use futures::Stream;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use weir_proto::{
    envoy::{
        config::core::v3::{DataSource, data_source::Specifier},
        extensions::transport_sockets::tls::v3::{
            CertificateValidationContext, Secret, TlsCertificate, secret,
        },
        service::{
            discovery::v3::{
                DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
            },
            secret::v3::secret_discovery_service_server::{
                SecretDiscoveryService, SecretDiscoveryServiceServer,
            },
        },
    },
    type_url,
};

use super::{
    manager::{SecretData, SecretError, SecretManager},
    names::SecretName,
};

/// The SDS service. Clones share the manager and the version counter.
#[derive(Clone)]
pub struct SdsServer {
    manager: SecretManager,
    version: Arc<AtomicU64>,
    streams: Arc<AtomicU64>,
}

impl SdsServer {
    pub fn new(manager: SecretManager) -> Self {
        Self { manager, version: Arc::default(), streams: Arc::default() }
    }

    /// Serves on `listener` (see `xds::uds::bind`) until `shutdown`.
    pub async fn serve(
        self,
        listener: tokio::net::UnixListener,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), crate::support::accept::ServeError> {
        let (incoming, broken) = crate::sidecar::xds::authority::incoming(listener, "SDS socket");
        let served = tonic::transport::Server::builder()
            .add_service(SecretDiscoveryServiceServer::new(self))
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await;
        crate::support::accept::ServeError::check(served, &broken)
    }

    async fn response(&self, names: &[SecretName]) -> Result<DiscoveryResponse, Status> {
        let mut resources = Vec::with_capacity(names.len());
        for name in names {
            let data = self.manager.secret(name).await.map_err(|e| {
                let text = crate::error_chain(&e);
                tracing::error!(resource = %name, error = %text, "cannot serve SDS resource");
                match e {
                    SecretError::Unknown(_) | SecretError::External(_) => Status::invalid_argument(text),
                    SecretError::Stopped => Status::unavailable(text),
                    _ => Status::failed_precondition(text),
                }
            })?;
            resources.push(weir_proto::to_any(type_url::SECRET, &to_envoy(&name.to_string(), &data)));
        }
        let now = time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        Ok(DiscoveryResponse {
            version_info: format!("{now}/{}", self.version.fetch_add(1, Ordering::Relaxed) + 1),
            resources,
            type_url: type_url::SECRET.into(),
            nonce: format!("{:032x}", rand::random::<u128>()),
            ..Default::default()
        })
    }

    async fn run_stream(
        &self,
        id: u64,
        mut inbound: Streaming<DiscoveryRequest>,
        tx: &mpsc::Sender<Result<DiscoveryResponse, Status>>,
    ) -> Result<(), Status> {
        let mut updates = self.manager.subscribe();
        let mut watched = Interest { manager: self.manager.clone(), names: BTreeSet::new() };
        let mut last_nonce = String::new();
        loop {
            let names: Vec<SecretName> = tokio::select! {
                message = inbound.message() => {
                    let Ok(Some(request)) = message else { return Ok(()) };
                    if !request.type_url.is_empty() && request.type_url != type_url::SECRET {
                        return Err(Status::invalid_argument(format!(
                            "type {:?} on the SDS stream: expected {}", request.type_url, type_url::SECRET
                        )));
                    }
                    if !request.response_nonce.is_empty() && request.response_nonce != last_nonce {
                        continue; // stale: an answer to a response Envoy has since been sent
                    }
                    if let Some(error) = &request.error_detail {
                        tracing::warn!(stream = id, resources = ?request.resource_names, error = %error.message, "Envoy rejected a secret (NACK)");
                        continue;
                    }
                    let requested = request
                        .resource_names
                        .iter()
                        .map(|n| SecretName::parse(n))
                        .collect::<Result<BTreeSet<_>, _>>()
                        .map_err(|e| {
                            tracing::error!(stream = id, error = %e, "SDS request for an unknown resource");
                            Status::invalid_argument(e.to_string())
                        })?;
                    if !request.response_nonce.is_empty() && requested == watched.names {
                        continue; // ACK
                    }
                    let added = requested.difference(&watched.names).cloned().collect();
                    watched.set(requested);
                    tracing::debug!(stream = id, resources = ?watched.names, "SDS subscription");
                    added
                }
                update = updates.recv() => match update {
                    Ok(name) if watched.names.contains(&name) => vec![name],
                    Ok(_) => continue,
                    Err(broadcast::error::RecvError::Lagged(_)) => watched.names.iter().cloned().collect(),
                    Err(broadcast::error::RecvError::Closed) => return Ok(()),
                },
            };
            if names.is_empty() {
                continue;
            }
            let response = self.response(&names).await?;
            last_nonce = response.nonce.clone();
            tracing::info!(stream = id, resources = ?names.iter().map(|n| n.to_string()).collect::<Vec<_>>(), version = %response.version_info, "SDS push");
            if tx.send(Ok(response)).await.is_err() {
                return Ok(());
            }
        }
    }
}

/// The names one stream asks for, held in the manager's watch list while it does (and
/// released when the stream ends, however it ends).
struct Interest {
    manager: SecretManager,
    names: BTreeSet<SecretName>,
}

impl Interest {
    fn set(&mut self, names: BTreeSet<SecretName>) {
        for added in names.difference(&self.names) {
            self.manager.hold(added);
        }
        for dropped in self.names.difference(&names) {
            self.manager.release(dropped);
        }
        self.names = names;
    }
}

impl Drop for Interest {
    fn drop(&mut self) {
        for name in &self.names {
            self.manager.release(name);
        }
    }
}

type BoxedStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl SecretDiscoveryService for SdsServer {
    type StreamSecretsStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaSecretsStream = BoxedStream<DeltaDiscoveryResponse>;

    async fn stream_secrets(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamSecretsStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let id = self.streams.fetch_add(1, Ordering::Relaxed) + 1;
        let me = self.clone();
        let inbound = request.into_inner();
        tokio::spawn(async move {
            if let Err(status) = me.run_stream(id, inbound, &tx).await {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_secrets(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaSecretsStream>, Status> {
        Err(Status::unimplemented("DeltaSecrets not implemented"))
    }

    async fn fetch_secrets(
        &self,
        _request: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        Err(Status::unimplemented("FetchSecrets not implemented"))
    }
}

fn inline(bytes: &str) -> Option<DataSource> {
    Some(DataSource { specifier: Some(Specifier::InlineBytes(bytes.as_bytes().to_vec())) })
}

/// The Envoy `Secret` for one resource.
pub fn to_envoy(name: &str, data: &SecretData) -> Secret {
    let r#type = match data {
        SecretData::KeyCert { chain_pem, key_pem } => secret::Type::TlsCertificate(TlsCertificate {
            certificate_chain: inline(chain_pem),
            private_key: inline(key_pem),
            ..Default::default()
        }),
        SecretData::Root { pem } => secret::Type::ValidationContext(CertificateValidationContext {
            trusted_ca: inline(pem),
            ..Default::default()
        }),
    };
    Secret { name: name.into(), r#type: Some(r#type) }
}
