//! One CNI invocation: ADD finds the pod (Kubernetes API), hands an ambient pod to the
//! node agent (`ambient`), captures a sidecar pod's traffic inside its network
//! namespace (`capture`: eBPF through the node's pinned capture, or iptables / native
//! nftables through weir-iptables with a lock private to that namespace) and passes
//! `prevResult` on; DEL removes what ADD (or repair) made
//! and is idempotent (a namespace already gone is success); CHECK verifies the capture
//! is still there; VERSION, STATUS and GC answer per the spec. stdout carries only the
//! result or the error JSON; logs go to stderr.

use std::path::{Path, PathBuf};

use weir_iptables::{CaptureConfig, RunOptions};

use crate::capture::ebpf::{netns::netns_cookie, record::PinRecord};

use super::{
    capture::{
        capture_with, ebpf_error, missing_capture, node_capture, pod_netns_here, repair_container_id_for_uid,
    },
    kube::{KubeClient, KubeError},
    pod::{self, PodInfo, Skip},
    spec::{CniError, Command, Invocation, NetConf, code, version_result},
};

/// The kubeconfig istio-cni's node agent writes into `cni_agent_run_dir`.
pub const KUBECONFIG_NAME: &str = "istio-cni-kubeconfig";
pub use super::spec::DEFAULT_RUN_DIR;
/// istio-cni waits this long for the API server to answer (30 × 1 s).
const POD_LOOKUP_ATTEMPTS: u32 = 30;
const POD_LOOKUP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
/// istio-cni's ambient check (`isAmbientPod`) tries its reads again this many times,
/// [`POD_LOOKUP_INTERVAL`] apart: once by default, `podRetrievalMaxRetries` with
/// `enable_ambient_detection_retry`.
const NAMESPACE_READ_RETRIES: u32 = 1;
const NAMESPACE_READ_RETRIES_WITH_DETECTION_RETRY: u32 = 30;

/// What a command printed on success (stdout; empty for DEL/CHECK/STATUS/GC).
pub type Output = String;

/// Runs `command` with the invocation's stdin and environment.
pub fn run(command: Command, stdin: &[u8], env: impl Fn(&str) -> Option<String>) -> Result<Output, CniError> {
    if command == Command::Version {
        return Ok(version_result());
    }
    let conf = NetConf::parse(stdin)?;
    let version = conf.cni_version.clone();
    let result = (|| {
        let inv = Invocation::from_env(command, &env)?;
        super::phases::mark("config");
        match command {
            Command::Add => add(&conf, &inv).map(|()| conf.result()),
            Command::Del => del(&conf, &inv).map(|()| String::new()),
            Command::Check => check(&conf, &inv).map(|()| String::new()),
            Command::Status => status(&conf).map(|()| String::new()),
            Command::Gc | Command::Version => Ok(String::new()),
        }
    })();
    result.map_err(|e| e.in_version(&version))
}

/// Where the kubeconfig is: the node agent's run dir, or the legacy field.
pub fn kubeconfig_path(conf: &NetConf) -> PathBuf {
    if let Some(path) =
        conf.kubernetes.as_ref().and_then(|k| k.kubeconfig.as_deref()).filter(|p| !p.is_empty())
        && conf.cni_agent_run_dir.is_none()
    {
        return PathBuf::from(path);
    }
    Path::new(conf.cni_agent_run_dir.as_deref().unwrap_or(DEFAULT_RUN_DIR)).join(KUBECONFIG_NAME)
}

/// What ADD does for the invocation's pod.
enum Target {
    /// Nothing (not a pod, the agent's own, excluded, not meshed).
    Skip,
    /// A sidecar pod: captured here.
    Sidecar(PodInfo),
    /// An ambient pod: handed to the node agent.
    Ambient(PodInfo),
}

/// The pod this invocation is for, when it is one to capture; `None` with the reason
/// logged otherwise.
fn pod_to_capture(conf: &NetConf, inv: &Invocation) -> Result<Option<PodInfo>, CniError> {
    match target(conf, inv)? {
        Target::Sidecar(pod) => Ok(Some(pod)),
        Target::Skip | Target::Ambient(_) => Ok(None),
    }
}

