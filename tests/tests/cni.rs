//! The CNI plugin chained after the reference `bridge` + `host-local` plugins, run by
//! the rig's small CNI runtime inside a test "node" namespace, with pods as fresh
//! network namespaces and Pod objects served by the test Kubernetes API server. ADD
//! gives a real pod IP and capture proven with real TCP connections; CHECK notices
//! rules removed behind its back; DEL removes them (twice is fine); bad input gets the
//! spec's error JSON; 100 ADDs in parallel stay correct.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::{Value, json};
use weir_agent::sandbox::{NetNs, unique_name};
use weir_tests::{
    Placement,
    capture::captured,
    cni::{
        Attachment, CniRuntime, KubeletSandbox, TestApiServer, conflist, pod_object, run_in, run_placed,
        start_in, start_placed, try_run_placed, write_kubeconfig,
    },
    control_plane::TestCa,
    envoy::tempfile_dir::Dir,
    require_root, test_cgroup, test_name, tools,
};

const TOKEN: &str = "cni-test-token";
const SUBNET: &str = "10.77.0.0/24";
const GATEWAY: &str = "10.77.0.1";

/// A node: its namespace (lo up), the API server inside it, the plugin's run dir with
/// the kubeconfig, and host-local's state dir.
struct Node {
    api: TestApiServer,
    run_dir: Dir,
    ipam: Dir,
    ns: NetNs,
}

impl Node {
    fn new(test: &str, https: bool) -> Self {
        let ns = NetNs::create(&unique_name(&format!("{test}-node"))).unwrap();
        assert_eq!(run_in(&ns, None, Command::new("ip"), &["link", "set", "lo", "up"]), "");
        let (tls, ca) = if https {
            let ca = TestCa::new("test API server CA").unwrap();
            (Some(ca.server_cert(&["localhost"]).unwrap()), Some(ca.root_pem().to_string()))
        } else {
            (None, None)
        };
        let api = TestApiServer::start(&ns, TOKEN, tls).unwrap();
        let run_dir = Dir::new("cni-run").unwrap();
        write_kubeconfig(run_dir.path(), &api.kubeconfig(TOKEN, ca.as_deref())).unwrap();
        Self { api, run_dir, ipam: Dir::new("cni-ipam").unwrap(), ns }
    }

    fn conflist(&self, weir: Value) -> Value {
        let mut fields = json!({"cni_agent_run_dir": self.run_dir.path()});
        for (k, v) in weir.as_object().into_iter().flatten() {
            fields[k] = v.clone();
        }
        conflist(SUBNET, self.ipam.path(), fields)
    }
}

