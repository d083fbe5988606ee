//! Wasm over ECDS end to end: istiod (the test control plane) sends an HTTP listener
//! whose first filter comes over ECDS, and an ECDS resource for a WasmPlugin whose
//! module is at a remote URL (a test HTTP server in another pod, named as such). The
//! agent fetches the module, checks its sha256, caches it and hands a real Envoy the
//! config rewritten to the local file; Envoy's V8 runs it. A bad checksum or an
//! unreachable URL is NACKed to istiod and Envoy keeps the module it has.
//!
//! The module is built in the test from WAT: a proxy-wasm (ABI 0.2.1) HTTP filter that
//! answers every request itself with `418 served by wasm`.

use std::{net::SocketAddr, time::Duration};

use weir_agent::sidecar::controlplane::{AdsServer, AuthPolicy, Snapshot, resources};
use weir_proto::type_url;
use weir_tests::{
    Mesh, Placement, Pod,
    control_plane::{CLUSTER_ID, ControlPlane, TOKEN, TestCa, eventually},
    envoy::{Envoy, ads_bootstrap},
    http,
    http_server::TestHttpServer,
    require_root,
    sidecar::{AgentProcess, IstiodEnv, PROXY_UID, SidecarRoot},
    test_name,
};

const LISTENER: &str = "127.0.0.1:18000";
const ADMIN: &str = "127.0.0.1:15000";
const FILTER: &str = "default.teapot";
const CONVERGE: Duration = Duration::from_secs(30);

const TEAPOT_WAT: &str = r#"
(module
  (import "env" "proxy_send_local_response"
    (func $send_local_response (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "served by wasm")
  (global $heap (mut i32) (i32.const 4096))
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_memory_allocate") (param $size i32) (result i32)
    (local $at i32)
    (local.set $at (global.get $heap))
    (global.set $heap (i32.add (global.get $heap) (local.get $size)))
    (local.get $at))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
    (drop (call $send_local_response
      (i32.const 418) (i32.const 0) (i32.const 0)
      (i32.const 16) (i32.const 14)
      (i32.const 0) (i32.const 0) (i32.const -1)))
    (i32.const 1))
  (func (export "proxy_on_done") (param i32) (result i32) (i32.const 1))
  (func (export "proxy_on_delete") (param i32)))
"#;

fn sha256_hex(bytes: &[u8]) -> String {
    // The test's own digest, independent of the agent's.
    use std::io::Write as _;
    let mut child = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("sha256sum");
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string()
}

fn snapshot(wasm: prost_types::Any, version: &str) -> Snapshot {
    snapshot_with(wasm, version, &[])
}

/// `snapshot`, with more plain HTTP listeners (name, address) on the same routes.
fn snapshot_with(wasm: prost_types::Any, version: &str, more: &[(&str, &str)]) -> Snapshot {
    let mut s = Snapshot::new();
    let mut listeners = vec![(
        "http".to_string(),
        resources::http_listener_with_ecds(
            "http",
            LISTENER.parse().unwrap(),
            "routes",
            &[(FILTER, weir_agent::sidecar::wasm::rewrite::HTTP_WASM)],
        ),
    )];
    for (name, address) in more {
        listeners
            .push((name.to_string(), resources::http_listener(name, address.parse().unwrap(), "routes")));
    }
    s.set(type_url::LISTENER, version, listeners);
    s.set(
        type_url::ROUTE,
        version,
        [(
            "routes",
            resources::route_config(
                "routes",
                resources::RouteTarget::Direct { status: 200, body: "no wasm".into() },
            ),
        )],
    );
    s.set(type_url::CLUSTER, version, Vec::<(String, prost_types::Any)>::new());
    s.set(type_url::EXTENSION_CONFIG, version, [(FILTER, wasm)]);
    s
}

struct Rig {
    envoy: Option<Envoy>,
    agent: AgentProcess,
    cp: ControlPlane,
    modules: TestHttpServer,
    root: SidecarRoot,
    app: Pod,
    _module_pod: Pod,
    _istiod: Pod,
    _mesh: Mesh,
}

