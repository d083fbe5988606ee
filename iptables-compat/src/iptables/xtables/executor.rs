//! The executor interface iptables commands go through ([`Xtables`]: save, restore,
//! run), its error ([`XtablesError`]), and the dry-run implementation ([`Recorder`])
//! that writes Istio's transcript instead of running anything.

use crate::kernel::netlink::Family;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recorder_writes_istios_transcript() {
        let mut r = Recorder::default();
        r.save(Family::V4);
        r.restore(Family::V4, "* nat\n-N X\nCOMMIT\n", true).unwrap();
        r.run(Family::V6, &["-t".into(), "nat".into(), "-F".into(), "X".into()]).unwrap();
        assert_eq!(r.transcript(), "iptables-save\n* nat\n-N X\nCOMMIT\nip6tables -t nat -F X\n");
    }
}
