//! Istio's ambient iptables rules as pure plans: the in-pod rules that send a pod's
//! traffic to ztunnel (15001 out, 15006 in, 15053 DNS) and the node's host-probe rule
//! that SNATs kubelet's probes to 169.254.7.127, in the order Istio's node agent
//! builds them, so the shared renderer ([`crate::iptables::render`]) writes Istio's exact
//! iptables-restore input.

use super::{
    config::{AmbientConfig, InpodConfig},
    constants::{
        INPOD_MARK, INPOD_MASK, INPOD_RESTORE_MASK, INPOD_TPROXY_MARK, INPOD_TPROXY_MASK, PROBE_SET_V4,
        PROBE_SET_V6, ZTUNNEL_DNS_PORT, ZTUNNEL_INBOUND_PLAINTEXT_PORT, ZTUNNEL_INBOUND_PORT,
        ZTUNNEL_OUTBOUND_PORT,
    },
};
use crate::iptables::plan::{Builder, RulePlan, SPECIFIC, Table};

/// The chains the in-pod rules own (both in mangle, nat and raw).
pub const CHAIN_OUTPUT: &str = "ISTIO_OUTPUT";
pub const CHAIN_PREROUTING: &str = "ISTIO_PRERT";
/// The chain the host-probe rule owns (nat, on the node).
pub const CHAIN_POSTROUTING: &str = "ISTIO_POSTRT";

fn hex(v: u32) -> String {
    format!("0x{v:x}")
}

/// The values the in-pod rules share, as iptables writes them.
struct Inpod {
    b: Builder,
    /// `0x539/0xfff`: ztunnel's own packets.
    mark: String,
    /// `0x111/0xfff`: connections ztunnel accepted.
    tproxy_mark: String,
    probe4: String,
    probe6: String,
    outbound: String,
}

/// The in-pod rules for one pod (Istio's `AppendInpodRules`), in Istio's order.
pub fn inpod(cfg: &InpodConfig) -> RulePlan {
    use Table::*;
    let (out, pre) = (CHAIN_OUTPUT, CHAIN_PREROUTING);
    let mut p = Inpod {
        b: Builder { plan: RulePlan { ipv6: cfg.ambient.enable_ipv6, ..Default::default() } },
        mark: format!("{}/{}", hex(INPOD_MARK), hex(INPOD_MASK)),
        tproxy_mark: format!("{}/{}", hex(INPOD_TPROXY_MARK), hex(INPOD_TPROXY_MASK)),
        probe4: cfg.ambient.host_probe_snat_v4.to_string(),
        probe6: cfg.ambient.host_probe_snat_v6.to_string(),
        outbound: ZTUNNEL_OUTBOUND_PORT.to_string(),
    };
    let dns = cfg.redirect_dns();
    // Jumps into the owned chains, which keeps cleanup to the chains and these jumps.
    p.b.append("PREROUTING", Mangle, &["-j", pre]);
    p.b.append("OUTPUT", Mangle, &["-j", out]);
    p.b.append("OUTPUT", Nat, &["-j", out]);
    if dns {
        p.b.append("PREROUTING", Raw, &["-j", pre]);
        p.b.append("OUTPUT", Raw, &["-j", out]);
    }
    p.b.append("PREROUTING", Nat, &["-j", pre]);
    // Virtual interfaces: their inbound TCP is outbound traffic, sent to 15001.
    for nic in &cfg.pod.virtual_interfaces {
        p.b.append(pre, Nat, &["-i", nic, "-p", "tcp", "-j", "REDIRECT", "--to-ports", &p.outbound]);
        p.b.append(pre, Nat, &["-i", nic, "-p", "tcp", "-j", "RETURN"]);
    }
    inbound(&mut p, cfg.pod.ingress_mode);
    let restore_mask = hex(INPOD_RESTORE_MASK);
    p.b.append(
        out,
        Mangle,
        &[
            "-m",
            "connmark",
            "--mark",
            &p.tproxy_mark,
            "-j",
            "CONNMARK",
            "--restore-mark",
            "--nfmask",
            &restore_mask,
            "--ctmask",
            &restore_mask,
        ],
    );
    if dns {
        dns_rules(&mut p);
    }
    outbound(&mut p);
    p.b.plan
}

