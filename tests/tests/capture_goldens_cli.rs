//! Conformance through the command line: every one of Istio's 55 capture goldens (27
//! iptables transcripts, 28 nft transactions) is reproduced by `weir istio-iptables
//! ... --dry-run` run as an init container would run it — in a fresh network
//! namespace whose addresses make Istio's detection choose the golden's family (an
//! IPv4 pod, or an IPv6-only one) and with the golden's DNS servers in its own
//! resolv.conf. The flags and variables are the ones iptables-compat/testdata/
//! ISTIO-CONFORMANCE.md gives for each case; the pure planner's golden test is
//! `iptables-compat/tests/golden.rs`.

use std::{
    path::Path,
    process::{Command, Stdio},
};

use weir_agent::sandbox::{NetNs, Placement, unique_name};
use weir_tests::{cni::run_in, envoy::tempfile_dir::Dir, require_root, tools};

/// Istio's constructTestConfig on the command line.
const BASE: &[&str] =
    &["-p", "15001", "-z", "15006", "-e", "15008", "-u", "1337", "-g", "1337", "-t", "1337", "-r", "133"];

#[derive(Clone, Copy)]
enum Family {
    V4,
    V6,
}

/// (golden, extra flags, env, family, resolv.conf)
type Case =
    (&'static str, &'static [&'static str], &'static [(&'static str, &'static str)], Family, &'static str);

const DNS4: &str = "nameserver 127.0.0.53\n";

const CASES: &[Case] = &[
    ("ipv6-empty-inbound-ports", &[], &[], Family::V6, ""),
    (
        "ip-range",
        &["-x", "1.1.0.0/16", "-i", "9.9.0.0/16", "-n", "--redirect-dns", "-g", "1,2", "-u", "3,4"],
        &[],
        Family::V4,
        DNS4,
    ),
    (
        "tproxy",
        &[
            "-m",
            "TPROXY",
            "-b",
            "*",
            "-x",
            "1.1.0.0/16",
            "-i",
            "9.9.0.0/16",
            "-n",
            "--redirect-dns",
            "-c",
            "not-istio-nic",
        ],
        &[],
        Family::V6,
        DNS4,
    ),
    ("ipv6-inbound-ports", &["-b", "4000,5000"], &[], Family::V6, ""),
    ("ipv6-virt-interfaces", &["-b", "4000,5000", "-k", "eth0,eth1"], &[], Family::V6, ""),
    (
        "ipv6-ipnets",
        &[
            "-b",
            "4000,5000",
            "-d",
            "6000,7000,",
            "-k",
            "eth0,eth1",
            "-x",
            "2001:db8::/32",
            "-i",
            "2001:db8::/32",
        ],
        &[],
        Family::V6,
        "",
    ),
    (
        "ipv6-uid-gid",
        &[
            "-b",
            "4000,5000",
            "-d",
            "6000,7000",
            "-k",
            "eth0,eth1",
            "-g",
            "1,2",
            "-u",
            "3,4",
            "-x",
            "2001:db8::/32",
            "-i",
            "2001:db8::/32",
        ],
        &[],
        Family::V6,
        "",
    ),
    ("ipv6-outbound-ports", &["-q", "32000,31000"], &[], Family::V6, ""),
    ("empty", &[], &[], Family::V4, ""),
    ("kube-virt-interfaces", &["-k", "eth1,eth2", "-i", "*"], &[], Family::V4, ""),
    ("ipnets", &["-i", "10.0.0.0/8"], &[], Family::V4, ""),
    ("ipnets-with-kube-virt-interfaces", &["-k", "eth1,eth2", "-i", "10.0.0.0/8"], &[], Family::V4, ""),
    ("inbound-ports-include", &["-b", "32000,31000"], &[], Family::V4, ""),
    ("inbound-ports-wildcard", &["-b", "*"], &[], Family::V4, ""),
    ("inbound-ports-tproxy", &["-b", "32000,31000", "-m", "TPROXY"], &[], Family::V4, ""),
    ("inbound-ports-wildcard-tproxy", &["-b", "*", "-m", "TPROXY"], &[], Family::V4, ""),
    (
        "dns-uid-gid",
        &["--redirect-dns", "-g", "1,2", "-u", "3,4"],
        &[],
        Family::V6,
        "nameserver 127.0.0.53\nnameserver ::127.0.0.53\n",
    ),
    ("ipv6-dns-uid-gid", &["--redirect-dns", "-g", "1,2", "-u", "3,4"], &[], Family::V6, ""),
    ("outbound-owner-groups", &[], &[("ISTIO_OUTBOUND_OWNER_GROUPS", "java,202")], Family::V4, ""),
    (
        "outbound-owner-groups-exclude",
        &[],
        &[("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", "888,ftp")],
        Family::V4,
        "",
    ),
    (
        "ipv6-dns-outbound-owner-groups",
        &["--redirect-dns"],
        &[("ISTIO_OUTBOUND_OWNER_GROUPS", "java,202")],
        Family::V6,
        "",
    ),
    (
        "ipv6-dns-outbound-owner-groups-exclude",
        &["--redirect-dns"],
        &[("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", "888,ftp")],
        Family::V6,
        "",
    ),
    ("outbound-ports-include", &["-q", "32000,31000"], &[], Family::V4, ""),
    (
        "loopback-outbound-iprange",
        &["-i", "127.1.2.3/32", "-n", "--redirect-dns", "-g", "1,2", "-u", "3,4"],
        &[],
        Family::V4,
        DNS4,
    ),
    ("basic-exclude-nic", &["-c", "not-istio-nic"], &[], Family::V4, ""),
    ("drop-invalid", &["--drop-invalid"], &[], Family::V4, ""),
    ("host-ipv4-loopback-cidr", &[], &[("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR", "127.0.0.1/8")], Family::V4, ""),
    // nftables only.
    ("inbound-ports-empty-tproxy", &["-b", "", "-m", "TPROXY"], &[], Family::V4, ""),
];

/// A pod namespace whose `eth0` holds only an address of `family` (and `lo` its own).
fn pod(family: Family) -> NetNs {
    let ns = NetNs::create(&unique_name("golden")).unwrap();
    let addr = match family {
        Family::V4 => "10.66.0.5/24",
        Family::V6 => "fd00:66::5/64",
    };
    for args in [
        &["link", "add", "eth0", "type", "veth", "peer", "name", "peer0"][..],
        &["addr", "add", addr, "dev", "eth0"][..],
        &["link", "set", "eth0", "up"][..],
        &["link", "set", "lo", "up"][..],
    ] {
        run_in(&ns, None, Command::new("ip"), args);
    }
    ns
}

/// `weir istio-iptables <base> <flags> [--native-nftables] --dry-run` in `ns` with
/// `resolv` as its resolv.conf; the transcript it prints.
fn dry_run(ns: &NetNs, resolv: &Path, flags: &[&str], env: &[(&str, &str)], nft: bool) -> String {
    let mut cmd = tools::weir_command();
    cmd.arg("istio-iptables").args(BASE).args(flags);
    if nft {
        cmd.arg("--native-nftables");
    }
    cmd.arg("--dry-run").env_clear().env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").env("WEIR_LOG", "warn");
    cmd.envs(env.iter().copied()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let placement = Placement { netns: Some(ns), resolv_conf: Some(resolv), ..Placement::default() };
    let out = weir_agent::sandbox::process::spawn(&mut cmd, placement)
        .unwrap()
        .into_inner()
        .wait_with_output()
        .unwrap();
    assert!(out.status.success(), "{flags:?} {env:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn all_55_capture_goldens_pass_through_the_command_line() {
    require_root!();
    let testdata = tools::workspace().join("iptables-compat/testdata");
    let dir = Dir::new("golden-resolv").unwrap();
    let (v4, v6) = (pod(Family::V4), pod(Family::V6));
    let (mut checked, mut failures) = (0, Vec::new());
    for (i, (name, flags, env, family, resolv)) in CASES.iter().enumerate() {
        let resolv_path = dir.path().join(format!("resolv-{i}"));
        std::fs::write(&resolv_path, resolv).unwrap();
        let ns = match family {
            Family::V4 => &v4,
            Family::V6 => &v6,
        };
        for (backend, nft) in [("iptables-capture", false), ("nftables-capture", true)] {
            let golden = testdata.join(backend).join(format!("{name}.golden"));
            let Ok(want) = std::fs::read_to_string(&golden) else {
                assert!(!nft && *name == "inbound-ports-empty-tproxy", "{} is missing", golden.display());
                continue;
            };
            let got = dry_run(ns, &resolv_path, flags, env, nft);
            checked += 1;
            if got.trim() != want.trim() {
                failures.push(format!(
                    "{backend}/{name} ({flags:?} {env:?}):\nwant:\n{}\ngot:\n{}",
                    want.trim(),
                    got.trim()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{} of {checked} differ:\n\n{}", failures.len(), failures.join("\n\n"));
    assert_eq!(checked, 55, "every golden ran");
}
