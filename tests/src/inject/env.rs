//! A container's environment and command line as the kubelet computes them
//! (`kubelet_pods.go:makeEnvironmentVariables`, `third_party/forked/golang/expansion`):
//! `value` with `$(VAR)` expanded over the variables defined before it, `fieldRef`
//! (pod name, namespace, IPs, node, service account, a label or annotation),
//! `resourceFieldRef` (limits and requests, divided and rounded up as kubelet does),
//! and `$(VAR)` in `command`/`args` over the final environment. `$$` escapes a `$`; a
//! reference to an unknown variable is left as written.

use std::{collections::BTreeMap, net::IpAddr};

use anyhow::{Context as _, bail};

use super::manifest::{Container, FieldRef, Manifest, ResourceFieldRef, Scalar};

/// What the kubelet knows about a running pod besides its spec: its IPs, its node.
#[derive(Debug, Clone)]
pub struct PodStatus {
    /// Primary first (`status.podIP`), all of them `status.podIPs`.
    pub pod_ips: Vec<IpAddr>,
    pub host_ip: IpAddr,
    pub node_name: String,
    /// The node's allocatable CPU and memory: the limits of a container with none.
    pub node_cpu: Scalar,
    pub node_memory: Scalar,
}

/// `$(VAR)` expansion as Kubernetes does it: `lookup` gives a variable's value; an
/// unknown one stays `$(VAR)`, `$$` is a `$`, an unterminated `$(` stays as written,
/// and `$` before anything else is kept with it.
pub fn expand(input: &str, lookup: impl Fn(&str) -> Option<String>) -> String {
    let bytes = input.as_bytes();
    let mut out: Vec<u8> = Vec::with_capacity(bytes.len());
    let mut checkpoint = 0;
    let mut cursor = 0;
    while cursor < bytes.len() {
        if bytes[cursor] == b'$' && cursor + 1 < bytes.len() {
            out.extend_from_slice(&bytes[checkpoint..cursor]);
            let rest = &bytes[cursor + 1..];
            let advance = match rest[0] {
                b'$' => {
                    out.push(b'$');
                    1
                }
                b'(' => match rest.iter().position(|&b| b == b')') {
                    Some(close) => {
                        let name = String::from_utf8_lossy(&rest[1..close]);
                        match lookup(&name) {
                            Some(value) => out.extend_from_slice(value.as_bytes()),
                            None => out.extend_from_slice(format!("$({name})").as_bytes()),
                        }
                        close + 1
                    }
                    None => {
                        out.extend_from_slice(b"$(");
                        1
                    }
                },
                // Go writes `string(input[0])`: the byte taken as a code point.
                other => {
                    out.push(b'$');
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(char::from(other).encode_utf8(&mut buf).as_bytes());
                    1
                }
            };
            cursor += advance;
            checkpoint = cursor + 1;
        }
        cursor += 1;
    }
    out.extend_from_slice(&bytes[checkpoint.min(bytes.len())..]);
    String::from_utf8_lossy(&out).into_owned()
}

/// The container's environment variables (last definition of a name wins).
pub fn container_env(
    manifest: &Manifest,
    status: &PodStatus,
    container: &Container,
) -> anyhow::Result<BTreeMap<String, String>> {
    container_env_with(manifest, status, container, None)
}

/// Objects by name, each its keys and values (a namespace's ConfigMaps or Secrets).
pub type NamedData = BTreeMap<String, BTreeMap<String, String>>;

