//! The test control plane itself, as a client sees it: istiod's CA answers on the same
//! TLS port as xDS, checks the token and signs a workload CSR into a leaf + root chain.

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
use weir_agent::sidecar::controlplane::{AdsServer, AuthPolicy, Snapshot};
use weir_proto::istio::v1::auth::{
    IstioCertificateRequest, istio_certificate_service_client::IstioCertificateServiceClient,
};
use weir_tests::{
    Mesh,
    control_plane::{ControlPlane, ISTIOD_SAN, TOKEN, TestCa},
    istiod_ca::IstiodCa,
    require_root, test_name,
};

#[test]
fn istiods_ca_signs_over_tls_on_the_xds_port_and_checks_the_token() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let istiod = mesh.pod("istiod").unwrap();
    let app = mesh.pod("app").unwrap();
    let serving_ca = TestCa::new("istiod serving").unwrap();
    let workload_ca = IstiodCa::new("workload CA", Some(TOKEN)).unwrap();
    let ads = AdsServer::new(Snapshot::new(), AuthPolicy::default());
    let cp = ControlPlane::istiod(&istiod, &serving_ca, ads).unwrap().with_ca(workload_ca.clone()).unwrap();

    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    let id = "spiffe://cluster.local/ns/default/sa/app";
    params.subject_alt_names = vec![rcgen::SanType::URI(id.try_into().unwrap())];
    let csr = params.serialize_request(&key).unwrap().pem().unwrap();

    let (addr, root) = (cp.addr, serving_ca.root_pem().to_string());
    let results = app
        .run(|| async move {
            let tls =
                ClientTlsConfig::new().ca_certificate(Certificate::from_pem(root)).domain_name(ISTIOD_SAN);
            let channel = Endpoint::from_shared(format!("https://{addr}"))
                .unwrap()
                .tls_config(tls)
                .unwrap()
                .connect()
                .await?;
            let mut client = IstioCertificateServiceClient::new(channel);
            let mut out = Vec::new();
            for token in [TOKEN, "wrong"] {
                let mut request = tonic::Request::new(IstioCertificateRequest {
                    csr: csr.clone(),
                    validity_duration: 600,
                    metadata: None,
                });
                request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
                out.push(client.create_certificate(request).await.map(|r| r.into_inner().cert_chain));
            }
            anyhow::Ok(out)
        })
        .unwrap()
        .unwrap();
    let chain = results[0].as_ref().expect("signed with the right token");
    assert_eq!(chain.len(), 2);
    assert_eq!(chain[1], workload_ca.root_pem());
    let status = results[1].as_ref().expect_err("refused with a wrong token");
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    let seen = workload_ca.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!((seen[0].validity_seconds, seen[0].uri_sans.clone()), (600, vec![id.to_string()]));
}

/// A push sends clusters before the listeners that name them, whatever order the
/// client subscribed in, as istiod does: Envoy rejects a listener whose route names a
/// cluster it does not have yet, and keeps that version rejected. Before, the types of
/// a push went out in a hash map's order (seen through containerd: every proxy of a
/// three-node rig rejected `virtualInbound` for `inbound|80||`).
#[tokio::test]
async fn a_push_sends_clusters_before_listeners() {
    use weir_proto::{
        envoy::service::discovery::v3::{
            DeltaDiscoveryRequest, aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
        },
        type_url,
    };
    let any = |t: &str| prost_types::Any { type_url: t.into(), value: vec![] };
    let ads = AdsServer::new(Snapshot::new(), AuthPolicy { token: None, cluster_id: None });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = ads.clone();
    tokio::spawn(async move { server.serve(listener, None, std::future::pending()).await });
    let channel = Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut responses = AggregatedDiscoveryServiceClient::new(channel)
        .delta_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    // Listeners subscribed first, then clusters.
    for t in [type_url::LISTENER, type_url::CLUSTER] {
        tx.send(DeltaDiscoveryRequest { type_url: t.into(), ..Default::default() }).await.unwrap();
        responses.message().await.unwrap().unwrap();
    }
    for round in 0..5 {
        let mut s = Snapshot::new();
        s.set(type_url::LISTENER, round.to_string(), vec![(format!("l{round}"), any(type_url::LISTENER))]);
        s.set(type_url::CLUSTER, round.to_string(), vec![(format!("c{round}"), any(type_url::CLUSTER))]);
        ads.push(s);
        let first = responses.message().await.unwrap().unwrap();
        let second = responses.message().await.unwrap().unwrap();
        assert_eq!(
            (first.type_url.as_str(), second.type_url.as_str()),
            (type_url::CLUSTER, type_url::LISTENER),
            "round {round}"
        );
    }
}
