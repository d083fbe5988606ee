//! Capturing one pod inside its network namespace, and telling whether it is captured:
//! what ADD and CHECK (`plugin`) and repair (`repair`) share. The backend comes from
//! the plugin's config (`capture_mode`, Istio's `native_nftables`): eBPF registers the
//! pod with the node's pinned capture, netfilter goes through weir-iptables in CNI mode;
//! where the node capture's cgroup sits below programs that make eBPF capture unsafe
//! (`capture::ebpf::ancestors`), `auto` gives a new pod netfilter, naming why.
//! Also the container id a repaired pod is registered under, which DEL must find.

use std::{net::IpAddr, path::Path};

use weir_iptables::{CaptureConfig, RunOptions, state::Verdict};

use crate::capture::ebpf::netns::NetnsFacts;

use super::{
    pod::{self, PodInfo},
    spec::{CniError, NetConf, code},
};

/// Which backend captures the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureMode {
    Ebpf,
    Iptables,
    Nftables,
}

impl CaptureMode {
    /// `capture_mode` (Weir's) and `native_nftables` (Istio's). `auto` picks eBPF when
    /// the node capture is attached, else native nftables when Istio's flag asks for
    /// it, else iptables, Istio's default.
    pub fn from_conf(conf: &NetConf) -> Result<Self, CniError> {
        match conf.capture_mode.as_deref().unwrap_or("auto") {
            "iptables" => Ok(Self::Iptables),
            "nftables" => Ok(Self::Nftables),
            "ebpf" => Ok(Self::Ebpf),
            "auto" if super::ebpf::node_captures_with_ebpf(node_capture(conf)) => Ok(Self::Ebpf),
            "auto" if conf.native_nftables => Ok(Self::Nftables),
            "auto" => Ok(Self::Iptables),
            other => Err(CniError::new(
                code::INVALID_CONFIG,
                format!("capture_mode {other:?} is not a capture mode"),
                "expected ebpf, nftables, iptables or auto",
            )),
        }
    }
}

/// The node's eBPF capture name.
pub(super) fn node_capture(conf: &NetConf) -> &str {
    conf.ebpf_node_capture.as_deref().unwrap_or(super::ebpf::DEFAULT_NODE_CAPTURE)
}

pub(super) fn ebpf_error(what: String) -> impl FnOnce(super::ebpf::CniEbpfError) -> CniError {
    move |e| CniError::new(code::CAPTURE_FAILED, what, crate::error_chain(&e))
}

/// What capture reads inside the pod's network namespace (its addresses; for eBPF
/// also its cookie and interfaces), in one visit.
pub fn pod_netns(netns: &Path) -> Result<NetnsFacts, CniError> {
    NetnsFacts::read(netns).map_err(netns_error(netns))
}

/// [`pod_netns`] from a thread already inside the namespace.
pub fn pod_netns_here(netns: &Path) -> Result<NetnsFacts, CniError> {
    NetnsFacts::read_here().map_err(netns_error(netns))
}

fn netns_error(netns: &Path) -> impl FnOnce(std::io::Error) -> CniError + '_ {
    move |e| {
        CniError::new(
            code::IO_FAILURE,
            format!("cannot read the addresses in network namespace {}", netns.display()),
            e.to_string(),
        )
    }
}

/// The capture config and run options for `pod` in `netns`, whose addresses are
/// `addresses`.
fn plan(
    conf: &NetConf,
    pod: &PodInfo,
    netns: &Path,
    addresses: &[IpAddr],
) -> Result<(CaptureMode, CaptureConfig, RunOptions), CniError> {
    let mode = for_user_namespace(conf, CaptureMode::from_conf(conf)?, pod, netns)?;
    let dual_stack = pod
        .proxy_env
        .get("ISTIO_DUAL_STACK")
        .and_then(|v| weir_iptables::flags::parse_bool(v))
        .unwrap_or(false);
    let (host_ip, enable_ipv6) = match weir_iptables::detect::local_ip(addresses, dual_stack) {
        Some((ip, v6)) => (Some(ip), v6),
        None => (None, false),
    };
    let cfg = pod::capture_config(pod, enable_ipv6).map_err(|e| {
        CniError::new(
            code::INVALID_POD,
            format!("pod {}/{} cannot be captured", pod.namespace, pod.name),
            e.to_string(),
        )
    })?;
    let opts = RunOptions {
        network_namespace: Some(netns.into()),
        cni_mode: true,
        native_nftables: mode == CaptureMode::Nftables,
        host_ip,
        ..RunOptions::default()
    };
    Ok((mode, cfg, opts))
}

