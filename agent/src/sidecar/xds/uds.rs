//! The Unix socket Envoy dials for xDS (`./etc/istio/proxy/XDS`): a stale socket is
//! removed, the directory created, the socket made connectable by the proxy user, and
//! the relay served on it over HTTP/2 until shutdown.

use std::{
    future::Future,
    os::unix::fs::{FileTypeExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    time::Duration,
};

use tokio::net::UnixListener;
use weir_proto::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;

use super::relay::XdsProxy;

/// Istio's default server-side receive limit.
pub const MAX_RECV: usize = 4 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum UdsError {
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("remove stale socket {path}")]
    Remove {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("create directory {path}")]
    Directory {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("listen on unix socket {path}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("set owner or permissions of {path}")]
    Permissions {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Binds `path` (mode 0666, as Istio). With `owner`, the directory and socket are
/// handed to that uid/gid so an Envoy running as the proxy user can reach them.
pub fn bind(path: &Path, owner: Option<(u32, u32)>) -> Result<UnixListener, UdsError> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            std::fs::remove_file(path).map_err(|source| UdsError::Remove { path: path.into(), source })?
        }
        Ok(_) => return Err(UdsError::NotASocket(path.into())),
        Err(_) => {}
    }
    let perms = |p: &Path, source: std::io::Error| UdsError::Permissions { path: p.into(), source };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        std::fs::create_dir_all(dir).map_err(|source| UdsError::Directory { path: dir.into(), source })?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750)).map_err(|e| perms(dir, e))?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(dir, Some(uid), Some(gid)).map_err(|e| perms(dir, e))?;
        }
    }
    let listener = UnixListener::bind(path).map_err(|source| UdsError::Bind { path: path.into(), source })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(|e| perms(path, e))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(|e| perms(path, e))?;
    }
    Ok(listener)
}

impl XdsProxy {
    /// Serves ADS on `listener` until `shutdown` resolves, then ends the active stream.
    pub async fn serve(
        self,
        listener: UnixListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), crate::support::accept::ServeError> {
        let service = AggregatedDiscoveryServiceServer::new(self.clone())
            .max_decoding_message_size(MAX_RECV)
            .max_encoding_message_size(usize::MAX);
        let me = self.clone();
        let (incoming, broken) = super::authority::incoming(listener, "XDS socket");
        let served = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(super::upstream::KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(super::upstream::KEEPALIVE_TIMEOUT))
            .initial_stream_window_size(super::upstream::WINDOW)
            .initial_connection_window_size(super::upstream::WINDOW)
            .timeout(Duration::MAX)
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, async move {
                shutdown.await;
                me.close_active();
            })
            .await;
        crate::support::accept::ServeError::check(served, &broken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stale_sockets_are_replaced_and_files_refused() {
        let dir = std::env::temp_dir().join(crate::sandbox::unique_name("uds"));
        let path = dir.join("proxy").join("XDS");
        let first = bind(&path, None).unwrap();
        drop(first);
        // The socket file stays behind after the listener is gone: a stale socket.
        assert!(path.exists());
        let _second = bind(&path, None).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666);
        let file = dir.join("not-a-socket");
        std::fs::write(&file, "keep me").unwrap();
        assert!(matches!(bind(&file, None), Err(UdsError::NotASocket(_))));
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
