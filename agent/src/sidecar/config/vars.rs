//! Every environment variable the agent (`proxy sidecar|router`) reads: its name, its
//! default, what it sets and where pilot-agent reads it. This table is the only way
//! the configuration reads the environment — each entry parses its own value and
//! names itself when the value is wrong — and it is what `weir config env` prints and
//! `docs/env.md` holds (a test keeps the file equal to [`markdown`]).

use std::time::Duration;

use serde::Serialize;

use super::{ConfigError, env::Env};

/// How a variable's value is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Text,
    Bool,
    /// Go's `time.ParseDuration` forms (`5s`, `100ms`, `1m30s`).
    Duration,
    /// A whole number.
    Count,
    /// A number between 0 and 1.
    Ratio,
}

/// One variable.
#[derive(Debug, Serialize)]
pub struct Var {
    pub name: &'static str,
    pub kind: Kind,
    /// The value used when the variable is unset or empty ("" for none, or a
    /// description in angle brackets when it is computed).
    pub default: &'static str,
    /// What it sets.
    pub sets: &'static str,
    /// Where pilot-agent reads it (istio/istio path), or `Weir` for Weir's own.
    pub istio: &'static str,
}

/// A family of variables sharing a prefix (`XDS_HEADER_<name>`).
#[derive(Debug, Serialize)]
pub struct Family {
    pub prefix: &'static str,
    pub sets: &'static str,
    pub istio: &'static str,
}

fn invalid(var: &Var, value: String, expected: &'static str) -> ConfigError {
    ConfigError::Env { name: var.name.into(), value, expected }
}

impl Var {
    /// The value when set and not empty.
    pub fn value(&self, env: &dyn Env) -> Option<String> {
        env.var(self.name).filter(|v| !v.is_empty())
    }

    /// The value, else the default.
    pub fn text(&self, env: &dyn Env) -> String {
        self.value(env).unwrap_or_else(|| self.default.to_string())
    }

    /// The value or default, read by `parse`; a value it refuses is named.
    fn parsed<T>(
        &self,
        env: &dyn Env,
        expected: &'static str,
        parse: impl Fn(&str) -> Option<T>,
    ) -> Result<T, ConfigError> {
        match self.value(env) {
            Some(value) => parse(&value).ok_or_else(|| invalid(self, value, expected)),
            // A computed default (`<...>`) is the caller's: it reads `value()` first.
            None => Ok(parse(self.default)
                .unwrap_or_else(|| panic!("{}: a computed default is read with value() first", self.name))),
        }
    }

    pub fn bool(&self, env: &dyn Env) -> Result<bool, ConfigError> {
        debug_assert_eq!(self.kind, Kind::Bool, "{}", self.name);
        self.parsed(env, "a boolean (true/false/1/0)", super::env::parse_bool)
    }

    pub fn duration(&self, env: &dyn Env) -> Result<Duration, ConfigError> {
        debug_assert_eq!(self.kind, Kind::Duration, "{}", self.name);
        self.parsed(env, "a duration such as 5s, 100ms or 1m30s", super::env::parse_duration)
    }

    pub fn count(&self, env: &dyn Env) -> Result<u32, ConfigError> {
        debug_assert_eq!(self.kind, Kind::Count, "{}", self.name);
        self.parsed(env, "a whole number", |v| v.parse().ok())
    }

    pub fn ratio(&self, env: &dyn Env) -> Result<f64, ConfigError> {
        debug_assert_eq!(self.kind, Kind::Ratio, "{}", self.name);
        self.parsed(env, "a number between 0 and 1", |v| v.parse().ok().filter(|f| (0.0..=1.0).contains(f)))
    }

    /// An error naming this variable and its value.
    pub fn invalid(&self, value: String, expected: &'static str) -> ConfigError {
        invalid(self, value, expected)
    }
}

impl Family {
    /// `(suffix, value)` for every variable of the family.
    pub fn members(&self, env: &dyn Env) -> Vec<(String, String)> {
        env.vars()
            .into_iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(self.prefix)?.to_string(), v)))
            .collect()
    }
}

macro_rules! vars {
    ($($id:ident: $kind:ident, $default:literal, $sets:literal, $istio:literal;)*) => {
        $(#[allow(non_upper_case_globals, reason = "Go's lower-case proxy variables")]
        pub const $id: Var = Var {
            name: stringify!($id),
            kind: Kind::$kind,
            default: $default,
            sets: $sets,
            istio: $istio,
        };)*
        /// Every variable, in the table's order.
        pub const ALL: &[&Var] = &[$(&$id),*];
    };
}

