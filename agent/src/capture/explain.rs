//! `weir capture explain`: what capture does with one connection of a pod, outbound or
//! (`--inbound`) arriving at it, and why, from the pod's live config. eBPF (`--pod`):
//! the programs' own decision functions (`weir_ebpf_common::policy`, and
//! `InboundConfig::captures` for the tc classifier) over the pod's registered config
//! and CIDR tries, read from the pinned maps, with the counter the decision is counted
//! in. Netfilter (`--netns`): the nat rules the pod's namespace holds (`iptables-save`
//! or Weir's nftables table), walked from OUTPUT or PREROUTING
//! (`weir_iptables::explain`), naming the deciding rule.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use anyhow::{Context as _, bail};
use clap::Args;
use weir_ebpf_common::{
    capture::{PodConfig, map},
    policy::{self, DstClass, Reason, Verdict},
};
use weir_iptables::{
    detect::{HostFacts as _, SystemFacts},
    explain::{Connection, Outcome},
};

use crate::{
    capture::ebpf::{
        capture::{MapSet, OWN_ADDRESS},
        netns::in_netns,
        pod,
        record::PinRecord,
    },
    support::privileges::{self, Capability},
};

/// Which pod: an eBPF capture or a namespace with netfilter rules.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct ExplainTarget {
    /// An eBPF capture (its name in `weir capture status`): explain from its maps.
    #[arg(long)]
    pub pod: Option<String>,
    /// A pod's network namespace captured with netfilter: explain from its nat rules.
    #[arg(long)]
    pub netns: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ExplainArgs {
    #[command(flatten)]
    pub target: ExplainTarget,
    /// The connection's destination (`ip:port`, `[ip6]:port`).
    pub destination: SocketAddr,
    /// The connecting process's uid (default: 0, an app running as root).
    #[arg(long, default_value_t = 0)]
    pub uid: u32,
    /// Its gid (default: the uid).
    #[arg(long)]
    pub gid: Option<u32>,
    /// The address its socket is bound to (Envoy's inbound passthrough binds 127.0.0.6).
    #[arg(long)]
    pub src: Option<IpAddr>,
    /// A UDP send rather than a TCP connect.
    #[arg(long)]
    pub udp: bool,
    /// A connection arriving at the pod instead: the destination is one of the pod's
    /// addresses and its port, `--src` the peer's address (TCP; no uid or gid applies).
    #[arg(long, conflicts_with_all = ["udp", "uid", "gid"])]
    pub inbound: bool,
    /// The interface it arrives on (default: the capture's, else eth0).
    #[arg(long, requires = "inbound")]
    pub interface: Option<String>,
    /// The pod's cgroup v2 directory: also say whether the programs its ancestors run
    /// leave eBPF capture safe there (why `auto` picked netfilter). With --pod, the
    /// capture's own cgroup is judged without it.
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
}

/// The answer: what happens, why, and what counts it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Answer {
    pub backend: &'static str,
    /// `redirected to 127.0.0.1:15001 (Envoy's outbound listener)` or `not captured`.
    pub outcome: String,
    pub why: String,
    /// The decision counter (eBPF) or the rules walked (netfilter).
    pub evidence: Vec<String>,
}

pub fn run(args: &ExplainArgs) -> anyhow::Result<()> {
    let answer = match (&args.target.pod, &args.target.netns) {
        (Some(pod), _) => {
            privileges::require(&[Capability::SysAdmin, Capability::Bpf], "weir capture explain --pod")?;
            if args.inbound { inbound::ebpf(pod, args)? } else { ebpf(pod, args)? }
        }
        (_, Some(netns)) => {
            privileges::require(
                &[Capability::SysAdmin, Capability::NetAdmin],
                "weir capture explain --netns",
            )?;
            if args.inbound { inbound::netfilter(netns, args)? } else { netfilter(netns, args)? }
        }
        _ => bail!("--pod or --netns is needed"),
    };
    if args.inbound {
        let from = args.src.map_or("a peer".to_string(), |s| s.to_string());
        println!("{} capture: TCP connection from {from} to {}", answer.backend, args.destination);
    } else {
        println!(
            "{} capture: {} {} by uid {} gid {}",
            answer.backend,
            kind(args),
            args.destination,
            args.uid,
            gid(args)
        );
    }
    println!("  {}", answer.outcome);
    println!("  because {}", answer.why);
    for e in &answer.evidence {
        println!("  {e}");
    }
    if let Some(line) = ancestors_line(args)? {
        println!("  {line}");
    }
    Ok(())
}

