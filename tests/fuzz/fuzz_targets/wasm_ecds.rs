//! A Wasm ECDS resource (`TypedExtensionConfig` bytes from istiod): the remote module
//! it names, and the rewrite to a local file. A rewritten resource names no remote
//! module any more.
#![no_main]
use libfuzzer_sys::fuzz_target;
use prost_types::Any;
use weir_agent::sidecar::wasm::rewrite::{remote_module, replace_field, with_local_file};

fuzz_target!(|data: &[u8]| {
    let resource = Any { type_url: weir_proto::type_url::EXTENSION_CONFIG.into(), value: data.to_vec() };
    // The wire-level rewrite alone, on any path the first byte picks.
    let path: Vec<u32> =
        data.first().map(|b| (0..(b % 6)).map(|i| u32::from(i % 4) + 1).collect()).unwrap_or_default();
    let _ = replace_field(data, &path, b"x");
    let Ok(Some(_remote)) = remote_module(&resource) else { return };
    let Ok(local) = with_local_file(&resource, "/var/lib/istio/data/module.wasm") else { return };
    assert_eq!(remote_module(&local), Ok(None), "a remote module survived the rewrite");
});
