//! Istio's ambient rules for native nftables: pure plans over the tables
//! `istio-ambient-nat`, `-mangle` and `-raw` (family inet) for a pod, and
//! `istio-ambient-nat`'s postrouting chain for the node's probe SNAT, rendered as the
//! one `nft -f` transaction Istio's knftables sends.

use super::{
    config::{AmbientConfig, InpodConfig},
    constants::{
        INPOD_MARK, INPOD_MASK, INPOD_TPROXY_MARK, INPOD_TPROXY_MASK, PROBE_SET_V4, PROBE_SET_V6,
        ZTUNNEL_DNS_PORT, ZTUNNEL_INBOUND_PLAINTEXT_PORT, ZTUNNEL_INBOUND_PORT, ZTUNNEL_OUTBOUND_PORT,
    },
};

pub const TABLE_NAT: &str = "istio-ambient-nat";
pub const TABLE_MANGLE: &str = "istio-ambient-mangle";
pub const TABLE_RAW: &str = "istio-ambient-raw";
/// Every table the in-pod rules use, in the order Istio writes them.
pub const INPOD_TABLES: [&str; 3] = [TABLE_NAT, TABLE_MANGLE, TABLE_RAW];

const ISTIO_OUTPUT: &str = "istio-output";
const ISTIO_PREROUTING: &str = "istio-prerouting";
const COUNTER: &str = "counter";

/// A chain Istio may create: its name and, for a base chain, its hook spec.
type ChainSpec = (&'static str, Option<&'static str>);

/// The chains of each in-pod table, in Istio's declaration order.
fn inpod_chains(table: &str) -> &'static [ChainSpec] {
    match table {
        TABLE_NAT => &[
            ("prerouting", Some("type nat hook prerouting priority -100 ;")),
            ("output", Some("type nat hook output priority -100 ;")),
            (ISTIO_PREROUTING, None),
            (ISTIO_OUTPUT, None),
        ],
        TABLE_MANGLE => &[
            ("prerouting", Some("type filter hook prerouting priority -150 ;")),
            ("output", Some("type route hook output priority -150 ;")),
            (ISTIO_PREROUTING, None),
            (ISTIO_OUTPUT, None),
        ],
        _ => &[
            ("prerouting", Some("type filter hook prerouting priority -300 ;")),
            ("output", Some("type filter hook output priority -300 ;")),
            (ISTIO_PREROUTING, None),
            (ISTIO_OUTPUT, None),
        ],
    }
}

/// The node's chain: SNAT happens in postrouting.
const HOST_CHAINS: &[ChainSpec] = &[("postrouting", Some("type nat hook postrouting priority 100 ;"))];

/// One rule in a table's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmbientNftRule {
    pub table: &'static str,
    pub chain: &'static str,
    pub expr: String,
}

/// The rules of one run, in order, and the chains each table may hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmbientNftPlan {
    /// Tables in the order they are written, with their possible chains.
    pub tables: Vec<(&'static str, &'static [ChainSpec])>,
    pub rules: Vec<AmbientNftRule>,
}

struct Builder {
    rules: Vec<AmbientNftRule>,
    ipv6: bool,
}

impl Builder {
    fn append(&mut self, chain: &'static str, table: &'static str, parts: &[&str]) {
        self.rules.push(AmbientNftRule { table, chain, expr: parts.join(" ") });
    }
    fn append_v6(&mut self, chain: &'static str, table: &'static str, parts: &[&str]) {
        if self.ipv6 {
            self.append(chain, table, parts);
        }
    }
}

fn hex(v: u32) -> String {
    format!("0x{v:x}")
}

