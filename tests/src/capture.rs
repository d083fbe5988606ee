//! A capture scenario for the rule and eBPF tests: a `client` pod (captured) with
//! Envoy-like listeners on 15001/15006 that report original destinations, an app on
//! 8080 and a health port on 15021; a `server` pod and a `server2` pod with hello
//! servers on 8080 and 9090. Helpers run `weir-testkit ask` as a given uid and
//! `weir istio-iptables` inside a pod.

use std::{
    io::{BufRead as _, BufReader},
    net::{IpAddr, SocketAddr},
    path::Path,
    process::{Command, Output, Stdio},
};

use crate::{Mesh, Placement, Pod, PodChild, tools};

/// IPv4 or IPv6 traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(self, pod: &Pod) -> IpAddr {
        match self {
            Family::V4 => pod.ipv4().into(),
            Family::V6 => pod.ipv6().into(),
        }
    }
    pub fn any(self) -> IpAddr {
        match self {
            Family::V4 => IpAddr::from([0, 0, 0, 0]),
            Family::V6 => IpAddr::from([0u16; 8]),
        }
    }
    /// The prefix length of a single host.
    pub fn host_bits(self) -> u8 {
        if self == Family::V4 { 32 } else { 128 }
    }
}

/// The outbound half of the command line Istio's injector gives istio-init:
/// `-p 15001 -z 15006 -u 1337 -m REDIRECT -i '*' -x ""` (inbound: `-b`, `-d`).
pub const INJECTOR_OUTBOUND: [&str; 12] =
    ["-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-x", ""];
/// The whole istio-init command line as Istio's injection template writes it (as in
/// tests/testdata/istio-inject's injected pods), after `pilot-agent`.
pub fn injector_istio_init_args() -> Vec<&'static str> {
    let inbound = ["-b", "*", "-d", "15090,15021,15020", "--log_output_level=default:info"];
    std::iter::once("istio-iptables").chain(INJECTOR_OUTBOUND).chain(inbound).collect()
}
/// Starts a testkit server in `pod` as `uid` and waits for its `listening` line.
pub fn start_server(pod: &Pod, uid: u32, args: &[&str]) -> PodChild {
    start_server_placed(pod, Placement { user: Some((uid, uid)), ..Placement::default() }, args)
}

pub fn start_server_placed(pod: &Pod, placement: Placement<'_>, args: &[&str]) -> PodChild {
    let mut cmd = tools::testkit_command();
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = pod.spawn_placed(&mut cmd, placement).expect("spawn testkit server");
    let stdout = child.child_mut().stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read listening line");
    assert!(line.starts_with("listening"), "testkit {args:?} said {line:?}");
    child
}

/// `weir-testkit ask <addr>` in `pod` as `uid`: the first line the server sent, or the
/// client's error.
pub fn ask(pod: &Pod, uid: u32, addr: SocketAddr) -> String {
    ask_placed(pod, Placement { user: Some((uid, uid)), ..Placement::default() }, addr)
}

pub fn ask_placed(pod: &Pod, placement: Placement<'_>, addr: SocketAddr) -> String {
    run_testkit(pod, placement, &["ask", &addr.to_string()])
}

/// Runs a testkit client command; stdout on success, `error: <stderr>` otherwise.
pub fn run_testkit(pod: &Pod, placement: Placement<'_>, args: &[&str]) -> String {
    let mut cmd = tools::testkit_command();
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = pod.spawn_placed(&mut cmd, placement).expect("spawn testkit client");
    let out = child.into_inner().wait_with_output().expect("wait testkit client");
    if out.status.success() {
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    } else {
        format!("error: {}", String::from_utf8_lossy(&out.stderr).trim())
    }
}

/// `weir istio-iptables <args>` inside `pod`, as root, optionally with the pod's own
/// resolv.conf.
pub fn istio_iptables(pod: &Pod, args: &[&str], resolv_conf: Option<&Path>) -> Output {
    istio_iptables_placed(pod, Placement { user: Some((0, 0)), resolv_conf, ..Placement::default() }, args)
}

/// `weir istio-iptables <args>` inside `pod`, placed (user, cgroup) as the caller says.
pub fn istio_iptables_placed(pod: &Pod, placement: Placement<'_>, args: &[&str]) -> Output {
    istio_iptables_with(tools::weir_command(), pod, placement, args)
}