/// A pod sandbox: its namespace, with `lo` brought up by the loopback plugin.
fn pod_netns(rt: &CniRuntime<'_>, name: &str) -> NetNs {
    let ns = NetNs::create(&unique_name(name)).unwrap();
    let lo =
        Attachment { ifname: "lo".into(), ..Attachment::pod(&format!("c-{name}"), ns.path(), "x", name) };
    let conf = json!({"cniVersion": "1.0.0", "name": "lo", "type": "loopback"});
    rt.exec("loopback", "ADD", &lo, conf.to_string().as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    ns
}

fn istio_rules(ns: &NetNs) -> String {
    let mut out = run_in(ns, None, Command::new("iptables-save"), &[]);
    out.push_str(&run_in(ns, None, Command::new("nft"), &["list", "ruleset"]));
    out.lines().filter(|l| l.contains("ISTIO") || l.contains("istio")).collect::<Vec<_>>().join("\n")
}

fn pod_ip(result: &Value) -> String {
    let cidr = result["ips"][0]["address"].as_str().unwrap_or_else(|| panic!("no IP in {result}"));
    cidr.split('/').next().unwrap().to_string()
}

/// Outbound from the app (uid 1000) to the gateway and inbound from the node to the
/// pod both land on the pod's capture listeners with their original destinations.
fn assert_captured(node: &Node, pod: &NetNs, ip: &str) {
    // The bridge's gateway: .1 of the pod's /24.
    let gateway = format!("{}.1", ip.rsplit_once('.').unwrap().0);
    let _outbound = start_in(pod, 1337, &["capture-listener", "0.0.0.0:15001"]).unwrap();
    let _inbound = start_in(pod, 1337, &["capture-listener", "0.0.0.0:15006"]).unwrap();
    let out = run_in(pod, Some(1000), tools::testkit_command(), &["ask", &format!("{gateway}:80")]);
    let (local, orig) =
        captured(&out).unwrap_or_else(|| panic!("outbound not captured: {out}\n{}", istio_rules(pod)));
    assert!(local.ends_with(":15001") && orig == format!("{gateway}:80"), "{out}");
    let out = run_in(&node.ns, None, tools::testkit_command(), &["ask", &format!("{ip}:8080")]);
    let (local, orig) = captured(&out).unwrap_or_else(|| panic!("inbound not captured: {out}"));
    assert!(local.ends_with(":15006") && orig == format!("{ip}:8080"), "{out}");
}

fn add_check_break_del(https: bool, mode: &str) {
    let node = Node::new(&format!("{}-{mode}", test_name!()), https);
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let rt = CniRuntime::new(&node.ns).unwrap();
    let pod = pod_netns(&rt, "web-1");
    let list = node.conflist(json!({"capture_mode": mode}));
    let a = Attachment::pod("c-web-1", pod.path(), "shop", "web-1");

    let result = rt.add(&list, &a).unwrap_or_else(|e| panic!("ADD: {e}"));
    let ip = pod_ip(&result);
    assert!(ip.starts_with("10.77.0."), "{result}");
    assert_eq!(result["cniVersion"], "1.0.0");
    assert!(
        result["interfaces"].as_array().is_some_and(|i| !i.is_empty()),
        "the bridge's result passed on: {result}"
    );
    assert!(node.api.requests.lock().unwrap().iter().any(|p| p == "/api/v1/namespaces/shop/pods/web-1"));
    let rules = istio_rules(&pod);
    match mode {
        "nftables" => assert!(rules.contains("table inet istio-proxy-nat"), "{rules}"),
        _ => assert!(
            rules.contains("-A ISTIO_OUTPUT") && rules.contains("-A PREROUTING -p tcp -j ISTIO_INBOUND"),
            "{rules}"
        ),
    }
    assert_captured(&node, &pod, &ip);
    rt.check(&list, &a, &result).unwrap_or_else(|e| panic!("CHECK: {e}"));

    // Rules removed behind the plugin's back: CHECK says so.
    match mode {
        "nftables" => {
            let tables = run_in(&pod, None, Command::new("nft"), &["list", "tables"]);
            for table in tables.lines().filter(|l| l.contains("istio")) {
                let name = table.split_whitespace().last().unwrap();
                run_in(&pod, None, Command::new("nft"), &["delete", "table", "inet", name]);
            }
        }
        _ => {
            run_in(&pod, None, Command::new("iptables"), &["-t", "nat", "-F"]);
            run_in(&pod, None, Command::new("iptables"), &["-t", "nat", "-X"]);
        }
    }
    let e = rt.check(&list, &a, &result).unwrap_err();
    assert_eq!(e.plugin, "istio-cni", "{e}");
    assert_eq!(e.error()["code"], 100, "{e}");
    assert!(e.error()["msg"].as_str().unwrap().contains("not captured"), "{e}");

    // Weir's ADD again (the runtime retrying) restores them; DEL removes; DEL twice
    // is fine.
    let weir = CniRuntime::plugin_config(&list, &list["plugins"][1], Some(&result));
    rt.exec("istio-cni", "ADD", &a, weir.to_string().as_bytes()).unwrap_or_else(|e| panic!("ADD again: {e}"));
    rt.check(&list, &a, &result).unwrap_or_else(|e| panic!("CHECK after ADD again: {e}"));
    assert!(!istio_rules(&pod).is_empty());
    rt.del(&list, &a, Some(&result)).unwrap_or_else(|e| panic!("DEL: {e}"));
    assert_eq!(istio_rules(&pod), "", "DEL left rules");
    rt.del(&list, &a, Some(&result)).unwrap_or_else(|e| panic!("second DEL: {e}"));
}

#[test]
fn iptables_capture_is_added_checked_and_deleted() {
    require_root!();
    add_check_break_del(false, "iptables");
}

#[test]
fn nftables_capture_over_an_https_api_server() {
    require_root!();
    add_check_break_del(true, "nftables");
}

#[test]
fn pods_without_a_sidecar_or_in_excluded_namespaces_are_passed_through() {
    require_root!();
    let node = Node::new(&test_name!(), false);
    node.api.set_pod(pod_object("shop", "plain", false, &[], &[]));
    node.api.set_pod(pod_object("shop", "opted-out", true, &[("sidecar.istio.io/inject", "false")], &[]));
    node.api.set_pod(pod_object("shop", "vm-style", true, &[], &[("DISABLE_ENVOY", "true")]));
    node.api.set_pod(pod_object("istio-system", "gw", true, &[], &[]));
    let rt = CniRuntime::new(&node.ns).unwrap();
    let list = node.conflist(json!({"exclude_namespaces": ["istio-system"]}));
    for (namespace, name) in
        [("shop", "plain"), ("shop", "opted-out"), ("shop", "vm-style"), ("istio-system", "gw")]
    {
        let pod = pod_netns(&rt, name);
        let a = Attachment::pod(&format!("c-{name}"), pod.path(), namespace, name);
        let result = rt.add(&list, &a).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(result["ips"][0]["address"].is_string(), "{name}: prevResult passed on: {result}");
        assert_eq!(istio_rules(&pod), "", "{name} was captured");
        rt.del(&list, &a, Some(&result)).unwrap();
    }
    let asked = node.api.requests.lock().unwrap().clone();
    assert!(
        !asked.iter().any(|p| p.contains("istio-system")),
        "excluded namespaces are not looked up: {asked:?}"
    );
}

/// Runs weir-cni alone with `stdin` and CNI_* for `netns`; the error object.
fn plugin_error(rt: &CniRuntime<'_>, command: &str, netns: &Path, stdin: &str) -> Value {
    let a = Attachment::pod("c-bad", netns, "shop", "web-1");
    let e = rt.exec("weir-cni", command, &a, stdin.as_bytes()).expect_err("the plugin should fail");
    assert_eq!(e.code, Some(1), "{e}");
    assert!(!e.stdout.contains("level=") && !e.stdout.contains("INFO"), "logs on stdout: {}", e.stdout);
    e.error()
}

#[test]
fn bad_input_gets_the_specs_error_json() {
    require_root!();
    let node = Node::new(&test_name!(), false);
    let rt = CniRuntime::new(&node.ns).unwrap();
    let pod = pod_netns(&rt, "web-1");
    let dir = node.run_dir.path().display().to_string();
    let good = json!({"cniVersion": "1.0.0", "name": "k8s", "type": "weir-cni", "cni_agent_run_dir": dir})
        .to_string();

    let e = plugin_error(&rt, "ADD", pod.path(), "{not json");
    assert_eq!(e["code"], 6, "{e}");
    let e = plugin_error(&rt, "ADD", pod.path(), r#"{"cniVersion": "9.9.9", "name": "k8s"}"#);
    assert_eq!(e["code"], 1, "{e}");
    let e = plugin_error(&rt, "ADD", Path::new("/run/netns/does-not-exist"), &good);
    assert_eq!(e["code"], 3, "{e}");
    assert!(e["msg"].as_str().unwrap().contains("/run/netns/does-not-exist"), "{e}");
    let e = plugin_error(&rt, "CHECK", pod.path(), &good);
    assert_eq!(e["code"], 7, "{e}");
    assert!(e["msg"].as_str().unwrap().contains("prevResult"), "{e}");
    // The pod is unknown to the API server: named, no retry loop.
    let e = plugin_error(&rt, "ADD", pod.path(), &good);
    assert_eq!(e["code"], 101, "{e}");
    assert!(e["details"].as_str().unwrap().contains("pod shop/web-1 not found"), "{e}");
    // A wrong token: the API server's answer is in the details.
    let bad_token = Dir::new("cni-bad-token").unwrap();
    write_kubeconfig(bad_token.path(), &node.api.kubeconfig("stolen", None)).unwrap();
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let other =
        json!({"cniVersion": "1.0.0", "name": "k8s", "cni_agent_run_dir": bad_token.path()}).to_string();
    let e = plugin_error(&rt, "ADD", pod.path(), &other);
    assert!(e["details"].as_str().unwrap().contains("HTTP 401"), "{e}");
    // A bad capture annotation is named.
    node.api.set_pod(pod_object(
        "shop",
        "web-1",
        true,
        &[("traffic.sidecar.istio.io/excludeInboundPorts", "http")],
        &[],
    ));
    let e = plugin_error(&rt, "ADD", pod.path(), &good);
    assert_eq!(e["code"], 102, "{e}");
    assert!(e["details"].as_str().unwrap().contains("traffic.sidecar.istio.io/excludeInboundPorts"), "{e}");
    assert_eq!(istio_rules(&pod), "", "nothing half applied");

    // VERSION and STATUS.
    let a = Attachment::pod("c", pod.path(), "shop", "web-1");
    let v: Value =
        serde_json::from_str(&rt.exec("weir-cni", "VERSION", &a, b"{\"cniVersion\":\"1.0.0\"}").unwrap())
            .unwrap();
    assert!(v["supportedVersions"].as_array().unwrap().contains(&json!("0.4.0")), "{v}");
    rt.exec("weir-cni", "STATUS", &a, good.as_bytes()).unwrap();
    let missing =
        json!({"cniVersion": "1.1.0", "name": "k8s", "cni_agent_run_dir": "/nonexistent"}).to_string();
    let e = plugin_error(&rt, "STATUS", pod.path(), &missing);
    assert_eq!(e["code"], 50, "{e}");
}

#[test]
fn a_hundred_parallel_adds_each_capture_their_own_pod() {
    require_root!();
    const PODS: usize = 100;
    let node = Node::new(&test_name!(), false);
    for i in 0..PODS {
        node.api.set_pod(pod_object("load", &format!("p{i}"), true, &[], &[]));
    }
    let rt = CniRuntime::new(&node.ns).unwrap();
    let list = node.conflist(json!({"capture_mode": "iptables"}));
    let pods: Vec<NetNs> =
        (0..PODS).map(|i| NetNs::create(&unique_name(&format!("p{i}"))).unwrap()).collect();
    let results: Vec<Result<Value, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = pods
            .iter()
            .enumerate()
            .map(|(i, ns)| {
                let (rt, list) = (&rt, &list);
                s.spawn(move || {
                    let a = Attachment::pod(&format!("c-p{i}"), ns.path(), "load", &format!("p{i}"));
                    rt.add(list, &a).map_err(|e| e.to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let failures: Vec<String> = results.iter().filter_map(|r| r.as_ref().err().cloned()).collect();
    assert!(failures.is_empty(), "{} of {PODS} ADDs failed:\n{}", failures.len(), failures.join("\n"));
    let mut ips: Vec<String> = results.iter().map(|r| pod_ip(r.as_ref().unwrap())).collect();
    // Every pod has its own address and exactly one copy of the rules.
    for (i, ns) in pods.iter().enumerate() {
        let rules = run_in(ns, None, Command::new("iptables-save"), &["-t", "nat"]);
        assert_eq!(rules.matches("-A ISTIO_OUTPUT -j ISTIO_REDIRECT").count(), 1, "pod {i}:\n{rules}");
        let addr = run_in(ns, None, Command::new("ip"), &["-4", "-o", "addr", "show", "eth0"]);
        assert!(addr.contains(&format!("{}/24", ips[i])), "pod {i} holds {addr}, CNI said {}", ips[i]);
    }
    ips.sort();
    ips.dedup();
    assert_eq!(ips.len(), PODS, "addresses are unique");
    for (i, ns) in pods.iter().enumerate() {
        let a = Attachment::pod(&format!("c-p{i}"), ns.path(), "load", &format!("p{i}"));
        rt.del(&list, &a, results[i].as_ref().ok()).unwrap_or_else(|e| panic!("DEL p{i}: {e}"));
    }
}

/// The node's DaemonSet agent: `weir cni install|uninstall --ebpf-cgroup` on a test
/// host layout (net.d with a primary conflist, bin, run) and this node's kubeconfig.
struct NodeAgent {
    host: Dir,
    kubeconfig: std::path::PathBuf,
    cgroup: String,
    name: String,
}

impl NodeAgent {
    fn new(node: &Node, cgroup: &Path, name: &str) -> Self {
        let host = Dir::new("cni-host").unwrap();
        std::fs::create_dir_all(host.path().join("net.d")).unwrap();
        std::fs::write(
            host.path().join("net.d/10-k8s.conflist"),
            r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"ptp"}]}"#,
        )
        .unwrap();
        Self {
            host,
            kubeconfig: node.run_dir.path().join("istio-cni-kubeconfig"),
            cgroup: cgroup.display().to_string(),
            name: name.into(),
        }
    }

    fn run(&self, verb: &str, once: &[&str]) -> std::process::Output {
        self.command(verb, once).output().unwrap()
    }

    /// `weir cni install` as the DaemonSet runs it (watching), as the build whose
    /// program set is `set` (the key's suffix: another build), until it is stopped
    /// (killed on drop, pass or fail).
    fn start(&self, set: &str) -> Running {
        let log = std::fs::File::create(self.host.path().join("agent.log")).unwrap();
        self.command("install", &["--interval", "200ms"])
            .env(weir_agent::capture::ebpf::set::SET_ENV, set)
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .map(Running)
            .unwrap()
    }

    fn command(&self, verb: &str, once: &[&str]) -> Command {
        let mut cmd = weir_tests::cni::node_agent_command(
            verb,
            self.host.path(),
            Path::new(&self.cgroup),
            &self.name,
            &self.kubeconfig,
        );
        // The tests read the agent's info lines (the kernel matrix's VM sets warn).
        cmd.args(once).env("WEIR_LOG", "info");
        // With the install container's capabilities only, as the DaemonSet runs it.
        weir_tests::daemonset::confine(&mut cmd, "install");
        cmd
    }

    /// The chain as install left it.
    fn installed(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.host.path().join("net.d/10-k8s.conflist")).unwrap())
            .unwrap()
    }
}

/// A test cgroup with a node capture attached to it (removed when the guard drops):
/// the cgroup, the capture's name and its guard.
fn attached_node_capture(test: &str) -> (weir_tests::Cgroup, String, NodeCapture) {
    let cgroup = test_cgroup(test);
    let name = unique_name("cni-node");
    let guard = NodeCapture(name.clone());
    weir_agent::node::cni::node_capture::attach_node(&name, cgroup.path()).unwrap();
    (cgroup, name, guard)
}

/// A pod on the node's bridge through the primary plugin alone (no Weir): its
/// namespace and address.
fn plain_pod(node: &Node, rt: &CniRuntime<'_>, name: &str) -> (NetNs, String) {
    let ns = pod_netns(rt, name);
    let mut plain_chain = node.conflist(json!({}));
    plain_chain["plugins"].as_array_mut().unwrap().pop();
    let result = rt.add(&plain_chain, &Attachment::pod(&format!("c-{name}"), ns.path(), "x", name)).unwrap();
    (ns, pod_ip(&result))
}

/// web-1's ADD in auto mode, the conflist naming the node capture `capture`: the
/// conflist, the attachment, the result and the pod's IP.
fn add_auto(
    node: &Node,
    rt: &CniRuntime<'_>,
    pod: &NetNs,
    capture: &str,
) -> (Value, Attachment, Value, String) {
    let list = node.conflist(json!({"capture_mode": "auto", "ebpf_node_capture": capture}));
    let a = Attachment::pod("c-web-1", pod.path(), "shop", "web-1");
    let result = rt.add(&list, &a).unwrap_or_else(|e| panic!("ADD: {e}"));
    let ip = pod_ip(&result);
    (list, a, result, ip)
}

/// A process of the pod as `uid`, in `cgroup` when given.
fn placed<'a>(pod: &'a NetNs, cgroup: Option<&'a weir_tests::Cgroup>, uid: u32) -> Placement<'a> {
    Placement { netns: Some(pod), cgroup, user: Some((uid, uid)), ..Placement::default() }
}

/// Stand-ins on 15001 and 15006 (uid 1337); the app (uid 1000) connects to the gateway
/// and must land on 15001 with its original destination. Then the node connects to the
/// pod's 8080: returns the (local, original destination) the inbound side reported, and
/// the stand-ins, still listening (so a later connect that fails was not captured).
fn ask_through_capture(
    node: &Node,
    pod: &NetNs,
    cgroup: Option<&weir_tests::Cgroup>,
    ip: &str,
    rules: &str,
) -> (String, String, [weir_tests::PodChild; 2]) {
    let outbound = start_placed(placed(pod, cgroup, 1337), &["capture-listener", "0.0.0.0:15001"]).unwrap();
    let inbound = start_placed(placed(pod, cgroup, 1337), &["capture-listener", "0.0.0.0:15006"]).unwrap();
    let app = placed(pod, cgroup, 1000);
    let out = run_placed(app, tools::testkit_command(), &["ask", &format!("{GATEWAY}:80")]);
    let (local, orig) = captured(&out).unwrap_or_else(|| panic!("outbound not captured: {out}\n{rules}"));
    assert!(local.ends_with(":15001") && orig == format!("{GATEWAY}:80"), "{out}");
    let out = run_in(&node.ns, None, tools::testkit_command(), &["ask", &format!("{ip}:8080")]);
    let (local, orig) = captured(&out).unwrap_or_else(|| panic!("inbound not captured: {out}"));
    (local, orig, [outbound, inbound])
}

/// A running node agent; killed on drop.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Ends a node agent as the kubelet would (`signal`), and what it logged.
fn stop(agent: &NodeAgent, mut running: Running, signal: nix::sys::signal::Signal) -> String {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(running.0.id() as i32), signal).unwrap();
    let status = running.0.wait().unwrap();
    let log = std::fs::read_to_string(agent.host.path().join("agent.log")).unwrap_or_default();
    if signal == nix::sys::signal::Signal::SIGTERM {
        assert!(status.success(), "the agent did not stop cleanly: {log}");
    }
    log
}

/// Waits until the node capture `name` runs the program set whose key ends in `set`.
fn wait_node_capture(name: &str, set: &str) -> weir_agent::capture::ebpf::record::PinRecord {
    weir_tests::control_plane::eventually(std::time::Duration::from_secs(20), || {
        weir_agent::capture::ebpf::record::PinRecord::load(name)
            .filter(|r| r.programs.as_deref().is_some_and(|k| k.ends_with(set)))
    })
    .unwrap_or_else(|| panic!("the node capture {name} never ran set {set}"))
}

/// `weir capture status --json`: one object per pinned capture.
fn capture_status() -> Vec<serde_json::Value> {
    let out =
        std::process::Command::new(tools::weir()).args(["capture", "status", "--json"]).output().unwrap();
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("capture status: {e}: {}", String::from_utf8_lossy(&out.stderr)))
}

/// Detaches the node's eBPF capture when the test ends, passed or not.
struct NodeCapture(String);

impl Drop for NodeCapture {
    fn drop(&mut self) {
        let _ = weir_agent::node::cni::node_capture::detach_node(&self.0);
    }
}

