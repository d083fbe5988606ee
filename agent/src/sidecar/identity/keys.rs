//! Private keys and certificate signing requests, made in process as pilot-agent's
//! `pkiutil.GenCSR` makes them: RSA (`WORKLOAD_RSA_KEY_SIZE`, 2048) unless
//! `ECC_SIGNATURE_ALGORITHM=ECDSA` asks for P-256; the CSR has an empty subject and the
//! workload's SPIFFE ID as its only SAN; the key is PEM-encoded as PKCS#1/SEC1, or
//! PKCS#8 with `PKCS8_KEY`. Keys never touch the disk here.

use std::fmt;

use rcgen::{CertificateParams, DistinguishedName, KeyPair, PublicKeyData, SanType};
use serde::Serialize;

/// A workload's SPIFFE identity: `spiffe://<trust domain>/ns/<namespace>/sa/<account>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadIdentity {
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
}

impl fmt::Display for WorkloadIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "spiffe://{}/ns/{}/sa/{}", self.trust_domain, self.namespace, self.service_account)
    }
}

/// Which key the agent makes for its workload certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum KeyAlgorithm {
    /// RSA with this modulus size in bits, signed with SHA-256.
    Rsa(u32),
    /// ECDSA on P-256 with SHA-256 (`ECC_SIGNATURE_ALGORITHM=ECDSA`, `ECC_CURVE=P256`).
    EcdsaP256,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyOptions {
    pub algorithm: KeyAlgorithm,
    /// `PKCS8_KEY`: encode the private key as PKCS#8 rather than PKCS#1/SEC1.
    pub pkcs8: bool,
}

impl Default for KeyOptions {
    fn default() -> Self {
        Self { algorithm: KeyAlgorithm::Rsa(2048), pkcs8: false }
    }
}

/// RSA sizes Envoy's BoringSSL and the signer both accept.
pub const RSA_KEY_SIZES: std::ops::RangeInclusive<u32> = 2048..=8192;

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("RSA key size {0}: expected a multiple of 8 between 2048 and 8192 bits")]
    RsaSize(u32),
    #[error("generate the {algorithm:?} private key")]
    Generate { algorithm: KeyAlgorithm, message: String },
    #[error("build the certificate signing request for {identity}")]
    Csr {
        identity: String,
        #[source]
        source: rcgen::Error,
    },
}

/// A fresh private key and the CSR for it.
pub struct KeyAndCsr {
    pub csr_pem: String,
    /// The private key as PEM, in the encoding `KeyOptions::pkcs8` chose.
    pub key_pem: String,
    /// The key's SubjectPublicKeyInfo (DER): the issued leaf must carry exactly this.
    pub public_key_der: Vec<u8>,
}

impl fmt::Debug for KeyAndCsr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyAndCsr").field("csr_pem", &self.csr_pem).finish_non_exhaustive()
    }
}

impl KeyOptions {
    /// Checks the options without generating anything (config validation).
    pub fn validate(&self) -> Result<(), KeyError> {
        match self.algorithm {
            KeyAlgorithm::Rsa(bits) if !RSA_KEY_SIZES.contains(&bits) || bits % 8 != 0 => {
                Err(KeyError::RsaSize(bits))
            }
            _ => Ok(()),
        }
    }
}

/// Makes a new key and a CSR asking for `identity`. RSA key generation is CPU work
/// (tens of milliseconds): call it from a blocking task.
pub fn generate(identity: &WorkloadIdentity, options: &KeyOptions) -> Result<KeyAndCsr, KeyError> {
    options.validate()?;
    let fail = |message: String| KeyError::Generate { algorithm: options.algorithm, message };
    let (key_pair, key_pem) = match options.algorithm {
        KeyAlgorithm::Rsa(bits) => {
            use rsa::pkcs1::EncodeRsaPrivateKey;
            use rsa::pkcs8::EncodePrivateKey;
            let key = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, bits as usize)
                .map_err(|e| fail(e.to_string()))?;
            let pkcs8 = key.to_pkcs8_der().map_err(|e| fail(e.to_string()))?;
            let pair = KeyPair::from_pkcs8_der_and_sign_algo(
                &pkcs8.as_bytes().to_vec().into(),
                &rcgen::PKCS_RSA_SHA256,
            )
            .map_err(|e| fail(e.to_string()))?;
            let pem = if options.pkcs8 {
                pair.serialize_pem()
            } else {
                key.to_pkcs1_pem(rsa::pkcs8::LineEnding::LF).map_err(|e| fail(e.to_string()))?.to_string()
            };
            (pair, pem)
        }
        KeyAlgorithm::EcdsaP256 => {
            use p256::pkcs8::DecodePrivateKey;
            let pair =
                KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|e| fail(e.to_string()))?;
            let pem = if options.pkcs8 {
                pair.serialize_pem()
            } else {
                let key = p256::SecretKey::from_pkcs8_der(&pair.serialize_der())
                    .map_err(|e| fail(e.to_string()))?;
                sec1_pem(&key).map_err(fail)?
            };
            (pair, pem)
        }
    };
    let csr_error = |source| KeyError::Csr { identity: identity.to_string(), source };
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    let uri = identity.to_string().try_into().map_err(csr_error)?;
    params.subject_alt_names = vec![SanType::URI(uri)];
    let csr = params.serialize_request(&key_pair).map_err(csr_error)?;
    Ok(KeyAndCsr {
        csr_pem: csr.pem().map_err(csr_error)?,
        key_pem,
        public_key_der: key_pair.subject_public_key_info(),
    })
}

