//! An injected manifest as the kubelet gets it: a Pod, or the pod a Deployment's
//! ReplicaSet makes from its template (named `<deployment>-<hash>-<suffix>`, labelled
//! `pod-template-hash`). The fields the rig acts on are typed; the rest of the YAML is
//! ignored. A volume source the rig cannot provide is an error naming the volume.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};
use serde::Deserialize;

/// The `pod-template-hash` the rig's "ReplicaSet controller" gives Deployment pods.
pub const POD_TEMPLATE_HASH: &str = "5b7c9d8f6";
/// The random suffix of a Deployment pod's name.
const POD_SUFFIX: &str = "x4k2p";

/// Where the copies of Istio's injector goldens live (see its README).
pub fn testdata_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/istio-inject")
}

/// Every manifest file in [`testdata_dir`], sorted.
pub fn testdata_files() -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(testdata_dir())
        .map(|d| d.flatten().filter_map(|e| e.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    files.retain(|f| f.ends_with(".yaml.injected"));
    files.sort();
    files
}

/// One pod to run.
#[derive(Debug, Clone)]
pub struct Manifest {
    /// The file it came from.
    pub file: String,
    /// `Pod` or `Deployment`.
    pub kind: String,
    /// The pod's metadata (name resolved, namespace defaulted).
    pub meta: ObjectMeta,
    pub spec: PodSpec,
    /// What the rig changed to make the manifest runnable, one line each (tests
    /// assert these, so a change never goes unnoticed).
    pub notes: Vec<String>,
}

impl Manifest {
    /// Reads `file` from [`testdata_dir`].
    pub fn load(file: &str) -> anyhow::Result<Self> {
        let path = testdata_dir().join(file);
        let text = std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        Self::parse(file, &text)
    }

    /// Parses a Pod or Deployment (the first document of `text`).
    pub fn parse(file: &str, text: &str) -> anyhow::Result<Self> {
        // Injector output ends with `---`: an empty trailing document.
        let mut documents = Vec::new();
        for document in serde_yaml_ng::Deserializer::from_str(text) {
            let value =
                serde_yaml_ng::Value::deserialize(document).with_context(|| format!("parse {file}"))?;
            if !value.is_null() {
                documents.push(value);
            }
        }
        let [document] = <[serde_yaml_ng::Value; 1]>::try_from(documents)
            .map_err(|d| anyhow::anyhow!("{file}: {} YAML documents, expected one pod", d.len()))?;
        let object: Object = serde_yaml_ng::from_value(document).with_context(|| format!("parse {file}"))?;
        let (mut meta, spec) = match object.kind.as_str() {
            "Pod" => {
                let spec: PodSpec =
                    serde_yaml_ng::from_value(object.spec).with_context(|| format!("{file}: pod spec"))?;
                (object.metadata.clone(), spec)
            }
            "Deployment" => {
                let deployment: DeploymentSpec = serde_yaml_ng::from_value(object.spec)
                    .with_context(|| format!("{file}: deployment spec"))?;
                let mut meta = deployment.template.metadata;
                let owner = object.metadata.name.clone().unwrap_or_default();
                meta.name = Some(format!("{owner}-{POD_TEMPLATE_HASH}-{POD_SUFFIX}"));
                meta.namespace = object.metadata.namespace.clone();
                meta.labels.insert("pod-template-hash".into(), POD_TEMPLATE_HASH.into());
                (meta, deployment.template.spec)
            }
            other => bail!("{file}: kind {other:?}: expected Pod or Deployment"),
        };
        meta.namespace.get_or_insert_with(|| "default".into());
        let Some(name) = meta.name.as_deref().filter(|n| !n.is_empty()) else {
            bail!("{file}: the pod has no name");
        };
        let name = name.to_string();
        let mut manifest = Self { file: file.into(), kind: object.kind, meta, spec, notes: Vec::new() };
        manifest.merge_container_patches();
        for volume in &manifest.spec.volumes {
            volume.source().with_context(|| format!("{file}: pod {name}"))?;
        }
        Ok(manifest)
    }

    pub fn name(&self) -> &str {
        self.meta.name.as_deref().unwrap_or_default()
    }

    pub fn namespace(&self) -> &str {
        self.meta.namespace.as_deref().unwrap_or("default")
    }

    /// The service account (`default` when the spec names none, as admission sets it).
    pub fn service_account(&self) -> &str {
        self.spec.service_account_name.as_deref().unwrap_or("default")
    }

    /// An init container, by name.
    pub fn init_container(&self, name: &str) -> Option<&Container> {
        self.spec.init_containers.iter().find(|c| c.name == name)
    }

    /// Any container, by name.
    pub fn container(&self, name: &str) -> Option<&Container> {
        self.spec.init_containers.iter().chain(&self.spec.containers).find(|c| c.name == name)
    }

    /// A container in `containers` with no image and the name of an init container is
    /// an injection template's patch of that container (the `spire` template's
    /// `istio-proxy` with its socket mount read-only): the API server would refuse the
    /// pod (duplicate name, no image), so the rig applies the patch — its volume mounts
    /// replace the init container's mounts at the same paths — and notes it.
    fn merge_container_patches(&mut self) {
        let patches: Vec<Container> = self
            .spec
            .containers
            .iter()
            .filter(|c| c.image.is_none() && self.spec.init_containers.iter().any(|i| i.name == c.name))
            .cloned()
            .collect();
        for patch in patches {
            self.spec.containers.retain(|c| c.name != patch.name);
            let target =
                self.spec.init_containers.iter_mut().find(|c| c.name == patch.name).expect("matched above");
            for mount in patch.volume_mounts {
                target.volume_mounts.retain(|m| m.mount_path != mount.mount_path);
                self.notes.push(format!(
                    "containers[{}] (no image) patches init container {}: {} on {}{}",
                    patch.name,
                    patch.name,
                    mount.name,
                    mount.mount_path,
                    if mount.read_only { " read-only" } else { "" }
                ));
                target.volume_mounts.push(mount);
            }
        }
    }
}

#[derive(Debug, Deserialize)]
struct Object {
    kind: String,
    #[serde(default)]
    metadata: ObjectMeta,
    spec: serde_yaml_ng::Value,
}

#[derive(Debug, Deserialize)]
struct DeploymentSpec {
    template: PodTemplate,
}

#[derive(Debug, Deserialize)]
struct PodTemplate {
    #[serde(default)]
    metadata: ObjectMeta,
    spec: PodSpec,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ObjectMeta {
    pub name: Option<String>,
    pub namespace: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    #[serde(default)]
    pub init_containers: Vec<Container>,
    #[serde(default)]
    pub containers: Vec<Container>,
    #[serde(default)]
    pub volumes: Vec<Volume>,
    pub service_account_name: Option<String>,
    #[serde(default)]
    pub security_context: PodSecurityContext,
    pub termination_grace_period_seconds: Option<u64>,
    /// What the kubelet stand-in (tests/src/cluster/kubelet) reads besides.
    #[serde(default)]
    pub host_network: bool,
    #[serde(rename = "hostPID", default)]
    pub host_pid: bool,
    pub dns_policy: Option<String>,
    pub dns_config: Option<PodDnsConfig>,
    #[serde(default)]
    pub host_aliases: Vec<HostAlias>,
    /// `Always` (the default), `OnFailure` or `Never`.
    pub restart_policy: Option<String>,
    pub node_name: Option<String>,
    pub automount_service_account_token: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct PodDnsConfig {
    #[serde(default)]
    pub nameservers: Vec<String>,
    #[serde(default)]
    pub searches: Vec<String>,
    #[serde(default)]
    pub options: Vec<PodDnsOption>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct PodDnsOption {
    pub name: String,
    pub value: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct HostAlias {
    pub ip: String,
    #[serde(default)]
    pub hostnames: Vec<String>,
}

/// `envFrom`: every key of a ConfigMap or Secret, with a prefix.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnvFromSource {
    pub config_map_ref: Option<NameRef>,
    pub secret_ref: Option<NameRef>,
    pub prefix: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct NameRef {
    pub name: String,
    #[serde(default)]
    pub optional: bool,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Capabilities {
    #[serde(default)]
    pub add: Vec<String>,
    #[serde(default)]
    pub drop: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SeccompProfile {
    #[serde(rename = "type")]
    pub kind: String,
    pub localhost_profile: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSecurityContext {
    pub fs_group: Option<u32>,
    pub run_as_user: Option<u32>,
    pub run_as_group: Option<u32>,
    #[serde(default)]
    pub supplemental_groups: Vec<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Container {
    pub name: String,
    pub image: Option<String>,
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: Vec<EnvVar>,
    #[serde(default)]
    pub env_from: Vec<EnvFromSource>,
    pub working_dir: Option<String>,
    #[serde(default)]
    pub ports: Vec<ContainerPort>,
    #[serde(default)]
    pub volume_mounts: Vec<VolumeMount>,
    pub security_context: Option<SecurityContext>,
    /// `Always` on an init container: a native sidecar.
    pub restart_policy: Option<String>,
    #[serde(default)]
    pub resources: Resources,
    pub lifecycle: Option<Lifecycle>,
    pub readiness_probe: Option<Probe>,
    pub liveness_probe: Option<Probe>,
    pub startup_probe: Option<Probe>,
}

impl Container {
    /// A native sidecar (an init container that keeps running).
    pub fn is_sidecar(&self) -> bool {
        self.restart_policy.as_deref() == Some("Always")
    }

    /// The port number `port` names (a number, or a container port's name).
    pub fn port(&self, port: &IntOrString) -> anyhow::Result<u16> {
        match port {
            IntOrString::Int(n) => u16::try_from(*n).with_context(|| format!("port {n}")),
            IntOrString::String(name) => self
                .ports
                .iter()
                .find(|p| p.name.as_deref() == Some(name))
                .map(|p| p.container_port)
                .with_context(|| format!("container {} has no port named {name:?}", self.name)),
        }
    }

    /// The probes the kubelet runs for it, with their kind.
    pub fn probes(&self) -> Vec<(ProbeKind, &Probe)> {
        [
            (ProbeKind::Startup, &self.startup_probe),
            (ProbeKind::Readiness, &self.readiness_probe),
            (ProbeKind::Liveness, &self.liveness_probe),
        ]
        .into_iter()
        .filter_map(|(kind, probe)| probe.as_ref().map(|p| (kind, p)))
        .collect()
    }

    /// Its user and group: the container's `runAsUser`/`runAsGroup`, else the pod's,
    /// else the image's (root).
    pub fn user(&self, pod: &PodSecurityContext) -> (u32, u32) {
        let sc = self.security_context.as_ref();
        let uid = sc.and_then(|s| s.run_as_user).or(pod.run_as_user).unwrap_or(0);
        let gid = sc.and_then(|s| s.run_as_group).or(pod.run_as_group).unwrap_or(uid);
        (uid, gid)
    }

    /// Its supplementary groups: the pod's `fsGroup` and `supplementalGroups`.
    pub fn groups(&self, pod: &PodSecurityContext) -> Vec<u32> {
        pod.fs_group.into_iter().chain(pod.supplemental_groups.iter().copied()).collect()
    }

    /// Whether its root file system is read-only.
    pub fn read_only_root(&self) -> bool {
        self.security_context.as_ref().and_then(|s| s.read_only_root_filesystem).unwrap_or(false)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ProbeKind {
    Startup,
    Readiness,
    Liveness,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnvVar {
    pub name: String,
    pub value: Option<String>,
    pub value_from: Option<EnvVarSource>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnvVarSource {
    pub field_ref: Option<FieldRef>,
    pub resource_field_ref: Option<ResourceFieldRef>,
    pub config_map_key_ref: Option<serde_yaml_ng::Value>,
    pub secret_key_ref: Option<serde_yaml_ng::Value>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FieldRef {
    pub field_path: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceFieldRef {
    pub container_name: Option<String>,
    pub resource: String,
    pub divisor: Option<Scalar>,
}

/// A YAML scalar kept as its text (`"2"`, `2`, `1Gi` are all quantities).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scalar(pub String);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match serde_yaml_ng::Value::deserialize(d)? {
            serde_yaml_ng::Value::String(s) => Ok(Self(s)),
            serde_yaml_ng::Value::Number(n) => Ok(Self(n.to_string())),
            other => Err(serde::de::Error::custom(format!("expected a quantity, got {other:?}"))),
        }
    }
}

/// A port as a number or a named container port.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum IntOrString {
    Int(i64),
    String(String),
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerPort {
    pub name: Option<String>,
    pub container_port: u16,
    pub protocol: Option<String>,
    pub host_port: Option<u16>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMount {
    pub name: String,
    pub mount_path: String,
    #[serde(default)]
    pub read_only: bool,
    pub sub_path: Option<String>,
    /// `None`, `HostToContainer` or `Bidirectional`.
    pub mount_propagation: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SecurityContext {
    pub run_as_user: Option<u32>,
    pub run_as_group: Option<u32>,
    pub read_only_root_filesystem: Option<bool>,
    pub privileged: Option<bool>,
    pub allow_privilege_escalation: Option<bool>,
    pub capabilities: Option<Capabilities>,
    pub seccomp_profile: Option<SeccompProfile>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Resources {
    #[serde(default)]
    pub limits: BTreeMap<String, Scalar>,
    #[serde(default)]
    pub requests: BTreeMap<String, Scalar>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lifecycle {
    pub pre_stop: Option<Handler>,
}

/// A lifecycle handler (the rig runs `exec` ones).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Handler {
    pub exec: Option<ExecAction>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ExecAction {
    #[serde(default)]
    pub command: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Probe {
    pub http_get: Option<HttpGetAction>,
    pub tcp_socket: Option<TcpSocketAction>,
    pub grpc: Option<GrpcAction>,
    pub exec: Option<ExecAction>,
    pub timeout_seconds: Option<u64>,
    pub period_seconds: Option<u64>,
    pub failure_threshold: Option<u64>,
    pub success_threshold: Option<u64>,
    pub initial_delay_seconds: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpGetAction {
    pub path: Option<String>,
    pub port: IntOrString,
    pub host: Option<String>,
    pub scheme: Option<String>,
    #[serde(default)]
    pub http_headers: Vec<HttpHeader>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct HttpHeader {
    pub name: String,
    pub value: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct TcpSocketAction {
    pub port: IntOrString,
    pub host: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct GrpcAction {
    pub port: u16,
    pub service: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    pub name: String,
    pub empty_dir: Option<EmptyDir>,
    #[serde(rename = "downwardAPI")]
    pub downward_api: Option<DownwardApi>,
    pub projected: Option<Projected>,
    pub config_map: Option<ObjectVolume>,
    pub secret: Option<ObjectVolume>,
    pub csi: Option<CsiVolume>,
    pub host_path: Option<HostPathVolume>,
    /// Any other source (persistentVolumeClaim, ...): not provided by the rig.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_yaml_ng::Value>,
}

/// Which source a volume has.
#[derive(Debug, Clone, Copy)]
pub enum VolumeSource<'a> {
    EmptyDir(&'a EmptyDir),
    DownwardApi(&'a DownwardApi),
    Projected(&'a Projected),
    ConfigMap(&'a ObjectVolume),
    Secret(&'a ObjectVolume),
    Csi(&'a CsiVolume),
    HostPath(&'a HostPathVolume),
}

/// A node path as a volume; `type` checks (or makes) what is there.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct HostPathVolume {
    pub path: String,
    #[serde(rename = "type", default)]
    pub kind: String,
}

impl Volume {
    /// Its source. A volume with none is an emptyDir (the API server's defaulting).
    pub fn source(&self) -> anyhow::Result<VolumeSource<'_>> {
        static EMPTY: EmptyDir = EmptyDir { medium: None };
        if let Some(kind) = self.other.keys().next() {
            bail!("volume {}: source {kind:?} is not one the rig provides", self.name);
        }
        if let Some(h) = &self.host_path {
            let others = [self.empty_dir.is_some(), self.downward_api.is_some(), self.projected.is_some()];
            if others.iter().any(|o| *o)
                || self.config_map.is_some()
                || self.secret.is_some()
                || self.csi.is_some()
            {
                bail!("volume {} has more than one source", self.name);
            }
            return Ok(VolumeSource::HostPath(h));
        }
        Ok(
            match (
                &self.empty_dir,
                &self.downward_api,
                &self.projected,
                &self.config_map,
                &self.secret,
                &self.csi,
            ) {
                (Some(e), None, None, None, None, None) => VolumeSource::EmptyDir(e),
                (None, Some(d), None, None, None, None) => VolumeSource::DownwardApi(d),
                (None, None, Some(p), None, None, None) => VolumeSource::Projected(p),
                (None, None, None, Some(c), None, None) => VolumeSource::ConfigMap(c),
                (None, None, None, None, Some(s), None) => VolumeSource::Secret(s),
                (None, None, None, None, None, Some(c)) => VolumeSource::Csi(c),
                (None, None, None, None, None, None) => VolumeSource::EmptyDir(&EMPTY),
                _ => bail!("volume {} has more than one source", self.name),
            },
        )
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct EmptyDir {
    pub medium: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DownwardApi {
    #[serde(default)]
    pub items: Vec<DownwardApiItem>,
    pub default_mode: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DownwardApiItem {
    pub path: String,
    pub field_ref: Option<FieldRef>,
    pub resource_field_ref: Option<ResourceFieldRef>,
    pub mode: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Projected {
    #[serde(default)]
    pub sources: Vec<ProjectedSource>,
    pub default_mode: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProjectedSource {
    pub service_account_token: Option<ServiceAccountToken>,
    pub config_map: Option<ObjectVolume>,
    pub secret: Option<ObjectVolume>,
    #[serde(rename = "downwardAPI")]
    pub downward_api: Option<DownwardApi>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAccountToken {
    pub audience: Option<String>,
    pub expiration_seconds: Option<u64>,
    pub path: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyToPath {
    pub key: String,
    pub path: String,
    pub mode: Option<u32>,
}

/// A ConfigMap or Secret as a volume (or a projected source): the object's name
/// (`name` or `secretName`), which keys go where, whether it may be missing.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectVolume {
    #[serde(alias = "secretName")]
    pub name: String,
    #[serde(default)]
    pub items: Vec<KeyToPath>,
    #[serde(default)]
    pub optional: bool,
    pub default_mode: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CsiVolume {
    pub driver: String,
    #[serde(default)]
    pub read_only: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_copied_manifest_parses_with_its_pod_named_as_a_replicaset_names_it() {
        let files = testdata_files();
        assert_eq!(files.len(), 10, "{files:?}");
        for file in files {
            let m = Manifest::load(&file).unwrap_or_else(|e| panic!("{e:#}"));
            assert_eq!(m.namespace(), "default", "{file}");
            let proxy = m.init_container("istio-proxy").unwrap_or_else(|| panic!("{file}: no istio-proxy"));
            assert!(proxy.is_sidecar(), "{file}: istio-proxy is a native sidecar");
            assert!(m.init_container("istio-init").is_some_and(|c| !c.is_sidecar()), "{file}");
            if m.kind == "Deployment" {
                assert!(m.name().ends_with(&format!("-{POD_TEMPLATE_HASH}-{POD_SUFFIX}")), "{}", m.name());
                assert_eq!(m.meta.labels["pod-template-hash"], POD_TEMPLATE_HASH);
            }
        }
    }

    #[test]
    fn a_pod_keeps_its_own_name_and_metadata() {
        let m = Manifest::load("prometheus-scrape.yaml.injected").unwrap();
        assert_eq!((m.kind.as_str(), m.name()), ("Pod", "hellopod"));
        assert_eq!(m.meta.annotations["prometheus.io/scrape"], "false");
        assert!(!m.meta.labels.contains_key("pod-template-hash"));
        assert_eq!(m.service_account(), "default");
    }

    #[test]
    fn the_spire_templates_container_patch_is_applied_to_the_sidecar_and_noted() {
        let m = Manifest::load("sidecar-spire.yaml.injected").unwrap();
        assert_eq!(m.spec.containers.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["hello"]);
        let proxy = m.init_container("istio-proxy").unwrap();
        let socket: Vec<_> = proxy
            .volume_mounts
            .iter()
            .filter(|v| v.mount_path == "/var/run/secrets/workload-spiffe-uds")
            .collect();
        assert_eq!(socket.len(), 1);
        assert!(socket[0].read_only);
        assert_eq!(
            m.notes,
            [
                "containers[istio-proxy] (no image) patches init container istio-proxy: workload-socket on /var/run/secrets/workload-spiffe-uds read-only"
            ]
        );
    }

    #[test]
    fn a_volume_source_the_rig_lacks_is_named() {
        let yaml = "kind: Pod\nmetadata: {name: p}\nspec:\n  containers: []\n  volumes:\n  - name: data\n    persistentVolumeClaim: {claimName: x}\n";
        let e = format!("{:#}", Manifest::parse("x.yaml", yaml).unwrap_err());
        assert!(e.contains("volume data: source \"persistentVolumeClaim\""), "{e}");
        let e = format!("{:#}", Manifest::parse("x.yaml", "kind: Service\nspec: {}\n").unwrap_err());
        assert!(e.contains("kind \"Service\""), "{e}");
    }
}
