//! Standalone mode's embedded control plane, in a pod: it serves the services file's
//! view for its workload, follows edits to the file (keeping the last good one when an
//! edit is broken), and keeps its mesh CA across restarts in the state directory. Its
//! xDS and CA answer only the agent itself (a token it makes and keeps): anything else
//! on 127.0.0.1:15010 is refused, and even the agent's CA signs only the workload's own
//! identity for at most its TTL. The whole path with real Envoys and traffic is the
//! demo's test (tests/demo.rs).

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tonic::transport::Endpoint;
use weir_agent::{
    sidecar::controlplane::SigningPolicy,
    sidecar::identity::WorkloadIdentity,
    sidecar::standalone::{EMBEDDED_ADDRESS, StandaloneSettings, start},
};
use weir_proto::{
    envoy::service::discovery::v3::{
        DiscoveryRequest, aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
    },
    istio::v1::auth::{
        IstioCertificateRequest, istio_certificate_service_client::IstioCertificateServiceClient,
    },
    type_url,
};
use weir_tests::{
    Mesh,
    control_plane::eventually,
    envoy::tempfile_dir::Dir,
    require_root,
    sidecar::{AgentProcess, SidecarRoot},
    test_name, tools,
};

fn file(services: &[(&str, &str)]) -> String {
    let mut out = String::from("services:\n");
    for (name, ip) in services {
        out.push_str(&format!(
            "- name: {name}\n  address: {ip}\n  port: 8080\n  endpoints: [\"{ip}:8080\"]\n"
        ));
    }
    out
}

fn signing(ttl: Duration) -> SigningPolicy {
    let app = WorkloadIdentity {
        trust_domain: "cluster.local".into(),
        namespace: "default".into(),
        service_account: "app".into(),
    };
    SigningPolicy::new(&app, ttl)
}

#[test]
fn the_embedded_control_plane_follows_its_file_and_keeps_its_ca() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    let dir = Dir::new("standalone").unwrap();
    let settings =
        StandaloneSettings { services: dir.path().join("mesh.yaml"), state_dir: dir.path().join("ca") };
    let ip = pod.ipv4();
    std::fs::write(&settings.services, file(&[("server", &ip.to_string())])).unwrap();
    pod.run(|| async {
        let stop = CancellationToken::new();
        let cp = start(
            &settings,
            Some(ip.into()),
            signing(Duration::from_secs(24 * 3600)),
            "t".into(),
            stop.clone(),
        )
        .await
        .unwrap();
        let root = cp.ca.root_pem();
        let snapshot = cp.ads.snapshot();
        let listeners: Vec<&String> = snapshot.get(type_url::LISTENER).unwrap().resources.keys().collect();
        assert_eq!(listeners, ["virtualInbound", "virtualOutbound"], "this workload serves `server`");

        // An edit is pushed as a new version.
        std::fs::write(&settings.services, file(&[("server", &ip.to_string()), ("other", "10.66.0.99")]))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while cp.ads.snapshot().version(type_url::CLUSTER) != "2" {
            assert!(Instant::now() < deadline, "the edit was not pushed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let clusters = cp.ads.snapshot();
        assert!(
            clusters
                .get(type_url::CLUSTER)
                .unwrap()
                .resources
                .contains_key("outbound|8080||other.default.svc.cluster.local")
        );
        // A broken edit keeps the last good config.
        std::fs::write(&settings.services, "services: [oops").unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(cp.ads.snapshot().version(type_url::CLUSTER), "2");

        stop.cancel();
        let _ = cp.task.await;
        // A restart keeps the mesh CA (and the port is free again).
        std::fs::write(&settings.services, file(&[("server", &ip.to_string())])).unwrap();
        let stop = CancellationToken::new();
        let again = start(
            &settings,
            Some(ip.into()),
            signing(Duration::from_secs(24 * 3600)),
            "t".into(),
            stop.clone(),
        )
        .await
        .unwrap();
        assert_eq!(again.ca.root_pem(), root, "the mesh CA lives in the state directory");
        stop.cancel();
        let _ = again.task.await;
    })
    .unwrap();
}

/// A CSR for `uri` (a fresh P-256 key).
fn csr(uri: &str) -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names = vec![rcgen::SanType::URI(uri.try_into().unwrap())];
    params.serialize_request(&key).unwrap().pem().unwrap()
}

