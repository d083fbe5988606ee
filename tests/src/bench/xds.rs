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
use weir_agent::sidecar::controlplane::{AdsServer, AuthPolicy, Snapshot, resources};
use weir_proto::type_url;
use weir_tests::{
    Mesh, Placement, Pod,
    capture::start_server,
    control_plane::{CLUSTER_ID, ControlPlane, ISTIOD_SAN, TOKEN, TestCa, filler_clusters},
    envoy::{Envoy, XdsTarget, ads_bootstrap_to},
    sidecar::{AgentProcess, IstiodEnv, PROXY_UID, SidecarRoot, peak_rss_kib},
};

use crate::report::{Options, Row, Samples, Table};

/// Small pushes per run: enough that a run's median moves less between runs than the
/// relay's goal (+100 µs); 200 gave ±40 % round to round.
const SMALL_PUSHES: usize = 1000;
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
    /// The agent's figures, for relay runs.
    agent: Option<AgentFigures>,
}

/// What the agent spent: over the small pushes (per push) and over the big one.
#[derive(Clone, Copy)]
struct AgentFigures {
    cpu_us_per_push: f64,
    switches_per_push: f64,
    big_cpu_ms: f64,
    peak_rss_mib: f64,
}

impl AgentFigures {
    const FAILED: Self = Self {
        cpu_us_per_push: f64::NAN,
        switches_per_push: f64::NAN,
        big_cpu_ms: f64::NAN,
        peak_rss_mib: f64::NAN,
    };
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

/// Applies `change`, then waits (on `waiter`, made once per run: a runtime made per
/// push would be timed with it) for one more ACK of `type_url`; the elapsed time.
fn push_and_wait(
    waiter: &tokio::runtime::Runtime,
    cp: &ControlPlane,
    type_url: &str,
    change: impl FnOnce(&mut Snapshot),
) -> anyhow::Result<f64> {
    let before = acks(cp, type_url);
    let start = Instant::now();
    cp.update(change);
    waiter
        .block_on(cp.log.wait_for(ACK_TIMEOUT, |reqs, _| {
            (reqs.iter().filter(|r| r.type_url == type_url && r.is_ack()).count() > before).then_some(())
        }))
        .with_context(|| format!("no ACK of {type_url} within {ACK_TIMEOUT:?}"))?;
    Ok(start.elapsed().as_secs_f64() * 1000.0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Waits until the agent has done its start-up work: it makes the workload key at
/// start (RSA 2048, Istio's default, 0.2–3 s of one CPU), and on two CPUs that would
/// fall on the timed pushes of some runs and not others. Settled: under 2 ms of CPU in
/// each of three 100 ms windows running (at most 30 s).
fn settle(pid: u32) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut quiet = 0;
    let mut last = usage(pid)?.cpu_ns;
    while quiet < 3 {
        if Instant::now() > deadline {
            bail!("the agent kept using CPU for 30 s after Envoy started");
        }
        std::thread::sleep(Duration::from_millis(100));
        let now = usage(pid)?.cpu_ns;
        quiet = if now - last < 2e6 { quiet + 1 } else { 0 };
        last = now;
    }
    Ok(())
}

/// A process's CPU time so far (ns, every live thread's `schedstat`: nanoseconds, not
/// the 10 ms ticks of `stat`) and how often its threads gave up the CPU (voluntary and
/// involuntary context switches: each wait for a message is one).
#[derive(Clone, Copy)]
struct Usage {
    cpu_ns: f64,
    switches: f64,
}

fn usage(pid: u32) -> anyhow::Result<Usage> {
    let mut total = Usage { cpu_ns: 0.0, switches: 0.0 };
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let dir = task?.path();
        // A thread may end between the listing and the read.
        let (Ok(schedstat), Ok(status)) =
            (std::fs::read_to_string(dir.join("schedstat")), std::fs::read_to_string(dir.join("status")))
        else {
            continue;
        };
        total.cpu_ns += schedstat.split_whitespace().next().context("schedstat")?.parse::<f64>()?;
        for line in status.lines() {
            if let Some(n) = line
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                total.switches += n.trim().parse::<f64>()?;
            }
        }
    }
    Ok(total)
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
    let pid = agent.as_ref().map(|a| a.child.pid());
    if let Some(pid) = pid {
        settle(pid)?;
    }
    let before = pid.map(usage).transpose()?;

    let waiter = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    let mut small = Vec::with_capacity(SMALL_PUSHES);
    for i in 0..SMALL_PUSHES {
        // A new port each time: Delta sends only resources whose content changed.
        let port = 10_000 + i as u16;
        small.push(push_and_wait(
            &waiter,
            &cp,
            type_url::ENDPOINT,
            endpoints(&server, &format!("p{i}"), port),
        )?);
    }
    let after_small = pid.map(usage).transpose()?;
    small.sort_by(f64::total_cmp);
    let filler = SocketAddr::new(server.ipv4().into(), 9);
    let big_ms = push_and_wait(&waiter, &cp, type_url::CLUSTER, move |s| {
        s.set(type_url::CLUSTER, "big", filler_clusters(BIG, filler));
    })?;
    let clusters = envoy.admin_get(&app, "/clusters")?;
    if !clusters.contains(&format!("filler-{:05}::", BIG - 1)) {
        bail!("Envoy ACKed but does not list the 10 000 clusters");
    }
    let agent_figures = match (pid, before, after_small) {
        (Some(pid), Some(before), Some(small_done)) => {
            let done = usage(pid)?;
            Some(AgentFigures {
                cpu_us_per_push: (small_done.cpu_ns - before.cpu_ns) / 1000.0 / SMALL_PUSHES as f64,
                switches_per_push: (small_done.switches - before.switches) / SMALL_PUSHES as f64,
                big_cpu_ms: (done.cpu_ns - small_done.cpu_ns) / 1e6,
                peak_rss_mib: peak_rss_kib(pid)? as f64 / 1024.0,
            })
        }
        _ => None,
    };
    drop(envoy);
    Ok(RunResult {
        p50_ms: percentile(&small, 0.5),
        p99_ms: percentile(&small, 0.99),
        big_ms,
        agent: agent_figures,
    })
}

