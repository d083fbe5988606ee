//! A test Kubernetes API server with watches, for the ambient node agent and the CNI
//! plugin: Pods and Namespaces in a store with one resource-version counter, served as
//! the real API serves them — GET of one object, LIST (with `fieldSelector=
//! spec.nodeName=`), WATCH (`watch=1&resourceVersion=N`: the events after N, then new
//! ones as they happen, with `allowWatchBookmarks` honoured and `410 Gone` for a
//! version older than the server keeps), and a JSON merge patch of a pod's status (the
//! agent's annotations). A bearer token is checked. Tests change the store
//! (`set_pod`, `delete_pod`, `set_namespace`), read it (`pod`), can make every
//! version older than now expire (`expire_history`) to force a relist, and can make the
//! next requests to one path fail (`fail_next`).

use std::{
    collections::BTreeMap,
    convert::Infallible,
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use weir_agent::sandbox::NetNs;

type Key = (String, String);

/// One change, as a watch sends it.
#[derive(Debug, Clone)]
struct Change {
    version: u64,
    kind: &'static str,
    /// "pods" or "namespaces".
    collection: &'static str,
    object: Value,
}

#[derive(Default)]
struct Store {
    version: u64,
    pods: BTreeMap<Key, Value>,
    namespaces: BTreeMap<String, Value>,
    /// DaemonSets by namespace and name (GET only: the node agent asks whether its own
    /// still exists when it stops).
    daemonsets: BTreeMap<Key, Value>,
    /// Nodes by name (GET only: the node agent matches its DaemonSet's node affinity
    /// against its own node when it stops).
    nodes: BTreeMap<String, Value>,
    history: Vec<Change>,
    /// Versions at or below this are gone (410).
    expired_below: u64,
    requests: Vec<String>,
    /// Path → (requests still to fail, the status code they get).
    faults: BTreeMap<String, (u32, u16)>,
}

/// The server; dropping it stops it.
pub struct KubeApi {
    pub addr: SocketAddr,
    token: String,
    /// Tokens that may only read (GET, LIST, WATCH): a role like istio-cni's plugin's.
    read_only: Arc<Mutex<Vec<String>>>,
    /// The CA of the serving certificate, when served over TLS.
    pub ca_pem: Option<String>,
    store: Arc<Mutex<Store>>,
    changes: broadcast::Sender<Change>,
    stop: CancellationToken,
    _thread: std::thread::JoinHandle<()>,
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn status(code: u16, message: &str) -> (u16, Value) {
    (
        code,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}),
    )
}

/// A JSON merge patch (RFC 7386).
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            let t = target.as_object_mut().expect("object");
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

impl Store {
    fn record(&mut self, kind: &'static str, collection: &'static str, object: &mut Value) -> Change {
        self.version += 1;
        object["metadata"]["resourceVersion"] = json!(self.version.to_string());
        let change = Change { version: self.version, kind, collection, object: object.clone() };
        self.history.push(change.clone());
        change
    }
}

impl KubeApi {
    /// Listens on 127.0.0.1 inside `netns`, plain HTTP.
    pub fn start(netns: &NetNs, token: &str) -> anyhow::Result<Self> {
        Self::start_on(netns, SocketAddr::from(([127, 0, 0, 1], 0)), token, None)
    }