/// [`container_env`] with the pod's ConfigMaps and Secrets (`objects`: name → key →
/// value, ConfigMaps then Secrets) for `envFrom` (first, each key with its prefix) and
/// `configMapKeyRef`/`secretKeyRef`.
pub fn container_env_with(
    manifest: &Manifest,
    status: &PodStatus,
    container: &Container,
    objects: Option<(&NamedData, &NamedData)>,
) -> anyhow::Result<BTreeMap<String, String>> {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for from in &container.env_from {
        let (source, kind) = match (&from.config_map_ref, &from.secret_ref) {
            (Some(r), None) => (objects.map(|o| o.0), r),
            (None, Some(r)) => (objects.map(|o| o.1), r),
            _ => {
                bail!("container {}: an envFrom entry needs one of configMapRef or secretRef", container.name)
            }
        };
        match source.and_then(|s| s.get(&kind.name)) {
            Some(data) => {
                for (k, v) in data {
                    env.insert(format!("{}{k}", from.prefix.as_deref().unwrap_or_default()), v.clone());
                }
            }
            None if kind.optional => {}
            None => {
                bail!("container {}: envFrom names {:?}, which does not exist", container.name, kind.name)
            }
        }
    }
    let key_ref = |r: &serde_yaml_ng::Value, source: Option<&NamedData>| {
        let (name, key) = (r["name"].as_str().unwrap_or_default(), r["key"].as_str().unwrap_or_default());
        let optional = r["optional"].as_bool().unwrap_or(false);
        match source.and_then(|s| s.get(name)).and_then(|d| d.get(key)) {
            Some(v) => Ok(Some(v.clone())),
            None if optional => Ok(None),
            None => Err(anyhow::anyhow!("key {key:?} of {name:?} does not exist")),
        }
    };
    for var in &container.env {
        if let Some(from) = &var.value_from
            && (from.config_map_key_ref.is_some() || from.secret_key_ref.is_some())
            && objects.is_some()
        {
            let found = match (&from.config_map_key_ref, &from.secret_key_ref) {
                (Some(r), _) => key_ref(r, objects.map(|o| o.0)),
                (_, Some(r)) => key_ref(r, objects.map(|o| o.1)),
                _ => Ok(None),
            }
            .with_context(|| format!("container {} env {}", container.name, var.name))?;
            if let Some(v) = found {
                env.insert(var.name.clone(), v);
            }
            continue;
        }
        let value = match (&var.value, &var.value_from) {
            (Some(value), _) if !value.is_empty() => expand(value, |name| env.get(name).cloned()),
            (_, Some(from)) => if let Some(field) = &from.field_ref {
                field_value(manifest, status, field)
            } else if let Some(resource) = &from.resource_field_ref {
                resource_value(manifest, status, container, resource)
            } else if from.config_map_key_ref.is_some() || from.secret_key_ref.is_some() {
                bail!("the rig provides no ConfigMap or Secret keys as env")
            } else {
                bail!("valueFrom has no source")
            }
            .with_context(|| format!("container {} env {}", container.name, var.name))?,
            _ => String::new(),
        };
        env.insert(var.name.clone(), value);
    }
    Ok(env)
}

/// `command` and `args` with `$(VAR)` expanded over `env`.
pub fn command_line(container: &Container, env: &BTreeMap<String, String>) -> (Vec<String>, Vec<String>) {
    let expand_all = |list: &[String]| -> Vec<String> {
        list.iter().map(|s| expand(s, |name| env.get(name).cloned())).collect()
    };
    (expand_all(&container.command), expand_all(&container.args))
}

/// A `fieldRef`'s value (`podFieldSelectorRuntimeValue`, `ExtractFieldPathAsString`).
pub fn field_value(manifest: &Manifest, status: &PodStatus, field: &FieldRef) -> anyhow::Result<String> {
    let ips = |all: bool| -> String {
        let list: Vec<String> = status.pod_ips.iter().map(IpAddr::to_string).collect();
        if all { list.join(",") } else { list.first().cloned().unwrap_or_default() }
    };
    let path = field.field_path.as_str();
    Ok(match path {
        "metadata.name" => manifest.name().into(),
        "metadata.namespace" => manifest.namespace().into(),
        "metadata.labels" => format_map(&manifest.meta.labels),
        "metadata.annotations" => format_map(&manifest.meta.annotations),
        "spec.nodeName" => status.node_name.clone(),
        "spec.serviceAccountName" => manifest.service_account().into(),
        "status.hostIP" | "status.hostIPs" => status.host_ip.to_string(),
        "status.podIP" => ips(false),
        "status.podIPs" => ips(true),
        _ => {
            let subscript = |prefix: &str| {
                path.strip_prefix(prefix)?.strip_prefix("['")?.strip_suffix("']").map(str::to_string)
            };
            if let Some(key) = subscript("metadata.labels") {
                manifest.meta.labels.get(&key).cloned().unwrap_or_default()
            } else if let Some(key) = subscript("metadata.annotations") {
                manifest.meta.annotations.get(&key).cloned().unwrap_or_default()
            } else {
                bail!("unsupported fieldPath {path:?}")
            }
        }
    })
}

