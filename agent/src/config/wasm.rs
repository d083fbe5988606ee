//! Where remote Wasm modules are fetched to, and how (pilot-agent's `WASM_*`).

use std::path::PathBuf;

use super::{ConfigError, Sources, vars};
use crate::wasm::CacheOptions;

pub fn resolve(src: &Sources<'_>) -> Result<CacheOptions, ConfigError> {
    let env = src.env;
    Ok(CacheOptions {
        dir: PathBuf::from(vars::WEIR_WASM_CACHE_DIR.text(env)),
        module_expiry: vars::WASM_MODULE_EXPIRY.duration(env)?,
        purge_interval: vars::WASM_PURGE_INTERVAL.duration(env)?,
        insecure_registries: vars::WASM_INSECURE_REGISTRIES
            .text(env)
            .split(',')
            .map(|r| r.trim().to_string())
            .filter(|r| !r.is_empty())
            .collect(),
        http_timeout: vars::WASM_HTTP_REQUEST_TIMEOUT.duration(env)?,
        max_retries: vars::WASM_HTTP_REQUEST_MAX_RETRIES.count(env)?,
        max_bytes: CacheOptions::default().max_bytes,
    })
}