/// The backend for a pod whose network namespace belongs to a user namespace of its
/// own (`hostUsers: false`). Neither eBPF nor iptables can capture it: eBPF programs
/// see the node's user ids (Envoy's 1337 is another id there), and iptables' owner
/// match refuses rules written from outside the pod's user namespace (EINVAL). Native
/// nftables matches ids as the pod sees them: `auto` picks it, with the reason logged;
/// an explicit `ebpf` or `iptables` is an error naming why.
fn for_user_namespace(
    conf: &NetConf,
    mode: CaptureMode,
    pod: &PodInfo,
    netns: &Path,
) -> Result<CaptureMode, CniError> {
    if mode == CaptureMode::Nftables {
        return Ok(mode);
    }
    let own = !crate::capture::ebpf::netns::owned_by_this_user_namespace(netns).map_err(|e| {
        CniError::new(
            code::IO_FAILURE,
            format!("cannot read the owner of {}", netns.display()),
            e.to_string(),
        )
    })?;
    if !own {
        return Ok(mode);
    }
    let who = format!("{}/{}", pod.namespace, pod.name);
    let why = "its network namespace belongs to a user namespace of its own (hostUsers: false)";
    match conf.capture_mode.as_deref().unwrap_or("auto") {
        "auto" => {
            tracing::warn!(pod = %who, reason = why, backend = "nftables", "captured with native nftables: neither eBPF nor iptables can capture such a pod");
            Ok(CaptureMode::Nftables)
        }
        chosen => Err(CniError::new(
            code::INVALID_POD,
            format!("pod {who} cannot be captured with capture_mode {chosen}"),
            format!(
                "{why}: eBPF programs see the node's user ids, and iptables' owner match refuses rules written \
                 from outside the pod's user namespace; capture_mode nftables (or auto) captures it"
            ),
        )),
    }
}

/// The backend for a pod planned for eBPF when the ancestors of the node capture's
/// cgroup run programs that make eBPF capture unsafe (`capture::ebpf::ancestors`):
/// `auto` picks netfilter (native nftables when Istio's flag asks for it), logging the
/// program, its cgroup and why; an explicit `ebpf` is an error in the same words. A pod
/// registered with eBPF already keeps it (netfilter on top would capture it twice).
fn for_ancestors(conf: &NetConf, who: &str, netns: &Path) -> Result<CaptureMode, CniError> {
    let node = node_capture(conf);
    let Err(e) = super::ebpf::check_node_ancestors(node) else { return Ok(CaptureMode::Ebpf) };
    let why = crate::error_chain(&e);
    if conf.capture_mode.as_deref() == Some("ebpf") {
        return Err(CniError::new(
            code::CAPTURE_FAILED,
            format!("pod {who} cannot be captured with capture_mode ebpf"),
            why,
        ));
    }
    let registered = super::ebpf::registered_in_any_set(netns)
        .map_err(ebpf_error(format!("cannot check the eBPF registrations of {}", netns.display())))?;
    if registered {
        tracing::warn!(pod = %who, reason = %why, "the pod is captured by eBPF already: kept");
        return Ok(CaptureMode::Ebpf);
    }
    let mode = if conf.native_nftables { CaptureMode::Nftables } else { CaptureMode::Iptables };
    tracing::warn!(pod = %who, reason = %why, backend = ?mode, "captured with netfilter: eBPF capture is unsafe here");
    Ok(mode)
}

