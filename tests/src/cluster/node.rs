//! One node of the cluster in a box: a network namespace (its underlay address, a pod
//! CIDR on the bridge its primary CNI makes, routes to the other nodes' pod CIDRs), a
//! mount namespace of its own held by a small process (so the node has its own
//! `/etc/cni/net.d`, `/opt/cni/bin`, `/var/lib/cni`, a bpffs of its own at
//! `/sys/fs/bpf`, and its own `/run` folders: `/run/netns`, `/run/weir`,
//! `/run/istio-cni`, `/run/ztunnel`, each a bind of the node's folder, shared so
//! containers' `HostToContainer` mounts see what appears later), a `kubepods` cgroup of
//! its own, and its containerd in both namespaces. Containers' hostPath volumes resolve
//! in the node's mount namespace, as on a real node, so Weir's DaemonSet manifest runs
//! unchanged but for the pods' cgroup path. A reboot kills everything the node runs,
//! clears its `/run` and bpffs, and starts containerd again.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};
use weir_agent::sandbox::{Cgroup, NetNs};

use super::containerd::Containerd;

/// The node folders bound over their paths in the node's mount namespace, and whether
/// they are the node's tmpfs (`/run`: cleared by a reboot) or its disk.
const BOUND: &[(&str, bool)] = &[
    ("/etc/cni/net.d", false),
    ("/opt/cni/bin", false),
    ("/var/lib/cni", false),
    ("/run/netns", true),
    ("/run/weir", true),
    ("/run/istio-cni", true),
    ("/run/ztunnel", true),
];

/// The reference plugins the primary CNI chain uses, from Debian's containernetworking-plugins.
const PRIMARY_PLUGINS: &[&str] = &["bridge", "host-local", "portmap", "loopback"];

/// The pids of the processes in `cgroup` and below it.
pub fn cgroup_processes(cgroup: &Path) -> Vec<i32> {
    let mut out = Vec::new();
    let mut stack = vec![cgroup.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            out.extend(procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            stack.extend(entries.flatten().filter(|e| e.path().is_dir()).map(|e| e.path()));
        }
    }
    out
}

