//! iptables-compat with real traffic: `weir istio-iptables` programs a real pod
//! namespace (iptables-restore or one nft transaction), and TCP and DNS traffic from
//! real processes lands where Istio's rules send it. REDIRECT and TPROXY, iptables and
//! nftables, IPv4 and IPv6.

use std::net::SocketAddr;

use weir_tests::{
    Placement,
    capture::{
        CaptureScene, Family, ask, ask_placed, capture_state, captured, in_pod, istio_iptables, run_testkit,
        start_server,
    },
    require_root, test_name,
};

#[derive(Clone, Copy, PartialEq)]
enum Backend {
    Iptables,
    Nft,
}

fn common_args(mode: &str, exclude: SocketAddr, family: Family, backend: Backend) -> Vec<String> {
    let mut args: Vec<String> = [
        "-p",
        "15001",
        "-z",
        "15006",
        "-u",
        "1337",
        "-m",
        mode,
        "-i",
        "*",
        "-b",
        "*",
        "-d",
        "15090,15021,15020",
        "-o",
        "9090",
    ]
    .map(String::from)
    .to_vec();
    args.extend(["-x".into(), format!("{}/{}", exclude.ip(), family.host_bits())]);
    if family == Family::V6 {
        args.push("--dual-stack".into());
    }
    if backend == Backend::Nft {
        args.push("--native-nftables".into());
    }
    args
}

/// The behaviour matrix for one backend × mode × family.
fn capture_matrix(test: &str, backend: Backend, mode: &str, family: Family) {
    let tproxy = mode == "TPROXY";
    let s = CaptureScene::new(test, family, tproxy);
    let server = s.addr(&s.server, 8080);
    let args = common_args(mode, s.addr(&s.server2, 8080), family, backend);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = istio_iptables(&s.client, &args, None);
    assert!(out.status.success(), "istio-iptables failed: {}", String::from_utf8_lossy(&out.stderr));

    // An app (uid 1000) connecting out lands on 15001, which sees the real destination.
    let line = ask(&s.client, 1000, server);
    let (_, orig) = captured(&line).unwrap_or_else(|| panic!("outbound not captured: {line:?}"));
    assert_eq!(orig, server.to_string(), "SO_ORIGINAL_DST is the server");

    // The proxy's own uid reaches the server directly.
    assert!(ask(&s.client, 1337, server).starts_with("hello server "), "uid 1337 must bypass capture");
    // Excluded outbound port (-o 9090) and excluded CIDR (-x server2) are not captured.
    assert!(ask(&s.client, 1000, s.addr(&s.server, 9090)).starts_with("hello server "), "-o 9090");
    assert!(ask(&s.client, 1000, s.addr(&s.server2, 8080)).starts_with("hello server2 "), "-x server2");

    // Inbound to an app port lands on 15006 with the original destination intact.
    let app = s.addr(&s.client, 8080);
    let line = ask(&s.server, 0, app);
    let (local, orig) = captured(&line).unwrap_or_else(|| panic!("inbound not captured: {line:?}"));
    if tproxy {
        assert_eq!(local, app.to_string(), "TPROXY keeps the destination as the socket's local address");
    } else {
        assert_eq!(orig, app.to_string(), "REDIRECT records the original destination");
    }
    // Excluded inbound port (-d 15021) reaches the app's own listener.
    assert!(ask(&s.server, 0, s.addr(&s.client, 15021)).starts_with("hello app-15021 "), "-d 15021");
}

macro_rules! matrix {
    ($($name:ident: $backend:expr, $mode:literal, $family:expr;)*) => {$(
        #[test]
        fn $name() {
            require_root!();
            capture_matrix(&test_name!(), $backend, $mode, $family);
        }
    )*};
}

matrix! {
    iptables_redirect_ipv4: Backend::Iptables, "REDIRECT", Family::V4;
    iptables_redirect_ipv6: Backend::Iptables, "REDIRECT", Family::V6;
    iptables_tproxy_ipv4: Backend::Iptables, "TPROXY", Family::V4;
    iptables_tproxy_ipv6: Backend::Iptables, "TPROXY", Family::V6;
    nft_redirect_ipv4: Backend::Nft, "REDIRECT", Family::V4;
    nft_redirect_ipv6: Backend::Nft, "REDIRECT", Family::V6;
    nft_tproxy_ipv4: Backend::Nft, "TPROXY", Family::V4;
    nft_tproxy_ipv6: Backend::Nft, "TPROXY", Family::V6;
}

