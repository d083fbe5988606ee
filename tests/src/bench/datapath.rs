//! The capture data path without Envoy: what capture itself costs. In a fresh pod per
//! mode, an acceptor on 15001 (uid 1337, pinned to one CPU) asks every connection for
//! its original destination and serves it; a client (uid 1000, pinned to the other
//! CPU) makes the same load for every mode. The floor connects to 127.0.0.1:15001
//! directly (the same loopback path with no capture hook); every other row dials the
//! server pod's address and lets capture bring it to the acceptor, which must report
//! that address as the original destination or the connection counts as failed. CPU is
//! the pod cgroup's `usage_usec` (both processes, and the softirq work done in their
//! context: this kernel has no IRQ time accounting) and the machine's busy time.

use std::{
    io::{BufRead as _, BufReader},
    net::SocketAddrV4,
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};
use weir_tests::{Cgroup, Mesh, Placement, Pod, PodChild, datapath::LoadResult, tools::testkit};

use crate::{
    capture::{Mode, apply},
    report::{Options, Row, Samples, Table},
};

/// Connections per connect run, and seconds per request/response and bulk run.
const CONNECTIONS: u64 = 3000;
const SECS: f64 = 2.0;

/// One mode's samples, a run per entry.
#[derive(Default)]
struct Figures {
    conn_rate: Samples,
    conn_p50: Samples,
    conn_p99: Samples,
    cpu_per_conn: Samples,
    host_cpu_per_conn: Samples,
    rr1: Samples,
    rr1_p99: Samples,
    rr16: Samples,
    cpu_per_rr: Samples,
    bulk_gbps: Samples,
    cpu_per_gib: Samples,
    failures: Vec<String>,
}

