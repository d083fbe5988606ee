//! The agent's wiring (`proxy sidecar`): from an `AgentConfig`, build the components,
//! bind every port and socket, write Envoy's bootstrap, and start the services in one
//! order — embedded control plane (standalone), workload certificate, SDS server, xDS
//! relay, DNS proxy, Wasm cache, workload health check, STS server, status server,
//! start-up memory release, Envoy — then run until SIGTERM/SIGINT or `/quitquitquit`
//! (drain, exit 0) or until any service ends on its own (report it by name, exit
//! non-zero), and stop them in the reverse order. Every component is built with `new(..)` and started here; nothing
//! else wires.

#[cfg(test)]
mod tests;

use std::{net::SocketAddr, sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;

use crate::{
    sidecar::config::{AgentConfig, args::ProxyType},
    sidecar::dns::{DnsConfig, DnsProxy},
    sidecar::envoy::{
        EnvoyAdmin, LifecycleControl, Readiness, Supervisor,
        bootstrap::{self, BootstrapError},
        process::RunAs,
        supervisor::SupervisorError,
    },
    sidecar::identity::{CaClient, SdsServer, SecretManager, WorkloadSource},
    sidecar::metrics::Metrics,
    sidecar::status::{AppProber, MetricsMerge, StatusServer},
    sidecar::xds::{XdsProxy, relay::Handler},
    support::services::Services,
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
    DnsConfig(#[from] crate::sidecar::dns::server::DnsConfigError),
    #[error(transparent)]
    DnsBind(#[from] crate::sidecar::dns::server::DnsBindError),
    #[error("XDS socket")]
    Uds(#[from] crate::sidecar::xds::uds::UdsError),
    #[error(transparent)]
    Status(#[from] crate::sidecar::status::StatusBindError),
    #[error(transparent)]
    Sts(#[from] crate::sidecar::sts::StsError),
    #[error("SDS socket")]
    SdsUds(#[source] crate::sidecar::xds::uds::UdsError),
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
        source: crate::support::accept::ServeError,
    },
    #[error("XDS server on {path}")]
    XdsServe {
        path: std::path::PathBuf,
        #[source]
        source: crate::support::accept::ServeError,
    },
    #[error("signal handler")]
    Signal(#[source] std::io::Error),
    #[error("DNS proxy")]
    DnsServe(#[source] std::io::Error),
    #[error(transparent)]
    Service(#[from] crate::support::services::ServiceExit),
    #[error(transparent)]
    Bootstrap(#[from] Box<BootstrapError>),
    #[error("custom Envoy bootstrap {path} (customConfigFile) cannot be read")]
    CustomBootstrap {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Envoy(#[from] SupervisorError),
    #[error(transparent)]
    GrpcBootstrap(#[from] crate::sidecar::xds::grpc_bootstrap::GrpcBootstrapError),
    #[error("standalone mode")]
    Standalone(#[from] crate::sidecar::standalone::StandaloneError),
    #[error("create the configuration directory {path}")]
    ConfigDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    EnvoyAccess(crate::sidecar::envoy::access::AccessError),
    #[error("Envoy needs {missing} for {why}, but the agent lacks it")]
    EnvoyCapability { missing: crate::support::privileges::MissingCapabilities, why: &'static str },
}

/// The running agent's handles (for tests and the Envoy lifecycle).
pub struct Agent {
    pub config: AgentConfig,
    pub metrics: Arc<Metrics>,
    pub dns: Option<Arc<DnsProxy>>,
    pub xds: XdsProxy,
    pub secrets: SecretManager,
    pub wasm_cache: Arc<crate::sidecar::wasm::ModuleCache>,
    /// Standalone: what the embedded control plane asks of its callers.
    embedded_token: Option<String>,
}

impl Agent {
    /// Builds the components (nothing is bound yet).
    pub fn new(config: AgentConfig) -> Result<Self, AgentError> {
        // The agent's own TLS (istiod, the CA, ...) follows COMPLIANCE_POLICY, checked
        // when the configuration was read.
        crate::support::tls::Compliance::parse(&config.envoy.bootstrap_env.compliance_policy)
            .unwrap_or_default()
            .set_for_process();
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
        // Standalone: the embedded control plane answers only this agent, which presents
        // a token made now and held in memory (no token file).
        let embedded_token = config.standalone.as_ref().map(|_| crate::sidecar::standalone::new_token());
        let embedded_credential = |mut up: crate::sidecar::xds::UpstreamConfig| {
            if let Some(token) = &embedded_token {
                up.token_path = None;
                up.headers.push(crate::sidecar::standalone::credential(token));
            }
            up
        };
        let wasm_cache =
            Arc::new(crate::sidecar::wasm::ModuleCache::new(config.wasm.clone(), metrics.clone()));
        let xds = XdsProxy::new(
            embedded_credential(config.xds.upstream(&config.pod.cluster_id)),
            handlers,
            metrics.clone(),
        )
        .with_wasm(Arc::new(crate::sidecar::wasm::WasmConverter::new(wasm_cache.clone())));
        let id = &config.identity;
        let source = match (&id.mounted, &id.ca) {
            (Some(files), _) => WorkloadSource::Files(files.clone()),
            (None, Some(ca)) => WorkloadSource::Ca {
                client: CaClient::new(
                    embedded_credential(ca.upstream(&id.token_path, &id.cluster_id)),
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
        Ok(Self { config, metrics, dns, xds, secrets, wasm_cache, embedded_token })
    }

    /// Binds every port and socket (all or nothing: a port in use fails start-up
    /// before any socket file exists, and sockets already made are removed again),
    /// starts the services in order, runs until SIGTERM, SIGINT (a second one ends the
    /// process at once), `/quitquitquit` or a service's end, then drains: readiness turns 503, and the services stop in
    /// reverse order, Envoy first.
    pub async fn run(self) -> Result<(), AgentError> {
        let shutdown = crate::support::shutdown::Shutdown::watch().map_err(AgentError::Signal)?;
        let bound = self.bind().await?;
        let readiness = bound
            .supervisor
            .as_ref()
            .map(|s| s.readiness.clone())
            .unwrap_or_else(|| Arc::new(Readiness::new(None)));
        let admin = bound.supervisor.is_some().then(|| EnvoyAdmin::new(self.config.envoy.admin_port));
        let lifecycle = LifecycleControl::new(admin, self.config.args.proxy_type == ProxyType::Sidecar);
        self.log_started(&bound);
        let (mut services, _sockets) = self.start(bound, &readiness, &lifecycle);
        let result = tokio::select! {
            _ = shutdown.requested() => { tracing::info!("draining and shutting down"); Ok(()) }
            _ = lifecycle.quit_requested() => Ok(()),
            exit = services.first_exit() => {
                tracing::error!(service = exit.name(), error = %crate::error_chain(&exit), "a service ended: stopping the agent");
                Err(AgentError::Service(exit))
            }
        };
        readiness.set_draining();
        services.stop(STOP_GRACE).await;
        result
    }

    /// Binds, in order: the status and STS ports, the DNS proxy's sockets, the embedded
    /// control plane (standalone), Envoy's bootstrap, the XDS socket, the gRPC
    /// bootstrap, the SDS socket.
    async fn bind(&self) -> Result<Bound, AgentError> {
        let c = &self.config;
        let status = match c.status.port {
            0 => None,
            port => Some(StatusServer::bind(port).await?),
        };
        let sts = match &c.sts {
            Some(settings) => Some((
                crate::sidecar::sts::StsServer::new(crate::sidecar::sts::TokenManager::new(
                    settings.clone(),
                )?),
                crate::sidecar::sts::StsServer::bind(settings.port).await?,
            )),
            None => None,
        };
        let dns = match &self.dns {
            Some(dns) => Some(dns.bind().await?),
            None => None,
        };
        // Standalone: the control plane comes up first, inside the pod.
        let embedded_stop = CancellationToken::new();
        let embedded = match &c.standalone {
            Some(settings) => {
                let ip = c.pod.ip();
                let signing = crate::sidecar::controlplane::SigningPolicy::new(
                    &c.identity.identity,
                    c.identity.secret_ttl,
                );
                let token = self.embedded_token.clone().unwrap_or_else(crate::sidecar::standalone::new_token);
                let cp =
                    crate::sidecar::standalone::start(settings, ip, signing, token, embedded_stop.clone())
                        .await?;
                Some((cp, embedded_stop))
            }
            None => None,
        };
        // What pilot-agent creates, made reachable by the user Envoy runs as.
        let owner = self.envoy_user();
        crate::sidecar::envoy::access::create_dir(std::path::Path::new(&c.proxy_config.config_path), owner)
            .map_err(|source| AgentError::ConfigDir {
            path: c.proxy_config.config_path.clone().into(),
            source,
        })?;
        let supervisor = if c.envoy_mode.launches() { Some(self.prepare_envoy()?) } else { None };
        let uds_path = c.xds.uds_path.clone();
        let xds = crate::sidecar::xds::uds::bind(&uds_path, owner)?;
        let xds_socket = SocketFile(uds_path.clone());
        // Proxyless gRPC applications read this to reach the same socket. Paths are
        // made absolute: the application's working directory is not the agent's (in
        // a container both are `/`, and this is what pilot-agent's `./` paths mean).
        let absolute = |p: &std::path::Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        let grpc = crate::sidecar::xds::grpc_bootstrap::render(
            &c.node.id,
            c.node.typed_metadata(),
            &absolute(&uds_path),
            c.identity.output_dir.as_deref().map(absolute).as_deref(),
        );
        crate::sidecar::xds::grpc_bootstrap::write(&c.node.grpc_bootstrap, &grpc)?;
        let sds = self.bind_sds(owner).await?;
        if let (Some(supervisor), Some((uid, gid))) = (&supervisor, owner) {
            self.check_envoy_access(supervisor, uid, gid, &sds)?;
        }
        Ok(Bound { status, sts, dns, embedded, supervisor, xds: (xds, xds_socket), sds })
    }

    /// The user Envoy runs as when the agent starts it as root (istio-proxy, 1337).
    fn envoy_user(&self) -> Option<(u32, u32)> {
        (self.config.envoy_mode.launches() && nix::unistd::geteuid().is_root()).then_some((1337, 1337))
    }

    /// Envoy, as its user, can read its bootstrap and reach both sockets — or the
    /// agent does not start, naming the path and the uid.
    fn check_envoy_access(
        &self,
        supervisor: &Supervisor,
        uid: u32,
        gid: u32,
        sds: &SdsSocket,
    ) -> Result<(), AgentError> {
        use crate::sidecar::envoy::access::Need;
        let c = &self.config;
        let mut needs = vec![
            Need::Read { what: "its bootstrap", path: supervisor.settings.bootstrap.clone() },
            Need::Connect { what: "the XDS socket", path: c.xds.uds_path.clone() },
        ];
        if !matches!(sds, SdsSocket::NotServed) {
            needs.push(Need::Connect { what: "the SDS socket", path: c.identity.sds_socket.clone() });
        }
        if let SdsSocket::External { files: Some(_) } = sds {
            let path = crate::sidecar::config::paths::FILES_SOCKET.into();
            needs.push(Need::Connect { what: "the file-secret SDS socket", path });
        }
        crate::sidecar::envoy::access::check(uid, gid, &needs).map_err(AgentError::EnvoyAccess)
    }

    /// The SDS socket: not served (proxyless), another server's (SPIRE), or ours.
    async fn bind_sds(&self, owner: Option<(u32, u32)>) -> Result<SdsSocket, AgentError> {
        let path = &self.config.identity.sds_socket;
        if !self.config.envoy_mode.serves_sds() {
            // Proxyless: nothing reads SDS; certificates go to OUTPUT_CERTS.
            return Ok(SdsSocket::NotServed);
        }
        if external_sds(path).await? {
            // As pilot-agent: the workload identity is the other server's; Weir serves
            // only file-based secrets, on the credential socket Envoy's bootstrap names.
            let files = std::path::PathBuf::from(crate::sidecar::config::paths::FILES_SOCKET);
            tracing::info!(path = %path.display(), files = %files.display(), "existing workload SDS socket found (SPIRE or similar): using it; serving only file secrets");
            return Ok(match crate::sidecar::xds::uds::bind(&files, owner) {
                Ok(listener) => SdsSocket::External { files: Some((listener, SocketFile(files))) },
                // The injector mounts a volume there; without one, file secrets go unserved.
                Err(e) => {
                    tracing::warn!(error = %crate::error_chain(&e), "no file-secret SDS server: the credential socket cannot be made");
                    SdsSocket::External { files: None }
                }
            });
        }
        let listener = crate::sidecar::xds::uds::bind(path, owner).map_err(AgentError::SdsUds)?;
        Ok(SdsSocket::Served(listener, SocketFile(path.clone())))
    }

    fn log_started(&self, bound: &Bound) {
        let c = &self.config;
        tracing::info!(
            uds = %c.xds.uds_path.display(),
            sds = %c.identity.sds_socket.display(),
            identity = %c.identity.identity,
            ca = c.identity.ca.as_ref().map(|c| c.address.as_str()).unwrap_or("none (mounted certificates)"),
            upstream = %c.xds.discovery_address,
            dns = self.dns.is_some(),
            status_port = c.status.port,
            sts_port = c.sts.as_ref().map(|s| s.port).unwrap_or(0),
            envoy = ?c.envoy_mode,
            sds_server = matches!(bound.sds, SdsSocket::Served(..)),
            "agent started"
        );
    }

    /// Starts the services in their order; returns them and the socket files they
    /// serve on (removed when dropped, after the services stopped).
    fn start(
        self,
        bound: Bound,
        readiness: &Arc<Readiness>,
        lifecycle: &LifecycleControl,
    ) -> (Services, Vec<SocketFile>) {
        let Bound { status, sts, dns, embedded, supervisor, xds: (xds_listener, xds_socket), sds } = bound;
        let c = &self.config;
        let mut services = Services::new();
        let mut sockets = vec![xds_socket];
        if let Some((mut cp, cp_stop)) = embedded {
            services.start_infallible("embedded control plane", move |stop| async move {
                tokio::select! {
                    _ = &mut cp.task => {}
                    _ = stop.cancelled() => {
                        cp_stop.cancel();
                        let _ = tokio::time::timeout(Duration::from_secs(2), cp.task).await;
                    }
                }
            });
        }
        self.start_secrets(sds, &mut services, &mut sockets);
        let (xds, path) = (self.xds.clone(), c.xds.uds_path.clone());
        services.start("xDS relay", move |stop| async move {
            xds.serve(xds_listener, stop.cancelled_owned())
                .await
                .map_err(|source| AgentError::XdsServe { path, source })
        });
        if let Some(mut tasks) = dns {
            services.start("DNS proxy", move |stop| async move {
                tokio::select! {
                    ended = tasks.join_next() => match ended {
                        Some(Ok(Err(e))) => Err(AgentError::DnsServe(e)),
                        _ => Ok(()),
                    },
                    _ = stop.cancelled() => { tasks.abort_all(); Ok(()) }
                }
            });
        }
        let purger = self.wasm_cache.clone();
        services.start_infallible("Wasm module cache", move |stop| {
            until(stop, async move { purger.purge_forever().await })
        });
        if let Some(settings) = c.health_check.clone() {
            let checker = crate::sidecar::health::WorkloadHealthChecker::new(
                settings,
                c.status.probe_destination,
                supervisor.is_some().then(|| readiness.clone()),
            );
            let relay = self.xds.clone();
            services.start_infallible("workload health check", move |stop| checker.run(relay, stop));
        }
        if let Some((server, listener)) = sts {
            services.start_infallible("STS server", move |stop| until(stop, server.serve(listener)));
        }
        if let Some(listener) = status {
            let server = self.status_server(readiness, lifecycle, supervisor.is_some());
            services.start_infallible("status server", move |stop| until(stop, server.serve(listener)));
        }
        // Start-up code and data, run once, leave the resident set once the proxy is
        // ready (crate::sidecar::footprint).
        let ready = readiness.clone();
        services.start_infallible("start-up memory release", move |stop| {
            until(stop, async move {
                let ready = || {
                    let ready = ready.clone();
                    async move { ready.check().await.is_ok() }
                };
                crate::sidecar::footprint::release_when_ready(
                    ready,
                    Duration::from_secs(1),
                    Duration::from_secs(120),
                )
                .await;
                std::future::pending::<()>().await
            })
        });
        if let Some(supervisor) = supervisor {
            // Last started, first stopped: Envoy drains while everything else serves.
            let lifecycle = lifecycle.clone();
            services.start_draining("Envoy", move |stop| async move {
                supervisor.run(stop, lifecycle).await.map(drop)
            });
        }
        (services, sockets)
    }

    /// The secrets services, in their order: the file-secrets server (when SPIRE or
    /// another server owns the workload socket), the workload certificate, the SDS
    /// server. Socket files served go to `sockets`.
    fn start_secrets(&self, sds: SdsSocket, services: &mut Services, sockets: &mut Vec<SocketFile>) {
        let (serves_sds, sds_listener) = match sds {
            SdsSocket::Served(listener, file) => {
                sockets.push(file);
                (true, Some(listener))
            }
            SdsSocket::External { files: None } => (false, None),
            SdsSocket::External { files: Some((files, file)) } => {
                sockets.push(file);
                // File secrets only: the workload's own come from the other server.
                let id = &self.config.identity;
                let manager = SecretManager::new(
                    WorkloadSource::None,
                    id.rotation,
                    None,
                    id.file_debounce,
                    self.metrics.clone(),
                );
                let poller = manager.clone();
                services.start_infallible("file certificates", move |stop| poller.run(stop));
                let path = std::path::PathBuf::from(crate::sidecar::config::paths::FILES_SOCKET);
                let server = SdsServer::new(manager);
                services.start("SDS server (files)", move |stop| async move {
                    server
                        .serve(files, stop.cancelled_owned())
                        .await
                        .map_err(|source| AgentError::SdsServe { path, source })
                });
                (false, None)
            }
            SdsSocket::NotServed => (false, None),
        };
        if serves_sds || !self.config.envoy_mode.serves_sds() {
            // Issues, rotates and (with OUTPUT_CERTS) writes the workload certificate.
            let secrets = self.secrets.clone();
            services.start_infallible("workload certificate", move |stop| secrets.run(stop));
        }
        if let Some(listener) = sds_listener {
            let (server, path) =
                (SdsServer::new(self.secrets.clone()), self.config.identity.sds_socket.clone());
            services.start("SDS server", move |stop| async move {
                server
                    .serve(listener, stop.cancelled_owned())
                    .await
                    .map_err(|source| AgentError::SdsServe { path, source })
            });
        }
    }

    fn status_server(
        &self,
        readiness: &Arc<Readiness>,
        lifecycle: &LifecycleControl,
        envoy: bool,
    ) -> StatusServer {
        let c = &self.config;
        let merge = MetricsMerge::new(
            self.metrics.clone(),
            (envoy && c.status.merge_envoy_stats)
                .then(|| SocketAddr::from(([127, 0, 0, 1], c.status.prometheus_port))),
            c.status.app_metrics.clone(),
        );
        let probes = AppProber::new(c.status.app_probers.clone(), c.status.probe_destination);
        StatusServer::new(self.dns.clone(), readiness.clone(), lifecycle.clone(), merge, probes)
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
            let started = std::time::Instant::now();
            let (text, data) = render_bootstrap(c).map_err(Box::new)?;
            for (path, content) in &data.files {
                bootstrap::write(path, content).map_err(Box::new)?;
            }
            bootstrap::write(&settings.bootstrap, &text).map_err(Box::new)?;
            tracing::info!(
                path = %settings.bootstrap.display(),
                template = %settings.template.as_deref().map(|t| t.display().to_string()).unwrap_or_else(|| "built-in".into()),
                node = %c.node.id,
                elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
                "Envoy bootstrap written"
            );
        }
        let override_json = match &settings.bootstrap_override {
            Some(path) => Some(bootstrap::override_json(path, c.pod.host_ip.as_deref()).map_err(Box::new)?),
            None => None,
        };
        let run_as = match self.envoy_user() {
            Some((uid, gid)) => {
                if !settings.capabilities.is_empty() {
                    crate::support::privileges::require(settings.capabilities, "Envoy (TPROXY interception)")
                        .map_err(|missing| AgentError::EnvoyCapability {
                            missing,
                            why: "TPROXY interception",
                        })?;
                }
                Some(RunAs { uid, gid, capabilities: settings.capabilities })
            }
            None => None,
        };
        let args = crate::sidecar::envoy::process::args(&settings, override_json.as_deref());
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

/// How long a service (other than Envoy, whose drain policy bounds it) may take to
/// stop before it is aborted.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Runs `task` until `stop` (for services that serve until dropped).
async fn until(stop: CancellationToken, task: impl std::future::Future<Output = ()>) {
    tokio::select! {
        _ = task => {}
        _ = stop.cancelled() => {}
    }
}

/// Everything the services serve on, bound before any of them starts.
struct Bound {
    status: Option<tokio::net::TcpListener>,
    sts: Option<(crate::sidecar::sts::StsServer, tokio::net::TcpListener)>,
    dns: Option<tokio::task::JoinSet<std::io::Result<()>>>,
    embedded: Option<(crate::sidecar::standalone::EmbeddedControlPlane, CancellationToken)>,
    supervisor: Option<Supervisor>,
    xds: (tokio::net::UnixListener, SocketFile),
    sds: SdsSocket,
}

enum SdsSocket {
    /// Proxyless: no SDS server, as pilot-agent.
    NotServed,
    /// Another SDS server (SPIRE) owns the socket; Weir serves file secrets on its own.
    External {
        files: Option<(tokio::net::UnixListener, SocketFile)>,
    },
    Served(tokio::net::UnixListener, SocketFile),
}

/// A socket file the agent made; removed when dropped (on every exit path).
struct SocketFile(std::path::PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The bootstrap Envoy gets from `c` (its text, and the data it was rendered from),
/// written by nobody: `weir config bootstrap` prints it, the agent writes it.
pub fn render_bootstrap(c: &AgentConfig) -> Result<(String, bootstrap::TemplateData), BootstrapError> {
    let null = serde_json::Value::Null;
    let inputs = bootstrap::BootstrapInputs {
        node_id: &c.node.id,
        cluster: &c.node.cluster,
        metadata: &c.node.parts,
        proxy_config: c.node.metadata.get("PROXY_CONFIG").unwrap_or(&null),
        env: c.envoy.bootstrap_env.clone(),
        sts_port: c.args.sts_port,
        outlier_log_path: &c.args.outlier_log_path,
        log_as_json: c.args.log_as_json,
    };
    let data = bootstrap::options::template_data(&inputs)?;
    let text = bootstrap::render(c.envoy.template.as_deref(), &data)?;
    Ok((text, data))
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
