//! The `istio-iptables` command line: every flag Istio's has, bound to the same
//! environment variables (flag > additional env > env > default, as pflag binding
//! gives), turned into a validated [`CaptureConfig`] and [`RunOptions`].

use std::{net::IpAddr, time::Duration};

use clap::Args;

pub use super::duration::parse_go_duration;

use super::{
    config::{
        CaptureConfig, Cidr, ConfigError, InboundPorts, InterceptionMode, IpRanges, IptablesBackend,
        OwnerGroups, PortSpec, RunOptions, parse_exclude_ranges, parse_interfaces, parse_loopback_cidr,
        parse_ports, split,
    },
    detect::{self, HostFacts},
};

/// Istio's istio-iptables flags. Values stay text until [`IstioIptablesArgs::resolve`].
#[derive(Debug, Clone, Default, Args)]
pub struct IstioIptablesArgs {
    /// Envoy port to which all outbound TCP traffic is redirected.
    #[arg(short = 'p', long = "envoy-port")]
    pub envoy_port: Option<String>,
    /// Port to which all inbound TCP traffic is redirected. [env: INBOUND_CAPTURE_PORT]
    #[arg(short = 'z', long = "inbound-capture-port")]
    pub inbound_capture_port: Option<String>,
    /// Istio tunnel port for inbound TCP traffic. [env: INBOUND_TUNNEL_PORT]
    #[arg(short = 'e', long = "inbound-tunnel-port")]
    pub inbound_tunnel_port: Option<String>,
    /// UIDs whose traffic is not redirected (the proxy's). [env: PROXY_UID]
    #[arg(short = 'u', long = "proxy-uid")]
    pub proxy_uid: Option<String>,
    /// GIDs whose traffic is not redirected (default: as -u). [env: PROXY_GID]
    #[arg(short = 'g', long = "proxy-gid")]
    pub proxy_gid: Option<String>,
    /// Inbound interception mode: REDIRECT or TPROXY. [env: ISTIO_INBOUND_INTERCEPTION_MODE]
    #[arg(short = 'm', long = "istio-inbound-interception-mode")]
    pub mode: Option<String>,
    /// Inbound ports to redirect ("*" for all, empty for none). [env: ISTIO_INBOUND_PORTS]
    #[arg(short = 'b', long = "istio-inbound-ports", allow_hyphen_values = true)]
    pub inbound_ports: Option<String>,
    /// Inbound ports excluded when -b is "*". [env: ISTIO_LOCAL_EXCLUDE_PORTS]
    #[arg(short = 'd', long = "istio-local-exclude-ports")]
    pub inbound_ports_exclude: Option<String>,
    /// Interfaces whose traffic is never captured. [env: ISTIO_EXCLUDE_INTERFACES]
    #[arg(short = 'c', long = "istio-exclude-interfaces")]
    pub exclude_interfaces: Option<String>,
    /// Outbound CIDRs to redirect ("*" for all, empty for none). [env: ISTIO_SERVICE_CIDR]
    #[arg(short = 'i', long = "istio-service-cidr")]
    pub outbound_include: Option<String>,
    /// Outbound CIDRs excluded from redirection. [env: ISTIO_SERVICE_EXCLUDE_CIDR]
    #[arg(short = 'x', long = "istio-service-exclude-cidr")]
    pub outbound_exclude: Option<String>,
    /// Outbound ports always redirected. [env: ISTIO_OUTBOUND_PORTS]
    #[arg(short = 'q', long = "istio-outbound-ports")]
    pub outbound_ports_include: Option<String>,
    /// Outbound ports never redirected. [env: ISTIO_LOCAL_OUTBOUND_PORTS_EXCLUDE]
    #[arg(short = 'o', long = "istio-local-outbound-ports-exclude")]
    pub outbound_ports_exclude: Option<String>,
    /// Virtual interfaces whose inbound traffic (from VMs) is treated as outbound. [env: KUBE_VIRT_INTERFACES]
    #[arg(short = 'k', long = "kube-virt-interfaces")]
    pub kube_virt_interfaces: Option<String>,
    /// TPROXY mark. [env: ISTIO_INBOUND_TPROXY_MARK]
    #[arg(short = 't', long = "istio-inbound-tproxy-mark")]
    pub tproxy_mark: Option<String>,
    /// TPROXY route table. [env: ISTIO_INBOUND_TPROXY_ROUTE_TABLE]
    #[arg(short = 'r', long = "istio-inbound-tproxy-route-table")]
    pub tproxy_route_table: Option<String>,
    /// Print what would run; change nothing. [env: DRY_RUN]
    #[arg(short = 'n', long = "dry-run", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub dry_run: Option<String>,
    /// Validation probe listen port. [env: IPTABLES_PROBE_PORT]
    #[arg(long = "iptables-probe-port")]
    pub probe_port: Option<String>,
    /// Validation probe timeout (Go duration, e.g. 5s). [env: PROBE_TIMEOUT]
    #[arg(long = "probe-timeout")]
    pub probe_timeout: Option<String>,
    /// Do not apply rules (use with --run-validation). [env: SKIP_RULE_APPLY]
    #[arg(long = "skip-rule-apply", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub skip_rule_apply: Option<String>,
    /// Check that capture works; exit 126 if not. [env: RUN_VALIDATION]
    #[arg(long = "run-validation", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub run_validation: Option<String>,
    /// Redirect DNS to the agent (15053). [env: REDIRECT_DNS, ISTIO_META_DNS_CAPTURE]
    #[arg(long = "redirect-dns", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub redirect_dns: Option<String>,
    /// Drop conntrack-INVALID packets. [env: DROP_INVALID, INVALID_DROP]
    #[arg(long = "drop-invalid", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub drop_invalid: Option<String>,
    /// Enable IPv4/IPv6 redirects for dual-stack. [env: DUAL_STACK, ISTIO_DUAL_STACK]
    #[arg(long = "dual-stack", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub dual_stack: Option<String>,
    /// Capture all DNS on port 53, not only to resolv.conf servers. [env: CAPTURE_ALL_DNS]
    #[arg(long = "capture-all-dns", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub capture_all_dns: Option<String>,
    /// Network namespace (path) to program. [env: NETWORK_NAMESPACE]
    #[arg(long = "network-namespace")]
    pub network_namespace: Option<String>,
    /// Run as a CNI plugin (pod-scoped xtables lock). [env: CNI_MODE]
    #[arg(long = "cni-mode", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub cni_mode: Option<String>,
    /// Repair drifted rules instead of failing. [env: RECONCILE]
    #[arg(long = "reconcile", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub reconcile: Option<String>,
    /// Remove every Istio chain, rule, table and route; apply nothing. [env: CLEANUP_ONLY]
    #[arg(long = "cleanup-only", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub cleanup_only: Option<String>,
    /// Apply even if the rules appear to be in place. [env: FORCE_APPLY]
    #[arg(long = "force-apply", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub force_apply: Option<String>,
    /// Use native nftables instead of iptables. [env: NATIVE_NFTABLES]
    #[arg(long = "native-nftables", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub native_nftables: Option<String>,
    /// Force the iptables flavour: legacy or nft. [env: FORCE_IPTABLES_BINARY]
    #[arg(long = "force-iptables-binary")]
    pub force_iptables_binary: Option<String>,
    /// Istio's log level flag (e.g. default:info); accepted for compatibility.
    #[arg(long = "log_output_level")]
    pub log_output_level: Option<String>,
    /// Istio's JSON log flag; accepted for compatibility.
    #[arg(long = "log_as_json", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub log_as_json: Option<String>,
    #[arg(long = "log_caller", hide = true)]
    pub log_caller: Option<String>,
    #[arg(long = "log_stacktrace_level", hide = true)]
    pub log_stacktrace_level: Option<String>,
    #[arg(long = "log_target", hide = true)]
    pub log_target: Option<String>,
}