#[test]
fn ebpf_capture_registers_pods_with_the_node_capture() {
    require_root!();
    // Declared first, dropped last: a bpffs this test mounted is unmounted, pass or fail.
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let cgroup = test_cgroup(&test_name!());
    let name = unique_name("cni-node");
    let _guard = NodeCapture(name.clone());

    // The node side: `weir cni install --ebpf-cgroup` attaches and pins the programs.
    let node_agent = NodeAgent::new(&node, cgroup.path(), &name);
    let out = node_agent.run("install", &["--once"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let installed = node_agent.installed();
    assert_eq!(installed["plugins"][1]["ebpf_node_capture"], name.as_str());
    assert!(Path::new("/sys/fs/bpf/weir").join(&name).join("links").exists(), "node capture pinned");

    let rt = CniRuntime::new(&node.ns).unwrap();
    let pod = pod_netns(&rt, "web-1");
    let (list, a, result, ip) = add_auto(&node, &rt, &pod, &name);
    assert_eq!(istio_rules(&pod), "", "auto picked eBPF: no netfilter rules");

    // The plugin lists the interface's tc filters with one blocking netlink dump (no
    // runtime): it reads what `tc filter show` reads (priority, handle, program id), and
    // Weir's one filter is there at Weir's priority and handle. An unknown interface is
    // named.
    let (blocking, unknown) = weir_agent::capture::ebpf::netns::in_netns(pod.path(), || {
        let blocking =
            weir_iptables::netlink::ingress_bpf_filters_blocking("eth0").map_err(std::io::Error::other)?;
        let unknown =
            weir_iptables::netlink::ingress_bpf_filters_blocking("nosuch0").unwrap_err().to_string();
        Ok((blocking, unknown))
    })
    .unwrap();
    let tc = run_in(&pod, None, Command::new("tc"), &["filter", "show", "dev", "eth0", "ingress"]);
    let from_tc: Vec<(u16, u32, u32)> = tc
        .lines()
        .filter(|l| l.contains(" bpf ") && l.contains(" handle "))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let after = |key: &str| {
                words[words.iter().position(|w| *w == key).unwrap_or_else(|| panic!("{key} in {l}")) + 1]
            };
            (
                after("pref").parse().unwrap(),
                u32::from_str_radix(after("handle").trim_start_matches("0x"), 16).unwrap(),
                after("id").parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        blocking.iter().map(|f| (f.priority, f.handle, f.prog_id)).collect::<Vec<_>>(),
        from_tc,
        "{tc}"
    );
    use weir_agent::capture::ebpf::inbound::{FILTER_HANDLE, FILTER_PRIORITY};
    assert_eq!(
        blocking.iter().map(|f| (f.priority, f.handle)).collect::<Vec<_>>(),
        [(FILTER_PRIORITY, FILTER_HANDLE)],
        "{blocking:?}"
    );
    assert!(blocking[0].prog_id != 0 && !blocking[0].name.is_empty(), "{blocking:?}");
    assert!(unknown.contains("nosuch0"), "{unknown}");

    // Processes in the pods' cgroup and the pod's namespace are captured.
    let placed = |uid: u32| placed(&pod, Some(&cgroup), uid);
    let (local, _, _stand_ins) = ask_through_capture(&node, &pod, Some(&cgroup), &ip, "");
    // Nothing listens on 8080: the 15006 listener answered; sk_assign keeps the original
    // destination as the local address.
    assert_eq!(local, format!("{ip}:8080"), "inbound");
    rt.check(&list, &a, &result).unwrap_or_else(|e| panic!("CHECK: {e}"));
    // `weir capture status` shows the node capture and the pod registered with it as
    // live: the pod has no links of its own, the node capture's are its links.
    let status = capture_status();
    let ours: Vec<&serde_json::Value> = status
        .iter()
        .filter(|p| p["pod"].as_str().is_some_and(|n| n == name || n.starts_with(&format!("{name}-pod-"))))
        .collect();
    assert_eq!(ours.len(), 2, "the node capture and the pod: {status:?}");
    assert!(ours.iter().all(|p| p["live"] == true), "{status:?}");
    // The pod's own decisions, counted in the node set's maps: the app's one connection
    // redirected, its original destination answered.
    let pod_status = ours.iter().find(|p| p["pod"] != name.as_str()).unwrap();
    assert_eq!(pod_status["counters"]["redirected"], 1, "{pod_status}");
    assert_eq!(pod_status["counters"]["orig_dst_answered"], 1, "{pod_status}");
    // And the node classifier's, for this pod by its netns cookie: the node's one
    // connection to 8080 assigned to the 15006 listener.
    assert_eq!(pod_status["counters"]["inbound_assigned"], 1, "{pod_status}");
    assert_eq!(pod_status["counters"]["inbound_no_listener"], 0, "{pod_status}");

    // A namespace whose `lo` is still down (the runtime's loopback ADD may come later)
    // registers too.
    node.api.set_pod(pod_object("shop", "web-2", true, &[], &[]));
    let bare = NetNs::create(&unique_name("web-2")).unwrap();
    let b = Attachment::pod("c-web-2", bare.path(), "shop", "web-2");
    let bare_result = rt.add(&list, &b).unwrap_or_else(|e| panic!("ADD with lo down: {e}"));
    rt.check(&list, &b, &bare_result).unwrap_or_else(|e| panic!("CHECK with lo down: {e}"));
    // Counted per pod: web-2 is registered with the same node classifier and has had
    // no inbound connection, while web-1's one is still counted as web-1's.
    let status = capture_status();
    let of = |netns: &Path| {
        status.iter().find(|p| p["netns"].as_str().is_some_and(|n| Path::new(n) == netns)).cloned()
    };
    let web2 = of(bare.path()).unwrap_or_else(|| panic!("web-2 in capture status: {status:?}"));
    assert_eq!(web2["counters"]["inbound_assigned"], 0, "{web2}");
    let web1 = of(pod.path()).unwrap_or_else(|| panic!("web-1 in capture status: {status:?}"));
    assert_eq!(web1["counters"]["inbound_assigned"], 1, "{web1}");
    // A check that cannot be made is not read as "nothing wrong": with web-2's
    // interface renamed, its inbound filters cannot be listed under the recorded name,
    // and CHECK and status say so. Before, a failed listing counted as a filter found.
    let rename = |from: &str, to: &str| {
        for args in [
            vec!["link", "set", from, "down"],
            vec!["link", "set", from, "name", to],
            vec!["link", "set", to, "up"],
        ] {
            run_in(&bare, None, Command::new("ip"), &args);
        }
    };
    rename("eth0", "weir-renamed0");
    // Weir's CHECK alone: the bridge plugin's own CHECK would refuse the rename first.
    let weir_check = CniRuntime::plugin_config(&list, &list["plugins"][1], Some(&bare_result));
    let e = rt.exec("istio-cni", "CHECK", &b, weir_check.to_string().as_bytes()).unwrap_err();
    assert!(e.stdout.contains("cannot check the inbound filters on eth0"), "{e}");
    let web2 = capture_status()
        .into_iter()
        .find(|p| p["netns"].as_str().is_some_and(|n| Path::new(n) == bare.path()));
    let web2 = web2.unwrap_or_else(|| panic!("web-2 in capture status"));
    assert_eq!(web2["live"], false, "{web2}");
    assert!(web2["faults"].to_string().contains("cannot check the inbound filters on eth0"), "{web2}");
    rename("weir-renamed0", "eth0");
    rt.check(&list, &b, &bare_result).unwrap_or_else(|e| panic!("CHECK with eth0 back: {e}"));
    rt.exec("istio-cni", "CHECK", &b, weir_check.to_string().as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    rt.del(&list, &b, Some(&bare_result)).unwrap();

    // DEL unregisters: the app's connections go where they were sent; CHECK says so.
    rt.del(&list, &a, Some(&result)).unwrap_or_else(|e| panic!("DEL: {e}"));
    let out = try_run_placed(placed(1000), tools::testkit_command(), &["ask", &format!("{GATEWAY}:80")]);
    // Uncaptured, the app's connect goes to the network, which the runtime's DEL took
    // away: the connect itself fails (captured, the stand-in on 15001 would answer).
    let uncaptured = out.as_ref().is_err_and(|e| e.contains("weir-testkit: connect: "));
    assert!(uncaptured, "still captured after DEL: {out:?}");
    rt.del(&list, &a, Some(&result)).unwrap_or_else(|e| panic!("second DEL: {e}"));

    // Uninstall detaches the node capture.
    let out = node_agent.run("uninstall", &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!Path::new("/sys/fs/bpf/weir").join(&name).exists(), "node capture unpinned");
}

/// A pod as the API lists it on a node: UID, node, IP.
fn listed_pod(name: &str, sidecar: bool, node: &str, ip: &str) -> Value {
    let mut object = pod_object("shop", name, sidecar, &[], &[]);
    object["metadata"]["uid"] = json!(format!("uid-{name}"));
    object["spec"]["nodeName"] = json!(node);
    object["status"] = json!({"podIP": ip});
    object
}

/// The node agent stopped (SIGTERM), killed (SIGKILL), rolled to a build with another
/// program set and rolled back, with pods registered: no pod ever loses its capture.
/// Before, SIGTERM uninstalled: it detached the node capture and unregistered every
/// pod; and the new build refused the old build's node capture (OtherVersion).
#[test]
fn capture_outlives_the_node_agent_through_restarts_and_rollouts() {
    use nix::sys::signal::Signal;
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    let cgroup = test_cgroup(&test_name!());
    let name = unique_name("cni-node");
    let (old, new) = (unique_name("old").replace('-', "_"), unique_name("new").replace('-', "_"));
    // Dropped after the node capture is detached, so the sets are unused by then.
    let _sets = [SetGuard(old.clone()), SetGuard(new.clone())];
    let _guard = NodeCapture(name.clone());
    let agent = NodeAgent::new(&node, cgroup.path(), &name);
    let mut rt = CniRuntime::new(&node.ns).unwrap();
    rt.env = vec![(weir_agent::capture::ebpf::set::SET_ENV.into(), old.clone())];

    let running = agent.start(&old);
    let old_key = wait_node_capture(&name, &old).programs.unwrap();
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let web1 = pod_netns(&rt, "web-1");
    let (list, a, result, ip1) = add_auto(&node, &rt, &web1, &name);
    let captured = |pod: &NetNs, ip: &str, when: &str| {
        let (local, _, _stand_ins) = ask_through_capture(&node, pod, Some(&cgroup), ip, when);
        assert_eq!(local, format!("{ip}:8080"), "{when}: inbound");
    };
    captured(&web1, &ip1, "installed");

    let log = stop(&agent, running, Signal::SIGTERM);
    captured(&web1, &ip1, "after SIGTERM");
    assert!(log.contains("every pod stays captured"), "{log}");
    assert_eq!(agent.installed()["plugins"][1]["type"], "weir-cni", "still chained after SIGTERM");
    stop(&agent, agent.start(&old), Signal::SIGKILL);
    captured(&web1, &ip1, "after SIGKILL");

    // Rolled to another build: the old build's set stays attached for web-1; new pods
    // go to the new build's set.
    let running = agent.start(&new);
    let new_key = wait_node_capture(&name, &new).programs.unwrap();
    let retired = weir_agent::node::cni::ebpf::retired_name(&name, &old_key);
    let kept = weir_agent::capture::ebpf::record::PinRecord::load(&retired)
        .expect("the old set is kept for its pods");
    assert_eq!(kept.programs.as_deref(), Some(old_key.as_str()));
    captured(&web1, &ip1, "after the rollout");
    rt.env = vec![(weir_agent::capture::ebpf::set::SET_ENV.into(), new.clone())];
    node.api.set_pod(pod_object("shop", "web-2", true, &[], &[]));
    let web2 = pod_netns(&rt, "web-2");
    let b = Attachment::pod("c-web-2", web2.path(), "shop", "web-2");
    let result2 = rt.add(&list, &b).unwrap_or_else(|e| panic!("ADD with the new build: {e}"));
    let ip2 = pod_ip(&result2);
    captured(&web2, &ip2, "a pod of the new build");
    captured(&web1, &ip1, "the old build's pod beside it");
    let out = std::process::Command::new(tools::weir()).args(["capture", "status"]).output().unwrap();
    assert!(out.status.success(), "status after the rollout: {}", String::from_utf8_lossy(&out.stdout));

    // Rolled back: the old build's set becomes the node capture again (never attached
    // twice), the new build's is kept for web-2, and goes with it.
    stop(&agent, running, Signal::SIGTERM);
    let running = agent.start(&old);
    weir_tests::control_plane::eventually(std::time::Duration::from_secs(20), || {
        weir_agent::capture::ebpf::record::PinRecord::load(&retired).is_none().then_some(())
    })
    .expect("the old set taken up again");
    wait_node_capture(&name, &old);
    let kept_new = weir_agent::node::cni::ebpf::retired_name(&name, &new_key);
    assert!(
        weir_agent::capture::ebpf::record::PinRecord::load(&kept_new).is_some(),
        "the new build's set kept for web-2"
    );
    let hooks = weir_tests::capture::cgroup_programs(cgroup.path());
    assert_eq!(
        hooks.iter().filter(|l| l.split_whitespace().last() == Some("weir_connect4")).count(),
        2,
        "one connect4 per set: {hooks:?}"
    );
    captured(&web1, &ip1, "after the rollback");
    captured(&web2, &ip2, "the new build's pod after the rollback");
    rt.del(&list, &b, Some(&result2)).unwrap_or_else(|e| panic!("DEL web-2: {e}"));
    assert!(
        weir_agent::capture::ebpf::record::PinRecord::load(&kept_new).is_none(),
        "the new build's set went with its last pod"
    );
    assert!(!weir_agent::capture::ebpf::set::set_dir(&new_key).exists(), "and its programs");
    stop(&agent, running, Signal::SIGTERM);
    rt.env = vec![(weir_agent::capture::ebpf::set::SET_ENV.into(), old.clone())];
    rt.del(&list, &a, Some(&result)).unwrap_or_else(|e| panic!("DEL web-1: {e}"));
    let out = agent.run("uninstall", &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// What a crafted SYN from `client` to the server (`mac`, `dst`:`port`) drew.
fn syn_probe(client: &NetNs, mac: [u8; 6], src: &str, dst: &str, port: u16, shape: &str) -> String {
    let mac = mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
    let args = ["syn-probe", "eth0", &mac, src, dst, &port.to_string(), shape];
    run_in(client, None, tools::testkit_command(), &args)
}

/// Inbound capture fails closed, through the node classifier. A SYN to a captured port
/// while nothing listens on 15006 (Envoy starting, restarting, gone) is refused: before,
/// it reached the app in plain text. SYNs the classifier cannot read (IPv4 and IPv6
/// fragments, more VLAN tags than it reads) never reach the app: before, they went
/// straight to it, as did IPv6 SYNs behind extension headers and SYNs behind two VLAN
/// priority tags (the kernel strips the second after this hook), which it now reads
/// through and captures like any SYN.
#[test]
fn inbound_capture_refuses_what_it_cannot_hand_to_envoy() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let (cgroup, name, _guard) = attached_node_capture(&test_name!());
    let rt = CniRuntime::new(&node.ns).unwrap();
    let server = pod_netns(&rt, "web-1");
    let (client, client_ip) = plain_pod(&node, &rt, "client");
    let (list, a, result, ip) = add_auto(&node, &rt, &server, &name);
    // IPv6 addresses too, then the runtime's ADD again: registered again in place.
    for (ns, v6) in [(&server, "fd00:77::10"), (&client, "fd00:77::20")] {
        run_in(
            ns,
            None,
            Command::new("ip"),
            &["-6", "addr", "add", &format!("{v6}/64"), "dev", "eth0", "nodad"],
        );
    }
    let weir = CniRuntime::plugin_config(&list, &list["plugins"][1], Some(&result));
    rt.exec("istio-cni", "ADD", &a, weir.to_string().as_bytes()).unwrap_or_else(|e| panic!("ADD again: {e}"));
    let mac = weir_agent::capture::ebpf::netns::interface_mac(server.path(), "eth0").unwrap();
    let in_pod = |uid: u32| placed(&server, Some(&cgroup), uid);

    // The app listens; Envoy does not yet.
    let app = start_placed(in_pod(1000), &["serve-hello", "0.0.0.0:8080", "app"]).unwrap();
    assert_eq!(
        syn_probe(&client, mac, &client_ip, &ip, 8080, "plain"),
        "nothing",
        "no listener on 15006: dropped"
    );
    let out = try_run_placed(
        placed(&client, None, 1000),
        tools::testkit_command(),
        &["ask", &format!("{ip}:8080")],
    );
    assert!(out.is_err(), "the app answered around its sidecar: {out:?}");
    drop(app);

    // Envoy listens, the app does not: what is captured gets a SYN-ACK from 15006, what
    // bypassed capture would get a RST from the app's closed port, and what is dropped
    // gets nothing.
    let _envoy = ["0.0.0.0:15006", "[::]:15006"]
        .map(|at| start_placed(in_pod(1337), &["capture-listener", at]).unwrap());
    for (src, dst, shape, expected) in [
        (client_ip.as_str(), ip.as_str(), "plain", "syn-ack"),
        (&client_ip, &ip, "fragments", "nothing"),
        (&client_ip, &ip, "qinq", "syn-ack"),
        (&client_ip, &ip, "vlan4", "nothing"),
        ("fd00:77::20", "fd00:77::10", "plain", "syn-ack"),
        ("fd00:77::20", "fd00:77::10", "qinq", "syn-ack"),
        ("fd00:77::20", "fd00:77::10", "hbh", "syn-ack"),
        ("fd00:77::20", "fd00:77::10", "dstopts", "syn-ack"),
        ("fd00:77::20", "fd00:77::10", "fragments", "nothing"),
    ] {
        assert_eq!(syn_probe(&client, mac, src, dst, 8080, shape), expected, "{shape} SYN to {dst}");
    }
    let status = capture_status();
    let web1 = status
        .iter()
        .find(|p| p["netns"].as_str().is_some_and(|n| Path::new(n) == server.path()))
        .unwrap_or_else(|| panic!("web-1 in capture status: {status:?}"));
    // Each fragment of the two fragmented SYNs.
    assert_eq!(web1["counters"]["inbound_unparseable"], 4, "{web1}");
    // Plain, QinQ (both families), Hop-by-Hop and Destination Options.
    assert_eq!(web1["counters"]["inbound_assigned"], 6, "{web1}");
    assert!(web1["counters"]["inbound_no_listener"].as_u64() >= Some(2), "{web1}");
    rt.del(&list, &a, Some(&result)).unwrap_or_else(|e| panic!("DEL: {e}"));
}

/// A pod cannot take over another pod's inbound capture by registering with its address
/// and MAC address (a pod that set both on its own interface, then had its capture
/// registered again): the registration is refused, naming the address, and the other
/// pod stays captured. A leftover of a pod that is no longer registered may be taken,
/// and then removing the old pod leaves the new owner's entry alone. Before, the second
/// registration replaced the first pod's entry with its own config (here: port 8080
/// not captured), and the first pod's SYNs went around its sidecar.
#[test]
fn a_pod_cannot_take_another_pods_inbound_address() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let exclude = [("traffic.sidecar.istio.io/excludeInboundPorts", "8080")];
    node.api.set_pod(pod_object("shop", "thief", true, &exclude, &[]));
    let (cgroup, name, _guard) = attached_node_capture(&test_name!());
    let rt = CniRuntime::new(&node.ns).unwrap();
    let server = pod_netns(&rt, "web-1");
    let (client, client_ip) = plain_pod(&node, &rt, "client");
    let (list, a, result, ip) = add_auto(&node, &rt, &server, &name);
    let mac = weir_agent::capture::ebpf::netns::interface_mac(server.path(), "eth0").unwrap();
    let mac_text = mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");

    // The thief's interface gets web-1's MAC address and address, then its ADD.
    let mut plain_chain = node.conflist(json!({}));
    plain_chain["plugins"].as_array_mut().unwrap().pop();
    let thief = pod_netns(&rt, "thief");
    let t = Attachment::pod("c-thief", thief.path(), "shop", "thief");
    let bridge = rt.add(&plain_chain, &t).unwrap_or_else(|e| panic!("bridge ADD: {e}"));
    let disguise = |ns: &NetNs| {
        for args in [
            vec!["link", "set", "eth0", "down"],
            vec!["link", "set", "eth0", "address", &mac_text],
            vec!["link", "set", "eth0", "up"],
            vec!["addr", "add", &format!("{ip}/32"), "dev", "eth0"],
        ] {
            run_in(ns, None, Command::new("ip"), &args);
        }
    };
    disguise(&thief);
    let weir = CniRuntime::plugin_config(&list, &list["plugins"][1], Some(&bridge));
    let e =
        rt.exec("istio-cni", "ADD", &t, weir.to_string().as_bytes()).expect_err("the thief's ADD is refused");
    assert!(
        e.to_string()
            .contains(&format!("address {ip} on an interface with MAC address {mac_text} is registered")),
        "{e}"
    );
    rt.del(&plain_chain, &t, Some(&bridge)).unwrap_or_else(|e| panic!("DEL thief: {e}"));
    drop(thief);

    // web-1 is still captured: with Envoy on 15006 and nothing on 8080, its SYN to 8080
    // is answered by Envoy (a RST would be the bypass).
    let in_pod = |uid: u32| placed(&server, Some(&cgroup), uid);
    let _envoy = start_placed(in_pod(1337), &["capture-listener", "0.0.0.0:15006"]).unwrap();
    assert_eq!(syn_probe(&client, mac, &client_ip, &ip, 8080, "plain"), "syn-ack", "web-1 captured");

    // web-1's inbound registration lost (as a failed removal would leave it): its entry
    // is a leftover, and the next pod with that address takes it.
    let key = weir_agent::node::cni::ebpf::pod_records(&name)
        .into_iter()
        .find(|r| r.netns.as_deref() == Some(server.path()))
        .unwrap()
        .programs
        .unwrap();
    let counters = weir_agent::capture::ebpf::set::set_dir(&key).join("maps").join("INBOUND_POD_COUNTERS");
    let cookie = weir_agent::capture::ebpf::netns::netns_cookie(Some(server.path())).unwrap();
    let key_bytes: Vec<String> = cookie.to_ne_bytes().iter().map(|b| b.to_string()).collect();
    let mut args = vec!["map", "delete", "pinned", counters.to_str().unwrap(), "key"];
    args.extend(key_bytes.iter().map(String::as_str));
    let out = Command::new("bpftool").args(&args).output().unwrap();
    assert!(out.status.success(), "bpftool map delete: {}", String::from_utf8_lossy(&out.stderr));
    let heir = pod_netns(&rt, "thief");
    let h = Attachment::pod("c-heir", heir.path(), "shop", "thief");
    let bridge = rt.add(&plain_chain, &h).unwrap_or_else(|e| panic!("bridge ADD: {e}"));
    disguise(&heir);
    let weir = CniRuntime::plugin_config(&list, &list["plugins"][1], Some(&bridge));
    rt.exec("istio-cni", "ADD", &h, weir.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("ADD over a leftover: {e}"));
    let heir_cookie = weir_agent::capture::ebpf::netns::netns_cookie(Some(heir.path())).unwrap();
    let set_dir = weir_agent::capture::ebpf::set::set_dir(&key);
    let owns = || {
        weir_agent::capture::ebpf::inbound::pod_config(
            &set_dir,
            std::path::Path::new("/nonexistent"),
            heir_cookie,
        )
        .unwrap()
        .is_some()
    };
    assert!(owns(), "the heir owns the address");
    rt.del(&list, &a, Some(&result)).unwrap_or_else(|e| panic!("DEL web-1: {e}"));
    assert!(owns(), "removing web-1 left the heir's entry alone");
    rt.del(&list, &h, Some(&bridge)).unwrap_or_else(|e| panic!("DEL heir: {e}"));
}

/// ADD again for a pod that is captured (the runtime retried it, or repair) that fails
/// after the switch to its new registration leaves the pod captured. Before, the
/// failure path unregistered the pod, and its SYNs went around its sidecar.
#[test]
fn a_failed_add_again_leaves_the_pod_captured() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let (cgroup, name, _guard) = attached_node_capture(&test_name!());
    let rt = CniRuntime::new(&node.ns).unwrap();
    let server = pod_netns(&rt, "web-1");
    let (client, client_ip) = plain_pod(&node, &rt, "client");
    let (list, a, result, ip) = add_auto(&node, &rt, &server, &name);
    let mac = weir_agent::capture::ebpf::netns::interface_mac(server.path(), "eth0").unwrap();
    let _envoy =
        start_placed(placed(&server, Some(&cgroup), 1337), &["capture-listener", "0.0.0.0:15006"]).unwrap();
    assert_eq!(syn_probe(&client, mac, &client_ip, &ip, 8080, "plain"), "syn-ack", "captured");

    // The record cannot be written (a directory where its temporary file goes).
    let record = weir_agent::node::cni::ebpf::pod_records(&name)
        .into_iter()
        .find(|r| r.netns.as_deref() == Some(server.path()))
        .expect("web-1's record");
    let blocker = std::path::Path::new(weir_agent::capture::ebpf::record::RECORD_DIR)
        .join(format!("{}.json.tmp", record.pod));
    std::fs::create_dir(&blocker).unwrap();
    let weir = CniRuntime::plugin_config(&list, &list["plugins"][1], Some(&result));
    let e = rt.exec("istio-cni", "ADD", &a, weir.to_string().as_bytes());
    std::fs::remove_dir(&blocker).unwrap();
    let e = e.expect_err("ADD again fails: the record cannot be written");
    assert!(e.to_string().contains("write the pod's capture record"), "{e}");
    assert_eq!(syn_probe(&client, mac, &client_ip, &ip, 8080, "plain"), "syn-ack", "still captured");
    rt.del(&list, &a, Some(&result)).unwrap_or_else(|e| panic!("DEL: {e}"));
}

/// Capture's second line, at the socket: an app's listener on a captured port takes no
/// connection that came in from outside the pod around the inbound classifier: not to
/// an address the pod was not registered with (one added later, as SLAAC does), not
/// over a second interface the classifier is not on (as Multus adds). What the
/// classifier hands Envoy, and what Envoy hands the app over loopback (from 127.0.0.6),
/// work as before. Before, both went straight to the app.
#[test]
fn the_inbound_guard_refuses_what_went_around_the_classifier() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let (cgroup, name, _guard) = attached_node_capture(&test_name!());
    let rt = CniRuntime::new(&node.ns).unwrap();
    let server = pod_netns(&rt, "web-1");
    let (client, _) = plain_pod(&node, &rt, "client");
    let (list, a, result, ip) = add_auto(&node, &rt, &server, &name);
    let in_pod = |uid: u32| placed(&server, Some(&cgroup), uid);
    let _app = start_placed(in_pod(1000), &["serve-hello", "0.0.0.0:8080", "app"]).unwrap();
    let _envoy = start_placed(in_pod(1337), &["capture-listener", "0.0.0.0:15006"]).unwrap();
    let ask = |to: &str| {
        try_run_placed(placed(&client, None, 1000), tools::testkit_command(), &["ask", &format!("{to}:8080")])
    };

    // The registered address: captured (Envoy's stand-in answers), as before.
    let through = ask(&ip).unwrap_or_else(|e| panic!("the registered address: {e}"));
    assert!(through.starts_with("captured "), "{through}");
    // Envoy's way to the app: from 127.0.0.6, over loopback.
    let passthrough =
        run_placed(in_pod(1337), tools::testkit_command(), &["ask-from", "127.0.0.6", &format!("{ip}:8080")]);
    assert!(passthrough.starts_with("hello app"), "{passthrough}");

    // An address added after registration: the classifier does not know it.
    let late = ip.rsplit_once('.').map(|(net, _)| format!("{net}.250")).unwrap();
    run_in(&server, None, Command::new("ip"), &["addr", "add", &format!("{late}/32"), "dev", "eth0"]);
    run_in(&client, None, Command::new("ip"), &["route", "add", &format!("{late}/32"), "dev", "eth0"]);
    let out = ask(&late);
    assert!(out.is_err(), "the app answered on an unregistered address: {out:?}");

    // A second interface between the two pods, which the classifier is not on.
    run_in(
        &client,
        None,
        Command::new("ip"),
        &["link", "add", "net1", "type", "veth", "peer", "name", "net1", "netns", server.name()],
    );
    for (ns, addr) in [(&client, "192.168.77.1/24"), (&server, "192.168.77.2/24")] {
        run_in(ns, None, Command::new("ip"), &["addr", "add", addr, "dev", "net1"]);
        run_in(ns, None, Command::new("ip"), &["link", "set", "net1", "up"]);
    }
    let out = ask("192.168.77.2");
    assert!(out.is_err(), "the app answered over a second interface: {out:?}");

    let status = capture_status();
    let web1 = status
        .iter()
        .find(|p| p["netns"].as_str().is_some_and(|n| Path::new(n) == server.path()))
        .unwrap_or_else(|| panic!("web-1 in capture status: {status:?}"));
    assert!(web1["counters"]["inbound_bypass_refused"].as_u64() >= Some(2), "{web1}");
    rt.del(&list, &a, Some(&result)).unwrap_or_else(|e| panic!("DEL: {e}"));
}

/// Entries in one of a program set's pinned maps.
fn map_entries(key: &str, map: &str) -> u32 {
    weir_agent::capture::ebpf::metrics::map_fill()
        .into_iter()
        .find(|f| f.program_set == key && f.map == map)
        .unwrap_or_else(|| panic!("no map {map} in program set {key}"))
        .entries
}

/// One pod's annotation cannot fill the node's lists for the others: a pod asking to
/// exclude 20 000 ranges is refused with an error naming the annotation and the limit,
/// before anything is written; the next pods are captured as usual. Before, it filled
/// the node-wide tries (16 384 entries), the failed registration stayed, and every
/// later meshed pod on the node failed ADD.
#[test]
fn one_pods_annotation_cannot_fill_the_node_for_the_others() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    let cgroup = test_cgroup(&test_name!());
    let name = unique_name("cni-node");
    let set = unique_name("tenancy").replace('-', "_");
    let _set = SetGuard(set.clone());
    let _guard = NodeCapture(name.clone());
    let agent = NodeAgent::new(&node, cgroup.path(), &name);
    let out = agent
        .command("install", &["--once"])
        .env(weir_agent::capture::ebpf::set::SET_ENV, &set)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let key = wait_node_capture(&name, &set).programs.unwrap();
    let mut rt = CniRuntime::new(&node.ns).unwrap();
    rt.env = vec![(weir_agent::capture::ebpf::set::SET_ENV.into(), set.clone())];
    let list = node.conflist(json!({"capture_mode": "auto", "ebpf_node_capture": name}));

    let ranges: Vec<String> = (0..20_000u32).map(|i| format!("11.{}.{}.0/24", i / 256, i % 256)).collect();
    let annotation = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
    node.api.set_pod(pod_object("shop", "greedy", true, &[(annotation, &ranges.join(","))], &[]));
    let greedy = pod_netns(&rt, "greedy");
    let g = Attachment::pod("c-greedy", greedy.path(), "shop", "greedy");
    let e = rt.add(&list, &g).unwrap_err();
    assert_eq!(e.error()["code"], 102, "{e}");
    let details = e.error()["details"].as_str().unwrap_or_default().to_string();
    assert!(
        details.contains(annotation) && details.contains("256"),
        "names the annotation and the limit: {e}"
    );
    assert_eq!(map_entries(&key, "EXCLUDE_V4"), 0, "nothing written");
    assert_eq!(map_entries(&key, "POD_CONFIG"), 0, "nothing registered");
    rt.del(&list, &g, None).unwrap_or_else(|e| panic!("DEL of the refused pod: {e}"));

    for i in 0..3 {
        let pod = format!("web-{i}");
        node.api.set_pod(pod_object("shop", &pod, true, &[(annotation, "10.10.0.0/16")], &[]));
        let ns = pod_netns(&rt, &pod);
        let a = Attachment::pod(&format!("c-{pod}"), ns.path(), "shop", &pod);
        let result = rt.add(&list, &a).unwrap_or_else(|e| panic!("ADD {pod} after the refused one: {e}"));
        let (local, _, _stand_ins) = ask_through_capture(&node, &ns, Some(&cgroup), &pod_ip(&result), "");
        assert_eq!(local, format!("{}:8080", pod_ip(&result)));
        rt.del(&list, &a, Some(&result)).unwrap();
    }
    let out =
        agent.command("uninstall", &[]).env(weir_agent::capture::ebpf::set::SET_ENV, &set).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A pod registered again (the runtime retrying ADD, an update) is never without its
/// capture for a moment: while it is registered again 60 times, none of its app's
/// connections to an excluded address is redirected, and no connection the node makes
/// to its port reaches the port around Envoy. Before, its lists and inbound keys were
/// removed before the new ones were written.
#[test]
fn registering_a_pod_again_leaves_no_window() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    let annotation = ("traffic.sidecar.istio.io/excludeOutboundIPRanges", format!("{GATEWAY}/32"));
    node.api.set_pod(pod_object("shop", "web-1", true, &[(annotation.0, &annotation.1)], &[]));
    let (cgroup, name, _guard) = attached_node_capture(&test_name!());
    let rt = CniRuntime::new(&node.ns).unwrap();
    let pod = pod_netns(&rt, "web-1");
    let (list, a, result, ip) = add_auto(&node, &rt, &pod, &name);
    let _envoy =
        start_placed(placed(&pod, Some(&cgroup), 1337), &["capture-listener", "0.0.0.0:15006"]).unwrap();
    let _outbound =
        start_placed(placed(&pod, Some(&cgroup), 1337), &["capture-listener", "0.0.0.0:15001"]).unwrap();
    let counters = || {
        let status = capture_status();
        status.into_iter().find(|p| p["netns"].as_str().is_some_and(|n| Path::new(n) == pod.path())).unwrap()
            ["counters"]
            .clone()
    };
    let before = counters();

    let weir = CniRuntime::plugin_config(&list, &list["plugins"][1], Some(&result));
    let (storms, added) = std::thread::scope(|s| {
        let outbound = s.spawn(|| {
            run_placed(
                placed(&pod, Some(&cgroup), 1000),
                tools::testkit_command(),
                &["connect-storm", &format!("{GATEWAY}:9"), "4000"],
            )
        });
        let inbound = s.spawn(|| {
            run_in(
                &node.ns,
                None,
                tools::testkit_command(),
                &["connect-storm", &format!("{ip}:8080"), "2000"],
            )
        });
        let mut added = 0;
        while !(outbound.is_finished() && inbound.is_finished()) || added < 60 {
            rt.exec("istio-cni", "ADD", &a, weir.to_string().as_bytes())
                .unwrap_or_else(|e| panic!("ADD again: {e}"));
            added += 1;
        }
        ((outbound.join().unwrap(), inbound.join().unwrap()), added)
    });
    let after = counters();
    let delta = |k: &str| after[k].as_u64().unwrap() - before[k].as_u64().unwrap();
    assert!(added >= 60, "registered again {added} times");
    assert_eq!(
        delta("redirected"),
        0,
        "an excluded destination was redirected during a registration: {storms:?} {after}"
    );
    assert!(delta("bypass_excluded_cidr") >= 4000, "{after}");
    // Nothing listens on the app's port: a SYN that slipped past capture would be
    // refused there. (A SYN the stand-in's full accept queue drops just times out.)
    let inbound: Vec<u64> = storms.1.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    assert_eq!(inbound[1], 0, "inbound connections reached the app's port around Envoy: {}", storms.1);
    assert!(delta("inbound_assigned") >= inbound[0] && inbound[0] > 1000, "{} {after}", storms.1);
    rt.del(&list, &a, Some(&result)).unwrap();
}

