//! Every command, each in a module of its own with its arguments and its run; here the
//! command line they hang from: `weir`'s four personalities chosen by argv[0]'s file
//! name — `weir` (everything), `pilot-agent` (the command lines Istio's injector
//! writes), `weir-cni`/`istio-cni` (the CNI plugin) and `install-cni` (Istio's
//! istio-cni container, as its chart runs it) — and the per-pod
//! `weir-init`'s, and [`main`], which picks one and runs it.

use std::{ffi::OsString, path::Path};

use clap::{Args, Parser, Subcommand, ValueEnum};
pub use weir_iptables::flags::IstioIptablesArgs;

use crate::support::exit;

pub mod capture;
pub mod cni;
pub mod config;
pub mod demo;
pub mod install_cni;
pub mod istio_iptables;
pub mod local;
pub mod proxy;
pub mod sandbox;
pub mod version;

/// The `weir` binary: picks a personality from argv[0], parses the command line and
/// runs it; the process's exit code.
pub fn main(argv: Vec<OsString>) -> u8 {
    let personality = argv.first().map(Personality::from_argv0).unwrap_or(Personality::Weir);
    // The CNI plugin sets up its logs once it has read its config (plugin_log_level).
    if personality != Personality::Cni {
        crate::support::logs::init(&argv, None);
    }
    match personality {
        Personality::Weir => run_weir(WeirCli::parse_from(&argv)),
        Personality::PilotAgent => run_pilot_agent(PilotAgentCli::parse_from(&argv)),
        Personality::Cni => crate::node::cni::main(|level| crate::support::logs::init(&argv, level)),
        Personality::InstallCni => edge(install_cni::run(install_cni::InstallCniCli::parse_from(&argv))),
    }
}

fn run_weir(cli: WeirCli) -> u8 {
    match cli.command {
        WeirCommand::Proxy(args) => proxy::run(&args.args),
        WeirCommand::IstioIptables(args) => istio_iptables::run(&args),
        WeirCommand::Capture(args) => edge(capture::run(args)),
        WeirCommand::Wait(args) => local::run_wait(&args.args),
        WeirCommand::Request(args) => local::run_request(&args.args),
        WeirCommand::Config(args) => config::run(&args.args),
        WeirCommand::Cni(args) => edge(cni::run(*args)),
        WeirCommand::Demo(args) => edge(demo::run(&args)),
        WeirCommand::Sandbox(args) => edge(sandbox::run(args.command)),
        WeirCommand::Version(args) => version::print(&args),
        WeirCommand::DemoApp { args } => edge(demo::app(&args)),
    }
}

