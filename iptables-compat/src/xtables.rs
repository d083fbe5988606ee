//! Running iptables: choosing the binaries the way Istio does (legacy if it already
//! holds rules, else nft, else plain `iptables`; or what FORCE_IPTABLES_BINARY says),
//! the xtables lock ([`lock`]), and an executor interface with two implementations:
//! the system's binaries, and a recorder that writes Istio's dry-run transcript
//! instead.

mod lock;

use std::{
    io::Write as _,
    process::{Child, Command, Stdio},
};

pub use lock::{Confinement, LOCK_WAIT_SECS, LOCKFILE_ENV_VERSION, Lock, NODE_LOCK};

use crate::{config::IptablesBackend, netlink::Family};

/// A failed iptables command, with xtables' exit status named.
#[derive(Debug, thiserror::Error)]
pub enum XtablesError {
    #[error("{command}: {kind}: {stderr}")]
    Failed { command: String, kind: String, stderr: String },
    #[error("run {command}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no usable {family} binary: {reason}")]
    NotFound { family: &'static str, reason: String },
}

/// Executes iptables commands for one namespace.
pub trait Xtables {
    /// `iptables-save` output, `None` when it fails.
    fn save(&mut self, family: Family) -> Option<String>;
    /// `iptables-restore [--noflush]` with `input` on stdin.
    fn restore(&mut self, family: Family, input: &str, noflush: bool) -> Result<(), XtablesError>;
    /// `iptables <args>`.
    fn run(&mut self, family: Family, args: &[String]) -> Result<(), XtablesError>;
    /// Whether this executor changes anything (false for the dry-run recorder).
    fn is_real(&self) -> bool;
}

/// Records commands as Istio's DependenciesStub does: the binary and its arguments, or
/// for restores the stdin lines. `save` returns an empty state.
#[derive(Debug, Default)]
pub struct Recorder {
    pub lines: Vec<String>,
}

impl Recorder {
    fn name(family: Family, suffix: &str) -> String {
        let base = if family == Family::V4 { "iptables" } else { "ip6tables" };
        format!("{base}{suffix}")
    }

    /// The transcript, one command or stdin line per line.
    pub fn transcript(&self) -> String {
        let mut out = self.lines.join("\n");
        out.push('\n');
        out
    }
}

impl Xtables for Recorder {
    fn save(&mut self, family: Family) -> Option<String> {
        self.lines.push(Self::name(family, "-save"));
        Some(String::new())
    }
    fn restore(&mut self, _family: Family, input: &str, _noflush: bool) -> Result<(), XtablesError> {
        self.lines.extend(input.lines().map(String::from));
        Ok(())
    }
    fn run(&mut self, family: Family, args: &[String]) -> Result<(), XtablesError> {
        let mut line = Self::name(family, "");
        for a in args {
            line.push(' ');
            line.push_str(a);
        }
        self.lines.push(line);
        Ok(())
    }
    fn is_real(&self) -> bool {
        false
    }
}

/// One family's detected binaries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binaries {
    pub iptables: String,
    pub save: String,
    pub restore: String,
    pub version: (u32, u32, u32),
    pub legacy: bool,
    pub existing_rules: bool,
}

impl Binaries {
    /// Whether writes take the xtables lock (`--wait`): legacy ≥ 1.6.2 only.
    pub fn needs_lock(&self) -> bool {
        self.legacy && self.version >= (1, 6, 2)
    }
}

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

/// Parses `vX.Y.Z` out of `iptables-save --version` output.
pub fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    let start = text
        .char_indices()
        .find(|(i, c)| *c == 'v' && text[i + 1..].starts_with(|d: char| d.is_ascii_digit()))?
        .0;
    let digits: String = text[start + 1..].chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    let mut parts = digits.split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

/// Whether an `iptables-save` dump holds rules or user chains. Istio counts lines
/// (three or more), which an empty table left by its own probe rule already passes, so
/// a second run would switch to a backend that has no rules; Weir counts real ones.
pub fn has_rules(dump: &str) -> bool {
    dump.lines().any(|l| {
        l.starts_with("-A ")
            || l.strip_prefix(':').is_some_and(|decl| {
                let chain = decl.split_whitespace().next().unwrap_or_default();
                !crate::plan::is_builtin(chain)
            })
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_table_is_not_existing_rules() {
        let empty = "# Generated by iptables-save v1.8.9\n*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n";
        assert!(!has_rules(empty));
        assert!(has_rules(&format!("{empty}*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j DROP\nCOMMIT\n")));
        assert!(has_rules("*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n"));
    }

    #[test]
    fn versions_parse() {
        assert_eq!(parse_version("iptables-save v1.8.9 (nf_tables)"), Some((1, 8, 9)));
        assert_eq!(parse_version("iptables v1.6.1"), Some((1, 6, 1)));
        assert_eq!(parse_version("garbage"), None);
    }

    #[test]
    fn only_new_legacy_binaries_lock() {
        let b = |legacy, version| Binaries {
            iptables: "iptables".into(),
            save: "iptables-save".into(),
            restore: "iptables-restore".into(),
            version,
            legacy,
            existing_rules: false,
        };
        assert!(b(true, (1, 8, 9)).needs_lock());
        assert!(!b(true, (1, 6, 1)).needs_lock());
        assert!(!b(false, (1, 8, 9)).needs_lock());
    }

    #[test]
    fn the_recorder_writes_istios_transcript() {
        let mut r = Recorder::default();
        r.save(Family::V4);
        r.restore(Family::V4, "* nat\n-N X\nCOMMIT\n", true).unwrap();
        r.run(Family::V6, &["-t".into(), "nat".into(), "-F".into(), "X".into()]).unwrap();
        assert_eq!(r.transcript(), "iptables-save\n* nat\n-N X\nCOMMIT\nip6tables -t nat -F X\n");
    }
}
