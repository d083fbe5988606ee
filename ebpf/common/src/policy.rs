//! The outbound capture decision, as a pure function shared by the connect programs
//! (compiled for the kernel) and host tests. It reproduces Istio's ISTIO_OUTPUT order:
//! excluded ports; Envoy's inbound passthrough (bound to 127.0.0.6: passed); the
//! proxy's own traffic (passed, except through loopback to anything but 127.0.0.1,
//! i.e. another 127/8 address or the pod's own, which goes to Envoy's inbound side as
//! Istio's `-o lo ! -d 127.0.0.1/32 ... -j ISTIO_IN_REDIRECT` does: this is what
//! istio-validation's probe to 127.0.0.6 relies on; the tunnel port stays out of that
//! redirect); loopback; excluded CIDRs and the pod's own addresses; included ports;
//! included CIDRs. An app's connection to a tunnel port elsewhere is captured, as in
//! Istio (its ISTIO_OUTPUT has no rule for it).
//! Lookups are closures so the kernel does only the ones needed.

use crate::capture::{MAX_PORTS, PodConfig, flags};

/// What a connect should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Leave it alone; the reason is counted.
    Pass(Reason),
    /// Rewrite the destination to the local port given.
    Redirect(u16),
}

/// What the pod's exclusion trie says about a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DstClass {
    Other,
    /// In `-x`.
    Excluded,
    /// One of the pod's own addresses.
    OwnPod,
}

/// Whether a destination is a loopback address, and which kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loopback {
    No,
    /// 127.0.0.1 or ::1.
    Localhost,
    /// Another 127/8 address (127.0.0.6, Istio's validation probe).
    Other,
}

/// 127.0.0.6, the source Envoy's inbound passthrough binds (network order in memory).
pub const INBOUND_PASSTHROUGH_SRC4: u32 = u32::from_ne_bytes([127, 0, 0, 6]);

/// Whether a socket bound to `src` (network order in memory) is Envoy's inbound
/// passthrough to the app, which Istio passes first (`-o lo -s 127.0.0.6/32 -j RETURN`).
#[inline(always)]
pub fn from_inbound_passthrough(src: u32) -> bool {
    src == INBOUND_PASSTHROUGH_SRC4
}

/// The loopback kind of an IPv6 `dst` (network order in memory): `::1` is localhost,
/// and so is `::` (the kernel connects it to `::1`); `::6`, which Istio's validator
/// dials on IPv6 pods, is another loopback address (Istio's rule is `-o lo ! -d
/// ::1/128`).
#[inline(always)]
pub fn loopback6(dst: &[u32; 4]) -> Loopback {
    match (dst[0], dst[1], dst[2], dst[3].to_ne_bytes()) {
        (0, 0, 0, [0, 0, 0, 1] | [0, 0, 0, 0]) => Loopback::Localhost,
        (0, 0, 0, [0, 0, 0, 6]) => Loopback::Other,
        _ => Loopback::No,
    }
}

/// Whether a socket bound to the IPv6 `src` is Envoy's inbound passthrough (`::6`,
/// or 127.0.0.6 mapped).
#[inline(always)]
pub fn from_inbound_passthrough6(src: &[u32; 4]) -> bool {
    let mapped = src[0] == 0 && src[1] == 0 && src[2] == u32::from_ne_bytes([0, 0, 0xff, 0xff]);
    loopback6(src) == Loopback::Other || (mapped && from_inbound_passthrough(src[3]))
}

/// The loopback kind of `dst` (network order in memory). `0.0.0.0` is localhost: the
/// kernel connects it to the socket's own bound address or 127.0.0.1, never off the
/// host, and Istio's rules see it as that local address.
#[inline(always)]
pub fn loopback4(dst: u32) -> Loopback {
    let b = dst.to_ne_bytes();
    match b {
        [127, 0, 0, 1] | [0, 0, 0, 0] => Loopback::Localhost,
        [127, ..] => Loopback::Other,
        _ => Loopback::No,
    }
}

