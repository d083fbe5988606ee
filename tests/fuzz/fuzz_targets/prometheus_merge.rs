//! The merged `/stats/prometheus`: the scrape annotations (`ISTIO_PROMETHEUS_ANNOTATIONS`
//! JSON, first section) and expositions from Envoy and apps (further sections, any
//! bytes) concatenated. The result has no `# EOF`, ends in a newline, and keeps every
//! other line of every part, in order.
#![no_main]
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use weir_agent::sidecar::status::merge::{parse_scrape_config, push_part};

fuzz_target!(|data: &[u8]| {
    let parts: Vec<&[u8]> = data.split(|b| *b == 0).collect();
    if let Some(json) = parts.first().and_then(|p| std::str::from_utf8(p).ok()) {
        let _ = parse_scrape_config(Some(json), 15020);
    }
    let mut out = BytesMut::new();
    let mut expected = Vec::new();
    for part in &parts[1.min(parts.len())..] {
        push_part(&mut out, part);
        for line in part.split(|b| *b == b'\n') {
            if !line.is_empty() && line.trim_ascii() != b"# EOF" {
                expected.push(line.to_vec());
            }
        }
    }
    assert!(out.is_empty() || out.ends_with(b"\n"));
    let got: Vec<Vec<u8>> =
        out[..].split(|b| *b == b'\n').filter(|l| !l.is_empty()).map(<[u8]>::to_vec).collect();
    assert_eq!(got, expected);
});