    /// Listens on `bind` inside `netns`; over TLS with a certificate for `bind`'s
    /// address from `ca` when given (the in-cluster API: its `ca.crt` is `ca`'s root).
    pub fn start_on(
        netns: &NetNs,
        bind: SocketAddr,
        token: &str,
        ca: Option<&crate::control_plane::TestCa>,
    ) -> anyhow::Result<Self> {
        let store: Arc<Mutex<Store>> = Arc::default();
        let (changes, _) = broadcast::channel(4096);
        let stop = CancellationToken::new();
        let read_only: Arc<Mutex<Vec<String>>> = Arc::default();
        let tls = match ca {
            Some(ca) => {
                let (chain, key) = ca.server_cert(&[&bind.ip().to_string(), "kubernetes.default.svc"])?;
                Some(crate::http_server::tls_acceptor(&chain, &key)?)
            }
            None => None,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let (st, ch, sp, tk, ro) =
            (store.clone(), changes.clone(), stop.clone(), token.to_string(), read_only.clone());
        let thread = netns.spawn_thread(move || async move {
            let listener = match tokio::net::TcpListener::bind(bind).await {
                Ok(l) => l,
                Err(e) => return drop(tx.send(Err(e.to_string()))),
            };
            let _ = tx.send(Ok(listener.local_addr().expect("bound")));
            loop {
                let (stream, _) = tokio::select! {
                    () = sp.cancelled() => return,
                    a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                };
                let (st, ch, tk, sp, ro, tls) =
                    (st.clone(), ch.clone(), tk.clone(), sp.clone(), ro.clone(), tls.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let (st, ch, tk, sp, ro) =
                            (st.clone(), ch.clone(), tk.clone(), sp.clone(), ro.clone());
                        async move { Ok::<_, Infallible>(serve(req, &st, &ch, &tk, &ro, sp).await) }
                    });
                    let builder = hyper::server::conn::http1::Builder::new();
                    match tls {
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let _ = builder
                                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                                    .await;
                            }
                        }
                        None => {
                            let _ =
                                builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
                        }
                    }
                });
            }
        })?;
        let addr = rx
            .recv_timeout(std::time::Duration::from_secs(10))?
            .map_err(|e| anyhow::anyhow!("test API server: {e}"))?;
        let ca_pem = ca.map(|c| c.root_pem().to_string());
        Ok(Self { addr, token: token.into(), read_only, ca_pem, store, changes, stop, _thread: thread })
    }

    /// Accepts `token` for reads only (a write with it is 403 Forbidden).
    pub fn allow_reads_with(&self, token: &str) {
        self.read_only.lock().expect("tokens").push(token.to_string());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().expect("store lock")
    }

    /// Creates or replaces a pod (its `metadata.namespace`/`name`).
    pub fn set_pod(&self, mut pod: Value) {
        let key = (
            pod["metadata"]["namespace"].as_str().unwrap_or_default().to_string(),
            pod["metadata"]["name"].as_str().unwrap_or_default().to_string(),
        );
        let mut s = self.lock();
        let kind = if s.pods.contains_key(&key) { "MODIFIED" } else { "ADDED" };
        let change = s.record(kind, "pods", &mut pod);
        s.pods.insert(key, pod);
        drop(s);
        let _ = self.changes.send(change);
    }

    /// Changes a stored pod with `f` (a MODIFIED event).
    pub fn update_pod(&self, namespace: &str, name: &str, f: impl FnOnce(&mut Value)) {
        let mut pod = self.pod(namespace, name).unwrap_or_else(|| panic!("no pod {namespace}/{name}"));
        f(&mut pod);
        self.set_pod(pod);
    }

    /// Changes a stored pod with `f` under the store's lock (no write of another
    /// client's lands in between); `false` when there is no such pod.
    pub fn try_update_pod(&self, namespace: &str, name: &str, f: impl FnOnce(&mut Value)) -> bool {
        let mut s = self.lock();
        let key = (namespace.to_string(), name.to_string());
        let Some(mut pod) = s.pods.get(&key).cloned() else { return false };
        f(&mut pod);
        let change = s.record("MODIFIED", "pods", &mut pod);
        s.pods.insert(key, pod);
        drop(s);
        let _ = self.changes.send(change);
        true
    }

    /// Every stored pod.
    pub fn pods(&self) -> Vec<Value> {
        self.lock().pods.values().cloned().collect()
    }

    /// Deletes a pod (a DELETED event).
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        let mut s = self.lock();
        let Some(mut pod) = s.pods.remove(&(namespace.into(), name.into())) else { return };
        let change = s.record("DELETED", "pods", &mut pod);
        drop(s);
        let _ = self.changes.send(change);
    }

    /// Creates or relabels a namespace.
    /// A DaemonSet `namespace/name` as the API serves it (`None`: deleted).
    pub fn set_daemonset(&self, namespace: &str, name: &str, daemonset: Option<Value>) {
        let mut s = self.store.lock().expect("store");
        let key = (namespace.to_string(), name.to_string());
        match daemonset {
            Some(d) => s.daemonsets.insert(key, d),
            None => s.daemonsets.remove(&key),
        };
    }

    /// DaemonSet `namespace/name` as the API serves it.
    pub fn daemonset(&self, namespace: &str, name: &str) -> Option<Value> {
        self.store.lock().expect("store").daemonsets.get(&(namespace.to_string(), name.to_string())).cloned()
    }

    /// Node `name` as the API serves it (`None`: not there).
    pub fn set_node(&self, name: &str, node: Option<Value>) {
        let mut s = self.store.lock().expect("store");
        match node {
            Some(n) => s.nodes.insert(name.to_string(), n),
            None => s.nodes.remove(name),
        };
    }

    pub fn set_namespace(&self, name: &str, labels: &[(&str, &str)]) {
        let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
        let mut ns =
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}});
        let mut s = self.lock();
        let kind = if s.namespaces.contains_key(name) { "MODIFIED" } else { "ADDED" };
        let change = s.record(kind, "namespaces", &mut ns);
        s.namespaces.insert(name.into(), ns);
        drop(s);
        let _ = self.changes.send(change);
    }

    /// The stored pod.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        self.lock().pods.get(&(namespace.into(), name.into())).cloned()
    }

    /// A pod's `ambient.istio.io/redirection` annotation.
    pub fn redirection(&self, namespace: &str, name: &str) -> Option<String> {
        self.pod(namespace, name)?["metadata"]["annotations"]["ambient.istio.io/redirection"]
            .as_str()
            .map(String::from)
    }

    /// Every version so far expires: watches from them get `410 Gone`.
    pub fn expire_history(&self) {
        let mut s = self.lock();
        s.expired_below = s.version;
        s.history.clear();
    }

    /// Answers the next `times` requests to exactly `path` (no query) with `code` and a
    /// Kubernetes `Status`, as an API server that is overloaded or restarting does; any
    /// count left from before is replaced.
    pub fn fail_next(&self, path: &str, times: u32, code: u16) {
        self.lock().faults.insert(path.to_string(), (times, code));
    }

    /// The requests seen (`METHOD path?query`).
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }

    /// A kubeconfig for this server.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: http://127.0.0.1:{}\n\
             users:\n- name: u\n  user:\n    token: {}\ncontexts:\n- name: c\n  context:\n    cluster: local\n    user: u\n\
             current-context: c\n",
            self.addr.port(),
            self.token
        )
    }
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn full(code: u16, value: &Value) -> hyper::Response<Body> {
    hyper::Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(value.to_string())).boxed())
        .expect("response")
}

