//! `weir-bench ambient`: what enrolling an ambient pod costs. CNI ADD of an ambient pod
//! until ztunnel's ack (the plugin exec'd as a runtime does: the pod and its namespace
//! read from the test API server, Istio's event posted to `weir cni ambient`, which
//! applies the in-pod rules, sends the pod over ZDS and answers only after the ack,
//! adds the pod's address to the probe ipset and annotates it), p50/p99 over 50 pods,
//! against the floor: the same in-pod rules applied raw (`apply_inpod` in a fresh
//! namespace) plus one SEQPACKET round trip of an Add-sized datagram. The ztunnel is
//! the rig's stand-in, which acks at once (the real ztunnel's proxy start is ztunnel's
//! cost, not the agent's).

use std::{net::IpAddr, time::Instant};

use weir_agent::sandbox::{Mesh, unique_name};
use weir_iptables::ambient::{AmbientConfig, apply_inpod};
use weir_tests::{
    ambient::{AmbientNode, pod_object},
    fake_ztunnel::FakeZtunnel,
};

use crate::report::{Options, Row, Table, repeat_pair};

/// Pods per run.
const PODS: usize = 50;

fn percentiles(mut ms: Vec<f64>) -> (f64, f64) {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// The floor: rules applied raw in `PODS` fresh namespaces, each plus one SEQPACKET
/// round trip of a 600-byte datagram (an Add with a long pod name) and its 2-byte ack.
fn floor_once() -> anyhow::Result<(f64, f64)> {
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
    for i in 0..PODS {
        let pod = mesh.pod(&format!("p{i}"))?;
        let started = Instant::now();
        apply_inpod(pod.netns().path(), &cfg)?;
        send(agent.as_raw_fd(), &request, MsgFlags::empty())?;
        let mut ack = [0u8; 64];
        recv(agent.as_raw_fd(), &mut ack, MsgFlags::empty())?;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    drop(agent);
    let _ = echo.join();
    Ok(percentiles(ms))
}

/// ADD of `PODS` ambient pods through the plugin and `weir cni ambient`.
fn enroll_once() -> anyhow::Result<(f64, f64)> {
    let mesh = Mesh::new(&unique_name("bench-amb"))?;
    let mut node = AmbientNode::new(&mesh)?;
    node.api.set_namespace("bench", &[("istio.io/dataplane-mode", "ambient")]);
    node.start_agent()?;
    let zt = FakeZtunnel::start(&node.zds_socket());
    node.wait("the stand-in ztunnel connected", std::time::Duration::from_secs(20), || zt.connections() > 0)?;
    let mut ms = Vec::with_capacity(PODS);
    for i in 0..PODS {
        let name = format!("p{i}");
        let pod = mesh.pod(&name)?;
        node.api.set_pod(pod_object("bench", &name, &format!("uid-{i}"), IpAddr::V4(pod.ipv4()), &[], &[]));
        // The agent's watch has the pod before its ADD, as on a node (the kubelet's ADD
        // comes after the binding the agent watches); the timer starts after.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let started = Instant::now();
        node.cni_add(&pod, "bench", &name).map_err(|e| anyhow::anyhow!("ADD {name}: {e}"))?;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    node.stop_agent()?;
    Ok(percentiles(ms))
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    let floor = "in-pod rules applied raw + one SEQPACKET round trip (floor)";
    let measured = "CNI ADD of an ambient pod until ztunnel's ack (weir-cni → weir cni ambient)";
    let (f50, f99) = repeat_pair("ambient", floor, opts.runs, floor_once);
    let (e50, e99) = repeat_pair("ambient", measured, opts.runs, enroll_once);
    let table = Table {
        title: "Ambient enrollment latency (per pod)".into(),
        columns: vec![("p50", "ms", false), ("p99", "ms", false)],
        rows: vec![
            Row { name: floor.into(), metrics: vec![f50, f99] },
            Row { name: measured.into(), metrics: vec![e50, e99] },
        ],
        notes: vec![format!(
            "{PODS} pods per run, one ADD at a time, iptables in-pod rules (Istio's default case, DNS capture on). \
             The ADD row is the whole plugin exec as a runtime runs it: GET pod and namespace from the test API \
             server (loopback HTTP), Istio's add event over the agent's unix socket, the agent's rules, ZDS Add and \
             ack (the rig's stand-in ztunnel, which acks at once), probe ipset entry over netlink, the \
             pods/status annotation patch, then the answer. The floor is the same rules applied raw in a fresh \
             namespace plus one SEQPACKET round trip. Median [min–max] of {} runs.",
            opts.runs
        )],
    };
    Ok(vec![table])
}
