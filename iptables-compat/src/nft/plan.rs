//! Istio's native-nftables rules: a pure plan from a [`CaptureConfig`] (tables
//! `istio-proxy-nat`, `-mangle`, `-raw` in family inet), in Istio's order.

use super::table::{NftPlan, NftRule, NftTable};
use crate::inputs::{
    config::{CaptureConfig, InboundPorts, InterceptionMode, OwnerGroups},
    decisions::{DNS_PROXY_PORT, Decisions, OUTBOUND_MARK},
};

struct Builder {
    plan: NftPlan,
    ipv6: bool,
}

impl Builder {
    fn append(&mut self, chain: &'static str, table: NftTable, parts: &[&str]) {
        self.plan.rules.push(NftRule { table, chain, index: None, expr: parts.join(" ") });
    }
    fn append_v6(&mut self, chain: &'static str, table: NftTable, parts: &[&str]) {
        if self.ipv6 {
            self.append(chain, table, parts);
        }
    }
    fn insert(&mut self, chain: &'static str, table: NftTable, index: usize, parts: &[&str]) {
        self.plan.rules.push(NftRule { table, chain, index: Some(index), expr: parts.join(" ") });
    }
    fn insert_v6(&mut self, chain: &'static str, table: NftTable, index: usize, parts: &[&str]) {
        if self.ipv6 {
            self.insert(chain, table, index, parts);
        }
    }
}

const COUNTER: &str = "counter";

/// Generates Istio's nftables rules for `cfg`, in Istio's order.
pub fn plan(cfg: &CaptureConfig) -> NftPlan {
    let d = Decisions::of(cfg);
    let mut b = Builder { plan: NftPlan::default(), ipv6: cfg.enable_ipv6 };
    let tproxy = cfg.interception_mode == InterceptionMode::Tproxy;
    let lo4 = cfg.host_ipv4_loopback_cidr.to_string();
    let lo4 = lo4.as_str();
    let mark = cfg.tproxy_mark.to_string();
    let tunnel = cfg.inbound_tunnel_port.to_string();

    uncaptured_interfaces(&mut b, cfg, tproxy);
    if cfg.drop_invalid {
        invalid_drop(&mut b);
    }
    redirect_targets(&mut b, cfg, &tunnel);
    if !cfg.inbound_ports.is_none() {
        if tproxy {
            inbound_tproxy(&mut b, cfg, &mark, lo4);
        } else {
            inbound_redirect(&mut b, cfg);
        }
    }
    output_entry(&mut b, cfg);
    for uid in &cfg.proxy_uids {
        proxy_uid(&mut b, &d, uid, lo4, &tunnel);
    }
    for gid in &cfg.proxy_gids {
        proxy_gid(&mut b, &d, gid, lo4, &tunnel);
    }
    owner_groups(&mut b, cfg);
    if d.redirect_dns {
        dns(&mut b, cfg);
    }
    outbound_destinations(&mut b, cfg, &d, lo4);
    if tproxy {
        tproxy_marks(&mut b, cfg, &mark, lo4);
    }
    b.plan
}

/// Interfaces whose traffic is not captured: the excluded ones in neither direction
/// (in mangle too for TPROXY), the virtual (VM) ones not as inbound.
fn uncaptured_interfaces(b: &mut Builder, cfg: &CaptureConfig, tproxy: bool) {
    use NftTable::*;
    for nic in &cfg.exclude_interfaces {
        b.append("prerouting", Nat, &["iifname", nic, COUNTER, "return"]);
        b.append("output", Nat, &["oifname", nic, COUNTER, "return"]);
    }
    if tproxy {
        for nic in &cfg.exclude_interfaces {
            b.append("prerouting", Mangle, &["iifname", nic, COUNTER, "return"]);
            b.append("output", Mangle, &["oifname", nic, COUNTER, "return"]);
        }
    }
    for nic in &cfg.reroute_virtual_interfaces {
        b.insert("prerouting", Nat, 0, &["iifname", nic, COUNTER, "return"]);
    }
}

/// Conntrack-invalid packets dropped (`--drop-invalid`).
fn invalid_drop(b: &mut Builder) {
    use NftTable::*;
    b.append(
        "prerouting",
        Mangle,
        &["meta l4proto tcp", "ct state", "invalid", COUNTER, "jump", "istio-drop"],
    );
    b.append("istio-drop", Mangle, &[COUNTER, "drop"]);
}

