//! Capture in user space: the eBPF programs loaded, pinned, attached and registered
//! per pod ([`ebpf`]), and what capture a pod gets and why ([`explain`]). The
//! iptables and nftables rules are the `weir_iptables` crate's; the commands that
//! drive either are in `cmd` (`weir capture`, `istio-iptables`) and `node` (the CNI
//! plugin and node agent).

pub mod ebpf;
pub mod explain;
