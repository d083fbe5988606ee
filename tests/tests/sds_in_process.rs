//! The SDS server, secret manager and CA client in one process: a gRPC client on the
//! SDS Unix socket plays Envoy, the tests' istiod CA plays istiod's (plaintext on
//! loopback).
//! The real-Envoy mutual-TLS and rotation tests are in tests/tests/sds.rs; these reach
//! what Envoy cannot show: request metadata, single-flight issuance, ACK silence, the
//! exact status of a refused stream, file swaps and each bad answer from the CA.

use std::{path::Path, sync::Arc, time::Duration};

use hyper_util::rt::TokioIo;
use prost::Message as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use weir_agent::{
    sidecar::controlplane::{self, AdsServer, AuthPolicy, Snapshot},
    sidecar::identity::{
        CaClient, KeyAlgorithm, KeyOptions, RotationPolicy, SdsServer, SecretManager, WorkloadIdentity,
        WorkloadSource, caclient::CaClientError, manager::CertFiles,
    },
    sidecar::metrics::{CSR, Metrics},
    sidecar::xds::UpstreamConfig,
};
use weir_proto::{
    envoy::{
        extensions::transport_sockets::tls::v3::{Secret, secret},
        service::{
            discovery::v3::{DiscoveryRequest, DiscoveryResponse},
            secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient,
        },
    },
    type_url,
};
use weir_tests::istiod_ca::{CaBehaviour, IstiodCa};

const WAIT: Duration = Duration::from_secs(15);
const TOKEN: &str = "sds-test-token";

