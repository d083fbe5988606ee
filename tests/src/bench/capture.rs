//! The capture benchmark: the same load through a real Envoy sidecar for each capture
//! mode, in fresh sandbox pods per mode. The floor is the app calling Envoy's outbound
//! listener on 127.0.0.1:15001 directly (the same listener, filter chain and
//! passthrough cluster over the same loopback path, with no capture hook: the upstream
//! comes from the `x-envoy-original-dst-host` header every row sends); every other row
//! sends the app's traffic to the server's address and lets capture bring it to Envoy.
//! iperf3's floor is a tcp_proxy listener on 127.0.0.1:15201 (a TCP stream carries no
//! header to name its upstream).

use std::{
    net::SocketAddr,
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};
use weir_agent::capture::ebpf::{
    capture::CapturePrograms,
    config::{EbpfOptions, PodCapture},
    netns::netns_cookie,
};
use weir_iptables::config::{CaptureConfig, InboundPorts, IpRanges};
use weir_tests::{Cgroup, Mesh, Placement, Pod, capture::istio_iptables, envoy::Envoy};

use crate::report::{Options, Row, Samples, Table, parse_iperf, parse_wrk};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    Floor,
    Iptables,
    Nftables,
    Ebpf,
    /// eBPF with the pod's decision counters off (what counting costs).
    EbpfNoCounters,
    EbpfSkMsg,
}

impl Mode {
    pub const ALL: [Mode; 5] = [Mode::Floor, Mode::Iptables, Mode::Nftables, Mode::Ebpf, Mode::EbpfSkMsg];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Floor => "no capture (floor)",
            Mode::Iptables => "iptables REDIRECT",
            Mode::Nftables => "nftables",
            Mode::Ebpf => "eBPF",
            Mode::EbpfNoCounters => "eBPF, decision counters off",
            Mode::EbpfSkMsg => "eBPF + sk_msg",
        }
    }
}

const BACKEND: &str = r#"
admin: { address: { socket_address: { address: 127.0.0.1, port_value: 15000 } } }
static_resources:
  listeners:
  - name: backend
    address: { socket_address: { address: 0.0.0.0, port_value: 8080 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: backend
          route_config:
            virtual_hosts:
            - { name: all, domains: ["*"], routes: [ { match: { prefix: "/" }, direct_response: { status: 200, body: { inline_string: "ok" } } } ] }
          http_filters:
          - { name: envoy.filters.http.router, typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router } }
"#;

fn hcm(prefix: &str, cluster: &str) -> String {
    format!(
        r#"      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {prefix}
          route_config:
            virtual_hosts:
            - {{ name: all, domains: ["*"], routes: [ {{ match: {{ prefix: "/" }}, route: {{ cluster: {cluster} }} }} ] }}
          http_filters:
          - {{ name: envoy.filters.http.router, typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }} }}
"#
    )
}

fn tcp(prefix: &str, cluster: &str) -> String {
    format!(
        r#"      - name: envoy.filters.network.tcp_proxy
        typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: {prefix}, cluster: {cluster} }}
"#
    )
}

fn static_cluster(name: &str, addr: SocketAddr) -> String {
    format!(
        r#"  - name: {name}
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: {name}
      endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }} }} ] }} ]
"#,
        addr.ip(),
        addr.port()
    )
}

/// The sidecar: 15001 (original_dst; iperf's port by tcp_proxy, the rest over HTTP to
/// the passthrough cluster, which takes its upstream from the header when given), plus
/// iperf3's floor listener.
fn sidecar(server: std::net::Ipv4Addr) -> String {
    format!(
        r#"
admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 15000 }} }} }}
static_resources:
  listeners:
  - name: virtualOutbound
    address: {{ socket_address: {{ address: 0.0.0.0, port_value: 15001 }} }}
    listener_filters:
    - {{ name: envoy.filters.listener.original_dst, typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst }} }}
    filter_chains:
    - filter_chain_match: {{ destination_port: 5201 }}
      filters:
{tcp_out}    - filters:
{hcm_out}  - name: floorTcp
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: 15201 }} }}
    filter_chains:
    - filters:
{tcp_floor}  clusters:
  - name: PassthroughCluster
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    original_dst_lb_config: {{ use_http_header: true }}
{iperf_cluster}"#,
        tcp_out = tcp("outbound_tcp", "PassthroughCluster"),
        hcm_out = hcm("outbound_http", "PassthroughCluster"),
        tcp_floor = tcp("floor_tcp", "server_iperf"),
        iperf_cluster = static_cluster("server_iperf", SocketAddr::new(server.into(), 5201)),
    )
}

