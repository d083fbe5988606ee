//! The `weir` binary: picks a personality from argv[0], parses the command line and
//! dispatches. Everything it calls lives in the `weir_agent` library.

use std::{ffi::OsString, process::ExitCode};

use clap::Parser as _;
use weir_agent::{
    app, build_info, capture_cmd,
    cli::{Personality, PilotAgentCli, PilotAgentCommand, SandboxCommand, WeirCli, WeirCommand},
    config, demo, exit, istio_iptables, local_cmd, sandbox,
};

fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let personality = argv.first().map(Personality::from_argv0).unwrap_or(Personality::Weir);
    // The CNI plugin sets up its logs once it has read its config (plugin_log_level).
    if personality != Personality::Cni {
        weir_agent::logs::init(&argv, None);
    }
    let code = match personality {
        Personality::Weir => run_weir(WeirCli::parse_from(&argv)),
        Personality::PilotAgent => run_pilot_agent(PilotAgentCli::parse_from(&argv)),
        Personality::Cni => weir_agent::node::cni::main(|level| weir_agent::logs::init(&argv, level)),
    };
    ExitCode::from(code)
}

fn run_weir(cli: WeirCli) -> u8 {
    match cli.command {
        WeirCommand::Proxy(args) => proxy(&args.args),
        WeirCommand::IstioIptables(args) => istio_iptables::run(&args),
        WeirCommand::Capture(args) => edge(capture_cmd::run(args)),
        WeirCommand::Wait(args) => wait(&args.args),
        WeirCommand::Request(args) => request(&args.args),
        // `weir config env`: every environment variable the agent reads (docs/env.md).
        WeirCommand::Config(args) if args.args.first().is_some_and(|a| a == "env") => {
            print!("{}", config::vars::markdown());
            exit::OK
        }
        // `weir config bootstrap [proxy flags]`: the bootstrap Envoy would get.
        WeirCommand::Config(args) if args.args.first().is_some_and(|a| a == "bootstrap") => {
            match load_config(&args.args[1..]) {
                Ok(config) => match app::render_bootstrap(&config) {
                    Ok((text, _)) => {
                        print!("{text}");
                        exit::OK
                    }
                    Err(e) => {
                        eprintln!("weir: cannot render the bootstrap: {}", weir_agent::error_chain(&e));
                        exit::FAILURE
                    }
                },
                Err(code) => code,
            }
        }
        // `weir config [dump] [proxy flags]`: `dump` is optional.
        WeirCommand::Config(args) => {
            match load_config(args.args.strip_prefix(&["dump".to_string()]).unwrap_or(&args.args)) {
                Ok(config) => {
                    print!("{}", config.to_yaml());
                    exit::OK
                }
                Err(code) => code,
            }
        }
        WeirCommand::Cni(args) => edge(weir_agent::node::command::run(*args)),
        WeirCommand::Demo(args) => edge(demo::run(&args)),
        WeirCommand::Sandbox(args) => edge(run_sandbox(args.command)),
        WeirCommand::Version(args) => build_info::print(&args),
        WeirCommand::DemoApp { args } => edge(demo::app(&args)),
    }
}

fn run_pilot_agent(cli: PilotAgentCli) -> u8 {
    match cli.command {
        PilotAgentCommand::Proxy(args) => proxy(&args.args),
        PilotAgentCommand::IstioIptables(args) => istio_iptables::run(&args),
        PilotAgentCommand::Wait(args) => wait(&args.args),
        PilotAgentCommand::Request(args) => request(&args.args),
        PilotAgentCommand::Version(args) => build_info::print(&args),
    }
}

/// Loads the agent configuration; on error prints it and returns the exit code.
fn load_config(args: &[String]) -> Result<config::AgentConfig, u8> {
    match config::AgentConfig::load(args) {
        Ok(c) => Ok(c),
        Err(config::ConfigError::Help) => {
            println!("{}", config::args::USAGE);
            Err(exit::OK)
        }
        Err(e) => {
            eprintln!("weir: invalid configuration: {}", weir_agent::error_chain(&e));
            Err(exit::USAGE)
        }
    }
}