struct Setup {
    ca: IstiodCa,
    metrics: Arc<Metrics>,
    manager: SecretManager,
    socket: std::path::PathBuf,
    dir: tempfile::TempDir,
    stop: CancellationToken,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn identity() -> WorkloadIdentity {
    WorkloadIdentity {
        trust_domain: "cluster.local".into(),
        namespace: "app".into(),
        service_account: "echo".into(),
    }
}

async fn ca_client(ca: &IstiodCa, dir: &Path, metrics: &Arc<Metrics>, stop: &CancellationToken) -> CaClient {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let ads = AdsServer::new(Snapshot::new(), AuthPolicy::default());
    tokio::spawn(controlplane::serve(listener, None, ads, Some(ca.clone()), stop.clone().cancelled_owned()));
    let token = dir.join("istio-token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let mut upstream = UpstreamConfig::plaintext(addr.to_string());
    upstream.token_path = Some(token);
    upstream.cluster_id = "east".into();
    upstream.headers = vec![("X-Tenant".into(), "blue".into())];
    CaClient::new(upstream, Duration::from_secs(3600), Some("clusterissuer".into()), metrics.clone())
}

async fn setup_with(source: impl FnOnce(CaClient) -> WorkloadSource, output: Option<&str>) -> Setup {
    let ca = IstiodCa::new("sds-test", Some(TOKEN)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let metrics = Arc::new(Metrics::new());
    let client = ca_client(&ca, dir.path(), &metrics, &stop).await;
    let exact = RotationPolicy { grace_ratio: 0.5, grace_ratio_jitter: 0.0 };
    let manager = SecretManager::new(
        source(client),
        exact,
        output.map(|o| dir.path().join(o)),
        Duration::from_millis(50),
        metrics.clone(),
    );
    tokio::spawn(manager.clone().run(stop.clone()));
    let socket = dir.path().join("sds").join("socket");
    let listener = weir_agent::sidecar::xds::uds::bind(&socket, None).unwrap();
    tokio::spawn(SdsServer::new(manager.clone()).serve(listener, stop.clone().cancelled_owned()));
    Setup { ca, metrics, manager, socket, dir, stop }
}

async fn setup() -> Setup {
    setup_with(
        |client| WorkloadSource::Ca {
            client,
            identity: identity(),
            keys: KeyOptions { algorithm: KeyAlgorithm::EcdsaP256, pkcs8: false },
        },
        None,
    )
    .await
}

async fn sds_client(socket: &Path) -> SecretDiscoveryServiceClient<tonic::transport::Channel> {
    let path = socket.to_path_buf();
    let channel = tonic::transport::Endpoint::from_static("http://sds.local")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .unwrap();
    SecretDiscoveryServiceClient::new(channel)
}

/// One SDS stream, as Envoy opens one per secret.
struct Stream {
    tx: mpsc::Sender<DiscoveryRequest>,
    rx: tonic::Streaming<DiscoveryResponse>,
}

impl Stream {
    async fn open(socket: &Path, names: &[&str]) -> Self {
        let (tx, rx) = mpsc::channel(8);
        tx.send(request(names, "", "")).await.unwrap();
        let rx = sds_client(socket).await.stream_secrets(ReceiverStream::new(rx)).await.unwrap().into_inner();
        Self { tx, rx }
    }

    async fn next(&mut self) -> Result<DiscoveryResponse, tonic::Status> {
        tokio::time::timeout(WAIT, self.rx.message())
            .await
            .expect("an SDS response in time")
            .map(|m| m.expect("stream open"))
    }

    async fn ack(&self, names: &[&str], r: &DiscoveryResponse) {
        self.tx.send(request(names, &r.version_info, &r.nonce)).await.unwrap();
    }
}

fn request(names: &[&str], version: &str, nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        type_url: type_url::SECRET.into(),
        resource_names: names.iter().map(|s| s.to_string()).collect(),
        version_info: version.into(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

fn secrets(r: &DiscoveryResponse) -> Vec<Secret> {
    assert_eq!(r.type_url, type_url::SECRET);
    r.resources
        .iter()
        .map(|a| {
            assert_eq!(a.type_url, type_url::SECRET);
            Secret::decode(a.value.as_slice()).unwrap()
        })
        .collect()
}

fn inline(ds: &Option<weir_proto::envoy::config::core::v3::DataSource>) -> String {
    use weir_proto::envoy::config::core::v3::data_source::Specifier;
    match ds.as_ref().and_then(|d| d.specifier.as_ref()) {
        Some(Specifier::InlineBytes(b)) => String::from_utf8(b.clone()).unwrap(),
        other => panic!("not inline bytes: {other:?}"),
    }
}

/// (chain, key) of a tls_certificate secret.
fn key_cert(s: &Secret) -> (String, String) {
    match &s.r#type {
        Some(secret::Type::TlsCertificate(t)) => (inline(&t.certificate_chain), inline(&t.private_key)),
        other => panic!("not a tls_certificate: {other:?}"),
    }
}

fn trusted_ca(s: &Secret) -> String {
    match &s.r#type {
        Some(secret::Type::ValidationContext(v)) => inline(&v.trusted_ca),
        other => panic!("not a validation_context: {other:?}"),
    }
}

fn leaf_serial_and_uri(chain: &str) -> (String, String) {
    let (_, pem) = x509_parser::pem::parse_x509_pem(chain.as_bytes()).unwrap();
    let cert = pem.parse_x509().unwrap();
    let san = cert.subject_alternative_name().unwrap().unwrap();
    let uri = san
        .value
        .general_names
        .iter()
        .find_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) => Some(u.to_string()),
            _ => None,
        })
        .unwrap();
    (cert.raw_serial_as_string(), uri)
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn default_and_rootca_come_from_one_csr_with_istios_request_metadata() {
    let s = setup().await;
    // Two streams at once, as Envoy opens them for a cluster's default + ROOTCA.
    let (mut a, mut b) =
        tokio::join!(Stream::open(&s.socket, &["default"]), Stream::open(&s.socket, &["ROOTCA"]));
    let (ra, rb) = (a.next().await.unwrap(), b.next().await.unwrap());
    let (chain, key) = key_cert(&secrets(&ra)[0]);
    assert_eq!(secrets(&ra)[0].name, "default");
    assert!(key.starts_with("-----BEGIN EC PRIVATE KEY-----"), "SEC1 by default for ECDSA");
    let (_, uri) = leaf_serial_and_uri(&chain);
    assert_eq!(uri, "spiffe://cluster.local/ns/app/sa/echo");
    assert!(chain.ends_with(&format!("{}\n", s.ca.root_pem().trim_end())), "chain ends in the root");
    assert_eq!(trusted_ca(&secrets(&rb)[0]).trim_end(), s.ca.root_pem().trim_end());
    assert_ne!(ra.nonce, rb.nonce);
    assert_ne!(ra.version_info, rb.version_info);

    let requests = s.ca.requests();
    assert_eq!(requests.len(), 1, "concurrent requests share one CSR: {requests:?}");
    let r = &requests[0];
    assert_eq!(r.authorization.as_deref(), Some(format!("Bearer {TOKEN}").as_str()));
    assert_eq!(r.validity_seconds, 3600);
    assert_eq!(r.uri_sans, ["spiffe://cluster.local/ns/app/sa/echo"]);
    assert_eq!(r.cert_signer.as_deref(), Some("clusterissuer"));
    let text = s.metrics.encode();
    assert!(text.contains("istio_agent_num_outgoing_requests_total{request_type=\"csr\"} 1"), "{text}");
    assert!(text.contains("istio_agent_cert_expiry_seconds{resource_name=\"default\"} 3"), "{text}");

    // An ACK gets no answer; the stream stays open.
    a.ack(&["default"], &ra).await;
    assert!(tokio::time::timeout(Duration::from_millis(500), a.rx.message()).await.is_err(), "ACK answered");
}

#[tokio::test]
async fn short_certificates_rotate_and_a_new_root_is_pushed() {
    let s = setup().await;
    s.ca.force_lifetime(Some(Duration::from_secs(2)));
    let mut d = Stream::open(&s.socket, &["default"]).await;
    let mut r = Stream::open(&s.socket, &["ROOTCA"]).await;
    let first = d.next().await.unwrap();
    let root = r.next().await.unwrap();
    d.ack(&["default"], &first).await;
    r.ack(&["ROOTCA"], &root).await;
    let serial = |resp: &DiscoveryResponse| leaf_serial_and_uri(&key_cert(&secrets(resp)[0]).0).0;

    // At half the 2 s lifetime the agent renews and pushes on the open stream.
    let second = d.next().await.unwrap();
    assert_ne!(serial(&first), serial(&second));
    assert_ne!(key_cert(&secrets(&first)[0]).1, key_cert(&secrets(&second)[0]).1, "a new key each time");
    d.ack(&["default"], &second).await;

    s.ca.rotate_root().unwrap();
    let new_root = r.next().await.unwrap();
    assert_eq!(trusted_ca(&secrets(&new_root)[0]).trim_end(), s.ca.root_pem().trim_end());
    assert_ne!(trusted_ca(&secrets(&new_root)[0]), trusted_ca(&secrets(&root)[0]));
}

#[tokio::test]
async fn a_ca_outage_at_rotation_keeps_the_valid_certificate_and_recovers() {
    let s = setup().await;
    s.ca.force_lifetime(Some(Duration::from_secs(6)));
    let mut d = Stream::open(&s.socket, &["default"]).await;
    let first = d.next().await.unwrap();
    d.ack(&["default"], &first).await;
    let held = s.manager.workload().unwrap();
    s.ca.set_behaviour(CaBehaviour::Fail(tonic::Code::Unavailable, "istiod is restarting".into()));
    let failed = || s.metrics.num_failed_outgoing_requests.get_or_create(&CSR).get();
    // Rotation is due at ~3 s; three attempts per issuance, so ≥ 3 failures.
    eventually("failed CSRs at rotation time", || failed() >= 3).await;
    assert_eq!(s.manager.workload().unwrap().leaf.serial, held.leaf.serial, "still serving the valid cert");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), d.rx.message()).await.is_err(),
        "nothing pushed"
    );

    // Every retry sends the same CSR: the key is made once per rotation, not per
    // attempt (an RSA key costs hundreds of milliseconds of CPU).
    let csrs: Vec<String> = s.ca.requests().into_iter().map(|r| r.csr).collect();
    assert!(csrs.len() >= 4, "{}", csrs.len());
    assert!(csrs[1..].iter().all(|c| *c == csrs[1]), "one CSR for every failed attempt");
    assert_ne!(csrs[0], csrs[1], "a rotation makes a new key");

    s.ca.set_behaviour(CaBehaviour::Sign);
    let renewed = d.next().await.unwrap();
    let (chain, _) = key_cert(&secrets(&renewed)[0]);
    assert_ne!(leaf_serial_and_uri(&chain).0.replace(':', "").to_lowercase(), held.leaf.serial);
}