/// Captures `pod`'s outbound TCP (every destination, to 15001; no inbound capture) the
/// way `mode` does: istio-iptables' injector flags for netfilter, the capture programs
/// on `cgroup` with the pod registered for eBPF (kept attached while the value lives).
pub fn apply(mode: Mode, pod: &Pod, cgroup: &Cgroup) -> anyhow::Result<Option<CapturePrograms>> {
    match mode {
        Mode::Floor => Ok(None),
        Mode::Iptables | Mode::Nftables => {
            let mut args =
                vec!["-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-b", ""];
            if mode == Mode::Nftables {
                args.push("--native-nftables");
            }
            let out = istio_iptables(pod, &args, None);
            if !out.status.success() {
                bail!("istio-iptables: {}", String::from_utf8_lossy(&out.stderr));
            }
            Ok(None)
        }
        Mode::Ebpf | Mode::EbpfNoCounters | Mode::EbpfSkMsg => {
            let mut programs = CapturePrograms::load()?;
            programs.attach(cgroup.path())?;
            let cfg = CaptureConfig {
                outbound_ip_ranges_include: IpRanges::All,
                inbound_ports: InboundPorts::None,
                ..CaptureConfig::default()
            };
            let mut capture = PodCapture::new(
                &cfg,
                vec![pod.ipv4().into()],
                EbpfOptions { accelerate: mode == Mode::EbpfSkMsg },
            )?;
            if mode == Mode::EbpfNoCounters {
                capture.config.flags |= weir_ebpf_common::capture::flags::NO_COUNTERS;
            }
            programs.register(netns_cookie(Some(pod.netns().path()))?, &capture, None)?;
            Ok(Some(programs))
        }
    }
}

