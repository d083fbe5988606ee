//! An injected pod's file system and its agent for tests: a root directory laid out as
//! Istio's injector mounts it (`etc/istio/proxy`, the istiod root certificate, the
//! service-account token), and `weir proxy sidecar` started there as the proxy user,
//! the way the `istio-proxy` container runs `pilot-agent`.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use anyhow::bail;

use crate::{Placement, Pod, PodChild, envoy::tempfile_dir::Dir, tools};

/// The proxy user (istio-proxy's uid).
pub const PROXY_UID: u32 = 1337;

/// A pod's root as the sidecar sees it (the agent's working directory).
pub struct SidecarRoot {
    dir: Dir,
}

impl SidecarRoot {
    /// Lays out the mounts: `etc/istio/proxy`, `var/run/secrets/workload-spiffe-uds` and
    /// `var/run/secrets/credential-uds` (the injector's emptyDirs, writable by the proxy user),
    /// `var/run/secrets/istio/root-cert.pem` and `var/run/secrets/tokens/istio-token`.
    pub fn new(root_cert_pem: &str, token: &str) -> anyhow::Result<Self> {
        let dir = Dir::new("pod-root")?;
        let root = dir.path();
        for dir in
            ["etc/istio/proxy", "var/run/secrets/workload-spiffe-uds", "var/run/secrets/credential-uds"]
        {
            let dir = root.join(dir);
            std::fs::create_dir_all(&dir)?;
            std::os::unix::fs::chown(&dir, Some(PROXY_UID), Some(PROXY_UID))?;
        }
        for (path, text) in [
            ("var/run/secrets/istio/root-cert.pem", root_cert_pem),
            ("var/run/secrets/tokens/istio-token", token),
        ] {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().expect("has a parent"))?;
            std::fs::write(&path, text)?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        }
        // Every directory on the way must be searchable by the proxy user.
        for d in [
            "etc",
            "etc/istio",
            "var",
            "var/run",
            "var/run/secrets",
            "var/run/secrets/istio",
            "var/run/secrets/tokens",
        ] {
            std::fs::set_permissions(root.join(d), std::fs::Permissions::from_mode(0o755))?;
        }
        Ok(Self { dir })
    }

    /// A bare host's root (a VM, no Kubernetes volumes): only istiod's root
    /// certificate and the token, every directory root's and 0755; the agent makes the
    /// rest.
    pub fn bare(root_cert_pem: &str, token: &str) -> anyhow::Result<Self> {
        let dir = Dir::new("bare-root")?;
        for (path, text) in [
            ("var/run/secrets/istio/root-cert.pem", root_cert_pem),
            ("var/run/secrets/tokens/istio-token", token),
        ] {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().expect("has a parent"))?;
            std::fs::write(&path, text)?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        }
        for d in ["var", "var/run", "var/run/secrets", "var/run/secrets/istio", "var/run/secrets/tokens"] {
            std::fs::set_permissions(dir.path().join(d), std::fs::Permissions::from_mode(0o755))?;
        }
        Ok(Self { dir })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Where the agent serves xDS to Envoy.
    pub fn xds_socket(&self) -> PathBuf {
        self.path().join("etc/istio/proxy/XDS")
    }

    /// Where the agent serves SDS to Envoy.
    pub fn sds_socket(&self) -> PathBuf {
        self.path().join("var/run/secrets/workload-spiffe-uds/socket")
    }

    /// The bootstrap the agent wrote for Envoy.
    pub fn bootstrap(&self) -> PathBuf {
        self.path().join("etc/istio/proxy/envoy-rev.json")
    }

    /// Rewrites the token file (the kubelet rotating it).
    pub fn set_token(&self, token: &str) -> std::io::Result<()> {
        std::fs::write(self.path().join("var/run/secrets/tokens/istio-token"), token)
    }
}

/// `weir proxy sidecar` running in a pod.
pub struct AgentProcess {
    pub child: PodChild,
    log: PathBuf,
}

impl AgentProcess {
    /// Starts the agent in `pod` as the proxy user with `root` as its working directory
    /// and `env` added to a clean environment; returns once its XDS socket exists.
    pub fn start(
        pod: &Pod,
        root: &SidecarRoot,
        env: &[(&str, &str)],
        resolv_conf: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let args = ["proxy", "sidecar", "--domain", "default.svc.cluster.local"];
        Self::launch(pod, root, tools::weir_command(), &args, env, Some((PROXY_UID, PROXY_UID)), resolv_conf)
    }

