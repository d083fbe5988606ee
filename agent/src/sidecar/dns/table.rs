//! The lookup table built from an NDS `NameTable`, as Istio builds it: each host under
//! its FQDN with a trailing dot; Kubernetes services also as `name.ns.`, `name.ns.svc.`
//! and, in the proxy's own namespace, `name.`; wildcard hosts (`*.example.com`); and for
//! the first resolv.conf search domain a CNAME shortcut, so `svc.ns.svc.cluster.local`
//! asked as `svc.ns.svc.cluster.local.ns.svc.cluster.local.` resolves in one round trip.
//! Pure: no I/O.

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    str::FromStr,
};

use hickory_proto::rr::{Name, RData, Record, RecordType, rdata};
use weir_proto::istio::networking::nds::v1::NameTable;

/// TTL of every locally answered record (Istio's 30 s).
pub const TTL: u32 = 30;

#[derive(Debug, Default, Clone)]
pub struct LookupTable {
    hosts: HashSet<String>,
    v4: HashMap<String, Vec<Ipv4Addr>>,
    v6: HashMap<String, Vec<Ipv6Addr>>,
    cname: HashMap<String, String>,
}

/// Where the proxy sits, for the short-name expansions.
#[derive(Debug, Clone, Default)]
pub struct ProxyScope {
    /// The pod's namespace.
    pub namespace: String,
    /// The proxy domain, e.g. `ns.svc.cluster.local`.
    pub domain: String,
    /// resolv.conf search domains.
    pub search: Vec<String>,
}

impl ProxyScope {
    /// The domain without the leading namespace label (`svc.cluster.local`).
    fn domain_parts(&self) -> Vec<&str> {
        let mut parts: Vec<&str> = self.domain.split('.').filter(|p| !p.is_empty()).collect();
        if parts.first() == Some(&self.namespace.as_str()) {
            parts.remove(0);
        }
        parts
    }
}

fn alt_hosts(
    host: &str,
    info: &weir_proto::istio::networking::nds::v1::name_table::NameInfo,
    scope: &ProxyScope,
) -> HashSet<String> {
    let mut out = HashSet::new();
    if host.ends_with('.') {
        return out;
    }
    out.insert(format!("{host}."));
    // Istio drops the proxy's namespace from its domain: `svc.cluster.local`. Services in
    // another cluster domain get no short forms (conflicts could not be resolved).
    let parts = scope.domain_parts();
    let domain = parts.join(".");
    if domain.is_empty() || !host.ends_with(&domain) {
        return out;
    }
    out.insert(format!("{}.{}.", info.shortname, info.namespace));
    if scope.namespace == info.namespace {
        out.insert(format!("{}.", info.shortname));
    }
    if let Some(first) = parts.first() {
        out.insert(format!("{}.{}.{first}.", info.shortname, info.namespace));
    }
    #[allow(deprecated, reason = "Istio still honours alt_hosts")]
    for alt in &info.alt_hosts {
        out.insert(format!("{alt}."));
    }
    out
}

impl LookupTable {
    pub fn build(table: &NameTable, scope: &ProxyScope) -> Self {
        let mut out = Self::default();
        for (host, info) in &table.table {
            let alts = if info.registry == "Kubernetes" {
                alt_hosts(host, info, scope)
            } else {
                HashSet::from([if host.ends_with('.') { host.clone() } else { format!("{host}.") }])
            };
            let (mut v4, mut v6) = (Vec::new(), Vec::new());
            for ip in &info.ips {
                match IpAddr::from_str(ip) {
                    Ok(IpAddr::V4(a)) => v4.push(a),
                    Ok(IpAddr::V6(a)) => match a.to_ipv4_mapped() {
                        Some(m) => v4.push(m),
                        None => v6.push(a),
                    },
                    Err(_) => {}
                }
            }
            if v4.is_empty() && v6.is_empty() {
                continue;
            }
            for h in &alts {
                let h = h.to_ascii_lowercase();
                out.hosts.insert(h.clone());
                if !v4.is_empty() {
                    out.v4.insert(h.clone(), v4.clone());
                }
                if !v6.is_empty() {
                    out.v6.insert(h.clone(), v6.clone());
                }
                if let Some(search) = scope.search.first() {
                    let search = search.trim_end_matches('.');
                    if !h.ends_with(&format!("{search}.")) {
                        let expanded = format!("{h}{search}.").to_ascii_lowercase();
                        if !alts.contains(&expanded) {
                            out.cname.insert(expanded.clone(), h.clone());
                            out.hosts.insert(expanded);
                        }
                    }
                }
            }
        }
        out
    }

    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The records answering `qtype` for `name` (lowercase, trailing dot), or `None` if
    /// the name is not ours (forward it). `Some(empty)` is an authoritative NOERROR with
    /// no answers: a known host without an address of that family.
    pub fn lookup(&self, qtype: RecordType, name: &str) -> Option<Vec<Record>> {
        let question = name.to_ascii_lowercase();
        let mut host = question.clone();
        let mut wildcard = false;
        if !self.hosts.contains(&host) {
            let labels: Vec<&str> = host.trim_end_matches('.').split('.').collect();
            let found = (0..labels.len()).find_map(|i| {
                let candidate = format!("*.{}.", labels[i + 1..].join("."));
                self.hosts.contains(&candidate).then_some(candidate)
            })?;
            host = found;
            wildcard = true;
        }
        let mut out = Vec::new();
        let mut target = host.clone();
        if let Some(cn) = self.cname.get(&host) {
            out.push(record(&question, RData::CNAME(rdata::CNAME(name_of(cn)))));
            target = cn.clone();
        }
        // With a CNAME the address records carry its target; a wildcard expands to the
        // question; otherwise the host itself.
        let owner = if !out.is_empty() {
            target.clone()
        } else if wildcard {
            question.clone()
        } else {
            host.clone()
        };
        match qtype {
            RecordType::A => {
                for ip in self.v4.get(&target).into_iter().flatten() {
                    out.push(record(&owner, RData::A(rdata::A(*ip))));
                }
            }
            RecordType::AAAA => {
                for ip in self.v6.get(&target).into_iter().flatten() {
                    out.push(record(&owner, RData::AAAA(rdata::AAAA(*ip))));
                }
            }
            _ => return None,
        }
        if out.iter().all(|r| r.record_type() == RecordType::CNAME) {
            // Known host, no address of this family: NOERROR with nothing (not even the
            // CNAME, as Istio does).
            out.clear();
        }
        Some(out)
    }
}