/// Connects that fail (nothing on 15001 yet) leave nothing behind: one pod's storm of
/// 5 000 of them does not fill the node-wide table of connections in flight, where it
/// would evict other pods' original destinations. Before, each left its entry until
/// the LRU map evicted it.
#[test]
fn a_connect_storm_leaves_no_tracking_entries_behind() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let (cgroup, name, _guard) = attached_node_capture(&test_name!());
    let key = weir_agent::capture::ebpf::record::PinRecord::load(&name).unwrap().programs.unwrap();
    let rt = CniRuntime::new(&node.ns).unwrap();
    let pod = pod_netns(&rt, "web-1");
    let (list, a, result, _) = add_auto(&node, &rt, &pod, &name);
    let out = run_placed(
        placed(&pod, Some(&cgroup), 1000),
        tools::testkit_command(),
        &["connect-storm", &format!("{GATEWAY}:80"), "5000"],
    );
    assert!(out.starts_with("connected 0 refused 5000"), "every connect redirected to an empty 15001: {out}");
    let left = map_entries(&key, "ORIG_BY_COOKIE");
    assert!(left < 100, "{left} connection-tracking entries left behind by 5000 failed connects");
    rt.del(&list, &a, Some(&result)).unwrap();
}

/// A pod with `hostUsers: false`: a network namespace owned by a user namespace of its
/// own, where ids 0-65535 are the node's 100000-165535. Its sandbox process holds it;
/// both go on drop.
struct UsernsPod(std::process::Child);

