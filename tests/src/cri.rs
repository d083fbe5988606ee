//! Kubelet's side of CRI v1 (`weir_proto::cri`, the vendored `runtime.v1` API) over a
//! container runtime's unix socket: the calls the kubelet stand-in makes, each with a
//! deadline and an error naming the call.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use tonic::transport::{Channel, Endpoint};
use weir_proto::cri::{
    self as cri, image_service_client::ImageServiceClient, runtime_service_client::RuntimeServiceClient,
};

/// Deadlines: making a sandbox or container can take a while on a busy machine.
const SLOW: Duration = Duration::from_secs(120);
const FAST: Duration = Duration::from_secs(30);

/// A connection to one runtime.
#[derive(Clone)]
pub struct Cri {
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    socket: PathBuf,
}

fn request<T>(message: T, deadline: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.set_timeout(deadline);
    r
}

impl Cri {
    /// Connects to `socket`, waiting up to 10 s for it to appear.
    pub async fn connect(socket: &Path) -> anyhow::Result<Self> {
        Self::connect_within(socket, Duration::from_secs(10)).await
    }

    /// Connects to `socket`, waiting up to `wait` for it to appear.
    pub async fn connect_within(socket: &Path, wait: Duration) -> anyhow::Result<Self> {
        let deadline = Instant::now() + wait;
        while !socket.exists() {
            if Instant::now() > deadline {
                bail!("the runtime's socket {} did not appear within {wait:?}", socket.display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let path = socket.to_path_buf();
        let channel = Endpoint::try_from("http://[::]:50051")?
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }))
            .await
            .with_context(|| format!("connect to the runtime at {}", socket.display()))?;
        Ok(Self {
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            socket: socket.to_path_buf(),
        })
    }

