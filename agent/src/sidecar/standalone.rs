//! Standalone mode: the agent serves xDS and certificates itself instead of istiod
//! (`--discovery-address embedded`). The control plane is the one the tests run as
//! istiod (`controlplane::serve`), bound on the pod's loopback (127.0.0.1:15010,
//! plaintext, as istiod's in-cluster port), and the agent's own relay and CA client
//! talk to it, so the relay, SDS and Envoy paths are exactly the istiod ones. What it
//! serves comes from a small YAML file of services (`mesh`); the mesh CA is created on
//! first start and kept in a state directory only its owner may enter (0700: give the
//! agent one of its own, never a directory the workloads mount), and signs only this
//! workload's identity for at most its TTL (`SigningPolicy`). Anything on the host or
//! in the pod can reach 127.0.0.1:15010, so both xDS and the CA answer only callers
//! presenting a token the agent makes at start and keeps in memory: its own relay and
//! CA client.

pub mod mesh;

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use crate::sidecar::controlplane::{AdsServer, AuthPolicy, MeshCa, SigningPolicy, WorkloadCa};

/// Where the embedded control plane listens (inside the pod).
pub const EMBEDDED_ADDRESS: &str = "127.0.0.1:15010";
/// The mesh CA's organisation name.
pub const CA_ORG: &str = "weir standalone mesh";

/// What `weir standalone` adds to the agent's configuration.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StandaloneSettings {
    /// The services file (`--services`).
    pub services: PathBuf,
    /// The mesh CA's directory (`--state-dir`), shared by the mesh's workloads.
    pub state_dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum StandaloneError {
    #[error(transparent)]
    Mesh(#[from] mesh::MeshError),
    #[error(transparent)]
    Ca(#[from] crate::sidecar::controlplane::ca::CaError),
    #[error("embedded control plane cannot listen on {EMBEDDED_ADDRESS}")]
    Bind(#[source] std::io::Error),
}

/// The embedded control plane, bound and serving.
pub struct EmbeddedControlPlane {
    pub ads: AdsServer,
    pub ca: WorkloadCa,
    pub task: tokio::task::JoinHandle<()>,
}

/// A fresh credential for the embedded control plane: 128 random bits, hex.
pub fn new_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// The metadata the agent's own relay and CA client present (`authorization`).
pub fn credential(token: &str) -> (String, String) {
    ("authorization".into(), format!("Bearer {token}"))
}

/// Binds and starts serving this workload's view of the mesh (`workload_ip`), and
/// keeps it current when the services file changes (polled every 2 s), to callers
/// presenting `token` (see `credential`). The CA signs what `signing` allows: the
/// workload's own identity, for at most its TTL.
pub async fn start(
    settings: &StandaloneSettings,
    workload_ip: Option<std::net::IpAddr>,
    signing: SigningPolicy,
    token: String,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<EmbeddedControlPlane, StandaloneError> {
    let file = mesh::MeshFile::load(&settings.services)?;
    let snapshot = file.snapshot(workload_ip, "1");
    let ca = WorkloadCa::new(MeshCa::load_or_create(CA_ORG, &settings.state_dir)?, signing)
        .with_token(token.clone());
    let ads = AdsServer::new(snapshot, AuthPolicy { token: Some(token), cluster_id: None });
    let address: SocketAddr = EMBEDDED_ADDRESS.parse().expect("a socket address");
    let listener = tokio::net::TcpListener::bind(address).await.map_err(StandaloneError::Bind)?;
    tracing::info!(
        services = file.services.len(),
        file = %settings.services.display(),
        state_dir = %settings.state_dir.display(),
        address = EMBEDDED_ADDRESS,
        signs = ca.policy().identity(),
        max_lifetime_seconds = ca.policy().max_lifetime().as_secs(),
        "embedded control plane serving"
    );
    let (serve_ads, serve_ca, path) = (ads.clone(), ca.clone(), settings.services.clone());
    let stop = shutdown.clone();
    let task = tokio::spawn(async move {
        let server = crate::sidecar::controlplane::serve(
            listener,
            None,
            serve_ads.clone(),
            Some(serve_ca),
            stop.clone().cancelled_owned(),
        );
        let reload = async {
            let mut last = file;
            let mut version = 1u64;
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                match mesh::MeshFile::load(&path) {
                    Ok(now) if now != last => {
                        version += 1;
                        serve_ads.push(now.snapshot(workload_ip, &version.to_string()));
                        tracing::info!(
                            version,
                            services = now.services.len(),
                            "services file changed: pushed"
                        );
                        last = now;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %crate::error_chain(&e), "services file unreadable; keeping the last good one")
                    }
                }
            }
        };
        tokio::select! {
            result = server => if let Err(e) = result {
                tracing::error!(error = %e, "embedded control plane stopped");
            },
            _ = reload => {}
            _ = stop.cancelled() => {}
        }
    });
    Ok(EmbeddedControlPlane { ads, ca, task })
}
