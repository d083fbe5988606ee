//! Weir's built images (`scripts/image`, OCI archives under `target/images/`), each
//! unpacked and its entrypoint run chrooted in its own root inside a test namespace,
//! since containers cannot run on this host:
//! - `weir-init` and `weir-proxy-standalone` run one of Istio's injector goldens as
//!   the kubelet would with Helm values pointing `global.proxy_init.image` and
//!   `global.proxy.image` at them: the init image programs Istio's rules from the
//!   injector's args with its own iptables, the proxy image's pilot-agent and Envoy get
//!   ready against the test istiod, with a workload certificate, and drain;
//! - `weir-cni` runs `agent/deploy/weir-cni.yaml`'s install container as written
//!   (command, env, volumes) on a temporary node layout: the static binary lands in the
//!   CNI bin folder and runs on the host, Weir is chained after the primary CNI, the
//!   eBPF node capture is attached to the pods' cgroup (a test cgroup), and SIGTERM
//!   takes it all out.

use std::{
    collections::BTreeMap,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use weir_agent::sandbox::{NetNs, process::Mount, unique_name};
use weir_proto::type_url;
use weir_tests::{
    Placement,
    capture::capture_state,
    control_plane::eventually,
    envoy::tempfile_dir::Dir,
    inject::{
        InjectedPod, Manifest, PodOptions, ProbeKind, ProbeOutcome, images::PodImages, pod::PROBE_BUDGET,
        volumes::mount_point_under,
    },
    oci::UnpackedImage,
    require_root, test_cgroup, test_name,
};

const PROXY: &str = "istio-proxy";
const WAIT: Duration = Duration::from_secs(20);

/// Whether `f` becomes true within [`WAIT`].
fn settles(mut f: impl FnMut() -> bool) -> bool {
    eventually(WAIT, || f().then_some(())).is_some()
}

/// Whether the ELF file at `path` asks for a program interpreter (is dynamically
/// linked): a PT_INTERP program header.
fn has_interpreter(path: &Path) -> bool {
    let elf = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&elf[..4], b"\x7fELF", "{} is not ELF", path.display());
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into().unwrap()) as usize;
    let (size, count) = (u16_at(0x36), u16_at(0x38));
    (0..count).any(|i| u32::from_le_bytes(elf[phoff + i * size..][..4].try_into().unwrap()) == 3)
}

