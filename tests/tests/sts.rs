//! The STS server on `--stsPort`: `weir proxy sidecar --stsPort 15463
//! --tokenManagerPlugin GoogleTokenExchange` in a pod, its token manager pointed (by
//! `WEIR_STS_TOKEN_ENDPOINT`) at a stand-in federated token endpoint in another pod
//! (a test HTTP server, named as such). Requests come from inside the pod, as Envoy's
//! Google gRPC client sends them.

use std::{net::SocketAddr, process::Command};

use weir_tests::{
    Mesh, Pod,
    http::request_with,
    http_server::{SeenRequest, TestHttpServer},
    require_root,
    sidecar::{AgentProcess, SidecarRoot},
    test_name, tools,
};

const STS: &str = "127.0.0.1:15463";
const FORM: &str = "application/x-www-form-urlencoded";
const GKE: &str = "https://container.googleapis.com/v1/projects/p/locations/l/clusters/c";

fn exchange_form(subject: &str) -> String {
    format!(
        "grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Atoken-exchange&subject_token={subject}\
         &subject_token_type=urn%3Aietf%3Aparams%3Aoauth%3Atoken-type%3Ajwt&scope=https%3A%2F%2Fwww.googleapis.com%2Fauth%2Fcloud-platform"
    )
}

