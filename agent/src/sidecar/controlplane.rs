//! A small local control plane, what standalone mode embeds: an ADS server (SotW and
//! Delta) that serves a snapshot of resources with the checks istiod makes on a stream
//! (bearer token, `ClusterID`) and tells an observer what it sees (`observe`), a CA
//! that signs a workload's own CSRs with the mesh root under a policy (`ca`), and builders for the Envoy
//! resources it serves (`resources`). It does no config translation (no Kubernetes,
//! no Istio APIs): callers hand it Envoy resources. The tests run it as istiod, with
//! their own CA and request log beside it (weir-tests).

pub mod ads;
pub mod ca;
pub mod observe;
pub mod resources;
pub mod snapshot;

use std::future::Future;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use weir_proto::{
    envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer,
    istio::v1::auth::istio_certificate_service_server::{
        IstioCertificateService, IstioCertificateServiceServer,
    },
};

pub use ads::{AdsServer, AuthPolicy};
pub use ca::{MeshCa, SigningPolicy, WorkloadCa};
pub use observe::{AdsObserver, ObservedRequest, ObservedStream};
pub use snapshot::{Snapshot, TypeSnapshot};

/// The server's TLS: its certificate chain and key (PEM), and optionally the roots
/// client certificates are checked against (clients without one are still admitted,
/// as istiod admits token-only clients).
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub cert_chain: Vec<u8>,
    pub key: Vec<u8>,
    pub client_roots: Option<Vec<u8>>,
}

impl AdsServer {
    /// Serves xDS on `listener` (TLS when `tls` is given) until `shutdown`; open
    /// streams are ended first so shutdown does not wait on them.
    pub async fn serve(
        self,
        listener: TcpListener,
        tls: Option<ServerTls>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        serve(listener, tls, self, None::<WorkloadCa>, shutdown).await
    }
}

/// Serves xDS and, when given, a CA (`IstioCertificateService`) on one port, as istiod
/// serves both on 15012.
pub async fn serve<Ca: IstioCertificateService>(
    listener: TcpListener,
    tls: Option<ServerTls>,
    ads: AdsServer,
    ca: Option<Ca>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        let mut config = ServerTlsConfig::new().identity(Identity::from_pem(tls.cert_chain, tls.key));
        if let Some(roots) = tls.client_roots {
            config = config.client_ca_root(Certificate::from_pem(roots)).client_auth_optional(true);
        }
        builder = builder.tls_config(config)?;
    }
    let me = ads.clone();
    // Small gRPC answers (a signed certificate) must not wait out Nagle + delayed ACK.
    let incoming = tokio_stream::StreamExt::map(TcpListenerStream::new(listener), |stream| {
        stream.inspect(|s| {
            let _ = s.set_nodelay(true);
        })
    });
    builder
        .add_service(
            AggregatedDiscoveryServiceServer::new(ads)
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX),
        )
        .add_optional_service(ca.map(IstioCertificateServiceServer::new))
        .serve_with_incoming_shutdown(incoming, async move {
            shutdown.await;
            me.drop_streams(tonic::Status::unavailable("control plane shutting down"));
        })
        .await
}
