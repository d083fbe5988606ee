//! The ambient settings, under Istio's names: the node agent's global ones
//! ([`AmbientConfig`]: istio-cni's `AmbientConfig` and the env that fills it) and a
//! pod's own ([`PodOverrides`]: Istio's `PodLevelOverrides`, read from the pod's
//! annotations as Istio's node agent reads them). [`InpodConfig`] is the two together,
//! the one input of the in-pod generators.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::inputs::config::{ConfigError, IptablesBackend};

/// `ambient.istio.io/dns-capture`: `true`/`false` overrides the agent's DNS capture.
pub const ANNOTATION_DNS_CAPTURE: &str = "ambient.istio.io/dns-capture";
/// `ambient.istio.io/bypass-inbound-capture`: `true` is Istio's ingress mode (no inbound
/// redirection, no probe exemption on the way in).
pub const ANNOTATION_BYPASS_INBOUND_CAPTURE: &str = "ambient.istio.io/bypass-inbound-capture";
/// `istio.io/reroute-virtual-interfaces`: comma-separated interfaces whose inbound TCP is
/// treated as outbound (KubeVirt, VMs, DinD).
pub const ANNOTATION_REROUTE_VIRTUAL_INTERFACES: &str = "istio.io/reroute-virtual-interfaces";

/// Istio's default source address for kubelet probes SNATed on the node
/// (`HOST_PROBE_SNAT_IP`).
pub const DEFAULT_HOST_PROBE_SNAT_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 7, 127);
/// Istio's default IPv6 twin (`HOST_PROBE_SNAT_IPV6`):
/// `fd16:9254:7127:1337:ffff:ffff:ffff:ffff`.
pub const DEFAULT_HOST_PROBE_SNAT_V6: Ipv6Addr =
    Ipv6Addr::new(0xfd16, 0x9254, 0x7127, 0x1337, 0xffff, 0xffff, 0xffff, 0xffff);

/// Which netfilter front end programs the rules (`NATIVE_NFTABLES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AmbientBackend {
    /// iptables-restore, with the binary Istio's detection picks (or
    /// `FORCE_IPTABLES_BINARY`).
    #[default]
    Iptables,
    /// One `nft -f` transaction over the `istio-ambient-*` tables.
    Nftables,
}

/// The node agent's ambient settings (Istio's `AmbientConfig`), the same for every pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmbientConfig {
    /// `AMBIENT_IPV6` (Istio's `EnableIPv6`): IPv6 rules, routes and the v6 probe set.
    pub enable_ipv6: bool,
    /// `AMBIENT_DNS_CAPTURE` (Istio's `RedirectDNS`): DNS to ztunnel's 15053, unless a pod
    /// says otherwise.
    pub redirect_dns: bool,
    /// `HOST_PROBE_SNAT_IP`: the source kubelet's probes get on the node, exempt in-pod.
    pub host_probe_snat_v4: Ipv4Addr,
    /// `HOST_PROBE_SNAT_IPV6`.
    pub host_probe_snat_v6: Ipv6Addr,
    /// `AMBIENT_RECONCILE_POD_RULES_ON_STARTUP` (Istio's `Reconcile`): rules that differ
    /// from the plan are replaced; without it a drifted iptables namespace is an error
    /// that changes nothing.
    pub reconcile: bool,
    /// `NATIVE_NFTABLES`.
    pub backend: AmbientBackend,
    /// `FORCE_IPTABLES_BINARY` (`legacy` or `nft`); detected when unset.
    pub force_iptables_binary: Option<IptablesBackend>,
    /// `AMBIENT_USE_SCOPED_XTABLES_LOCKING` (default true, as Istio's): iptables-legacy
    /// in a pod's namespace takes a lock of that namespace's own, not the node's
    /// `/run/xtables.lock`; false takes the node's, as before Istio 1.30.
    pub scoped_xtables_lock: bool,
}

impl AmbientConfig {
    /// The xtables lock for rules in the pod namespace `netns`.
    pub fn inpod_lock(&self, netns: &std::path::Path) -> crate::iptables::xtables::Lock {
        use crate::iptables::xtables::Lock;
        if self.scoped_xtables_lock { Lock::PodScoped(netns.to_path_buf()) } else { Lock::Global }
    }
}

impl Default for AmbientConfig {
    /// Istio's defaults: IPv4 only, no DNS capture, 169.254.7.127 and its v6 twin,
    /// no reconcile, iptables.
    fn default() -> Self {
        Self {
            enable_ipv6: false,
            redirect_dns: false,
            host_probe_snat_v4: DEFAULT_HOST_PROBE_SNAT_V4,
            host_probe_snat_v6: DEFAULT_HOST_PROBE_SNAT_V6,
            reconcile: false,
            backend: AmbientBackend::Iptables,
            force_iptables_binary: None,
            scoped_xtables_lock: true,
        }
    }
}

/// A boolean as Go's strconv.ParseBool reads it.
fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

