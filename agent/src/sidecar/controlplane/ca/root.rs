//! The mesh CA's root: an ECDSA P-256 self-signed certificate and its key, made fresh or
//! kept in a state directory only its owner may enter (0700), and the signing of
//! workload certificates with it, only as a `SigningPolicy` approves: the certificate
//! carries the approved SPIFFE ID and lifetime and nothing else the CSR asked for.

use std::{path::Path, sync::Arc};

use super::policy::{Approved, Refusal, SigningPolicy};

/// The persisted root's files in a state directory.
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
pub const ROOT_KEY_FILE: &str = "root-key.pem";

/// How long a root lives.
const ROOT_DAYS: i64 = 3650;

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("create the CA root")]
    Root(#[source] rcgen::Error),
    #[error("the mesh CA in {path} is unusable")]
    Stored {
        path: std::path::PathBuf,
        #[source]
        source: rcgen::Error,
    },
    #[error("the mesh CA directory {path} {problem}: it holds the root key, so only its owner may enter it")]
    Exposed { path: std::path::PathBuf, problem: String },
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Why a CSR was not signed.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("the CSR is not a valid PEM certificate request")]
    Csr(#[source] rcgen::Error),
    #[error("certificate refused")]
    Refused(#[source] Refusal),
    #[error("signing the workload certificate failed")]
    Sign(#[source] rcgen::Error),
}

impl SignError {
    /// The answer a gRPC client gets, naming the reason.
    pub fn to_status(&self) -> tonic::Status {
        let code = match self {
            Self::Csr(_) => tonic::Code::InvalidArgument,
            Self::Refused(refusal) => refusal.code(),
            Self::Sign(_) => tonic::Code::Internal,
        };
        tonic::Status::new(code, crate::error_chain(self))
    }
}

/// A signed workload certificate.
#[derive(Debug, Clone)]
pub struct Signed {
    /// The leaf (PEM).
    pub leaf_pem: String,
    /// What it was signed for.
    pub approved: Approved,
}

/// The root and its key. Clones share them.
#[derive(Clone)]
pub struct MeshCa {
    root: Arc<Root>,
}

struct Root {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
    /// The signing key, PEM (kept to persist the root).
    key_pem: String,
}

impl MeshCa {
    /// A fresh self-signed root named `org`, valid for ten years.
    pub fn generate(org: &str) -> Result<Self, CaError> {
        let key = rcgen::KeyPair::generate().map_err(CaError::Root)?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(CaError::Root)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::OrganizationName, org);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(ROOT_DAYS);
        let cert = params.self_signed(&key).map_err(CaError::Root)?;
        let root =
            Root { pem: cert.pem(), key_pem: key.serialize_pem(), issuer: rcgen::Issuer::new(params, key) };
        Ok(Self { root: Arc::new(root) })
    }

    /// The mesh CA kept in `dir`: loaded when it is there, else generated and written
    /// (key 0600) in a directory only its owner may enter (0700, see `private_dir`).
    /// Agents of one user sharing `dir` share the CA; a lock file makes concurrent
    /// first starts agree on one root.
    pub fn load_or_create(org: &str, dir: &Path) -> Result<Self, CaError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let io = |what, path: &Path| {
            let path = path.to_path_buf();
            move |source| CaError::Io { what, path, source }
        };
        private_dir(dir)?;
        let lock_path = dir.join(".lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .map_err(io("open", &lock_path))?;
        let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| CaError::Io { what: "lock", path: lock_path.clone(), source: e.into() })?;
        if dir.join(ROOT_KEY_FILE).exists() {
            return Self::load(dir);
        }
        let ca = Self::generate(org)?;
        // The key's file is 0600 from its creation, never a leftover someone holds.
        for (name, text, mode) in
            [(ROOT_KEY_FILE, &ca.root.key_pem, 0o600), (ROOT_CERT_FILE, &ca.root.pem, 0o644)]
        {
            crate::support::atomic_file::write(&dir.join(name), text.as_bytes(), mode)
                .map_err(|e| CaError::Io { what: e.what, path: e.path, source: e.source })?;
        }
        Ok(ca)
    }

    /// The root kept in `dir` (`root-cert.pem`, `root-key.pem`).
    fn load(dir: &Path) -> Result<Self, CaError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(|source| CaError::Io { what: "read", path, source })
        };
        let (pem, key_pem) = (read(ROOT_CERT_FILE)?, read(ROOT_KEY_FILE)?);
        let stored = |source| CaError::Stored { path: dir.into(), source };
        let key = rcgen::KeyPair::from_pem(&key_pem).map_err(stored)?;
        let issuer = rcgen::Issuer::from_ca_cert_pem(&pem, key).map_err(stored)?;
        Ok(Self { root: Arc::new(Root { issuer, pem, key_pem }) })
    }

    /// The root certificate (PEM).
    pub fn root_pem(&self) -> &str {
        &self.root.pem
    }

    /// Signs `csr_pem` (its signature checked: the requester holds the key) as `policy`
    /// approves it for `requested_seconds` (`IstioCertificateRequest.validity_duration`):
    /// a leaf with an empty subject, the approved SPIFFE ID as its only SAN, not a CA,
    /// valid for the approved lifetime (back-dated a minute for clock skew).
    pub fn sign(
        &self,
        csr_pem: &str,
        requested_seconds: i64,
        policy: &SigningPolicy,
    ) -> Result<Signed, SignError> {
        let mut csr = rcgen::CertificateSigningRequestParams::from_pem(csr_pem).map_err(SignError::Csr)?;
        let approved =
            policy.check(&csr.params.subject_alt_names, requested_seconds).map_err(SignError::Refused)?;
        let identity =
            rcgen::string::Ia5String::try_from(approved.identity.as_str()).map_err(SignError::Sign)?;
        // Only what the policy approved: nothing else the CSR asked for is carried over.
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.subject_alt_names = vec![rcgen::SanType::URI(identity)];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::minutes(1);
        params.not_after =
            now + time::Duration::try_from(approved.lifetime).unwrap_or(time::Duration::days(1));
        params.is_ca = rcgen::IsCa::ExplicitNoCa;
        params.key_usages =
            vec![rcgen::KeyUsagePurpose::DigitalSignature, rcgen::KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&rand::random::<[u8; 16]>()));
        csr.params = params;
        let cert = csr.signed_by(&self.root.issuer).map_err(SignError::Sign)?;
        Ok(Signed { leaf_pem: cert.pem(), approved })
    }
}

