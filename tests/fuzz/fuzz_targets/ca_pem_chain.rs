//! PEM from the CA: a signed chain (leaf first) as `CreateCertificate` returns it, and
//! bundles as files hold them. Checked at a fixed time, against a key that does not
//! match (so a chain reaches every check but the last).
#![no_main]
use std::time::{Duration, UNIX_EPOCH};

use libfuzzer_sys::fuzz_target;
use weir_agent::sidecar::identity::chain::{check_bundle, check_issued, parse_pem};

fuzz_target!(|data: &[u8]| {
    let Some(text) = weir_fuzz::text(data) else { return };
    let now = UNIX_EPOCH + Duration::from_secs(1_780_000_000);
    let _ = parse_pem(1, text);
    let _ = check_bundle("fuzz bundle", text, now);
    let chain: Vec<String> = text
        .split_inclusive("-----END CERTIFICATE-----")
        .map(|s| s.trim_start().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    let _ = check_issued(&chain, b"not the key", now);
});
