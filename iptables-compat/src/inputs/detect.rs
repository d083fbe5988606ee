//! Facts about the pod that Istio detects rather than takes as flags: whether IPv6 is in
//! use (from the pod's first usable address), the DNS servers in /etc/resolv.conf, and
//! user/group names. Parsing is pure; [`SystemFacts`] reads the real machine.

use std::{
    net::{IpAddr, Ipv6Addr},
    path::PathBuf,
};

/// What config building needs from the host; tests pass fixed facts.
pub trait HostFacts {
    /// Every interface address, in the kernel's dump order (IPv4 before IPv6).
    fn addresses(&self) -> std::io::Result<Vec<IpAddr>>;
    /// The text of /etc/resolv.conf.
    fn resolv_conf(&self) -> std::io::Result<String>;
    /// The uid of a user name.
    fn user_id(&self, name: &str) -> Option<u32>;
    /// Whether a group name exists.
    fn group_exists(&self, name: &str) -> bool;
}

/// The real host, optionally looking at addresses inside another network namespace.
#[derive(Debug, Clone, Default)]
pub struct SystemFacts {
    pub netns: Option<PathBuf>,
}

impl HostFacts for SystemFacts {
    fn addresses(&self) -> std::io::Result<Vec<IpAddr>> {
        let read = || -> std::io::Result<Vec<IpAddr>> {
            let addrs = nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)?;
            let mut v4 = Vec::new();
            let mut v6 = Vec::new();
            for ifa in addrs {
                let Some(addr) = ifa.address else { continue };
                if let Some(sin) = addr.as_sockaddr_in() {
                    v4.push(IpAddr::V4(sin.ip()));
                } else if let Some(sin6) = addr.as_sockaddr_in6() {
                    v6.push(IpAddr::V6(sin6.ip()));
                }
            }
            v4.extend(v6);
            Ok(v4)
        };
        match &self.netns {
            None => read(),
            Some(path) => {
                let file = std::fs::File::open(path)?;
                std::thread::scope(|s| {
                    s.spawn(|| {
                        use std::os::fd::AsFd as _;
                        nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                            .map_err(std::io::Error::from)?;
                        read()
                    })
                    .join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("address thread panicked")))
                })
            }
        }
    }

    fn resolv_conf(&self) -> std::io::Result<String> {
        std::fs::read_to_string("/etc/resolv.conf")
    }

    fn user_id(&self, name: &str) -> Option<u32> {
        nix::unistd::User::from_name(name).ok().flatten().map(|u| u.uid.as_raw())
    }

    fn group_exists(&self, name: &str) -> bool {
        nix::unistd::Group::from_name(name).ok().flatten().is_some()
    }
}

fn is_link_local_unicast(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

fn is_link_local_multicast(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.octets()[..3] == [224, 0, 0],
        IpAddr::V6(v6) => v6.segments()[0] & 0xff0f == 0xff02,
    }
}

fn unmap(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

/// Istio's getLocalIP: the pod's address and whether IPv6 is enabled. Without
/// dual-stack the first usable address decides; with it, any IPv6 address enables IPv6.
pub fn local_ip(addresses: &[IpAddr], dual_stack: bool) -> Option<(IpAddr, bool)> {
    let mut found: Vec<IpAddr> = Vec::new();
    let mut ipv6 = false;
    for ip in addresses.iter().copied().map(unmap) {
        if ip.is_loopback() || is_link_local_unicast(ip) || is_link_local_multicast(ip) {
            continue;
        }
        ipv6 = ip.is_ipv6();
        found.push(ip);
        if !dual_stack {
            return Some((ip, ipv6));
        }
        if ipv6 {
            break;
        }
    }
    found.first().map(|ip| (*ip, ipv6))
}

/// The `nameserver` addresses in a resolv.conf, split by family as Istio splits them
/// (`IPsSplitV4V6`: an IPv4-mapped IPv6 address stays IPv6), each printed as the
/// kernel's tools print it ([`ipv6_text`]). Unparsable entries are skipped, as Istio does.
pub fn resolv_conf_servers(text: &str) -> (Vec<String>, Vec<String>) {
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        let Some(addr) = words.next() else { continue };
        match addr.parse::<IpAddr>() {
            Ok(IpAddr::V4(a)) => v4.push(a.to_string()),
            Ok(IpAddr::V6(a)) => v6.push(ipv6_text(a)),
            Err(_) => tracing::debug!(addr, "ignoring unparsable nameserver"),
        }
    }
    (v4, v6)
}

/// An IPv6 address as `inet_ntop` (and so `ip6tables-save`) writes it, which is also
/// how Istio's goldens show it: RFC 5952 text, except that an IPv4-compatible
/// (`::a.b.c.d`) or IPv4-mapped (`::ffff:a.b.c.d`) address keeps its dotted tail.
pub fn ipv6_text(a: Ipv6Addr) -> String {
    let s = a.segments();
    let compatible = s[..6] == [0; 6] && s[6] != 0;
    let mapped = s[..5] == [0; 5] && s[5] == 0xffff;
    if compatible || mapped {
        let [.., a1, a2, a3, a4] = a.octets();
        let tail = std::net::Ipv4Addr::new(a1, a2, a3, a4);
        return if mapped { format!("::ffff:{tail}") } else { format!("::{tail}") };
    }
    a.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn the_first_usable_address_decides_without_dual_stack() {
        let a = ips(&["127.0.0.1", "10.66.0.10", "::1", "fd00:66::a", "fe80::1"]);
        assert_eq!(local_ip(&a, false), Some(("10.66.0.10".parse().unwrap(), false)));
        assert_eq!(local_ip(&a, true), Some(("10.66.0.10".parse().unwrap(), true)));
        let v6only = ips(&["127.0.0.1", "::1", "fe80::1", "fd00:66::a"]);
        assert_eq!(local_ip(&v6only, false), Some(("fd00:66::a".parse().unwrap(), true)));
        assert_eq!(local_ip(&ips(&["127.0.0.1", "169.254.1.1", "::1"]), false), None);
    }

    #[test]
    fn resolv_conf_servers_split_by_family() {
        let text = "# comment\nsearch ns.svc.cluster.local\nnameserver 10.96.0.10\nnameserver fd00::10\nnameserver bogus\noptions ndots:5\n";
        assert_eq!(resolv_conf_servers(text), (vec!["10.96.0.10".to_string()], vec!["fd00::10".to_string()]));
    }

    #[test]
    fn ipv6_servers_print_as_inet_ntop_does() {
        let text = "nameserver ::127.0.0.53\nnameserver ::ffff:10.0.0.1\nnameserver FD00:0::10\nnameserver ::1\nnameserver ::0.0.0.2\n";
        let (v4, v6) = resolv_conf_servers(text);
        assert!(v4.is_empty(), "an IPv4-mapped server stays IPv6, as Istio splits it: {v4:?}");
        assert_eq!(v6, ["::127.0.0.53", "::ffff:10.0.0.1", "fd00::10", "::1", "::2"]);
    }
}
