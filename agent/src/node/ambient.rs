//! Ambient mode on the node: Weir's node agent does what istio-cni's does for pods
//! labelled `istio.io/dataplane-mode=ambient` (or in such a namespace): it redirects
//! each pod's traffic to ztunnel with rules inside the pod's own network namespace, and
//! hands that namespace to the node's unmodified ztunnel over ZDS (`node/zds`).
//!
//! - `settings`: istio-cni's ambient environment (`AMBIENT_ENABLED`, the enablement
//!   selector, DNS capture, IPv6, reconcile, native nftables, `ZTUNNEL_UDS_ADDRESS`...).
//! - `backend`: whether `NATIVE_NFTABLES` really gets nftables on this node (not while
//!   the node's iptables probe set exists, nor with an nft without JSON).
//! - `objects`: the Pod and Namespace fields read, the redirection annotation. Pure.
//! - `watch`: list+watch of a collection on the agent's own Kubernetes client.
//! - `dataplane`: one pod into the mesh and out (netns, rules, ZDS, probe set,
//!   annotation), in Istio's order; what it acts on is behind `dataplane/effects`
//!   (`dataplane/inpod`: the capture on the node).
//! - `controller`: enrollment from the watches, level-based, with retries.
//! - `listener`: the plugin's event socket (`pluginevent.sock`).
//! - `snapshot`: enrolled pods restored at start (their namespaces through /proc).
//! - `hostprobe`: the node's kubelet-probe SNAT rule and sets, kept in place.
//! - `branch_eni`: AWS branch-ENI pods' host rules, following their addresses in and
//!   out of the probe sets (`AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE`).
//! - `run`: the agent's start, in order, and its stop (which removes nothing).
//! - `rules_cmd`: `weir cni ambient-rules`, the rules for given settings (dry run).
//!
//! Which pods are ambient and the plugin's add event are `node/enroll` (the plugin
//! shares them). The rules themselves are `weir_iptables::ambient` (pure plans,
//! Istio's goldens).

pub mod backend;
pub mod branch_eni;
pub mod controller;
pub mod dataplane;
pub mod hostprobe;
pub mod listener;
pub mod objects;
pub mod rules_cmd;
pub mod run;
pub mod settings;
pub mod snapshot;
pub mod watch;

#[cfg(test)]
mod fakes;
