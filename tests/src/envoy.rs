//! The real Envoy for tests: found once where scripts/bootstrap put it, started inside
//! a pod as the proxy user, waited on until its admin endpoint says LIVE, killed on drop.

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{Pod, PodChild, http};

/// Where to find Envoy: `$WEIR_ENVOY`, else `<workspace>/.tools/bin/envoy`.
pub fn binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("WEIR_ENVOY") {
        return Ok(PathBuf::from(path));
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/bin/envoy");
    if !path.is_file() {
        bail!("Envoy not found at {}: run scripts/bootstrap (or set WEIR_ENVOY)", path.display());
    }
    Ok(path.canonicalize()?)
}

/// Envoy's path for a child that starts Envoy itself (`binaryPath` for an agent that
/// runs as 1337): reachable whatever the directories above the checkout allow.
pub fn binary_for_children() -> anyhow::Result<PathBuf> {
    Ok(crate::tools::for_children(&binary()?))
}

/// A running Envoy in a pod.
pub struct Envoy {
    pub admin: SocketAddr,
    pub child: PodChild,
    /// Holds the config file (and log) for as long as Envoy runs.
    pub dir: tempfile_dir::Dir,
}

/// Tiny self-cleaning directory, world-readable so the proxy uid can read its config.
pub mod tempfile_dir {
    use std::path::{Path, PathBuf};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new(tag: &str) -> std::io::Result<Self> {
            let path = std::env::temp_dir().join(weir_agent::sandbox::unique_name(tag));
            std::fs::create_dir_all(&path)?;
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
            Ok(Self(path))
        }
        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Envoy {
    /// Starts Envoy in `pod` as `uid` with the YAML bootstrap `config`, whose admin
    /// listener must be `admin`; returns once `/ready` answers LIVE (30 s at most).
    pub fn start(pod: &Pod, config: &str, admin: SocketAddr, uid: u32) -> anyhow::Result<Self> {
        Self::start_placed(
            pod,
            config,
            admin,
            crate::Placement { user: Some((uid, uid)), ..Default::default() },
        )
    }

    /// As [`Envoy::start`], with a cgroup (eBPF capture) and user from `placement`.
    pub fn start_placed(
        pod: &Pod,
        config: &str,
        admin: SocketAddr,
        placement: crate::Placement<'_>,
    ) -> anyhow::Result<Self> {
        Self::launch(pod, config, admin, placement, true)
    }

    /// As [`Envoy::start_placed`], but returns once the admin endpoint answers at all:
    /// for an Envoy that is expected to stay in initialization (no config yet).
    pub fn start_uninitialized(
        pod: &Pod,
        config: &str,
        admin: SocketAddr,
        placement: crate::Placement<'_>,
    ) -> anyhow::Result<Self> {
        Self::launch(pod, config, admin, placement, false)
    }

    fn launch(
        pod: &Pod,
        config: &str,
        admin: SocketAddr,
        placement: crate::Placement<'_>,
        live: bool,
    ) -> anyhow::Result<Self> {
        let dir = tempfile_dir::Dir::new("envoy")?;
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, config)?;
        let log = std::fs::File::create(dir.path().join("envoy.log"))?;
        let envoy = weir_agent::support::executable::Executable::open(binary()?)?;
        let mut cmd = envoy.command();
        cmd.arg("-c")
            .arg(&config_path)
            .args(["--disable-hot-restart", "--log-level", "warning", "--concurrency", "1"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = pod.spawn_placed(&mut cmd, placement)?;
        let mut envoy = Self { admin, child, dir };
        envoy.wait_live(Duration::from_secs(30), pod, live)?;
        Ok(envoy)
    }

    fn wait_live(&mut self, timeout: Duration, pod: &Pod, live: bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.child_mut().try_wait()? {
                bail!("Envoy exited with {status} during start; log:\n{}", self.log());
            }
            let admin = self.admin;
            let ready = pod.run(|| async move { http::get(admin, "/ready").await })?;
            if matches!(&ready, Ok((200, body)) if body.trim() == "LIVE") || (!live && ready.is_ok()) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("Envoy not LIVE after {timeout:?} (last: {ready:?}); log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Envoy's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }

    /// GET on the admin endpoint (from inside `pod`); returns the body on 200.
    pub fn admin_get(&self, pod: &Pod, path: &str) -> anyhow::Result<String> {
        let admin = self.admin;
        let (status, body) = pod.run(|| async move { http::get(admin, path).await })??;
        if status != 200 {
            bail!("GET {path} on Envoy admin: HTTP {status}: {body}");
        }
        Ok(body)
    }

    /// The value of one counter or gauge from `/stats`, if Envoy has it.
    pub fn stat(&self, pod: &Pod, name: &str) -> anyhow::Result<Option<u64>> {
        let body = self.admin_get(pod, &format!("/stats?filter=^{}$", regex_escape(name)))?;
        Ok(body.lines().find_map(|l| {
            let (k, v) = l.split_once(": ")?;
            (k == name).then(|| v.trim().parse().ok()).flatten()
        }))
    }
}

fn regex_escape(s: &str) -> String {
    s.chars().flat_map(|c| if ".[]()*+?^$|\\".contains(c) { vec!['\\', c] } else { vec![c] }).collect()
}

impl std::fmt::Debug for Envoy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Envoy").field("admin", &self.admin).field("pid", &self.child.pid()).finish()
    }
}

/// Checks Envoy's version line, so a broken install fails with a readable message.
pub fn version() -> anyhow::Result<String> {
    let out = Command::new(binary()?).arg("--version").output().context("run envoy --version")?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Where an ADS bootstrap points Envoy.
pub enum XdsTarget<'a> {
    /// The agent's XDS socket (the sidecar setup).
    Uds(&'a std::path::Path),
    /// A control plane directly, over TLS with istiod's credentials (the floor the relay
    /// is measured against).
    Direct {
        address: SocketAddr,
        ca_file: &'a std::path::Path,
        sni: &'a str,
        token: &'a str,
        cluster_id: &'a str,
    },
}

/// Istio's `sds-grpc` bootstrap cluster (HTTP/2 over a pipe to the agent's SDS
/// socket), as a `static_resources.clusters` entry to append to a bootstrap from
/// [`ads_bootstrap`].
pub fn sds_cluster(socket: &std::path::Path) -> String {
    grpc_cluster("sds-grpc", &format!("pipe: {{ path: \"{}\" }}", socket.display()))
}

/// A static HTTP/2 (gRPC) cluster with one endpoint at `address` (YAML of an
/// `Address`), as a `static_resources.clusters` entry.
fn grpc_cluster(name: &str, address: &str) -> String {
    format!(
        r#"  - name: {name}
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: {name}
      endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ {address} }} }} }}] }}]