vars! {
    // The pod (downward API in the injector's template).
    POD_NAME: Text, "", "the pod's name: node id, metadata NAME", "pilot/cmd/pilot-agent/options/options.go";
    POD_NAMESPACE: Text, "", "the pod's namespace: node id, identity, DNS domain", "pilot/cmd/pilot-agent/options/options.go";
    INSTANCE_IP: Text, "", "the pod IP: node id, INSTANCE_IPS, probe destination", "pilot/cmd/pilot-agent/options/options.go";
    HOST_IP: Text, "", "the node's IP, for $(HOST_IP) in ISTIO_BOOTSTRAP_OVERRIDE", "pkg/envoy/proxy.go";
    SERVICE_ACCOUNT: Text, "", "the workload's service account: its SPIFFE identity", "pilot/cmd/pilot-agent/options/options.go";
    ISTIO_META_CLUSTER_ID: Text, "", "ClusterID sent to istiod and its CA (also metadata CLUSTER_ID)", "pilot/cmd/pilot-agent/options/options.go";
    PROXY_CONFIG: Text, "", "ProxyConfig (YAML or JSON) over the mesh config's defaultConfig", "pilot/cmd/pilot-agent/options/options.go";
    // istiod and its CA.
    ISTIOD_SAN: Text, "", "the SAN checked on istiod's certificate (default: the discovery host)", "pilot/cmd/pilot-agent/options/options.go";
    XDS_ROOT_CA: Text, "<FindRootCAForXDS>", "roots for istiod's TLS (a file, or SYSTEM)", "pilot/cmd/pilot-agent/options/options.go";
    CA_ROOT_CA: Text, "<FindRootCAForCA>", "roots for the CA's TLS (a file, or SYSTEM)", "pilot/cmd/pilot-agent/options/options.go";
    PILOT_CERT_PROVIDER: Text, "istiod", "who signed istiod's certificate (custom: ./etc/certs; none: no default root)", "pilot/pkg/features/pilot.go";
    PROV_CERT: Text, "", "a directory of provisioned certificates (VMs): client certificate and root for istiod", "pilot/cmd/pilot-agent/options/options.go";
    FILE_MOUNTED_CERTS: Bool, "false", "workload certificates are mounted in ./etc/certs; no CA client", "pilot/cmd/pilot-agent/options/options.go";
    CA_ADDR: Text, "<discovery address>", "the CA's address", "pilot/cmd/pilot-agent/options/options.go";
    CA_PROVIDER: Text, "Citadel", "the CA protocol (only Citadel: istiod's CreateCertificate)", "pilot/cmd/pilot-agent/options/options.go";
    ISTIO_META_CERT_SIGNER: Text, "", "CertSigner metadata on CSRs (istiod's external signers)", "pilot/cmd/pilot-agent/options/options.go";
    ISTIO_DELTA_XDS: Bool, "true", "Envoy's ADS: Delta, else state of the world", "pilot/pkg/features/experimental.go";
    // The workload certificate.
    TRUST_DOMAIN: Text, "cluster.local", "the SPIFFE trust domain (else --trust-domain)", "pilot/cmd/pilot-agent/options/options.go";
    ECC_SIGNATURE_ALGORITHM: Text, "", "ECDSA for P-256 keys; unset for RSA", "pilot/cmd/pilot-agent/options/options.go";
    ECC_CURVE: Text, "P256", "the ECDSA curve (P256)", "pilot/cmd/pilot-agent/options/options.go";
    WORKLOAD_RSA_KEY_SIZE: Count, "2048", "the RSA key size", "pilot/cmd/pilot-agent/options/options.go";
    PKCS8_KEY: Bool, "false", "write the key as PKCS#8", "pilot/cmd/pilot-agent/options/options.go";
    SECRET_TTL: Duration, "24h", "the validity asked of the CA", "pilot/cmd/pilot-agent/options/options.go";
    SECRET_GRACE_PERIOD_RATIO: Ratio, "0.5", "rotate when this much of the lifetime is left", "pilot/cmd/pilot-agent/options/options.go";
    SECRET_GRACE_PERIOD_RATIO_JITTER: Ratio, "0.01", "jitter on the grace ratio", "pilot/cmd/pilot-agent/options/options.go";
    WORKLOAD_IDENTITY_SOCKET_FILE: Text, "socket", "the SDS socket's name in ./var/run/secrets/workload-spiffe-uds", "pilot/cmd/pilot-agent/options/options.go";
    OUTPUT_CERTS: Text, "", "a directory the key, chain and root are written to after each issuance", "pilot/cmd/pilot-agent/options/options.go";
    FILE_DEBOUNCE_DURATION: Duration, "100ms", "settle time before a changed mounted certificate is read", "pilot/cmd/pilot-agent/options/options.go";
    // Envoy.
    DISABLE_ENVOY: Bool, "false", "no Envoy and no SDS server (proxyless gRPC)", "pilot/cmd/pilot-agent/options/options.go";
    WEIR_ENVOY_MODE: Text, "launch", "launch: the agent runs Envoy; external: somebody else does", "Weir";
    WEIR_RESTART_ENVOY: Bool, "false", "restart an Envoy that exits (VMs), instead of exiting", "Weir";
    EXIT_ON_ZERO_ACTIVE_CONNECTIONS: Bool, "false", "drain until no connection is left, not for terminationDrainDuration", "pilot/cmd/pilot-agent/options/options.go";
    MINIMUM_DRAIN_DURATION: Duration, "5s", "the least drain with EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "pilot/cmd/pilot-agent/options/options.go";
    ISTIO_BOOTSTRAP_OVERRIDE: Text, "", "a file Envoy merges over the bootstrap (--config-yaml)", "pkg/envoy/proxy.go";
    ISTIO_META_INTERCEPTION_MODE: Text, "REDIRECT", "TPROXY keeps CAP_NET_ADMIN for Envoy", "pkg/kube/inject/inject.go";
    GRPC_XDS_BOOTSTRAP: Text, "<configPath>/grpc-bootstrap.json", "where proxyless gRPC applications find their bootstrap", "pilot/cmd/pilot-agent/options/options.go";
    ENVOY_STATUS_PORT: Count, "15021", "Envoy's readiness listener (node metadata ENVOY_STATUS_PORT)", "pilot/cmd/pilot-agent/options/options.go";
    ENVOY_PROMETHEUS_PORT: Count, "15090", "Envoy's Prometheus listener, read by the merged /stats/prometheus (and node metadata)", "pilot/cmd/pilot-agent/options/options.go";
    ENVOY_SECURE_METRICS_PORT: Count, "0", "a TLS listener for Envoy's stats (0: none)", "pilot/cmd/pilot-agent/options/options.go";
    ENVOY_SECURE_MERGED_METRICS_PORT: Count, "0", "a TLS listener for the merged stats (0: none)", "pilot/cmd/pilot-agent/options/options.go";
    ENVOY_STATUS_PORT_ENABLE_PROXY_PROTOCOL: Bool, "false", "PROXY protocol on the readiness listener", "pilot/pkg/features/experimental.go";
    ENVOY_SKIP_DEPRECATED_LOGS: Bool, "true", "Envoy's --skip-deprecated-logs (and metadata)", "pilot/cmd/pilot-agent/options/options.go";
    PEER_METADATA_DISCOVERY: Bool, "<ENABLE_HBONE>", "the metadata_discovery bootstrap extension", "pilot/cmd/pilot-agent/options/options.go";
    ISTIO_CPU_LIMIT: Count, "0", "the container's CPU limit: Envoy's concurrency when ProxyConfig has none", "pilot/cmd/pilot-agent/config/config.go";
    ISTIO_DUAL_STACK: Bool, "false", "dual-stack listeners and DNS lookup family ALL", "pilot/pkg/features/experimental.go";
    COMPLIANCE_POLICY: Text, "", "fips-140-2 or fips-140-3 restrict the agent's TLS and Envoy's google_grpc ciphers; pqc is refused", "pkg/features/security.go";
    HTTP_STRIP_FRAGMENT_FROM_PATH_UNSAFE_IF_DISABLED: Bool, "true", "false keeps URL fragments (Envoy runtime flag)", "pkg/bootstrap/config.go";
    ISTIO_BOOTSTRAP: Text, "", "the bootstrap template to render, over every other choice", "pkg/bootstrap/instance.go";
    // DNS.
    ISTIO_META_DNS_CAPTURE: Bool, "false", "the DNS proxy on 15053 (sidecars)", "pilot/cmd/pilot-agent/options/options.go";
    ISTIO_META_ENABLE_DNS_SERVER: Bool, "false", "the DNS proxy, for any proxy type", "pilot/cmd/pilot-agent/options/options.go";
    DNS_PROXY_ADDR: Text, "localhost:15053", "the DNS proxy's address", "pilot/cmd/pilot-agent/options/options.go";
    DNS_FORWARD_PARALLEL: Bool, "false", "ask every upstream server at once", "pilot/cmd/pilot-agent/options/options.go";
    DNS_FORWARD_TIMEOUT: Duration, "5s", "how long an upstream server is waited on", "pilot/cmd/pilot-agent/options/options.go";
    // The status server.
    ISTIO_KUBE_APP_PROBERS: Text, "", "the app probes rewritten to the status port (JSON)", "pilot/cmd/pilot-agent/status/server.go";
    ISTIO_PROMETHEUS_ANNOTATIONS: Text, "", "the app's metrics merged into /stats/prometheus (JSON)", "pilot/cmd/pilot-agent/status/server.go";
    REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION: Bool, "false", "probes go to localhost, not the pod IP", "pilot/cmd/pilot-agent/status/server.go";
    PILOT_AGENT_MERGE_ENVOY_STATS: Bool, "true", "Envoy's metrics merged into /stats/prometheus", "pilot/pkg/features/telemetry.go";
    // Wasm.
    WEIR_WASM_CACHE_DIR: Text, "/var/lib/istio/data", "where remote Wasm modules are kept", "Weir";
    WASM_MODULE_EXPIRY: Duration, "24h", "how long a module fetched without a checksum is reused", "pilot/cmd/pilot-agent/options/options.go";
    WASM_PURGE_INTERVAL: Duration, "1h", "how often unused modules are removed", "pilot/cmd/pilot-agent/options/options.go";
    WASM_INSECURE_REGISTRIES: Text, "", "registries pulled over plain HTTP (comma-separated)", "pilot/cmd/pilot-agent/options/options.go";
    WASM_HTTP_REQUEST_TIMEOUT: Duration, "15s", "one module download's timeout", "pilot/cmd/pilot-agent/options/options.go";
    WASM_HTTP_REQUEST_MAX_RETRIES: Count, "5", "retries of a failed download", "pilot/cmd/pilot-agent/options/options.go";
    HTTPS_PROXY: Text, "", "the proxy for https Wasm modules and registries (CONNECT)", "Go's net/http (httpproxy.FromEnvironment)";
    https_proxy: Text, "", "HTTPS_PROXY when that is unset", "Go's net/http (httpproxy.FromEnvironment)";
    HTTP_PROXY: Text, "", "the proxy for plain-HTTP Wasm modules and registries", "Go's net/http (httpproxy.FromEnvironment)";
    http_proxy: Text, "", "HTTP_PROXY when that is unset", "Go's net/http (httpproxy.FromEnvironment)";
    NO_PROXY: Text, "", "hosts, domains, IPs and CIDRs reached directly, not through the proxy (loopback always is)", "Go's net/http (httpproxy.FromEnvironment)";
    no_proxy: Text, "", "NO_PROXY when that is unset", "Go's net/http (httpproxy.FromEnvironment)";
    // STS and standalone mode.
    GKE_CLUSTER_URL: Text, "", "the identity provider in the STS token exchange's audience", "security/pkg/stsservice/tokenmanager/google";
    WEIR_STS_TOKEN_ENDPOINT: Text, "https://sts.googleapis.com/v1/token", "where the STS token manager exchanges tokens", "Weir";
    WEIR_MESH_SERVICES: Text, "./etc/weir/mesh.yaml", "standalone mode's services file (else --mesh-services)", "Weir";
    WEIR_STATE_DIR: Text, "./var/lib/weir", "standalone mode's CA and state (else --state-dir)", "Weir";
}

