//! The start with pods enrolled already, against a [`FakeNode`]; and once with the real
//! ZDS server and a fake ztunnel, to see the snapshot the first ztunnel gets.

use std::sync::Arc;

use super::{SnapshotReport, restore};
use crate::node::{
    ambient::{
        dataplane::{Dataplane, effects::Effects},
        fakes::{Call, FakeNode, annotated, ip, pod, settings, uid},
        objects::AmbientPod,
    },
    zds::{
        ZdsConfig, ZdsServer,
        fake::{FakeZtunnel, netns_id, own_netns},
    },
};

/// Pod 1 and 2 enrolled (pod 2's namespace not found), pod 3 not enrolled, pod 4
/// enrolled but finished, and a ztunnel pod annotated as enrolled.
fn node_at_start(node: &FakeNode) -> Vec<AmbientPod> {
    node.netns_not_found_for(&uid(2));
    let mut finished = annotated(pod(4), "enabled");
    finished.phase = "Succeeded".into();
    let mut ztunnel = annotated(pod(5), "enabled");
    ztunnel.namespace = "istio-system".into();
    ztunnel.labels = [("app".to_string(), "ztunnel".to_string())].into();
    vec![annotated(pod(1), "enabled"), annotated(pod(2), "enabled"), pod(3), finished, ztunnel]
}

#[tokio::test]
async fn enrolled_pods_are_known_to_zds_first_then_cached_with_the_namespace_found() {
    let node = FakeNode::default();
    let pods = node_at_start(&node);
    let report = restore(&node.dataplane(), &pods).await;
    let expected =
        SnapshotReport { found: 1, kept: vec!["shop/web-2".into()], reconciled: 0, pruned: vec![] };
    assert_eq!(report, expected);
    assert_eq!(
        node.calls(),
        [
            Call::ZdsKeep(uid(1)),
            Call::ZdsKeep(uid(2)),
            Call::FindNetnsOfPods(vec![uid(1), uid(2)]),
            Call::ZdsCache(uid(1)),
            Call::ProbeUpsert(uid(1), ip(1)),
            Call::ProbeUpsert(uid(2), ip(2)),
            Call::ProbePrune(vec![ip(1), ip(2)]),
        ]
    );
}

#[tokio::test]
async fn the_probe_sets_are_not_pruned_while_an_enrolled_pod_has_no_address() {
    let node = FakeNode::default();
    let mut placeless = annotated(pod(2), "enabled");
    placeless.ips.clear();
    restore(&node.dataplane(), &[annotated(pod(1), "enabled"), placeless]).await;
    let calls = node.calls();
    assert_eq!(calls.last(), Some(&Call::ProbeUpsert(uid(1), ip(1))), "{calls:?}");
}

#[tokio::test]
async fn the_first_ztunnel_gets_every_enrolled_pod_in_its_snapshot_and_keeps_those_not_found() {
    let dir = tempfile::tempdir().unwrap();
    // A directory the server makes (one that exists already it would chown to root).
    let socket = dir.path().join("zds/ztunnel.sock");
    let own_uid = nix::unistd::geteuid().as_raw();
    let server =
        ZdsServer::bind_with(&socket, ZdsConfig { peer_uids: vec![own_uid], ..Default::default() }).unwrap();
    let node = FakeNode::default();
    let effects = Effects { zds: Box::new(server.handle()), ..node.effects() };
    let pods = node_at_start(&node);
    let report = restore(&Dataplane::with_effects(Arc::new(settings()), effects), &pods).await;
    assert_eq!((report.found, report.kept.len()), (1, 1));
    let stop = tokio_util::sync::CancellationToken::new();
    let served = tokio::spawn(server.run(stop.clone()));
    let mut ztunnel = FakeZtunnel::connect_hello(&socket).await;
    let snapshot = ztunnel.take_snapshot().await;
    assert_eq!(snapshot.len(), 2, "{snapshot:?}");
    let own = netns_id(std::os::fd::AsFd::as_fd(&own_netns()));
    let added = snapshot.iter().find(|r| r.fds.len() == 1).expect("an Add with the namespace");
    assert_eq!((added.add_uid(), added.netns_id()), (uid(1).as_str(), own));
    let kept = snapshot.iter().find(|r| r.fds.is_empty()).expect("a Keep");
    assert_eq!(kept.keep_uid(), uid(2));
    stop.cancel();
    served.await.unwrap().unwrap();
}
