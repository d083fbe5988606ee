//! `weir-bench setup`: a pod's capture set up as kubelet sees it. The istio-init
//! container runs `pilot-agent istio-iptables` with the injector's flags inside the pod's
//! network namespace; kubelet waits for it to exit. Timed from outside, exec to exit,
//! against the floor of the kernel's own tool as a process doing the same work: `iptables-
//! nft-restore --noflush` of the very text Weir restores (per family it plans), or `nft
//! -f` of its transaction. What Weir adds over that floor is its own start-up, the
//! flags and environment resolved, the namespace probed, and what it logs.
//!
//! Weir is timed twice: as `weir-init` (the weir-init image's pilot-agent, istio-init's
//! commands only) and as the whole `weir` (what istio-init runs from a proxy image).
//! All three run in one fresh pod namespace, taking turns in each round (the order
//! rotating), each started from a thread inside the namespace with its output read
//! through pipes as a container runtime reads it; the rules are removed (untimed) after
//! each, so every apply finds the namespace clean.

use std::{
    io::Write as _,
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use weir_agent::sandbox::{Mesh, Pod};
use weir_iptables::{detect::SystemFacts, flags::IstioIptablesArgs};

use weir_tests::capture::injector_istio_init_args;

use crate::report::{Options, Row, Samples, Table};

/// Applies of each per run.
const ROUNDS: usize = 20;

/// The same flags as the library reads them.
fn injector_flags(nftables: bool) -> IstioIptablesArgs {
    IstioIptablesArgs {
        envoy_port: Some("15001".into()),
        inbound_capture_port: Some("15006".into()),
        proxy_uid: Some("1337".into()),
        mode: Some("REDIRECT".into()),
        outbound_include: Some("*".into()),
        outbound_exclude: Some(String::new()),
        inbound_ports: Some("*".into()),
        inbound_ports_exclude: Some("15090,15021,15020".into()),
        log_output_level: Some("default:info".into()),
        native_nftables: nftables.then(|| "true".into()),
        ..IstioIptablesArgs::default()
    }
}

/// One raw process: argv and its stdin.
struct Raw {
    argv: Vec<&'static str>,
    stdin: String,
}

/// The floor's processes for `pod`: what Weir's run restores, as the kernel's tools
/// take it (the plan resolved from the same flags, with the pod's own addresses), and
/// what removes it again.
fn raw_work(pod: &Pod, nftables: bool) -> anyhow::Result<(Vec<Raw>, Vec<Raw>)> {
    let facts = SystemFacts { netns: Some(pod.netns().path().to_path_buf()) };
    let (cfg, _) = injector_flags(nftables).resolve(&|_| None, &facts)?;
    if nftables {
        let tx = weir_iptables::nft::render(&weir_iptables::nft::plan(&cfg));
        let apply = vec![Raw { argv: vec!["nft", "-f", "-"], stdin: tx }];
        let remove = vec![Raw { argv: vec!["nft", "-f", "-"], stdin: weir_iptables::nft::render_cleanup() }];
        return Ok((apply, remove));
    }
    let plan = weir_iptables::plan::plan(&cfg);
    let (mut apply, mut remove) = (Vec::new(), Vec::new());
    for (tool, rules) in [("iptables-nft-restore", &plan.v4), ("ip6tables-nft-restore", &plan.v6)] {
        if rules.is_empty() {
            continue;
        }
        let argv = vec![tool, "--noflush"];
        apply.push(Raw { argv: argv.clone(), stdin: weir_iptables::render::restore(rules) });
        remove.push(Raw { argv, stdin: weir_iptables::render::removal(rules) });
    }
    Ok((apply, remove))
}

/// Runs `cmd` to its exit inside `netns`, its stdin written and its output read through
/// pipes; the milliseconds from spawn to exit. A failed run is an error, never a sample.
fn exec_to_exit(netns: &Path, mut cmd: Command, stdin: &str, what: &str) -> anyhow::Result<f64> {
    weir_agent::capture::ebpf::netns::in_netns(netns, move || {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let started = Instant::now();
        let mut child = cmd.spawn()?;
        child.stdin.take().expect("piped").write_all(stdin.as_bytes())?;
        let out = child.wait_with_output()?;
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        if !out.status.success() {
            return Err(std::io::Error::other(format!(
                "exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(ms)
    })
    .map_err(|e| anyhow::anyhow!("{what} in {}: {e}", netns.display()))
}

fn run_raw(netns: &Path, work: &[Raw]) -> anyhow::Result<f64> {
    let mut ms = 0.0;
    for raw in work {
        let mut cmd = Command::new(raw.argv[0]);
        cmd.args(&raw.argv[1..]);
        ms += exec_to_exit(netns, cmd, &raw.stdin, &raw.argv.join(" "))?;
    }
    Ok(ms)
}

fn run_weir(netns: &Path, nftables: bool, mut cmd: Command) -> anyhow::Result<f64> {
    cmd.args(injector_istio_init_args());
    if nftables {
        cmd.arg("--native-nftables");
    }
    exec_to_exit(netns, cmd, "", "pilot-agent istio-iptables")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Who runs the apply in a turn.
#[derive(Clone, Copy)]
enum Turn {
    Floor,
    /// `weir-init`, the weir-init image's pilot-agent.
    Init,
    /// `weir`, the proxy image's pilot-agent (istio-init on Istio's own proxyv2 image).
    Whole,
}

/// One run: `ROUNDS` rounds in a fresh pod namespace; (floor, weir-init, weir) medians
/// in ms.
fn run_once(nftables: bool) -> anyhow::Result<[f64; 3]> {
    let mesh = Mesh::new("bench-setup")?;
    let pod = mesh.pod("app")?;
    let netns = pod.netns().path().to_path_buf();
    let (apply, remove) = raw_work(&pod, nftables)?;
    let mut ms = [Vec::new(), Vec::new(), Vec::new()];
    let order = [Turn::Floor, Turn::Init, Turn::Whole];
    for round in 0..ROUNDS {
        // Each takes each place in the order in turn.
        for i in 0..order.len() {
            let turn = order[(i + round) % order.len()];
            let took = match turn {
                Turn::Floor => run_raw(&netns, &apply)?,
                Turn::Init => run_weir(&netns, nftables, weir_tests::tools::init_command())?,
                Turn::Whole => run_weir(&netns, nftables, weir_tests::tools::pilot_agent_command())?,
            };
            ms[turn as usize].push(took);
            run_raw(&netns, &remove)?;
        }
    }
    Ok(ms.map(median))
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    let mut tables = Vec::new();
    for nftables in [false, true] {
        let (floor_name, command, title) = if nftables {
            (
                "nft -f of the same transaction, exec → exit (floor)",
                "pilot-agent istio-iptables --native-nftables",
                "Whole-process setup as kubelet sees it, nftables",
            )
        } else {
            (
                "iptables-nft-restore --noflush of the same text, exec → exit (floor)",
                "pilot-agent istio-iptables",
                "Whole-process setup as kubelet sees it, iptables",
            )
        };
        let mut samples = [Samples::default(), Samples::default(), Samples::default()];
        for run in 0..opts.runs {
            eprintln!("[bench setup] {title}: run {}/{}", run + 1, opts.runs);
            let figures = run_once(nftables).unwrap_or_else(|e| {
                eprintln!("[bench setup] {title} failed: {e:#}");
                [f64::NAN; 3]
            });
            for (s, f) in samples.iter_mut().zip(figures) {
                s.0.push(f);
            }
        }
        let [floor, init, whole] = samples;
        // One name for both builds of an A/B: a build without weir-init runs its weir there.
        let init_name = format!("{command}, weir-init (the weir-init image's pilot-agent), exec → exit");
        tables.push(Table {
            title: title.into(),
            columns: vec![("apply", "ms", false)],
            rows: vec![
                Row { name: floor_name.into(), metrics: vec![floor] },
                Row { name: init_name, metrics: vec![init] },
                Row {
                    name: format!("{command}, weir (a proxy image's pilot-agent), exec → exit"),
                    metrics: vec![whole],
                },
            ],
            notes: vec![format!(
                "istio-init's command line as Istio's injector writes it ({}), run inside a fresh pod namespace as \
                 root; the floor runs the kernel's tool on the text Weir restores there (the plan resolved from the \
                 same flags and the pod's addresses). {ROUNDS} applies of each per run, taking turns (order \
                 rotating), the rules removed (untimed) after each; median of the applies. weir-init is what \
                 kubelet runs with global.proxy_init.image set to Weir's weir-init; weir is what it runs when \
                 istio-init uses the proxy image (Istio's default), the same code in the whole binary (a build without weir-init runs its weir in \
                 that row). Goal: ≤ 1.3× the floor. {}",
                injector_istio_init_args().join(" ").replace(" -x  ", " -x \"\" "),
                opts.summary()
            )],
        });
    }
    Ok(tables)
}