/// Connection marking, the probe exemptions and (unless ingress mode) inbound to 15006.
fn inbound(p: &mut Inpod, ingress: bool) {
    use Table::*;
    let (out, pre) = (CHAIN_OUTPUT, CHAIN_PREROUTING);
    // ztunnel's marked packets set the connection mark.
    p.b.append(
        pre,
        Mangle,
        &["-m", "mark", "--mark", &p.mark, "-j", "CONNMARK", "--set-xmark", &p.tproxy_mark],
    );
    let accept = ["-p", "tcp", "-m", "tcp", "-j", "ACCEPT"];
    if !ingress {
        // Kubelet's probes, SNATed on the node, are not captured on the way in...
        let params: Vec<&str> = ["-s", SPECIFIC].iter().chain(&accept).copied().collect();
        p.b.append_versioned(&p.probe4, &p.probe6, pre, Nat, &params);
    }
    // ...nor their replies on the way out.
    let params: Vec<&str> = ["-d", SPECIFIC].iter().chain(&accept).copied().collect();
    p.b.append_versioned(&p.probe4, &p.probe6, out, Nat, &params);
    if !ingress {
        let inbound = ZTUNNEL_INBOUND_PORT.to_string();
        let plaintext = ZTUNNEL_INBOUND_PLAINTEXT_PORT.to_string();
        p.b.append_versioned(
            "127.0.0.1/32",
            "::1/128",
            pre,
            Nat,
            &[
                "!",
                "-d",
                SPECIFIC,
                "-p",
                "tcp",
                "!",
                "--dport",
                &inbound,
                "-m",
                "mark",
                "!",
                "--mark",
                &p.mark,
                "-j",
                "REDIRECT",
                "--to-ports",
                &plaintext,
            ],
        );
    }
}

/// DNS to ztunnel's 15053, and ztunnel's upstream queries in their own conntrack zone
/// (istio/istio#33469).
fn dns_rules(p: &mut Inpod) {
    use Table::*;
    let (out, pre) = (CHAIN_OUTPUT, CHAIN_PREROUTING);
    let (mark, dns_port) = (p.mark.as_str(), ZTUNNEL_DNS_PORT.to_string());
    p.b.append(
        out,
        Nat,
        &[
            "!",
            "-o",
            "lo",
            "-p",
            "udp",
            "-m",
            "mark",
            "!",
            "--mark",
            mark,
            "-m",
            "udp",
            "--dport",
            "53",
            "-j",
            "REDIRECT",
            "--to-port",
            &dns_port,
        ],
    );
    p.b.append_versioned(
        "127.0.0.1/32",
        "::1/128",
        out,
        Nat,
        &[
            "!",
            "-d",
            SPECIFIC,
            "-p",
            "tcp",
            "--dport",
            "53",
            "-m",
            "mark",
            "!",
            "--mark",
            mark,
            "-j",
            "REDIRECT",
            "--to-ports",
            &dns_port,
        ],
    );
    p.b.append(
        out,
        Raw,
        &["-p", "udp", "-m", "mark", "--mark", mark, "-m", "udp", "--dport", "53", "-j", "CT", "--zone", "1"],
    );
    p.b.append(
        pre,
        Raw,
        &[
            "-p", "udp", "-m", "mark", "!", "--mark", mark, "-m", "udp", "--sport", "53", "-j", "CT",
            "--zone", "1",
        ],
    );
}

