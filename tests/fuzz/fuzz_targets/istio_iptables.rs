//! `istio-iptables` on an arbitrary command line and environment: one argument per
//! line; lines `ENV NAME=VALUE` set the environment. Parsed as `pilot-agent
//! istio-iptables` parses it, resolved against a fixed pod host, then rendered.
#![no_main]
use clap::Parser as _;
use libfuzzer_sys::fuzz_target;
use weir_agent::cmd::{PilotAgentCli, PilotAgentCommand};

fuzz_target!(|data: &[u8]| {
    let Some(text) = weir_fuzz::text(data) else { return };
    let mut argv = vec!["pilot-agent".to_string(), "istio-iptables".to_string()];
    let mut env = Vec::new();
    for line in text.lines() {
        match line.strip_prefix("ENV ").and_then(|l| l.split_once('=')) {
            Some((k, v)) => env.push((k.to_string(), v.to_string())),
            None => argv.push(line.to_string()),
        }
    }
    let Ok(cli) = PilotAgentCli::try_parse_from(&argv) else { return };
    let PilotAgentCommand::IstioIptables(args) = cli.command else { return };
    let get = |name: &str| env.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let Ok((cfg, _options)) = args.resolve(&get, &weir_fuzz::PodHost) else { return };
    weir_fuzz::render_all(&cfg);
});
