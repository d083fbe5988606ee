//! The plugin's ambient path (istio-cni's, when its config says `ambient_enabled`): a
//! pod the enablement selector picks (its labels and its namespace's; never a sidecar
//! or host-network pod) is not captured here: its add event (Istio's JSON: netns, pod,
//! the addresses from `prevResult`) is POSTed to the node agent's
//! `<cni_agent_run_dir>/pluginevent.sock`, which programs the pod and hands it to
//! ztunnel before answering. Any failure fails ADD (kubelet retries the sandbox), so no
//! ambient pod starts uncaptured. The namespace is read as istio-cni's `isAmbientPod`
//! reads it: an answer that may pass (none, 429, 5xx) is tried again 1 s later, once,
//! or 30 times with `enable_ambient_detection_retry`. Weir also fails closed where
//! Istio's plugin, with detection retries off, carries on as "not ambient": a
//! namespace it still cannot read.

use std::{collections::BTreeMap, path::Path};

use super::{
    kube::KubeError,
    pod::PodInfo,
    spec::{CniError, Invocation, NetConf, code},
};
use crate::node::enroll::{
    event::{AddEvent, SOCKET_NAME},
    selector::{EnablementSelectors, PodFacts},
};

/// Whether deciding may need the pod's namespace labels: ambient is on and an entry
/// of the selector looks at namespaces (the caller then reads them beside the pod).
pub fn may_read_namespace(conf: &NetConf) -> Result<bool, CniError> {
    Ok(conf.ambient_enabled && selectors(conf)?.entries().iter().any(|e| !e.namespace_selector.is_empty()))
}

fn selectors(conf: &NetConf) -> Result<EnablementSelectors, CniError> {
    EnablementSelectors::new(conf.enablement_selectors.clone()).map_err(|e| {
        CniError::new(code::INVALID_CONFIG, "enablement_selectors in the plugin's config", e.to_string())
    })
}

/// Whether `pod` is ambient per the plugin's config. Sidecar and host-network pods,
/// and pods an entry with no namespace selector picks, are answered without looking
/// at `namespace_labels` (read beside the pod when [`may_read_namespace`]); a failed
/// read of them fails ADD only when they decide.
pub fn is_ambient(
    conf: &NetConf,
    pod: &PodInfo,
    namespace_labels: Option<Result<BTreeMap<String, String>, KubeError>>,
) -> Result<bool, CniError> {
    if !conf.ambient_enabled
        || pod.host_network
        || pod.annotations.contains_key(crate::node::enroll::selector::SIDECAR_STATUS_ANNOTATION)
    {
        return Ok(false);
    }
    let selectors = selectors(conf)?;
    let facts =
        PodFacts { labels: &pod.labels, annotations: &pod.annotations, host_network: pod.host_network };
    let any_namespace = selectors
        .entries()
        .iter()
        .any(|e| e.namespace_selector.is_empty() && e.pod_selector.matches(&pod.labels));
    if any_namespace {
        return Ok(true);
    }
    let Some(labels) = namespace_labels else { return Ok(false) };
    let labels = labels.map_err(|e| {
        CniError::new(
            code::POD_LOOKUP_FAILED,
            format!(
                "cannot get namespace {} to tell whether pod {}/{} is ambient",
                pod.namespace, pod.namespace, pod.name
            ),
            crate::error_chain(&e),
        )
    })?;
    Ok(selectors.matches(&facts, &labels))
}

/// Hands the ambient pod to the node agent and waits for its answer.
pub fn hand_over(conf: &NetConf, inv: &Invocation, pod: &PodInfo) -> Result<(), CniError> {
    let run_dir = conf.cni_agent_run_dir.as_deref().unwrap_or(super::spec::DEFAULT_RUN_DIR);
    let socket = Path::new(run_dir).join(SOCKET_NAME);
    let event = AddEvent::new(
        inv.netns.as_deref().unwrap_or_default(),
        &pod.namespace,
        &pod.name,
        conf.prev_result.as_ref(),
    );
    let runtime = crate::support::runtime::current_thread("the plugin's add event")
        .map_err(|e| CniError::new(code::IO_FAILURE, "cannot start a runtime", crate::error_chain(&e)))?;
    let posted = runtime.block_on(event.post(&socket));
    super::phases::mark("agent");
    posted.map_err(|e| {
        CniError::new(
            code::TRY_AGAIN_LATER,
            format!("ambient pod {}/{}: the node agent did not capture it", pod.namespace, pod.name),
            crate::error_chain(&e),
        )
    })?;
    tracing::info!(pod = %format!("{}/{}", pod.namespace, pod.name), socket = %socket.display(), "ambient pod handed to the node agent");
    Ok(())
}
