//! Exit codes Weir uses, in one place so scripts and tests can rely on them.

/// Success.
pub const OK: u8 = 0;
/// A runtime failure (rules not applied, Envoy failed, ...).
pub const FAILURE: u8 = 1;
/// clap's usage errors (unknown subcommand, missing argument).
pub const CLAP_USAGE: u8 = 2;
/// Bad configuration or flags (EX_USAGE).
pub const USAGE: u8 = 64;
