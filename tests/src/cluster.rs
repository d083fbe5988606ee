//! A Kubernetes cluster in a box, for Weir on real nodes: three nodes, each with its
//! own network and mount namespaces, its own containerd (`containerd`), a kubelet
//! stand-in that runs the API stand-in's pods through CRI (`kubelet`), a primary CNI
//! (the reference bridge and host-local, chained as a cluster's), and an underlay
//! network routing every node's pod CIDR. Weir runs from its own DaemonSet or from
//! Istio's istio-cni chart with Weir's image (`chart`). Images come from `scripts/image`'s archives
//! and the rig's own (`images`); nothing is pulled.

pub mod chart;
pub mod containerd;
pub mod images;
pub mod istio_agent;
pub mod kubelet;
pub mod node;
pub mod rig;
pub mod scene;
pub mod workloads;
pub mod ztunnel_state;

use std::net::Ipv4Addr;

/// Node `index`'s underlay address (192.168.77.10 + index).
pub fn underlay_ip(index: u8) -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 77, 10 + index)
}

/// Node `index`'s pod CIDR.
pub fn pod_cidr(index: u8) -> String {
    format!("10.80.{index}.0/24")
}