/// Makes `dir` 0700 (its parents as usual), or checks the one there: a directory (not
/// a symlink) owned by this user. One this user owns but others may enter (made by an
/// earlier Weir, 0755) is closed, with a warning; one owned by another user is refused.
fn private_dir(dir: &Path) -> Result<(), CaError> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
    let io = |what, source| CaError::Io { what, path: dir.into(), source };
    let exposed = |problem: String| CaError::Exposed { path: dir.into(), problem };
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|source| CaError::Io {
            what: "create",
            path: parent.into(),
            source,
        })?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io("create", e)),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| io("inspect", e))?;
    if !meta.file_type().is_dir() {
        return Err(exposed("is not a directory (a symlink or a file)".into()));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(exposed(format!("is owned by uid {}, not by this agent's uid {me}", meta.uid())));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        tracing::warn!(path = %dir.display(), mode = format!("{mode:04o}"), "the mesh CA directory was open to others; closing it (0700)");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| io("chmod", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::sidecar::identity::WorkloadIdentity;

    const OWN: &str = "spiffe://cluster.local/ns/default/sa/app";

    fn policy(ttl: u64) -> SigningPolicy {
        let id = WorkloadIdentity {
            trust_domain: "cluster.local".into(),
            namespace: "default".into(),
            service_account: "app".into(),
        };
        SigningPolicy::new(&id, Duration::from_secs(ttl))
    }

    /// A CSR asking for more than an identity: a subject, CA rights, code signing.
    fn greedy_csr(uri: &str) -> (String, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![rcgen::SanType::URI(uri.try_into().unwrap())];
        params.distinguished_name.push(rcgen::DnType::CommonName, "root of everything");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::CodeSigning];
        (params.serialize_request(&key).unwrap().pem().unwrap(), key)
    }

    #[test]
    fn a_certificate_carries_what_the_policy_approved_and_nothing_else() {
        let ca = MeshCa::generate("mesh").unwrap();
        let (csr, key) = greedy_csr(OWN);
        let signed = ca.sign(&csr, 10 * 365 * 86_400, &policy(3600)).unwrap();
        assert!(signed.approved.capped);
        let (_, pem) = x509_parser::pem::parse_x509_pem(signed.leaf_pem.as_bytes()).unwrap();
        let leaf = pem.parse_x509().unwrap();
        let lifetime = leaf.validity().not_after.timestamp() - leaf.validity().not_before.timestamp();
        assert_eq!(lifetime, 3600 + 60, "the TTL plus the minute of back-dating");
        assert_eq!(leaf.subject().to_string(), "", "no subject from the CSR");
        assert!(!leaf.is_ca());
        let eku = leaf.extended_key_usage().unwrap().unwrap().value;
        assert!(eku.server_auth && eku.client_auth && !eku.code_signing);
        let sans = &leaf.subject_alternative_name().unwrap().unwrap().value.general_names;
        assert_eq!(sans.len(), 1);
        assert!(matches!(sans[0], x509_parser::extensions::GeneralName::URI(u) if u == OWN));
        use rcgen::PublicKeyData as _;
        assert_eq!(leaf.public_key().raw, key.subject_public_key_info().as_slice(), "the key of the CSR");

        let (other, _) = greedy_csr("spiffe://cluster.local/ns/default/sa/admin");
        let e = ca.sign(&other, 600, &policy(3600)).unwrap_err();
        let status = e.to_status();
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(status.message().contains("sa/admin") && status.message().contains(OWN), "{status:?}");
        let e = ca.sign("not a CSR", 600, &policy(3600)).unwrap_err();
        assert_eq!(e.to_status().code(), tonic::Code::InvalidArgument);
    }

    /// The root key never passes through a file that was already there (a leftover
    /// temporary file someone holds open, under this or an earlier name).
    #[test]
    fn the_root_key_is_written_to_a_file_of_its_own() {
        use std::io::Read as _;
        let dir = tempfile::tempdir().unwrap();
        let mut held = Vec::new();
        for name in [".root-key.pem.tmp", ".root-key.pem.weir-tmp"] {
            let leftover = dir.path().join(name);
            std::fs::write(&leftover, b"").unwrap();
            held.push(std::fs::File::open(&leftover).unwrap());
        }
        let ca = MeshCa::load_or_create("mesh", dir.path()).unwrap();
        for mut file in held {
            let mut seen = String::new();
            file.read_to_string(&mut seen).unwrap();
            assert_eq!(seen, "", "the root key went through a file opened before it was written");
        }
        assert_eq!(std::fs::read_to_string(dir.path().join(ROOT_KEY_FILE)).unwrap(), ca.root.key_pem);
    }

    /// The root key's directory is the CA's own: made 0700, an open one (an older
    /// Weir's 0755) closed, another user's or a symlink refused, naming the path.
    #[test]
    fn the_state_directory_is_for_its_owner_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
        let dir = tempfile::tempdir().unwrap();
        let fresh = dir.path().join("state").join("ca");
        MeshCa::load_or_create("mesh", &fresh).unwrap();
        assert_eq!(mode(&fresh), 0o700);

        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        MeshCa::load_or_create("mesh", &open).unwrap();
        assert_eq!(mode(&open), 0o700);

        let theirs = dir.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(4242), Some(4242)).unwrap();
        let e = MeshCa::load_or_create("mesh", &theirs).err().expect("another user's directory").to_string();
        assert!(e.contains(&theirs.display().to_string()) && e.contains("uid 4242"), "{e}");
        assert!(!theirs.join(ROOT_KEY_FILE).exists());

        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        let e = MeshCa::load_or_create("mesh", &link).err().expect("a symlink").to_string();
        assert!(e.contains(&link.display().to_string()) && e.contains("symlink"), "{e}");
    }

    #[test]
    fn a_stored_root_is_reused() {
        let dir = tempfile::tempdir().unwrap();
        let first = MeshCa::load_or_create("mesh", dir.path()).unwrap();
        let again = MeshCa::load_or_create("mesh", dir.path()).unwrap();
        assert_eq!(first.root_pem(), again.root_pem());
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join(ROOT_KEY_FILE)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(dir.path().join(ROOT_KEY_FILE), "garbage").unwrap();
        let e = MeshCa::load_or_create("mesh", dir.path()).err().unwrap().to_string();
        assert!(e.contains("unusable") && e.contains(&dir.path().display().to_string()), "{e}");
    }
}
