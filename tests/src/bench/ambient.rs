//! `weir-bench ambient`: what enrolling an ambient pod costs. CNI ADD of an ambient pod
//! until ztunnel's ack (the plugin exec'd as a runtime does: the pod and its namespace
//! read from the test API server, Istio's event posted to `weir cni ambient`, which
//! applies the in-pod rules, sends the pod over ZDS and answers only after the ack,
//! adds the pod's address to the probe ipset and annotates it), p50/p99 over 50 pods,
//! against the floor: the same in-pod rules applied raw (`apply_inpod` in a fresh
//! namespace) plus one SEQPACKET round trip of an Add-sized datagram. The ztunnel is
//! the rig's stand-in, which acks at once (the real ztunnel's proxy start is ztunnel's
//! cost, not the agent's). A third row puts a pod that is not ambient through the same
//! plugin (what every ADD costs before its pod's work), and a second table splits an
//! ADD into the plugin's phases and the agent's steps.

use std::{net::IpAddr, time::Instant};

use weir_agent::sandbox::{Mesh, unique_name};
use weir_iptables::ambient::{AmbientConfig, apply_inpod};
use weir_tests::{
    ambient::{AmbientNode, pod_object},
    capture::NodeCapture,
    fake_ztunnel::FakeZtunnel,
};

use crate::report::{Options, Row, Samples, Table};

/// Pods per run.
const PODS: usize = 50;

fn percentiles(mut ms: Vec<f64>) -> (f64, f64) {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// The floor: rules applied raw in `PODS` fresh namespaces, each plus one SEQPACKET
/// round trip of a 600-byte datagram (an Add with a long pod name) and its 2-byte ack.
/// Its figures: p50 and p99 of the whole, and in `STEPS`, the medians of its two parts
/// (under "agent: rules" and "agent: ZDS ack", the agent's steps that do the same).
fn floor_once() -> anyhow::Result<RunFigures> {
    use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockType, recv, send, socketpair};
    use std::os::fd::AsRawFd as _;
    let mesh = Mesh::new(&unique_name("bench-amb-floor"))?;
    let cfg = AmbientConfig { redirect_dns: true, ..AmbientConfig::default() }.for_pod(Default::default());
    let (agent, peer) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 1024];
        while let Ok(n) = recv(peer.as_raw_fd(), &mut buf, MsgFlags::empty()) {
            if n == 0 || send(peer.as_raw_fd(), &[0x0a, 0x00], MsgFlags::empty()).is_err() {
                return;
            }
        }
    });
    let request = vec![0x55u8; 600];
    let mut ms = Vec::with_capacity(PODS);
    let (mut rules, mut round_trips) = (Vec::with_capacity(PODS), Vec::with_capacity(PODS));
    for i in 0..PODS {
        let pod = mesh.pod(&format!("p{i}"))?;
        let started = Instant::now();
        apply_inpod(pod.netns().path(), &cfg)?;
        let applied = Instant::now();
        send(agent.as_raw_fd(), &request, MsgFlags::empty())?;
        let mut ack = [0u8; 64];
        recv(agent.as_raw_fd(), &mut ack, MsgFlags::empty())?;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
        rules.push(applied.duration_since(started).as_secs_f64() * 1000.0);
        round_trips.push(applied.elapsed().as_secs_f64() * 1000.0);
    }
    drop(agent);
    let _ = echo.join();
    let (p50, p99) = percentiles(ms);
    let mut steps = [f64::NAN; STEPS.len()];
    steps[step("rules")] = median(rules);
    steps[step("ztunnel")] = median(round_trips);
    Ok(RunFigures { p50, p99, steps })
}

/// `name`'s column in `STEPS`.
fn step(name: &str) -> usize {
    STEPS.iter().position(|(s, _)| *s == name).expect("a listed step")
}

/// The plugin's phases and the agent's steps of an ambient ADD, in table order: the
/// plugin's marks (`phases::mark` names) with spawn → main first and exit last, then
/// the agent's (`steps_us` in its "pod added" line), which fall inside `agent`.
const STEPS: [(&str, &str); 12] = [
    ("main", "spawn → main"),
    ("logs", "logs"),
    ("config", "config"),
    ("api", "API GETs"),
    ("agent", "event → answer"),
    ("result", "result"),
    ("exit", "exit"),
    ("netns", "agent: netns"),
    ("rules", "agent: rules"),
    ("ztunnel", "agent: ZDS ack"),
    ("probes", "agent: probe set"),
    ("annotate", "agent: annotate"),
];

