//! The order the events run in, each judged on its window: what the node rig test and
//! `weir-cluster events` run.

use std::time::Duration;

use anyhow::bail;

use super::{Call, DEV_IMAGE, NEXT_IMAGE, Scene, Touched};
use crate::{
    busynode::now_ms,
    cluster::workloads::{Capture, Kind, Sidecar},
};

/// How long each window runs on after its event, before the calls are checked again:
/// every call has its rounds.
const AFTER: Duration = Duration::from_secs(6);

impl Scene {
    /// The traffic window after an event: `AFTER`, then every call answered again.
    fn after_event(&self) -> anyhow::Result<()> {
        std::thread::sleep(AFTER);
        self.settle()
    }

    /// Every event, one after another, each judged; `stop` is asked between events (an
    /// operator's Ctrl-C).
    pub fn run_events(&mut self, stop: &dyn Fn() -> bool) -> anyhow::Result<()> {
        let check_stop = || if stop() { bail!("stopped between events") } else { Ok(()) };

        let mark = now_ms();
        self.after_event()?;
        self.judge("steady", mark, &Touched::none())?;
        self.assert_hbone("a1", "a2")?;
        check_stop()?;

        let mark = now_ms();
        for node in 1..=3 {
            self.progress.step(&format!("roll node-{node} to weir-cni:next"));
            self.roll_node(node, NEXT_IMAGE)?;
        }
        self.progress.step("a pod started under the next version (r2: CNI, native sidecar)");
        let r2 = self.start("r2", 2, Kind::Sidecar(Capture::Cni, Sidecar::Native))?;
        self.workloads.push(r2);
        self.calls.push(Call { client: "r2".into(), server: "s3".into(), path: "/".into() });
        self.wait_all_ready()?;
        self.sync()?;
        self.after_event()?;
        self.judge("DaemonSet rolled to the next version", mark, &Touched::pods(["r2"]))?;
        check_stop()?;

        let mark = now_ms();
        for node in 1..=3 {
            self.progress.step(&format!("roll node-{node} back to weir-cni:dev"));
            self.roll_node(node, DEV_IMAGE)?;
        }
        self.after_event()?;
        self.judge("DaemonSet rolled back", mark, &Touched::none())?;
        let mark = now_ms();
        self.progress.step("r2 deleted: no pod is left on the next version's program set");
        self.delete_all(&["r2".to_string()])?;
        self.after_event()?;
        self.judge("the next version's last pod deleted", mark, &Touched::pods(["r2"]))?;
        check_stop()?;

        let mark = now_ms();
        self.progress.step("restart containerd on node-2");
        self.restart_containerd(2)?;
        self.after_event()?;
        self.judge("containerd restarted on node-2", mark, &Touched::none())?;
        check_stop()?;

        let mark = now_ms();
        self.progress.step("kill the node agent's containers on node-1");
        self.kill_agent(1)?;
        self.after_event()?;
        self.judge("node agent killed on node-1", mark, &Touched::none())?;
        check_stop()?;

        let mark = now_ms();
        self.progress.step("reboot node-3, its agent's pod held back");
        let touched = self.pods_on(3);
        self.reboot(3)?;
        self.wait_all_ready()?;
        self.sync()?;
        self.after_event()?;
        self.judge("node-3 rebooted", mark, &touched)?;
        check_stop()?;

        let mark = now_ms();
        self.progress.step("delete c2 (classic sidecar) with a request of s1 in flight");
        self.delete_draining("c2", "s1")?;
        self.after_event()?;
        self.judge("c2 deleted while serving", mark, &Touched::none())?;
        check_stop()?;

        let mark = now_ms();
        self.progress.step("20 pods at once on node-2");
        let burst = self.start_many(2, 20)?;
        self.after_event()?;
        let touched = Touched::pods(burst.iter().map(String::as_str));
        self.judge("20 pods started at once", mark, &touched)?;
        self.progress.step(&format!(
            "node-2's containerd root with the 20 pods and its others: {} MiB on disk",
            self.cluster.node(2).containerd.disk_use() >> 20
        ));
        let mark = now_ms();
        self.after_event()?;
        self.judge("20 pods running", mark, &Touched::none())?;
        let mark = now_ms();
        self.progress.step("the 20 pods deleted at once");
        self.delete_all(&burst)?;
        self.after_event()?;
        self.judge("20 pods deleted", mark, &touched)?;
        Ok(())
    }
}
