//! `weir cni ambient-rules`: what the ambient node agent would program, printed and
//! not applied (a dry run): a pod's in-pod rules for the agent's settings (read from
//! the environment under istio-cni's names: `AMBIENT_DNS_CAPTURE`, `AMBIENT_IPV6`,
//! `NATIVE_NFTABLES`, `HOST_PROBE_SNAT_IP(V6)`) and the pod's annotations, or with
//! `--host-probe` the node's probe SNAT rule. The output is Istio's golden format: the
//! iptables transcript (`iptables-restore` input and commands) or the nft transaction.

use weir_iptables::{
    ambient::{
        AmbientBackend, AmbientConfig, PodOverrides, program_host_iptables, program_host_nft,
        program_inpod_iptables, program_inpod_nft,
    },
    nft_exec::NftRecorder,
    xtables::Recorder,
};

/// Why the rules could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum RulesCmdError {
    #[error(transparent)]
    Config(#[from] weir_iptables::config::ConfigError),
    #[error("--annotation {0:?}: expected KEY=VALUE")]
    Annotation(String),
    #[error("render the rules")]
    Render(#[source] weir_iptables::apply::CaptureError),
}

/// What to print.
#[derive(Debug, Clone, Default)]
pub struct RulesRequest {
    /// The pod's annotations (`KEY=VALUE`).
    pub annotations: Vec<String>,
    /// The node's probe rule instead of a pod's rules.
    pub host_probe: bool,
    /// kubelet's uid, for the nftables probe rule.
    pub kubelet_uid: u32,
}

/// The rules as Istio's goldens hold them, for `cfg` (the agent's settings) and `req`.
pub fn render(cfg: &AmbientConfig, req: &RulesRequest) -> Result<String, RulesCmdError> {
    let pairs: Vec<(String, String)> = req
        .annotations
        .iter()
        .map(|a| {
            a.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| RulesCmdError::Annotation(a.clone()))
        })
        .collect::<Result<_, _>>()?;
    let pod = PodOverrides::from_annotations(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
    let out = match (cfg.backend, req.host_probe) {
        (AmbientBackend::Iptables, false) => {
            let mut rec = Recorder::default();
            program_inpod_iptables(&cfg.for_pod(pod), &mut rec).map_err(RulesCmdError::Render)?;
            rec.lines.join("\n")
        }
        (AmbientBackend::Nftables, false) => {
            let mut rec = NftRecorder::default();
            program_inpod_nft(&cfg.for_pod(pod), &mut rec).map_err(RulesCmdError::Render)?;
            rec.transactions.join("\n")
        }
        (AmbientBackend::Iptables, true) => {
            let mut rec = Recorder::default();
            program_host_iptables(cfg, &mut rec).map_err(RulesCmdError::Render)?;
            rec.lines.join("\n")
        }
        (AmbientBackend::Nftables, true) => {
            let mut rec = NftRecorder::default();
            program_host_nft(cfg, req.kubelet_uid, &mut rec).map_err(RulesCmdError::Render)?;
            rec.transactions.join("\n")
        }
    };
    Ok(out.trim_end().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn annotations_choose_the_pods_rules_and_bad_ones_are_named() {
        let cfg = AmbientConfig::default();
        let plain = render(&cfg, &RulesRequest::default()).unwrap();
        let ingress = render(
            &cfg,
            &RulesRequest {
                annotations: vec!["ambient.istio.io/bypass-inbound-capture=true".into()],
                ..Default::default()
            },
        )
        .unwrap();
        assert!(plain.contains("--to-ports 15006") && !ingress.contains("--to-ports 15006"), "{ingress}");
        let e = render(&cfg, &RulesRequest { annotations: vec!["novalue".into()], ..Default::default() })
            .unwrap_err();
        assert_eq!(e.to_string(), "--annotation \"novalue\": expected KEY=VALUE");
        let nft = AmbientConfig { backend: AmbientBackend::Nftables, ..cfg };
        let host = render(&nft, &RulesRequest { host_probe: true, kubelet_uid: 1000, ..Default::default() })
            .unwrap();
        assert!(host.contains("skuid 1000"), "{host}");
    }
}
