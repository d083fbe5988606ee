//! An anonymous pull of a Wasm module from an OCI registry (the distribution API, as
//! go-containerregistry pulls for pilot-agent): the manifest for the tag or digest (an
//! image index resolved to this platform's manifest), then the blob of its Wasm layer,
//! its digest checked. A registry that answers 401 with a `Bearer` challenge (Docker
//! Hub, GHCR, most others even for public images) gets the token-service round trip
//! and the request again with the token; blobs may be redirected to storage elsewhere
//! (the client drops the token when a redirect leaves the registry).

use std::time::Duration;

use bytes::Bytes;
use reqwest::StatusCode;

use super::fetch::{Answer, Client, MAX_MODULE};

/// The OCI artifact layer that holds the module (Wasm OCI image spec).
pub const WASM_LAYER: &str = "application/vnd.module.wasm.content.layer.v1+wasm";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// Every manifest shape asked for, single images first.
const ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, \
     application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.index.v1+json, \
     application/vnd.docker.distribution.manifest.list.v2+json";
const MAX_MANIFEST: usize = 4 << 20;
const MAX_TOKEN: usize = 1 << 20;

/// `<registry>/<repository>[:tag|@digest]`, as written after `oci://`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    pub registry: String,
    pub repository: String,
    /// A tag, or a `sha256:...` digest.
    pub reference: String,
}

impl Reference {
    pub fn parse(text: &str) -> Result<Self, String> {
        let (registry, rest) = text
            .split_once('/')
            .filter(|(r, rest)| !r.is_empty() && !rest.is_empty())
            .ok_or("expected oci://<registry>/<repository>[:tag|@digest]")?;
        let (repository, reference) = match rest.rsplit_once('@') {
            Some((repo, digest)) => (repo, digest.to_string()),
            None => match rest.rsplit_once(':') {
                Some((repo, tag)) if !tag.contains('/') => (repo, tag.to_string()),
                _ => (rest, "latest".to_string()),
            },
        };
        if repository.is_empty() || reference.is_empty() {
            return Err("expected oci://<registry>/<repository>[:tag|@digest]".into());
        }
        Ok(Self { registry: registry.into(), repository: repository.into(), reference })
    }
}

/// One pull: the registry's base URL, and the bearer token once a challenge gave one.
pub struct Pull<'a> {
    client: &'a Client,
    base: String,
    image: &'a Reference,
    timeout: Duration,
    token: Option<String>,
}

/// The SHA-256 a manifest gives the module's layer, and where the layer came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerDigest {
    pub sha256: String,
    pub url: String,
}

impl LayerDigest {
    /// The blob does not hash to what the manifest promised.
    pub fn mismatch(&self, actual: &str) -> Option<String> {
        (self.sha256 != actual)
            .then(|| format!("blob {} has digest sha256:{actual}, not sha256:{}", self.url, self.sha256))
    }
}

impl<'a> Pull<'a> {
    /// `plain_http`: the registry is in `WASM_INSECURE_REGISTRIES`.
    pub fn new(client: &'a Client, image: &'a Reference, plain_http: bool, timeout: Duration) -> Self {
        let scheme = if plain_http { "http" } else { "https" };
        Self {
            client,
            base: format!("{scheme}://{}/v2/{}", image.registry, image.repository),
            image,
            timeout,
            token: None,
        }
    }

    /// The module's bytes, and the digest its manifest gives the layer: the caller
    /// checks it when it hashes the module (once, off the agent's thread).
    pub async fn module(mut self) -> Result<(Bytes, Option<LayerDigest>), String> {
        let mut manifest = self.manifest(&self.image.reference.clone()).await?;
        if is_index(&manifest) {
            let digest = choose_from_index(&manifest, &self.image.reference)?;
            manifest = self.manifest(&digest).await?;
        }
        let digest = wasm_layer(&manifest, &self.image.reference)?;
        let url = format!("{}/blobs/{digest}", self.base);
        let blob = self.get(&url, "", MAX_MODULE).await?;
        let layer = digest.strip_prefix("sha256:").map(|sha256| LayerDigest { sha256: sha256.into(), url });
        Ok((blob, layer))
    }

    async fn manifest(&mut self, reference: &str) -> Result<serde_json::Value, String> {
        let url = format!("{}/manifests/{reference}", self.base);
        let body = self.get(&url, ACCEPT, MAX_MANIFEST).await?;
        serde_json::from_slice(&body).map_err(|e| format!("manifest {url}: {e}"))
    }