impl Rig {
    fn new(test: &str, module: Vec<u8>) -> Self {
        let mesh = Mesh::new(test).unwrap();
        let istiod = mesh.pod("istiod").unwrap();
        let module_pod = mesh.pod("modules").unwrap();
        let app = mesh.pod("app").unwrap();
        let modules = TestHttpServer::start(
            module_pod.netns(),
            SocketAddr::new(module_pod.ipv4().into(), 8080),
            move |req| match req.path.as_str() {
                "/teapot.wasm" => (200, "application/wasm", module.clone()),
                _ => (404, "text/plain", b"no such module".to_vec()),
            },
        )
        .unwrap();
        let good = format!("http://{}/teapot.wasm", modules.addr);
        let ca = TestCa::new("istiod test CA").unwrap();
        let sha = sha256_hex(&weir_wat());
        let ads = AdsServer::new(
            snapshot(resources::remote_wasm_filter(FILTER, &good, &sha), "1"),
            AuthPolicy { token: Some(TOKEN.into()), cluster_id: Some(CLUSTER_ID.into()) },
        );
        let cp = ControlPlane::istiod(&istiod, &ca, ads).unwrap();
        let root = SidecarRoot::new(ca.root_pem(), TOKEN).unwrap();
        let data = root.path().join("var/lib/istio/data");
        std::fs::create_dir_all(&data).unwrap();
        for d in ["var/lib", "var/lib/istio", "var/lib/istio/data"] {
            std::os::unix::fs::chown(root.path().join(d), Some(PROXY_UID), Some(PROXY_UID)).unwrap();
        }
        let ip = app.ipv4().to_string();
        let insecure = format!("registry.example,{}", modules.addr);
        let pod_env = IstiodEnv::new(cp.addr, &app, "app");
        let env = pod_env.with(&[
            ("WEIR_ENVOY_MODE", "external"),
            ("WEIR_WASM_CACHE_DIR", "./var/lib/istio/data"),
            ("WASM_HTTP_REQUEST_MAX_RETRIES", "1"),
            ("WASM_INSECURE_REGISTRIES", insecure.as_str()),
        ]);
        let agent = AgentProcess::start(&app, &root, &env, None).unwrap();
        let node = format!("sidecar~{ip}~app.default~default.svc.cluster.local");
        let bootstrap = ads_bootstrap(&root.xds_socket(), false, &node, ADMIN.parse().unwrap());
        let placement = Placement { user: Some((PROXY_UID, PROXY_UID)), ..Placement::default() };
        let envoy = Envoy::start_placed(&app, &bootstrap, ADMIN.parse().unwrap(), placement)
            .unwrap_or_else(|e| panic!("{e:#}\nagent log:\n{}", agent.log()));
        Self {
            envoy: Some(envoy),
            agent,
            cp,
            modules,
            root,
            app,
            _module_pod: module_pod,
            _istiod: istiod,
            _mesh: mesh,
        }
    }

    fn get(&self) -> (u16, String) {
        self.app
            .run(|| async { http::get(LISTENER.parse().unwrap(), "/").await })
            .unwrap()
            .unwrap_or_else(|e| panic!("GET {LISTENER}: {e:#}\n{}", self.logs()))
    }

    fn logs(&self) -> String {
        format!(
            "agent log:\n{}\nEnvoy log:\n{}",
            self.agent.log(),
            self.envoy.as_ref().map(|e| e.log()).unwrap_or_default()
        )
    }

    /// The NACK istiod got for the ECDS push `version` (its message), if any yet.
    fn nack(&self, version: &str) -> Option<String> {
        self.cp.wait_for(CONVERGE, |reqs, _| {
            reqs.iter()
                .find(|r| {
                    r.type_url == type_url::EXTENSION_CONFIG && r.version_info == version && r.is_nack()
                })
                .and_then(|r| r.error.clone())
        })
    }
}

fn weir_wat() -> Vec<u8> {
    wat::parse_str(TEAPOT_WAT).expect("the test module assembles")
}

/// The same filter answering with another body (so a second module is told apart).
fn oci_wat() -> Vec<u8> {
    let source = TEAPOT_WAT.replace("\"served by wasm\"", "\"served by oci!\"");
    wat::parse_str(source).expect("the test module assembles")
}