impl UsernsPod {
    fn new() -> Self {
        let child = Command::new("unshare").args(["--user", "--net", "sleep", "infinity"]).spawn().unwrap();
        let pod = Self(child);
        let pid = pod.0.id();
        let ns = format!("/proc/{pid}/ns/user");
        weir_tests::control_plane::eventually(std::time::Duration::from_secs(5), || {
            (std::fs::read_link(&ns).ok()? != std::fs::read_link("/proc/self/ns/user").ok()?).then_some(())
        })
        .expect("unshare made its user namespace");
        for map in ["uid_map", "gid_map"] {
            std::fs::write(format!("/proc/{pid}/{map}"), "0 100000 65536").unwrap();
        }
        pod
    }

    fn netns(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.0.id()))
    }

    /// Runs weir-testkit in the pod as `uid` of its user namespace.
    fn testkit(&self, uid: u32, args: &[&str]) -> Result<String, String> {
        let pid = self.0.id().to_string();
        let id = uid.to_string();
        let kit = tools::for_children(&tools::testkit());
        let out = Command::new("nsenter")
            .args(["-t", &pid, "-U", "-n", "-S", &id, "-G", &id])
            .arg(kit)
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() { Ok(text) } else { Err(String::from_utf8_lossy(&out.stderr).into_owned()) }
    }
}