/// The tunnel port's exemption from inbound capture, and the two redirect chains'
/// targets (Envoy's outbound and inbound ports).
fn redirect_targets(b: &mut Builder, cfg: &CaptureConfig, tunnel: &str) {
    use NftTable::*;
    let redirect_outbound = format!(":{}", cfg.proxy_port);
    let redirect_inbound = format!(":{}", cfg.inbound_capture_port);
    b.append("istio-inbound", Nat, &["meta l4proto tcp", "tcp dport", tunnel, COUNTER, "return"]);
    b.append("istio-redirect", Nat, &["meta l4proto tcp", COUNTER, "redirect to", &redirect_outbound]);
    b.append("istio-in-redirect", Nat, &["meta l4proto tcp", COUNTER, "redirect to", &redirect_inbound]);
}

/// REDIRECT mode's inbound capture: prerouting into istio-inbound, and the ports it
/// redirects (all but the excluded, or the listed ones).
fn inbound_redirect(b: &mut Builder, cfg: &CaptureConfig) {
    use NftTable::*;
    b.append("prerouting", Nat, &["meta l4proto tcp", COUNTER, "jump", "istio-inbound"]);
    match &cfg.inbound_ports {
        InboundPorts::All => {
            for port in &cfg.inbound_ports_exclude {
                b.append(
                    "istio-inbound",
                    Nat,
                    &["meta l4proto tcp", "tcp dport", &port.nft(), COUNTER, "return"],
                );
            }
            b.append("istio-inbound", Nat, &["meta l4proto tcp", COUNTER, "jump", "istio-in-redirect"]);
        }
        InboundPorts::Only(ports) => {
            for port in ports {
                b.append(
                    "istio-inbound",
                    Nat,
                    &["meta l4proto tcp", "tcp dport", &port.nft(), COUNTER, "jump", "istio-in-redirect"],
                );
            }
        }
        InboundPorts::None => {}
    }
}

/// Output into istio-output, the outbound ports never captured, and the inbound
/// passthrough's own source address let through.
fn output_entry(b: &mut Builder, cfg: &CaptureConfig) {
    use NftTable::*;
    b.append("output", Nat, &[COUNTER, "jump", "istio-output"]);
    for port in &cfg.outbound_ports_exclude {
        b.append("istio-output", Nat, &["tcp dport", &port.nft(), COUNTER, "return"]);
        b.append("istio-output", Nat, &["udp dport", &port.nft(), COUNTER, "return"]);
    }
    b.append("istio-output", Nat, &["oifname", "lo", "ip saddr", "127.0.0.6/32", COUNTER, "return"]);
    b.append_v6("istio-output", Nat, &["oifname", "lo", "ip6 saddr", "::6/128", COUNTER, "return"]);
}

/// One proxy uid's rules: the proxy's calls to itself through a service VIP go to
/// Envoy's inbound, an app's calls to itself over lo are not captured (unless loopback
/// was included), and the proxy's own traffic is never captured.
fn proxy_uid(b: &mut Builder, d: &Decisions, uid: &str, lo4: &str, tunnel: &str) {
    use NftTable::*;
    let dns_and_tunnel = format!("{{ 53, {tunnel} }}");
    let ports = if d.redirect_dns { dns_and_tunnel.as_str() } else { tunnel };
    b.append(
        "istio-output",
        Nat,
        &[
            "oifname",
            "lo",
            "meta l4proto tcp",
            "ip daddr",
            "!=",
            lo4,
            "tcp dport",
            "!=",
            ports,
            "skuid",
            uid,
            COUNTER,
            "jump",
            "istio-in-redirect",
        ],
    );
    b.append_v6(
        "istio-output",
        Nat,
        &[
            "oifname",
            "lo",
            "meta l4proto tcp",
            "ip6 daddr",
            "!=",
            "::1/128",
            "tcp dport",
            "!=",
            ports,
            "skuid",
            uid,
            COUNTER,
            "jump",
            "istio-in-redirect",
        ],
    );
    if !d.includes_loopback() {
        if d.redirect_dns {
            b.append(
                "istio-output",
                Nat,
                &[
                    "oifname",
                    "lo",
                    "meta l4proto tcp",
                    "tcp dport",
                    "!=",
                    "53",
                    "skuid",
                    "!=",
                    uid,
                    COUNTER,
                    "return",
                ],
            );
        } else {
            b.append("istio-output", Nat, &["oifname", "lo", "skuid", "!=", uid, COUNTER, "return"]);
        }
    }
    b.append("istio-output", Nat, &["skuid", uid, COUNTER, "return"]);
}