/// The CA answering garbage when rotation is due (a broken istiod rollout): the valid
/// certificate stays in service, nothing is pushed, the CA is asked again, and the
/// first good answer is pushed.
#[tokio::test]
async fn garbage_from_the_ca_at_rotation_keeps_the_valid_certificate_and_recovers() {
    let s = setup().await;
    s.ca.force_lifetime(Some(Duration::from_secs(6)));
    let mut d = Stream::open(&s.socket, &["default"]).await;
    let first = d.next().await.unwrap();
    d.ack(&["default"], &first).await;
    let held = s.manager.workload().unwrap();
    let asked = s.ca.requests().len();
    s.ca.set_behaviour(CaBehaviour::Garbage);
    // Rotation is due at ~3 s; the garbage is refused, and the CA is asked again.
    eventually("two garbage answers at rotation time", || s.ca.requests().len() >= asked + 2).await;
    assert_eq!(s.manager.workload().unwrap().leaf.serial, held.leaf.serial, "still serving the valid cert");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), d.rx.message()).await.is_err(),
        "nothing pushed"
    );
    s.ca.set_behaviour(CaBehaviour::Sign);
    let renewed = d.next().await.unwrap();
    let (chain, _) = key_cert(&secrets(&renewed)[0]);
    assert_ne!(leaf_serial_and_uri(&chain).0.replace(':', "").to_lowercase(), held.leaf.serial);
}

