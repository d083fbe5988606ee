//! The CNI protocol as a plugin sees it (spec 1.0.0; 0.3.x, 0.4.0 and 1.1.0 configs
//! accepted): the command and its parameters from `CNI_*` environment variables, the
//! network configuration on stdin (with `prevResult` kept as raw JSON and passed on
//! unchanged), Kubernetes' `CNI_ARGS`, and errors in the spec's JSON shape with its
//! well-known codes. Pure: no I/O beyond what the caller hands in.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The versions this plugin accepts in a network configuration.
pub const SUPPORTED_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// Istio's default `cni_agent_run_dir` (the plugin's kubeconfig, the agent's event
/// socket).
pub const DEFAULT_RUN_DIR: &str = "/var/run/istio-cni";

/// The version this plugin implements.
pub const IMPLEMENTED_VERSION: &str = "1.0.0";

/// The spec's well-known error codes.
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const UNKNOWN_CONTAINER: u32 = 3;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODE_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// STATUS: the plugin cannot serve ADDs now.
    pub const NOT_AVAILABLE: u32 = 50;
    /// Plugin-specific (≥ 100): capture could not be applied or verified.
    pub const CAPTURE_FAILED: u32 = 100;
    /// Plugin-specific: the Kubernetes API did not give us the pod.
    pub const POD_LOOKUP_FAILED: u32 = 101;
    /// Plugin-specific: the pod's capture annotations are invalid.
    pub const INVALID_POD: u32 = 102;
}

/// A CNI error: what the runtime reads from stdout after a non-zero exit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("CNI error {code}: {msg}{}", if .details.is_empty() { String::new() } else { format!(" ({})", .details) })]
pub struct CniError {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    pub code: u32,
    pub msg: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self { cni_version: IMPLEMENTED_VERSION.into(), code, msg: msg.into(), details: details.into() }
    }

    /// Reported in the configuration's version when it is one we speak.
    pub fn in_version(mut self, version: &str) -> Self {
        if SUPPORTED_VERSIONS.contains(&version) {
            self.cni_version = version.into();
        }
        self
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a CNI error serializes")
    }
}

/// `CNI_COMMAND`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Version,
    Status,
    Gc,
}

impl Command {
    pub fn name(self) -> &'static str {
        match self {
            Self::Add => "ADD",
            Self::Del => "DEL",
            Self::Check => "CHECK",
            Self::Version => "VERSION",
            Self::Status => "STATUS",
            Self::Gc => "GC",
        }
    }

    pub fn parse(value: &str) -> Result<Self, CniError> {
        match value {
            "ADD" => Ok(Self::Add),
            "DEL" => Ok(Self::Del),
            "CHECK" => Ok(Self::Check),
            "VERSION" => Ok(Self::Version),
            "STATUS" => Ok(Self::Status),
            "GC" => Ok(Self::Gc),
            "" => Err(CniError::new(
                code::INVALID_ENV,
                "CNI_COMMAND is not set",
                "expected ADD, DEL, CHECK, VERSION, STATUS or GC",
            )),
            other => Err(CniError::new(
                code::INVALID_ENV,
                format!("CNI_COMMAND {other:?} is not a CNI command"),
                "expected ADD, DEL, CHECK, VERSION, STATUS or GC",
            )),
        }
    }
}

/// The invocation's parameters (`CNI_*`), checked for what each command requires.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Invocation {
    pub container_id: String,
    /// `CNI_NETNS`: required for ADD and CHECK, optional for DEL.
    pub netns: Option<String>,
    pub ifname: String,
    /// `CNI_ARGS`, `K=V;K=V`.
    pub args: BTreeMap<String, String>,
    pub path: Vec<String>,
}

impl Invocation {
    /// From the environment (`get` reads one variable), for `command`.
    pub fn from_env(command: Command, get: impl Fn(&str) -> Option<String>) -> Result<Self, CniError> {
        let need = |name: &str| -> Result<String, CniError> {
            get(name).filter(|v| !v.is_empty()).ok_or_else(|| {
                CniError::new(code::INVALID_ENV, format!("{name} is required for {}", command.name()), "")
            })
        };
        let mut inv = Self {
            path: get("CNI_PATH")
                .unwrap_or_default()
                .split(':')
                .filter(|p| !p.is_empty())
                .map(String::from)
                .collect(),
            args: parse_args(&get("CNI_ARGS").unwrap_or_default())?,
            ..Self::default()
        };
        match command {
            Command::Add | Command::Check => {
                inv.container_id = need("CNI_CONTAINERID")?;
                inv.netns = Some(need("CNI_NETNS")?);
                inv.ifname = need("CNI_IFNAME")?;
            }
            Command::Del => {
                inv.container_id = need("CNI_CONTAINERID")?;
                inv.netns = get("CNI_NETNS").filter(|v| !v.is_empty());
                inv.ifname = need("CNI_IFNAME")?;
            }
            Command::Version | Command::Status | Command::Gc => {}
        }
        Ok(inv)
    }

