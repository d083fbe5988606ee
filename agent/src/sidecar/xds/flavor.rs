//! The two ADS variants, State of the World and Delta, behind one trait so the relay is
//! written once. Each says how to read a type URL off its messages, how the agent
//! subscribes, ACKs or NACKs on its own (SotW: version + nonce; Delta: nonce), and how
//! to open the upstream stream.

use std::future::Future;

use prost_types::Any;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Status, Streaming};
use weir_proto::{
    envoy::service::discovery::v3::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
    },
    google::rpc,
    type_url,
};

use super::upstream::AdsClient;

/// What the agent reports about the workload's readiness (`istio.v1.HealthInformation`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy(String),
}

impl Health {
    /// `error_detail` as Istio sends it: none when healthy, code 13 (INTERNAL) otherwise.
    fn error_detail(&self) -> Option<rpc::Status> {
        match self {
            Health::Healthy => None,
            Health::Unhealthy(message) => Some(internal(message.clone())),
        }
    }
}

/// A `google.rpc.Status` with code INTERNAL, as pilot-agent NACKs.
pub fn internal(message: String) -> rpc::Status {
    rpc::Status { code: tonic::Code::Internal as i32, message, details: vec![] }
}

/// The request stream the relay feeds upstream.
pub type RequestStream<F> = UnboundedReceiverStream<<F as Flavor>::Request>;

pub trait Flavor: Send + Sync + 'static {
    type Request: prost::Message + Default + Clone + Send + 'static;
    type Response: prost::Message + Default + Send + 'static;
    /// `sotw` or `delta`, for logs.
    const NAME: &'static str;

    fn request_type(r: &Self::Request) -> &str;
    fn response_type(r: &Self::Response) -> &str;
    fn response_nonce(r: &Self::Response) -> &str;
    fn resource_count(r: &Self::Response) -> usize;
    /// The agent's own initial subscription to `type_url` (NDS).
    fn subscribe(type_url: &str) -> Self::Request;
    fn health(health: &Health) -> Self::Request;
    /// Takes the first resource out of a response (agent-internal types are
    /// singletons; the response is then only ACKed, never forwarded); None when the
    /// response has no resource.
    fn take_first_resource(r: &mut Self::Response) -> Option<Any>;
    /// Every resource of a response, to rewrite in place (Wasm modules).
    fn resources_mut(r: &mut Self::Response) -> Vec<&mut Any>;
    /// ACK (no error) or NACK for a response the agent consumed itself.
    fn ack(r: &Self::Response, error: Option<rpc::Status>) -> Self::Request;
    fn open(
        client: AdsClient,
        request: tonic::Request<RequestStream<Self>>,
    ) -> impl Future<Output = Result<Streaming<Self::Response>, Status>> + Send;
}

/// `StreamAggregatedResources`.
pub struct Sotw;

impl Flavor for Sotw {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;
    const NAME: &'static str = "sotw";

    fn request_type(r: &DiscoveryRequest) -> &str {
        &r.type_url
    }
    fn response_type(r: &DiscoveryResponse) -> &str {
        &r.type_url
    }
    fn response_nonce(r: &DiscoveryResponse) -> &str {
        &r.nonce
    }
    fn resource_count(r: &DiscoveryResponse) -> usize {
        r.resources.len()
    }
    fn subscribe(type_url: &str) -> DiscoveryRequest {
        DiscoveryRequest { type_url: type_url.into(), ..Default::default() }
    }
    fn health(health: &Health) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: type_url::HEALTH_INFO.into(),
            error_detail: health.error_detail(),
            ..Default::default()
        }
    }
    fn take_first_resource(r: &mut DiscoveryResponse) -> Option<Any> {
        r.resources.first_mut().map(std::mem::take)
    }
    fn resources_mut(r: &mut DiscoveryResponse) -> Vec<&mut Any> {
        r.resources.iter_mut().collect()
    }
    fn ack(r: &DiscoveryResponse, error: Option<rpc::Status>) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: r.version_info.clone(),
            type_url: r.type_url.clone(),
            response_nonce: r.nonce.clone(),
            error_detail: error,
            ..Default::default()
        }
    }
    async fn open(
        mut client: AdsClient,
        request: tonic::Request<RequestStream<Self>>,
    ) -> Result<Streaming<DiscoveryResponse>, Status> {
        Ok(client.stream_aggregated_resources(request).await?.into_inner())
    }
}