/// One value's sources, in precedence order.
struct Source<'a> {
    flag: &'a Option<String>,
    names: &'static str,
    envs: &'static [&'static str],
}

/// A flag's [`Source`]: the flag's value, its names for errors, its variables.
macro_rules! src {
    ($flag:expr, $names:literal, [$($env:literal),*]) => {
        Source { flag: &$flag, names: $names, envs: &[$($env),*] }
    };
}

/// The environment a resolve reads, and each kind of value read from a [`Source`]
/// (flag > additional env > env > default).
struct Env<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Env<'_> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name)
    }

    /// `(input, value)`: the names (and variable) the value came from, and the value.
    fn value(&self, s: Source<'_>) -> Option<(String, String)> {
        // pflag binding: the primary env, then the additional env, then the flag.
        if let Some(v) = s.flag {
            return Some((s.names.to_string(), v.clone()));
        }
        s.envs.iter().rev().find_map(|e| self.get(e).map(|v| (format!("{} (env {e})", s.names), v)))
    }

    fn text(&self, s: Source<'_>, default: &str) -> (String, String) {
        let names = s.names;
        self.value(s).unwrap_or_else(|| (names.to_string(), default.to_string()))
    }

    fn boolean(&self, s: Source<'_>) -> Result<bool, ConfigError> {
        match self.value(s) {
            None => Ok(false),
            Some((input, v)) => parse_bool(&v).ok_or_else(|| ConfigError::new(input, v, "true or false")),
        }
    }

    fn port(&self, s: Source<'_>, default: &str) -> Result<u16, ConfigError> {
        let (input, v) = self.text(s, default);
        v.trim()
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| ConfigError::new(input, v, "a port 1-65535"))
    }

    fn number(&self, s: Source<'_>, default: &str) -> Result<u32, ConfigError> {
        let (input, v) = self.text(s, default);
        v.trim().parse::<u32>().map_err(|_| ConfigError::new(input, v, "a non-negative integer"))
    }

    fn interfaces(&self, s: Source<'_>) -> Result<Vec<String>, ConfigError> {
        let (input, v) = self.text(s, "");
        parse_interfaces(&input, &v)
    }
}