#[tokio::test]
async fn bad_answers_from_the_ca_are_refused_with_the_reason() {
    let s = setup().await;
    let client = ca_client(&s.ca, s.dir.path(), &s.metrics, &s.stop).await;
    let key = weir_agent::sidecar::identity::keys::generate(&identity(), &KeyOptions::default()).unwrap();
    let sign = || client.sign(&key.csr_pem, &key.public_key_der);
    sign().await.expect("a good CA answer is accepted");

    let cases: [(CaBehaviour, &str); 4] = [
        (CaBehaviour::LeafOnly, "1 certificate(s)"),
        (CaBehaviour::Garbage, "not PEM"),
        (CaBehaviour::ExpiredRoot, "(the root) expired"),
        (CaBehaviour::Fail(tonic::Code::PermissionDenied, "no such signer".into()), "no such signer"),
    ];
    for (behaviour, needle) in cases {
        s.ca.set_behaviour(behaviour.clone());
        let e = sign().await.unwrap_err();
        let text = weir_agent::error_chain(&e);
        assert!(text.contains(needle) && text.contains("CA at 127.0.0.1"), "{behaviour:?}: {text}");
        assert!(!e.is_transient(), "{behaviour:?}");
    }
    s.ca.set_behaviour(CaBehaviour::Sign);

    // The token is read on every call: missing, empty, wrong.
    let token = s.dir.path().join("istio-token");
    std::fs::write(&token, "").unwrap();
    let e = weir_agent::error_chain(&sign().await.unwrap_err());
    assert!(e.contains("istio-token") && e.contains("empty"), "{e}");
    std::fs::remove_file(&token).unwrap();
    let e = weir_agent::error_chain(&sign().await.unwrap_err());
    assert!(e.contains("cannot read the istiod token") && e.contains("istio-token"), "{e}");
    std::fs::write(&token, "stolen").unwrap();
    let e = sign().await.unwrap_err();
    assert!(matches!(e, CaClientError::Status { code: tonic::Code::Unauthenticated, .. }), "{e}");

    // A CSR for a different key than the one held is refused too.
    std::fs::write(&token, TOKEN).unwrap();
    let other = weir_agent::sidecar::identity::keys::generate(&identity(), &KeyOptions::default()).unwrap();
    let e = client.sign(&key.csr_pem, &other.public_key_der).await.unwrap_err();
    assert!(weir_agent::error_chain(&e).contains("different key"), "{e}");
}

