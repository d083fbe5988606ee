//! TLS for every connection the agent opens as a client — istiod's xDS and CA, the
//! Kubernetes API, the STS token endpoint, Wasm module servers and registries, HTTPS
//! app probes: one rustls configuration ([`client_config`]: ring, TLS 1.2 and 1.3,
//! narrowed by `COMPLIANCE_POLICY` as pilot-agent's gRPC clients are:
//! [`Compliance`]) and one way to load trust roots ([`Roots`]: a PEM file or bundle, or the system's store
//! as Go finds it, `SSL_CERT_FILE` and `SSL_CERT_DIR` included).
//!
//! A server's certificate is verified against roots unless the caller's contract says
//! otherwise ([`ServerTrust::AnyCertificate`]: a kubeconfig's
//! `insecure-skip-tls-verify`, kubelet-style HTTPS probes); even then the handshake
//! signature is checked against the key the server presented, so the peer holds the
//! private key of the certificate it sent.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
};

use tokio_rustls::rustls::{
    self, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{CryptoProvider, WebPkiSupportedAlgorithms},
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject as _},
};

/// ALPN for gRPC (HTTP/2).
pub const ALPN_H2: &[u8] = b"h2";
/// ALPN for HTTP/1.1 clients.
pub const ALPN_HTTP1: &[u8] = b"http/1.1";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {message}")]
    Pem { what: String, message: String },
    #[error("{what} holds no PEM certificate")]
    NoCertificate { what: String },
    #[error(
        "no trusted root certificate found on this system (looked at SSL_CERT_FILE, SSL_CERT_DIR and the \
         distribution's bundle){}",
        if .0.is_empty() { String::new() } else { format!(": {}", .0) }
    )]
    NoSystemRoots(String),
    #[error("client certificate {what}: {message}")]
    Identity { what: String, message: String },
}

/// Trust roots, loaded one way for every client.
pub struct Roots;

impl Roots {
    /// The system's roots, loaded once per process (`SSL_CERT_FILE`, `SSL_CERT_DIR`,
    /// else the distribution's bundle and directory), as Go's crypto/x509 finds them.
    /// None at all is an error, not a store that trusts nothing.
    pub fn system() -> Result<Arc<RootCertStore>, TlsError> {
        static SYSTEM: OnceLock<Result<Arc<RootCertStore>, String>> = OnceLock::new();
        SYSTEM
            .get_or_init(|| {
                let found = rustls_native_certs::load_native_certs();
                let mut roots = RootCertStore::empty();
                let (added, _) = roots.add_parsable_certificates(found.certs);
                let errors: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
                if added == 0 {
                    return Err(errors.join("; "));
                }
                if !errors.is_empty() {
                    tracing::warn!(errors = %errors.join("; "), roots = added, "some system root certificates were not loaded");
                }
                Ok(Arc::new(roots))
            })
            .clone()
            .map_err(TlsError::NoSystemRoots)
    }

    /// Every certificate in the PEM text `pem`, named `what` in errors (at least one).
    pub fn from_pem(pem: &[u8], what: &str) -> Result<Arc<RootCertStore>, TlsError> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| TlsError::Pem { what: what.into(), message: e.to_string() })?;
            roots.add(cert).map_err(|e| TlsError::Pem { what: what.into(), message: e.to_string() })?;
        }
        if roots.is_empty() {
            return Err(TlsError::NoCertificate { what: what.into() });
        }
        Ok(Arc::new(roots))
    }

    /// The PEM bundle at `path`; `what` names it in errors ("XDS root certificate").
    pub fn from_file(path: &Path, what: &'static str) -> Result<Arc<RootCertStore>, TlsError> {
        let pem = std::fs::read(path).map_err(|source| TlsError::Read { what, path: path.into(), source })?;
        Self::from_pem(&pem, &format!("{what} {}", path.display()))
    }
}

/// `COMPLIANCE_POLICY` as it narrows the agent's own TLS (Istio's
/// `EnforceGoCompliance`, pkg/model/fips.go): `fips-140-2` is TLS 1.2 only with
/// ECDHE-{ECDSA,RSA}-AES{128,256}-GCM and P-256; `fips-140-3` is TLS 1.2 or 1.3 with
/// those suites (TLS 1.3: AES-GCM only, as Go's FIPS mode) and P-256 or P-384.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compliance {
    #[default]
    None,
    Fips1402,
    Fips1403,
}

