//! The ambient node agent's settings, read once at start under istio-cni's names
//! (the environment its DaemonSet's configmap sets) with istio-cni's *binary* defaults:
//! ambient off, no pod selected, DNS capture, IPv6 and reconcile off. The Helm chart
//! turns most on; `agent/deploy/weir-cni.yaml` sets the chart's values. Weir's own
//! additions are named `WEIR_*`. A value that does not parse is an error naming the
//! variable; [`AmbientSettings::describe`] is what the agent logs at start.

use std::path::PathBuf;

use weir_iptables::{ambient::AmbientConfig, config::ConfigError};

use crate::node::enroll::selector::EnablementSelectors;

/// Where ztunnel expects the agent's ZDS socket (ztunnel's `INPOD_UDS`).
pub const DEFAULT_ZTUNNEL_SOCKET: &str = crate::node::zds::DEFAULT_SOCKET;
/// Istio's `CNI_AGENT_RUN_DIR`: the plugin's kubeconfig and the event socket.
pub const DEFAULT_RUN_DIR: &str = crate::node::cni::spec::DEFAULT_RUN_DIR;
/// Istio's `SYSTEM_NAMESPACE`.
pub const DEFAULT_SYSTEM_NAMESPACE: &str = "istio-system";

/// How ambient pods are captured (`WEIR_AMBIENT_CAPTURE`, Weir's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AmbientCapture {
    /// Istio's in-pod rules (iptables or nftables, as `NATIVE_NFTABLES` says): Istio's
    /// behaviour, held to its goldens.
    #[default]
    Rules,
    /// Weir's eBPF programs through the node capture (`weir cni install
    /// --ebpf-cgroup`); a pod they cannot capture fails its add, naming why.
    Ebpf,
    /// eBPF when the node capture is attached and the pod can be captured by it, else
    /// the in-pod rules; the choice and its reason are logged per pod.
    Auto,
}

impl AmbientCapture {
    pub fn parse(value: &str) -> Result<Self, ConfigError> {
        match value.trim() {
            "" | "rules" => Ok(Self::Rules),
            "ebpf" => Ok(Self::Ebpf),
            "auto" => Ok(Self::Auto),
            other => Err(ConfigError::new("WEIR_AMBIENT_CAPTURE", other, "rules, ebpf or auto")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rules => "rules",
            Self::Ebpf => "ebpf",
            Self::Auto => "auto",
        }
    }
}

/// Every setting of the ambient node agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmbientSettings {
    /// `AMBIENT_ENABLED`.
    pub enabled: bool,
    /// `AMBIENT_ENABLEMENT_SELECTOR`.
    pub selectors: EnablementSelectors,
    /// The rule settings: `AMBIENT_IPV6`, `AMBIENT_DNS_CAPTURE`,
    /// `AMBIENT_RECONCILE_POD_RULES_ON_STARTUP`, `NATIVE_NFTABLES`,
    /// `HOST_PROBE_SNAT_IP(V6)`, `FORCE_IPTABLES_BINARY`.
    pub rules: AmbientConfig,
    /// `ZTUNNEL_UDS_ADDRESS`.
    pub ztunnel_socket: PathBuf,
    /// `CNI_AGENT_RUN_DIR`.
    pub run_dir: PathBuf,
    /// `EXCLUDE_NAMESPACES` (comma separated, empty items dropped).
    pub exclude_namespaces: Vec<String>,
    /// `NODE_NAME`: the pods watched are this node's.
    pub node_name: String,
    /// `POD_NAMESPACE`, `POD_NAME`: the agent's own pod.
    pub pod_namespace: String,
    pub pod_name: String,
    /// `SYSTEM_NAMESPACE`: where ztunnel's pods (never enrolled) run.
    pub system_namespace: String,
    /// `AMBIENT_DISABLE_SAFE_UPGRADE`: every stop is for good (Istio's dataplane
    /// `Stop(cleanup)`): the node's probe rule and sets, and the plugin's chain entry,
    /// are taken out, even while the DaemonSet stays ([`safe_upgrade_disabled`]).
    pub disable_safe_upgrade: bool,
    /// `ENABLE_AMBIENT_DETECTION_RETRY`: written into the plugin's config.
    pub detection_retry: bool,
    /// `AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE` (default true, as Istio 1.30's; empty is
    /// the default, as Istio reads it): on a node with `net.ipv4.tcp_early_demux=0`,
    /// AWS branch-ENI pods get the host rules that keep kubelet's probes reaching them
    /// ([`super::branch_eni`]).
    pub aws_branch_eni_probe: bool,
    /// `WEIR_HOST_ROOT` (default `/host`): the node's root as mounted; the network
    /// namespace paths the plugin sends are resolved under it, every link taken as
    /// relative to it (Istio's `/host`; empty: this container's root).
    pub host_root: PathBuf,
    /// `WEIR_HOST_PROC` (default `/host/proc`): the node's /proc, where pods that started
    /// before the agent are found and kubelet's uid is read.
    pub host_proc: PathBuf,
    /// `WEIR_KUBELET_UID`: kubelet's uid for the nftables probe rule when no kubelet
    /// process can be found (a node without one, a test).
    pub kubelet_uid: Option<u32>,
    /// `WEIR_AMBIENT_CAPTURE` (default `rules`).
    pub capture: AmbientCapture,
    /// `WEIR_ZTUNNEL_UIDS` (default `0`, as ztunnel's chart runs it): the uids a ZDS
    /// peer may run as (comma separated); any other is closed before it is sent a pod.
    pub ztunnel_uids: Vec<u32>,
    /// `WEIR_EBPF_NODE_CAPTURE` (default `cni-node`, as `weir cni install --ebpf-name`):
    /// the node capture eBPF capture registers ambient pods with.
    pub ebpf_node_capture: String,
}