#[tokio::test]
async fn unknown_names_and_unimplemented_rpcs_end_cleanly() {
    let s = setup().await;
    let mut bad = Stream::open(&s.socket, &["kubernetes://my-secret"]).await;
    let status = bad.next().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("\"kubernetes://my-secret\"") && status.message().contains("ROOTCA"),
        "{status:?}"
    );
    let mut missing = Stream::open(&s.socket, &["file-root:/nonexistent/root.pem"]).await;
    let status = missing.next().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(status.message().contains("/nonexistent/root.pem"), "{status:?}");

    let mut client = sds_client(&s.socket).await;
    let e = client.fetch_secrets(request(&["default"], "", "")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented);
    let e = client.delta_secrets(tokio_stream::iter(vec![])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented);

    // The server is still fine for everyone else.
    let mut good = Stream::open(&s.socket, &["default"]).await;
    good.next().await.unwrap();
}

/// Kubernetes updates a mounted secret by writing a new timestamped directory and
/// swapping the `..data` symlink; the files are symlinks through it.
fn kube_publish(dir: &Path, generation: u32, files: &[(&str, &str)]) {
    let data = dir.join(format!("..2026_11_22_{generation}"));
    std::fs::create_dir_all(&data).unwrap();
    for (name, text) in files {
        std::fs::write(data.join(name), text).unwrap();
    }
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(data.file_name().unwrap(), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    for (name, _) in files {
        let link = dir.join(name);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(Path::new("..data").join(name), &link).unwrap();
        }
    }
}

fn self_signed(name: &str) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec![name.into()]).unwrap().self_signed(&key).unwrap();
    (cert.pem(), key.serialize_pem())
}

#[tokio::test]
async fn mounted_files_are_served_and_pushed_when_kubernetes_swaps_them() {
    let mount_dir = tempfile::tempdir().unwrap();
    let mount = mount_dir.path().to_path_buf();
    let (cert1, key1) = self_signed("one");
    kube_publish(&mount, 1, &[("cert-chain.pem", &cert1), ("key.pem", &key1), ("root-cert.pem", &cert1)]);
    let files = CertFiles::in_dir(&mount);
    let s = setup_with(|_| WorkloadSource::Files(files), None).await;
    let mut d = Stream::open(&s.socket, &["default"]).await;
    let mut fc = Stream::open(
        &s.socket,
        &[&format!(
            "file-cert:{}~{}",
            mount.join("cert-chain.pem").display(),
            mount.join("key.pem").display()
        )],
    )
    .await;
    let first = d.next().await.unwrap();
    assert_eq!(key_cert(&secrets(&first)[0]), (cert1.clone(), key1.clone()));
    let f1 = fc.next().await.unwrap();
    d.ack(&["default"], &first).await;
    fc.ack(&[&secrets(&f1)[0].name], &f1).await;
    assert!(s.ca.requests().is_empty(), "mounted certificates: no CA calls");

    let (cert2, key2) = self_signed("two");
    kube_publish(&mount, 2, &[("cert-chain.pem", &cert2), ("key.pem", &key2), ("root-cert.pem", &cert2)]);
    let pushed = d.next().await.unwrap();
    assert_eq!(key_cert(&secrets(&pushed)[0]), (cert2.clone(), key2.clone()));
    assert_eq!(key_cert(&secrets(&fc.next().await.unwrap())[0]).0, cert2);

    // A garbage certificate file ends the stream with the file's name.
    let mut r = Stream::open(&s.socket, &[&format!("file-root:{}", mount.join("bad.pem").display())]).await;
    std::fs::write(mount.join("bad.pem"), "-----BEGIN CERTIFICATE-----\nnot base64\n").unwrap();
    let status = r.next().await.unwrap_err();
    assert!(status.message().contains("bad.pem"), "{status:?}");
}