    /// Starts `cmd` (`tools::weir_command()` or `tools::pilot_agent_command()`) with
    /// `args` in `pod`, as `user` (root when `None`), in `root`, with `env` added to a
    /// clean environment; returns once its XDS socket exists.
    pub fn launch(
        pod: &Pod,
        root: &SidecarRoot,
        mut cmd: Command,
        args: &[&str],
        env: &[(&str, &str)],
        user: Option<(u32, u32)>,
        resolv_conf: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let log = root.path().join("agent.log");
        let file = std::fs::File::create(&log)?;
        cmd.args(args)
            .current_dir(root.path())
            .env_clear()
            .env("WEIR_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        let child = pod.spawn_placed(&mut cmd, Placement { user, resolv_conf, ..Placement::default() })?;
        let mut agent = Self { child, log };
        let deadline = Instant::now() + Duration::from_secs(15);
        while !root.xds_socket().exists() {
            if let Some(status) = agent.child.child_mut().try_wait()? {
                bail!("weir proxy exited with {status} during start; log:\n{}", agent.log());
            }
            if Instant::now() > deadline {
                bail!(
                    "weir proxy did not create {} in 15s; log:\n{}",
                    root.xds_socket().display(),
                    agent.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(agent)
    }

    /// What the agent logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the agent is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.child_mut().try_wait(), Ok(None))
    }

    /// The agent's children (Envoy), by pid.
    pub fn children(&self) -> Vec<u32> {
        let pid = self.child.pid();
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
        tasks
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
            .flat_map(|c| c.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>())
            .collect()
    }

    /// Waits up to `timeout` for the agent to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        match self.child.wait_timeout(timeout)? {
            Some(status) => Ok(status),
            None => bail!("weir proxy still running after {timeout:?}; log:\n{}", self.log()),
        }
    }

    /// SIGKILL (no drain, no cleanup: as the kernel's OOM killer ends it), and reaps it.
    pub fn kill(&mut self) -> anyhow::Result<ExitStatus> {
        self.child.signal(libc::SIGKILL)?;
        match self.child.wait_timeout(Duration::from_secs(10))? {
            Some(status) => Ok(status),
            None => bail!("weir proxy survived SIGKILL for 10 s"),
        }
    }

    /// SIGTERM, then waits up to 10 s for it to exit.
    pub fn terminate(&mut self) -> anyhow::Result<ExitStatus> {
        self.child.signal(libc::SIGTERM)?;
        match self.child.wait_timeout(Duration::from_secs(10))? {
            Some(status) => Ok(status),
            None => bail!("weir proxy still running 10s after SIGTERM; log:\n{}", self.log()),
        }
    }
}

/// Peak resident set size (`VmHWM`) of `pid`, in KiB.
pub fn peak_rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM in /proc/{pid}/status"))
}

/// The env of an `istio-proxy` container talking to the test istiod at `discovery`:
/// `PROXY_CONFIG` naming it, `ISTIOD_SAN`, the cluster id, the pod's name (also its
/// service account) and namespace `default`, and its instance IP.
pub struct IstiodEnv {
    proxy_config: String,
    ip: String,
    name: String,
}

impl IstiodEnv {
    pub fn new(discovery: std::net::SocketAddr, pod: &Pod, name: &str) -> Self {
        Self {
            proxy_config: format!("{{\"discoveryAddress\": \"{discovery}\"}}"),
            ip: pod.ipv4().to_string(),
            name: name.into(),
        }
    }

    /// These variables followed by `extra`.
    pub fn with<'a>(&'a self, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        let mut env = vec![
            ("PROXY_CONFIG", self.proxy_config.as_str()),
            ("ISTIOD_SAN", crate::control_plane::ISTIOD_SAN),
            ("ISTIO_META_CLUSTER_ID", crate::control_plane::CLUSTER_ID),
            ("POD_NAME", self.name.as_str()),
            ("POD_NAMESPACE", "default"),
            ("SERVICE_ACCOUNT", self.name.as_str()),
            ("INSTANCE_IP", self.ip.as_str()),
        ];
        env.extend_from_slice(extra);
        env
    }
}