fn run_pilot_agent(cli: PilotAgentCli) -> u8 {
    match cli.command {
        PilotAgentCommand::Proxy(args) => proxy::run(&args.args),
        PilotAgentCommand::IstioIptables(args) => istio_iptables::run(&args),
        PilotAgentCommand::Wait(args) => local::run_wait(&args.args),
        PilotAgentCommand::Request(args) => local::run_request(&args.args),
        PilotAgentCommand::Version(args) => version::print(&args),
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

/// Which command-line surface to present, from argv[0].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Personality {
    Weir,
    PilotAgent,
    Cni,
    /// Istio's `install-cni` container command (its chart runs Weir's image so).
    InstallCni,
}

impl Personality {
    /// Chooses by argv[0]'s file name: `pilot-agent`, `weir-cni` / `istio-cni`,
    /// `install-cni`, else Weir.
    pub fn from_argv0(argv0: &OsString) -> Self {
        let name = Path::new(argv0).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        match name.as_str() {
            "pilot-agent" => Self::PilotAgent,
            "weir-cni" | "istio-cni" => Self::Cni,
            "install-cni" => Self::InstallCni,
            _ => Self::Weir,
        }
    }
}

/// `weir`: traffic capture and sidecar agent for Envoy.
#[derive(Debug, Parser)]
#[command(name = "weir", version = env!("WEIR_VERSION"), about, long_about = None, disable_help_subcommand = true)]
pub struct WeirCli {
    #[command(subcommand)]
    pub command: WeirCommand,
}

#[derive(Debug, Subcommand)]
pub enum WeirCommand {
    /// Run a proxy (as pilot-agent does): `weir proxy sidecar --domain ...`.
    Proxy(PassThrough),
    /// Program Istio's capture rules (istio-iptables compatible flags).
    #[command(name = "istio-iptables", args_override_self = true)]
    IstioIptables(Box<IstioIptablesArgs>),
    /// eBPF capture: attach, inspect and remove Weir's programs.
    Capture(crate::cmd::capture::CaptureArgs),
    /// Wait until Envoy reports ready (pilot-agent wait).
    Wait(PassThrough),
    /// Send a request to Envoy's admin or the agent's status port (pilot-agent request).
    Request(PassThrough),
    /// Print the effective configuration (`weir config [dump] [proxy flags]`), the
    /// bootstrap Envoy would get (`weir config bootstrap [proxy flags]`), or every
    /// environment variable the agent reads (`weir config env`).
    Config(PassThrough),
    /// The CNI plugin's node side: install, uninstall, repair.
    Cni(Box<crate::cmd::cni::CniArgs>),
    /// Run Weir's main job on an embedded default: a demo pod with real Envoy and capture.
    Demo(DemoArgs),
    /// Remove sandboxes (namespaces, cgroups, processes) left by demos or tests that died.
    Sandbox(SandboxArgs),
    /// Print version and build information.
    Version(VersionArgs),
    /// The demo's app process (internal).
    #[command(name = "demo-app", hide = true)]
    DemoApp {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// `pilot-agent`: the subset of Istio's pilot-agent command line that sidecars use.
#[derive(Debug, Parser)]
#[command(
    name = "pilot-agent",
    version,
    about = "Istio pilot-agent compatible (Weir)",
    disable_help_subcommand = true
)]
pub struct PilotAgentCli {
    #[command(subcommand)]
    pub command: PilotAgentCommand,
}

#[derive(Debug, Subcommand)]
pub enum PilotAgentCommand {
    /// XDS proxy agent: `pilot-agent proxy sidecar ...`.
    Proxy(PassThrough),
    /// Script to set up iptables to divert traffic to Envoy (istio-iptables).
    #[command(name = "istio-iptables", args_override_self = true)]
    IstioIptables(Box<IstioIptablesArgs>),
    /// Wait for the Envoy proxy to become ready.
    Wait(PassThrough),
    /// Make an HTTP request to the Envoy admin API or the agent.
    Request(PassThrough),
    /// Print version information.
    Version(VersionArgs),
}

/// `pilot-agent` as the istio-init container runs it (the `weir-init` binary, the
/// weir-init image's pilot-agent): only the commands an init container runs, so the
/// per-pod process starts with nothing else to map or build.
#[derive(Debug, Parser)]
#[command(
    name = "pilot-agent",
    version,
    about = "Istio pilot-agent compatible (Weir), istio-init's commands",
    disable_help_subcommand = true
)]
pub struct InitCli {
    #[command(subcommand)]
    pub command: InitCommand,
}

#[derive(Debug, Subcommand)]
pub enum InitCommand {
    /// Script to set up iptables to divert traffic to Envoy (istio-iptables).
    #[command(name = "istio-iptables", args_override_self = true)]
    IstioIptables(Box<IstioIptablesArgs>),
    /// Print version information.
    Version(VersionArgs),
}

/// pilot-agent's commands that `weir-init` leaves to the full binary, for a clear error.
pub const NOT_IN_INIT: [&str; 3] = ["proxy", "wait", "request"];

/// Arguments taken verbatim; their parser belongs to the command that owns them
/// (`--help` included: each prints pilot-agent's usage for its flags).
#[derive(Debug, Args)]
#[command(disable_help_flag = true)]
pub struct PassThrough {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    pub args: Vec<String>,
}

#[derive(Debug, Args)]
pub struct VersionArgs {
    /// Print only the version number.
    #[arg(short = 's', long)]
    pub short: bool,
    /// Output format.
    #[arg(short = 'o', long, value_enum)]
    pub output: Option<VersionFormat>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum VersionFormat {
    Json,
    Yaml,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    pub duration: Option<u64>,
    /// The capture backend (default: the best this machine offers).
    #[arg(long, value_enum)]
    pub capture_mode: Option<crate::capture::ebpf::detect::CaptureMode>,
}

#[derive(Debug, Args)]
pub struct SandboxArgs {
    #[command(subcommand)]
    pub command: SandboxCommand,
}

#[derive(Debug, Subcommand)]
pub enum SandboxCommand {
    /// Remove namespaces, cgroups and processes whose creating process is gone.
    Reap,
    /// List Weir's sandboxes on this machine.
    List,
}
