//! ProxyConfig (YAML or JSON) and the mesh config, layered as pilot-agent layers them.
//! Sections (separated by a `%%` line): the mesh config file, `PROXY_CONFIG`, the
//! `proxy.istio.io/config` annotation value, then the agent's flags (one a line).
#![no_main]
use std::{collections::BTreeMap, path::PathBuf};

use libfuzzer_sys::fuzz_target;
use weir_agent::sidecar::config::{AgentConfig, MapEnv, ProxyArgs, paths};

/// A Go-quoted annotation value, as kubelet writes it into the downward-API file.
fn go_quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fuzz_target!(|data: &[u8]| {
    let Some(text) = weir_fuzz::text(data) else { return };
    let s = weir_fuzz::sections(text, 4);
    let mut argv = vec!["sidecar".to_string()];
    argv.extend(s[3].lines().map(String::from));
    let Ok(args) = ProxyArgs::parse(&argv) else { return };
    let mesh_path = PathBuf::from(&args.mesh_config);
    let mut files: BTreeMap<PathBuf, String> =
        [(PathBuf::from(paths::CA_ROOT_CERT), "-----BEGIN CERTIFICATE-----\n".to_string())].into();
    if !s[0].is_empty() {
        files.insert(mesh_path, s[0].to_string());
    }
    if !s[2].is_empty() {
        files.insert(
            PathBuf::from(paths::POD_ANNOTATIONS),
            format!("proxy.istio.io/config={}\n", go_quote(s[2])),
        );
    }
    let mut env: BTreeMap<String, String> =
        [("POD_NAME", "app-1"), ("POD_NAMESPACE", "default"), ("INSTANCE_IP", "10.1.2.3")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    if !s[1].is_empty() {
        env.insert("PROXY_CONFIG".into(), s[1].to_string());
    }
    if let Ok(config) = AgentConfig::resolve(args, &MapEnv(env), &files) {
        let _ = config.to_yaml();
    }
});