impl Compliance {
    /// The variable's value; `pqc` is refused (its X25519MLKEM768 is not in this
    /// build's TLS), an unknown value is no policy, as in Istio (which logs it).
    pub fn parse(value: &str) -> Result<Self, String> {
        match value {
            "" => Ok(Self::None),
            "fips-140-2" => Ok(Self::Fips1402),
            "fips-140-3" => Ok(Self::Fips1403),
            "pqc" => Err("\"pqc\" requires X25519MLKEM768 key exchange, which this build's TLS (ring) does \
                          not have; use \"fips-140-3\", \"fips-140-2\" or leave it unset"
                .into()),
            other => {
                tracing::warn!(policy = other, "unknown COMPLIANCE_POLICY; no restriction applied");
                Ok(Self::None)
            }
        }
    }

    /// The TLS 1.2 cipher suites Envoy's google_grpc client is limited to
    /// (`GRPC_SSL_CIPHER_SUITES` in Envoy's environment), under either FIPS policy.
    pub fn grpc_ssl_cipher_suites(self) -> Option<&'static str> {
        (self != Self::None).then_some(
            "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384",
        )
    }

    /// ring's provider, narrowed to this policy's suites and key exchange groups.
    pub fn provider(self) -> CryptoProvider {
        use rustls::{CipherSuite as S, crypto::ring::kx_group};
        let mut provider = rustls::crypto::ring::default_provider();
        let groups = match self {
            Self::None => return provider,
            Self::Fips1402 => vec![kx_group::SECP256R1],
            Self::Fips1403 => vec![kx_group::SECP256R1, kx_group::SECP384R1],
        };
        provider.cipher_suites.retain(|suite| {
            matches!(
                suite.suite(),
                S::TLS13_AES_128_GCM_SHA256
                    | S::TLS13_AES_256_GCM_SHA384
                    | S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
                    | S::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
                    | S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
                    | S::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384
            )
        });
        provider.kx_groups = groups;
        provider
    }

    /// The protocol versions this policy allows.
    pub fn versions(self) -> &'static [&'static rustls::SupportedProtocolVersion] {
        static TLS12_ONLY: [&rustls::SupportedProtocolVersion; 1] = [&rustls::version::TLS12];
        match self {
            Self::Fips1402 => &TLS12_ONLY,
            _ => rustls::DEFAULT_VERSIONS,
        }
    }

    /// Applies to every client configuration made from now on (set once, at start-up,
    /// before any connection).
    pub fn set_for_process(self) {
        if COMPLIANCE.set(self).is_err() && COMPLIANCE.get() != Some(&self) {
            tracing::warn!(policy = ?self, "the compliance policy was already set; the first one stays");
        }
    }

    fn of_process() -> Self {
        COMPLIANCE.get().copied().unwrap_or_default()
    }
}

static COMPLIANCE: OnceLock<Compliance> = OnceLock::new();

/// A client certificate and its key (PEM), for mutual TLS.
pub struct Identity {
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Identity {
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8], what: &str) -> Result<Self, TlsError> {
        let invalid = |message: String| TlsError::Identity { what: what.into(), message };
        let certs = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(format!("certificate: {e}")))?;
        if certs.is_empty() {
            return Err(invalid("no PEM certificate".into()));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| invalid(format!("key: {e}")))?;
        Ok(Self { certs, key })
    }
}

/// How a client decides to trust the server it reached.
#[derive(Clone)]
pub enum ServerTrust {
    /// The certificate chains to one of these roots and names the server.
    Roots(Arc<RootCertStore>),
    /// Any certificate (`insecure-skip-tls-verify`, kubelet's HTTPS probes); the
    /// handshake signature is still checked against the presented key.
    AnyCertificate,
}