/// Why a connect is left alone: one per rule of Istio's ISTIO_OUTPUT that returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The proxy's own traffic (`--uid-owner`/`--gid-owner` of `-u`/`-g`).
    Proxy,
    /// Envoy's inbound passthrough to the app, bound to 127.0.0.6 (`-s 127.0.0.6/32`).
    InboundPassthrough,
    /// `-o`: an excluded outbound port.
    ExcludedPort,
    /// `-x`: an excluded destination CIDR.
    ExcludedCidr,
    /// The app calling its own pod address.
    OwnPodAddress,
    /// A loopback destination (`-d 127.0.0.1/32`, `-o lo`).
    Loopback,
    /// Neither `-i '*'`, an included CIDR nor an included port (`-q`) matches.
    NotIncluded,
}

impl Reason {
    /// The pod counter slot this reason is counted in.
    pub const fn counter(self) -> u32 {
        use crate::capture::counter::*;
        match self {
            Reason::Proxy => BYPASS_PROXY,
            Reason::InboundPassthrough => BYPASS_INBOUND_PASSTHROUGH,
            Reason::ExcludedPort => BYPASS_EXCLUDED_PORT,
            Reason::ExcludedCidr => BYPASS_EXCLUDED_CIDR,
            Reason::OwnPodAddress => BYPASS_OWN_ADDRESS,
            Reason::Loopback => BYPASS_LOOPBACK,
            Reason::NotIncluded => NOT_INCLUDED,
        }
    }
}

#[inline(always)]
fn in_list(list: &[u16; MAX_PORTS], port: u16) -> bool {
    let mut i = 0;
    while i < MAX_PORTS {
        if list[i] != 0 && list[i] == port {
            return true;
        }
        i += 1;
    }
    false
}

/// The decision for a TCP connect to `dst_port` (host order) by a process with
/// `uid`/`gid`. `loopback` says whether the destination is a loopback address;
/// `classify`/`included` look the destination up in the pod's CIDR lists. Envoy's
/// inbound passthrough ([`from_inbound_passthrough`]) is passed before this is asked.
#[inline(always)]
pub fn outbound_tcp(
    cfg: &PodConfig,
    uid: u32,
    gid: u32,
    dst_port: u16,
    loopback: Loopback,
    classify: impl FnOnce() -> DstClass,
    included: impl FnOnce() -> bool,
) -> Verdict {
    if in_list(&cfg.exclude_ports, dst_port) {
        return Verdict::Pass(Reason::ExcludedPort);
    }
    // Port 53 is special on lo only when DNS is captured (Istio's `! --dport 53`).
    let dns_skipped = dst_port == 53 && cfg.has(flags::REDIRECT_DNS);
    if cfg.is_proxy(uid, gid) {
        // Through lo to anything but localhost: another loopback address, or the pod's
        // own. Istio's rule matches the first proxy uid only: the `-o lo ! --uid-owner
        // <first> -j RETURN` after it passes every other uid and gid-only matches.
        let through_lo = match loopback {
            Loopback::Localhost => false,
            Loopback::Other => true,
            Loopback::No => classify() == DstClass::OwnPod,
        };
        if through_lo && uid == cfg.proxy_uids[0] && dst_port != cfg.tunnel_port && !dns_skipped {
            return Verdict::Redirect(cfg.inbound_port);
        }
        return Verdict::Pass(Reason::Proxy);
    }
    // `-d 127.0.0.1/32 -j RETURN` (::1 for IPv6).
    if loopback == Loopback::Localhost {
        return Verdict::Pass(Reason::Loopback);
    }
    let class = if loopback == Loopback::No { classify() } else { DstClass::Other };
    // An app's traffic through lo (another 127/8 address, the pod's own) is returned by
    // `-o lo -p tcp ! --dport 53 -m owner ! --uid-owner <proxy> -j RETURN`; with DNS
    // captured, port 53 goes on to the rules below, as in Istio.
    let through_lo = loopback == Loopback::Other || class == DstClass::OwnPod;
    if through_lo && !dns_skipped {
        return Verdict::Pass(if class == DstClass::OwnPod {
            Reason::OwnPodAddress
        } else {
            Reason::Loopback
        });
    }
    if class == DstClass::Excluded {
        return Verdict::Pass(Reason::ExcludedCidr);
    }
    if in_list(&cfg.include_ports, dst_port) || cfg.has(flags::CAPTURE_ALL_OUTBOUND) || included() {
        return Verdict::Redirect(cfg.outbound_port);
    }
    Verdict::Pass(Reason::NotIncluded)
}