/// `DeltaAggregatedResources`.
pub struct Delta;

impl Flavor for Delta {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;
    const NAME: &'static str = "delta";

    fn request_type(r: &DeltaDiscoveryRequest) -> &str {
        &r.type_url
    }
    fn response_type(r: &DeltaDiscoveryResponse) -> &str {
        &r.type_url
    }
    fn response_nonce(r: &DeltaDiscoveryResponse) -> &str {
        &r.nonce
    }
    fn resource_count(r: &DeltaDiscoveryResponse) -> usize {
        r.resources.len()
    }
    fn subscribe(type_url: &str) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest { type_url: type_url.into(), ..Default::default() }
    }
    fn health(health: &Health) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: type_url::HEALTH_INFO.into(),
            error_detail: health.error_detail(),
            ..Default::default()
        }
    }
    /// A first resource without a body is handed on empty (pilot-agent hands its
    /// handler nil), for the handler to refuse by its type.
    fn take_first_resource(r: &mut DeltaDiscoveryResponse) -> Option<Any> {
        r.resources.first_mut().map(|r| r.resource.take().unwrap_or_default())
    }
    fn resources_mut(r: &mut DeltaDiscoveryResponse) -> Vec<&mut Any> {
        r.resources.iter_mut().filter_map(|r| r.resource.as_mut()).collect()
    }
    fn ack(r: &DeltaDiscoveryResponse, error: Option<rpc::Status>) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: r.type_url.clone(),
            response_nonce: r.nonce.clone(),
            error_detail: error,
            ..Default::default()
        }
    }
    async fn open(
        mut client: AdsClient,
        request: tonic::Request<RequestStream<Self>>,
    ) -> Result<Streaming<DeltaDiscoveryResponse>, Status> {
        Ok(client.delta_aggregated_resources(request).await?.into_inner())
    }
}

/// Envoy's own types: the only ones forwarded to Envoy.
pub fn is_envoy_type(type_url: &str) -> bool {
    type_url.starts_with("type.googleapis.com/envoy.")
}

/// The last segment of a type URL (`Cluster`), for logs.
pub fn short_type(type_url: &str) -> &str {
    type_url.rsplit('.').next().unwrap_or(type_url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_carry_what_each_protocol_needs() {
        let sotw = DiscoveryResponse {
            version_info: "v7".into(),
            type_url: type_url::NAME_TABLE.into(),
            nonce: "n1".into(),
            ..Default::default()
        };
        let ack = Sotw::ack(&sotw, None);
        assert_eq!((ack.version_info.as_str(), ack.response_nonce.as_str()), ("v7", "n1"));
        assert!(ack.error_detail.is_none());
        let nack = Sotw::ack(&sotw, Some(internal("bad table".into())));
        assert_eq!(nack.error_detail.unwrap().code, 13);

        let delta = DeltaDiscoveryResponse {
            system_version_info: "v7".into(),
            type_url: type_url::NAME_TABLE.into(),
            nonce: "n2".into(),
            ..Default::default()
        };
        let ack = Delta::ack(&delta, None);
        assert_eq!(ack.response_nonce, "n2");
        assert_eq!(ack.type_url, type_url::NAME_TABLE);
    }

    #[test]
    fn health_reports_follow_istio() {
        assert!(Sotw::health(&Health::Healthy).error_detail.is_none());
        let unhealthy = Delta::health(&Health::Unhealthy("probe failed".into()));
        assert_eq!(unhealthy.type_url, type_url::HEALTH_INFO);
        assert_eq!(unhealthy.error_detail.unwrap().message, "probe failed");
    }

    #[test]
    fn only_envoy_types_go_to_envoy() {
        assert!(is_envoy_type(type_url::CLUSTER));
        assert!(!is_envoy_type(type_url::NAME_TABLE));
        assert!(!is_envoy_type("type.googleapis.com/istio.mesh.v1alpha1.ProxyConfig"));
        assert_eq!(short_type(type_url::CLUSTER), "Cluster");
    }
}
