//! The workload's identity: keys and CSRs made in process, signed by istiod's CA,
//! cached, rotated before expiry and served to Envoy over SDS (or read from mounted
//! files). Private keys live in memory unless `OUTPUT_CERTS` asks for files.

pub mod caclient;
pub mod chain;
pub mod files;
pub mod keys;
pub mod manager;
pub mod names;
pub mod sds;

use std::time::Duration;

pub use caclient::CaClient;
pub use keys::{KeyAlgorithm, KeyOptions, WorkloadIdentity};
pub use manager::{CertFiles, RotationPolicy, SecretManager, WorkloadSource};
pub use names::SecretName;
pub use sds::SdsServer;

/// `d` moved up or down by up to `fraction` of itself, at random.
pub fn jitter(d: Duration, fraction: f64) -> Duration {
    d.mul_f64(1.0 + fraction * (rand::random::<f64>() * 2.0 - 1.0))
}
