//! `weir-bench rules`: what programming capture costs, per backend, against the same
//! work done raw. The injector rule set (`istio-iptables -p 15001 -z 15006 -u 1337 -m
//! REDIRECT -i '*' -x "" -b '*' -d 15090,15021,15020`, as the CNI plugin plans it) is
//! applied to a fresh pod namespace and removed again, by Weir and by the kernel's own
//! tool fed the very text Weir renders: `iptables-nft-restore --noflush` of the rules
//! and of their removal (`-D`/`-F`/`-X`), `nft -f` of the transaction and of the
//! cleanup. Weir's rows add what Istio's contract needs around that (state probe,
//! backend choice, verify). eBPF capture in init-container mode: a pod on a node that
//! already has Weir's program set (its links on the pod's cgroup, its cookie and config
//! in the pinned maps, the inbound classifier on its interface), against the raw work
//! of registering a pod, one update of the pinned config map; the first pod, which
//! loads and pins the set, is a row of its own.

use std::{path::Path, process::Command, time::Instant};

use weir_agent::{
    capture::ebpf::{
        config::{EbpfOptions, PodCapture, own_addresses},
        netns::netns_cookie,
        pod::{self, PodTarget},
        record::PinRecord,
        set,
    },
    sandbox::{Cgroup, Mesh, Pod, unique_name},
};
use weir_iptables::RunOptions;

use crate::report::{Options, Row, Samples, Table};

/// Applies per run.
const ROUNDS: usize = 20;

#[derive(Clone, Copy, PartialEq)]
enum Backend {
    IptablesRaw,
    Iptables,
    NftRaw,
    Nftables,
    MapUpdate,
    EbpfFirstPod,
    EbpfPod,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::IptablesRaw => "iptables-nft-restore --noflush of the same text (floor)",
            Backend::Iptables => "weir: iptables backend",
            Backend::NftRaw => "nft -f of the same transaction (floor)",
            Backend::Nftables => "weir: nftables backend",
            Backend::MapUpdate => "one update of the pinned POD_CONFIG map (floor)",
            Backend::EbpfFirstPod => "weir: first pod on the node (loads, verifies and pins the program set)",
            Backend::EbpfPod => "weir: a pod on a node that has the program set",
        }
    }
}

fn injector_config() -> weir_iptables::CaptureConfig {
    let mut pod = weir_agent::node::cni::pod::PodInfo::default();
    pod.annotations.insert("sidecar.istio.io/status".into(), "{}".into());
    pod.containers.insert("istio-proxy".into());
    weir_agent::node::cni::pod::capture_config(&pod, false).expect("the default pod shape is valid")
}

