//! Istio's istio-cni chart on the rig, with only its image changed to Weir's: the
//! DaemonSet istioctl renders for the default values (`tests/testdata/istio-cni-chart/
//! istio-cni.golden.yaml`, Istio's own golden) and the `istio-cni-config` ConfigMap its
//! `configmap-cni.yaml` writes from `values.yaml`. The ambient profile
//! (`files/profile-ambient.yaml`: `ambient.enabled: true`) adds what `daemonset.yaml`
//! adds under `.Values.ambient.enabled`: the `/host/var/run/netns` mount
//! (`HostToContainer`), the `/var/run/ztunnel` mount and its `DirectoryOrCreate` volume;
//! and the ConfigMap's `AMBIENT_ENABLED: "true"`. No helm binary is available here.
//!
//! One value is re-rooted, because the rig's nodes share the machine's PID namespace:
//! the chart's `ALLOW_SWITCH_TO_HOST_NS` makes the agent enter `/host/proc/1/ns/net`,
//! which here is the machine's own namespace. `WEIR_HOST_NETNS` points it at the node's
//! "PID 1" instead ([`super::node::Node::host_netns_pid`]), through the same `/host/proc`
//! mount; the rig checks that it is the node's namespace before it creates the pod.

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use super::rig::Cluster;

/// Which of the chart's profiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    Default,
    Ambient,
}

/// The chart's namespace (the golden's) and its DaemonSet's pod name on node `index`.
pub const NAMESPACE: &str = "istio-system";

/// The chart's DaemonSet.
pub const DAEMONSET: &str = "istio-cni-node";

/// The plugin's entry as Istio's installer writes it into the chain
/// (cni/pkg/install/cniconfig.go `createCNIConfigFile`: `plugin.Config` marshalled, name
/// and type `istio-cni`, `cniVersion` dropped when inserted; `ipam` and `dns` are
/// `types.NetConf`'s structs, which Go writes even when empty), for `profile`'s values.
pub fn istio_installer_entry(profile: Profile) -> anyhow::Result<Value> {
    let data: std::collections::BTreeMap<String, String> = config_map(profile)?.into_iter().collect();
    let selectors: Value = serde_yaml_ng::from_str(&data["AMBIENT_ENABLEMENT_SELECTOR"])?;
    Ok(json!({
        "name": "istio-cni", "type": "istio-cni", "ipam": {}, "dns": {},
        "plugin_log_level": "warn", "cni_agent_run_dir": "/var/run/istio-cni",
        "ambient_enabled": data["AMBIENT_ENABLED"] == "true",
        "enablement_selectors": selectors,
        "exclude_namespaces": data["EXCLUDE_NAMESPACES"].split(',').collect::<Vec<_>>(),
        "pod_namespace": NAMESPACE,
        "native_nftables": data["NATIVE_NFTABLES"] == "true",
        "enable_ambient_detection_retry": data["ENABLE_AMBIENT_DETECTION_RETRY"] == "true",
    }))
}

/// Writes `entry` in place of the chain's `istio-cni` entry (last) in `conflist`, as
/// Istio's installer does (`insertCNIConfig`: an existing `istio-cni` entry replaced).
pub fn put_chain_entry(conflist: &std::path::Path, entry: Value) -> anyhow::Result<()> {
    let mut list: Value = serde_json::from_slice(&std::fs::read(conflist)?)?;
    let plugins = list["plugins"].as_array_mut().context("a plugin list")?;
    plugins.retain(|p| p["type"] != "istio-cni");
    plugins.push(entry);
    std::fs::write(conflist, serde_json::to_vec_pretty(&list)?)?;
    Ok(())
}

pub fn pod_name(index: u8) -> String {
    format!("istio-cni-node-{index}")
}

fn testdata(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/istio-cni-chart").join(path)
}

fn yaml(path: &str) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(testdata(path)).with_context(|| format!("read {path}"))?;
    serde_yaml_ng::from_str(&text).with_context(|| format!("{path} is not YAML"))
}

/// The golden's DaemonSet, with `profile`'s additions.
pub fn daemonset(profile: Profile) -> anyhow::Result<Value> {
    let mut ds = yaml("istio-cni.golden.yaml")?;
    if ds["kind"] != "DaemonSet" {
        bail!("the golden is not a DaemonSet");
    }
    if profile == Profile::Ambient {
        let spec = &mut ds["spec"]["template"]["spec"];
        let c = spec["containers"].get_mut(0).context("the golden has its one container")?;
        let mounts = c["volumeMounts"].as_array_mut().context("volumeMounts")?;
        mounts.push(json!({"mountPath": "/host/var/run/netns", "mountPropagation": "HostToContainer", "name": "cni-netns-dir"}));
        mounts.push(json!({"mountPath": "/var/run/ztunnel", "name": "cni-ztunnel-sock-dir"}));
        spec["volumes"]
            .as_array_mut()
            .context("volumes")?
            .push(json!({"name": "cni-ztunnel-sock-dir", "hostPath": {"path": "/var/run/ztunnel", "type": "DirectoryOrCreate"}}));
    }
    Ok(ds)
}