impl Drop for UsernsPod {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Pods with `hostUsers: false` are not captured with eBPF, whose programs tell
/// Envoy's connections apart by the user id the node sees (1337 in the pod is 101337
/// there), nor with iptables, whose owner match refuses rules written from outside the
/// pod's user namespace: in `auto` mode they get Istio's rules as native nftables,
/// which match ids as the pod sees them, and the proxy's own connections are left
/// alone while the app's are captured; `capture_mode: ebpf` refuses them, naming why.
/// Before, eBPF registered them, and Envoy's upstream connections looped back to 15001.
#[test]
fn pods_in_a_user_namespace_get_netfilter_and_a_named_refusal_for_ebpf() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let (_cgroup, name, _guard) = attached_node_capture(&test_name!());
    let rt = CniRuntime::new(&node.ns).unwrap();
    let pod = UsernsPod::new();
    let netns = pod.netns();
    let a = Attachment::pod("c-web-1", &netns, "shop", "web-1");

    let forced = node.conflist(json!({"capture_mode": "ebpf", "ebpf_node_capture": name}));
    let e = rt.add(&forced, &a).unwrap_err();
    assert!(e.error().to_string().contains("user namespace of its own (hostUsers: false)"), "{e}");
    assert!(e.error().to_string().contains("capture_mode nftables (or auto)"), "{e}");
    rt.del(&forced, &a, None).unwrap();

    let list = node.conflist(json!({"capture_mode": "auto", "ebpf_node_capture": name}));
    let result = rt.add(&list, &a).unwrap_or_else(|e| panic!("ADD: {e}"));
    assert!(weir_agent::node::cni::ebpf::pod_records(&name).is_empty(), "not registered with eBPF");
    let rules = run_placed(
        Placement::default(),
        Command::new("nsenter"),
        &["-t", &pod.0.id().to_string(), "-n", "nft", "list", "table", "inet", "istio-proxy-nat"],
    );
    assert!(rules.contains("skuid 1337"), "Istio's rules as native nftables: {rules}");
    rt.check(&list, &a, &result).unwrap_or_else(|e| panic!("CHECK: {e}"));
    let lo = Command::new("nsenter")
        .args(["-t", &pod.0.id().to_string(), "-n", "ip", "link", "set", "lo", "up"])
        .status();
    assert!(lo.unwrap().success());

    let (outbound, inner) = {
        let pid = pod.0.id().to_string();
        let kit = tools::for_children(&tools::testkit());
        let listener = Command::new("nsenter")
            .args(["-t", &pid, "-U", "-n", "-S", "1337", "-G", "1337"])
            .arg(kit)
            .args(["capture-listener", "0.0.0.0:15001"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        (listener, pid)
    };
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut outbound = Kill(outbound);
    let mut ready = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(outbound.0.stdout.take().unwrap()), &mut ready)
        .unwrap();
    assert!(ready.starts_with("listening"), "{ready} in {inner}");
    let app = pod.testkit(1000, &["ask", &format!("{GATEWAY}:80")]).unwrap_or_else(|e| panic!("app: {e}"));
    let (_, orig) = captured(&app).unwrap_or_else(|| panic!("the app's connection was not captured: {app}"));
    assert_eq!(orig, format!("{GATEWAY}:80"));
    let proxy = pod.testkit(1337, &["ask", &format!("{GATEWAY}:80")]);
    assert!(
        proxy.as_ref().is_err_and(|e| e.contains("connect")),
        "the proxy's own connection goes out, not back to 15001: {proxy:?}"
    );
    rt.del(&list, &a, Some(&result)).unwrap();
}

/// The getsockopt hook sits on the cgroup every pod of the node shares: calls that are
/// not Envoy's SO_ORIGINAL_DST come back as the kernel made them, for pods that are not
/// meshed as for meshed ones, however large. `iptables-legacy-save` reads a table of
/// 400 rules (well over a page) in both. Before, on kernels before 6.5, a non-mesh pod's
/// call failed with EFAULT and a meshed pod's answer was cut to a page. (From 6.5 the
/// kernel copes on its own: this test shows the bug only on older kernels, as the
/// kernel matrix runs it.)
#[test]
fn large_getsockopt_answers_come_back_whole_for_every_pod() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let (cgroup, name, _guard) = attached_node_capture(&test_name!());
    let rt = CniRuntime::new(&node.ns).unwrap();
    let meshed = pod_netns(&rt, "web-1");
    let (list, a, result, _) = add_auto(&node, &rt, &meshed, &name);
    let plain = pod_netns(&rt, "plain");
    let rules: String = (0..400)
        .map(|i| {
            format!("-A INPUT -s 10.200.{}.{}/32 -p tcp --dport {} -j ACCEPT\n", i / 250, i % 250, 1000 + i)
        })
        .collect();
    for ns in [&meshed, &plain] {
        let table = format!("*filter\n:INPUT ACCEPT [0:0]\n{rules}COMMIT\n");
        let mut restore = Command::new("iptables-legacy-restore");
        restore.stdin(std::process::Stdio::piped());
        let child = weir_agent::sandbox::process::spawn(
            &mut restore,
            Placement { netns: Some(ns), ..Placement::default() },
        )
        .unwrap();
        let mut child = child.into_inner();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), table.as_bytes()).unwrap();
        assert!(child.wait().unwrap().success(), "iptables-legacy-restore");
        // Run from the pods' shared cgroup, where the hook runs.
        let saved = try_run_placed(
            placed(ns, Some(&cgroup), 0),
            Command::new("iptables-legacy-save"),
            &["-t", "filter"],
        )
        .unwrap_or_else(|e| panic!("iptables-legacy-save in {}: {e}", ns.path().display()));
        assert_eq!(
            saved.lines().filter(|l| l.starts_with("-A INPUT")).count(),
            400,
            "every rule read back in {}",
            ns.path().display()
        );
    }
    rt.del(&list, &a, Some(&result)).unwrap();
}

/// Removes every program set whose key ends in the suffix, whatever a test reached.
struct SetGuard(String);

impl Drop for SetGuard {
    fn drop(&mut self) {
        for key in weir_agent::capture::ebpf::set::pinned_keys().into_iter().filter(|k| k.ends_with(&self.0))
        {
            if let Ok(Some(set)) = weir_agent::capture::ebpf::set::LockedSet::open(&key) {
                let _ = set.release();
            }
        }
    }
}

#[test]
fn repair_captures_pods_that_started_before_the_plugin() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    let rt = CniRuntime::new(&node.ns).unwrap();
    let kubepods = test_cgroup(&format!("{}-kubepods", test_name!()));
    // The cluster's CNI without Weir: these pods start uncaptured, each with its
    // sandbox process in a kubelet-named cgroup.
    let mut before = conflist("10.79.0.0/24", node.ipam.path(), json!({}));
    before["plugins"].as_array_mut().unwrap().pop();
    let mut pods = Vec::new();
    for (name, sidecar) in [("old-web", true), ("old-plain", false)] {
        let ns = pod_netns(&rt, name);
        let result =
            rt.add(&before, &Attachment::pod(&format!("c-{name}"), ns.path(), "shop", name)).unwrap();
        node.api.set_pod(listed_pod(name, sidecar, "node-1", &pod_ip(&result)));
        let sandbox = KubeletSandbox::start(&kubepods, &format!("uid-{name}"), &ns).unwrap();
        pods.push((ns, pod_ip(&result), sandbox));
    }
    // Another pod claims old-web's IP in its own namespace: repair must not take it
    // for old-web (it goes by the sandbox, not by the IP).
    let squatter = pod_netns(&rt, "squatter");
    run_in(&squatter, None, Command::new("ip"), &["addr", "add", &format!("{}/32", pods[0].1), "dev", "lo"]);
    let mut elsewhere = pod_object("shop", "other-node", true, &[], &[]);
    elsewhere["spec"]["nodeName"] = json!("node-2");
    node.api.set_pod(elsewhere);
    assert_eq!(istio_rules(&pods[0].0), "");

    let kubeconfig = node.run_dir.path().join("istio-cni-kubeconfig").display().to_string();
    // `weir cni repair --once` for a node, with extra flags.
    let repair_node = |node_name: &str, extra: &[&str]| {
        let mut args = vec!["cni", "repair", "--once", "--node-name", node_name, "--proc-dir", "/proc"];
        args.extend(["--kubeconfig", kubeconfig.as_str()]);
        args.extend(extra);
        try_run_placed(
            Placement { netns: Some(&node.ns), ..Placement::default() },
            tools::weir_command(),
            &args,
        )
    };
    let repair = || repair_node("node-1", &["--capture-mode", "iptables"]).unwrap_or_else(|e| panic!("{e}"));
    let out = repair();
    assert!(out.contains("repaired shop/old-web in /proc/"), "{out}");
    assert!(!out.contains("old-plain") && !out.contains("other-node"), "{out}");
    assert!(
        node.api.requests.lock().unwrap().iter().any(|r| r.contains("fieldSelector=spec.nodeName%3Dnode-1"))
    );
    assert_eq!(istio_rules(&pods[1].0), "", "a pod without a sidecar is left alone");
    assert_eq!(istio_rules(&squatter), "", "the namespace that claimed the pod's IP is not the pod's");
    assert_captured(&node, &pods[0].0, &pods[0].1);
    // A second pass finds it captured and changes nothing.
    let out = repair();
    assert!(!out.contains("repaired"), "{out}");

    // A sandbox whose namespace does not hold the pod's IP is reported, not captured.
    let stray = pod_netns(&rt, "stray");
    node.api.set_pod(listed_pod("stray", true, "node-1", "10.79.0.250"));
    let _stray = KubeletSandbox::start(&kubepods, "uid-stray", &stray).unwrap();
    let e = repair_node("node-1", &["--capture-mode", "iptables"]).expect_err("stray is not repaired");
    assert!(e.contains("shop/stray") && e.contains("does not hold its IP 10.79.0.250"), "{e}");
    assert_eq!(istio_rules(&stray), "");
}

