//! Wasm modules over ECDS, as pilot-agent's xDS proxy handles them: an extension
//! config (`TypedExtensionConfig`) whose Wasm filter loads its code from a remote
//! URL (HTTP(S) or an OCI image) is rewritten, before Envoy sees it, to load a local
//! file the agent fetched, checked and cached. If any module of a response cannot be
//! had, the whole response is NACKed to istiod with the reason and nothing reaches
//! Envoy, which keeps its last good config.

pub mod cache;
pub mod fetch;
pub mod oci;
pub mod rewrite;
#[cfg(test)]
mod stand_ins;

use std::sync::Arc;

use prost_types::Any;

pub use cache::{CacheOptions, ModuleCache};
pub use fetch::ProxySettings;

/// Rewrites remote Wasm modules to cached local files.
pub struct WasmConverter {
    cache: Arc<ModuleCache>,
}

impl WasmConverter {
    pub fn new(cache: Arc<ModuleCache>) -> Self {
        Self { cache }
    }

    /// Rewrites every remote module in `resources`; returns how many. All or nothing:
    /// on an error the caller forwards none of them.
    pub async fn convert(&self, resources: Vec<&mut Any>) -> Result<usize, String> {
        let mut rewritten = Vec::new();
        for (i, resource) in resources.iter().enumerate() {
            let Some(module) = rewrite::remote_module(resource)? else { continue };
            let path = self
                .cache
                .get(&module)
                .await
                .map_err(|e| format!("Wasm config {}: {}", module.resource, crate::error_chain(&e)))?;
            let local = rewrite::with_local_file(resource, &path.to_string_lossy())
                .map_err(|e| format!("Wasm config {}: {e}", module.resource))?;
            tracing::info!(resource = %module.resource, uri = %module.uri, path = %path.display(), "Wasm module served from a local file");
            rewritten.push((i, local));
        }
        let count = rewritten.len();
        let mut resources = resources;
        for (i, local) in rewritten {
            *resources[i] = local;
        }
        Ok(count)
    }
}
