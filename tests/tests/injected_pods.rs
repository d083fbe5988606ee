//! Istio's injector goldens run as the kubelet would run them (`weir_tests::inject`):
//! `istio-init`'s `pilot-agent istio-iptables` as root in the pod's namespace, then
//! `istio-proxy` (`pilot-agent proxy sidecar`, its env resolved, its volumes at their
//! real paths in a private mount namespace, as its securityContext user) against the
//! test istiod on TLS :15012 (`istiod.istio-system.svc` from the pod's hosts file).
//! For each pod: Istio's rules are in place; the pod gets ready on its own probes
//! (the proxy's startup and readiness probes, each app container's rewritten ones);
//! Envoy holds istiod's config and the workload certificate; istiod saw Istio's node
//! metadata; the preStop hook and SIGTERM exit 0; and nothing of the pod is left.

use std::{collections::BTreeMap, time::Duration};

use weir_proto::type_url;
use weir_tests::{
    capture::capture_state,
    control_plane::TestCa,
    http,
    inject::{
        InjectedPod, Manifest, PodOptions, ProbeKind, ProbeOutcome,
        env::format_map,
        metadata,
        pod::{INBOUND_CLUSTER, INBOUND_LISTENER, PROBE_BUDGET, bootstrap_template},
    },
    require_root,
    spire::SpireAgent,
    test_name,
};

const PROXY: &str = "istio-proxy";
const SPIFFE_ID: &str = "spiffe://cluster.local/ns/default/sa/default";
const WAIT: Duration = Duration::from_secs(20);

/// Where the workload certificate comes from.
enum Identity {
    /// istiod's CA, asked by the agent with the pod's token.
    Istiod,
    /// Files mounted at /etc/certs (the `istio.default` Secret); no CSR.
    Mounted { serial: String },
    /// SPIRE's socket; the agent serves no SDS and asks no CA.
    Spire { serial: String },
}

/// What a case expects beyond the common checks.
struct Expect {
    identity: Identity,
    /// Probes the rig cannot send, by (container, kind).
    not_run: Vec<(&'static str, ProbeKind)>,
    /// What the rig changed in the manifest.
    notes: Vec<String>,
    /// A check of this case's own, once the pod is ready.
    check: fn(&InjectedPod),
    /// The preStop hook fails, saying this (as pilot-agent's would).
    pre_stop_fails_with: Option<&'static str>,
}

impl Expect {
    fn plain() -> Self {
        Self {
            identity: Identity::Istiod,
            not_run: Vec::new(),
            notes: Vec::new(),
            check: |_| {},
            pre_stop_fails_with: None,
        }
    }
}

/// The value after `flag` in `args`.
fn flag<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).map(String::as_str)
}