/// Runs a command in the client pod as the app (uid 1000, in the pod's cgroup).
fn app_run(pod: &Pod, cgroup: &Cgroup, program: &str, args: &[String]) -> anyhow::Result<String> {
    let mut cmd = Command::new(program);
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    let placement = Placement { user: Some((1000, 1000)), cgroup: Some(cgroup), ..Placement::default() };
    let out = pod.spawn_placed(&mut cmd, placement)?.into_inner().wait_with_output()?;
    if !out.status.success() {
        bail!("{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

struct Measured {
    rps: Samples,
    p50: Samples,
    p99: Samples,
    conns: Samples,
    gbps: Samples,
    /// Load that failed (the row shows NaN for it).
    failures: Vec<String>,
}

fn measure(mode: Mode, opts: &Options) -> anyhow::Result<Measured> {
    let mesh = Mesh::new(&format!("bench-{mode:?}"))?;
    let client = mesh.pod("client")?;
    let server = mesh.pod("server")?;
    let cgroup = Cgroup::create(&weir_agent::sandbox::unique_name("bench"))?;
    let _backend =
        Envoy::start(&server, BACKEND, "127.0.0.1:15000".parse()?, 1337).context("backend Envoy")?;
    let _iperf = start_iperf(&server)?;
    let sidecar_place = Placement { user: Some((1337, 1337)), cgroup: Some(&cgroup), ..Placement::default() };
    let _sidecar =
        Envoy::start_placed(&client, &sidecar(server.ipv4()), "127.0.0.1:15000".parse()?, sidecar_place)
            .context("sidecar Envoy")?;

    let _programs = apply(mode, &client, &cgroup)?;
    let (http, iperf) = if mode == Mode::Floor {
        ("127.0.0.1:15001".to_string(), ("127.0.0.1".to_string(), 15201))
    } else {
        (format!("{}:8080", server.ipv4()), (server.ipv4().to_string(), 5201))
    };
    let upstream = format!("x-envoy-original-dst-host: {}:8080", server.ipv4());
    let d = opts.duration_secs.to_string();
    let c = opts.connections.to_string();
    // Warm up Envoy's connection pools and caches.
    app_run(
        &client,
        &cgroup,
        "wrk",
        &["-t1", "-c4", "-d1s", "-H", &upstream, &format!("http://{http}/")].map(String::from),
    )?;
    let mut m = Measured {
        rps: Samples::default(),
        p50: Samples::default(),
        p99: Samples::default(),
        conns: Samples::default(),
        gbps: Samples::default(),
        failures: Vec::new(),
    };
    for _ in 0..opts.runs {
        let out = app_run(
            &client,
            &cgroup,
            "wrk",
            &[
                "-t1".into(),
                format!("-c{c}"),
                format!("-d{d}s"),
                "--latency".into(),
                "-H".into(),
                upstream.clone(),
                format!("http://{http}/"),
            ],
        )?;
        let (rps, p50, p99) = parse_wrk(&out).with_context(|| format!("wrk output: {out}"))?;
        m.rps.0.push(rps);
        m.p50.0.push(p50);
        m.p99.0.push(p99);
        let out = app_run(
            &client,
            &cgroup,
            "wrk",
            &[
                "-t1".into(),
                format!("-c{c}"),
                format!("-d{d}s"),
                "-H".into(),
                "Connection: close".into(),
                "-H".into(),
                upstream.clone(),
                format!("http://{http}/"),
            ],
        )?;
        m.conns.0.push(parse_wrk(&format!("{out}\n50% 0ms\n99% 0ms")).map(|r| r.0).unwrap_or(f64::NAN));
        match app_run(
            &client,
            &cgroup,
            "iperf3",
            &[
                "-c".into(),
                iperf.0.clone(),
                "-p".into(),
                iperf.1.to_string(),
                "-t".into(),
                d.clone(),
                "-J".into(),
            ],
        ) {
            Ok(out) => match parse_iperf(&out) {
                Some(gbps) => m.gbps.0.push(gbps),
                None => {
                    let error = serde_json::from_str::<serde_json::Value>(&out)
                        .ok()
                        .and_then(|v| v["error"].as_str().map(String::from))
                        .with_context(|| format!("iperf3 output: {out}"))?;
                    m.failures.push(format!("iperf3 failed: {error}"));
                    m.gbps.0.push(f64::NAN);
                }
            },
            Err(e) => {
                let text = e.to_string();
                let why = text
                    .lines()
                    .find(|l| l.contains("\"error\""))
                    .map(|l| l.trim().to_string())
                    .unwrap_or(text);
                m.failures.push(format!("iperf3 failed: {why}"));
                m.gbps.0.push(f64::NAN);
            }
        }
    }
    Ok(m)
}

fn start_iperf(server: &Pod) -> anyhow::Result<weir_tests::PodChild> {
    let mut cmd = Command::new("iperf3");
    cmd.args(["-s", "-p", "5201"]).stdout(Stdio::null()).stderr(Stdio::null());
    let child = server.spawn(&mut cmd, 0)?;
    // iperf3 -s has no readiness line; wait for its port.
    for _ in 0..100 {
        let addr = SocketAddr::new(server.ipv4().into(), 5201);
        if server.run(|| async move {
            std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(100)).is_ok()
        })? {
            return Ok(child);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    bail!("iperf3 server did not start")
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    weir_agent::support::privileges::require(
        &[
            weir_agent::support::privileges::Capability::SysAdmin,
            weir_agent::support::privileges::Capability::NetAdmin,
            weir_agent::support::privileges::Capability::Bpf,
        ],
        "weir-bench capture",
    )?;
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for mode in Mode::ALL {
        eprintln!("weir-bench: measuring {} ({} runs of {}s)", mode.name(), opts.runs, opts.duration_secs);
        let m = measure(mode, opts)?;
        notes.extend(m.failures.iter().map(|f| format!("{}: {f}", mode.name())));
        rows.push(Row { name: mode.name().into(), metrics: vec![m.rps, m.p50, m.p99, m.conns, m.gbps] });
    }
    let table = Table {
        title: "Capture data path through a real Envoy (median [min–max])".into(),
        columns: vec![
            ("requests/s", "req/s", true),
            ("p50", "ms", false),
            ("p99", "ms", false),
            ("new connections/s", "conn/s", true),
            ("TCP throughput", "Gbit/s", true),
        ],
        rows,
        notes: std::iter::once(format!(
            "wrk -t1 -c{} -d{}s (keep-alive; and with Connection: close for new connections), every row naming the upstream in x-envoy-original-dst-host; iperf3 -t {} through Envoy's tcp_proxy; {} runs per mode, fresh pods per mode. Envoy and wrk share the machine's cores with the kernel's work, so capture's own cost is small next to theirs here: the data-path benchmark measures it alone.",
            opts.connections, opts.duration_secs, opts.duration_secs, opts.runs
        ))
        .chain(notes)
        .collect(),
    };
    Ok(vec![table])
}