fn federated_ok(_: &SeenRequest) -> weir_tests::http_server::Answer {
    (200, "application/json", br#"{"access_token":"federated-token-1","issued_token_type":"urn:ietf:params:oauth:token-type:access_token","token_type":"Bearer","expires_in":3600}"#.to_vec())
}

struct Rig {
    agent: AgentProcess,
    upstream: TestHttpServer,
    app: Pod,
    _root: SidecarRoot,
    _upstream_pod: Pod,
    _mesh: Mesh,
}

impl Rig {
    fn new(test: &str) -> Self {
        let mesh = Mesh::new(test).unwrap();
        let upstream_pod = mesh.pod("sts-upstream").unwrap();
        let app = mesh.pod("app").unwrap();
        let addr = SocketAddr::new(upstream_pod.ipv4().into(), 8080);
        let upstream = TestHttpServer::start(upstream_pod.netns(), addr, federated_ok).unwrap();
        let root = SidecarRoot::new("", "k8s-token").unwrap();
        let endpoint = format!("http://{addr}/v1/token");
        // No istiod here: the discovery address answers nothing, which the agent
        // logs and retries while the STS server works on its own.
        let proxy_config = format!("{{\"discoveryAddress\": \"{}:15012\"}}", upstream_pod.ipv4());
        let env = [
            ("DISABLE_ENVOY", "true"),
            ("PROXY_CONFIG", proxy_config.as_str()),
            ("PILOT_CERT_PROVIDER", "none"),
            ("XDS_ROOT_CA", "SYSTEM"),
            ("CA_ROOT_CA", "SYSTEM"),
            ("POD_NAME", "app"),
            ("POD_NAMESPACE", "default"),
            ("WEIR_STS_TOKEN_ENDPOINT", endpoint.as_str()),
            ("GKE_CLUSTER_URL", GKE),
        ];
        let args = [
            "proxy",
            "sidecar",
            "--domain",
            "default.svc.cluster.local",
            "--stsPort",
            "15463",
            "--tokenManagerPlugin",
            "GoogleTokenExchange",
        ];
        let agent =
            AgentProcess::launch(&app, &root, tools::weir_command(), &args, &env, Some((1337, 1337)), None)
                .unwrap();
        Self { agent, upstream, app, _root: root, _upstream_pod: upstream_pod, _mesh: mesh }
    }

    fn post(&self, content_type: &str, body: &str) -> (u16, serde_json::Value) {
        self.call("POST", content_type, body)
    }

    fn call(&self, method: &str, content_type: &str, body: &str) -> (u16, serde_json::Value) {
        let (status, text) = self
            .app
            .run(|| async {
                request_with(
                    STS.parse().unwrap(),
                    method,
                    "/token",
                    &[("Content-Type", content_type)],
                    Some(body),
                )
                .await
            })
            .unwrap()
            .unwrap_or_else(|e| panic!("STS request: {e:#}\nagent log:\n{}", self.agent.log()));
        let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        (status, json)
    }
}

#[test]
fn a_good_exchange_reaches_the_federated_endpoint_once_and_is_cached() {
    require_root!();
    let rig = Rig::new(&test_name!());
    let (status, json) = rig.post(FORM, &exchange_form("pod-jwt-1"));
    assert_eq!(status, 200, "{json}\n{}", rig.agent.log());
    assert_eq!(json["access_token"], "federated-token-1");
    assert_eq!(json["token_type"], "Bearer");
    assert_eq!(json["issued_token_type"], "urn:ietf:params:oauth:token-type:access_token");
    assert_eq!(json["expires_in"], 3600);

    // What the token manager sent: Istio's federated token request, as JSON.
    let seen = rig.upstream.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!((seen[0].method.as_str(), seen[0].path.as_str()), ("POST", "/v1/token"));
    assert_eq!(seen[0].header("content-type"), Some("application/json"));
    let sent: serde_json::Value = serde_json::from_slice(&seen[0].body).unwrap();
    assert_eq!(sent["subjectToken"], "pod-jwt-1");
    assert_eq!(sent["grantType"], "urn:ietf:params:oauth:grant-type:token-exchange");
    assert_eq!(sent["subjectTokenType"], "urn:ietf:params:oauth:token-type:jwt");
    assert_eq!(sent["requestedTokenType"], "urn:ietf:params:oauth:token-type:access_token");
    assert_eq!(sent["audience"], format!("identitynamespace:cluster.local:{GKE}"));
    assert_eq!(sent["scope"], "https://www.googleapis.com/auth/cloud-platform");

    // The same exchange again is answered from the cache (the token has an hour left).
    let (status, json) = rig.post(FORM, &exchange_form("pod-jwt-1"));
    assert_eq!((status, json["access_token"].as_str()), (200, Some("federated-token-1")));
    assert_eq!(rig.upstream.seen().len(), 1, "a cached token was fetched again");
    let (status, text) = rig
        .app
        .run(|| async { weir_tests::http::get(STS.parse().unwrap(), "/stsStatus").await })
        .unwrap()
        .unwrap();
    assert_eq!(status, 200);
    let cached: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(cached.as_array().map(Vec::len), Some(1), "{text}");
    assert!(!text.contains("federated-token-1"), "the status page shows no token");
}

#[test]
fn malformed_requests_get_rfc_shaped_invalid_request_errors() {
    require_root!();
    let rig = Rig::new(&test_name!());
    let cases = [
        ("GET", FORM, exchange_form("t"), "should be POST"),
        ("POST", "application/json", exchange_form("t"), "content type is invalid"),
        ("POST", FORM, "grant_type=password&subject_token=t".to_string(), "grant_type is invalid"),
        ("POST", FORM, exchange_form(""), "subject_token is empty"),
        ("POST", FORM, "grant_type=%zz".to_string(), "failed to parse"),
    ];
    for (method, content_type, body, needle) in cases {
        let (status, json) = rig.call(method, content_type, &body);
        assert_eq!(status, 400, "{method} {content_type} {body}: {json}");
        assert_eq!(json["error"], "invalid_request");
        let description = json["error_description"].as_str().unwrap_or_default();
        assert!(description.contains(needle), "{needle}: {description}");
    }
    assert!(rig.upstream.seen().is_empty(), "a malformed request reached the upstream");
}

#[test]
fn an_upstream_failure_is_retried_then_reported_as_invalid_target() {
    require_root!();
    let rig = Rig::new(&test_name!());
    rig.upstream.answer_with(|_| (503, "text/plain", b"backend unavailable".to_vec()));
    let (status, json) = rig.post(FORM, &exchange_form("pod-jwt-2"));
    assert_eq!(status, 500, "{json}");
    assert_eq!(json["error"], "invalid_target");
    let description = json["error_description"].as_str().unwrap_or_default();
    assert!(
        description.contains("HTTP status 503") && description.contains("backend unavailable"),
        "{description}"
    );
    assert_eq!(rig.upstream.seen().len(), 5, "5xx is retried up to 5 times");

    // A 4xx is the upstream's final word: no retry.
    rig.upstream.answer_with(|_| (401, "application/json", br#"{"error":"invalid_grant"}"#.to_vec()));
    let (status, json) = rig.post(FORM, &exchange_form("pod-jwt-3"));
    assert_eq!((status, json["error"].as_str()), (500, Some("invalid_target")));
    assert!(json["error_description"].as_str().unwrap().contains("HTTP status 401"));
    assert_eq!(rig.upstream.seen().len(), 6);

    // Once the upstream recovers, the next exchange works.
    rig.upstream.answer_with(federated_ok);
    let (status, _) = rig.post(FORM, &exchange_form("pod-jwt-2"));
    assert_eq!(status, 200);
    assert!(rig.agent.log().contains("federated token request failed"));
}

#[test]
fn an_unknown_token_manager_plugin_is_a_usage_error() {
    let out = Command::new(tools::weir())
        .args(["proxy", "sidecar", "--stsPort", "15463", "--tokenManagerPlugin", "Vault"])
        .env_clear()
        .env("POD_NAMESPACE", "default")
        .env("XDS_ROOT_CA", "SYSTEM")
        .env("CA_ROOT_CA", "SYSTEM")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("--tokenManagerPlugin") && stderr.contains("GoogleTokenExchange"), "{stderr}");
}
