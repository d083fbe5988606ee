//! What the mesh CA agrees to sign for a workload: a certificate for the workload's own
//! SPIFFE ID only (every SAN the CSR asks for must be that URI), for no longer than the
//! workload's TTL (`SECRET_TTL`; a longer request is capped to it, none asked means the
//! TTL). Pure: the CSR's SANs and the asked validity in, an approval or a refusal naming
//! what was asked and what is allowed out.

use std::time::Duration;

use rcgen::SanType;

use crate::sidecar::identity::WorkloadIdentity;

/// The one identity, and the longest lifetime, the CA signs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SigningPolicy {
    identity: String,
    max_lifetime: Duration,
}

/// What a CSR may have signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Approved {
    /// The SPIFFE ID the certificate carries (its only SAN).
    pub identity: String,
    pub lifetime: Duration,
    /// The request asked for longer than the policy allows.
    pub capped: bool,
}

/// Why a CSR is not signed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the CSR asks for no identity (no URI SAN); this CA signs only {allowed}")]
    NoIdentity { allowed: String },
    #[error("the CSR asks for {requested}; this CA signs only {allowed}")]
    OtherIdentity { requested: String, allowed: String },
}

impl Refusal {
    /// The gRPC code a client gets: a malformed request, or one for what it may not have.
    pub fn code(&self) -> tonic::Code {
        match self {
            Self::NoIdentity { .. } => tonic::Code::InvalidArgument,
            Self::OtherIdentity { .. } => tonic::Code::PermissionDenied,
        }
    }
}

/// A SAN as a refusal names it.
fn describe(san: &SanType) -> String {
    match san {
        SanType::URI(uri) => uri.as_str().to_string(),
        SanType::DnsName(name) => format!("DNS name {}", name.as_str()),
        SanType::IpAddress(ip) => format!("IP address {ip}"),
        SanType::Rfc822Name(email) => format!("email address {}", email.as_str()),
        SanType::OtherName((oid, _)) => format!("an otherName SAN ({oid:?})"),
        _ => "a SAN of another kind".to_string(),
    }
}

impl SigningPolicy {
    /// Signs only `identity`'s SPIFFE ID, for at most `max_lifetime`.
    pub fn new(identity: &WorkloadIdentity, max_lifetime: Duration) -> Self {
        Self { identity: identity.to_string(), max_lifetime }
    }

    /// The SPIFFE ID this policy signs.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    pub fn max_lifetime(&self) -> Duration {
        self.max_lifetime
    }

    /// Checks a CSR's SANs and its asked validity (seconds, `IstioCertificateRequest`'s
    /// `validity_duration`; 0 or less: none asked).
    pub fn check(&self, sans: &[SanType], requested_seconds: i64) -> Result<Approved, Refusal> {
        if sans.is_empty() {
            return Err(Refusal::NoIdentity { allowed: self.identity.clone() });
        }
        if let Some(other) =
            sans.iter().find(|san| !matches!(san, SanType::URI(uri) if uri.as_str() == self.identity))
        {
            return Err(Refusal::OtherIdentity {
                requested: describe(other),
                allowed: self.identity.clone(),
            });
        }
        let requested = u64::try_from(requested_seconds).ok().filter(|s| *s > 0).map(Duration::from_secs);
        let capped = requested.is_some_and(|r| r > self.max_lifetime);
        let lifetime = requested.filter(|_| !capped).unwrap_or(self.max_lifetime);
        Ok(Approved { identity: self.identity.clone(), lifetime, capped })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: &str = "spiffe://cluster.local/ns/shop/sa/cart";
    const OTHER: &str = "spiffe://cluster.local/ns/shop/sa/payments";

    fn policy() -> SigningPolicy {
        let identity = WorkloadIdentity {
            trust_domain: "cluster.local".into(),
            namespace: "shop".into(),
            service_account: "cart".into(),
        };
        SigningPolicy::new(&identity, Duration::from_secs(3600))
    }

    fn uri(u: &str) -> SanType {
        SanType::URI(u.try_into().unwrap())
    }

    #[test]
    fn the_workloads_own_identity_is_signed_for_what_it_asks_up_to_the_ttl() {
        let p = policy();
        assert_eq!(p.identity(), OWN);
        let asked = p.check(&[uri(OWN)], 600).unwrap();
        assert_eq!(
            (asked.identity.as_str(), asked.lifetime, asked.capped),
            (OWN, Duration::from_secs(600), false)
        );
        let longer = p.check(&[uri(OWN)], 10 * 365 * 86_400).unwrap();
        assert_eq!((longer.lifetime, longer.capped), (Duration::from_secs(3600), true), "capped at the TTL");
        for none in [0, -5] {
            let default = p.check(&[uri(OWN)], none).unwrap();
            assert_eq!((default.lifetime, default.capped), (Duration::from_secs(3600), false));
        }
    }

    #[test]
    fn another_identity_or_any_other_name_is_refused_by_name() {
        let p = policy();
        let e = p.check(&[uri(OTHER)], 600).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert_eq!(e.to_string(), format!("the CSR asks for {OTHER}; this CA signs only {OWN}"));
        // Its own identity does not carry another one along.
        let e = p.check(&[uri(OWN), uri(OTHER)], 600).unwrap_err();
        assert_eq!(e, Refusal::OtherIdentity { requested: OTHER.into(), allowed: OWN.into() });
        let e =
            p.check(&[uri(OWN), SanType::DnsName("payments.shop.svc".try_into().unwrap())], 600).unwrap_err();
        assert!(e.to_string().contains("DNS name payments.shop.svc"), "{e}");
        let e = p.check(&[SanType::IpAddress([10, 0, 0, 1].into())], 600).unwrap_err();
        assert!(e.to_string().contains("IP address 10.0.0.1") && e.to_string().contains(OWN), "{e}");
        // A trust domain is part of the identity.
        let e = p.check(&[uri("spiffe://evil.example/ns/shop/sa/cart")], 600).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
    }

    #[test]
    fn a_csr_without_an_identity_is_a_bad_request() {
        let e = policy().check(&[], 600).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.to_string().contains("no identity") && e.to_string().contains(OWN), "{e}");
    }
}
