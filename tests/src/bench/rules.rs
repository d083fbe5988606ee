//! `weir-bench rules`: what programming capture costs, per backend. The full injector
//! rule set (`istio-iptables -p 15001 -z 15006 -u 1337 -m REDIRECT -i '*' -x "" -b '*'
//! -d 15090,15021,15020`, as the CNI plugin plans it) applied to a fresh pod namespace
//! with iptables-restore and with one nft transaction, and eBPF capture attached to a
//! fresh cgroup and the pod registered; then removed. The floor is one empty
//! `iptables-restore --noflush` (the exec and lock every netfilter apply pays).

use std::{process::Command, time::Instant};

use weir_agent::sandbox::{Cgroup, Mesh, unique_name};
use weir_iptables::RunOptions;

use crate::report::{Options, Row, Table, repeat_pair};

/// Applies per run.
const ROUNDS: usize = 20;

#[derive(Clone, Copy, PartialEq)]
enum Backend {
    Floor,
    Iptables,
    Nftables,
    Ebpf,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Floor => "empty iptables-restore --noflush (floor)",
            Backend::Iptables => "iptables: iptables-restore of the injector rules",
            Backend::Nftables => "nftables: one nft -f transaction",
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// (apply ms, remove ms), medians of `ROUNDS`.
fn run_once(backend: Backend) -> anyhow::Result<(f64, f64)> {
    let mesh = Mesh::new("bench-rules")?;
    let pod = mesh.pod("app")?;
    let cfg = injector_config();
    let (mut apply, mut remove) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        match backend {
            Backend::Floor => {
                let netns = pod.netns().path().to_path_buf();
                let started = Instant::now();
                // Entered the same way weir-iptables enters a pod namespace.
                weir_agent::ebpf::capture::in_netns(&netns, || {
                    use std::io::Write as _;
                    let mut child = Command::new("iptables-restore")
                        .arg("--noflush")
                        .stdin(std::process::Stdio::piped())
                        .spawn()?;
                    child.stdin.take().expect("piped").write_all(b"*nat\nCOMMIT\n")?;
                    child.wait()?;
                    Ok(())
                })
                .map_err(|e| anyhow::anyhow!("iptables-restore in {}: {e}", netns.display()))?;
                apply.push(started.elapsed().as_secs_f64() * 1000.0);
                remove.push(f64::NAN);
            }
            Backend::Iptables | Backend::Nftables => {
                let opts = RunOptions {
                    network_namespace: Some(pod.netns().path().to_path_buf()),
                    cni_mode: true,
                    native_nftables: backend == Backend::Nftables,
                    ..RunOptions::default()
                };
                let started = Instant::now();
                weir_iptables::program(&cfg, &opts)?;
                apply.push(started.elapsed().as_secs_f64() * 1000.0);
                let started = Instant::now();
                weir_iptables::program(&cfg, &RunOptions { cleanup_only: true, ..opts })?;
                remove.push(started.elapsed().as_secs_f64() * 1000.0);
            }
            Backend::Ebpf => {
                let cgroup = Cgroup::create(&unique_name(&format!("bench-rules-{round}")))?;
                let node = unique_name("bench-rules-node");
                let started = Instant::now();
                weir_agent::cni::ebpf::attach_node(&node, cgroup.path())?;
                weir_agent::cni::ebpf::register(&node, "bench", pod.netns().path(), "eth0", &cfg)?;
                apply.push(started.elapsed().as_secs_f64() * 1000.0);
                let started = Instant::now();
                weir_agent::cni::ebpf::unregister(&node, "bench")?;
                weir_agent::cni::ebpf::detach_node(&node)?;
                remove.push(started.elapsed().as_secs_f64() * 1000.0);
            }
        }
    }
    let remove = if remove.iter().all(|r| r.is_nan()) { f64::NAN } else { median(remove) };
    Ok((median(apply), remove))
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    // The eBPF rows pin; a bpffs mounted for them is unmounted afterwards.
    let _bpffs = weir_tests::BpffsUse::acquire()?;
    let mut rows = Vec::new();
    for backend in [Backend::Floor, Backend::Iptables, Backend::Nftables, Backend::Ebpf] {
        let (apply, mut remove) = repeat_pair("rules", backend.name(), opts.runs, || run_once(backend));
        // The floor has no removal: its column stays empty rather than "failed".
        if backend == Backend::Floor {
            remove.0.clear();
        }
        rows.push(Row { name: backend.name().into(), metrics: vec![apply, remove] });
    }
    let table = Table {
        title: "Rule programming: the full injector rule set, applied and removed".into(),
        columns: vec![("apply", "ms", false), ("remove", "ms", false)],
        rows,
        notes: vec![format!(
            "{ROUNDS} applies per run into a fresh pod namespace (netfilter: pod-scoped xtables lock, state read, one \
             transaction, final state read, as Istio); eBPF: the five capture programs loaded and verified, attached to a \
             fresh cgroup, pinned, the pod registered with its inbound classifier. Median of the rounds, then median \
             [min–max] of {} runs.",
            opts.runs
        )],
    };
    Ok(vec![table])
}
