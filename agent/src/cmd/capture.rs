//! `weir capture`: program capture for one pod with the best backend (or the one asked
//! for), and manage eBPF captures left pinned by init containers: status, clean, and
//! the programs' runtime log switch. eBPF capture of a pod uses the node's program
//! set (loaded once per node, `ebpf::set`) and refuses to register a namespace no
//! process of the pod's cgroup is in.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use weir_iptables::{detect::SystemFacts, flags::IstioIptablesArgs};

use crate::{
    capture::ebpf::{
        ancestors::{self, AncestorError, Probe},
        bpffs,
        capture::CapturePrograms,
        config::{EbpfOptions, PodCapture, own_addresses},
        detect::{self, Backend, CaptureMode},
        health,
        inbound::{self, InboundProgram},
        netns::{self, netns_cookie},
        pod::{self, PodTarget},
        record::{PinRecord, pin_dir},
        set,
    },
    support::privileges::{self, Capability},
};

#[derive(Debug, Args)]
pub struct CaptureArgs {
    #[command(subcommand)]
    pub command: CaptureCommand,
}

#[derive(Debug, Subcommand)]
pub enum CaptureCommand {
    /// Attach eBPF capture to a pod's cgroup; exits 0 once capture is live (pinned).
    Ebpf(Box<RunArgs>),
    /// Program capture with the best backend this machine offers (or --capture-mode).
    Apply(Box<ApplyArgs>),
    /// Print the backend this machine supports and why (with --cgroup: for that pod's
    /// cgroup, whose ancestors' programs may rule eBPF out).
    Detect {
        #[arg(long, value_enum, default_value_t = CaptureMode::Auto)]
        capture_mode: CaptureMode,
        /// The pod's cgroup v2 directory.
        #[arg(long)]
        cgroup: Option<PathBuf>,
    },
    /// What eBPF capture is attached where: pods, maps, counters, and whether each is
    /// still live (exits 1 when one is broken).
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Only this capture.
        #[arg(long)]
        pod: Option<String>,
    },
    /// What capture does with one connection of a pod and why (which program decision
    /// or netfilter rule), from the pod's live config.
    Explain(Box<crate::capture::explain::ExplainArgs>),
    /// Remove pinned eBPF capture (programs, links, maps, classifier).
    Clean(CleanArgs),
    /// Switch the programs' log records on or off at run time.
    Log {
        #[arg(value_parser = ["on", "off"])]
        state: String,
        /// The pod whose capture to switch (default: every pinned capture).
        #[arg(long)]
        pod: Option<String>,
    },
}

/// Where and how to capture one pod with eBPF.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The pod's cgroup v2 directory (programs see only processes in it).
    #[arg(long)]
    pub cgroup: PathBuf,
    /// A name for the pins (/sys/fs/bpf/weir/<pod>); default: the cgroup's name.
    #[arg(long)]
    pub pod: Option<String>,
    /// The pod's network namespace (a path); default: this process's, which must then
    /// be the namespace of some process in --cgroup (or below it).
    #[arg(long)]
    pub netns: Option<PathBuf>,
    /// Without --netns, register this process's network namespace even when no process
    /// in --cgroup (or below it) is in it. Normally refused: run from outside the pod,
    /// the pod would silently not be captured.
    #[arg(long)]
    pub allow_netns_mismatch: bool,
    /// The pod interface inbound capture attaches to.
    #[arg(long, default_value = "eth0")]
    pub interface: String,
    /// Experimental: pass data between local socket pairs with sk_msg. The kernel gives
    /// sockmap ingress no flow control (a sender outpacing its reader gets ENOMEM); see
    /// ARCHITECTURE.md.
    #[arg(long)]
    pub accelerate: bool,
    /// Stay attached until SIGTERM/SIGINT instead of pinning and exiting (a private
    /// copy of the programs, not the node's set).
    #[arg(long)]
    pub foreground: bool,
    #[command(flatten)]
    pub capture: IstioIptablesArgs,
}