"#
    )
}

/// A bootstrap that takes all of Envoy's config over ADS from the agent's XDS socket,
/// as Istio's does (`xds-grpc` cluster over a pipe, HTTP/2), SotW (`GRPC`) or Delta.
pub fn ads_bootstrap(xds_socket: &std::path::Path, delta: bool, node_id: &str, admin: SocketAddr) -> String {
    ads_bootstrap_to(&XdsTarget::Uds(xds_socket), delta, node_id, admin)
}

/// As [`ads_bootstrap`], to any [`XdsTarget`].
pub fn ads_bootstrap_to(target: &XdsTarget<'_>, delta: bool, node_id: &str, admin: SocketAddr) -> String {
    let api_type = if delta { "DELTA_GRPC" } else { "GRPC" };
    let (metadata, address, transport) = match target {
        XdsTarget::Uds(path) => {
            (String::new(), format!("pipe: {{ path: \"{}\" }}", path.display()), String::new())
        }
        XdsTarget::Direct { address, ca_file, sni, token, cluster_id } => (
            format!(
                ", initial_metadata: [{{ key: authorization, value: \"Bearer {token}\" }}, {{ key: clusterid, value: \"{cluster_id}\" }}]"
            ),
            format!("socket_address: {{ address: \"{}\", port_value: {} }}", address.ip(), address.port()),
            format!(
                r#"    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: "{sni}"
        common_tls_context:
          alpn_protocols: [h2]
          validation_context:
            trusted_ca: {{ filename: "{ca}" }}
            match_typed_subject_alt_names: [{{ san_type: DNS, matcher: {{ exact: "{sni}" }} }}]
"#,
                ca = ca_file.display()
            ),
        ),
    };
    format!(
        r#"node: {{ id: "{node_id}", cluster: "app.default" }}
admin:
  address: {{ socket_address: {{ address: "{admin_ip}", port_value: {admin_port} }} }}
dynamic_resources:
  ads_config:
    api_type: {api_type}
    transport_api_version: V3
    set_node_on_first_message_only: true
    grpc_services: [{{ envoy_grpc: {{ cluster_name: xds-grpc }}{metadata} }}]
  lds_config: {{ ads: {{}}, resource_api_version: V3 }}
  cds_config: {{ ads: {{}}, resource_api_version: V3 }}
static_resources:
  clusters:
{xds_cluster}{transport}"#,
        xds_cluster = grpc_cluster("xds-grpc", &address),
        admin_ip = admin.ip(),
        admin_port = admin.port(),
    )
}

/// A sidecar's outbound path reduced to its core: the 15001 listener restores the
/// original destination (`original_dst`) and tcp_proxies to it (`PassthroughCluster`);
/// admin on 127.0.0.1:15000.
pub const OUTBOUND_PASSTHROUGH: &str = r#"
admin:
  address: { socket_address: { address: 127.0.0.1, port_value: 15000 } }
static_resources:
  listeners:
  - name: virtualOutbound
    address: { socket_address: { address: 0.0.0.0, port_value: 15001 } }
    listener_filters:
    - name: envoy.filters.listener.original_dst
      typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst }
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: outbound
          cluster: PassthroughCluster
  clusters:
  - name: PassthroughCluster
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
"#;
