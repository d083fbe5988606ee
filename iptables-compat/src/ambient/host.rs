//! The node's probe SNAT: kubelet's probes to ambient pods leave the node from
//! 169.254.7.127 (its v6 twin), which the in-pod rules let through uncaptured. iptables
//! (`nat POSTROUTING → ISTIO_POSTRT`, `--socket-exists`, ipsets) or nftables
//! (`istio-ambient-nat` postrouting, kubelet's uid, sets in the table). Each family's
//! change is one `iptables-restore` (old chain and jump out, new in, in one commit), or
//! one nft transaction; no guardrails, since this is the node's own namespace.

use std::{collections::BTreeMap, path::Path};

use super::{
    apply::{
        AmbientError, AmbientNft, detect, iptables_verdict, owned_leftovers, owned_saves, removal_restore,
    },
    config::{AmbientBackend, AmbientConfig},
    nft as anft, plan,
};
use crate::{
    apply::{CaptureError, Report, in_netns},
    iptables::{
        render,
        state::Verdict,
        xtables::{Lock, Xtables},
    },
    kernel::netlink::Family,
    nft::exec::{self, Nft as _, NftError},
    outcome::{Action, ApplyPath, Backend},
};

const OWNED: [&str; 1] = [plan::CHAIN_POSTROUTING];
const CHAIN: &str = "postrouting";

/// Joins `iptables-restore` inputs into one block per table (one commit each).
fn merge_restores(texts: &[&str]) -> String {
    let mut tables: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut table = String::new();
    for line in texts.iter().flat_map(|t| t.lines()) {
        if let Some(name) = line.strip_prefix("* ") {
            table = name.to_string();
            tables.entry(table.clone()).or_default();
        } else if line != "COMMIT" && !line.is_empty() {
            tables.entry(table.clone()).or_default().push(line.to_string());
        }
    }
    tables.into_iter().map(|(t, lines)| format!("* {t}\n{}\nCOMMIT\n", lines.join("\n"))).collect()
}

/// Istio's host run through `x`: both families read; nothing if the rule is in place;
/// else per planned family one restore that takes out whatever `ISTIO_POSTRT` and jump
/// were there and puts the planned ones in.
pub fn program_host_iptables(cfg: &AmbientConfig, x: &mut dyn Xtables) -> Result<Report, CaptureError> {
    let plan = plan::host_probe(cfg);
    let saves = (x.save(Family::V4), x.save(Family::V6));
    let verdict = iptables_verdict(&plan, x, owned_saves(saves.clone(), &OWNED));
    let report = |action| Report {
        backend: Backend::Iptables,
        verdict: Some(verdict),
        action,
        path: ApplyPath::Full,
        transcript: None,
    };
    if verdict == Verdict::Applied {
        return Ok(report(Action::AlreadyApplied));
    }
    for (family, rules, save) in [(Family::V4, &plan.v4, saves.0), (Family::V6, &plan.v6, saves.1)] {
        if rules.is_empty() {
            continue;
        }
        let old = save.map(|s| removal_restore(&owned_leftovers(&s, &OWNED))).unwrap_or_default();
        x.restore(family, &merge_restores(&[&old, &render::restore(rules)]), true)?;
    }
    Ok(report(if verdict == Verdict::Clean { Action::Applied } else { Action::Reconciled }))
}

/// Istio's host nftables transaction through `n` (`add table`, `flush table`: the
/// table's sets and their members stay).
pub fn program_host_nft(
    cfg: &AmbientConfig,
    kubelet_uid: u32,
    n: &mut dyn exec::Nft,
) -> Result<Report, CaptureError> {
    n.apply(&anft::render(&anft::host_probe(cfg, kubelet_uid)))?;
    Ok(Report {
        backend: Backend::Nftables,
        verdict: None,
        action: Action::Applied,
        path: ApplyPath::Full,
        transcript: None,
    })
}