async fn serve(
    req: hyper::Request<hyper::body::Incoming>,
    store: &Mutex<Store>,
    changes: &broadcast::Sender<Change>,
    token: &str,
    read_only: &Mutex<Vec<String>>,
    stop: CancellationToken,
) -> hyper::Response<Body> {
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let query: BTreeMap<String, String> = req
        .uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.replace("%3D", "=").replace("%2F", "/")))
        .collect();
    let bearer = req.headers().get("authorization").and_then(|v| v.to_str().ok()).map(String::from);
    let authorized = bearer.as_deref() == Some(&format!("Bearer {token}"));
    let reader = bearer
        .as_deref()
        .and_then(|b| b.strip_prefix("Bearer "))
        .is_some_and(|t| read_only.lock().expect("tokens").iter().any(|r| r == t));
    let fault = {
        let mut s = store.lock().expect("store");
        s.requests.push(format!("{method} {}", req.uri()));
        match s.faults.get_mut(&path) {
            Some((left, code)) if *left > 0 => {
                *left -= 1;
                Some(*code)
            }
            _ => None,
        }
    };
    if let Some(code) = fault {
        let (c, v) = status(code, "injected by the test: try again");
        return full(c, &v);
    }
    if !authorized && !reader {
        let (c, v) = status(401, "Unauthorized");
        return full(c, &v);
    }
    if !authorized && method != "GET" {
        let (c, v) = status(403, "Forbidden: this token may only read");
        return full(c, &v);
    }
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let node = query.get("fieldSelector").and_then(|f| f.strip_prefix("spec.nodeName=")).map(String::from);
    let collection = match parts.as_slice() {
        ["api", "v1", "pods"] => Some("pods"),
        ["api", "v1", "namespaces"] => Some("namespaces"),
        _ => None,
    };
    if let Some(collection) = collection {
        if query.get("watch").is_some_and(|w| w == "1" || w == "true") {
            let from: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
            return watch(store, changes, collection, node, from, stop);
        }
        let s = store.lock().expect("store");
        let items: Vec<Value> = match collection {
            "pods" => s
                .pods
                .values()
                .filter(|p| node.as_deref().is_none_or(|n| p["spec"]["nodeName"] == n))
                .cloned()
                .collect(),
            _ => s.namespaces.values().cloned().collect(),
        };
        let kind = if collection == "pods" { "PodList" } else { "NamespaceList" };
        return full(
            200,
            &json!({"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": s.version.to_string()}, "items": items}),
        );
    }
    let (code, value) = match (method.as_str(), parts.as_slice()) {
        ("GET", ["api", "v1", "namespaces", name]) => {
            match store.lock().expect("store").namespaces.get(*name) {
                Some(ns) => (200, ns.clone()),
                None => status(404, &format!("namespaces \"{name}\" not found")),
            }
        }
        ("GET", ["api", "v1", "namespaces", ns, "pods", name]) => {
            match store.lock().expect("store").pods.get(&(ns.to_string(), name.to_string())) {
                Some(p) => (200, p.clone()),
                None => status(404, &format!("pods \"{name}\" not found")),
            }
        }
        ("GET", ["api", "v1", "nodes", name]) => match store.lock().expect("store").nodes.get(*name) {
            Some(n) => (200, n.clone()),
            None => status(404, &format!("nodes \"{name}\" not found")),
        },
        ("GET", ["apis", "apps", "v1", "namespaces", ns, "daemonsets", name]) => {
            match store.lock().expect("store").daemonsets.get(&(ns.to_string(), name.to_string())) {
                Some(d) => (200, d.clone()),
                None => status(404, &format!("daemonsets.apps \"{name}\" not found")),
            }
        }
        ("PATCH", ["api", "v1", "namespaces", ns, "pods", name, "status"]) => {
            patch(store, changes, ns, name, &body)
        }
        _ => status(404, "the server could not find the requested resource"),
    };
    full(code, &value)
}