/// What the ancestors of the pod's cgroup run, judged for eBPF capture: the capture's
/// own cgroup for `--pod` (Weir's programs there show the order: nothing is attached),
/// `--cgroup` for a pod on netfilter (a pass-through probe may be attached for a moment
/// to tell it). `None` without a cgroup to judge.
fn ancestors_line(args: &ExplainArgs) -> anyhow::Result<Option<String>> {
    use crate::capture::ebpf::ancestors::{self, AncestorError, Probe};
    let (cgroup, probe) = match (&args.cgroup, &args.target.pod) {
        (Some(cgroup), _) => (cgroup.clone(), Probe::Attach),
        (None, Some(pod)) => (pod_record(pod)?.cgroup, Probe::Never),
        (None, None) => return Ok(None),
    };
    let hooks = crate::capture::ebpf::capture::cgroup_hook_types();
    let netfilter = args.target.pod.is_none();
    Ok(Some(match ancestors::check(&cgroup, &hooks, probe) {
        Ok(()) => format!(
            "eBPF capture of {}: no program its ancestor cgroups run stands in the way",
            cgroup.display()
        ),
        Err(AncestorError::Unsafe(u)) if netfilter => {
            format!("not eBPF, so `auto` picks netfilter for this pod: {u}")
        }
        Err(AncestorError::Unsafe(u)) => format!("UNSAFE: {u}"),
        Err(e) => format!("eBPF capture of {} not judged: {e}", cgroup.display()),
    }))
}

fn gid(args: &ExplainArgs) -> u32 {
    args.gid.unwrap_or(args.uid)
}

fn kind(args: &ExplainArgs) -> &'static str {
    if args.udp { "UDP send to" } else { "TCP connect to" }
}

/// A pod's pin record (not a node capture's).
fn pod_record(pod: &str) -> anyhow::Result<PinRecord> {
    let record = PinRecord::load(pod)
        .with_context(|| format!("no eBPF capture named {pod} (`weir capture status` lists them)"))?;
    if record.netns_cookie == 0 {
        bail!("{pod} is a node capture, not a pod: name one of its pods (`weir capture status`)");
    }
    Ok(record)
}

/// The pod's registered config and maps, from its pin record.
fn registered(pod: &str) -> anyhow::Result<(MapSet, u64, PodConfig)> {
    let record = pod_record(pod)?;
    let maps = pod::maps_of(&record).with_context(|| format!("open the maps of capture {pod}"))?;
    let cfg = maps.pod_config(record.netns_cookie)?.with_context(|| {
        format!("capture {pod}: its namespace (cookie {}) is not registered", record.netns_cookie)
    })?;
    Ok((maps, record.netns_cookie, cfg))
}