/// One proxy gid's rules, as [`proxy_uid`]'s for a group.
fn proxy_gid(b: &mut Builder, d: &Decisions, gid: &str, lo4: &str, tunnel: &str) {
    use NftTable::*;
    b.append(
        "istio-output",
        Nat,
        &[
            "oifname",
            "lo",
            "meta l4proto tcp",
            "ip daddr",
            "!=",
            lo4,
            "tcp dport",
            "!=",
            tunnel,
            "skgid",
            gid,
            COUNTER,
            "jump",
            "istio-in-redirect",
        ],
    );
    b.append_v6(
        "istio-output",
        Nat,
        &[
            "oifname",
            "lo",
            "meta l4proto tcp",
            "ip6 daddr",
            "!=",
            "::1/128",
            "tcp dport",
            "!=",
            tunnel,
            "skgid",
            gid,
            COUNTER,
            "jump",
            "istio-in-redirect",
        ],
    );
    if !d.includes_loopback() {
        if d.redirect_dns {
            b.append(
                "istio-output",
                Nat,
                &[
                    "oifname",
                    "lo",
                    "meta l4proto tcp",
                    "tcp dport",
                    "!=",
                    "53",
                    "skgid",
                    "!=",
                    gid,
                    COUNTER,
                    "return",
                ],
            );
        } else {
            b.append("istio-output", Nat, &["oifname", "lo", "skgid", "!=", gid, COUNTER, "return"]);
        }
    }
    b.append("istio-output", Nat, &["skgid", gid, COUNTER, "return"]);
}

/// ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE]: the groups whose traffic is not captured.
fn owner_groups(b: &mut Builder, cfg: &CaptureConfig) {
    use NftTable::*;
    match &cfg.owner_groups {
        OwnerGroups::AllExcept(groups) => {
            for group in groups {
                b.append("istio-output", Nat, &["skgid", group, COUNTER, "return"]);
            }
        }
        OwnerGroups::Only(groups) => {
            let mut parts: Vec<&str> = Vec::new();
            for group in groups {
                parts.extend(["skgid", "!=", group.as_str()]);
            }
            parts.extend([COUNTER, "return"]);
            b.append("istio-output", Nat, &parts);
        }
    }
}

/// Outbound destinations: localhost and the excluded ranges let through, the included
/// ports and ranges (per family) redirected to Envoy, from the virtual interfaces too.
fn outbound_destinations(b: &mut Builder, cfg: &CaptureConfig, d: &Decisions, lo4: &str) {
    use NftTable::*;
    b.append("istio-output", Nat, &["ip daddr", lo4, COUNTER, "return"]);
    b.append_v6("istio-output", Nat, &["ip6 daddr", "::1/128", COUNTER, "return"]);
    for cidr in &d.exclude_v4 {
        b.append("istio-output", Nat, &["ip daddr", &cidr.to_string(), COUNTER, "return"]);
    }
    for cidr in &d.exclude_v6 {
        b.append_v6("istio-output", Nat, &["ip6 daddr", &cidr.to_string(), COUNTER, "return"]);
    }
    for port in &cfg.outbound_ports_include {
        b.append("istio-output", Nat, &["tcp dport", &port.nft(), COUNTER, "jump", "istio-redirect"]);
    }
    if d.include_v4.wildcard || d.include_v6.wildcard {
        b.append("istio-output", Nat, &[COUNTER, "jump", "istio-redirect"]);
        for nic in &cfg.reroute_virtual_interfaces {
            b.insert("prerouting", Nat, 0, &["iifname", nic, COUNTER, "jump", "istio-redirect"]);
        }
    } else {
        for cidr in &d.include_v4.cidrs {
            let cidr = cidr.to_string();
            for nic in &cfg.reroute_virtual_interfaces {
                b.insert(
                    "prerouting",
                    Nat,
                    0,
                    &["iifname", nic, "ip daddr", &cidr, COUNTER, "jump", "istio-redirect"],
                );
            }
            b.append("istio-output", Nat, &["ip daddr", &cidr, COUNTER, "jump", "istio-redirect"]);
        }
        for cidr in &d.include_v6.cidrs {
            let cidr = cidr.to_string();
            for nic in &cfg.reroute_virtual_interfaces {
                b.insert_v6(
                    "prerouting",
                    Nat,
                    0,
                    &["iifname", nic, "ip6 daddr", &cidr, COUNTER, "jump", "istio-redirect"],
                );
            }
            b.append_v6("istio-output", Nat, &["ip6 daddr", &cidr, COUNTER, "jump", "istio-redirect"]);
        }
    }
}