fn patch(
    store: &Mutex<Store>,
    changes: &broadcast::Sender<Change>,
    ns: &str,
    name: &str,
    body: &[u8],
) -> (u16, Value) {
    let Ok(patch) = serde_json::from_slice::<Value>(body) else {
        return status(400, "the patch is not JSON");
    };
    let mut s = store.lock().expect("store");
    let key = (ns.to_string(), name.to_string());
    let Some(mut pod) = s.pods.get(&key).cloned() else {
        return status(404, &format!("pods \"{name}\" not found"));
    };
    merge_patch(&mut pod, &patch);
    let change = s.record("MODIFIED", "pods", &mut pod);
    s.pods.insert(key, pod.clone());
    drop(s);
    let _ = changes.send(change);
    (200, pod)
}

/// A watch from version `from`: past changes, then live ones, until the client or the
/// server goes.
fn watch(
    store: &Mutex<Store>,
    changes: &broadcast::Sender<Change>,
    collection: &'static str,
    node: Option<String>,
    from: u64,
    stop: CancellationToken,
) -> hyper::Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(256);
    let s = store.lock().expect("store");
    if from != 0 && from < s.expired_below {
        let (c, v) = status(410, "too old resource version");
        return full(c, &v);
    }
    let mut live = changes.subscribe();
    let past: Vec<Change> = s.history.iter().filter(|c| c.version > from).cloned().collect();
    drop(s);
    let wanted = move |c: &Change| {
        c.collection == collection
            && node.as_deref().is_none_or(|n| c.collection != "pods" || c.object["spec"]["nodeName"] == n)
    };
    tokio::spawn(async move {
        let line = |c: &Change| Bytes::from(format!("{}\n", json!({"type": c.kind, "object": c.object})));
        let mut last = from;
        for c in past.iter().filter(|c| wanted(c)) {
            last = c.version;
            if tx.send(Ok(Frame::data(line(c)))).await.is_err() {
                return;
            }
        }
        loop {
            let change = tokio::select! {
                () = stop.cancelled() => return,
                () = tx.closed() => return,
                c = live.recv() => c,
            };
            let Ok(c) = change else { return };
            if c.version <= last || !wanted(&c) {
                continue;
            }
            last = c.version;
            if tx.send(Ok(Frame::data(line(&c)))).await.is_err() {
                return;
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    hyper::Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(StreamBody::new(stream).boxed())
        .expect("response")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patches_set_and_remove() {
        let mut pod = json!({"metadata": {"name": "a", "annotations": {"x": "1"}}});
        merge_patch(
            &mut pod,
            &json!({"metadata": {"annotations": {"ambient.istio.io/redirection": "enabled"}}}),
        );
        assert_eq!(pod["metadata"]["annotations"]["ambient.istio.io/redirection"], "enabled");
        assert_eq!(pod["metadata"]["annotations"]["x"], "1");
        merge_patch(&mut pod, &json!({"metadata": {"annotations": {"ambient.istio.io/redirection": null}}}));
        assert!(pod["metadata"]["annotations"].get("ambient.istio.io/redirection").is_none());
    }
}
