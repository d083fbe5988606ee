//! The reconcile queue against a [`FakeNode`], on tokio's paused clock (a backoff of
//! seconds passes at once): retries (of adds and of removals), unenrollment, deleted
//! pods, and how retries share the [`PARALLEL`] permits.

use std::{sync::Arc, time::Duration};

use tokio::{sync::mpsc, task::JoinHandle};

use super::{PARALLEL, SharedCluster, apply_pod_event, run};
use crate::node::ambient::{
    fakes::{Call, FakeNode, Ztunnel, annotate, annotated, ip, pod, removed, uid},
    objects::AmbientPod,
    watch::WatchEvent,
};

/// Longer than any backoff (5 s at most): what has not happened by then will not.
const SETTLED: Duration = Duration::from_secs(30);

/// A running reconcile queue fed as the watches feed it.
struct Controller {
    node: FakeNode,
    cluster: SharedCluster,
    queue: mpsc::UnboundedSender<String>,
    task: JoinHandle<()>,
}

impl Controller {
    fn start(node: &FakeNode) -> Self {
        let cluster: SharedCluster = Arc::default();
        let (queue, incoming) = mpsc::unbounded_channel();
        let dataplane = Arc::new(node.dataplane());
        let task = tokio::spawn(run(dataplane, cluster.clone(), queue.clone(), incoming));
        Self { node: node.clone(), cluster, queue, task }
    }

    fn watch(&self, event: WatchEvent<AmbientPod>) {
        for uid in apply_pod_event(&self.cluster, event) {
            self.queue.send(uid).unwrap();
        }
    }