/// TPROXY's marks: Envoy's mark saved as the connection mark and restored on the
/// workload's replies, and the proxy's loopback traffic to the workload marked.
fn tproxy_marks(b: &mut Builder, cfg: &CaptureConfig, mark: &str, lo4: &str) {
    use NftTable::*;
    b.append("prerouting", Mangle, &["meta l4proto tcp", "mark", mark, COUNTER, "ct mark set mark"]);
    b.append("output", Mangle, &["oifname", "lo", "meta l4proto tcp", "mark", mark, COUNTER, "return"]);
    for (key, ids) in [("skuid", &cfg.proxy_uids), ("skgid", &cfg.proxy_gids)] {
        for id in ids {
            b.append(
                "output",
                Mangle,
                &[
                    "oifname",
                    "lo",
                    "meta l4proto tcp",
                    "ip daddr",
                    "!=",
                    lo4,
                    key,
                    id,
                    COUNTER,
                    "meta mark set",
                    OUTBOUND_MARK,
                ],
            );
            b.append_v6(
                "output",
                Mangle,
                &[
                    "oifname",
                    "lo",
                    "meta l4proto tcp",
                    "ip6 daddr",
                    "!=",
                    "::1/128",
                    key,
                    id,
                    COUNTER,
                    "meta mark set",
                    OUTBOUND_MARK,
                ],
            );
        }
    }
    b.append(
        "output",
        Mangle,
        &["meta l4proto tcp", "ct", "mark", mark, COUNTER, "meta mark set", "ct", "mark"],
    );
    b.insert("istio-inbound", Mangle, 0, &["meta l4proto tcp", "mark", mark, COUNTER, "return"]);
    b.insert(
        "istio-inbound",
        Mangle,
        1,
        &["iifname", "lo", "meta l4proto tcp", "ip saddr", "127.0.0.6/32", COUNTER, "return"],
    );
    b.insert_v6(
        "istio-inbound",
        Mangle,
        1,
        &["iifname", "lo", "meta l4proto tcp", "ip6 saddr", "::6/128", COUNTER, "return"],
    );
    b.insert(
        "istio-inbound",
        Mangle,
        2,
        &["iifname", "lo", "meta l4proto tcp", "mark", "!=", OUTBOUND_MARK, COUNTER, "return"],
    );
}

fn inbound_tproxy(b: &mut Builder, cfg: &CaptureConfig, mark: &str, lo4: &str) {
    use NftTable::Mangle;
    let on_port = format!(":{}", cfg.inbound_capture_port);
    b.append("istio-divert", Mangle, &[COUNTER, "meta mark set", mark]);
    b.append("istio-divert", Mangle, &[COUNTER, "accept"]);
    b.append(
        "istio-tproxy",
        Mangle,
        &[
            "meta l4proto tcp",
            "ip daddr",
            "!=",
            lo4,
            "tproxy ip to",
            &on_port,
            "meta mark set",
            mark,
            COUNTER,
            "accept",
        ],
    );
    b.append_v6(
        "istio-tproxy",
        Mangle,
        &[
            "meta l4proto tcp",
            "ip6 daddr",
            "!=",
            "::1/128",
            "tproxy ip6 to",
            &on_port,
            "meta mark set",
            mark,
            COUNTER,
            "accept",
        ],
    );
    b.append("prerouting", Mangle, &["meta l4proto tcp", COUNTER, "jump", "istio-inbound"]);
    match &cfg.inbound_ports {
        InboundPorts::All => {
            for port in &cfg.inbound_ports_exclude {
                b.append(
                    "istio-inbound",
                    Mangle,
                    &["meta l4proto tcp", "tcp dport", &port.nft(), COUNTER, "return"],
                );
            }
            b.append(
                "istio-inbound",
                Mangle,
                &["meta l4proto tcp", "ct state", "related,established", COUNTER, "jump", "istio-divert"],
            );
            b.append("istio-inbound", Mangle, &["meta l4proto tcp", COUNTER, "jump", "istio-tproxy"]);
        }
        InboundPorts::Only(ports) => {
            for port in ports {
                let port = port.nft();
                b.append(
                    "istio-inbound",
                    Mangle,
                    &[
                        "meta l4proto tcp",
                        "ct state",
                        "related,established",
                        "tcp dport",
                        &port,
                        COUNTER,
                        "jump",
                        "istio-divert",
                    ],
                );
                b.append(
                    "istio-inbound",
                    Mangle,
                    &["meta l4proto tcp", "tcp dport", &port, COUNTER, "jump", "istio-tproxy"],
                );
            }
        }
        InboundPorts::None => {}
    }
}