#[test]
fn the_init_and_proxy_images_run_an_injected_pod() {
    require_root!();
    let init = UnpackedImage::unpack("weir-init").unwrap_or_else(|e| panic!("{e:#}"));
    let proxy = UnpackedImage::unpack("weir-proxy-standalone").unwrap_or_else(|e| panic!("{e:#}"));
    // The images are what they say: a static pilot-agent (the init image's is
    // `weir-init`, istio-init's commands only, the proxy image's the whole `weir`); the
    // proxy image has the upstream Envoy and no Istio template (pilot-agent's built-in
    // bootstrap is used).
    assert!(!has_interpreter(&init.path("/usr/local/bin/pilot-agent")), "pilot-agent is static");
    let init_agent = std::fs::metadata(init.path("/usr/local/bin/pilot-agent")).unwrap().len();
    let proxy_agent = std::fs::metadata(proxy.path("/usr/local/bin/pilot-agent")).unwrap().len();
    assert!(
        init_agent < proxy_agent / 2,
        "weir-init ({init_agent} bytes) against weir ({proxy_agent} bytes)"
    );
    assert_eq!(init.entrypoint, ["/usr/local/bin/pilot-agent"]);
    assert_eq!(proxy.entrypoint, ["/usr/local/bin/pilot-agent"]);
    assert_eq!(proxy.user, "1337:1337");
    assert!(proxy.path("/usr/local/bin/envoy").is_file());
    assert!(!proxy.path("/var/lib/istio/envoy/envoy_bootstrap_tmpl.json").exists());
    let proxy_root = proxy.root.clone();

    let manifest = Manifest::load("hello-readiness.yaml.injected").unwrap_or_else(|e| panic!("{e:#}"));
    let options = PodOptions { images: Some(PodImages { init, proxy }), ..PodOptions::default() };
    let mut pod = InjectedPod::start(&test_name!(), manifest, options).unwrap_or_else(|e| panic!("{e:#}"));
    let proxy_log = |pod: &InjectedPod| format!("{PROXY} log:\n{}", pod.log(PROXY));

    // istio-init: the image's pilot-agent ran `istio-iptables` with the injector's
    // args. The pod's namespace is fresh, so REDIRECT's rules were written in process,
    // as iptables-nft writes them, with no iptables process (the image still ships
    // iptables, for the other modes, verify and removal); iptables-nft-save reads them
    // below.
    let done = pod.completed.iter().find(|c| c.name == "istio-init").expect("istio-init ran");
    assert_eq!(&done.command[..2], ["/usr/local/bin/pilot-agent", "istio-iptables"]);
    let said = String::from_utf8_lossy(&done.output.stderr);
    assert!(said.contains("Final iptables state (IPv4), written in process"), "{said}");
    let rules = capture_state(&pod.pod);
    for want in [
        "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001",
        "-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006",
        "-A OUTPUT -j ISTIO_OUTPUT",
        "-A PREROUTING -p tcp -j ISTIO_INBOUND",
        "-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN",
    ] {
        assert!(rules.contains(want), "{want:?} not in the pod's rules:\n{rules}");
    }

    // istio-proxy: pilot-agent and Envoy run inside the proxy image's root.
    let agent = pod.container(PROXY).child.pid();
    assert_eq!(std::fs::read_link(format!("/proc/{agent}/root")).unwrap(), proxy_root);
    let ready = pod.wait_probe(PROXY, ProbeKind::Readiness, PROBE_BUDGET);
    assert!(matches!(ready, Ok(ProbeOutcome::Success(_))), "{ready:?}\n{}", proxy_log(&pod));
    // Envoy is the image's: some process of the pod runs the root's envoy binary
    // (pilot-agent starts it through a descriptor, so its name is not "envoy").
    let image_envoy = proxy_root.join("usr/local/bin/envoy");
    let exes: Vec<PathBuf> = pod
        .pod
        .processes()
        .iter()
        .filter_map(|p| std::fs::read_link(format!("/proc/{p}/exe")).ok())
        .collect();
    assert!(exes.contains(&image_envoy), "no process runs {}: {exes:?}", image_envoy.display());

    // Envoy holds istiod's config and a workload certificate from istiod's CA.
    assert!(pod.cluster.acked(type_url::LISTENER, WAIT), "no LDS ACK\n{}", proxy_log(&pod));
    assert!(pod.cluster.acked(type_url::CLUSTER, WAIT), "no CDS ACK\n{}", proxy_log(&pod));
    assert!(!pod.cluster.csrs().is_empty(), "no CSR reached istiod\n{}", proxy_log(&pod));
    let argv: Vec<String> = ["pilot-agent", "request", "GET", "certs"].map(String::from).to_vec();
    let out = pod.exec(PROXY, &argv).unwrap();
    assert!(out.status.success(), "request GET certs: {}", String::from_utf8_lossy(&out.stderr));
    let certs = String::from_utf8_lossy(&out.stdout);
    assert!(certs.contains("spiffe://cluster.local/ns/default/sa/default"), "{certs}");

    // preStop through the image's pilot-agent, SIGTERM, and nothing left.
    let end = pod.terminate(PROXY).unwrap_or_else(|e| panic!("{e:#}"));
    let pre_stop = end.pre_stop.as_ref().expect("istio-proxy has a preStop hook");
    assert!(pre_stop.status.success(), "preStop: {}", String::from_utf8_lossy(&pre_stop.stderr));
    assert_eq!(end.exit.code(), Some(0), "{}", proxy_log(&pod));
    assert!(end.processes_left.is_empty() && end.in_mount_ns.is_empty(), "{end:?}");
    let left = pod.remove();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The first document of `kind` in a multi-document YAML file.
fn yaml_doc(path: &Path, kind: &str) -> Value {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .find(|v: &Value| v["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in {}", path.display()))
}

/// A bpffs of the test's own, mounted in the host's namespace on a test directory and
/// unmounted on drop: the node capture's pins go there, not under /sys/fs/bpf.
struct PrivateBpffs(PathBuf);

impl PrivateBpffs {
    fn mount(at: PathBuf) -> Self {
        std::fs::create_dir_all(&at).unwrap();
        let out = Command::new("mount").args(["-t", "bpf", "bpf"]).arg(&at).output().unwrap();
        assert!(out.status.success(), "mount bpffs: {}", String::from_utf8_lossy(&out.stderr));
        Self(at)
    }
}

impl Drop for PrivateBpffs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn the_cni_image_installs_the_daemonsets_node_agent() {
    require_root!();
    let image = UnpackedImage::unpack("weir-cni").unwrap_or_else(|e| panic!("{e:#}"));
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../agent/deploy/weir-cni.yaml");
    let ds = yaml_doc(&manifest, "DaemonSet");
    let spec = &ds["spec"]["template"]["spec"];
    let container = spec["containers"].as_array().unwrap().iter().find(|c| c["name"] == "install").unwrap();

    // The node: its folders in a test directory, the primary CNI's config, the pods'
    // cgroup (a test cgroup), a bpffs of its own, a service account.
    let node = Dir::new("image-node").unwrap();
    let host = |p: &str| {
        let dir = node.path().join(p.trim_start_matches('/'));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    };
    std::fs::write(
        host("/etc/cni/net.d").join("10-k8s.conflist"),
        r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"ptp"}]}"#,
    )
    .unwrap();
    let cgroup = test_cgroup(&test_name!());
    let bpffs = PrivateBpffs::mount(node.path().join("bpffs"));
    let sa = host("/sa");
    std::fs::write(sa.join("token"), "token-1").unwrap();
    std::fs::write(sa.join("ca.crt"), "-----BEGIN CERTIFICATE-----\n").unwrap();
    let volumes: BTreeMap<&str, PathBuf> = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            let name = v["name"].as_str().unwrap();
            if let Some(secret) = v["secret"]["secretName"].as_str() {
                // A service-account-token Secret, as the runtime writes it: its keys
                // as files.
                let dir = host(&format!("/secrets/{secret}"));
                std::fs::write(dir.join("token"), "plugin-token-1").unwrap();
                std::fs::write(dir.join("ca.crt"), "-----BEGIN CERTIFICATE-----\n").unwrap();
                std::fs::write(dir.join("namespace"), "kube-system").unwrap();
                return (name, dir);
            }
            let path = v["hostPath"]["path"].as_str().expect("hostPath or Secret volumes");
            let source = match path {
                "/sys/fs/bpf" => bpffs.0.clone(),
                other => host(other),
            };
            (name, source)
        })
        .collect();

    // The container's mounts in the image's root, as a runtime makes them for a
    // privileged container: /proc, /dev, /sys, its volumes, the service account.
    let root = &image.root;
    let under = |p: &str| root.join(p.trim_start_matches('/'));
    let mut mounts = vec![Mount::Bind { source: root.clone(), target: root.clone(), read_only: false }];
    for system in ["/proc", "/dev", "/sys"] {
        mount_point_under(root, Path::new(system), false).unwrap();
        mounts.push(Mount::Bind { source: system.into(), target: under(system), read_only: false });
    }
    let mut wanted: Vec<(String, PathBuf)> = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["mountPath"].as_str().unwrap().to_string(), volumes[m["name"].as_str().unwrap()].clone()))
        .collect();
    wanted.push(("/var/run/secrets/kubernetes.io/serviceaccount".into(), sa.clone()));
    wanted.sort_by_key(|(path, _)| path.matches('/').count());
    for (path, source) in wanted {
        mount_point_under(root, Path::new(&path), false).unwrap();
        mounts.push(Mount::Bind { source, target: under(&path), read_only: false });
    }
    // The pods' cgroup the manifest names, inside the cgroup volume: the test cgroup.
    let env: BTreeMap<String, String> = weir_tests::daemonset::container_env("install");
    let pods_cgroup = &env["WEIR_EBPF_CGROUP"];
    let cgroup_volume = &volumes["cgroup"];
    let inside =
        pods_cgroup.strip_prefix("/sys/fs/cgroup/").expect("the pods' cgroup is under /sys/fs/cgroup");
    std::fs::create_dir_all(cgroup_volume.join(inside)).unwrap();
    mounts.push(Mount::Bind {
        source: cgroup.path().to_path_buf(),
        target: under(pods_cgroup),
        read_only: false,
    });

    let command: Vec<String> =
        container["command"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect();
    let log = node.path().join("install.log");
    // A command of the install container: its image's and manifest's environment, the
    // API server's, the output into `log`.
    let in_container = |argv: Vec<String>, file: std::fs::File| {
        let (mut cmd, argv) = weir_tests::inject::images::command(&image, argv, Vec::new()).unwrap();
        cmd.env_clear()
            .envs(image.env.iter().cloned())
            .envs(&env)
            .env("KUBERNETES_SERVICE_HOST", "10.96.0.1")
            .env("KUBERNETES_SERVICE_PORT", "443")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        (cmd, argv)
    };
    let (mut cmd, argv) = in_container(command, std::fs::File::create(&log).unwrap());
    assert_eq!(argv, ["weir", "cni", "install"]);
    // hostNetwork: a namespace of the test's own stands in for the node's.
    let netns = NetNs::create(&unique_name("image-node")).unwrap();
    netns
        .run(|| async { weir_iptables::netlink::Netlink::open()?.set_up("lo").await })
        .unwrap()
        .expect("lo up, as on a node");
    let placement = Placement {
        netns: Some(&netns),
        mounts: &mounts,
        root: Some(root),
        die_with_parent: true,
        ..Placement::default()
    };
    let mut agent = weir_agent::sandbox::process::spawn(&mut cmd, placement).unwrap();
    let said = || std::fs::read_to_string(&log).unwrap_or_default();

    // Installed: the plugin binary is the image's static weir, it runs on the host as
    // a CNI plugin; the chain ends with weir-cni; the node capture is on the cgroup.
    let conflist = host("/etc/cni/net.d").join("10-k8s.conflist");
    let chained = || {
        std::fs::read(&conflist)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|v| v["plugins"].as_array().is_some_and(|p| p.len() == 2))
    };
    assert!(settles(chained), "not chained\n{}", said());
    let list: Value = serde_json::from_slice(&std::fs::read(&conflist).unwrap()).unwrap();
    assert_eq!(list["plugins"][1]["type"], "weir-cni");
    assert_eq!(list["plugins"][1]["capture_mode"], env["WEIR_CAPTURE_MODE"].as_str());
    let plugin = host("/opt/cni/bin").join("weir-cni");
    assert!(settles(|| plugin.is_file()), "no plugin binary\n{}", said());
    // The image's plugin-only binary, not `weir`: the runtime execs it for every pod.
    assert_eq!(
        std::fs::read(&plugin).unwrap(),
        std::fs::read(image.path("/usr/local/bin/weir-cni")).unwrap()
    );
    assert_eq!(std::fs::metadata(&plugin).unwrap().permissions().mode() & 0o777, 0o755);
    assert!(!has_interpreter(&plugin), "the installed plugin is static");
    let v = Command::new(&plugin).env_clear().env("CNI_COMMAND", "VERSION").output().unwrap();
    assert!(String::from_utf8_lossy(&v.stdout).contains("supportedVersions"), "{v:?}");
    let kubeconfig = host("/var/run/istio-cni").join("istio-cni-kubeconfig");
    assert!(settles(|| kubeconfig.is_file()), "no kubeconfig\n{}", said());
    // The plugin's own read-only token (the manifest's Secret), not the DaemonSet's.
    let written = std::fs::read_to_string(&kubeconfig).unwrap();
    assert!(written.contains("token: plugin-token-1") && !written.contains("token: token-1"), "{written}");
    let attached =
        || weir_tests::capture::cgroup_programs(cgroup.path()).iter().any(|p| p.contains("connect4"));
    assert!(
        settles(attached),
        "no connect4 on the pods' cgroup: {:?}\n{}",
        weir_tests::capture::cgroup_programs(cgroup.path()),
        said()
    );
    assert!(bpffs.0.join("weir").is_dir(), "the node capture is pinned in the node's bpffs");
    // The monitoring port the manifest sets serves the node's capture decisions.
    let port: u16 = env["MONITORING_PORT"].parse().unwrap();
    let scrape = || {
        netns
            .run(move || async move {
                weir_tests::http::get(([127, 0, 0, 1], port).into(), "/metrics").await.ok()
            })
            .unwrap()
    };
    assert!(settles(|| scrape().is_some()), "nothing serves :{port}/metrics\n{}", said());
    let (status, body) = scrape().unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("weir_capture_pods 0\n"), "no pod is captured on this node yet: {body}");

    // SIGTERM (the DaemonSet's pod going away, a rollout): capture is the mesh's
    // boundary, so nothing is taken away: still chained, the plugin binary in place, the
    // node capture on the pods' cgroup.
    agent.signal(libc::SIGTERM).unwrap();
    let status = agent.wait_timeout(Duration::from_secs(10)).unwrap().expect("install exits on SIGTERM");
    assert!(status.success(), "{status:?}\n{}", said());
    let list: Value = serde_json::from_slice(&std::fs::read(&conflist).unwrap()).unwrap();
    assert_eq!(list["plugins"][1]["type"], "weir-cni", "still chained after SIGTERM: {list}");
    assert!(plugin.is_file(), "the plugin binary stays after SIGTERM");
    assert!(attached(), "the node capture stays on the pods' cgroup after SIGTERM");

    // The explicit act, as docs/install.md says: `weir cni uninstall
    // --detach-running-pods` in the same container takes everything away.
    let uninstall: Vec<String> =
        ["weir", "cni", "uninstall", "--detach-running-pods"].map(String::from).into();
    let (mut cmd, _) = in_container(uninstall, std::fs::OpenOptions::new().append(true).open(&log).unwrap());
    let mut uninstalling = weir_agent::sandbox::process::spawn(&mut cmd, placement).unwrap();
    let status = uninstalling.wait_timeout(Duration::from_secs(30)).unwrap().expect("uninstall ends");
    assert!(status.success(), "{status:?}\n{}", said());
    let list: Value = serde_json::from_slice(&std::fs::read(&conflist).unwrap()).unwrap();
    assert_eq!(list["plugins"].as_array().unwrap().len(), 1, "{list}");
    assert!(!plugin.exists(), "plugin binary left");
    assert_eq!(
        weir_tests::capture::cgroup_programs(cgroup.path()),
        Vec::<String>::new(),
        "programs left on the cgroup"
    );
}
