//! One node's containerd (Debian's 1.6, its CRI plugin built in) as the node's runtime:
//! its own root, state and socket under the node's folder, started inside the node's
//! network and mount namespaces with `nsenter` (`ip netns exec` would remount /sys and
//! runc would find no cgroup mount), with the settings this VM needs (`../shared/cri/
//! README.md`): `restrict_oom_score_adj`, runc with the cgroupfs driver, and
//! containerd's default snapshotter, overlayfs ([`SNAPSHOTTER`]). Its CNI folders are
//! the standard ones, which the node's mount namespace binds to the node's own.
//! Stopping it leaves its containers running (their shims are their own processes), as
//! on a node; [`Containerd::kill_all`] is a reboot's end of them.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

/// The sandbox image every node imports (a pause: a static binary that waits).
pub const PAUSE_IMAGE: &str = "localhost/weir-rig-pause:dev";

/// The snapshotter the CRI plugin and `ctr images import` both use: overlayfs, as on a
/// real node. (The native snapshotter copies an image's whole file system for every
/// container: the rig's pods filled a CI machine's disk with copies, and the images
/// were unpacked twice, once for `ctr`'s default and once for the CRI's.)
pub const SNAPSHOTTER: &str = "overlayfs";

/// A node's containerd, its folders and its process.
pub struct Containerd {
    /// `<node>/containerd`: config, root, state, socket, log.
    pub dir: PathBuf,
    pub socket: PathBuf,
    netns: PathBuf,
    mount_ns: PathBuf,
    process: Option<Child>,
    starts: u32,
}

impl Containerd {
    /// The config.
    fn config(&self) -> String {
        format!(
            r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[debug]
  level = "info"
[plugins."io.containerd.grpc.v1.cri"]
  restrict_oom_score_adj = true
  disable_apparmor = true
  sandbox_image = "{PAUSE_IMAGE}"
  enable_unprivileged_ports = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "{SNAPSHOTTER}"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
    max_conf_num = 1
"#,
            root = self.dir.join("root").display(),
            state = self.dir.join("state").display(),
            socket = self.socket.display(),
        )
    }

    /// Not started: a value to hold the place while the node's namespaces are made.
    pub fn placeholder(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            socket: dir.join("c.sock"),
            netns: PathBuf::new(),
            mount_ns: PathBuf::new(),
            process: None,
            starts: 0,
        }
    }

    /// Writes the config and starts containerd in the namespaces `netns` and `mount_ns`;
    /// returns once its socket appears.
    pub fn start(dir: &Path, netns: &Path, mount_ns: PathBuf) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut me = Self::placeholder(dir);
        me.netns = netns.to_path_buf();
        me.mount_ns = mount_ns;
        std::fs::write(dir.join("config.toml"), me.config())?;
        me.restart()?;
        Ok(me)
    }

    /// After a reboot: the node's new mount namespace.
    pub fn set_mount_ns(&mut self, mount_ns: PathBuf) {
        self.mount_ns = mount_ns;
    }

    /// Starts containerd again (after [`Containerd::stop`], or a reboot).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.starts += 1;
        let log = std::fs::File::create(self.dir.join(format!("containerd-{}.log", self.starts)))?;
        let _ = std::fs::remove_file(&self.socket);
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.netns.display()))
            .arg(format!("--mount={}", self.mount_ns.display()))
            .arg("--")
            .arg("containerd")
            .arg("--config")
            .arg(self.dir.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("start containerd (apt-get install containerd runc: scripts/bootstrap test)")?;
        self.process = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.socket.exists() {
            if let Some(status) = self.process.as_mut().and_then(|p| p.try_wait().ok().flatten()) {
                bail!("containerd exited ({status}): {}", self.log());
            }
            if Instant::now() > deadline {
                bail!("containerd's socket {} did not appear in 30 s: {}", self.socket.display(), self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Stops containerd (SIGTERM, then SIGKILL); its containers keep running.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.process.take() {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(p.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while p.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = p.kill();
            let _ = p.wait();
        }
    }

    /// The last run's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join(format!("containerd-{}.log", self.starts))).unwrap_or_default()
    }

    /// The bytes this containerd's root holds on disk (blocks allocated, each inode
    /// once): the images' content and every container's snapshot.
    pub fn disk_use(&self) -> u64 {
        use std::os::unix::fs::MetadataExt as _;
        let mut seen = std::collections::HashSet::new();
        let mut total = 0u64;
        let mut stack = vec![self.dir.join("root")];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for entry in entries.flatten() {
                let Ok(meta) = entry.path().symlink_metadata() else { continue };
                if meta.is_dir() {
                    stack.push(entry.path());
                }
                if seen.insert((meta.dev(), meta.ino())) {
                    total += meta.blocks() * 512;
                }
            }
        }
        total
    }

    /// `ctr` against this containerd, in the namespace the CRI uses.
    pub fn ctr(&self) -> Command {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address").arg(&self.socket).args(["--namespace", "k8s.io"]);
        cmd
    }

    /// Imports an OCI archive (its `org.opencontainers.image.ref.name` names it).
    pub fn import(&self, archive: &Path) -> anyhow::Result<()> {
        let out = self
            .ctr()
            .args(["images", "import", "--all-platforms", "--snapshotter", SNAPSHOTTER])
            .arg(archive)
            .output()
            .context("run ctr")?;
        if !out.status.success() {
            bail!("ctr images import {}: {}", archive.display(), String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// The pids of this containerd's shims (`containerd-shim-runc-v2 ... -address <socket>`).
    pub fn shims(&self) -> Vec<i32> {
        let socket = self.socket.to_string_lossy().into_owned();
        let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                    let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                    args.first().is_some_and(|a| a.ends_with(b"containerd-shim-runc-v2"))
                        && args.windows(2).any(|w| w[0] == b"-address" && w[1] == socket.as_bytes())
                })
            })
            .collect()
    }

    /// A reboot's end of every container: containerd, then each shim and every process
    /// `in_pods` lists (the node's pod cgroups', asked again each round) are killed
    /// (SIGKILL), and containerd's state (a tmpfs on a node) is removed.
    pub fn kill_all(&mut self, in_pods: impl Fn() -> Vec<i32>) {
        self.stop();
        for _ in 0..50 {
            let mut any = false;
            for pid in self.shims().into_iter().chain(in_pods()) {
                any = true;
                // SAFETY: kill(2) of processes of this node's containers.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            if !any {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = std::fs::remove_dir_all(self.dir.join("state"));
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.stop();
    }
}
