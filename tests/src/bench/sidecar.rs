//! `weir-bench sidecar`: what `weir proxy sidecar` costs beside the Envoy it runs.
//! Start → ready: the agent started as the injector starts it until its
//! `/healthz/ready` answers 200, against the floor of the same Envoy started by hand
//! with ADS straight to the control plane until it reports LIVE. Footprint: the agent's
//! and its Envoy's resident memory and CPU, idle and under a steady 1 000 requests/s
//! through Envoy (HTTP/1.1 keep-alive, 4 connections, paced), Envoy being the floor;
//! the agent's idle RSS by part (binary text and data, libraries, heap, stacks), every
//! feature on (relay, SDS, status server, DNS proxy, metrics).

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
    control_plane::{CLUSTER_ID, ControlPlane, ISTIOD_SAN, TOKEN, TestCa},
    envoy::{self, Envoy, XdsTarget, ads_bootstrap_to},
    http,
    istiod_ca::IstiodCa,
    sidecar::{AgentProcess, PROXY_UID, SidecarRoot},
};

use crate::{
    report::{Options, Row, Samples, Table},
    smaps,
};

const OUTBOUND: &str = "127.0.0.1:18000";
const RATE: u64 = 1000;
const CONNECTIONS: u64 = 4;
const WINDOW: Duration = Duration::from_secs(5);

fn snapshot(upstream: &Pod) -> Snapshot {
    let mut s = Snapshot::new();
    s.set(
        type_url::LISTENER,
        "1",
        [("outbound", resources::tcp_proxy_listener("outbound", OUTBOUND.parse().unwrap(), "upstream"))],
    );
    let app = SocketAddr::new(upstream.ipv4().into(), 8080);
    s.set(
        type_url::CLUSTER,
        "1",
        [("upstream", resources::static_cluster("upstream", &[app], Duration::from_secs(1)))],
    );
    // The DNS proxy is on: istiod sends the name table (NDS) with the rest.
    use weir_proto::istio::networking::nds::v1::{NameTable, name_table::NameInfo};
    let mut table = NameTable::default();
    table.table.insert(
        "upstream.default.svc.cluster.local".into(),
        NameInfo {
            ips: vec![upstream.ipv4().to_string()],
            registry: "Kubernetes".into(),
            shortname: "upstream".into(),
            namespace: "default".into(),
            ..Default::default()
        },
    );
    s.set(type_url::NAME_TABLE, "1", [("", weir_proto::to_any(type_url::NAME_TABLE, &table))]);
    s
}

/// A pod, its upstream app and the istiod stand-in.
struct Stage {
    app: Pod,
    cp: ControlPlane,
    ca: TestCa,
    _upstream_app: weir_tests::PodChild,
    _upstream: Pod,
    _istiod: Pod,
    _mesh: Mesh,
}

fn stage() -> anyhow::Result<Stage> {
    let mesh = Mesh::new("bench-sidecar")?;
    let istiod = mesh.pod("istiod")?;
    let app = mesh.pod("app")?;
    let upstream = mesh.pod("upstream")?;
    let upstream_app = start_server(&upstream, 1000, &["serve-http", "0.0.0.0:8080"]);
    let ca = TestCa::new("bench istiod CA")?;
    let ads = AdsServer::new(
        snapshot(&upstream),
        AuthPolicy { token: Some(TOKEN.into()), cluster_id: Some(CLUSTER_ID.into()) },
    );
    let cp =
        ControlPlane::istiod(&istiod, &ca, ads)?.with_ca(IstiodCa::new("bench mesh CA", Some(TOKEN))?)?;
    Ok(Stage { app, cp, ca, _upstream_app: upstream_app, _upstream: upstream, _istiod: istiod, _mesh: mesh })
}

/// CPU time (user + system) of `pid` in seconds.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> = stat.rsplit_once(") ").context("stat")?.1.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.unwrap_or(100) as f64;
    Ok(ticks / hz)
}

/// Resident memory (`VmRSS`) of `pid` in MiB.
fn rss_mib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("VmRSS")?;
    Ok(kib / 1024.0)
}