#[tokio::test]
async fn output_certs_writes_the_key_owner_only() {
    use std::os::unix::fs::PermissionsExt as _;
    let s = setup_with(
        |client| WorkloadSource::Ca {
            client,
            identity: identity(),
            keys: KeyOptions { algorithm: KeyAlgorithm::Rsa(2048), pkcs8: true },
        },
        Some("out"),
    )
    .await;
    let mut d = Stream::open(&s.socket, &["default"]).await;
    let (chain, key) = key_cert(&secrets(&d.next().await.unwrap())[0]);
    assert!(key.starts_with("-----BEGIN PRIVATE KEY-----"), "PKCS8_KEY");
    let out = s.dir.path().join("out");
    assert_eq!(std::fs::read_to_string(out.join("key.pem")).unwrap(), key);
    assert_eq!(std::fs::read_to_string(out.join("cert-chain.pem")).unwrap(), chain);
    assert_eq!(std::fs::metadata(out.join("key.pem")).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(
        std::fs::read_to_string(out.join("root-cert.pem")).unwrap().trim_end(),
        s.ca.root_pem().trim_end()
    );
}

/// `OUTPUT_CERTS` on a full disk: Envoy is still served its certificate (as
/// pilot-agent logs and carries on), no partial file (a piece of a private key) is
/// left, and once there is space the next rotation writes the whole set.
#[tokio::test]
async fn a_full_disk_under_output_certs_costs_envoy_nothing_and_leaves_no_partial_file() {
    weir_tests::require_root!();
    let s = setup_with(
        |client| WorkloadSource::Ca {
            client,
            identity: identity(),
            keys: KeyOptions { algorithm: KeyAlgorithm::EcdsaP256, pkcs8: false },
        },
        Some("out"),
    )
    .await;
    s.ca.force_lifetime(Some(Duration::from_secs(6)));
    let out = s.dir.path().join("out");
    let _tmpfs = weir_tests::full_disk::Tmpfs::mount(&out, "size=64k");
    let filler = weir_tests::full_disk::fill(&out);
    let listing = || {
        let mut names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };

    let mut d = Stream::open(&s.socket, &["default"]).await;
    let first = d.next().await.expect("the certificate is served although the files cannot be written");
    let (chain, _) = key_cert(&secrets(&first)[0]);
    assert!(chain.contains("BEGIN CERTIFICATE"));
    d.ack(&["default"], &first).await;
    assert_eq!(listing(), ["filler"], "nothing written, nothing partial");

    std::fs::remove_file(&filler).unwrap();
    let renewed = d.next().await.expect("the rotation after the disk has space");
    let (chain, key) = key_cert(&secrets(&renewed)[0]);
    eventually("the whole set written", || listing() == ["cert-chain.pem", "key.pem", "root-cert.pem"]).await;
    assert_eq!(std::fs::read_to_string(out.join("key.pem")).unwrap(), key);
    assert_eq!(std::fs::read_to_string(out.join("cert-chain.pem")).unwrap(), chain);
}

/// The agent's shape for the file tests: mounted workload certificates, the manager,
/// its SDS server and a status server on a runtime of two workers as the agent's, apart
/// from the test's (a worker the agent loses to a blocking read shows as a timeout
/// here, not as a hung test).
struct TwoWorkers {
    runtime: Option<tokio::runtime::Runtime>,
    socket: std::path::PathBuf,
    status: std::net::SocketAddr,
    metrics: Arc<Metrics>,
    mount: tempfile::TempDir,
    _dir: tempfile::TempDir,
    stop: CancellationToken,
}

impl TwoWorkers {
    fn start() -> Self {
        use weir_agent::{
            sidecar::envoy::{LifecycleControl, Readiness},
            sidecar::status::{AppProber, AppProbers, MetricsMerge, StatusServer},
        };
        let mount = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed("mounted");
        kube_publish(
            mount.path(),
            1,
            &[("cert-chain.pem", &cert), ("key.pem", &key), ("root-cert.pem", &cert)],
        );
        let dir = tempfile::tempdir().unwrap();
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (metrics, stop) = (Arc::new(Metrics::new()), CancellationToken::new());
        let socket = dir.path().join("sds").join("socket");
        let files = CertFiles::in_dir(mount.path());
        let manager = SecretManager::new(
            WorkloadSource::Files(files),
            RotationPolicy::default(),
            None,
            Duration::from_millis(50),
            metrics.clone(),
        );
        let merge = MetricsMerge::new(metrics.clone(), None, Vec::new());
        let status = StatusServer::new(
            None,
            Arc::new(Readiness::new(None)),
            LifecycleControl::new(None, false),
            merge,
            AppProber::new(AppProbers::default(), std::net::Ipv4Addr::LOCALHOST.into()),
        );
        // Set up on the agent's runtime (the test's own is the caller's: no block_on).
        let (ready, port) = std::sync::mpsc::channel();
        let (sds, shutdown) = (socket.clone(), stop.clone());
        runtime.spawn(async move {
            tokio::spawn(manager.clone().run(shutdown.clone()));
            let listener = weir_agent::sidecar::xds::uds::bind(&sds, None).unwrap();
            tokio::spawn(SdsServer::new(manager).serve(listener, shutdown.cancelled_owned()));
            let listener = StatusServer::bind(0).await.unwrap();
            let _ = ready.send(listener.local_addr().unwrap().port());
            status.serve(listener).await;
        });
        let port = port.recv().unwrap();
        let status = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        Self { runtime: Some(runtime), socket, status, metrics, mount, _dir: dir, stop }
    }

    /// `default` is still served and the status port still answers.
    async fn still_answers(&self) {
        let check = async {
            let mut d = Stream::open(&self.socket, &["default"]).await;
            assert_eq!(secrets(&d.next().await.unwrap())[0].name, "default");
            let (status, metrics) = weir_tests::http::get(self.status, "/stats/prometheus").await.unwrap();
            assert!(status == 200 && metrics.contains("istio_agent_"), "{status} {metrics}");
        };
        tokio::time::timeout(WAIT, check).await.expect("the agent answers SDS and status in time");
    }

    /// The status a stream for `name` ends with.
    async fn refused(&self, name: &str) -> tonic::Status {
        let refused = async {
            match Stream::open(&self.socket, &[name]).await.next().await {
                Ok(served) => panic!("{name} was served ({} resources)", served.resources.len()),
                Err(status) => status,
            }
        };
        tokio::time::timeout(WAIT, refused).await.unwrap_or_else(|_| panic!("no answer for {name} in time"))
    }
}

impl Drop for TwoWorkers {
    fn drop(&mut self) {
        self.stop.cancel();
        // A worker blocked for good (by a file read on it) would hang the runtime's drop.
        std::mem::forget(self.runtime.take());
    }
}

/// Reading `/dev/zero` would never end; a runaway allocation in this test's process is
/// capped (4 GiB of address space) so a failure here cannot take the machine's memory.
fn cap_memory() {
    let limit = libc::rlimit { rlim_cur: 4 << 30, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: setrlimit on this process with a valid struct.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0);
}

fn assert_named(status: &tonic::Status, path: &str, says: &str) {
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains(path) && status.message().contains(says), "{status:?}");
}