fn ebpf(pod: &str, args: &ExplainArgs) -> anyhow::Result<Answer> {
    let (maps, netns, cfg) = registered(pod)?;
    let dst = match args.destination.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    let port = args.destination.port();
    let lookup = |v4, v6| maps.lookup(v4, v6, netns, dst);
    let decision = decide(&cfg, args, dst, &lookup)?;
    let counters = maps.pod_counters(netns)?;
    let counted = |name: &str| match &counters {
        Some(c) => format!("counted as {name} (this pod so far: {})", c.get(name)),
        None => format!("counted as {name}"),
    };
    let answer = |outcome: String, why: String, counter: &str| Answer {
        backend: "eBPF",
        outcome,
        why,
        evidence: vec![counted(counter)],
    };
    Ok(match decision {
        Decision::Dns => answer(
            format!("redirected to the DNS proxy on {}:{}", loopback_of(dst), cfg.dns_port),
            "DNS capture is on (--redirect-dns) and the destination is a DNS server the pod uses".into(),
            "dns_redirected",
        ),
        Decision::Udp => Answer {
            backend: "eBPF",
            outcome: "not captured".into(),
            why: "eBPF capture redirects TCP connects and DNS; other UDP goes where it is sent".into(),
            evidence: Vec::new(),
        },
        Decision::Verdict(Verdict::Redirect(to)) => {
            let (listener, counter) = if to == cfg.inbound_port {
                ("Envoy's inbound listener", "redirected_inbound")
            } else {
                ("Envoy's outbound listener", "redirected")
            };
            let why = if to == cfg.inbound_port {
                format!(
                    "uid {} is the proxy's and it calls its own pod through loopback (Istio's `-o lo ! -d 127.0.0.1/32 ... -j ISTIO_IN_REDIRECT`)",
                    args.uid
                )
            } else {
                included_why(&cfg, port)
            };
            answer(
                format!(
                    "redirected to {}:{to} ({listener}), original destination {}:{port}",
                    loopback_of(dst),
                    dst
                ),
                why,
                counter,
            )
        }
        Decision::Verdict(Verdict::Pass(reason)) => {
            let counter = weir_ebpf_common::capture::counter::NAMES[reason.counter() as usize];
            answer("not captured".into(), reason_why(&cfg, reason, args, port), counter)
        }
    })
}

enum Decision {
    Dns,
    Udp,
    Verdict(Verdict),
}

/// The programs' decision for this connection, in the connect programs' order:
/// Envoy's inbound passthrough, DNS, then the outbound decision.
fn decide(
    cfg: &PodConfig,
    args: &ExplainArgs,
    dst: IpAddr,
    lookup: &dyn Fn(&'static str, &'static str) -> Result<Option<u8>, crate::capture::ebpf::EbpfError>,
) -> anyhow::Result<Decision> {
    let (uid, gid, port) = (args.uid, gid(args), args.destination.port());
    let passthrough = match args.src {
        Some(IpAddr::V4(s)) => policy::from_inbound_passthrough(u32::from_ne_bytes(s.octets())),
        Some(IpAddr::V6(s)) => policy::from_inbound_passthrough6(&words6(s.octets())),
        None => false,
    };
    if passthrough && !args.udp {
        return Ok(Decision::Verdict(Verdict::Pass(Reason::InboundPassthrough)));
    }
    let dns_server = lookup(map::DNS_V4, map::DNS_V6)?.is_some();
    if policy::dns(cfg, uid, gid, port, || dns_server) {
        return Ok(Decision::Dns);
    }
    if args.udp {
        return Ok(Decision::Udp);
    }
    let loopback = match dst {
        IpAddr::V4(a) => policy::loopback4(u32::from_ne_bytes(a.octets())),
        IpAddr::V6(a) => policy::loopback6(&words6(a.octets())),
    };
    let class = match lookup(map::EXCLUDE_V4, map::EXCLUDE_V6)? {
        None => DstClass::Other,
        Some(OWN_ADDRESS) => DstClass::OwnPod,
        Some(_) => DstClass::Excluded,
    };
    let included = lookup(map::INCLUDE_V4, map::INCLUDE_V6)?.is_some();
    Ok(Decision::Verdict(policy::outbound_tcp(cfg, uid, gid, port, loopback, || class, || included)))
}

fn words6(b: [u8; 16]) -> [u32; 4] {
    std::array::from_fn(|i| u32::from_ne_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]))
}

fn loopback_of(dst: IpAddr) -> &'static str {
    if dst.is_ipv4() { "127.0.0.1" } else { "[::1]" }
}

fn ids(list: &[u32]) -> String {
    let v: Vec<String> =
        list.iter().filter(|i| **i != weir_ebpf_common::capture::NO_ID).map(u32::to_string).collect();
    if v.is_empty() { "none".into() } else { v.join(",") }
}

fn ports(list: &[u16]) -> String {
    let v: Vec<String> = list.iter().filter(|p| **p != 0).map(u16::to_string).collect();
    v.join(",")
}

