//! Sandboxed "pods" on one host: named network namespaces joined to a hub bridge by
//! veth pairs, cgroup v2 directories, and processes placed into both. `weir demo` and
//! the test rig (`weir-tests`) build on this; nothing here touches the host namespace's
//! network configuration.
//!
//! Every object is named `weir-<pid>-<n>-<tag>...` after the process that made it, and
//! removed by `Drop`, also on panic. [`reap`] removes what a process that died without
//! unwinding (SIGKILL, a timeout) left behind.

pub mod cgroup;
pub mod mesh;
pub mod netns;
pub mod process;
pub mod reap;

pub use cgroup::Cgroup;
pub use mesh::{Mesh, Pod};
pub use netns::NetNs;
pub use process::{Placement, PodChild};
pub use reap::{Leftover, leftovers, reap};

use std::path::PathBuf;

/// Prefix of every sandbox object's name.
pub const NAME_PREFIX: &str = "weir-";

/// Failures while building or tearing down a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}")]
    Sys {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no cgroup v2 (cgroup2) mount found in /proc/self/mountinfo")]
    NoCgroup2,
    #[error(transparent)]
    Netlink(#[from] weir_iptables::netlink::NetlinkError),
    #[error("thread in network namespace {netns} panicked")]
    ThreadPanicked { netns: String },
}

impl SandboxError {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { what, path, source }
    }
    pub(crate) fn sys(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| Self::Sys { what, source }
    }
}

/// A unique object name for this process: `weir-<pid>-<n>-<tag>`, `tag` reduced to
/// `[a-z0-9-]` and shortened so the result stays readable in `ip netns` listings.
pub fn unique_name(tag: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut clean: String =
        tag.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    // Keep the informative tail of long test paths (module::test_name).
    if clean.len() > 40 {
        clean = clean[clean.len() - 40..].to_string();
    }
    let clean = clean.trim_matches('-');
    format!("{NAME_PREFIX}{}-{n}-{clean}", std::process::id())
}

/// The creating process's pid encoded in a sandbox name, if it is one.
pub fn owner_pid(name: &str) -> Option<u32> {
    name.strip_prefix(NAME_PREFIX)?.split('-').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_pid_and_a_clean_tag() {
        let name = unique_name("capture::Tests/ipv6 Redirect");
        assert_eq!(owner_pid(&name), Some(std::process::id()));
        assert!(name.ends_with("capture--tests-ipv6-redirect"), "{name}");
        assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
    }

    #[test]
    fn long_tags_keep_their_tail() {
        let name = unique_name(&format!("{}the_end", "x".repeat(100)));
        assert!(name.ends_with("the-end"));
        assert!(name.len() < 60);
    }

    #[test]
    fn owner_pid_rejects_foreign_names() {
        assert_eq!(owner_pid("cni-1234"), None);
        assert_eq!(owner_pid("weir-abc-1"), None);
        assert_eq!(owner_pid("weir-42-0-x"), Some(42));
    }
}