    /// Kubernetes' pod identity from `CNI_ARGS`, when the runtime passed it.
    pub fn pod(&self) -> Option<(String, String)> {
        let name = self.args.get("K8S_POD_NAME").filter(|v| !v.is_empty())?;
        let namespace = self.args.get("K8S_POD_NAMESPACE").filter(|v| !v.is_empty())?;
        Some((namespace.clone(), name.clone()))
    }
}

/// `CNI_ARGS`: `K=V` pairs separated by `;`.
pub fn parse_args(raw: &str) -> Result<BTreeMap<String, String>, CniError> {
    raw.split(';')
        .filter(|p| !p.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(CniError::new(
                code::INVALID_ENV,
                format!("CNI_ARGS entry {pair:?} is not KEY=VALUE"),
                raw.to_string(),
            )),
        })
        .collect()
}

/// The network configuration on stdin: the spec's fields, Istio's and Weir's.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct NetConf {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    #[serde(default)]
    pub name: String,
    #[serde(rename = "type", default)]
    pub plugin_type: String,
    #[serde(rename = "prevResult", default)]
    pub prev_result: Option<Value>,
    /// Istio: `plugin_log_level` (current) or `log_level` (legacy).
    #[serde(default)]
    pub plugin_log_level: Option<String>,
    #[serde(default)]
    pub log_level: Option<String>,
    /// Istio: where the node agent keeps `istio-cni-kubeconfig`.
    #[serde(default)]
    pub cni_agent_run_dir: Option<String>,
    /// Istio writes `null` for none.
    #[serde(default, deserialize_with = "null_as_default")]
    pub exclude_namespaces: Vec<String>,
    #[serde(default)]
    pub native_nftables: bool,
    /// Istio: ambient pods go to the node agent's event socket.
    #[serde(default)]
    pub ambient_enabled: bool,
    /// Istio: which pods are ambient (`AMBIENT_ENABLEMENT_SELECTOR`, as JSON).
    #[serde(default, deserialize_with = "null_as_default")]
    pub enablement_selectors: Vec<crate::node::enroll::selector::EnablementSelector>,
    /// Istio: retry the ambient check while the API server does not answer (30 retries
    /// of the namespace read instead of 1, 1 s apart).
    #[serde(default)]
    pub enable_ambient_detection_retry: bool,
    /// Istio's legacy `kubernetes` section.
    #[serde(default)]
    pub kubernetes: Option<LegacyKubernetes>,
    /// Weir: ebpf | nftables | iptables | auto.
    #[serde(default)]
    pub capture_mode: Option<String>,
    /// Weir: the node's pinned eBPF capture (`weir cni install --ebpf-cgroup`).
    #[serde(default)]
    pub ebpf_node_capture: Option<String>,
    /// The pod namespace of the node agent itself (its own pods are never captured).
    #[serde(default)]
    pub pod_namespace: Option<String>,
}

/// A field Istio may write as `null`: read as its default.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
pub struct LegacyKubernetes {
    #[serde(default)]
    pub kubeconfig: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub exclude_namespaces: Vec<String>,
    #[serde(default)]
    pub cni_bin_dir: Option<String>,
}

impl NetConf {
    /// Parses and checks the version (code 6 for bad JSON, 1 for a version we do not
    /// speak, 7 for a missing `cniVersion`).
    pub fn parse(stdin: &[u8]) -> Result<Self, CniError> {
        let conf: NetConf = serde_json::from_slice(stdin).map_err(|e| {
            let code = if e.is_data() { code::INVALID_CONFIG } else { code::DECODE_FAILURE };
            CniError::new(code, "the network configuration on stdin is not valid", e.to_string())
        })?;
        if !SUPPORTED_VERSIONS.contains(&conf.cni_version.as_str()) {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!("cniVersion {:?} is not supported", conf.cni_version),
                format!("supported: {}", SUPPORTED_VERSIONS.join(", ")),
            ));
        }
        if let Some(prev) = &conf.prev_result
            && !prev.is_object()
        {
            return Err(CniError::new(
                code::INVALID_CONFIG,
                "prevResult is not a JSON object",
                prev.to_string(),
            ));
        }
        Ok(conf)
    }

    /// Namespaces whose pods are never captured (current and legacy fields).
    pub fn excluded_namespaces(&self) -> impl Iterator<Item = &str> {
        self.exclude_namespaces
            .iter()
            .chain(self.kubernetes.iter().flat_map(|k| k.exclude_namespaces.iter()))
            .map(String::as_str)
    }

    /// What ADD prints: `prevResult` unchanged (in the config's version), or an empty
    /// result when this plugin is first in the chain.
    pub fn result(&self) -> String {
        let mut result = self.prev_result.clone().unwrap_or_else(|| serde_json::json!({}));
        if let Some(obj) = result.as_object_mut() {
            obj.insert("cniVersion".into(), Value::String(self.cni_version.clone()));
        }
        result.to_string()
    }
}

