//! The README's first command ends in `weir demo`: run it briefly with each capture
//! backend this machine has and check its own summary (`weir_tests::demo`).

use weir_tests::{demo::assert_demo_works, require_root, tools};

fn demo(mode: &str) {
    let envoy = weir_tests::envoy::binary().unwrap();
    assert_demo_works(&tools::weir(), mode, &[("WEIR_ENVOY", envoy.as_os_str())]);
}

#[test]
fn the_demo_carries_traffic_over_mtls_with_ebpf() {
    require_root!();
    demo("ebpf");
}

#[test]
fn the_demo_carries_traffic_over_mtls_with_nftables() {
    require_root!();
    demo("nftables");
}

#[test]
fn the_demo_carries_traffic_over_mtls_with_iptables() {
    require_root!();
    demo("iptables");
}
