//! Checks a certificate chain before the agent serves it: every element is a PEM
//! certificate, none has expired, the chain has a leaf and a root, and the leaf
//! carries the key the agent made. What the CA answers is input like any other.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use x509_parser::prelude::{FromDer, X509Certificate};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    #[error(
        "the certificate chain has {0} certificate(s): expected the leaf and at least the root (2 or more)"
    )]
    TooShort(usize),
    #[error("certificate {index} of the chain is not PEM (expected -----BEGIN CERTIFICATE-----)")]
    NotPem { index: usize },
    #[error("certificate {index} of the chain is not a valid X.509 certificate: {message}")]
    NotCertificate { index: usize, message: String },
    #[error("certificate {index} of the chain ({role}) expired at {not_after} (unix time)")]
    Expired { index: usize, role: &'static str, not_after: u64 },
    #[error("certificate {index} of the chain ({role}) is not valid before {not_before} (unix time)")]
    NotYetValid { index: usize, role: &'static str, not_before: u64 },
    #[error("the leaf certificate is for a different key than the one in the CSR")]
    KeyMismatch,
    #[error("{what} holds no PEM certificate")]
    NoCertificate { what: String },
}

/// What the agent needs to know about a served certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafInfo {
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// Hex, lowercase, as Envoy's `/certs` prints it.
    pub serial: String,
    /// URI SANs (SPIFFE IDs).
    pub uris: Vec<String>,
}

/// How far a `notBefore` in the future is tolerated (clock skew to the CA).
pub const CLOCK_SKEW: Duration = Duration::from_secs(120);

/// Parses one PEM certificate; `index` names it in errors.
pub fn parse_pem(index: usize, pem: &str) -> Result<Vec<u8>, ChainError> {
    let (_, block) =
        x509_parser::pem::parse_x509_pem(pem.as_bytes()).map_err(|_| ChainError::NotPem { index })?;
    if block.label != "CERTIFICATE" {
        return Err(ChainError::NotPem { index });
    }
    Ok(block.contents)
}

fn unix(t: x509_parser::time::ASN1Time) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(t.timestamp().max(0) as u64)
}

fn secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn inspect(index: usize, role: &'static str, der: &[u8], now: SystemTime) -> Result<LeafInfo, ChainError> {
    let (_, cert) = X509Certificate::from_der(der)
        .map_err(|e| ChainError::NotCertificate { index, message: e.to_string() })?;
    let not_before = unix(cert.validity().not_before);
    let not_after = unix(cert.validity().not_after);
    if not_after <= now {
        return Err(ChainError::Expired { index, role, not_after: secs(not_after) });
    }
    if not_before > now + CLOCK_SKEW {
        return Err(ChainError::NotYetValid { index, role, not_before: secs(not_before) });
    }
    let mut uris = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::URI(uri) = name {
                uris.push(uri.to_string());
            }
        }
    }
    Ok(LeafInfo { not_before, not_after, serial: cert.raw_serial_as_string().replace(':', ""), uris })
}

/// Checks the CA's answer (leaf first, root last) for the key `public_key_der`.
pub fn check_issued(
    chain: &[String],
    public_key_der: &[u8],
    now: SystemTime,
) -> Result<LeafInfo, ChainError> {
    if chain.len() < 2 {
        return Err(ChainError::TooShort(chain.len()));
    }
    let mut leaf = None;
    for (i, pem) in chain.iter().enumerate() {
        let index = i + 1;
        let der = parse_pem(index, pem)?;
        let role = match i {
            0 => "the leaf",
            i if i == chain.len() - 1 => "the root",
            _ => "an intermediate",
        };
        let info = inspect(index, role, &der, now)?;
        if i == 0 {
            let (_, cert) = X509Certificate::from_der(&der).expect("parsed above");
            if cert.public_key().raw != public_key_der {
                return Err(ChainError::KeyMismatch);
            }
            leaf = Some(info);
        }
    }
    Ok(leaf.expect("chain has a leaf"))
}

/// Splits a PEM bundle (a file's contents) into certificates, each checked; `what`
/// names the bundle in errors. Returns the first certificate's details.
pub fn check_bundle(what: &str, text: &str, now: SystemTime) -> Result<LeafInfo, ChainError> {
    let mut first = None;
    for (i, pem) in x509_parser::pem::Pem::iter_from_buffer(text.as_bytes()).enumerate() {
        let index = i + 1;
        let pem = pem.map_err(|_| ChainError::NotPem { index })?;
        if pem.label != "CERTIFICATE" {
            continue;
        }
        let role = if i == 0 { "the first" } else { "a further certificate" };
        let info = inspect(index, role, &pem.contents, now)?;
        first.get_or_insert(info);
    }
    first.ok_or_else(|| ChainError::NoCertificate { what: what.into() })
}

/// Joins PEM certificates as Istio does (each ending in a newline).
pub fn concat(pems: &[String]) -> String {
    let mut out = String::new();
    for pem in pems {
        out.push_str(pem.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(days: i64, key: &rcgen::KeyPair) -> String {
        let mut p = rcgen::CertificateParams::new(vec!["x".into()]).unwrap();
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now - time::Duration::days(2);
        p.not_after = now + time::Duration::days(days);
        p.self_signed(key).unwrap().pem()
    }

    #[test]
    fn chains_are_checked_element_by_element() {
        use rcgen::PublicKeyData;
        let key = rcgen::KeyPair::generate().unwrap();
        let other = rcgen::KeyPair::generate().unwrap();
        let now = SystemTime::now();
        let spki = key.subject_public_key_info();
        let good = [cert(1, &key), cert(30, &other)];
        let leaf = check_issued(&good, &spki, now).unwrap();
        assert!(leaf.not_after > now);
        assert!(!leaf.serial.contains(':'));
        assert_eq!(check_issued(&good[..1], &spki, now), Err(ChainError::TooShort(1)));
        assert_eq!(
            check_issued(&[good[0].clone(), "garbage".into()], &spki, now),
            Err(ChainError::NotPem { index: 2 })
        );
        let expired_root = [cert(1, &key), cert(-1, &other)];
        let e = check_issued(&expired_root, &spki, now).unwrap_err();
        assert!(matches!(e, ChainError::Expired { index: 2, role: "the root", .. }), "{e}");
        assert!(e.to_string().contains("the root"));
        assert_eq!(
            check_issued(&[cert(1, &other), good[1].clone()], &spki, now),
            Err(ChainError::KeyMismatch)
        );
    }

    #[test]
    fn bundles_need_a_certificate() {
        let key = rcgen::KeyPair::generate().unwrap();
        let now = SystemTime::now();
        let two = format!("{}{}", cert(1, &key), cert(2, &key));
        check_bundle("root-cert.pem", &two, now).unwrap();
        let e = check_bundle("root-cert.pem", "not a cert", now).unwrap_err();
        assert!(e.to_string().contains("root-cert.pem"), "{e}");
        assert!(check_bundle("r", &cert(-1, &key), now).is_err());
    }
}
