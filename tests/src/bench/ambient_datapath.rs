//! `weir-bench ambient-datapath`: what capturing ambient pods with eBPF instead of
//! Istio's in-pod rules is worth per connection. Three rigs side by side, each its own
//! mesh: two plain pods (the floor: the same client and server, no capture, no
//! ztunnel), and two ambient pods with the real ztunnel (`tests/src/ztunnel.rs`)
//! captured by the in-pod rules (iptables) or by Weir's eBPF programs. In each, the
//! client (uid 1000) makes connections one after another to the server's address
//! (connect, one answer, close; `datapath-load connect`), through ztunnel and HBONE
//! mutual TLS in the ambient rigs. CPU is the pods' cgroup (both apps and ztunnel,
//! and the softirq work done in their context) and the machine's busy time, per
//! connection. Runs go round the rigs in turn, so load from elsewhere falls on all.

use std::{
    net::{IpAddr, SocketAddrV4},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};
use weir_tests::{
    Cgroup, Mesh, Placement, Pod, PodChild,
    ambient::{AmbientNode, pod_object},
    capture::NodeCapture,
    cni::start_placed,
    datapath::LoadResult,
    tools::testkit,
    ztunnel::{self, LocalWorkload, Ztunnel},
};

use crate::report::{Options, Row, Samples, Table};

/// Connections per run.
const CONNECTIONS: u64 = 1000;
const NS: &str = "bench";
const PORT: u16 = 8080;

/// One rig: what it keeps alive while runs go round.
struct Rig {
    name: &'static str,
    client: Pod,
    server: Pod,
    cgroup: Cgroup,
    _server_app: PodChild,
    _ztunnel: Option<(Ztunnel, Cgroup)>,
    _node: Option<AmbientNode>,
    _capture: Option<NodeCapture>,
    _mesh: Mesh,
}

/// How a rig captures its pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Capture {
    None,
    Rules,
    Ebpf,
}

fn serve(pod: &Pod, cgroup: &Cgroup) -> anyhow::Result<PodChild> {
    let placement = Placement {
        netns: Some(pod.netns()),
        user: Some((1000, 1000)),
        cgroup: Some(cgroup),
        ..Placement::default()
    };
    start_placed(placement, &["datapath-serve", &format!("0.0.0.0:{PORT}")])
}

fn rig(name: &'static str, capture: Capture) -> anyhow::Result<Rig> {
    let mesh = Mesh::new(&weir_agent::sandbox::unique_name("bench-ambdp"))?;
    let (client, server) = (mesh.pod("client")?, mesh.pod("server")?);
    let cgroup = Cgroup::create(&weir_agent::sandbox::unique_name("bench-ambdp"))?;
    if capture == Capture::None {
        let app = serve(&server, &cgroup)?;
        return Ok(Rig {
            name,
            client,
            server,
            cgroup,
            _server_app: app,
            _ztunnel: None,
            _node: None,
            _capture: None,
            _mesh: mesh,
        });
    }
    let mut node = AmbientNode::new(&mesh)?;
    let node_capture = if capture == Capture::Ebpf {
        let guard = NodeCapture::attach("bench-ambdp", cgroup.path())?;
        node.env.extend([
            ("WEIR_AMBIENT_CAPTURE".to_string(), "ebpf".to_string()),
            ("WEIR_EBPF_NODE_CAPTURE".to_string(), guard.name().to_string()),
        ]);
        Some(guard)
    } else {
        None
    };
    node.env.push(("AMBIENT_DNS_CAPTURE".into(), "false".into()));
    node.api.set_namespace(NS, &[("istio.io/dataplane-mode", "ambient")]);
    let pods = [(&client, "client"), (&server, "server")];
    for (i, (pod, name)) in pods.iter().enumerate() {
        node.api.set_pod(pod_object(NS, name, &format!("uid-{i}"), IpAddr::V4(pod.ipv4()), &[], &[]));
    }
    node.start_agent()?;
    let workloads: Vec<LocalWorkload> = pods
        .iter()
        .map(|(pod, name)| LocalWorkload {
            name: name.to_string(),
            namespace: NS.into(),
            service_account: name.to_string(),
            ips: vec![pod.ipv4().into()],
        })
        .collect();
    let zt_cgroup =
        Cgroup::create(&format!("{}/ztunnel", cgroup.path().file_name().unwrap().to_string_lossy()))?;
    let zt = Ztunnel::start_in_cgroup(&node.node, &node.zds_socket(), &workloads, Some(&zt_cgroup))?;
    node.wait("ztunnel's snapshot", Duration::from_secs(60), || zt.log().contains("received snapshot sent"))?;
    for (pod, name) in pods {
        node.cni_add(pod, NS, name).map_err(|e| anyhow::anyhow!("ADD {name}: {e}"))?;
        node.wait(&format!("ztunnel listening in {name}"), Duration::from_secs(60), || {
            ztunnel::listening_tcp_ports(pod.netns()).is_ok_and(|p| p.contains(&15006) && p.contains(&15001))
        })?;
    }
    let app = serve(&server, &cgroup)?;
    Ok(Rig {
        name,
        client,
        server,
        cgroup,
        _server_app: app,
        _ztunnel: Some((zt, zt_cgroup)),
        _node: Some(node),
        _capture: node_capture,
        _mesh: mesh,
    })
}

