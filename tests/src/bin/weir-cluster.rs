//! weir-cluster: the node rig by hand (scripts/rig runs it).
//!
//!   up       three nodes in a box (containerd, the kubelet stand-in, Weir's DaemonSet,
//!            istiod, ztunnel, sidecar/ambient/plain pods calling each other); prints
//!            the traffic's numbers every 10 s until Ctrl-C, then tears it all down
//!   events   the same, then every event of the node rig test, each judged; torn down
//!            at the end, on the first failed judgement, or after Ctrl-C (between events)
//!
//! Run as root. Nothing is left on the machine afterwards (`weir sandbox list` checks).

use std::{
    process::ExitCode,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use weir_tests::cluster::scene::{Scene, Touched};

/// Ctrl-C and SIGTERM set the flag (the scene is torn down by the main thread).
fn stop_flag() -> anyhow::Result<Arc<AtomicBool>> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block()?;
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    std::thread::spawn(move || {
        while set.wait().is_ok() {
            eprintln!("[rig] stopping: tearing the rig down");
            f.store(true, Ordering::SeqCst);
        }
    });
    Ok(flag)
}

fn run(command: &str) -> anyhow::Result<()> {
    if !nix::unistd::Uid::effective().is_root() {
        anyhow::bail!("run as root: the rig makes network namespaces, cgroups and runs containerd");
    }
    let stop = stop_flag()?;
    let mut scene = Scene::up("weir-cluster")?;
    match command {
        "up" => {
            scene.progress.step("up: Ctrl-C tears it down");
            let mut mark = weir_tests::busynode::now_ms();
            while !stop.load(Ordering::SeqCst) {
                for _ in 0..10 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
                if let Err(e) = scene.judge("the last 10 s", mark, &Touched::none()) {
                    eprintln!("{e:#}");
                }
                mark = weir_tests::busynode::now_ms();
            }
            Ok(())
        }
        "events" => {
            let s = stop.clone();
            scene.run_events(&move || s.load(Ordering::SeqCst))?;
            scene.progress.step("every event judged: tearing the rig down");
            Ok(())
        }
        other => anyhow::bail!("unknown command {other:?}: up or events"),
    }
}

fn main() -> ExitCode {
    let command = std::env::args().nth(1).unwrap_or_default();
    match run(&command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weir-cluster: {e:#}");
            ExitCode::FAILURE
        }
    }
}
