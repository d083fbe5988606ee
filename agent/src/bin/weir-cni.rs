//! `weir-cni`: the CNI plugin alone, the binary `weir cni install` puts in the node's
//! CNI bin folder. The runtime execs it for every ADD, DEL and CHECK, so it holds only
//! the plugin (`weir_agent::node::cni`); `weir` run as `weir-cni` or `istio-cni` is the
//! same plugin, in a binary that maps and relocates everything else too.

use std::{ffi::OsString, process::ExitCode};

fn main() -> ExitCode {
    // Kept in the binary: `weir cni install` checks a companion plugin is its own build.
    std::hint::black_box(weir_agent::support::build_info::BUILD_MARKER);
    let argv: Vec<OsString> = std::env::args_os().collect();
    // Logs are set up once the network configuration is read (plugin_log_level).
    ExitCode::from(weir_agent::node::cni::main(|level| weir_agent::support::logs::init(&argv, level)))
}
