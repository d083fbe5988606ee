//! The agent's wiring (`proxy sidecar`): from an `AgentConfig`, start the DNS proxy,
//! the xDS relay and the SDS server on their Unix sockets, the secret manager and the
//! status server, then run until a signal.
//! Every component is built with `new(..)` and started here; nothing else wires.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use futures::FutureExt as _;

use crate::{
    config::AgentConfig,
    dns::{DnsConfig, DnsProxy},
    identity::{CaClient, SdsServer, SecretManager, WorkloadSource},
    metrics::Metrics,
    status::StatusServer,
    xds::{XdsProxy, relay::Handler},
};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot read {path}")]
    ResolvConf {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("DNS proxy configuration")]
    DnsConfig(#[from] crate::dns::server::DnsConfigError),
    #[error(transparent)]
    DnsBind(#[from] crate::dns::server::DnsBindError),
    #[error("XDS socket")]
    Uds(#[from] crate::xds::uds::UdsError),
    #[error(transparent)]
    Status(#[from] crate::status::StatusBindError),
    #[error("SDS socket")]
    SdsUds(#[source] crate::xds::uds::UdsError),
    #[error(
        "an SDS socket exists at {path} but cannot be checked (is another SDS server's socket readable by this user?)"
    )]
    SdsSocketCheck {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("SDS server on {path}")]
    SdsServe {
        path: std::path::PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("XDS server on {path}")]
    XdsServe {
        path: std::path::PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("signal handler")]
    Signal(#[source] std::io::Error),
}

/// The running agent's handles (for tests and the Envoy lifecycle).
pub struct Agent {
    pub config: AgentConfig,
    pub metrics: Arc<Metrics>,
    pub dns: Option<Arc<DnsProxy>>,
    pub xds: XdsProxy,
    pub secrets: SecretManager,
}

impl Agent {
    /// Builds the components (nothing is bound yet).
    pub fn new(config: AgentConfig) -> Result<Self, AgentError> {
        let metrics = Arc::new(Metrics::new());
        let dns = if config.dns.enabled {
            let path = &config.dns.resolv_conf;
            let resolv_conf = std::fs::read_to_string(path)
                .map_err(|source| AgentError::ResolvConf { path: path.clone(), source })?;
            let is_root = nix::unistd::geteuid().is_root();
            let mut dns = DnsConfig::resolve(
                &config.dns.address,
                &config.pod.namespace,
                &config.pod.domain,
                &resolv_conf,
                is_root,
            )?;
            dns.forward_parallel = config.dns.forward_parallel;
            dns.upstream_timeout = config.dns.forward_timeout;
            Some(DnsProxy::new(dns, metrics.clone()))
        } else {
            None
        };
        let mut handlers: std::collections::HashMap<String, Handler> = Default::default();
        if let Some(dns) = &dns {
            handlers.insert(weir_proto::type_url::NAME_TABLE.into(), dns.nds_handler());
        }
        let xds = XdsProxy::new(config.xds.upstream(&config.pod.cluster_id), handlers, metrics.clone());
        let id = &config.identity;
        let source = match (&id.mounted, &id.ca) {
            (Some(files), _) => WorkloadSource::Files(files.clone()),
            (None, Some(ca)) => WorkloadSource::Ca {
                client: CaClient::new(
                    ca.upstream(&id.token_path, &id.cluster_id),
                    id.secret_ttl,
                    ca.cert_signer.clone(),
                    metrics.clone(),
                ),
                identity: id.identity.clone(),
                keys: id.keys,
            },
            (None, None) => WorkloadSource::None,
        };
        let secrets =
            SecretManager::new(source, id.rotation, id.output_dir.clone(), id.file_debounce, metrics.clone());
        Ok(Self { config, metrics, dns, xds, secrets })
    }

    /// Binds everything (all or nothing), then serves until SIGTERM/SIGINT.
    pub async fn run(self) -> Result<(), AgentError> {
        let mut tasks = tokio::task::JoinSet::new();
        let mut dns_tasks = match &self.dns {
            Some(dns) => Some(dns.bind().await?),
            None => None,
        };
        let uds_path = self.config.xds.uds_path.clone();
        let listener = crate::xds::uds::bind(&uds_path, None)?;
        let sds_path = self.config.identity.sds_socket.clone();
        let external = external_sds(&sds_path).await?;
        let sds_listener = if external {
            tracing::info!(path = %sds_path.display(), "existing workload SDS socket found (SPIRE or similar): using it, not serving SDS");
            None
        } else {
            Some(crate::xds::uds::bind(&sds_path, None).map_err(AgentError::SdsUds)?)
        };
        let status = if self.config.proxy_config.status_port > 0 {
            let address = SocketAddr::from(([0, 0, 0, 0], self.config.proxy_config.status_port));
            Some(StatusServer::bind(address).await?)
        } else {
            None
        };
        tracing::info!(
            uds = %uds_path.display(),
            sds = %sds_path.display(),
            identity = %self.config.identity.identity,
            ca = self.config.identity.ca.as_ref().map(|c| c.address.as_str()).unwrap_or("none (mounted certificates)"),
            upstream = %self.config.xds.discovery_address,
            dns = self.dns.is_some(),
            status_port = self.config.proxy_config.status_port,
            "agent started"
        );
        let shutdown = tokio_util::sync::CancellationToken::new();
        if let Some(listener) = status {
            let server = StatusServer { metrics: self.metrics.clone(), dns: self.dns.clone() };
            let stop = shutdown.clone();
            tasks.spawn(async move {
                tokio::select! {
                    _ = server.serve(listener) => {}
                    _ = stop.cancelled() => {}
                }
                Ok(())
            });
        }
        if let Some(listener) = sds_listener {
            tasks.spawn(self.secrets.clone().run(shutdown.clone()).map(Ok));
            let stop = shutdown.clone();
            let server = SdsServer::new(self.secrets.clone());
            let path = sds_path.clone();
            tasks.spawn(async move {
                server
                    .serve(listener, stop.cancelled_owned())
                    .await
                    .map_err(|source| AgentError::SdsServe { path, source })
            });
        }
        let stop = shutdown.clone();
        let xds = self.xds.clone();
        let path = uds_path.clone();
        tasks.spawn(async move {
            xds.serve(listener, stop.cancelled_owned())
                .await
                .map_err(|source| AgentError::XdsServe { path, source })
        });

        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(AgentError::Signal)?;
        let result = tokio::select! {
            _ = term.recv() => { tracing::info!("SIGTERM: shutting down"); Ok(()) }
            _ = tokio::signal::ctrl_c() => { tracing::info!("SIGINT: shutting down"); Ok(()) }
            Some(Ok(Err(e))) = tasks.join_next() => Err(e),
            Some(Ok(Err(e))) = async { match dns_tasks.as_mut() { Some(t) => t.join_next().await, None => std::future::pending().await } } => {
                tracing::error!(error = %e, "DNS proxy stopped");
                Ok(())
            }
        };
        shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        tasks.abort_all();
        if let Some(mut t) = dns_tasks {
            t.abort_all();
        }
        let _ = std::fs::remove_file(&uds_path);
        if !external {
            let _ = std::fs::remove_file(&sds_path);
        }
        result
    }
}

/// An SDS server already listens on `path` (SPIRE's agent, mounted into the pod). A
/// socket nobody listens on is stale and will be replaced; one that cannot be tried
/// (permissions) is an error, never deleted.
async fn external_sds(path: &std::path::Path) -> Result<bool, AgentError> {
    use std::os::unix::fs::FileTypeExt as _;
    if !std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        return Ok(false);
    }
    let check = |source| AgentError::SdsSocketCheck { path: path.into(), source };
    match tokio::time::timeout(Duration::from_secs(1), tokio::net::UnixStream::connect(path)).await {
        Ok(Ok(_)) => Ok(true),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(false),
        Ok(Err(e)) => Err(check(e)),
        Err(_) => Err(check(std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer within 1s"))),
    }
}
