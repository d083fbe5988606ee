//! The node side: what Weir runs once per node rather than once per pod. The CNI plugin
//! (`cni`: the plugin itself, its eBPF and netfilter capture, install and repair), the
//! node agent's command line (`command`: `weir cni install|uninstall|repair`), and ZDS,
//! the node agent's server for ztunnel (Istio's ambient mode).

pub mod cni;
pub mod command;
pub mod zds;