fn dns(b: &mut Builder, cfg: &CaptureConfig) {
    use NftTable::*;
    let all = cfg.capture_all_dns;
    let to = format!(":{DNS_PROXY_PORT}");
    b.append("output", Raw, &[COUNTER, "jump", "istio-output-dns"]);
    if all || !cfg.dns_servers_v4.is_empty() || !cfg.dns_servers_v6.is_empty() {
        b.append("istio-output", Nat, &[COUNTER, "jump", "istio-output-dns"]);
    }
    let v4: Vec<String> = cfg.dns_servers_v4.iter().map(|s| format!("{s}/32")).collect();
    let v6: Vec<String> = cfg.dns_servers_v6.iter().map(|s| format!("{s}/128")).collect();
    if all {
        b.append(
            "istio-output-dns",
            Nat,
            &["meta l4proto tcp", "tcp dport", "53", COUNTER, "redirect", "to", &to],
        );
    } else {
        for s in &v4 {
            b.append(
                "istio-output-dns",
                Nat,
                &["ip daddr", s, "tcp dport", "53", COUNTER, "redirect", "to", &to],
            );
        }
        for s in &v6 {
            b.append_v6(
                "istio-output-dns",
                Nat,
                &["ip6 daddr", s, "tcp dport", "53", COUNTER, "redirect", "to", &to],
            );
        }
    }
    if all {
        b.append("istio-output-dns", Nat, &["udp dport", "53", COUNTER, "redirect", "to", &to]);
    } else {
        for s in &v4 {
            b.append(
                "istio-output-dns",
                Nat,
                &["ip daddr", s, "udp dport", "53", COUNTER, "redirect", "to", &to],
            );
        }
        for s in &v6 {
            b.append_v6(
                "istio-output-dns",
                Nat,
                &["ip6 daddr", s, "udp dport", "53", COUNTER, "redirect", "to", &to],
            );
        }
    }
    for (key, ids) in [("skuid", &cfg.proxy_uids), ("skgid", &cfg.proxy_gids)] {
        for id in ids {
            b.append(
                "istio-output-dns",
                Raw,
                &["udp dport", "53", "meta", key, id, COUNTER, "ct", "zone", "set", "1"],
            );
            b.append(
                "istio-output-dns",
                Raw,
                &["udp sport", "15053", "meta", key, id, COUNTER, "ct", "zone", "set", "2"],
            );
        }
    }
    if all {
        b.append("prerouting", Raw, &[COUNTER, "jump", "istio-inbound"]);
        b.append("istio-output-dns", Raw, &["udp dport", "53", COUNTER, "ct", "zone", "set", "2"]);
        b.append("istio-inbound", Raw, &["udp sport", "53", COUNTER, "ct", "zone", "set", "1"]);
    } else {
        if !v4.is_empty() || !v6.is_empty() {
            b.append("prerouting", Raw, &[COUNTER, "jump", "istio-inbound"]);
        }
        for s in &v4 {
            b.append(
                "istio-output-dns",
                Raw,
                &["udp dport", "53", "ip daddr", s, COUNTER, "ct", "zone", "set", "2"],
            );
            b.append(
                "istio-inbound",
                Raw,
                &["udp sport", "53", "ip saddr", s, COUNTER, "ct", "zone", "set", "1"],
            );
        }
        for s in &v6 {
            b.append_v6(
                "istio-output-dns",
                Raw,
                &["udp dport", "53", "ip6 daddr", s, COUNTER, "ct", "zone", "set", "2"],
            );
            b.append_v6(
                "istio-inbound",
                Raw,
                &["udp sport", "53", "ip6 saddr", s, COUNTER, "ct", "zone", "set", "1"],
            );
        }
    }
}
