//! The CNI network configuration on stdin (with `prevResult`), as the container
//! runtime hands it to the plugin: parse, then everything the plugin derives from it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use weir_agent::node::cni::{plugin, spec::NetConf};

fuzz_target!(|data: &[u8]| {
    let Ok(conf) = NetConf::parse(data) else { return };
    // A parsed config passes its prevResult on as a JSON object.
    let result: serde_json::Value = serde_json::from_str(&conf.result()).expect("result is JSON");
    assert!(result.is_object(), "result {result} is not an object");
    let _ = conf.excluded_namespaces().count();
    let _ = plugin::kubeconfig_path(&conf);
});
