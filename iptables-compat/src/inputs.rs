//! A run's inputs: the capture configuration Istio's rule generator reads, parsed and
//! validated (`config`); istio-iptables' command line and environment that fill it
//! (`flags`), with Go's duration text (`duration`); the facts about the pod Istio
//! detects rather than takes as flags (`detect`); and what both generators derive
//! from a configuration the same way, the order they write Istio's rules in among it
//! (`decisions`). Nothing here touches the kernel.

pub mod config;
pub mod decisions;
pub mod detect;
pub mod duration;
pub mod flags;
