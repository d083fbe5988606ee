//! The capture configuration: every input of Istio's rule generator, parsed and
//! validated, with Istio's defaults. Values that end up verbatim in rules (uids, group
//! names, interface names, DNS servers) keep their text; the rest are typed.

use std::{fmt, net::IpAddr, str::FromStr, time::Duration};

/// A configuration value that failed to parse or validate, named by its flag or env var.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {input}: {value:?}: {expected}")]
pub struct ConfigError {
    /// The flag or environment variable, e.g. `-b/--istio-inbound-ports`.
    pub input: String,
    pub value: String,
    /// What was expected instead.
    pub expected: String,
}

impl ConfigError {
    pub fn new(input: impl Into<String>, value: impl Into<String>, expected: impl Into<String>) -> Self {
        Self { input: input.into(), value: value.into(), expected: expected.into() }
    }
}

/// Splits a comma-separated list as Istio does: empty items are dropped.
pub fn split(list: &str) -> Vec<&str> {
    list.split(',').filter(|s| !s.is_empty()).collect()
}

/// How inbound connections reach Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InterceptionMode {
    /// NAT REDIRECT to the inbound capture port (the default; Istio also treats an
    /// empty mode as REDIRECT).
    #[default]
    Redirect,
    /// TPROXY in mangle PREROUTING, preserving the original destination.
    Tproxy,
}

impl InterceptionMode {
    pub fn parse(input: &str, value: &str) -> Result<Self, ConfigError> {
        match value {
            "" | "REDIRECT" => Ok(Self::Redirect),
            "TPROXY" => Ok(Self::Tproxy),
            _ => Err(ConfigError::new(input, value, "REDIRECT or TPROXY")),
        }
    }
}

impl fmt::Display for InterceptionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Redirect => "REDIRECT",
            Self::Tproxy => "TPROXY",
        })
    }
}

/// A TCP/UDP port or an inclusive range (`8000:8080`), as iptables takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortSpec {
    pub first: u16,
    pub last: Option<u16>,
}

impl PortSpec {
    pub fn parse(input: &str, value: &str) -> Result<Self, ConfigError> {
        let bad = || ConfigError::new(input, value, "a port number 1-65535 or a range like 8000:8080");
        let port = |s: &str| s.trim().parse::<u16>().ok().filter(|p| *p != 0);
        match value.split_once(':') {
            None => Ok(Self { first: port(value).ok_or_else(bad)?, last: None }),
            Some((a, b)) => {
                let (first, last) = (port(a).ok_or_else(bad)?, port(b).ok_or_else(bad)?);
                if first > last {
                    return Err(bad());
                }
                Ok(Self { first, last: Some(last) })
            }
        }
    }

    /// As nft writes it: `8000-8080`.
    pub fn nft(&self) -> String {
        match self.last {
            None => self.first.to_string(),
            Some(last) => format!("{}-{last}", self.first),
        }
    }

    pub fn contains(&self, port: u16) -> bool {
        port >= self.first && port <= self.last.unwrap_or(self.first)
    }
}

impl fmt::Display for PortSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.last {
            None => write!(f, "{}", self.first),
            Some(last) => write!(f, "{}:{last}", self.first),
        }
    }
}

/// Parses a comma-separated port list (empty items dropped, as Istio does).
pub fn parse_ports(input: &str, value: &str) -> Result<Vec<PortSpec>, ConfigError> {
    split(value).into_iter().map(|p| PortSpec::parse(input, p)).collect()
}

/// Which inbound ports go to Envoy.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum InboundPorts {
    /// No inbound capture (an empty `-b`).
    #[default]
    None,
    /// Every port (`-b '*'`), minus `-d`.
    All,
    /// Only these.
    Only(Vec<PortSpec>),
}

impl InboundPorts {
    pub fn parse(input: &str, value: &str) -> Result<Self, ConfigError> {
        match value.trim() {
            "" => Ok(Self::None),
            "*" => Ok(Self::All),
            _ => {
                let ports = parse_ports(input, value)?;
                Ok(if ports.is_empty() { Self::None } else { Self::Only(ports) })
            }
        }
    }