#[tokio::test]
async fn a_fifo_is_refused_by_name_and_blocks_nothing() {
    let agent = TwoWorkers::start();
    // Two of them: one per worker of the agent's runtime.
    for name in ["one.fifo", "two.fifo"] {
        let fifo = agent.mount.path().join(name);
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let status = agent.refused(&format!("file-root:{}", fifo.display())).await;
        assert_named(&status, &fifo.display().to_string(), "a FIFO, not a regular file");
    }
    agent.still_answers().await;
}

#[tokio::test]
async fn dev_zero_is_refused_by_name() {
    cap_memory();
    let agent = TwoWorkers::start();
    let status = agent.refused("file-root:/dev/zero").await;
    assert_named(&status, "/dev/zero", "a device, not a regular file");
    let key = agent.mount.path().join("key.pem");
    let status = agent.refused(&format!("file-cert:/dev/zero~{}", key.display())).await;
    assert_named(&status, "/dev/zero", "a device");
    agent.still_answers().await;
}

#[tokio::test]
async fn an_oversized_file_is_refused_by_name() {
    let agent = TwoWorkers::start();
    let big = agent.mount.path().join("big.pem");
    let (cert, _) = self_signed("big");
    std::fs::write(&big, cert.repeat((2 << 20) / cert.len() + 1)).unwrap();
    let status = agent.refused(&format!("file-root:{}", big.display())).await;
    assert_named(&status, &big.display().to_string(), "larger than 1048576 bytes");
    agent.still_answers().await;
}