/// The run options read from flags before the pod's facts are detected.
struct Tooling {
    force_iptables_binary: Option<IptablesBackend>,
    probe_port: u16,
    probe_timeout: Duration,
    network_namespace: Option<std::path::PathBuf>,
}

/// What is detected rather than given: the pod's address and whether IPv6 is in use
/// (from its addresses), and the DNS servers (from resolv.conf, when DNS is captured
/// but not all of it).
struct Detected {
    host_ip: IpAddr,
    enable_ipv6: bool,
    dns_servers_v4: Vec<String>,
    dns_servers_v6: Vec<String>,
}

impl IstioIptablesArgs {
    /// Resolves flags, the environment (`env`) and detected facts into a validated
    /// configuration. Every error names the flag or variable and the expected form.
    pub fn resolve(
        &self,
        env: &dyn Fn(&str) -> Option<String>,
        facts: &dyn HostFacts,
    ) -> Result<(CaptureConfig, RunOptions), ConfigError> {
        // Values are read in this order, so of several bad ones the first is reported.
        let env = Env(env);
        let (proxy_port, inbound_capture_port, inbound_tunnel_port) = self.listener_ports(&env)?;
        let (proxy_uids, proxy_gids) = self.proxy_ids(&env, facts)?;
        let (interception_mode, tproxy_mark, tproxy_route_table) = self.interception(&env)?;
        let (inbound_ports, inbound_ports_exclude) = self.inbound_ports(&env)?;
        let (outbound_ports_include, outbound_ports_exclude) = self.outbound_ports(&env)?;
        let (outbound_ip_ranges_include, outbound_ip_ranges_exclude) = self.outbound_ranges(&env)?;
        let exclude_interfaces = env.interfaces(src!(
            self.exclude_interfaces,
            "-c/--istio-exclude-interfaces",
            ["ISTIO_EXCLUDE_INTERFACES"]
        ))?;
        let reroute_virtual_interfaces = env.interfaces(src!(
            self.kube_virt_interfaces,
            "-k/--kube-virt-interfaces",
            ["KUBE_VIRT_INTERFACES"]
        ))?;

        let redirect_dns = env.boolean(src!(
            self.redirect_dns,
            "--redirect-dns",
            ["REDIRECT_DNS", "ISTIO_META_DNS_CAPTURE"]
        ))?;
        let capture_all_dns =
            env.boolean(src!(self.capture_all_dns, "--capture-all-dns", ["CAPTURE_ALL_DNS"]))?;
        let drop_invalid =
            env.boolean(src!(self.drop_invalid, "--drop-invalid", ["DROP_INVALID", "INVALID_DROP"]))?;
        let dual_stack =
            env.boolean(src!(self.dual_stack, "--dual-stack", ["DUAL_STACK", "ISTIO_DUAL_STACK"]))?;

        let owner_groups = OwnerGroups::from_env(
            &env.get("ISTIO_OUTBOUND_OWNER_GROUPS").unwrap_or_else(|| "*".into()),
            &env.get("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE").unwrap_or_default(),
        )?;
        let host_ipv4_loopback_cidr = parse_loopback_cidr(
            &env.get("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR").unwrap_or_else(|| "127.0.0.1/32".into()),
        )?;
        let tooling = self.tooling(&env)?;
        let detected = detect_facts(facts, dual_stack, redirect_dns && !capture_all_dns)?;

        let cfg = CaptureConfig {
            proxy_port,
            inbound_capture_port,
            inbound_tunnel_port,
            proxy_uids,
            proxy_gids,
            interception_mode,
            tproxy_mark,
            tproxy_route_table,
            inbound_ports,
            inbound_ports_exclude,
            owner_groups,
            outbound_ports_include,
            outbound_ports_exclude,
            outbound_ip_ranges_include,
            outbound_ip_ranges_exclude,
            reroute_virtual_interfaces,
            exclude_interfaces,
            redirect_dns,
            capture_all_dns,
            drop_invalid,
            enable_ipv6: detected.enable_ipv6,
            dns_servers_v4: detected.dns_servers_v4,
            dns_servers_v6: detected.dns_servers_v6,
            host_ipv4_loopback_cidr,
        };
        let opts = self.run_options(&env, tooling, detected.host_ip)?;
        Ok((cfg, opts))
    }

