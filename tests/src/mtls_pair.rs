//! Two sidecar pods over mutual TLS, for the SDS tests and the soak: each pod runs
//! `weir proxy sidecar` serving SDS to a real Envoy, certificates issued by the test CA
//! that istiod's stand-in serves beside xDS (over TLS, on 15012). The client Envoy
//! originates mutual TLS with `default` + `ROOTCA`; the server Envoy requires it and
//! checks the client's SPIFFE ID; [`load`] sends real TCP requests across it.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use tokio::io::AsyncBufReadExt as _;
use weir_agent::sidecar::controlplane::{AdsServer, AuthPolicy, Snapshot, resources};
use weir_proto::type_url;

use crate::{
    Mesh, Placement, Pod, PodChild,
    capture::{ask, start_server},
    control_plane::{CLUSTER_ID, ControlPlane, TOKEN, TestCa, eventually},
    envoy::{Envoy, ads_bootstrap, sds_cluster},
    http,
    istiod_ca::IstiodCa,
    sidecar::{AgentProcess, IstiodEnv, PROXY_UID, SidecarRoot},
};

pub const APP_UID: u32 = 1000;
/// The client app's way out: Envoy's plaintext listener in the client pod.
pub const OUTBOUND: &str = "127.0.0.1:18000";
/// The server Envoy's mutual-TLS listener (Istio's inbound port).
pub const INBOUND_PORT: u16 = 15006;
pub const APP: &str = "127.0.0.1:8080";
pub const ADMIN: &str = "127.0.0.1:15000";
pub const CONVERGE: Duration = Duration::from_secs(30);

pub fn spiffe(sa: &str) -> String {
    format!("spiffe://cluster.local/ns/default/sa/{sa}")
}

/// One snapshot for both Envoys (each binds both listeners; only one is used in each
/// pod): outbound → mTLS cluster to the server pod, expecting the server's identity;
/// inbound mTLS listener requiring `client_sa`'s identity → the local app.
pub fn snapshot(server: &Pod, version: &str, client_sa: &str) -> Snapshot {
    snapshot_with(server, version, client_sa, Vec::new())
}

/// Replaces `s` with the same resources under `version` (a push that changes
/// nothing Envoy must rebuild).
pub fn set_version(s: &mut Snapshot, server: &Pod, version: &str) {
    *s = snapshot(server, version, "client");
}

pub fn snapshot_with(
    server: &Pod,
    version: &str,
    client_sa: &str,
    extra: Vec<(&str, prost_types::Any)>,
) -> Snapshot {
    let inbound = SocketAddr::new(server.ipv4().into(), INBOUND_PORT);
    let mut s = Snapshot::new();
    s.set(
        type_url::LISTENER,
        version,
        [
            ("outbound", resources::tcp_proxy_listener("outbound", OUTBOUND.parse().unwrap(), "server-mtls")),
            (
                "inbound",
                resources::mtls_tcp_proxy_listener(
                    "inbound",
                    SocketAddr::from(([0, 0, 0, 0], INBOUND_PORT)),
                    "local-app",
                    &[&spiffe(client_sa)],
                ),
            ),
        ],
    );
    s.set(
        type_url::CLUSTER,
        version,
        [
            (
                "server-mtls",
                resources::mtls_static_cluster(
                    "server-mtls",
                    &[inbound],
                    Duration::from_secs(1),
                    &[&spiffe("server")],
                ),
            ),
            (
                "local-app",
                resources::static_cluster("local-app", &[APP.parse().unwrap()], Duration::from_secs(1)),
            ),
        ]
        .into_iter()
        .chain(extra),
    );
    s
}

pub struct Sidecar {
    pub envoy: Option<Envoy>,
    pub agent: AgentProcess,
    pub root: SidecarRoot,
    pub pod: Pod,
}

impl Sidecar {
    /// Starts the agent (`WEIR_ENVOY_MODE=external`) and Envoy as the proxy user in `pod`.
    pub fn start(pod: Pod, sa: &str, cp: &ControlPlane, istiod_root: &str) -> Self {
        let root = SidecarRoot::new(istiod_root, TOKEN).unwrap();
        let ip = pod.ipv4().to_string();
        let pod_env = IstiodEnv::new(cp.addr, &pod, sa);
        let env = pod_env.with(&[("WEIR_ENVOY_MODE", "external")]);
        let agent = AgentProcess::start(&pod, &root, &env, None).unwrap();
        let node = format!("sidecar~{ip}~{sa}.default~default.svc.cluster.local");
        let mut bootstrap = ads_bootstrap(&root.xds_socket(), false, &node, ADMIN.parse().unwrap());
        bootstrap.push_str(&sds_cluster(&root.sds_socket()));
        let placement = Placement { user: Some((PROXY_UID, PROXY_UID)), ..Placement::default() };
        let envoy = Envoy::start_placed(&pod, &bootstrap, ADMIN.parse().unwrap(), placement)
            .unwrap_or_else(|e| panic!("{e:#}\nagent log:\n{}", agent.log()));
        Self { envoy: Some(envoy), agent, root, pod }
    }

    pub fn envoy(&self) -> &Envoy {
        self.envoy.as_ref().expect("Envoy running")
    }

