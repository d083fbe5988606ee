//! `weir-init`: pilot-agent as the istio-init container runs it (`pilot-agent
//! istio-iptables ...` with the injector's flags; `version`). The weir-init image
//! installs it as /usr/local/bin/pilot-agent. It is the `weir` binary's istio-iptables
//! and nothing else, so each pod's init container starts a small process; the sidecar's
//! commands (`proxy`, `wait`, `request`) are in `weir`.

use std::{ffi::OsString, process::ExitCode};

use clap::Parser as _;
use weir_agent::{
    cmd::{InitCli, InitCommand, NOT_IN_INIT, istio_iptables, version},
    support::exit,
};

fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    if let Some(command) = argv.get(1).and_then(|a| a.to_str()).filter(|a| NOT_IN_INIT.contains(a)) {
        eprintln!(
            "pilot-agent {command}: not in weir-init, which runs istio-init's commands \
             (istio-iptables, version); the sidecar's pilot-agent is the `weir` binary \
             (the weir-proxy image)"
        );
        return ExitCode::from(exit::USAGE);
    }
    weir_agent::support::logs::init(&argv, None);
    let code = match InitCli::parse_from(&argv).command {
        InitCommand::IstioIptables(args) => istio_iptables::run(&args),
        InitCommand::Version(args) => version::print(&args),
    };
    ExitCode::from(code)
}