impl Default for AmbientSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            selectors: EnablementSelectors::default(),
            rules: AmbientConfig::default(),
            ztunnel_socket: DEFAULT_ZTUNNEL_SOCKET.into(),
            run_dir: DEFAULT_RUN_DIR.into(),
            exclude_namespaces: Vec::new(),
            node_name: String::new(),
            pod_namespace: String::new(),
            pod_name: String::new(),
            system_namespace: DEFAULT_SYSTEM_NAMESPACE.into(),
            disable_safe_upgrade: false,
            detection_retry: false,
            aws_branch_eni_probe: true,
            host_root: "/host".into(),
            host_proc: "/host/proc".into(),
            kubelet_uid: None,
            capture: AmbientCapture::default(),
            ztunnel_uids: vec![0],
            ebpf_node_capture: crate::node::cni::ebpf::DEFAULT_NODE_CAPTURE.into(),
        }
    }
}

/// A boolean as Go's strconv.ParseBool reads it (viper's reading of Istio's flags).
fn parse_bool(name: &str, value: &str) -> Result<bool, ConfigError> {
    match value.trim() {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" | "" => Ok(false),
        _ => Err(ConfigError::new(name, value, "a boolean (true or false)")),
    }
}

/// Whether every stop of the node agent is for good: `AMBIENT_ENABLED` and
/// `AMBIENT_DISABLE_SAFE_UPGRADE` both true (Istio reads the second only with ambient).
/// Read by every container of Weir's DaemonSet from the shared ConfigMap.
pub fn safe_upgrade_disabled(get: impl Fn(&str) -> Option<String>) -> Result<bool, ConfigError> {
    let flag = |name: &str| get(name).map(|v| parse_bool(name, &v)).transpose().map(|v| v.unwrap_or(false));
    Ok(flag("AMBIENT_ENABLED")? && flag("AMBIENT_DISABLE_SAFE_UPGRADE")?)
}

/// Comma separated, trimmed, empty items dropped (Istio's `SplitExcludeNamespaces`).
pub fn split_namespaces(list: &str) -> Vec<String> {
    list.split(',').map(str::trim).filter(|n| !n.is_empty()).map(String::from).collect()
}

