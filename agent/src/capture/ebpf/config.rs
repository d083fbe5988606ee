//! From a capture configuration (istio-iptables' flags) to what the kernel programs
//! read: a [`PodConfig`], the pod's CIDR and DNS lists, and the inbound classifier's
//! [`InboundConfig`]. Pure; limits of the fixed-size kernel structs, and each pod's
//! share of the node-wide lists ([`MAX_CIDRS_PER_POD`] entries per list and address
//! family), are errors here, named after the flag that exceeds them and checked before
//! anything is written. Istio has no such limit (its rules live in the pod's own
//! namespace); Weir's lists are shared by every pod on the node, so one pod's
//! annotation must not be able to fill them for the others.

use std::net::IpAddr;

use weir_ebpf_common::{
    capture::{MAX_CIDRS_PER_POD, MAX_IDS, MAX_PORTS, NO_ID, PodConfig, flags},
    inbound::{self, InboundConfig},
};
use weir_iptables::{
    config::{CaptureConfig, Cidr, InboundPorts, IpRanges, PortSpec},
    decisions::Decisions,
};

/// The agent's DNS listener port (Istio's 15053).
pub const DNS_PROXY_PORT: u16 = 15053;

/// A configuration eBPF capture cannot express.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("eBPF capture: {input}: {problem}")]
pub struct EbpfConfigError {
    pub input: &'static str,
    pub problem: String,
}

fn err(input: &'static str, problem: impl Into<String>) -> EbpfConfigError {
    EbpfConfigError { input, problem: problem.into() }
}

/// Everything registered for one pod.
#[derive(Debug, Clone, PartialEq)]
pub struct PodCapture {
    pub config: PodConfig,
    /// `-x` prefixes.
    pub exclude: Vec<Cidr>,
    /// The pod's own addresses: never captured for the app; the proxy's connections to
    /// them go to Envoy's inbound port.
    pub own_addresses: Vec<IpAddr>,
    /// `-i` prefixes (empty with the wildcard).
    pub include: Vec<Cidr>,
    pub dns_servers: Vec<IpAddr>,
    /// Inbound capture, if any inbound port is captured.
    pub inbound: Option<InboundConfig>,
}

/// Whether two pod configs capture alike: the generation (which of the pod's list
/// entries a config names) left out.
pub fn same_capture(a: &PodConfig, b: &PodConfig) -> bool {
    PodConfig { generation: 0, ..*a } == PodConfig { generation: 0, ..*b }
}

/// Options that are Weir's own rather than istio-iptables'.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EbpfOptions {
    /// Pass data between local socket pairs with sk_msg.
    pub accelerate: bool,
}

/// Refuses a list with more entries of one address family than a pod may have.
fn within_limit<'a>(
    input: &'static str,
    addrs: impl Iterator<Item = &'a IpAddr>,
) -> Result<(), EbpfConfigError> {
    let (v4, v6) =
        addrs.fold((0u32, 0u32), |(v4, v6), a| if a.is_ipv4() { (v4 + 1, v6) } else { (v4, v6 + 1) });
    let (family, n) = if v4 > v6 { ("IPv4", v4) } else { ("IPv6", v6) };
    if n > MAX_CIDRS_PER_POD {
        return Err(err(
            input,
            format!(
                "{n} {family} entries, more than the {MAX_CIDRS_PER_POD} one pod may have with eBPF capture \
                 (the lists are shared by every pod on the node); merge ranges, or capture this pod with \
                 iptables or nftables"
            ),
        ));
    }
    Ok(())
}

/// Refuses a pod with more addresses of one family than the inbound classifier
/// registers per pod.
fn inbound_addresses_within_limit(own_addresses: &[IpAddr]) -> Result<(), EbpfConfigError> {
    let per_family = |v4: bool| own_addresses.iter().filter(|a| a.is_ipv4() == v4).count() as u32;
    let most = per_family(true).max(per_family(false));
    if most > inbound::MAX_ADDRESSES_PER_POD {
        return Err(err(
            "the pod's addresses",
            format!(
                "{most} addresses of one family on the pod's interfaces; eBPF inbound capture registers at most {} \
                 per family (the node's classifier keys are shared by every pod)",
                inbound::MAX_ADDRESSES_PER_POD
            ),
        ));
    }
    Ok(())
}