    pub fn is_none(&self) -> bool {
        matches!(self, Self::None)
    }
}

/// An IP prefix, printed `addr/bits` like Go's netip.Prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub bits: u8,
}

impl Cidr {
    pub fn parse(input: &str, value: &str) -> Result<Self, ConfigError> {
        let bad = |why: &str| ConfigError::new(input, value, why);
        let (addr, bits) =
            value.trim().split_once('/').ok_or_else(|| bad("a CIDR like 10.0.0.0/8 or fd00::/8"))?;
        let addr: IpAddr =
            addr.parse().map_err(|_| bad("a CIDR whose address is an IPv4 or IPv6 address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let bits: u8 = bits
            .parse()
            .ok()
            .filter(|b| *b <= max)
            .ok_or_else(|| bad(&format!("a prefix length 0-{max} after the /")))?;
        Ok(Self { addr, bits })
    }

    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    pub fn is_loopback(&self) -> bool {
        self.addr.is_loopback()
    }

    /// Whether `ip` falls inside this prefix.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = if self.bits == 0 { 0 } else { u32::MAX << (32 - u32::from(self.bits)) };
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = if self.bits == 0 { 0 } else { u128::MAX << (128 - u32::from(self.bits)) };
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.bits)
    }
}

impl FromStr for Cidr {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse("CIDR", s)
    }
}

/// Linux's longest interface name, in bytes (`IFNAMSIZ` - 1).
pub const MAX_INTERFACE_NAME: usize = 15;

/// What an interface name may be, as Istio checks `excludeInterfaces`,
/// `kubevirtInterfaces` and `reroute-virtual-interfaces` (istio/istio#58781, Istio
/// 1.29): a letter, then letters, digits, `_`, `.` or `-`, at most 15 bytes. Such a
/// name is one iptables argument and one nft word: it cannot end a statement, start
/// a comment, open a set or carry another match. (So `veth+`, iptables' wildcard, is
/// refused, as Istio's injector and CNI plugin refuse it.)
pub const INTERFACE_NAME_FORM: &str = "interface names of at most 15 characters, each a letter followed by \
                                       letters, digits, '_', '.' or '-' (comma-separated)";

/// Checks one interface name against [`INTERFACE_NAME_FORM`]; `input` names where it
/// came from (a flag, an env var, an annotation).
pub fn check_interface_name(input: &str, name: &str) -> Result<(), ConfigError> {
    let mut chars = name.chars();
    let first_is_letter = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
    let rest_allowed = chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if name.len() > MAX_INTERFACE_NAME || !first_is_letter || !rest_allowed {
        return Err(ConfigError::new(input, name, INTERFACE_NAME_FORM));
    }
    Ok(())
}

/// Parses a comma-separated interface list: each name trimmed of white space around
/// it (as Istio trims), empty items dropped, every name checked.
pub fn parse_interfaces(input: &str, value: &str) -> Result<Vec<String>, ConfigError> {
    let names: Vec<String> =
        value.split(',').map(str::trim).filter(|n| !n.is_empty()).map(String::from).collect();
    for name in &names {
        check_interface_name(input, name)?;
    }
    Ok(names)
}

/// Checks a user or group (a number or a name) that goes into rules verbatim: a name
/// that could not be one argument of iptables or one word of nft is refused (the
/// system's tools resolve the rest when the rules go in).
pub fn check_owner(input: &str, owner: &str) -> Result<(), ConfigError> {
    let unsafe_char = |c: char| c.is_whitespace() || c.is_control() || "\"'#;{}\\$`".contains(c);
    if owner.is_empty() || owner.len() > 256 || owner.chars().any(unsafe_char) {
        return Err(ConfigError::new(
            input,
            owner,
            "a uid, gid or user/group name without white space, quotes or any of #;{}\\$`",
        ));
    }
    Ok(())
}

