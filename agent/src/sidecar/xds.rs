//! xDS relay (Istio's "XDS proxy"): Envoy speaks ADS only to the agent, over a Unix
//! socket; the agent holds the authenticated connection to istiod, one upstream stream
//! per Envoy stream. Resources pass through as opaque `Any`; agent-internal types
//! (NDS) are consumed, ACKed and NACKed here and never reach Envoy. `grpc_bootstrap`
//! points proxyless gRPC applications at the same socket.

pub mod authority;
pub mod flavor;
pub mod grpc_bootstrap;
pub mod relay;
pub mod uds;
pub mod upstream;

pub use flavor::{Delta, Flavor, Health, Sotw};
pub use relay::{Handler, XdsProxy};
pub use upstream::{ClientIdentity, RootCerts, Transport, UpstreamConfig, UpstreamError};
