//! `AgentConfig::resolve` end to end: each part as pilot-agent resolves it, from
//! flags, a map of env vars and a map of files.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use super::*;
use crate::{
    sidecar::envoy::DrainPolicy,
    sidecar::identity::{CertFiles, KeyAlgorithm, KeyOptions, RotationPolicy},
};

fn files(entries: &[(&str, &str)]) -> BTreeMap<PathBuf, String> {
    entries.iter().map(|(p, t)| (PathBuf::from(p), t.to_string())).collect()
}

fn resolve(args: &[&str], env: &[(&str, &str)], fs: &[(&str, &str)]) -> Result<AgentConfig, ConfigError> {
    let args = ProxyArgs::parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())?;
    let env = MapEnv(env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    AgentConfig::resolve(args, &env, &files(fs))
}

const ROOT: (&str, &str) = (paths::CA_ROOT_CERT, "-----BEGIN CERTIFICATE-----\n");

#[test]
fn a_kubernetes_sidecar() {
    let c = resolve(
        &["sidecar", "--domain", "app.svc.cluster.local"],
        &[
            ("POD_NAME", "echo-1"),
            ("POD_NAMESPACE", "app"),
            ("INSTANCE_IP", "10.1.2.3"),
            ("ISTIO_META_CLUSTER_ID", "Kubernetes"),
            ("ISTIO_META_DNS_CAPTURE", "true"),
            ("XDS_HEADER_X-Team", "payments"),
        ],
        &[ROOT],
    )
    .unwrap();
    assert_eq!(c.xds.uds_path, PathBuf::from("./etc/istio/proxy/XDS"));
    assert_eq!(c.xds.root_ca, Some(PathBuf::from(paths::CA_ROOT_CERT)));
    assert!(!c.xds.plaintext);
    assert_eq!(c.xds.headers.get("X-Team").unwrap(), "payments");
    assert!(c.dns.enabled);
    assert_eq!(c.dns.address, "localhost:15053");
    let up = c.xds.upstream(&c.pod.cluster_id);
    assert_eq!(up.server_name().unwrap(), "istiod.istio-system.svc");
    assert!(c.to_yaml().contains("discoveryAddress: istiod.istio-system.svc:15012"));
}

#[test]
fn root_ca_lookup_follows_pilot_agent() {
    let e = resolve(&[], &[], &[]).unwrap_err();
    assert!(matches!(e, ConfigError::XdsRootCa(_)), "{e}");
    assert!(e.to_string().contains("root-cert.pem"));
    let c = resolve(&[], &[("XDS_ROOT_CA", "SYSTEM"), ("CA_ROOT_CA", "SYSTEM")], &[]).unwrap();
    assert_eq!(c.xds.root_ca, None);
    let e = resolve(&[], &[("XDS_ROOT_CA", "SYSTEM")], &[]).unwrap_err();
    assert!(matches!(e, ConfigError::CaRootCa(_)), "the CA's root is looked up on its own: {e}");
    let c = resolve(&[], &[], &[ROOT, (paths::MOUNTED_ROOT_CERT, "x")]).unwrap();
    assert_eq!(c.xds.root_ca, Some(PathBuf::from(paths::MOUNTED_ROOT_CERT)));
    let e = resolve(&[], &[("PILOT_CERT_PROVIDER", "none")], &[]).unwrap_err();
    assert!(matches!(e, ConfigError::XdsRootCaRequired));
    let c = resolve(&[], &[("PROV_CERT", "/etc/prov")], &[]).unwrap();
    assert_eq!(c.xds.client_cert, Some(PathBuf::from("/etc/prov/cert-chain.pem")));
}

#[test]
fn plaintext_by_policy_or_port() {
    let c =
        resolve(&[], &[("PROXY_CONFIG", "discoveryAddress: istiod.istio-system.svc:15010")], &[]).unwrap();
    assert!(c.xds.plaintext);
    assert!(c.identity.ca.as_ref().unwrap().plaintext, "the CA on 15010 is plaintext too");
    let c = resolve(&[], &[("PROXY_CONFIG", "controlPlaneAuthPolicy: NONE"), ("CA_ROOT_CA", "SYSTEM")], &[])
        .unwrap();
    assert!(c.xds.plaintext);
}

