//! Envoy as the agent's child: its command line as pilot-agent builds it, launched as
//! the proxy user when the agent is root, watched until it exits, and stopped the
//! Istio way on termination: drain inbound listeners, wait `terminationDrainDuration`
//! (or, with `EXIT_ON_ZERO_ACTIVE_CONNECTIONS`, `MINIMUM_DRAIN_DURATION` and then
//! until no user connection is left), then end it.

use std::{
    path::PathBuf,
    process::{ExitStatus, Stdio},
    time::Duration,
};

use serde::Serialize;
use tokio::process::Child;

use super::admin::EnvoyAdmin;
use crate::support::executable::Executable;

/// How the agent ends Envoy on SIGTERM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "mode")]
pub enum DrainPolicy {
    /// Drain, then wait this long (`terminationDrainDuration`, 5 s).
    Fixed {
        #[serde(serialize_with = "crate::support::text::serialize_duration")]
        wait: Duration,
    },
    /// Drain, wait `minimum`, then poll until no user connection is active
    /// (`EXIT_ON_ZERO_ACTIVE_CONNECTIONS`, `MINIMUM_DRAIN_DURATION`).
    UntilIdle {
        #[serde(serialize_with = "crate::support::text::serialize_duration")]
        minimum: Duration,
    },
}

/// What Envoy is started with.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EnvoySettings {
    pub binary: PathBuf,
    /// Where the bootstrap is written (`<configPath>/envoy-rev.json`), or
    /// `customConfigFile` used as is.
    pub bootstrap: PathBuf,
    pub custom_bootstrap: bool,
    /// The Go template rendered (`ISTIO_BOOTSTRAP`, `--templateFile` /
    /// `proxyBootstrapTemplatePath`, or the image's); `None`: Weir's built-in bootstrap.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<PathBuf>,
    /// What the bootstrap options read from the environment.
    pub bootstrap_env: crate::sidecar::envoy::bootstrap::BootstrapEnv,
    /// `ENVOY_SKIP_DEPRECATED_LOGS` (default true): Envoy's `--skip-deprecated-logs`.
    pub skip_deprecated_logs: bool,
    /// `ISTIO_BOOTSTRAP_OVERRIDE`: merged by Envoy (`--config-yaml`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_override: Option<PathBuf>,
    #[serde(serialize_with = "crate::support::text::serialize_duration")]
    pub drain_duration: Duration,
    pub drain: DrainPolicy,
    pub log_level: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub component_log_level: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    /// `v4` unless every node IP is IPv6.
    pub local_address_ip_version: &'static str,
    pub admin_port: u16,
    /// Capabilities Envoy keeps when started by a root agent: `CAP_NET_ADMIN` for
    /// TPROXY interception (transparent sockets), none otherwise.
    #[serde(serialize_with = "serialize_capabilities")]
    pub capabilities: &'static [crate::support::privileges::Capability],
    /// Start Envoy again (with backoff) when it exits on its own, instead of exiting
    /// (`WEIR_RESTART_ENVOY`, for VMs without a kubelet).
    pub restart: bool,
}

fn serialize_capabilities<S: serde::Serializer>(
    caps: &&'static [crate::support::privileges::Capability],
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_seq(caps.iter().map(ToString::to_string))
}

/// pilot-agent's Envoy command line.
pub fn args(s: &EnvoySettings, override_json: Option<&str>) -> Vec<String> {
    let mut args = vec![
        "-c".to_string(),
        s.bootstrap.display().to_string(),
        "--drain-time-s".into(),
        s.drain_duration.as_secs().to_string(),
        "--drain-strategy".into(),
        "immediate".into(),
        "--local-address-ip-version".into(),
        s.local_address_ip_version.into(),
        "--file-flush-interval-msec".into(),
        "1000".into(),
        "--disable-hot-restart".into(),
        "--allow-unknown-static-fields".into(),
        "-l".into(),
        s.log_level.clone(),
    ];
    if !s.component_log_level.is_empty() {
        args.extend(["--component-log-level".into(), s.component_log_level.clone()]);
    }
    if s.skip_deprecated_logs {
        args.push("--skip-deprecated-logs".into());
    }
    if let Some(json) = override_json {
        args.extend(["--config-yaml".into(), json.into()]);
    }
    if let Some(n) = s.concurrency.filter(|n| *n > 0) {
        args.extend(["--concurrency".into(), n.to_string()]);
    }
    args
}

