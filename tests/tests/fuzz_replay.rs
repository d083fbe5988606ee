//! Every fuzz target (`tests/fuzz/fuzz_targets/`) replayed as an ordinary test: each
//! target's committed seeds (`tests/fuzz/seeds/<target>/`), the inputs that once crashed
//! it (`tests/fuzz/regressions/<target>/`) and, when an earlier `scripts/fuzz` left one,
//! its working corpus (`tests/fuzz/corpus/<target>/`) go through the target's own body,
//! compiled here from the same file libFuzzer builds. A panic or a failed assertion
//! fails the target's test, naming every input that did it.
//!
//! How the files compile here unchanged: a target writes `use libfuzzer_sys::fuzz_target;`
//! and `fuzz_target!(|data: &[u8]| { .. })`, and calls the fuzz crate's plumbing as
//! `weir_fuzz::..`. In this crate `libfuzzer_sys` and `weir_fuzz` are this crate itself
//! (`extern crate self as ..`): its `fuzz_target!` turns the body into `pub fn run(data:
//! &[u8])`, and the plumbing (`tests/fuzz/src/lib.rs`) is included at its root. No
//! libFuzzer, no sanitizer, no nightly: the dev build the suite already has.
//!
//! This is the suite's fuzzing; libFuzzer's search (`scripts/fuzz`) runs where it pays,
//! see docs/reliability.md.

extern crate self as libfuzzer_sys;
extern crate self as weir_fuzz;

use std::{
    panic::{AssertUnwindSafe, catch_unwind},
    path::{Path, PathBuf},
};

#[path = "../fuzz/src/lib.rs"]
mod plumbing;
pub use plumbing::*;

/// libfuzzer-sys's macro, for the replay: the target's body becomes `run`. In a module
/// of its own, so that targets reach it by their `use libfuzzer_sys::fuzz_target`.
mod shim {
    #[macro_export]
    macro_rules! fuzz_target {
        (|$data:ident: &[u8]| $body:block) => {
            /// The target's body, as libFuzzer runs it on one input.
            pub fn run($data: &[u8]) $body
        };
    }
}

/// One module per target, from libFuzzer's own file (its `#![no_main]` is for the fuzz
/// binary and means nothing in a module).
macro_rules! targets {
    ($($name:ident => $file:literal),* $(,)?) => {
        $(
            #[allow(unused_attributes)]
            #[path = $file]
            mod $name;

            #[test]
            fn $name() {
                replay(stringify!($name), $name::run);
            }
        )*
        /// The targets replayed here, by name.
        const REPLAYED: &[&str] = &[$(stringify!($name)),*];
    };
}

targets! {
    app_probers => "../fuzz/fuzz_targets/app_probers.rs",
    ca_pem_chain => "../fuzz/fuzz_targets/ca_pem_chain.rs",
    cni_args => "../fuzz/fuzz_targets/cni_args.rs",
    cni_netconf => "../fuzz/fuzz_targets/cni_netconf.rs",
    dns_tcp => "../fuzz/fuzz_targets/dns_tcp.rs",
    dns_udp => "../fuzz/fuzz_targets/dns_udp.rs",
    h2_authority => "../fuzz/fuzz_targets/h2_authority.rs",
    iptables_explain => "../fuzz/fuzz_targets/iptables_explain.rs",
    istio_iptables => "../fuzz/fuzz_targets/istio_iptables.rs",
    kubeconfig => "../fuzz/fuzz_targets/kubeconfig.rs",
    nds_table => "../fuzz/fuzz_targets/nds_table.rs",
    pod_annotations => "../fuzz/fuzz_targets/pod_annotations.rs",
    pod_json => "../fuzz/fuzz_targets/pod_json.rs",
    prometheus_merge => "../fuzz/fuzz_targets/prometheus_merge.rs",
    proxy_config => "../fuzz/fuzz_targets/proxy_config.rs",
    standalone_services => "../fuzz/fuzz_targets/standalone_services.rs",
    wasm_ecds => "../fuzz/fuzz_targets/wasm_ecds.rs",
}

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// The files directly in `dir`, sorted; none when `dir` does not exist.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.unwrap_or_else(|e| panic!("read {}: {e}", dir.display())).path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Runs `run` on every input of `target`; fails naming each input that panicked.
fn replay(target: &str, run: fn(&[u8])) {
    let fuzz = fuzz_dir();
    let seeds = inputs(&fuzz.join("seeds").join(target));
    assert!(!seeds.is_empty(), "{target} has no seeds under {}", fuzz.join("seeds").display());
    let mut all = seeds;
    all.extend(inputs(&fuzz.join("regressions").join(target)));
    all.extend(inputs(&fuzz.join("corpus").join(target)));
    let mut crashed = Vec::new();
    for path in &all {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        if catch_unwind(AssertUnwindSafe(|| run(&data))).is_err() {
            crashed.push(path.display().to_string());
        }
    }
    assert!(
        crashed.is_empty(),
        "{target} panicked on {} of {} inputs (the panics are printed above; reproduce one with \
         `scripts/fuzz {target}` or tests/fuzz/target/x86_64-unknown-linux-gnu/release/{target} FILE):\n{}",
        crashed.len(),
        all.len(),
        crashed.join("\n")
    );
    eprintln!("{target}: {} inputs replayed", all.len());
}

/// A target added to `tests/fuzz/fuzz_targets/` is replayed here too, and has seeds.
#[test]
fn every_fuzz_target_is_replayed() {
    let mut files: Vec<String> = inputs(&fuzz_dir().join("fuzz_targets"))
        .iter()
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    files.sort();
    let mut replayed: Vec<String> = REPLAYED.iter().map(|s| s.to_string()).collect();
    replayed.sort();
    assert_eq!(
        files, replayed,
        "tests/fuzz/fuzz_targets/ and the targets! list of tests/tests/fuzz_replay.rs differ: add the new \
         target there"
    );
}
