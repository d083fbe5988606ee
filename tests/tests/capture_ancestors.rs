//! Unsafe cgroup layouts above a pod are refused, naming why. A test hierarchy (a
//! parent cgroup and the pod's cgroup in it) gets at the parent a minimal connect4
//! program named as Cilium names its own (`cil_sock4_conn`, two raw instructions:
//! `r0 = 1; exit`), attached as a socket load balancer may attach it: with no flags
//! (old Cilium, old kernels), with `BPF_F_PREORDER` (Linux 6.15), with
//! `BPF_F_ALLOW_OVERRIDE`, and as a bpf_link (Cilium on 5.7 and later). Then, for the
//! pod's cgroup: `weir capture detect --cgroup`, `capture ebpf`, `capture apply` (auto),
//! `capture explain`, `capture status`, and the node capture (`weir cni install
//! --ebpf-cgroup`'s part): the first three layouts refused, each message naming the
//! program's id and name, the parent cgroup and why; the link allowed, and capture then
//! carries the app's connection to Envoy's port with its original destination.
//! Nothing is attached anywhere but the cgroups made here, and everything is detached
//! and removed on drop, pass or fail.

use std::{
    fs::File,
    os::fd::{AsFd as _, AsRawFd as _, OwnedFd},
    path::Path,
    process::Output,
};

use weir_agent::capture::ebpf::{
    link::{self, CgroupLink},
    sys,
};
use weir_tests::{
    Cgroup, Placement,
    capture::{CaptureScene, Family, PinnedCapture, ask_placed, captured, cgroup_programs},
    require_root, test_name, tools,
};

const INET4_CONNECT: u32 = 10;
const ALLOW_OVERRIDE: u32 = 1;
const ALLOW_MULTI: u32 = 2;
const PREORDER: u32 = 64;
const STAND_IN: &str = "cil_sock4_conn";

/// How the stand-in is attached at the parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    Flagless,
    Override,
    Preorder,
    Link,
}

/// The stand-in attached to a cgroup made here; detached on drop.
struct StandIn {
    cgroup: File,
    program: OwnedFd,
    link: Option<CgroupLink>,
    id: u32,
}

