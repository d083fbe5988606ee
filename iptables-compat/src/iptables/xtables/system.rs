//! The system's iptables binaries ([`SystemXtables`]): chosen the way Istio chooses
//! them (legacy if it already holds rules, else nft, else plain `iptables`; or what
//! FORCE_IPTABLES_BINARY says, each probed with a harmless test rule), and run,
//! confined as the lock says ([`super::lock`]), with xtables' exit status named.

use std::{
    io::Write as _,
    process::{Child, Command, Stdio},
};

use super::{
    binaries::{Binaries, has_rules, parse_version},
    executor::{Xtables, XtablesError},
    lock::{Confinement, Lock, NODE_LOCK},
};
use crate::{inputs::config::IptablesBackend, kernel::netlink::Family};

/// The system's iptables binaries.
#[derive(Debug)]
pub struct SystemXtables {
    pub v4: Binaries,
    pub v6: Option<Binaries>,
    pub lock: Lock,
}

impl SystemXtables {
    /// Detects binaries for both families. A missing v6 binary is an error only when
    /// IPv6 rules are needed.
    pub fn detect(force: Option<IptablesBackend>, need_v6: bool, lock: Lock) -> Result<Self, XtablesError> {
        Self::detect_with(force, need_v6, lock, false)
    }

    /// [`SystemXtables::detect`], told whether legacy tables are known to hold no rule
    /// (read in process): then the legacy binaries, which Istio takes only when they
    /// hold rules, are not run at all.
    pub fn detect_with(
        force: Option<IptablesBackend>,
        need_v6: bool,
        lock: Lock,
        legacy_unused: bool,
    ) -> Result<Self, XtablesError> {
        let v4 = detect_family(Family::V4, force, legacy_unused, &lock)?;
        let v6 = match detect_family(Family::V6, force, legacy_unused, &lock) {
            Ok(b) => Some(b),
            Err(e) if need_v6 => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "no working ip6tables; continuing because IPv6 is disabled");
                None
            }
        };
        Ok(Self { v4, v6, lock })
    }

    fn binaries(&self, family: Family) -> Result<&Binaries, XtablesError> {
        match family {
            Family::V4 => Ok(&self.v4),
            Family::V6 => self
                .v6
                .as_ref()
                .ok_or(XtablesError::NotFound { family: "ip6tables", reason: "not detected".into() }),
        }
    }

    /// Runs `program args` for `bin`, confined as [`Lock`] says.
    fn run_for(
        &self,
        bin: &Binaries,
        program: &str,
        write: bool,
        args: &[String],
        stdin: Option<&str>,
    ) -> Result<String, XtablesError> {
        run_confined(&Confinement::of(&self.lock, bin, write), program, args, stdin)
    }
}

/// `program args`, confined; when the private mount namespace of a pod's command
/// cannot be made (a security policy refusing unshare or mount), the command runs in
/// the node's, as Istio's sandbox falls back, and a warning says what that means.
fn run_confined(
    confinement: &Confinement,
    program: &str,
    args: &[String],
    stdin: Option<&str>,
) -> Result<String, XtablesError> {
    let spawn_error = |source| XtablesError::Spawn { command: program.to_string(), source };
    let mut cmd = confinement.command(program, args).map_err(spawn_error)?;
    let child = match spawn(&mut cmd, stdin.is_some()) {
        Ok(child) => child,
        Err(e) if confinement.private_mounts && e.kind() != std::io::ErrorKind::NotFound => {
            tracing::warn!(
                command = program,
                error = %e,
                "cannot run iptables in a private mount namespace; running it in the node's \
                 (/etc/nsswitch.conf is read, and an iptables-legacy older than 1.8.6 takes the node's {NODE_LOCK})"
            );
            let plain = Confinement { private_mounts: false, lock_mount: None, ..confinement.clone() };
            cmd = plain.command(program, args).map_err(spawn_error)?;
            spawn(&mut cmd, stdin.is_some())
                .map_err(|source| XtablesError::Spawn { command: describe(&cmd), source })?
        }
        Err(source) => return Err(XtablesError::Spawn { command: describe(&cmd), source }),
    };
    finish(describe(&cmd), child, stdin)
}

/// The command line, for errors.
fn describe(cmd: &Command) -> String {
    format!(
        "{} {}",
        cmd.get_program().to_string_lossy(),
        cmd.get_args().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ")
    )
    .trim()
    .to_string()
}