    /// GET `url` (with a bearer token once there is one); a 401 with a `Bearer`
    /// challenge gets a token and one more try.
    async fn get(&mut self, url: &str, accept: &str, limit: usize) -> Result<Bytes, String> {
        let answer = self.send(url, accept, limit).await?;
        let answer = if answer.status == StatusCode::UNAUTHORIZED {
            let challenge = answer
                .headers
                .get(reqwest::header::WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            self.token = Some(self.bearer_token(url, &challenge).await?);
            self.send(url, accept, limit).await?
        } else {
            answer
        };
        if answer.status != StatusCode::OK {
            return Err(format!(
                "{url}: HTTP status {}{}",
                answer.status.as_u16(),
                registry_error(&answer.body)
            ));
        }
        Ok(answer.body)
    }

    async fn send(&self, url: &str, accept: &str, limit: usize) -> Result<Answer, String> {
        let authorization = self.token.as_ref().map(|t| format!("Bearer {t}"));
        let mut headers = Vec::new();
        if !accept.is_empty() {
            headers.push(("accept", accept));
        }
        if let Some(a) = &authorization {
            headers.push(("authorization", a.as_str()));
        }
        self.client.get(url, &headers, self.timeout, limit).await.map_err(|e| format!("{url}: {e}"))
    }

    /// The token service round trip of the registry token protocol: `realm` with the
    /// challenge's `service` and `scope` (this repository's pull scope when absent).
    async fn bearer_token(&self, url: &str, challenge: &str) -> Result<String, String> {
        let params = BearerChallenge::parse(challenge).ok_or_else(|| {
            if challenge.is_empty() {
                format!("{url}: HTTP status 401 without a WWW-Authenticate challenge")
            } else {
                format!("{url}: HTTP status 401, challenge {challenge:?}: only anonymous Bearer tokens are supported")
            }
        })?;
        let scope = params.scope.unwrap_or_else(|| format!("repository:{}:pull", self.image.repository));
        let mut token_url = reqwest::Url::parse(&params.realm)
            .map_err(|e| format!("token realm {:?} from {url}: {e}", params.realm))?;
        {
            let mut query = token_url.query_pairs_mut();
            if let Some(service) = &params.service {
                query.append_pair("service", service);
            }
            query.append_pair("scope", &scope);
        }
        let answer = self
            .client
            .get(token_url.as_str(), &[], self.timeout, MAX_TOKEN)
            .await
            .map_err(|e| format!("token {token_url}: {e}"))?;
        if answer.status != StatusCode::OK {
            return Err(format!("token {token_url}: HTTP status {}", answer.status.as_u16()));
        }
        let json: serde_json::Value =
            serde_json::from_slice(&answer.body).map_err(|e| format!("token {token_url}: {e}"))?;
        json["token"]
            .as_str()
            .or_else(|| json["access_token"].as_str())
            .filter(|t| !t.is_empty())
            .map(String::from)
            .ok_or_else(|| format!("token {token_url}: the answer has no token"))
    }
}

/// `WWW-Authenticate: Bearer realm="...",service="...",scope="..."`.
#[derive(Debug, PartialEq, Eq)]
struct BearerChallenge {
    realm: String,
    service: Option<String>,
    scope: Option<String>,
}

impl BearerChallenge {
    fn parse(header: &str) -> Option<Self> {
        let (scheme, params) = header.trim().split_once(char::is_whitespace)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return None;
        }
        let (mut realm, mut service, mut scope) = (None, None, None);
        let mut rest = params.trim();
        while !rest.is_empty() {
            let (name, after) = rest.split_once('=')?;
            let after = after.trim_start();
            let (value, after) = match after.strip_prefix('"') {
                Some(quoted) => {
                    let end = quoted.find('"')?;
                    (&quoted[..end], &quoted[end + 1..])
                }
                None => after.split_at(after.find(',').unwrap_or(after.len())),
            };
            match name.trim().to_ascii_lowercase().as_str() {
                "realm" => realm = Some(value.to_string()),
                "service" => service = Some(value.to_string()),
                "scope" => scope = Some(value.to_string()),
                _ => {}
            }
            rest = after.trim_start().trim_start_matches(',').trim_start();
        }
        Some(Self { realm: realm?, service, scope })
    }
}

fn is_index(manifest: &serde_json::Value) -> bool {
    matches!(manifest["mediaType"].as_str(), Some(OCI_INDEX | DOCKER_LIST))
        || (manifest["manifests"].is_array() && manifest["layers"].is_null())
}

/// The index entry to pull: this platform's (`linux/<arch>`), else a `wasm` one,
/// else the only entry.
fn choose_from_index(index: &serde_json::Value, reference: &str) -> Result<String, String> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let entries = index["manifests"].as_array().cloned().unwrap_or_default();
    let platform = |e: &serde_json::Value| {
        (
            e["platform"]["os"].as_str().unwrap_or_default().to_string(),
            e["platform"]["architecture"].as_str().unwrap_or_default().to_string(),
        )
    };
    let manifests: Vec<&serde_json::Value> = entries
        .iter()
        .filter(|e| matches!(e["mediaType"].as_str(), Some(OCI_MANIFEST | DOCKER_MANIFEST) | None))
        .collect();
    let chosen = manifests
        .iter()
        .find(|e| platform(e) == ("linux".into(), arch.into()))
        .or_else(|| manifests.iter().find(|e| platform(e).1 == "wasm"))
        .or_else(|| (manifests.len() == 1).then(|| &manifests[0]))
        .ok_or_else(|| {
            let offered: Vec<String> = manifests
                .iter()
                .map(|e| {
                    let (os, a) = platform(e);
                    format!("{os}/{a}")
                })
                .collect();
            format!(
                "image index {reference} has no manifest for linux/{arch} or wasm (it offers {})",
                offered.join(", ")
            )
        })?;
    chosen["digest"]
        .as_str()
        .map(String::from)
        .ok_or_else(|| format!("image index {reference}: the chosen entry has no digest"))
}