    /// Envoy's outbound port, its inbound capture port and the inbound tunnel port.
    fn listener_ports(&self, env: &Env<'_>) -> Result<(u16, u16, u16), ConfigError> {
        let proxy_port = env.port(src!(self.envoy_port, "-p/--envoy-port", []), "15001")?;
        let inbound_capture_port = env.port(
            src!(self.inbound_capture_port, "-z/--inbound-capture-port", ["INBOUND_CAPTURE_PORT"]),
            "15006",
        )?;
        let inbound_tunnel_port = env.port(
            src!(self.inbound_tunnel_port, "-e/--inbound-tunnel-port", ["INBOUND_TUNNEL_PORT"]),
            "15008",
        )?;
        Ok((proxy_port, inbound_capture_port, inbound_tunnel_port))
    }

    /// The proxy's uids (default: ENVOY_USER's, else 1337) and gids (default: as the uids).
    fn proxy_ids(
        &self,
        env: &Env<'_>,
        facts: &dyn HostFacts,
    ) -> Result<(Vec<String>, Vec<String>), ConfigError> {
        let (uid_input, uids) = env.text(src!(self.proxy_uid, "-u/--proxy-uid", ["PROXY_UID"]), "");
        let uids = if uids.is_empty() {
            // Default to ENVOY_USER's uid, else 1337.
            let user = env.get("ENVOY_USER").unwrap_or_else(|| "istio-proxy".into());
            facts.user_id(&user).map(|u| u.to_string()).unwrap_or_else(|| "1337".into())
        } else {
            uids
        };
        // Names stay names: the kernel's tools resolve them when the rules go in
        // (`apply::check_names` names an unknown one first), so a dry run is the
        // same on any host.
        let proxy_uids: Vec<String> = split(&uids).into_iter().map(String::from).collect();
        if proxy_uids.is_empty() {
            return Err(ConfigError::new(uid_input, uids, "a uid or user name (comma-separated)"));
        }
        let (_, gids) = env.text(src!(self.proxy_gid, "-g/--proxy-gid", ["PROXY_GID"]), "");
        let gids = if gids.is_empty() { uids.clone() } else { gids };
        let proxy_gids: Vec<String> = split(&gids).into_iter().map(String::from).collect();
        Ok((proxy_uids, proxy_gids))
    }

