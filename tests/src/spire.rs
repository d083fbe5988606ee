//! A stand-in for a SPIRE agent's workload socket, as the SPIFFE CSI driver
//! (`csi.spiffe.io`) publishes it into a pod: a directory holding `socket`, on which an
//! SDS server (state of the world, `StreamSecrets`) hands Envoy `default` (an SVID
//! from its own CA) and `ROOTCA`, and records every name it was asked for. Written for
//! tests, independent of Weir's own SDS server.

use std::{
    path::{Path, PathBuf},
    pin::Pin,
    sync::{Arc, Mutex},
    thread::JoinHandle,
};

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use weir_agent::sidecar::identity::manager::SecretData;
use weir_proto::{
    envoy::service::{
        discovery::v3::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse},
        secret::v3::secret_discovery_service_server::{SecretDiscoveryService, SecretDiscoveryServiceServer},
    },
    type_url,
};

use crate::{control_plane::TestCa, envoy::tempfile_dir::Dir};

/// A running SPIRE stand-in. Stops (and its directory goes) on drop.
pub struct SpireAgent {
    stop: CancellationToken,
    thread: Option<JoinHandle<()>>,
    requested: Arc<Mutex<Vec<String>>>,
    serial_hex: String,
    trust_root: String,
    dir: Dir,
}

#[derive(Clone)]
struct Sds {
    chain: String,
    key: String,
    root: String,
    requested: Arc<Mutex<Vec<String>>>,
}

impl SpireAgent {
    /// Serves an SVID for `spiffe_id` on `<its dir>/socket` (connectable by any user).
    pub fn start(spiffe_id: &str) -> anyhow::Result<Self> {
        let ca = TestCa::new("SPIRE server CA")?;
        let svid = ca.workload_cert(spiffe_id)?;
        let dir = Dir::new("spire-agent")?;
        let socket = dir.path().join("socket");
        let std_listener = std::os::unix::net::UnixListener::bind(&socket)
            .with_context(|| format!("bind {}", socket.display()))?;
        std::fs::set_permissions(&socket, std::os::unix::fs::PermissionsExt::from_mode(0o777))?;
        std_listener.set_nonblocking(true)?;
        let requested = Arc::new(Mutex::new(Vec::new()));
        let sds = Sds {
            chain: svid.chain_pem.clone(),
            key: svid.key_pem.clone(),
            root: ca.root_pem().to_string(),
            requested: requested.clone(),
        };
        let stop = CancellationToken::new();
        let cancelled = stop.clone();
        let thread = std::thread::spawn(move || {
            let runtime =
                tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::UnixListener::from_std(std_listener).expect("tokio listener");
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
                let _ = tonic::transport::Server::builder()
                    .add_service(SecretDiscoveryServiceServer::new(sds))
                    .serve_with_incoming_shutdown(incoming, cancelled.cancelled_owned())
                    .await;
            });
        });
        Ok(Self {
            stop,
            thread: Some(thread),
            requested,
            serial_hex: svid.serial_hex,
            trust_root: ca.root_pem().to_string(),
            dir,
        })
    }

    /// The directory the CSI driver publishes (holding `socket`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("socket")
    }

    /// The SVID's serial number (hex, as Envoy's `/certs` prints it).
    pub fn serial_hex(&self) -> &str {
        &self.serial_hex
    }

    /// The trust bundle it serves as `ROOTCA`.
    pub fn trust_root(&self) -> &str {
        &self.trust_root
    }

    /// Every secret name asked for, in order.
    pub fn requested(&self) -> Vec<String> {
        self.requested.lock().expect("lock").clone()
    }
}

impl Drop for SpireAgent {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

type SecretStream = Pin<Box<dyn futures::Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;
type DeltaStream = Pin<Box<dyn futures::Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

impl Sds {
    fn response(&self, names: &[String], version: u64) -> DiscoveryResponse {
        let resources = names
            .iter()
            .filter_map(|name| {
                let data = match name.as_str() {
                    "default" => {
                        SecretData::KeyCert { chain_pem: self.chain.clone(), key_pem: self.key.clone() }
                    }
                    "ROOTCA" => SecretData::Root { pem: self.root.clone() },
                    _ => return None,
                };
                let secret = weir_agent::sidecar::identity::sds::to_envoy(name, &data);
                Some(weir_proto::to_any(type_url::SECRET, &secret))
            })
            .collect();
        DiscoveryResponse {
            version_info: version.to_string(),
            resources,
            type_url: type_url::SECRET.into(),
            nonce: format!("spire-{version}"),
            ..Default::default()
        }
    }
}

#[tonic::async_trait]
impl SecretDiscoveryService for Sds {
    type StreamSecretsStream = SecretStream;
    type DeltaSecretsStream = DeltaStream;

    async fn stream_secrets(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamSecretsStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let sds = self.clone();
        tokio::spawn(async move {
            let mut sent: Vec<String> = Vec::new();
            let mut version = 0;
            while let Ok(Some(req)) = inbound.message().await {
                let mut names = req.resource_names.clone();
                names.sort();
                // A new subscription is answered; an ACK of what was sent is not.
                if names == sent && !req.response_nonce.is_empty() {
                    continue;
                }
                sds.requested.lock().expect("lock").extend(req.resource_names.iter().cloned());
                version += 1;
                if tx.send(Ok(sds.response(&names, version))).await.is_err() {
                    break;
                }
                sent = names;
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn delta_secrets(
        &self,
        _: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaSecretsStream>, Status> {
        Err(Status::unimplemented("DeltaSecrets"))
    }

    async fn fetch_secrets(
        &self,
        _: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        Err(Status::unimplemented("FetchSecrets"))
    }
}
