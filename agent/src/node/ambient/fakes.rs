//! Fakes of what the ambient dataplane acts on (`dataplane::effects`), for the unit
//! tests of the dataplane, the controller and the snapshot: one [`FakeNode`] plays the
//! pods' namespaces and capture, ZDS, the Kubernetes API and the probe sets, records
//! every call in one log (so a test reads the order of steps across them), keeps the
//! probe sets' entries (address → pod uid) as the node's do, and fails where a test
//! tells it to. Pods and settings for those tests are made here too.

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    net::IpAddr,
    os::fd::OwnedFd,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use futures::future::BoxFuture;
use weir_iptables::ambient::{AmbientError, InpodConfig, probeset::ProbeSetError};

use super::{
    dataplane::{
        Dataplane, DataplaneError,
        effects::{Effects, HostProbeSet, PodCapture, PodStatusApi, ZtunnelPods},
    },
    objects::{AmbientPod, REDIRECTION_ANNOTATION},
    settings::AmbientSettings,
};
use crate::node::{
    cni::kube::KubeError,
    enroll::selector::EnablementSelectors,
    zds::{WorkloadInfo, ZdsError},
};

/// One call a fake got, naming the pod by uid (the annotation: by `namespace/name`,
/// as the API names it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    OpenEventNetns(String),
    FindNetns(String),
    FindNetnsOfPods(Vec<String>),
    ApplyCapture(String),
    /// `in_netns`: the rules in the pod's namespace are undone too.
    RemoveCapture {
        uid: String,
        in_netns: bool,
    },
    ZdsAdd(String),
    ZdsCache(String),
    ZdsKeep(String),
    ZdsForget(String),
    ZdsDel(String),
    ProbeUpsert(String, IpAddr),
    ProbeRemove(String, IpAddr),
    ProbePrune(Vec<IpAddr>),
    /// The redirection annotation's new value (`None`: removed).
    Annotate(String, Option<String>),
}

/// How ztunnel answers one Add.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ztunnel {
    Acks,
    /// Connected, answers with an error.
    Refuses,
    /// No ztunnel connected.
    Gone,
}

#[derive(Default)]
struct State {
    /// Each call, and when (on tokio's clock, which tests may pause).
    calls: Vec<(tokio::time::Instant, Call)>,
    /// ztunnel's answers to the next Adds, in turn; once they run out it acks.
    ztunnel: VecDeque<Ztunnel>,
    /// The uids ZDS knows, and those it has a namespace for.
    zds_known: BTreeSet<String>,
    zds_netns: BTreeSet<String>,
    /// The uids whose capture fails to apply.
    capture_fails: BTreeSet<String>,
    /// The uids whose capture fails to be removed, and how many more times it will.
    removal_fails: BTreeMap<String, u32>,
    /// The probe sets' entries: address → the uid it was added for.
    probe_set: BTreeMap<IpAddr, String>,
    /// The uids whose namespace is not found on the node.
    no_netns: BTreeSet<String>,
    /// The uids whose event's namespace path fails so.
    event_netns: BTreeMap<String, EventPath>,
    /// The pods (`namespace/name`) the API server no longer has.
    gone_from_api: BTreeSet<String>,
    /// The API server answers every patch 503.
    api_down: bool,
    /// ztunnel refuses every Add of these uids.
    refused: BTreeSet<String>,
}

/// How the namespace path of a pod's event fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventPath {
    /// It does not open under the node's root (no such file there).
    DoesNotOpen,
    /// It is refused: it names the node's own namespace.
    NodesNamespace,
}

/// Every effect of the dataplane, faked; clones share one state.
#[derive(Clone, Default)]
pub struct FakeNode {
    state: Arc<Mutex<State>>,
}

impl FakeNode {
    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn record(&self, call: Call) {
        self.with(|s| s.calls.push((tokio::time::Instant::now(), call)));
    }

    /// The calls so far.
    pub fn calls(&self) -> Vec<Call> {
        self.with(|s| s.calls.iter().map(|(_, c)| c.clone()).collect())
    }

    /// The calls so far, each with when it came.
    pub fn calls_at(&self) -> Vec<(tokio::time::Instant, Call)> {
        self.with(|s| s.calls.clone())
    }

    /// ztunnel answers the next Adds so, in turn; then it acks.
    pub fn ztunnel_answers(&self, answers: &[Ztunnel]) {
        self.with(|s| s.ztunnel.extend(answers));
    }

