//! The namespace test rig: pods (network namespaces on a private bridge), cgroups and
//! processes placed in them, a guard for tests that need root, helpers to run the real
//! Envoy and the `weir-testkit` traffic tool, and the test control plane (Weir's ADS
//! server as istiod, with istiod's CA and a request log that only tests have). The
//! sandbox primitives come from `weir_agent::sandbox` (the demo uses them too); what is
//! test-only lives here.
//!
//! ```no_run
//! use weir_tests::{Mesh, require_root, test_name};
//! #[test]
//! fn example() {
//!     require_root!();
//!     let mesh = Mesh::new(test_name!()).unwrap();
//!     let server = mesh.pod("server").unwrap();
//!     let client = mesh.pod("client").unwrap();
//! }
//! ```

pub mod ambient;
pub mod busynode;
pub mod capture;
pub mod cluster;
pub mod cni;
pub mod control_plane;
pub mod cri;
pub mod daemonset;
pub mod datapath;
pub mod demo;
pub mod envoy;
pub mod fake_ztunnel;
pub mod full_disk;
pub mod http;
pub mod http_server;
pub mod inject;
pub mod istiod_ca;
pub mod kernel;
pub mod kube_api;
pub mod meshtraffic;
pub mod mtls_pair;
pub mod oci;
pub mod privilege;
pub mod prototext;
pub mod request_log;
pub mod sidecar;
pub mod socket_lb;
pub mod spire;
pub mod synprobe;
pub mod tools;
pub mod ztunnel;

pub use weir_agent::{
    capture::ebpf::bpffs::BpffsUse,
    sandbox::{Cgroup, Mesh, Placement, Pod, PodChild, leftovers, reap},
};

/// The current test's name (its function path), for naming its sandbox.
#[macro_export]
macro_rules! test_name {
    () => {{
        fn f() {}
        fn type_name_of<T>(_: T) -> &'static str {
            std::any::type_name::<T>()
        }
        let name = type_name_of(f);
        let name = name.strip_suffix("::f").unwrap_or(name);
        name.split("::").skip(1).collect::<Vec<_>>().join("::")
    }};
}

/// Fails a test that needs root, naming the missing capabilities, when this process
/// lacks them: a privileged test never passes without running.
#[macro_export]
macro_rules! require_root {
    () => {
        $crate::privilege::require(&$crate::test_name!())
    };
}

/// A cgroup named after the test, under the cgroup2 mount.
pub fn test_cgroup(test: &str) -> Cgroup {
    Cgroup::create(&weir_agent::sandbox::unique_name(test)).expect("create test cgroup")
}
