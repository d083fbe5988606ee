//! The agent's end of the plugin's add event: HTTP/1.1 on the unix socket
//! `<CNI_AGENT_RUN_DIR>/pluginevent.sock` (directory `0750` when made, socket `0666`
//! so the plugin, run by the container runtime, can reach it), `POST /cmdadd` only. The
//! pod is looked up in the watch's cache (retried 10 times 10 ms apart, as Istio: the
//! cache may lag the API the plugin just read), must still be selected, and is added
//! with the addresses and network namespace the plugin sent. 200 when it is captured
//! and ztunnel acked; 400 for a body that is not an event; 500 with the reason
//! otherwise (the plugin fails ADD with it, and kubelet retries the sandbox).

use std::{os::unix::fs::PermissionsExt as _, path::Path, sync::Arc, time::Duration};

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
const MAX_BODY: usize = 1 << 20;

/// Why the listener could not start.
#[derive(Debug, thiserror::Error)]
#[error("{what} {path}")]
pub struct ListenerError {
    what: &'static str,
    path: std::path::PathBuf,
    #[source]
    source: std::io::Error,
}

/// Binds the event socket at `path` (a socket file left there is replaced).
pub fn bind(path: &Path) -> Result<tokio::net::UnixListener, ListenerError> {
    let fail = |what| move |source| ListenerError { what, path: path.into(), source };
    if let Some(dir) = path.parent().filter(|d| !d.exists()) {
        std::fs::create_dir_all(dir).map_err(fail("create the directory of"))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750))
            .map_err(fail("chmod the directory of"))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            std::fs::remove_file(path).map_err(fail("remove the old socket"))?
        }
        Ok(_) => {
            return Err(ListenerError {
                what: "refusing to replace a file that is not a socket:",
                path: path.into(),
                source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
            });
        }
        Err(_) => {}
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(fail("listen on"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(fail("chmod"))?;
    Ok(listener)
}

/// Serves events until `stop`.
pub async fn serve(
    listener: tokio::net::UnixListener,
    dataplane: Arc<Dataplane>,
    cluster: SharedCluster,
    stop: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            a = crate::accept::next("pluginevent", || listener.accept()) => a,
        };
        let Ok((stream, _)) = accepted else { return };
        let (dp, cl) = (dataplane.clone(), cluster.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let (dp, cl) = (dp.clone(), cl.clone());
                async move { Ok::<_, std::convert::Infallible>(answer(req, &dp, &cl).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

fn reply(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}

async fn answer(
    req: Request<hyper::body::Incoming>,
    dp: &Dataplane,
    cluster: &SharedCluster,
) -> Response<Full<Bytes>> {
    if req.method() != Method::POST || req.uri().path() != ADD_PATH {
        return reply(StatusCode::NOT_FOUND, format!("only POST {ADD_PATH} is served\n"));
    }
    let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return reply(StatusCode::BAD_REQUEST, format!("read the event: {e}\n")),
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