    pub fn capture_fails_for(&self, uid: &str) {
        self.with(|s| s.capture_fails.insert(uid.to_string()));
    }

    /// Taking `uid`'s capture out fails the next `times` times (the rules cannot be
    /// undone in its namespace), then succeeds.
    pub fn capture_removal_fails_for(&self, uid: &str, times: u32) {
        self.with(|s| s.removal_fails.insert(uid.to_string(), times));
    }

    /// The probe sets hold `ip` for `uid` (it was added before).
    pub fn probed(&self, uid: &str, ip: IpAddr) {
        self.with(|s| s.probe_set.insert(ip, uid.to_string()));
    }

    /// The probe sets' entries now.
    pub fn probe_set(&self) -> BTreeMap<IpAddr, String> {
        self.with(|s| s.probe_set.clone())
    }

    /// The namespace path of `uid`'s events fails as `how` says.
    pub fn event_netns_fails_for(&self, uid: &str, how: EventPath) {
        self.with(|s| s.event_netns.insert(uid.to_string(), how));
    }

    pub fn netns_not_found_for(&self, uid: &str) {
        self.with(|s| s.no_netns.insert(uid.to_string()));
    }

    /// ZDS has the pod cached with its namespace (it was added before).
    pub fn zds_has_netns_of(&self, uid: &str) {
        self.with(|s| {
            s.zds_known.insert(uid.to_string());
            s.zds_netns.insert(uid.to_string());
        });
    }

    /// The uids ZDS knows.
    pub fn zds_known(&self) -> BTreeSet<String> {
        self.with(|s| s.zds_known.clone())
    }

    /// The API server answers NotFound for `pod` from now on.
    pub fn gone_from_api(&self, pod: &AmbientPod) {
        self.with(|s| s.gone_from_api.insert(pod.key()));
    }

    /// The API server answers every patch 503 from now on.
    pub fn api_down(&self) {
        self.with(|s| s.api_down = true);
    }

    /// ztunnel refuses every Add of `uid` from now on.
    pub fn ztunnel_refuses_always(&self, uid: &str) {
        self.with(|s| s.refused.insert(uid.to_string()));
    }

    /// Effects all played by this node.
    pub fn effects(&self) -> Effects {
        Effects {
            capture: Box::new(self.clone()),
            zds: Box::new(self.clone()),
            kube: Arc::new(self.clone()),
            probes: Arc::new(self.clone()),
        }
    }

    /// A dataplane with the [`settings`] acting on this node.
    pub fn dataplane(&self) -> Dataplane {
        Dataplane::with_effects(Arc::new(settings()), self.effects())
    }
}

/// A network namespace descriptor (this process's: a real one, which ZDS accepts).
pub fn netns() -> OwnedFd {
    std::fs::File::open("/proc/self/ns/net").expect("open /proc/self/ns/net").into()
}