/// (CPU % of one core, RSS MiB) of each pid over `window`, while `during` runs.
fn usage<T>(
    pids: &[u32],
    window: Duration,
    during: impl FnOnce() -> T,
) -> anyhow::Result<(Vec<(f64, f64)>, T)> {
    let before: Vec<f64> = pids.iter().map(|p| cpu_seconds(*p)).collect::<anyhow::Result<_>>()?;
    let started = Instant::now();
    let out = during();
    let elapsed = started.elapsed().max(window).as_secs_f64();
    let mut result = Vec::new();
    for (pid, cpu0) in pids.iter().zip(before) {
        result.push(((cpu_seconds(*pid)? - cpu0) * 100.0 / elapsed, rss_mib(*pid)?));
    }
    Ok((result, out))
}

/// `RATE` requests/s for `window` over `CONNECTIONS` keep-alive connections, in `pod`;
/// (answered, failed).
fn paced_load(pod: &Pod, window: Duration) -> anyhow::Result<(u64, u64)> {
    Ok(pod.run(move || async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let per_connection = Duration::from_micros(1_000_000 * CONNECTIONS / RATE);
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..CONNECTIONS {
            tasks.spawn(async move {
                let (mut ok, mut failed) = (0u64, 0u64);
                let Ok(mut s) = tokio::net::TcpStream::connect(OUTBOUND).await else { return (0, 1) };
                let request = b"GET / HTTP/1.1\r\nHost: upstream\r\n\r\n";
                // serve-http's answer to `/`: fixed length.
                let expected = b"HTTP/1.1 200 X\r\nContent-Length: 3\r\n\r\nok\n";
                let mut buf = vec![0u8; expected.len()];
                let mut tick = tokio::time::interval(per_connection);
                let deadline = tokio::time::Instant::now() + window;
                while tokio::time::Instant::now() < deadline {
                    tick.tick().await;
                    let round = async {
                        s.write_all(request).await?;
                        s.read_exact(&mut buf).await?;
                        Ok::<_, std::io::Error>(buf == expected)
                    };
                    match tokio::time::timeout(Duration::from_secs(2), round).await {
                        Ok(Ok(true)) => ok += 1,
                        _ => {
                            failed += 1;
                            break;
                        }
                    }
                }
                (ok, failed)
            });
        }
        let (mut ok, mut failed) = (0, 0);
        while let Some(Ok((o, f))) = tasks.join_next().await {
            ok += o;
            failed += f;
        }
        (ok, failed)
    })?)
}

struct AgentRun {
    ready_ms: f64,
    /// (agent, Envoy) × (CPU %, RSS MiB), idle and loaded.
    idle: [(f64, f64); 2],
    loaded: [(f64, f64); 2],
    rps: f64,
    /// The agent's idle RSS by part, at the end of the idle window.
    parts: smaps::Breakdown,
}

/// Istio's bootstrap template, where the proxyv2 image puts it (in the pod's root).
fn place_image_template(root: &SidecarRoot) -> anyhow::Result<()> {
    let dir = root.path().join("var/lib/istio/envoy");
    std::fs::create_dir_all(&dir)?;
    let template = weir_tests::tools::workspace().join("tests/testdata/istio-bootstrap/envoy_bootstrap.json");
    std::fs::copy(template, dir.join("envoy_bootstrap_tmpl.json"))?;
    Ok(())
}

