//! Which of Istio's nat rules a connection meets, walked as the kernel walks them for
//! its first packet, for `weir capture explain`: from the nat output hook for one the
//! pod makes, from the nat prerouting hook for one arriving at the pod (REDIRECT
//! inbound capture; TPROXY's mangle rules are refused by name). The rules: the `nat`
//! table of an `iptables-save` (or `ip6tables-save`), or
//! the native nftables table (`nft list table inet istio-proxy-nat`, or the `add rule`
//! lines Weir renders). Pure: the caller reads the rules from the pod's namespace and
//! says how the packet leaves (loopback or not). It understands the matches and targets
//! Istio's rules use; a rule with anything else is an error naming it, never a guess.

//!
//! One job a module: `model` (the connection, the answer, the rules), `save` and
//! `nft` (each kind of rules read into chains) and `walk` (the walk itself).

mod model;
mod nft;
mod save;
mod walk;

pub use model::{Connection, ExplainError, Explanation, Outcome};
pub use walk::{explain, explain_inbound, explain_nft, explain_nft_inbound};

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::{
        inputs::{detect::HostFacts, flags::IstioIptablesArgs},
        iptables::render,
    };
    use clap::Parser;

    #[derive(Parser)]
    #[command(args_override_self = true)]
    struct Cli {
        #[command(flatten)]
        args: IstioIptablesArgs,
    }

    struct Pod;

    impl HostFacts for Pod {
        fn addresses(&self) -> std::io::Result<Vec<IpAddr>> {
            Ok(vec!["127.0.0.1".parse().unwrap(), "10.0.0.5".parse().unwrap()])
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

    /// The injector's IPv4 rules (plus `extra` flags) as restore input.
    fn injector_save(extra: &[&str]) -> String {
        let mut argv = vec![
            "istio-iptables",
            "-p",
            "15001",
            "-z",
            "15006",
            "-u",
            "1337",
            "-m",
            "REDIRECT",
            "-i",
            "*",
            "-x",
            "",
            "-b",
            "*",
            "-d",
            "15090,15021,15020",
        ];
        argv.extend(extra);
        let cli = Cli::try_parse_from(argv).unwrap();
        let (cfg, _) = cli.args.resolve(&|_| None, &Pod).unwrap();
        render::restore(&crate::iptables::plan::plan(&cfg).v4)
    }

    fn app(dst: &str, port: u16) -> Connection {
        let dst: IpAddr = dst.parse().unwrap();
        Connection {
            dst,
            dst_port: port,
            udp: false,
            uid: 1000,
            gid: 1000,
            src: None,
            through_lo: dst.is_loopback(),
            in_iface: None,
        }
    }

    /// A new connection from a peer to the pod's `port`, arriving on eth0.
    fn peer(port: u16) -> Connection {
        Connection {
            in_iface: Some("eth0".into()),
            src: Some("10.0.0.7".parse().unwrap()),
            uid: 0,
            gid: 0,
            ..app("10.0.0.5", port)
        }
    }

    #[test]
    fn inbound_connections_are_walked_from_prerouting() {
        let save = injector_save(&[]);
        let e = explain_inbound(&save, &peer(8080)).unwrap();
        assert_eq!(e.outcome, Outcome::Redirect(15006), "{e:?}");
        assert_eq!(
            e.jumps,
            ["-A PREROUTING -p tcp -j ISTIO_INBOUND", "-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT"]
        );
        assert_eq!(e.decided_by.as_deref(), Some("-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006"));
        let e = explain_inbound(&save, &peer(15021)).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured);
        assert_eq!(e.decided_by.as_deref(), Some("-A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN"));
        let e = explain_inbound(&save, &peer(15008)).unwrap();
        assert_eq!(e.decided_by.as_deref(), Some("-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN"));
        // An excluded interface (-c) is named by its rule; others still captured. Weir's
        // flags take names only, as Istio's injector does; rules another tool made may
        // use iptables' wildcard, and explain reads them too.
        let save = injector_save(&["-c", "vethx"]).replace(" vethx ", " veth+ ");
        let on = |iface: &str| Connection { in_iface: Some(iface.into()), ..peer(8080) };
        let e = explain_inbound(&save, &on("veth7")).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured, "{save}");
        assert!(e.decided_by.as_deref().is_some_and(|r| r.contains("-i veth+")), "{e:?}");
        assert_eq!(explain_inbound(&save, &on("eth0")).unwrap().outcome, Outcome::Redirect(15006));
        // No inbound capture at all: nothing in PREROUTING decides.
        let none = explain_inbound(&injector_save(&["-b", ""]), &peer(8080)).unwrap();
        assert_eq!((none.outcome, none.decided_by), (Outcome::NotCaptured, None));
    }

    #[test]
    fn tproxy_inbound_capture_is_refused_by_its_rule() {
        let save = injector_save(&["-m", "TPROXY"]);
        let err = explain_inbound(&save, &peer(8080)).unwrap_err();
        assert!(matches!(err, ExplainError::Tproxy { .. }), "{err}");
        assert!(err.to_string().contains("TPROXY"), "{err}");
    }

    #[test]
    fn the_injectors_rules_send_apps_to_envoy_and_leave_envoy_alone() {
        let save = injector_save(&[]);
        let e = explain(&save, &app("10.0.0.9", 80)).unwrap();
        assert_eq!(e.outcome, Outcome::Redirect(15001), "{e:?}");
        assert_eq!(e.jumps, ["-A OUTPUT -j ISTIO_OUTPUT", "-A ISTIO_OUTPUT -j ISTIO_REDIRECT"]);
        let proxy = Connection { uid: 1337, gid: 1337, ..app("10.0.0.9", 80) };
        let e = explain(&save, &proxy).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured);
        assert_eq!(e.decided_by.as_deref(), Some("-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN"));
        let e = explain(&save, &app("127.0.0.1", 8080)).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured, "{e:?}");
        // Envoy calling its own pod through lo goes to the inbound side.
        let own = Connection { uid: 1337, gid: 1337, through_lo: true, ..app("10.0.0.5", 8080) };
        assert_eq!(explain(&save, &own).unwrap().outcome, Outcome::Redirect(15006));
        // Envoy's inbound passthrough, bound to 127.0.0.6.
        let passthrough =
            Connection { uid: 1337, gid: 1337, src: Some("127.0.0.6".parse().unwrap()), ..own.clone() };
        let e = explain(&save, &passthrough).unwrap();
        assert_eq!(e.decided_by.as_deref(), Some("-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN"), "{e:?}");
    }

    #[test]
    fn excluded_ports_and_cidrs_are_named_by_their_rule() {
        let save = injector_save(&["-o", "3306", "-x", "10.96.0.0/12"]);
        let e = explain(&save, &app("10.0.0.9", 3306)).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured);
        assert!(e.decided_by.as_deref().unwrap().contains("3306"), "{e:?}");
        let e = explain(&save, &app("10.96.0.10", 443)).unwrap();
        assert_eq!(e.outcome, Outcome::NotCaptured);
        assert!(e.decided_by.as_deref().unwrap().contains("10.96.0.0/12"), "{e:?}");
    }

    #[test]
    fn a_live_native_nftables_table_is_walked_too() {
        // `nft list table inet istio-proxy-nat` in a namespace after `weir
        // istio-iptables ... -x 10.96.0.0/12 -o 9090 -q 3306 --redirect-dns
        // --native-nftables` (pod address 10.0.0.5, DNS server 10.255.255.53).
        let table = include_str!("../testdata/explain/nft-list-injector.txt");
        let e = explain_nft(table, &app("10.1.2.3", 80)).unwrap();
        assert_eq!(e.outcome, Outcome::Redirect(15001), "{e:?}");
        assert_eq!(
            e.jumps,
            [
                "counter packets 0 bytes 0 jump istio-output",
                "counter packets 0 bytes 0 jump istio-output-dns",
                "counter packets 0 bytes 0 jump istio-redirect"
            ]
        );
        let e = explain_nft(table, &app("10.96.1.1", 443)).unwrap();
        assert_eq!(e.decided_by.as_deref(), Some("ip daddr 10.96.0.0/12 counter packets 0 bytes 0 return"));
        let e = explain_nft(table, &app("10.1.2.3", 9090)).unwrap();
        assert_eq!(e.decided_by.as_deref(), Some("tcp dport 9090 counter packets 0 bytes 0 return"));
        let proxy = Connection { uid: 1337, gid: 1337, ..app("10.1.2.3", 80) };
        assert_eq!(
            explain_nft(table, &proxy).unwrap().decided_by.as_deref(),
            Some("meta skuid 1337 counter packets 0 bytes 0 return")
        );
        let dns = explain_nft(table, &app("10.255.255.53", 53)).unwrap();
        assert_eq!(dns.outcome, Outcome::Redirect(15053));
        // IPv6 skips every `ip` rule: an app's connection is captured all the same.
        let v6 = explain_nft(table, &app("fd00::9", 80)).unwrap();
        assert_eq!(v6.outcome, Outcome::Redirect(15001));
        let own = Connection { uid: 1337, gid: 1337, through_lo: true, ..app("10.0.0.5", 8080) };
        assert_eq!(explain_nft(table, &own).unwrap().outcome, Outcome::Redirect(15006));
        // Truncated statements are errors, never a panic (found by the fuzz target).
        for cut in ["ip daddr", "ip daddr !=", "tcp dport", "meta skuid", "oifname !=", "tcp dport { 53"] {
            let table = format!(
                "add chain inet istio-proxy-nat output {{ type nat hook output ; }}\nadd rule inet istio-proxy-nat output {cut}\n"
            );
            assert!(
                matches!(explain_nft(&table, &app("10.1.2.3", 80)), Err(ExplainError::Malformed { .. })),
                "{cut}"
            );
        }
        let odd = "table inet istio-proxy-nat {\n chain output {\n type nat hook output priority -100; policy accept;\n fib daddr type local counter return\n }\n}\n";
        assert!(explain_nft(odd, &app("10.1.2.3", 80)).unwrap_err().to_string().contains("statement fib"));
    }

    #[test]
    fn rules_it_does_not_understand_are_refused_by_name() {
        let save =
            "*nat\n-A OUTPUT -m statistic --probability 0.5 -j DNAT --to-destination 1.2.3.4\nCOMMIT\n";
        let err = explain(save, &app("10.0.0.9", 80)).unwrap_err();
        assert!(err.to_string().contains("option --probability"), "{err}");
        assert_eq!(explain("*filter\nCOMMIT\n", &app("10.0.0.9", 80)).unwrap_err(), ExplainError::NoNatTable);
        // Positions out of range and odd lines are read, not trusted.
        let save =
            "*nat\n-I OUTPUT 0 -p tcp -j REDIRECT --to-ports 15001\n-I OUTPUT 99 -j RETURN\n-A OUTPUT -j\n";
        assert!(matches!(explain(save, &app("10.0.0.9", 80)), Err(ExplainError::Malformed { .. })));
        let save = "*nat\n-I OUTPUT 0 -p tcp -j REDIRECT --to-ports 15001\n-I OUTPUT 99 -j RETURN\n";
        assert_eq!(explain(save, &app("10.0.0.9", 80)).unwrap().outcome, Outcome::Redirect(15001));
        let save = "*nat\n-A OUTPUT -j ISTIO_NOWHERE\nCOMMIT\n";
        assert!(matches!(explain(save, &app("10.0.0.9", 80)), Err(ExplainError::NoChain { .. })));
    }
}