/// Outbound: accepted connections' replies pass, the app calling itself over lo stays
/// local, everything else not from ztunnel goes to 15001.
fn outbound(p: &mut Inpod) {
    let out = CHAIN_OUTPUT;
    p.b.append(out, Table::Nat, &["-p", "tcp", "-m", "mark", "--mark", &p.tproxy_mark, "-j", "ACCEPT"]);
    p.b.append_versioned(
        "127.0.0.1/32",
        "::1/128",
        out,
        Table::Nat,
        &["!", "-d", SPECIFIC, "-o", "lo", "-j", "ACCEPT"],
    );
    p.b.append_versioned(
        "127.0.0.1/32",
        "::1/128",
        out,
        Table::Nat,
        &[
            "!",
            "-d",
            SPECIFIC,
            "-p",
            "tcp",
            "-m",
            "mark",
            "!",
            "--mark",
            &p.mark,
            "-j",
            "REDIRECT",
            "--to-ports",
            &p.outbound,
        ],
    );
}

/// The node's rule that SNATs kubelet's probes to the pods in the probe sets (Istio's
/// `AppendHostRules`): a locally originated TCP packet (`--socket-exists`) to an
/// address in `istio-inpod-probes-v4` (`-v6`) leaves from the probe address.
pub fn host_probe(cfg: &AmbientConfig) -> RulePlan {
    let mut b = Builder { plan: RulePlan { ipv6: cfg.enable_ipv6, ..Default::default() } };
    b.insert("POSTROUTING", Table::Nat, 1, &["-j", CHAIN_POSTROUTING]);
    let snat = |set: &'static str, to: &str| -> Vec<String> {
        [
            "-m",
            "owner",
            "--socket-exists",
            "-p",
            "tcp",
            "-m",
            "set",
            "--match-set",
            set,
            "dst",
            "-j",
            "SNAT",
            "--to-source",
            to,
        ]
        .map(String::from)
        .to_vec()
    };
    let v4 = snat(PROBE_SET_V4, &cfg.host_probe_snat_v4.to_string());
    b.append_v4(CHAIN_POSTROUTING, Table::Nat, &v4.iter().map(String::as_str).collect::<Vec<_>>());
    let v6 = snat(PROBE_SET_V6, &cfg.host_probe_snat_v6.to_string());
    b.append_v6(CHAIN_POSTROUTING, Table::Nat, &v6.iter().map(String::as_str).collect::<Vec<_>>());
    b.plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        ambient::{PodDns, PodOverrides},
        iptables::render,
    };

    #[test]
    fn ingress_mode_drops_inbound_redirection_only() {
        let cfg = InpodConfig::default();
        let ingress =
            InpodConfig { pod: PodOverrides { ingress_mode: true, ..Default::default() }, ..cfg.clone() };
        let text = render::restore(&inpod(&cfg).v4);
        let ingress = render::restore(&inpod(&ingress).v4);
        assert!(text.contains("--to-ports 15006") && !ingress.contains("--to-ports 15006"));
        assert!(ingress.contains("--to-ports 15001"), "outbound still captured");
        assert!(ingress.contains("-A PREROUTING -j ISTIO_PRERT"), "the jump stays, as Istio's");
    }

    #[test]
    fn dns_rules_follow_the_pod_override() {
        let global_on = AmbientConfig { redirect_dns: true, ..Default::default() };
        let off = global_on.for_pod(PodOverrides { dns: PodDns::Disabled, ..Default::default() });
        let text = render::restore(&inpod(&off).v4);
        assert!(!text.contains("15053") && !text.contains("* raw"), "{text}");
    }

    #[test]
    fn ipv6_rules_only_when_enabled() {
        assert!(inpod(&InpodConfig::default()).v6.is_empty());
        let v6 = AmbientConfig { enable_ipv6: true, ..Default::default() }.for_pod(PodOverrides::default());
        let text = render::restore(&inpod(&v6).v6);
        assert!(text.contains("-s fd16:9254:7127:1337:ffff:ffff:ffff:ffff") && text.contains("! -d ::1/128"));
    }
}
