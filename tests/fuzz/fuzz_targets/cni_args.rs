//! `CNI_ARGS` and the other `CNI_*` variables: `K=V;K=V` into a map, then the
//! invocation the plugin checks (one line per variable, `NAME=VALUE`).
#![no_main]
use libfuzzer_sys::fuzz_target;
use weir_agent::node::cni::spec::{Command, Invocation, parse_args};

fuzz_target!(|data: &[u8]| {
    let Some(text) = weir_fuzz::text(data) else { return };
    if let Ok(args) = parse_args(text) {
        // Every pair came from the text: keys are non-empty and neither holds a `;`.
        for (k, v) in &args {
            assert!(!k.is_empty() && !k.contains(';') && !v.contains(';'), "{k:?}={v:?}");
            assert!(text.contains(&format!("{k}={v}")), "{k}={v} is not in {text:?}");
        }
    }
    let env = weir_fuzz::env_lines(text);
    let get = |name: &str| env.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let Ok(command) = Command::parse(&get("CNI_COMMAND").unwrap_or_default()) else { return };
    if let Ok(inv) = Invocation::from_env(command, get) {
        let _ = inv.pod();
    }
});
