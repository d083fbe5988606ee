//! Pod annotations, as the downward-API file kubelet writes (`key="value"` lines):
//! parsed as pilot-agent parses the file, then used both ways Weir uses them, as the
//! CNI plugin's capture config and as the agent's ProxyConfig overrides.
#![no_main]
use std::{collections::BTreeMap, path::PathBuf};

use libfuzzer_sys::fuzz_target;
use weir_agent::{
    node::cni::pod::{PodInfo, capture_config},
    sidecar::{
        config::{AgentConfig, MapEnv, ProxyArgs, paths},
        podinfo,
    },
};

fuzz_target!(|data: &[u8]| {
    let Some(text) = weir_fuzz::text(data) else { return };
    let Ok(annotations) = podinfo::parse(text) else { return };
    let mut pod = PodInfo { annotations, ..Default::default() };
    pod.containers.insert("istio-proxy".into());
    for ipv6 in [false, true] {
        if let Ok(cfg) = capture_config(&pod, ipv6) {
            weir_fuzz::render_all(&cfg);
        }
    }
    let files: BTreeMap<PathBuf, String> = [
        (PathBuf::from(paths::POD_ANNOTATIONS), text.to_string()),
        (PathBuf::from(paths::CA_ROOT_CERT), "-----BEGIN CERTIFICATE-----\n".to_string()),
    ]
    .into();
    let args = ProxyArgs::parse(&["sidecar".to_string()]).expect("fixed flags parse");
    let env =
        MapEnv::from([("POD_NAME", "app-1"), ("POD_NAMESPACE", "default"), ("INSTANCE_IP", "10.1.2.3")]);
    if let Ok(config) = AgentConfig::resolve(args, &env, &files) {
        let _ = config.to_yaml();
    }
});
