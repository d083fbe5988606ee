//! `weir capture explain --inbound`: what capture does with a connection arriving at
//! the pod. eBPF: the tc classifier's own test (`InboundConfig::captures`) over the
//! pod's registered inbound config, then whether Envoy's inbound port has a listener
//! (the classifier assigns only to a listening socket; without one the connection is
//! refused: capture fails closed). Netfilter: the nat rules walked from
//! PREROUTING; TPROXY inbound capture (mangle rules) is refused by name.

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
};

use anyhow::{Context as _, bail};
use weir_ebpf_common::inbound::{InboundConfig, mode};
use weir_iptables::explain::Connection;

use super::{Answer, ExplainArgs, nat_rules, pod_record, ports, walked};
use crate::capture::ebpf::{inbound, netns::in_netns, pod};

/// The interface the connection arrives on: `--interface`, else `fallback`, else eth0.
fn interface(args: &ExplainArgs, fallback: Option<&str>) -> String {
    args.interface.clone().or(fallback.map(String::from)).unwrap_or_else(|| "eth0".into())
}

pub(super) fn ebpf(pod: &str, args: &ExplainArgs) -> anyhow::Result<Answer> {
    let record = pod_record(pod)?;
    let (set_dir, pin_dir, cookie) = (pod::maps_dir(&record), record.pin_dir(), record.netns_cookie);
    let cfg = inbound::pod_config(&set_dir, &pin_dir, cookie)
        .with_context(|| format!("read the inbound config of capture {pod}"))?;
    let Some(cfg) = cfg else {
        return Ok(Answer {
            backend: "eBPF",
            outcome: "not captured".into(),
            why: format!("capture {pod} has no inbound capture (-b '' or no classifier on its interface)"),
            evidence: Vec::new(),
        });
    };
    let counters = inbound::pod_counters(&set_dir, &pin_dir, cookie).and_then(Result::ok);
    let counted = |name: &str| match &counters {
        Some(c) => format!("counted as {name} (this pod so far: {})", c.get(name)),
        None => format!("counted as {name}"),
    };
    let (dst, port) = (args.destination.ip(), args.destination.port());
    if let Some(why) = not_captured_why(&cfg, port) {
        return Ok(Answer {
            backend: "eBPF",
            outcome: format!("not captured: it reaches {} directly", args.destination),
            why,
            evidence: vec![counted("inbound_not_captured")],
        });
    }
    let netns = record.netns.as_deref().with_context(|| format!("capture {pod} records no namespace"))?;
    let listening = listens(netns, dst, cfg.capture_port)
        .with_context(|| format!("read the listening sockets of {}", netns.display()))?;
    Ok(if listening {
        Answer {
            backend: "eBPF",
            outcome: format!(
                "assigned to Envoy's inbound listener on port {}; the connection keeps {} as its local address",
                cfg.capture_port, args.destination
            ),
            why: captured_why(&cfg, port),
            evidence: vec![counted("inbound_assigned")],
        }
    } else {
        Answer {
            backend: "eBPF",
            outcome: format!(
                "refused: the SYN is dropped, so it never reaches {} around the sidecar (the client retries, and connects once Envoy listens)",
                args.destination
            ),
            why: format!(
                "{}, but nothing in the pod listens on port {} yet (Envoy not started, restarting or gone)",
                captured_why(&cfg, port),
                cfg.capture_port
            ),
            evidence: vec![counted("inbound_no_listener")],
        }
    })
}

/// Why the classifier leaves `port` alone, in Istio's flag terms (`None`: captured).
fn not_captured_why(cfg: &InboundConfig, port: u16) -> Option<String> {
    if cfg.captures(port) {
        return None;
    }
    Some(if port == cfg.tunnel_port {
        format!("port {port} is the HBONE tunnel port, never captured (Istio's first ISTIO_INBOUND rule)")
    } else if port == cfg.capture_port {
        format!("port {port} is Envoy's inbound port itself")
    } else if cfg.mode == mode::ALL {
        format!("port {port} is an excluded inbound port (-d {})", ports(&cfg.exclude_ports))
    } else if cfg.mode == mode::ONLY {
        format!("port {port} is not an included inbound port (-b {})", ports(&cfg.include_ports))
    } else {
        "inbound capture is off (-b '')".into()
    })
}

fn captured_why(cfg: &InboundConfig, port: u16) -> String {
    if cfg.mode == mode::ALL {
        let excluded = ports(&cfg.exclude_ports);
        let excluded = if excluded.is_empty() { String::new() } else { format!(" except -d {excluded}") };
        format!("inbound capture takes every port (-b '*'){excluded}, and {port} is one of them")
    } else {
        format!("port {port} is an included inbound port (-b {})", ports(&cfg.include_ports))
    }
}