/// The pod's own (non-loopback) addresses, as the capture config needs them.
pub fn own_addresses(facts: &dyn weir_iptables::detect::HostFacts) -> std::io::Result<Vec<IpAddr>> {
    Ok(facts.addresses()?.into_iter().filter(|a| !a.is_loopback()).collect())
}

fn ids(input: &'static str, list: &[String]) -> Result<[u32; MAX_IDS], EbpfConfigError> {
    if list.len() > MAX_IDS {
        return Err(err(input, format!("at most {MAX_IDS} ids, got {}", list.len())));
    }
    let mut out = [NO_ID; MAX_IDS];
    for (slot, id) in out.iter_mut().zip(list) {
        *slot = match id.parse() {
            Ok(n) => n,
            Err(_) => match input {
                "-u/--proxy-uid" => nix::unistd::User::from_name(id).ok().flatten().map(|u| u.uid.as_raw()),
                _ => nix::unistd::Group::from_name(id).ok().flatten().map(|g| g.gid.as_raw()),
            }
            .ok_or_else(|| err(input, format!("{id:?} is not a number or a known name")))?,
        };
    }
    Ok(out)
}

fn ports<const N: usize>(input: &'static str, list: &[PortSpec]) -> Result<[u16; N], EbpfConfigError> {
    if list.len() > N {
        return Err(err(input, format!("at most {N} ports, got {}", list.len())));
    }
    let mut out = [0u16; N];
    for (slot, p) in out.iter_mut().zip(list) {
        if p.last.is_some() {
            return Err(err(input, format!("port ranges ({p}) are not supported; list the ports")));
        }
        *slot = p.first;
    }
    Ok(out)
}

/// The inbound classifier's view of `cfg`'s inbound capture (`None`: no inbound capture).
fn inbound_config(cfg: &CaptureConfig) -> Result<Option<InboundConfig>, EbpfConfigError> {
    let none = [0u16; inbound::MAX_PORTS];
    match &cfg.inbound_ports {
        InboundPorts::None => Ok(None),
        InboundPorts::All => Ok(Some(InboundConfig {
            capture_port: cfg.inbound_capture_port,
            tunnel_port: cfg.inbound_tunnel_port,
            mode: inbound::mode::ALL,
            flags: 0,
            include_ports: none,
            exclude_ports: ports::<{ inbound::MAX_PORTS }>(
                "-d/--istio-local-exclude-ports",
                &cfg.inbound_ports_exclude,
            )?,
            probe_src4: [0; 4],
            probe_src6: [0; 16],
        })),
        InboundPorts::Only(list) => Ok(Some(InboundConfig {
            capture_port: cfg.inbound_capture_port,
            tunnel_port: cfg.inbound_tunnel_port,
            mode: inbound::mode::ONLY,
            flags: 0,
            include_ports: ports::<{ inbound::MAX_PORTS }>("-b/--istio-inbound-ports", list)?,
            exclude_ports: none,
            probe_src4: [0; 4],
            probe_src6: [0; 16],
        })),
    }
}