fn target(conf: &NetConf, inv: &Invocation) -> Result<Target, CniError> {
    let Some((namespace, name)) = inv.pod() else {
        tracing::info!(container = %inv.container_id, "not a Kubernetes pod (no K8S_POD_NAME/K8S_POD_NAMESPACE in CNI_ARGS): nothing to do");
        return Ok(Target::Skip);
    };
    // The node agent's own pods never wait on the kubeconfig they are about to write.
    if conf.pod_namespace.as_deref() == Some(namespace.as_str())
        && (name.starts_with("weir-cni-node") || name.starts_with("istio-cni-node"))
    {
        tracing::info!(pod = %format!("{namespace}/{name}"), "the CNI node agent's own pod: not captured");
        return Ok(Target::Skip);
    }
    if conf.excluded_namespaces().any(|n| n == namespace) {
        tracing::info!(pod = %format!("{namespace}/{name}"), reason = %Skip::ExcludedNamespace, "not captured");
        return Ok(Target::Skip);
    }
    let path = kubeconfig_path(conf);
    let client = KubeClient::load(&path).map_err(|e| {
        CniError::new(
            code::POD_LOOKUP_FAILED,
            format!("cannot use the kubeconfig for pod {namespace}/{name}"),
            crate::error_chain(&e),
        )
    })?;
    // With ambient on, the namespace's labels may decide: read them while the pod is
    // read (one round trip, not two, on every ADD the selector needs them for).
    let runtime = crate::support::runtime::current_thread("the plugin's API reads")
        .map_err(|e| CniError::new(code::IO_FAILURE, "cannot start a runtime", crate::error_chain(&e)))?;
    let (pod, namespace_labels) = if super::ambient::may_read_namespace(conf)? {
        let retries = if conf.enable_ambient_detection_retry {
            NAMESPACE_READ_RETRIES_WITH_DETECTION_RETRY
        } else {
            NAMESPACE_READ_RETRIES
        };
        let (pod, labels) = runtime.block_on(async {
            tokio::join!(
                lookup(&client, &namespace, &name),
                namespace_labels(&client, &namespace, &name, retries)
            )
        });
        (pod?, Some(labels))
    } else {
        (runtime.block_on(lookup(&client, &namespace, &name))?, None)
    };
    super::phases::mark("api");
    if super::ambient::is_ambient(conf, &pod, namespace_labels)? {
        return Ok(Target::Ambient(pod));
    }
    if let Some(reason) = pod::skip_reason(&pod) {
        tracing::info!(pod = %format!("{namespace}/{name}"), reason = %reason, "not captured");
        return Ok(Target::Skip);
    }
    Ok(Target::Sidecar(pod))
}

/// Whether an API error may pass: no answer, a timeout, 429 or a 5xx.
fn transient(e: &KubeError) -> bool {
    match e {
        KubeError::Request { .. } | KubeError::Timeout { .. } => true,
        KubeError::Status { status, .. } => *status == 429 || *status >= 500,
        _ => false,
    }
}

/// GET the pod's namespace's labels, trying again `retries` times what may pass
/// ([`transient`]), [`POD_LOOKUP_INTERVAL`] apart, as istio-cni's ambient check does;
/// the last error otherwise (the caller fails ADD with it when the labels decide).
async fn namespace_labels(
    client: &KubeClient,
    namespace: &str,
    pod: &str,
    retries: u32,
) -> Result<std::collections::BTreeMap<String, String>, KubeError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match client.namespace_labels(namespace).await {
            Ok(labels) => {
                if attempt > 1 {
                    tracing::info!(namespace, pod = %format!("{namespace}/{pod}"), attempt, "namespace read after retrying");
                }
                return Ok(labels);
            }
            Err(e) if transient(&e) && attempt <= retries => {
                // Once: with detection retries on, a long outage would repeat it 30 times.
                if attempt == 1 {
                    tracing::warn!(namespace, pod = %format!("{namespace}/{pod}"), attempt, retries, error = %crate::error_chain(&e), "cannot read the pod's namespace: retrying");
                }
                tokio::time::sleep(POD_LOOKUP_INTERVAL).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// GET the pod, retrying what may pass (no answer, 5xx, 429) as istio-cni does.
async fn lookup(client: &KubeClient, namespace: &str, name: &str) -> Result<PodInfo, CniError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match client.pod(namespace, name).await {
            Ok(pod) => return Ok(pod),
            Err(e) => {
                if !transient(&e) || attempt >= POD_LOOKUP_ATTEMPTS {
                    return Err(CniError::new(
                        code::POD_LOOKUP_FAILED,
                        format!("cannot get pod {namespace}/{name} from the Kubernetes API"),
                        crate::error_chain(&e),
                    ));
                }
                if attempt == 1 {
                    tracing::warn!(pod = %format!("{namespace}/{name}"), error = %crate::error_chain(&e), "Kubernetes API not answering; retrying");
                }
                tokio::time::sleep(POD_LOOKUP_INTERVAL).await;
            }
        }
    }
}