    /// Waits (on the paused clock) until the calls satisfy `done`.
    async fn until(&self, what: &str, done: impl Fn(&[Call]) -> bool) {
        let waited = tokio::time::timeout(SETTLED, async {
            while !done(&self.node.calls()) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        if waited.await.is_err() {
            panic!("{what}: not by {SETTLED:?}; calls: {:#?}", self.node.calls());
        }
    }

    /// Lets every backoff run out, then the calls made meanwhile.
    async fn settled_calls(&self) -> Vec<Call> {
        tokio::time::sleep(SETTLED).await;
        self.node.calls()
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn count(calls: &[Call], call: &Call) -> usize {
    calls.iter().filter(|c| *c == call).count()
}

#[tokio::test(start_paused = true)]
async fn a_failing_add_is_retried_until_ztunnel_takes_the_pod_then_left_alone() {
    let node = FakeNode::default();
    node.ztunnel_answers(&[Ztunnel::Gone, Ztunnel::Refuses]);
    let controller = Controller::start(&node);
    controller.watch(WatchEvent::Applied(pod(1)));
    let calls = controller.settled_calls().await;
    let steps: Vec<&Call> =
        calls.iter().filter(|c| matches!(c, Call::ZdsAdd(_) | Call::Annotate(..))).collect();
    let pending = annotate(1, Some("pending"));
    let add = Call::ZdsAdd(uid(1));
    assert_eq!(steps, [&add, &pending, &add, &pending, &add, &annotate(1, Some("enabled"))]);
}

#[tokio::test(start_paused = true)]
async fn a_retried_add_waits_out_a_backoff_that_doubles() {
    let node = FakeNode::default();
    node.ztunnel_answers(&[Ztunnel::Gone, Ztunnel::Gone, Ztunnel::Gone]);
    let controller = Controller::start(&node);
    controller.watch(WatchEvent::Applied(pod(1)));
    controller.settled_calls().await;
    let adds: Vec<_> =
        node.calls_at().into_iter().filter(|(_, c)| *c == Call::ZdsAdd(uid(1))).map(|(at, _)| at).collect();
    let gaps: Vec<Duration> = adds.windows(2).map(|w| w[1] - w[0]).collect();
    // 5 ms doubling from the first retry: 10, 20, 40 ms; then the fourth add is taken.
    assert_eq!(gaps.len(), 3, "{gaps:?}");
    for (gap, backoff) in gaps.iter().zip([10, 20, 40]) {
        let backoff = Duration::from_millis(backoff);
        assert!(*gap >= backoff && *gap < backoff + Duration::from_millis(5), "gaps {gaps:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_final_error_is_not_retried() {
    let node = FakeNode::default();
    node.capture_fails_for(&uid(1));
    let controller = Controller::start(&node);
    controller.watch(WatchEvent::Applied(pod(1)));
    let calls = controller.settled_calls().await;
    assert_eq!(count(&calls, &Call::ApplyCapture(uid(1))), 1, "{calls:?}");
}

#[tokio::test(start_paused = true)]
async fn a_pod_backing_off_does_not_hold_up_another_pods_add() {
    let node = FakeNode::default();
    node.ztunnel_refuses_always(&uid(1));
    let controller = Controller::start(&node);
    controller.watch(WatchEvent::Applied(pod(1)));
    controller.until("pod 1 retried", |calls| count(calls, &Call::ZdsAdd(uid(1))) >= 10).await;
    controller.watch(WatchEvent::Applied(pod(2)));
    let quickly = tokio::time::timeout(
        Duration::from_millis(100),
        controller.until("pod 2 enrolled", |calls| calls.contains(&annotate(2, Some("enabled")))),
    );
    assert!(quickly.await.is_ok(), "pod 2 waited on pod 1's backoff: {:#?}", node.calls());
}

#[tokio::test(start_paused = true)]
async fn pods_backing_off_leave_the_permits_to_other_pods() {
    let node = FakeNode::default();
    let failing: Vec<u8> = (1..=PARALLEL as u8).collect();
    let controller = Controller::start(&node);
    for &n in &failing {
        node.ztunnel_refuses_always(&uid(n));
        controller.watch(WatchEvent::Applied(pod(n)));
    }
    // Their backoffs are a second and more by now.
    controller
        .until("the failing pods retried", |calls| {
            failing.iter().all(|&n| count(calls, &Call::ZdsAdd(uid(n))) >= 9)
        })
        .await;
    let other = 100;
    controller.watch(WatchEvent::Applied(pod(other)));
    let quickly = tokio::time::timeout(
        Duration::from_millis(100),
        controller.until("the other pod enrolled", |calls| calls.contains(&annotate(other, Some("enabled")))),
    );
    assert!(quickly.await.is_ok(), "the other pod waited for a permit a backing-off pod held");
}

/// A controller that has seen pod 1 enrolled (and left it as it is).
async fn start_with_pod_enrolled(node: &FakeNode) -> (Controller, AmbientPod) {
    node.zds_has_netns_of(&uid(1));
    let controller = Controller::start(node);
    let enrolled = annotated(pod(1), "enabled");
    controller.watch(WatchEvent::Applied(enrolled.clone()));
    assert_eq!(controller.settled_calls().await, Vec::new(), "an enrolled, selected pod is left as it is");
    (controller, enrolled)
}

#[tokio::test(start_paused = true)]
async fn a_pod_whose_label_is_removed_is_taken_out_of_the_mesh() {
    let node = FakeNode::default();
    let (controller, enrolled) = start_with_pod_enrolled(&node).await;
    let mut unlabelled = enrolled;
    unlabelled.labels.clear();
    controller.watch(WatchEvent::Applied(unlabelled));
    assert_eq!(controller.settled_calls().await, removed(1, true));
}

#[tokio::test(start_paused = true)]
async fn a_deleted_pod_is_taken_out_by_the_addresses_it_last_had_and_forgotten() {
    let node = FakeNode::default();
    let (controller, enrolled) = start_with_pod_enrolled(&node).await;
    // kubelet strips a terminating pod's addresses before it goes.
    let mut stripped = enrolled;
    stripped.ips.clear();
    controller.watch(WatchEvent::Deleted(stripped));
    assert_eq!(controller.settled_calls().await, removed(1, false), "removed by the address it had");
    let cluster = controller.cluster.read().unwrap();
    assert!(cluster.deleted.is_empty() && cluster.last_ips.is_empty(), "{cluster:?}");
}

#[tokio::test(start_paused = true)]
async fn a_removal_that_fails_once_is_retried_and_completes_keeping_the_probe_entry_until_then() {
    let node = FakeNode::default();
    node.probed(&uid(1), ip(1));
    let (controller, enrolled) = start_with_pod_enrolled(&node).await;
    node.capture_removal_fails_for(&uid(1), 1);
    let mut unlabelled = enrolled;
    unlabelled.labels.clear();
    controller.watch(WatchEvent::Applied(unlabelled));
    let removal = Call::RemoveCapture { uid: uid(1), in_netns: true };
    controller.until("the first removal", |calls| calls.contains(&removal)).await;
    assert_eq!(node.probe_set(), [(ip(1), uid(1))].into(), "the entry stays while the rules do");
    let calls = controller.settled_calls().await;
    assert_eq!(calls, [vec![removal], removed(1, true)].concat(), "retried, then completed");
    assert!(node.probe_set().is_empty());
}