/// One run: ADD p50/p99 (ms) and the median of each of `STEPS` (ms).
struct RunFigures {
    p50: f64,
    p99: f64,
    steps: [f64; STEPS.len()],
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The plugin's phases of one run, ms, into `out` (by `STEPS` name).
fn plugin_steps(run: &weir_tests::cni::PluginRun, out: &mut [Vec<f64>]) {
    let Some((main_ns, phases)) = run.stderr.lines().find_map(weir_agent::node::cni::phases::parse) else {
        return;
    };
    let mut push = |name: &str, ms: f64| {
        if let Some(i) = STEPS.iter().position(|(s, _)| *s == name) {
            out[i].push(ms);
        }
    };
    push("main", main_ns.saturating_sub(run.spawned_ns) as f64 / 1e6);
    let mut last = main_ns;
    for (phase, us) in phases {
        last += (us * 1000.0) as u64;
        push(&phase, us / 1000.0);
    }
    push("exit", run.exited_ns.saturating_sub(last) as f64 / 1e6);
}

/// The agent's steps from its "pod added" lines (`steps_us=netns=… rules=… …`), ms.
fn agent_steps(log: &str, out: &mut [Vec<f64>]) {
    for line in log.lines().filter(|l| l.contains("pod added to the ambient mesh")) {
        let Some(rest) = line.split_once("steps_us=").map(|(_, r)| r) else { continue };
        for word in rest.split_whitespace() {
            let Some((name, us)) = word.split_once('=') else { break };
            let (Some(i), Ok(us)) = (STEPS.iter().position(|(s, _)| *s == name), us.parse::<f64>()) else {
                break;
            };
            out[i].push(us / 1000.0);
        }
    }
}

/// ADD of `PODS` pods through the plugin; `ambient`: in a namespace labelled for
/// ambient (handed to `weir cni ambient`), else in a plain one (the plugin's fixed
/// cost: exec, the pod and namespace GETs, the answer). As kubelet orders it, the pod
/// is in the agent's watch, without an address, before its ADD, and gets its address
/// in its status after. `ebpf`: the ambient pods are captured by Weir's eBPF programs
/// (a node capture attached to a cgroup of the run's own).
fn enroll_once(ambient: bool, ebpf: bool) -> anyhow::Result<RunFigures> {
    let mesh = Mesh::new(&unique_name("bench-amb"))?;
    let mut node = AmbientNode::new(&mesh)?;
    // Declared in this order: the capture is detached before its cgroup goes.
    let cgroup =
        if ebpf { Some(weir_agent::sandbox::Cgroup::create(&unique_name("bench-amb"))?) } else { None };
    let _capture = match &cgroup {
        Some(cgroup) => {
            let guard = NodeCapture::attach("bench-amb", cgroup.path())?;
            node.env.extend([
                ("WEIR_AMBIENT_CAPTURE".into(), "ebpf".into()),
                ("WEIR_EBPF_NODE_CAPTURE".into(), guard.name().to_string()),
            ]);
            Some(guard)
        }
        None => None,
    };
    node.api.set_namespace("bench", &[("istio.io/dataplane-mode", "ambient")]);
    node.api.set_namespace("plain", &[]);
    let namespace = if ambient { "bench" } else { "plain" };
    node.start_agent()?;
    let zt = FakeZtunnel::start(&node.zds_socket());
    node.wait("the stand-in ztunnel connected", std::time::Duration::from_secs(20), || zt.connections() > 0)?;
    let mut ms = Vec::with_capacity(PODS);
    let mut steps = vec![Vec::with_capacity(PODS); STEPS.len()];
    let phases_env = [(weir_agent::node::cni::phases::ENV, "1")];
    for i in 0..PODS {
        let name = format!("p{i}");
        let pod = mesh.pod(&name)?;
        let ip = IpAddr::V4(pod.ipv4());
        let mut object = pod_object(namespace, &name, &format!("uid-{i}"), ip, &[], &[]);
        object["status"] = serde_json::json!({"phase": "Pending"});
        node.api.set_pod(object);
        // The agent's watch has the pod before its ADD, as on a node (the kubelet's ADD
        // comes after the binding the agent watches); the timer starts after.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let started = Instant::now();
        let (_, run) = node
            .cni_add_traced(&pod, namespace, &name, &phases_env)
            .map_err(|e| anyhow::anyhow!("ADD {name}: {e}"))?;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
        plugin_steps(&run, &mut steps);
        node.api.update_pod(namespace, &name, |p| {
            p["status"] =
                serde_json::json!({"phase": "Running", "podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}]});
        });
    }
    node.stop_agent()?;
    agent_steps(&node.agent_logs(), &mut steps);
    if ambient && steps[step("rules")].len() != PODS {
        anyhow::bail!("the agent's log does not time every ADD's steps; its log:\n{}", node.agent_logs());
    }
    let (p50, p99) = percentiles(ms);
    let mut figures = RunFigures { p50, p99, steps: [f64::NAN; STEPS.len()] };
    for (slot, column) in figures.steps.iter_mut().zip(steps) {
        *slot = median(column);
    }
    Ok(figures)
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    let _bpffs = weir_tests::BpffsUse::acquire()?;
    let rows = [
        "in-pod rules applied raw + one SEQPACKET round trip (floor)",
        "CNI ADD of an ambient pod until ztunnel's ack (weir-cni → weir cni ambient)",
        "the same, the pod captured by eBPF (WEIR_AMBIENT_CAPTURE=ebpf)",
        "CNI ADD of a pod that is not ambient (the same plugin's exec, GETs and answer)",
    ];
    let mut adds = vec![(Samples::default(), Samples::default()); rows.len()];
    let mut steps = vec![vec![Samples::default(); STEPS.len()]; rows.len()];
    // Run by run, every row in turn, so load from elsewhere falls on all of them.
    for run in 0..opts.runs {
        for (i, row) in rows.iter().enumerate() {
            eprintln!("[bench ambient] {row} run {}/{}", run + 1, opts.runs);
            let figures = match i {
                0 => floor_once(),
                1 => enroll_once(true, false),
                2 => enroll_once(true, true),
                _ => enroll_once(false, false),
            }
            .unwrap_or_else(|e| {
                eprintln!("[bench ambient] {row} failed: {e:#}");
                RunFigures { p50: f64::NAN, p99: f64::NAN, steps: [f64::NAN; STEPS.len()] }
            });
            adds[i].0.0.push(figures.p50);
            adds[i].1.0.push(figures.p99);
            // A step a row does not have stays empty ("-"); a failed run shows above.
            for (column, value) in steps[i].iter_mut().zip(figures.steps).filter(|(_, v)| v.is_finite()) {
                column.0.push(value);
            }
        }
    }
    let table_rows = rows
        .iter()
        .zip(adds)
        .map(|(name, (p50, p99))| Row { name: name.to_string(), metrics: vec![p50, p99] });
    let table = Table {
        title: "Ambient enrollment latency (per pod)".into(),
        columns: vec![("p50", "ms", false), ("p99", "ms", false)],
        rows: table_rows.collect(),
        notes: vec![format!(
            "{PODS} pods per run, one ADD at a time, iptables in-pod rules (Istio's default case, DNS capture on). \
             Each pod is in the agent's watch without an address before its ADD and gets its address after, as \
             kubelet orders it. The ambient row is the whole plugin exec as a runtime runs it: GET pod and \
             namespace from the test API server (loopback HTTP, side by side), Istio's add event over the agent's \
             unix socket, the agent's rules, ZDS Add and ack (the rig's stand-in ztunnel, which acks at once), \
             probe ipset entry over netlink, the pods/status annotation patch, then the answer. The not-ambient \
             row is the same plugin and API for a pod in an unlabelled namespace: what any ADD costs before its \
             pod's work. The eBPF row registers each pod with a node capture (programs verified and pinned once \
             per node, before the run) instead of the rules: its rules step is the registration, the inbound \
             filter and the in-pod route. The floor is the same rules applied raw in a fresh namespace plus one SEQPACKET round \
             trip. {}",
            opts.summary()
        )],
    };
    let step_table = Table {
        title: "Ambient ADD: where the time goes (per pod, ms)".into(),
        columns: STEPS.iter().map(|(_, label)| (*label, "ms", false)).collect(),
        rows: rows.iter().zip(steps).map(|(name, metrics)| Row { name: name.to_string(), metrics }).collect(),
        notes: vec![format!(
            "Median over the run's {PODS} ADDs, then median [min–max] over runs. The plugin's phases ({}=1): spawn → \
             main (fork, exec, loader, start-up), logs, config, API GETs (kubeconfig, pod and namespace), event → \
             answer (the add event posted and the agent's answer), result, exit (last mark to reap). The agent's \
             steps (from `steps_us` in its `pod added to the ambient mesh` line) fall inside event → answer: \
             netns (opened), rules (iptables-restore in the pod), ZDS ack (Add sent, ack read), probe set (ipset \
             over netlink), annotate (pods/status merge patch). The floor's row has its two parts under the \
             agent's steps that do the same work: the rules applied raw, and the SEQPACKET round trip. {}",
            weir_agent::node::cni::phases::ENV,
            opts.summary()
        )],
    };
    Ok(vec![table, step_table])
}