/// Removes the cgroup `relative` (to each hierarchy's mount) and everything under it,
/// in every cgroup hierarchy mounted (runc makes a container's cgroup in each v1
/// controller as well as in v2), deepest first.
pub fn remove_cgroup_trees(relative: &Path) {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for line in mounts.lines() {
        let Some((left, right)) = line.split_once(" - ") else { continue };
        if !right.starts_with("cgroup") {
            continue;
        }
        let Some(mount) = left.split_whitespace().nth(4) else { continue };
        let root = Path::new(mount).join(relative);
        let mut dirs = Vec::new();
        let mut stack = vec![root];
        while let Some(dir) = stack.pop() {
            if let Ok(entries) = std::fs::read_dir(&dir) {
                stack.extend(entries.flatten().filter(|e| e.path().is_dir()).map(|e| e.path()));
            }
            dirs.push(dir);
        }
        for dir in dirs.iter().rev() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// What a node is made of.
pub struct Node {
    pub name: String,
    /// 1-based.
    pub index: u8,
    pub netns: NetNs,
    /// The node's folder on the machine (`<rig>/<name>`).
    pub dir: PathBuf,
    /// Holds the node's mount namespace.
    mounts: Option<Child>,
    pub containerd: Containerd,
    /// The node's pods' cgroup parent (a `kubepods` of its own, under the cgroup2 mount).
    pub kubepods: Cgroup,
    /// `kubepods`, relative to each cgroup hierarchy.
    pub kubepods_relative: PathBuf,
}

impl Node {
    /// The node's underlay address.
    pub fn ip(&self) -> std::net::Ipv4Addr {
        super::underlay_ip(self.index)
    }

    /// The node's pod CIDR.
    pub fn pod_cidr(&self) -> String {
        super::pod_cidr(self.index)
    }

    /// `path` as the node sees it, from the machine (through its mount namespace).
    pub fn host_path(&self, path: &str) -> PathBuf {
        let pid = self.mounts.as_ref().map(Child::id).unwrap_or(0);
        PathBuf::from(format!("/proc/{pid}/root")).join(path.trim_start_matches('/'))
    }

    /// The node's own folder for `path` (one of [`BOUND`]).
    pub fn folder(&self, path: &str) -> PathBuf {
        self.dir.join(path.trim_start_matches('/'))
    }

    /// Makes node `index` named `name` under `rig`, its network namespace `netns`
    /// already plugged into the underlay.
    pub fn create(rig: &Path, name: &str, index: u8, netns: NetNs, kubepods: Cgroup) -> anyhow::Result<Self> {
        let dir = rig.join(name);
        for (path, _) in BOUND {
            std::fs::create_dir_all(dir.join(path.trim_start_matches('/')))?;
        }
        for plugin in PRIMARY_PLUGINS {
            let to = dir.join("opt/cni/bin").join(plugin);
            if !to.exists() {
                std::fs::copy(Path::new("/usr/lib/cni").join(plugin), &to).with_context(|| {
                    format!("copy the reference plugin {plugin} (containernetworking-plugins)")
                })?;
            }
        }
        let primary = dir.join("etc/cni/net.d/10-primary.conflist");
        std::fs::write(&primary, primary_conflist(index))?;
        // The primary CNI's own mode, which the chained plugin's installer keeps.
        std::fs::set_permissions(&primary, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
        let mount = weir_agent::sandbox::cgroup::cgroup2_mount()?;
        let kubepods_relative = kubepods.path().strip_prefix(&mount)?.to_path_buf();
        let mounts = Some(spawn_mounts(&dir, netns.path())?);
        let netns_path = netns.path().to_path_buf();
        let mut node = Self {
            name: name.to_string(),
            index,
            netns,
            dir: dir.clone(),
            mounts,
            // Replaced just below, once the mount namespace is there.
            containerd: Containerd::placeholder(&dir.join("containerd")),
            kubepods,
            kubepods_relative,
        };
        node.containerd = Containerd::start(&dir.join("containerd"), &netns_path, node.mount_ns())?;
        Ok(node)
    }

    /// A process that lives as long as the node, in its network and mount namespaces:
    /// what PID 1 is to a real node. The nodes share the machine's PID namespace, so a
    /// pod's `/host/proc/1` is the machine's: Istio's chart's `/host/proc/1/ns/net` is
    /// re-rooted to `/host/proc/<this>/ns/net`.
    pub fn host_netns_pid(&self) -> u32 {
        self.mounts.as_ref().map(Child::id).unwrap_or(0)
    }

    /// `/proc/<holder>/ns/mnt`: the node's mount namespace.
    pub fn mount_ns(&self) -> PathBuf {
        let pid = self.mounts.as_ref().map(Child::id).unwrap_or(0);
        PathBuf::from(format!("/proc/{pid}/ns/mnt"))
    }

    /// A command run on the node: in its mount and network namespaces, as root.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--mount={}", self.mount_ns().display()))
            .arg(format!("--net={}", self.netns.path().display()))
            .arg("--")
            .arg(program);
        cmd
    }

    /// Runs `program args` on the node; its stdout, or an error with its stderr.
    pub fn run(&self, program: &str, args: &[&str]) -> anyhow::Result<String> {
        let out = self.command(program).args(args).output()?;
        if !out.status.success() {
            bail!("{program} {args:?} on {}: {}", self.name, String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A reboot: every process of the node killed, its `/run` folders and bpffs cleared
    /// (a fresh mount namespace), containerd started again with no state.
    pub fn reboot(&mut self) -> anyhow::Result<()> {
        self.containerd.kill_all(|| cgroup_processes(self.kubepods.path()));
        self.reset_network()?;
        if let Some(mut m) = self.mounts.take() {
            let _ = m.kill();
            let _ = m.wait();
        }
        for (path, tmpfs) in BOUND {
            if *tmpfs {
                let folder = self.folder(path);
                let _ = std::fs::remove_dir_all(&folder);
                std::fs::create_dir_all(&folder)?;
            }
        }
        self.mounts = Some(spawn_mounts(&self.dir, self.netns.path())?);
        self.containerd.set_mount_ns(self.mount_ns());
        self.containerd.restart()
    }
}

impl Node {
    /// What a reboot does to the node's network: its netfilter rules (nftables and
    /// legacy iptables) and the primary CNI's bridge gone. Run in the node's network
    /// namespace, and refused there if that were this process's own.
    fn reset_network(&self) -> anyhow::Result<()> {
        let ours = std::fs::read_link("/proc/self/ns/net")?;
        let script = format!(
            "[ \"$(readlink /proc/self/ns/net)\" != '{}' ] || {{ echo 'not in the node namespace' >&2; exit 99; }}; \
             ip link del cni0 2>/dev/null; nft flush ruleset; \
             if command -v iptables-legacy >/dev/null; then for t in filter nat mangle raw; do \
             iptables-legacy -t $t -F; iptables-legacy -t $t -X; ip6tables-legacy -t $t -F; ip6tables-legacy -t $t -X; \
             done 2>/dev/null; fi; true",
            ours.display()
        );
        self.run("sh", &["-c", &script]).map(drop)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.containerd.kill_all(|| cgroup_processes(self.kubepods.path()));
        if let Some(mut m) = self.mounts.take() {
            let _ = m.kill();
            let _ = m.wait();
        }
        remove_cgroup_trees(&self.kubepods_relative);
    }
}

/// The node's mount namespace: each [`BOUND`] folder bound over its path, a bpffs of its
/// own at /sys/fs/bpf, each made shared (for containers' propagation), held by a
/// process that waits, in the node's network namespace `netns` (the node's "PID 1":
/// [`Node::host_netns_pid`]).
fn spawn_mounts(dir: &Path, netns: &Path) -> anyhow::Result<Child> {
    let mut script = String::from("set -e; mount --make-rprivate /; ");
    for (path, _) in BOUND {
        let from = dir.join(path.trim_start_matches('/'));
        script.push_str(&format!("mkdir -p {path}; mount --bind '{}' {path}; ", from.display()));
    }
    // Everything shared inside the node, as systemd makes a node's mounts (runtimes
    // check a propagated hostPath's mount: `/` for `/var/run/netns`); the namespace is
    // private from the machine's, so nothing propagates out of it.
    script.push_str("mount -t bpf bpf /sys/fs/bpf; mount --make-rshared /; echo ready; exec sleep infinity");
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args(["--", "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("unshare a node's mount namespace")?;
    let mut line = String::new();
    let stdout = child.stdout.take().context("stdout")?;
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
    if line.trim() != "ready" {
        let _ = child.kill();
        let out = child.wait_with_output()?;
        bail!("a node's mounts: {}", String::from_utf8_lossy(&out.stderr));
    }
    // Wait until the process is `sleep` (its namespace complete).
    std::thread::sleep(Duration::from_millis(20));
    Ok(child)
}

/// The cluster's primary CNI on node `index`: the reference bridge (the node's pod
/// CIDR, the bridge the gateway, no masquerade: pods reach other nodes' pods routed),
/// host-local IPAM (its state in the node's /var/lib/cni), portmap.
pub fn primary_conflist(index: u8) -> String {
    let cidr = super::pod_cidr(index);
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "plugins": [
            {
                "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": cidr}]], "routes": [{"dst": "0.0.0.0/0"}]}
            },
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]
    })
    .to_string()
}