fn here_or_in<T: Send>(
    netns: Option<&Path>,
    f: impl FnOnce() -> Result<T, CaptureError> + Send,
) -> Result<T, AmbientError> {
    let name = netns.map_or_else(|| "the node's namespace".to_string(), |p| p.display().to_string());
    match netns {
        Some(path) => in_netns(path, f),
        None => f(),
    }
    .map_err(|e| AmbientError::from_capture(&name, e))
}

/// Programs the node's probe SNAT in `netns` (`None`: this thread's namespace). For
/// nftables the probe sets are created first if missing; `kubelet_uid` is used only by
/// nftables.
pub fn apply_host_probe(
    netns: Option<&Path>,
    cfg: &AmbientConfig,
    kubelet_uid: u32,
) -> Result<Report, AmbientError> {
    here_or_in(netns, || match cfg.backend {
        AmbientBackend::Iptables => {
            let mut x = detect(cfg, Lock::Global, None)?;
            program_host_iptables(cfg, &mut x)
        }
        AmbientBackend::Nftables => {
            let mut n = AmbientNft(&[anft::TABLE_NAT]);
            if host_nft_verdict(cfg, kubelet_uid)? == Verdict::Applied {
                let verdict = Some(Verdict::Applied);
                return Ok(Report {
                    backend: Backend::Nftables,
                    verdict,
                    action: Action::AlreadyApplied,
                    path: ApplyPath::Full,
                    transcript: None,
                });
            }
            n.apply(&anft::render_probe_sets(cfg.enable_ipv6))?;
            program_host_nft(cfg, kubelet_uid, &mut n)
        }
    })
}

