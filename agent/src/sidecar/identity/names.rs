//! The SDS resource names Envoy asks for, as Istio spells them: `default` (the workload
//! key and chain), `ROOTCA` (the mesh root), `file-cert:<cert>~<key>` and
//! `file-root:<path>` (files named by the resource itself, used by DestinationRules and
//! gateways), and `file-root:system` (the OS trust bundle).

use std::{fmt, path::PathBuf};

pub const WORKLOAD: &str = "default";
pub const ROOT_CA: &str = "ROOTCA";
pub const FILE_CERT_PREFIX: &str = "file-cert:";
pub const FILE_ROOT_PREFIX: &str = "file-root:";
/// `file-root:system`: the OS trust bundle.
pub const SYSTEM_ROOT: &str = "file-root:system";
/// Where Debian and its derivatives keep the OS trust bundle.
pub const SYSTEM_ROOT_PATH: &str = "/etc/ssl/certs/ca-certificates.crt";

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SecretName {
    Workload,
    RootCa,
    FileCert { cert: PathBuf, key: PathBuf },
    FileRoot(PathBuf),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "unknown SDS resource {0:?}: expected \"default\", \"ROOTCA\", \"file-cert:<cert path>~<key path>\" or \"file-root:<path>\""
)]
pub struct UnknownSecret(pub String);

impl SecretName {
    pub fn parse(name: &str) -> Result<Self, UnknownSecret> {
        let unknown = || UnknownSecret(name.into());
        if name == WORKLOAD {
            return Ok(Self::Workload);
        }
        if name == ROOT_CA {
            return Ok(Self::RootCa);
        }
        if name == SYSTEM_ROOT {
            return Ok(Self::FileRoot(SYSTEM_ROOT_PATH.into()));
        }
        if let Some(rest) = name.strip_prefix(FILE_CERT_PREFIX) {
            let (cert, key) = rest.split_once('~').ok_or_else(unknown)?;
            if cert.is_empty() || key.is_empty() {
                return Err(unknown());
            }
            return Ok(Self::FileCert { cert: cert.into(), key: key.into() });
        }
        if let Some(path) = name.strip_prefix(FILE_ROOT_PREFIX).filter(|p| !p.is_empty()) {
            return Ok(Self::FileRoot(path.into()));
        }
        Err(unknown())
    }

    /// A root (validation context) rather than a key and certificate.
    pub fn is_root(&self) -> bool {
        matches!(self, Self::RootCa | Self::FileRoot(_))
    }
}

impl fmt::Display for SecretName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Workload => f.write_str(WORKLOAD),
            Self::RootCa => f.write_str(ROOT_CA),
            Self::FileCert { cert, key } => {
                write!(f, "{FILE_CERT_PREFIX}{}~{}", cert.display(), key.display())
            }
            Self::FileRoot(p) if p.as_os_str() == SYSTEM_ROOT_PATH => f.write_str(SYSTEM_ROOT),
            Self::FileRoot(p) => write!(f, "{FILE_ROOT_PREFIX}{}", p.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for name in [
            "default",
            "ROOTCA",
            "file-cert:/etc/c.pem~/etc/k.pem",
            "file-root:/etc/r.pem",
            "file-root:system",
        ] {
            assert_eq!(SecretName::parse(name).unwrap().to_string(), name);
        }
        assert_eq!(
            SecretName::parse("file-cert:/c~/k").unwrap(),
            SecretName::FileCert { cert: "/c".into(), key: "/k".into() }
        );
        for bad in ["", "rootca", "kubernetes://secret", "file-cert:/c", "file-cert:~/k", "file-root:"] {
            let e = SecretName::parse(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }
}
