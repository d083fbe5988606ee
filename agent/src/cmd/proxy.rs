//! `proxy sidecar|router [flags]` (pilot-agent's and weir's): the configuration loaded
//! once, then the sidecar agent run until it stops.

use crate::{
    sidecar::{
        agent::Agent,
        config::{self, AgentConfig, ConfigError},
    },
    support::{exit, runtime},
};

/// Runs the agent with the proxy flags `args`; the process's exit code.
pub fn run(args: &[String]) -> u8 {
    let config = match load_config(args) {
        Ok(c) => c,
        Err(code) => return code,
    };
    for flag in &config.args.ignored {
        tracing::warn!(flag, "ignoring unknown flag (as pilot-agent does)");
    }
    tracing::info!("Effective config:\n{}", config.to_yaml());
    // One thread for every task: a relayed message passes from the upstream
    // connection's task to the relay's and on to Envoy's connection without waking
    // another thread (with two workers, a push and its ACK woke threads about four
    // times); work that takes a CPU for long (key generation, file reads and writes)
    // runs on the blocking pool.
    let runtime = match runtime::current_thread("the sidecar agent") {
        Ok(r) => r,
        Err(e) => {
            eprintln!("weir: {}", crate::error_chain(&e));
            return exit::FAILURE;
        }
    };
    let result = runtime.block_on(async move { Agent::new(config)?.run().await });
    match result {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("weir: {}", crate::error_chain(&e));
            exit::FAILURE
        }
    }
}

/// Loads the agent configuration; on error prints it and returns the exit code (0
/// after `--help`, 64 for bad input).
pub fn load_config(args: &[String]) -> Result<AgentConfig, u8> {
    match AgentConfig::load(args) {
        Ok(c) => Ok(c),
        Err(ConfigError::Help) => {
            println!("{}", config::args::USAGE);
            Err(exit::OK)
        }
        Err(e) => {
            eprintln!("weir: invalid configuration: {}", crate::error_chain(&e));
            Err(exit::USAGE)
        }
    }
}