#[test]
fn mesh_file_env_and_annotations_layer() {
    let c = resolve(
        &["--meshConfig", "/etc/mesh"],
        &[
            ("PROXY_CONFIG", "{\"drainDuration\": \"20s\"}"),
            ("XDS_ROOT_CA", "SYSTEM"),
            ("CA_ROOT_CA", "SYSTEM"),
        ],
        &[
            ("/etc/mesh", "defaultConfig:\n  discoveryAddress: istiod.mesh:15012\n  drainDuration: 30s\n"),
            (paths::POD_ANNOTATIONS, "sidecar.istio.io/discoveryAddress=\"istiod.pod:15012\"\n"),
        ],
    )
    .unwrap();
    assert_eq!(c.proxy_config.drain_duration, Duration::from_secs(20));
    assert_eq!(c.xds.discovery_address, "istiod.pod:15012");
}

#[test]
fn workload_certificates_follow_pilot_agent() {
    let env = [("POD_NAMESPACE", "app"), ("SERVICE_ACCOUNT", "echo"), ("ISTIO_META_CLUSTER_ID", "east")];
    let c = resolve(&[], &env, &[ROOT]).unwrap();
    let id = &c.identity;
    assert_eq!(id.identity.to_string(), "spiffe://cluster.local/ns/app/sa/echo");
    assert_eq!(id.keys, KeyOptions { algorithm: KeyAlgorithm::Rsa(2048), pkcs8: false });
    assert_eq!(id.secret_ttl, Duration::from_secs(86400));
    assert_eq!(id.rotation, RotationPolicy::default());
    assert_eq!(id.sds_socket, PathBuf::from("./var/run/secrets/workload-spiffe-uds/socket"));
    let ca = id.ca.as_ref().unwrap();
    assert_eq!(ca.address, "istiod.istio-system.svc:15012");
    assert_eq!(ca.root_ca, Some(PathBuf::from(paths::CA_ROOT_CERT)));
    assert!(c.to_yaml().contains("spiffe") || c.to_yaml().contains("serviceAccount: echo"));

    let mut env = env.to_vec();
    env.extend([
        ("TRUST_DOMAIN", "example.org"),
        ("ECC_SIGNATURE_ALGORITHM", "ECDSA"),
        ("PKCS8_KEY", "true"),
        ("CA_ADDR", "ca.example:443"),
        ("CA_ROOT_CA", "SYSTEM"),
        ("CA_HEADER_X-Tenant", "a"),
        ("SECRET_TTL", "1h"),
        ("SECRET_GRACE_PERIOD_RATIO", "0.25"),
        ("ISTIOD_SAN", "ignored.for.ca"),
        ("OUTPUT_CERTS", "/out"),
    ]);
    let c = resolve(&[], &env, &[ROOT]).unwrap();
    let id = &c.identity;
    assert_eq!(id.identity.trust_domain, "example.org");
    assert_eq!(id.keys, KeyOptions { algorithm: KeyAlgorithm::EcdsaP256, pkcs8: true });
    assert_eq!(id.secret_ttl, Duration::from_secs(3600));
    assert_eq!(id.rotation.grace_ratio, 0.25);
    let ca = id.ca.as_ref().unwrap();
    assert_eq!((ca.address.as_str(), ca.root_ca.as_ref(), ca.san.as_ref()), ("ca.example:443", None, None));
    assert_eq!(ca.headers.get("X-Tenant").unwrap(), "a");
    assert_eq!(id.output_dir, Some(PathBuf::from("/out")));

    // Mounted SPIFFE credentials: no CA client, and no CA root needed.
    let spiffe = CertFiles::in_dir(Path::new(paths::WORKLOAD_CREDENTIALS));
    let fs = [
        (spiffe.cert_chain.to_str().unwrap(), "x"),
        (spiffe.key.to_str().unwrap(), "x"),
        (spiffe.root.to_str().unwrap(), "x"),
    ];
    let c = resolve(&[], &[("XDS_ROOT_CA", "SYSTEM")], &fs).unwrap();
    assert!(c.identity.ca.is_none());
    assert_eq!(c.identity.mounted, Some(spiffe.clone()));
    // ./etc/certs is not "mounted" when the agent writes its own certificates there.
    let etc = CertFiles::in_dir(Path::new(paths::ETC_CERTS));
    let fs = [
        (etc.cert_chain.to_str().unwrap(), "x"),
        (etc.key.to_str().unwrap(), "x"),
        (etc.root.to_str().unwrap(), "x"),
        ROOT,
    ];
    assert_eq!(resolve(&[], &[], &fs).unwrap().identity.mounted, Some(etc.clone()));
    assert_eq!(resolve(&[], &[("OUTPUT_CERTS", "./etc/certs")], &fs).unwrap().identity.mounted, None);
}

