//! `weir config env|bootstrap|[dump] [proxy flags]`: every environment variable the
//! agent reads (docs/env.md), the bootstrap Envoy would get, or the configuration the
//! agent would run with.

use super::proxy::load_config;
use crate::{sidecar::agent::render_bootstrap, sidecar::config::vars, support::exit};

/// Runs `weir config` with `args`; the exit code.
pub fn run(args: &[String]) -> u8 {
    match args.first().map(String::as_str) {
        Some("env") => {
            print!("{}", vars::markdown());
            exit::OK
        }
        Some("bootstrap") => match load_config(&args[1..]) {
            Ok(config) => match render_bootstrap(&config) {
                Ok((text, _)) => {
                    print!("{text}");
                    exit::OK
                }
                Err(e) => {
                    eprintln!("weir: cannot render the bootstrap: {}", crate::error_chain(&e));
                    exit::FAILURE
                }
            },
            Err(code) => code,
        },
        // `dump` is optional.
        _ => match load_config(args.strip_prefix(&["dump".to_string()]).unwrap_or(args)) {
            Ok(config) => {
                print!("{}", config.to_yaml());
                exit::OK
            }
            Err(code) => code,
        },
    }
}