/// The pod's namespace from `CNI_NETNS`: one of the forms a runtime sends, a network
/// namespace, neither the node's nor the plugin's own
/// ([`crate::node::enroll::netns_path`]); the path as given.
fn netns_of(inv: &Invocation) -> Result<PathBuf, CniError> {
    use crate::node::enroll::netns_path::{NetnsPath, NetnsPathError};
    let given = inv.netns.as_deref().unwrap_or_default();
    let bad = |e: NetnsPathError| match &e {
        NetnsPathError::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            CniError::new(
                code::UNKNOWN_CONTAINER,
                format!("network namespace {given} does not exist"),
                format!("container {}", inv.container_id),
            )
        }
        _ => CniError::new(code::INVALID_ENV, format!("CNI_NETNS {given:?} refused"), crate::error_chain(&e)),
    };
    let parsed = NetnsPath::parse(given).map_err(bad)?;
    drop(parsed.open(Path::new("/"), Path::new("/proc")).map_err(bad)?);
    Ok(PathBuf::from(given))
}

fn add(conf: &NetConf, inv: &Invocation) -> Result<(), CniError> {
    let netns = netns_of(inv)?;
    // The pod's namespace is read (addresses; cookie and interfaces for eBPF) by a
    // thread that enters it while the API server answers (only a sidecar pod needs
    // them, and only then their error).
    let (target, facts) = std::thread::scope(|s| {
        let facts = s.spawn(|| {
            crate::capture::ebpf::netns::enter(&netns).map_err(|e| {
                CniError::new(
                    code::IO_FAILURE,
                    format!("cannot enter network namespace {}", netns.display()),
                    e.to_string(),
                )
            })?;
            pod_netns_here(&netns)
        });
        let target = target(conf, inv);
        (target, facts.join())
    });
    match target? {
        Target::Skip => Ok(()),
        Target::Ambient(pod) => super::ambient::hand_over(conf, inv, &pod),
        Target::Sidecar(pod) => {
            let facts = facts.unwrap_or_else(|_| {
                Err(CniError::new(code::IO_FAILURE, "the namespace reader panicked", ""))
            })?;
            super::phases::mark("netns");
            capture_with(conf, &pod, &netns, &facts, &inv.container_id, &inv.ifname)
        }
    }
}

/// Removes Weir's (and Istio's) capture from the namespace: both backends, since DEL
/// is not told which one ADD used, and TPROXY's routes. A missing namespace is done.
fn del(conf: &NetConf, inv: &Invocation) -> Result<(), CniError> {
    // ADD registered under the container id; repair (for pods older than the plugin)
    // under the pod's UID, which every sandbox of the pod shares: repair's record goes
    // only when it is this sandbox's namespace. A late DEL of an earlier sandbox never
    // takes the running one's capture; a record whose namespace is gone is collected.
    let mut ids = vec![inv.container_id.clone()];
    if let Some(uid) = inv.args.get("K8S_POD_UID").filter(|u| !u.is_empty()) {
        let repair_id = repair_container_id_for_uid(uid);
        // CNI_NETNS checked as ADD checks it (a runtime's form, a network namespace, not
        // the node's) before anything enters it.
        let this_sandbox = netns_of(inv).ok().and_then(|n| netns_cookie(Some(&n)).ok());
        let record = PinRecord::load(&super::ebpf::pod_record_name(node_capture(conf), &repair_id));
        if record.is_some_and(|r| Some(r.netns_cookie) == this_sandbox) {
            ids.push(repair_id);
        }
    }
    for id in ids {
        let key = super::ebpf::unregister(node_capture(conf), &id).map_err(ebpf_error(format!(
            "cannot remove the eBPF capture of container {}",
            inv.container_id
        )))?;
        super::node_capture::collect_retired_after(node_capture(conf), key.as_deref()).map_err(
            ebpf_error(format!(
                "cannot remove another build's eBPF capture after container {}",
                inv.container_id
            )),
        )?;
    }
    let netns = match netns_of(inv) {
        Ok(netns) => netns,
        Err(e)
            if e.code == code::UNKNOWN_CONTAINER || inv.netns.as_deref().unwrap_or_default().is_empty() =>
        {
            tracing::info!(container = %inv.container_id, "network namespace already gone: nothing to remove");
            return Ok(());
        }
        Err(e) => {
            tracing::warn!(container = %inv.container_id, error = %e, "nothing removed from a network namespace the plugin refuses");
            return Ok(());
        }
    };
    let cfg = CaptureConfig::default();
    for native_nftables in [false, true] {
        let opts = RunOptions {
            network_namespace: Some(netns.clone()),
            cni_mode: true,
            cleanup_only: true,
            native_nftables,
            ..RunOptions::default()
        };
        weir_iptables::program(&cfg, &opts).map_err(|e| {
            CniError::new(
                code::CAPTURE_FAILED,
                format!("cannot remove capture from {}", netns.display()),
                crate::error_chain(&e),
            )
        })?;
    }
    tracing::info!(netns = %netns.display(), container = %inv.container_id, "capture removed");
    Ok(())
}

