//! `istio-iptables` (as `weir istio-iptables` or `pilot-agent istio-iptables`): resolve
//! Istio's flags and environment, check privileges, program the capture rules (or
//! print the dry-run transcript), then optionally run Istio's validation probe.

use std::io::Write as _;

use weir_iptables::{
    Action, CaptureConfig, RunOptions, config::InboundPorts, detect::SystemFacts, flags::IstioIptablesArgs,
    validation,
};

use crate::{
    support::exit,
    support::privileges::{self, Capability},
};

/// Istio's exit code for a failed validation probe.
pub const VALIDATION_FAILED: u8 = 126;

/// Runs the command; returns the process exit code.
pub fn run(args: &IstioIptablesArgs) -> u8 {
    let env = |name: &str| std::env::var(name).ok();
    let facts =
        SystemFacts { netns: args.network_namespace.clone().filter(|n| !n.is_empty()).map(Into::into) };
    let (cfg, opts) = match args.resolve(&env, &facts) {
        Ok(resolved) => resolved,
        Err(e) => {
            eprintln!("istio-iptables: {e}");
            return exit::FAILURE;
        }
    };
    log_config(&cfg, &opts);

    // Programming rules needs NET_ADMIN; the validation probe alone needs none.
    if !opts.dry_run && !opts.skip_rule_apply {
        let mut needed = vec![Capability::NetAdmin, Capability::NetRaw];
        if opts.network_namespace.is_some() {
            needed.push(Capability::SysAdmin);
        }
        if let Err(e) = privileges::require(&needed, "istio-iptables") {
            eprintln!("istio-iptables: {e}");
            return exit::FAILURE;
        }
    }

    if !opts.skip_rule_apply {
        match weir_iptables::program(&cfg, &opts) {
            Ok(report) => {
                if let Some(transcript) = &report.transcript
                    && let Err(e) = write_transcript(&opts, transcript)
                {
                    eprintln!("istio-iptables: write dry-run output: {e}");
                    return exit::FAILURE;
                }
                let what = match report.action {
                    Action::Applied => "capture rules applied",
                    Action::AlreadyApplied => "capture rules already in place; nothing changed",
                    Action::Reconciled => "drifted capture rules reconciled",
                    Action::ForceApplied => "capture rules force-applied",
                    Action::Cleaned => "capture rules removed",
                };
                tracing::info!(backend = %report.backend, path = %report.path, verdict = ?report.verdict, dry_run = opts.dry_run, "{what}");
            }
            Err(e) => {
                eprintln!("istio-iptables: {e}");
                let mut source = std::error::Error::source(&e);
                while let Some(s) = source {
                    eprintln!("  caused by: {s}");
                    source = s.source();
                }
                return exit::FAILURE;
            }
        }
    }

    if opts.run_validation {
        let result = validation::proxy_uid_number(&cfg).and_then(|uid| match &opts.network_namespace {
            Some(path) => in_netns(path, || validation::validate(&cfg, &opts, uid)),
            None => validation::validate(&cfg, &opts, uid),
        });
        if let Err(e) = result {
            eprintln!(
                "istio-iptables: iptables validation failed; workload is not ready for Istio: {e}\n\
                 When using the CNI plugin, this can occur if a pod is scheduled before the node is ready."
            );
            return VALIDATION_FAILED;
        }
    }
    exit::OK
}

fn in_netns<T: Send>(
    path: &std::path::Path,
    f: impl FnOnce() -> Result<T, validation::ValidationError> + Send,
) -> Result<T, validation::ValidationError> {
    let file = std::fs::File::open(path).map_err(|e| {
        validation::ValidationError::NoListener(format!("network namespace {}: {e}", path.display()))
    })?;
    std::thread::scope(|s| {
        s.spawn(|| {
            use std::os::fd::AsFd as _;
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
                validation::ValidationError::NoListener(format!(
                    "enter network namespace {}: {e}",
                    path.display()
                ))
            })?;
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// DRY_RUN_FILE_PATH when set, else stdout.
fn write_transcript(opts: &RunOptions, transcript: &str) -> std::io::Result<()> {
    match &opts.dry_run_file {
        Some(path) => std::fs::write(path, transcript),
        None => std::io::stdout().write_all(transcript.as_bytes()),
    }
}

/// Logs the effective configuration once, with Istio's names.
fn log_config(cfg: &CaptureConfig, opts: &RunOptions) {
    let list = |v: &[String]| v.join(",");
    let inbound = match &cfg.inbound_ports {
        InboundPorts::None => String::new(),
        InboundPorts::All => "*".into(),
        InboundPorts::Only(p) => p.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
    };
    tracing::info!(
        proxy_port = cfg.proxy_port,
        inbound_capture_port = cfg.inbound_capture_port,
        inbound_tunnel_port = cfg.inbound_tunnel_port,
        proxy_uid = %list(&cfg.proxy_uids),
        proxy_gid = %list(&cfg.proxy_gids),
        interception_mode = %cfg.interception_mode,
        inbound_ports = %inbound,
        enable_ipv6 = cfg.enable_ipv6,
        redirect_dns = cfg.redirect_dns,
        dns_servers = ?(&cfg.dns_servers_v4, &cfg.dns_servers_v6),
        native_nftables = opts.native_nftables,
        network_namespace = ?opts.network_namespace,
        "istio-iptables config"
    );
}
