//! The dataplane's steps, in order, against a [`FakeNode`]: adding a pod, what an add
//! that fails leaves behind (as the module doc promises), and removing a pod.

use super::DataplaneError;
use crate::node::{
    ambient::fakes::{
        Call, EventPath, FakeNode, Ztunnel, added_up_to_ztunnel, annotate, annotated, ip, pod, removed, uid,
    },
    ambient::objects::AmbientPod,
    zds::ZdsError,
};

/// Adds `pod` (with its addresses, no event), which must fail.
async fn add_failing(node: &FakeNode, pod: AmbientPod) -> DataplaneError {
    node.dataplane().add(&pod, &pod.ips, None).await.expect_err("the add must fail")
}

#[tokio::test]
async fn an_added_pod_is_captured_then_sent_to_ztunnel_then_probed_then_annotated_enabled() {
    let node = FakeNode::default();
    node.dataplane().add(&pod(1), &[ip(1)], None).await.unwrap();
    let then = [Call::ProbeUpsert(uid(1), ip(1)), annotate(1, Some("enabled"))];
    assert_eq!(node.calls(), [added_up_to_ztunnel(1), then.to_vec()].concat());
}

#[tokio::test]
async fn a_pod_annotated_enabled_already_is_added_without_annotating_it_again() {
    let node = FakeNode::default();
    node.dataplane().add(&annotated(pod(1), "enabled"), &[ip(1)], None).await.unwrap();
    let calls = node.calls();
    assert_eq!(calls.last(), Some(&Call::ProbeUpsert(uid(1), ip(1))), "{calls:?}");
    assert!(!calls.iter().any(|c| matches!(c, Call::Annotate(..))), "{calls:?}");
}

#[tokio::test]
async fn a_pod_from_the_plugins_event_is_added_in_the_namespace_the_event_names() {
    let node = FakeNode::default();
    node.dataplane().add(&pod(1), &[ip(1)], Some("/var/run/netns/cni-1")).await.unwrap();
    let calls = node.calls();
    assert_eq!(calls[..3], [Call::ZdsKeep(uid(1)), Call::OpenEventNetns(uid(1)), Call::ApplyCapture(uid(1))]);
}

#[tokio::test]
async fn an_event_whose_namespace_path_does_not_open_is_served_by_the_pods_namespace_found_through_proc() {
    let node = FakeNode::default();
    node.event_netns_fails_for(&uid(1), EventPath::DoesNotOpen);
    node.dataplane().add(&pod(1), &[ip(1)], Some("/var/run/docker/netns/a1b2")).await.unwrap();
    let calls = node.calls();
    let found = [Call::ZdsKeep(uid(1)), Call::OpenEventNetns(uid(1)), Call::FindNetns(uid(1))];
    assert_eq!(calls[..4], [found.to_vec(), vec![Call::ApplyCapture(uid(1))]].concat(), "{calls:?}");
    assert_eq!(calls.last(), Some(&annotate(1, Some("enabled"))));
}

#[tokio::test]
async fn an_event_path_that_does_not_open_with_no_process_of_the_pod_on_the_node_fails_naming_both() {
    let node = FakeNode::default();
    node.event_netns_fails_for(&uid(1), EventPath::DoesNotOpen);
    node.netns_not_found_for(&uid(1));
    let error = node.dataplane().add(&pod(1), &[ip(1)], Some("/var/run/netns/cni-1")).await.unwrap_err();
    let text = crate::error_chain(&error);
    assert!(text.contains("/host/var/run/netns/cni-1") && text.contains("/proc"), "{text}");
    assert!(!error.retryable(), "{error:?}");
    assert!(node.zds_known().is_empty(), "forgotten: {:?}", node.calls());
}

#[tokio::test]
async fn an_event_path_refused_as_the_nodes_namespace_is_not_searched_around() {
    let node = FakeNode::default();
    node.event_netns_fails_for(&uid(1), EventPath::NodesNamespace);
    let error = node.dataplane().add(&pod(1), &[ip(1)], Some("/proc/1/ns/net")).await.unwrap_err();
    assert!(matches!(error, DataplaneError::EventNetns { .. }), "{error:?}");
    assert!(!node.calls().contains(&Call::FindNetns(uid(1))), "{:?}", node.calls());
}

#[tokio::test]
async fn a_pod_zds_has_a_namespace_for_is_added_in_that_namespace_without_a_search() {
    let node = FakeNode::default();
    node.zds_has_netns_of(&uid(1));
    node.dataplane().add(&pod(1), &[ip(1)], None).await.unwrap();
    let calls = node.calls();
    assert_eq!(calls[..2], [Call::ZdsKeep(uid(1)), Call::ApplyCapture(uid(1))], "{calls:?}");
}

/// What an add leaves when ztunnel does not take the pod: the capture stays (no
/// removal), the pod stays cached for the next snapshot (no forget), its addresses are
/// not probed, it is annotated pending, and the error is retryable.
async fn assert_ztunnel_not_taking_the_pod_leaves_it_pending(answer: Ztunnel) {
    let node = FakeNode::default();
    node.ztunnel_answers(&[answer]);
    let error = add_failing(&node, pod(1)).await;
    assert!(matches!(error, DataplaneError::Zds { .. }) && error.retryable(), "{error:?}");
    assert_eq!(node.calls(), [added_up_to_ztunnel(1), vec![annotate(1, Some("pending"))]].concat());
    assert!(node.zds_known().contains(&uid(1)), "the pod goes out with the next snapshot");
}

#[tokio::test]
async fn a_pod_ztunnel_refuses_keeps_its_capture_and_is_annotated_pending_for_a_retry() {
    assert_ztunnel_not_taking_the_pod_leaves_it_pending(Ztunnel::Refuses).await;
}

