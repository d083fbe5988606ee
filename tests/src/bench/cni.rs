//! `weir-bench cni`: what chaining Weir costs a pod's start. CNI ADD latency of the
//! whole chain (reference `bridge` + `host-local`, then `weir-cni` with each backend)
//! against the floor of the same chain without Weir, measured by the rig's CNI
//! runtime in a node namespace, the pod fetched from the test Kubernetes API server.

use std::time::Instant;

use serde_json::{Value, json};
use weir_agent::sandbox::{Cgroup, NetNs, unique_name};
use weir_tests::{
    cni::{Attachment, CniRuntime, TestApiServer, conflist, pod_object, run_in, write_kubeconfig},
    envoy::tempfile_dir::Dir,
};

use crate::report::{Options, Row, Table, repeat_pair};

/// ADDs per run.
const PODS: usize = 40;
const TOKEN: &str = "bench-token";

#[derive(Clone, Copy)]
enum Chain {
    BridgeOnly,
    Weir(&'static str),
}

impl Chain {
    fn name(self) -> String {
        match self {
            Chain::BridgeOnly => "bridge + host-local alone (floor)".into(),
            Chain::Weir(mode) => format!("bridge + host-local + weir-cni ({mode})"),
        }
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// (p50, p99) ms of `PODS` sequential ADDs.
fn run_once(chain: Chain) -> anyhow::Result<(f64, f64)> {
    let node = NetNs::create(&unique_name("bench-cni-node"))?;
    run_in(&node, None, std::process::Command::new("ip"), &["link", "set", "lo", "up"]);
    let api = TestApiServer::start(&node, TOKEN, None)?;
    for i in 0..PODS {
        api.set_pod(pod_object("bench", &format!("p{i}"), true, &[], &[]));
    }
    let run_dir = Dir::new("bench-cni-run")?;
    write_kubeconfig(run_dir.path(), &api.kubeconfig(TOKEN, None))?;
    let ipam = Dir::new("bench-cni-ipam")?;
    let cgroup;
    let node_capture = unique_name("bench-cni-ebpf");
    let mut weir = json!({"cni_agent_run_dir": run_dir.path()});
    match chain {
        Chain::Weir("ebpf") => {
            cgroup = Some(Cgroup::create(&unique_name("bench-cni"))?);
            weir_agent::node::cni::ebpf::attach_node(&node_capture, cgroup.as_ref().expect("made").path())?;
            weir["capture_mode"] = json!("ebpf");
            weir["ebpf_node_capture"] = json!(node_capture);
        }
        Chain::Weir(mode) => {
            cgroup = None;
            weir["capture_mode"] = json!(mode);
        }
        Chain::BridgeOnly => cgroup = None,
    }
    let mut list: Value = conflist("10.88.0.0/24", ipam.path(), weir);
    if matches!(chain, Chain::BridgeOnly) {
        list["plugins"].as_array_mut().expect("plugins").pop();
    }
    let rt = CniRuntime::new(&node)?;
    let mut ms = Vec::with_capacity(PODS);
    let result = (|| -> anyhow::Result<()> {
        for i in 0..PODS {
            let pod = NetNs::create(&unique_name(&format!("bench-p{i}")))?;
            let a = Attachment::pod(&format!("c-p{i}"), pod.path(), "bench", &format!("p{i}"));
            let started = Instant::now();
            let result = rt.add(&list, &a).map_err(|e| anyhow::anyhow!("{e}"))?;
            ms.push(started.elapsed().as_secs_f64() * 1000.0);
            rt.del(&list, &a, Some(&result)).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        Ok(())
    })();
    if matches!(chain, Chain::Weir("ebpf")) {
        let _ = weir_agent::node::cni::ebpf::detach_node(&node_capture);
    }
    drop(cgroup);
    result?;
    ms.sort_by(f64::total_cmp);
    Ok((percentile(&ms, 0.5), percentile(&ms, 0.99)))
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    // The eBPF rows pin; a bpffs mounted for them is unmounted afterwards.
    let _bpffs = weir_tests::BpffsUse::acquire()?;
    let chains = [Chain::BridgeOnly, Chain::Weir("iptables"), Chain::Weir("nftables"), Chain::Weir("ebpf")];
    let mut rows = Vec::new();
    for chain in chains {
        let (p50, p99) = repeat_pair("cni", &chain.name(), opts.runs, || run_once(chain));
        rows.push(Row { name: chain.name(), metrics: vec![p50, p99] });
    }
    let table = Table {
        title: "CNI ADD latency (whole chain, per pod)".into(),
        columns: vec![("ADD p50", "ms", false), ("ADD p99", "ms", false)],
        rows,
        notes: vec![format!(
            "{PODS} pods per run, one ADD at a time (each followed by its DEL, not timed), every plugin exec'd as a \
             runtime does; weir-cni fetches the pod from the test Kubernetes API server over loopback HTTP. The eBPF \
             row registers pods with a node capture attached once before the run (which loads the node program \
             set, inbound classifier included): per pod, its cookie and config in the pinned maps and the pinned \
             classifier attached to its interface. Median [min–max] of {} runs.",
            opts.runs
        )],
    };
    Ok(vec![table])
}