/// `pilot-agent request GET <path>` in istio-proxy, as JSON.
fn admin_json(pod: &InjectedPod, path: &str) -> serde_json::Value {
    let argv: Vec<String> = ["pilot-agent", "request", "GET", path].map(String::from).to_vec();
    let out = pod.exec(PROXY, &argv).unwrap();
    assert!(out.status.success(), "request GET {path}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Names of the active dynamic resources in one config_dump section.
fn dumped(dump: &serde_json::Value, section: &str, list: &str, inner: &str) -> Vec<String> {
    dump["configs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["@type"].as_str().is_some_and(|t| t.ends_with(section)))
        .flat_map(|c| c[list].as_array().cloned().unwrap_or_default())
        .filter_map(|r| r.pointer(inner).and_then(|n| n.as_str()).map(str::to_string))
        .collect()
}

/// Serial numbers of the SPIFFE certificates for `id` that Envoy holds.
fn serials_for(certs: &serde_json::Value, id: &str) -> Vec<String> {
    let mut out: Vec<String> = certs["certificates"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| c["cert_chain"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["subject_alt_names"].as_array().into_iter().flatten().any(|s| s["uri"] == id))
        .filter_map(|c| c["serial_number"].as_str().map(str::to_string))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// `path` as a process whose root is `root` (`/proc/<pid>/root`) sees it: absolute
/// symlinks (`/var/run` → `/run`) resolve inside that root, not the reader's.
fn in_root(root: &str, path: &str) -> std::path::PathBuf {
    let mut resolved = std::path::PathBuf::from("/");
    let mut rest: Vec<String> = path.split('/').filter(|c| !c.is_empty()).rev().map(String::from).collect();
    while let Some(part) = rest.pop() {
        let next = resolved.join(&part);
        match std::fs::read_link(format!("{root}{}", next.display())) {
            Ok(target) => {
                if target.is_absolute() {
                    resolved = std::path::PathBuf::from("/");
                }
                rest.extend(
                    target.to_string_lossy().split('/').filter(|c| !c.is_empty()).rev().map(String::from),
                );
            }
            Err(_) => resolved = next,
        }
    }
    std::path::PathBuf::from(format!("{root}{}", resolved.display()))
}

/// Every check, for one manifest.
fn run(test: &str, file: &str, options: PodOptions, expect: Expect) {
    require_root!();
    let manifest = Manifest::load(file).unwrap_or_else(|e| panic!("{e:#}"));
    let mut pod = InjectedPod::start(test, manifest, options).unwrap_or_else(|e| panic!("{file}: {e:#}"));
    let proxy_log = |pod: &InjectedPod| format!("{PROXY} log:\n{}", pod.log(PROXY));
    assert_eq!(pod.manifest.notes, expect.notes, "what the rig changed in {file}");

    // istio-init: `pilot-agent istio-iptables <args>` exited 0; Istio's chains are in
    // the pod's namespace with the redirects and exclusions its args ask for.
    let init = pod.completed.iter().find(|c| c.name == "istio-init").expect("istio-init ran");
    assert!(init.output.status.success());
    assert_eq!(&init.command[..2], ["pilot-agent", "istio-iptables"]);
    let rules = capture_state(&pod.pod);
    let args = &init.command;
    for want in [
        format!("-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports {}", flag(args, "-p").unwrap()),
        format!("-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports {}", flag(args, "-z").unwrap()),
        "-A OUTPUT -j ISTIO_OUTPUT".into(),
        "-A PREROUTING -p tcp -j ISTIO_INBOUND".into(),
        "-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN".into(),
    ] {
        assert!(rules.contains(&want), "{want:?} not in the pod's rules:\n{rules}");
    }
    for port in flag(args, "-d").unwrap().split(',') {
        let want = format!("-A ISTIO_INBOUND -p tcp -m tcp --dport {port} -j RETURN");
        assert!(rules.contains(&want), "{want:?} not in the pod's rules:\n{rules}");
    }

    // The sidecar runs as its securityContext says, with the pod's fsGroup, in its own
    // mount namespace where the volumes and the image's files sit at their real paths.
    let proxy = pod.container(PROXY);
    let spec = pod.manifest.init_container(PROXY).unwrap().clone();
    let sc = &pod.manifest.spec.security_context;
    let status = std::fs::read_to_string(format!("/proc/{}/status", proxy.child.pid())).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
    };
    let (uid, gid) = spec.user(sc);
    assert_eq!(field("Uid:")[0], uid.to_string());
    assert_eq!(field("Gid:")[0], gid.to_string());
    let groups: Vec<String> = spec.groups(sc).iter().map(u32::to_string).collect();
    assert_eq!(field("Groups:"), groups);
    let root = format!("/proc/{}/root", proxy.child.pid());
    let read =
        |path: &str| std::fs::read_to_string(in_root(&root, path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert_eq!(read("/etc/istio/pod/labels"), format_map(&pod.manifest.meta.labels));
    assert_eq!(read("/etc/istio/pod/annotations"), format_map(&pod.manifest.meta.annotations));
    assert_eq!(read("/var/run/secrets/tokens/istio-token"), pod.cluster.token());
    assert_eq!(read("/var/run/secrets/istio/root-cert.pem"), pod.cluster.serving_ca.root_pem());
    assert_eq!(
        read("/var/lib/istio/envoy/envoy_bootstrap_tmpl.json"),
        std::fs::read_to_string(bootstrap_template()).unwrap()
    );
    assert!(
        read("/etc/hosts").contains(&format!("{}\tistiod.istio-system.svc\n", pod.cluster.istiod.ipv4()))
    );
    assert!(!std::path::Path::new("/etc/istio/proxy").exists(), "the host's /etc is untouched");
    let mountinfo = std::fs::read_to_string(format!("/proc/{}/mountinfo", proxy.child.pid())).unwrap();
    let root_options = mountinfo.lines().find_map(|l| {
        let fields: Vec<&str> = l.split(' ').collect();
        (fields.get(4) == Some(&"/")).then(|| fields[5].to_string())
    });
    let read_only = root_options.as_deref().is_some_and(|o| o.split(',').any(|f| f == "ro"));
    assert_eq!(read_only, spec.read_only_root(), "readOnlyRootFilesystem: / is {root_options:?}");

    // Ready on its own probes: the proxy's startup probe passed before the apps
    // started; its readiness probe and every app probe (rewritten to the agent's
    // /app-health/<container>/<probe>) pass from the node.
    let ready = pod.wait_probe(PROXY, ProbeKind::Readiness, PROBE_BUDGET);
    assert!(matches!(ready, Ok(ProbeOutcome::Success(_))), "{ready:?}\n{}", proxy_log(&pod));
    let mut not_run = Vec::new();
    for container in pod.manifest.spec.containers.clone() {
        for (kind, _) in container.probes() {
            match pod.wait_probe(&container.name, kind, PROBE_BUDGET) {
                Ok(ProbeOutcome::Success(_)) => {}
                Ok(ProbeOutcome::NotRun(why)) => {
                    println!("not run: {} {kind:?} probe: {why}", container.name);
                    not_run.push((container.name.as_str().to_owned(), kind));
                }
                other => panic!("{} {kind:?} probe: {other:?}\n{}", container.name, proxy_log(&pod)),
            }
        }
    }
    let want: Vec<(String, ProbeKind)> = expect.not_run.iter().map(|(c, k)| (c.to_string(), *k)).collect();
    assert_eq!(not_run, want, "probes the rig could not send");
    (expect.check)(&pod);

    // Envoy got istiod's config and ACKed it.
    assert!(pod.cluster.acked(type_url::LISTENER, WAIT), "no LDS ACK\n{}", proxy_log(&pod));
    assert!(pod.cluster.acked(type_url::CLUSTER, WAIT), "no CDS ACK\n{}", proxy_log(&pod));
    let dump = admin_json(&pod, "config_dump");
    assert_eq!(
        dumped(&dump, "ListenersConfigDump", "dynamic_listeners", "/active_state/listener/name"),
        [INBOUND_LISTENER]
    );
    assert!(
        dumped(&dump, "ClustersConfigDump", "dynamic_active_clusters", "/cluster/name")
            .contains(&INBOUND_CLUSTER.to_string()),
        "no {INBOUND_CLUSTER} in Envoy's clusters"
    );

    // Envoy holds the workload certificate, from where this pod's identity comes.
    let serials = serials_for(&admin_json(&pod, "certs"), SPIFFE_ID);
    assert_eq!(
        serials.len(),
        1,
        "one certificate for {SPIFFE_ID} in /certs: {serials:?}\n{}",
        proxy_log(&pod)
    );
    let csrs = pod.cluster.csrs();
    match &expect.identity {
        Identity::Istiod => {
            assert!(!csrs.is_empty(), "no CSR reached istiod\n{}", proxy_log(&pod));
            for csr in &csrs {
                assert_eq!(csr.uri_sans, [SPIFFE_ID]);
                assert_eq!(csr.authorization.as_deref(), Some(&*format!("Bearer {}", pod.cluster.token())));
            }
        }
        Identity::Mounted { serial } | Identity::Spire { serial } => {
            assert_eq!(&serials[0], serial, "Envoy uses the certificate it was given");
            assert!(csrs.is_empty(), "the agent asked istiod's CA anyway: {csrs:?}");
        }
    }

    // istiod saw Istio's node: id, cluster and metadata as pilot-agent makes them.
    let seen =
        pod.cluster.first_node(WAIT).unwrap_or_else(|| panic!("istiod saw no node\n{}", proxy_log(&pod)));
    let inputs = pod.node_inputs(proxy, weir_agent::sidecar::config::node::ISTIO_VERSION);
    assert_eq!(seen.id, metadata::expected_id(&inputs));
    assert_eq!(seen.cluster, metadata::expected_cluster(&inputs));
    let mismatched = metadata::mismatches(&seen.metadata, &metadata::expected(&inputs));
    assert!(
        mismatched.is_empty(),
        "node metadata differs from pilot-agent's:\n  {}",
        mismatched.join("\n  ")
    );

    // preStop (`pilot-agent request --debug-port=<status port> POST drain`), then
    // SIGTERM: both exit 0 within the grace period; nothing of the pod is left.
    let end = pod.terminate(PROXY).unwrap_or_else(|e| panic!("{e:#}"));
    let pre_stop = end.pre_stop.as_ref().expect("istio-proxy has a preStop hook");
    let said =
        format!("{}{}", String::from_utf8_lossy(&pre_stop.stdout), String::from_utf8_lossy(&pre_stop.stderr));
    match expect.pre_stop_fails_with {
        None => assert!(pre_stop.status.success(), "preStop: {said}\n{}", proxy_log(&pod)),
        Some(error) => {
            assert!(
                !pre_stop.status.success() && said.contains(error),
                "preStop: {:?} {said}",
                pre_stop.status
            );
            println!("preStop failed as pilot-agent's does: {said}");
        }
    }
    assert_eq!(end.exit.code(), Some(0), "{}", proxy_log(&pod));
    assert!(end.took < end.grace, "{end:?}");
    assert!(end.processes_left.is_empty() && end.in_mount_ns.is_empty(), "{end:?}");
    let left = pod.remove();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn hello_readiness() {
    run(&test_name!(), "hello-readiness.yaml.injected", PodOptions::default(), Expect::plain());
}

#[test]
fn https_probes() {
    let expect = Expect { not_run: vec![("world", ProbeKind::Readiness)], ..Expect::plain() };
    run(&test_name!(), "https-probes.yaml.injected", PodOptions::default(), expect);
}

#[test]
fn tcp_probes() {
    run(&test_name!(), "tcp-probes.yaml.injected", PodOptions::default(), Expect::plain());
}

#[test]
fn startup_ready_live() {
    let expect = Expect { not_run: vec![("world", ProbeKind::Readiness)], ..Expect::plain() };
    run(&test_name!(), "startup_ready_live.yaml.injected", PodOptions::default(), expect);
}

/// A Pod (not a Deployment) whose owner is itself; Prometheus would scrape the
/// agent's merged metrics on 15020 from off the pod.
#[test]
fn prometheus_scrape() {
    let expect = Expect {
        check: |pod| {
            let target = std::net::SocketAddr::new(pod.pod.ipv4().into(), 15020);
            let (status, body) = pod
                .cluster
                .node
                .run(|| async move { http::get(target, "/stats/prometheus").await })
                .unwrap()
                .unwrap();
            assert_eq!(status, 200);
            assert!(body.contains("istio_agent_") && body.contains("envoy_server_live"), "{body}");
        },
        ..Expect::plain()
    };
    run(&test_name!(), "prometheus-scrape.yaml.injected", PodOptions::default(), expect);
}

/// `fsGroup: 1234`: the proxy runs with it as a supplementary group, and the
/// volumes are group-owned by it and setgid, as the kubelet makes them.
#[test]
fn explicit_security_context() {
    let expect = Expect {
        check: |pod| {
            use std::os::unix::fs::MetadataExt as _;
            for volume in ["istio-data", "istio-podinfo", "istio-token", "istiod-ca-cert"] {
                let meta = std::fs::metadata(pod.volume_dir(volume).unwrap()).unwrap();
                assert_eq!((meta.gid(), meta.mode() & 0o2000), (1234, 0o2000), "{volume}");
            }
        },
        ..Expect::plain()
    };
    run(&test_name!(), "explicit-security-context.yaml.injected", PodOptions::default(), expect);
}

/// At this commit the injector adds no core-dump init container: the pod's init
/// containers are Istio's two, and it runs like any other.
#[test]
fn enable_core_dump() {
    let manifest = Manifest::load("enable-core-dump.yaml.injected").unwrap();
    let init: Vec<&str> = manifest.spec.init_containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(init, ["istio-init", "istio-proxy"]);
    run(&test_name!(), "enable-core-dump.yaml.injected", PodOptions::default(), Expect::plain());
}

/// `values.global.proxy.statusPort=123` reaches the pod only as istio-init's
/// exclusion and the preStop port; the annotation that gives pilot-agent the same port
/// (and makes the injector write this same spec) is added. The agent then serves its
/// status on 123 (reached from the node: excluded from capture), but the preStop hook
/// (`request --debug-port=123`) fails as pilot-agent's does: `request` only reaches
/// 15000, 15004, 15020 and 15021. The kubelet goes on to SIGTERM, which drains.
#[test]
fn status_params() {
    let options = PodOptions {
        annotations: vec![("status.sidecar.istio.io/port".into(), "123".into())],
        ..PodOptions::default()
    };
    let expect = Expect {
        notes: vec!["annotation status.sidecar.istio.io/port=\"123\" added".into()],
        check: |pod| {
            let target = std::net::SocketAddr::new(pod.pod.ipv4().into(), 123);
            let ready =
                pod.cluster.node.run(|| async move { http::get(target, "/healthz/ready").await }).unwrap();
            assert_eq!(ready.unwrap().0, 200, "the agent's status port is 123");
        },
        pre_stop_fails_with: Some("debug port 123 is not in the allowed list"),
        ..Expect::plain()
    };
    run(&test_name!(), "status_params.yaml.injected", options, expect);
}

/// The Secret `istio.default` mounted at /etc/certs/ holds a key, chain and root: the
/// agent serves those files to Envoy and never asks istiod's CA.
#[test]
fn hello_mount_mtls_certs() {
    // Istio's legacy Secret: issued by the mesh root, which also signs istiod's serving
    // certificate (pilot-agent then trusts istiod through /etc/certs/root-cert.pem).
    let root = TestCa::new("mesh root CA").unwrap();
    let cert = root.workload_cert(SPIFFE_ID).unwrap();
    let secret: BTreeMap<String, String> = [
        ("key.pem".to_string(), cert.key_pem.clone()),
        ("cert-chain.pem".to_string(), cert.chain_pem.clone()),
        ("root-cert.pem".to_string(), root.root_pem().to_string()),
    ]
    .into();
    let options = PodOptions {
        secrets: [("istio.default".to_string(), secret)].into(),
        root_ca: Some(root),
        ..PodOptions::default()
    };
    let expect = Expect { identity: Identity::Mounted { serial: cert.serial_hex }, ..Expect::plain() };
    run(&test_name!(), "hello-mount-mtls-certs.yaml.injected", options, expect);
}

/// SPIRE's agent owns the workload socket (the SPIFFE CSI driver's volume, mounted
/// read-only): the agent serves no SDS of its own and asks no CA; Envoy gets its SVID
/// from SPIRE.
#[test]
fn sidecar_spire() {
    let spire = SpireAgent::start(SPIFFE_ID).unwrap();
    let options = PodOptions {
        csi: [("csi.spiffe.io".to_string(), spire.dir().to_path_buf())].into(),
        ..PodOptions::default()
    };
    let expect = Expect {
        identity: Identity::Spire { serial: spire.serial_hex().to_string() },
        notes: vec![
            "containers[istio-proxy] (no image) patches init container istio-proxy: workload-socket on /var/run/secrets/workload-spiffe-uds read-only".into(),
        ],
        ..Expect::plain()
    };
    run(&test_name!(), "sidecar-spire.yaml.injected", options, expect);
    let asked = spire.requested();
    assert!(asked.contains(&"default".to_string()) && asked.contains(&"ROOTCA".to_string()), "{asked:?}");
}