/// `configmap-cni.yaml`'s data for `values.yaml`'s defaults (and `profile`).
pub fn config_map(profile: Profile) -> anyhow::Result<Vec<(String, String)>> {
    let values = &yaml("values.yaml")?["_internal_defaults_do_not_set"];
    let s = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let ambient = &values["ambient"];
    let repair = &values["repair"];
    let selectors = serde_yaml_ng::to_string(&ambient["enablementSelectors"])?;
    let excluded: Vec<String> =
        values["excludeNamespaces"].as_array().context("excludeNamespaces")?.iter().map(s).collect();
    let enabled = profile == Profile::Ambient || ambient["enabled"] == true;
    Ok([
        ("CURRENT_AGENT_VERSION", s(&values["global"]["tag"])),
        ("AMBIENT_ENABLED", enabled.to_string()),
        ("AMBIENT_ENABLEMENT_SELECTOR", selectors),
        ("AMBIENT_DNS_CAPTURE", s(&ambient["dnsCapture"])),
        ("AMBIENT_IPV6", s(&ambient["ipv6"])),
        ("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", s(&ambient["reconcileIptablesOnStartup"])),
        ("ENABLE_AMBIENT_DETECTION_RETRY", s(&ambient["enableAmbientDetectionRetry"])),
        ("ISTIO_OWNED_CNI_CONFIG", s(&values["istioOwnedCNIConfig"])),
        ("CHAINED_CNI_PLUGIN", s(&values["chained"])),
        ("EXCLUDE_NAMESPACES", excluded.join(",")),
        ("REPAIR_ENABLED", s(&repair["enabled"])),
        ("REPAIR_LABEL_PODS", s(&repair["labelPods"])),
        ("REPAIR_DELETE_PODS", s(&repair["deletePods"])),
        ("REPAIR_REPAIR_PODS", s(&repair["repairPods"])),
        ("REPAIR_INIT_CONTAINER_NAME", s(&repair["initContainerName"])),
        ("REPAIR_BROKEN_POD_LABEL_KEY", s(&repair["brokenPodLabelKey"])),
        ("REPAIR_BROKEN_POD_LABEL_VALUE", s(&repair["brokenPodLabelValue"])),
        ("NATIVE_NFTABLES", values["global"]["nativeNftables"].as_bool().unwrap_or(false).to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect())
}

impl Cluster {
    /// The chart's pod for node `index`, running `image` in place of Istio's.
    pub fn istio_cni_pod(&self, index: u8, image: &str, profile: Profile) -> anyhow::Result<Value> {
        let ds = daemonset(profile)?;
        let template = &ds["spec"]["template"];
        let mut spec = template["spec"].clone();
        let node = self.node(index);
        let pid = node.host_netns_pid();
        let same = |a: &std::path::Path, b: &std::path::Path| {
            use std::os::unix::fs::MetadataExt as _;
            let (a, b) = (std::fs::metadata(a), std::fs::metadata(b));
            matches!((a, b), (Ok(a), Ok(b)) if (a.dev(), a.ino()) == (b.dev(), b.ino()))
        };
        let holder = PathBuf::from(format!("/proc/{pid}/ns/net"));
        if pid == 0 || !same(&holder, node.netns.path()) {
            bail!(
                "node {index}'s PID 1 stand-in ({}) is not in the node's network namespace",
                holder.display()
            );
        }
        let c = spec["containers"].get_mut(0).context("the golden has its one container")?;
        c["image"] = json!(image);
        c["env"]
            .as_array_mut()
            .context("env")?
            .push(json!({"name": "WEIR_HOST_NETNS", "value": format!("/host/proc/{pid}/ns/net")}));
        Ok(json!({
            "metadata": {"name": pod_name(index), "namespace": NAMESPACE,
                         "labels": template["metadata"]["labels"], "annotations": template["metadata"]["annotations"]},
            "spec": spec,
        }))
    }

    /// The chart on `nodes`: its ConfigMap, its DaemonSet (as the API serves it: the
    /// agent asks for it when it stops), and the DaemonSet's pod on each.
    pub fn apply_istio_cni_chart(&self, image: &str, profile: Profile, nodes: &[u8]) -> anyhow::Result<()> {
        let mut ds = daemonset(profile)?;
        ds["metadata"]["namespace"] = json!(NAMESPACE);
        self.api.set_daemonset(NAMESPACE, DAEMONSET, Some(ds));
        let data = config_map(profile)?;
        let data: Vec<(&str, &str)> = data.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        self.config_map(NAMESPACE, "istio-cni-config", &data);
        for &index in nodes {
            let pod = self.istio_cni_pod(index, image, profile)?;
            self.create_pod(pod, index);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the ambient profile adds is what the chart's template adds under
    /// `.Values.ambient.enabled`, and the ConfigMap carries the chart's names.
    #[test]
    fn the_ambient_profile_adds_what_the_template_adds() {
        let template = std::fs::read_to_string(testdata("templates/daemonset.yaml.tmpl")).unwrap();
        let block = template.split("{{- if .Values.ambient.enabled }}").nth(1).unwrap();
        for line in [
            "mountPath: /host/var/run/netns",
            "mountPropagation: HostToContainer",
            "mountPath: /var/run/ztunnel",
            "name: cni-ztunnel-sock-dir",
        ] {
            assert!(block.contains(line), "{line}");
        }
        let vols = template.split("- name: cni-ztunnel-sock-dir").nth(1).unwrap();
        assert!(vols.contains("path: /var/run/ztunnel") && vols.contains("type: DirectoryOrCreate"));
        let ambient = daemonset(Profile::Ambient).unwrap();
        let plain = daemonset(Profile::Default).unwrap();
        let mounts = |d: &Value| {
            d["spec"]["template"]["spec"]["containers"][0]["volumeMounts"].as_array().unwrap().len()
        };
        assert_eq!(mounts(&ambient), mounts(&plain) + 2);
        let cm = std::fs::read_to_string(testdata("templates/configmap-cni.yaml.tmpl")).unwrap();
        for (key, _) in config_map(Profile::Default).unwrap() {
            assert!(cm.contains(&format!("  {key}:")), "{key} is not the chart's");
        }
        let data = config_map(Profile::Ambient).unwrap();
        assert!(data.contains(&("AMBIENT_ENABLED".into(), "true".into())));
        assert!(data.contains(&("EXCLUDE_NAMESPACES".into(), "kube-system".into())));
    }
}