/// Whether a TCP socket in the namespace at `netns` listens on `port` at `dst` or at
/// the wildcard address: what the classifier's socket lookup would find.
fn listens(netns: &Path, dst: IpAddr, port: u16) -> std::io::Result<bool> {
    let (v4, v6) = in_netns(netns, || {
        Ok((
            std::fs::read_to_string("/proc/thread-self/net/tcp")?,
            std::fs::read_to_string("/proc/thread-self/net/tcp6").unwrap_or_default(),
        ))
    })?;
    Ok(listeners(&v4).chain(listeners(&v6)).any(|l| {
        l.port() == port && (l.ip().is_unspecified() || l.ip() == dst || mapped(l.ip()) == Some(dst))
    }))
}

fn mapped(ip: IpAddr) -> Option<IpAddr> {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4),
        IpAddr::V4(_) => None,
    }
}

/// The listening sockets of a `/proc/net/tcp` or `tcp6` table (state 0A).
fn listeners(table: &str) -> impl Iterator<Item = SocketAddr> + '_ {
    table.lines().skip(1).filter_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.get(3) != Some(&"0A") {
            return None;
        }
        let (addr, port) = f.get(1)?.split_once(':')?;
        let port = u16::from_str_radix(port, 16).ok()?;
        // The kernel prints each 32-bit word of the address as a host-order number.
        let words: Vec<u32> = (0..addr.len() / 8)
            .map(|i| u32::from_str_radix(addr.get(i * 8..i * 8 + 8)?, 16).ok())
            .collect::<Option<_>>()?;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let ip = match bytes.len() {
            4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
            16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
            _ => return None,
        };
        Some(SocketAddr::new(ip, port))
    })
}

pub(super) fn netfilter(netns: &Path, args: &ExplainArgs) -> anyhow::Result<Answer> {
    let dst = args.destination.ip();
    let (backend, rules) = nat_rules(netns, dst.is_ipv6())?;
    if backend == "nftables" {
        let mangle = in_netns(netns, || {
            std::process::Command::new("nft").args(["list", "table", "inet", "istio-proxy-mangle"]).output()
        })
        .with_context(|| format!("read the mangle table of {}", netns.display()))?;
        let text = String::from_utf8_lossy(&mangle.stdout);
        if mangle.status.success() && text.contains("tproxy") {
            bail!(
                "inbound capture in {} is TPROXY (Weir's istio-proxy-mangle table), which is not walked; its nat rules do not decide inbound connections",
                netns.display()
            );
        }
    }
    let conn = Connection {
        dst,
        dst_port: args.destination.port(),
        udp: false,
        uid: 0,
        gid: 0,
        src: args.src,
        through_lo: false,
        in_iface: Some(interface(args, None)),
    };
    let e = match backend {
        "nftables" => weir_iptables::explain::explain_nft_inbound(&rules, &conn),
        _ => weir_iptables::explain::explain_inbound(&rules, &conn),
    }
    .with_context(|| format!("the {backend} rules of {}", netns.display()))?;
    let mut answer = walked(backend, &e, args, "prerouting");
    if let weir_iptables::explain::Outcome::Redirect(to) = e.outcome
        && !listens(netns, dst, to).unwrap_or(true)
    {
        answer
            .evidence
            .push(format!("nothing in the pod listens on port {to} yet: the connection is refused"));
    }
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_sockets_are_read_from_proc_tables() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 00000000:3A9E 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1337        0 1 1\n   1: 0100007F:3A99 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1337        0 2 1\n   2: 0500000A:1F90 0700000A:C350 01 00000000:00000000 00:00000000 00000000  1000        0 3 1\n";
        let got: Vec<SocketAddr> = listeners(v4).collect();
        assert_eq!(got, ["0.0.0.0:15006".parse().unwrap(), "127.0.0.1:15001".parse().unwrap()]);
        let v6 = "  sl  local_address                         remote_address                        st\n   0: 00000000000000000000000001000000:3A9E 00000000000000000000000000000000:0000 0A\n";
        assert_eq!(listeners(v6).collect::<Vec<_>>(), ["[::1]:15006".parse::<SocketAddr>().unwrap()]);
    }

    #[test]
    fn each_port_left_alone_is_named_by_its_flag() {
        let mut cfg = InboundConfig {
            capture_port: 15006,
            tunnel_port: 15008,
            mode: mode::ALL,
            flags: 0,
            include_ports: [0; weir_ebpf_common::inbound::MAX_PORTS],
            exclude_ports: [0; weir_ebpf_common::inbound::MAX_PORTS],
            probe_src4: [0; 4],
            probe_src6: [0; 16],
        };
        cfg.exclude_ports[0] = 15021;
        assert!(not_captured_why(&cfg, 8080).is_none());
        assert!(captured_why(&cfg, 8080).contains("except -d 15021"));
        assert!(not_captured_why(&cfg, 15021).unwrap().contains("-d 15021"));
        assert!(not_captured_why(&cfg, 15008).unwrap().contains("tunnel"));
        assert!(not_captured_why(&cfg, 15006).unwrap().contains("inbound port itself"));
        cfg.mode = mode::ONLY;
        cfg.include_ports[0] = 9080;
        assert!(not_captured_why(&cfg, 8080).unwrap().contains("-b 9080"));
        assert!(captured_why(&cfg, 9080).contains("-b 9080"));
    }
}
