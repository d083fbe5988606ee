//! The xDS relay benchmark: push → ACK latency with a real Envoy, through
//! `weir proxy sidecar` (SotW and Delta) against the floor, the same Envoy talking
//! TLS straight to the same control plane (Weir's test ADS server in an "istiod"
//! pod). Small pushes are one endpoint update each, sent after the previous ACK; the
//! large push is a 10 000-cluster snapshot. The agent's CPU time and peak RSS over the
//! run are reported for each relay row.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use weir_agent::controlplane::{AdsServer, AuthPolicy, Snapshot, resources};
use weir_proto::type_url;
use weir_tests::{
    Mesh, Placement, Pod,
    capture::start_server,
    control_plane::{CLUSTER_ID, ControlPlane, ISTIOD_SAN, TOKEN, TestCa, filler_clusters},
    envoy::{Envoy, XdsTarget, ads_bootstrap_to},
    sidecar::{AgentProcess, IstiodEnv, PROXY_UID, SidecarRoot, peak_rss_kib},
};

use crate::report::{Options, Row, Samples, Table};

const SMALL_PUSHES: usize = 200;
const BIG: usize = 10_000;
const ADMIN: &str = "127.0.0.1:15000";
const ACK_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Clone, Copy)]
enum Path {
    Direct,
    Relay { delta: bool },
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Direct => "Envoy → control plane directly (floor)",
            Path::Relay { delta: false } => "Envoy → Weir relay → control plane (SotW)",
            Path::Relay { delta: true } => "Envoy → Weir relay → control plane (Delta)",
        }
    }
}

struct RunResult {
    p50_ms: f64,
    p99_ms: f64,
    big_ms: f64,
    /// (CPU ms, peak RSS MiB) of the agent, for relay runs.
    agent: Option<(f64, f64)>,
}

fn endpoints(server: &Pod, version: &str, port: u16) -> impl FnOnce(&mut Snapshot) {
    let endpoint = SocketAddr::new(server.ipv4().into(), port);
    let version = version.to_string();
    move |s: &mut Snapshot| {
        s.set(type_url::ENDPOINT, version, [("hello", resources::load_assignment("hello", &[endpoint]))]);
    }
}

fn acks(cp: &ControlPlane, type_url: &str) -> usize {
    cp.log.requests().iter().filter(|r| r.type_url == type_url && r.is_ack()).count()
}

