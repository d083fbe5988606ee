//! Privilege checks done before privileged work starts, so a missing capability is
//! reported by name instead of surfacing as EPERM halfway through.

use std::fmt;

/// The Linux capabilities Weir's commands need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    NetAdmin,
    NetRaw,
    SysAdmin,
    Bpf,
    Perfmon,
    Setuid,
    Setgid,
    Kill,
    SysPtrace,
}

impl Capability {
    fn caps(self) -> caps::Capability {
        match self {
            Capability::NetAdmin => caps::Capability::CAP_NET_ADMIN,
            Capability::NetRaw => caps::Capability::CAP_NET_RAW,
            Capability::SysAdmin => caps::Capability::CAP_SYS_ADMIN,
            Capability::Bpf => caps::Capability::CAP_BPF,
            Capability::Perfmon => caps::Capability::CAP_PERFMON,
            Capability::Setuid => caps::Capability::CAP_SETUID,
            Capability::Setgid => caps::Capability::CAP_SETGID,
            Capability::Kill => caps::Capability::CAP_KILL,
            Capability::SysPtrace => caps::Capability::CAP_SYS_PTRACE,
        }
    }
}

impl Capability {
    /// The kernel's number for it (`CAP_NET_ADMIN` is 12).
    pub fn index(self) -> u8 {
        self.caps().index()
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.caps())
    }
}

/// The capabilities a command needs that the process lacks.
#[derive(Debug, thiserror::Error)]
#[error("{what} needs {} (missing from the effective capability set)", list(.missing))]
pub struct MissingCapabilities {
    pub what: String,
    pub missing: Vec<Capability>,
}

fn list(missing: &[Capability]) -> String {
    missing.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// Checks the effective set for every capability in `needed`.
pub fn require(needed: &[Capability], what: &str) -> Result<(), MissingCapabilities> {
    let missing: Vec<Capability> = needed
        .iter()
        .copied()
        .filter(|c| !caps::has_cap(None, caps::CapSet::Effective, c.caps()).unwrap_or(false))
        .collect();
    if missing.is_empty() { Ok(()) } else { Err(MissingCapabilities { what: what.to_string(), missing }) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_names_every_missing_capability() {
        let e = MissingCapabilities {
            what: "istio-iptables".into(),
            missing: vec![Capability::NetAdmin, Capability::NetRaw],
        };
        assert_eq!(
            e.to_string(),
            "istio-iptables needs CAP_NET_ADMIN, CAP_NET_RAW (missing from the effective capability set)"
        );
    }
}