/// Outbound destinations to capture (`-i`): all, or a list of prefixes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpRanges {
    All,
    Only(Vec<Cidr>),
}

impl Default for IpRanges {
    fn default() -> Self {
        Self::Only(Vec::new())
    }
}

impl IpRanges {
    pub fn parse(input: &str, value: &str) -> Result<Self, ConfigError> {
        if value.trim() == "*" {
            return Ok(Self::All);
        }
        Ok(Self::Only(split(value).into_iter().map(|c| Cidr::parse(input, c)).collect::<Result<_, _>>()?))
    }
}

/// Parses `-x`: a CIDR list where "*" is not allowed (Istio rejects it).
pub fn parse_exclude_ranges(input: &str, value: &str) -> Result<Vec<Cidr>, ConfigError> {
    if value.trim() == "*" {
        return Err(ConfigError::new(input, value, "a list of CIDRs (\"*\" cannot be excluded)"));
    }
    split(value).into_iter().map(|c| Cidr::parse(input, c)).collect()
}

/// Whose outbound traffic is captured, by owner group (ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnerGroups {
    /// Every group except these (include "*").
    AllExcept(Vec<String>),
    /// Only these groups.
    Only(Vec<String>),
}

impl Default for OwnerGroups {
    fn default() -> Self {
        Self::AllExcept(Vec::new())
    }
}

/// Istio's limit on included owner groups (one rule with N matches).
pub const MAX_OWNER_GROUPS_INCLUDE: usize = 64;

impl OwnerGroups {
    /// As Istio's ParseInterceptFilter: include "*" means all except `exclude`.
    pub fn from_env(include: &str, exclude: &str) -> Result<Self, ConfigError> {
        let owned = |s: &str| split(s).into_iter().map(str::to_string).collect::<Vec<_>>();
        let groups =
            if include == "*" { Self::AllExcept(owned(exclude)) } else { Self::Only(owned(include)) };
        if let Self::Only(values) = &groups
            && values.len() > MAX_OWNER_GROUPS_INCLUDE
        {
            return Err(ConfigError::new(
                "ISTIO_OUTBOUND_OWNER_GROUPS",
                include,
                format!("at most {MAX_OWNER_GROUPS_INCLUDE} groups, got {}", values.len()),
            ));
        }
        Ok(groups)
    }
}

/// Every input of the rule generator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureConfig {
    pub proxy_port: u16,
    pub inbound_capture_port: u16,
    pub inbound_tunnel_port: u16,
    /// Proxy uids (numbers or user names), rendered verbatim.
    pub proxy_uids: Vec<String>,
    /// Proxy gids (numbers or group names), rendered verbatim.
    pub proxy_gids: Vec<String>,
    pub interception_mode: InterceptionMode,
    pub tproxy_mark: u32,
    pub tproxy_route_table: u32,
    pub inbound_ports: InboundPorts,
    /// Applies only with `inbound_ports == All`.
    pub inbound_ports_exclude: Vec<PortSpec>,
    pub owner_groups: OwnerGroups,
    pub outbound_ports_include: Vec<PortSpec>,
    pub outbound_ports_exclude: Vec<PortSpec>,
    pub outbound_ip_ranges_include: IpRanges,
    pub outbound_ip_ranges_exclude: Vec<Cidr>,
    pub reroute_virtual_interfaces: Vec<String>,
    pub exclude_interfaces: Vec<String>,
    pub redirect_dns: bool,
    pub capture_all_dns: bool,
    pub drop_invalid: bool,
    /// Generate IPv6 rules (detected from the pod's addresses, as Istio does).
    pub enable_ipv6: bool,
    pub dns_servers_v4: Vec<String>,
    pub dns_servers_v6: Vec<String>,
    /// ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR.
    pub host_ipv4_loopback_cidr: Cidr,
}

