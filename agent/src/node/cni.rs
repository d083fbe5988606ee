//! The CNI plugin (argv[0] `weir-cni` or `istio-cni`, chained after the cluster's
//! primary CNI): the protocol (`spec`), ambient pods handed to the node agent
//! (`ambient`), what to do for a pod (`pod`), where the pod
//! comes from (`kube`, the Kubernetes API through the node's kubeconfig), capturing a
//! pod inside its network namespace (`capture`, eBPF registration in `ebpf`), ADD /
//! DEL / CHECK (`plugin`), capturing pods that started before the plugin (`repair`,
//! which finds their namespaces through the node's /proc: `podns`), and the node side
//! that installs and keeps the plugin chained (`install`); `phases` times a run for
//! the benchmark.

pub mod ambient;
pub mod capture;
pub mod ebpf;
pub mod install;
pub mod kube;
pub mod node_capture;
pub mod phases;
pub mod plugin;
pub mod pod;
pub mod podns;
pub mod repair;
pub mod spec;

use std::io::{Read as _, Write as _};

/// The plugin's process: the result (or the spec's error JSON) on stdout, exit 0 (or
/// 1). Nothing else is ever written to stdout. `init_logs` is called once with the
/// config's log level (`plugin_log_level`, or the legacy `log_level`).
pub fn main(init_logs: impl FnOnce(Option<&str>)) -> u8 {
    phases::start();
    let code = run_main(init_logs);
    phases::mark("result");
    phases::report();
    code
}

fn run_main(init_logs: impl FnOnce(Option<&str>)) -> u8 {
    let mut stdin = Vec::new();
    let read = std::io::stdin().read_to_end(&mut stdin);
    let level: Option<String> = serde_json::from_slice::<serde_json::Value>(&stdin).ok().and_then(|v| {
        v.get("plugin_log_level").or_else(|| v.get("log_level")).and_then(|l| l.as_str()).map(String::from)
    });
    init_logs(level.as_deref());
    phases::mark("logs");
    let command = match spec::Command::parse(&std::env::var("CNI_COMMAND").unwrap_or_default()) {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    if let Err(e) = read {
        return fail(&spec::CniError::new(
            spec::code::IO_FAILURE,
            "cannot read the network configuration on stdin",
            e.to_string(),
        ));
    }
    match plugin::run(command, &stdin, |k| std::env::var(k).ok()) {
        Ok(out) => {
            if !out.is_empty() {
                let mut stdout = std::io::stdout().lock();
                let _ = writeln!(stdout, "{out}");
            }
            0
        }
        Err(e) => fail(&e),
    }
}

fn fail(e: &spec::CniError) -> u8 {
    tracing::error!(code = e.code, msg = %e.msg, details = %e.details, "CNI command failed");
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{}", e.to_json());
    1
}