/// Families of variables.
pub const XDS_HEADER: Family = Family {
    prefix: "XDS_HEADER_",
    sets: "gRPC metadata on the xDS stream to istiod",
    istio: "pilot/cmd/pilot-agent/options/agent.go",
};
pub const CA_HEADER: Family = Family {
    prefix: "CA_HEADER_",
    sets: "gRPC metadata on CSRs",
    istio: "pilot/cmd/pilot-agent/options/security.go",
};
pub const ISTIO_METAJSON: Family = Family {
    prefix: "ISTIO_METAJSON_",
    sets: "node metadata, the value parsed as JSON",
    istio: "pkg/bootstrap/config.go",
};
pub const ISTIO_META: Family = Family {
    prefix: "ISTIO_META_",
    sets: "node metadata, the value as a string",
    istio: "pkg/bootstrap/config.go",
};
pub const FAMILIES: &[&Family] = &[&XDS_HEADER, &CA_HEADER, &ISTIO_METAJSON, &ISTIO_META];

/// The table as Markdown (`docs/env.md`, `weir config env`).
pub fn markdown() -> String {
    let mut out = String::from(
        "# Environment variables the agent reads\n\n\
         Generated from `agent/src/sidecar/config/vars.rs` (`weir config env` prints the same table). \
         Flags win over these; ProxyConfig (`PROXY_CONFIG`, the mesh config, the \
         `proxy.istio.io/config` annotation) is read as Istio layers it.\n\n\
         | variable | kind | default | sets | pilot-agent reads it in |\n|---|---|---|---|---|\n",
    );
    let cell = |s: &str| if s.is_empty() { "–".to_string() } else { format!("`{s}`") };
    for v in ALL {
        let kind =
            serde_json::to_value(v.kind).ok().and_then(|k| k.as_str().map(String::from)).unwrap_or_default();
        out.push_str(&format!(
            "| `{}` | {kind} | {} | {} | {} |\n",
            v.name,
            cell(v.default),
            v.sets,
            v.istio
        ));
    }
    for f in FAMILIES {
        out.push_str(&format!("| `{}*` | family | – | {} | {} |\n", f.prefix, f.sets, f.istio));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sidecar::config::env::MapEnv;

    #[test]
    fn names_are_unique_and_defaults_parse() {
        let mut names: Vec<&str> = ALL.iter().map(|v| v.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ALL.len(), "a variable is listed twice");
        let empty = MapEnv::default();
        for v in ALL.iter().filter(|v| !v.default.starts_with('<')) {
            match v.kind {
                Kind::Text => drop(v.text(&empty)),
                Kind::Bool => drop(v.bool(&empty).unwrap()),
                Kind::Duration => drop(v.duration(&empty).unwrap()),
                Kind::Count => drop(v.count(&empty).unwrap()),
                Kind::Ratio => drop(v.ratio(&empty).unwrap()),
            }
            assert!(v.istio == "Weir" || v.istio.contains('/'), "{}: where Istio reads it", v.name);
        }
    }

    #[test]
    fn a_bad_value_names_the_variable() {
        let env = MapEnv::from([("DNS_FORWARD_TIMEOUT", "soon"), ("SECRET_GRACE_PERIOD_RATIO", "1.5")]);
        let e = DNS_FORWARD_TIMEOUT.duration(&env).unwrap_err().to_string();
        assert!(e.contains("DNS_FORWARD_TIMEOUT") && e.contains("soon"), "{e}");
        let e = SECRET_GRACE_PERIOD_RATIO.ratio(&env).unwrap_err().to_string();
        assert!(e.contains("between 0 and 1"), "{e}");
        assert_eq!(SECRET_TTL.duration(&env).unwrap(), Duration::from_secs(86400));
    }

    /// docs/env.md is the table, as generated.
    #[test]
    fn the_reference_in_docs_is_the_table() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/env.md");
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        if on_disk != markdown() {
            panic!(
                "{} is not the table in agent/src/sidecar/config/vars.rs: regenerate it with \
                 `weir config env > docs/env.md`",
                path.display()
            );
        }
    }

    /// The configuration reads the environment only through this table: no module
    /// under config/ names a variable by a string of its own.
    #[test]
    fn configuration_code_reads_the_environment_only_through_the_table() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/sidecar/config");
        let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
        files.push(dir.with_extension("rs"));
        for file in files.iter().filter(|f| f.extension().is_some_and(|e| e == "rs")) {
            let name = file.file_name().unwrap().to_string_lossy();
            if name == "vars.rs" || name == "env.rs" || name == "tests.rs" {
                continue;
            }
            let text = std::fs::read_to_string(file).unwrap();
            for needle in ["env.var(\"", ".var(\"", "std::env::var"] {
                assert!(!text.contains(needle), "{name} reads the environment around the table ({needle})");
            }
        }
    }
}