impl PodCapture for FakeNode {
    fn open_event_netns<'a>(
        &'a self,
        _zds: &'a dyn ZtunnelPods,
        pod: &'a AmbientPod,
        ips: &'a [IpAddr],
        path: &'a str,
    ) -> BoxFuture<'a, Result<OwnedFd, DataplaneError>> {
        use crate::node::enroll::netns_path::NetnsPathError;
        self.record(Call::OpenEventNetns(pod.uid.clone()));
        let fails = self.with(|s| s.event_netns.get(&pod.uid).copied());
        let source = match fails {
            None => return Box::pin(self.find(pod, ips)),
            Some(EventPath::DoesNotOpen) => NetnsPathError::Open {
                path: PathBuf::from("/host").join(path.trim_start_matches('/')),
                source: std::io::ErrorKind::NotFound.into(),
            },
            Some(EventPath::NodesNamespace) => {
                NetnsPathError::NotAPods { path: path.into(), whose: "node's" }
            }
        };
        Box::pin(async move { Err(DataplaneError::EventNetns { pod: pod.key(), source }) })
    }

    fn find_netns<'a>(
        &'a self,
        pod: &'a AmbientPod,
        ips: &'a [IpAddr],
    ) -> BoxFuture<'a, Result<OwnedFd, DataplaneError>> {
        self.record(Call::FindNetns(pod.uid.clone()));
        Box::pin(self.find(pod, ips))
    }

    fn find_netns_of_pods(
        &self,
        pods: BTreeMap<String, Vec<IpAddr>>,
    ) -> BoxFuture<'_, BTreeMap<String, Result<OwnedFd, String>>> {
        self.record(Call::FindNetnsOfPods(pods.keys().cloned().collect()));
        let missing = self.with(|s| s.no_netns.clone());
        let found = pods
            .into_keys()
            .map(|uid| {
                let fd = if missing.contains(&uid) { Err("no process".to_string()) } else { Ok(netns()) };
                (uid, fd)
            })
            .collect();
        Box::pin(async move { found })
    }

    fn apply<'a>(
        &'a self,
        pod: &'a AmbientPod,
        _netns: &'a OwnedFd,
        _recorded: Option<PathBuf>,
        _cfg: InpodConfig,
    ) -> BoxFuture<'a, Result<&'static str, DataplaneError>> {
        self.record(Call::ApplyCapture(pod.uid.clone()));
        let fails = self.with(|s| s.capture_fails.contains(&pod.uid));
        Box::pin(async move {
            if fails {
                let source = AmbientError::Drift { backend: "iptables", netns: "fake".into() };
                return Err(DataplaneError::Rules { pod: pod.key(), source: Box::new(source) });
            }
            Ok("rules")
        })
    }

    fn remove<'a>(
        &'a self,
        pod: &'a AmbientPod,
        netns: Option<OwnedFd>,
    ) -> BoxFuture<'a, Result<(), DataplaneError>> {
        self.record(Call::RemoveCapture { uid: pod.uid.clone(), in_netns: netns.is_some() });
        let fails = self.with(|s| match s.removal_fails.get_mut(&pod.uid) {
            Some(left) if *left > 0 => {
                *left -= 1;
                true
            }
            _ => false,
        });
        Box::pin(async move {
            if fails {
                let source = AmbientError::Drift { backend: "iptables", netns: "fake".into() };
                return Err(DataplaneError::Rules { pod: pod.key(), source: Box::new(source) });
            }
            Ok(())
        })
    }
}

impl FakeNode {
    async fn find(&self, pod: &AmbientPod, ips: &[IpAddr]) -> Result<OwnedFd, DataplaneError> {
        let missing = self.with(|s| s.no_netns.contains(&pod.uid));
        if missing || ips.is_empty() {
            return Err(DataplaneError::FindNetns { pod: pod.key(), message: "not found (fake)".into() });
        }
        Ok(netns())
    }
}

impl ZtunnelPods for FakeNode {
    fn add_pod<'a>(
        &'a self,
        uid: &'a str,
        _info: WorkloadInfo,
        _netns: OwnedFd,
    ) -> BoxFuture<'a, Result<(), ZdsError>> {
        self.record(Call::ZdsAdd(uid.to_string()));
        let answer = self.with(|s| {
            // As the real cache: the pod stays cached with its namespace whatever the answer.
            s.zds_known.insert(uid.to_string());
            s.zds_netns.insert(uid.to_string());
            if s.refused.contains(uid) {
                Ztunnel::Refuses
            } else {
                s.ztunnel.pop_front().unwrap_or(Ztunnel::Acks)
            }
        });
        let uid = uid.to_string();
        Box::pin(async move {
            match answer {
                Ztunnel::Acks => Ok(()),
                Ztunnel::Refuses => {
                    Err(ZdsError::Nack { message: "add", uid, conn: 1, error: "refused (fake)".into() })
                }
                Ztunnel::Gone => Err(ZdsError::NoZtunnel { uid }),
            }
        })
    }

    fn cache_pod(&self, uid: &str, _info: WorkloadInfo, _netns: OwnedFd) -> Result<(), ZdsError> {
        self.record(Call::ZdsCache(uid.to_string()));
        self.zds_has_netns_of(uid);
        Ok(())
    }

    fn keep_pod(&self, uid: &str) {
        self.record(Call::ZdsKeep(uid.to_string()));
        self.with(|s| s.zds_known.insert(uid.to_string()));
    }

    fn forget(&self, uid: &str) {
        self.record(Call::ZdsForget(uid.to_string()));
        self.with(|s| {
            s.zds_known.remove(uid);
            s.zds_netns.remove(uid);
        });
    }

    fn del_pod<'a>(&'a self, uid: &'a str) -> BoxFuture<'a, Result<(), ZdsError>> {
        self.record(Call::ZdsDel(uid.to_string()));
        self.with(|s| {
            s.zds_known.remove(uid);
            s.zds_netns.remove(uid);
        });
        Box::pin(async { Ok(()) })
    }

    fn netns(&self, uid: &str) -> Option<OwnedFd> {
        self.with(|s| s.zds_netns.contains(uid)).then(netns)
    }

    fn enrolled_with(&self, _id: (u64, u64), _uid: &str) -> Option<String> {
        None
    }

    fn pods(&self) -> Vec<String> {
        self.with(|s| s.zds_known.iter().cloned().collect())
    }
}