#[tokio::test]
async fn a_pod_added_with_no_ztunnel_connected_keeps_its_capture_and_is_annotated_pending() {
    assert_ztunnel_not_taking_the_pod_leaves_it_pending(Ztunnel::Gone).await;
}

#[tokio::test]
async fn a_pending_pod_that_ztunnel_refuses_again_is_not_annotated_again() {
    let node = FakeNode::default();
    node.ztunnel_answers(&[Ztunnel::Refuses]);
    let error = add_failing(&node, annotated(pod(1), "pending")).await;
    assert!(matches!(error, DataplaneError::Zds { source: ZdsError::Nack { .. }, .. }), "{error:?}");
    assert_eq!(node.calls().last(), Some(&Call::ZdsAdd(uid(1))));
}

#[tokio::test]
async fn a_pod_whose_capture_fails_is_forgotten_by_zds_and_not_annotated() {
    let node = FakeNode::default();
    node.capture_fails_for(&uid(1));
    let error = add_failing(&node, pod(1)).await;
    assert!(matches!(error, DataplaneError::Rules { .. }) && !error.retryable(), "{error:?}");
    assert_eq!(
        node.calls(),
        [Call::ZdsKeep(uid(1)), Call::FindNetns(uid(1)), Call::ApplyCapture(uid(1)), Call::ZdsForget(uid(1))]
    );
    assert!(node.zds_known().is_empty());
}

#[tokio::test]
async fn an_enrolled_pod_whose_capture_fails_stays_known_to_zds_so_ztunnel_keeps_its_proxy() {
    let node = FakeNode::default();
    node.capture_fails_for(&uid(1));
    add_failing(&node, annotated(pod(1), "enabled")).await;
    assert_eq!(node.calls().last(), Some(&Call::ApplyCapture(uid(1))));
    assert!(node.zds_known().contains(&uid(1)));
}

#[tokio::test]
async fn a_pod_whose_namespace_is_not_found_is_forgotten_by_zds_and_not_captured() {
    let node = FakeNode::default();
    node.netns_not_found_for(&uid(1));
    let error = add_failing(&node, pod(1)).await;
    assert!(matches!(error, DataplaneError::FindNetns { .. }) && !error.retryable(), "{error:?}");
    assert_eq!(node.calls(), [Call::ZdsKeep(uid(1)), Call::FindNetns(uid(1)), Call::ZdsForget(uid(1))]);
}

#[tokio::test]
async fn a_pod_whose_annotations_cannot_stand_in_its_rules_is_forgotten_by_zds() {
    let node = FakeNode::default();
    let mut bad = pod(1);
    bad.annotations.insert("istio.io/reroute-virtual-interfaces".into(), "not an interface!".into());
    let error = add_failing(&node, bad).await;
    assert!(matches!(error, DataplaneError::Annotation { .. }), "{error:?}");
    assert!(node.zds_known().is_empty(), "still known to ZDS: {:?}", node.calls());
}

#[tokio::test]
async fn a_removed_pod_has_its_rules_undone_then_leaves_the_probe_set_then_ztunnel_then_its_annotation() {
    let node = FakeNode::default();
    node.zds_has_netns_of(&uid(1));
    node.dataplane().remove(&annotated(pod(1), "enabled"), false).await.unwrap();
    assert_eq!(node.calls(), removed(1, true));
    assert!(node.zds_known().is_empty());
}

#[tokio::test]
async fn a_deleted_pod_is_removed_without_touching_its_namespace_and_its_missing_annotation_is_no_error() {
    let node = FakeNode::default();
    node.zds_has_netns_of(&uid(1));
    let gone = annotated(pod(1), "enabled");
    node.gone_from_api(&gone);
    node.dataplane().remove(&gone, true).await.unwrap();
    assert_eq!(node.calls(), removed(1, false));
}

#[tokio::test]
async fn a_pod_taken_out_whose_annotation_cannot_be_cleared_fails_so_that_it_is_tried_again() {
    let node = FakeNode::default();
    node.api_down();
    let error = node.dataplane().remove(&annotated(pod(1), "enabled"), false).await.unwrap_err();
    assert!(matches!(error, DataplaneError::Annotate { .. }) && error.retryable(), "{error:?}");
}

#[tokio::test]
async fn a_deleted_pod_is_removed_even_when_its_annotation_cannot_be_cleared() {
    let node = FakeNode::default();
    node.api_down();
    node.dataplane().remove(&annotated(pod(1), "enabled"), true).await.unwrap();
    assert_eq!(node.calls().last(), Some(&annotate(1, None)));
}

#[tokio::test]
async fn a_removal_whose_rules_cannot_be_undone_fails_retryably_keeping_the_probe_entry_and_annotation() {
    let node = FakeNode::default();
    node.zds_has_netns_of(&uid(1));
    node.probed(&uid(1), ip(1));
    node.capture_removal_fails_for(&uid(1), 1);
    let enrolled = annotated(pod(1), "enabled");
    let error = node.dataplane().remove(&enrolled, false).await.unwrap_err();
    assert!(error.retryable(), "a failed removal is tried again: {error:?}");
    assert_eq!(node.calls(), [Call::RemoveCapture { uid: uid(1), in_netns: true }], "nothing after it");
    assert_eq!(node.probe_set(), [(ip(1), uid(1))].into(), "kubelet's probes still pass the rules left");
    assert!(node.zds_known().contains(&uid(1)), "its namespace stays cached for the retry");

    node.dataplane().remove(&enrolled, false).await.unwrap();
    assert_eq!(node.calls()[1..], removed(1, true));
    assert!(node.probe_set().is_empty());
}