/// The node's probe chain as nft lists it (counters zeroed), `None` without it.
fn list_probe_chain() -> Result<Option<String>, NftError> {
    if !exec::inet_tables()?.iter().any(|t| t == anft::TABLE_NAT) {
        return Ok(None);
    }
    match exec::nft(&["list", "chain", "inet", anft::TABLE_NAT, CHAIN], None) {
        Ok(listing) => Ok(Some(exec::zero_counters(&listing))),
        Err(NftError::Failed { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

fn host_nft_verdict(cfg: &AmbientConfig, kubelet_uid: u32) -> Result<Verdict, CaptureError> {
    let Some(current) = list_probe_chain()? else { return Ok(Verdict::Clean) };
    let tx = format!(
        "{}{}",
        anft::render_probe_sets(cfg.enable_ipv6),
        anft::render(&anft::host_probe(cfg, kubelet_uid))
    );
    let expected = exec::in_scratch_netns(|| {
        exec::nft(&["-f", "-"], Some(&tx))?;
        list_probe_chain()
    })?;
    Ok(if expected.as_deref() == Some(current.as_str()) { Verdict::Applied } else { Verdict::Drifted })
}

/// Whether the node's probe SNAT is as `cfg` plans it.
pub fn verify_host_probe(
    netns: Option<&Path>,
    cfg: &AmbientConfig,
    kubelet_uid: u32,
) -> Result<Verdict, AmbientError> {
    here_or_in(netns, || match cfg.backend {
        AmbientBackend::Iptables => {
            let mut x = detect(cfg, Lock::Global, None)?;
            let saves = owned_saves((x.save(Family::V4), x.save(Family::V6)), &OWNED);
            Ok(iptables_verdict(&plan::host_probe(cfg), &mut x, saves))
        }
        AmbientBackend::Nftables => host_nft_verdict(cfg, kubelet_uid),
    })
}

/// Removes the node's probe SNAT (the chain and its jump, or the nft chain); the probe
/// sets and their members stay, as Istio leaves them.
pub fn remove_host_probe(netns: Option<&Path>, cfg: &AmbientConfig) -> Result<Action, AmbientError> {
    here_or_in(netns, || {
        match cfg.backend {
            AmbientBackend::Iptables => {
                let mut x = detect(&AmbientConfig { enable_ipv6: false, ..cfg.clone() }, Lock::Global, None)?;
                for family in [Family::V4, Family::V6] {
                    let Some(save) = x.save(family) else { continue };
                    let text = removal_restore(&owned_leftovers(&save, &OWNED));
                    if !text.is_empty() {
                        x.restore(family, &text, true)?;
                    }
                }
            }
            AmbientBackend::Nftables if list_probe_chain()?.is_some() => {
                let t = anft::TABLE_NAT;
                let tx = format!("flush chain inet {t} {CHAIN}\ndelete chain inet {t} {CHAIN}\n");
                AmbientNft(&[anft::TABLE_NAT]).apply(&tx)?;
            }
            AmbientBackend::Nftables => {}
        }
        Ok(Action::Cleaned)
    })
}

/// kubelet's uid, from this host's `/proc` (Istio reads the host's through a mount).
pub fn kubelet_uid() -> Result<u32, AmbientError> {
    kubelet_uid_in(Path::new("/proc"))
}

/// kubelet's uid from a proc directory, as Istio finds it: the first process named
/// `kubelet` or `kubelite` with "kubelet" in an argument, or `k3s`; its real uid.
pub fn kubelet_uid_in(proc: &Path) -> Result<u32, AmbientError> {
    let entries = std::fs::read_dir(proc)
        .map_err(|e| AmbientError::KubeletUid(format!("read {}: {e}", proc.display())))?;
    for entry in entries.flatten() {
        let dir = entry.path();
        if !entry.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else { continue };
        let needs_arg = match comm.trim() {
            "kubelet" | "kubelite" => true,
            "k3s" => false,
            _ => continue,
        };
        if needs_arg {
            let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
            let has = cmdline
                .split(|b| *b == 0)
                .any(|a| String::from_utf8_lossy(a).to_lowercase().contains("kubelet"));
            if !has {
                continue;
            }
        }
        let Ok(status) = std::fs::read_to_string(dir.join("status")) else { continue };
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok());
        if let Some(uid) = uid {
            return Ok(uid);
        }
    }
    Err(AmbientError::KubeletUid(format!("no kubelet process found in {}", proc.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restores_merge_into_one_commit_per_table() {
        let a = "* nat\n-D POSTROUTING -j ISTIO_POSTRT\n-F ISTIO_POSTRT\n-X ISTIO_POSTRT\nCOMMIT\n";
        let b = "* nat\n-N ISTIO_POSTRT\n-I POSTROUTING 1 -j ISTIO_POSTRT\nCOMMIT\n";
        let merged = merge_restores(&[a, b]);
        assert_eq!(merged.matches("COMMIT").count(), 1, "{merged}");
        assert!(merged.find("-X ISTIO_POSTRT").unwrap() < merged.find("-N ISTIO_POSTRT").unwrap());
        assert_eq!(merge_restores(&["", ""]), "");
    }

    #[test]
    fn kubelet_is_found_by_name_and_argument() {
        let dir = std::env::temp_dir().join(format!("weir-kubelet-uid-{}", std::process::id()));
        let proc = |pid: &str, comm: &str, cmdline: &[u8], uid: u32| {
            let p = dir.join(pid);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("comm"), format!("{comm}\n")).unwrap();
            std::fs::write(p.join("cmdline"), cmdline).unwrap();
            std::fs::write(p.join("status"), format!("Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"))
                .unwrap();
        };
        proc("10", "kubelet", b"/bin/sh\0-c\0true\0", 5);
        assert!(kubelet_uid_in(&dir).is_err(), "a 'kubelet' without kubelet in its arguments");
        proc("11", "kubelet", b"/usr/bin/kubelet\0--config\0x\0", 1000);
        assert_eq!(kubelet_uid_in(&dir).unwrap(), 1000);
        std::fs::remove_dir_all(&dir).unwrap();
        let e = kubelet_uid_in(&dir).unwrap_err().to_string();
        assert!(e.contains("weir-kubelet-uid"), "{e}");
    }
}