    /// The inbound interception mode, and TPROXY's mark and route table.
    fn interception(&self, env: &Env<'_>) -> Result<(InterceptionMode, u32, u32), ConfigError> {
        let (input, mode) = env.text(
            src!(self.mode, "-m/--istio-inbound-interception-mode", ["ISTIO_INBOUND_INTERCEPTION_MODE"]),
            "",
        );
        let interception_mode = InterceptionMode::parse(&input, &mode)?;
        let tproxy_mark = env.number(
            src!(self.tproxy_mark, "-t/--istio-inbound-tproxy-mark", ["ISTIO_INBOUND_TPROXY_MARK"]),
            "1337",
        )?;
        let tproxy_route_table = env.number(
            src!(
                self.tproxy_route_table,
                "-r/--istio-inbound-tproxy-route-table",
                ["ISTIO_INBOUND_TPROXY_ROUTE_TABLE"]
            ),
            "133",
        )?;
        Ok((interception_mode, tproxy_mark, tproxy_route_table))
    }

    /// The inbound ports captured, and those excluded when all are.
    fn inbound_ports(&self, env: &Env<'_>) -> Result<(InboundPorts, Vec<PortSpec>), ConfigError> {
        let (input, v) =
            env.text(src!(self.inbound_ports, "-b/--istio-inbound-ports", ["ISTIO_INBOUND_PORTS"]), "");
        let inbound_ports = InboundPorts::parse(&input, &v)?;
        let (input, v) = env.text(
            src!(self.inbound_ports_exclude, "-d/--istio-local-exclude-ports", ["ISTIO_LOCAL_EXCLUDE_PORTS"]),
            "",
        );
        let inbound_ports_exclude = parse_ports(&input, &v)?;
        Ok((inbound_ports, inbound_ports_exclude))
    }

    /// The outbound ports always captured, and those never captured.
    fn outbound_ports(&self, env: &Env<'_>) -> Result<(Vec<PortSpec>, Vec<PortSpec>), ConfigError> {
        let (input, v) = env.text(
            src!(self.outbound_ports_include, "-q/--istio-outbound-ports", ["ISTIO_OUTBOUND_PORTS"]),
            "",
        );
        let outbound_ports_include = parse_ports(&input, &v)?;
        let (input, v) = env.text(
            src!(
                self.outbound_ports_exclude,
                "-o/--istio-local-outbound-ports-exclude",
                ["ISTIO_LOCAL_OUTBOUND_PORTS_EXCLUDE"]
            ),
            "",
        );
        let outbound_ports_exclude = parse_ports(&input, &v)?;
        Ok((outbound_ports_include, outbound_ports_exclude))
    }

    /// The outbound address ranges captured, and those excluded.
    fn outbound_ranges(&self, env: &Env<'_>) -> Result<(IpRanges, Vec<Cidr>), ConfigError> {
        let (input, v) =
            env.text(src!(self.outbound_include, "-i/--istio-service-cidr", ["ISTIO_SERVICE_CIDR"]), "");
        let outbound_ip_ranges_include = IpRanges::parse(&input, &v)?;
        let (input, v) = env.text(
            src!(self.outbound_exclude, "-x/--istio-service-exclude-cidr", ["ISTIO_SERVICE_EXCLUDE_CIDR"]),
            "",
        );
        let outbound_ip_ranges_exclude = parse_exclude_ranges(&input, &v)?;
        Ok((outbound_ip_ranges_include, outbound_ip_ranges_exclude))
    }

