//! What this kernel and host should give Weir's capture, worked out from plain facts
//! (the kernel's release, whether cgroup v2 is mounted) and not from Weir's own probe,
//! so that tests can hold `weir capture detect`, `capture apply` and the CNI node agent
//! to it on every kernel of the matrix (vagrant/qemu-kernels) and on the host.

use std::path::{Path, PathBuf};

use weir_agent::{
    sandbox::{Cgroup, unique_name},
    support::cgroup2::parse_mount as parse_cgroup2_mount,
};

/// The backend `auto` must pick here, and a phrase the reason must contain when it is
/// not eBPF.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedCapture {
    pub backend: &'static str,
    /// `None` when eBPF is expected.
    pub because: Option<&'static str>,
}

impl ExpectedCapture {
    pub fn ebpf(&self) -> bool {
        self.because.is_none()
    }
}

/// From the facts of this machine (see `expected_for`).
pub fn expected_capture() -> ExpectedCapture {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("read the kernel's release");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
    expected_for(release.trim(), parse_cgroup2_mount(&mountinfo).is_some())
        .unwrap_or_else(|| panic!("cannot read a version from the kernel release {release:?}"))
}

/// eBPF capture needs a cgroup v2 mount (it attaches to the pod's cgroup),
/// SO_NETNS_COOKIE (Linux 5.14) and `bpf_get_netns_cookie` in sockops and sk_msg
/// programs (Linux 5.15); without them, `auto` falls back to nftables (this rig always
/// has nft), naming the missing socket option before 5.14 and the verifier's refusal
/// on 5.14. `None` when `release` has no major.minor.
pub fn expected_for(release: &str, cgroup2: bool) -> Option<ExpectedCapture> {
    let mut numbers = release.split(|c: char| !c.is_ascii_digit()).map(str::parse::<u32>);
    let (major, minor) = (numbers.next()?.ok()?, numbers.next()?.ok()?);
    let because = if !cgroup2 {
        Some("no cgroup v2 mount")
    } else if (major, minor) < (5, 14) {
        Some("SO_NETNS_COOKIE")
    } else if (major, minor) < (5, 15) {
        Some("the kernel rejected the capture programs")
    } else {
        None
    };
    Some(ExpectedCapture { backend: if because.is_some() { "nftables" } else { "ebpf" }, because })
}

/// The cgroup a test's pod lives in: a cgroup v2 directory where there is a v2 mount,
/// else a directory in the first cgroup v1 hierarchy (which eBPF capture must refuse).
/// Removed on drop.
pub enum PodCgroup {
    V2(Cgroup),
    V1(PathBuf),
}

impl PodCgroup {
    pub fn create(test: &str) -> Self {
        let info = std::fs::read_to_string("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
        if parse_cgroup2_mount(&info).is_some() {
            return Self::V2(crate::test_cgroup(test));
        }
        let hierarchy = info
            .lines()
            .find_map(|l| {
                let (left, right) = l.split_once(" - ")?;
                (right.split_whitespace().next()? == "cgroup").then(|| left.split_whitespace().nth(4))?
            })
            .unwrap_or_else(|| panic!("no cgroup v2 mount and no cgroup v1 hierarchy either:\n{info}"));
        let dir = Path::new(hierarchy).join(unique_name(test));
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        Self::V1(dir)
    }

    pub fn path(&self) -> &Path {
        match self {
            Self::V2(c) => c.path(),
            Self::V1(p) => p,
        }
    }

    /// For `Placement::cgroup`: processes join only a v2 cgroup.
    pub fn v2(&self) -> Option<&Cgroup> {
        match self {
            Self::V2(c) => Some(c),
            Self::V1(_) => None,
        }
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        if let Self::V1(dir) = self {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expectation_follows_the_release_and_the_cgroup_mount() {
        let e = |r, c| expected_for(r, c).unwrap();
        assert_eq!(e("5.10.0-32-amd64", true).because, Some("SO_NETNS_COOKIE"));
        assert_eq!(e("5.13.19", true).backend, "nftables");
        assert_eq!(e("5.14.0", true).because, Some("the kernel rejected the capture programs"));
        assert!(e("5.15.0", true).ebpf());
        assert!(e("6.12.95+deb12-amd64", true).ebpf());
        assert!(e("6.18.0", true).ebpf());
        assert_eq!(e("6.12.95+deb12-amd64", false).because, Some("no cgroup v2 mount"));
        assert_eq!(expected_for("weird", true), None);
    }
}