impl AmbientSettings {
    /// Reads every setting through `get` (the environment, or a map in tests).
    pub fn from_settings(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut s = Self { rules: AmbientConfig::from_settings(&get)?, ..Self::default() };
        let flag = |name: &str| get(name).map(|v| parse_bool(name, &v)).transpose();
        s.enabled = flag("AMBIENT_ENABLED")?.unwrap_or(false);
        s.disable_safe_upgrade = flag("AMBIENT_DISABLE_SAFE_UPGRADE")?.unwrap_or(false);
        s.detection_retry = flag("ENABLE_AMBIENT_DETECTION_RETRY")?.unwrap_or(false);
        // Istio's env reads an empty value as its default (true), not as false.
        let branch_eni = "AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE";
        if let Some(v) = get(branch_eni).filter(|v| !v.trim().is_empty()) {
            s.aws_branch_eni_probe = parse_bool(branch_eni, &v)?;
        }
        if let Some(v) = get("AMBIENT_ENABLEMENT_SELECTOR") {
            s.selectors = EnablementSelectors::parse(&v)
                .map_err(|e| ConfigError::new("AMBIENT_ENABLEMENT_SELECTOR", &v, e.to_string()))?;
        }
        let path = |name: &str, into: &mut PathBuf| {
            if let Some(v) = get(name).filter(|v| !v.is_empty()) {
                *into = v.into();
            }
        };
        path("ZTUNNEL_UDS_ADDRESS", &mut s.ztunnel_socket);
        path("CNI_AGENT_RUN_DIR", &mut s.run_dir);
        path("WEIR_HOST_PROC", &mut s.host_proc);
        if let Some(v) = get("WEIR_HOST_ROOT") {
            s.host_root = v.into();
        }
        s.exclude_namespaces = split_namespaces(&get("EXCLUDE_NAMESPACES").unwrap_or_default());
        s.node_name = get("NODE_NAME").unwrap_or_default();
        s.pod_namespace = get("POD_NAMESPACE").unwrap_or_default();
        s.pod_name = get("POD_NAME").unwrap_or_default();
        if let Some(v) = get("SYSTEM_NAMESPACE").filter(|v| !v.is_empty()) {
            s.system_namespace = v;
        }
        if let Some(v) = get("WEIR_KUBELET_UID").filter(|v| !v.is_empty()) {
            s.kubelet_uid = Some(
                v.trim().parse().map_err(|_| ConfigError::new("WEIR_KUBELET_UID", &v, "a uid (a number)"))?,
            );
        }
        if let Some(v) = get("WEIR_ZTUNNEL_UIDS").filter(|v| !v.trim().is_empty()) {
            s.ztunnel_uids =
                v.split(',').map(|u| u.trim().parse::<u32>()).collect::<Result<_, _>>().map_err(|_| {
                    ConfigError::new("WEIR_ZTUNNEL_UIDS", &v, "uids (numbers), comma separated")
                })?;
        }
        if let Some(v) = get("WEIR_AMBIENT_CAPTURE") {
            s.capture = AmbientCapture::parse(&v)?;
        }
        if let Some(v) = get("WEIR_EBPF_NODE_CAPTURE").filter(|v| !v.is_empty()) {
            s.ebpf_node_capture = v;
        }
        if s.enabled && s.node_name.is_empty() {
            return Err(ConfigError::new(
                "NODE_NAME",
                "",
                "this node's name (the DaemonSet sets it from spec.nodeName) when AMBIENT_ENABLED=true",
            ));
        }
        Ok(s)
    }

    /// Whether pods of `namespace` are never enrolled.
    pub fn excluded(&self, namespace: &str) -> bool {
        self.exclude_namespaces.iter().any(|n| n == namespace)
    }

    /// The event socket the plugin posts to.
    pub fn event_socket(&self) -> PathBuf {
        self.run_dir.join(crate::node::enroll::event::SOCKET_NAME)
    }

