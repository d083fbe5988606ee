//! `install-cni` (argv[0]): Istio's istio-cni container command line, so that Istio's
//! own chart runs Weir with only its image changed. Every setting has Istio's flag and
//! environment names (viper's: `--cni-conf-name` or `CNI_CONF_NAME`; the chart sets
//! them through the `istio-cni-config` ConfigMap) and Istio's default; the ambient
//! agent's are read as `weir cni ambient` reads them. Settings Weir does not implement
//! are refused at start, naming the setting, rather than silently ignored. The process
//! itself is [`crate::node::istio_cni`].

use std::{path::PathBuf, time::Duration};

use anyhow::Context as _;
use clap::{ArgAction, Parser};
use serde_json::json;

use super::cni::{PluginOptions, default_plugin_binary, file_mode, go_bool};
use crate::{
    node::{
        ambient::settings::AmbientSettings,
        cni::{
            install::{self, InstallSettings, KubeconfigSource},
            spec::NetConf,
        },
        istio_cni::{self, Parts, RepairPart},
    },
    support::privileges::{self, Capability},
};

/// Istio's `install-cni`: installs the CNI plugin, repairs pods that started before it,
/// and runs the ambient node agent, in one process.
#[derive(Debug, Parser)]
#[command(name = "install-cni", version = env!("WEIR_VERSION"), about, long_about = None)]
pub struct InstallCniCli {
    /// Istio's log levels (`info`, or `default:info,cni-agent:debug`).
    #[arg(long = "log_output_level")]
    pub log_output_level: Option<String>,
    /// Accepted: Weir's node logs are tracing's text.
    #[arg(long = "log_as_json")]
    pub log_as_json: bool,
    /// Where the node's CNI config dir is mounted.
    #[arg(long, env = "MOUNTED_CNI_NET_DIR", default_value = "/host/etc/cni/net.d")]
    pub mounted_cni_net_dir: PathBuf,
    /// The primary CNI config's file name (default: the one kubelet picks).
    #[arg(long, env = "CNI_CONF_NAME")]
    pub cni_conf_name: Option<String>,
    /// Where the node's CNI bin dir is mounted (Istio's fixed `/host/opt/cni/bin`).
    #[arg(long, env = "WEIR_HOST_CNI_BIN_DIR", default_value = "/host/opt/cni/bin", hide = true)]
    pub cni_bin_dir: PathBuf,
    /// Chain the plugin after the primary CNI (Istio's default). Standalone configs are
    /// not supported.
    #[arg(long, env = "CHAINED_CNI_PLUGIN", default_value = "true", value_parser = go_bool, action = ArgAction::Set)]
    pub chained_cni_plugin: bool,
    /// A CNI config template (standalone installs only): refused.
    #[arg(long, env = "CNI_NETWORK_CONFIG", default_value = "")]
    pub cni_network_config: String,
    #[arg(long, env = "CNI_NETWORK_CONFIG_FILE", default_value = "")]
    pub cni_network_config_file: String,
    /// Write the chained list to Istio's own file (a copy of the primary's list with the
    /// plugin last) instead of into the primary's (`ISTIO_OWNED_CNI_CONFIG`); needs
    /// `CNI_CONF_NAME`, as Istio's installer does.
    #[arg(long, env = "ISTIO_OWNED_CNI_CONFIG", default_value = "false", value_parser = go_bool, action = ArgAction::Set)]
    pub istio_owned_cni_config: bool,
    /// The Istio-owned file's name, read where Istio's agent reads it (viper's
    /// `istio-owned-cni-config-filename`); default `02-istio-cni.conflist`.
    #[arg(long, env = "ISTIO_OWNED_CNI_CONFIG_FILENAME", default_value = "")]
    pub istio_owned_cni_config_filename: String,
    /// What Istio's chart sets (`ISTIO_OWNED_CNI_CONF_FILENAME`) and Istio's agent does
    /// not read (a mismatch in Istio at 86c9f01): ignored the same way, with a warning,
    /// so that both agents write the same file and a swap finds it.
    #[arg(long, env = "ISTIO_OWNED_CNI_CONF_FILENAME", default_value = "", hide = true)]
    pub istio_owned_cni_conf_filename: String,
    /// The plugin's log level (written into its config).
    #[arg(long, env = "LOG_LEVEL", default_value = "warn")]
    pub log_level: String,
    /// The kubeconfig's file mode (`0600`).
    #[arg(long, env = "KUBECONFIG_MODE", default_value = "0600", value_parser = file_mode)]
    pub kubeconfig_mode: u32,
    /// Write the CNI config 0640 instead of 0600.
    #[arg(long, env = "CNI_CONF_GROUP_READ", default_value = "false", value_parser = go_bool, action = ArgAction::Set)]
    pub cni_conf_group_read: bool,
    /// Another CA for the plugin's kubeconfig: refused (the service account's is used).
    #[arg(long, env = "KUBE_CA_FILE", default_value = "")]
    pub kube_ca_file: String,
    #[arg(long, env = "SKIP_TLS_VERIFY", default_value = "false", value_parser = go_bool, action = ArgAction::Set)]
    pub skip_tls_verify: bool,
    /// Prometheus metrics port (0: none).
    #[arg(long, env = "MONITORING_PORT", default_value_t = istio_cni::MONITORING_PORT)]
    pub monitoring_port: u16,
    /// The node agent's run dir (kubeconfig, plugin event socket).
    #[arg(long, env = "CNI_AGENT_RUN_DIR", default_value = crate::node::cni::plugin::DEFAULT_RUN_DIR)]
    pub cni_agent_run_dir: PathBuf,
    #[command(flatten)]
    pub plugin: PluginOptions,
    /// Repair pods that started before the plugin.
    #[arg(long, env = "REPAIR_ENABLED", default_value = "true", value_parser = go_bool, action = ArgAction::Set)]
    pub repair_enabled: bool,
    #[arg(long, env = "REPAIR_REPAIR_PODS", default_value = "true", value_parser = go_bool, action = ArgAction::Set)]
    pub repair_repair_pods: bool,
    /// Delete broken pods instead: refused (Weir repairs in place).
    #[arg(long, env = "REPAIR_DELETE_PODS", default_value = "false", value_parser = go_bool, action = ArgAction::Set)]
    pub repair_delete_pods: bool,
    /// Label broken pods instead: refused (Weir repairs in place).
    #[arg(long, env = "REPAIR_LABEL_PODS", default_value = "false", value_parser = go_bool, action = ArgAction::Set)]
    pub repair_label_pods: bool,
    /// This node's name.
    #[arg(long, env = "REPAIR_NODE_NAME", default_value = "")]
    pub repair_node_name: String,
    /// The service account folder (token, ca.crt).
    #[arg(long, default_value = "/var/run/secrets/kubernetes.io/serviceaccount", hide = true)]
    pub service_account_dir: PathBuf,
    /// The node's network namespace, entered at start when `ALLOW_SWITCH_TO_HOST_NS`
    /// is true (Istio's `/host/proc/1/ns/net`).
    #[arg(long, env = "WEIR_HOST_NETNS", default_value = istio_cni::HOST_NETNS, hide = true)]
    pub host_netns: PathBuf,
    /// How often the chain and kubeconfig are checked.
    #[arg(long, default_value = "1s", hide = true, value_parser = super::cni::parse_duration)]
    pub interval: Duration,
}