/// Splits pilot-agent's `--proxyLogLevel` (`level` or `level,component:level,...`) and
/// `--proxyComponentLogLevel` into Envoy's `-l` and `--component-log-level`.
pub fn log_levels(proxy_log_level: &str, component_log_level: &str) -> (String, String) {
    let mut level = "warning".to_string();
    let mut components = Vec::new();
    for part in proxy_log_level.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if part.contains(':') {
            components.push(part.to_string());
        } else {
            level = part.to_string();
        }
    }
    components
        .extend(component_log_level.split(',').map(str::trim).filter(|p| !p.is_empty()).map(String::from));
    (level, components.join(","))
}

#[derive(Debug, thiserror::Error)]
pub enum EnvoyError {
    #[error("start Envoy")]
    Binary(#[from] crate::support::executable::ExecutableError),
    #[error("start Envoy {binary}")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("wait for Envoy")]
    Wait(#[source] std::io::Error),
}

/// The user Envoy runs as when the agent is root (istio-proxy's 1337), and the only
/// capabilities it keeps (none for REDIRECT capture; `CAP_NET_ADMIN` for TPROXY).
#[derive(Debug, Clone, Copy)]
pub struct RunAs {
    pub uid: u32,
    pub gid: u32,
    pub capabilities: &'static [crate::support::privileges::Capability],
}

/// A set of Linux capabilities as the kernel numbers them (0..=63): a 64-bit mask,
/// since `CAP_PERFMON` (38) and `CAP_BPF` (39) are past the first 32-bit word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CapabilityMask(u64);

impl CapabilityMask {
    pub fn of(capabilities: &[crate::support::privileges::Capability]) -> Self {
        Self(capabilities.iter().fold(0, |mask, c| mask | 1u64 << c.index()))
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn contains(self, index: u8) -> bool {
        index < 64 && self.0 & (1u64 << index) != 0
    }

    /// `capset`'s `_LINUX_CAPABILITY_VERSION_3` data: two `{effective, permitted,
    /// inheritable}` records, the first for capabilities 0-31, the second for 32-63.
    pub fn capset_data(self) -> [u32; 6] {
        #[expect(clippy::cast_possible_truncation, reason = "each word takes 32 of the 64 bits")]
        let (low, high) = (self.0 as u32, (self.0 >> 32) as u32);
        [low, low, low, high, high, high]
    }
}

/// In the child between fork and exec: drops to `uid`:`gid` with no supplementary
/// groups, keeping only `mask` (effective, permitted, inheritable and ambient, so the
/// capabilities survive the exec of a binary without file capabilities).
///
/// # Safety
/// Only for a `pre_exec` hook: it makes raw, async-signal-safe system calls only.
unsafe fn become_user(uid: u32, gid: u32, mask: CapabilityMask) -> std::io::Result<()> {
    let fail = || Err(std::io::Error::last_os_error());
    // SAFETY: plain system calls on this process with valid arguments.
    unsafe {
        if !mask.is_empty() && libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0 {
            return fail();
        }
        if libc::setgroups(0, std::ptr::null()) != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0 {
            return fail();
        }
        if mask.is_empty() {
            return Ok(());
        }
        // _LINUX_CAPABILITY_VERSION_3, this process.
        let header = [0x2008_0522u32, 0];
        let data = mask.capset_data();
        if libc::syscall(libc::SYS_capset, header.as_ptr(), data.as_ptr()) != 0 {
            return fail();
        }
        for cap in 0..64u8 {
            if mask.contains(cap)
                && libc::prctl(
                    libc::PR_CAP_AMBIENT,
                    libc::PR_CAP_AMBIENT_RAISE,
                    libc::c_ulong::from(cap),
                    0,
                    0,
                ) != 0
            {
                return fail();
            }
        }
    }
    Ok(())
}

/// A running Envoy.
pub struct EnvoyProcess {
    child: Child,
    pub pid: u32,
    admin: EnvoyAdmin,
}

impl EnvoyProcess {
    /// Starts Envoy with `args`; as `run_as` when given. Envoy inherits the agent's
    /// stdout/stderr (its logs are the container's logs, as in Istio) and dies with
    /// the agent. The binary is opened by the agent and run through that descriptor,
    /// so Envoy's user needs no access to the directories above it.
    pub fn spawn(s: &EnvoySettings, args: &[String], run_as: Option<RunAs>) -> Result<Self, EnvoyError> {
        let binary = Executable::open(&s.binary)?;
        let mut cmd = binary.tokio_command();
        cmd.args(args).stdin(Stdio::null()).kill_on_drop(true);
        cmd.envs(extra_env(s));
        // Computed before fork: the child may only make raw system calls.
        let drop_to = run_as.map(|r| (r, CapabilityMask::of(r.capabilities)));
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs between fork and exec and only makes
        // async-signal-safe system calls (prctl, setgroups, setgid, setuid, capset,
        // getppid, _exit).
        unsafe {
            cmd.pre_exec(move || {
                if let Some((r, mask)) = drop_to {
                    become_user(r.uid, r.gid, mask)?;
                }
                // Envoy dies with the agent, however the agent ends (SIGKILL too): set
                // after the credential change, which clears it; an agent that died
                // before it was set means now.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 || libc::getppid() != parent {
                    libc::_exit(137);
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|source| EnvoyError::Spawn { binary: s.binary.clone(), source })?;
        let pid = child.id().unwrap_or_default();
        tracing::info!(pid, binary = %s.binary.display(), args = ?args, run_as = ?run_as, "Envoy started");
        Ok(Self { child, pid, admin: EnvoyAdmin::new(s.admin_port) })
    }

    /// Waits for Envoy to exit on its own.
    pub async fn wait(&mut self) -> Result<ExitStatus, EnvoyError> {
        self.child.wait().await.map_err(EnvoyError::Wait)
    }

    /// Istio's termination: drain listeners (inbound only for a sidecar), wait per
    /// `policy`, then end Envoy. `None`: already drained (`POST /drain`,
    /// `/quitquitquit`), end it now. Returns how Envoy exited.
    pub async fn terminate(
        mut self,
        policy: Option<DrainPolicy>,
        inbound_only: bool,
        ignored: &[String],
    ) -> ExitStatus {
        let waited = match policy {
            None => {
                tracing::info!("already drained: stopping Envoy now");
                None
            }
            Some(policy) => {
                if let Err(e) = self.admin.drain(inbound_only, false).await {
                    tracing::warn!(error = %crate::error_chain(&e), "cannot start draining Envoy's listeners");
                }
                match policy {
                    DrainPolicy::Fixed { wait } => {
                        tracing::info!(drain = ?wait, "graceful termination period starting");
                        tokio::time::timeout(wait, self.child.wait()).await.ok()
                    }
                    DrainPolicy::UntilIdle { minimum } => {
                        tracing::info!(minimum = ?minimum, "draining, then waiting for active connections to end");
                        match tokio::time::timeout(minimum, self.child.wait()).await {
                            Ok(done) => Some(done),
                            Err(_) => tokio::select! {
                                done = self.child.wait() => Some(done),
                                _ = wait_until_idle(self.admin, ignored) => None,
                            },
                        }
                    }
                }
            }
        };
        if let Some(Ok(status)) = waited {
            tracing::warn!(%status, "Envoy exited before the drain ended");
            return status;
        }
        tracing::info!(pid = self.pid, "stopping Envoy");
        let _ = self.child.start_kill();
        match self.child.wait().await {
            Ok(status) => status,
            Err(e) => {
                tracing::error!(error = %e, "cannot reap Envoy");
                std::os::unix::process::ExitStatusExt::from_raw(0)
            }
        }
    }
}

/// What Envoy gets in its environment besides the agent's: under a FIPS
/// `COMPLIANCE_POLICY`, its google_grpc client's TLS 1.2 suites (pilot-agent's
/// `GRPC_SSL_CIPHER_SUITES`, pkg/envoy/proxy.go).
fn extra_env(s: &EnvoySettings) -> Vec<(&'static str, &'static str)> {
    crate::support::tls::Compliance::parse(&s.bootstrap_env.compliance_policy)
        .unwrap_or_default()
        .grpc_ssl_cipher_suites()
        .map(|suites| ("GRPC_SSL_CIPHER_SUITES", suites))
        .into_iter()
        .collect()
}

/// Polls `downstream_cx_active` of user listeners every second until it is zero (or
/// Envoy stops answering five times in a row).
async fn wait_until_idle(admin: EnvoyAdmin, ignored: &[String]) {
    let mut failures = 0;
    loop {
        match admin.stats("downstream_cx_active$").await {
            Ok(stats) => {
                failures = 0;
                let active: u64 = stats
                    .iter()
                    .filter(|(name, _)| {
                        name.starts_with("listener.")
                            && !name.contains("worker_")
                            && !name.starts_with("listener.admin.")
                            && !name.starts_with("listener.envoy_internal_")
                            && !ignored.iter().any(|i| i == *name)
                    })
                    .map(|(_, v)| *v)
                    .sum();
                if active == 0 {
                    tracing::info!("no active connections left");
                    return;
                }
                tracing::info!(active, "still draining active connections");
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %crate::error_chain(&e), failures, "cannot read active connections");
                if failures >= 5 {
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> EnvoySettings {
        EnvoySettings {
            binary: "/usr/local/bin/envoy".into(),
            bootstrap: "./etc/istio/proxy/envoy-rev.json".into(),
            custom_bootstrap: false,
            template: None,
            bootstrap_env: Default::default(),
            skip_deprecated_logs: true,
            bootstrap_override: None,
            drain_duration: Duration::from_secs(45),
            drain: DrainPolicy::Fixed { wait: Duration::from_secs(5) },
            log_level: "warning".into(),
            component_log_level: "misc:error".into(),
            concurrency: Some(2),
            local_address_ip_version: "v4",
            admin_port: 15000,
            capabilities: &[],
            restart: false,
        }
    }

    #[test]
    fn the_command_line_is_pilot_agents() {
        let a = args(&settings(), Some("{\"a\":1}"));
        assert_eq!(
            a.join(" "),
            "-c ./etc/istio/proxy/envoy-rev.json --drain-time-s 45 --drain-strategy immediate \
             --local-address-ip-version v4 --file-flush-interval-msec 1000 --disable-hot-restart \
             --allow-unknown-static-fields -l warning --component-log-level misc:error \
             --skip-deprecated-logs --config-yaml {\"a\":1} --concurrency 2"
        );
    }

    #[test]
    fn capability_masks_reach_past_the_first_32_bits() {
        use crate::support::privileges::Capability;
        let mask = CapabilityMask::of(&[Capability::NetAdmin, Capability::Perfmon, Capability::Bpf]);
        assert!(mask.contains(12) && mask.contains(38) && mask.contains(39));
        assert!(!mask.contains(7) && !mask.contains(6), "no wrap-around onto CAP_SETUID/CAP_SETGID");
        let word = 1 << 12;
        let high = (1 << (38 - 32)) | (1 << (39 - 32));
        assert_eq!(mask.capset_data(), [word, word, word, high, high, high]);
        assert!(CapabilityMask::of(&[]).is_empty());
    }

    /// The drop to the proxy user as Envoy gets it, checked in the kernel's own view:
    /// a child keeps exactly the capabilities asked for, those above 31 included.
    #[test]
    fn a_child_keeps_capabilities_above_31_through_the_user_change() {
        use std::os::unix::process::CommandExt as _;

        use crate::support::privileges::Capability;
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test changes the child's user and capabilities: run it as root"
        );
        let mask = CapabilityMask::of(&[Capability::NetAdmin, Capability::Bpf, Capability::Perfmon]);
        let mut cmd = std::process::Command::new("/bin/cat");
        cmd.arg("/proc/self/status");
        // SAFETY: become_user only makes raw system calls.
        unsafe { cmd.pre_exec(move || become_user(1337, 1337, mask)) };
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let status = String::from_utf8(out.stdout).unwrap();
        let field = |name: &str| {
            let line =
                status.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {status}"));
            u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
        };
        let want = (1 << 12) | (1 << 38) | (1 << 39);
        for name in ["CapEff:", "CapPrm:", "CapAmb:"] {
            assert_eq!(field(name), want, "{name} in\n{status}");
        }
        assert!(status.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("1337")));
    }

    /// Under COMPLIANCE_POLICY=fips-140-3 (and fips-140-2) Envoy's google_grpc client
    /// is limited to the FIPS TLS 1.2 suites through its environment, as pilot-agent
    /// starts it; without a policy Envoy's environment is the agent's.
    #[test]
    fn a_fips_policy_limits_envoys_grpc_ciphers_through_its_environment() {
        let mut s = settings();
        assert!(extra_env(&s).is_empty());
        s.bootstrap_env.compliance_policy = "fips-140-3".into();
        assert_eq!(
            extra_env(&s),
            [(
                "GRPC_SSL_CIPHER_SUITES",
                "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384"
            )]
        );
    }

    /// An Envoy admin answering every `/stats` with `stats`.
    async fn admin_serving(stats: &'static str) -> EnvoyAdmin {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(crate::support::http1::serve(listener, move |_, _| async move {
            hyper::Response::new(http_body_util::Full::new(bytes::Bytes::from_static(stats.as_bytes())))
        }));
        EnvoyAdmin::new(port)
    }

    /// EXIT_ON_ZERO_ACTIVE_CONNECTIONS (istio/istio#60728): connections on Envoy's
    /// internal listeners (`envoy_internal_*`: ambient's HBONE connect_originate,
    /// main_internal), the admin listener and Istio's own listeners are not downstream
    /// clients; with only those active the drain is over at the first look. One
    /// connection on a user listener keeps it waiting.
    #[tokio::test]
    async fn the_drain_waits_for_user_connections_only_not_internal_listeners() {
        const INTERNAL_ONLY: &str = "http.admin.downstream_cx_active: 2\n\
            listener.0.0.0.0_15021.downstream_cx_active: 1\n\
            listener.0.0.0.0_8443.downstream_cx_active: 0\n\
            listener.admin.downstream_cx_active: 2\n\
            listener.admin.main_thread.downstream_cx_active: 2\n\
            listener.envoy_internal_connect_originate.downstream_cx_active: 2\n\
            listener.envoy_internal_connect_originate.worker_0.downstream_cx_active: 2\n\
            listener.envoy_internal_main_internal.downstream_cx_active: 3\n\
            listener.envoy_internal_inner_connect_originate.downstream_cx_active: 1\n\
            listener.envoy_internal_outer_connect_originate.downstream_cx_active: 1\n";
        const ONE_USER: &str = "listener.0.0.0.0_8443.downstream_cx_active: 1\n\
            listener.envoy_internal_main_internal.downstream_cx_active: 3\n";
        let known = ["listener.0.0.0.0_15021.downstream_cx_active".to_string()];
        let idle = admin_serving(INTERNAL_ONLY).await;
        tokio::time::timeout(Duration::from_millis(900), wait_until_idle(idle, &known))
            .await
            .expect("only internal, admin and Istio listeners are active: drained at once");
        let busy = admin_serving(ONE_USER).await;
        let waited = tokio::time::timeout(Duration::from_millis(1500), wait_until_idle(busy, &known)).await;
        assert!(waited.is_err(), "a user connection keeps the drain waiting");
    }

    #[test]
    fn log_levels_split_as_pilot_agent() {
        assert_eq!(log_levels("warning", ""), ("warning".into(), "".into()));
        assert_eq!(
            log_levels("info,misc:error", "upstream:debug"),
            ("info".into(), "misc:error,upstream:debug".into())
        );
        assert_eq!(log_levels("", "misc:error"), ("warning".into(), "misc:error".into()));
    }
}