/// eBPF: repair registers a pod that started before the plugin under its UID, and the
/// runtime's DEL for that pod (K8S_POD_UID in CNI_ARGS) unregisters it, a DEL of an
/// earlier sandbox of the same pod does not; a pod ADD
/// captured is recognised by its record and never registered again (before, repair
/// looked for ADD's registration under the wrong name and registered every such pod
/// again on each pass, adding a tc filter each time).
#[test]
fn repair_with_ebpf_registers_once_and_never_again() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    let rt = CniRuntime::new(&node.ns).unwrap();
    let kubepods = test_cgroup(&format!("{}-kubepods", test_name!()));
    let name = unique_name("cni-node");
    let _guard = NodeCapture(name.clone());
    weir_agent::node::cni::node_capture::attach_node(&name, kubepods.path()).unwrap();
    let kubeconfig = node.run_dir.path().join("istio-cni-kubeconfig").display().to_string();
    let repair = || {
        let args = [
            "cni",
            "repair",
            "--once",
            "--node-name",
            "node-3",
            "--proc-dir",
            "/proc",
            "--kubeconfig",
            &kubeconfig,
            "--capture-mode",
            "ebpf",
            "--ebpf-name",
            &name,
        ];
        run_in(&node.ns, None, tools::weir_command(), &args)
    };
    // One pod from before the plugin, one through ADD.
    let mut before = conflist(SUBNET, node.ipam.path(), json!({}));
    before["plugins"].as_array_mut().unwrap().pop();
    let old = pod_netns(&rt, "old-ebpf");
    let a = Attachment::pod("c-old-ebpf", old.path(), "shop", "old-ebpf");
    let result = rt.add(&before, &a).unwrap();
    node.api.set_pod(listed_pod("old-ebpf", true, "node-3", &pod_ip(&result)));
    let _old_sandbox = KubeletSandbox::start(&kubepods, "uid-old-ebpf", &old).unwrap();
    let weir = node.conflist(json!({"capture_mode": "ebpf", "ebpf_node_capture": name}));
    let new = pod_netns(&rt, "new-ebpf");
    node.api.set_pod(listed_pod("new-ebpf", true, "node-3", "10.77.0.200"));
    let b = Attachment::pod("c-new-ebpf", new.path(), "shop", "new-ebpf");
    let new_result = rt.add(&weir, &b).unwrap_or_else(|e| panic!("ADD: {e}"));
    node.api.set_pod(listed_pod("new-ebpf", true, "node-3", &pod_ip(&new_result)));
    let _new_sandbox = KubeletSandbox::start(&kubepods, "uid-new-ebpf", &new).unwrap();
    let records_of = |uid: &str| {
        weir_agent::node::cni::ebpf::pod_records(&name)
            .into_iter()
            .filter(|r| r.pod_uid.as_deref() == Some(uid))
            .count()
    };
    let filters_on = |ns: &NetNs| {
        weir_agent::capture::ebpf::netns::in_netns(ns.path(), || {
            weir_agent::capture::ebpf::inbound::weir_filters("eth0")
        })
        .unwrap()
        .len()
    };

    // Repair's registration of old-ebpf (by its UID; no container record of its own).
    let repair_registration_whole =
        || weir_agent::node::cni::ebpf::capture_gap(&name, "", "uid-old-ebpf", old.path()).unwrap().is_none();
    let out = repair();
    assert!(out.contains("repaired shop/old-ebpf"), "{out}");
    assert!(!out.contains("new-ebpf"), "ADD captured it: {out}");
    assert!(repair_registration_whole());
    for _ in 0..2 {
        let out = repair();
        assert!(!out.contains("repaired"), "{out}");
    }
    assert_eq!((records_of("uid-old-ebpf"), records_of("uid-new-ebpf")), (1, 1), "one registration each");
    assert_eq!((filters_on(&old), filters_on(&new)), (1, 1), "one inbound filter each");

    // A late DEL of an earlier sandbox of the same pod (same UID, another namespace)
    // leaves the running sandbox's registration: before, it took it.
    let conf = CniRuntime::plugin_config(&weir, &weir["plugins"][1], Some(&result));
    let earlier = pod_netns(&rt, "old-ebpf-earlier");
    let e = Attachment::pod("c-old-ebpf-earlier", earlier.path(), "shop", "old-ebpf");
    rt.exec("istio-cni", "DEL", &e, conf.to_string().as_bytes()).unwrap_or_else(|e| panic!("DEL: {e}"));
    assert!(
        repair_registration_whole(),
        "a DEL of an earlier sandbox took the running sandbox's repair registration"
    );
    rt.exec("istio-cni", "DEL", &a, conf.to_string().as_bytes()).unwrap_or_else(|e| panic!("DEL: {e}"));
    assert!(!repair_registration_whole(), "DEL left the repair registration");
    rt.del(&weir, &b, Some(&new_result)).unwrap_or_else(|e| panic!("DEL: {e}"));
}

/// `weir cni repair --once` on node-3 in `auto` mode with the node capture `name`.
fn repair_once_auto(node: &Node, kubeconfig: &str, name: &str) -> Result<String, String> {
    let args = [
        "cni",
        "repair",
        "--once",
        "--node-name",
        "node-3",
        "--proc-dir",
        "/proc",
        "--kubeconfig",
        kubeconfig,
        "--capture-mode",
        "auto",
        "--ebpf-name",
        name,
    ];
    weir_tests::cni::try_run_placed(
        weir_agent::sandbox::Placement { netns: Some(&node.ns), ..Default::default() },
        tools::weir_command(),
        &args,
    )
}

/// A rollout moves the node capture aside (kept for its pods under its retired name)
/// before the new build's is attached. Repair in `auto` mode running in that window
/// must still see an eBPF node, and a pod registered with eBPF must never be given
/// netfilter rules on top: before, `auto` resolved to iptables there and repair applied
/// REDIRECT rules to a registered pod, capturing every connection twice (the node rig
/// found it: every request of the pod failed after a roll).
#[test]
fn repair_while_the_node_capture_is_moved_aside_captures_no_pod_twice() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    let rt = CniRuntime::new(&node.ns).unwrap();
    let kubepods = test_cgroup(&format!("{}-kubepods", test_name!()));
    let name = unique_name("cni-node");
    let _guard = NodeCapture(name.clone());
    weir_agent::node::cni::node_capture::attach_node(&name, kubepods.path()).unwrap();
    let kubeconfig = node.run_dir.path().join("istio-cni-kubeconfig").display().to_string();
    let weir = node.conflist(json!({"capture_mode": "ebpf", "ebpf_node_capture": name}));
    let pod = pod_netns(&rt, "web-ebpf");
    node.api.set_pod(listed_pod("web-ebpf", true, "node-3", "10.77.0.200"));
    let a = Attachment::pod("c-web-ebpf", pod.path(), "shop", "web-ebpf");
    let result = rt.add(&weir, &a).unwrap_or_else(|e| panic!("ADD: {e}"));
    node.api.set_pod(listed_pod("web-ebpf", true, "node-3", &pod_ip(&result)));
    let _sandbox = KubeletSandbox::start(&kubepods, "uid-web-ebpf", &pod).unwrap();

    // The window of a rollout: the node capture kept under its retired name, no new one.
    let record =
        weir_agent::capture::ebpf::record::PinRecord::load(&name).expect("the node capture's record");
    let key = record.programs.clone().expect("its program set");
    let retired = weir_agent::node::cni::ebpf::retired_name(&name, &key);
    record.move_to(&retired).unwrap();
    assert!(
        weir_agent::node::cni::ebpf::node_captures_with_ebpf(&name),
        "a node mid-rollout captures with eBPF"
    );
    let out = repair_once_auto(&node, &kubeconfig, &name);
    let moved_back = weir_agent::capture::ebpf::record::PinRecord::load(&retired).unwrap().move_to(&name);
    let out = out.unwrap_or_else(|e| panic!("repair: {e}"));
    assert!(!out.contains("repaired"), "{out}");
    let rules = run_in(&pod, None, std::process::Command::new("iptables-save"), &[]);
    assert!(!rules.contains("ISTIO_"), "netfilter capture added to a registered pod:\n{rules}");
    moved_back.unwrap();
    rt.del(&weir, &a, Some(&result)).unwrap_or_else(|e| panic!("DEL: {e}"));
}

/// The records lost (another `/run/weir` mounted by a new DaemonSet, `/run` cleaned)
/// while pods stay registered in the pinned maps: `auto` then sees no node capture and
/// plans netfilter, and repair must still find the pod registered (its namespace in a
/// set's map) and add nothing on top (found by a security review: the check read the
/// records only, and repair would have captured every registered pod twice).
#[test]
fn repair_with_the_records_lost_captures_no_registered_pod_twice() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let node = Node::new(&test_name!(), false);
    let rt = CniRuntime::new(&node.ns).unwrap();
    let kubepods = test_cgroup(&format!("{}-kubepods", test_name!()));
    let name = unique_name("cni-node");
    let _guard = NodeCapture(name.clone());
    weir_agent::node::cni::node_capture::attach_node(&name, kubepods.path()).unwrap();
    let kubeconfig = node.run_dir.path().join("istio-cni-kubeconfig").display().to_string();
    let weir = node.conflist(json!({"capture_mode": "ebpf", "ebpf_node_capture": name}));
    let pod = pod_netns(&rt, "web-lost");
    node.api.set_pod(listed_pod("web-lost", true, "node-3", "10.77.0.201"));
    let a = Attachment::pod("c-web-lost", pod.path(), "shop", "web-lost");
    let result = rt.add(&weir, &a).unwrap_or_else(|e| panic!("ADD: {e}"));
    node.api.set_pod(listed_pod("web-lost", true, "node-3", &pod_ip(&result)));
    let _sandbox = KubeletSandbox::start(&kubepods, "uid-web-lost", &pod).unwrap();

    // Every record of this node capture and its pods moved away: what a new /run/weir shows.
    let records: Vec<(std::path::PathBuf, Vec<u8>)> =
        weir_agent::capture::ebpf::record::PinRecord::load_all()
            .into_iter()
            .filter(|r| r.pod == name || r.pod.starts_with(&format!("{name}-pod-")))
            .map(|r| {
                let path = weir_agent::capture::ebpf::record::PinRecord::path(&r.pod);
                let bytes = std::fs::read(&path).unwrap();
                std::fs::remove_file(&path).unwrap();
                (path, bytes)
            })
            .collect();
    assert_eq!(records.len(), 2, "the node capture's record and the pod's");
    assert!(!weir_agent::node::cni::ebpf::node_captures_with_ebpf(&name), "no record: auto plans netfilter");
    let out = repair_once_auto(&node, &kubeconfig, &name);
    for (path, bytes) in &records {
        std::fs::write(path, bytes).unwrap();
    }
    // Refused, naming the pod and why: the operator sees it (the pass fails).
    let said = match out {
        Ok(out) => panic!("repair passed a registered pod it planned netfilter for: {out}"),
        Err(e) => e.to_string(),
    };
    assert!(said.contains("shop/web-lost is registered with eBPF capture"), "{said}");
    let rules = run_in(&pod, None, std::process::Command::new("iptables-save"), &[]);
    assert!(!rules.contains("ISTIO_"), "netfilter capture added to a registered pod:\n{rules}\n{said}");
    rt.del(&weir, &a, Some(&result)).unwrap_or_else(|e| panic!("DEL: {e}"));
}

