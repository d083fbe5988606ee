//! The agent's end of the plugin's add event: HTTP/1.1 on the unix socket
//! `<CNI_AGENT_RUN_DIR>/pluginevent.sock`, which only the plugin drives: the socket
//! `0600` in a directory only root writes ([`crate::node::local_socket`]), and every
//! connection's peer must be root (the container runtime runs the plugin as root),
//! else it is answered 403 and closed before anything it sends is read. Bounded: at
//! most [`MAX_CONNECTIONS`] at once, the headers within [`HEADER_DEADLINE`], the body
//! ([`MAX_BODY`] at most) within [`BODY_DEADLINE`], the whole exchange within
//! [`CONNECTION_DEADLINE`]; a slow client holds only its own task. `POST /cmdadd` only. The
//! pod is looked up in the watch's cache (retried 10 times 10 ms apart, as Istio: the
//! cache may lag the API the plugin just read), must still be selected, and is added
//! with the addresses and network namespace the plugin sent. 200 when it is captured
//! and ztunnel acked; 400 for a body that is not an event; 500 with the reason
//! otherwise (the plugin fails ADD with it, and kubelet retries the sandbox).

use std::{os::fd::AsFd as _, path::Path, sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::{Method, Request, Response, StatusCode};
use tokio_util::sync::CancellationToken;

use super::{
    controller::{SharedCluster, selected},
    dataplane::Dataplane,
};
use crate::node::enroll::event::{ADD_PATH, AddEvent};

const LOOKUP_ATTEMPTS: u32 = 10;
const LOOKUP_INTERVAL: Duration = Duration::from_millis(10);
/// An event is a few hundred bytes; Istio's plugin never sends more than a few KiB.
pub const MAX_BODY: usize = 64 << 10;
/// Connections served at once; more are closed at once.
pub const MAX_CONNECTIONS: usize = 64;
pub const HEADER_DEADLINE: Duration = Duration::from_secs(5);
pub const BODY_DEADLINE: Duration = Duration::from_secs(5);
/// The plugin gives up after 5 s; an add (ztunnel's ack included) is bounded well within this.
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(30);
/// Who may post events: root, as the container runtime runs the plugin.
const PLUGIN_UIDS: &[u32] = &[0];

/// Binds the event socket at `path` (`0600`, a socket file left there replaced).
pub fn bind(path: &Path) -> Result<tokio::net::UnixListener, crate::node::local_socket::LocalSocketError> {
    crate::node::local_socket::bind_private(path, |at| tokio::net::UnixListener::bind(at))
}

/// Serves events until `stop`.
pub async fn serve(
    listener: tokio::net::UnixListener,
    dataplane: Arc<Dataplane>,
    cluster: SharedCluster,
    stop: CancellationToken,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            a = crate::support::accept::next("pluginevent", || listener.accept()) => a,
        };
        let Ok((stream, _)) = accepted else { return };
        if let Err(why) =
            crate::node::local_socket::check_peer(stream.as_fd(), PLUGIN_UIDS, "pluginevent.sock")
        {
            tracing::warn!(reason = %why, "plugin event refused");
            tokio::spawn(refuse(stream, StatusCode::FORBIDDEN, why));
            continue;
        }
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(limit = MAX_CONNECTIONS, "plugin event refused: too many connections at once");
            tokio::spawn(refuse(
                stream,
                StatusCode::SERVICE_UNAVAILABLE,
                "too many connections at once".into(),
            ));
            continue;
        };
        let (dp, cl) = (dataplane.clone(), cluster.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req| {
                let (dp, cl) = (dp.clone(), cl.clone());
                async move { Ok::<_, std::convert::Infallible>(answer(req, &dp, &cl).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_DEADLINE)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            if tokio::time::timeout(CONNECTION_DEADLINE, conn).await.is_err() {
                tracing::warn!(deadline = ?CONNECTION_DEADLINE, "plugin event connection closed: over its deadline");
            }
        });
    }
}

/// Answers `status` with `why` and closes, reading nothing the peer sent.
async fn refuse(mut stream: tokio::net::UnixStream, status: StatusCode, why: String) {
    use tokio::io::AsyncWriteExt as _;
    let body = format!("{why}\n");
    let head = format!(
        "HTTP/1.1 {} {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

fn reply(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}

/// Answers one request and counts it by its code (`istio_cni_plugin_requests_total`).
async fn answer(
    req: Request<hyper::body::Incoming>,
    dp: &Dataplane,
    cluster: &SharedCluster,
) -> Response<Full<Bytes>> {
    let response = answer_uncounted(req, dp, cluster).await;
    crate::node::metrics::plugin_request(response.status().as_u16());
    response
}

async fn answer_uncounted(
    req: Request<hyper::body::Incoming>,
    dp: &Dataplane,
    cluster: &SharedCluster,
) -> Response<Full<Bytes>> {
    if req.method() != Method::POST || req.uri().path() != ADD_PATH {
        return reply(StatusCode::NOT_FOUND, format!("only POST {ADD_PATH} is served\n"));
    }
    let body = match tokio::time::timeout(
        BODY_DEADLINE,
        http_body_util::Limited::new(req.into_body(), MAX_BODY).collect(),
    )
    .await
    {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => {
            return reply(
                StatusCode::BAD_REQUEST,
                format!("read the event (at most {MAX_BODY} bytes): {e}\n"),
            );
        }
        Err(_) => {
            return reply(
                StatusCode::REQUEST_TIMEOUT,
                format!("the event's body took longer than {BODY_DEADLINE:?}\n"),
            );
        }
    };
    let event = match AddEvent::parse(&body) {
        Ok(e) => e,
        Err(e) => return reply(StatusCode::BAD_REQUEST, format!("{e}\n")),
    };
    match handle(&event, dp, cluster).await {
        Ok(()) => reply(StatusCode::OK, String::new()),
        Err(e) => {
            tracing::error!(pod = %format!("{}/{}", event.pod_namespace, event.pod_name), netns = %event.netns, error = %e, "CNI add event failed");
            reply(StatusCode::INTERNAL_SERVER_ERROR, e)
        }
    }
}

async fn handle(event: &AddEvent, dp: &Dataplane, cluster: &SharedCluster) -> Result<(), String> {
    let (ns, name) = (&event.pod_namespace, &event.pod_name);
    let mut found = None;
    for attempt in 0..LOOKUP_ATTEMPTS {
        found = {
            let c = cluster.read().unwrap_or_else(|p| p.into_inner());
            c.pod(ns, name).map(|pod| (selected(dp, &c, &pod), pod))
        };
        if found.is_some() {
            break;
        }
        if attempt + 1 < LOOKUP_ATTEMPTS {
            tracing::warn!(pod = %format!("{ns}/{name}"), attempt, "CNI add event for a pod not in the watch's cache yet: retrying");
            tokio::time::sleep(LOOKUP_INTERVAL).await;
        }
    }
    let Some((selected, pod)) = found else {
        return Err(format!("failed to get pod {ns}/{name}: not in this node's pods"));
    };
    if !selected {
        return Err(format!("pod {ns}/{name} is unexpectedly not eligible for ambient enrollment"));
    }
    let ips = event.addresses();
    dp.add(&pod, &ips, Some(&event.netns)).await.map_err(|e| crate::error_chain(&e))
}
