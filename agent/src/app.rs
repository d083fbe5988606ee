//! The agent's wiring (`proxy sidecar`): from an `AgentConfig`, start the DNS proxy,
//! the xDS relay and the SDS server on their Unix sockets, the secret manager and the
//! status server, write Envoy's bootstrap and start Envoy under supervision; then run
//! until SIGTERM/SIGINT or `/quitquitquit` (drain Envoy, exit 0) or until Envoy exits
//! on its own (report it, exit non-zero).
//! Every component is built with `new(..)` and started here; nothing else wires.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use futures::FutureExt as _;

use crate::{
    config::{AgentConfig, args::ProxyType},
    dns::{DnsConfig, DnsProxy},
    envoy::{
        EnvoyAdmin, LifecycleControl, Readiness, Supervisor,
        bootstrap::{self, BootstrapError, BootstrapParams},
        process::RunAs,
        supervisor::SupervisorError,
    },
    identity::{CaClient, SdsServer, SecretManager, WorkloadSource},
    metrics::Metrics,
    status::{AppProber, MetricsMerge, StatusServer},
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
    #[error(transparent)]
    Sts(#[from] crate::sts::StsError),
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
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
    #[error("custom Envoy bootstrap {path} (customConfigFile) cannot be read")]
    CustomBootstrap {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Envoy(#[from] SupervisorError),
    #[error(transparent)]
    GrpcBootstrap(#[from] crate::xds::grpc_bootstrap::GrpcBootstrapError),
    #[error("standalone mode")]
    Standalone(#[from] crate::standalone::StandaloneError),
    #[error("Envoy needs {missing} for {why}, but the agent lacks it")]
    EnvoyCapability { missing: crate::privileges::MissingCapabilities, why: &'static str },
}

/// The running agent's handles (for tests and the Envoy lifecycle).
pub struct Agent {
    pub config: AgentConfig,
    pub metrics: Arc<Metrics>,
    pub dns: Option<Arc<DnsProxy>>,
    pub xds: XdsProxy,
    pub secrets: SecretManager,
    pub wasm_cache: Arc<crate::wasm::ModuleCache>,
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
        // Standalone: the embedded control plane asks for no token.
        let standalone = config.standalone.is_some();
        let without_token = |mut up: crate::xds::UpstreamConfig| {
            if standalone {
                up.token_path = None;
            }
            up
        };
        let wasm_cache = Arc::new(crate::wasm::ModuleCache::new(config.wasm.clone(), metrics.clone()));
        let xds = XdsProxy::new(
            without_token(config.xds.upstream(&config.pod.cluster_id)),
            handlers,
            metrics.clone(),
        )
        .with_wasm(Arc::new(crate::wasm::WasmConverter::new(wasm_cache.clone())));
        let id = &config.identity;
        let source = match (&id.mounted, &id.ca) {
            (Some(files), _) => WorkloadSource::Files(files.clone()),
            (None, Some(ca)) => WorkloadSource::Ca {
                client: CaClient::new(
                    without_token(ca.upstream(&id.token_path, &id.cluster_id)),
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
        Ok(Self { config, metrics, dns, xds, secrets, wasm_cache })
    }

    /// Binds everything (all or nothing: ports first, then the sockets, removed again
    /// if a later one fails), then serves until SIGTERM/SIGINT.
    pub async fn run(self) -> Result<(), AgentError> {
        let mut tasks = tokio::task::JoinSet::new();
        let status = if self.config.status.port > 0 {
            let address = SocketAddr::from(([0, 0, 0, 0], self.config.status.port));
            Some(StatusServer::bind(address).await?)
        } else {
            None
        };
        let sts = match &self.config.sts {
            Some(settings) => Some((
                crate::sts::StsServer::new(crate::sts::TokenManager::new(settings.clone())?),
                crate::sts::StsServer::bind(settings.port).await?,
            )),
            None => None,
        };
        let mut dns_tasks = match &self.dns {
            Some(dns) => Some(dns.bind().await?),
            None => None,
        };
        // Standalone: the control plane comes up first, inside the pod.
        let embedded_stop = tokio_util::sync::CancellationToken::new();
        let embedded = match &self.config.standalone {
            Some(settings) => {
                let ip = self.config.pod.instance_ip.as_deref().and_then(|ip| ip.parse().ok());
                Some(crate::standalone::start(settings, ip, embedded_stop.clone()).await?)
            }
            None => None,
        };
        let envoy = self.config.envoy_mode.launches();
        let supervisor = if envoy { Some(self.prepare_envoy()?) } else { None };
        let uds_path = self.config.xds.uds_path.clone();
        let listener = crate::xds::uds::bind(&uds_path, None)?;
        // Proxyless gRPC applications read this to reach the same socket. Paths are
        // made absolute: the application's working directory is not the agent's (in
        // a container both are `/`, and this is what pilot-agent's `./` paths mean).
        let absolute = |p: &std::path::Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        let grpc = crate::xds::grpc_bootstrap::render(
            &self.config.node.id,
            &self.config.node.metadata,
            &absolute(&uds_path),
            self.config.identity.output_dir.as_deref().map(absolute).as_deref(),
        );
        if let Err(e) = crate::xds::grpc_bootstrap::write(&self.config.node.grpc_bootstrap, &grpc) {
            let _ = std::fs::remove_file(&uds_path);
            return Err(e.into());
        }
        let sds_path = self.config.identity.sds_socket.clone();
        let serve_sds = self.config.envoy_mode.serves_sds();
        let sds = async {
            if !serve_sds {
                // Proxyless: nothing reads SDS; certificates go to OUTPUT_CERTS.
                Ok((false, None))
            } else if external_sds(&sds_path).await? {
                tracing::info!(path = %sds_path.display(), "existing workload SDS socket found (SPIRE or similar): using it, not serving SDS");
                Ok((true, None))
            } else {
                Ok((false, Some(crate::xds::uds::bind(&sds_path, None).map_err(AgentError::SdsUds)?)))
            }
        };
        let (external, sds_listener) = match sds.await {
            Ok(bound) => bound,
            Err(e) => {
                let _ = std::fs::remove_file(&uds_path);
                return Err(e);
            }
        };
        let admin = envoy.then(|| EnvoyAdmin::new(self.config.envoy.admin_port));
        let readiness = supervisor
            .as_ref()
            .map(|s| s.readiness.clone())
            .unwrap_or_else(|| Arc::new(Readiness::new(None)));
        let lifecycle = LifecycleControl::new(admin, self.config.args.proxy_type == ProxyType::Sidecar);
        tracing::info!(
            uds = %uds_path.display(),
            sds = %sds_path.display(),
            identity = %self.config.identity.identity,
            ca = self.config.identity.ca.as_ref().map(|c| c.address.as_str()).unwrap_or("none (mounted certificates)"),
            upstream = %self.config.xds.discovery_address,
            dns = self.dns.is_some(),
            status_port = self.config.status.port,
            sts_port = self.config.sts.as_ref().map(|s| s.port).unwrap_or(0),
            envoy = ?self.config.envoy_mode,
            sds_server = serve_sds && !external,
            "agent started"
        );
        let shutdown = tokio_util::sync::CancellationToken::new();
        // A background service that runs until shutdown and cannot fail the agent.
        let until_shutdown = |task: futures::future::BoxFuture<'static, ()>| {
            let stop = shutdown.clone();
            async move {
                tokio::select! {
                    _ = task => {}
                    _ = stop.cancelled() => {}
                }
                Ok(())
            }
        };
        if let Some((server, listener)) = sts {
            tasks.spawn(until_shutdown(Box::pin(server.serve(listener))));
        }
        if let Some(listener) = status {
            let merge = MetricsMerge {
                metrics: self.metrics.clone(),
                envoy: envoy.then(|| SocketAddr::from(([127, 0, 0, 1], self.config.status.prometheus_port))),
                apps: Arc::new(self.config.status.app_metrics.clone()),
            };
            let probes = AppProber::new(
                self.config.status.app_probers.clone(),
                self.config.status.probe_destination,
                self.config.status.port,
            );
            let server =
                StatusServer::new(self.dns.clone(), readiness.clone(), lifecycle.clone(), merge, probes);
            tasks.spawn(until_shutdown(Box::pin(server.serve(listener))));
        }
        let owns_sds = sds_listener.is_some();
        if owns_sds || !serve_sds {
            // Issues, rotates and (with OUTPUT_CERTS) writes the workload certificate.
            tasks.spawn(self.secrets.clone().run(shutdown.clone()).map(Ok));
        }
        if let Some(listener) = sds_listener {
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
        let purger = self.wasm_cache.clone();
        tasks.spawn(until_shutdown(Box::pin(async move { purger.purge_forever().await })));
        if let Some(settings) = self.config.health_check.clone() {
            let checker = crate::health::WorkloadHealthChecker::new(
                settings,
                self.config.status.probe_destination,
                self.config.status.port,
                envoy.then(|| readiness.clone()),
            );
            let (relay, stop) = (self.xds.clone(), shutdown.clone());
            tasks.spawn(async move {
                checker.run(relay, stop).await;
                Ok(())
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

        // Envoy runs until `stop_envoy`; its task ends early only if Envoy exits on
        // its own (and is not restarted).
        let stop_envoy = tokio_util::sync::CancellationToken::new();
        let mut envoy_task = supervisor.map(|s| tokio::spawn(s.run(stop_envoy.clone(), lifecycle.clone())));
        let envoy_done = async {
            match envoy_task.as_mut() {
                Some(task) => task.await,
                None => std::future::pending().await,
            }
        };

        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(AgentError::Signal)?;
        let (mut result, stopping) = tokio::select! {
            _ = term.recv() => { tracing::info!("SIGTERM: draining and shutting down"); (Ok(()), true) }
            _ = tokio::signal::ctrl_c() => { tracing::info!("SIGINT: draining and shutting down"); (Ok(()), true) }
            _ = lifecycle.quit_requested() => (Ok(()), true),
            done = envoy_done => {
                let result = match done {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(e)) => Err(AgentError::Envoy(e)),
                    Err(join) => {
                        tracing::error!(error = %join, "Envoy supervisor task failed");
                        Ok(())
                    }
                };
                envoy_task = None;
                (result, false)
            }
            Some(Ok(Err(e))) = tasks.join_next() => (Err(e), true),
            Some(Ok(Err(e))) = async { match dns_tasks.as_mut() { Some(t) => t.join_next().await, None => std::future::pending().await } } => {
                tracing::error!(error = %e, "DNS proxy stopped");
                (Ok(()), true)
            }
        };
        readiness.set_draining();
        if stopping {
            stop_envoy.cancel();
            if let Some(task) = envoy_task {
                // The drain itself is bounded by the policy; Envoy is killed after it.
                match task.await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) if result.is_ok() => result = Err(AgentError::Envoy(e)),
                    Ok(Err(_)) => {}
                    Err(join) => tracing::error!(error = %join, "Envoy supervisor task failed"),
                }
            }
        }
        shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        embedded_stop.cancel();
        if let Some(cp) = embedded {
            let _ = tokio::time::timeout(Duration::from_secs(2), cp.task).await;
        }
        tasks.abort_all();
        if let Some(mut t) = dns_tasks {
            t.abort_all();
        }
        let _ = std::fs::remove_file(&uds_path);
        if owns_sds {
            let _ = std::fs::remove_file(&sds_path);
        }
        result
    }

    /// Writes the bootstrap (unless a custom one is configured), reads the override,
    /// and decides who Envoy runs as.
    fn prepare_envoy(&self) -> Result<Supervisor, AgentError> {
        let c = &self.config;
        let settings = c.envoy.clone();
        if settings.custom_bootstrap {
            std::fs::File::open(&settings.bootstrap)
                .map_err(|source| AgentError::CustomBootstrap { path: settings.bootstrap.clone(), source })?;
        } else {
            let params = BootstrapParams {
                node_id: c.node.id.clone(),
                cluster: c.node.cluster.clone(),
                metadata: c.node.metadata.clone(),
                admin_port: settings.admin_port,
                status_port: c.status.port,
                prometheus_port: c.status.prometheus_port,
                readiness_port: c.status.readiness_port,
                xds_socket: c.xds.uds_path.clone(),
                sds_socket: c.identity.sds_socket.clone(),
                delta: c.node.delta_xds,
            };
            let document = match &settings.template {
                Some(path) => {
                    let text = std::fs::read_to_string(path).map_err(|source| BootstrapError::Read {
                        what: "bootstrap template",
                        path: path.clone(),
                        source,
                    })?;
                    bootstrap::render_template(path, &text, &bootstrap::template_vars(&params))?
                }
                None => bootstrap::render(&params),
            };
            bootstrap::write(&settings.bootstrap, &document)?;
            tracing::info!(path = %settings.bootstrap.display(), node = %c.node.id, "Envoy bootstrap written");
        }
        let override_json = match &settings.bootstrap_override {
            Some(path) => Some(bootstrap::override_json(path, c.pod.host_ip.as_deref())?),
            None => None,
        };
        let run_as = if nix::unistd::geteuid().is_root() {
            if !settings.capabilities.is_empty() {
                crate::privileges::require(settings.capabilities, "Envoy (TPROXY interception)")
                    .map_err(|missing| AgentError::EnvoyCapability { missing, why: "TPROXY interception" })?;
            }
            Some(RunAs { uid: 1337, gid: 1337, capabilities: settings.capabilities })
        } else {
            None
        };
        let args = crate::envoy::process::args(&settings, override_json.as_deref());
        let readiness = Arc::new(Readiness::new(Some(EnvoyAdmin::new(settings.admin_port))));
        let ignored_listeners = [
            format!("listener.0.0.0.0_{}.downstream_cx_active", c.status.readiness_port),
            format!("listener.0.0.0.0_{}.downstream_cx_active", c.status.prometheus_port),
        ]
        .into();
        Ok(Supervisor {
            settings,
            args,
            run_as,
            readiness,
            inbound_only: c.args.proxy_type == ProxyType::Sidecar,
            ignored_listeners,
        })
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
