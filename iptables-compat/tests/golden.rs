//! Conformance: for each configuration of Istio's own test table, the dry-run
//! transcript (iptables) and the nft transaction must equal Istio's golden file, line
//! for line after trimming. Goldens are copied byte for byte from istio/istio (see
//! testdata/ISTIO-CONFORMANCE.md for what produced each).

use std::path::PathBuf;

use weir_iptables::{
    apply::{program_iptables, program_nft},
    config::{
        CaptureConfig, Cidr, InboundPorts, InterceptionMode, IpRanges, OwnerGroups, RunOptions, parse_ports,
    },
    nft_exec::NftRecorder,
    xtables::Recorder,
};

type Case = (&'static str, fn(&mut CaptureConfig));

fn ports(s: &str) -> Vec<weir_iptables::config::PortSpec> {
    parse_ports("test", s).unwrap()
}
fn only(s: &str) -> InboundPorts {
    InboundPorts::parse("test", s).unwrap()
}
fn ranges(s: &str) -> IpRanges {
    IpRanges::parse("test", s).unwrap()
}
fn cidrs(s: &str) -> Vec<Cidr> {
    weir_iptables::config::parse_exclude_ranges("test", s).unwrap()
}
fn ids(s: &str) -> Vec<String> {
    s.split(',').map(String::from).collect()
}
fn nics(s: &str) -> Vec<String> {
    ids(s)
}

/// Istio's getCommonTestCases, as mutations of constructTestConfig (= our default).
const CASES: &[Case] = &[
    ("ipv6-empty-inbound-ports", |c| {
        c.inbound_ports = only("");
        c.enable_ipv6 = true;
    }),
    ("ip-range", |c| {
        c.outbound_ip_ranges_exclude = cidrs("1.1.0.0/16");
        c.outbound_ip_ranges_include = ranges("9.9.0.0/16");
        c.redirect_dns = true;
        c.enable_ipv6 = false;
        c.proxy_gids = ids("1,2");
        c.proxy_uids = ids("3,4");
        c.dns_servers_v4 = vec!["127.0.0.53".into()];
    }),
    ("tproxy", |c| {
        c.interception_mode = InterceptionMode::Tproxy;
        c.inbound_ports = only("*");
        c.outbound_ip_ranges_exclude = cidrs("1.1.0.0/16");
        c.outbound_ip_ranges_include = ranges("9.9.0.0/16");
        c.redirect_dns = true;
        c.dns_servers_v4 = vec!["127.0.0.53".into()];
        c.proxy_gids = ids("1337");
        c.proxy_uids = ids("1337");
        c.exclude_interfaces = nics("not-istio-nic");
        c.enable_ipv6 = true;
    }),
    ("ipv6-inbound-ports", |c| {
        c.inbound_ports = only("4000,5000");
        c.enable_ipv6 = true;
    }),
    ("ipv6-virt-interfaces", |c| {
        c.inbound_ports = only("4000,5000");
        c.reroute_virtual_interfaces = nics("eth0,eth1");
        c.enable_ipv6 = true;
    }),
    ("ipv6-ipnets", |c| {
        c.inbound_ports = only("4000,5000");
        c.inbound_ports_exclude = ports("6000,7000,");
        c.reroute_virtual_interfaces = nics("eth0,eth1");
        c.outbound_ip_ranges_exclude = cidrs("2001:db8::/32");
        c.outbound_ip_ranges_include = ranges("2001:db8::/32");
        c.enable_ipv6 = true;
    }),
    ("ipv6-uid-gid", |c| {
        c.inbound_ports = only("4000,5000");
        c.inbound_ports_exclude = ports("6000,7000");
        c.reroute_virtual_interfaces = nics("eth0,eth1");
        c.proxy_gids = ids("1,2");
        c.proxy_uids = ids("3,4");
        c.enable_ipv6 = true;
        c.outbound_ip_ranges_exclude = cidrs("2001:db8::/32");
        c.outbound_ip_ranges_include = ranges("2001:db8::/32");
    }),
    ("ipv6-outbound-ports", |c| {
        c.inbound_ports = only("");
        c.outbound_ports_include = ports("32000,31000");
        c.enable_ipv6 = true;
    }),
    ("empty", |_| {}),
    ("kube-virt-interfaces", |c| {
        c.reroute_virtual_interfaces = nics("eth1,eth2");
        c.outbound_ip_ranges_include = ranges("*");
    }),
    ("ipnets", |c| c.outbound_ip_ranges_include = ranges("10.0.0.0/8")),
    ("ipnets-with-kube-virt-interfaces", |c| {
        c.reroute_virtual_interfaces = nics("eth1,eth2");
        c.outbound_ip_ranges_include = ranges("10.0.0.0/8");
    }),
    ("inbound-ports-include", |c| c.inbound_ports = only("32000,31000")),
    ("inbound-ports-wildcard", |c| c.inbound_ports = only("*")),
    ("inbound-ports-tproxy", |c| {
        c.inbound_ports = only("32000,31000");
        c.interception_mode = InterceptionMode::Tproxy;
    }),
    ("inbound-ports-wildcard-tproxy", |c| {
        c.inbound_ports = only("*");
        c.interception_mode = InterceptionMode::Tproxy;
    }),
    ("dns-uid-gid", |c| {
        c.redirect_dns = true;
        c.dns_servers_v4 = vec!["127.0.0.53".into()];
        c.dns_servers_v6 = vec!["::127.0.0.53".into()];
        c.proxy_gids = ids("1,2");
        c.proxy_uids = ids("3,4");
        c.enable_ipv6 = true;
    }),
    ("ipv6-dns-uid-gid", |c| {
        c.enable_ipv6 = true;
        c.redirect_dns = true;
        c.proxy_gids = ids("1,2");
        c.proxy_uids = ids("3,4");
    }),
    ("outbound-owner-groups", |c| c.owner_groups = OwnerGroups::from_env("java,202", "").unwrap()),
    ("outbound-owner-groups-exclude", |c| c.owner_groups = OwnerGroups::from_env("*", "888,ftp").unwrap()),
    ("ipv6-dns-outbound-owner-groups", |c| {
        c.enable_ipv6 = true;
        c.redirect_dns = true;
        c.owner_groups = OwnerGroups::from_env("java,202", "").unwrap();
    }),
    ("ipv6-dns-outbound-owner-groups-exclude", |c| {
        c.enable_ipv6 = true;
        c.redirect_dns = true;
        c.owner_groups = OwnerGroups::from_env("*", "888,ftp").unwrap();
    }),
    ("outbound-ports-include", |c| c.outbound_ports_include = ports("32000,31000")),
    ("loopback-outbound-iprange", |c| {
        c.outbound_ip_ranges_include = ranges("127.1.2.3/32");
        c.redirect_dns = true;
        c.dns_servers_v4 = vec!["127.0.0.53".into()];
        c.enable_ipv6 = false;
        c.proxy_gids = ids("1,2");
        c.proxy_uids = ids("3,4");
    }),
    ("basic-exclude-nic", |c| c.exclude_interfaces = nics("not-istio-nic")),
    ("drop-invalid", |c| c.drop_invalid = true),
    ("host-ipv4-loopback-cidr", |c| {
        c.host_ipv4_loopback_cidr = weir_iptables::config::parse_loopback_cidr("127.0.0.1/8").unwrap()
    }),
];

/// The nft-only regression case (istio/istio#58135).
const NFT_ONLY: &[Case] = &[("inbound-ports-empty-tproxy", |c| {
    c.inbound_ports = only("");
    c.interception_mode = InterceptionMode::Tproxy;
})];

fn golden(dir: &str, name: &str) -> String {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata").join(dir).join(format!("{name}.golden"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Compares trimmed texts line by line; the message shows the first difference.
fn compare(kind: &str, name: &str, want: &str, got: &str) -> Option<String> {
    let want: Vec<&str> = want.trim().lines().collect();
    let got: Vec<&str> = got.trim().lines().collect();
    if want == got {
        return None;
    }
    let at = want.iter().zip(&got).position(|(a, b)| a != b).unwrap_or(want.len().min(got.len()));
    Some(format!(
        "{kind} {name}: first difference at line {}: want {:?}, got {:?} ({} vs {} lines)",
        at + 1,
        want.get(at),
        got.get(at),
        want.len(),
        got.len()
    ))
}

fn config(mutate: fn(&mut CaptureConfig)) -> CaptureConfig {
    let mut cfg = CaptureConfig::default();
    mutate(&mut cfg);
    cfg
}

#[test]
fn iptables_transcripts_match_istios_27_goldens() {
    assert_eq!(CASES.len(), 27);
    let failures: Vec<String> = CASES
        .iter()
        .filter_map(|(name, mutate)| {
            let mut rec = Recorder::default();
            program_iptables(&config(*mutate), &RunOptions::default(), &mut rec).unwrap();
            compare("iptables", name, &golden("iptables-capture", name), &rec.transcript())
        })
        .collect();
    assert!(failures.is_empty(), "{} of 27 differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn nft_transactions_match_istios_28_goldens() {
    let all: Vec<&Case> = CASES.iter().chain(NFT_ONLY).collect();
    assert_eq!(all.len(), 28);
    let failures: Vec<String> = all
        .iter()
        .filter_map(|(name, mutate)| {
            let mut rec = NftRecorder::default();
            program_nft(&config(*mutate), &RunOptions::default(), &mut rec).unwrap();
            compare("nft", name, &golden("nftables-capture", name), &rec.transactions.concat())
        })
        .collect();
    assert!(failures.is_empty(), "{} of 28 differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn every_golden_file_has_a_case() {
    for (dir, count) in [("iptables-capture", 27), ("nftables-capture", 28)] {
        let files = std::fs::read_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata").join(dir))
            .unwrap()
            .count();
        assert_eq!(files, count, "{dir}");
    }
}
