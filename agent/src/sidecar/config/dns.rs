//! The DNS proxy: whether it runs (`ISTIO_META_DNS_CAPTURE` for sidecars,
//! `ISTIO_META_ENABLE_DNS_SERVER` for any proxy), where it listens and how it forwards.

use std::{path::PathBuf, time::Duration};

use serde::Serialize;

use super::{ConfigError, ProxyType, Sources, paths, serialize_duration, vars};

/// The DNS proxy.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DnsSettings {
    /// `ISTIO_META_DNS_CAPTURE` for sidecars, or `ISTIO_META_ENABLE_DNS_SERVER`.
    pub enabled: bool,
    /// `DNS_PROXY_ADDR`.
    pub address: String,
    pub forward_parallel: bool,
    #[serde(serialize_with = "serialize_duration")]
    pub forward_timeout: Duration,
    pub resolv_conf: PathBuf,
}

impl DnsSettings {
    pub fn resolve(src: &Sources<'_>) -> Result<Self, ConfigError> {
        let env = src.env;
        let capture = vars::ISTIO_META_DNS_CAPTURE.bool(env)? && src.args.proxy_type == ProxyType::Sidecar;
        Ok(Self {
            enabled: capture || vars::ISTIO_META_ENABLE_DNS_SERVER.bool(env)?,
            address: vars::DNS_PROXY_ADDR.text(env),
            forward_parallel: vars::DNS_FORWARD_PARALLEL.bool(env)?,
            forward_timeout: vars::DNS_FORWARD_TIMEOUT.duration(env)?,
            resolv_conf: paths::RESOLV_CONF.into(),
        })
    }
}
