//! The pure half of Wasm over ECDS: find the remote module a `TypedExtensionConfig`
//! (an HTTP or network Wasm filter) points at, and rewrite the resource so its
//! `vm_config.code` names a local file instead. The rewrite works on the protobuf wire
//! format, replacing only that one field: every other byte istiod sent (fields Weir's
//! trimmed protos do not know included) reaches Envoy unchanged.

use std::time::Duration;

use prost::Message as _;
use prost_types::Any;
use weir_proto::envoy::{
    config::core::v3::{AsyncDataSource, DataSource, TypedExtensionConfig, async_data_source, data_source},
    extensions::{
        filters::{http::wasm::v3::Wasm as HttpWasm, network::wasm::v3::Wasm as NetworkWasm},
        wasm::v3::{PluginConfig, plugin_config},
    },
};

pub const HTTP_WASM: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
pub const NETWORK_WASM: &str = "type.googleapis.com/envoy.extensions.filters.network.wasm.v3.Wasm";

/// A module to fetch, as the resource asks for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteModule {
    /// The extension config's name (for logs and errors).
    pub resource: String,
    pub uri: String,
    /// Lowercase hex; empty when not given (istiod writes "nil" for none).
    pub sha256: String,
    pub timeout: Option<Duration>,
}

/// The remote module of a Wasm extension config, `None` for anything else (other
/// filters, local modules).
pub fn remote_module(resource: &Any) -> Result<Option<RemoteModule>, String> {
    let ec = TypedExtensionConfig::decode(resource.value.as_slice())
        .map_err(|e| format!("TypedExtensionConfig: {e}"))?;
    let Some(typed) = &ec.typed_config else { return Ok(None) };
    let plugin: Option<PluginConfig> = match typed.type_url.as_str() {
        HTTP_WASM => {
            HttpWasm::decode(typed.value.as_slice()).map_err(|e| format!("{}: {e}", ec.name))?.config
        }
        NETWORK_WASM => {
            NetworkWasm::decode(typed.value.as_slice()).map_err(|e| format!("{}: {e}", ec.name))?.config
        }
        _ => return Ok(None),
    };
    let Some(plugin_config::Vm::VmConfig(vm)) = plugin.and_then(|p| p.vm) else { return Ok(None) };
    let Some(async_data_source::Specifier::Remote(remote)) = vm.code.and_then(|c| c.specifier) else {
        return Ok(None);
    };
    let http =
        remote.http_uri.ok_or_else(|| format!("Wasm config {}: the remote code has no http_uri", ec.name))?;
    if http.uri.is_empty() {
        return Err(format!("Wasm config {}: the remote code's http_uri is empty", ec.name));
    }
    let sha256 = if remote.sha256 == "nil" { String::new() } else { remote.sha256.to_ascii_lowercase() };
    Ok(Some(RemoteModule {
        resource: ec.name,
        uri: http.uri,
        sha256,
        timeout: http
            .timeout
            .and_then(|d| {
                (d.seconds >= 0 && d.nanos >= 0).then(|| Duration::new(d.seconds as u64, d.nanos as u32))
            })
            .filter(|d| !d.is_zero()),
    }))
}

/// Field path from `TypedExtensionConfig` to `VmConfig.code`: typed_config (2) →
/// Any.value (2) → Wasm.config (1) → PluginConfig.vm_config (3) → VmConfig.code (3).
const CODE_PATH: [u32; 5] = [2, 2, 1, 3, 3];

/// `resource` with its module's code replaced by `filename`.
pub fn with_local_file(resource: &Any, filename: &str) -> Result<Any, String> {
    let code = AsyncDataSource {
        specifier: Some(async_data_source::Specifier::Local(DataSource {
            specifier: Some(data_source::Specifier::Filename(filename.into())),
        })),
    }
    .encode_to_vec();
    let value = replace_field(&resource.value, &CODE_PATH, &code)?;
    Ok(Any { type_url: resource.type_url.clone(), value })
}

/// Rewrites `message` so that every occurrence of the length-delimited field at `path`
/// holds `new` (nested messages re-encoded with their new lengths).
pub fn replace_field(message: &[u8], path: &[u32], new: &[u8]) -> Result<Vec<u8>, String> {
    let (&field, rest) = path.split_first().ok_or("empty field path")?;
    let mut out = Vec::with_capacity(message.len() + new.len());
    let mut found = false;
    let mut input = message;
    while !input.is_empty() {
        let start = input;
        let key = varint(&mut input)?;
        let (number, wire) = ((key >> 3) as u32, (key & 7) as u8);
        match wire {
            0 => {
                varint(&mut input)?;
            }
            1 => input = input.get(8..).ok_or("truncated fixed64")?,
            5 => input = input.get(4..).ok_or("truncated fixed32")?,
            2 => {
                let len = usize::try_from(varint(&mut input)?).map_err(|_| "length overflows")?;
                let payload = input.get(..len).ok_or("truncated length-delimited field")?;
                input = &input[len..];
                if number == field {
                    found = true;
                    let replaced =
                        if rest.is_empty() { new.to_vec() } else { replace_field(payload, rest, new)? };
                    put_varint(&mut out, key);
                    put_varint(&mut out, replaced.len() as u64);
                    out.extend_from_slice(&replaced);
                    continue;
                }
            }
            other => return Err(format!("unsupported wire type {other} (field {number})")),
        }
        let consumed = start.len() - input.len();
        out.extend_from_slice(&start[..consumed]);
    }
    if !found {
        return Err(format!("field {field} not present"));
    }
    Ok(out)
}