/// `proxy sidecar|router ...`: the agent.
fn proxy(args: &[String]) -> u8 {
    let config = match load_config(args) {
        Ok(c) => c,
        Err(code) => return code,
    };
    for flag in &config.args.ignored {
        tracing::warn!(flag, "ignoring unknown flag (as pilot-agent does)");
    }
    tracing::info!("Effective config:\n{}", config.to_yaml());
    let Some(runtime) = agent_runtime() else { return exit::FAILURE };
    let result = runtime.block_on(async move { app::Agent::new(config)?.run().await });
    match result {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("weir: {}", weir_agent::error_chain(&e));
            exit::FAILURE
        }
    }
}

/// The agent's runtime: one thread for every task. A relayed message passes from the
/// upstream connection's task to the relay's and on to Envoy's connection without
/// waking another thread (with two workers, a push and its ACK woke threads about four
/// times); work that takes a CPU for long (key generation, file reads and writes) runs
/// on the blocking pool.
fn agent_runtime() -> Option<tokio::runtime::Runtime> {
    started(tokio::runtime::Builder::new_current_thread().enable_all().build())
}

fn runtime(workers: usize) -> Option<tokio::runtime::Runtime> {
    started(tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build())
}

fn started(built: std::io::Result<tokio::runtime::Runtime>) -> Option<tokio::runtime::Runtime> {
    built.inspect_err(|e| eprintln!("weir: cannot start the runtime: {e}")).ok()
}

/// A local command's parsed arguments; else the exit code once help (0) or the error
/// (64) is printed.
fn parsed<T>(
    command: &str,
    usage: &str,
    parsed: Result<Option<T>, local_cmd::LocalCmdError>,
) -> Result<T, u8> {
    match parsed {
        Ok(Some(args)) => Ok(args),
        Ok(None) => {
            println!("{usage}");
            Err(exit::OK)
        }
        Err(e) => {
            eprintln!("weir {command}: {e}");
            Err(exit::USAGE)
        }
    }
}

/// `wait`: exit 0 once Envoy is ready, 1 on timeout, 64 on bad flags.
fn wait(args: &[String]) -> u8 {
    let w = match parsed("wait", local_cmd::WAIT_USAGE, local_cmd::parse_wait(args)) {
        Ok(w) => w,
        Err(code) => return code,
    };
    let Some(runtime) = runtime(1) else { return exit::FAILURE };
    match runtime.block_on(local_cmd::wait(&w)) {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("weir wait: {e}");
            exit::FAILURE
        }
    }
}

/// `request`: the answer's body on stdout, nothing else (istioctl parses it).
fn request(args: &[String]) -> u8 {
    let r = match parsed("request", local_cmd::REQUEST_USAGE, local_cmd::parse_request(args)) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let Some(runtime) = runtime(1) else { return exit::FAILURE };
    match runtime.block_on(local_cmd::send(&r)) {
        Ok(body) => {
            use std::io::Write as _;
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(&body);
            let _ = out.write_all(b"\n");
            exit::OK
        }
        Err(e) => {
            eprintln!("weir request: {e}");
            exit::FAILURE
        }
    }
}

/// The binary's edge: a library error becomes one line on stderr and exit 1.
fn edge(result: anyhow::Result<()>) -> u8 {
    match result {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("weir: {e:#}");
            exit::FAILURE
        }
    }
}

fn run_sandbox(command: SandboxCommand) -> anyhow::Result<()> {
    match command {
        SandboxCommand::Reap => {
            let reaped = sandbox::reap()?;
            println!("reaped {} sandbox object(s)", reaped.len());
            for item in reaped {
                println!("  {item}");
            }
        }
        SandboxCommand::List => {
            for item in sandbox::leftovers(false) {
                println!("{item}");
            }
        }
    }
    Ok(())
}