impl PodCapture {
    /// Translates `cfg` for a pod whose own addresses are `own_addresses`.
    pub fn new(
        cfg: &CaptureConfig,
        own_addresses: Vec<IpAddr>,
        options: EbpfOptions,
    ) -> Result<Self, EbpfConfigError> {
        if !cfg.reroute_virtual_interfaces.is_empty() {
            return Err(err(
                "-k/--kube-virt-interfaces",
                "not supported with eBPF capture (use iptables or nftables)",
            ));
        }
        if !cfg.exclude_interfaces.is_empty() {
            return Err(err(
                "-c/--istio-exclude-interfaces",
                "not supported with eBPF capture (use iptables or nftables)",
            ));
        }
        let decisions = Decisions::of(cfg);
        let mut bits = 0;
        if matches!(cfg.outbound_ip_ranges_include, IpRanges::All) {
            bits |= flags::CAPTURE_ALL_OUTBOUND;
        }
        if decisions.redirect_dns {
            bits |= flags::REDIRECT_DNS;
        }
        if cfg.capture_all_dns {
            bits |= flags::CAPTURE_ALL_DNS;
        }
        if options.accelerate {
            bits |= flags::ACCELERATE;
        }
        let config = PodConfig {
            proxy_uids: ids("-u/--proxy-uid", &cfg.proxy_uids)?,
            proxy_gids: ids("-g/--proxy-gid", &cfg.proxy_gids)?,
            include_ports: ports::<MAX_PORTS>("-q/--istio-outbound-ports", &cfg.outbound_ports_include)?,
            exclude_ports: ports::<MAX_PORTS>(
                "-o/--istio-local-outbound-ports-exclude",
                &cfg.outbound_ports_exclude,
            )?,
            outbound_port: cfg.proxy_port,
            inbound_port: cfg.inbound_capture_port,
            tunnel_port: cfg.inbound_tunnel_port,
            dns_port: DNS_PROXY_PORT,
            flags: bits,
            generation: 0,
            proxy_mark: 0,
            proxy_mark_mask: 0,
        };
        let include = match &cfg.outbound_ip_ranges_include {
            IpRanges::All => Vec::new(),
            IpRanges::Only(cidrs) => cidrs.clone(),
        };
        let dns_servers: Vec<IpAddr> = cfg
            .dns_servers_v4
            .iter()
            .chain(&cfg.dns_servers_v6)
            .map(|s| {
                s.parse::<IpAddr>()
                    .map_err(|_| err("/etc/resolv.conf", format!("nameserver {s:?} is not an address")))
            })
            .collect::<Result<_, _>>()?;
        let inbound = inbound_config(cfg)?;
        let exclude: Vec<Cidr> = decisions.exclude_v4.iter().chain(&decisions.exclude_v6).copied().collect();
        within_limit(
            "-x/--istio-service-exclude-cidr",
            exclude.iter().map(|c| &c.addr).chain(own_addresses.iter()),
        )?;
        within_limit("-i/--istio-service-cidr", include.iter().map(|c| &c.addr))?;
        within_limit("/etc/resolv.conf", dns_servers.iter())?;
        if inbound.is_some() {
            inbound_addresses_within_limit(&own_addresses)?;
        }
        Ok(Self { config, exclude, own_addresses, include, dns_servers, inbound })
    }
}

/// ztunnel's ports in an ambient pod's namespace (the same contract as Envoy's).
pub mod ztunnel {
    pub const OUTBOUND: u16 = 15001;
    pub const INBOUND: u16 = 15006;
    pub const HBONE: u16 = 15008;
    pub const DNS: u16 = 15053;
}

impl PodCapture {
    /// What Istio's in-pod rules do for an ambient pod, for the programs: every
    /// outbound TCP connect but loopback and the pod's own addresses to ztunnel's
    /// 15001 (its sockets, marked 0x539/0xfff, left alone, as the rules return them);
    /// DNS to any server to 15053 when captured; inbound SYNs to every port but 15008
    /// (and 15006) assigned to 15006, except from the host's probe address, and none
    /// in ingress mode (`ambient.istio.io/bypass-inbound-capture`). Virtual interfaces
    /// cannot be expressed: an error naming the annotation.
    pub fn ambient(
        cfg: &weir_iptables::ambient::InpodConfig,
        own_addresses: Vec<IpAddr>,
    ) -> Result<Self, EbpfConfigError> {
        use weir_ebpf_common::inbound::{ambient as marks, flags as inbound_flags};
        if !cfg.pod.virtual_interfaces.is_empty() {
            return Err(err(
                "istio.io/reroute-virtual-interfaces",
                "not supported with eBPF capture (the in-pod rules capture this pod)",
            ));
        }
        let mut bits = flags::CAPTURE_ALL_OUTBOUND;
        if cfg.redirect_dns() {
            // Istio's in-pod rules send DNS to any server to ztunnel.
            bits |= flags::REDIRECT_DNS | flags::CAPTURE_ALL_DNS;
        }
        let config = PodConfig {
            proxy_uids: [NO_ID; MAX_IDS],
            proxy_gids: [NO_ID; MAX_IDS],
            include_ports: [0; MAX_PORTS],
            exclude_ports: [0; MAX_PORTS],
            outbound_port: ztunnel::OUTBOUND,
            inbound_port: ztunnel::INBOUND,
            tunnel_port: ztunnel::HBONE,
            dns_port: ztunnel::DNS,
            flags: bits,
            generation: 0,
            proxy_mark: marks::ZTUNNEL_MARK,
            proxy_mark_mask: marks::MARK_MASK,
        };
        let inbound = (!cfg.pod.ingress_mode).then(|| InboundConfig {
            capture_port: ztunnel::INBOUND,
            tunnel_port: ztunnel::HBONE,
            mode: inbound::mode::ALL,
            flags: inbound_flags::AMBIENT,
            include_ports: [0; inbound::MAX_PORTS],
            exclude_ports: [0; inbound::MAX_PORTS],
            probe_src4: cfg.ambient.host_probe_snat_v4.octets(),
            probe_src6: cfg.ambient.host_probe_snat_v6.octets(),
        });
        within_limit("the pod's addresses", own_addresses.iter())?;
        if inbound.is_some() {
            inbound_addresses_within_limit(&own_addresses)?;
        }
        Ok(Self {
            config,
            exclude: Vec::new(),
            own_addresses,
            include: Vec::new(),
            dns_servers: Vec::new(),
            inbound,
        })
    }
}