/// Native nftables with TPROXY and no inbound ports (`-b ''`, an empty
/// `includeInboundPorts`) goes in: Istio's failed on it until 1.29 (istio/istio#58135,
/// an insert into an empty chain). Outbound is captured, inbound is not.
#[test]
fn nft_tproxy_without_inbound_ports() {
    require_root!();
    let s = CaptureScene::new(&test_name!(), Family::V4, true);
    let args = ["-u", "1337", "-m", "TPROXY", "-i", "*", "-b", "", "--native-nftables"];
    let out = istio_iptables(&s.client, &args, None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        in_pod(&s.client, "nft", &["list", "table", "inet", "istio-proxy-mangle"]).contains("istio-inbound")
    );
    assert!(captured(&ask(&s.client, 1000, s.addr(&s.server, 8080))).is_some(), "outbound captured");
    assert!(ask(&s.server, 0, s.addr(&s.client, 8080)).starts_with("hello app "), "inbound left alone");
    let again = istio_iptables(&s.client, &args, None);
    assert!(
        again.status.success(),
        "a second run finds its rules: {}",
        String::from_utf8_lossy(&again.stderr)
    );
}

/// `-c eth0`: nothing through the excluded interface is captured, either way.
fn excluded_interface(test: &str, backend: Backend) {
    let s = CaptureScene::new(test, Family::V4, false);
    let mut args = vec!["-u", "1337", "-i", "*", "-b", "*", "-c", "eth0"];
    if backend == Backend::Nft {
        args.push("--native-nftables");
    }
    let out = istio_iptables(&s.client, &args, None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(ask(&s.client, 1000, s.addr(&s.server, 8080)).starts_with("hello server "));
    assert!(ask(&s.server, 0, s.addr(&s.client, 8080)).starts_with("hello app "));
    // Loopback is not excluded: a connect to a local non-loopback-range address via lo
    // is still subject to the rules (the app's own pod IP is reached over lo).
    assert!(!capture_state(&s.client).is_empty());
}

#[test]
fn iptables_excluded_interface() {
    require_root!();
    excluded_interface(&test_name!(), Backend::Iptables);
}

#[test]
fn nft_excluded_interface() {
    require_root!();
    excluded_interface(&test_name!(), Backend::Nft);
}

/// `--redirect-dns`: DNS to the resolv.conf server goes to the agent on 15053, and the
/// reply comes back from the server's address; the proxy's own queries go out.
fn dns_redirect(test: &str, backend: Backend) {
    let s = CaptureScene::new(test, Family::V4, false);
    let dns_server = SocketAddr::new(s.server.ipv4().into(), 53);
    let _upstream = start_server(&s.server, 0, &["dns-serve", &dns_server.to_string(), "9.9.9.9"]);
    let _agent = start_server(&s.client, 1337, &["dns-serve", "127.0.0.1:15053", "1.2.3.4"]);
    let dir = weir_tests::envoy::tempfile_dir::Dir::new("resolv").unwrap();
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(&resolv, format!("nameserver {}\nsearch ns.svc.cluster.local\n", s.server.ipv4()))
        .unwrap();
    let mut args = vec!["-u", "1337", "-i", "*", "--redirect-dns"];
    if backend == Backend::Nft {
        args.push("--native-nftables");
    }
    let out = istio_iptables(&s.client, &args, Some(&resolv));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let app = Placement { user: Some((1000, 1000)), resolv_conf: Some(&resolv), ..Placement::default() };
    let reply =
        run_testkit(&s.client, app, &["dns-query", &dns_server.to_string(), "echo.ns.svc.cluster.local"]);
    assert_eq!(
        reply,
        format!("answer 1.2.3.4 from {dns_server}"),
        "the agent answered, from the server's address"
    );
    let proxy = Placement { user: Some((1337, 1337)), ..Placement::default() };
    let reply =
        run_testkit(&s.client, proxy, &["dns-query", &dns_server.to_string(), "echo.ns.svc.cluster.local"]);
    assert_eq!(
        reply,
        format!("answer 9.9.9.9 from {dns_server}"),
        "the proxy's upstream query is not redirected"
    );
    // TCP to the server's other ports is still captured as usual.
    assert!(captured(&ask_placed(&s.client, app, s.addr(&s.server, 8080))).is_some());
}

#[test]
fn iptables_dns_redirect() {
    require_root!();
    dns_redirect(&test_name!(), Backend::Iptables);
}

#[test]
fn nft_dns_redirect() {
    require_root!();
    dns_redirect(&test_name!(), Backend::Nft);
}

#[test]
fn bad_input_is_named_and_applies_nothing() {
    require_root!();
    let s = CaptureScene::new(&test_name!(), Family::V4, false);
    for (args, want) in [
        (vec!["-m", "MAGIC"], "-m/--istio-inbound-interception-mode"),
        (vec!["-i", "10.0.0.0"], "-i/--istio-service-cidr"),
        (vec!["-x", "*"], "-x/--istio-service-exclude-cidr"),
        (vec!["-b", "80,http"], "-b/--istio-inbound-ports"),
        (vec!["-u", "no-such-user-here"], "-u/--proxy-uid"),
        (vec!["--force-iptables-binary", "iptables-magic"], "legacy or nft"),
    ] {
        let out = istio_iptables(&s.client, &args, None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    assert_eq!(capture_state(&s.client), "", "nothing was applied");
    // The pod is untouched: traffic flows directly.
    assert!(ask(&s.client, 1000, s.addr(&s.server, 8080)).starts_with("hello server "));
    assert!(in_pod(&s.client, "iptables-save", &[]).lines().all(|l| !l.contains("ISTIO")));
}

/// Interface names reach the rules' text verbatim (`-i <name>` in a restore line, a
/// bare word in an nft statement): one that is not a name is refused by the flag that
/// carried it, for both backends, before anything is applied.
#[test]
fn interface_names_cannot_carry_rule_text() {
    require_root!();
    let s = CaptureScene::new(&test_name!(), Family::V4, false);
    // A tab separates iptables-restore's words: this "name" adds `-s 1.2.3.4` to the
    // exclusion rule (the old check refused only spaces, slashes and long names).
    let injected = "lo\t-s\t1.2.3.4";
    let cases: &[(&[&str], &str)] = &[
        (&["-c", injected], "invalid -c/--istio-exclude-interfaces: \"lo\\t-s\\t1.2.3.4\": interface names"),
        (&["-c", "eth0;"], "invalid -c/--istio-exclude-interfaces: \"eth0;\""),
        (&["-c", "eth0#", "--native-nftables"], "invalid -c/--istio-exclude-interfaces: \"eth0#\""),
        (&["-c", "eth0\"", "--native-nftables"], "invalid -c/--istio-exclude-interfaces: \"eth0\\\"\""),
        (&["-k", "eth0{", "--native-nftables"], "invalid -k/--kube-virt-interfaces: \"eth0{\""),
        (&["-k", "net1,eth1\n-F"], "invalid -k/--kube-virt-interfaces: \"eth1\\n-F\""),
        (&["-k", ".."], "invalid -k/--kube-virt-interfaces: \"..\""),
    ];
    for (flags, want) in cases {
        let mut args = vec!["-p", "15001", "-z", "15006", "-u", "1337", "-i", "*", "-b", "*"];
        args.extend_from_slice(flags);
        let out = istio_iptables(&s.client, &args, None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {err}");
        assert!(err.contains(want), "{flags:?}: {err}");
        assert!(err.contains("a letter followed by letters, digits, '_', '.' or '-'"), "{err}");
        assert_eq!(capture_state(&s.client), "", "{flags:?}: nothing applied");
    }
    assert!(
        !in_pod(&s.client, "iptables-save", &[]).contains("1.2.3.4"),
        "no rule carries the injected match"
    );
    // Real names go in as they are.
    let out =
        istio_iptables(&s.client, &["-u", "1337", "-i", "*", "-c", "eth1,veth-a.1", "-k", "net1"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let nat = in_pod(&s.client, "iptables-save", &["-t", "nat"]);
    for rule in [
        "-A PREROUTING -i net1 -j RETURN",
        "-A PREROUTING -i eth1 -j RETURN",
        "-A OUTPUT -o veth-a.1 -j RETURN",
    ] {
        assert!(nat.contains(rule), "{rule}:\n{nat}");
    }
}

#[test]
fn dry_run_writes_istios_transcript_and_changes_nothing() {
    require_root!();
    let s = CaptureScene::new(&test_name!(), Family::V4, false);
    let dir = weir_tests::envoy::tempfile_dir::Dir::new("dry-run").unwrap();
    let file = dir.path().join("transcript");
    // The base configuration of Istio's golden cases, through the real command line.
    let args = [
        "-p", "15001", "-z", "15006", "-e", "15008", "-u", "1337", "-g", "1337", "-t", "1337", "-r", "133",
        "-n",
    ];
    let mut cmd = std::process::Command::new(weir_tests::tools::weir());
    cmd.arg("istio-iptables").args(args).env("DRY_RUN_FILE_PATH", &file).env("WEIR_LOG", "warn");
    cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let out = s.client.spawn(&mut cmd, 0).unwrap().into_inner().wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let golden = include_str!("../../iptables-compat/testdata/iptables-capture/empty.golden");
    assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), golden.trim());
    assert!(out.stdout.is_empty(), "with DRY_RUN_FILE_PATH the transcript goes to the file only");
    // Without the variable it goes to stdout.
    let out = istio_iptables(&s.client, &args, None);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), golden.trim());
    assert_eq!(capture_state(&s.client), "", "a dry run changes nothing");
}

#[test]
fn a_missing_iptables_binary_is_a_clear_error() {
    require_root!();
    let s = CaptureScene::new(&test_name!(), Family::V4, false);
    let mut cmd = std::process::Command::new(weir_tests::tools::weir());
    cmd.args(["istio-iptables", "-i", "*"]).env("PATH", "/nonexistent").env("WEIR_LOG", "warn");
    cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let out = s.client.spawn(&mut cmd, 0).unwrap().into_inner().wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no usable iptables binary"), "{err}");
    assert_eq!(capture_state(&s.client), "");
}