/// Milliseconds to run `argv` with `stdin` in the pod's namespace (entered as
/// weir-iptables enters it); a failed run is an error, never a fast sample.
fn raw(pod: &Pod, argv: &[&str], stdin: &str) -> anyhow::Result<f64> {
    let netns = pod.netns().path().to_path_buf();
    let started = Instant::now();
    weir_agent::capture::ebpf::netns::in_netns(&netns, || {
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
fn round(backend: Backend, pod: &Pod) -> anyhow::Result<(f64, f64)> {
    let cfg = injector_config();
    Ok(match backend {
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
        Backend::MapUpdate | Backend::EbpfFirstPod | Backend::EbpfPod => {
            unreachable!("the eBPF rows run together (ebpf_round)")
        }
    })
}

/// The eBPF pods of one run: two pod namespaces, each with a cgroup, captured in a
/// program set of the run's own (so nothing else on the machine shares it).
struct EbpfPods<'a> {
    first: (&'a Pod, Cgroup),
    second: (&'a Pod, Cgroup),
    key: String,
}

/// What `weir capture ebpf --netns <pod>` does past its arguments, timed: the pod's
/// addresses, its settings, its namespace cookie, its capture on the set `key`.
fn capture_pod(key: &str, name: &str, pod: &Pod, cgroup: &Cgroup) -> anyhow::Result<(f64, PinRecord)> {
    let cfg = injector_config();
    let started = Instant::now();
    let facts = weir_iptables::detect::SystemFacts { netns: Some(pod.netns().path().to_path_buf()) };
    let capture = PodCapture::new(&cfg, own_addresses(&facts)?, EbpfOptions::default())?;
    let cookie = netns_cookie(Some(pod.netns().path()))?;
    let target = PodTarget {
        name: unique_name(name),
        cgroup: cgroup.path().to_path_buf(),
        netns: Some(pod.netns().path().to_path_buf()),
        interface: "eth0".into(),
    };
    let record = pod::capture_in_set(key, &target, cookie, &capture)?;
    Ok((started.elapsed().as_secs_f64() * 1000.0, record))
}

/// The floor: one update (and one delete) of the pinned config map, opened from its pin.
fn map_update(set_dir: &Path, cookie: u64) -> anyhow::Result<(f64, f64)> {
    use aya::maps::{HashMap, Map, MapData};
    use weir_ebpf_common::capture::PodConfig;
    let path = set_dir.join("maps").join(weir_ebpf_common::capture::map::POD_CONFIG);
    let config: PodConfig = PodCapture::new(&injector_config(), Vec::new(), EbpfOptions::default())?.config;
    let open = || -> anyhow::Result<Map> { Ok(Map::HashMap(MapData::from_pin(&path)?)) };
    let apply = timed(|| {
        let mut map = open()?;
        Ok(HashMap::<_, u64, PodConfig>::try_from(&mut map)?.insert(cookie, config, 0)?)
    })?;
    let remove = timed(|| {
        let mut map = open()?;
        Ok(HashMap::<_, u64, PodConfig>::try_from(&mut map)?.remove(&cookie)?)
    })?;
    Ok((apply, remove))
}

/// One round of the eBPF rows, in turn: the first pod (the set absent: loaded and
/// pinned), the floor (the set present), a second pod added and removed, then the first
/// pod removed (the last one: the set goes with it). (apply, remove) per row, in
/// `EBPF_ROWS` order.
fn ebpf_round(pods: &EbpfPods<'_>) -> anyhow::Result<[(f64, f64); 3]> {
    anyhow::ensure!(!set::present(&pods.key), "the run's program set is pinned before its first pod");
    let (first_apply, first) = capture_pod(&pods.key, "bench-first", pods.first.0, &pods.first.1)?;
    let floor = map_update(&set::set_dir(&pods.key), u64::MAX - 1)?;
    let (second_apply, second) = capture_pod(&pods.key, "bench-second", pods.second.0, &pods.second.1)?;
    let second_remove = timed(|| Ok(second.remove()?))?;
    let first_remove = timed(|| Ok(first.remove()?))?;
    anyhow::ensure!(!set::present(&pods.key), "the set outlived its last pod");
    Ok([floor, (first_apply, first_remove), (second_apply, second_remove)])
}

/// The eBPF table's rows, in the order `ebpf_round` returns them.
const EBPF_ROWS: [Backend; 3] = [Backend::MapUpdate, Backend::EbpfFirstPod, Backend::EbpfPod];

fn run_ebpf() -> anyhow::Result<Vec<(f64, f64)>> {
    let mesh = Mesh::new("bench-rules-ebpf")?;
    let (a, b) = (mesh.pod("app")?, mesh.pod("app2")?);
    let pods = EbpfPods {
        first: (&a, Cgroup::create(&unique_name("bench-rules-first"))?),
        second: (&b, Cgroup::create(&unique_name("bench-rules-second"))?),
        key: format!("{}-bench-{}", set::version_key(), std::process::id()),
    };
    let mut samples = vec![(Vec::new(), Vec::new()); EBPF_ROWS.len()];
    for _ in 0..ROUNDS {
        for ((apply, remove), (a, r)) in samples.iter_mut().zip(ebpf_round(&pods)?) {
            apply.push(a);
            remove.push(r);
        }
    }
    Ok(samples.into_iter().map(|(apply, remove)| (median(apply), median(remove))).collect())
}

/// One run of a group: `ROUNDS` rounds in one fresh pod namespace, the group's rows
/// taking turns within each round (so whatever else the machine does falls on floor
/// and Weir alike); per row, the medians of its (apply, remove).
fn run_group(backends: &[Backend]) -> anyhow::Result<Vec<(f64, f64)>> {
    if backends == EBPF_ROWS {
        return run_ebpf();
    }
    let mesh = Mesh::new("bench-rules")?;
    let pod = mesh.pod("app")?;
    let mut samples = vec![(Vec::new(), Vec::new()); backends.len()];
    for _ in 0..ROUNDS {
        for (backend, (apply, remove)) in backends.iter().zip(samples.iter_mut()) {
            let (a, r) = round(*backend, &pod)?;
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
         (backend detection, save, verify, restore) only where the probe cannot settle the state. eBPF: the \
         pods are captured as `weir capture ebpf --netns` captures them (addresses, settings, cookie, links on \
         the pod's cgroup, registration, inbound classifier), in a program set of the run's own; the first pod \
         of each round loads and pins it, and its removal (the last pod's) removes it.",
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
        ("Rule programming, eBPF: a pod captured (init-container mode), then removed", &EBPF_ROWS),
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
        for (&backend, (apply, remove)) in backends.iter().zip(columns) {
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