    /// Serial numbers of the workload certificates Envoy holds now (admin `/certs`;
    /// sorted, each once: every TLS context lists the one it uses).
    pub fn serials(&self) -> Vec<String> {
        let body = self.envoy().admin_get(&self.pod, "/certs").unwrap();
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        json["certificates"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|c| c["cert_chain"].as_array().cloned().unwrap_or_default())
            .filter(|c| c["subject_alt_names"].to_string().contains("spiffe://"))
            .filter_map(|c| c["serial_number"].as_str().map(str::to_string))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    /// The one SPIFFE leaf serial Envoy uses, once it holds exactly one.
    pub fn serial(&self) -> String {
        let mut s = self.serials();
        assert_eq!(s.len(), 1, "one workload certificate in /certs: {s:?}");
        s.remove(0)
    }

    pub fn metrics(&self) -> String {
        let (status, body) = self
            .pod
            .run(|| async { http::get("127.0.0.1:15020".parse().unwrap(), "/stats/prometheus").await })
            .unwrap()
            .unwrap();
        assert_eq!(status, 200);
        body
    }

    pub fn issued(&self) -> usize {
        self.agent.log().matches("generated new workload certificate").count()
    }

    pub fn logs(&self) -> String {
        format!("agent log:\n{}\nEnvoy log:\n{}", self.agent.log(), self.envoy().log())
    }
}

/// Sum of every sample of `name` (any labels) in Prometheus text.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.starts_with(name) && (l[name.len()..].starts_with('{') || l[name.len()..].starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Fields drop in order: sidecars (Envoy, agent), app server, control plane, pods.
pub struct Rig {
    pub client: Sidecar,
    pub server: Sidecar,
    pub app: PodChild,
    pub cp: ControlPlane,
    pub ca: IstiodCa,
    pub istiod: Pod,
    pub mesh: Mesh,
}

impl Rig {
    /// `lifetime`: every workload certificate lives this long.
    pub fn new(test: &str, lifetime: Option<Duration>) -> Self {
        let mesh = Mesh::new(test).unwrap();
        let istiod = mesh.pod("istiod").unwrap();
        let client_pod = mesh.pod("client").unwrap();
        let server_pod = mesh.pod("server").unwrap();
        let app = start_server(&server_pod, APP_UID, &["serve-hello", APP, "v1"]);
        let tls_ca = TestCa::new("istiod serving CA").unwrap();
        let ca = IstiodCa::new("mesh workload CA", Some(TOKEN)).unwrap();
        ca.force_lifetime(lifetime);
        let ads = AdsServer::new(
            snapshot(&server_pod, "1", "client"),
            AuthPolicy { token: Some(TOKEN.into()), cluster_id: Some(CLUSTER_ID.into()) },
        );
        let cp = ControlPlane::istiod(&istiod, &tls_ca, ads).unwrap().with_ca(ca.clone()).unwrap();
        let server = Sidecar::start(server_pod, "server", &cp, tls_ca.root_pem());
        let client = Sidecar::start(client_pod, "client", &cp, tls_ca.root_pem());
        Self { client, server, app, cp, ca, istiod, mesh }
    }

    pub fn call(&self) -> String {
        ask(&self.client.pod, APP_UID, OUTBOUND.parse().unwrap())
    }

    pub fn expect_calls_pass(&self) {
        let mut last = String::new();
        if eventually(CONVERGE, || {
            last = self.call();
            last.starts_with("hello v1 ").then_some(())
        })
        .is_none()
        {
            panic!(
                "no call passed (last: {last:?})\nCLIENT {}\nSERVER {}",
                self.client.logs(),
                self.server.logs()
            );
        }
    }

    pub fn logs(&self) -> String {
        format!("CLIENT {}\nSERVER {}", self.client.logs(), self.server.logs())
    }
}

/// Load from the client pod: `workers` connections at a time through Envoy for
/// `duration`, each reading the app's greeting. Returns (passed, failures).
pub fn load(pod: &Pod, workers: usize, duration: Duration) -> std::thread::JoinHandle<(u64, Vec<String>)> {
    let netns = weir_agent::sandbox::NetNs::open(pod.netns().path()).unwrap();
    netns
        .spawn_thread(move || async move {
            let deadline = Instant::now() + duration;
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..workers {
                tasks.spawn(async move {
                    let (mut ok, mut failed) = (0u64, Vec::new());
                    while Instant::now() < deadline {
                        let attempt = async {
                            let s = tokio::net::TcpStream::connect(OUTBOUND).await?;
                            let mut line = String::new();
                            tokio::io::BufReader::new(s).read_line(&mut line).await?;
                            Ok::<_, std::io::Error>(line)
                        };
                        match tokio::time::timeout(Duration::from_secs(5), attempt).await {
                            Ok(Ok(line)) if line.starts_with("hello v1 ") => ok += 1,
                            Ok(Ok(line)) => failed.push(format!("unexpected answer {line:?}")),
                            Ok(Err(e)) => failed.push(e.to_string()),
                            Err(_) => failed.push("no answer in 5s".into()),
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    (ok, failed)
                });
            }
            let (mut ok, mut failed) = (0, Vec::new());
            while let Some(Ok((o, f))) = tasks.join_next().await {
                ok += o;
                failed.extend(f);
            }
            (ok, failed)
        })
        .unwrap()
}
