//! What the CNI plugin does for one pod, decided from its Kubernetes object as
//! istio-cni decides it: the skip rules (no sidecar, `istio-init` present,
//! `DISABLE_ENVOY`, a proxy type other than sidecar, injection disabled, no
//! `sidecar.istio.io/status`), then the capture config from the sidecar annotations
//! and the istio-proxy container's env and securityContext, with istio-cni's defaults
//! (all inbound ports, all outbound ranges, 15020/15021/15090 never captured inbound,
//! 15020 never outbound, DNS capture capturing all DNS). Pure.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use weir_iptables::{
    CaptureConfig,
    config::{InboundPorts, InterceptionMode, IpRanges, parse_exclude_ranges, parse_interfaces, parse_ports},
};

pub const ISTIO_PROXY: &str = "istio-proxy";
pub const ISTIO_INIT: &str = "istio-init";

const INJECT: &str = "sidecar.istio.io/inject";
const STATUS: &str = "sidecar.istio.io/status";
const INTERCEPTION_MODE: &str = "sidecar.istio.io/interceptionMode";
const INCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
const EXCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
const INCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
const EXCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
const INCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
const EXCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
const EXCLUDE_INTERFACES: &str = "traffic.sidecar.istio.io/excludeInterfaces";
const KUBEVIRT_INTERFACES: &str = "traffic.sidecar.istio.io/kubevirtInterfaces";
const REROUTE_VIRTUAL_INTERFACES: &str = "istio.io/reroute-virtual-interfaces";

/// Ports the sidecar's own listeners use: never captured inbound.
const ALWAYS_EXCLUDED_INBOUND: [&str; 3] = ["15020", "15021", "15090"];

/// The parts of a Kubernetes Pod the plugin reads.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// Init containers and containers, by name.
    pub containers: BTreeSet<String>,
    /// istio-proxy's env (plain `value`s; `valueFrom` entries are empty).
    pub proxy_env: BTreeMap<String, String>,
    /// istio-proxy's args[1] when args[0] is `proxy`.
    pub proxy_type: Option<String>,
    pub proxy_uid: Option<i64>,
    pub proxy_gid: Option<i64>,
    /// `spec.nodeName`, `status.podIP`, `spec.hostNetwork` (for repair).
    pub node_name: String,
    pub pod_ip: Option<std::net::IpAddr>,
    pub host_network: bool,
    pub uid: String,
}

#[derive(Deserialize)]
struct Pod {
    metadata: Metadata,
    #[serde(default, deserialize_with = "null_as_default")]
    spec: Spec,
    #[serde(default, deserialize_with = "null_as_default")]
    status: Status,
}

#[derive(Deserialize, Default)]
struct Status {
    #[serde(rename = "podIP", default, deserialize_with = "null_as_default")]
    pod_ip: String,
}

#[derive(Deserialize)]
struct Metadata {
    #[serde(default, deserialize_with = "null_as_default")]
    name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    namespace: String,
    #[serde(default, deserialize_with = "null_as_default")]
    labels: BTreeMap<String, String>,
    #[serde(default, deserialize_with = "null_as_default")]
    annotations: BTreeMap<String, String>,
    #[serde(default, deserialize_with = "null_as_default")]
    uid: String,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Spec {
    #[serde(default, deserialize_with = "null_as_default")]
    containers: Vec<Container>,
    #[serde(default, deserialize_with = "null_as_default")]
    init_containers: Vec<Container>,
    #[serde(default, deserialize_with = "null_as_default")]
    node_name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    host_network: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Container {
    name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    args: Vec<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    env: Vec<EnvVar>,
    #[serde(default, deserialize_with = "null_as_default")]
    security_context: Option<SecurityContext>,
}

#[derive(Deserialize)]
struct EnvVar {
    name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    value: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SecurityContext {
    run_as_user: Option<i64>,
    run_as_group: Option<i64>,
}

/// A field the API sends as `null` (Go's encoding of a nil slice or map) is empty, as
/// Go's decoder takes it.
fn null_as_default<'de, D: serde::Deserializer<'de>, T: Default + Deserialize<'de>>(
    d: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

impl PodInfo {
    /// From a `v1/Pod` as the API server returns it.
    pub fn from_json(json: &[u8]) -> Result<Self, serde_json::Error> {
        Ok(Self::from_pod(serde_json::from_slice(json)?))
    }

    /// Every pod of a `v1/PodList`.
    pub fn list_from_json(json: &[u8]) -> Result<Vec<Self>, serde_json::Error> {
        #[derive(Deserialize)]
        struct PodList {
            #[serde(default, deserialize_with = "null_as_default")]
            items: Vec<Pod>,
        }
        Ok(serde_json::from_slice::<PodList>(json)?.items.into_iter().map(Self::from_pod).collect())
    }

    fn from_pod(pod: Pod) -> Self {
        let mut info = PodInfo {
            namespace: pod.metadata.namespace,
            name: pod.metadata.name,
            labels: pod.metadata.labels,
            annotations: pod.metadata.annotations,
            uid: pod.metadata.uid,
            node_name: pod.spec.node_name,
            host_network: pod.spec.host_network,
            pod_ip: pod.status.pod_ip.parse().ok(),
            ..Default::default()
        };
        for c in pod.spec.init_containers.into_iter().chain(pod.spec.containers) {
            if c.name == ISTIO_PROXY {
                info.proxy_env = c.env.into_iter().map(|e| (e.name, e.value)).collect();
                if c.args.len() >= 2 && c.args[0] == "proxy" {
                    info.proxy_type = Some(c.args[1].clone());
                }
                if let Some(sc) = c.security_context {
                    info.proxy_uid = sc.run_as_user;
                    info.proxy_gid = sc.run_as_group;
                }
            }
            info.containers.insert(c.name);
        }
        info
    }
}

/// Why a pod is left alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    ExcludedNamespace,
    HasIstioInit,
    EnvoyDisabled,
    NoSidecar,
    NotASidecar(String),
    InjectionDisabled,
    NotInjected,
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Skip::ExcludedNamespace => write!(f, "its namespace is excluded"),
            Skip::HasIstioInit => write!(f, "it has an istio-init container (capture is done there)"),
            Skip::EnvoyDisabled => write!(f, "DISABLE_ENVOY is set on istio-proxy"),
            Skip::NoSidecar => write!(f, "it has no istio-proxy container"),
            Skip::NotASidecar(t) => write!(f, "its proxy type is {t}, not sidecar"),
            Skip::InjectionDisabled => write!(f, "sidecar injection is disabled for it"),
            Skip::NotInjected => write!(f, "it has no sidecar.istio.io/status annotation"),
        }
    }
}

