//! Every Kubernetes manifest in the repository validated offline against Kubernetes'
//! OpenAPI schemas (kubernetes-validate, installed by scripts/bootstrap with its
//! bundled schemas) for each release Weir supports, in strict mode: an unknown field,
//! a wrong type or a missing required field fails, naming the file, the resource and
//! the release. Files with no Kubernetes kind (Helm values, kustomize's Kustomization,
//! which no API server receives) are not manifests.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;

/// The Kubernetes releases Weir's manifests must be accepted by.
const RELEASES: &[&str] = &["1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0"];
/// Documents with these kinds are tools' inputs, not objects for an API server.
const NOT_MANIFESTS: &[&str] = &["Kustomization"];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap()
}

/// The validator: the interpreter bootstrap installed it for, with its packages.
fn validator() -> Command {
    let tools = workspace().join(".tools");
    let interpreter = std::fs::read_to_string(tools.join("python/INTERPRETER"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "python3".into());
    let lib = tools.join("kubernetes-validate");
    assert!(lib.join("kubernetes_validate").is_dir(), "{} missing: run scripts/bootstrap", lib.display());
    let mut cmd = Command::new(interpreter);
    cmd.env("PYTHONPATH", lib).args(["-m", "kubernetes_validate", "--strict"]);
    cmd
}

/// YAML files under the repository (not build output, tools or fuzz corpora).
fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | ".tools" | ".git" | "corpus" | "artifacts") {
                yaml_files(&path, out);
            }
        } else if name.ends_with(".yaml") || name.ends_with(".yml") || name.ends_with(".yaml.injected") {
            out.push(path);
        }
    }
}

/// The kinds of the documents in a YAML file (empty for none); a file that is not
/// YAML fails the test, naming it.
fn kinds(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| {
            serde::Deserialize::deserialize(d)
                .unwrap_or_else(|e| panic!("{} is not YAML: {e}", path.display()))
        })
        .filter_map(|v: Value| Some(v.get("kind")?.as_str()?.to_string()))
        .collect()
}

/// Validates `files` against `release`: the number of resources that passed, or what
/// the validator said when any did not. A resource without a schema for the release
/// (an unknown apiVersion or kind) is only a warning to the validator, and a failure
/// here: every line must say "passed".
fn validate(release: &str, files: &[PathBuf]) -> Result<usize, String> {
    let out = validator().args(["-k", release]).args(files).output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = said.lines().filter(|l| !l.trim().is_empty()).collect();
    let passed =
        lines.iter().filter(|l| l.starts_with("INFO ") && l.contains(" passed for resource ")).count();
    if out.status.success() && passed > 0 && passed == lines.len() {
        Ok(passed)
    } else {
        Err(format!("Kubernetes {release} ({}):\n{said}", out.status))
    }
}

#[test]
fn every_manifest_in_the_repository_validates_against_each_supported_release() {
    let mut files = Vec::new();
    yaml_files(&workspace(), &mut files);
    files.sort();
    let manifests: Vec<PathBuf> = files
        .into_iter()
        .filter(|f| {
            let kinds = kinds(f);
            !kinds.is_empty() && kinds.iter().any(|k| !NOT_MANIFESTS.contains(&k.as_str()))
        })
        .collect();
    let names: Vec<String> =
        manifests.iter().map(|f| f.strip_prefix(workspace()).unwrap().display().to_string()).collect();
    for must in ["agent/deploy/weir-cni.yaml", "tests/testdata/istio-inject/hello-readiness.yaml.injected"] {
        assert!(names.iter().any(|n| n == must), "{must} not among the manifests found: {names:?}");
    }
    println!("manifests: {names:?}");
    let failures: Vec<String> = RELEASES.iter().filter_map(|r| validate(r, &manifests).err()).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Each file holds at least one resource, and each was validated.
    let resources = validate(RELEASES[0], &manifests).unwrap();
    assert!(resources >= manifests.len(), "{resources} resources in {} files", manifests.len());
}