    /// The iptables flavour, the validation probe's port and timeout, and the network
    /// namespace to program.
    fn tooling(&self, env: &Env<'_>) -> Result<Tooling, ConfigError> {
        let (input, v) = env
            .text(src!(self.force_iptables_binary, "--force-iptables-binary", ["FORCE_IPTABLES_BINARY"]), "");
        let force_iptables_binary = IptablesBackend::parse(&input, &v)?;
        let (input, v) =
            env.text(src!(self.probe_port, "--iptables-probe-port", ["IPTABLES_PROBE_PORT"]), "15002");
        let probe_port = v.trim().parse::<u16>().map_err(|_| ConfigError::new(input, v, "a port 0-65535"))?;
        let (input, v) = env.text(src!(self.probe_timeout, "--probe-timeout", ["PROBE_TIMEOUT"]), "5s");
        let probe_timeout = parse_go_duration(&v)
            .ok_or_else(|| ConfigError::new(input, v, "a duration such as 5s or 500ms"))?;
        let (_, netns) =
            env.text(src!(self.network_namespace, "--network-namespace", ["NETWORK_NAMESPACE"]), "");
        let network_namespace = (!netns.is_empty()).then(|| std::path::PathBuf::from(netns));
        Ok(Tooling { force_iptables_binary, probe_port, probe_timeout, network_namespace })
    }

    /// How the rules are run: the switches, then what [`Self::tooling`] read and the
    /// detected address.
    fn run_options(
        &self,
        env: &Env<'_>,
        tooling: Tooling,
        host_ip: IpAddr,
    ) -> Result<RunOptions, ConfigError> {
        let Tooling { force_iptables_binary, probe_port, probe_timeout, network_namespace } = tooling;
        Ok(RunOptions {
            dry_run: env.boolean(src!(self.dry_run, "-n/--dry-run", ["DRY_RUN"]))?,
            reconcile: env.boolean(src!(self.reconcile, "--reconcile", ["RECONCILE"]))?,
            cleanup_only: env.boolean(src!(self.cleanup_only, "--cleanup-only", ["CLEANUP_ONLY"]))?,
            force_apply: env.boolean(src!(self.force_apply, "--force-apply", ["FORCE_APPLY"]))?,
            native_nftables: env.boolean(src!(
                self.native_nftables,
                "--native-nftables",
                ["NATIVE_NFTABLES"]
            ))?,
            force_iptables_binary,
            run_validation: env.boolean(src!(self.run_validation, "--run-validation", ["RUN_VALIDATION"]))?,
            skip_rule_apply: env.boolean(src!(
                self.skip_rule_apply,
                "--skip-rule-apply",
                ["SKIP_RULE_APPLY"]
            ))?,
            probe_port,
            probe_timeout,
            network_namespace,
            cni_mode: env.boolean(src!(self.cni_mode, "--cni-mode", ["CNI_MODE"]))?,
            host_ip: Some(host_ip),
            dry_run_file: env.get("DRY_RUN_FILE_PATH").filter(|p| !p.is_empty()).map(Into::into),
        })
    }

    /// The process-wide log level from `--log_output_level` (`default:<level>`).
    pub fn log_level(&self) -> Option<String> {
        let spec = self.log_output_level.as_deref()?;
        spec.split(',').find_map(|scope| {
            let (name, level) = scope.split_once(':')?;
            (name == "default" || name == "all").then(|| level.to_string())
        })
    }
}

/// Detected, as Istio does: IPv6 from the pod's addresses, DNS servers from
/// resolv.conf (read only when `read_resolv_conf`).
fn detect_facts(
    facts: &dyn HostFacts,
    dual_stack: bool,
    read_resolv_conf: bool,
) -> Result<Detected, ConfigError> {
    let addresses = facts
        .addresses()
        .map_err(|e| ConfigError::new("local interface addresses", e.to_string(), "readable addresses"))?;
    let (host_ip, enable_ipv6) = detect::local_ip(&addresses, dual_stack).ok_or_else(|| {
        ConfigError::new(
            "local interface addresses",
            format!("{addresses:?}"),
            "at least one non-loopback, non-link-local address",
        )
    })?;
    let (dns_servers_v4, dns_servers_v6) = if read_resolv_conf {
        let text = facts.resolv_conf().map_err(|e| {
            ConfigError::new(
                "/etc/resolv.conf",
                e.to_string(),
                "a readable resolv.conf (needed by --redirect-dns)",
            )
        })?;
        detect::resolv_conf_servers(&text)
    } else {
        (Vec::new(), Vec::new())
    };
    Ok(Detected { host_ip, enable_ipv6, dns_servers_v4, dns_servers_v6 })
}