/// Whether a DNS packet or connect (port 53) by `uid`/`gid` goes to the agent.
#[inline(always)]
pub fn dns(cfg: &PodConfig, uid: u32, gid: u32, dst_port: u16, is_dns_server: impl FnOnce() -> bool) -> bool {
    dst_port == 53
        && cfg.has(flags::REDIRECT_DNS)
        && !cfg.is_proxy(uid, gid)
        && (cfg.has(flags::CAPTURE_ALL_DNS) || is_dns_server())
}

#[cfg(test)]
mod tests {
    extern crate std;

    use super::*;
    use crate::capture::{MAX_IDS, NO_ID};

    fn cfg(flags: u32) -> PodConfig {
        let mut ids = [NO_ID; MAX_IDS];
        ids[0] = 1337;
        let mut exclude = [0; MAX_PORTS];
        exclude[0] = 9090;
        let mut include = [0; MAX_PORTS];
        include[0] = 3306;
        PodConfig {
            proxy_uids: ids,
            proxy_gids: ids,
            include_ports: include,
            exclude_ports: exclude,
            outbound_port: 15001,
            inbound_port: 15006,
            tunnel_port: 15008,
            dns_port: 15053,
            flags,
            generation: 0,
            proxy_mark: 0,
            proxy_mark_mask: 0,
        }
    }

    const ALL: u32 = flags::CAPTURE_ALL_OUTBOUND;

    #[test]
    fn apps_are_redirected_and_the_proxy_is_not() {
        assert_eq!(
            outbound_tcp(&cfg(ALL), 1000, 1000, 80, Loopback::No, || DstClass::Other, || false),
            Verdict::Redirect(15001)
        );
        assert_eq!(
            outbound_tcp(&cfg(ALL), 1337, 1000, 80, Loopback::No, || DstClass::Other, || false),
            Verdict::Pass(Reason::Proxy)
        );
        assert_eq!(
            outbound_tcp(&cfg(ALL), 1000, 1337, 80, Loopback::No, || DstClass::Other, || false),
            Verdict::Pass(Reason::Proxy)
        );
    }

    #[test]
    fn exclusions_win_over_inclusions_as_in_istio() {
        let c = cfg(ALL);
        let other = || DstClass::Other;
        assert_eq!(
            outbound_tcp(&c, 1000, 1000, 9090, Loopback::No, other, || true),
            Verdict::Pass(Reason::ExcludedPort)
        );
        assert_eq!(
            outbound_tcp(&c, 1000, 1000, 80, Loopback::No, || DstClass::Excluded, || true),
            Verdict::Pass(Reason::ExcludedCidr)
        );
        assert_eq!(
            outbound_tcp(&c, 1000, 1000, 3306, Loopback::No, || DstClass::Excluded, || false),
            Verdict::Pass(Reason::ExcludedCidr)
        );
        assert_eq!(
            outbound_tcp(&c, 1000, 1000, 80, Loopback::Localhost, other, || true),
            Verdict::Pass(Reason::Loopback),
            "loopback"
        );
        // Istio leaves 15008 alone only for the proxy (its ISTIO_OUTPUT has no rule for
        // an app's connection to a tunnel port elsewhere: it is captured).
        assert_eq!(
            outbound_tcp(&c, 1000, 1000, 15008, Loopback::No, other, || true),
            Verdict::Redirect(15001),
            "tunnel port, app"
        );
        assert_eq!(
            outbound_tcp(&c, 1000, 1000, 80, Loopback::No, || DstClass::OwnPod, || true),
            Verdict::Pass(Reason::OwnPodAddress),
            "app to itself"
        );
    }

