//! weir-soak: Weir under a long, steady load with the control plane moving (issue 20's
//! soak; not run by CI). Two sidecars over mutual TLS (`weir_tests::mtls_pair`), a
//! paced TCP load through them, an xDS push every second, 10-second workload
//! certificates, and istiod (xDS and CA) restarted every two minutes. Prints, as
//! markdown: failed requests (inside and outside the restart windows), the agents'
//! RSS and open descriptors over time, and Envoy exits.
//!
//!   weir-soak [--minutes N] [--rate REQ_PER_SEC]     (defaults: 30 minutes, 1000/s)

use std::{
    process::ExitCode,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::io::AsyncBufReadExt as _;
use weir_tests::mtls_pair::{OUTBOUND, Rig, set_version};

/// How long each istiod restart keeps it away.
const ISTIOD_DOWN: Duration = Duration::from_secs(2);
const ISTIOD_EVERY: Duration = Duration::from_secs(120);
const PUSH_EVERY: Duration = Duration::from_secs(1);
const SAMPLE_EVERY: Duration = Duration::from_secs(60);
/// Samples before this are warm-up: growth is measured from the first one after it.
const WARM_UP: Duration = Duration::from_secs(120);
/// A failure this close after a restart began is inside its window.
const WINDOW: Duration = Duration::from_secs(10);
const CERT_LIFETIME: Duration = Duration::from_secs(10);
/// Load connections at once.
const WORKERS: u32 = 32;

struct Options {
    minutes: u64,
    rate: u32,
}

fn options() -> anyhow::Result<Options> {
    let mut o = Options { minutes: 30, rate: 1000 };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> anyhow::Result<u64> {
            let v = args.next().ok_or_else(|| anyhow::anyhow!("{name} needs a value"))?;
            v.parse().map_err(|_| anyhow::anyhow!("{name} {v:?}: expected a whole number"))
        };
        match a.as_str() {
            "--minutes" => o.minutes = value("--minutes")?.max(1),
            "--rate" => o.rate = u32::try_from(value("--rate")?.clamp(1, 100_000)).unwrap_or(1000),
            other => anyhow::bail!("unknown argument {other:?} (expected --minutes N, --rate N)"),
        }
    }
    Ok(o)
}

/// One sample of a process: (VmRSS KiB, open descriptors).
fn footprint(pid: u32) -> Option<(u64, usize)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches(" kB").trim();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    Some((rss.parse().ok()?, fds))
}

/// What the load saw: successes, and the time of each failure with why.
#[derive(Default)]
struct LoadLog {
    ok: u64,
    failed: Vec<(Instant, String)>,
}