/// Istio's defaults: 15001/15006/15008, mark 1337, table 133, uid=gid=1337, all owner
/// groups, loopback 127.0.0.1/32, nothing captured inbound or outbound.
impl Default for CaptureConfig {
    fn default() -> Self {
        Self {
            proxy_port: 15001,
            inbound_capture_port: 15006,
            inbound_tunnel_port: 15008,
            proxy_uids: vec!["1337".into()],
            proxy_gids: vec!["1337".into()],
            interception_mode: InterceptionMode::Redirect,
            tproxy_mark: 1337,
            tproxy_route_table: 133,
            inbound_ports: InboundPorts::None,
            inbound_ports_exclude: Vec::new(),
            owner_groups: OwnerGroups::default(),
            outbound_ports_include: Vec::new(),
            outbound_ports_exclude: Vec::new(),
            outbound_ip_ranges_include: IpRanges::default(),
            outbound_ip_ranges_exclude: Vec::new(),
            reroute_virtual_interfaces: Vec::new(),
            exclude_interfaces: Vec::new(),
            redirect_dns: false,
            capture_all_dns: false,
            drop_invalid: false,
            enable_ipv6: false,
            dns_servers_v4: Vec::new(),
            dns_servers_v6: Vec::new(),
            host_ipv4_loopback_cidr: Cidr { addr: IpAddr::V4([127, 0, 0, 1].into()), bits: 32 },
        }
    }
}

impl CaptureConfig {
    /// Checks every value that goes into rule text verbatim (interface names, users
    /// and groups), wherever the config came from: the command line and the CNI
    /// plugin check them on the way in; this holds for any other caller too.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for nic in &self.exclude_interfaces {
            check_interface_name("excluded interface (-c/--istio-exclude-interfaces)", nic)?;
        }
        for nic in &self.reroute_virtual_interfaces {
            check_interface_name("virtual interface (-k/--kube-virt-interfaces)", nic)?;
        }
        for uid in &self.proxy_uids {
            check_owner("proxy uid (-u/--proxy-uid)", uid)?;
        }
        for gid in &self.proxy_gids {
            check_owner("proxy gid (-g/--proxy-gid)", gid)?;
        }
        let (OwnerGroups::AllExcept(groups) | OwnerGroups::Only(groups)) = &self.owner_groups;
        for group in groups {
            check_owner("owner group (ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE])", group)?;
        }
        Ok(())
    }
}

/// Validates ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR as Istio does: IPv4, loopback, /8-/32.
pub fn parse_loopback_cidr(value: &str) -> Result<Cidr, ConfigError> {
    const INPUT: &str = "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR";
    let cidr = Cidr::parse(INPUT, value)?;
    if !cidr.is_ipv4() || !cidr.is_loopback() {
        return Err(ConfigError::new(INPUT, value, "an IPv4 loopback CIDR such as 127.0.0.1/32"));
    }
    if !(8..=32).contains(&cidr.bits) {
        return Err(ConfigError::new(INPUT, value, "a prefix length between 8 and 32"));
    }
    Ok(cidr)
}

/// How the rules are run, as opposed to what they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunOptions {
    pub dry_run: bool,
    pub reconcile: bool,
    pub cleanup_only: bool,
    pub force_apply: bool,
    pub native_nftables: bool,
    pub force_iptables_binary: Option<IptablesBackend>,
    pub run_validation: bool,
    pub skip_rule_apply: bool,
    pub probe_port: u16,
    pub probe_timeout: Duration,
    /// Apply inside this network namespace (a path such as /var/run/netns/x).
    pub network_namespace: Option<std::path::PathBuf>,
    /// Called by a CNI plugin: use a pod-scoped xtables lock.
    pub cni_mode: bool,
    /// The pod's address (the first found), for the validation probe.
    pub host_ip: Option<IpAddr>,
    /// Where the dry-run transcript goes (DRY_RUN_FILE_PATH); stdout when unset.
    pub dry_run_file: Option<std::path::PathBuf>,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            dry_run: false,
            reconcile: false,
            cleanup_only: false,
            force_apply: false,
            native_nftables: false,
            force_iptables_binary: None,
            run_validation: false,
            skip_rule_apply: false,
            probe_port: 15002,
            probe_timeout: Duration::from_secs(5),
            network_namespace: None,
            cni_mode: false,
            host_ip: None,
            dry_run_file: None,
        }
    }
}