/// Applies `change`, then waits for one more ACK of `type_url`; the elapsed time.
fn push_and_wait(
    cp: &ControlPlane,
    type_url: &str,
    change: impl FnOnce(&mut Snapshot),
) -> anyhow::Result<f64> {
    let before = acks(cp, type_url);
    let start = Instant::now();
    cp.update(change);
    cp.wait_for(ACK_TIMEOUT, |reqs, _| {
        (reqs.iter().filter(|r| r.type_url == type_url && r.is_ack()).count() > before).then_some(())
    })
    .with_context(|| format!("no ACK of {type_url} within {ACK_TIMEOUT:?}"))?;
    Ok(start.elapsed().as_secs_f64() * 1000.0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// CPU time (user + system) of `pid` in ms, and its peak RSS in MiB.
fn cpu_and_peak(pid: u32) -> anyhow::Result<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> = stat.rsplit_once(") ").context("stat")?.1.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.unwrap_or(100) as f64;
    let hwm_kib = peak_rss_kib(pid)? as f64;
    Ok((ticks * 1000.0 / hz, hwm_kib / 1024.0))
}

fn run_once(path: Path) -> anyhow::Result<RunResult> {
    let mesh = Mesh::new("bench-xds")?;
    let istiod = mesh.pod("istiod")?;
    let server = mesh.pod("server")?;
    let app = mesh.pod("app")?;
    let _hello = start_server(&server, 1000, &["serve-hello", "0.0.0.0:8080", "v1"]);
    let ca = TestCa::new("bench CA")?;
    let mut snapshot = Snapshot::new();
    snapshot.set(
        type_url::LISTENER,
        "1",
        [("outbound", resources::tcp_proxy_listener("outbound", "127.0.0.1:18000".parse()?, "hello"))],
    );
    snapshot.set(
        type_url::CLUSTER,
        "1",
        [("hello", resources::eds_cluster("hello", Duration::from_secs(1)))],
    );
    endpoints(&server, "0", 8080)(&mut snapshot);
    let ads = AdsServer::new(
        snapshot,
        AuthPolicy { token: Some(TOKEN.into()), cluster_id: Some(CLUSTER_ID.into()) },
    );
    let cp = ControlPlane::istiod(&istiod, &ca, ads)?;
    let root = SidecarRoot::new(ca.root_pem(), TOKEN)?;
    let ca_file = root.path().join("var/run/secrets/istio/root-cert.pem");
    let ip = app.ipv4().to_string();
    let node = format!("sidecar~{ip}~app.default~default.svc.cluster.local");
    let socket = root.xds_socket();
    let (agent, target, delta) = match path {
        Path::Direct => (
            None,
            XdsTarget::Direct {
                address: cp.addr,
                ca_file: &ca_file,
                sni: ISTIOD_SAN,
                token: TOKEN,
                cluster_id: CLUSTER_ID,
            },
            false,
        ),
        Path::Relay { delta } => {
            let pod_env = IstiodEnv::new(cp.addr, &app, "app");
            let env = pod_env.with(&[("WEIR_ENVOY_MODE", "external"), ("WEIR_LOG", "warn")]);
            let agent = AgentProcess::start(&app, &root, &env, None)?;
            (Some(agent), XdsTarget::Uds(&socket), delta)
        }
    };
    let mut bootstrap = ads_bootstrap_to(&target, delta, &node, ADMIN.parse()?);
    bootstrap.push_str("stats_config: { stats_matcher: { reject_all: true } }\n");
    let placement = Placement { user: Some((PROXY_UID, PROXY_UID)), ..Placement::default() };
    let envoy = Envoy::start_placed(&app, &bootstrap, ADMIN.parse()?, placement)?;
    let start_usage = match &agent {
        Some(a) => Some(cpu_and_peak(a.child.pid())?),
        None => None,
    };

    let mut small = Vec::with_capacity(SMALL_PUSHES);
    for i in 0..SMALL_PUSHES {
        // A new port each time: Delta sends only resources whose content changed.
        let port = 10_000 + i as u16;
        small.push(push_and_wait(&cp, type_url::ENDPOINT, endpoints(&server, &format!("p{i}"), port))?);
    }
    small.sort_by(f64::total_cmp);
    let filler = SocketAddr::new(server.ipv4().into(), 9);
    let big_ms = push_and_wait(&cp, type_url::CLUSTER, move |s| {
        s.set(type_url::CLUSTER, "big", filler_clusters(BIG, filler));
    })?;
    let clusters = envoy.admin_get(&app, "/clusters")?;
    if !clusters.contains(&format!("filler-{:05}::", BIG - 1)) {
        bail!("Envoy ACKed but does not list the 10 000 clusters");
    }
    let agent_usage = match (&agent, start_usage) {
        (Some(a), Some((cpu0, _))) => {
            let (cpu1, peak) = cpu_and_peak(a.child.pid())?;
            Some((cpu1 - cpu0, peak))
        }
        _ => None,
    };
    drop(envoy);
    Ok(RunResult {
        p50_ms: percentile(&small, 0.5),
        p99_ms: percentile(&small, 0.99),
        big_ms,
        agent: agent_usage,
    })
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    let paths = [Path::Direct, Path::Relay { delta: false }, Path::Relay { delta: true }];
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for path in paths {
        let (mut p50, mut p99, mut big, mut cpu, mut rss) = (
            Samples::default(),
            Samples::default(),
            Samples::default(),
            Samples::default(),
            Samples::default(),
        );
        for run in 0..opts.runs {
            eprintln!("[bench xds] {} run {}/{}", path.name(), run + 1, opts.runs);
            match run_once(path) {
                Ok(r) => {
                    p50.0.push(r.p50_ms);
                    p99.0.push(r.p99_ms);
                    big.0.push(r.big_ms);
                    if let Some((c, m)) = r.agent {
                        cpu.0.push(c);
                        rss.0.push(m);
                    }
                }
                Err(e) => {
                    eprintln!("[bench xds] {} failed: {e:#}", path.name());
                    for s in [&mut p50, &mut p99, &mut big] {
                        s.0.push(f64::NAN);
                    }
                }
            }
        }
        if !cpu.0.is_empty() {
            notes.push(format!(
                "{}: agent CPU over the run (200 pushes + 10 000 clusters) {:.0} ms [{:.0}–{:.0}], peak RSS {:.1} MiB [{:.1}–{:.1}]",
                path.name(),
                cpu.median(),
                cpu.min(),
                cpu.max(),
                rss.median(),
                rss.min(),
                rss.max()
            ));
        }
        rows.push(Row { name: path.name().into(), metrics: vec![p50, p99, big] });
    }
    notes.push(format!(
        "{SMALL_PUSHES} endpoint pushes per run, each sent after the previous ACK; then one {BIG}-cluster CDS push. \
         Control plane: Weir's test ADS server over TLS (token + ClusterID checked). Median [min–max] of {} runs.",
        opts.runs
    ));
    let table = Table {
        title: "xDS relay: push → ACK with a real Envoy".into(),
        columns: vec![
            ("push→ACK p50", "ms", false),
            ("push→ACK p99", "ms", false),
            ("10 000 clusters→ACK", "ms", false),
        ],
        rows,
        notes,
    };
    Ok(vec![table])
}