/// `image_template`: the pod has Istio's template at the image's path (rendered), else
/// Weir's built-in bootstrap is written.
fn run_agent(opts: &Options, image_template: bool) -> anyhow::Result<AgentRun> {
    let st = stage()?;
    let root = SidecarRoot::new(st.ca.root_pem(), TOKEN)?;
    if image_template {
        place_image_template(&root)?;
    }
    let pc = format!(
        "{{\"discoveryAddress\": \"{}\", \"binaryPath\": \"{}\", \"concurrency\": 2}}",
        st.cp.addr,
        envoy::binary_for_children()?.display()
    );
    let ip = st.app.ipv4().to_string();
    let env = [
        ("WEIR_LOG", "warn"),
        ("PROXY_CONFIG", pc.as_str()),
        ("ISTIOD_SAN", ISTIOD_SAN),
        ("ISTIO_META_CLUSTER_ID", CLUSTER_ID),
        ("POD_NAME", "app"),
        ("POD_NAMESPACE", "default"),
        ("SERVICE_ACCOUNT", "app"),
        ("INSTANCE_IP", ip.as_str()),
        // Every feature on: the DNS proxy too (Istio's DNS capture).
        ("ISTIO_META_DNS_CAPTURE", "true"),
    ];
    let args = ["proxy", "sidecar", "--domain", "default.svc.cluster.local", "--proxyLogLevel=warning"];
    let started = Instant::now();
    let mut agent = AgentProcess::launch(
        &st.app,
        &root,
        weir_tests::tools::weir_command(),
        &args,
        &env,
        Some((PROXY_UID, PROXY_UID)),
        None,
    )?;
    let status: SocketAddr = "127.0.0.1:15020".parse()?;
    loop {
        let ready = st.app.run(move || async move { http::get(status, "/healthz/ready").await })?;
        if matches!(ready, Ok((200, _))) {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("not ready after 60 s (last {ready:?}); log:\n{}", agent.log());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let ready_ms = started.elapsed().as_secs_f64() * 1000.0;
    let children = agent.children();
    let [envoy] = children.as_slice() else { bail!("expected one Envoy, found {children:?}") };
    let pids = [agent.child.pid(), *envoy];
    std::thread::sleep(Duration::from_secs(2));
    let (idle, ()) = usage(&pids, WINDOW, || std::thread::sleep(WINDOW))?;
    let parts = smaps::read(pids[0])?;
    let window = Duration::from_secs(opts.duration_secs.max(5));
    let (loaded, load) = usage(&pids, window, || paced_load(&st.app, window))?;
    let (ok, failed) = load?;
    if failed > 0 {
        bail!("{failed} failed requests under load; agent log:\n{}", agent.log());
    }
    agent.terminate()?;
    Ok(AgentRun {
        ready_ms,
        idle: [idle[0], idle[1]],
        loaded: [loaded[0], loaded[1]],
        rps: ok as f64 / window.as_secs_f64(),
        parts,
    })
}

/// The floor for start → ready: Envoy alone, ADS over TLS straight to the control
/// plane, from spawn until `/ready` says LIVE.
fn run_envoy_alone() -> anyhow::Result<f64> {
    let st = stage()?;
    let root = SidecarRoot::new(st.ca.root_pem(), TOKEN)?;
    let ca_file = root.path().join("var/run/secrets/istio/root-cert.pem");
    let node = format!("sidecar~{}~app.default~default.svc.cluster.local", st.app.ipv4());
    let target = XdsTarget::Direct {
        address: st.cp.addr,
        ca_file: &ca_file,
        sni: ISTIOD_SAN,
        token: TOKEN,
        cluster_id: CLUSTER_ID,
    };
    let bootstrap = ads_bootstrap_to(&target, true, &node, "127.0.0.1:15000".parse()?);
    let started = Instant::now();
    let placement = Placement { user: Some((PROXY_UID, PROXY_UID)), ..Placement::default() };
    let envoy = Envoy::start_placed(&st.app, &bootstrap, "127.0.0.1:15000".parse()?, placement)?;
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    drop(envoy);
    Ok(ms)
}

/// Rendering alone, in this process: the agent's configuration for an injected pod,
/// its bootstrap through Istio's template and through the built-in one, each `n`
/// times; milliseconds per rendering.
fn render_ms(n: usize) -> anyhow::Result<(Samples, Samples)> {
    use weir_agent::sidecar::config::{AgentConfig, MapEnv, ProxyArgs};
    let dir = weir_tests::envoy::tempfile_dir::Dir::new("bench-render")?;
    let template = weir_tests::tools::workspace().join("tests/testdata/istio-bootstrap/envoy_bootstrap.json");
    let args = ProxyArgs::parse(&["sidecar".into(), "--domain".into(), "default.svc.cluster.local".into()])?;
    let pc = format!("{{\"configPath\": \"{}\"}}", dir.path().display());
    let env = MapEnv::from([
        ("XDS_ROOT_CA", "SYSTEM"),
        ("CA_ROOT_CA", "SYSTEM"),
        ("POD_NAME", "app-1"),
        ("POD_NAMESPACE", "default"),
        ("INSTANCE_IP", "10.66.0.5"),
        ("ISTIO_META_WORKLOAD_NAME", "app"),
        ("ISTIO_META_POD_PORTS", "[{\"name\":\"http\",\"containerPort\":8080}]"),
        ("PROXY_CONFIG", pc.as_str()),
    ]);
    let mut config = AgentConfig::resolve(args, &env, &std::collections::BTreeMap::new())?;
    let mut time = |template: Option<std::path::PathBuf>| -> anyhow::Result<Samples> {
        config.envoy.template = template;
        let mut out = Samples::default();
        for _ in 0..n {
            let started = Instant::now();
            let (text, _) = weir_agent::sidecar::agent::render_bootstrap(&config)?;
            std::hint::black_box(text);
            out.0.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        Ok(out)
    };
    Ok((time(None)?, time(Some(template))?))
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    let mut floor = Samples::default();
    let (mut ready, mut ready_template, mut rps) =
        (Samples::default(), Samples::default(), Samples::default());
    let mut cols: [[Samples; 4]; 2] = Default::default();
    let mut parts: Vec<smaps::Breakdown> = Vec::new();
    for run in 0..opts.runs {
        eprintln!("[bench sidecar] Envoy alone run {}/{}", run + 1, opts.runs);
        floor.0.push(run_envoy_alone().unwrap_or_else(|e| {
            eprintln!("[bench sidecar] Envoy alone failed: {e:#}");
            f64::NAN
        }));
        // The two agent variants alternate which goes first, so order is no bias.
        let template_run = |ready_template: &mut Samples| {
            eprintln!("[bench sidecar] weir proxy sidecar (Istio's template) run {}/{}", run + 1, opts.runs);
            ready_template.0.push(run_agent(opts, true).map(|r| r.ready_ms).unwrap_or_else(|e| {
                eprintln!("[bench sidecar] weir proxy sidecar (Istio's template) failed: {e:#}");
                f64::NAN
            }));
        };
        if run % 2 == 0 {
            template_run(&mut ready_template);
        }
        eprintln!("[bench sidecar] weir proxy sidecar run {}/{}", run + 1, opts.runs);
        let result = run_agent(opts, false);
        if run % 2 == 1 {
            template_run(&mut ready_template);
        }
        match result {
            Ok(r) => {
                ready.0.push(r.ready_ms);
                rps.0.push(r.rps);
                parts.push(r.parts);
                for (who, col) in cols.iter_mut().enumerate() {
                    col[0].0.push(r.idle[who].1);
                    col[1].0.push(r.loaded[who].1);
                    col[2].0.push(r.idle[who].0);
                    col[3].0.push(r.loaded[who].0);
                }
            }
            Err(e) => {
                eprintln!("[bench sidecar] weir proxy sidecar failed: {e:#}");
                ready.0.push(f64::NAN);
            }
        }
    }
    let start = Table {
        title: "Sidecar start: process start → ready".into(),
        columns: vec![("start→ready", "ms", false)],
        rows: vec![
            Row { name: "Envoy alone, ADS straight to the control plane, until LIVE (floor)".into(), metrics: vec![floor] },
            Row { name: "weir proxy sidecar, built-in bootstrap: agent start → /healthz/ready 200".into(), metrics: vec![ready] },
            Row {
                name: "weir proxy sidecar, the image's Istio template rendered: start → ready".into(),
                metrics: vec![ready_template],
            },
        ],
        notes: vec![
            "The agent's figure includes loading its config, writing the bootstrap, starting Envoy and CDS/LDS \
             through the relay; the workload certificate (RSA 2048, Istio's default) is issued meanwhile but no \
             listener here needs it. Both bootstraps are Istio's document (16 KB); the second is rendered from \
             the template at ./var/lib/istio/envoy/envoy_bootstrap_tmpl.json, as in Istio's proxyv2 image."
                .into(),
        ],
    };
    let (builtin_ms, template_ms) = render_ms(50)?;
    let render = Table {
        title: "Bootstrap rendering (config → text), per bootstrap".into(),
        columns: vec![("render", "ms", false)],
        rows: vec![
            Row {
                name: "built-in bootstrap (JSON values, pretty-printed; floor)".into(),
                metrics: vec![builtin_ms],
            },
            Row {
                name: "Istio's template through the Go template engine".into(),
                metrics: vec![template_ms],
            },
        ],
        notes: vec![
            "Options computed from an injected pod's configuration, then rendered, 50 times in this process \
             (release build); the template is read and parsed each time, as at agent start. The goal: \
             rendering Istio's template costs under 10 ms of start → ready."
                .into(),
        ],
    };
    let [agent, envoy_cols] = cols;
    let footprint = Table {
        title: format!("Sidecar footprint: idle and at {RATE} requests/s through Envoy"),
        columns: vec![
            ("RSS idle", "MiB", false),
            ("RSS loaded", "MiB", false),
            ("CPU idle", "% core", false),
            ("CPU loaded", "% core", false),
        ],
        rows: vec![
            Row { name: "Envoy (concurrency 2), the data path (floor)".into(), metrics: envoy_cols.to_vec() },
            Row { name: "weir agent (relay, SDS, status server, DNS proxy)".into(), metrics: agent.to_vec() },
        ],
        notes: vec![format!(
            "Load: {RATE} req/s paced over {CONNECTIONS} HTTP/1.1 keep-alive connections to Envoy's tcp_proxy \
             listener → an HTTP app in another pod; achieved {:.0} req/s [{:.0}–{:.0}]. CPU over a {}-s idle window \
             and the load window. pilot-agent's published idle figure is about 50 MB (istio/istio#38000). \
             Median [min–max] of {} runs.",
            rps.median(),
            rps.min(),
            rps.max(),
            WINDOW.as_secs(),
            opts.runs
        )],
    };
    let by_part = parts_table(&parts, opts.runs);
    // Binary size: what a node pulls and maps, Envoy's as the floor.
    let size = |path: &std::path::Path| {
        std::fs::metadata(path).map(|m| m.len() as f64 / (1024.0 * 1024.0)).unwrap_or(f64::NAN)
    };
    let weir_bin = weir_tests::tools::weir();
    let sizes = Table {
        title: "Binary size".into(),
        columns: vec![("size", "MiB", false)],
        rows: vec![
            Row {
                name: "envoy (the proxy it runs; floor)".into(),
                metrics: vec![Samples(vec![size(&envoy::binary()?)])],
            },
            Row {
                name: "weir (agent, capture, eBPF objects, CNI plugin, demo)".into(),
                metrics: vec![Samples(vec![size(&weir_bin)])],
            },
            Row {
                name: "weir-cni (the CNI plugin alone, exec'd for every pod)".into(),
                metrics: vec![Samples(vec![size(&weir_tests::tools::weir_cni())])],
            },
            Row {
                name: "weir-init (istio-init's pilot-agent, exec'd for every pod)".into(),
                metrics: vec![Samples(vec![weir_tests::tools::weir_init().map_or(f64::NAN, |p| size(&p))])],
            },
        ],
        notes: vec![format!("{} as built by scripts/bench (release).", weir_bin.display())],
    };
    Ok(vec![start, render, footprint, by_part, sizes])
}

/// The agent's idle RSS by part: the whole first, so each part reads as its share.
fn parts_table(parts: &[smaps::Breakdown], runs: usize) -> Table {
    let mib = |f: fn(&smaps::Breakdown) -> u64| Samples(parts.iter().map(|b| f(b) as f64 / 1024.0).collect());
    let row = |name: &str, f: fn(&smaps::Breakdown) -> u64| Row { name: name.into(), metrics: vec![mib(f)] };
    let threads = Samples(parts.iter().map(|b| b.threads as f64).collect());
    Table {
        title: "Agent idle RSS by part (share of the whole)".into(),
        columns: vec![("RSS idle", "MiB", false)],
        rows: vec![
            row("the whole agent (every mapping's Rss)", |b| b.total),
            row("weir binary: text (code touched)", |b| b.binary_text),
            row("weir binary: read-only data, relocations, .data/.bss", |b| b.binary_data),
            row("shared libraries (libc, libgcc, ld.so)", |b| b.libraries),
            row("heap: [heap] and malloc arenas", |b| b.heap),
            row("thread stacks (main and each thread's)", |b| b.stacks),
            row("other anonymous (direct mmaps, vdso)", |b| b.other_anon),
        ],
        notes: vec![format!(
            "From /proc/<agent>/smaps at the end of the idle window (relay, SDS, status server, DNS proxy, \
             metrics all serving); {} threads [{}–{}]. Median [min–max] of {runs} runs; \"vs floor\" here is the \
             share of the whole.",
            threads.median(),
            threads.min(),
            threads.max(),
        )],
    }
}