/// RFC 5915 `EC PRIVATE KEY` with the named curve in it, as Go's
/// `x509.MarshalECPrivateKey` writes it. (The `p256` crate leaves the optional curve
/// out, and BoringSSL, hence Envoy, refuses such a key.)
fn sec1_pem(key: &p256::SecretKey) -> Result<String, String> {
    use base64::Engine as _;
    use p256::{elliptic_curve::sec1::ToEncodedPoint as _, pkcs8::AssociatedOid as _};
    use sec1::der::Encode as _;
    let private = key.to_bytes();
    let public = key.public_key().to_encoded_point(false);
    let der = sec1::EcPrivateKey {
        private_key: &private,
        parameters: Some(sec1::EcParameters::NamedCurve(p256::NistP256::OID)),
        public_key: Some(public.as_bytes()),
    }
    .to_der()
    .map_err(|e| e.to_string())?;
    let body = base64::engine::general_purpose::STANDARD.encode(&der);
    let lines: Vec<&str> =
        body.as_bytes().chunks(64).map(|c| std::str::from_utf8(c).expect("base64 is ASCII")).collect();
    Ok(format!("-----BEGIN EC PRIVATE KEY-----\n{}\n-----END EC PRIVATE KEY-----\n", lines.join("\n")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use x509_parser::prelude::FromDer;

    fn identity() -> WorkloadIdentity {
        WorkloadIdentity {
            trust_domain: "cluster.local".into(),
            namespace: "app".into(),
            service_account: "echo".into(),
        }
    }

    fn csr_sans(pem: &str) -> Vec<String> {
        let (_, der) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
        let (_, csr) =
            x509_parser::certification_request::X509CertificationRequest::from_der(&der.contents).unwrap();
        csr.verify_signature().unwrap();
        let mut out = Vec::new();
        for ext in csr.requested_extensions().into_iter().flatten() {
            if let x509_parser::extensions::ParsedExtension::SubjectAlternativeName(san) = ext {
                for name in &san.general_names {
                    out.push(name.to_string());
                }
            }
        }
        out
    }

    #[test]
    fn ecdsa_keys_are_sec1_or_pkcs8() {
        let sec1 =
            generate(&identity(), &KeyOptions { algorithm: KeyAlgorithm::EcdsaP256, pkcs8: false }).unwrap();
        assert!(sec1.key_pem.starts_with("-----BEGIN EC PRIVATE KEY-----"), "{}", sec1.key_pem);
        // The curve is named inside the key: BoringSSL (Envoy) needs it.
        use base64::Engine as _;
        use sec1::der::Decode as _;
        let body: String = sec1.key_pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let der = base64::engine::general_purpose::STANDARD.decode(body).unwrap();
        let parsed = sec1::EcPrivateKey::from_der(&der).unwrap();
        assert!(parsed.parameters.is_some(), "SEC1 key without its curve");
        assert!(p256::SecretKey::from_sec1_der(&der).is_ok());
        assert_eq!(csr_sans(&sec1.csr_pem), ["URI(spiffe://cluster.local/ns/app/sa/echo)"]);
        let pkcs8 =
            generate(&identity(), &KeyOptions { algorithm: KeyAlgorithm::EcdsaP256, pkcs8: true }).unwrap();
        assert!(pkcs8.key_pem.starts_with("-----BEGIN PRIVATE KEY-----"));
        assert_ne!(sec1.public_key_der, pkcs8.public_key_der, "every call makes a new key");
    }

    #[test]
    fn rsa_keys_are_pkcs1_by_default() {
        let k = generate(&identity(), &KeyOptions::default()).unwrap();
        assert!(k.key_pem.starts_with("-----BEGIN RSA PRIVATE KEY-----"));
        assert_eq!(csr_sans(&k.csr_pem), ["URI(spiffe://cluster.local/ns/app/sa/echo)"]);
        let (_, der) = x509_parser::pem::parse_x509_pem(k.csr_pem.as_bytes()).unwrap();
        let (_, csr) =
            x509_parser::certification_request::X509CertificationRequest::from_der(&der.contents).unwrap();
        let spki = csr.certification_request_info.subject_pki;
        assert_eq!(spki.raw, k.public_key_der.as_slice());
        let x509_parser::public_key::PublicKey::RSA(rsa) = spki.parsed().unwrap() else { panic!("not RSA") };
        assert_eq!(rsa.key_size(), 2048);
    }

    #[test]
    fn bad_rsa_sizes_are_refused_before_any_work() {
        for bits in [0, 1024, 2049, 16384] {
            let e = generate(&identity(), &KeyOptions { algorithm: KeyAlgorithm::Rsa(bits), pkcs8: false })
                .unwrap_err();
            assert!(e.to_string().contains(&bits.to_string()), "{e}");
        }
    }
}