/// Captures `pod` inside `netns` with the configured backend (repair, for pods that
/// started before the plugin was installed; ADD reads the addresses itself, while it
/// waits for the API server, and calls [`capture_with`]).
pub fn capture(
    conf: &NetConf,
    pod: &PodInfo,
    netns: &Path,
    container_id: &str,
    ifname: &str,
) -> Result<(), CniError> {
    capture_with(conf, pod, netns, &pod_netns(netns)?, container_id, ifname)
}

/// [`capture`], with the namespace read already.
pub fn capture_with(
    conf: &NetConf,
    pod: &PodInfo,
    netns: &Path,
    facts: &NetnsFacts,
    container_id: &str,
    ifname: &str,
) -> Result<(), CniError> {
    let (mut mode, cfg, mut opts) = plan(conf, pod, netns, &facts.addresses)?;
    let who = format!("{}/{}", pod.namespace, pod.name);
    super::phases::mark("plan");
    if mode == CaptureMode::Ebpf {
        mode = for_ancestors(conf, &who, netns)?;
        opts.native_nftables = mode == CaptureMode::Nftables;
        super::phases::mark("ancestors");
    }
    if mode == CaptureMode::Ebpf {
        let node = node_capture(conf);
        let identity = super::ebpf::PodIdentity { name: who.clone(), uid: pod.uid.clone() };
        match super::ebpf::register(node, container_id, netns, ifname, &cfg, &identity, facts) {
            Ok(cookie) => {
                super::phases::mark("capture");
                tracing::info!(pod = %who, netns = %netns.display(), backend = "ebpf", node_capture = node, netns_cookie = cookie, "pod captured");
                return Ok(());
            }
            Err(super::ebpf::CniEbpfError::Config(e)) => {
                // A limit of eBPF capture, named after the pod's annotation.
                let annotation = pod::annotation_for_flag(e.input).unwrap_or(e.input);
                return Err(CniError::new(
                    code::INVALID_POD,
                    format!("pod {who} cannot be captured with eBPF"),
                    format!("pod annotation {annotation} (istio-iptables {}): {}", e.input, e.problem),
                ));
            }
            Err(e) => {
                return Err(
                    ebpf_error(format!("cannot capture pod {who} with eBPF in {}", netns.display()))(e),
                );
            }
        }
    }
    let report = weir_iptables::program(&cfg, &opts).map_err(|e| {
        CniError::new(
            code::CAPTURE_FAILED,
            format!("cannot capture pod {who} in {}", netns.display()),
            crate::error_chain(&e),
        )
    })?;
    super::phases::mark("capture");
    tracing::info!(
        pod = %who,
        netns = %netns.display(),
        backend = %report.backend,
        path = %report.path,
        action = ?report.action,
        mode = %cfg.interception_mode,
        "pod captured"
    );
    Ok(())
}