#[cfg(test)]
mod tests {
    use weir_iptables::config::{InterceptionMode, parse_ports};

    use super::*;

    fn injector() -> CaptureConfig {
        CaptureConfig {
            outbound_ip_ranges_include: IpRanges::All,
            inbound_ports: InboundPorts::All,
            inbound_ports_exclude: parse_ports("-d", "15090,15021,15020").unwrap(),
            ..CaptureConfig::default()
        }
    }

    const OPTS: EbpfOptions = EbpfOptions { accelerate: true };

    #[test]
    fn the_injector_line_translates() {
        let pod = PodCapture::new(&injector(), vec!["10.66.0.10".parse().unwrap()], OPTS).unwrap();
        assert_eq!(pod.config.proxy_uids, [1337, NO_ID, NO_ID, NO_ID]);
        assert!(pod.config.has(flags::CAPTURE_ALL_OUTBOUND));
        assert!(pod.config.has(flags::ACCELERATE));
        assert!(!pod.config.has(flags::REDIRECT_DNS));
        assert_eq!(
            (pod.config.outbound_port, pod.config.inbound_port, pod.config.tunnel_port),
            (15001, 15006, 15008)
        );
        let inbound = pod.inbound.unwrap();
        assert!(inbound.captures(8080) && !inbound.captures(15021));
    }

