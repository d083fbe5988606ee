//! `weir-bench rules`: what programming capture costs, per backend, against the same
//! work done raw. The injector rule set (`istio-iptables -p 15001 -z 15006 -u 1337 -m
//! REDIRECT -i '*' -x "" -b '*' -d 15090,15021,15020`, as the CNI plugin plans it) is
//! applied to a fresh pod namespace and removed again, by Weir and by the kernel's own
//! tool fed the very text Weir renders: `iptables-nft-restore --noflush` of the rules
//! and of their removal (`-D`/`-F`/`-X`), `nft -f` of the transaction and of the
//! cleanup. Weir's rows add what Istio's contract needs around that (state probe,
//! backend choice, verify). eBPF capture is attached to a fresh cgroup and the pod
//! registered; its floor is still the empty `iptables-restore --noflush`.

use std::{process::Command, time::Instant};

use weir_agent::sandbox::{Cgroup, Mesh, Pod, unique_name};
use weir_iptables::RunOptions;

use crate::report::{Options, Row, Samples, Table};

/// Applies per run.
const ROUNDS: usize = 20;

#[derive(Clone, Copy, PartialEq)]
enum Backend {
    EmptyRestore,
    IptablesRaw,
    Iptables,
    NftRaw,
    Nftables,
    Ebpf,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::EmptyRestore => "empty iptables-restore --noflush (floor)",
            Backend::IptablesRaw => "iptables-nft-restore --noflush of the same text (floor)",
            Backend::Iptables => "weir: iptables backend",
            Backend::NftRaw => "nft -f of the same transaction (floor)",
            Backend::Nftables => "weir: nftables backend",
            Backend::Ebpf => "eBPF: load + attach to a cgroup + register the pod",
        }
    }
}

fn injector_config() -> weir_iptables::CaptureConfig {
    let mut pod = weir_agent::cni::pod::PodInfo::default();
    pod.annotations.insert("sidecar.istio.io/status".into(), "{}".into());
    pod.containers.insert("istio-proxy".into());
    weir_agent::cni::pod::capture_config(&pod, false).expect("the default pod shape is valid")
}

