//! The injected-pod rig: each of Istio's injector goldens (`testdata/istio-inject/`)
//! run as the kubelet would run it. [`manifest`] reads the pod (a Pod, or a
//! Deployment's pod as its ReplicaSet names it); [`env`] resolves a container's
//! environment and command line as the kubelet does (`fieldRef`, `resourceFieldRef`,
//! `$(VAR)`); [`volumes`] lays out the pod's volumes as the kubelet does and mounts
//! them at their real paths in a container's private mount namespace; [`pod`] runs the
//! init containers, the native sidecar and stand-ins for the app images, sends the
//! kubelet's probes, `exec`s and terminates; [`cluster`] is istiod's stand-in and the
//! node; [`metadata`] is the node pilot-agent would present, to compare with what
//! istiod saw; [`images`] runs Istio's containers from Weir's built images instead.
//!
//! ```no_run
//! use weir_tests::inject::{Manifest, InjectedPod, PodOptions, ProbeKind};
//! let manifest = Manifest::load("hello-readiness.yaml.injected").unwrap();
//! let mut pod = InjectedPod::start("example", manifest, PodOptions::default()).unwrap();
//! pod.wait_probe("hello", ProbeKind::Readiness, std::time::Duration::from_secs(30)).unwrap();
//! let end = pod.terminate("istio-proxy").unwrap();
//! assert!(end.exit.success());
//! assert!(pod.remove().is_empty());
//! ```

pub mod cluster;
pub mod env;
pub mod images;
pub mod manifest;
pub mod metadata;
pub mod pod;
pub mod volumes;

pub use cluster::{Cluster, SeenCsr, SeenNode};
pub use manifest::{Manifest, ProbeKind};
pub use pod::{InjectedPod, PodOptions, ProbeOutcome, RunningContainer, Termination};
