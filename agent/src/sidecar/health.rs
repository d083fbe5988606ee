//! Workload health for VMs: when ProxyConfig carries a `readinessProbe` (from a
//! WorkloadGroup), the agent probes the application (HTTP GET, TCP connect, exec, or
//! gRPC health, with Kubernetes' period, timeout and thresholds) together with
//! Envoy's own readiness, and reports each transition to istiod as
//! `istio.v1.HealthInformation` through the relay: healthy with no error detail,
//! unhealthy with code 13 and the reason. As pilot-agent, only transitions are sent
//! (the relay re-sends the last one on every new upstream stream), the first probe
//! runs after `initialDelaySeconds`, and the thresholds count consecutive results.

use std::{net::IpAddr, sync::Arc, time::Duration};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::{
    sidecar::envoy::Readiness,
    sidecar::status::probes::{
        AppProber, AppProbers, CheckError, GrpcAction, HttpGetAction, Prober, TcpSocketAction,
    },
    sidecar::xds::{XdsProxy, flavor::Health},
};

/// `istio.networking.v1alpha3.ReadinessProbe`, as ProxyConfig carries it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReadinessProbe {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_get: Option<HttpGetAction>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_socket: Option<TcpSocketAction>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec: Option<ExecAction>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<GrpcAction>,
    #[serde(default)]
    pub initial_delay_seconds: u32,
    #[serde(default)]
    pub timeout_seconds: u32,
    #[serde(default)]
    pub period_seconds: u32,
    #[serde(default)]
    pub success_threshold: u32,
    #[serde(default)]
    pub failure_threshold: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecAction {
    pub command: Vec<String>,
}

/// The probe with Istio's defaults filled in, checked.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthCheckSettings {
    pub probe: ReadinessProbe,
    #[serde(serialize_with = "crate::support::text::serialize_duration")]
    pub initial_delay: Duration,
    #[serde(serialize_with = "crate::support::text::serialize_duration")]
    pub timeout: Duration,
    #[serde(serialize_with = "crate::support::text::serialize_duration")]
    pub period: Duration,
    pub success_threshold: u32,
    pub failure_threshold: u32,
}

impl HealthCheckSettings {
    /// Parses ProxyConfig's `readinessProbe` value; errors say what is wrong with it.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, String> {
        let probe: ReadinessProbe = serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
        let kinds = [
            probe.http_get.is_some(),
            probe.tcp_socket.is_some(),
            probe.exec.is_some(),
            probe.grpc.is_some(),
        ];
        if kinds.iter().filter(|k| **k).count() != 1 {
            return Err("exactly one of httpGet, tcpSocket, exec or grpc is required".into());
        }
        if probe.exec.as_ref().is_some_and(|e| e.command.is_empty()) {
            return Err("exec.command is empty".into());
        }
        if let Some(scheme) = probe.http_get.as_ref().and_then(|h| h.scheme.as_deref())
            && !scheme.eq_ignore_ascii_case("http")
            && !scheme.eq_ignore_ascii_case("https")
        {
            return Err(format!("httpGet.scheme {scheme:?}: expected HTTP or HTTPS"));
        }
        let or = |v: u32, default: u32| if v == 0 { default } else { v };
        Ok(Self {
            initial_delay: Duration::from_secs(probe.initial_delay_seconds.into()),
            timeout: Duration::from_secs(or(probe.timeout_seconds, 1).into()),
            period: Duration::from_secs(or(probe.period_seconds, 10).into()),
            success_threshold: or(probe.success_threshold, 1),
            failure_threshold: or(probe.failure_threshold, 1),
            probe,
        })
    }
}

/// Counts consecutive results and says when the state flips (pure: the loop feeds it).
#[derive(Debug, Default)]
pub struct Transitions {
    successes: u32,
    failures: u32,
    last: Option<bool>,
}