/// A setting Weir refuses, and why.
fn refused(cli: &InstallCniCli) -> Option<String> {
    let why = if !cli.chained_cni_plugin {
        "CHAINED_CNI_PLUGIN=false: Weir installs only as a plugin chained after the primary CNI"
    } else if !cli.cni_network_config.is_empty() || !cli.cni_network_config_file.is_empty() {
        "CNI_NETWORK_CONFIG(_FILE): a config template is for standalone installs, which Weir does not do"
    } else if owned_config(cli).is_some() && cli.cni_conf_name.as_deref().unwrap_or_default().is_empty() {
        "ISTIO_OWNED_CNI_CONFIG=true needs CNI_CONF_NAME (the primary CNI's config file to copy), as Istio's installer does"
    } else if owned_config(cli).is_some_and(|n| !plain_config_name(&n)) {
        "ISTIO_OWNED_CNI_CONFIG_FILENAME: expected a file name in the CNI config directory ending in .conf or .conflist"
    } else if !cli.kube_ca_file.is_empty() || cli.skip_tls_verify {
        "KUBE_CA_FILE / SKIP_TLS_VERIFY: the plugin's kubeconfig uses the service account's CA"
    } else if cli.repair_delete_pods || cli.repair_label_pods {
        "REPAIR_DELETE_PODS / REPAIR_LABEL_PODS: Weir repairs pods in place (REPAIR_REPAIR_PODS)"
    } else {
        return None;
    };
    Some(why.to_string())
}

fn install_settings(cli: &InstallCniCli) -> anyhow::Result<InstallSettings> {
    let mut plugin = cli.plugin.fields()?;
    plugin.insert("plugin_log_level".into(), json!(cli.log_level));
    Ok(InstallSettings {
        net_dir: cli.mounted_cni_net_dir.clone(),
        bin_dir: cli.cni_bin_dir.clone(),
        conf_name: cli.cni_conf_name.clone().filter(|n| !n.is_empty()),
        run_dir: cli.cni_agent_run_dir.clone(),
        plugin,
        binary: default_plugin_binary(&std::env::current_exe().context("find this executable")?),
        kubeconfig: KubeconfigSource::ServiceAccount {
            host: std::env::var("KUBERNETES_SERVICE_HOST")
                .context("KUBERNETES_SERVICE_HOST is not set (not in a pod?)")?,
            port: std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into()),
            dir: cli.service_account_dir.clone(),
        },
        ebpf: None,
        plugin_type: install::ISTIO_PLUGIN_TYPE,
        config_mode: if cli.cni_conf_group_read {
            install::CONFIG_MODE_GROUP_READ
        } else {
            install::CONFIG_MODE
        },
        kubeconfig_mode: cli.kubeconfig_mode,
        owned_config: owned_config(cli),
    })
}

