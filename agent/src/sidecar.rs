//! The sidecar agent: what Istio's `pilot-agent proxy sidecar|router` does beside
//! Envoy. [`agent`] wires it: the configuration ([`config`], loaded once), Envoy's
//! bootstrap and process ([`envoy`]), the xDS relay ([`xds`]), certificates and SDS
//! ([`identity`]), the DNS proxy ([`dns`]), the status server ([`status`]), app health
//! for VMs ([`health`]), Wasm modules ([`wasm`]), the STS endpoint ([`sts`]), the
//! agent's own metrics ([`metrics`]) and memory figure ([`footprint`]), the node metadata
//! istiod and Envoy get ([`node_metadata`], from the pod's files: [`podinfo`]); standalone mode
//! ([`standalone`]) runs it against the embedded control plane ([`controlplane`]).

pub mod agent;
pub mod config;
pub mod controlplane;
pub mod dns;
pub mod envoy;
pub mod footprint;
pub mod health;
pub mod identity;
pub mod metrics;
pub mod node_metadata;
pub mod podinfo;
pub mod standalone;
pub mod status;
pub mod sts;
pub mod wasm;
pub mod xds;
