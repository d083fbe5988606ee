//! The CNI plugin (argv[0] `weir-cni` or `istio-cni`, chained after the cluster's
//! primary CNI): the protocol (`spec`), what to do for a pod (`pod`), where the pod
//! comes from (`kube`, the Kubernetes API through the node's kubeconfig), and ADD /
//! DEL / CHECK applying capture inside the pod's network namespace (`plugin`).

pub mod kube;
pub mod pod;
pub mod spec;