/// Istio's default name for its own CNI config file.
pub const OWNED_CONFIG_DEFAULT: &str = "02-istio-cni.conflist";

/// The Istio-owned config's file name, when `ISTIO_OWNED_CNI_CONFIG` is on and so is
/// ambient (Istio's `useIstioOwnedCNIConfig`: without ambient the plugin is chained
/// into the primary's file whatever the setting says).
fn owned_config(cli: &InstallCniCli) -> Option<String> {
    if !(cli.istio_owned_cni_config && cli.plugin.ambient_enabled) {
        return None;
    }
    let name = match cli.istio_owned_cni_config_filename.as_str() {
        "" => OWNED_CONFIG_DEFAULT.to_string(),
        name => name.to_string(),
    };
    let chart = cli.istio_owned_cni_conf_filename.as_str();
    if !chart.is_empty() && chart != name {
        tracing::warn!(
            ISTIO_OWNED_CNI_CONF_FILENAME = chart,
            file = %name,
            "the chart's ISTIO_OWNED_CNI_CONF_FILENAME is not what Istio's agent reads (ISTIO_OWNED_CNI_CONFIG_FILENAME): ignored, as Istio ignores it, so a swap between the two finds the same file"
        );
    }
    Some(name)
}

/// A bare file name (no folder, not `.` or `..`) a CNI runtime reads as a config.
fn plain_config_name(name: &str) -> bool {
    let path = std::path::Path::new(name);
    path.file_name().is_some_and(|f| f == name)
        && matches!(path.extension().and_then(|e| e.to_str()), Some("conf" | "conflist"))
}

fn repair_part(cli: &InstallCniCli, ambient: &AmbientSettings) -> anyhow::Result<Option<RepairPart>> {
    if !(cli.repair_enabled && cli.repair_repair_pods) {
        return Ok(None);
    }
    let node_name = match cli.repair_node_name.as_str() {
        "" => std::env::var("NODE_NAME").context("REPAIR_NODE_NAME (or NODE_NAME) is not set")?,
        name => name.to_string(),
    };
    let mut conf = cli.plugin.fields()?;
    conf.insert("cniVersion".into(), json!("1.0.0"));
    conf.insert("name".into(), json!("istio-cni-repair"));
    let conf = NetConf::parse(serde_json::Value::Object(conf).to_string().as_bytes())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(Some(RepairPart {
        conf,
        node_name,
        proc_dir: ambient.host_proc.clone(),
        kubeconfig: cli.cni_agent_run_dir.join(crate::node::cni::plugin::KUBECONFIG_NAME),
        interval: istio_cni::REPAIR_EVERY,
    }))
}

