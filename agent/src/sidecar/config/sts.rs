//! The STS server (`--stsPort` above 0): its token manager plugin and endpoint.

use super::{ConfigError, IdentitySettings, Sources, vars};
use crate::sidecar::sts::{GOOGLE_TOKEN_EXCHANGE, StsSettings};

pub fn resolve(src: &Sources<'_>, identity: &IdentitySettings) -> Result<Option<StsSettings>, ConfigError> {
    let args = src.args;
    if args.sts_port == 0 {
        return Ok(None);
    }
    let plugin = args.token_manager_plugin.clone();
    if !plugin.is_empty() && plugin != GOOGLE_TOKEN_EXCHANGE {
        return Err(ConfigError::Flag {
            name: "--tokenManagerPlugin".into(),
            value: plugin,
            expected: "GoogleTokenExchange",
        });
    }
    let text = vars::WEIR_STS_TOKEN_ENDPOINT.text(src.env);
    let endpoint = text
        .parse::<hyper::Uri>()
        .ok()
        .filter(|u| matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some())
        .ok_or_else(|| vars::WEIR_STS_TOKEN_ENDPOINT.invalid(text.clone(), "an http:// or https:// URL"))?;
    Ok(Some(StsSettings {
        port: args.sts_port,
        plugin: if plugin.is_empty() { GOOGLE_TOKEN_EXCHANGE.into() } else { plugin },
        endpoint,
        trust_domain: identity.identity.trust_domain.clone(),
        identity_provider: vars::GKE_CLUSTER_URL.text(src.env),
    }))
}
