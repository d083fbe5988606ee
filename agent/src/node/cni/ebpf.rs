//! eBPF capture from the CNI plugin. The node side (`weir cni install
//! --ebpf-cgroup`, [`super::node_capture`]) links the node program set (`ebpf::set`,
//! loaded once per node) to the cgroup that holds the node's pods and pins the links
//! (`<bpffs>/weir/<node capture>/links`); each ADD then registers the pod's network-namespace cookie with
//! its capture config in the set's maps and attaches the set's inbound classifier to
//! the pod's interface, DEL unregisters it (from a record, so it works after the
//! namespace is gone), CHECK looks it up. Nothing is loaded per pod.
//!
//! Capture outlives the node agent: nothing here runs when the agent stops. When the
//! agent of another Weir build takes over a node (an upgrade, a rollback), the set the
//! node capture ran is kept attached as `<node>-set-<key>` for the pods registered
//! with it, which stay captured by it until they go; the set and its links go with its
//! last pod ([`super::node_capture::collect_retired`]). Taking capture away from running
//! pods is only ever [`super::node_capture::detach_node`], which `weir cni uninstall --detach-running-pods` asks for.

use std::path::{Path, PathBuf};

use weir_iptables::CaptureConfig;

use crate::capture::ebpf::{
    capture::MapSet,
    config::{EbpfOptions, PodCapture},
    health,
    netns::{NetnsFacts, netns_cookie, owned_by_this_user_namespace},
    record::{PinRecord, RECORD_DIR},
    registration::Registration,
    set::{self, NodePrograms, PodInterface},
};

/// The node capture's default name (its pins and record).
pub const DEFAULT_NODE_CAPTURE: &str = "cni-node";