impl Transitions {
    /// The report to send after this result, if the state changed.
    pub fn observe(
        &mut self,
        result: Result<(), String>,
        success_threshold: u32,
        failure_threshold: u32,
    ) -> Option<Health> {
        match result {
            Ok(()) => {
                self.successes += 1;
                self.failures = 0;
                if self.successes >= success_threshold && self.last != Some(true) {
                    self.successes = 0;
                    self.last = Some(true);
                    return Some(Health::Healthy);
                }
            }
            Err(reason) => {
                self.failures += 1;
                self.successes = 0;
                if self.failures >= failure_threshold && self.last != Some(false) {
                    self.failures = 0;
                    self.last = Some(false);
                    return Some(Health::Unhealthy(reason));
                }
            }
        }
        None
    }
}

/// Probes the app (and Envoy) and reports transitions through the relay.
pub struct WorkloadHealthChecker {
    settings: HealthCheckSettings,
    prober: AppProber,
    envoy: Option<Arc<Readiness>>,
}

const PROBE_PATH: &str = "/app-health/workload/readyz";

impl WorkloadHealthChecker {
    /// `destination`: where app probes go (the pod IP, as Istio's default host);
    /// `envoy`: Envoy's readiness when the agent runs Envoy.
    pub fn new(settings: HealthCheckSettings, destination: IpAddr, envoy: Option<Arc<Readiness>>) -> Self {
        let p = &settings.probe;
        let prober = Prober {
            http_get: p.http_get.clone().map(|mut h| {
                if h.path.is_empty() {
                    h.path = "/".into();
                }
                h
            }),
            tcp_socket: p.tcp_socket.clone(),
            grpc: p.grpc.clone(),
            timeout_seconds: settings.timeout.as_secs() as u32,
        };
        let probers = AppProbers([(PROBE_PATH.to_string(), prober)].into());
        Self { prober: AppProber::new(probers, destination), settings, envoy }
    }

    /// One probe: Envoy first (when there is one), then the application.
    pub async fn probe(&self) -> Result<(), String> {
        if let Some(envoy) = &self.envoy {
            envoy.check().await.map_err(|e| format!("Envoy is not ready: {e}"))?;
        }
        let timeout = self.settings.timeout;
        if let Some(exec) = &self.settings.probe.exec {
            return run_exec(&exec.command, timeout).await;
        }
        let outcome = match self.prober.check(PROBE_PATH, &hyper::HeaderMap::new()).await {
            Ok(outcome) => outcome,
            Err(CheckError::Failed(reason)) => return Err(reason),
            Err(CheckError::NoProber) => return Err("no prober".into()),
        };
        // kubelet: any 2xx or 3xx is a success.
        if outcome.status.is_success() || outcome.status.is_redirection() {
            Ok(())
        } else {
            Err(format!("HTTP probe failed with statuscode: {}", outcome.status.as_u16()))
        }
    }

    /// Probes every period until `stop`, reporting transitions to `relay`.
    pub async fn run(self, relay: XdsProxy, stop: CancellationToken) {
        tracing::info!(
            initial_delay = ?self.settings.initial_delay,
            period = ?self.settings.period,
            "starting the workload health check"
        );
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(self.settings.initial_delay) => {}
        }
        let mut transitions = Transitions::default();
        let mut ticker = tokio::time::interval(self.settings.period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let result = self.probe().await;
            let (s, f) = (self.settings.success_threshold, self.settings.failure_threshold);
            if let Some(report) = transitions.observe(result, s, f) {
                match &report {
                    Health::Healthy => tracing::info!("success threshold hit, marking the workload healthy"),
                    Health::Unhealthy(reason) => {
                        tracing::warn!(reason = %reason, "failure threshold hit, marking the workload unhealthy")
                    }
                }
                relay.report_health(report);
            }
        }
    }
}