/// Connections ztunnel opened as the destination's reporter (its metrics, in the node's
/// namespace); 0 for the floor.
fn through_ztunnel(rig: &Rig) -> anyhow::Result<u64> {
    let Some(node) = &rig._node else { return Ok(0) };
    let metrics = weir_tests::capture::in_pod(&node.node, "curl", &["-s", "http://127.0.0.1:15020/metrics"]);
    Ok(metrics
        .lines()
        .filter(|l| {
            l.starts_with("istio_tcp_connections_opened_total") && l.contains("reporter=\"destination\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64)
}

/// One run; with ztunnel, fails unless ztunnel counted every connection.
fn load(rig: &Rig, count: u64) -> anyhow::Result<LoadResult> {
    let before = through_ztunnel(rig)?;
    let r = load_once(rig, count)?;
    if rig._ztunnel.is_some() {
        let seen = through_ztunnel(rig)? - before;
        if seen < count {
            bail!("ztunnel counted {seen} of {count} connections: the rest did not go through it");
        }
    }
    Ok(r)
}

fn load_once(rig: &Rig, count: u64) -> anyhow::Result<LoadResult> {
    let to = SocketAddrV4::new(rig.server.ipv4(), PORT);
    let mut cmd = Command::new(testkit());
    // The app's original destination is whatever its kernel says behind ztunnel
    // (conntrack's tuple under the rules, nothing under eBPF): not checked here; that
    // the run went through ztunnel is ([`through_ztunnel`]).
    let expect = if rig._ztunnel.is_some() { "any" } else { "none" };
    cmd.args(["datapath-load", "connect", &to.to_string(), expect])
        .args([count.to_string(), "1".into(), "1".into()])
        .arg(rig.cgroup.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let placement = Placement { user: Some((1000, 1000)), cgroup: Some(&rig.cgroup), ..Placement::default() };
    let out = rig.client.spawn_placed(&mut cmd, placement)?.into_inner().wait_with_output()?;
    if !out.status.success() {
        bail!("datapath-load: {}", String::from_utf8_lossy(&out.stderr));
    }
    let r: LoadResult = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("datapath-load output: {}", String::from_utf8_lossy(&out.stdout)))?;
    if r.failed > 0 {
        bail!("{} of {count} connections failed: {}", r.failed, r.errors.join("; "));
    }
    Ok(r)
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    ztunnel::binary().context("the ztunnel peer")?;
    let _bpffs = weir_tests::BpffsUse::acquire()?;
    let rigs = [
        rig("pod to pod, no mesh (floor: no capture, no ztunnel)", Capture::None)?,
        rig("ambient, in-pod rules (iptables) → ztunnel → HBONE", Capture::Rules)?,
        rig("ambient, eBPF capture → ztunnel → HBONE", Capture::Ebpf)?,
    ];
    for rig in &rigs {
        // Warm up: caches, conntrack, ztunnel's HBONE connection pool, the maps.
        load(rig, 200).with_context(|| format!("{}: warm-up", rig.name))?;
    }
    let mut figures: Vec<[Samples; 6]> = rigs.iter().map(|_| Default::default()).collect();
    for run in 0..opts.runs {
        for (rig, f) in rigs.iter().zip(&mut figures) {
            eprintln!("[bench ambient-datapath] {} run {}/{}", rig.name, run + 1, opts.runs);
            let r = load(rig, CONNECTIONS).with_context(|| rig.name.to_string())?;
            let per = |us: f64| us / r.ops as f64;
            f[0].0.push(r.ops as f64 / r.secs);
            f[1].0.push(r.p50_us.unwrap_or(f64::NAN));
            f[2].0.push(r.p99_us.unwrap_or(f64::NAN));
            f[3].0.push(r.cgroup_cpu_us.map_or(f64::NAN, per));
            f[4].0.push(per(r.host_cpu_us));
            f[5].0.push(r.secs);
        }
    }
    let rows = rigs
        .iter()
        .zip(figures)
        .map(|(rig, [rate, p50, p99, cpu, host, _])| Row {
            name: rig.name.to_string(),
            metrics: vec![rate, p50, p99, cpu, host],
        })
        .collect();
    let build = match std::env::var_os("WEIR_ZTUNNEL_BIN") {
        Some(bin) => format!("the build at {} (WEIR_ZTUNNEL_BIN)", std::path::Path::new(&bin).display()),
        None => "the test peer's debug build: its own per-connection work is far larger than a release \
                 build's, so the ztunnel rows overstate what a node pays; the difference between the two \
                 capture rows is what this table shows (WEIR_ZTUNNEL_BIN names a release build)"
            .into(),
    };
    Ok(vec![Table {
        title: "Ambient data path: eBPF capture against the in-pod rules (per connection)".into(),
        columns: vec![
            ("connections/s", "1/s", true),
            ("p50", "µs", false),
            ("p99", "µs", false),
            ("pods' CPU", "µs/conn", false),
            ("host CPU", "µs/conn", false),
        ],
        rows,
        notes: vec![format!(
            "{CONNECTIONS} connections per run, one after another (connect, one 8-byte answer, close) from the \
             client pod to the server pod's address, uid 1000, the same load in every rig. The ambient rigs run \
             the real ztunnel (istio/ztunnel at 62d82653, {build}), both ends' ztunnel in one process as on a \
             node, HBONE mutual TLS between them; every run checks ztunnel counted every connection. pods' CPU is the pods' cgroup (both apps \
             and ztunnel, with the softirq work done in their context); host CPU is every CPU's busy time \
             (/proc/stat, 10 ms ticks). The floor is the same client and server with nothing between them: it \
             is not the same work (no proxy), only the network's own cost. {}",
            opts.summary()
        )],
    }])
}