fn bpf(cmd: libc::c_long, attr: &mut [u64; 16]) -> std::io::Result<()> {
    // SAFETY: `attr` is a zeroed bpf_attr of 128 bytes, large enough for the command.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), std::mem::size_of_val(attr)) };
    if rc < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// BPF_PROG_ATTACH (8) / BPF_PROG_DETACH (9): target_fd, attach_bpf_fd, attach_type,
/// attach_flags.
fn prog_attach(cmd: libc::c_long, cgroup: &File, program: &OwnedFd, flags: u32) -> std::io::Result<()> {
    let mut attr = [0u64; 16];
    attr[0] = u64::from(cgroup.as_raw_fd() as u32) | (u64::from(program.as_raw_fd() as u32) << 32);
    attr[1] = u64::from(INET4_CONNECT) | (u64::from(flags) << 32);
    bpf(cmd, &mut attr)
}

impl StandIn {
    /// A `BPF_F_PREORDER` stand-in, or `None` on a kernel without the flag: only one
    /// before 6.15 (upstream 4b82b181a26c; unless a stable tree took it) may refuse it,
    /// and then with EINVAL. There no program can run before Weir's, which this
    /// asserts instead.
    fn preorder(parent: &Path) -> Option<Self> {
        let program = sys::load_pass_sock_addr(INET4_CONNECT, STAND_IN).expect("load the stand-in");
        let cgroup = File::open(parent).unwrap();
        match prog_attach(8, &cgroup, &program, ALLOW_MULTI | PREORDER) {
            Ok(()) => {
                let id = link::prog_id(program.as_fd()).unwrap();
                Some(Self { cgroup, program, link: None, id })
            }
            Err(e) => {
                let kernel = aya::util::KernelVersion::current().expect("kernel version");
                let old = kernel < aya::util::KernelVersion::new(6, 15, 0);
                assert!(
                    old && e.raw_os_error() == Some(libc::EINVAL),
                    "BPF_F_PREORDER refused on Linux {kernel:?}: {e}"
                );
                eprintln!(
                    "Linux {kernel:?} has no BPF_F_PREORDER (EINVAL): no program can run before Weir's"
                );
                None
            }
        }
    }

    fn attach(parent: &Path, how: How) -> Self {
        let program = sys::load_pass_sock_addr(INET4_CONNECT, STAND_IN).expect("load the stand-in");
        let id = link::prog_id(program.as_fd()).unwrap();
        let cgroup = File::open(parent).unwrap();
        let flags = match how {
            How::Flagless => Some(0),
            How::Override => Some(ALLOW_OVERRIDE),
            How::Preorder => Some(ALLOW_MULTI | PREORDER),
            How::Link => None,
        };
        let link = match flags {
            Some(flags) => {
                prog_attach(8, &cgroup, &program, flags)
                    .unwrap_or_else(|e| panic!("attach the stand-in {how:?} to {}: {e}", parent.display()));
                None
            }
            None => Some(CgroupLink::create(program.as_fd(), cgroup.as_fd(), INET4_CONNECT).unwrap()),
        };
        Self { cgroup, program, link, id }
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        if self.link.take().is_none() {
            let _ = prog_attach(9, &self.cgroup, &self.program, 0);
        }
    }
}

/// A parent cgroup and the pod's cgroup in it, removed on drop (deepest first).
struct Tree {
    child: Cgroup,
    parent: Cgroup,
}

impl Tree {
    fn new(test: &str) -> Self {
        let parent = weir_tests::test_cgroup(test);
        let name = parent.path().file_name().unwrap().to_string_lossy().into_owned();
        let child = Cgroup::create(&format!("{name}/pod")).unwrap();
        Self { child, parent }
    }

    fn child(&self) -> &str {
        self.child.path().to_str().unwrap()
    }

    fn parent(&self) -> String {
        self.parent.path().display().to_string()
    }
}

fn weir(args: &[&str]) -> Output {
    tools::weir_command().args(args).env("WEIR_LOG", "warn").output().unwrap()
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Asserts `said` names the stand-in (id and name), the parent cgroup and `why`.
fn names_it(said: &str, stand_in: &StandIn, tree: &Tree, why: &str) {
    let program = format!("program {} \"{STAND_IN}\"", stand_in.id);
    for part in [program.as_str(), "connect4", &format!("ancestor cgroup {} ", tree.parent()), why] {
        assert!(said.contains(part), "{part:?} in:\n{said}");
    }
}

/// The flags Istio's injector gives istio-init, for `weir capture ebpf`/`apply`.
const FLAGS: &[&str] = &["-p", "15001", "-z", "15006", "-u", "1337", "-i", "*", "-b", ""];

/// A refused layout: `detect` picks netfilter and names why, a forced eBPF and `capture
/// ebpf` fail in the same words, `apply` (auto) captures with netfilter naming it,
/// `explain` tells it for that pod, and nothing of Weir's (nor the probe) is left on
/// the pod's cgroup.
fn refused(test: &str, how: How, why: &str) {
    let tree = Tree::new(test);
    let mesh = weir_tests::Mesh::new(test).unwrap();
    let pod = mesh.pod("client").unwrap();
    let netns = pod.netns().path().to_str().unwrap().to_string();
    let stand_in = StandIn::attach(tree.parent.path(), how);

    let detect = weir(&["capture", "detect", "--cgroup", tree.child()]);
    assert!(detect.status.success(), "{}", text(&detect));
    let said = text(&detect);
    assert_ne!(said.lines().next(), Some("ebpf"), "{said}");
    assert!(said.contains("not ebpf: "), "{said}");
    names_it(&said, &stand_in, &tree, why);
    let forced = weir(&["capture", "detect", "--capture-mode", "ebpf", "--cgroup", tree.child()]);
    assert!(!forced.status.success(), "{}", text(&forced));
    assert!(text(&forced).contains("--capture-mode=ebpf cannot work"), "{}", text(&forced));
    names_it(&text(&forced), &stand_in, &tree, why);

    let name = weir_agent::sandbox::unique_name("anc");
    let _pins = PinnedCapture(name.clone());
    let mut ebpf = vec!["capture", "ebpf", "--cgroup", tree.child(), "--netns", &netns, "--pod", &name];
    ebpf.extend(FLAGS);
    let out = weir(&ebpf);
    assert!(!out.status.success(), "eBPF capture attached under {how:?}: {}", text(&out));
    assert!(text(&out).contains("eBPF capture cannot work here"), "{}", text(&out));
    names_it(&text(&out), &stand_in, &tree, why);
    assert!(!Path::new("/sys/fs/bpf/weir").join(&name).exists(), "pins made for a refused capture");
    assert_eq!(cgroup_programs(tree.child.path()), Vec::<String>::new(), "left on the pod's cgroup");

    let mut apply = vec!["capture", "apply", "--cgroup", tree.child(), "--netns", &netns, "--pod", &name];
    apply.extend(FLAGS);
    let out = weir(&apply);
    assert!(out.status.success(), "{}", text(&out));
    let said = text(&out);
    assert!(!said.contains("capture backend: ebpf"), "{said}");
    names_it(&said, &stand_in, &tree, why);
    let explain = weir(&["capture", "explain", "--netns", &netns, "--cgroup", tree.child(), "10.0.0.1:80"]);
    assert!(explain.status.success(), "{}", text(&explain));
    let said = text(&explain);
    assert!(said.contains("redirected to local port 15001"), "{said}");
    assert!(said.contains("not eBPF, so `auto` picks netfilter for this pod"), "{said}");
    names_it(&said, &stand_in, &tree, why);
    assert_eq!(cgroup_programs(tree.child.path()), Vec::<String>::new(), "left on the pod's cgroup");
}

#[test]
fn a_flagless_ancestor_program_is_named_and_ebpf_refused() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    refused(&test_name!(), How::Flagless, "refuses any connect4 program below it (EPERM)");
}

#[test]
fn a_preorder_ancestor_program_is_named_and_ebpf_refused() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    if StandIn::preorder(Tree::new(&format!("{test}-flag")).parent.path()).is_none() {
        return;
    }
    refused(&test, How::Preorder, "BPF_F_PREORDER: it runs before Weir's connect4 program");
}