fn varint(input: &mut &[u8]) -> Result<u64, String> {
    let mut value = 0u64;
    for i in 0..10 {
        let (&b, rest) = input.split_first().ok_or("truncated varint")?;
        *input = rest;
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("varint longer than 10 bytes".into())
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

#[cfg(test)]
pub(crate) mod tests {
    use weir_proto::{
        envoy::{
            config::core::v3::{HttpUri, RemoteDataSource},
            extensions::wasm::v3::VmConfig,
        },
        to_any, type_url,
    };

    use super::*;

    /// An ECDS resource as istiod writes it for a WasmPlugin with a remote module.
    pub(crate) fn remote_wasm(name: &str, uri: &str, sha256: &str) -> Any {
        let wasm = HttpWasm {
            config: Some(PluginConfig {
                name: name.into(),
                root_id: "root".into(),
                vm: Some(plugin_config::Vm::VmConfig(VmConfig {
                    vm_id: "vm".into(),
                    runtime: "envoy.wasm.runtime.v8".into(),
                    code: Some(AsyncDataSource {
                        specifier: Some(async_data_source::Specifier::Remote(RemoteDataSource {
                            http_uri: Some(HttpUri {
                                uri: uri.into(),
                                http_upstream_type: None,
                                timeout: Some(prost_types::Duration { seconds: 30, nanos: 0 }),
                            }),
                            sha256: sha256.into(),
                        })),
                    }),
                    ..Default::default()
                })),
                fail_open: true,
                ..Default::default()
            }),
        };
        to_any(
            type_url::EXTENSION_CONFIG,
            &TypedExtensionConfig { name: name.into(), typed_config: Some(to_any(HTTP_WASM, &wasm)) },
        )
    }

    #[test]
    fn a_remote_module_is_found_and_replaced_by_a_local_file_keeping_everything_else() {
        let mut resource = remote_wasm("ns.plugin", "https://example.com/f.wasm", "ABCD");
        // A field Weir's protos do not know (PluginConfig field 7, varint 1) must survive.
        let mut ec = TypedExtensionConfig::decode(resource.value.as_slice()).unwrap();
        let typed = ec.typed_config.as_mut().unwrap();
        let plugin_path = [1u32];
        let wasm = HttpWasm::decode(typed.value.as_slice()).unwrap();
        let mut plugin = wasm.config.unwrap().encode_to_vec();
        plugin.extend_from_slice(&[7 << 3, 1]);
        typed.value = replace_field(&typed.value, &plugin_path, &plugin).unwrap();
        resource.value = ec.encode_to_vec();

        let remote = remote_module(&resource).unwrap().unwrap();
        assert_eq!(remote.uri, "https://example.com/f.wasm");
        assert_eq!(remote.sha256, "abcd");
        assert_eq!(remote.timeout, Some(Duration::from_secs(30)));

        let local = with_local_file(&resource, "/var/lib/istio/data/abcd.wasm").unwrap();
        assert_eq!(remote_module(&local).unwrap(), None, "no remote left");
        let ec = TypedExtensionConfig::decode(local.value.as_slice()).unwrap();
        let typed = ec.typed_config.unwrap();
        let plugin = HttpWasm::decode(typed.value.as_slice()).unwrap().config.unwrap();
        assert_eq!(
            (plugin.name.as_str(), plugin.root_id.as_str(), plugin.fail_open),
            ("ns.plugin", "root", true)
        );
        let Some(plugin_config::Vm::VmConfig(vm)) = plugin.vm else { panic!() };
        assert_eq!(vm.runtime, "envoy.wasm.runtime.v8");
        let Some(async_data_source::Specifier::Local(DataSource {
            specifier: Some(data_source::Specifier::Filename(f)),
        })) = vm.code.unwrap().specifier
        else {
            panic!("code is not a local file")
        };
        assert_eq!(f, "/var/lib/istio/data/abcd.wasm");
        assert!(
            typed.value.windows(2).any(|w| w == [7 << 3, 1]),
            "the unknown PluginConfig field was dropped"
        );
    }

    #[test]
    fn other_extensions_pass_and_broken_ones_are_named() {
        let rbac = to_any(
            type_url::EXTENSION_CONFIG,
            &TypedExtensionConfig {
                name: "rbac".into(),
                typed_config: Some(Any {
                    type_url: "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC".into(),
                    value: vec![],
                }),
            },
        );
        assert_eq!(remote_module(&rbac).unwrap(), None);
        let nil = remote_wasm("p", "http://x/f.wasm", "nil");
        assert_eq!(remote_module(&nil).unwrap().unwrap().sha256, "");
        let garbage = Any { type_url: type_url::EXTENSION_CONFIG.into(), value: vec![0xff, 0xff] };
        assert!(remote_module(&garbage).unwrap_err().contains("TypedExtensionConfig"));
        assert!(replace_field(&[0x0a, 0x05, 1], &[1], b"x").unwrap_err().contains("truncated"));
        assert!(replace_field(&[0x08, 0x01], &[1], b"x").unwrap_err().contains("not present"));
    }
}