#[test]
fn a_remote_module_is_fetched_cached_and_run_by_envoy_and_bad_ones_are_nacked() {
    require_root!();
    let module = weir_wat();
    let sha = sha256_hex(&module);
    let rig = Rig::new(&test_name!(), module.clone());

    // Envoy runs the module: every request is answered by it.
    let served = eventually(CONVERGE, || {
        let (status, body) = rig.get();
        (status == 418).then_some(body)
    });
    assert_eq!(served.as_deref(), Some("served by wasm"), "{}", rig.logs());
    let cached = rig.root.path().join(format!("var/lib/istio/data/{sha}.wasm"));
    assert_eq!(std::fs::read(&cached).unwrap(), module, "the module is cached under its sha256");
    assert_eq!(rig.modules.seen().len(), 1, "fetched once");
    // What Envoy holds names the local file, not the URL.
    let dump = rig
        .envoy
        .as_ref()
        .unwrap()
        .admin_get(&rig.app, "/config_dump?resource=ecds_filters")
        .unwrap_or_default();
    assert!(dump.contains(&cached.file_name().unwrap().to_string_lossy().to_string()), "{dump}");
    assert!(!dump.contains("teapot.wasm"), "Envoy was given the remote URL: {dump}");

    // A wrong checksum: NACKed upstream with the reason, Envoy unchanged.
    let good = format!("http://{}/teapot.wasm", rig.modules.addr);
    let wrong = "0".repeat(64);
    rig.cp.ads.push(snapshot(resources::remote_wasm_filter(FILTER, &good, &wrong), "2"));
    let reason = rig.nack("2").unwrap_or_else(|| panic!("no NACK for a bad checksum\n{}", rig.logs()));
    assert!(reason.contains("checksum") && reason.contains(&sha) && reason.contains(&wrong), "{reason}");
    assert_eq!(rig.get(), (418, "served by wasm".into()));
    assert_eq!(rig.modules.seen().len(), 2, "an unknown checksum is fetched to be checked");

    // An unreachable URL (nothing listens there): NACKed, Envoy unchanged.
    let nowhere = format!("http://{}:1/teapot.wasm", rig.modules.addr.ip());
    rig.cp.ads.push(snapshot(resources::remote_wasm_filter(FILTER, &nowhere, &sha), "3"));
    // The checksum is cached: the module is not fetched again and the push is ACKed.
    let acked = rig.cp.wait_for_ack(type_url::EXTENSION_CONFIG, "3", CONVERGE);
    assert!(acked, "a cached checksum needs no fetch\n{}", rig.logs());
    let missing = "f".repeat(64);
    rig.cp.ads.push(snapshot(resources::remote_wasm_filter(FILTER, &nowhere, &missing), "4"));
    let reason = rig.nack("4").unwrap_or_else(|| panic!("no NACK for an unreachable URL\n{}", rig.logs()));
    assert!(reason.contains(&nowhere) && reason.contains("connect"), "{reason}");
    assert_eq!(rig.get(), (418, "served by wasm".into()));
    assert_eq!(rig.modules.seen().len(), 2, "nothing else was fetched from the module server");
    let metrics = rig
        .app
        .run(|| async { http::get("127.0.0.1:15020".parse().unwrap(), "/stats/prometheus").await })
        .unwrap()
        .unwrap()
        .1;
    for result in ["success", "checksum_mismatched", "download_failure"] {
        assert!(
            metrics.contains(&format!("istio_agent_wasm_remote_fetch_count_total{{result=\"{result}\"}} 1")),
            "{result}: {}",
            metrics.lines().filter(|l| l.contains("wasm")).collect::<Vec<_>>().join("\n")
        );
    }
}

