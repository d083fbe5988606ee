//! The TLS transport sockets and TCP keepalives Istio's bootstrap options carry for
//! tracers and the metrics and access-log services (`option/convert.go`): an Envoy
//! `UpstreamTlsContext` built from ProxyConfig's `ClientTLSSettings` (certificates read
//! over SDS from files, or Istio's own for `ISTIO_MUTUAL`), and `tcp_keepalive`, each
//! as the compact Go JSON text the template inserts.

use serde_json::{Map, Value, json};

use crate::sidecar::node_metadata::Typed;

/// The `TLS_CLIENT_*` node metadata, which overrides a TLS setting's file paths.
#[derive(Debug, Clone, Default)]
pub struct TlsMetadata {
    pub root: String,
    pub cert_chain: String,
    pub key: String,
}

impl From<&Typed> for TlsMetadata {
    fn from(t: &Typed) -> Self {
        Self {
            root: t.str("TLS_CLIENT_ROOT_CERT").into(),
            cert_chain: t.str("TLS_CLIENT_CERT_CHAIN").into(),
            key: t.str("TLS_CLIENT_KEY").into(),
        }
    }
}

/// An SDS secret from the agent's `sds-grpc` cluster; Istio's own two (`default`,
/// `ROOTCA`) do not wait for the first fetch.
fn sds(name: &str) -> Value {
    let mut config = json!({
        "api_config_source": {
            "api_type": "GRPC",
            "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}],
            "set_node_on_first_message_only": true,
            "transport_api_version": "V3"
        },
        "resource_api_version": "V3"
    });
    if name == "default" || name == "ROOTCA" {
        config["initial_fetch_timeout"] = json!("0s");
    }
    json!({"name": name, "sds_config": config})
}

/// `transportSocketConverter`: the TLS socket for `tls` (protobuf JSON of
/// `ClientTLSSettings`), `""` when its mode is DISABLE; `default_sni` is used for
/// ISTIO_MUTUAL without an SNI; ALPN (`h2`) only for an HTTP/2 upstream.
pub fn transport_socket(tls: &Value, default_sni: &str, meta: &TlsMetadata, h2: bool) -> String {
    let text = |k: &str| tls.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
    let sans: Vec<Value> = tls
        .get("subjectAltNames")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(|s| json!({"exact": s})).collect())
        .unwrap_or_default();
    let mut default_validation = Map::new();
    if !sans.is_empty() {
        default_validation.insert("match_subject_alt_names".into(), Value::Array(sans));
    }
    let root = if meta.root.is_empty() { text("caCertificates") } else { meta.root.clone() };
    let mut validation = json!({"default_validation_context": default_validation});
    let mut common = Map::new();
    let mut sni = text("sni");
    match text("mode").as_str() {
        "SIMPLE" | "MUTUAL" => {
            if !root.is_empty() {
                validation["validation_context_sds_secret_config"] = sds(&format!("file-root:{root}"));
            }
            if text("mode") == "MUTUAL" {
                let cert = if meta.cert_chain.is_empty() {
                    text("clientCertificate")
                } else {
                    meta.cert_chain.clone()
                };
                let key = if meta.key.is_empty() { text("privateKey") } else { meta.key.clone() };
                if !cert.is_empty() && !key.is_empty() {
                    common.insert(
                        "tls_certificate_sds_secret_configs".into(),
                        json!([sds(&format!("file-cert:{cert}~{key}"))]),
                    );
                }
            }
            common.insert("alpn_protocols".into(), json!(["h2"]));
        }
        "ISTIO_MUTUAL" => {
            common.insert("tls_certificate_sds_secret_configs".into(), json!([sds("default")]));
            validation["validation_context_sds_secret_config"] = sds("ROOTCA");
            common.insert("alpn_protocols".into(), json!(["istio", "h2"]));
            if sni.is_empty() {
                sni = default_sni.to_string();
            }
        }
        _ => return String::new(),
    }
    if !h2 {
        common.remove("alpn_protocols");
    }
    common.insert("combined_validation_context".into(), validation);
    let mut context = json!({
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common
    });
    if !sni.is_empty() {
        context["sni"] = json!(sni);
    }
    crate::support::gotemplate::to_json(
        &json!({"name": "envoy.transport_sockets.tls", "typed_config": context}),
    )
}

/// `keepaliveConverter`: `tcp_keepalive` with Istio's wrapper objects.
pub fn keepalive(k: &Value) -> String {
    let mut out = Map::new();
    if let Some(probes) = k.get("probes").and_then(Value::as_u64).filter(|p| *p > 0) {
        out.insert("keepalive_probes".into(), json!({"value": probes}));
    }
    for (field, name) in [("time", "keepalive_time"), ("interval", "keepalive_interval")] {
        let seconds = k.get(field).and_then(Value::as_str).and_then(crate::support::text::parse_duration);
        if let Some(s) = seconds.map(|d| d.as_secs()).filter(|s| *s > 0) {
            out.insert(name.into(), json!({"value": s}));
        }
    }
    crate::support::gotemplate::to_json(&json!({"tcp_keepalive": out}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simple_tls_to_a_tracer_verifies_against_its_file_root() {
        let tls =
            json!({"mode": "SIMPLE", "caCertificates": "/etc/zipkin/ca.pem", "sni": "zipkin-custom-sni"});
        let text = transport_socket(&tls, "tracer", &TlsMetadata::default(), false);
        let v: Value = serde_json::from_str(&text).unwrap();
        let ctx = &v["typed_config"];
        assert_eq!(ctx["sni"], "zipkin-custom-sni");
        assert_eq!(
            ctx["common_tls_context"]["combined_validation_context"]["validation_context_sds_secret_config"]
                ["name"],
            "file-root:/etc/zipkin/ca.pem"
        );
        assert!(ctx["common_tls_context"].get("alpn_protocols").is_none(), "no ALPN for a non-HTTP/2 tracer");
        assert!(
            text.starts_with(r#"{"name":"envoy.transport_sockets.tls","typed_config":{"@type":"#),
            "{text}"
        );
    }

    #[test]
    fn istio_mutual_uses_the_workload_certificate_and_a_default_sni() {
        let text = transport_socket(
            &json!({"mode": "ISTIO_MUTUAL"}),
            "envoy_metrics_service",
            &TlsMetadata::default(),
            true,
        );
        let v: Value = serde_json::from_str(&text).unwrap();
        let common = &v["typed_config"]["common_tls_context"];
        assert_eq!(common["tls_certificate_sds_secret_configs"][0]["name"], "default");
        assert_eq!(
            common["tls_certificate_sds_secret_configs"][0]["sds_config"]["initial_fetch_timeout"],
            "0s"
        );
        assert_eq!(common["alpn_protocols"], json!(["istio", "h2"]));
        assert_eq!(v["typed_config"]["sni"], "envoy_metrics_service");
        assert_eq!(transport_socket(&json!({"mode": "DISABLE"}), "x", &TlsMetadata::default(), true), "");
    }

    #[test]
    fn keepalives_carry_istios_wrapper_objects() {
        assert_eq!(keepalive(&json!({"time": "1s"})), r#"{"tcp_keepalive":{"keepalive_time":{"value":1}}}"#);
        assert_eq!(keepalive(&json!({})), r#"{"tcp_keepalive":{}}"#);
    }
}