/// The in-pod rules for one pod (Istio's nftables `AppendInpodRules`).
pub fn inpod(cfg: &InpodConfig) -> AmbientNftPlan {
    let (nat, mangle, raw) = (TABLE_NAT, TABLE_MANGLE, TABLE_RAW);
    let (out, pre) = (ISTIO_OUTPUT, ISTIO_PREROUTING);
    let mut b = Builder { rules: Vec::new(), ipv6: cfg.ambient.enable_ipv6 };
    let dns = cfg.redirect_dns();
    let ingress = cfg.pod.ingress_mode;
    let (mark, mask) = (hex(INPOD_MARK), hex(INPOD_MASK));
    let (tproxy_mark, tproxy_mask) = (hex(INPOD_TPROXY_MARK), hex(INPOD_TPROXY_MASK));
    let probe4 = cfg.ambient.host_probe_snat_v4.to_string();
    let probe6 = cfg.ambient.host_probe_snat_v6.to_string();
    let to_outbound = format!(":{ZTUNNEL_OUTBOUND_PORT}");
    let to_dns = format!(":{ZTUNNEL_DNS_PORT}");

    b.append("prerouting", mangle, &["jump", pre]);
    b.append("output", mangle, &["jump", out]);
    b.append("output", nat, &["jump", out]);
    if dns {
        b.append("prerouting", raw, &["jump", pre]);
        b.append("output", raw, &["jump", out]);
    }
    b.append("prerouting", nat, &["jump", pre]);
    for nic in &cfg.pod.virtual_interfaces {
        b.append(pre, nat, &["iifname", nic, "meta l4proto tcp", COUNTER, "redirect to", &to_outbound]);
        b.append(pre, nat, &["iifname", nic, "meta l4proto tcp", COUNTER, "return"]);
    }
    // Istio's text, spacing included: `... | ` then the mark.
    b.append(
        pre,
        mangle,
        &["meta mark & 0xfff ==", &mark, COUNTER, "ct mark set ct mark & 0xfffff000 | ", &tproxy_mark],
    );
    if !ingress {
        b.append(pre, nat, &["meta l4proto tcp", "ip saddr", &probe4, COUNTER, "accept"]);
        b.append_v6(pre, nat, &["meta l4proto tcp", "ip6 saddr", &probe6, COUNTER, "accept"]);
    }
    b.append(out, nat, &["meta l4proto tcp", "ip daddr", &probe4, COUNTER, "accept"]);
    b.append_v6(out, nat, &["meta l4proto tcp", "ip6 daddr", &probe6, COUNTER, "accept"]);
    if !ingress {
        let to_plaintext = format!(":{ZTUNNEL_INBOUND_PLAINTEXT_PORT}");
        let dport = format!("tcp dport != {ZTUNNEL_INBOUND_PORT}");
        // Istio's v4 rule has "mark and 0xfff " (a trailing space) before "!=".
        let v4 = format!(
            "ip daddr != 127.0.0.1/32 {dport} mark and 0xfff  != {mark} {COUNTER} redirect to {to_plaintext}"
        );
        let v6 = format!(
            "ip6 daddr != ::1/128 {dport} mark and 0xfff != {mark} {COUNTER} redirect to {to_plaintext}"
        );
        b.append(pre, nat, &[&v4]);
        b.append_v6(pre, nat, &[&v6]);
    }
    let restore = format!("ct mark and {tproxy_mask} == {tproxy_mark} {COUNTER} meta mark set ct mark");
    b.append(out, mangle, &[&restore]);
    if dns {
        dns_rules(&mut b, &mark, &mask, &to_dns);
    }
    b.append(
        out,
        nat,
        &[&format!("meta l4proto tcp mark and {tproxy_mask} == {tproxy_mark} {COUNTER} accept")],
    );
    b.append(out, nat, &["oifname", "lo", "ip daddr", "!=", "127.0.0.1/32", COUNTER, "accept"]);
    b.append_v6(out, nat, &["oifname", "lo", "ip6 daddr", "!=", "::1/128", COUNTER, "accept"]);
    let redirect = format!("mark and {mask} != {mark} {COUNTER} redirect to {to_outbound}");
    b.append(out, nat, &["meta l4proto tcp ip daddr != 127.0.0.1/32", &redirect]);
    b.append_v6(out, nat, &["meta l4proto tcp ip6 daddr != ::1/128", &redirect]);
    AmbientNftPlan { tables: INPOD_TABLES.iter().map(|t| (*t, inpod_chains(t))).collect(), rules: b.rules }
}

fn dns_rules(b: &mut Builder, mark: &str, mask: &str, to_dns: &str) {
    let (nat, raw, out, pre) = (TABLE_NAT, TABLE_RAW, ISTIO_OUTPUT, ISTIO_PREROUTING);
    let unmarked = format!("mark and {mask} != {mark}");
    let redirect = format!("{COUNTER} redirect to {to_dns}");
    b.append(out, nat, &["oifname != lo", &unmarked, "udp dport 53", &redirect]);
    b.append(out, nat, &["ip daddr != 127.0.0.1/32 tcp dport 53", &unmarked, &redirect]);
    b.append_v6(out, nat, &["ip6 daddr != ::1/128 tcp dport 53", &unmarked, &redirect]);
    // ztunnel ↔ upstream resolvers in their own conntrack zone (istio/istio#33469).
    b.append(out, raw, &[&format!("udp dport 53 meta mark and {mask} == {mark} {COUNTER} ct zone set 1")]);
    b.append(pre, raw, &[&format!("udp sport 53 meta mark and {mask} != {mark} {COUNTER} ct zone set 1")]);
}