fn included_why(cfg: &PodConfig, port: u16) -> String {
    use weir_ebpf_common::capture::flags::CAPTURE_ALL_OUTBOUND;
    if cfg.include_ports.contains(&port) {
        format!("port {port} is an included outbound port (-q {})", ports(&cfg.include_ports))
    } else if cfg.has(CAPTURE_ALL_OUTBOUND) {
        "every outbound destination not excluded is captured (-i '*')".into()
    } else {
        "the destination is in an included CIDR (-i)".into()
    }
}

fn reason_why(cfg: &PodConfig, reason: Reason, args: &ExplainArgs, port: u16) -> String {
    match reason {
        Reason::Proxy => format!(
            "uid {} / gid {} is the proxy's (-u {} / -g {}): Envoy's own connections are never captured",
            args.uid,
            gid(args),
            ids(&cfg.proxy_uids),
            ids(&cfg.proxy_gids)
        ),
        Reason::InboundPassthrough => {
            "the socket is bound to Envoy's inbound passthrough address (127.0.0.6 / ::6)".into()
        }
        Reason::ExcludedPort => {
            format!("port {port} is an excluded outbound port (-o {})", ports(&cfg.exclude_ports))
        }
        Reason::ExcludedCidr => "the destination is in an excluded CIDR (-x)".into(),
        Reason::OwnPodAddress => "the destination is one of the pod's own addresses".into(),
        Reason::Loopback => "the destination is a loopback address".into(),
        Reason::NotIncluded => "no included CIDR (-i) or port (-q) matches, and -i is not '*'".into(),
    }
}

/// The pod's nat rules: Weir's native nftables table when the namespace has one, else
/// what iptables-save prints for the destination's family.
fn nat_rules(netns: &std::path::Path, v6: bool) -> anyhow::Result<(&'static str, String)> {
    use weir_iptables::{
        netlink::Family,
        xtables::{Lock, SystemXtables, Xtables as _},
    };
    let family = if v6 { Family::V6 } else { Family::V4 };
    in_netns(netns, || {
        let nft =
            std::process::Command::new("nft").args(["list", "table", "inet", "istio-proxy-nat"]).output();
        if let Some(out) = nft.ok().filter(|o| o.status.success()) {
            return Ok(Some(("nftables", String::from_utf8_lossy(&out.stdout).into_owned())));
        }
        let mut x = SystemXtables::detect(None, v6, Lock::Global).map_err(std::io::Error::other)?;
        Ok(x.save(family).map(|save| ("iptables", save)))
    })
    .with_context(|| format!("read the rules of {}", netns.display()))?
    .with_context(|| format!("neither nft nor iptables-save could read the rules of {}", netns.display()))
}

/// The answer for a netfilter walk: the outcome, the deciding rule, the jumps taken.
fn walked(
    backend: &'static str,
    e: &weir_iptables::explain::Explanation,
    args: &ExplainArgs,
    hook: &str,
) -> Answer {
    let outcome = match e.outcome {
        Outcome::Redirect(port) => {
            format!("redirected to local port {port}, original destination {}", args.destination)
        }
        Outcome::NotCaptured => "not captured".into(),
    };
    let why = match &e.decided_by {
        Some(rule) => format!("the rule `{rule}` matched"),
        None => format!("no rule of the nat {hook} chain matched"),
    };
    Answer { backend, outcome, why, evidence: e.jumps.iter().map(|j| format!("through `{j}`")).collect() }
}

fn netfilter(netns: &std::path::Path, args: &ExplainArgs) -> anyhow::Result<Answer> {
    let dst = args.destination.ip();
    let own = SystemFacts { netns: Some(netns.to_path_buf()) }
        .addresses()
        .with_context(|| format!("read the addresses of {}", netns.display()))?;
    let (backend, rules) = nat_rules(netns, dst.is_ipv6())?;
    let conn = Connection {
        dst,
        dst_port: args.destination.port(),
        udp: args.udp,
        uid: args.uid,
        gid: gid(args),
        src: args.src,
        through_lo: dst.is_loopback() || own.contains(&dst),
        in_iface: None,
    };
    let e = match backend {
        "nftables" => weir_iptables::explain::explain_nft(&rules, &conn),
        _ => weir_iptables::explain::explain(&rules, &conn),
    }
    .with_context(|| format!("the {backend} rules of {}", netns.display()))?;
    Ok(walked(backend, &e, args, "output"))
}