/// The downward API's text of a map: `key="value"` lines, sorted by key, the value
/// quoted as Go's `%q`, no trailing newline (`fieldpath.FormatMap`).
pub fn format_map(map: &BTreeMap<String, String>) -> String {
    map.iter().map(|(k, v)| format!("{k}={}", go_quote(v))).collect::<Vec<_>>().join("\n")
}

/// Go's `strconv.Quote`: `"` and `\` escaped, `\a \b \f \n \r \t \v` by name, other
/// control characters as `\xNN` (below 0x80) or `\uNNNN`; printable text as is.
pub fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{b}' => out.push_str("\\v"),
            c if c.is_control() || (c.is_whitespace() && c != ' ') => {
                let n = u32::from(c);
                if n < 0x80 {
                    out.push_str(&format!("\\x{n:02x}"));
                } else if n < 0x10000 {
                    out.push_str(&format!("\\u{n:04x}"));
                } else {
                    out.push_str(&format!("\\U{n:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A `resourceFieldRef`'s value (`containerResourceRuntimeValue`): the limit (the
/// node's allocatable when unset) or request (the limit when unset), divided by the
/// divisor (default 1) and rounded up; CPU in millicores first.
pub fn resource_value(
    manifest: &Manifest,
    status: &PodStatus,
    container: &Container,
    field: &ResourceFieldRef,
) -> anyhow::Result<String> {
    let target = match &field.container_name {
        Some(name) if !name.is_empty() => {
            manifest.container(name).with_context(|| format!("no container {name:?}"))?
        }
        _ => container,
    };
    let (class, resource) =
        field.resource.split_once('.').with_context(|| format!("resource {:?}", field.resource))?;
    let allocatable = |resource: &str| match resource {
        "cpu" => Some(status.node_cpu.clone()),
        "memory" => Some(status.node_memory.clone()),
        _ => None,
    };
    // API defaulting makes an unset request equal to the limit the spec gives; the
    // kubelet makes an unset limit the node's allocatable.
    let limit = target.resources.limits.get(resource).cloned();
    let value = match class {
        "limits" => limit.or_else(|| allocatable(resource)),
        "requests" => target.resources.requests.get(resource).cloned().or(limit).or(Some(Scalar("0".into()))),
        _ => bail!("resource {:?}: expected limits.* or requests.*", field.resource),
    }
    .with_context(|| format!("no value for {}", field.resource))?;
    let value = Quantity::parse(&value.0)?;
    let divisor = match &field.divisor {
        Some(d) => Quantity::parse(&d.0)?,
        None => Quantity::parse("1")?,
    };
    let divisor = if divisor.is_zero() { Quantity::parse("1")? } else { divisor };
    let result = if resource == "cpu" {
        div_ceil(value.milli(), divisor.milli())
    } else {
        div_ceil(value.units(), divisor.units())
    };
    Ok(result.to_string())
}

fn div_ceil(a: i128, b: i128) -> i128 {
    if b == 0 {
        return 0;
    }
    let q = a / b;
    if a % b != 0 && ((a < 0) == (b < 0)) { q + 1 } else { q }
}

/// A Kubernetes resource quantity as an exact fraction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantity {
    num: i128,
    den: i128,
}

impl Quantity {
    /// `<number><suffix>`: decimal (`n u m k M G T P E`), binary (`Ki`..`Ei`) or an
    /// exponent (`e3`, `E-2`).
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let bad = || anyhow::anyhow!("quantity {text:?}: expected a number with an optional suffix");
        let split = text
            .char_indices()
            .find(|(i, c)| !(c.is_ascii_digit() || *c == '.' || ((*c == '+' || *c == '-') && *i == 0)))
            .map_or(text.len(), |(i, _)| i);
        let (number, suffix) = text.split_at(split);
        let (sign, digits) = match number.strip_prefix('-') {
            Some(rest) => (-1, rest),
            None => (1, number.strip_prefix('+').unwrap_or(number)),
        };
        let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
        if int.is_empty() && frac.is_empty() || !int.chars().chain(frac.chars()).all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        let mut num: i128 = format!("{int}{frac}").parse().map_err(|_| bad())?;
        let mut den: i128 =
            10i128.checked_pow(u32::try_from(frac.len()).map_err(|_| bad())?).ok_or_else(bad)?;
        num *= sign;
        let scale = |n: &mut i128, d: &mut i128, base: i128, exp: i32| -> Option<()> {
            let factor = base.checked_pow(exp.unsigned_abs())?;
            if exp >= 0 {
                *n = n.checked_mul(factor)?;
            } else {
                *d = d.checked_mul(factor)?;
            }
            Some(())
        };
        let done = match suffix {
            "" => Some(()),
            "n" => scale(&mut num, &mut den, 10, -9),
            "u" => scale(&mut num, &mut den, 10, -6),
            "m" => scale(&mut num, &mut den, 10, -3),
            "k" => scale(&mut num, &mut den, 10, 3),
            "M" => scale(&mut num, &mut den, 10, 6),
            "G" => scale(&mut num, &mut den, 10, 9),
            "T" => scale(&mut num, &mut den, 10, 12),
            "P" => scale(&mut num, &mut den, 10, 15),
            "E" => scale(&mut num, &mut den, 10, 18),
            "Ki" => scale(&mut num, &mut den, 2, 10),
            "Mi" => scale(&mut num, &mut den, 2, 20),
            "Gi" => scale(&mut num, &mut den, 2, 30),
            "Ti" => scale(&mut num, &mut den, 2, 40),
            "Pi" => scale(&mut num, &mut den, 2, 50),
            "Ei" => scale(&mut num, &mut den, 2, 60),
            other => {
                let exp =
                    other.strip_prefix(['e', 'E']).and_then(|e| e.parse::<i32>().ok()).ok_or_else(bad)?;
                scale(&mut num, &mut den, 10, exp)
            }
        };
        done.ok_or_else(|| anyhow::anyhow!("quantity {text:?} is out of range"))?;
        Ok(Self { num, den })
    }

    fn is_zero(&self) -> bool {
        self.num == 0
    }

    /// In thousandths, rounded up (`MilliValue`).
    pub fn milli(&self) -> i128 {
        div_ceil(self.num * 1000, self.den)
    }

    /// In units, rounded up (`Value`).
    pub fn units(&self) -> i128 {
        div_ceil(self.num, self.den)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn expansion_follows_kubernetes_rules() {
        let vars = lookup(&[("VAR_A", "A"), ("VAR_B", "B"), ("EMPTY", "")]);
        // Cases from Kubernetes' expansion_test.go.
        for (input, want) in [
            ("$(VAR_A)", "A"),
            ("___$(VAR_B)___", "___B___"),
            ("$(VAR_A)-$(VAR_B)", "A-B"),
            ("$(VAR_A)$(VAR_B)", "AB"),
            ("f000-$$VAR_A", "f000-$VAR_A"),
            ("$$(VAR_A)", "$(VAR_A)"),
            ("$$$(VAR_A)", "$A"),
            ("$(UNKNOWN)", "$(UNKNOWN)"),
            ("--x=$(UNKNOWN)-$(VAR_A)", "--x=$(UNKNOWN)-A"),
            ("$(VAR_A", "$(VAR_A"),
            ("$(", "$("),
            ("$", "$"),
            ("foo$", "foo$"),
            ("$VAR_A", "$VAR_A"),
            ("$(EMPTY)x", "x"),
            ("$()", "$()"),
            ("$(VAR_A)$", "A$"),
            ("", ""),
        ] {
            assert_eq!(expand(input, &vars), want, "{input:?}");
        }
    }

    fn status() -> PodStatus {
        PodStatus {
            pod_ips: vec!["10.66.0.12".parse().unwrap(), "fd00:66::c".parse().unwrap()],
            host_ip: "10.66.0.11".parse().unwrap(),
            node_name: "weir-node".into(),
            node_cpu: Scalar("4".into()),
            node_memory: Scalar("8Gi".into()),
        }
    }

    const POD: &str = r#"
kind: Pod
metadata:
  name: web
  labels: {app: web, "quote": "say \"hi\"\n"}
spec:
  serviceAccountName: web-sa
  containers:
  - name: app
    image: app
    args: ["--ns=$(POD_NAMESPACE)", "$(LATER)", "$$(POD_NAME)", "$(NOPE)"]
    resources:
      limits: {cpu: 1500m, memory: 1Gi}
      requests: {cpu: 250m}
    env:
    - {name: EARLY, value: "before-$(LATER)"}
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: POD_NAMESPACE
      valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
    - name: LATER
      value: "$(POD_NAME).$(POD_NAMESPACE)"
    - {name: IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}
    - {name: IPS, valueFrom: {fieldRef: {fieldPath: status.podIPs}}}
    - {name: HOST, valueFrom: {fieldRef: {fieldPath: status.hostIP}}}
    - {name: NODE, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
    - {name: SA, valueFrom: {fieldRef: {fieldPath: spec.serviceAccountName}}}
    - {name: APP, valueFrom: {fieldRef: {fieldPath: "metadata.labels['app']"}}}
    - {name: CPU, valueFrom: {resourceFieldRef: {resource: limits.cpu, divisor: "1"}}}
    - {name: CPU_M, valueFrom: {resourceFieldRef: {resource: limits.cpu, divisor: 1m}}}
    - {name: CPU_REQ, valueFrom: {resourceFieldRef: {resource: requests.cpu}}}
    - {name: MEM, valueFrom: {resourceFieldRef: {resource: limits.memory, divisor: "1"}}}
    - {name: MEM_MI, valueFrom: {resourceFieldRef: {resource: limits.memory, divisor: 1Mi}}}
    - {name: MEM_REQ, valueFrom: {resourceFieldRef: {resource: requests.memory}}}
    - {name: STORAGE_REQ, valueFrom: {resourceFieldRef: {resource: requests.ephemeral-storage}}}
    - {name: FROM_FIELD, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
    - {name: EMPTY, value: ""}
    - {name: DUP, value: one}
    - {name: DUP, value: "$(DUP)-two"}
  - name: other
    image: other
    env:
    - {name: OTHER_CPU, valueFrom: {resourceFieldRef: {resource: limits.cpu}}}
    - {name: APP_MEM, valueFrom: {resourceFieldRef: {containerName: app, resource: limits.memory, divisor: 1Ki}}}
"#;

    #[test]
    fn env_resolves_like_the_kubelet() {
        let m = Manifest::parse("pod.yaml", POD).unwrap();
        let env = container_env(&m, &status(), &m.spec.containers[0]).unwrap();
        let get = |k: &str| env.get(k).map(String::as_str).unwrap_or("<unset>");
        // Only variables defined earlier expand; later ones stay as written.
        assert_eq!(get("EARLY"), "before-$(LATER)");
        assert_eq!(get("LATER"), "web.default");
        assert_eq!(get("IP"), "10.66.0.12");
        assert_eq!(get("IPS"), "10.66.0.12,fd00:66::c");
        assert_eq!(get("HOST"), "10.66.0.11");
        assert_eq!(get("NODE"), "weir-node");
        assert_eq!(get("SA"), "web-sa");
        assert_eq!(get("APP"), "web");
        assert_eq!(get("CPU"), "2", "1500m rounded up to whole cores");
        assert_eq!(get("CPU_M"), "1500");
        assert_eq!(get("CPU_REQ"), "1", "250m rounded up");
        assert_eq!(get("MEM"), "1073741824");
        assert_eq!(get("MEM_MI"), "1024");
        assert_eq!(get("MEM_REQ"), "1073741824", "a request defaults to the limit");
        assert_eq!(get("STORAGE_REQ"), "0", "no request and no limit");
        assert_eq!(get("FROM_FIELD"), "web");
        assert_eq!(get("EMPTY"), "");
        assert_eq!(get("DUP"), "one-two", "the second definition sees the first");
        // Command and args expand over the final environment, wherever defined.
        let (command, args) = command_line(&m.spec.containers[0], &env);
        assert!(command.is_empty());
        assert_eq!(args, ["--ns=default", "web.default", "$(POD_NAME)", "$(NOPE)"]);

        // No limit: the node's allocatable; another container's by name.
        let other = container_env(&m, &status(), &m.spec.containers[1]).unwrap();
        assert_eq!(other["OTHER_CPU"], "4");
        assert_eq!(other["APP_MEM"], "1048576");
    }

    #[test]
    fn unsupported_sources_are_named() {
        let pod = "kind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n  - name: c\n    env:\n    - {name: X, valueFrom: {fieldRef: {fieldPath: status.phase}}}\n";
        let m = Manifest::parse("p.yaml", pod).unwrap();
        let e = format!("{:#}", container_env(&m, &status(), &m.spec.containers[0]).unwrap_err());
        assert!(e.contains("container c env X") && e.contains("status.phase"), "{e}");
        let pod = pod.replace("fieldRef: {fieldPath: status.phase}", "secretKeyRef: {name: s, key: k}");
        let m = Manifest::parse("p.yaml", &pod).unwrap();
        let e = format!("{:#}", container_env(&m, &status(), &m.spec.containers[0]).unwrap_err());
        assert!(e.contains("no ConfigMap or Secret"), "{e}");
    }

    #[test]
    fn downward_api_maps_are_sorted_go_quoted_lines() {
        let m = Manifest::parse("pod.yaml", POD).unwrap();
        assert_eq!(format_map(&m.meta.labels), "app=\"web\"\nquote=\"say \\\"hi\\\"\\n\"");
        assert_eq!(go_quote("a\\b\u{1}\u{7f}\u{85}é ü\t"), r#""a\\b\x01\x7f\u0085é ü\t""#);
        // The agent's own parser reads back what the kubelet writes.
        let text =
            format!("{}\nsidecar.istio.io/status={}", format_map(&m.meta.labels), go_quote(r#"{"a":["b"]}"#));
        let parsed = weir_agent::sidecar::podinfo::parse(&text).unwrap();
        assert_eq!(parsed["quote"], "say \"hi\"\n");
        assert_eq!(parsed["sidecar.istio.io/status"], r#"{"a":["b"]}"#);
    }

    #[test]
    fn quantities_parse_exactly() {
        for (text, milli, units) in [
            ("2", 2000, 2),
            ("100m", 100, 1),
            ("0.5", 500, 1),
            ("1.5Gi", 1_610_612_736_000, 1_610_612_736),
            ("128Mi", 134_217_728_000, 134_217_728),
            ("1k", 1_000_000, 1000),
            ("1e3", 1_000_000, 1000),
            ("5E-1", 500, 1),
            ("1n", 1, 1),
        ] {
            let q = Quantity::parse(text).unwrap();
            assert_eq!((q.milli(), q.units()), (milli, units), "{text}");
        }
        for bad in ["", "Gi", "1.2.3", "1Q", "--1", "1e"] {
            assert!(Quantity::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
