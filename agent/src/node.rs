//! The node side: what Weir runs once per node rather than once per pod. Today that is
//! ZDS, the node agent's server for ztunnel (Istio's ambient mode); the node agent, the
//! ambient enrollment and the CNI plugin gather here as they are built or moved.

pub mod zds;