fn name_of(s: &str) -> Name {
    Name::from_ascii(s).unwrap_or_else(|_| Name::root())
}

fn record(owner: &str, data: RData) -> Record {
    Record::from_rdata(name_of(owner), TTL, data)
}

#[cfg(test)]
mod tests {
    use weir_proto::istio::networking::nds::v1::name_table::NameInfo;

    use super::*;

    fn table() -> LookupTable {
        let mut nt = NameTable::default();
        let k8s = |short: &str, ns: &str, ips: &[&str]| NameInfo {
            ips: ips.iter().map(|s| s.to_string()).collect(),
            registry: "Kubernetes".into(),
            shortname: short.into(),
            namespace: ns.into(),
            ..Default::default()
        };
        nt.table
            .insert("echo.app.svc.cluster.local".into(), k8s("echo", "app", &["10.96.0.20", "10.96.0.21"]));
        nt.table.insert("db.other.svc.cluster.local".into(), k8s("db", "other", &["fd00::30"]));
        nt.table.insert(
            "*.wild.example.com".into(),
            NameInfo { ips: vec!["192.0.2.7".into()], registry: "External".into(), ..Default::default() },
        );
        nt.table
            .insert("bad.example.com".into(), NameInfo { ips: vec!["nope".into()], ..Default::default() });
        let scope = ProxyScope {
            namespace: "app".into(),
            domain: "app.svc.cluster.local".into(),
            search: vec!["app.svc.cluster.local".into(), "svc.cluster.local".into()],
        };
        LookupTable::build(&nt, &scope)
    }

    fn ips(records: &[Record]) -> Vec<String> {
        let mut v: Vec<String> = records
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) => Some(a.0.to_string()),
                RData::AAAA(a) => Some(a.0.to_string()),
                _ => None,
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn kubernetes_names_and_their_short_forms() {
        let t = table();
        for name in ["echo.app.svc.cluster.local.", "echo.app.", "echo.app.svc.", "echo."] {
            assert_eq!(ips(&t.lookup(RecordType::A, name).unwrap()), ["10.96.0.20", "10.96.0.21"], "{name}");
        }
        // The short name only in the proxy's own namespace.
        assert!(t.lookup(RecordType::AAAA, "db.").is_none());
        assert_eq!(ips(&t.lookup(RecordType::AAAA, "db.other.").unwrap()), ["fd00::30"]);
    }

    #[test]
    fn known_hosts_without_that_family_get_an_empty_authoritative_answer() {
        let t = table();
        assert_eq!(t.lookup(RecordType::AAAA, "echo.app.svc.cluster.local.").unwrap(), vec![]);
        assert_eq!(t.lookup(RecordType::A, "db.other.svc.cluster.local.").unwrap(), vec![]);
    }

    #[test]
    fn search_domain_expansions_resolve_through_a_cname() {
        let t = table();
        // A resolver trying `echo.app` with the first search domain appended.
        let answer = t.lookup(RecordType::A, "echo.app.app.svc.cluster.local.").unwrap();
        assert_eq!(answer[0].record_type(), RecordType::CNAME);
        assert_eq!(ips(&answer), ["10.96.0.20", "10.96.0.21"]);
        // Names already under the search domain get no expansion.
        assert!(t.lookup(RecordType::A, "echo.app.svc.cluster.local.app.svc.cluster.local.").is_none());
    }

    #[test]
    fn wildcards_and_unknown_names() {
        let t = table();
        let answer = t.lookup(RecordType::A, "api.wild.example.com.").unwrap();
        assert_eq!(ips(&answer), ["192.0.2.7"]);
        assert_eq!(answer[0].name.to_ascii(), "api.wild.example.com.");
        assert!(t.lookup(RecordType::A, "www.example.org.").is_none(), "not ours: forward");
        assert!(t.lookup(RecordType::A, "bad.example.com.").is_none(), "malformed entries are skipped");
        assert!(t.lookup(RecordType::MX, "echo.").is_none(), "other types are forwarded");
    }

    #[test]
    fn names_are_case_insensitive() {
        assert!(table().lookup(RecordType::A, "ECHO.App.").is_some());
    }
}
