//! The iptables rule plan: a pure function from a [`CaptureConfig`] to the ordered rules
//! Istio's istio-iptables would program, per family. Rules keep iptables' own argument
//! form (`-A CHAIN ...` / `-I CHAIN N ...`) so rendering is plain text work.

use std::fmt;

use crate::inputs::{
    config::{CaptureConfig, InboundPorts, OwnerGroups},
    decisions::{DNS_PROXY_PORT, Decisions, FamilyRanges, IstioOrder, OUTBOUND_MARK, Steps, in_istio_order},
};

/// The chains Istio creates.
pub mod chain {
    pub const OUTPUT: &str = "ISTIO_OUTPUT";
    pub const OUTPUT_DNS: &str = "ISTIO_OUTPUT_DNS";
    pub const INBOUND: &str = "ISTIO_INBOUND";
    pub const DIVERT: &str = "ISTIO_DIVERT";
    pub const TPROXY: &str = "ISTIO_TPROXY";
    pub const REDIRECT: &str = "ISTIO_REDIRECT";
    pub const IN_REDIRECT: &str = "ISTIO_IN_REDIRECT";
    pub const DROP: &str = "ISTIO_DROP";
    /// Every chain name Istio uses starts with this.
    pub const PREFIX: &str = "ISTIO_";
}

/// Chains and targets built into iptables: never created or deleted.
pub const BUILTIN: &[&str] =
    &["INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING", "ACCEPT", "RETURN", "DROP"];

pub fn is_builtin(chain: &str) -> bool {
    BUILTIN.contains(&chain)
}

/// An iptables table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    // Declaration order is alphabetical: renderers sort tables by name, as Istio does.
    Filter,
    Mangle,
    Nat,
    Raw,
}

impl Table {
    pub const ALL: [Table; 4] = [Table::Filter, Table::Mangle, Table::Nat, Table::Raw];

    pub fn name(self) -> &'static str {
        match self {
            Table::Filter => "filter",
            Table::Mangle => "mangle",
            Table::Nat => "nat",
            Table::Raw => "raw",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One rule: its table, its chain and iptables arguments starting with `-A`/`-I`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub table: Table,
    pub chain: String,
    pub params: Vec<String>,
}

impl Rule {
    /// The jump target when the rule ends in `-j <target>` (a plain jump).
    pub fn jump_target(&self) -> Option<&str> {
        let n = self.params.len();
        (n >= 2 && self.params[n - 2] == "-j").then(|| self.params[n - 1].as_str())
    }
}

/// The IPv4 and IPv6 rules for one configuration.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RulePlan {
    pub v4: Vec<Rule>,
    pub v6: Vec<Rule>,
    /// Whether IPv6 rules were generated at all (the pod has IPv6).
    pub ipv6: bool,
}

impl RulePlan {
    pub fn family(&self, v6: bool) -> &[Rule] {
        if v6 { &self.v6 } else { &self.v4 }
    }
}

/// Builds rules the way Istio's IptablesRuleBuilder does (v6 only when enabled).
pub(crate) struct Builder {
    pub(crate) plan: RulePlan,
}

fn args(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

impl Builder {
    fn push(rules: &mut Vec<Rule>, table: Table, chain: &str, head: Vec<String>, params: &[&str]) {
        let mut all = head;
        all.extend(params.iter().map(|s| s.to_string()));
        rules.push(Rule { table, chain: chain.to_string(), params: all });
    }
    pub(crate) fn append_v4(&mut self, chain: &str, table: Table, params: &[&str]) {
        Self::push(&mut self.plan.v4, table, chain, args(&["-A", chain]), params);
    }
    pub(crate) fn append_v6(&mut self, chain: &str, table: Table, params: &[&str]) {
        if self.plan.ipv6 {
            Self::push(&mut self.plan.v6, table, chain, args(&["-A", chain]), params);
        }
    }
    pub(crate) fn append(&mut self, chain: &str, table: Table, params: &[&str]) {
        self.append_v4(chain, table, params);
        self.append_v6(chain, table, params);
    }
    pub(crate) fn insert_v4(&mut self, chain: &str, table: Table, pos: usize, params: &[&str]) {
        let head = vec!["-I".into(), chain.into(), pos.to_string()];
        Self::push(&mut self.plan.v4, table, chain, head, params);
    }
    pub(crate) fn insert_v6(&mut self, chain: &str, table: Table, pos: usize, params: &[&str]) {
        if self.plan.ipv6 {
            let head = vec!["-I".into(), chain.into(), pos.to_string()];
            Self::push(&mut self.plan.v6, table, chain, head, params);
        }
    }
    pub(crate) fn insert(&mut self, chain: &str, table: Table, pos: usize, params: &[&str]) {
        self.insert_v4(chain, table, pos, params);
        self.insert_v6(chain, table, pos, params);
    }
    /// A rule with a family-specific address: `SPECIFIC` in `params` becomes `v4`/`v6`.
    pub(crate) fn append_versioned(
        &mut self,
        v4: &str,
        v6: &str,
        chain: &str,
        table: Table,
        params: &[&str],
    ) {
        fn swap<'a>(params: &[&'a str], with: &'a str) -> Vec<&'a str> {
            params.iter().map(|p| if *p == SPECIFIC { with } else { p }).collect()
        }
        self.append_v4(chain, table, &swap(params, v4));
        self.append_v6(chain, table, &swap(params, v6));
    }
}