/// kubelet's exec probe: exit status 0 within the timeout is a success.
async fn run_exec(command: &[String], timeout: Duration) -> Result<(), String> {
    let mut cmd = tokio::process::Command::new(&command[0]);
    cmd.args(&command[1..]).stdin(std::process::Stdio::null()).kill_on_drop(true);
    match tokio::time::timeout(timeout, cmd.output()).await {
        Err(_) => Err(format!("command {:?} timed out after {timeout:?}", command.join(" "))),
        Ok(Err(e)) => Err(format!("command {:?} could not run: {e}", command.join(" "))),
        Ok(Ok(out)) if out.status.success() => Ok(()),
        Ok(Ok(out)) => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let stdout = String::from_utf8_lossy(&out.stdout);
            let said = if stderr.trim().is_empty() { stdout } else { stderr };
            Err(format!("command {:?} exited with {}: {}", command.join(" "), out.status, said.trim()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_checks_follow_istio() {
        let s = HealthCheckSettings::from_json(&serde_json::json!({"httpGet": {"port": 8080}})).unwrap();
        assert_eq!(
            (s.initial_delay, s.timeout, s.period, s.success_threshold, s.failure_threshold),
            (Duration::ZERO, Duration::from_secs(1), Duration::from_secs(10), 1, 1)
        );
        let s = HealthCheckSettings::from_json(&serde_json::json!({
            "exec": {"command": ["cat", "/tmp/healthy"]},
            "initialDelaySeconds": 2, "periodSeconds": 3, "timeoutSeconds": 4,
            "successThreshold": 2, "failureThreshold": 3
        }))
        .unwrap();
        assert_eq!((s.period, s.success_threshold, s.failure_threshold), (Duration::from_secs(3), 2, 3));
        for (bad, needle) in [
            (serde_json::json!({}), "exactly one"),
            (serde_json::json!({"httpGet": {"port": 1}, "tcpSocket": {"port": 1}}), "exactly one"),
            (serde_json::json!({"exec": {"command": []}}), "exec.command is empty"),
            (serde_json::json!({"httpGet": {"port": 1, "scheme": "FTP"}}), "FTP"),
            (serde_json::json!({"tcpSocket": {"port": "http"}}), "integer"),
            (serde_json::json!({"tcpSocket": {"port": 1}, "periodSecond": 3}), "periodSecond"),
        ] {
            let err = HealthCheckSettings::from_json(&bad).unwrap_err();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }

    #[test]
    fn only_transitions_past_a_threshold_are_reported() {
        let mut t = Transitions::default();
        let (ok, bad) = (|| Ok(()), || Err("down".to_string()));
        // success threshold 2, failure threshold 3
        assert_eq!(t.observe(ok(), 2, 3), None);
        assert_eq!(t.observe(ok(), 2, 3), Some(Health::Healthy));
        assert_eq!(t.observe(ok(), 2, 3), None, "no repeat while healthy");
        assert_eq!(t.observe(ok(), 2, 3), None);
        assert_eq!(t.observe(bad(), 2, 3), None);
        assert_eq!(t.observe(bad(), 2, 3), None);
        assert_eq!(t.observe(ok(), 2, 3), None, "a success resets the failure count");
        assert_eq!(t.observe(bad(), 2, 3), None);
        assert_eq!(t.observe(bad(), 2, 3), None);
        assert_eq!(t.observe(bad(), 2, 3), Some(Health::Unhealthy("down".into())));
        assert_eq!(t.observe(bad(), 2, 3), None, "no repeat while unhealthy");
        assert_eq!(t.observe(ok(), 2, 3), None);
        assert_eq!(t.observe(ok(), 2, 3), Some(Health::Healthy));
        // A first failure with threshold 1 reports unhealthy straight away.
        assert_eq!(Transitions::default().observe(bad(), 1, 1), Some(Health::Unhealthy("down".into())));
    }

    #[tokio::test]
    async fn exec_probes_use_the_exit_status_and_the_timeout() {
        let cmd = |c: &[&str]| c.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(run_exec(&cmd(&["true"]), Duration::from_secs(5)).await.is_ok());
        let err = run_exec(&cmd(&["sh", "-c", "echo not ready >&2; exit 3"]), Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(err.contains("exit status: 3") && err.contains("not ready"), "{err}");
        let err = run_exec(&cmd(&["sleep", "5"]), Duration::from_millis(200)).await.unwrap_err();
        assert!(err.contains("timed out"), "{err}");
        let err = run_exec(&cmd(&["/nonexistent/probe"]), Duration::from_secs(1)).await.unwrap_err();
        assert!(err.contains("could not run"), "{err}");
    }
}