/// VERSION's answer.
pub fn version_result() -> String {
    serde_json::json!({ "cniVersion": IMPLEMENTED_VERSION, "supportedVersions": SUPPORTED_VERSIONS })
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn commands_and_their_required_parameters() {
        assert_eq!(Command::parse("ADD"), Ok(Command::Add));
        let e = Command::parse("add").unwrap_err();
        assert_eq!(e.code, code::INVALID_ENV);
        let e = Invocation::from_env(Command::Add, env(&[("CNI_CONTAINERID", "c1"), ("CNI_IFNAME", "eth0")]))
            .unwrap_err();
        assert_eq!((e.code, e.msg.as_str()), (code::INVALID_ENV, "CNI_NETNS is required for ADD"));
        let del =
            Invocation::from_env(Command::Del, env(&[("CNI_CONTAINERID", "c1"), ("CNI_IFNAME", "eth0")]))
                .unwrap();
        assert_eq!(del.netns, None, "DEL may come after the namespace is gone");
        let add = Invocation::from_env(
            Command::Add,
            env(&[
                ("CNI_CONTAINERID", "c1"),
                ("CNI_NETNS", "/var/run/netns/p"),
                ("CNI_IFNAME", "eth0"),
                ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-1;K8S_POD_UID=u"),
                ("CNI_PATH", "/opt/cni/bin:/usr/lib/cni"),
            ]),
        )
        .unwrap();
        assert_eq!(add.pod(), Some(("default".into(), "web-1".into())));
        assert_eq!(add.path, ["/opt/cni/bin", "/usr/lib/cni"]);
        let e = Invocation::from_env(Command::Version, env(&[("CNI_ARGS", "novalue")])).unwrap_err();
        assert!(e.msg.contains("\"novalue\""), "{e}");
    }

    #[test]
    fn configs_are_checked_and_results_passed_through() {
        let e = NetConf::parse(b"{not json").unwrap_err();
        assert_eq!(e.code, code::DECODE_FAILURE);
        let e = NetConf::parse(br#"{"cniVersion": "2.0.0", "name": "k8s"}"#).unwrap_err();
        assert_eq!(e.code, code::INCOMPATIBLE_VERSION);
        assert!(e.details.contains("1.0.0"));
        let e = NetConf::parse(br#"{"name": "k8s"}"#).unwrap_err();
        assert_eq!(e.code, code::INVALID_CONFIG, "missing cniVersion");
        let e = NetConf::parse(br#"{"cniVersion": "1.0.0", "prevResult": 3}"#).unwrap_err();
        assert_eq!(e.code, code::INVALID_CONFIG);

        let c = NetConf::parse(
            br#"{"cniVersion": "0.4.0", "name": "k8s", "type": "istio-cni", "exclude_namespaces": ["istio-system"],
                 "kubernetes": {"kubeconfig": "/etc/cni/net.d/ZZZ-istio-cni-kubeconfig", "exclude_namespaces": ["kube-system"]},
                 "prevResult": {"cniVersion": "0.4.0", "ips": [{"version": "4", "address": "10.1.0.5/24"}], "dns": {}}}"#,
        )
        .unwrap();
        assert_eq!(c.excluded_namespaces().collect::<Vec<_>>(), ["istio-system", "kube-system"]);
        let out: Value = serde_json::from_str(&c.result()).unwrap();
        assert_eq!(out["ips"][0]["address"], "10.1.0.5/24");
        assert_eq!(out["cniVersion"], "0.4.0");
        let first = NetConf::parse(br#"{"cniVersion": "1.0.0", "name": "k8s"}"#).unwrap();
        assert_eq!(first.result(), r#"{"cniVersion":"1.0.0"}"#);
    }

    #[test]
    fn istios_ambient_entry_parses() {
        // The entry of Istio's install golden (list.conflist.golden), with the list's
        // version, and one with a selector.
        let c = NetConf::parse(
            br#"{"cniVersion": "0.4.0", "ambient_enabled": false, "cni_agent_run_dir": "/path/to/kubeconfig",
                 "dns": {}, "enable_ambient_detection_retry": false, "enablement_selectors": [],
                 "exclude_namespaces": null, "ipam": {}, "name": "istio-cni", "native_nftables": false,
                 "plugin_log_level": "debug", "pod_namespace": "my-namespace", "type": "istio-cni"}"#,
        )
        .unwrap();
        assert!(!c.ambient_enabled && c.exclude_namespaces.is_empty() && c.enablement_selectors.is_empty());
        let c = NetConf::parse(
            br#"{"cniVersion": "1.0.0", "ambient_enabled": true,
                 "enablement_selectors": [{"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}]}"#,
        )
        .unwrap();
        assert!(c.ambient_enabled);
        assert_eq!(c.enablement_selectors[0].pod_selector.match_labels["istio.io/dataplane-mode"], "ambient");
    }

    #[test]
    fn errors_have_the_spec_shape() {
        let e = CniError::new(code::INVALID_CONFIG, "bad", "why").in_version("0.4.0");
        let v: Value = serde_json::from_str(&e.to_json()).unwrap();
        assert_eq!(v, serde_json::json!({"cniVersion": "0.4.0", "code": 7, "msg": "bad", "details": "why"}));
        let v: Value = serde_json::from_str(&version_result()).unwrap();
        assert_eq!(v["supportedVersions"].as_array().unwrap().len(), SUPPORTED_VERSIONS.len());
    }
}
