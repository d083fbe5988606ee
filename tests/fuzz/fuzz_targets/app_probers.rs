//! `ISTIO_KUBE_APP_PROBERS`, the injector's JSON of rewritten probes: parse and
//! validate; what parses serializes back to JSON that parses to the same probers.
#![no_main]
use libfuzzer_sys::fuzz_target;
use weir_agent::sidecar::status::AppProbers;

fuzz_target!(|data: &[u8]| {
    let Some(text) = weir_fuzz::text(data) else { return };
    let Ok(probers) = AppProbers::parse(text) else { return };
    let json = serde_json::to_string(&probers.0).expect("probers serialize");
    assert_eq!(AppProbers::parse(&json).as_ref(), Ok(&probers), "round trip through {json}");
});