pub fn run(cli: InstallCniCli) -> anyhow::Result<()> {
    privileges::require(
        &[Capability::SysAdmin, Capability::NetAdmin, Capability::NetRaw, Capability::SysPtrace],
        "install-cni",
    )?;
    if let Some(why) = refused(&cli) {
        anyhow::bail!("{why}");
    }
    let env = |k: &str| std::env::var(k).ok();
    let ambient = AmbientSettings::from_settings(env).map_err(|e| anyhow::anyhow!("{e}"))?;
    let switch = env("ALLOW_SWITCH_TO_HOST_NS")
        .map(|v| go_bool(&v))
        .transpose()
        .map_err(|e| anyhow::anyhow!("ALLOW_SWITCH_TO_HOST_NS: {e}"))?;
    let parts = Parts {
        install: install_settings(&cli)?,
        install_interval: cli.interval,
        repair: repair_part(&cli, &ambient)?,
        ambient: None,
        stop_kube: None,
    };
    let args = super::cni::AmbientArgs {
        kubeconfig: None,
        service_account_dir: cli.service_account_dir.clone(),
        readiness_port: 0,
        readiness_address: std::net::Ipv4Addr::LOCALHOST.into(),
    };
    let parts = if ambient.enabled {
        let (agent, at_stop) = (super::cni::ambient_kube(&args)?, super::cni::ambient_kube(&args)?);
        Parts { ambient: Some((ambient, agent)), stop_kube: Some(at_stop), ..parts }
    } else {
        parts
    };
    tracing::info!(
        version = %crate::support::build_info::BUILD_INFO,
        ambient = parts.ambient.is_some(),
        repair = parts.repair.is_some(),
        "install-cni (Weir) starting"
    );
    // The ports are the pod's: bound before the process moves to the node's namespace.
    let ports = istio_cni::bind_ports(cli.monitoring_port)?;
    if switch == Some(true) && istio_cni::enter_host_netns(&cli.host_netns)? {
        tracing::info!(netns = %cli.host_netns.display(), "ALLOW_SWITCH_TO_HOST_NS: running in the node's network namespace");
    }
    let runtime = crate::support::runtime::workers("install-cni", 2)?;
    runtime.block_on(async {
        let stop = crate::support::shutdown::Shutdown::watch()?.token();
        istio_cni::run(parts, ports, stop).await.map_err(|e| anyhow::anyhow!("{}", crate::error_chain(&e)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(env: &[(&str, &str)]) -> InstallCniCli {
        // Flags, not the process's environment: tests run in parallel.
        let mut argv = vec!["install-cni".to_string(), "--log_output_level=info".into()];
        for (k, v) in env {
            argv.push(format!("--{}={v}", k.to_lowercase().replace('_', "-")));
        }
        InstallCniCli::try_parse_from(argv).unwrap()
    }

    #[test]
    fn istios_defaults_install_chained_with_repair() {
        let cli = parse(&[]);
        assert!(cli.chained_cni_plugin && cli.repair_enabled && cli.repair_repair_pods);
        assert_eq!(cli.monitoring_port, 15014);
        assert_eq!(cli.kubeconfig_mode, 0o600);
        assert_eq!(cli.mounted_cni_net_dir, PathBuf::from("/host/etc/cni/net.d"));
        assert_eq!(cli.cni_agent_run_dir, PathBuf::from("/var/run/istio-cni"));
        assert_eq!(cli.log_level, "warn");
        assert_eq!(refused(&cli), None);
    }

    /// Parsed with ambient on (a flag the chart sets through the environment).
    fn ambient(env: &[(&str, &str)]) -> InstallCniCli {
        let mut cli = parse(env);
        cli.plugin.ambient_enabled = true;
        cli
    }

    #[test]
    fn the_owned_config_is_istios_file_name_and_the_charts_name_is_ignored_as_istio_ignores_it() {
        assert_eq!(owned_config(&parse(&[])), None);
        assert_eq!(owned_config(&parse(&[("ISTIO_OWNED_CNI_CONFIG", "true")])), None, "only with ambient");
        let on = [("ISTIO_OWNED_CNI_CONFIG", "true"), ("CNI_CONF_NAME", "10-calico.conflist")];
        let cli = ambient(&on);
        assert_eq!(refused(&cli), None);
        assert_eq!(owned_config(&cli).as_deref(), Some("02-istio-cni.conflist"));
        let chart = ambient(&[on[0], on[1], ("ISTIO_OWNED_CNI_CONF_FILENAME", "05-mine.conflist")]);
        assert_eq!(owned_config(&chart).as_deref(), Some("02-istio-cni.conflist"));
        let agent = ambient(&[on[0], on[1], ("ISTIO_OWNED_CNI_CONFIG_FILENAME", "05-mine.conflist")]);
        assert_eq!(owned_config(&agent).as_deref(), Some("05-mine.conflist"));
        for bad in ["../02-x.conflist", "/etc/02-x.conflist", "02-x.json", ".."] {
            let cli = ambient(&[on[0], on[1], ("ISTIO_OWNED_CNI_CONFIG_FILENAME", bad)]);
            let why = refused(&cli).unwrap_or_else(|| panic!("{bad} accepted"));
            assert!(why.contains("ISTIO_OWNED_CNI_CONFIG_FILENAME"), "{why}");
        }
        let why = refused(&ambient(&[on[0]])).expect("no CNI_CONF_NAME: refused");
        assert!(why.contains("ISTIO_OWNED_CNI_CONFIG") && why.contains("CNI_CONF_NAME"), "{why}");
    }

    #[test]
    fn settings_weir_does_not_implement_are_refused_by_name() {
        for (setting, value) in [
            ("CHAINED_CNI_PLUGIN", "false"),
            ("REPAIR_DELETE_PODS", "true"),
            ("REPAIR_LABEL_PODS", "true"),
            ("SKIP_TLS_VERIFY", "true"),
        ] {
            let why = refused(&parse(&[(setting, value)])).unwrap_or_else(|| panic!("{setting} accepted"));
            assert!(why.contains(setting), "{why}");
        }
        let e = InstallCniCli::try_parse_from(["install-cni", "--kubeconfig-mode=0999"]).unwrap_err();
        assert!(e.to_string().contains("file mode"), "{e}");
    }
}