fn check(conf: &NetConf, inv: &Invocation) -> Result<(), CniError> {
    if conf.prev_result.is_none() {
        return Err(CniError::new(code::INVALID_CONFIG, "CHECK needs prevResult (the result of ADD)", ""));
    }
    let netns = netns_of(inv)?;
    let Some(pod) = pod_to_capture(conf, inv)? else { return Ok(()) };
    match missing_capture(conf, &pod, &netns, &inv.container_id)? {
        None => Ok(()),
        Some(what) => Err(CniError::new(
            code::CAPTURE_FAILED,
            format!("pod {}/{} is not captured: {what}", pod.namespace, pod.name),
            "",
        )),
    }
}

/// Ready when the kubeconfig the ADDs need is readable.
fn status(conf: &NetConf) -> Result<(), CniError> {
    let path = kubeconfig_path(conf);
    KubeClient::load(&path).map(|_| ()).map_err(|e| {
        CniError::new(code::NOT_AVAILABLE, "the plugin cannot reach Kubernetes yet", crate::error_chain(&e))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(json: &str) -> NetConf {
        NetConf::parse(json.as_bytes()).unwrap()
    }

    #[test]
    fn the_kubeconfig_is_found_where_istio_puts_it() {
        assert_eq!(
            kubeconfig_path(&conf(r#"{"cniVersion":"1.0.0"}"#)),
            PathBuf::from("/var/run/istio-cni/istio-cni-kubeconfig")
        );
        assert_eq!(
            kubeconfig_path(&conf(r#"{"cniVersion":"1.0.0","cni_agent_run_dir":"/run/weir"}"#)),
            PathBuf::from("/run/weir/istio-cni-kubeconfig")
        );
        assert_eq!(
            kubeconfig_path(&conf(
                r#"{"cniVersion":"0.3.1","kubernetes":{"kubeconfig":"/etc/cni/net.d/ZZZ-istio-cni-kubeconfig"}}"#
            )),
            PathBuf::from("/etc/cni/net.d/ZZZ-istio-cni-kubeconfig")
        );
    }

    #[test]
    fn version_needs_nothing_and_bad_input_is_spec_shaped() {
        let v = run(Command::Version, b"", |_| None).unwrap();
        assert!(v.contains("supportedVersions"));
        let e = run(Command::Add, br#"{"cniVersion":"0.4.0","name":"k8s"}"#, |_| None).unwrap_err();
        assert_eq!((e.code, e.cni_version.as_str()), (code::INVALID_ENV, "0.4.0"));
        let env = |k: &str| match k {
            "CNI_CONTAINERID" => Some("c".to_string()),
            "CNI_NETNS" => Some("/var/run/netns/weir-test-nonexistent".to_string()),
            "CNI_IFNAME" => Some("eth0".to_string()),
            _ => None,
        };
        let e = run(Command::Add, br#"{"cniVersion":"1.0.0","name":"k8s"}"#, env).unwrap_err();
        assert_eq!(e.code, code::UNKNOWN_CONTAINER);
        assert!(e.msg.contains("/var/run/netns/weir-test-nonexistent"), "{e}");
        // A path in no form a runtime sends is refused before anything opens it.
        let escape = |k: &str| match k {
            "CNI_NETNS" => Some("/var/run/netns/../../../proc/1/ns/net".to_string()),
            other => env(other),
        };
        let e = run(Command::Add, br#"{"cniVersion":"1.0.0","name":"k8s"}"#, escape).unwrap_err();
        assert_eq!(e.code, code::INVALID_ENV, "{e}");
        assert!(e.msg.contains("CNI_NETNS") && e.details.contains("expected /var/run/netns/<name>"), "{e}");
        // DEL of a namespace that is gone is success.
        assert_eq!(run(Command::Del, br#"{"cniVersion":"1.0.0","name":"k8s"}"#, env), Ok(String::new()));
        let e = run(Command::Check, br#"{"cniVersion":"1.0.0","name":"k8s"}"#, env).unwrap_err();
        assert!(e.msg.contains("prevResult"), "{e}");
    }
}