/// The real agent in standalone mode (`--discovery-address embedded`) for
/// `default/app` gets its certificate from its own CA; another process in its pod
/// (or any local user) asking 127.0.0.1:15010 for a certificate or for xDS is refused:
/// it does not hold the agent's credential.
#[test]
fn the_embedded_control_plane_answers_only_its_own_agent() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    let dir = Dir::new("standalone-ca").unwrap();
    let services = dir.path().join("mesh.yaml");
    let ip = pod.ipv4().to_string();
    std::fs::write(&services, file(&[("server", "10.66.0.99")])).unwrap();
    let state = dir.path().join("ca");
    let root = SidecarRoot::new("", "").unwrap();
    let args = [
        "proxy",
        "sidecar",
        "--discovery-address",
        "embedded",
        "--mesh-services",
        services.to_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
    ];
    let env = [
        ("WEIR_ENVOY_MODE", "external"),
        ("POD_NAME", "app"),
        ("POD_NAMESPACE", "default"),
        ("SERVICE_ACCOUNT", "app"),
        ("INSTANCE_IP", ip.as_str()),
        ("SECRET_TTL", "1h"),
    ];
    let mut agent =
        AgentProcess::launch(&pod, &root, tools::weir_command(), &args, &env, None, None).unwrap();
    let issued = eventually(Duration::from_secs(20), || {
        agent.log().contains("generated new workload certificate").then_some(())
    });
    assert!(issued.is_some(), "the agent got no certificate from its own CA:\n{}", agent.log());

    let own = "spiffe://cluster.local/ns/default/sa/app";
    let (certificate, xds) = pod
        .run(|| async move {
            let channel = Endpoint::from_shared(format!("http://{EMBEDDED_ADDRESS}"))?.connect().await?;
            let request = IstioCertificateRequest { csr: csr(own), validity_duration: 600, metadata: None };
            let certificate = IstioCertificateServiceClient::new(channel.clone())
                .create_certificate(request)
                .await
                .map(|r| r.into_inner().cert_chain);
            let lds = DiscoveryRequest { type_url: type_url::LISTENER.into(), ..Default::default() };
            let xds = match AggregatedDiscoveryServiceClient::new(channel)
                .stream_aggregated_resources(tokio_stream::iter(vec![lds]))
                .await
            {
                Err(status) => Err(status),
                Ok(stream) => stream.into_inner().message().await.map(|m| m.map(|r| r.resources.len())),
            };
            anyhow::Ok((certificate, xds))
        })
        .unwrap()
        .unwrap();
    let refused = certificate.expect_err("a certificate for a caller without the agent's credential");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    let refused = xds.expect_err("xDS for a caller without the agent's credential");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    assert!(agent.log().contains("CSR refused"), "the refusal is logged:\n{}", agent.log());
    assert!(agent.terminate().unwrap().success(), "{}", agent.log());
}

/// The CA, for a caller with the credential: another identity is refused by name; its
/// own for ten years is signed for the TTL.
#[test]
fn the_embedded_ca_signs_only_the_workloads_own_identity_for_at_most_its_ttl() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    let dir = Dir::new("standalone-policy").unwrap();
    let settings =
        StandaloneSettings { services: dir.path().join("mesh.yaml"), state_dir: dir.path().join("ca") };
    std::fs::write(&settings.services, file(&[("server", "10.66.0.99")])).unwrap();
    let own = "spiffe://cluster.local/ns/default/sa/app";
    let other = "spiffe://cluster.local/ns/default/sa/payments";
    let answers = pod
        .run(|| async {
            let stop = CancellationToken::new();
            let token = weir_agent::sidecar::standalone::new_token();
            let cp = start(&settings, None, signing(Duration::from_secs(3600)), token.clone(), stop.clone())
                .await?;
            let channel = Endpoint::from_shared(format!("http://{EMBEDDED_ADDRESS}"))?.connect().await?;
            let mut ca = IstioCertificateServiceClient::new(channel);
            let mut out = Vec::new();
            for (uri, seconds) in [(other, 600), (own, 10 * 365 * 86_400)] {
                let mut request = tonic::Request::new(IstioCertificateRequest {
                    csr: csr(uri),
                    validity_duration: seconds,
                    metadata: None,
                });
                let (name, value) = weir_agent::sidecar::standalone::credential(&token);
                request
                    .metadata_mut()
                    .insert(tonic::metadata::MetadataKey::from_bytes(name.as_bytes())?, value.parse()?);
                out.push(ca.create_certificate(request).await.map(|r| r.into_inner().cert_chain));
            }
            stop.cancel();
            let _ = cp.task.await;
            anyhow::Ok(out)
        })
        .unwrap()
        .unwrap();

    let refused = answers[0].as_ref().expect_err("a certificate for another identity");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains(other) && refused.message().contains(own), "{refused:?}");
    let chain = answers[1].as_ref().unwrap_or_else(|e| panic!("its own identity was refused: {e:?}"));
    let (_, pem) = x509_parser::pem::parse_x509_pem(chain[0].as_bytes()).unwrap();
    let leaf = pem.parse_x509().unwrap();
    let lifetime = leaf.validity().not_after.timestamp() - leaf.validity().not_before.timestamp();
    assert_eq!(
        lifetime,
        3600 + 60,
        "ten years asked, a TTL of one hour given (plus a minute of back-dating)"
    );
    assert!(format!("{:?}", leaf.subject_alternative_name().unwrap().unwrap().value).contains(own));
}