#[test]
fn the_validator_refuses_an_unknown_field_and_an_unknown_kind() {
    let dir = std::env::temp_dir().join(format!("weir-manifests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let typo = dir.join("typo.yaml");
    std::fs::write(
        &typo,
        "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  selector: {matchLabels: {a: b}}\n  \
         template:\n    metadata: {labels: {a: b}}\n    spec:\n      containers:\n      - name: c\n        imagee: x\n",
    )
    .unwrap();
    let unknown = dir.join("unknown.yaml");
    std::fs::write(&unknown, "apiVersion: apps/v9\nkind: DaemonSet\nmetadata: {name: x}\n").unwrap();
    let typo_said = validate("1.34.0", std::slice::from_ref(&typo));
    let unknown_said = validate("1.34.0", std::slice::from_ref(&unknown));
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(typo_said.as_ref().is_err_and(|e| e.contains("'imagee' was unexpected")), "{typo_said:?}");
    assert!(
        unknown_said.as_ref().is_err_and(|e| e.contains("apps/v9")),
        "an unknown apiVersion passed: {unknown_said:?}"
    );
}

/// The pod specs in `path` (a Pod's, or a workload's template): `(name, spec)`.
fn pod_specs(path: &Path) -> Vec<(String, Value)> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .filter_map(|v: Value| {
            let name = format!("{} {}", v["kind"].as_str()?, v["metadata"]["name"].as_str().unwrap_or("?"));
            let spec = if v["kind"] == "Pod" { &v["spec"] } else { &v["spec"]["template"]["spec"] };
            spec.get("containers").is_some().then(|| (name, spec.clone()))
        })
        .collect()
}

/// What the schema cannot see: a volumeMount naming no volume of its pod (the API
/// server refuses the pod), or two volumes of one name. Two changes to one manifest can
/// merge without a conflict and leave either behind.
#[test]
fn every_volume_mount_names_a_volume_of_its_pod() {
    let mut files = Vec::new();
    yaml_files(&workspace(), &mut files);
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in &files {
        for (name, spec) in pod_specs(file) {
            checked += 1;
            let volumes: Vec<&str> =
                spec["volumes"].as_array().into_iter().flatten().filter_map(|v| v["name"].as_str()).collect();
            for (i, v) in volumes.iter().enumerate() {
                if volumes[..i].contains(v) {
                    problems.push(format!("{}: {name}: volume {v} declared twice", file.display()));
                }
            }
            let containers = ["initContainers", "containers"]
                .iter()
                .flat_map(|k| spec[*k].as_array().cloned().unwrap_or_default());
            for c in containers {
                for m in c["volumeMounts"].as_array().into_iter().flatten() {
                    let wanted = m["name"].as_str().unwrap_or("");
                    if !volumes.contains(&wanted) {
                        problems.push(format!(
                            "{}: {name}: container {} mounts volume {wanted:?}, which the pod does not declare",
                            file.display(),
                            c["name"].as_str().unwrap_or("?")
                        ));
                    }
                }
            }
        }
    }
    assert!(checked > 0, "no pod specs found");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The DaemonSet asks for no more than it uses (the node rigs run each container with
/// exactly its capabilities: tests/src/daemonset.rs): no container privileged, each
/// dropping every capability and adding its own list, the runtime's seccomp profile,
/// the node's cgroups read-only, bpffs never `Bidirectional`; the plugin's token an
/// account of its own that can only read; metrics on the pod's own address. Before,
/// all three containers were privileged, install mounted the cgroups read-write and
/// bpffs Bidirectional, and the plugin carried a token that may patch pods/status.
#[test]
fn the_daemonset_asks_for_least_privilege() {
    let spec = weir_tests::daemonset::pod_spec();
    for c in spec["containers"].as_array().unwrap() {
        let name = c["name"].as_str().unwrap();
        assert!(!weir_tests::daemonset::capabilities(name).is_empty(), "{name} adds its capabilities");
        let security = &c["securityContext"];
        assert_eq!(security["seccompProfile"]["type"], "RuntimeDefault", "{name}");
        assert_eq!(security["allowPrivilegeEscalation"], false, "{name}");
        for m in c["volumeMounts"].as_array().unwrap() {
            if m["name"] == "cgroup" {
                assert_eq!(m["readOnly"], true, "{name}: the node's cgroups read-only");
            }
            assert_ne!(m["mountPropagation"], "Bidirectional", "{name}: {m}");
        }
    }
    let install = weir_tests::daemonset::container("install");
    let env = install["env"].as_array().unwrap();
    let pod_ip = env.iter().find(|e| e["name"] == "POD_IP").expect("install has POD_IP");
    assert_eq!(pod_ip["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
    assert!(!env.iter().any(|e| e["name"] == "WEIR_METRICS_POD_LABELS" && e["value"] == "true"));
    let token_dir =
        env.iter().find(|e| e["name"] == "WEIR_PLUGIN_TOKEN_DIR").expect("the plugin's token")["value"]
            .as_str()
            .unwrap()
            .to_string();
    assert!(install["volumeMounts"].as_array().unwrap().iter().any(|m| m["mountPath"] == token_dir.as_str()));
    // The plugin's role reads, and only pods and namespaces.
    let text = std::fs::read_to_string(weir_tests::daemonset::manifest_path()).unwrap();
    let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let role = docs
        .iter()
        .find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "weir-cni-plugin")
        .expect("the plugin's ClusterRole");
    for rule in role["rules"].as_array().unwrap() {
        assert_eq!(rule["verbs"], serde_json::json!(["get"]), "{rule}");
        for r in rule["resources"].as_array().unwrap() {
            assert!(r == "pods" || r == "namespaces", "{rule}");
        }
    }
}

/// Weir's DaemonSet keeps the settings its containers share in one ConfigMap (as
/// istio-cni's `istio-cni-config`), read by every container through `envFrom` and set
/// in no container's own `env`, so the plugin, repair and the ambient agent cannot
/// disagree about which pods are whose; and every setting it shares with Istio's chart
/// has the chart's value (`tests/testdata/istio-cni-chart`, ambient profile). Before,
/// the selector and exclusions were written out in two containers each, and
/// `EXCLUDE_NAMESPACES` added istio-system, which the chart does not: after a swap,
/// ambient pods in istio-system were taken out of the mesh.
#[test]
fn the_daemonsets_shared_settings_are_one_config_map_with_the_charts_values() {
    use weir_tests::cluster::chart::{Profile, config_map};
    let ours: std::collections::BTreeMap<String, String> =
        weir_tests::daemonset::config_map_data().into_iter().collect();
    let spec = weir_tests::daemonset::pod_spec();
    for c in spec["containers"].as_array().unwrap() {
        let name = c["name"].as_str().unwrap();
        assert_eq!(
            c["envFrom"],
            serde_json::json!([{"configMapRef": {"name": "weir-cni-config"}}]),
            "{name} reads the ConfigMap"
        );
        for e in c["env"].as_array().into_iter().flatten() {
            let key = e["name"].as_str().unwrap();
            assert!(!ours.contains_key(key), "{name} sets {key} itself, beside the ConfigMap");
        }
    }
    let chart = config_map(Profile::Ambient).unwrap();
    let mut shared = 0;
    for (key, theirs) in &chart {
        let Some(mine) = ours.get(key) else { continue };
        shared += 1;
        if key == "AMBIENT_ENABLEMENT_SELECTOR" {
            let parse = |t: &str| serde_yaml_ng::from_str::<serde_json::Value>(t).unwrap();
            assert_eq!(parse(mine), parse(theirs), "{key}");
        } else {
            assert_eq!(mine, theirs, "{key}: Weir's DaemonSet and Istio's chart differ");
        }
    }
    assert!(shared >= 7, "only {shared} settings shared with the chart: {ours:?}");
}