/// `oci://` modules: an anonymous pull (manifest, then the Wasm layer's blob, its
/// digest checked) from a registry in `WASM_INSECURE_REGISTRIES`, reached over plain
/// HTTP. The registry is the test HTTP server answering the OCI distribution API.
#[test]
fn an_oci_image_is_pulled_from_an_insecure_registry() {
    require_root!();
    let rig = Rig::new(&test_name!(), weir_wat());
    assert!(eventually(CONVERGE, || (rig.get().0 == 418).then_some(())).is_some(), "{}", rig.logs());

    let module = oci_wat();
    let digest = format!("sha256:{}", sha256_hex(&module));
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.module.wasm.config.v1+json", "digest": "sha256:00", "size": 2},
        "layers": [{"mediaType": "application/vnd.module.wasm.content.layer.v1+wasm", "digest": digest, "size": module.len()}],
    })
    .to_string();
    let blob_path = format!("/v2/weir/teapot/blobs/{digest}");
    rig.modules.answer_with(move |req| {
        if req.path == "/v2/weir/teapot/manifests/v1" {
            (200, "application/vnd.oci.image.manifest.v1+json", manifest.clone().into_bytes())
        } else if req.path == blob_path {
            (200, "application/octet-stream", module.clone())
        } else {
            (404, "application/json", br#"{"errors":[{"code":"NAME_UNKNOWN"}]}"#.to_vec())
        }
    });
    let image = format!("oci://{}/weir/teapot:v1", rig.modules.addr);
    rig.cp.ads.push(snapshot(resources::remote_wasm_filter(FILTER, &image, ""), "2"));
    let served = eventually(CONVERGE, || {
        let (status, body) = rig.get();
        (status == 418 && body == "served by oci!").then_some(())
    });
    assert!(served.is_some(), "the OCI module never ran: {:?}\n{}", rig.get(), rig.logs());
    let paths: Vec<String> = rig.modules.seen().into_iter().map(|r| r.path).collect();
    assert!(
        paths.ends_with(&[
            "/v2/weir/teapot/manifests/v1".to_string(),
            format!("/v2/weir/teapot/blobs/{digest}")
        ]),
        "{paths:?}"
    );
    let accept = rig.modules.seen().iter().rev().nth(1).and_then(|r| r.header("accept").map(String::from));
    assert!(accept.unwrap_or_default().contains("application/vnd.oci.image.manifest.v1+json"));

    // A registry that does not know the image: a NACK naming it.
    let unknown = format!("oci://{}/weir/missing:v9", rig.modules.addr);
    rig.cp.ads.push(snapshot(resources::remote_wasm_filter(FILTER, &unknown, ""), "3"));
    let reason = rig.nack("3").unwrap_or_else(|| panic!("no NACK for an unknown image\n{}", rig.logs()));
    assert!(reason.contains("weir/missing") && reason.contains("404"), "{reason}");
    assert_eq!(rig.get(), (418, "served by oci!".into()));
}

/// A full disk under the module cache (a 64 KiB tmpfs, filled): the module cannot be
/// stored, the push is NACKed naming the file and the reason, no partial file is left,
/// and Envoy keeps the module it runs. Once there is room, the next push is served.
#[test]
fn a_full_disk_under_the_wasm_cache_is_nacked_leaves_no_partial_file_and_recovers() {
    require_root!();
    let rig = Rig::new(&test_name!(), weir_wat());
    assert!(eventually(CONVERGE, || (rig.get().0 == 418).then_some(())).is_some(), "{}", rig.logs());

    // The cache's folder on a small file system, filled (Envoy loaded the first module
    // already; its file is hidden under the mount).
    let data = rig.root.path().join("var/lib/istio/data");
    let options = format!("size=64k,mode=0755,uid={PROXY_UID},gid={PROXY_UID}");
    let _tmpfs = weir_tests::full_disk::Tmpfs::mount(&data, &options);
    let filler = weir_tests::full_disk::fill(&data);
    let module = oci_wat();
    let sha = sha256_hex(&module);
    rig.modules.answer_with(move |req| match req.path.as_str() {
        "/second.wasm" => (200, "application/wasm", module.clone()),
        _ => (404, "text/plain", b"no such module".to_vec()),
    });
    let second = format!("http://{}/second.wasm", rig.modules.addr);
    rig.cp.ads.push(snapshot(resources::remote_wasm_filter(FILTER, &second, &sha), "2"));
    let reason =
        rig.nack("2").unwrap_or_else(|| panic!("no NACK for a module that cannot be stored\n{}", rig.logs()));
    let file = data.join(format!("{sha}.wasm"));
    assert!(
        reason.contains(&format!("cannot store the Wasm module in {}", file.display()))
            && reason.contains("No space left on device"),
        "{reason}"
    );
    let mut names: Vec<String> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["filler"], "no partial module left in the cache");
    assert_eq!(rig.get(), (418, "served by wasm".into()), "Envoy keeps the module it runs");

    // Room again: the next push is fetched, stored whole and run.
    std::fs::remove_file(&filler).unwrap();
    rig.cp.ads.push(snapshot(resources::remote_wasm_filter(FILTER, &second, &sha), "3"));
    let served = eventually(CONVERGE, || {
        let (status, body) = rig.get();
        (status == 418 && body == "served by oci!").then_some(())
    });
    assert!(served.is_some(), "the module never ran once there was room: {:?}\n{}", rig.get(), rig.logs());
    assert_eq!(std::fs::read(&file).unwrap(), oci_wat(), "stored whole under its sha256");
}

