//! Plumbing every job uses, importing nothing of the jobs themselves: accepting
//! connections, HTTP/1 and TLS clients, files replaced atomically, executables handed
//! to another user, exit codes, logs, privilege checks, build information, Go
//! templates, and one way to build a runtime, wait for shutdown and supervise tasks.

pub mod accept;
pub mod atomic_file;
pub mod build_info;
pub mod cgroup2;
pub mod executable;
pub mod exit;
pub mod gotemplate;
pub mod http1;
pub mod logs;
pub mod privileges;
pub mod readiness;
pub mod runtime;
pub mod services;
pub mod shutdown;
pub mod text;
pub mod tls;