/// The node's probe SNAT (Istio's nftables `CreateHostRulesForHealthChecks`). nftables
/// has no `--socket-exists`; Istio matches kubelet's uid instead, so the caller passes
/// it ([`crate::ambient::kubelet_uid`] finds it).
pub fn host_probe(cfg: &AmbientConfig, kubelet_uid: u32) -> AmbientNftPlan {
    let rule = |family: &str, set: &str, to: String| AmbientNftRule {
        table: TABLE_NAT,
        chain: "postrouting",
        expr: format!("meta l4proto tcp skuid {kubelet_uid} {family} daddr @{set} {COUNTER} snat to {to}"),
    };
    let mut rules = vec![rule("ip", PROBE_SET_V4, cfg.host_probe_snat_v4.to_string())];
    if cfg.enable_ipv6 {
        rules.push(rule("ip6", PROBE_SET_V6, cfg.host_probe_snat_v6.to_string()));
    }
    AmbientNftPlan { tables: vec![(TABLE_NAT, HOST_CHAINS)], rules }
}

/// The transaction Istio's knftables sends for `plan`: per table that has rules,
/// `add table`, `flush table`, `add chain` for each chain that has rules or is jumped
/// to, then the rules in order.
pub fn render(plan: &AmbientNftPlan) -> String {
    let mut out = String::new();
    for (table, chains) in &plan.tables {
        let rules: Vec<&AmbientNftRule> = plan.rules.iter().filter(|r| r.table == *table).collect();
        if rules.is_empty() {
            continue;
        }
        let used = |chain: &str| {
            rules.iter().any(|r| {
                r.chain == chain
                    || r.expr.split_whitespace().collect::<Vec<_>>().windows(2).any(|w| w == ["jump", chain])
            })
        };
        out.push_str(&format!("add table inet {table}\nflush table inet {table}\n"));
        for (chain, hook) in chains.iter().filter(|(c, _)| used(c)) {
            match hook {
                Some(spec) => out.push_str(&format!("add chain inet {table} {chain} {{ {spec} }}\n")),
                None => out.push_str(&format!("add chain inet {table} {chain}\n")),
            }
        }
        for rule in rules {
            out.push_str(&format!("add rule inet {table} {} {}\n", rule.chain, rule.expr));
        }
    }
    out
}

/// A transaction that deletes `tables` whether or not they exist.
pub fn render_delete(tables: &[&str]) -> String {
    tables.iter().map(|t| format!("add table inet {t}\ndelete table inet {t}\n")).collect()
}

/// The sets the node's probe rule reads, created if missing (`add` leaves an existing
/// set and its members alone), in the table the rule lives in.
pub fn render_probe_sets(ipv6: bool) -> String {
    let mut out = format!("add table inet {TABLE_NAT}\n");
    let comment = "comment \"UUID of the pods that are part of ambient mesh\" ;";
    out.push_str(&format!("add set inet {TABLE_NAT} {PROBE_SET_V4} {{ type ipv4_addr ; {comment} }}\n"));
    if ipv6 {
        out.push_str(&format!("add set inet {TABLE_NAT} {PROBE_SET_V6} {{ type ipv6_addr ; {comment} }}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ambient::PodOverrides;

    #[test]
    fn a_chain_only_jumped_to_is_still_declared() {
        let ingress = InpodConfig {
            pod: PodOverrides { ingress_mode: true, ..Default::default() },
            ..Default::default()
        };
        let tx = render(&inpod(&ingress));
        assert!(tx.contains("add chain inet istio-ambient-nat istio-prerouting\n"), "{tx}");
        assert!(!tx.contains("istio-ambient-raw"), "no DNS, no raw table");
    }

    #[test]
    fn host_rule_matches_kubelets_uid() {
        let tx = render(&host_probe(&AmbientConfig::default(), 4242));
        assert!(
            tx.contains("skuid 4242 ip daddr @istio-inpod-probes-v4 counter snat to 169.254.7.127"),
            "{tx}"
        );
        assert!(!tx.contains("ip6"));
    }
}