    #[test]
    fn dns_only_with_servers_or_capture_all() {
        let mut cfg = injector();
        cfg.redirect_dns = true;
        assert!(!PodCapture::new(&cfg, vec![], OPTS).unwrap().config.has(flags::REDIRECT_DNS));
        cfg.dns_servers_v4 = vec!["10.96.0.10".into()];
        let pod = PodCapture::new(&cfg, vec![], OPTS).unwrap();
        assert!(pod.config.has(flags::REDIRECT_DNS));
        assert_eq!(pod.dns_servers, vec!["10.96.0.10".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn what_ebpf_cannot_express_is_an_error_naming_the_flag() {
        let mut cfg = injector();
        cfg.outbound_ports_exclude = parse_ports("-o", "8000:8080").unwrap();
        let e = PodCapture::new(&cfg, vec![], OPTS).unwrap_err();
        assert_eq!(e.input, "-o/--istio-local-outbound-ports-exclude");
        let mut cfg = injector();
        cfg.proxy_uids = (0..5).map(|i| i.to_string()).collect();
        assert_eq!(PodCapture::new(&cfg, vec![], OPTS).unwrap_err().input, "-u/--proxy-uid");
        let mut cfg = injector();
        cfg.exclude_interfaces = vec!["eth1".into()];
        assert!(
            PodCapture::new(&cfg, vec![], OPTS)
                .unwrap_err()
                .to_string()
                .contains("-c/--istio-exclude-interfaces")
        );
        let mut cfg = injector();
        cfg.interception_mode = InterceptionMode::Tproxy;
        assert!(PodCapture::new(&cfg, vec![], OPTS).is_ok(), "TPROXY semantics are what sk_assign gives");
    }

    #[test]
    fn one_pods_lists_are_limited_before_anything_is_written() {
        let mut cfg = injector();
        let many: Vec<String> =
            (0..=MAX_CIDRS_PER_POD).map(|i| format!("10.{}.{}.0/24", i / 256, i % 256)).collect();
        cfg.outbound_ip_ranges_exclude =
            weir_iptables::config::parse_exclude_ranges("-x", &many.join(",")).unwrap();
        let e = PodCapture::new(&cfg, vec![], OPTS).unwrap_err();
        assert_eq!(e.input, "-x/--istio-service-exclude-cidr");
        assert!(e.problem.contains(&format!("{} IPv4 entries", MAX_CIDRS_PER_POD + 1)), "{e}");
        assert!(e.problem.contains(&MAX_CIDRS_PER_POD.to_string()), "{e}");
        // At the limit, counting the pod's own address: refused too.
        cfg.outbound_ip_ranges_exclude =
            weir_iptables::config::parse_exclude_ranges("-x", &many[..MAX_CIDRS_PER_POD as usize].join(","))
                .unwrap();
        assert!(PodCapture::new(&cfg, vec![], OPTS).is_ok());
        assert!(PodCapture::new(&cfg, vec!["10.66.0.10".parse().unwrap()], OPTS).is_err());
        // IPv6 entries count apart from IPv4 ones.
        assert!(PodCapture::new(&cfg, vec!["fd00::10".parse().unwrap()], OPTS).is_ok());
        // A pod with more addresses than the classifier registers per pod.
        let many: Vec<IpAddr> = (1..=9).map(|i| format!("10.66.0.{i}").parse().unwrap()).collect();
        let e = PodCapture::new(&injector(), many, OPTS).unwrap_err();
        assert_eq!(e.input, "the pod's addresses");
        assert!(e.problem.contains("9 addresses") && e.problem.contains('8'), "{e}");
    }

    #[test]
    fn an_ambient_pod_is_captured_for_ztunnel() {
        use weir_ebpf_common::inbound::flags as inbound_flags;
        use weir_iptables::ambient::{AmbientConfig, InpodConfig, PodDns, PodOverrides};
        let ip: IpAddr = "10.66.0.10".parse().unwrap();
        let cfg = InpodConfig { ambient: AmbientConfig::default(), pod: PodOverrides::default() };
        let pod = PodCapture::ambient(&cfg, vec![ip]).unwrap();
        assert_eq!(pod.config.proxy_uids, [NO_ID; MAX_IDS], "ztunnel is told apart by its mark, not a uid");
        assert!(pod.config.is_proxy_mark(0x539) && pod.config.is_proxy_mark(0x1539));
        assert!(!pod.config.is_proxy_mark(0) && !pod.config.is_proxy_mark(0x111));
        assert!(pod.config.has(flags::CAPTURE_ALL_OUTBOUND) && !pod.config.has(flags::REDIRECT_DNS));
        let inbound = pod.inbound.unwrap();
        assert!(inbound.flags & inbound_flags::AMBIENT != 0);
        assert!(inbound.captures(8080) && inbound.captures(15001));
        assert!(!inbound.captures(15008) && !inbound.captures(15006));
        assert!(
            inbound.from_probe_source4([169, 254, 7, 127]) && !inbound.from_probe_source4([10, 66, 0, 9])
        );
        let v6: std::net::Ipv6Addr = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff".parse().unwrap();
        assert!(inbound.from_probe_source6(v6.octets()));
        // Every word of the address is compared: a source one bit off in any is not it.
        for word in 0..4 {
            let mut near = v6.octets();
            near[word * 4 + 3] ^= 1;
            assert!(!inbound.from_probe_source6(near), "{}", std::net::Ipv6Addr::from(near));
        }
        assert!(!inbound.from_probe_source6([0; 16]));
        // DNS capture (the agent's setting or the pod's annotation): every server.
        let dns = InpodConfig {
            pod: PodOverrides { dns: PodDns::Enabled, ..PodOverrides::default() },
            ..cfg.clone()
        };
        let pod = PodCapture::ambient(&dns, vec![ip]).unwrap();
        assert!(pod.config.has(flags::REDIRECT_DNS) && pod.config.has(flags::CAPTURE_ALL_DNS));
        // Ingress mode: no inbound capture. Virtual interfaces: the rules' job.
        let ingress = InpodConfig {
            pod: PodOverrides { ingress_mode: true, ..PodOverrides::default() },
            ..cfg.clone()
        };
        assert!(PodCapture::ambient(&ingress, vec![ip]).unwrap().inbound.is_none());
        let kubevirt = InpodConfig {
            pod: PodOverrides { virtual_interfaces: vec!["tap0".into()], ..PodOverrides::default() },
            ..cfg
        };
        assert_eq!(
            PodCapture::ambient(&kubevirt, vec![ip]).unwrap_err().input,
            "istio.io/reroute-virtual-interfaces"
        );
    }
}
