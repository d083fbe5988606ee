//! Which capture backend this machine can run: eBPF if the kernel verifies and loads
//! every capture program and offers what they need (and, for one pod's cgroup, when
//! the programs its ancestors run leave eBPF capture safe: `ancestors`), else native
//! nftables if `nft` works, else iptables. The choice comes with the reasons, one line
//! each.

use std::path::Path;

use super::{
    ancestors::{self, Probe},
    capture::cgroup_hook_types,
    netns::netns_cookie,
    set,
};

/// A capture backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Ebpf,
    Nftables,
    Iptables,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Ebpf => "ebpf",
            Backend::Nftables => "nftables",
            Backend::Iptables => "iptables",
        })
    }
}

/// `--capture-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum CaptureMode {
    #[default]
    Auto,
    Ebpf,
    Nftables,
    Iptables,
}

/// The backend chosen and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Choice {
    pub backend: Backend,
    /// Why each better backend was not taken, or why this one was.
    pub reasons: Vec<String>,
}

impl std::fmt::Display for Choice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "capture backend: {} ({})", self.backend, self.reasons.join("; "))
    }
}

/// A forced backend that cannot work here.
#[derive(Debug, thiserror::Error)]
#[error("--capture-mode={backend} cannot work on this machine: {reason}")]
pub struct Unavailable {
    pub backend: Backend,
    pub reason: String,
}

/// Why eBPF capture cannot run here before any program is loaded (cgroup v2, the
/// netns cookie, real objects in this binary), or `None`.
pub fn ebpf_prerequisites() -> Option<String> {
    if crate::support::cgroup2::mount().is_err() {
        return Some("no cgroup v2 mount (eBPF capture attaches to a pod's cgroup v2 directory)".into());
    }
    if let Err(e) = netns_cookie(None) {
        return Some(format!(
            "the kernel has no SO_NETNS_COOKIE (Linux 5.14+; the capture programs need 5.15+): {e}"
        ));
    }
    if super::objects::IS_STUB {
        return Some("this binary was built without eBPF objects (WEIR_EBPF_STUB=1)".into());
    }
    None
}

/// Why eBPF capture cannot run here, or `None` if it can. The programs are verified
/// once: a node that has this Weir's program set pinned passed already, and programs
/// loaded here are kept for the set this process pins next.
pub fn ebpf_unavailable() -> Option<String> {
    if let Some(why) = ebpf_prerequisites() {
        return Some(why);
    }
    match set::verify_once() {
        Ok(()) => None,
        Err(e) => Some(format!("the kernel rejected the capture programs: {}", crate::error_chain(&e))),
    }
}

/// Why eBPF capture of the cgroup `cgroup` is unsafe (a program its ancestors run,
/// named with its cgroup and why: `ancestors`), or why that could not be read; `None`
/// when it is safe. Before anything of Weir's is attached there, a pass-through probe
/// may be attached for a moment to tell the programs' order.
pub fn ebpf_unsafe_for(cgroup: &Path) -> Option<String> {
    match ancestors::check(cgroup, &cgroup_hook_types(), Probe::Attach) {
        Ok(()) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// Why native nftables cannot run here, or `None`.
pub fn nftables_unavailable() -> Option<String> {
    match std::process::Command::new("nft").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!("`nft --version` failed: {}", String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => Some(format!("no nft binary: {e}")),
    }
}

/// Why iptables cannot run here, or `None`.
pub fn iptables_unavailable() -> Option<String> {
    let found = ["iptables", "iptables-nft", "iptables-legacy"]
        .iter()
        .any(|b| std::process::Command::new(b).arg("--version").output().is_ok_and(|o| o.status.success()));
    (!found).then(|| "no iptables binary (iptables, iptables-nft or iptables-legacy)".into())
}

/// Chooses a backend for `mode` on this machine, logging one line that says which and
/// why. For one pod's cgroup, [`choose_for`].
pub fn choose(mode: CaptureMode) -> Result<Choice, Unavailable> {
    choose_with(mode, ebpf_unavailable)
}

/// [`choose`] for capturing the cgroup `cgroup`: eBPF also needs its ancestors'
/// programs to leave eBPF capture safe ([`ebpf_unsafe_for`]); `auto` picks netfilter
/// where they do not, naming the program, its cgroup and why, and a forced eBPF fails
/// with the same words.
pub fn choose_for(mode: CaptureMode, cgroup: &Path) -> Result<Choice, Unavailable> {
    choose_with(mode, || ebpf_unavailable().or_else(|| ebpf_unsafe_for(cgroup)))
}

fn choose_with(mode: CaptureMode, ebpf_why: impl FnOnce() -> Option<String>) -> Result<Choice, Unavailable> {
    let forced = |backend: Backend, why: Option<String>| match why {
        None => Ok(Choice { backend, reasons: vec!["forced by --capture-mode".into()] }),
        Some(reason) => Err(Unavailable { backend, reason }),
    };
    let choice = match mode {
        CaptureMode::Ebpf => forced(Backend::Ebpf, ebpf_why())?,
        CaptureMode::Nftables => forced(Backend::Nftables, nftables_unavailable())?,
        CaptureMode::Iptables => forced(Backend::Iptables, iptables_unavailable())?,
        CaptureMode::Auto => {
            let mut reasons = Vec::new();
            match ebpf_why() {
                None => {
                    reasons.push("the kernel verified and loaded every capture program".into());
                    Choice { backend: Backend::Ebpf, reasons }
                }
                Some(why) => {
                    reasons.push(format!("not ebpf: {why}"));
                    match nftables_unavailable() {
                        None => {
                            reasons.push("nft works".into());
                            Choice { backend: Backend::Nftables, reasons }
                        }
                        Some(why) => {
                            reasons.push(format!("not nftables: {why}"));
                            if let Some(why) = iptables_unavailable() {
                                return Err(Unavailable {
                                    backend: Backend::Iptables,
                                    reason: format!("{}; {why}", reasons.join("; ")),
                                });
                            }
                            Choice { backend: Backend::Iptables, reasons }
                        }
                    }
                }
            }
        }
    };
    tracing::info!(backend = %choice.backend, reasons = %choice.reasons.join("; "), "capture backend chosen");
    Ok(choice)
}

/// The cgroup v2 directory a process is in (`/proc/<pid>/cgroup`, the `0::` line),
/// as a path under the cgroup2 mount.
pub fn cgroup_of(pid: u32) -> std::io::Result<std::path::PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let rel = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or_else(|| std::io::Error::other("process has no cgroup v2 membership"))?;
    let root = crate::support::cgroup2::mount().map_err(std::io::Error::other)?;
    Ok(root.join(Path::new(rel.trim_start_matches('/'))))
}