/// A module server that reads each request and answers only when released: a fetch
/// from it stalls for as long as the test wants.
struct StalledModules {
    addr: SocketAddr,
    requests: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    release: std::sync::mpsc::Sender<Vec<u8>>,
}

impl StalledModules {
    fn start(pod: &Pod) -> Self {
        use std::io::{Read as _, Write as _};
        let addr = SocketAddr::new(pod.ipv4().into(), 8081);
        let listener = pod.run(|| async move { std::net::TcpListener::bind(addr) }).unwrap().unwrap();
        let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (release, released) = std::sync::mpsc::channel::<Vec<u8>>();
        let seen = requests.clone();
        std::thread::spawn(move || {
            // One connection (the agent's one attempt): held until released.
            let Ok((mut conn, _)) = listener.accept() else { return };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                head.push(byte[0]);
            }
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let Ok(module) = released.recv() else { return };
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/wasm\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                module.len()
            );
            let _ = conn.write_all(head.as_bytes()).and_then(|()| conn.write_all(&module));
        });
        Self { addr, requests, release }
    }
}

/// A module server that takes its time holds only its own ECDS response: a listener
/// pushed while the fetch stalls reaches Envoy and serves, and once the module comes,
/// the ECDS response is converted, forwarded and ACKed in its turn.
#[test]
fn a_stalled_module_fetch_holds_back_no_other_xds_type() {
    require_root!();
    let rig = Rig::new(&test_name!(), weir_wat());
    assert!(eventually(CONVERGE, || (rig.get().0 == 418).then_some(())).is_some(), "{}", rig.logs());
    let stalled = StalledModules::start(&rig._module_pod);
    let module = oci_wat();
    let url = format!("http://{}/stalled.wasm", stalled.addr);
    // The WasmPlugin's own timeout: longer than the test.
    let wasm = resources::remote_wasm_filter_with_timeout(
        FILTER,
        &url,
        &sha256_hex(&module),
        Duration::from_secs(3600),
    );
    rig.cp.ads.push(snapshot(wasm.clone(), "2"));
    let fetching = eventually(CONVERGE, || {
        (stalled.requests.load(std::sync::atomic::Ordering::SeqCst) == 1).then_some(())
    });
    assert!(fetching.is_some(), "the agent never asked the module server\n{}", rig.logs());

    // A new listener while the module is on its way: it serves.
    let extra = "127.0.0.1:18001";
    rig.cp.ads.push(snapshot_with(wasm, "3", &[("extra", extra)]));
    let served = eventually(CONVERGE, || {
        rig.app
            .run(|| async { http::get(extra.parse().unwrap(), "/").await })
            .unwrap()
            .ok()
            .filter(|(status, _)| *status == 200)
    });
    assert_eq!(served, Some((200, "no wasm".to_string())), "LDS waited for a Wasm fetch\n{}", rig.logs());
    assert_eq!(rig.get(), (418, "served by wasm".into()), "Envoy keeps its module meanwhile");

    // The module arrives: both ECDS responses reach Envoy in order and are ACKed.
    stalled.release.send(module).unwrap();
    assert!(rig.cp.wait_for_ack(type_url::EXTENSION_CONFIG, "3", CONVERGE), "{}", rig.logs());
    let converted = eventually(CONVERGE, || {
        let (status, body) = rig.get();
        (status == 418 && body == "served by oci!").then_some(())
    });
    assert!(converted.is_some(), "the released module never ran: {:?}\n{}", rig.get(), rig.logs());
}