pub(crate) const SPECIFIC: &str = "\u{0}family-specific";

/// Generates Istio's iptables rules for `cfg`, in Istio's order.
pub fn plan(cfg: &CaptureConfig) -> RulePlan {
    let rules = Builder { plan: RulePlan { ipv6: cfg.enable_ipv6, ..Default::default() } };
    in_istio_order(Steps::new(cfg, rules)).plan
}

/// Each part of Istio's rules in iptables' words, per family (`-A`/`-I` arguments).
impl IstioOrder for Steps<'_, Builder> {
    fn uncaptured_interfaces(&mut self) {
        use Table::*;
        let Steps { ref mut b, cfg, tproxy, .. } = *self;
        // Excluded interfaces: neither direction captured.
        for nic in &cfg.exclude_interfaces {
            b.append("PREROUTING", Nat, &["-i", nic, "-j", "RETURN"]);
            b.append("OUTPUT", Nat, &["-o", nic, "-j", "RETURN"]);
        }
        if tproxy {
            for nic in &cfg.exclude_interfaces {
                b.append("PREROUTING", Mangle, &["-i", nic, "-j", "RETURN"]);
                b.append("OUTPUT", Mangle, &["-o", nic, "-j", "RETURN"]);
            }
        }
        // Virtual (VM) interfaces are not captured as inbound.
        for nic in &cfg.reroute_virtual_interfaces {
            b.insert("PREROUTING", Nat, 1, &["-i", nic, "-j", "RETURN"]);
        }
    }

    fn invalid_drop(&mut self) {
        use Table::*;
        use chain::*;
        let Steps { ref mut b, .. } = *self;
        b.append("PREROUTING", Mangle, &["-m", "conntrack", "--ctstate", "INVALID", "-j", DROP]);
        b.append(DROP, Mangle, &["-j", "DROP"]);
    }

    fn redirect_targets(&mut self) {
        use Table::*;
        use chain::*;
        let Steps { ref mut b, cfg, ref tunnel_port, ref capture_port, .. } = *self;
        let proxy_port = cfg.proxy_port.to_string();
        b.append(INBOUND, Nat, &["-p", "tcp", "--dport", tunnel_port, "-j", "RETURN"]);
        b.append(REDIRECT, Nat, &["-p", "tcp", "-j", "REDIRECT", "--to-ports", &proxy_port]);
        b.append(IN_REDIRECT, Nat, &["-p", "tcp", "-j", "REDIRECT", "--to-ports", capture_port]);
    }

    fn inbound(&mut self) {
        use Table::*;
        use chain::*;
        let Steps { ref mut b, cfg, tproxy, ref mark, ref capture_port, ref lo4, .. } = *self;
        if cfg.inbound_ports.is_none() {
            return;
        }
        let table = if tproxy {
            b.append(DIVERT, Mangle, &["-j", "MARK", "--set-mark", mark]);
            b.append(DIVERT, Mangle, &["-j", "ACCEPT"]);
            let tproxy_mark = format!("{mark}/0xffffffff");
            b.append_versioned(
                lo4,
                "::1/128",
                TPROXY,
                Mangle,
                &[
                    "!",
                    "-d",
                    SPECIFIC,
                    "-p",
                    "tcp",
                    "-j",
                    "TPROXY",
                    "--tproxy-mark",
                    &tproxy_mark,
                    "--on-port",
                    capture_port,
                ],
            );
            Mangle
        } else {
            Nat
        };
        b.append("PREROUTING", table, &["-p", "tcp", "-j", INBOUND]);
        match &cfg.inbound_ports {
            InboundPorts::None => {}
            InboundPorts::All => {
                for port in &cfg.inbound_ports_exclude {
                    b.append(INBOUND, table, &["-p", "tcp", "--dport", &port.to_string(), "-j", "RETURN"]);
                }
                if tproxy {
                    b.append(
                        INBOUND,
                        Mangle,
                        &["-p", "tcp", "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", DIVERT],
                    );
                    b.append(INBOUND, Mangle, &["-p", "tcp", "-j", TPROXY]);
                } else {
                    b.append(INBOUND, Nat, &["-p", "tcp", "-j", IN_REDIRECT]);
                }
            }
            InboundPorts::Only(ports) => {
                for port in ports {
                    let port = port.to_string();
                    if tproxy {
                        b.append(
                            INBOUND,
                            Mangle,
                            &[
                                "-p",
                                "tcp",
                                "--dport",
                                &port,
                                "-m",
                                "conntrack",
                                "--ctstate",
                                "RELATED,ESTABLISHED",
                                "-j",
                                DIVERT,
                            ],
                        );
                        b.append(INBOUND, Mangle, &["-p", "tcp", "--dport", &port, "-j", TPROXY]);
                    } else {
                        b.append(INBOUND, Nat, &["-p", "tcp", "--dport", &port, "-j", IN_REDIRECT]);
                    }
                }
            }
        }
    }

    fn output_entry(&mut self) {
        use Table::*;
        use chain::*;
        let Steps { ref mut b, cfg, .. } = *self;
        b.append("OUTPUT", Nat, &["-j", OUTPUT]);
        for port in &cfg.outbound_ports_exclude {
            let port = port.to_string();
            b.append(OUTPUT, Nat, &["-p", "tcp", "--dport", &port, "-j", "RETURN"]);
            b.append(OUTPUT, Nat, &["-p", "udp", "--dport", &port, "-j", "RETURN"]);
        }
        // 127.0.0.6 / ::6 is the inbound passthrough cluster's source address.
        b.append_versioned(
            "127.0.0.6/32",
            "::6/128",
            OUTPUT,
            Nat,
            &["-o", "lo", "-s", SPECIFIC, "-j", "RETURN"],
        );
    }

    fn proxy_uid(&mut self, uid: &str) {
        let Steps { ref mut b, ref d, ref lo4, ref tunnel_port, .. } = *self;
        let dns_and_tunnel = format!("53,{tunnel_port}");
        // Proxy → itself via a service VIP goes through Envoy's inbound.
        if d.redirect_dns {
            let ports = ["-m", "multiport", "!", "--dports", dns_and_tunnel.as_str()];
            proxy_to_inbound(b, lo4, &ports, "--uid-owner", uid);
        } else {
            proxy_to_inbound(b, lo4, &["!", "--dport", tunnel_port], "--uid-owner", uid);
        }
        proxy_returns(b, d, "--uid-owner", uid);
    }

    fn proxy_gid(&mut self, gid: &str) {
        let Steps { ref mut b, ref d, ref lo4, ref tunnel_port, .. } = *self;
        proxy_to_inbound(b, lo4, &["!", "--dport", tunnel_port], "--gid-owner", gid);
        proxy_returns(b, d, "--gid-owner", gid);
    }

    fn owner_groups(&mut self) {
        use Table::*;
        use chain::*;
        let Steps { ref mut b, cfg, .. } = *self;
        match &cfg.owner_groups {
            OwnerGroups::AllExcept(groups) => {
                for group in groups {
                    b.append(OUTPUT, Nat, &["-m", "owner", "--gid-owner", group, "-j", "RETURN"]);
                }
            }
            OwnerGroups::Only(groups) => {
                let mut params: Vec<&str> = Vec::new();
                for group in groups {
                    params.extend(["-m", "owner", "!", "--gid-owner", group.as_str()]);
                }
                params.extend(["-j", "RETURN"]);
                b.append(OUTPUT, Nat, &params);
            }
        }
    }

    fn dns(&mut self) {
        use Table::*;
        use chain::*;
        let Steps { ref mut b, cfg, .. } = *self;
        let all = cfg.capture_all_dns;
        b.append("OUTPUT", Raw, &["-j", OUTPUT_DNS]);
        if all || !cfg.dns_servers_v4.is_empty() {
            b.append_v4(OUTPUT, Nat, &["-j", OUTPUT_DNS]);
        }
        if all || !cfg.dns_servers_v6.is_empty() {
            b.append_v6(OUTPUT, Nat, &["-j", OUTPUT_DNS]);
        }
        let v4_hosts: Vec<String> = cfg.dns_servers_v4.iter().map(|s| format!("{s}/32")).collect();
        let v6_hosts: Vec<String> = cfg.dns_servers_v6.iter().map(|s| format!("{s}/128")).collect();
        for proto in ["tcp", "udp"] {
            // Istio spells the UDP redirect `--to-port`, the TCP one `--to-ports`.
            let to = if proto == "tcp" { "--to-ports" } else { "--to-port" };
            if all {
                b.append(
                    OUTPUT_DNS,
                    Nat,
                    &["-p", proto, "--dport", "53", "-j", "REDIRECT", to, DNS_PROXY_PORT],
                );
            } else {
                for host in &v4_hosts {
                    b.append_v4(
                        OUTPUT_DNS,
                        Nat,
                        &["-p", proto, "--dport", "53", "-d", host, "-j", "REDIRECT", to, DNS_PROXY_PORT],
                    );
                }
                for host in &v6_hosts {
                    b.append_v6(
                        OUTPUT_DNS,
                        Nat,
                        &["-p", proto, "--dport", "53", "-d", host, "-j", "REDIRECT", to, DNS_PROXY_PORT],
                    );
                }
            }
        }
        // Conntrack zones: agent ↔ upstream resolvers in zone 1, app ↔ agent in zone 2.
        for (flag, ids) in [("--uid-owner", &cfg.proxy_uids), ("--gid-owner", &cfg.proxy_gids)] {
            for id in ids {
                b.append(
                    OUTPUT_DNS,
                    Raw,
                    &["-p", "udp", "--dport", "53", "-m", "owner", flag, id, "-j", "CT", "--zone", "1"],
                );
                b.append(
                    OUTPUT_DNS,
                    Raw,
                    &["-p", "udp", "--sport", "15053", "-m", "owner", flag, id, "-j", "CT", "--zone", "2"],
                );
            }
        }
        if all {
            b.append("PREROUTING", Raw, &["-j", INBOUND]);
            b.append(OUTPUT_DNS, Raw, &["-p", "udp", "--dport", "53", "-j", "CT", "--zone", "2"]);
            b.append(INBOUND, Raw, &["-p", "udp", "--sport", "53", "-j", "CT", "--zone", "1"]);
        } else {
            if !v4_hosts.is_empty() {
                b.append_v4("PREROUTING", Raw, &["-j", INBOUND]);
            }
            for host in &v4_hosts {
                b.append_v4(
                    OUTPUT_DNS,
                    Raw,
                    &["-p", "udp", "--dport", "53", "-d", host, "-j", "CT", "--zone", "2"],
                );
                b.append_v4(
                    INBOUND,
                    Raw,
                    &["-p", "udp", "--sport", "53", "-s", host, "-j", "CT", "--zone", "1"],
                );
            }
            if !v6_hosts.is_empty() {
                b.append_v6("PREROUTING", Raw, &["-j", INBOUND]);
            }
            for host in &v6_hosts {
                b.append_v6(
                    OUTPUT_DNS,
                    Raw,
                    &["-p", "udp", "--dport", "53", "-d", host, "-j", "CT", "--zone", "2"],
                );
                b.append_v6(
                    INBOUND,
                    Raw,
                    &["-p", "udp", "--sport", "53", "-s", host, "-j", "CT", "--zone", "1"],
                );
            }
        }
    }

    fn outbound_destinations(&mut self) {
        use Table::*;
        use chain::*;
        let Steps { ref mut b, cfg, ref d, ref lo4, .. } = *self;
        // Envoy-aware apps and container-to-container traffic use localhost explicitly.
        b.append_versioned(lo4, "::1/128", OUTPUT, Nat, &["-d", SPECIFIC, "-j", "RETURN"]);
        for cidr in &d.exclude_v4 {
            b.append_v4(OUTPUT, Nat, &["-d", &cidr.to_string(), "-j", "RETURN"]);
        }
        for cidr in &d.exclude_v6 {
            b.append_v6(OUTPUT, Nat, &["-d", &cidr.to_string(), "-j", "RETURN"]);
        }
        for port in &cfg.outbound_ports_include {
            b.append(OUTPUT, Nat, &["-p", "tcp", "--dport", &port.to_string(), "-j", REDIRECT]);
        }
        outbound_include(b, cfg, &d.include_v4, false);
        outbound_include(b, cfg, &d.include_v6, true);
    }

    fn tproxy_marks(&mut self) {
        use Table::*;
        use chain::*;
        let Steps { ref mut b, cfg, ref mark, ref lo4, .. } = *self;
        // Save the mark set by envoy.filters.listener.original_src as the connection mark.
        b.append(
            "PREROUTING",
            Mangle,
            &["-p", "tcp", "-m", "mark", "--mark", mark, "-j", "CONNMARK", "--save-mark"],
        );
        // Already marked: Envoy → app; do not mark again.
        b.append("OUTPUT", Mangle, &["-p", "tcp", "-o", "lo", "-m", "mark", "--mark", mark, "-j", "RETURN"]);
        for (owner, ids) in [("--uid-owner", &cfg.proxy_uids), ("--gid-owner", &cfg.proxy_gids)] {
            for id in ids {
                b.append_versioned(
                    lo4,
                    "::1/128",
                    "OUTPUT",
                    Mangle,
                    &[
                        "!",
                        "-d",
                        SPECIFIC,
                        "-p",
                        "tcp",
                        "-o",
                        "lo",
                        "-m",
                        "owner",
                        owner,
                        id,
                        "-j",
                        "MARK",
                        "--set-mark",
                        OUTBOUND_MARK,
                    ],
                );
            }
        }
        // Workload replies follow the TPROXY policy route.
        b.append(
            "OUTPUT",
            Mangle,
            &["-p", "tcp", "-m", "connmark", "--mark", mark, "-j", "CONNMARK", "--restore-mark"],
        );
        b.insert(INBOUND, Mangle, 1, &["-p", "tcp", "-m", "mark", "--mark", mark, "-j", "RETURN"]);
        b.insert_v4(INBOUND, Mangle, 2, &["-p", "tcp", "-s", "127.0.0.6/32", "-i", "lo", "-j", "RETURN"]);
        b.insert_v6(INBOUND, Mangle, 2, &["-p", "tcp", "-s", "::6/128", "-i", "lo", "-j", "RETURN"]);
        b.insert(
            INBOUND,
            Mangle,
            3,
            &["-p", "tcp", "-i", "lo", "-m", "mark", "!", "--mark", OUTBOUND_MARK, "-j", "RETURN"],
        );
    }
}