/// Whether `pod` is captured in `netns` as configured: `Ok(None)` when it is, else
/// what is missing (CHECK's answer, repair's test).
pub fn missing_capture(
    conf: &NetConf,
    pod: &PodInfo,
    netns: &Path,
    container_id: &str,
) -> Result<Option<String>, CniError> {
    let (mode, cfg, opts) = plan(conf, pod, netns, &pod_netns(netns)?.addresses)?;
    let node = node_capture(conf);
    // Its record, or, with records lost, its namespace in any set's maps.
    let registered = registered_container(conf, pod, netns).is_some()
        || super::ebpf::registered_in_any_set(netns)
            .map_err(ebpf_error(format!("cannot check the eBPF registrations of {}", netns.display())))?;
    let who = format!("{}/{}", pod.namespace, pod.name);
    if mode == CaptureMode::Ebpf || registered {
        let what = format!("cannot check the eBPF capture in {}", netns.display());
        let gap = super::ebpf::capture_gap(node, container_id, &pod.uid, netns).map_err(ebpf_error(what))?;
        return match (gap, mode == CaptureMode::Ebpf, registered) {
            (None, _, _) => Ok(None),
            // Registered with eBPF, planned for netfilter (capture_mode changed): adding
            // rules on top would capture each connection twice.
            (Some(gap), false, _) => Err(CniError::new(
                code::CAPTURE_FAILED,
                format!("pod {who} is registered with eBPF capture but capture_mode plans {mode:?}"),
                format!("{gap}; not adding netfilter capture on top of it (weir capture status shows it)"),
            )),
            (Some(gap), true, true) => Ok(Some(gap)),
            // Not registered: netfilter rules already there capture it (istio-init's,
            // an earlier pass's, or ADD's when unsafe ancestors gave it netfilter:
            // read with the backend ADD would have used); registering it too would
            // capture twice.
            (Some(gap), true, false) => match netfilter_verdict(
                &cfg,
                &RunOptions { native_nftables: conf.native_nftables, ..opts.clone() },
                netns,
            )? {
                Verdict::Clean => Ok(Some(gap)),
                Verdict::Applied => Ok(None),
                Verdict::Drifted => Err(CniError::new(
                    code::CAPTURE_FAILED,
                    format!("pod {who} has netfilter capture rules that differ from the plan"),
                    format!("{gap}; not registering it with eBPF on top of them"),
                )),
            },
        };
    }
    Ok(match netfilter_verdict(&cfg, &opts, netns)? {
        Verdict::Applied => None,
        Verdict::Clean => Some(format!("no capture rules in {}", netns.display())),
        Verdict::Drifted => {
            Some(format!("the capture rules in {} differ from the planned ones", netns.display()))
        }
    })
}

fn netfilter_verdict(cfg: &CaptureConfig, opts: &RunOptions, netns: &Path) -> Result<Verdict, CniError> {
    weir_iptables::apply::verify(cfg, opts).map_err(|e| {
        CniError::new(
            code::CAPTURE_FAILED,
            format!("cannot check capture in {}", netns.display()),
            crate::error_chain(&e),
        )
    })
}

/// The container id `pod` in `netns` is registered under with the eBPF node capture,
/// if it is (ADD's, or repair's).
pub fn registered_container(conf: &NetConf, pod: &PodInfo, netns: &Path) -> Option<String> {
    super::ebpf::pod_record(node_capture(conf), &pod.uid, netns).ok().flatten().and_then(|r| r.container)
}

/// The container id repair registers under (eBPF records are keyed by it).
pub fn repair_container_id(pod: &PodInfo) -> String {
    if pod.uid.is_empty() {
        format!("repair-{}-{}", pod.namespace, pod.name)
    } else {
        repair_container_id_for_uid(&pod.uid)
    }
}

/// What DEL (which knows `K8S_POD_UID`) looks for besides its container id.
pub fn repair_container_id_for_uid(uid: &str) -> String {
    format!("repair-{uid}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(json: &str) -> NetConf {
        NetConf::parse(json.as_bytes()).unwrap()
    }

    #[test]
    fn the_capture_mode_comes_from_weirs_field_or_istios() {
        assert_eq!(CaptureMode::from_conf(&conf(r#"{"cniVersion":"1.0.0"}"#)), Ok(CaptureMode::Iptables));
        assert_eq!(
            CaptureMode::from_conf(&conf(r#"{"cniVersion":"1.0.0","native_nftables":true}"#)),
            Ok(CaptureMode::Nftables)
        );
        assert_eq!(
            CaptureMode::from_conf(&conf(r#"{"cniVersion":"1.0.0","capture_mode":"nftables"}"#)),
            Ok(CaptureMode::Nftables)
        );
        let e =
            CaptureMode::from_conf(&conf(r#"{"cniVersion":"1.0.0","capture_mode":"magic"}"#)).unwrap_err();
        assert_eq!(e.code, code::INVALID_CONFIG);
    }
}