/// pflag's boolean forms.
pub fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, net::IpAddr};

    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    #[command(args_override_self = true)]
    struct Cli {
        #[command(flatten)]
        args: IstioIptablesArgs,
    }

    struct Facts {
        addrs: Vec<&'static str>,
        resolv: &'static str,
    }

    impl HostFacts for Facts {
        fn addresses(&self) -> std::io::Result<Vec<IpAddr>> {
            Ok(self.addrs.iter().map(|a| a.parse().unwrap()).collect())
        }
        fn resolv_conf(&self) -> std::io::Result<String> {
            Ok(self.resolv.to_string())
        }
        fn user_id(&self, name: &str) -> Option<u32> {
            (name == "istio-proxy").then_some(1337)
        }
        fn group_exists(&self, name: &str) -> bool {
            name == "java"
        }
    }

    fn pod() -> Facts {
        Facts {
            addrs: vec!["127.0.0.1", "10.66.0.10", "::1", "fd00:66::a"],
            resolv: "nameserver 10.96.0.10\n",
        }
    }

    fn resolve(argv: &[&str], env: &[(&str, &str)]) -> Result<(CaptureConfig, RunOptions), ConfigError> {
        let cli = Cli::try_parse_from(std::iter::once("istio-iptables").chain(argv.iter().copied())).unwrap();
        let env: HashMap<String, String> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        cli.args.resolve(&|k| env.get(k).cloned(), &pod())
    }

    #[test]
    fn the_injectors_command_line() {
        let (cfg, opts) = resolve(
            &[
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
                "--log_output_level=default:info",
            ],
            &[],
        )
        .unwrap();
        assert_eq!(cfg.proxy_uids, vec!["1337"]);
        assert_eq!(cfg.proxy_gids, vec!["1337"], "gid defaults to the uid");
        assert_eq!(cfg.outbound_ip_ranges_include, IpRanges::All);
        assert!(cfg.outbound_ip_ranges_exclude.is_empty());
        assert_eq!(cfg.inbound_ports, InboundPorts::All);
        assert_eq!(cfg.inbound_ports_exclude.len(), 3);
        assert!(!cfg.enable_ipv6, "the first address is IPv4");
        assert!(!opts.dry_run);
    }

    #[test]
    fn flags_beat_env_and_additional_env_beats_primary() {
        let (cfg, _) = resolve(&["-z", "16006"], &[("INBOUND_CAPTURE_PORT", "17006")]).unwrap();
        assert_eq!(cfg.inbound_capture_port, 16006);
        let (cfg, _) = resolve(&[], &[("INBOUND_CAPTURE_PORT", "17006")]).unwrap();
        assert_eq!(cfg.inbound_capture_port, 17006);
        let (cfg, _) =
            resolve(&[], &[("REDIRECT_DNS", "false"), ("ISTIO_META_DNS_CAPTURE", "true")]).unwrap();
        assert!(cfg.redirect_dns);
        assert_eq!(cfg.dns_servers_v4, vec!["10.96.0.10"], "servers read from resolv.conf");
        let (cfg, _) = resolve(&["--redirect-dns=false"], &[("ISTIO_META_DNS_CAPTURE", "true")]).unwrap();
        assert!(!cfg.redirect_dns);
        let (cfg, _) = resolve(&[], &[("INVALID_DROP", "true")]).unwrap();
        assert!(cfg.drop_invalid);
    }

    #[test]
    fn detection_follows_istio() {
        let (cfg, _) = resolve(&["--dual-stack"], &[]).unwrap();
        assert!(cfg.enable_ipv6);
        let (_, opts) = resolve(&[], &[]).unwrap();
        assert_eq!(opts.host_ip, Some("10.66.0.10".parse().unwrap()));
        let (cfg, _) = resolve(&[], &[("ENVOY_USER", "nobody-here")]).unwrap();
        assert_eq!(cfg.proxy_uids, vec!["1337"]);
    }

    #[test]
    fn a_flag_given_twice_takes_the_last_value_as_pflag_does() {
        let (_, opts) = resolve(&["-n", "--dry-run"], &[]).unwrap();
        assert!(opts.dry_run);
        let (cfg, _) = resolve(&["-p", "15001", "-p", "16001"], &[]).unwrap();
        assert_eq!(cfg.proxy_port, 16001);
    }

    #[test]
    fn names_are_kept_for_the_kernel_and_checked_only_when_applying() {
        let env = [("ISTIO_OUTBOUND_OWNER_GROUPS", "nosuchgroup,202")];
        let (cfg, _) = resolve(&["-u", "not-a-user", "-g", "wheel-less"], &env).unwrap();
        assert_eq!(cfg.proxy_uids, ["not-a-user"]);
        assert_eq!(cfg.proxy_gids, ["wheel-less"]);
        let e = crate::apply::check_names(&cfg, &pod()).unwrap_err().to_string();
        assert!(e.contains("-u/--proxy-uid names user \"not-a-user\""), "{e}");
        let (cfg, _) = resolve(&["-u", "istio-proxy", "-g", "java"], &env).unwrap();
        let e = crate::apply::check_names(&cfg, &pod()).unwrap_err().to_string();
        assert!(e.contains("ISTIO_OUTBOUND_OWNER_GROUPS") && e.contains("nosuchgroup"), "{e}");
        let (cfg, _) =
            resolve(&["-u", "istio-proxy", "-g", "java"], &[("ISTIO_OUTBOUND_OWNER_GROUPS", "java,202")])
                .unwrap();
        crate::apply::check_names(&cfg, &pod()).unwrap();
    }

    #[test]
    fn bad_input_names_the_flag_and_the_form() {
        type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
        let cases: &[Case<'_>] = &[
            (
                &["-m", "MAGIC"],
                &[],
                "invalid -m/--istio-inbound-interception-mode: \"MAGIC\": REDIRECT or TPROXY",
            ),
            (&["-i", "10.0.0.0"], &[], "invalid -i/--istio-service-cidr: \"10.0.0.0\""),
            (&["-x", "*"], &[], "invalid -x/--istio-service-exclude-cidr: \"*\""),
            (&["-b", "80,http"], &[], "invalid -b/--istio-inbound-ports: \"http\""),
            (&["-d", "99999"], &[], "invalid -d/--istio-local-exclude-ports"),
            (&["-p", "0"], &[], "invalid -p/--envoy-port"),
            (&["-t", "x"], &[], "invalid -t/--istio-inbound-tproxy-mark"),
            (&["--force-iptables-binary", "iptables"], &[], "legacy or nft"),
            (&["--probe-timeout", "soon"], &[], "invalid --probe-timeout"),
            (
                &["-c", "eth0,eth1\" accept #"],
                &[],
                "invalid -c/--istio-exclude-interfaces: \"eth1\\\" accept #\": interface names",
            ),
            (&["-c", "eth0;"], &[], "invalid -c/--istio-exclude-interfaces: \"eth0;\""),
            (&["-k", "veth{"], &[], "invalid -k/--kube-virt-interfaces: \"veth{\""),
            (&["-k", "eth1\n-A OUTPUT"], &[], "invalid -k/--kube-virt-interfaces"),
            (
                &[],
                &[("ISTIO_EXCLUDE_INTERFACES", "eth0 -d 10.0.0.50")],
                "invalid -c/--istio-exclude-interfaces (env ISTIO_EXCLUDE_INTERFACES): \"eth0 -d 10.0.0.50\"",
            ),
            (
                &[],
                &[("KUBE_VIRT_INTERFACES", "a23456789012345x")],
                "invalid -k/--kube-virt-interfaces (env KUBE_VIRT_INTERFACES)",
            ),
            (
                &[],
                &[("REDIRECT_DNS", "yes")],
                "invalid --redirect-dns (env REDIRECT_DNS): \"yes\": true or false",
            ),
            (
                &[],
                &[("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR", "10.0.0.1/32")],
                "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR",
            ),
        ];
        for (argv, env, want) in cases {
            let e = resolve(argv, env).unwrap_err().to_string();
            assert!(e.contains(want), "{argv:?} {env:?}: {e}");
        }
    }

    #[test]
    fn log_level_from_istio_flag() {
        let cli = Cli::try_parse_from(["x", "--log_output_level=default:debug,ads:info"]).unwrap();
        assert_eq!(cli.args.log_level().as_deref(), Some("debug"));
    }
}
