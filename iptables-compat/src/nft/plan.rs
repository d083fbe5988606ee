//! Istio's native-nftables rules: a pure plan from a [`CaptureConfig`] (tables
//! `istio-proxy-nat`, `-mangle`, `-raw` in family inet), in Istio's order.

use super::table::{NftPlan, NftRule, NftTable};
use crate::inputs::{
    config::{CaptureConfig, InboundPorts, OwnerGroups},
    decisions::{DNS_PROXY_PORT, Decisions, IstioOrder, OUTBOUND_MARK, Steps, in_istio_order},
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
    let rules = Builder { plan: NftPlan::default(), ipv6: cfg.enable_ipv6 };
    in_istio_order(Steps::new(cfg, rules)).plan
}

/// Each part of Istio's rules in nft's words: tables `istio-proxy-*` of family inet,
/// a counter on every rule.
impl IstioOrder for Steps<'_, Builder> {
    fn uncaptured_interfaces(&mut self) {
        use NftTable::*;
        let Steps { ref mut b, cfg, tproxy, .. } = *self;
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

    fn invalid_drop(&mut self) {
        use NftTable::*;
        let Steps { ref mut b, .. } = *self;
        b.append(
            "prerouting",
            Mangle,
            &["meta l4proto tcp", "ct state", "invalid", COUNTER, "jump", "istio-drop"],
        );
        b.append("istio-drop", Mangle, &[COUNTER, "drop"]);
    }

    fn redirect_targets(&mut self) {
        use NftTable::*;
        let Steps { ref mut b, cfg, tunnel_port: ref tunnel, .. } = *self;
        let redirect_outbound = format!(":{}", cfg.proxy_port);
        let redirect_inbound = format!(":{}", cfg.inbound_capture_port);
        b.append("istio-inbound", Nat, &["meta l4proto tcp", "tcp dport", tunnel, COUNTER, "return"]);
        b.append("istio-redirect", Nat, &["meta l4proto tcp", COUNTER, "redirect to", &redirect_outbound]);
        b.append("istio-in-redirect", Nat, &["meta l4proto tcp", COUNTER, "redirect to", &redirect_inbound]);
    }

    fn inbound(&mut self) {
        let Steps { ref mut b, cfg, tproxy, ref mark, ref lo4, .. } = *self;
        if !cfg.inbound_ports.is_none() {
            if tproxy {
                inbound_tproxy(b, cfg, mark, lo4);
            } else {
                inbound_redirect(b, cfg);
            }
        }
    }

    fn output_entry(&mut self) {
        use NftTable::*;
        let Steps { ref mut b, cfg, .. } = *self;
        b.append("output", Nat, &[COUNTER, "jump", "istio-output"]);
        for port in &cfg.outbound_ports_exclude {
            b.append("istio-output", Nat, &["tcp dport", &port.nft(), COUNTER, "return"]);
            b.append("istio-output", Nat, &["udp dport", &port.nft(), COUNTER, "return"]);
        }
        b.append("istio-output", Nat, &["oifname", "lo", "ip saddr", "127.0.0.6/32", COUNTER, "return"]);
        b.append_v6("istio-output", Nat, &["oifname", "lo", "ip6 saddr", "::6/128", COUNTER, "return"]);
    }

    fn proxy_uid(&mut self, uid: &str) {
        let Steps { ref mut b, ref d, ref lo4, tunnel_port: ref tunnel, .. } = *self;
        let dns_and_tunnel = format!("{{ 53, {tunnel} }}");
        let ports = if d.redirect_dns { dns_and_tunnel.as_str() } else { tunnel };
        proxy_to_inbound(b, lo4, ports, "skuid", uid);
        proxy_returns(b, d, "skuid", uid);
    }

    fn proxy_gid(&mut self, gid: &str) {
        let Steps { ref mut b, ref d, ref lo4, tunnel_port: ref tunnel, .. } = *self;
        proxy_to_inbound(b, lo4, tunnel, "skgid", gid);
        proxy_returns(b, d, "skgid", gid);
    }

    fn owner_groups(&mut self) {
        use NftTable::*;
        let Steps { ref mut b, cfg, .. } = *self;
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

    fn dns(&mut self) {
        use NftTable::*;
        let Steps { ref mut b, cfg, .. } = *self;
        let all = cfg.capture_all_dns;
        let to = format!(":{DNS_PROXY_PORT}");
        b.append("output", Raw, &[COUNTER, "jump", "istio-output-dns"]);
        if all || !cfg.dns_servers_v4.is_empty() || !cfg.dns_servers_v6.is_empty() {
            b.append("istio-output", Nat, &[COUNTER, "jump", "istio-output-dns"]);
        }
        let v4: Vec<String> = cfg.dns_servers_v4.iter().map(|s| format!("{s}/32")).collect();
        let v6: Vec<String> = cfg.dns_servers_v6.iter().map(|s| format!("{s}/128")).collect();
        // TCP, then UDP: to every address (TCP's naming its protocol), or to each server.
        for (proto, to_all) in
            [("tcp dport", &["meta l4proto tcp", "tcp dport"][..]), ("udp dport", &["udp dport"])]
        {
            let redirect = ["53", COUNTER, "redirect", "to", &to];
            if all {
                b.append("istio-output-dns", Nat, &[to_all, &redirect].concat());
                continue;
            }
            for s in &v4 {
                b.append("istio-output-dns", Nat, &[&["ip daddr", s, proto][..], &redirect].concat());
            }
            for s in &v6 {
                b.append_v6("istio-output-dns", Nat, &[&["ip6 daddr", s, proto][..], &redirect].concat());
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

    fn outbound_destinations(&mut self) {
        use NftTable::*;
        let Steps { ref mut b, cfg, ref d, ref lo4, .. } = *self;
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

    fn tproxy_marks(&mut self) {
        use NftTable::*;
        let Steps { ref mut b, cfg, ref mark, ref lo4, .. } = *self;
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

/// The proxy's own TCP over lo to a non-loopback address (its calls to itself
/// through a service VIP), but to the ports `ports`, sent to Envoy's inbound; `key` is
/// `skuid` or `skgid`.
fn proxy_to_inbound(b: &mut Builder, lo4: &str, ports: &str, key: &str, id: &str) {
    use NftTable::*;
    for (v6, daddr, lo) in [(false, "ip daddr", lo4), (true, "ip6 daddr", "::1/128")] {
        let rule = ["oifname", "lo", "meta l4proto tcp", daddr, "!=", lo, "tcp dport", "!=", ports, key, id];
        let rule = [&rule[..], &[COUNTER, "jump", "istio-in-redirect"]].concat();
        if v6 {
            b.append_v6("istio-output", Nat, &rule);
        } else {
            b.append("istio-output", Nat, &rule);
        }
    }
}

/// An app's calls to itself over lo not captured (unless loopback was included; DNS
/// aside when it is captured), and the proxy's own traffic never captured.
fn proxy_returns(b: &mut Builder, d: &Decisions, key: &str, id: &str) {
    use NftTable::*;
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
                    key,
                    "!=",
                    id,
                    COUNTER,
                    "return",
                ],
            );
        } else {
            b.append("istio-output", Nat, &["oifname", "lo", key, "!=", id, COUNTER, "return"]);
        }
    }
    b.append("istio-output", Nat, &[key, id, COUNTER, "return"]);
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