/// Paced load from the client pod until `stop`: each worker sends one request per
/// `WORKERS / rate` seconds on its own schedule (a late request does not shift the next).
fn start_load(rig: &Rig, rate: u32, stop: Instant, log: Arc<Mutex<LoadLog>>) -> std::thread::JoinHandle<()> {
    let netns = weir_agent::sandbox::NetNs::open(rig.client.pod.netns().path()).expect("client netns");
    let interval = Duration::from_secs_f64(f64::from(WORKERS) / f64::from(rate));
    netns
        .spawn_thread(move || async move {
            let mut tasks = tokio::task::JoinSet::new();
            for w in 0..WORKERS {
                let log = log.clone();
                tasks.spawn(async move {
                    let mut next =
                        tokio::time::Instant::now() + interval.mul_f64(f64::from(w) / f64::from(WORKERS));
                    while Instant::now() < stop {
                        tokio::time::sleep_until(next).await;
                        next += interval;
                        let attempt = async {
                            let s = tokio::net::TcpStream::connect(OUTBOUND).await?;
                            let mut line = String::new();
                            tokio::io::BufReader::new(s).read_line(&mut line).await?;
                            Ok::<_, std::io::Error>(line)
                        };
                        let outcome = match tokio::time::timeout(Duration::from_secs(5), attempt).await {
                            Ok(Ok(line)) if line.starts_with("hello v1 ") => Ok(()),
                            Ok(Ok(line)) => Err(format!("unexpected answer {line:?}")),
                            Ok(Err(e)) => Err(e.to_string()),
                            Err(_) => Err("no answer in 5s".into()),
                        };
                        let mut l = log.lock().expect("load log");
                        match outcome {
                            Ok(()) => l.ok += 1,
                            Err(e) => l.failed.push((Instant::now(), e)),
                        }
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
        })
        .expect("load thread")
}

struct Sample {
    at: Duration,
    requests: u64,
    client: Option<(u64, usize)>,
    server: Option<(u64, usize)>,
}

/// Lets the client pod reuse TIME_WAIT ports for new outbound connections
/// (`net.ipv4.tcp_tw_reuse=1`, in its namespace only). Every request is a new
/// connection, and the client Envoy closes its upstream connection first, so each one
/// leaves a TIME_WAIT socket to the same server address for 60 s. With the default
/// (reuse on loopback only) the 28k ports of `ip_local_port_range` run out at about
/// 470 new connections/s to one destination, whatever the proxy: a first run failed
/// 13.5k connects that way, from its 58th second on.
fn reuse_time_wait_ports(rig: &Rig) -> anyhow::Result<()> {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net={}", rig.client.pod.netns().path().display()))
        .args(["--", "sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "set net.ipv4.tcp_tw_reuse=1 in the client pod: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn run(o: &Options) -> anyhow::Result<bool> {
    let mut rig = Rig::new("soak", Some(CERT_LIFETIME));
    rig.expect_calls_pass();
    reuse_time_wait_ports(&rig)?;
    let started = Instant::now();
    let end = started + Duration::from_secs(o.minutes * 60);
    let log = Arc::new(Mutex::new(LoadLog::default()));
    let load = start_load(&rig, o.rate, end, log.clone());
    let envoys = [rig.client.envoy().child.pid(), rig.server.envoy().child.pid()];
    let agents = [rig.client.agent.child.pid(), rig.server.agent.child.pid()];
    let (mut restarts, mut samples, mut pushes) = (Vec::new(), Vec::new(), 0u64);
    let (mut next_push, mut next_restart, mut next_sample) =
        (started + PUSH_EVERY, started + ISTIOD_EVERY, started);
    while Instant::now() < end {
        let now = Instant::now();
        if now >= next_sample {
            samples.push(Sample {
                at: now - started,
                requests: log.lock().expect("load log").ok,
                client: footprint(agents[0]),
                server: footprint(agents[1]),
            });
            eprintln!("[soak] {:?} sampled", now - started);
            next_sample += SAMPLE_EVERY;
        }
        if now >= next_restart {
            restarts.push(now);
            rig.cp.stop();
            std::thread::sleep(ISTIOD_DOWN);
            rig.cp.resume()?;
            next_restart += ISTIOD_EVERY;
        }
        if now >= next_push {
            pushes += 1;
            rig.cp.update(|s| set_version(s, &rig.server.pod, &format!("p{pushes}")));
            next_push += PUSH_EVERY;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    load.join().map_err(|_| anyhow::anyhow!("the load thread panicked"))?;
    samples.push(Sample {
        at: started.elapsed(),
        requests: log.lock().expect("load log").ok,
        client: footprint(agents[0]),
        server: footprint(agents[1]),
    });
    let envoy_exits = envoys.iter().filter(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()).count();
    let issued = (rig.client.issued(), rig.server.issued());
    let log = log.lock().expect("load log");
    let in_window = |t: &Instant| restarts.iter().any(|r| *t >= *r && *t < *r + WINDOW);
    let outside: Vec<&(Instant, String)> = log.failed.iter().filter(|(t, _)| !in_window(t)).collect();
    println!("{}", report(o, &samples, &log, outside.len(), restarts.len(), pushes, envoy_exits, issued));
    let mut kinds: std::collections::BTreeMap<&str, (usize, Duration)> = std::collections::BTreeMap::new();
    for (t, why) in &outside {
        kinds.entry(why.as_str()).or_insert((0, t.duration_since(started))).0 += 1;
    }
    for (why, (count, first)) in kinds {
        println!("- {count} failures outside a window ({why}), the first at {first:?}");
    }
    Ok(outside.is_empty() && envoy_exits == 0)
}

#[allow(clippy::too_many_arguments)]
fn report(
    o: &Options,
    samples: &[Sample],
    log: &LoadLog,
    outside: usize,
    restarts: usize,
    pushes: u64,
    envoy_exits: usize,
    issued: (usize, usize),
) -> String {
    let mib = |kib: u64| kib as f64 / 1024.0;
    let cell =
        |f: Option<(u64, usize)>| f.map_or("gone | -".to_string(), |(r, d)| format!("{:.1} | {d}", mib(r)));
    let mut out = format!(
        "### Soak: {} min at {}/s, xDS push every {}s, {}s certificates, istiod restarted every {}s\n\n\
         | t (s) | requests so far | client agent RSS (MiB) | fds | server agent RSS (MiB) | fds |\n|---|---|---|---|---|---|\n",
        o.minutes,
        o.rate,
        PUSH_EVERY.as_secs(),
        CERT_LIFETIME.as_secs(),
        ISTIOD_EVERY.as_secs()
    );
    for s in samples {
        out.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            s.at.as_secs(),
            s.requests,
            cell(s.client),
            cell(s.server)
        ));
    }
    let growth = |pick: fn(&Sample) -> Option<(u64, usize)>| {
        let base = samples.iter().find(|s| s.at >= WARM_UP).and_then(pick)?;
        let last = samples.last().and_then(pick)?;
        Some((mib(last.0) - mib(base.0), last.1 as i64 - base.1 as i64))
    };
    let show = |g: Option<(f64, i64)>| {
        g.map_or("n/a (run shorter than the warm-up)".into(), |(r, d)| format!("{r:+.2} MiB RSS, {d:+} fds"))
    };
    let seconds = samples.last().map_or(1.0, |s| s.at.as_secs_f64().max(1.0));
    out.push_str(&format!(
        "\nachieved {:.0} requests/s (each a new connection through both sidecars, mTLS between them); ",
        (log.ok + log.failed.len() as u64) as f64 / seconds
    ));
    out.push_str(&format!(
        "requests passed {}, failed {} ({} inside the {} istiod restart windows of {}s, {} outside: goal 0); \
         {} pushes; certificates issued: client {}, server {}; Envoy exits {} (goal 0); growth after the {}s warm-up: \
         client {}, server {} (goal: flat, ≤ 1 MiB over 30 minutes).",
        log.ok,
        log.failed.len(),
        log.failed.len() - outside,
        restarts,
        WINDOW.as_secs(),
        outside,
        pushes,
        issued.0,
        issued.1,
        envoy_exits,
        WARM_UP.as_secs(),
        show(growth(|s| s.client)),
        show(growth(|s| s.server)),
    ));
    out
}

fn main() -> ExitCode {
    let o = match options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("weir-soak: {e:#}");
            return ExitCode::from(64);
        }
    };
    match run(&o) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("weir-soak: {e:#}");
            ExitCode::FAILURE
        }
    }
}