/// The iptables flavour (FORCE_IPTABLES_BINARY).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IptablesBackend {
    Legacy,
    Nft,
}

impl IptablesBackend {
    pub fn parse(input: &str, value: &str) -> Result<Option<Self>, ConfigError> {
        match value {
            "" => Ok(None),
            "legacy" => Ok(Some(Self::Legacy)),
            "nft" => Ok(Some(Self::Nft)),
            _ => Err(ConfigError::new(input, value, "legacy or nft")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_and_ranges_parse_and_render_both_ways() {
        let p = PortSpec::parse("-q", "8000:8080").unwrap();
        assert_eq!(p.to_string(), "8000:8080");
        assert_eq!(p.nft(), "8000-8080");
        assert!(p.contains(8042) && !p.contains(8081));
        assert_eq!(parse_ports("-d", "6000,7000,").unwrap().len(), 2, "trailing comma ignored");
        for bad in ["0", "65536", "http", "9:1", " "] {
            let e = PortSpec::parse("-d/--istio-local-exclude-ports", bad).unwrap_err();
            assert!(e.to_string().starts_with("invalid -d/--istio-local-exclude-ports"), "{e}");
        }
    }

    #[test]
    fn inbound_ports_forms() {
        assert_eq!(InboundPorts::parse("-b", "").unwrap(), InboundPorts::None);
        assert_eq!(InboundPorts::parse("-b", "*").unwrap(), InboundPorts::All);
        assert!(
            matches!(InboundPorts::parse("-b", "80,443").unwrap(), InboundPorts::Only(p) if p.len() == 2)
        );
    }

    #[test]
    fn cidrs_validate_and_print_like_go() {
        assert_eq!(Cidr::parse("-i", "10.0.0.0/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(Cidr::parse("-i", "2001:db8::/32").unwrap().to_string(), "2001:db8::/32");
        for bad in ["10.0.0.0", "10.0.0.0/33", "10.0.0/8", "::/129", "foo/8"] {
            assert!(Cidr::parse("-i", bad).is_err(), "{bad}");
        }
        let net = Cidr::parse("-i", "10.66.0.0/24").unwrap();
        assert!(net.contains("10.66.0.9".parse().unwrap()));
        assert!(!net.contains("10.67.0.9".parse().unwrap()));
        assert!(Cidr::parse("-x", "0.0.0.0/0").unwrap().contains("1.2.3.4".parse().unwrap()));
    }

    #[test]
    fn exclude_ranges_reject_the_wildcard() {
        let e = parse_exclude_ranges("-x/--istio-service-exclude-cidr", "*").unwrap_err();
        assert!(e.to_string().contains("cannot be excluded"), "{e}");
        assert!(parse_exclude_ranges("-x", "").unwrap().is_empty());
    }

    #[test]
    fn interception_mode_is_exact() {
        assert_eq!(InterceptionMode::parse("-m", "").unwrap(), InterceptionMode::Redirect);
        assert_eq!(InterceptionMode::parse("-m", "TPROXY").unwrap(), InterceptionMode::Tproxy);
        let e = InterceptionMode::parse("-m/--istio-inbound-interception-mode", "MAGIC").unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid -m/--istio-inbound-interception-mode: \"MAGIC\": REDIRECT or TPROXY"
        );
    }

    #[test]
    fn owner_groups_follow_istio() {
        assert_eq!(
            OwnerGroups::from_env("*", "888,ftp").unwrap(),
            OwnerGroups::AllExcept(vec!["888".into(), "ftp".into()])
        );
        assert_eq!(
            OwnerGroups::from_env("java,202", "ignored").unwrap(),
            OwnerGroups::Only(vec!["java".into(), "202".into()])
        );
        let many = (0..65).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
        assert!(OwnerGroups::from_env(&many, "").is_err());
    }

    #[test]
    fn interface_names_follow_istios_rule() {
        const INPUT: &str = "-c/--istio-exclude-interfaces";
        for good in ["eth0", "eth_0", "eth-0", "eth0.1", "br-docker0", "bond0.100", "a23456789012345", "lo"] {
            check_interface_name(INPUT, good).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        // Each a way into iptables' arguments or nft's syntax, or not a name at all.
        let bad = [
            ("", "empty"),
            ("eth0;", "ends an nft statement"),
            ("eth0#", "starts an nft comment"),
            ("eth0\"", "closes an nft string"),
            ("eth0{", "opens an nft set"),
            ("eth0}", "closes an nft set"),
            ("eth0 -d 10.0.0.50", "a second iptables match"),
            ("eth0\tx", "a tab"),
            ("eth0\nx", "a newline: a second restore line"),
            ("eth0\\", "an escape"),
            ("eth0$PATH", "a shell expansion"),
            ("eth0`id`", "a command substitution"),
            ("eth0|cat", "a pipe"),
            ("eth0/1", "a path separator"),
            ("eth0:1", "an alias label"),
            ("veth@if12", "an ip-link peer suffix"),
            ("veth+", "iptables' wildcard, refused as Istio refuses it"),
            ("-j", "an option"),
            (".", "a directory"),
            ("..", "a directory"),
            ("0eth", "starts with a digit"),
            ("_eth0", "starts with an underscore"),
            ("1234567890123456", "16 bytes"),
            ("eth\u{e9}", "not ASCII"),
        ];
        for (name, why) in bad {
            let e = check_interface_name(INPUT, name).expect_err(why);
            assert!(e.to_string().starts_with(&format!("invalid {INPUT}: {name:?}: interface names")), "{e}");
        }
    }

    #[test]
    fn interface_lists_are_trimmed_and_checked() {
        assert_eq!(parse_interfaces("-k", " eth0 , eth1,").unwrap(), ["eth0", "eth1"]);
        assert!(parse_interfaces("-k", "").unwrap().is_empty());
        let e = parse_interfaces("-k/--kube-virt-interfaces", "eth0,eth1 -j ACCEPT").unwrap_err();
        assert_eq!(e.input, "-k/--kube-virt-interfaces");
        assert_eq!(e.value, "eth1 -j ACCEPT");
    }

    #[test]
    fn a_config_made_in_code_is_checked_too() {
        assert!(CaptureConfig::default().validate().is_ok());
        let nic = CaptureConfig { exclude_interfaces: vec!["eth0\" accept #".into()], ..Default::default() };
        assert!(nic.validate().unwrap_err().to_string().contains("-c/--istio-exclude-interfaces"));
        let virt = CaptureConfig { reroute_virtual_interfaces: vec!["{".into()], ..Default::default() };
        assert!(virt.validate().unwrap_err().to_string().contains("-k/--kube-virt-interfaces"));
        let uid = CaptureConfig { proxy_uids: vec!["1337 -j ACCEPT".into()], ..Default::default() };
        assert!(uid.validate().unwrap_err().to_string().contains("-u/--proxy-uid"));
        let group =
            CaptureConfig { owner_groups: OwnerGroups::Only(vec!["java;".into()]), ..Default::default() };
        assert!(group.validate().unwrap_err().to_string().contains("ISTIO_OUTBOUND_OWNER_GROUPS"));
        let names = CaptureConfig {
            proxy_uids: vec!["istio-proxy".into()],
            owner_groups: OwnerGroups::AllExcept(vec!["ftp".into(), "888".into()]),
            ..Default::default()
        };
        assert!(names.validate().is_ok());
    }

    #[test]
    fn loopback_cidr_rules() {
        assert!(parse_loopback_cidr("127.0.0.1/8").is_ok());
        assert!(parse_loopback_cidr("10.0.0.1/32").is_err());
        assert!(parse_loopback_cidr("127.0.0.1/7").is_err());
        assert!(parse_loopback_cidr("::1/128").is_err());
    }
}
