//! What the CNI plugin and the ambient node agent share about enrollment, so neither
//! imports the other: which pods are ambient (`selector`: Istio's enablement selector)
//! and how the plugin announces one to the agent (`event`: Istio's add event and its
//! POST over the agent's unix socket).

pub mod event;
pub mod netns_path;
pub mod selector;