mod inbound;

#[cfg(test)]
mod tests {
    //! The explainers agree: for the injector's rules and variants of them, every
    //! connection gets the same fate from the eBPF programs' decision function as from
    //! Istio's nat rules walked rule by rule, as iptables and as native nftables (so
    //! `explain` tells the same story for every backend, and the backends capture the
    //! same connections).
    use super::*;
    use crate::capture::ebpf::config::{EbpfOptions, PodCapture};
    use clap::Parser;
    use weir_iptables::{detect::HostFacts, flags::IstioIptablesArgs};

    #[derive(Parser)]
    #[command(args_override_self = true)]
    struct Cli {
        #[command(flatten)]
        args: IstioIptablesArgs,
    }

    struct Pod;

    const OWN: &str = "10.0.0.5";

    impl HostFacts for Pod {
        fn addresses(&self) -> std::io::Result<Vec<IpAddr>> {
            Ok(vec!["127.0.0.1".parse().unwrap(), OWN.parse().unwrap()])
        }
        fn resolv_conf(&self) -> std::io::Result<String> {
            Ok("nameserver 10.96.0.10\n".into())
        }
        fn user_id(&self, _: &str) -> Option<u32> {
            None
        }
        fn group_exists(&self, _: &str) -> bool {
            false
        }
    }

    fn agree(extra: &[&str]) {
        let mut argv = vec!["istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT"];
        argv.extend(["-i", "*", "-x", "", "-b", "*", "-d", "15090,15021,15020"]);
        argv.extend(extra);
        let (cfg, _) = Cli::try_parse_from(&argv).unwrap().args.resolve(&|_| None, &Pod).unwrap();
        let save = weir_iptables::render::restore(&weir_iptables::plan::plan(&cfg).v4);
        let nft = weir_iptables::nft::render(&weir_iptables::nft::plan(&cfg));
        let own: IpAddr = OWN.parse().unwrap();
        let pod = PodCapture::new(&cfg, vec![own], EbpfOptions { accelerate: false }).unwrap();
        let dsts = ["10.1.2.3", "10.96.0.10", "10.96.5.5", "192.168.7.7", OWN, "127.0.0.1", "127.0.0.6"];
        let mut compared = 0;
        for dst in dsts.map(|d| d.parse::<IpAddr>().unwrap()) {
            let lookup =
                |v4: &'static str, _: &'static str| -> Result<Option<u8>, crate::capture::ebpf::EbpfError> {
                    let hit = |list: &[weir_iptables::config::Cidr]| list.iter().any(|c| c.contains(dst));
                    Ok(match v4 {
                        map::EXCLUDE_V4 if dst == own => Some(OWN_ADDRESS),
                        map::EXCLUDE_V4 => hit(&pod.exclude).then_some(1),
                        map::INCLUDE_V4 => hit(&pod.include).then_some(1),
                        map::DNS_V4 => pod.dns_servers.contains(&dst).then_some(1),
                        _ => None,
                    })
                };
            for (uid, port, src) in [0u32, 1000, 1337].into_iter().flat_map(|u| {
                [80u16, 53, 3306, 9090, 15008, 15002]
                    .into_iter()
                    .flat_map(move |p| [None, Some("127.0.0.6")].map(move |s| (u, p, s)))
            }) {
                let src: Option<IpAddr> = src.map(|s| s.parse().unwrap());
                let through_lo = dst.is_loopback() || dst == own;
                if src.is_some() && !through_lo {
                    // A socket bound to 127.0.0.6 cannot reach a destination off `lo`:
                    // the route lookup refuses it (EINVAL) with either backend.
                    continue;
                }
                let args = ExplainArgs {
                    target: ExplainTarget { pod: None, netns: None },
                    destination: SocketAddr::new(dst, port),
                    uid,
                    gid: None,
                    src,
                    udp: false,
                    inbound: false,
                    interface: None,
                    cgroup: None,
                };
                let ebpf = match decide(&pod.config, &args, dst, &lookup).unwrap() {
                    Decision::Dns => Outcome::Redirect(pod.config.dns_port),
                    Decision::Udp => unreachable!("TCP only here"),
                    Decision::Verdict(Verdict::Redirect(p)) => Outcome::Redirect(p),
                    Decision::Verdict(Verdict::Pass(_)) => Outcome::NotCaptured,
                };
                let conn = Connection {
                    dst,
                    dst_port: port,
                    udp: false,
                    uid,
                    gid: uid,
                    src,
                    through_lo,
                    in_iface: None,
                };
                let nf = weir_iptables::explain::explain(&save, &conn).unwrap();
                let at = format!("{extra:?}: uid {uid} -> {dst}:{port} from {src:?}");
                assert_eq!(ebpf, nf.outcome, "{at}: iptables {nf:?}");
                let nft = weir_iptables::explain::explain_nft(&nft, &conn).unwrap();
                assert_eq!(ebpf, nft.outcome, "{at}: nftables {nft:?}");
                compared += 1;
            }
        }
        // Every destination, uid and port unbound; bound to 127.0.0.6 only through lo.
        assert_eq!(compared, 7 * 3 * 6 + 3 * 3 * 6);
    }