#[test]
fn an_override_ancestor_program_is_named_and_ebpf_refused_and_keeps_running() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    refused(&test, How::Override, "BPF_F_ALLOW_OVERRIDE: Weir's connect4 program");
    // Refused before anything was attached: the parent's program still runs for the
    // pod's sockets (Weir's attach would have dropped it from their list).
    let tree = Tree::new(&format!("{test}-runs"));
    let stand_in = StandIn::attach(tree.parent.path(), How::Override);
    let mesh = weir_tests::Mesh::new(&format!("{test}-runs")).unwrap();
    let netns = mesh.pod("client").unwrap().netns().path().to_str().unwrap().to_string();
    let name = weir_agent::sandbox::unique_name("anc");
    let _pins = PinnedCapture(name.clone());
    let mut ebpf = vec!["capture", "ebpf", "--cgroup", tree.child(), "--netns", &netns, "--pod", &name];
    ebpf.extend(FLAGS);
    assert!(!weir(&ebpf).status.success());
    let child = File::open(tree.child.path()).unwrap();
    let runs = sys::query_effective(child.as_fd(), INET4_CONNECT).unwrap();
    assert_eq!(runs, [stand_in.id], "the overridable program runs for the pod's sockets");
}

#[test]
fn a_link_ancestor_program_is_allowed_and_capture_works_until_a_preorder_one_comes() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let tree = Tree::new(&test);
    let s = CaptureScene::in_cgroup(&test, Family::V4, &tree.child);
    let _link = StandIn::attach(tree.parent.path(), How::Link);
    let netns = s.client.netns().path().to_str().unwrap().to_string();

    let detect = weir(&["capture", "detect", "--cgroup", tree.child()]);
    assert!(detect.status.success(), "{}", text(&detect));
    assert_eq!(text(&detect).lines().next(), Some("ebpf"), "{}", text(&detect));
    let name = weir_agent::sandbox::unique_name("anc");
    let _pins = PinnedCapture(name.clone());
    let mut ebpf = vec!["capture", "ebpf", "--cgroup", tree.child(), "--netns", &netns, "--pod", &name];
    ebpf.extend(FLAGS);
    let out = weir(&ebpf);
    assert!(out.status.success(), "{}", text(&out));

    // The app's connection reaches Envoy's port with its original destination: Weir's
    // connect4 ran first, the parent's after it.
    let to = s.addr(&s.server, 8080);
    let app = Placement { user: Some((1000, 1000)), cgroup: Some(&tree.child), ..Placement::default() };
    let line = ask_placed(&s.client, app, to);
    assert_eq!(captured(&line).map(|(_, orig)| orig), Some(to.to_string()), "{line}");
    let explain = weir(&["capture", "explain", "--pod", &name, &to.to_string(), "--uid", "1000"]);
    assert!(
        text(&explain).contains("no program its ancestor cgroups run stands in the way"),
        "{}",
        text(&explain)
    );
    let status = weir(&["capture", "status", "--pod", &name]);
    assert!(status.status.success(), "{}", text(&status));

    // A pre-order program added above later runs before Weir's: status and explain
    // name it (told from the order, with Weir's own links on the pod's cgroup).
    let Some(preorder) = StandIn::preorder(tree.parent.path()) else { return };
    let status = weir(&["capture", "status", "--pod", &name]);
    assert!(!status.status.success(), "{}", text(&status));
    assert!(text(&status).contains("UNSAFE: "), "{}", text(&status));
    names_it(&text(&status), &preorder, &tree, "BPF_F_PREORDER");
    let explain = weir(&["capture", "explain", "--pod", &name, &to.to_string(), "--uid", "1000"]);
    names_it(&text(&explain), &preorder, &tree, "BPF_F_PREORDER");
}