fn spawn(cmd: &mut Command, piped_stdin: bool) -> std::io::Result<Child> {
    cmd.stdin(if piped_stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
}

fn exec(mut cmd: Command, stdin: Option<&str>) -> Result<String, XtablesError> {
    let command = describe(&cmd);
    let child = spawn(&mut cmd, stdin.is_some())
        .map_err(|source| XtablesError::Spawn { command: command.clone(), source })?;
    finish(command, child, stdin)
}

/// Feeds `stdin`, waits, and reads the outcome with xtables' exit status named.
fn finish(command: String, mut child: Child, stdin: Option<&str>) -> Result<String, XtablesError> {
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("piped stdin");
        pipe.write_all(input.as_bytes())
            .map_err(|source| XtablesError::Spawn { command: command.clone(), source })?;
    }
    let out = child
        .wait_with_output()
        .map_err(|source| XtablesError::Spawn { command: command.clone(), source })?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    let kind = match out.status.code() {
        Some(1) => "xtables other problem".to_string(),
        Some(2) => "xtables parameter problem".to_string(),
        Some(3) => "xtables version problem".to_string(),
        Some(4) => "xtables resource problem".to_string(),
        Some(c) => format!("exit status {c}"),
        None => "killed by a signal".to_string(),
    };
    Err(XtablesError::Failed { command, kind, stderr })
}

impl Xtables for SystemXtables {
    fn save(&mut self, family: Family) -> Option<String> {
        let bin = self.binaries(family).ok()?.clone();
        self.run_for(&bin, &bin.save, false, &[], None)
            .map_err(|e| tracing::debug!(error = %e, "iptables-save failed"))
            .ok()
    }
    fn restore(&mut self, family: Family, input: &str, noflush: bool) -> Result<(), XtablesError> {
        let bin = self.binaries(family)?.clone();
        let args: Vec<String> = if noflush { vec!["--noflush".into()] } else { Vec::new() };
        tracing::info!(binary = %bin.restore, noflush, "iptables-restore:\n{}", input.trim());
        self.run_for(&bin, &bin.restore, true, &args, Some(input)).map(drop)
    }
    fn run(&mut self, family: Family, args: &[String]) -> Result<(), XtablesError> {
        let bin = self.binaries(family)?.clone();
        tracing::debug!(binary = %bin.iptables, args = %args.join(" "), "iptables");
        self.run_for(&bin, &bin.iptables, true, args, None).map(drop)
    }
    fn is_real(&self) -> bool {
        true
    }
}

/// Istio's shouldUseBinaryForCurrentContext: the binary exists, reports a version, and
/// can add (then delete) a harmless test rule in nat/INPUT (so a kernel without
/// `iptable_nat` fails it and detection moves on to iptables-nft, istio/istio#57385).
/// The test rule is a write: it waits for the lock (istio/istio#58582), and a pod's
/// never takes the node's ([`Lock`]).
fn probe_binary(iptables: &str, lock: &Lock) -> Result<Binaries, String> {
    let save = format!("{iptables}-save");
    let restore = format!("{iptables}-restore");
    let dump = exec(Command::new(&save), None).map_err(|e| match e {
        XtablesError::Spawn { source, .. } => format!("{save}: {source}"),
        other => other.to_string(),
    })?;
    let mut version_cmd = Command::new(&save);
    version_cmd.arg("--version");
    let (version, legacy) = match exec(version_cmd, None) {
        Ok(text) => (parse_version(&text).unwrap_or((0, 0, 0)), !text.contains("nf_tables")),
        Err(_) => ((0, 0, 0), true),
    };
    let bin = Binaries {
        iptables: iptables.to_string(),
        save,
        restore,
        version,
        legacy,
        existing_rules: has_rules(&dump),
    };
    let confinement = Confinement::of(lock, &bin, true);
    let mut test: Vec<String> = TEST_RULE.map(String::from).to_vec();
    run_confined(&confinement, iptables, &test, None)
        .map_err(|e| format!("{iptables} has no loaded kernel support and cannot be used: {e}"))?;
    test[2] = "-D".into();
    let _ = run_confined(&confinement, iptables, &test, None);
    Ok(bin)
}

/// Istio's capability probe rule: never matches (protocol 255), in the table capture
/// needs.
pub const TEST_RULE: [&str; 8] = ["-t", "nat", "-A", "INPUT", "-p", "255", "-j", "RETURN"];

fn detect_family(
    family: Family,
    force: Option<IptablesBackend>,
    legacy_unused: bool,
    lock: &Lock,
) -> Result<Binaries, XtablesError> {
    let base = if family == Family::V4 { "iptables" } else { "ip6tables" };
    let legacy = format!("{base}-legacy");
    let nft = format!("{base}-nft");
    let family_name = if family == Family::V4 { "iptables" } else { "ip6tables" };
    let not_found = |reason: String| XtablesError::NotFound { family: family_name, reason };
    match force {
        Some(IptablesBackend::Legacy) => return probe_binary(&legacy, lock).map_err(not_found),
        Some(IptablesBackend::Nft) => return probe_binary(&nft, lock).map_err(not_found),
        None => {}
    }
    if !legacy_unused
        && let Ok(b) = probe_binary(&legacy, lock)
        && b.existing_rules
    {
        return Ok(b);
    }
    if let Ok(b) = probe_binary(&nft, lock) {
        return Ok(b);
    }
    probe_binary(base, lock).map_err(|e| not_found(format!("tried {legacy}, {nft} and {base} (last: {e})")))
}
