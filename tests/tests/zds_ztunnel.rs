//! Weir's ZDS server (`weir_agent::node::zds`) with the real ztunnel (the rig's
//! `ztunnel` peer) in a test "node" namespace: ztunnel says hello and acks its
//! (empty) snapshot; an Add carrying a pod namespace this test made is acked and
//! ztunnel opens its listeners (15001, 15006, 15008, 15053) inside that namespace; a
//! Del closes them; a restarted ztunnel gets the snapshot again and reopens them
//! without any new Add.

use std::{fs::File, os::fd::OwnedFd, time::Duration};

use tokio_util::sync::CancellationToken;
use weir_agent::node::zds::{WorkloadInfo, ZdsHandle, ZdsServer, ZdsStatus};
use weir_tests::{
    Mesh, Pod, require_root, test_name,
    ztunnel::{self, LocalWorkload, POD_PORTS, Ztunnel, listening_tcp_ports, wait_until},
};

/// How long ztunnel may take to start, connect and act (a liveness bound).
const PATIENCE: Duration = Duration::from_secs(60);

fn netns_fd(pod: &Pod) -> OwnedFd {
    File::open(pod.netns().path()).expect("open the pod's netns").into()
}

fn listening(pod: &Pod) -> Vec<u16> {
    let ports = listening_tcp_ports(pod.netns()).expect("read the pod's listening ports");
    POD_PORTS.iter().copied().filter(|p| ports.contains(p)).collect()
}

/// Waits for the ZDS status, naming it and ztunnel's log when it does not come.
fn wait_status(rt: &tokio::runtime::Runtime, zds: &ZdsHandle, zt: &Ztunnel, want: ZdsStatus) {
    let mut watch = zds.watch();
    let reached = rt.block_on(async { tokio::time::timeout(PATIENCE, watch.wait_for(|s| *s == want)).await });
    if reached.is_err() {
        panic!("ZDS status stayed {:?}, not {want:?}; ztunnel's log:\n{}", zds.status(), zt.log());
    }
}

fn wait_ports(pod: &Pod, zt: &Ztunnel, want: &[u16]) {
    if let Err(e) = wait_until("ztunnel's listeners in the pod", PATIENCE, || listening(pod) == want) {
        panic!("{e}: {:?} listen, not {want:?}; ztunnel's log:\n{}", listening(pod), zt.log());
    }
}

/// Waits for `line` in ztunnel's log. ztunnel logs through a non-blocking writer, so
/// a line can reach the file after what it reports is visible (ports, acks).
fn wait_log(zt: &Ztunnel, line: &str) {
    if let Err(e) = wait_until("ztunnel's log", PATIENCE, || zt.log().contains(line)) {
        panic!("{e}: no {line:?} in ztunnel's log:\n{}", zt.log());
    }
}

#[test]
fn the_real_ztunnel_takes_pods_from_weirs_zds_server() {
    require_root!();
    // Built now if the cache does not hold it; a build that cannot be done fails here,
    // naming why.
    ztunnel::binary().unwrap_or_else(|e| panic!("the ztunnel peer: {e:#}"));
    let mesh = Mesh::new(&test_name!()).unwrap();
    let node = mesh.pod("node").unwrap();
    let app = mesh.pod("app").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ztunnel.sock");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(async { ZdsServer::bind(&socket) }).unwrap();
    let zds = server.handle();
    let stop = CancellationToken::new();
    let served = rt.spawn(server.run(stop.clone()));
    let workload = LocalWorkload {
        name: "app".into(),
        namespace: "default".into(),
        service_account: "app-sa".into(),
        ips: vec![app.ipv4().into()],
    };
    let info =
        WorkloadInfo { name: "app".into(), namespace: "default".into(), service_account: "app-sa".into() };

    // Hello, and the empty snapshot acked.
    let mut zt = Ztunnel::start(&node, &socket, std::slice::from_ref(&workload)).unwrap();
    wait_status(&rt, &zds, &zt, ZdsStatus { connections: 1, synced: 1 });
    assert_eq!(listening(&app), Vec::<u16>::new(), "nothing listens in the pod before its Add");

    // Add with the pod's netns: acked, and ztunnel listens inside the pod.
    rt.block_on(zds.add_pod("uid-app", info.clone(), netns_fd(&app)))
        .unwrap_or_else(|e| panic!("Add: {e}; ztunnel's log:\n{}", zt.log()));
    wait_ports(&app, &zt, &POD_PORTS);

    // Del: acked, and the listeners go.
    rt.block_on(zds.del_pod("uid-app")).unwrap_or_else(|e| panic!("Del: {e}; ztunnel's log:\n{}", zt.log()));
    wait_ports(&app, &zt, &[]);
    wait_log(&zt, r#"pod delete request, shutting down proxy	uid="uid-app""#);

    // Added again, then ztunnel restarted: the new one gets the snapshot (with no new
    // Add) and listens in the pod again.
    rt.block_on(zds.add_pod("uid-app", info, netns_fd(&app))).unwrap();
    wait_ports(&app, &zt, &POD_PORTS);
    zt.stop(Duration::from_secs(10)).unwrap();
    wait_status(&rt, &zds, &zt, ZdsStatus { connections: 0, synced: 0 });
    wait_ports(&app, &zt, &[]);
    let zt = Ztunnel::start(&node, &socket, &[workload]).unwrap();
    wait_status(&rt, &zds, &zt, ZdsStatus { connections: 1, synced: 1 });
    wait_ports(&app, &zt, &POD_PORTS);
    assert_eq!(zds.pods(), ["uid-app"]);
    wait_log(&zt, "received snapshot sent");
    let log = zt.log();
    let received = log.find(r#"pod received, starting proxy	uid="uid-app""#);
    let snapshot_sent = log.find("received snapshot sent");
    assert!(
        matches!((received, snapshot_sent), (Some(r), Some(s)) if r < s),
        "the restarted ztunnel did not get the pod in its snapshot; its log:\n{log}"
    );

    stop.cancel();
    rt.block_on(served).unwrap().unwrap();
    assert!(!socket.exists(), "the stopped server removed its socket");
}