#[test]
fn the_node_capture_is_refused_under_an_unsafe_ancestor_and_checked_again_per_pod() {
    use weir_agent::node::cni::ebpf::check_node_ancestors;
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let preorder_here = StandIn::preorder(Tree::new(&format!("{test}-flag")).parent.path()).is_some();
    for how in [How::Flagless, How::Preorder, How::Override] {
        if how == How::Preorder && !preorder_here {
            continue;
        }
        let tree = Tree::new(&format!("{test}-{how:?}"));
        let stand_in = StandIn::attach(tree.parent.path(), how);
        let e = weir_tests::capture::NodeCapture::attach("anc-node", tree.child.path()).err();
        let said = e.map(|e| format!("{e:#}")).unwrap_or_default();
        names_it(&said, &stand_in, &tree, "");
        assert_eq!(cgroup_programs(tree.child.path()), Vec::<String>::new(), "{how:?}: {said}");
    }
    // Allowed under a link; a pod added after a pre-order program came above is
    // refused (CNI ADD's `auto` then picks netfilter with these words).
    let tree = Tree::new(&format!("{test}-link"));
    let _link = StandIn::attach(tree.parent.path(), How::Link);
    let node = weir_tests::capture::NodeCapture::attach("anc-node", tree.child.path()).unwrap();
    check_node_ancestors(node.name()).unwrap();
    let Some(preorder) = StandIn::preorder(tree.parent.path()) else { return };
    let said = check_node_ancestors(node.name()).unwrap_err().to_string();
    assert!(said.contains(&format!("node capture {}", node.name())), "{said}");
    names_it(&said, &preorder, &tree, "BPF_F_PREORDER");
}
