//! Shared plumbing for Weir's fuzz targets: how one fuzz input becomes the several
//! texts a parser reads (sections), and the fixed host facts the pure resolvers need.
//! Each target under `fuzz_targets/` owns one parser; this crate owns nothing else.

use std::net::IpAddr;

/// The line that separates the sections of a multi-part input.
pub const SEPARATOR: &str = "\n%%\n";

/// The input as text, or `None` when it is not UTF-8 (the parsers behind these
/// targets take `&str`; their callers reject non-UTF-8 before them).
pub fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

/// Exactly `n` sections of `text` split on [`SEPARATOR`]; missing ones are empty and
/// the last one keeps any further separators.
pub fn sections(text: &str, n: usize) -> Vec<&str> {
    let mut out: Vec<&str> = text.splitn(n, SEPARATOR).collect();
    out.resize(n, "");
    out
}

/// `NAME=VALUE` lines as an environment (a line without `=` is skipped).
pub fn env_lines(text: &str) -> Vec<(String, String)> {
    text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// A pod's network namespace as istio-iptables would find it: fixed, so runs repeat.
pub struct PodHost;

impl weir_iptables::detect::HostFacts for PodHost {
    fn addresses(&self) -> std::io::Result<Vec<IpAddr>> {
        Ok(["127.0.0.1", "10.66.0.10", "::1", "fd00:66::a"]
            .iter()
            .map(|a| a.parse().expect("literal"))
            .collect())
    }
    fn resolv_conf(&self) -> std::io::Result<String> {
        Ok("nameserver 10.96.0.10\nsearch default.svc.cluster.local svc.cluster.local\n".into())
    }
    fn user_id(&self, name: &str) -> Option<u32> {
        (name == "istio-proxy").then_some(1337)
    }
    fn group_exists(&self, name: &str) -> bool {
        name == "istio-proxy"
    }
}

/// Renders a capture config every way Weir can (iptables-restore text for both
/// families, the nftables transaction, and the removal), as a resolved config would be
/// applied: a config that parses must render.
pub fn render_all(cfg: &weir_iptables::CaptureConfig) {
    let plan = weir_iptables::plan::plan(cfg);
    for v6 in [false, true] {
        let rules = plan.family(v6);
        let _ = weir_iptables::render::restore(rules);
        let _ = weir_iptables::render::removal(rules);
        let _ = weir_iptables::render::checks(rules);
    }
    let _ = weir_iptables::nft::render(&weir_iptables::nft::plan(cfg));
}

/// The agent's DNS proxy with a small NDS table installed and no upstream, so unknown
/// names are answered SERVFAIL without leaving the process.
pub fn dns_proxy() -> std::sync::Arc<weir_agent::sidecar::dns::DnsProxy> {
    use weir_agent::sidecar::dns::{DnsConfig, DnsProxy, table::ProxyScope};
    use weir_proto::istio::networking::nds::v1::{NameTable, name_table::NameInfo};
    let config = DnsConfig {
        listen: Vec::new(),
        scope: ProxyScope {
            namespace: "default".into(),
            domain: "default.svc.cluster.local".into(),
            search: vec!["default.svc.cluster.local".into()],
        },
        upstreams: Vec::new(),
        upstream_timeout: std::time::Duration::from_millis(1),
        forward_parallel: false,
        respond_before_sync: false,
        limits: Default::default(),
    };
    let proxy = DnsProxy::new(config, std::sync::Arc::new(weir_agent::sidecar::metrics::Metrics::new()));
    let info = |ips: &[&str], registry: &str, shortname: &str| NameInfo {
        ips: ips.iter().map(|s| s.to_string()).collect(),
        registry: registry.into(),
        shortname: shortname.into(),
        namespace: "default".into(),
        ..Default::default()
    };
    let mut table = NameTable::default();
    table.table.insert(
        "reviews.default.svc.cluster.local".into(),
        info(&["10.0.0.1", "fd00::1"], "Kubernetes", "reviews"),
    );
    table.table.insert("*.wild.example.com".into(), info(&["10.0.0.2"], "External", ""));
    table.table.insert(
        "big.example.com".into(),
        info(&(0..200).map(|_| "10.0.0.3").collect::<Vec<_>>(), "External", ""),
    );
    proxy.update(table);
    proxy
}

/// Runs `future` to completion on this thread's tokio runtime (current-thread, time
/// enabled: the DNS proxy bounds its TCP reads with timeouts).
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    thread_local! {
        static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread runtime");
    }
    RUNTIME.with(|runtime| runtime.block_on(future))
}