impl AmbientConfig {
    /// Reads the settings from `get` (the environment, or a map in tests) under
    /// istio-cni's names; unset names keep Istio's defaults. A value that does not
    /// parse is an error naming it.
    pub fn from_settings(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut cfg = Self::default();
        let flag = |name: &str, into: &mut bool| -> Result<(), ConfigError> {
            if let Some(value) = get(name) {
                *into = parse_bool(value.trim())
                    .ok_or_else(|| ConfigError::new(name, &value, "a boolean (true or false)"))?;
            }
            Ok(())
        };
        flag("AMBIENT_IPV6", &mut cfg.enable_ipv6)?;
        flag("AMBIENT_DNS_CAPTURE", &mut cfg.redirect_dns)?;
        flag("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", &mut cfg.reconcile)?;
        flag("AMBIENT_USE_SCOPED_XTABLES_LOCKING", &mut cfg.scoped_xtables_lock)?;
        let mut nft = false;
        flag("NATIVE_NFTABLES", &mut nft)?;
        cfg.backend = if nft { AmbientBackend::Nftables } else { AmbientBackend::Iptables };
        if let Some(v) = get("HOST_PROBE_SNAT_IP") {
            cfg.host_probe_snat_v4 = v
                .trim()
                .parse()
                .map_err(|_| ConfigError::new("HOST_PROBE_SNAT_IP", &v, "an IPv4 address"))?;
        }
        if let Some(v) = get("HOST_PROBE_SNAT_IPV6") {
            cfg.host_probe_snat_v6 = v
                .trim()
                .parse()
                .map_err(|_| ConfigError::new("HOST_PROBE_SNAT_IPV6", &v, "an IPv6 address"))?;
        }
        if let Some(v) = get("FORCE_IPTABLES_BINARY") {
            cfg.force_iptables_binary = IptablesBackend::parse("FORCE_IPTABLES_BINARY", v.trim())?;
        }
        Ok(cfg)
    }

    /// This configuration with one pod's overrides: the input of the in-pod plans.
    pub fn for_pod(&self, pod: PodOverrides) -> InpodConfig {
        InpodConfig { ambient: self.clone(), pod }
    }
}

/// A pod's DNS capture override (`ambient.istio.io/dns-capture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PodDns {
    /// No annotation: the agent's `AMBIENT_DNS_CAPTURE` decides.
    #[default]
    Unset,
    Enabled,
    Disabled,
}

/// What one pod's annotations change (Istio's `PodLevelOverrides`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodOverrides {
    /// `istio.io/reroute-virtual-interfaces`, in the annotation's order.
    pub virtual_interfaces: Vec<String>,
    /// `ambient.istio.io/bypass-inbound-capture: "true"` (Istio's ingress mode).
    pub ingress_mode: bool,
    pub dns: PodDns,
}

/// An interface name that can stand verbatim in an iptables-restore line and an nft
/// rule: the sidecar's rule, Istio's (a letter, then letters, digits, `_`, `.` or `-`;
/// at most 15 bytes), so no name can read as an iptables option either.
fn check_interface(input: &str, name: &str) -> Result<(), ConfigError> {
    crate::inputs::config::check_interface_name(input, name)
}

impl PodOverrides {
    /// Reads a pod's annotations as Istio's node agent does: a boolean annotation that
    /// does not parse (Go's ParseBool) is ignored with a warning, as Istio ignores it;
    /// virtual interfaces are split on commas, trimmed, empty items dropped. An
    /// interface name that could not stand in a rule is an error naming the annotation.
    pub fn from_annotations<'a>(
        annotations: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, ConfigError> {
        let mut pod = Self::default();
        for (key, value) in annotations {
            let boolean = || {
                let parsed = parse_bool(value);
                if parsed.is_none() {
                    tracing::warn!(
                        annotation = key,
                        value,
                        "only boolean values are supported; ignoring the annotation"
                    );
                }
                parsed
            };
            match key {
                ANNOTATION_BYPASS_INBOUND_CAPTURE => pod.ingress_mode = boolean().unwrap_or(false),
                ANNOTATION_DNS_CAPTURE => {
                    pod.dns = match boolean() {
                        Some(true) => PodDns::Enabled,
                        Some(false) => PodDns::Disabled,
                        None => PodDns::Unset,
                    }
                }
                ANNOTATION_REROUTE_VIRTUAL_INTERFACES => {
                    pod.virtual_interfaces.clear();
                    for nic in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                        check_interface(ANNOTATION_REROUTE_VIRTUAL_INTERFACES, nic)?;
                        pod.virtual_interfaces.push(nic.to_string());
                    }
                }
                _ => {}
            }
        }
        Ok(pod)
    }

    /// Checks overrides built by hand (not from annotations).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.virtual_interfaces
            .iter()
            .try_for_each(|n| check_interface("PodOverrides::virtual_interfaces", n))
    }
}

/// Everything the in-pod generators read: the agent's settings and the pod's overrides.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InpodConfig {
    pub ambient: AmbientConfig,
    pub pod: PodOverrides,
}