#[derive(Debug, thiserror::Error)]
pub enum CniEbpfError {
    #[error(
        "no eBPF node capture named {name} is attached (run `weir cni install --ebpf-cgroup <the pods' cgroup>` on this node)"
    )]
    NoNodeCapture { name: String },
    #[error("the node capture {name} is attached to {existing}, not {wanted}")]
    OtherCgroup { name: String, existing: PathBuf, wanted: PathBuf },
    #[error(
        "the node capture {name} runs the eBPF programs of another Weir build ({attached}; this one is {this}), \
         and this build's programs are not attached on this node: the node agent of this build has not started here yet"
    )]
    OtherVersion { name: String, attached: String, this: String },
    #[error(
        "the node capture {name} has pins under {} ({record} under {RECORD_DIR}) that are not a capture of {} Weir can take up: \
         {why}. They are left attached and this agent does not start. `weir cni uninstall --ebpf-name {name} --ebpf-cgroup {} \
         --detach-running-pods` removes them (and capture from the pods that use them); then start again",
        dir.display(), cgroup.display(), cgroup.display()
    )]
    PinsRefused { name: String, dir: PathBuf, cgroup: PathBuf, record: &'static str, why: String },
    #[error(
        "the cgroup {} is captured already by the node capture {other} (links {hooks} pinned under {}): a second node \
         capture there would run every hook twice. Start with --ebpf-name {other} to take that capture up, or remove it with \
         `weir cni uninstall --ebpf-name {other} --ebpf-cgroup {} --detach-running-pods` (which takes capture away from its pods)",
        cgroup.display(), dir.display(), cgroup.display()
    )]
    OtherName { name: String, other: String, dir: PathBuf, cgroup: PathBuf, hooks: String },
    #[error(
        "the pod's network namespace {netns} belongs to a user namespace of its own (hostUsers: false): eBPF \
         capture tells Envoy's connections apart by user id as the node sees it, which differs there"
    )]
    UserNamespace { netns: PathBuf },
    /// What the ancestors of the node capture's cgroup run makes eBPF capture of new
    /// pods unsafe, or could not be read (`capture::ebpf::ancestors`).
    #[error("eBPF capture through the node capture {node} is refused: {reason}")]
    Ancestors { node: String, reason: Box<crate::capture::ebpf::ancestors::AncestorError> },
    #[error(transparent)]
    Ebpf(Box<crate::capture::ebpf::EbpfError>),
    #[error(transparent)]
    Config(#[from] crate::capture::ebpf::config::EbpfConfigError),
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl From<crate::capture::ebpf::EbpfError> for CniEbpfError {
    fn from(e: crate::capture::ebpf::EbpfError) -> Self {
        Self::Ebpf(Box::new(e))
    }
}

pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CniEbpfError {
    let what = what.into();
    move |source| CniEbpfError::Io { what, source }
}

/// Whether the node capture `name` is pinned (what `auto` mode looks for).
pub fn node_capture_present(name: &str) -> bool {
    PinRecord::load(name).is_some_and(|r| r.pin_dir().join("links").exists())
}

/// Whether this node captures pods with eBPF: its node capture is attached, or a set
/// of another build is kept attached for its pods. True throughout a node capture's
/// replacement (a rollout moves the old one aside before the new one is attached), so
/// `auto` does not resolve to netfilter mid-way. Which pods are registered already is
/// asked per pod ([`registered_in_any_set`]): with the node capture refused, new pods
/// still get netfilter capture.
pub fn node_captures_with_ebpf(name: &str) -> bool {
    if node_capture_present(name) {
        return true;
    }
    let retired = format!("{name}-set-");
    PinRecord::load_all().iter().any(|r| r.pod.starts_with(&retired) && r.pin_dir().join("links").exists())
}

/// Whether the namespace at `netns` is registered in any program set pinned on this
/// node, of any build, whatever the records say (they may be lost: another `/run/weir`,
/// a cleaned `/run`). Read raw (its cookie as the key of each set's `POD_CONFIG`), so
/// another build's layout does not matter. A set whose map cannot be read is an error,
/// never "not registered".
pub fn registered_in_any_set(netns: &Path) -> Result<bool, CniEbpfError> {
    let keys = set::pinned_keys();
    if keys.is_empty() {
        return Ok(false);
    }
    let cookie = crate::capture::ebpf::netns::netns_cookie(Some(netns))
        .map_err(io("read the pod namespace's cookie"))?;
    for key in keys {
        let path = set::set_dir(&key).join("maps").join(weir_ebpf_common::capture::map::POD_CONFIG);
        if !path.exists() {
            continue;
        }
        let map =
            crate::capture::ebpf::link::obj_get(&path).map_err(io("open a program set's POD_CONFIG"))?;
        let found =
            crate::capture::ebpf::sys::lookup_raw(std::os::fd::AsFd::as_fd(&map), &cookie.to_ne_bytes())
                .map_err(io("read a program set's POD_CONFIG"))?;
        if found.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Refuses eBPF capture of new pods through node capture `name` where the ancestors
/// of its cgroup run programs that make it unsafe (a flagless, overridable or
/// pre-order one: `capture::ebpf::ancestors`), naming the program, its cgroup and why.
/// The order is read from the node capture's own links on its cgroup (one missing is
/// an error, never a probe attached per ADD); a record that cannot be read is an error.
pub fn check_node_ancestors(name: &str) -> Result<(), CniEbpfError> {
    let (record, _) = node_record(name)?;
    let hooks = crate::capture::ebpf::capture::cgroup_hook_types();
    crate::capture::ebpf::ancestors::check(
        &record.cgroup,
        &hooks,
        crate::capture::ebpf::ancestors::Probe::Own,
    )
    .map_err(|e| CniEbpfError::Ancestors { node: name.into(), reason: Box::new(e) })
}

/// The name a set of another build keeps while pods registered with it remain.
pub fn retired_name(node: &str, key: &str) -> String {
    format!("{node}-set-{key}")
}

/// The attachment this build registers pods with: the node capture when it runs this
/// build's set, else this build's set kept attached under its retired name (during a
/// rollout, before this build's agent took the node over, or after it was rolled back).
fn node_record(name: &str) -> Result<(PinRecord, String), CniEbpfError> {
    let record = PinRecord::load(name)
        .filter(|r| r.pin_dir().join("links").exists())
        .ok_or_else(|| CniEbpfError::NoNodeCapture { name: name.into() })?;
    let this = set::version_key();
    if record.programs.as_deref() == Some(this.as_str()) {
        return Ok((record, this));
    }
    if let Some(retired) =
        PinRecord::load(&retired_name(name, &this)).filter(|r| r.pin_dir().join("links").exists())
    {
        return Ok((retired, this));
    }
    Err(CniEbpfError::OtherVersion {
        name: name.into(),
        attached: record.programs.clone().unwrap_or_else(|| "programs of its own".into()),
        this,
    })
}

/// The pods registered through node capture `name` (their records).
pub fn pod_records(name: &str) -> Vec<PinRecord> {
    let prefix = pod_prefix(name);
    PinRecord::load_all().into_iter().filter(|r| r.pod.starts_with(&prefix)).collect()
}

pub(crate) fn pod_prefix(node: &str) -> String {
    format!("{node}-pod-")
}

/// The record name for a container's registration.
pub(crate) fn pod_record_name(node: &str, container_id: &str) -> String {
    let short: String = container_id.chars().filter(char::is_ascii_alphanumeric).take(32).collect();
    format!("{}{short}", pod_prefix(node))
}

/// The Kubernetes pod a registration is for (CNI_ARGS, or the API).
#[derive(Debug, Clone, Default)]
pub struct PodIdentity {
    /// `namespace/name`.
    pub name: String,
    pub uid: String,
}

/// ADD: registers the pod in the node program set's maps and attaches inbound
/// capture to `ifname` in `netns`. A container registered already (the runtime retried
/// ADD, or repair) is registered again in place, in one switch; one registered by
/// another build's set is registered in this set first, and only then taken out of the
/// other (the two sets' programs agree while both know it: the second sees a connection
/// the first redirected as bound for loopback). A failure never leaves a pod that was
/// captured less captured than before.
pub fn register(
    node: &str,
    container_id: &str,
    netns: &Path,
    ifname: &str,
    cfg: &CaptureConfig,
    who: &PodIdentity,
    facts: &NetnsFacts,
) -> Result<u64, CniEbpfError> {
    check_user_namespace(netns)?;
    let pod = PodCapture::new(cfg, facts.own_addresses(), EbpfOptions::default())?;
    let target = Target {
        record: pod_record_name(node, container_id),
        container: Some(container_id),
        netns,
        recorded_netns: Some(netns),
        ifname,
    };
    register_capture(node, &target, &pod, who, facts)
}

/// An ambient pod, registered by the node agent for ztunnel
/// ([`PodCapture::ambient`]), under its UID. `netns` is where the agent reaches the
/// namespace now; `recorded_netns` a path that names it for later (the plugin's),
/// if there is one. Its interface is the one holding one of its addresses.
pub fn register_ambient(
    node: &str,
    netns: &Path,
    recorded_netns: Option<&Path>,
    cfg: &weir_iptables::ambient::InpodConfig,
    who: &PodIdentity,
) -> Result<u64, CniEbpfError> {
    if who.uid.is_empty() {
        return Err(crate::capture::ebpf::config::EbpfConfigError {
            input: "the pod's UID",
            problem: "empty: an ambient pod's registration is named after it".into(),
        }
        .into());
    }
    check_user_namespace(netns)?;
    let facts = read_facts(netns)?;
    let own = facts.own_addresses();
    let ifname = interface_holding(netns, &facts, &own)?;
    let pod = PodCapture::ambient(cfg, own)?;
    let record = ambient_record_name(node, &who.uid);
    if let Some(cookie) =
        registered_as_wanted(node, &record, netns, ifname.as_str(), &pod, cookie_of(netns, &facts)?)?
    {
        return Ok(cookie);
    }
    check_node_ancestors(node)?;
    let target = Target { record, container: None, netns, recorded_netns, ifname: &ifname };
    register_capture(node, &target, &pod, who, &facts)
}

/// Takes an ambient pod's registration away (idempotent); `netns`, when the namespace
/// is still there, lets its inbound filter be detached too.
pub fn unregister_ambient(node: &str, uid: &str, netns: Option<&Path>) -> Result<bool, CniEbpfError> {
    let Some(mut record) = PinRecord::load(&ambient_record_name(node, uid)) else { return Ok(false) };
    if let Some(path) = netns {
        record.netns = Some(path.into());
    }
    record.remove()?;
    Ok(true)
}

/// Whether the ambient pod `uid` is registered through node capture `node` under
/// namespace `netns`, and its capture is whole.
pub fn ambient_registered(node: &str, uid: &str, netns: &Path) -> Result<bool, CniEbpfError> {
    let Some(record) = PinRecord::load(&ambient_record_name(node, uid)) else { return Ok(false) };
    let cookie = netns_cookie(Some(netns))
        .map_err(io(format!("read the network namespace cookie of {}", netns.display())))?;
    if cookie != record.netns_cookie || !is_registered(&record)? {
        return Ok(false);
    }
    Ok(health::faults(&record, &PinRecord::load_all()).is_empty())
}

/// Whether the ambient pod `uid` has a registration record with node capture `node`
/// (whole or not).
pub fn ambient_record_exists(node: &str, uid: &str) -> bool {
    PinRecord::load(&ambient_record_name(node, uid)).is_some()
}

/// The record name of an ambient pod's registration (its UID; pods have no container
/// id at the agent).
pub(crate) fn ambient_record_name(node: &str, uid: &str) -> String {
    let short: String = uid.chars().filter(char::is_ascii_alphanumeric).take(32).collect();
    format!("{}ambient-{short}", pod_prefix(node))
}

fn check_user_namespace(netns: &Path) -> Result<(), CniEbpfError> {
    if !owned_by_this_user_namespace(netns).map_err(io(format!("read the owner of {}", netns.display())))? {
        return Err(CniEbpfError::UserNamespace { netns: netns.into() });
    }
    Ok(())
}

/// The namespace's cookie, as read with its facts; where that read failed, read again
/// for the kernel's reason.
fn cookie_of(netns: &Path, facts: &NetnsFacts) -> Result<u64, CniEbpfError> {
    match facts.cookie {
        Some(cookie) => Ok(cookie),
        None => netns_cookie(Some(netns))
            .map_err(io(format!("read the network namespace cookie of {}", netns.display()))),
    }
}

/// The pod's namespace as registration needs it, read in one visit.
pub fn read_facts(netns: &Path) -> Result<NetnsFacts, CniEbpfError> {
    NetnsFacts::read(netns).map_err(io(format!("read the network namespace {}", netns.display())))
}

/// The pod's one interface that is up (besides `lo`), which must hold one of `addresses`. The
/// inbound classifier is attached to one interface: a pod with more (Multus) is
/// refused, naming them, and `auto` gives it the in-pod rules, which capture on every
/// interface.
fn interface_holding(
    netns: &Path,
    facts: &NetnsFacts,
    addresses: &[std::net::IpAddr],
) -> Result<String, CniEbpfError> {
    // Interfaces that are up: a namespace also holds the fallback devices of tunnel
    // modules (tunl0, sit0, ...), down and unused.
    let mut names: Vec<&str> =
        facts.interfaces.iter().filter(|i| i.up && i.name != "lo").map(|i| i.name.as_str()).collect();
    names.sort_unstable();
    if names.len() > 1 {
        return Err(crate::capture::ebpf::config::EbpfConfigError {
            input: "the pod's interfaces",
            problem: format!(
                "{} besides lo ({}); eBPF inbound capture is attached to one (the in-pod rules capture this pod)",
                names.len(),
                names.join(", ")
            ),
        }
        .into());
    }
    facts
        .interfaces
        .iter()
        .find(|i| i.addresses.iter().any(|a| addresses.contains(a)))
        .map(|i| i.name.clone())
        .ok_or_else(|| CniEbpfError::Io {
            what: format!("find the pod's interface in {}", netns.display()),
            source: std::io::Error::other(format!("no interface holds any of {addresses:?}")),
        })
}

/// The pod's cookie if record `name` registers it in this build's set under `netns`
/// with exactly `pod`'s capture config and inbound config already (the watch and the
/// plugin add a pod more than once): then only the inbound filter is made sure of
/// (kept if there), and the set's lock and map writes are spared.
fn registered_as_wanted(
    node: &str,
    name: &str,
    netns: &Path,
    ifname: &str,
    pod: &PodCapture,
    cookie: u64,
) -> Result<Option<u64>, CniEbpfError> {
    let Some(record) = PinRecord::load(name) else { return Ok(None) };
    let (_, key) = node_record(node)?;
    if record.netns_cookie != cookie
        || record.programs.as_deref() != Some(key.as_str())
        || record.interface.as_deref() != pod.inbound.map(|_| ifname)
    {
        return Ok(None);
    }
    let dir = set::set_dir(&key);
    let registered = MapSet::open_pinned(&dir)?.pod_config(cookie)?;
    if !registered.is_some_and(|c| crate::capture::ebpf::config::same_capture(&c, &pod.config)) {
        return Ok(None);
    }
    let inbound = crate::capture::ebpf::inbound::pod_config(&dir, &record.pin_dir(), cookie)?;
    if inbound != pod.inbound {
        return Ok(None);
    }
    if pod.inbound.is_some() {
        let Some(classifier) = crate::capture::ebpf::inbound::NodeClassifier::pinned(&dir) else {
            return Ok(None);
        };
        classifier.attach_reopen(netns, cookie, &record.pin_dir())?;
        classifier.attach(netns, cookie, ifname)?;
    }
    Ok(Some(cookie))
}

/// Where one registration goes.
struct Target<'a> {
    /// The capture record's name.
    record: String,
    container: Option<&'a str>,
    /// The namespace, reachable now.
    netns: &'a Path,
    /// The path the record keeps (None: none that lasts).
    recorded_netns: Option<&'a Path>,
    ifname: &'a str,
}

fn register_capture(
    node: &str,
    target: &Target<'_>,
    pod: &PodCapture,
    who: &PodIdentity,
    facts: &NetnsFacts,
) -> Result<u64, CniEbpfError> {
    let Target { netns, ifname, .. } = *target;
    let (node_record, key) = node_record(node)?;
    let cookie = cookie_of(netns, facts)?;
    let name = target.record.clone();
    let mut record = PinRecord {
        pod: name.clone(),
        cgroup: node_record.cgroup.clone(),
        // A registration again without a lasting path keeps the one recorded before.
        netns: target.recorded_netns.map(PathBuf::from).or_else(|| {
            PinRecord::load(&target.record).filter(|old| old.netns_cookie == cookie).and_then(|old| old.netns)
        }),
        netns_cookie: cookie,
        interface: pod.inbound.map(|_| ifname.to_string()),
        programs: Some(key.clone()),
        registration: None,
        k8s_pod: (!who.name.is_empty()).then(|| who.name.clone()),
        pod_uid: (!who.uid.is_empty()).then(|| who.uid.clone()),
        container: target.container.map(String::from),
    };
    let mut set = NodePrograms::open_existing(&key)?
        .ok_or_else(|| CniEbpfError::NoNodeCapture { name: node.into() })?;
    let (previous, other_build) = match PinRecord::load(&name) {
        Some(old) if old.netns_cookie == cookie && old.programs == record.programs => {
            (old.registration, None)
        }
        // The same pod in another build's set: moved once this set captures it (never
        // taken out first: a failure here leaves it captured by the other set).
        Some(old) if old.netns_cookie == cookie => (None, Some(old)),
        // Another namespace under this container id, or no way to hold both: nothing of
        // this pod to keep.
        Some(old) => {
            old.remove()?;
            (None, None)
        }
        None => (None, None),
    };
    // Registered already without a record this call can see (a record lost): captured
    // before this call, so never unregistered by its undo.
    let was_captured =
        previous.is_some() || other_build.is_some() || set.maps().pod_config(cookie)?.is_some();
    let interface = PodInterface { netns, name: ifname, mac: facts.mac(ifname).ok() };
    let registration = set.register(cookie, pod, Some(interface), previous.as_ref())?;
    // After the switch: a failure takes back a new pod's registration, and leaves a pod
    // that was captured before captured (its new registration, or the other build's).
    let undo = |set: &mut NodePrograms, registration: &Registration| {
        if !was_captured {
            let _ = set.unregister(cookie, Some(registration));
        }
    };
    if let Err(e) = set.attach_inbound(netns, cookie, ifname, pod, &record.pin_dir()) {
        undo(&mut set, &registration);
        return Err(e.into());
    }
    if let Some(old) = other_build {
        // With a node classifier, its filter was replaced by this set's: its maps, pins
        // and record go. Without one, the pod's own inbound copy pinned under the same
        // folder stays (this set kept it): only its registration goes.
        let removed = if set.has_node_classifier() {
            PinRecord { interface: None, ..old }.remove()
        } else {
            old.remove_registration()
        };
        if let Err(e) = removed {
            tracing::warn!(capture = %name, error = %crate::error_chain(&e), "the pod's registration in another build's set not wholly removed");
        }
    }
    record.registration = Some(registration);
    if let Err(e) = record.save() {
        undo(&mut set, record.registration.as_ref().expect("set above"));
        return Err(io("write the pod's capture record")(e));
    }
    Ok(cookie)
}

/// DEL: unregisters the container's pod (idempotent; works without the namespace).
/// Returns the program set it was registered in: when that is another build's kept for
/// its pods, [`super::node_capture::collect_retired`] removes it with its last pod.
pub fn unregister(node: &str, container_id: &str) -> Result<Option<String>, CniEbpfError> {
    let Some(record) = PinRecord::load(&pod_record_name(node, container_id)) else { return Ok(None) };
    record.remove()?;
    Ok(record.programs)
}

/// The pod with UID `uid` as registered through node capture `node` for namespace
/// `netns` (ADD's record, or repair's), whether or not its capture is whole.
pub fn pod_record(node: &str, uid: &str, netns: &Path) -> Result<Option<PinRecord>, CniEbpfError> {
    if uid.is_empty() {
        return Ok(None);
    }
    let cookie = netns_cookie(Some(netns))
        .map_err(io(format!("read the network namespace cookie of {}", netns.display())))?;
    Ok(pod_records(node).into_iter().find(|r| r.pod_uid.as_deref() == Some(uid) && r.netns_cookie == cookie))
}

/// Whether a record's namespace is registered in its set's maps.
fn is_registered(record: &PinRecord) -> Result<bool, CniEbpfError> {
    let Some(key) = record.programs.as_deref().filter(|k| set::present(k)) else { return Ok(false) };
    Ok(MapSet::open_pinned(&set::set_dir(key))?.pods()?.contains(&record.netns_cookie))
}

/// CHECK: what keeps the pod from being wholly captured through node capture `node`
/// in namespace `netns` (registered under its cookie, links attached, inbound filter in
/// place), by ADD's record (the container's) or repair's (the pod UID's); None when
/// either is whole.
pub fn capture_gap(
    node: &str,
    container_id: &str,
    uid: &str,
    netns: &Path,
) -> Result<Option<String>, CniEbpfError> {
    let cookie = netns_cookie(Some(netns))
        .map_err(io(format!("read the network namespace cookie of {}", netns.display())))?;
    let by_container = PinRecord::load(&pod_record_name(node, container_id));
    let mut broken = None;
    for record in by_container.into_iter().chain(pod_record(node, uid, netns)?) {
        if record.netns_cookie != cookie || !is_registered(&record)? {
            continue;
        }
        let faults = health::faults(&record, &PinRecord::load_all());
        if faults.is_empty() {
            return Ok(None);
        }
        broken.get_or_insert_with(|| {
            format!("its eBPF capture through {node} is not whole: {}", health::describe(&faults))
        });
    }
    Ok(Some(broken.unwrap_or_else(|| format!("not registered with the eBPF node capture {node}"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_records_are_named_after_the_node_capture_and_container() {
        let name = pod_record_name("cni-node", "0f3a5c9e-77/../x");
        assert_eq!(name, "cni-node-pod-0f3a5c9e77x");
        assert!(name.starts_with(&pod_prefix("cni-node")));
        crate::capture::ebpf::record::check_name(&retired_name("cni-node", "1_0_0-0123456789ab")).unwrap();
    }
}
