//! The DaemonSet's containers as the node rigs run them: each container's capabilities
//! read from `agent/deploy/weir-cni.yaml`, and a command confined to them the way a
//! container runtime confines a root process that is not privileged (the capability
//! bounding set cut to the container's `add` list between fork and exec, nothing
//! inheritable or ambient), so the suite's node tests pass only with the privileges
//! the manifest asks for.

use std::{os::unix::process::CommandExt as _, path::PathBuf, process::Command, str::FromStr as _};

use serde_json::Value;

/// The manifest.
pub fn manifest_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../agent/deploy/weir-cni.yaml")
}

/// The manifest's documents.
fn documents() -> Vec<Value> {
    let text = std::fs::read_to_string(manifest_path()).expect("read agent/deploy/weir-cni.yaml");
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("the manifest is YAML"))
        .collect()
}

/// The `weir-cni-config` ConfigMap's data: the settings every container reads.
pub fn config_map_data() -> Vec<(String, String)> {
    let docs = documents();
    let cm = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "weir-cni-config")
        .expect("the manifest has the weir-cni-config ConfigMap");
    cm["data"]
        .as_object()
        .expect("its data")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().expect("ConfigMap values are strings").to_string()))
        .collect()
}

/// Container `name`'s environment as kubelet makes it from the manifest: its
/// `envFrom` ConfigMap, then its `env` values (which win); `valueFrom` entries are left
/// out.
pub fn container_env(name: &str) -> std::collections::BTreeMap<String, String> {
    let c = container(name);
    let mut env = std::collections::BTreeMap::new();
    for from in c["envFrom"].as_array().into_iter().flatten() {
        assert_eq!(from["configMapRef"]["name"], "weir-cni-config", "{name}: envFrom {from}");
        env.extend(config_map_data());
    }
    for e in c["env"].as_array().into_iter().flatten() {
        if let (Some(k), Some(v)) = (e["name"].as_str(), e["value"].as_str()) {
            env.insert(k.to_string(), v.to_string());
        }
    }
    env
}

/// The DaemonSet's pod spec.
pub fn pod_spec() -> Value {
    let text = std::fs::read_to_string(manifest_path()).expect("read agent/deploy/weir-cni.yaml");
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("the manifest is YAML"))
        .find(|doc: &Value| doc["kind"] == "DaemonSet")
        .expect("the manifest has a DaemonSet")["spec"]["template"]["spec"]
        .clone()
}

/// The container `name` of the DaemonSet.
pub fn container(name: &str) -> Value {
    pod_spec()["containers"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == name).cloned())
        .unwrap_or_else(|| panic!("the DaemonSet has no container {name}"))
}

/// The capabilities container `name` adds (it drops ALL and is not privileged).
pub fn capabilities(name: &str) -> Vec<caps::Capability> {
    let c = container(name);
    let security = &c["securityContext"];
    assert_ne!(security["privileged"], true, "container {name} is privileged");
    assert_eq!(
        security["capabilities"]["drop"],
        serde_json::json!(["ALL"]),
        "container {name} keeps defaults"
    );
    security["capabilities"]["add"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            let a = a.as_str().expect("a capability name");
            caps::Capability::from_str(&format!("CAP_{a}")).unwrap_or_else(|e| panic!("{a}: {e}"))
        })
        .collect()
}

/// Confines `cmd` (to be run as root) to container `name`'s capabilities.
pub fn confine(cmd: &mut Command, name: &str) {
    let keep: Vec<u8> = capabilities(name).iter().map(|c| c.index()).collect();
    let last = caps::runtime::thread_all_supported().iter().map(|c| c.index()).max().unwrap_or(40);
    // SAFETY: only prctl(2) calls, async-signal-safe, between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            for cap in 0..=last {
                if !keep.contains(&cap)
                    && libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            caps::clear(None, caps::CapSet::Inheritable).map_err(std::io::Error::other)
        });
    }
}
