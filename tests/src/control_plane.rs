//! The relay's upstream in tests: Weir's own ADS server (`weir_agent::sidecar::controlplane`)
//! standing in for istiod in an "istiod" pod, behind TLS from a test CA, with istiod's
//! token and `ClusterID` checks, and istiod's CA (`IstiodCa`) on the same port when a
//! test asks for it. It can be stopped and started again on the same address, and its
//! request log is what tests assert on.

use std::{
    net::SocketAddr,
    sync::mpsc,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, anyhow};
use tokio_util::sync::CancellationToken;
use weir_agent::sidecar::controlplane::{AdsServer, ServerTls, Snapshot};

use crate::{
    Pod,
    istiod_ca::IstiodCa,
    request_log::{RecordedRequest, RecordedStream, RequestLog},
};

/// The SAN istiod's serving certificate carries (and Weir checks by default).
pub const ISTIOD_SAN: &str = "istiod.istio-system.svc";
/// istiod's secure xDS port.
pub const XDS_PORT: u16 = 15012;
/// The token the control plane accepts.
pub const TOKEN: &str = "weir-test-token";
/// The cluster the control plane serves.
pub const CLUSTER_ID: &str = "Kubernetes";

/// A self-signed CA for tests, and certificates it signs.
pub struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    root_pem: String,
}