#[test]
fn envoy_and_node_settings_follow_pilot_agent() {
    let c = resolve(
        &["sidecar", "--serviceCluster", "ignored.default", "--proxyLogLevel=info,upstream:debug", "--concurrency", "2"],
        &[
            ("XDS_ROOT_CA", "SYSTEM"),
            ("CA_ROOT_CA", "SYSTEM"),
            ("POD_NAME", "echo-1"),
            ("POD_NAMESPACE", "app"),
            ("INSTANCE_IP", "fd00::5"),
            ("ISTIO_META_WORKLOAD_NAME", "echo"),
            ("ISTIO_METAJSON_LABELS", r#"{"app":"echo"}"#),
            ("PROXY_CONFIG", r#"{"proxyMetadata": {"ISTIO_META_FROM_PROXY_CONFIG": "yes"}, "terminationDrainDuration": "7s"}"#),
        ],
        &[],
    )
    .unwrap();
    assert_eq!(c.node.id, "sidecar~fd00::5~echo-1.app~app.svc.cluster.local");
    assert_eq!(c.node.cluster, "echo.app", "WORKLOAD_NAME.namespace; the flag is ignored as in Istio");
    assert_eq!(c.identity.identity.trust_domain, "cluster.local");
    assert_eq!(c.node.metadata["LABELS"]["app"], "echo");
    assert_eq!(c.node.metadata["FROM_PROXY_CONFIG"], "yes");
    assert_eq!(c.node.metadata["NAMESPACE"], "app");
    assert!(c.node.delta_xds);
    assert_eq!(c.envoy.bootstrap, PathBuf::from("./etc/istio/proxy/envoy-rev.json"));
    assert_eq!(
        (c.envoy.log_level.as_str(), c.envoy.component_log_level.as_str()),
        ("info", "upstream:debug")
    );
    assert_eq!(c.envoy.concurrency, Some(2));
    // No interface address found: pilot-agent adds 127.0.0.1 and ::1, so not IPv6-only.
    assert_eq!(c.node.ips, ["fd00::5", "127.0.0.1", "::1"]);
    assert_eq!(c.envoy.local_address_ip_version, "v4");
    assert_eq!(c.envoy.drain, DrainPolicy::Fixed { wait: Duration::from_secs(7) });
    assert!(c.envoy.capabilities.is_empty());
    assert_eq!(c.status.probe_destination, "fd00::5".parse::<std::net::IpAddr>().unwrap());

    let c = resolve(
        &[],
        &[
            ("XDS_ROOT_CA", "SYSTEM"),
            ("CA_ROOT_CA", "SYSTEM"),
            ("POD_NAMESPACE", "app"),
            ("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true"),
            ("ISTIO_META_INTERCEPTION_MODE", "TPROXY"),
            ("ISTIO_DELTA_XDS", "false"),
            ("REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION", "true"),
            ("INSTANCE_IP", "10.0.0.9"),
        ],
        &[(paths::POD_LABELS, "app=\"reviews\"\nversion=\"v1\"\n")],
    )
    .unwrap();
    assert_eq!(c.node.cluster, "reviews.app", "the app label wins");
    let td = resolve(
        &["--trust-domain=corp.example"],
        &[("XDS_ROOT_CA", "SYSTEM"), ("CA_ROOT_CA", "SYSTEM")],
        &[],
    )
    .unwrap();
    assert_eq!(
        td.identity.identity.trust_domain, "corp.example",
        "Istio 1.7's flag, when TRUST_DOMAIN is unset"
    );
    assert!(!c.node.delta_xds);
    assert_eq!(c.envoy.drain, DrainPolicy::UntilIdle { minimum: Duration::from_secs(5) });
    assert_eq!(c.envoy.capabilities, &[crate::support::privileges::Capability::NetAdmin]);
    assert_eq!(c.status.probe_destination, std::net::IpAddr::from([127, 0, 0, 1]));
    let yaml = c.to_yaml();
    assert!(yaml.contains("CAP_NET_ADMIN") && yaml.contains("mode: untilIdle"), "{yaml}");
}

#[test]
fn bad_input_is_named() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("ISTIO_META_DNS_CAPTURE", "yes")], "ISTIO_META_DNS_CAPTURE"),
        (&[("DNS_FORWARD_TIMEOUT", "5")], "DNS_FORWARD_TIMEOUT"),
        (&[("INSTANCE_IP", "10.1.2")], "INSTANCE_IP"),
        (&[("PROXY_CONFIG", "discoveryAddress: istiod")], "istiod"),
        (&[("PROXY_CONFIG", "nope: 1")], "PROXY_CONFIG"),
        (&[("XDS_HEADER_bad name", "x")], "bad name"),
        (&[("CA_HEADER_bad name", "x")], "bad name"),
        (&[("ECC_SIGNATURE_ALGORITHM", "ED25519")], "ECC_SIGNATURE_ALGORITHM"),
        (&[("ECC_SIGNATURE_ALGORITHM", "ECDSA"), ("ECC_CURVE", "P384")], "ECC_CURVE"),
        (&[("WORKLOAD_RSA_KEY_SIZE", "1024")], "1024"),
        (&[("WORKLOAD_RSA_KEY_SIZE", "big")], "WORKLOAD_RSA_KEY_SIZE"),
        (&[("SECRET_GRACE_PERIOD_RATIO", "1.5")], "SECRET_GRACE_PERIOD_RATIO"),
        (&[("SECRET_TTL", "24")], "SECRET_TTL"),
        (&[("CA_PROVIDER", "GoogleCA")], "CA_PROVIDER"),
        (&[("WORKLOAD_IDENTITY_SOCKET_FILE", "../x")], "WORKLOAD_IDENTITY_SOCKET_FILE"),
        (&[("ISTIO_KUBE_APP_PROBERS", r#"{"/x":{}}"#)], "ISTIO_KUBE_APP_PROBERS: \"/x\""),
        (
            &[("ISTIO_PROMETHEUS_ANNOTATIONS", r#"{"port":"15090"}"#)],
            "ISTIO_PROMETHEUS_ANNOTATIONS: target port 15090",
        ),
        (&[("ISTIO_META_ENABLE_HBONE", "yes")], "node metadata ENABLE_HBONE"),
        (&[("ISTIO_METAJSON_X", r#"{"ENVOY_STATUS_PORT": "15021"}"#)], "ENVOY_STATUS_PORT"),
        (&[("ENVOY_STATUS_PORT", "ready")], "ENVOY_STATUS_PORT"),
        (&[("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "maybe")], "EXIT_ON_ZERO_ACTIVE_CONNECTIONS"),
        (
            &[("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true"), ("MINIMUM_DRAIN_DURATION", "5")],
            "MINIMUM_DRAIN_DURATION",
        ),
        (&[("WEIR_RESTART_ENVOY", "y")], "WEIR_RESTART_ENVOY"),
        (&[("ISTIO_DELTA_XDS", "no")], "ISTIO_DELTA_XDS"),
    ];
    for (env, needle) in cases {
        let mut env = env.to_vec();
        env.push(("XDS_ROOT_CA", "SYSTEM"));
        env.push(("CA_ROOT_CA", "SYSTEM"));
        let e = resolve(&[], &env, &[]).unwrap_err();
        let text = crate::error_chain(&e);
        assert!(text.contains(needle), "{needle}: {text}");
    }
}
#[test]
fn who_runs_envoy() {
    let mode = |env: &[(&str, &str)]| resolve(&[], env, &[ROOT]).map(|c| c.envoy_mode);
    assert_eq!(mode(&[]).unwrap(), EnvoyMode::Launch);
    assert_eq!(mode(&[("DISABLE_ENVOY", "true")]).unwrap(), EnvoyMode::Disabled);
    assert_eq!(mode(&[("WEIR_ENVOY_MODE", "external")]).unwrap(), EnvoyMode::External);
    // DISABLE_ENVOY wins: with no Envoy at all, nobody reads SDS.
    let both = [("DISABLE_ENVOY", "1"), ("WEIR_ENVOY_MODE", "external")];
    assert_eq!(mode(&both).unwrap(), EnvoyMode::Disabled);
    assert!(!EnvoyMode::Disabled.serves_sds() && EnvoyMode::External.serves_sds());
    assert!(EnvoyMode::Launch.launches() && !EnvoyMode::External.launches());
    let err = mode(&[("WEIR_ENVOY_MODE", "systemd")]).unwrap_err().to_string();
    assert!(err.contains("WEIR_ENVOY_MODE") && err.contains("launch or external"), "{err}");
    assert!(mode(&[("DISABLE_ENVOY", "maybe")]).unwrap_err().to_string().contains("DISABLE_ENVOY"));
}
#[test]
fn wasm_settings_read_pilot_agents_variables() {
    let c = resolve(&[], &[], &[ROOT]).unwrap();
    assert_eq!(c.wasm, crate::sidecar::wasm::CacheOptions::default());
    let env = [
        ("WASM_MODULE_EXPIRY", "2h"),
        ("WASM_PURGE_INTERVAL", "10m"),
        ("WASM_INSECURE_REGISTRIES", "localhost:5000, registry.local"),
        ("WASM_HTTP_REQUEST_TIMEOUT", "3s"),
        ("WASM_HTTP_REQUEST_MAX_RETRIES", "2"),
    ];
    let w = resolve(&[], &env, &[ROOT]).unwrap().wasm;
    assert_eq!(w.module_expiry, Duration::from_secs(7200));
    assert_eq!(w.purge_interval, Duration::from_secs(600));
    assert_eq!(w.insecure_registries, ["localhost:5000", "registry.local"]);
    assert_eq!((w.http_timeout, w.max_retries), (Duration::from_secs(3), 2));
    let err = resolve(&[], &[("WASM_HTTP_REQUEST_MAX_RETRIES", "many")], &[ROOT]).unwrap_err().to_string();
    assert!(err.contains("WASM_HTTP_REQUEST_MAX_RETRIES"), "{err}");
}

#[test]
fn wasm_fetches_take_their_proxies_from_the_environment_as_go_does() {
    let proxies = |env: &[(&str, &str)]| resolve(&[], env, &[ROOT]).map(|c| c.wasm.proxy);
    assert_eq!(proxies(&[]).unwrap(), crate::sidecar::wasm::ProxySettings::default());
    let p = proxies(&[
        ("HTTPS_PROXY", "http://proxy.corp:3128"),
        ("https_proxy", "http://ignored:1"),
        ("http_proxy", "http://plain.corp:8080"),
        ("no_proxy", ".svc,10.0.0.0/8"),
    ])
    .unwrap();
    assert_eq!(p.https.as_deref(), Some("http://proxy.corp:3128"), "the upper-case name wins");
    assert_eq!(p.http.as_deref(), Some("http://plain.corp:8080"), "the lower-case name when alone");
    assert_eq!(p.no_proxy, ".svc,10.0.0.0/8");
    let err = proxies(&[("https_proxy", "http://[::1")]).unwrap_err().to_string();
    assert!(err.contains("https_proxy") && err.contains("proxy URL"), "{err}");
}

#[test]
fn the_tables_defaults_are_the_components_own() {
    let none = MapEnv::default();
    assert_eq!(vars::DNS_PROXY_ADDR.text(&none), crate::sidecar::dns::server::DEFAULT_ADDRESS);
    assert_eq!(
        vars::DNS_FORWARD_TIMEOUT.duration(&none).unwrap(),
        crate::sidecar::dns::server::UPSTREAM_TIMEOUT
    );
    assert_eq!(vars::WEIR_STS_TOKEN_ENDPOINT.text(&none), crate::sidecar::sts::DEFAULT_ENDPOINT);
    assert_eq!(
        vars::WEIR_WASM_CACHE_DIR.text(&none),
        crate::sidecar::wasm::CacheOptions::default().dir.to_string_lossy()
    );
}

#[test]
fn an_ipv6_only_pod_gets_an_ipv6_envoy_and_its_interfaces_follow_the_pod_ip() {
    let host = HostFacts {
        interface_ips: vec![
            ("eth0".into(), "fd00::5".parse().unwrap()),
            ("eth1".into(), "fd00::6".parse().unwrap()),
            ("net1".into(), "fd00::7".parse().unwrap()),
        ],
        ..HostFacts::default()
    };
    let args = ProxyArgs::parse(&[]).unwrap();
    let env = MapEnv::from([("XDS_ROOT_CA", "SYSTEM"), ("CA_ROOT_CA", "SYSTEM"), ("INSTANCE_IP", "fd00::5")]);
    let fs = files(&[(paths::POD_ANNOTATIONS, "traffic.sidecar.istio.io/excludeInterfaces=\"net1\"\n")]);
    let c = AgentConfig::resolve_on(args, &env, &fs, host).unwrap();
    assert_eq!(c.node.ips, ["fd00::5", "fd00::6"], "the pod IP first, once; excluded interfaces left out");
    assert_eq!(c.envoy.local_address_ip_version, "v6");
    assert_eq!(c.node.metadata["INSTANCE_IPS"], "fd00::5,fd00::6");
}

#[test]
fn header_values_are_never_printed() {
    let c = resolve(
        &["sidecar"],
        &[
            ("XDS_HEADER_Authorization", "Bearer xds-secret-token"),
            ("CA_HEADER_X-Api-Key", "ca-secret-key"),
            ("POD_NAMESPACE", "app"),
        ],
        &[ROOT],
    )
    .unwrap();
    assert_eq!(c.xds.headers.get("Authorization").unwrap(), "Bearer xds-secret-token", "still sent");
    let ca = c.identity.ca.as_ref().unwrap();
    assert_eq!(ca.headers.get("X-Api-Key").unwrap(), "ca-secret-key", "still sent");
    for shown in [c.to_yaml(), format!("{c:?}")] {
        assert!(shown.contains("Authorization") && shown.contains("X-Api-Key"), "names kept: {shown}");
        assert!(!shown.contains("xds-secret-token") && !shown.contains("ca-secret-key"), "{shown}");
    }
}

#[test]
fn merging_envoy_stats_can_be_turned_off_as_in_istio_1_31() {
    let c = resolve(&["sidecar"], &[], &[ROOT]).unwrap();
    assert!(c.status.merge_envoy_stats);
    let c = resolve(&["sidecar"], &[("PILOT_AGENT_MERGE_ENVOY_STATS", "false")], &[ROOT]).unwrap();
    assert!(!c.status.merge_envoy_stats);
    let e = resolve(&["sidecar"], &[("PILOT_AGENT_MERGE_ENVOY_STATS", "sometimes")], &[ROOT]).unwrap_err();
    assert!(e.to_string().contains("PILOT_AGENT_MERGE_ENVOY_STATS"), "{e}");
}

/// COMPLIANCE_POLICY: the FIPS policies are taken (the agent's TLS and Envoy's
/// google_grpc ciphers follow them); `pqc`, which this build cannot honour, stops
/// start-up naming the variable instead of running without the protection asked for.
#[test]
fn compliance_policy_pqc_is_refused_at_start_naming_the_variable() {
    let c = resolve(&["sidecar"], &[("COMPLIANCE_POLICY", "fips-140-3")], &[ROOT]).unwrap();
    assert_eq!(c.envoy.bootstrap_env.compliance_policy, "fips-140-3");
    let e = resolve(&["sidecar"], &[("COMPLIANCE_POLICY", "pqc")], &[ROOT]).unwrap_err().to_string();
    assert!(e.contains("COMPLIANCE_POLICY") && e.contains("X25519MLKEM768"), "{e}");
}