    #[test]
    fn without_the_wildcard_only_included_ports_and_cidrs_are_captured() {
        let c = cfg(0);
        let other = || DstClass::Other;
        assert_eq!(
            outbound_tcp(&c, 1000, 1000, 80, Loopback::No, other, || false),
            Verdict::Pass(Reason::NotIncluded)
        );
        assert_eq!(outbound_tcp(&c, 1000, 1000, 80, Loopback::No, other, || true), Verdict::Redirect(15001));
        assert_eq!(
            outbound_tcp(&c, 1000, 1000, 3306, Loopback::No, other, || false),
            Verdict::Redirect(15001)
        );
    }

    #[test]
    fn the_proxy_calling_its_own_pod_goes_to_the_inbound_side() {
        let c = cfg(ALL);
        let own = || DstClass::OwnPod;
        assert_eq!(outbound_tcp(&c, 1337, 1337, 8080, Loopback::No, own, || false), Verdict::Redirect(15006));
        assert_eq!(
            outbound_tcp(&c, 1337, 1337, 15008, Loopback::No, own, || false),
            Verdict::Pass(Reason::Proxy)
        );
        // Port 53 is special only when DNS is captured.
        assert_eq!(outbound_tcp(&c, 1337, 1337, 53, Loopback::No, own, || false), Verdict::Redirect(15006));
        let dns = cfg(ALL | flags::REDIRECT_DNS);
        assert_eq!(
            outbound_tcp(&dns, 1337, 1337, 53, Loopback::No, own, || false),
            Verdict::Pass(Reason::Proxy)
        );
    }

    #[test]
    fn the_proxy_through_loopback_goes_to_the_inbound_side_as_istio_validation_needs() {
        let c = cfg(ALL);
        let none = || panic!("no lookup for loopback");
        // istio-validation: uid 1337 connects to 127.0.0.6:15002.
        assert_eq!(loopback4(u32::from_ne_bytes([127, 0, 0, 6])), Loopback::Other);
        assert_eq!(
            outbound_tcp(&c, 1337, 1337, 15002, Loopback::Other, none, || false),
            Verdict::Redirect(15006)
        );
        // Only the first proxy uid: a gid-only match and a second uid pass (Istio's uid
        // block returns every other uid's loopback traffic first).
        assert_eq!(
            outbound_tcp(&c, 1000, 1337, 15002, Loopback::Other, none, || false),
            Verdict::Pass(Reason::Proxy)
        );
        let mut two = cfg(ALL);
        two.proxy_uids[1] = 1338;
        assert_eq!(
            outbound_tcp(&two, 1338, 1000, 15002, Loopback::Other, none, || false),
            Verdict::Pass(Reason::Proxy)
        );
        // Envoy's own localhost traffic and the tunnel port stay where they go.
        assert_eq!(loopback4(u32::from_ne_bytes([127, 0, 0, 1])), Loopback::Localhost);
        assert_eq!(
            outbound_tcp(&c, 1337, 1337, 15000, Loopback::Localhost, none, || false),
            Verdict::Pass(Reason::Proxy)
        );
        assert_eq!(
            outbound_tcp(&c, 1337, 1337, 15008, Loopback::Other, none, || false),
            Verdict::Pass(Reason::Proxy)
        );
        // Apps' loopback traffic is never captured.
        assert_eq!(
            outbound_tcp(&c, 1000, 1000, 15002, Loopback::Other, none, || true),
            Verdict::Pass(Reason::Loopback)
        );
        assert_eq!(loopback4(u32::from_ne_bytes([10, 0, 0, 6])), Loopback::No);
        // IPv6: ::1 is localhost, ::6 (the validator's address on IPv6 pods) is not.
        let six = |last: u8| [0, 0, 0, u32::from_ne_bytes([0, 0, 0, last])];
        assert_eq!(loopback6(&six(1)), Loopback::Localhost);
        assert_eq!(loopback6(&six(6)), Loopback::Other);
        assert_eq!(loopback6(&[u32::from_ne_bytes([0xfd, 0, 0, 0]), 0, 0, six(6)[3]]), Loopback::No);
    }