    /// Inbound: the tc classifier's test against Istio's PREROUTING rules, both forms.
    fn agree_inbound(inbound: &[&str]) {
        let mut argv = vec!["istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT"];
        argv.extend(["-i", "*", "-x", ""]);
        argv.extend(inbound);
        let (cfg, _) = Cli::try_parse_from(&argv).unwrap().args.resolve(&|_| None, &Pod).unwrap();
        let save = weir_iptables::render::restore(&weir_iptables::plan::plan(&cfg).v4);
        let nft = weir_iptables::nft::render(&weir_iptables::nft::plan(&cfg));
        let pod =
            PodCapture::new(&cfg, vec![OWN.parse().unwrap()], EbpfOptions { accelerate: false }).unwrap();
        // Not 15006 itself: Istio redirects it to itself, the classifier leaves it; the
        // same listener either way.
        for port in [80u16, 8080, 9080, 15008, 15020, 15021, 15090, 22] {
            let ebpf = match &pod.inbound {
                Some(c) if c.captures(port) => Outcome::Redirect(c.capture_port),
                _ => Outcome::NotCaptured,
            };
            let conn = Connection {
                dst: OWN.parse().unwrap(),
                dst_port: port,
                udp: false,
                uid: 0,
                gid: 0,
                src: Some("10.0.0.7".parse().unwrap()),
                through_lo: false,
                in_iface: Some("eth0".into()),
            };
            let nf = weir_iptables::explain::explain_inbound(&save, &conn).unwrap();
            assert_eq!(ebpf, nf.outcome, "{inbound:?}: port {port}: iptables {nf:?}");
            let nft = weir_iptables::explain::explain_nft_inbound(&nft, &conn).unwrap();
            assert_eq!(ebpf, nft.outcome, "{inbound:?}: port {port}: nftables {nft:?}");
        }
    }

    #[test]
    fn the_inbound_classifier_and_netfilter_decide_alike() {
        agree_inbound(&["-b", "*", "-d", "15090,15021,15020"]);
        agree_inbound(&["-b", "8080,9080"]);
        agree_inbound(&["-b", "*"]);
        agree_inbound(&["-b", ""]);
    }

    #[test]
    fn ebpf_and_netfilter_decide_alike_for_the_injectors_rules() {
        agree(&[]);
    }

    #[test]
    fn ebpf_and_netfilter_decide_alike_with_exclusions_inclusions_and_dns() {
        agree(&["-o", "3306", "-x", "10.96.0.0/12"]);
        agree(&["-i", "192.168.0.0/16", "-q", "9090"]);
        agree(&["--redirect-dns"]);
        agree(&["--redirect-dns", "--capture-all-dns", "-o", "9090"]);
    }
}