/// The one client configuration: ring, TLS 1.2 and 1.3, `trust` for the server, an
/// optional client certificate, and `alpn` offered in order.
pub fn client_config(
    trust: ServerTrust,
    identity: Option<Identity>,
    alpn: &[&[u8]],
) -> Result<ClientConfig, TlsError> {
    let compliance = Compliance::of_process();
    let provider = provider(compliance);
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(compliance.versions())
        .expect("ring supports TLS 1.2 and 1.3 with every policy's suites");
    let builder = match trust {
        ServerTrust::Roots(roots) => builder.with_root_certificates(roots),
        ServerTrust::AnyCertificate => {
            builder.dangerous().with_custom_certificate_verifier(Arc::new(AnyCertificate {
                algorithms: provider.signature_verification_algorithms,
            }))
        }
    };
    let mut config = match identity {
        Some(id) => builder
            .with_client_auth_cert(id.certs, id.key)
            .map_err(|e| TlsError::Identity { what: "for this connection".into(), message: e.to_string() })?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A connector over [`client_config`] for HTTP/1.1 clients.
pub fn http1_connector(trust: ServerTrust) -> Result<tokio_rustls::TlsConnector, TlsError> {
    Ok(tokio_rustls::TlsConnector::from(Arc::new(client_config(trust, None, &[ALPN_HTTP1])?)))
}

fn provider(compliance: Compliance) -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<(Compliance, Arc<CryptoProvider>)> = OnceLock::new();
    match PROVIDER.get_or_init(|| (compliance, Arc::new(compliance.provider()))) {
        (c, p) if *c == compliance => p.clone(),
        _ => Arc::new(compliance.provider()),
    }
}

/// Accepts any certificate's identity and validity, but not a forged handshake: the
/// TLS 1.2 and 1.3 signatures must verify with the certificate's public key.
#[derive(Debug)]
struct AnyCertificate {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// COMPLIANCE_POLICY=fips-140-3, as Istio's EnforceGoCompliance: TLS 1.2 and 1.3,
    /// ECDHE with AES-GCM only (no ChaCha20), P-256 and P-384 (no X25519);
    /// fips-140-2 is TLS 1.2 and P-256 only. Unset changes nothing; `pqc` is refused.
    #[test]
    fn fips_140_3_narrows_the_agents_tls_to_aes_gcm_and_p256_or_p384() {
        use rustls::CipherSuite as S;
        let suites = |c: Compliance| c.provider().cipher_suites.iter().map(|s| s.suite()).collect::<Vec<_>>();
        let groups = |c: Compliance| c.provider().kx_groups.iter().map(|g| g.name()).collect::<Vec<_>>();
        let fips = Compliance::parse("fips-140-3").unwrap();
        assert_eq!(
            suites(fips),
            [
                S::TLS13_AES_256_GCM_SHA384,
                S::TLS13_AES_128_GCM_SHA256,
                S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
                S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
                S::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
                S::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
            ]
        );
        assert_eq!(groups(fips), [rustls::NamedGroup::secp256r1, rustls::NamedGroup::secp384r1]);
        assert_eq!(fips.versions(), rustls::DEFAULT_VERSIONS);
        let old = Compliance::parse("fips-140-2").unwrap();
        assert_eq!(groups(old), [rustls::NamedGroup::secp256r1]);
        assert_eq!(old.versions().len(), 1);
        assert_eq!(old.versions()[0].version, rustls::ProtocolVersion::TLSv1_2);
        assert!(suites(Compliance::parse("").unwrap()).contains(&S::TLS13_CHACHA20_POLY1305_SHA256));
        assert!(groups(Compliance::None).contains(&rustls::NamedGroup::X25519));
        assert!(Compliance::parse("pqc").unwrap_err().contains("X25519MLKEM768"));
        assert_eq!(fips.grpc_ssl_cipher_suites(), old.grpc_ssl_cipher_suites());
        assert_eq!(Compliance::None.grpc_ssl_cipher_suites(), None);
    }

    /// A fips-140-3 client and a server offering only ChaCha20 or only X25519 find
    /// nothing in common: the handshake fails, as it must.
    #[tokio::test]
    async fn a_fips_140_3_client_refuses_chacha20_and_x25519_servers() {
        let (cert, key) = self_signed();
        for (suite, group) in [
            (
                rustls::crypto::ring::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
                rustls::crypto::ring::kx_group::SECP256R1,
            ),
            (
                rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256,
                rustls::crypto::ring::kx_group::X25519,
            ),
        ] {
            let mut narrow = rustls::crypto::ring::default_provider();
            narrow.cipher_suites = vec![suite];
            narrow.kx_groups = vec![group];
            let narrow = Arc::new(narrow);
            let signing = narrow
                .key_provider
                .load_private_key(PrivateKeyDer::try_from(key.serialize_der()).unwrap())
                .unwrap();
            let server = rustls::ServerConfig::builder_with_provider(narrow)
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .with_no_client_auth()
                .with_cert_resolver(Arc::new(Presents(Arc::new(rustls::sign::CertifiedKey::new(
                    vec![cert.clone()],
                    signing,
                )))));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
            tokio::spawn(async move {
                let (tcp, _) = listener.accept().await.unwrap();
                let _ = acceptor.accept(tcp).await;
            });
            let client = ClientConfig::builder_with_provider(Arc::new(Compliance::Fips1403.provider()))
                .with_protocol_versions(Compliance::Fips1403.versions())
                .unwrap()
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate {
                    algorithms: rustls::crypto::ring::default_provider().signature_verification_algorithms,
                }))
                .with_no_client_auth();
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let name = ServerName::try_from("app.local").unwrap();
            let done = tokio_rustls::TlsConnector::from(Arc::new(client)).connect(name, tcp).await;
            assert!(done.is_err(), "{:?} with {:?} negotiated", suite.suite(), group.name());
        }
    }

    fn self_signed() -> (CertificateDer<'static>, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert =
            rcgen::CertificateParams::new(vec!["app.local".into()]).unwrap().self_signed(&key).unwrap();
        (cert.der().clone(), key)
    }

    /// A server presenting `cert` and signing its handshakes with `key` (its own key,
    /// or an impostor's who copied a certificate without its key), over `version`.
    #[derive(Debug)]
    struct Presents(Arc<rustls::sign::CertifiedKey>);

    impl rustls::server::ResolvesServerCert for Presents {
        fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
            Some(self.0.clone())
        }
    }

    async fn handshake(
        cert: &CertificateDer<'static>,
        key: &rcgen::KeyPair,
        version: &'static rustls::SupportedProtocolVersion,
    ) -> Result<(), String> {
        let signing = provider(Compliance::None)
            .key_provider
            .load_private_key(PrivateKeyDer::try_from(key.serialize_der()).unwrap())
            .unwrap();
        let certified = rustls::sign::CertifiedKey::new(vec![cert.clone()], signing);
        let server = rustls::ServerConfig::builder_with_provider(provider(Compliance::None))
            .with_protocol_versions(&[version])
            .unwrap()
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(Presents(Arc::new(certified))));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let served = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let _ = acceptor.accept(tcp).await;
        });
        let client = http1_connector(ServerTrust::AnyCertificate).unwrap();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        // Any name: the certificate's identity is not what this verifier checks.
        let name = ServerName::try_from("elsewhere.example").unwrap();
        let result = client.connect(name, tcp).await.map(drop).map_err(|e| e.to_string());
        served.abort();
        result
    }

    /// The verifier's doc promise, in real handshakes: any certificate's identity is
    /// accepted, but a server that does not hold the key of the certificate it shows
    /// (its handshake signature fails) is refused, in TLS 1.2 and 1.3.
    #[tokio::test]
    async fn any_certificate_still_refuses_a_server_without_the_certificates_key() {
        let (cert, key) = self_signed();
        let (_, impostor) = self_signed();
        for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
            handshake(&cert, &key, version)
                .await
                .unwrap_or_else(|e| panic!("{version:?}: the key holder refused: {e}"));
            let e = handshake(&cert, &impostor, version)
                .await
                .expect_err("a server signing with another key than its certificate's was accepted");
            assert!(e.to_lowercase().contains("signature"), "{version:?}: {e}");
        }
    }

    #[test]
    fn roots_and_identities_name_what_is_wrong() {
        let e = Roots::from_pem(b"not pem", "kubeconfig certificate-authority-data").unwrap_err().to_string();
        assert_eq!(e, "kubeconfig certificate-authority-data holds no PEM certificate");
        let e = Roots::from_file(Path::new("/nonexistent/root.pem"), "XDS root certificate")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "cannot read XDS root certificate /nonexistent/root.pem");
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert_pem =
            rcgen::CertificateParams::new(vec!["app.local".into()]).unwrap().self_signed(&key).unwrap().pem();
        assert_eq!(Roots::from_pem(cert_pem.as_bytes(), "bundle").unwrap().len(), 1);
        assert!(Identity::from_pem(cert_pem.as_bytes(), key.serialize_pem().as_bytes(), "client").is_ok());
        let e = Identity::from_pem(b"", key.serialize_pem().as_bytes(), "/etc/certs/cert-chain.pem")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("/etc/certs/cert-chain.pem") && e.contains("no PEM certificate"), "{e}");
    }
}