    #[test]
    fn envoys_inbound_passthrough_is_recognised_by_its_source() {
        assert!(from_inbound_passthrough(u32::from_ne_bytes([127, 0, 0, 6])));
        assert!(!from_inbound_passthrough(0), "an unbound socket");
        assert!(!from_inbound_passthrough(u32::from_ne_bytes([127, 0, 0, 1])));
        assert!(from_inbound_passthrough6(&[0, 0, 0, u32::from_ne_bytes([0, 0, 0, 6])]));
        let mapped = [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff]), u32::from_ne_bytes([127, 0, 0, 6])];
        assert!(from_inbound_passthrough6(&mapped));
        assert!(!from_inbound_passthrough6(&[0; 4]), "an unbound socket");
    }

    #[test]
    fn lookups_run_only_when_needed() {
        let c = cfg(ALL);
        let verdict = outbound_tcp(
            &c,
            1337,
            0,
            80,
            Loopback::Localhost,
            || panic!("no lookup for loopback"),
            || panic!("no include lookup"),
        );
        assert_eq!(verdict, Verdict::Pass(Reason::Proxy));
        let verdict = outbound_tcp(
            &c,
            1000,
            0,
            9090,
            Loopback::No,
            || panic!("excluded port decides"),
            || panic!("no include lookup"),
        );
        assert_eq!(verdict, Verdict::Pass(Reason::ExcludedPort));
    }

    #[test]
    fn dns_goes_to_the_agent_only_when_asked() {
        let on = cfg(flags::REDIRECT_DNS);
        assert!(dns(&on, 1000, 1000, 53, || true));
        assert!(!dns(&on, 1000, 1000, 53, || false), "not a resolv.conf server");
        assert!(!dns(&on, 1337, 1337, 53, || true), "the agent's own upstream queries");
        assert!(!dns(&on, 1000, 1000, 5353, || true));
        assert!(!dns(&cfg(0), 1000, 1000, 53, || true));
        assert!(dns(&cfg(flags::REDIRECT_DNS | flags::CAPTURE_ALL_DNS), 1000, 1000, 53, || false));
    }

    #[test]
    fn pair_keys_flip() {
        let k = crate::capture::PairKey {
            netns: 7,
            local_addr: [1, 0, 0, 0],
            remote_addr: [2, 0, 0, 0],
            local_port: 40000,
            remote_port: 15001,
            family: 2,
        };
        assert_eq!(k.peer().peer(), k);
        assert_eq!(k.peer().local_port, 15001);
    }

    #[test]
    fn the_unspecified_address_is_local() {
        assert_eq!(loopback4(0), Loopback::Localhost);
        assert_eq!(loopback6(&[0; 4]), Loopback::Localhost);
        assert_eq!(
            outbound_tcp(&cfg(ALL), 1000, 1000, 8080, loopback4(0), || DstClass::Other, || true),
            Verdict::Pass(Reason::Loopback),
            "connect(0.0.0.0) reaches the pod itself, never another host through the proxy"
        );
    }

    #[test]
    fn inbound_ports() {
        use crate::inbound::{InboundConfig, MAX_PORTS, mode};
        let mut c = InboundConfig {
            capture_port: 15006,
            tunnel_port: 15008,
            mode: mode::ALL,
            flags: 0,
            include_ports: [0; MAX_PORTS],
            exclude_ports: [0; MAX_PORTS],
            probe_src4: [0; 4],
            probe_src6: [0; 16],
        };
        c.exclude_ports[0] = 15021;
        assert!(c.captures(8080));
        assert!(!c.captures(15021) && !c.captures(15008) && !c.captures(15006));
        c.mode = mode::ONLY;
        c.include_ports[0] = 8080;
        assert!(c.captures(8080) && !c.captures(9090));
        c.mode = mode::NONE;
        assert!(!c.captures(8080));
    }
}
