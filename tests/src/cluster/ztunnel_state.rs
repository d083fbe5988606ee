//! What ztunnel on a node holds, read as an operator reads it: its admin
//! `/config_dump` (127.0.0.1:15000 in ztunnel's own network namespace), whose
//! `workloadState` maps each pod uid the node agent handed it to `Up` or `Pending`
//! (ztunnel's src/inpod/admin.rs). A watch samples it through an event, so a test can
//! say whether ztunnel was ever without a pod it had. A read that fails is an error in
//! the samples, never an empty map.

use std::{
    collections::{BTreeMap, BTreeSet},
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::rig::Cluster;

/// uid → state (`Up`, `Pending`).
pub type WorkloadState = BTreeMap<String, String>;

/// The pid of ztunnel's process on `node` (its `istio-proxy` container's task).
pub fn ztunnel_pid(cluster: &Cluster, node: u8) -> anyhow::Result<u32> {
    cluster.container_pid("istio-system", &format!("ztunnel-{node}"), Some("istio-proxy"))
}

/// ztunnel's `workloadState`, read in the network namespace of process `pid`.
pub fn read(pid: u32) -> anyhow::Result<WorkloadState> {
    let out = Command::new("nsenter")
        .arg(format!("--net=/proc/{pid}/ns/net"))
        .args(["curl", "-sS", "--max-time", "2", "http://127.0.0.1:15000/config_dump"])
        .output()
        .context("run curl in ztunnel's namespace")?;
    if !out.status.success() {
        bail!("ztunnel's /config_dump: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let dump: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("ztunnel's /config_dump as JSON")?;
    let state =
        dump.get("workloadState").and_then(|s| s.as_object()).context("no workloadState in /config_dump")?;
    Ok(state.iter().map(|(uid, v)| (uid.clone(), v["state"].as_str().unwrap_or("?").to_string())).collect())
}

/// What was read at each moment since the watch started.
type Samples = Vec<(Duration, anyhow::Result<WorkloadState>)>;

/// Samples of ztunnel's state every `every` on a thread of its own, until finished.
pub struct Watch {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Samples>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watch {
    pub fn start(pid: u32, every: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let samples: Arc<Mutex<Samples>> = Arc::default();
        let (s, out) = (stop.clone(), samples.clone());
        let thread = std::thread::spawn(move || {
            let start = Instant::now();
            while !s.load(Ordering::SeqCst) {
                let sample = read(pid);
                out.lock().expect("samples").push((start.elapsed(), sample));
                std::thread::sleep(every);
            }
        });
        Self { stop, samples, thread: Some(thread) }
    }

    /// Stops sampling; fails naming the first sample where a pod of `had` was missing
    /// (or not `Up`), or the first read that failed.
    pub fn finish(mut self, had: &BTreeSet<String>) -> anyhow::Result<usize> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let samples = std::mem::take(&mut *self.samples.lock().expect("samples"));
        for (at, sample) in &samples {
            let state =
                sample.as_ref().map_err(|e| anyhow::anyhow!("ztunnel unreadable at {at:?}: {e:#}"))?;
            let lost: Vec<&String> =
                had.iter().filter(|uid| state.get(*uid).map(String::as_str) != Some("Up")).collect();
            if !lost.is_empty() {
                bail!("at {at:?} ztunnel was without pods it had (uid: state): {lost:?} in {state:?}");
            }
        }
        if samples.is_empty() {
            bail!("no sample of ztunnel's state was taken");
        }
        Ok(samples.len())
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