/// `cmd istio-iptables <args>` inside `pod` (`cmd`: `weir`, or `tools::init_command()`
/// for the weir-init image's pilot-agent).
pub fn istio_iptables_with(mut cmd: Command, pod: &Pod, placement: Placement<'_>, args: &[&str]) -> Output {
    cmd.arg("istio-iptables")
        .args(args)
        .env("WEIR_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = pod.spawn_placed(&mut cmd, placement).expect("spawn weir istio-iptables");
    child.into_inner().wait_with_output().expect("wait weir")
}

/// Runs a command (iptables-save, nft ...) inside `pod` as root; returns stdout.
pub fn in_pod(pod: &Pod, program: &str, args: &[&str]) -> String {
    let mut cmd = Command::new(program);
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = pod.spawn(&mut cmd, 0).unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    let out = child.into_inner().wait_with_output().expect("wait");
    assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every `ISTIO`-related line of iptables-save (both families) and the Istio nft tables.
pub fn capture_state(pod: &Pod) -> String {
    let mut out = String::new();
    for save in ["iptables-save", "ip6tables-save"] {
        out.push_str(
            &in_pod(pod, save, &[])
                .lines()
                .filter(|l| l.contains("ISTIO") || l.contains("REDIRECT") || l.contains("TPROXY"))
                .map(|l| format!("{save}: {l}\n"))
                .collect::<String>(),
        );
    }
    let tables = in_pod(pod, "nft", &["list", "tables"]);
    for line in tables.lines().filter(|l| l.contains("istio")) {
        let name = line.split_whitespace().last().unwrap_or_default();
        out.push_str(&in_pod(pod, "nft", &["list", "table", "inet", name]));
    }
    out
}

/// The standard scenario.
pub struct CaptureScene {
    pub mesh: Mesh,
    pub client: Pod,
    pub server: Pod,
    pub server2: Pod,
    pub family: Family,
    pub servers: Vec<PodChild>,
}

impl CaptureScene {
    /// Builds the pods and starts every listener. `transparent` makes the 15006
    /// listener IP_TRANSPARENT (TPROXY).
    pub fn new(test: &str, family: Family, transparent: bool) -> Self {
        Self::build(test, family, transparent, None)
    }

    /// As [`CaptureScene::new`], with the client pod's processes in `cgroup` (eBPF
    /// capture attaches there, and Envoy's getsockopt must run in it too).
    pub fn in_cgroup(test: &str, family: Family, cgroup: &crate::Cgroup) -> Self {
        Self::build(test, family, false, Some(cgroup))
    }

    fn build(test: &str, family: Family, transparent: bool, cgroup: Option<&crate::Cgroup>) -> Self {
        let in_client = |uid: u32| Placement { user: Some((uid, uid)), cgroup, ..Placement::default() };
        let mesh = Mesh::new(test).expect("mesh");
        let client = mesh.pod("client").expect("client pod");
        let server = mesh.pod("server").expect("server pod");
        let server2 = mesh.pod("server2").expect("server2 pod");
        let mut servers = Vec::new();
        for (pod, name) in [(&server, "server"), (&server2, "server2")] {
            for port in [8080, 9090] {
                let addr = SocketAddr::new(family.of(pod), port).to_string();
                servers.push(start_server(pod, 0, &["serve-hello", &addr, name]));
            }
        }
        // Envoy stand-ins in the client pod (run as the proxy user, as Envoy does).
        for fam in [Family::V4, Family::V6] {
            let outbound = SocketAddr::new(fam.any(), 15001).to_string();
            servers.push(start_server_placed(&client, in_client(1337), &["capture-listener", &outbound]));
            let inbound = SocketAddr::new(fam.any(), 15006).to_string();
            let mut args = vec!["capture-listener", inbound.as_str()];
            if transparent {
                args.push("--transparent");
            }
            // IP_TRANSPARENT needs CAP_NET_ADMIN; Envoy gets it, our stand-in runs as root.
            servers.push(start_server_placed(&client, in_client(if transparent { 0 } else { 1337 }), &args));
        }
        let app = SocketAddr::new(family.of(&client), 8080).to_string();
        servers.push(start_server_placed(&client, in_client(1000), &["serve-hello", &app, "app"]));
        let health = SocketAddr::new(family.of(&client), 15021).to_string();
        servers.push(start_server_placed(&client, in_client(1000), &["serve-hello", &health, "app-15021"]));
        Self { mesh, client, server, server2, family, servers }
    }

    pub fn addr(&self, pod: &Pod, port: u16) -> SocketAddr {
        SocketAddr::new(self.family.of(pod), port)
    }
}

/// Parses `captured local=<l> peer=<p> orig=<o>` into (local, orig).
pub fn captured(line: &str) -> Option<(String, String)> {
    let rest = line.strip_prefix("captured ")?;
    let field = |k: &str| rest.split_whitespace().find_map(|f| f.strip_prefix(k)).map(String::from);
    Some((field("local=")?, field("orig=")?))
}

/// The programs attached to `cgroup`, one `bpftool cgroup show` line each (header
/// dropped); panics when bpftool itself fails, so "nothing attached" is never a
/// failed probe.
pub fn cgroup_programs(cgroup: &Path) -> Vec<String> {
    let out = Command::new("bpftool")
        .args(["cgroup", "show"])
        .arg(cgroup)
        .output()
        .unwrap_or_else(|e| panic!("run bpftool (scripts/bootstrap installs it): {e}"));
    assert!(
        out.status.success(),
        "bpftool cgroup show {}: {}",
        cgroup.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).lines().skip(1).map(String::from).collect()
}

/// Names of the programs on `pod`'s eth0 ingress: TCX links (Linux 6.6+) and tc
/// filters (`tc filter show`, one name per filter: its line names the program twice),
/// which the node classifier uses. Panics when either probe fails, so "nothing
/// attached" is never a failed probe. A kernel before 6.6 has no TCX (aya attaches a
/// tc filter there): it is not asked, rather than read as having nothing.
pub fn inbound_programs(pod: &Pod) -> Vec<String> {
    let kernel = aya::util::KernelVersion::current().expect("read the kernel's version");
    let mut names = if kernel >= aya::util::KernelVersion::new(6, 6, 0) {
        weir_agent::capture::ebpf::inbound::inbound_programs(pod.netns().path(), "eth0")
            .unwrap_or_else(|e| panic!("query the TCX programs on eth0 (Linux {kernel:?}): {e}"))
    } else {
        Vec::new()
    };
    names.extend(in_pod(pod, "tc", &["filter", "show", "dev", "eth0", "ingress"]).lines().filter_map(
        |line| {
            line.split_whitespace()
                .find(|w| w.starts_with("weir_"))
                .map(|w| w.split(':').next().unwrap_or(w).to_string())
        },
    ));
    names
}

/// Removes a pinned capture (record, pins, inbound filter) on drop; idempotent. Declare
/// it after the scene and cgroup, so the capture goes first whatever the test reached.
pub struct PinnedCapture(pub String);

impl Drop for PinnedCapture {
    fn drop(&mut self) {
        use weir_agent::capture::ebpf::{
            bpffs::unpin,
            record::{PinRecord, pin_dir},
        };
        match PinRecord::load(&self.0) {
            Some(record) => drop(record.remove()),
            None => drop(unpin(&pin_dir(&self.0))),
        }
    }
}

/// An eBPF node capture (`weir cni install --ebpf-cgroup`'s part) attached to a
/// cgroup a test or benchmark made, under a unique name; detached when dropped, passed
/// or failed.
pub struct NodeCapture(String);

impl NodeCapture {
    /// Attaches a node capture to `cgroup` under a name made from `tag`.
    pub fn attach(tag: &str, cgroup: &std::path::Path) -> anyhow::Result<Self> {
        let name = weir_agent::sandbox::unique_name(tag);
        let guard = Self(name.clone());
        weir_agent::node::cni::node_capture::attach_node(&name, cgroup)?;
        Ok(guard)
    }

    pub fn name(&self) -> &str {
        &self.0
    }
}

impl Drop for NodeCapture {
    fn drop(&mut self) {
        let _ = weir_agent::node::cni::node_capture::detach_node(&self.0);
    }
}
