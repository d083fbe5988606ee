//! What the ADS server tells whoever watches it: each stream it admits or refuses (with
//! the metadata that decided it) and each request on an admitted stream, as they
//! arrive. The server keeps none of it; an observer decides what is worth keeping (the
//! tests' request log keeps everything, standalone mode installs none).

use tonic::metadata::MetadataMap;
use weir_proto::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};

/// A stream as the server decided on it.
#[derive(Debug, Clone, Copy)]
pub struct ObservedStream<'a> {
    /// The server's number for the stream (requests on it carry the same).
    pub id: u64,
    pub delta: bool,
    pub metadata: &'a MetadataMap,
    /// Why the stream was refused (UNAUTHENTICATED), if it was.
    pub refused: Option<&'a str>,
}

/// One request on an admitted stream, as received.
#[derive(Debug, Clone, Copy)]
pub enum ObservedRequest<'a> {
    Sotw { stream: u64, request: &'a DiscoveryRequest },
    Delta { stream: u64, request: &'a DeltaDiscoveryRequest },
}

/// Told about streams and requests on the server's own tasks: keep it quick.
pub trait AdsObserver: Send + Sync {
    fn stream(&self, stream: ObservedStream<'_>);
    fn request(&self, request: ObservedRequest<'_>);
}
