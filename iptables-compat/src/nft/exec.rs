//! Running nft: the current Istio tables, what a transaction would produce (applied in
//! a throwaway network namespace, so both sides are printed by the same nft), and
//! applying one transaction. A recorder stands in for dry runs.

use std::{
    io::Write as _,
    process::{Command, Stdio},
};

use super::{table::NftTable, wire};
use crate::{kernel::nft_batch, outcome::ApplyPath};

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("nft {what}: {stderr}")]
    Failed { what: String, stderr: String },
    #[error("run nft (is the nft binary installed?)")]
    Spawn(#[source] std::io::Error),
    #[error("create a scratch network namespace to evaluate the plan")]
    Scratch(#[source] std::io::Error),
    #[error(transparent)]
    Batch(#[from] nft_batch::BatchError),
}

/// Executes nft for one namespace.
pub trait Nft {
    /// The Istio tables as `nft list table` prints them, counters zeroed; empty when
    /// there are none.
    fn list(&mut self) -> Result<String, NftError>;
    /// What [`Nft::list`] would print after `tx` on an empty namespace.
    fn expected(&mut self, tx: &str) -> Result<String, NftError>;
    /// Applies `tx` as one transaction (`nft -f -`).
    fn apply(&mut self, tx: &str) -> Result<(), NftError>;
    /// Applies `tx`, which creates tables the namespace does not have, as one
    /// transaction, and says which way it went in.
    fn apply_new(&mut self, tx: &str) -> Result<ApplyPath, NftError> {
        self.apply(tx).map(|()| ApplyPath::Full)
    }
    fn is_real(&self) -> bool;
}

/// Records the transactions a run would apply.
#[derive(Debug, Default)]
pub struct NftRecorder {
    pub transactions: Vec<String>,
}

impl Nft for NftRecorder {
    fn list(&mut self) -> Result<String, NftError> {
        Ok(String::new())
    }
    fn expected(&mut self, _tx: &str) -> Result<String, NftError> {
        Ok(String::new())
    }
    fn apply(&mut self, tx: &str) -> Result<(), NftError> {
        self.transactions.push(tx.to_string());
        Ok(())
    }
    fn is_real(&self) -> bool {
        false
    }
}

/// The system's `nft`.
#[derive(Debug, Default)]
pub struct SystemNft;

pub(crate) fn nft(args: &[&str], stdin: Option<&str>) -> Result<String, NftError> {
    let mut cmd = Command::new("nft");
    cmd.args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(NftError::Spawn)?;
    if let Some(input) = stdin {
        child.stdin.take().expect("piped").write_all(input.as_bytes()).map_err(NftError::Spawn)?;
    }
    let out = child.wait_with_output().map_err(NftError::Spawn)?;
    if !out.status.success() {
        return Err(NftError::Failed {
            what: args.join(" "),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The inet tables present: read in process (no nft run), or from `nft list tables`
/// if that probe fails.
pub(crate) fn inet_tables() -> Result<Vec<String>, NftError> {
    match crate::kernel::nf_probe::tables() {
        Ok(t) => Ok(t.nft_in(crate::kernel::nf_probe::NFPROTO_INET).map(|t| t.table.clone()).collect()),
        Err(e) => {
            tracing::debug!(error = %e, "netfilter probe failed; asking nft");
            Ok(nft(&["list", "tables"], None)?
                .lines()
                .filter_map(|l| l.trim().strip_prefix("table inet ").map(String::from))
                .collect())
        }
    }
}

/// Whether any Istio table is present in the current namespace.
pub fn istio_tables_present() -> Result<bool, NftError> {
    let present = inet_tables()?;
    Ok(NftTable::ALL.iter().any(|t| present.iter().any(|p| p == t.name())))
}

/// Lists the Istio tables present, counters zeroed, in a fixed order.
fn list_istio_tables() -> Result<String, NftError> {
    list_tables(&NftTable::ALL.map(NftTable::name))
}

/// Lists those of the inet tables `names` that are present, counters zeroed, in the
/// order given; empty when there are none.
pub fn list_tables(names: &[&str]) -> Result<String, NftError> {
    let present = inet_tables()?;
    let mut out = String::new();
    for name in names {
        if present.iter().any(|p| p == name) {
            out.push_str(&zero_counters(&nft(&["list", "table", "inet", name], None)?));
        }
    }
    Ok(out)
}

/// Runs `f` on a thread of its own in a fresh, empty network namespace (it and the
/// namespace end when `f` returns): what a transaction produces, seen without
/// touching the namespace it is meant for.
pub fn in_scratch_netns<T: Send>(f: impl FnOnce() -> Result<T, NftError> + Send) -> Result<T, NftError> {
    std::thread::scope(|s| {
        s.spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| NftError::Scratch(e.into()))?;
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(NftError::Scratch(std::io::Error::other("scratch thread panicked"))))
    })
}

/// `counter packets 12 bytes 720` → `counter`.
pub fn zero_counters(listing: &str) -> String {
    let mut out = String::with_capacity(listing.len());
    for line in listing.lines() {
        let words: Vec<&str> = line.split(' ').collect();
        let mut kept = Vec::with_capacity(words.len());
        let mut i = 0;
        while i < words.len() {
            if words[i] == "packets" && i + 3 < words.len() + 1 && words.get(i + 2) == Some(&"bytes") {
                i += 4;
                continue;
            }
            kept.push(words[i]);
            i += 1;
        }
        out.push_str(&kept.join(" "));
        out.push('\n');
    }
    out
}

impl Nft for SystemNft {
    fn list(&mut self) -> Result<String, NftError> {
        list_istio_tables()
    }

    fn expected(&mut self, tx: &str) -> Result<String, NftError> {
        in_scratch_netns(|| {
            nft(&["-f", "-"], Some(tx))?;
            list_istio_tables()
        })
    }

    fn apply(&mut self, tx: &str) -> Result<(), NftError> {
        tracing::info!("nft -f:\n{}", tx.trim());
        nft(&["-f", "-"], Some(tx)).map(drop)
    }

    /// In process when [`wire`] knows every line: the same messages `nft -f` would
    /// send, one batch, no process. A batch the kernel refuses changed nothing; `nft -f`
    /// then runs the same text (and reports in its own words if it fails too). A batch
    /// whose answer was lost may be in: that is an error, never a second try on top.
    fn apply_new(&mut self, tx: &str) -> Result<ApplyPath, NftError> {
        match wire::compile(tx) {
            Ok(batch) => match nft_batch::send(&batch) {
                Ok(()) => {
                    tracing::info!(
                        messages = batch.messages.len(),
                        "nf_tables batch, in process:\n{}",
                        tx.trim()
                    );
                    return Ok(ApplyPath::Fast);
                }
                Err(e) if e.applied_nothing() => {
                    tracing::warn!(error = %e, "the in-process nf_tables batch did not go in; running nft")
                }
                Err(e) => return Err(e.into()),
            },
            Err(why) => tracing::debug!(%why, "running nft"),
        }
        self.apply(tx).map(|()| ApplyPath::Full)
    }

    fn is_real(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_zeroed_for_comparison() {
        let l = "\t\tmeta l4proto tcp counter packets 12 bytes 720 jump istio-inbound\n";
        assert_eq!(zero_counters(l), "\t\tmeta l4proto tcp counter jump istio-inbound\n");
    }
}