impl TestCa {
    pub fn new(name: &str) -> anyhow::Result<Self> {
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::OrganizationName, name);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key)?;
        let root_pem = cert.pem();
        Ok(Self { issuer: rcgen::Issuer::new(params, key), root_pem })
    }

    pub fn root_pem(&self) -> &str {
        &self.root_pem
    }

    /// A serving certificate for `dns_names`: (chain PEM, key PEM).
    pub fn server_cert(&self, dns_names: &[&str]) -> anyhow::Result<(String, String)> {
        let key = rcgen::KeyPair::generate()?;
        let names: Vec<String> = dns_names.iter().map(|s| s.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(names)?;
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

/// A workload certificate a [`TestCa`] issued.
pub struct WorkloadCert {
    pub chain_pem: String,
    pub key_pem: String,
    /// Its serial number in lowercase hex, as Envoy's `/certs` prints it.
    pub serial_hex: String,
}

impl TestCa {
    /// A workload certificate for the SPIFFE ID `spiffe_id` (client and server auth),
    /// chained to this CA: what SPIRE or a mounted `istio.default` Secret holds.
    pub fn workload_cert(&self, spiffe_id: &str) -> anyhow::Result<WorkloadCert> {
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params.subject_alt_names = vec![rcgen::SanType::URI(rcgen::string::Ia5String::try_from(spiffe_id)?)];
        params.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages =
            vec![rcgen::KeyUsagePurpose::DigitalSignature, rcgen::KeyUsagePurpose::KeyEncipherment];
        // A first byte in 0x10..0x7f: no leading zero to drop, positive as DER wants.
        let mut serial: [u8; 8] = rand::random();
        serial[0] = 0x10 + serial[0] % 0x6f;
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(WorkloadCert {
            chain_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            serial_hex: serial.iter().map(|b| format!("{b:02x}")).collect(),
        })
    }
}

/// An ADS server running in a pod.
pub struct ControlPlane {
    pub ads: AdsServer,
    /// Every stream and request `ads` saw.
    pub log: RequestLog,
    /// istiod's CA on the same port, when the test asked for one.
    pub ca: Option<IstiodCa>,
    pub addr: SocketAddr,
    tls: Option<ServerTls>,
    netns: weir_agent::sandbox::NetNs,
    running: Option<(CancellationToken, JoinHandle<anyhow::Result<()>>)>,
}

impl ControlPlane {
    /// Serves `ads` on `addr` inside `pod`, over TLS when given. Returns once listening.
    pub fn start(
        pod: &Pod,
        addr: SocketAddr,
        ads: AdsServer,
        tls: Option<ServerTls>,
    ) -> anyhow::Result<Self> {
        let netns = weir_agent::sandbox::NetNs::open(pod.netns().path())?;
        let log = RequestLog::observing(&ads);
        let mut cp = Self { ads, log, ca: None, addr, tls, netns, running: None };
        cp.resume()?;
        Ok(cp)
    }

    /// The istiod stand-in: TLS with a certificate for [`ISTIOD_SAN`] from `ca`, token
    /// and cluster checks, on `pod`'s IPv4 address, port 15012.
    pub fn istiod(pod: &Pod, ca: &TestCa, ads: AdsServer) -> anyhow::Result<Self> {
        let (chain, key) = ca.server_cert(&[ISTIOD_SAN, &format!("{ISTIOD_SAN}.cluster.local")])?;
        let tls = ServerTls { cert_chain: chain.into_bytes(), key: key.into_bytes(), client_roots: None };
        Self::start(pod, SocketAddr::new(pod.ipv4().into(), XDS_PORT), ads, Some(tls))
    }

    /// Adds `ca` (served from the next [`ControlPlane::resume`], which this calls).
    pub fn with_ca(mut self, ca: IstiodCa) -> anyhow::Result<Self> {
        self.ca = Some(ca);
        self.resume()?;
        Ok(self)
    }

    /// Stops serving: open streams end with UNAVAILABLE, the port is closed.
    pub fn stop(&mut self) {
        if let Some((stop, thread)) = self.running.take() {
            stop.cancel();
            let _ = thread.join();
        }
    }

    /// Serves again on the same address (after [`ControlPlane::stop`]).
    pub fn resume(&mut self) -> anyhow::Result<()> {
        self.stop();
        let (ready_tx, ready_rx) = mpsc::channel();
        let stop = CancellationToken::new();
        let (ads, ca, tls, addr, cancelled) =
            (self.ads.clone(), self.ca.clone(), self.tls.clone(), self.addr, stop.clone());
        let thread = self.netns.spawn_thread(move || async move {
            let listener = match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => {
                    let _ = ready_tx.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(anyhow!("bind control plane on {addr}: {e}")));
                    return Ok(());
                }
            };
            weir_agent::sidecar::controlplane::serve(listener, tls, ads, ca, cancelled.cancelled_owned())
                .await
                .context("control plane")
        })?;
        ready_rx.recv_timeout(Duration::from_secs(10)).context("control plane did not start")??;
        self.running = Some((stop, thread));
        Ok(())
    }

    /// Waits (blocking) until `check` over the request and stream logs says `Some`.
    pub fn wait_for<T>(
        &self,
        timeout: Duration,
        check: impl FnMut(&[RecordedRequest], &[RecordedStream]) -> Option<T>,
    ) -> Option<T> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
        runtime.block_on(self.log.wait_for(timeout, check))
    }

    /// Changes the served snapshot with `f` and pushes the result to every stream.
    pub fn update(&self, f: impl FnOnce(&mut Snapshot)) {
        let mut next = (*self.ads.snapshot()).clone();
        f(&mut next);
        self.ads.push(next);
    }

    /// Waits for an ACK of `type_url` at `version` (SotW) on any stream.
    pub fn wait_for_ack(&self, type_url: &str, version: &str, timeout: Duration) -> bool {
        self.wait_for(timeout, |reqs, _| {
            reqs.iter()
                .any(|r| r.type_url == type_url && r.is_ack() && r.version_info == version)
                .then_some(())
        })
        .is_some()
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `count` static clusters (`filler-00000`, ...) pointing at `endpoint`, plus an EDS
/// cluster `hello`: the large CDS snapshot the relay tests and benchmark push.
pub fn filler_clusters(count: usize, endpoint: SocketAddr) -> Vec<(String, prost_types::Any)> {
    use weir_agent::sidecar::controlplane::resources;
    let mut clusters: Vec<(String, prost_types::Any)> = (0..count)
        .map(|i| {
            let name = format!("filler-{i:05}");
            let cluster = resources::static_cluster(&name, &[endpoint], Duration::from_secs(1));
            (name, cluster)
        })
        .collect();
    clusters.push(("hello".into(), resources::eds_cluster("hello", Duration::from_secs(1))));
    clusters
}

/// Polls `f` every 100 ms until it returns `Some` or `timeout` passes.
pub fn eventually<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