/// The proxy's own TCP over lo to a non-loopback address (its calls to itself
/// through a service VIP), but for the ports `ports` matches, sent to Envoy's inbound;
/// `owner` is `--uid-owner` or `--gid-owner`.
fn proxy_to_inbound(b: &mut Builder, lo4: &str, ports: &[&str], owner: &str, id: &str) {
    use chain::*;
    let head = ["-o", "lo", "!", "-d", SPECIFIC, "-p", "tcp"];
    let tail = ["-m", "owner", owner, id, "-j", IN_REDIRECT];
    b.append_versioned(lo4, "::1/128", OUTPUT, Table::Nat, &[&head[..], ports, &tail].concat());
}

/// An app's calls to itself over lo not captured (unless loopback was included; DNS
/// aside when it is captured), and the proxy's own traffic never captured.
fn proxy_returns(b: &mut Builder, d: &Decisions, owner: &str, id: &str) {
    use Table::*;
    use chain::*;
    // App → itself over lo is not captured, unless loopback was included.
    if !d.includes_loopback() {
        if d.redirect_dns {
            b.append(
                OUTPUT,
                Nat,
                &[
                    "-o", "lo", "-p", "tcp", "!", "--dport", "53", "-m", "owner", "!", owner, id, "-j",
                    "RETURN",
                ],
            );
        } else {
            b.append(OUTPUT, Nat, &["-o", "lo", "-m", "owner", "!", owner, id, "-j", "RETURN"]);
        }
    }
    // Never loop Envoy's own traffic back to Envoy.
    b.append(OUTPUT, Nat, &["-m", "owner", owner, id, "-j", "RETURN"]);
}

fn outbound_include(b: &mut Builder, cfg: &CaptureConfig, ranges: &FamilyRanges, v6: bool) {
    use Table::*;
    use chain::*;
    let append = |b: &mut Builder, chain: &str, params: &[&str]| {
        if v6 { b.append_v6(chain, Nat, params) } else { b.append_v4(chain, Nat, params) }
    };
    let insert = |b: &mut Builder, params: &[&str]| {
        if v6 { b.insert_v6("PREROUTING", Nat, 1, params) } else { b.insert_v4("PREROUTING", Nat, 1, params) }
    };
    if ranges.wildcard {
        append(b, OUTPUT, &["-j", REDIRECT]);
        for nic in &cfg.reroute_virtual_interfaces {
            insert(b, &["-i", nic, "-j", REDIRECT]);
        }
    } else {
        for cidr in &ranges.cidrs {
            let cidr = cidr.to_string();
            for nic in &cfg.reroute_virtual_interfaces {
                insert(b, &["-i", nic, "-d", &cidr, "-j", REDIRECT]);
            }
            append(b, OUTPUT, &["-d", &cidr, "-j", REDIRECT]);
        }
    }
}
