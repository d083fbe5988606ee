//! Envoy's bootstrap as pilot-agent writes it: Istio's template data (`options.rs`,
//! every key pilot-agent computes, from the node, ProxyConfig, the pod's annotations
//! and the environment) rendered through a Go template — `ISTIO_BOOTSTRAP`, a
//! `--templateFile` or `proxyBootstrapTemplatePath`, else the template the image
//! ships at `./var/lib/istio/envoy/envoy_bootstrap_tmpl.json` — or, when there is
//! none, through Weir's built-in bootstrap (`builtin.rs`), which makes the same JSON
//! from the same data. The rendered text is written as is (`write`), atomically;
//! `override_json` reads `ISTIO_BOOTSTRAP_OVERRIDE` for Envoy's `--config-yaml`.

pub mod builtin;
pub mod options;
mod sockets;

use std::path::{Path, PathBuf};

use serde_json::Value;

pub use options::{BootstrapEnv, BootstrapInputs, TemplateData};

/// The image's template, where pilot-agent looks for it (relative to `/`).
pub const IMAGE_TEMPLATE: &str = "./var/lib/istio/envoy/envoy_bootstrap_tmpl.json";

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("bootstrap options")]
    Options(#[from] options::OptionsError),
    #[error("bootstrap template {path}")]
    Template {
        path: PathBuf,
        #[source]
        source: Box<crate::support::gotemplate::TemplateError>,
    },
    #[error("built-in bootstrap")]
    BuiltIn(#[from] builtin::BuiltinError),
    #[error("read {what} {path}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("ISTIO_BOOTSTRAP_OVERRIDE {path} is neither YAML nor JSON")]
    OverrideSyntax {
        path: PathBuf,
        #[source]
        source: serde_yaml_ng::Error,
    },
    #[error("write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Renders the bootstrap from `data`: through the Go template at `template`, or the
/// built-in bootstrap when there is none. The text is the file Envoy reads.
pub fn render(template: Option<&Path>, data: &TemplateData) -> Result<String, BootstrapError> {
    let values = Value::Object(data.values.clone());
    match template {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| BootstrapError::Read {
                what: "bootstrap template",
                path: path.into(),
                source,
            })?;
            let err = |source| BootstrapError::Template { path: path.into(), source: Box::new(source) };
            let functions = crate::support::gotemplate::Functions::default().with_istio();
            let template = crate::support::gotemplate::Template::parse_with("bootstrap", &text, functions)
                .map_err(err)?;
            template.render(&values).map_err(err)
        }
        None => {
            let doc = builtin::render(&data.values)?;
            Ok(serde_json::to_string_pretty(&doc).expect("a JSON value serializes"))
        }
    }
}

/// Writes `text` to `path` atomically (a temporary file renamed over it), readable by
/// the proxy user.
pub fn write(path: &Path, text: &str) -> Result<(), BootstrapError> {
    use std::os::unix::fs::PermissionsExt as _;
    let err = |source| BootstrapError::Write { path: path.into(), source };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// `ISTIO_BOOTSTRAP_OVERRIDE`: the file (YAML or JSON) as one line of JSON for
/// Envoy's `--config-yaml`, with `$(HOST_IP)` replaced as pilot-agent does.
pub fn override_json(path: &Path, host_ip: Option<&str>) -> Result<String, BootstrapError> {
    let text = std::fs::read_to_string(path).map_err(|source| BootstrapError::Read {
        what: "ISTIO_BOOTSTRAP_OVERRIDE",
        path: path.into(),
        source,
    })?;
    let host = host_ip.unwrap_or_default();
    let text = if host.contains(':') {
        text.replace("[$(HOST_IP)]", &format!("[{host}]")).replace("$(HOST_IP)", &format!("[{host}]"))
    } else {
        text.replace("$(HOST_IP)", host)
    };
    let value: Value = serde_yaml_ng::from_str(&text)
        .map_err(|source| BootstrapError::OverrideSyntax { path: path.into(), source })?;
    Ok(value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_is_rendered_as_go_renders_it_and_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        std::fs::write(&path, "{\"id\": \"{{ .nodeID }}\"{{ if .zipkin }}, \"z\": {{ .zipkin }}{{ end }}}\n")
            .unwrap();
        let mut data = TemplateData::default();
        data.values.insert("nodeID".into(), Value::String("sidecar~1~p.ns~ns".into()));
        assert_eq!(render(Some(&path), &data).unwrap(), "{\"id\": \"sidecar~1~p.ns~ns\"}\n");
        std::fs::write(&path, "{\n{{ if .zipkin }}\n").unwrap();
        let e = crate::error_chain(&render(Some(&path), &data).unwrap_err());
        assert!(e.contains("t.json") && e.contains(":2"), "{e}");
        let e = render(Some(&dir.path().join("missing.json")), &data).unwrap_err();
        assert!(matches!(e, BootstrapError::Read { .. }), "{e}");
    }

    #[test]
    fn overrides_become_json_with_the_host_ip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("override.yaml");
        std::fs::write(&path, "tracing:\n  address: \"$(HOST_IP):8126\"\n").unwrap();
        assert_eq!(
            override_json(&path, Some("10.0.0.7")).unwrap(),
            r#"{"tracing":{"address":"10.0.0.7:8126"}}"#
        );
        assert_eq!(
            override_json(&path, Some("fd00::7")).unwrap(),
            r#"{"tracing":{"address":"[fd00::7]:8126"}}"#
        );
        std::fs::write(&path, "a: [unclosed").unwrap();
        let e = override_json(&path, None).unwrap_err().to_string();
        assert!(e.contains("ISTIO_BOOTSTRAP_OVERRIDE") && e.contains("override.yaml"), "{e}");
        let e = override_json(&dir.path().join("missing"), None).unwrap_err();
        assert!(matches!(e, BootstrapError::Read { .. }));
    }
}