/// A bad capture annotation: which, its value, what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pod annotation {annotation}={value:?}: {message}")]
pub struct AnnotationError {
    pub annotation: &'static str,
    pub value: String,
    pub message: String,
}

fn parse_bool(v: &str) -> Option<bool> {
    weir_iptables::flags::parse_bool(v)
}

/// The pod annotation that sets what an istio-iptables flag sets (`-x/--...` as
/// errors name flags), for errors about a pod's capture.
pub fn annotation_for_flag(input: &str) -> Option<&'static str> {
    let flag = input.split('/').next().unwrap_or(input);
    Some(match flag {
        "-x" => EXCLUDE_OUTBOUND_IP_RANGES,
        "-i" => INCLUDE_OUTBOUND_IP_RANGES,
        "-o" => EXCLUDE_OUTBOUND_PORTS,
        "-q" => INCLUDE_OUTBOUND_PORTS,
        "-d" => EXCLUDE_INBOUND_PORTS,
        "-b" => INCLUDE_INBOUND_PORTS,
        "-c" => EXCLUDE_INTERFACES,
        "-k" => REROUTE_VIRTUAL_INTERFACES,
        _ => return None,
    })
}

/// Whether to capture, per istio-cni's rules (namespace exclusion is the caller's).
pub fn skip_reason(pod: &PodInfo) -> Option<Skip> {
    if pod.containers.contains(ISTIO_INIT) {
        return Some(Skip::HasIstioInit);
    }
    if pod.proxy_env.get("DISABLE_ENVOY").and_then(|v| parse_bool(v)) == Some(true) {
        return Some(Skip::EnvoyDisabled);
    }
    if !pod.containers.contains(ISTIO_PROXY) {
        return Some(Skip::NoSidecar);
    }
    if let Some(t) = pod.proxy_type.as_deref().filter(|t| !t.is_empty() && *t != "sidecar") {
        return Some(Skip::NotASidecar(t.to_string()));
    }
    // The label is the newer API and wins over the annotation.
    let inject = pod.labels.get(INJECT).or_else(|| pod.annotations.get(INJECT));
    if inject.and_then(|v| parse_bool(v)) == Some(false) {
        return Some(Skip::InjectionDisabled);
    }
    if !pod.annotations.contains_key(STATUS) {
        return Some(Skip::NotInjected);
    }
    None
}

