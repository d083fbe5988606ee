//! The gRPC xDS bootstrap (`GRPC_XDS_BOOTSTRAP`, default
//! `./etc/istio/proxy/grpc-bootstrap.json`) that proxyless gRPC applications read, as
//! pilot-agent writes it: the agent's XDS socket as the one xDS server (insecure
//! channel credentials, `xds_v3`), the node with `GENERATOR=grpc` in its metadata, a
//! `file_watcher` certificate provider over `OUTPUT_CERTS` when certificates are
//! written there, and Istio's listener name template for gRPC servers. Pure, plus an
//! atomic write.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// Istio's template for the listeners a proxyless gRPC server asks for.
pub const SERVER_LISTENER_TEMPLATE: &str = "xds.istio.io/grpc/lds/inbound/%s";

/// The bootstrap document.
pub fn render(
    node_id: &str,
    metadata: &serde_json::Map<String, Value>,
    xds_socket: &Path,
    cert_dir: Option<&Path>,
) -> Value {
    let mut metadata = metadata.clone();
    metadata.insert("GENERATOR".into(), json!("grpc"));
    let mut bootstrap = json!({
        "xds_servers": [{
            "server_uri": format!("unix:///{}", xds_socket.strip_prefix("/").unwrap_or(xds_socket).display()),
            "channel_creds": [{"type": "insecure"}],
            "server_features": ["xds_v3"]
        }],
        "node": {"id": node_id, "metadata": metadata, "locality": {}},
        "server_listener_resource_name_template": SERVER_LISTENER_TEMPLATE
    });
    if let Some(dir) = cert_dir {
        bootstrap["certificate_providers"] = json!({
            "default": {
                "plugin_name": "file_watcher",
                "config": {
                    "certificate_file": dir.join("cert-chain.pem"),
                    "private_key_file": dir.join("key.pem"),
                    "ca_certificate_file": dir.join("root-cert.pem"),
                    "refresh_interval": "900s"
                }
            }
        });
    }
    bootstrap
}

#[derive(Debug, thiserror::Error)]
#[error("write the gRPC xDS bootstrap {path} (GRPC_XDS_BOOTSTRAP)")]
pub struct GrpcBootstrapError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Writes `document` to `path` atomically (0644), creating its folder.
pub fn write(path: &Path, document: &Value) -> Result<(), GrpcBootstrapError> {
    use std::os::unix::fs::PermissionsExt as _;
    let err = |source| GrpcBootstrapError { path: path.into(), source };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(document).expect("JSON serializes")).map_err(err)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bootstrap_is_pilot_agents() {
        let meta: serde_json::Map<String, Value> =
            [("CLUSTER_ID".to_string(), json!("Kubernetes"))].into_iter().collect();
        let b = render(
            "sidecar~10.0.0.5~app.ns~ns.svc.cluster.local",
            &meta,
            Path::new("./etc/istio/proxy/XDS"),
            None,
        );
        assert_eq!(b["xds_servers"][0]["server_uri"], "unix:///./etc/istio/proxy/XDS");
        assert_eq!(b["xds_servers"][0]["channel_creds"][0]["type"], "insecure");
        assert_eq!(b["node"]["metadata"]["GENERATOR"], "grpc");
        assert_eq!(b["node"]["metadata"]["CLUSTER_ID"], "Kubernetes");
        assert_eq!(b["server_listener_resource_name_template"], SERVER_LISTENER_TEMPLATE);
        assert!(b.get("certificate_providers").is_none(), "no certificates written: no provider");
        let b =
            render("n", &meta, Path::new("/pod/etc/istio/proxy/XDS"), Some(Path::new("/var/lib/istio/data")));
        assert_eq!(b["xds_servers"][0]["server_uri"], "unix:///pod/etc/istio/proxy/XDS");
        let cfg = &b["certificate_providers"]["default"]["config"];
        assert_eq!(b["certificate_providers"]["default"]["plugin_name"], "file_watcher");
        assert_eq!(cfg["private_key_file"], "/var/lib/istio/data/key.pem");
        assert_eq!(cfg["ca_certificate_file"], "/var/lib/istio/data/root-cert.pem");
    }
}
