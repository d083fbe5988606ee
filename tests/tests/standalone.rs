//! Standalone mode's embedded control plane, in a pod: it serves the services file's
//! view for its workload, follows edits to the file (keeping the last good one when an
//! edit is broken), and keeps its mesh CA across restarts in the state directory. The
//! whole path with real Envoys and traffic is the demo's test (tests/demo.rs).

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use weir_agent::standalone::{StandaloneSettings, start};
use weir_proto::type_url;
use weir_tests::{Mesh, envoy::tempfile_dir::Dir, require_root, test_name};

fn file(services: &[(&str, &str)]) -> String {
    let mut out = String::from("services:\n");
    for (name, ip) in services {
        out.push_str(&format!(
            "- name: {name}\n  address: {ip}\n  port: 8080\n  endpoints: [\"{ip}:8080\"]\n"
        ));
    }
    out
}

#[test]
fn the_embedded_control_plane_follows_its_file_and_keeps_its_ca() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    let dir = Dir::new("standalone").unwrap();
    let settings =
        StandaloneSettings { services: dir.path().join("mesh.yaml"), state_dir: dir.path().join("ca") };
    let ip = pod.ipv4();
    std::fs::write(&settings.services, file(&[("server", &ip.to_string())])).unwrap();
    pod.run(|| async {
        let stop = CancellationToken::new();
        let cp = start(&settings, Some(ip.into()), stop.clone()).await.unwrap();
        let root = cp.ca.root_pem();
        let snapshot = cp.ads.snapshot();
        let listeners: Vec<&String> = snapshot.get(type_url::LISTENER).unwrap().resources.keys().collect();
        assert_eq!(listeners, ["virtualInbound", "virtualOutbound"], "this workload serves `server`");

        // An edit is pushed as a new version.
        std::fs::write(&settings.services, file(&[("server", &ip.to_string()), ("other", "10.66.0.99")]))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while cp.ads.snapshot().version(type_url::CLUSTER) != "2" {
            assert!(Instant::now() < deadline, "the edit was not pushed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let clusters = cp.ads.snapshot();
        assert!(
            clusters
                .get(type_url::CLUSTER)
                .unwrap()
                .resources
                .contains_key("outbound|8080||other.default.svc.cluster.local")
        );
        // A broken edit keeps the last good config.
        std::fs::write(&settings.services, "services: [oops").unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(cp.ads.snapshot().version(type_url::CLUSTER), "2");

        stop.cancel();
        let _ = cp.task.await;
        // A restart keeps the mesh CA (and the port is free again).
        std::fs::write(&settings.services, file(&[("server", &ip.to_string())])).unwrap();
        let stop = CancellationToken::new();
        let again = start(&settings, Some(ip.into()), stop.clone()).await.unwrap();
        assert_eq!(again.ca.root_pem(), root, "the mesh CA lives in the state directory");
        stop.cancel();
        let _ = again.task.await;
    })
    .unwrap();
}
