//! `weir demo`: Weir's main job on an embedded default, in sandbox pods on this host.
//! For now it shows the capture foundation: the eBPF probe attached to a pod's cgroup
//! counts the connections an app in that pod makes, while a process outside the cgroup
//! goes unseen. Everything it creates is removed on exit, Ctrl-C included.

use std::{
    net::{SocketAddr, TcpStream},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{
    cli::DemoArgs,
    ebpf::probe::ConnectCounter,
    privileges::{self, Capability},
    sandbox::{Cgroup, Mesh, Placement, unique_name},
};

const ECHO_PORT: u16 = 8080;

/// Runs the demo; returns when it has shown its result (or `--duration` elapsed).
pub fn run(args: &DemoArgs) -> anyhow::Result<()> {
    privileges::require(&[Capability::SysAdmin, Capability::NetAdmin, Capability::Bpf], "weir demo")?;
    let started = Instant::now();
    step("sandbox", "creating pod `app` (network namespace + cgroup)");
    let mesh = Mesh::new("demo")?;
    let app = mesh.pod("app")?;
    let cgroup = Cgroup::create(&unique_name("demo-app"))?;
    step("capture", &format!("attaching eBPF connect4 probe to {}", cgroup.path().display()));
    let counter = ConnectCounter::attach(cgroup.path())?;

    let server: SocketAddr = (app.ipv4(), ECHO_PORT).into();
    let _server = app.netns().spawn_thread(move || async move { echo_server(server).await })?;
    wait_listening(&app, server)?;
    step("server", &format!("echo server on {server}"));

    let exe = std::env::current_exe().context("find the weir binary")?;
    let rounds = args.duration.map(|d| d.max(1)).unwrap_or(3);
    for round in 1..=rounds {
        let mut inside = Command::new(&exe);
        inside.args(["demo-app", &server.to_string(), "5"]).stdout(Stdio::null());
        let mut child =
            app.spawn_placed(&mut inside, Placement { cgroup: Some(&cgroup), ..Placement::default() })?;
        let status = child.child_mut().wait()?;
        if !status.success() {
            bail!("the app in the cgroup failed: {status}");
        }
        let mut outside = Command::new(&exe);
        outside.args(["demo-app", &server.to_string(), "2"]).stdout(Stdio::null());
        let mut other = app.spawn_placed(&mut outside, Placement::default())?;
        other.child_mut().wait()?;
        step(
            "traffic",
            &format!(
                "round {round}: app in cgroup made 5 connects, a process outside made 2; probe counted {}",
                counter.count()?
            ),
        );
        if args.duration.is_some() {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
    let total = counter.count()?;
    let expected = 5 * rounds;
    step("result", &format!("{total} connects seen, {expected} expected: only the pod's cgroup is captured"));
    drop(counter);
    step("cleanup", &format!("removing pod, cgroup and probe after {:.1}s", started.elapsed().as_secs_f64()));
    if total != expected {
        bail!("the probe counted {total} connects, expected {expected}");
    }
    Ok(())
}

fn step(name: &str, text: &str) {
    println!("[demo] {name:<8} {text}");
}

async fn echo_server(addr: SocketAddr) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt as _;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    loop {
        let (mut stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            let (mut r, mut w) = stream.split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
            let _ = w.shutdown().await;
        });
    }
}

fn wait_listening(pod: &crate::sandbox::Pod, addr: SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ok =
            pod.run(|| async move { TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() })?;
        if ok {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("demo server on {addr} did not start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The demo's app: connects `count` times to `addr` (hidden subcommand `demo-app`).
pub fn app(addr: &str, count: u32) -> anyhow::Result<()> {
    let addr: SocketAddr = addr.parse().with_context(|| format!("demo-app address {addr:?}"))?;
    for _ in 0..count {
        TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .with_context(|| format!("connect {addr}"))?;
    }
    Ok(())
}
