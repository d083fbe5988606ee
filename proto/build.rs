//! Compiles proto/protos/**/*.proto with protox (pure Rust: no protoc install) and
//! generates prost messages plus tonic clients and servers.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("protos");
    let files = [
        "envoy/service/discovery/v3/ads.proto",
        "envoy/service/secret/v3/sds.proto",
        "envoy/extensions/transport_sockets/tls/v3/secret.proto",
        "istio/v1/auth/ca.proto",
        "istio/networking/nds/v1/nds.proto",
        "istio/workload/zds/zds.proto",
        "envoy/config/listener/v3/listener.proto",
        "envoy/config/cluster/v3/cluster.proto",
        "envoy/config/endpoint/v3/endpoint.proto",
        "envoy/config/route/v3/route.proto",
        "envoy/config/core/v3/extension.proto",
        "envoy/extensions/filters/network/http_connection_manager/v3/http_connection_manager.proto",
        "envoy/extensions/filters/network/tcp_proxy/v3/tcp_proxy.proto",
        "envoy/extensions/filters/http/router/v3/router.proto",
        "envoy/extensions/filters/listener/original_dst/v3/original_dst.proto",
        "envoy/extensions/transport_sockets/tls/v3/tls.proto",
        "grpc/health/v1/health.proto",
        "envoy/extensions/filters/http/wasm/v3/wasm.proto",
        "envoy/extensions/filters/network/wasm/v3/wasm.proto",
    ];
    println!("cargo:rerun-if-changed={}", root.display());
    let fds = protox::compile(files, [&root])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    // The test rig's (`rig` feature): CRI v1, kubelet's side; istio.workload messages.
    if std::env::var_os("CARGO_FEATURE_RIG").is_some() {
        let rig = protox::compile(["cri/runtime/v1/api.proto", "istio/workload/workload.proto"], [&root])?;
        tonic_prost_build::configure().build_client(true).build_server(false).compile_fds(rig)?;
    }
    Ok(())
}