    /// One line per setting, for the start-up log.
    pub fn describe(&self) -> String {
        let r = &self.rules;
        format!(
            "AMBIENT_ENABLED={} AMBIENT_ENABLEMENT_SELECTOR={} entries AMBIENT_DNS_CAPTURE={} AMBIENT_IPV6={} \
             AMBIENT_RECONCILE_POD_RULES_ON_STARTUP={} NATIVE_NFTABLES={} ZTUNNEL_UDS_ADDRESS={} \
             CNI_AGENT_RUN_DIR={} EXCLUDE_NAMESPACES={} NODE_NAME={} SYSTEM_NAMESPACE={} HOST_PROBE_SNAT_IP={} \
             HOST_PROBE_SNAT_IPV6={} WEIR_HOST_ROOT={} WEIR_HOST_PROC={} WEIR_AMBIENT_CAPTURE={} \
             WEIR_EBPF_NODE_CAPTURE={} WEIR_ZTUNNEL_UIDS={} AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE={}",
            self.enabled,
            self.selectors.entries().len(),
            r.redirect_dns,
            r.enable_ipv6,
            r.reconcile,
            r.backend == weir_iptables::ambient::AmbientBackend::Nftables,
            self.ztunnel_socket.display(),
            self.run_dir.display(),
            self.exclude_namespaces.join(","),
            self.node_name,
            self.system_namespace,
            r.host_probe_snat_v4,
            r.host_probe_snat_v6,
            self.host_root.display(),
            self.host_proc.display(),
            self.capture.as_str(),
            self.ebpf_node_capture,
            self.ztunnel_uids.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
            self.aws_branch_eni_probe,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn read(pairs: &[(&str, &str)]) -> Result<AmbientSettings, ConfigError> {
        let env: HashMap<&str, &str> = pairs.iter().copied().collect();
        AmbientSettings::from_settings(|k| env.get(k).map(|v| v.to_string()))
    }

    #[test]
    fn istios_names_and_binary_defaults() {
        let s = read(&[]).unwrap();
        assert_eq!(s, AmbientSettings::default());
        assert!(!s.enabled && s.selectors.is_empty() && !s.rules.redirect_dns && !s.rules.enable_ipv6);
        assert_eq!(s.ztunnel_socket, PathBuf::from("/var/run/ztunnel/ztunnel.sock"));
        assert_eq!(s.event_socket(), PathBuf::from("/var/run/istio-cni/pluginevent.sock"));
        let s = read(&[
            ("AMBIENT_ENABLED", "true"),
            (
                "AMBIENT_ENABLEMENT_SELECTOR",
                "- podSelector: {matchLabels: {istio.io/dataplane-mode: ambient}}",
            ),
            ("AMBIENT_DNS_CAPTURE", "true"),
            ("AMBIENT_IPV6", "true"),
            ("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "true"),
            ("NATIVE_NFTABLES", "true"),
            ("ZTUNNEL_UDS_ADDRESS", "/run/zt.sock"),
            ("CNI_AGENT_RUN_DIR", "/run/cni"),
            ("EXCLUDE_NAMESPACES", "kube-system, ,istio-system,"),
            ("NODE_NAME", "n1"),
            ("WEIR_HOST_ROOT", ""),
            ("WEIR_KUBELET_UID", "1000"),
        ])
        .unwrap();
        assert!(s.enabled && s.rules.redirect_dns && s.rules.enable_ipv6 && s.rules.reconcile);
        assert_eq!(s.selectors.entries().len(), 1);
        assert_eq!(s.exclude_namespaces, ["kube-system", "istio-system"]);
        assert!(s.excluded("istio-system") && !s.excluded("default"));
        assert_eq!(s.event_socket(), PathBuf::from("/run/cni/pluginevent.sock"));
        assert_eq!(s.host_root, PathBuf::new());
        assert_eq!(s.kubelet_uid, Some(1000));
        assert_eq!(s.capture, AmbientCapture::Rules);
        let s = read(&[("WEIR_AMBIENT_CAPTURE", "auto"), ("WEIR_EBPF_NODE_CAPTURE", "n1-capture")]).unwrap();
        assert_eq!((s.capture, s.ebpf_node_capture.as_str()), (AmbientCapture::Auto, "n1-capture"));
        assert_eq!(AmbientSettings::default().host_root, PathBuf::from("/host"));
    }

    #[test]
    fn the_aws_branch_eni_probe_is_on_unless_set_false_and_is_described() {
        assert!(read(&[]).unwrap().aws_branch_eni_probe, "Istio's default");
        assert!(read(&[("AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE", "")]).unwrap().aws_branch_eni_probe);
        for off in ["false", "0", "F"] {
            let s = read(&[("AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE", off)]).unwrap();
            assert!(!s.aws_branch_eni_probe, "{off}");
            assert!(s.describe().contains("AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE=false"), "{}", s.describe());
        }
        assert!(read(&[]).unwrap().describe().contains("AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE=true"));
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (pairs, needle) in [
            (&[("AMBIENT_ENABLED", "yes")][..], "invalid AMBIENT_ENABLED"),
            (
                &[(
                    "AMBIENT_ENABLEMENT_SELECTOR",
                    "- podSelector: {matchExpressions: [{key: k, operator: In}]}",
                )][..],
                "invalid AMBIENT_ENABLEMENT_SELECTOR",
            ),
            (&[("AMBIENT_ENABLED", "true")][..], "invalid NODE_NAME"),
            (&[("WEIR_KUBELET_UID", "kubelet")][..], "invalid WEIR_KUBELET_UID"),
            (&[("WEIR_ZTUNNEL_UIDS", "0,ztunnel")][..], "invalid WEIR_ZTUNNEL_UIDS"),
            (&[("AMBIENT_IPV6", "on")][..], "invalid AMBIENT_IPV6"),
            (&[("WEIR_AMBIENT_CAPTURE", "bpf")][..], "invalid WEIR_AMBIENT_CAPTURE"),
            (
                &[("AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE", "yes")][..],
                "invalid AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE",
            ),
        ] {
            let e = read(pairs).unwrap_err().to_string();
            assert!(e.starts_with(needle), "{pairs:?}: {e}");
        }
    }
}
