//! Logs for every Weir process: `tracing` to stderr, at one level chosen once at start.
//! The level is `WEIR_LOG` (a level or per-target directives), else the caller's (the
//! CNI plugin's `plugin_log_level`), else Istio's `--log_output_level=default:<level>`
//! (which the injector passes to istio-iptables), else info.

use std::ffi::OsString;

/// Sets up the process's logs (once; `argv` is searched for Istio's level flag).
pub fn init(argv: &[OsString], level: Option<&str>) {
    use tracing_subscriber::{EnvFilter, fmt};
    let istio_level = argv.iter().filter_map(|a| a.to_str()).find_map(|a| {
        let spec = a.strip_prefix("--log_output_level=")?;
        // `info` alone is the default scope's level, as Istio reads it.
        spec.split(',').find_map(|s| {
            s.strip_prefix("default:").or_else(|| s.strip_prefix("all:")).or((!s.contains(':')).then_some(s))
        })
    });
    let level = level.or(istio_level).map(istio_level_name).unwrap_or("info");
    use std::io::IsTerminal as _;
    let logs =
        fmt().with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal()).with_target(false);
    // A plain level (every short-lived run: the CNI plugin, istio-iptables) needs no
    // directive matching: a level filter costs the start-up nothing. WEIR_LOG may
    // carry per-target directives, and anything that is not a level is read as one.
    match (EnvFilter::try_from_env("WEIR_LOG"), level.parse::<tracing_subscriber::filter::LevelFilter>()) {
        (Ok(directives), _) => logs.with_env_filter(directives).init(),
        (Err(_), Ok(level)) => logs.with_max_level(level).init(),
        (Err(_), Err(_)) => logs.with_env_filter(EnvFilter::new(level)).init(),
    }
}

/// Istio's level names (debug, info, warn, error, fatal, none) as tracing's.
fn istio_level_name(level: &str) -> &str {
    match level {
        "fatal" | "none" => "error",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::istio_level_name;

    #[test]
    fn istio_levels_map_to_tracing_levels() {
        assert_eq!(istio_level_name("fatal"), "error");
        assert_eq!(istio_level_name("none"), "error");
        assert_eq!(istio_level_name("debug"), "debug");
    }
}