/// The digest of the manifest's Wasm layer (or of its single non-tar layer).
fn wasm_layer(manifest: &serde_json::Value, reference: &str) -> Result<String, String> {
    let layers = manifest["layers"].as_array().cloned().unwrap_or_default();
    let layer = layers
        .iter()
        .find(|l| l["mediaType"] == WASM_LAYER)
        .or_else(|| {
            (layers.len() == 1)
                .then(|| &layers[0])
                .filter(|l| l["mediaType"] != "application/vnd.docker.image.rootfs.diff.tar.gzip")
        })
        .ok_or_else(|| format!("manifest {reference} has no {WASM_LAYER} layer"))?;
    layer["digest"]
        .as_str()
        .map(String::from)
        .ok_or_else(|| format!("manifest {reference}: the Wasm layer has no digest"))
}

/// A registry's error body (`{"errors":[{"code":..,"message":..}]}`), shortly.
fn registry_error(body: &[u8]) -> String {
    let json: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let codes: Vec<String> = json["errors"]
        .as_array()
        .map(|errors| errors.iter().filter_map(|e| e["code"].as_str().map(String::from)).collect())
        .unwrap_or_default();
    if codes.is_empty() { String::new() } else { format!(" ({})", codes.join(", ")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_as_docker_names_them() {
        let r = Reference::parse("ghcr.io/org/filters/auth:v1").unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.reference.as_str()),
            ("ghcr.io", "org/filters/auth", "v1")
        );
        let r = Reference::parse("localhost:5000/f@sha256:abc").unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.reference.as_str()),
            ("localhost:5000", "f", "sha256:abc")
        );
        assert_eq!(Reference::parse("registry:5000/f").unwrap().reference, "latest");
        for bad in ["registry-only", "/repo:tag", "registry/"] {
            assert!(Reference::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bearer_challenges_parse_as_registries_send_them() {
        let c = BearerChallenge::parse(
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/x:pull""#,
        )
        .unwrap();
        assert_eq!(c.realm, "https://auth.docker.io/token");
        assert_eq!(c.service.as_deref(), Some("registry.docker.io"));
        assert_eq!(c.scope.as_deref(), Some("repository:library/x:pull"));
        let c = BearerChallenge::parse(r#"bearer realm="https://ghcr.io/token", service="ghcr.io""#).unwrap();
        assert_eq!((c.service.as_deref(), c.scope), (Some("ghcr.io"), None));
        assert_eq!(BearerChallenge::parse(r#"Basic realm="registry""#), None);
        assert_eq!(BearerChallenge::parse("Bearer service=x"), None, "no realm");
        assert_eq!(BearerChallenge::parse(r#"Bearer realm="unterminated"#), None);
    }

    #[test]
    fn an_index_resolves_to_this_platform_or_wasm_or_its_only_entry() {
        let arch = if cfg!(target_arch = "aarch64") { "arm64" } else { "amd64" };
        let index = serde_json::json!({"mediaType": OCI_INDEX, "manifests": [
            {"mediaType": OCI_MANIFEST, "digest": "sha256:other", "platform": {"os": "linux", "architecture": "s390x"}},
            {"mediaType": OCI_MANIFEST, "digest": "sha256:mine", "platform": {"os": "linux", "architecture": arch}},
        ]});
        assert!(is_index(&index));
        assert_eq!(choose_from_index(&index, "v1").unwrap(), "sha256:mine");
        let wasm = serde_json::json!({"manifests": [
            {"digest": "sha256:w", "platform": {"os": "wasip1", "architecture": "wasm"}},
            {"digest": "sha256:o", "platform": {"os": "linux", "architecture": "s390x"}}]});
        assert!(is_index(&wasm));
        assert_eq!(choose_from_index(&wasm, "v1").unwrap(), "sha256:w");
        let single = serde_json::json!({"mediaType": DOCKER_LIST, "manifests": [{"digest": "sha256:s"}]});
        assert_eq!(choose_from_index(&single, "v1").unwrap(), "sha256:s");
        let none = serde_json::json!({"mediaType": OCI_INDEX, "manifests": [
            {"digest": "sha256:a", "platform": {"os": "windows", "architecture": "amd64"}},
            {"digest": "sha256:b", "platform": {"os": "linux", "architecture": "s390x"}}]});
        let e = choose_from_index(&none, "v1").unwrap_err();
        assert!(e.contains("windows/amd64, linux/s390x"), "{e}");
    }
}
