//! Where remote Wasm modules are fetched to, and how (pilot-agent's `WASM_*`).

use std::path::PathBuf;

use super::{ConfigError, Sources, vars};
use crate::sidecar::wasm::{CacheOptions, ProxySettings};

/// Go's `httpproxy.FromEnvironment`: the upper-case name, else the lower-case one; a
/// proxy URL the client cannot use is refused at start, naming the variable.
fn proxy(src: &Sources<'_>) -> Result<ProxySettings, ConfigError> {
    let env = src.env;
    let url = |upper: &vars::Var, lower: &vars::Var| -> Result<Option<String>, ConfigError> {
        let (var, value) = match upper.value(env) {
            Some(v) => (upper, v),
            None => match lower.value(env) {
                Some(v) => (lower, v),
                None => return Ok(None),
            },
        };
        ProxySettings::check(&value)
            .map(|()| Some(value.clone()))
            .map_err(|_| var.invalid(value, "a proxy URL such as http://proxy:3128"))
    };
    Ok(ProxySettings {
        http: url(&vars::HTTP_PROXY, &vars::http_proxy)?,
        https: url(&vars::HTTPS_PROXY, &vars::https_proxy)?,
        no_proxy: vars::NO_PROXY.value(env).or_else(|| vars::no_proxy.value(env)).unwrap_or_default(),
    })
}

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
        proxy: proxy(src)?,
        http_timeout: vars::WASM_HTTP_REQUEST_TIMEOUT.duration(env)?,
        max_retries: vars::WASM_HTTP_REQUEST_MAX_RETRIES.count(env)?,
        max_bytes: CacheOptions::default().max_bytes,
    })
}