/// Milliseconds to run `argv` with `stdin` in the pod's namespace (entered as
/// weir-iptables enters it); a failed run is an error, never a fast sample.
fn raw(pod: &Pod, argv: &[&str], stdin: &str) -> anyhow::Result<f64> {
    let netns = pod.netns().path().to_path_buf();
    let started = Instant::now();
    weir_agent::ebpf::capture::in_netns(&netns, || {
        use std::io::Write as _;
        let mut child = Command::new(argv[0]).args(&argv[1..]).stdin(std::process::Stdio::piped()).spawn()?;
        child.stdin.take().expect("piped").write_all(stdin.as_bytes())?;
        let status = child.wait()?;
        if !status.success() {
            return Err(std::io::Error::other(format!("{} exited with {status}", argv.join(" "))));
        }
        Ok(())
    })
    .map_err(|e| anyhow::anyhow!("{} in {}: {e}", argv.join(" "), netns.display()))?;
    Ok(started.elapsed().as_secs_f64() * 1000.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Milliseconds `f` takes.
fn timed(f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let started = Instant::now();
    f()?;
    Ok(started.elapsed().as_secs_f64() * 1000.0)
}

/// One round of `backend`: (apply ms, remove ms) in `pod`.
fn round(backend: Backend, pod: &Pod, round: usize) -> anyhow::Result<(f64, f64)> {
    let cfg = injector_config();
    Ok(match backend {
        Backend::EmptyRestore => (raw(pod, &["iptables-restore", "--noflush"], "*nat\nCOMMIT\n")?, f64::NAN),
        Backend::IptablesRaw => {
            let rules = weir_iptables::plan::plan(&cfg).v4;
            let restore = ["iptables-nft-restore", "--noflush"];
            let apply = raw(pod, &restore, &weir_iptables::render::restore(&rules))?;
            (apply, raw(pod, &restore, &weir_iptables::render::removal(&rules))?)
        }
        Backend::NftRaw => {
            let tx = weir_iptables::nft::render(&weir_iptables::nft::plan(&cfg));
            let apply = raw(pod, &["nft", "-f", "-"], &tx)?;
            (apply, raw(pod, &["nft", "-f", "-"], &weir_iptables::nft::render_cleanup())?)
        }
        Backend::Iptables | Backend::Nftables => {
            let opts = RunOptions {
                network_namespace: Some(pod.netns().path().to_path_buf()),
                cni_mode: true,
                native_nftables: backend == Backend::Nftables,
                ..RunOptions::default()
            };
            let apply = timed(|| Ok(weir_iptables::program(&cfg, &opts).map(drop)?))?;
            let cleanup = RunOptions { cleanup_only: true, ..opts };
            (apply, timed(|| Ok(weir_iptables::program(&cfg, &cleanup).map(drop)?))?)
        }
        Backend::Ebpf => {
            let cgroup = Cgroup::create(&unique_name(&format!("bench-rules-{round}")))?;
            let node = unique_name("bench-rules-node");
            let apply = timed(|| {
                weir_agent::cni::ebpf::attach_node(&node, cgroup.path())?;
                weir_agent::cni::ebpf::register(&node, "bench", pod.netns().path(), "eth0", &cfg)?;
                Ok(())
            })?;
            let remove = timed(|| {
                weir_agent::cni::ebpf::unregister(&node, "bench")?;
                Ok(weir_agent::cni::ebpf::detach_node(&node)?)
            })?;
            (apply, remove)
        }
    })
}

/// One run of a group: `ROUNDS` rounds in one fresh pod namespace, the group's rows
/// taking turns within each round (so whatever else the machine does falls on floor
/// and Weir alike); per row, the medians of its (apply, remove).
fn run_group(backends: &[Backend]) -> anyhow::Result<Vec<(f64, f64)>> {
    let mesh = Mesh::new("bench-rules")?;
    let pod = mesh.pod("app")?;
    let mut samples = vec![(Vec::new(), Vec::new()); backends.len()];
    for i in 0..ROUNDS {
        for (backend, (apply, remove)) in backends.iter().zip(samples.iter_mut()) {
            let (a, r) = round(*backend, &pod, i)?;
            apply.push(a);
            remove.push(r);
        }
    }
    Ok(samples
        .into_iter()
        .map(|(apply, remove)| {
            let remove = if remove.iter().all(|r: &f64| r.is_nan()) { f64::NAN } else { median(remove) };
            (median(apply), remove)
        })
        .collect())
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    // The eBPF rows pin; a bpffs mounted for them is unmounted afterwards.
    let _bpffs = weir_tests::BpffsUse::acquire()?;
    let note = format!(
        "{ROUNDS} rounds per run in one fresh pod namespace, the floor and Weir taking turns in each round (so \
         load from elsewhere falls on both); median of the rounds, then median [min–max] of {} runs. Weir's rows: \
         the in-process probe of the namespace (nf_tables and legacy tables over netlink), then Istio's full path \
         (backend detection, save, verify, restore) only where the probe cannot settle the state. The eBPF floor \
         is not the same work: it is the exec and lock every netfilter apply pays.",
        opts.runs
    );
    let groups: [(&str, &[Backend]); 3] = [
        (
            "Rule programming, iptables: the injector rule set applied and removed",
            &[Backend::IptablesRaw, Backend::Iptables],
        ),
        (
            "Rule programming, nftables: the injector rule set applied and removed",
            &[Backend::NftRaw, Backend::Nftables],
        ),
        (
            "Rule programming, eBPF: programs attached and the pod registered, then removed",
            &[Backend::EmptyRestore, Backend::Ebpf],
        ),
    ];
    let mut tables = Vec::new();
    for (title, backends) in groups {
        let mut columns = vec![(Samples::default(), Samples::default()); backends.len()];
        for run in 0..opts.runs {
            eprintln!("[bench rules] {title}: run {}/{}", run + 1, opts.runs);
            match run_group(backends) {
                Ok(figures) => {
                    for ((apply, remove), (a, r)) in columns.iter_mut().zip(figures) {
                        apply.0.push(a);
                        remove.0.push(r);
                    }
                }
                Err(e) => {
                    eprintln!("[bench rules] {title} failed: {e:#}");
                    for (apply, remove) in columns.iter_mut() {
                        apply.0.push(f64::NAN);
                        remove.0.push(f64::NAN);
                    }
                }
            }
        }
        let mut rows = Vec::new();
        for (&backend, (apply, mut remove)) in backends.iter().zip(columns) {
            // The empty restore has no removal: its column stays empty rather than "failed".
            if backend == Backend::EmptyRestore {
                remove.0.clear();
            }
            rows.push(Row { name: backend.name().into(), metrics: vec![apply, remove] });
        }
        tables.push(Table {
            title: title.into(),
            columns: vec![("apply", "ms", false), ("remove", "ms", false)],
            rows,
            notes: vec![note.clone()],
        });
    }
    Ok(tables)
}