/// The capture config for a pod that is captured. `enable_ipv6` comes from the pod's
/// addresses (the caller looks inside its namespace).
pub fn capture_config(pod: &PodInfo, enable_ipv6: bool) -> Result<CaptureConfig, AnnotationError> {
    let a = |key: &'static str, default: &str| -> (&'static str, String) {
        (key, pod.annotations.get(key).cloned().unwrap_or_else(|| default.to_string()))
    };
    let err = |(annotation, value): &(&'static str, String), e: &dyn std::fmt::Display| AnnotationError {
        annotation,
        value: value.clone(),
        message: e.to_string(),
    };
    let mut cfg = CaptureConfig::default();
    let mode = a(INTERCEPTION_MODE, "REDIRECT");
    cfg.interception_mode = match mode.1.as_str() {
        "REDIRECT" => InterceptionMode::Redirect,
        "TPROXY" => InterceptionMode::Tproxy,
        _ => return Err(err(&mode, &"expected REDIRECT or TPROXY")),
    };
    // runAsUser/runAsGroup 0 falls back to 1337, as istio-cni does.
    let id = |v: Option<i64>| v.filter(|v| *v != 0).map(|v| v.to_string()).unwrap_or_else(|| "1337".into());
    cfg.proxy_uids = vec![id(pod.proxy_uid)];
    cfg.proxy_gids = vec![id(pod.proxy_gid)];

    let include_ranges = a(INCLUDE_OUTBOUND_IP_RANGES, "*");
    cfg.outbound_ip_ranges_include =
        IpRanges::parse(include_ranges.0, &include_ranges.1).map_err(|e| err(&include_ranges, &e))?;
    let exclude_ranges = a(EXCLUDE_OUTBOUND_IP_RANGES, "");
    cfg.outbound_ip_ranges_exclude =
        parse_exclude_ranges(exclude_ranges.0, &exclude_ranges.1).map_err(|e| err(&exclude_ranges, &e))?;
    let include_inbound = a(INCLUDE_INBOUND_PORTS, "*");
    cfg.inbound_ports =
        InboundPorts::parse(include_inbound.0, &include_inbound.1).map_err(|e| err(&include_inbound, &e))?;
    let exclude_inbound = a(EXCLUDE_INBOUND_PORTS, "15020");
    let mut merged: Vec<String> = Vec::new();
    for p in exclude_inbound.1.split(',').map(str::trim).chain(ALWAYS_EXCLUDED_INBOUND) {
        if !p.is_empty() && !merged.iter().any(|m| m == p) {
            merged.push(p.to_string());
        }
    }
    cfg.inbound_ports_exclude =
        parse_ports(exclude_inbound.0, &merged.join(",")).map_err(|e| err(&exclude_inbound, &e))?;
    let exclude_outbound = a(EXCLUDE_OUTBOUND_PORTS, "15020");
    cfg.outbound_ports_exclude = if exclude_outbound.1 == "*" {
        return Err(err(&exclude_outbound, &"expected a port list (istio-iptables has no wildcard here)"));
    } else {
        parse_ports(exclude_outbound.0, &exclude_outbound.1).map_err(|e| err(&exclude_outbound, &e))?
    };
    let include_outbound = a(INCLUDE_OUTBOUND_PORTS, "");
    cfg.outbound_ports_include =
        parse_ports(include_outbound.0, &include_outbound.1).map_err(|e| err(&include_outbound, &e))?;
    // Istio's rule for a name (a letter, then letters, digits, '_', '.', '-'; at most
    // 15 bytes): nothing else reaches the rules' text.
    let interfaces = |key: &'static str| -> Result<Vec<String>, AnnotationError> {
        let v = a(key, "");
        parse_interfaces(v.0, &v.1).map_err(|e| {
            err(&v, &format!("{:?} is not a valid interface name: expected {}", e.value, e.expected))
        })
    };
    cfg.exclude_interfaces = interfaces(EXCLUDE_INTERFACES)?;
    cfg.reroute_virtual_interfaces = if pod.annotations.contains_key(REROUTE_VIRTUAL_INTERFACES) {
        interfaces(REROUTE_VIRTUAL_INTERFACES)?
    } else {
        interfaces(KUBEVIRT_INTERFACES)?
    };
    let env_bool = |name: &str| pod.proxy_env.get(name).and_then(|v| parse_bool(v)).unwrap_or(false);
    cfg.redirect_dns = env_bool("ISTIO_META_DNS_CAPTURE");
    cfg.capture_all_dns = cfg.redirect_dns;
    cfg.drop_invalid = env_bool("INVALID_DROP");
    cfg.enable_ipv6 = enable_ipv6;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: &str = r#"{
      "apiVersion": "v1", "kind": "Pod",
      "metadata": {"name": "web-1", "namespace": "shop", "labels": {"app": "web"},
                   "annotations": {"sidecar.istio.io/status": "{}"}},
      "status": {"podIP": "10.1.0.7"},
      "spec": {
        "nodeName": "node-1",
        "initContainers": [{"name": "istio-validate", "image": "x"}],
        "containers": [
          {"name": "web", "image": "web"},
          {"name": "istio-proxy", "args": ["proxy", "sidecar", "--domain", "x"],
           "env": [{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"},
                   {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
           "securityContext": {"runAsUser": 1000670000, "runAsGroup": 1000670001}}
        ]
      }
    }"#;

    /// `null` where a list or map is (Go's nil slice) reads as empty, as Go's decoder
    /// reads it: before, ADD failed for such a pod ("invalid type: null").
    #[test]
    fn nulls_for_lists_and_maps_read_as_empty() {
        let pod = r#"{"metadata": {"name": "p", "namespace": "d", "labels": null, "annotations": null},
                      "spec": {"initContainers": null, "containers": [{"name": "app", "args": null, "env": null}]},
                      "status": {"podIP": null}}"#;
        let p = PodInfo::from_json(pod.as_bytes()).unwrap();
        assert_eq!(p.containers.iter().map(String::as_str).collect::<Vec<_>>(), ["app"]);
        assert!(p.labels.is_empty() && p.pod_ip.is_none());
    }

    #[test]
    fn pods_read_as_istio_cni_reads_them() {
        let p = PodInfo::from_json(POD.as_bytes()).unwrap();
        assert_eq!((p.namespace.as_str(), p.name.as_str()), ("shop", "web-1"));
        assert_eq!(
            p.containers.iter().map(String::as_str).collect::<Vec<_>>(),
            ["istio-proxy", "istio-validate", "web"]
        );
        assert_eq!(p.proxy_type.as_deref(), Some("sidecar"));
        assert_eq!((p.proxy_uid, p.proxy_gid), (Some(1000670000), Some(1000670001)));
        assert_eq!(p.proxy_env["ISTIO_META_DNS_CAPTURE"], "true");
        assert_eq!(p.proxy_env["POD_NAME"], "");
        assert_eq!((p.node_name.as_str(), p.pod_ip), ("node-1", Some("10.1.0.7".parse().unwrap())));
        assert_eq!(skip_reason(&p), None);
        let c = capture_config(&p, false).unwrap();
        assert_eq!((c.proxy_uids[0].as_str(), c.proxy_gids[0].as_str()), ("1000670000", "1000670001"));
        assert!(c.redirect_dns && c.capture_all_dns);
    }

    #[test]
    fn the_skip_rules_are_istio_cnis() {
        let base = PodInfo::from_json(POD.as_bytes()).unwrap();
        let with = |f: &dyn Fn(&mut PodInfo)| {
            let mut p = base.clone();
            f(&mut p);
            skip_reason(&p)
        };
        assert_eq!(
            with(&|p| {
                p.containers.insert("istio-init".into());
            }),
            Some(Skip::HasIstioInit)
        );
        assert_eq!(
            with(&|p| {
                p.proxy_env.insert("DISABLE_ENVOY".into(), "true".into());
            }),
            Some(Skip::EnvoyDisabled)
        );
        assert_eq!(
            with(&|p| {
                p.containers.remove("istio-proxy");
            }),
            Some(Skip::NoSidecar)
        );
        assert_eq!(with(&|p| p.proxy_type = Some("router".into())), Some(Skip::NotASidecar("router".into())));
        assert_eq!(
            with(&|p| {
                p.annotations.insert(INJECT.into(), "false".into());
            }),
            Some(Skip::InjectionDisabled)
        );
        assert_eq!(
            with(&|p| {
                p.annotations.insert(INJECT.into(), "false".into());
                p.labels.insert(INJECT.into(), "true".into());
            }),
            None,
            "the label wins over the annotation"
        );
        assert_eq!(
            with(&|p| {
                p.annotations.remove(STATUS);
            }),
            Some(Skip::NotInjected)
        );
    }

    #[test]
    fn bad_annotations_are_named() {
        let mut p = PodInfo::from_json(POD.as_bytes()).unwrap();
        for (key, value, needle) in [
            (INTERCEPTION_MODE, "MAGIC", "REDIRECT or TPROXY"),
            (INCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/33", "10.0.0.0/33"),
            (EXCLUDE_INBOUND_PORTS, "http", "http"),
            (EXCLUDE_INTERFACES, "this-name-is-far-too-long", "not a valid interface name"),
            (
                EXCLUDE_INTERFACES,
                "eth0,net1\" accept #",
                "\"net1\\\" accept #\" is not a valid interface name",
            ),
            (EXCLUDE_INTERFACES, "eth0;", "a letter followed by letters, digits"),
            (EXCLUDE_INTERFACES, "eth0 -d 10.0.0.50 -p tcp", "not a valid interface name"),
            (KUBEVIRT_INTERFACES, "veth{", "not a valid interface name"),
            (REROUTE_VIRTUAL_INTERFACES, "net1\n-A OUTPUT -j ACCEPT", "not a valid interface name"),
        ] {
            p.annotations.insert(key.into(), value.into());
            let e = capture_config(&p, false).unwrap_err();
            assert_eq!(e.annotation, key);
            assert!(e.to_string().contains(needle), "{e}");
            p.annotations.remove(key);
        }
    }
}