impl PodStatusApi for FakeNode {
    fn patch_pod_status<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        patch: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<(), KubeError>> {
        let key = format!("{namespace}/{name}");
        let value = patch["metadata"]["annotations"][REDIRECTION_ANNOTATION].as_str().map(String::from);
        self.record(Call::Annotate(key.clone(), value));
        let (gone, down) = self.with(|s| (s.gone_from_api.contains(&key), s.api_down));
        Box::pin(async move {
            if down {
                let (method, url, status) = ("PATCH", format!("pods/{key}/status"), 503);
                return Err(KubeError::Status { method, url, status, message: "down (fake)".into() });
            }
            if gone {
                return Err(KubeError::NotFound { namespace: namespace.into(), name: name.into() });
            }
            Ok(())
        })
    }
}

impl HostProbeSet for FakeNode {
    fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), ProbeSetError> {
        self.record(Call::ProbeUpsert(uid.to_string(), ip));
        self.with(|s| s.probe_set.insert(ip, uid.to_string()));
        Ok(())
    }

    fn remove(&self, ip: IpAddr, uid: &str) -> Result<Option<String>, ProbeSetError> {
        self.record(Call::ProbeRemove(uid.to_string(), ip));
        // As the node's: only this pod's entry goes; another pod's holder is answered.
        Ok(self.with(|s| match s.probe_set.get(&ip) {
            Some(holder) if holder != uid => Some(holder.clone()),
            Some(_) => s.probe_set.remove(&ip).and(None),
            None => None,
        }))
    }

    fn prune(&self, keep: &BTreeSet<IpAddr>) -> Result<Vec<IpAddr>, ProbeSetError> {
        self.record(Call::ProbePrune(keep.iter().copied().collect()));
        Ok(Vec::new())
    }
}

/// The chart's settings as far as the tests need them: pods labelled ambient, or in a
/// namespace labelled so, are selected.
pub fn settings() -> AmbientSettings {
    AmbientSettings { enabled: true, selectors: EnablementSelectors::istio_default(), ..Default::default() }
}

/// Pod `n` of namespace `shop`: `web-<n>`, uid `uid-<n>`, address `10.0.0.<n>`,
/// running, labelled ambient, not enrolled yet.
pub fn pod(n: u8) -> AmbientPod {
    AmbientPod {
        namespace: "shop".into(),
        name: format!("web-{n}"),
        uid: format!("uid-{n}"),
        labels: [("istio.io/dataplane-mode".to_string(), "ambient".to_string())].into(),
        phase: "Running".into(),
        ips: vec![ip(n)],
        ..Default::default()
    }
}

pub fn ip(n: u8) -> IpAddr {
    IpAddr::from([10, 0, 0, n])
}

/// `pod` annotated `ambient.istio.io/redirection: <value>`.
pub fn annotated(mut pod: AmbientPod, value: &str) -> AmbientPod {
    pod.annotations.insert(REDIRECTION_ANNOTATION.into(), value.into());
    pod
}

/// The annotation call for pod `n`.
pub fn annotate(n: u8, value: Option<&str>) -> Call {
    Call::Annotate(format!("shop/web-{n}"), value.map(String::from))
}

pub fn uid(n: u8) -> String {
    format!("uid-{n}")
}

/// The calls an add of pod `n` makes up to ztunnel's answer (its namespace looked up
/// on the node).
pub fn added_up_to_ztunnel(n: u8) -> Vec<Call> {
    vec![Call::ZdsKeep(uid(n)), Call::FindNetns(uid(n)), Call::ApplyCapture(uid(n)), Call::ZdsAdd(uid(n))]
}

/// The calls taking pod `n` out makes (`in_netns`: its rules undone in its namespace).
pub fn removed(n: u8, in_netns: bool) -> Vec<Call> {
    vec![
        Call::RemoveCapture { uid: uid(n), in_netns },
        Call::ProbeRemove(uid(n), ip(n)),
        Call::ZdsDel(uid(n)),
        annotate(n, None),
    ]
}
