//! The pod (and pod list) JSON the API server returns to the CNI plugin and its
//! repair loop: parse, decide whether to capture, and render what it would program.
#![no_main]
use libfuzzer_sys::fuzz_target;
use weir_agent::node::cni::pod::{PodInfo, capture_config, skip_reason};

fn check(pod: &PodInfo) {
    let _ = skip_reason(pod).map(|s| s.to_string());
    for ipv6 in [false, true] {
        if let Ok(cfg) = capture_config(pod, ipv6) {
            weir_fuzz::render_all(&cfg);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(pod) = PodInfo::from_json(data) {
        check(&pod);
    }
    if let Ok(pods) = PodInfo::list_from_json(data) {
        pods.iter().for_each(check);
    }
});
