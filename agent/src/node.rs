//! The node side: what Weir runs once per node rather than once per pod. The CNI plugin
//! (`cni`: the plugin itself, its eBPF and netfilter capture, install and repair),
//! ambient mode's node agent (`ambient`: enrollment, in-pod rules, the plugin's event
//! socket), what the plugin and that agent share (`enroll`: which pods are ambient, the
//! plugin's add event, the namespace paths it sends), ZDS, the node agent's server for
//! ztunnel, `metrics` (istio-cni's metric names), `node_affinity` (whether a DaemonSet still
//! takes this node), and `local_socket`: the agent's Unix sockets only their one peer drives. The
//! node agent's command line (`weir cni install|uninstall|repair|ambient`) is `cmd::cni`;
//! `istio_cni` runs all of it as one process, as Istio's chart runs `install-cni`
//! (`cmd::install_cni`).

pub mod ambient;
pub mod cni;
pub mod enroll;
pub mod istio_cni;
pub mod local_socket;
pub mod metrics;
pub mod node_affinity;
pub mod zds;