/// The API server answering 500 and 503, then recovering: the plugin retries, as
/// istio-cni does, and the pod is captured. A refusal that will not pass (403) is
/// not retried: a named error, and nothing applied.
#[test]
fn an_api_server_failing_then_recovering_delays_the_add_and_a_refusal_is_named() {
    require_root!();
    let node = Node::new(&test_name!(), false);
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let rt = CniRuntime::new(&node.ns).unwrap();
    let pod = pod_netns(&rt, "web-1");
    let list = node.conflist(json!({"capture_mode": "nftables"}));
    let a = Attachment::pod("c-web-1", pod.path(), "shop", "web-1");
    let pod_path = "/api/v1/namespaces/shop/pods/web-1";

    node.api.fail_next(&[500, 503]);
    let result = rt.add(&list, &a).unwrap_or_else(|e| panic!("ADD: {e}"));
    let gets: Vec<String> =
        node.api.requests.lock().unwrap().iter().filter(|p| p.ends_with(pod_path)).cloned().collect();
    assert_eq!(
        gets,
        [format!("FAILED 500 {pod_path}"), format!("FAILED 503 {pod_path}"), pod_path.to_string()]
    );
    assert!(istio_rules(&pod).contains("table inet istio-proxy-nat"), "captured after the retries");
    rt.del(&list, &a, Some(&result)).unwrap_or_else(|e| panic!("DEL: {e}"));
    assert_eq!(istio_rules(&pod), "");

    node.api.requests.lock().unwrap().clear();
    node.api.fail_next(&[403]);
    let e = rt.add(&list, &a).unwrap_err();
    assert_eq!(e.plugin, "istio-cni", "{e}");
    assert_eq!(e.error()["code"], 101, "{e}");
    assert!(e.error()["msg"].as_str().unwrap().contains("shop/web-1"), "names the pod: {e}");
    assert!(e.error()["details"].as_str().unwrap().contains("403"), "names the answer: {e}");
    let gets = node.api.requests.lock().unwrap().iter().filter(|p| p.ends_with(pod_path)).count();
    assert_eq!(gets, 1, "a 403 is not retried");
    assert_eq!(istio_rules(&pod), "", "nothing applied");
    rt.del(&list, &a, None).unwrap_or_else(|e| panic!("DEL after the failed ADD: {e}"));
}

/// ADD reads a pod's namespace (its cookie) while the API server answers, registers the
/// pod under that cookie, then enters the namespace by its path again to attach the
/// node classifier. A path that names another namespace by then (the runtime re-pointed
/// it) is refused, naming both, and nothing is attached there: the classifier lands only
/// in the namespace the pod was registered under. Before, it was attached wherever the
/// path led.
#[test]
fn the_classifier_is_attached_only_in_the_namespace_registered() {
    require_root!();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let (_cgroup, name, _guard) = attached_node_capture(&test_name!());
    let key = weir_agent::capture::ebpf::record::PinRecord::load(&name)
        .and_then(|r| r.programs)
        .expect("node record");
    let classifier = weir_agent::capture::ebpf::inbound::NodeClassifier::pinned(
        &weir_agent::capture::ebpf::set::set_dir(&key),
    )
    .expect("the node capture's classifier");
    let registered = NetNs::create(&unique_name("registered")).unwrap();
    let other = NetNs::create(&unique_name("other")).unwrap();
    for ns in [&registered, &other] {
        run_in(
            ns,
            None,
            Command::new("ip"),
            &["link", "add", "eth0", "type", "veth", "peer", "name", "peer0"],
        );
        run_in(ns, None, Command::new("ip"), &["link", "set", "eth0", "up"]);
    }
    let netns = weir_agent::capture::ebpf::netns::netns_cookie;
    let (cookie, other_cookie) =
        (netns(Some(registered.path())).unwrap(), netns(Some(other.path())).unwrap());
    let filters = |ns: &NetNs| {
        weir_agent::capture::ebpf::netns::in_netns(ns.path(), || {
            weir_agent::capture::ebpf::inbound::weir_filters("eth0")
        })
        .unwrap()
    };

    let e = weir_agent::error_chain(&classifier.attach(other.path(), cookie, "eth0").unwrap_err());
    assert!(e.contains("now names another network namespace"), "{e}");
    assert!(e.contains(&format!("cookie {other_cookie}")) && e.contains(&format!("cookie {cookie}")), "{e}");
    assert!(filters(&other).is_empty(), "attached in a namespace the pod was not registered under");

    classifier.attach(registered.path(), cookie, "eth0").unwrap();
    assert_eq!(filters(&registered).len(), 1, "the registered namespace gets its filter");
}

/// The pod's namespace deleted while ADD waits on the API server: a named error for
/// that namespace, nothing left behind, and DEL of the gone pod succeeds.
#[test]
fn a_pod_namespace_deleted_during_add_is_named_and_leaves_nothing() {
    require_root!();
    for mode in ["iptables", "nftables"] {
        let node = Node::new(&format!("{}-{mode}", test_name!()), false);
        node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
        let rt = CniRuntime::new(&node.ns).unwrap();
        let pod = pod_netns(&rt, "web-1");
        let netns_path = pod.path().to_path_buf();
        let list = node.conflist(json!({"capture_mode": mode}));
        let a = Attachment::pod("c-web-1", &netns_path, "shop", "web-1");
        // The reference plugins run first; only weir-cni's ADD meets the fault.
        let bridge = rt
            .add(
                &json!({"cniVersion": list["cniVersion"], "name": list["name"],
            "plugins": [list["plugins"][0]]}),
                &a,
            )
            .unwrap_or_else(|e| panic!("bridge ADD: {e}"));

        let hold = node.api.hold_next_pod_get();
        let weir = CniRuntime::plugin_config(&list, &list["plugins"][1], Some(&bridge));
        let e = std::thread::scope(|s| {
            let add = s.spawn(|| rt.exec("istio-cni", "ADD", &a, weir.to_string().as_bytes()));
            hold.reached.recv_timeout(std::time::Duration::from_secs(30)).expect("ADD asked for the pod");
            drop(pod);
            assert!(!netns_path.exists(), "the namespace is gone");
            hold.release.send(()).unwrap();
            add.join().unwrap().expect_err("ADD into a deleted namespace fails")
        });
        assert_eq!(e.plugin, "istio-cni", "{e}");
        let text = e.error().to_string();
        assert!(text.contains(&netns_path.display().to_string()), "{mode}: names the namespace: {e}");
        let code = e.error()["code"].as_u64();
        assert!(matches!(code, Some(3 | 5 | 100)), "{mode}: unknown container, I/O or capture failure: {e}");
        rt.del(&list, &a, Some(&bridge)).unwrap_or_else(|e| panic!("{mode}: DEL of the gone pod: {e}"));
    }
}

/// The DaemonSet as shipped (`WEIR_EBPF_CGROUP` set, `capture_mode` auto) on whatever
/// this kernel is: where eBPF works the node capture is attached and pods are captured
/// by it; where it cannot (before 5.14, cgroup v1) the agent still installs the plugin,
/// says why there is no node capture, attaches nothing, and pods get Istio's iptables
/// rules. Either way the app's connections and the node's land on the capture ports.
#[test]
fn the_node_agent_and_auto_capture_use_what_this_kernel_offers() {
    require_root!();
    let expected = weir_tests::kernel::expected_capture();
    let _bpffs = weir_tests::BpffsUse::acquire().unwrap();
    let test = test_name!();
    let node = Node::new(&test, false);
    node.api.set_pod(pod_object("shop", "web-1", true, &[], &[]));
    let cgroup = weir_tests::kernel::PodCgroup::create(&test);
    let name = unique_name("cni-auto");
    let _guard = NodeCapture(name.clone());
    let node_agent = NodeAgent::new(&node, cgroup.path(), &name);
    let out = node_agent.run("install", &["--once"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    let installed = node_agent.installed();
    let pinned = Path::new("/sys/fs/bpf/weir").join(&name).exists();
    assert_eq!(pinned, expected.ebpf(), "a node capture exactly where eBPF works ({expected:?}): {said}");
    assert_eq!(installed["plugins"][1]["type"], "weir-cni", "{installed}");
    assert_eq!(installed["plugins"][1].get("ebpf_node_capture").is_some(), expected.ebpf(), "{installed}");
    if let Some(because) = expected.because {
        assert!(said.contains("eBPF node capture unavailable") && said.contains(because), "{said}");
    }

    // The conflist names the node capture either way (an operator's stale config):
    // auto follows what is attached, not what is named.
    let rt = CniRuntime::new(&node.ns).unwrap();
    let pod = pod_netns(&rt, "web-1");
    let (list, a, result, ip) = add_auto(&node, &rt, &pod, &name);
    let rules = istio_rules(&pod);
    assert_eq!(rules.contains("-A ISTIO_OUTPUT"), !expected.ebpf(), "{expected:?}:\n{rules}");
    let (local, orig, _stand_ins) = ask_through_capture(&node, &pod, cgroup.v2(), &ip, &rules);
    // eBPF's sk_assign hands the connection to the 15006 listener with the original
    // destination as its local address (nothing listens on 8080); REDIRECT lands on
    // 15006 and SO_ORIGINAL_DST gives the destination back.
    let landed = match expected.ebpf() {
        true => local == format!("{ip}:8080"),
        false => local.ends_with(":15006") && orig == format!("{ip}:8080"),
    };
    assert!(landed, "inbound: local={local} orig={orig}");
    rt.check(&list, &a, &result).unwrap_or_else(|e| panic!("CHECK: {e}"));
    rt.del(&list, &a, Some(&result)).unwrap_or_else(|e| panic!("DEL: {e}"));
    let out = node_agent.run("uninstall", &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!Path::new("/sys/fs/bpf/weir").join(&name).exists());
}

/// DEL with a FIFO where the pod's namespace should be (its path has a runtime's form)
/// ends, and removes nothing: CNI_NETNS is checked as ADD checks it before anything
/// opens it. Before, DEL's look for the pod's repair record opened the path as it was
/// and blocked for good (found by a security review).
#[test]
fn del_never_blocks_on_a_fifo_in_place_of_the_namespace() {
    require_root!();
    let node = Node::new(&test_name!(), false);
    let made = weir_tests::cni::FifoNetns::make().unwrap();
    let fifo = made.0.clone();
    let weir = node.conflist(json!({"capture_mode": "ebpf"}));
    let a = Attachment::pod("c-fifo", &fifo, "shop", "web-fifo");
    let (done, ended) = std::sync::mpsc::channel();
    let ns = node.ns.path().to_path_buf();
    std::thread::spawn(move || {
        let ns = NetNs::open(&ns);
        let out = ns.map_err(|e| e.to_string()).and_then(|ns| {
            let rt = CniRuntime::new(&ns).map_err(|e| e.to_string())?;
            rt.exec("istio-cni", "DEL", &a, weir.to_string().as_bytes()).map(drop).map_err(|e| e.to_string())
        });
        let _ = done.send(out);
    });
    // A liveness bound, not a timing: DEL takes milliseconds; a blocked open never ends.
    let out = ended
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("DEL with a FIFO as CNI_NETNS never ended");
    out.unwrap_or_else(|e| panic!("DEL: {e}"));
}