/// One path's figures over the runs, in `COLUMNS` order.
#[derive(Default)]
struct Figures([Samples; 7]);

impl Figures {
    fn push(&mut self, r: anyhow::Result<RunResult>, path: Path) {
        let r = r.unwrap_or_else(|e| {
            eprintln!("[bench xds] {} failed: {e:#}", path.name());
            RunResult {
                p50_ms: f64::NAN,
                p99_ms: f64::NAN,
                big_ms: f64::NAN,
                agent: Some(AgentFigures::FAILED),
            }
        });
        let [p50, p99, big, cpu, switches, big_cpu, rss] = &mut self.0;
        p50.0.push(r.p50_ms);
        p99.0.push(r.p99_ms);
        big.0.push(r.big_ms);
        if !matches!(path, Path::Direct) {
            let a = r.agent.unwrap_or(AgentFigures::FAILED);
            cpu.0.push(a.cpu_us_per_push);
            switches.0.push(a.switches_per_push);
            big_cpu.0.push(a.big_cpu_ms);
            rss.0.push(a.peak_rss_mib);
        }
    }
}

const COLUMNS: [(&str, &str, bool); 9] = [
    ("push→ACK p50", "ms", false),
    ("push→ACK p50 over direct, same round", "µs", false),
    ("push→ACK p99", "ms", false),
    ("10 000 clusters→ACK", "ms", false),
    ("10 000 clusters→ACK ÷ direct, same round", "×", false),
    ("agent CPU per small push", "µs", false),
    ("agent context switches per small push", "switches", false),
    ("agent CPU, 10 000 clusters", "ms", false),
    ("agent peak RSS", "MiB", false),
];

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    let paths = [Path::Direct, Path::Relay { delta: false }, Path::Relay { delta: true }];
    let mut figures: Vec<Figures> = paths.iter().map(|_| Figures::default()).collect();
    // Run by run, every path in turn, so load from elsewhere falls on all of them.
    for run in 0..opts.runs {
        for (path, figures) in paths.iter().zip(figures.iter_mut()) {
            eprintln!("[bench xds] {} run {}/{}", path.name(), run + 1, opts.runs);
            figures.push(run_once(*path), *path);
        }
    }
    // The relay's added time and its 10 000-cluster ratio, paired round by round with
    // the floor measured in the same round: the machine's drift between rounds falls on
    // both sides of each difference.
    let direct_p50 = figures[0].0[0].0.clone();
    let direct_big = figures[0].0[2].0.clone();
    let paired = |relay: &Samples, direct: &[f64], pair: fn(f64, f64) -> f64| {
        Samples(relay.0.iter().zip(direct).map(|(r, d)| pair(*r, *d)).collect())
    };
    let rows = paths
        .iter()
        .zip(figures)
        .map(|(path, f)| {
            let (added, big_ratio) = match path {
                Path::Direct => (Samples::default(), Samples::default()),
                Path::Relay { .. } => (
                    paired(&f.0[0], &direct_p50, |relay, direct| (relay - direct) * 1000.0),
                    paired(&f.0[2], &direct_big, |relay, direct| relay / direct),
                ),
            };
            let mut metrics: Vec<Samples> = f.0.into();
            metrics.insert(1, added);
            metrics.insert(4, big_ratio);
            Row { name: path.name().into(), metrics }
        })
        .collect();
    let notes = vec![format!(
        "{SMALL_PUSHES} endpoint pushes per run, each sent after the previous ACK; then one {BIG}-cluster CDS push. \
         Timed once the agent has settled after its start-up work (its workload key, RSA 2048). \
         \"Over direct, same round\": the relay's p50 less the floor's p50 of the same round, a median of those \
         differences; \"÷ direct, same round\": the relay's 10 000-cluster time over the floor's of the same \
         round, a median of those ratios. \
         Control plane: Weir's test ADS server over TLS (token + ClusterID checked). The agent's figures are \
         `weir proxy sidecar`'s, from its threads' schedstat (CPU time in ns) and context switches (each wait for \
         a message is one: a relay that hands a message between more threads shows more per push, and on an idle \
         machine each hand-off is a wake-up), over the small pushes and over the big one; peak RSS is its VmHWM. \
         Runs take turns path by path. {}",
        opts.summary()
    )];
    let table = Table {
        title: "xDS relay: push → ACK with a real Envoy".into(),
        columns: COLUMNS.to_vec(),
        rows,
        notes,
    };
    Ok(vec![table])
}
