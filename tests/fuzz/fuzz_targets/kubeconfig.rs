//! The kubeconfig the CNI plugin reads (written by the node agent, or an operator's):
//! parsed as the plugin parses it. It lives in a folder that does not exist, so
//! relative file references fail; inputs that could name a device or kernel file
//! (which would be read whole) are skipped.
#![no_main]
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use weir_agent::node::cni::kube::Kubeconfig;

fuzz_target!(|data: &[u8]| {
    let Some(text) = weir_fuzz::text(data) else { return };
    if ["dev", "proc", "sys", "\\"].iter().any(|s| text.contains(s)) {
        return;
    }
    let _ = Kubeconfig::parse(Path::new("/nonexistent/weir-fuzz/kubeconfig"), text);
});