impl InpodConfig {
    /// Whether DNS is captured for this pod: the pod's annotation, else the agent's
    /// setting.
    pub fn redirect_dns(&self) -> bool {
        match self.pod.dns {
            PodDns::Unset => self.ambient.redirect_dns,
            PodDns::Enabled => true,
            PodDns::Disabled => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn pod_rules_take_a_lock_of_their_own_unless_scoped_locking_is_off() {
        use crate::iptables::xtables::Lock;
        let netns = std::path::Path::new("/var/run/netns/cni-1");
        let on = AmbientConfig::from_settings(|_| None).unwrap();
        assert_eq!(on.inpod_lock(netns), Lock::PodScoped(netns.into()));
        let off = AmbientConfig::from_settings(|k| {
            (k == "AMBIENT_USE_SCOPED_XTABLES_LOCKING").then(|| "false".to_string())
        })
        .unwrap();
        assert_eq!(off.inpod_lock(netns), Lock::Global);
        let bad = AmbientConfig::from_settings(|k| {
            (k == "AMBIENT_USE_SCOPED_XTABLES_LOCKING").then(|| "sometimes".to_string())
        })
        .unwrap_err();
        assert!(bad.to_string().contains("AMBIENT_USE_SCOPED_XTABLES_LOCKING"), "{bad}");
    }

    #[test]
    fn settings_use_istios_names_and_defaults() {
        let env: HashMap<&str, &str> = [
            ("AMBIENT_IPV6", "true"),
            ("AMBIENT_DNS_CAPTURE", "1"),
            ("NATIVE_NFTABLES", "true"),
            ("HOST_PROBE_SNAT_IP", "169.254.7.128"),
        ]
        .into();
        let cfg = AmbientConfig::from_settings(|k| env.get(k).map(|v| v.to_string())).unwrap();
        assert!(cfg.enable_ipv6 && cfg.redirect_dns && !cfg.reconcile);
        assert_eq!(cfg.backend, AmbientBackend::Nftables);
        assert_eq!(cfg.host_probe_snat_v4, Ipv4Addr::new(169, 254, 7, 128));
        assert_eq!(cfg.host_probe_snat_v6.to_string(), "fd16:9254:7127:1337:ffff:ffff:ffff:ffff");
        assert_eq!(AmbientConfig::from_settings(|_| None).unwrap(), AmbientConfig::default());
    }

    #[test]
    fn bad_settings_name_the_variable() {
        let e = AmbientConfig::from_settings(|k| (k == "HOST_PROBE_SNAT_IP").then(|| "fd00::1".into()))
            .unwrap_err();
        assert_eq!(e.to_string(), "invalid HOST_PROBE_SNAT_IP: \"fd00::1\": an IPv4 address");
        let e = AmbientConfig::from_settings(|k| (k == "AMBIENT_IPV6").then(|| "yes".into())).unwrap_err();
        assert!(e.to_string().starts_with("invalid AMBIENT_IPV6"), "{e}");
    }

    #[test]
    fn annotations_read_as_istio_reads_them() {
        let pod = PodOverrides::from_annotations([
            (ANNOTATION_BYPASS_INBOUND_CAPTURE, "True"),
            (ANNOTATION_DNS_CAPTURE, "false"),
            (ANNOTATION_REROUTE_VIRTUAL_INTERFACES, " fake1s0f0, ,fake1s0f1,"),
            ("unrelated", "x"),
        ])
        .unwrap();
        assert!(pod.ingress_mode);
        assert_eq!(pod.dns, PodDns::Disabled);
        assert_eq!(pod.virtual_interfaces, ["fake1s0f0", "fake1s0f1"]);
        // Istio ignores a boolean it cannot parse.
        let pod = PodOverrides::from_annotations([(ANNOTATION_DNS_CAPTURE, "yes")]).unwrap();
        assert_eq!(pod.dns, PodDns::Unset);
    }

    #[test]
    fn interface_names_that_could_inject_rules_are_refused() {
        for bad in
            ["eth0 -j ACCEPT", "eth0\n-A OUTPUT", "@set", "a-name-longer-than-15", "eth\"0", "-j", "0eth"]
        {
            let e =
                PodOverrides::from_annotations([(ANNOTATION_REROUTE_VIRTUAL_INTERFACES, bad)]).unwrap_err();
            assert!(e.to_string().starts_with("invalid istio.io/reroute-virtual-interfaces"), "{e}");
        }
        assert!(
            PodOverrides { virtual_interfaces: vec!["x y".into()], ..Default::default() }.validate().is_err()
        );
    }

    #[test]
    fn the_pod_annotation_wins_over_the_agent_for_dns() {
        let on = AmbientConfig { redirect_dns: true, ..Default::default() };
        assert!(on.for_pod(PodOverrides::default()).redirect_dns());
        assert!(!on.for_pod(PodOverrides { dns: PodDns::Disabled, ..Default::default() }).redirect_dns());
        let off = AmbientConfig::default();
        assert!(off.for_pod(PodOverrides { dns: PodDns::Enabled, ..Default::default() }).redirect_dns());
    }
}