/// A watched file that turns into something else (here a symlink to `/dev/zero`, as a
/// mounted volume could) is checked by its metadata and refused, not read forever.
#[tokio::test]
async fn a_watched_file_that_becomes_a_device_is_refused_on_the_next_push() {
    cap_memory();
    let agent = TwoWorkers::start();
    let (cert, _) = self_signed("watched");
    let root = agent.mount.path().join("extra-root.pem");
    std::fs::write(&root, &cert).unwrap();
    let name = format!("file-root:{}", root.display());
    let mut stream = Stream::open(&agent.socket, &[&name]).await;
    let first = stream.next().await.unwrap();
    stream.ack(&[&name], &first).await;
    std::fs::remove_file(&root).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &root).unwrap();
    let status = match tokio::time::timeout(WAIT, stream.next()).await.expect("a push in time") {
        Ok(served) => panic!("{name} was served again ({} resources)", served.resources.len()),
        Err(status) => status,
    };
    assert_named(&status, &root.display().to_string(), "a device");
    agent.still_answers().await;
}

/// Names come from istiod (any DestinationRule): the watch list holds only the names a
/// stream still asks for, so it cannot grow without bound.
#[tokio::test]
async fn a_file_resource_no_stream_asks_for_is_no_longer_watched() {
    let agent = TwoWorkers::start();
    let dir = agent.mount.path();
    let name =
        format!("file-cert:{}~{}", dir.join("cert-chain.pem").display(), dir.join("key.pem").display());
    let gauge = format!("istio_agent_cert_expiry_seconds{{resource_name=\"{name}\"}}");
    let mut stream = Stream::open(&agent.socket, &[&name]).await;
    stream.next().await.unwrap();
    assert!(agent.metrics.encode().contains(&gauge), "served and reported");
    drop(stream);
    eventually("the resource to be dropped", || !agent.metrics.encode().contains(&gauge)).await;
}