    fn failed(&self, call: &str) -> impl FnOnce(tonic::Status) -> anyhow::Error + '_ {
        let call = call.to_string();
        move |status| {
            anyhow::anyhow!(
                "CRI {call} at {}: {}: {}",
                self.socket.display(),
                status.code(),
                status.message()
            )
        }
    }

    pub async fn version(&self) -> anyhow::Result<cri::VersionResponse> {
        let r = self.runtime.clone().version(request(cri::VersionRequest::default(), FAST)).await;
        Ok(r.map_err(self.failed("Version"))?.into_inner())
    }

    pub async fn run_pod_sandbox(&self, config: cri::PodSandboxConfig) -> anyhow::Result<String> {
        let req = cri::RunPodSandboxRequest { config: Some(config), runtime_handler: String::new() };
        let r = self.runtime.clone().run_pod_sandbox(request(req, SLOW)).await;
        Ok(r.map_err(self.failed("RunPodSandbox"))?.into_inner().pod_sandbox_id)
    }

    pub async fn stop_pod_sandbox(&self, id: &str) -> anyhow::Result<()> {
        let req = cri::StopPodSandboxRequest { pod_sandbox_id: id.into() };
        self.runtime
            .clone()
            .stop_pod_sandbox(request(req, SLOW))
            .await
            .map_err(self.failed("StopPodSandbox"))?;
        Ok(())
    }

    pub async fn remove_pod_sandbox(&self, id: &str) -> anyhow::Result<()> {
        let req = cri::RemovePodSandboxRequest { pod_sandbox_id: id.into() };
        let r = self.runtime.clone().remove_pod_sandbox(request(req, SLOW)).await;
        r.map_err(self.failed("RemovePodSandbox"))?;
        Ok(())
    }

    pub async fn pod_sandbox_status(&self, id: &str) -> anyhow::Result<cri::PodSandboxStatus> {
        let req = cri::PodSandboxStatusRequest { pod_sandbox_id: id.into(), verbose: false };
        let r = self.runtime.clone().pod_sandbox_status(request(req, FAST)).await;
        r.map_err(self.failed("PodSandboxStatus"))?.into_inner().status.context("PodSandboxStatus: no status")
    }

    pub async fn list_pod_sandbox(&self) -> anyhow::Result<Vec<cri::PodSandbox>> {
        let r =
            self.runtime.clone().list_pod_sandbox(request(cri::ListPodSandboxRequest::default(), FAST)).await;
        Ok(r.map_err(self.failed("ListPodSandbox"))?.into_inner().items)
    }

    pub async fn create_container(
        &self,
        sandbox: &str,
        config: cri::ContainerConfig,
        sandbox_config: cri::PodSandboxConfig,
    ) -> anyhow::Result<String> {
        let req = cri::CreateContainerRequest {
            pod_sandbox_id: sandbox.into(),
            config: Some(config),
            sandbox_config: Some(sandbox_config),
        };
        let r = self.runtime.clone().create_container(request(req, SLOW)).await;
        Ok(r.map_err(self.failed("CreateContainer"))?.into_inner().container_id)
    }

    pub async fn start_container(&self, id: &str) -> anyhow::Result<()> {
        let req = cri::StartContainerRequest { container_id: id.into() };
        self.runtime
            .clone()
            .start_container(request(req, SLOW))
            .await
            .map_err(self.failed("StartContainer"))?;
        Ok(())
    }

    /// Stops `id`: SIGTERM (or the image's stop signal), then SIGKILL after `grace`.
    pub async fn stop_container(&self, id: &str, grace: Duration) -> anyhow::Result<()> {
        let req = cri::StopContainerRequest { container_id: id.into(), timeout: grace.as_secs() as i64 };
        let r = self.runtime.clone().stop_container(request(req, grace + FAST)).await;
        r.map_err(self.failed("StopContainer"))?;
        Ok(())
    }

    pub async fn remove_container(&self, id: &str) -> anyhow::Result<()> {
        let req = cri::RemoveContainerRequest { container_id: id.into() };
        let r = self.runtime.clone().remove_container(request(req, FAST)).await;
        r.map_err(self.failed("RemoveContainer"))?;
        Ok(())
    }

    pub async fn container_status(&self, id: &str) -> anyhow::Result<cri::ContainerStatus> {
        let req = cri::ContainerStatusRequest { container_id: id.into(), verbose: false };
        let r = self.runtime.clone().container_status(request(req, FAST)).await;
        r.map_err(self.failed("ContainerStatus"))?.into_inner().status.context("ContainerStatus: no status")
    }

    pub async fn list_containers(&self) -> anyhow::Result<Vec<cri::Container>> {
        let r =
            self.runtime.clone().list_containers(request(cri::ListContainersRequest::default(), FAST)).await;
        Ok(r.map_err(self.failed("ListContainers"))?.into_inner().containers)
    }

    /// Runs `cmd` in container `id`: its exit code, stdout and stderr.
    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: &[String],
        timeout: Duration,
    ) -> anyhow::Result<(i32, Vec<u8>, Vec<u8>)> {
        let req = cri::ExecSyncRequest {
            container_id: id.into(),
            cmd: cmd.to_vec(),
            timeout: timeout.as_secs().max(1) as i64,
        };
        let r = self.runtime.clone().exec_sync(request(req, timeout + FAST)).await;
        let r = r.map_err(self.failed("ExecSync"))?.into_inner();
        Ok((r.exit_code, r.stdout, r.stderr))
    }

    /// The image `reference`, if the runtime has it.
    pub async fn image_status(&self, reference: &str) -> anyhow::Result<Option<cri::Image>> {
        let req = cri::ImageStatusRequest {
            image: Some(cri::ImageSpec { image: reference.into(), ..Default::default() }),
            verbose: false,
        };
        let r = self.images.clone().image_status(request(req, FAST)).await;
        Ok(r.map_err(self.failed("ImageStatus"))?.into_inner().image)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_socket_that_never_appears_is_named() {
        let e =
            Cri::connect_within(Path::new("/nonexistent/weir/containerd.sock"), Duration::from_millis(200))
                .await
                .err()
                .expect("no runtime there");
        assert!(e.to_string().contains("/nonexistent/weir/containerd.sock"), "{e}");
    }
}
