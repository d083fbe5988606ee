//! The `weir` binary: everything it does is `weir_agent::cmd`'s; this only hands it
//! the command line and returns its exit code.

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(weir_agent::cmd::main(std::env::args_os().collect()))
}