#[derive(Debug, Args)]
pub struct ApplyArgs {
    #[arg(long, value_enum, default_value_t = CaptureMode::Auto)]
    pub capture_mode: CaptureMode,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct CleanArgs {
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
    #[arg(long)]
    pub pod: Option<String>,
    #[arg(long)]
    pub all: bool,
    /// The captures of pods that are gone (their namespace or cgroup no longer
    /// exists), and list entries no registration owns.
    #[arg(long)]
    pub gone: bool,
}

pub fn run(args: CaptureArgs) -> anyhow::Result<()> {
    match args.command {
        CaptureCommand::Ebpf(run) => ebpf(&run),
        CaptureCommand::Apply(apply) => {
            let mut choice = detect::choose_for(apply.capture_mode, &apply.run.cgroup)?;
            if choice.backend == Backend::Ebpf
                && let Some(why) = pod_refuses_ebpf(&apply.run)?
            {
                if apply.capture_mode == CaptureMode::Ebpf {
                    bail!("--capture-mode=ebpf cannot capture this pod: {why}");
                }
                let fallback = match detect::nftables_unavailable() {
                    None => Backend::Nftables,
                    Some(_) => Backend::Iptables,
                };
                choice = detect::Choice { backend: fallback, reasons: vec![format!("not ebpf: {why}")] };
            }
            eprintln!("weir: {choice}");
            match choice.backend {
                Backend::Ebpf => ebpf(&apply.run),
                Backend::Nftables | Backend::Iptables => {
                    rules(&apply.run, choice.backend == Backend::Nftables)
                }
            }
        }
        CaptureCommand::Detect { capture_mode, cgroup } => {
            let choice = match &cgroup {
                Some(cgroup) => detect::choose_for(capture_mode, cgroup)?,
                None => detect::choose(capture_mode)?,
            };
            println!("{}", choice.backend);
            for reason in &choice.reasons {
                println!("  {reason}");
            }
            Ok(())
        }
        CaptureCommand::Status { json, pod } => status(json, pod.as_deref()),
        CaptureCommand::Explain(args) => crate::capture::explain::run(&args),
        CaptureCommand::Clean(args) => clean(&args),
        CaptureCommand::Log { state, pod } => log_switch(state == "on", pod.as_deref()),
    }
}

/// The netfilter backends, through weir-iptables (with the run's network namespace).
fn rules(run: &RunArgs, nft: bool) -> anyhow::Result<()> {
    let env = |n: &str| std::env::var(n).ok();
    let facts = SystemFacts { netns: run.netns.clone() };
    let (cfg, mut opts) = run.capture.resolve(&env, &facts)?;
    opts.native_nftables = nft;
    if opts.network_namespace.is_none() {
        opts.network_namespace = run.netns.clone();
    }
    privileges::require(&[Capability::NetAdmin, Capability::NetRaw], "weir capture")?;
    let report = weir_iptables::program(&cfg, &opts)?;
    eprintln!("weir: {} capture {:?}", report.backend, report.action);
    Ok(())
}

/// The capture's name: `--pod` (checked: it names pins and a record), or the cgroup's
/// basename with what a name cannot hold made '_' (kubelet cgroups end in `.slice`
/// or `.scope`, and bpffs refuses dots).
fn pod_name(run: &RunArgs) -> anyhow::Result<String> {
    let name = match &run.pod {
        Some(p) => p.clone(),
        None => run
            .cgroup
            .file_name()
            .map(|n| {
                n.to_string_lossy()
                    .chars()
                    .map(|c| if c.is_ascii_graphic() && !matches!(c, '/' | '.') { c } else { '_' })
                    .collect::<String>()
            })
            .filter(|n| !n.is_empty())
            .with_context(|| {
                format!("--pod is needed: cannot name the capture after {}", run.cgroup.display())
            })?,
    };
    crate::capture::ebpf::record::check_name(&name).context("--pod")?;
    Ok(name)
}

/// Why eBPF cannot capture this pod correctly (its own user namespace), or `None`.
fn pod_refuses_ebpf(run: &RunArgs) -> anyhow::Result<Option<String>> {
    let netns = run.netns.clone().unwrap_or_else(|| PathBuf::from("/proc/self/ns/net"));
    let own = !netns::owned_by_this_user_namespace(&netns)
        .with_context(|| format!("read the owner of network namespace {}", netns.display()))?;
    let in_userns = std::fs::read_to_string("/proc/self/uid_map")
        .map(|m| m.split_whitespace().collect::<Vec<_>>() != ["0", "0", "4294967295"])
        .unwrap_or(false);
    Ok((own || in_userns).then(|| {
        "the pod runs in a user namespace of its own (hostUsers: false): eBPF capture tells Envoy's \
         connections apart by user id as the node sees it, which differs there"
            .to_string()
    }))
}

/// Refuses a namespace no process of the cgroup is in (see `--allow-netns-mismatch`).
fn check_netns(run: &RunArgs) -> anyhow::Result<()> {
    if run.netns.is_some() || run.allow_netns_mismatch {
        return Ok(());
    }
    let own = Path::new("/proc/self/ns/net");
    let found = netns::cgroup_members_in(&run.cgroup, own)
        .with_context(|| format!("read the processes of cgroup {}", run.cgroup.display()))?;
    if found.in_namespace.is_none() {
        bail!(
            "none of the {} processes in cgroup {} (or below it) is in this process's network namespace {}: \
             registering it would leave the pod uncaptured. Run inside the pod's namespace, pass --netns \
             <the pod's namespace>, or --allow-netns-mismatch to register this namespace anyway",
            found.processes,
            run.cgroup.display(),
            netns::describe(own)
        );
    }
    Ok(())
}

fn ebpf(run: &RunArgs) -> anyhow::Result<()> {
    let env = |n: &str| std::env::var(n).ok();
    let facts = SystemFacts { netns: run.netns.clone() };
    let (cfg, opts) = run.capture.resolve(&env, &facts)?;
    let own = own_addresses(&facts).context("read the pod's addresses")?;
    let pod = PodCapture::new(&cfg, own, EbpfOptions { accelerate: run.accelerate })?;
    let name = pod_name(run)?;
    if opts.dry_run {
        println!("{}", serde_json::to_string_pretty(&describe(&name, run, &pod))?);
        return Ok(());
    }
    privileges::require(&[Capability::SysAdmin, Capability::NetAdmin, Capability::Bpf], "weir capture ebpf")?;
    if opts.cleanup_only {
        return clean(&CleanArgs { cgroup: None, pod: Some(name), all: false, gone: false });
    }
    if let Some(why) = detect::ebpf_prerequisites().or(pod_refuses_ebpf(run)?) {
        bail!(
            "eBPF capture cannot work here: {why} (use `weir capture apply` to fall back to nftables or iptables)"
        );
    }
    check_netns(run)?;
    // Pods captured before that are gone now (nothing else unregisters them in
    // init-container mode) go first, so they never fill the node's maps.
    collect_gone();
    let cookie = netns_cookie(run.netns.as_deref()).context("read the pod's network namespace cookie")?;
    // Before anything of an existing capture is touched: a refusal leaves it as it is.
    refuse_unsafe_ancestors(&run.cgroup)?;

    // An existing pinned capture of this pod is updated in place (no gap in capture),
    // or, when its pins are gone, replaced (see `repair`).
    if let Some(record) = PinRecord::load(&name) {
        let faults = health::faults(&record, &PinRecord::load_all());
        // Nothing of a capture whose pins are gone is live: a pod made again (a new
        // cgroup or namespace) under the same name just replaces it.
        let nothing_live = faults
            .iter()
            .any(|f| matches!(f, health::CaptureFault::PinsGone(_) | health::CaptureFault::BpffsNotMounted));
        if !nothing_live && (record.cgroup != run.cgroup || record.netns_cookie != cookie) {
            bail!(
                "a capture named {name} already exists for cgroup {} (clean it first with `weir capture clean --pod {name}`)",
                record.cgroup.display()
            );
        }
        if faults.is_empty() {
            pod::update(&record, &pod)?;
            eprintln!("weir: eBPF capture of {name} updated in place");
            return Ok(());
        }
        // Never repaired on a check that could not be made: the capture may be live,
        // and capturing again may fail for the same reason.
        if faults.iter().any(health::CaptureFault::is_unchecked) {
            bail!(
                "cannot confirm the eBPF capture of {name} ({}); it is left as it is: fix what stops the check, or remove it with `weir capture clean --pod {name}` and capture again",
                health::describe(&faults)
            );
        }
        // The same pod in this build's set is made whole in place: what still runs
        // keeps running, and a failure leaves it as it was. Anything else (another
        // build's set, a capture of its own maps) is taken down first.
        let same_pod = record.cgroup == run.cgroup
            && record.netns_cookie == cookie
            && record.programs.as_deref() == Some(set::version_key().as_str());
        if same_pod && set::present(&set::version_key()) {
            let why = health::describe(&faults);
            tracing::warn!(pod = %name, faults = %why, "eBPF capture broken: capturing it again in place");
            eprintln!(
                "weir: eBPF capture of {name} was broken ({why}): capturing it again in place (what still runs is kept)"
            );
        } else if !nothing_live && record.cgroup == run.cgroup && record.netns_cookie == cookie {
            // Another build's capture of this pod, part of it still running: this
            // build's goes in beside it (under its name, the old one moved aside), and
            // only then is the old one taken down. A failure puts the old one back.
            return replace_beside(&name, &record, run, cookie, &pod, &faults);
        } else {
            repair(&record, run.netns.as_deref(), cookie, &faults);
        }
    }
    if run.foreground {
        return foreground(run, &name, cookie, &pod);
    }
    let target = PodTarget {
        name: name.clone(),
        cgroup: run.cgroup.clone(),
        netns: run.netns.clone(),
        interface: run.interface.clone(),
    };
    let record = pod::capture(&target, cookie, &pod).map_err(|e| {
        anyhow::anyhow!(
            "{} (use `weir capture apply` to fall back to nftables or iptables)",
            crate::error_chain(&e)
        )
    })?;
    eprintln!(
        "weir: eBPF capture live on {} (pod {name}, netns cookie {cookie}, program set {})",
        run.cgroup.display(),
        record.programs.as_deref().unwrap_or("-")
    );
    eprintln!("weir: pinned under {}", record.pin_dir().display());
    Ok(())
}

/// Before attaching anew: what the cgroup's ancestors run must leave eBPF capture
/// safe (`ancestors`); else an error naming the program, its cgroup and why.
fn refuse_unsafe_ancestors(cgroup: &Path) -> anyhow::Result<()> {
    match detect::ebpf_unsafe_for(cgroup) {
        None => Ok(()),
        Some(why) => bail!(
            "eBPF capture cannot work here: {why} (use `weir capture apply` to fall back to nftables or iptables)"
        ),
    }
}

/// Captures the pod with this build's set while `old` (another build's, or pins of its
/// own, still partly live) keeps capturing it: `old` is moved to `<name>-replaced`, the
/// new capture made under `name`, then `old` removed. On failure `old` is moved back.
fn replace_beside(
    name: &str,
    old: &PinRecord,
    run: &RunArgs,
    cookie: u64,
    pod: &PodCapture,
    faults: &[health::CaptureFault],
) -> anyhow::Result<()> {
    let why = health::describe(faults);
    eprintln!("weir: eBPF capture of {name} was broken ({why}): capturing it again beside the old one");
    let aside = old.move_to(&format!("{name}-replaced")).context("move the old capture aside")?;
    let target = PodTarget {
        name: name.to_string(),
        cgroup: run.cgroup.clone(),
        netns: run.netns.clone(),
        interface: run.interface.clone(),
    };
    match pod::capture(&target, cookie, pod) {
        Ok(_) => {
            if let Err(e) = (PinRecord { interface: None, ..aside }).remove() {
                tracing::warn!(pod = %name, error = %crate::error_chain(&e), "the replaced capture not wholly removed");
            }
            eprintln!(
                "weir: eBPF capture live on {} (pod {name}, netns cookie {cookie})",
                run.cgroup.display()
            );
            Ok(())
        }
        Err(e) => {
            if let Err(back) = aside.move_to(name) {
                tracing::error!(pod = %name, error = %crate::error_chain(&back), "the old capture could not be moved back: it stays as {name}-replaced");
            }
            Err(anyhow::anyhow!("{} (the old capture is left as it was)", crate::error_chain(&e)))
        }
    }
}

/// Takes down what is left of a broken capture (`faults`), so it can be made again
/// whole: its registration, inbound filter, remaining pins and record. The inbound
/// filter is looked for in `netns` (this run's, whose cookie is `cookie`) when the
/// record names that namespace by cookie, and left alone otherwise: a recorded path may
/// name another pod's namespace by now.
fn repair(record: &PinRecord, netns: Option<&Path>, cookie: u64, faults: &[health::CaptureFault]) {
    let why = health::describe(faults);
    tracing::warn!(pod = %record.pod, cgroup = %record.cgroup.display(), faults = %why, "eBPF capture broken: capturing again");
    eprintln!("weir: eBPF capture of {} was broken ({why}): capturing it again", record.pod);
    let mut record = record.clone();
    if record.netns_cookie == cookie {
        record.netns = netns.map(Path::to_path_buf);
    } else {
        record.interface = None;
    }
    if let Err(e) = record.remove() {
        // Whatever could not be removed through its set goes by path.
        tracing::warn!(pod = %record.pod, error = %crate::error_chain(&e), "removing the broken capture's remains");
        if let Some(interface) = &record.interface {
            inbound::detach_inbound(record.netns.as_deref(), interface, record.netns_cookie);
        }
        let _ = bpffs::unpin(&record.pin_dir());
        let _ = std::fs::remove_file(PinRecord::path(&record.pod));
    }
}

/// `--foreground`: a private copy of the programs on the cgroup until a signal.
fn foreground(run: &RunArgs, name: &str, cookie: u64, pod: &PodCapture) -> anyhow::Result<()> {
    let mut programs = CapturePrograms::load()?;
    programs.attach(&run.cgroup)?;
    programs.register(cookie, pod, None)?;
    let netns_path = run.netns.clone().unwrap_or_else(|| PathBuf::from("/proc/self/ns/net"));
    let inbound = match &pod.inbound {
        Some(cfg) => Some(InboundProgram::attach(&netns_path, &run.interface, cfg)?),
        None => None,
    };
    eprintln!("weir: eBPF capture live on {} (pod {name}, netns cookie {cookie})", run.cgroup.display());
    hold(programs, inbound)
}

/// Foreground mode: keep the programs attached, forward their logs, detach on a signal.
fn hold(mut programs: CapturePrograms, inbound: Option<InboundProgram>) -> anyhow::Result<()> {
    let runtime = crate::support::runtime::current_thread("weir capture ebpf")?;
    runtime.block_on(async {
        let shutdown = crate::support::shutdown::Shutdown::watch()?;
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        loop {
            tokio::select! {
                _ = shutdown.requested() => break,
                _ = tick.tick() => programs.flush_logs(),
            }
        }
        anyhow::Ok(())
    })?;
    drop(inbound);
    drop(programs);
    eprintln!("weir: eBPF capture detached");
    Ok(())
}

fn describe(name: &str, run: &RunArgs, pod: &PodCapture) -> serde_json::Value {
    serde_json::json!({
        "pod": name,
        "cgroup": run.cgroup,
        "netns": run.netns,
        "proxy_uids": pod.config.proxy_uids.iter().filter(|u| **u != u32::MAX).collect::<Vec<_>>(),
        "proxy_gids": pod.config.proxy_gids.iter().filter(|u| **u != u32::MAX).collect::<Vec<_>>(),
        "outbound_port": pod.config.outbound_port,
        "inbound_port": pod.config.inbound_port,
        "flags": pod.config.flags,
        "exclude": pod.exclude.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "include": pod.include.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "own_addresses": pod.own_addresses,
        "dns_servers": pod.dns_servers,
        "inbound": pod.inbound.map(|c| serde_json::json!({"mode": c.mode, "capture_port": c.capture_port})),
    })
}

fn status(json: bool, only: Option<&str>) -> anyhow::Result<()> {
    // Pins and pinned maps cannot be read without these: a check that could not look
    // must not report captures as broken.
    privileges::require(&[Capability::SysAdmin, Capability::Bpf], "weir capture status")?;
    let all = PinRecord::load_all();
    let shown: Vec<&PinRecord> = all.iter().filter(|r| only.is_none_or(|p| p == r.pod)).collect();
    let ancestors = ancestors_of(&shown);
    let mut pods = Vec::new();
    for record in shown {
        let dir = record.pin_dir();
        let links: Vec<String> = std::fs::read_dir(dir.join("links"))
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let maps = pod::maps_of(record);
        let (counters, registered, pending, cookies) = match &maps {
            // A pod's own decisions; a node capture's record (no namespace of its
            // own) shows its program set's totals.
            Ok(m) if record.netns_cookie != 0 => (
                m.pod_counters(record.netns_cookie).ok().flatten(),
                m.pods().map(|p| p.len()).ok(),
                m.pending_original_destinations().ok(),
                m.pods().unwrap_or_default(),
            ),
            Ok(m) => (
                m.counters().ok(),
                m.pods().map(|p| p.len()).ok(),
                m.pending_original_destinations().ok(),
                m.pods().unwrap_or_default(),
            ),
            Err(_) => (None, None, None, Vec::new()),
        };
        // The tc classifier's decisions for the pod's inbound connections, next to its
        // outbound ones (a node capture's record: the classifier's totals).
        let inbound_counters = match record.netns_cookie {
            0 => inbound::pinned_totals(&pod::maps_dir(record)),
            cookie => inbound::pod_counters(&pod::maps_dir(record), &dir, cookie),
        };
        let (inbound_counters, inbound_error) = match inbound_counters {
            Some(Ok(c)) => (Some(c), None),
            Some(Err(e)) => (None, Some(crate::error_chain(&e))),
            None => (None, None),
        };
        let counters = match (counters, inbound_counters) {
            (Some(mut c), Some(i)) => {
                c.0.extend(i.0);
                Some(c)
            }
            (c, i) => c.or(i),
        };
        let faults = health::faults(record, &all);
        let (unsafe_ancestors, ancestors_error) = match ancestors.get(&record.cgroup) {
            Some(Err(AncestorError::Unsafe(u))) => (Some(u.to_string()), None),
            Some(Err(e)) => (None, Some(e.to_string())),
            _ => (None, None),
        };
        pods.push(serde_json::json!({
            "pod": record.pod,
            "live": faults.is_empty() && unsafe_ancestors.is_none() && ancestors_error.is_none(),
            "faults": faults.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "unsafe_ancestors": unsafe_ancestors,
            "ancestors_error": ancestors_error,
            "cgroup": record.cgroup,
            "netns": record.netns,
            "netns_cookie": record.netns_cookie,
            "registered": record.netns_cookie != 0 && cookies.contains(&record.netns_cookie),
            "interface": record.interface,
            "pins": dir,
            "program_set": record.programs,
            "links": links,
            "registered_pods": registered,
            "pending_original_destinations": pending,
            "inbound_error": inbound_error,
            "counters": counters.map(|c| c.0.into_iter().collect::<std::collections::BTreeMap<_, _>>()),
            "maps_error": maps.err().map(|e| crate::error_chain(&e)),
        }));
    }
    let broken = pods.iter().filter(|p| p["live"] == false).count();
    if json {
        println!("{}", serde_json::to_string_pretty(&pods)?);
    } else {
        print_status(&pods);
    }
    if broken > 0 {
        bail!("{broken} of {} pinned eBPF captures are broken (see above)", pods.len());
    }
    Ok(())
}

/// What the ancestors of each shown capture's cgroup run, judged once per cgroup
/// (read only: no probe is attached; a cgroup that is gone is a fault already).
fn ancestors_of(records: &[&PinRecord]) -> BTreeMap<PathBuf, Result<(), AncestorError>> {
    let hooks = crate::capture::ebpf::capture::cgroup_hook_types();
    let mut out = BTreeMap::new();
    for record in records.iter().filter(|r| r.cgroup.exists()) {
        if !out.contains_key(&record.cgroup) {
            out.insert(record.cgroup.clone(), ancestors::check(&record.cgroup, &hooks, Probe::Never));
        }
    }
    out
}

fn print_status(pods: &[serde_json::Value]) {
    if pods.is_empty() {
        println!("no pinned eBPF capture");
    }
    for p in pods {
        println!(
            "pod {}  cgroup {}  interface {}  program set {}",
            p["pod"], p["cgroup"], p["interface"], p["program_set"]
        );
        if let Some(why) = p["unsafe_ancestors"].as_str() {
            println!("  UNSAFE: {why}");
        }
        if let Some(e) = p["ancestors_error"].as_str() {
            println!("  ancestors unreadable: {e}");
        }
        match p["faults"].as_array().filter(|f| !f.is_empty()) {
            None if p["live"] == false => {}
            None => println!("  live"),
            Some(faults) => {
                for fault in faults {
                    println!("  BROKEN: {}", fault.as_str().unwrap_or_default());
                }
                println!(
                    "  repair: run `weir capture apply` (or `weir capture ebpf`) again with the pod's arguments"
                );
            }
        }
        println!("  attached: {}", p["links"]);
        println!(
            "  registered: {}  pods in its maps: {}  pending original destinations: {}",
            p["registered"], p["registered_pods"], p["pending_original_destinations"]
        );
        if let Some(e) = p["inbound_error"].as_str() {
            println!("  inbound counters unreadable: {e}");
        }
        if let Some(counters) = p["counters"].as_object() {
            let line: Vec<String> = counters.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!("  counters: {}", line.join(" "));
        }
    }
}

/// Removes the captures of pods that are gone, and orphaned list entries; logged.
fn collect_gone() {
    let (view, removed) = crate::capture::ebpf::gc::collect_gone_pods(Path::new("/proc"));
    if let Err(e) = &view {
        tracing::debug!(reason = %e, "gone pods judged on their namespace paths only");
    }
    match crate::capture::ebpf::gc::collect_unrecorded(&view) {
        Ok(0) => {}
        Ok(n) => eprintln!("weir: removed {n} registrations of gone pods that had no record"),
        Err(e) => eprintln!("weir: registrations without a record not collected: {}", crate::error_chain(&e)),
    }
    for (pod, result) in removed {
        match result {
            Ok(()) => eprintln!("weir: removed the eBPF capture of {pod}: the pod is gone"),
            Err(e) => {
                eprintln!("weir: the eBPF capture of {pod} (gone) not removed: {}", crate::error_chain(&e))
            }
        }
    }
    match crate::capture::ebpf::gc::collect_orphans() {
        Ok(0) => {}
        Ok(n) => eprintln!("weir: removed {n} orphaned capture list entries"),
        Err(e) => eprintln!("weir: orphaned capture list entries not collected: {}", crate::error_chain(&e)),
    }
}

fn clean(args: &CleanArgs) -> anyhow::Result<()> {
    privileges::require(
        &[Capability::SysAdmin, Capability::NetAdmin, Capability::Bpf],
        "weir capture clean",
    )?;
    if args.gone {
        collect_gone();
        for key in set::remove_unused()? {
            eprintln!("weir: removed unused eBPF program set {key}");
        }
        return Ok(());
    }
    let records: Vec<PinRecord> = PinRecord::load_all()
        .into_iter()
        .filter(|r| {
            args.all
                || args.pod.as_deref() == Some(r.pod.as_str())
                || args.cgroup.as_deref() == Some(r.cgroup.as_path())
        })
        .collect();
    if records.is_empty() {
        // Pins without a record (a crash between pinning and recording) still go.
        if let Some(pod) = &args.pod {
            crate::capture::ebpf::record::check_name(pod).context("--pod")?;
            bpffs::unpin(&pin_dir(pod))?;
        }
        remove_unused_sets(args.all)?;
        eprintln!("weir: nothing to clean");
        return Ok(());
    }
    for record in records {
        record.remove()?;
        eprintln!("weir: removed eBPF capture of {} ({})", record.pod, record.cgroup.display());
    }
    remove_unused_sets(args.all)
}

/// With `--all`, program sets nothing uses (left by a crash) go too.
fn remove_unused_sets(all: bool) -> anyhow::Result<()> {
    if all {
        for key in set::remove_unused()? {
            eprintln!("weir: removed unused eBPF program set {key}");
        }
    }
    Ok(())
}

fn log_switch(on: bool, pod: Option<&str>) -> anyhow::Result<()> {
    let records: Vec<PinRecord> =
        PinRecord::load_all().into_iter().filter(|r| pod.is_none_or(|p| p == r.pod)).collect();
    if records.is_empty() {
        bail!("no pinned eBPF capture{}", pod.map(|p| format!(" named {p}")).unwrap_or_default());
    }
    for record in records {
        // Pods sharing a program set share its switch.
        pod::maps_of(&record)?.set_logging(on)?;
        eprintln!(
            "weir: program logs {} for {} (program set {})",
            if on { "on" } else { "off" },
            record.pod,
            record.programs.as_deref().unwrap_or("of its own")
        );
    }
    Ok(())
}

/// True if `path` is a pinned capture's directory whose pod name says its creator (a
/// sandbox) is gone; used by sandbox reaping.
pub fn orphaned(pod: &str) -> bool {
    crate::sandbox::owner_pid(pod).is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
}