fn acceptor(pod: &Pod, cgroup: &Cgroup) -> anyhow::Result<PodChild> {
    let mut cmd = Command::new(testkit());
    cmd.args(["datapath-serve", "0.0.0.0:15001", "--cpu", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let placement = Placement { user: Some((1337, 1337)), cgroup: Some(cgroup), ..Placement::default() };
    let mut child = pod.spawn_placed(&mut cmd, placement)?;
    let stdout = child.child_mut().stdout.take().context("acceptor stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    if !line.starts_with("listening") {
        bail!("the acceptor did not start: {line:?}");
    }
    Ok(child)
}

#[allow(clippy::too_many_arguments)]
fn load(
    pod: &Pod,
    cgroup: &Cgroup,
    kind: &str,
    to: SocketAddrV4,
    expect: Option<SocketAddrV4>,
    count: u64,
    inflight: usize,
) -> anyhow::Result<LoadResult> {
    let mut cmd = Command::new(testkit());
    cmd.args(["datapath-load", kind, &to.to_string()])
        .arg(expect.map_or("none".into(), |a| a.to_string()))
        .args([count.to_string(), SECS.to_string(), inflight.to_string()])
        .arg(cgroup.path())
        .args(["--cpu", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let placement = Placement { user: Some((1000, 1000)), cgroup: Some(cgroup), ..Placement::default() };
    let out = pod.spawn_placed(&mut cmd, placement)?.into_inner().wait_with_output()?;
    if !out.status.success() {
        bail!("datapath-load {kind}: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("datapath-load output: {}", String::from_utf8_lossy(&out.stdout)))
}

/// A run's figure, or NaN with the failure noted when any of its operations failed.
fn checked(r: &LoadResult, what: &str, failures: &mut Vec<String>, value: f64) -> f64 {
    if r.failed > 0 {
        failures.push(format!("{what}: {} failed: {}", r.failed, r.errors.join("; ")));
        return f64::NAN;
    }
    value
}

fn measure(mode: Mode, opts: &Options) -> anyhow::Result<Figures> {
    let mesh = Mesh::new(&format!("dp-{mode:?}"))?;
    let client = mesh.pod("client")?;
    let server = mesh.pod("server")?;
    let cgroup = Cgroup::create(&weir_agent::sandbox::unique_name("datapath"))?;
    let _programs = apply(mode, &client, &cgroup)?;
    let _acceptor = acceptor(&client, &cgroup)?;
    let (to, expect) = match mode {
        Mode::Floor => ("127.0.0.1:15001".parse()?, None),
        _ => {
            let orig = SocketAddrV4::new(server.ipv4(), 8080);
            (orig, Some(orig))
        }
    };
    // Warm up: caches, conntrack, the programs' maps.
    load(&client, &cgroup, "connect", to, expect, 200, 1)?;
    let mut f = Figures::default();
    for run in 0..opts.runs {
        eprintln!("[bench datapath] {} run {}/{}", mode.name(), run + 1, opts.runs);
        let c = load(&client, &cgroup, "connect", to, expect, CONNECTIONS, 1)?;
        let n = c.ops.max(1) as f64;
        let fail = &mut f.failures;
        f.conn_rate.0.push(checked(&c, "connect", fail, c.ops as f64 / c.secs));
        f.conn_p50.0.push(checked(&c, "connect", fail, c.p50_us.unwrap_or(f64::NAN)));
        f.conn_p99.0.push(checked(&c, "connect", fail, c.p99_us.unwrap_or(f64::NAN)));
        f.cpu_per_conn.0.push(checked(&c, "connect", fail, c.cgroup_cpu_us.unwrap_or(f64::NAN) / n));
        f.host_cpu_per_conn.0.push(checked(&c, "connect", fail, c.host_cpu_us / n));

        let r1 = load(&client, &cgroup, "rr", to, expect, 0, 1)?;
        f.rr1.0.push(checked(&r1, "request/response x1", fail, r1.ops as f64 / r1.secs));
        f.rr1_p99.0.push(checked(&r1, "request/response x1", fail, r1.p99_us.unwrap_or(f64::NAN)));
        let r16 = load(&client, &cgroup, "rr", to, expect, 0, 16)?;
        f.rr16.0.push(checked(&r16, "request/response x16", fail, r16.ops as f64 / r16.secs));
        let per = r16.cgroup_cpu_us.unwrap_or(f64::NAN) / r16.ops.max(1) as f64;
        f.cpu_per_rr.0.push(checked(&r16, "request/response x16", fail, per));

        let b = load(&client, &cgroup, "bulk", to, expect, 0, 1)?;
        f.bulk_gbps.0.push(checked(&b, "bulk", fail, b.bytes as f64 * 8.0 / b.secs / 1e9));
        let gib = b.bytes as f64 / (1u64 << 30) as f64;
        f.cpu_per_gib.0.push(checked(&b, "bulk", fail, b.cgroup_cpu_us.unwrap_or(f64::NAN) / 1000.0 / gib));
    }
    Ok(f)
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    use weir_agent::support::privileges::{Capability, require};
    require(&[Capability::SysAdmin, Capability::NetAdmin, Capability::Bpf], "weir-bench datapath")?;
    if std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) < 2 {
        bail!("weir-bench datapath pins the client and the acceptor to CPUs 0 and 1: this machine has one");
    }
    let (mut conn, mut rr, mut bulk, mut notes) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let modes =
        [Mode::Floor, Mode::Iptables, Mode::Nftables, Mode::Ebpf, Mode::EbpfNoCounters, Mode::EbpfSkMsg];
    for mode in modes {
        let f = measure(mode, opts).with_context(|| mode.name())?;
        notes.extend(f.failures.iter().map(|e| format!("{}: {e}", mode.name())));
        let name = mode.name().to_string();
        conn.push(Row {
            name: name.clone(),
            metrics: vec![f.conn_rate, f.conn_p50, f.conn_p99, f.cpu_per_conn, f.host_cpu_per_conn],
        });
        rr.push(Row { name: name.clone(), metrics: vec![f.rr1, f.rr1_p99, f.rr16, f.cpu_per_rr] });
        bulk.push(Row { name, metrics: vec![f.bulk_gbps, f.cpu_per_gib] });
    }
    let how = format!(
        "Acceptor (uid 1337, CPU 1) and client (uid 1000, CPU 0) in one pod cgroup; the floor connects to 127.0.0.1:15001, the rest dial the server pod's address and are captured. {} runs per mode, median [min–max]; fresh pod per mode.",
        opts.runs
    );
    Ok(vec![
        Table {
            title: "Capture data path without Envoy: new connections".into(),
            columns: vec![
                ("new connections/s", "conn/s", true),
                ("connect→served p50", "µs", false),
                ("connect→served p99", "µs", false),
                ("CPU per connection, pod cgroup", "µs", false),
                ("CPU per connection, machine", "µs", false),
            ],
            rows: conn,
            notes: std::iter::once(format!(
                "{CONNECTIONS} connections per run, one at a time: connect, the acceptor's accept and SO_ORIGINAL_DST, its answer, close. {how}"
            ))
            .chain(notes)
            .collect(),
        },
        Table {
            title: "Capture data path without Envoy: request/response on kept connections".into(),
            columns: vec![
                ("round trips/s, 1 in flight", "rt/s", true),
                ("p99, 1 in flight", "µs", false),
                ("round trips/s, 16 in flight", "rt/s", true),
                ("CPU per round trip (16), pod cgroup", "µs", false),
            ],
            rows: rr,
            notes: vec![format!("{} B request, {} B response, {SECS} s per run. {how}", weir_tests::datapath::REQUEST, weir_tests::datapath::REQUEST)],
        },
        Table {
            title: "Capture data path without Envoy: bulk transfer".into(),
            columns: vec![("throughput", "Gbit/s", true), ("CPU per GiB, pod cgroup", "ms", false)],
            rows: bulk,
            notes: vec![format!(
                "One connection writing 64 KiB chunks for {SECS} s; the acceptor counts what arrived (a short count or a failed write fails the run). {how}"
            )],
        },
    ])
}
