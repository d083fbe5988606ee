//! What a capture's link pins are, read from the kernel and never from its record:
//! for each pin under `<bpffs>/weir/<capture>/links`, whether it is a cgroup link, the
//! cgroup it attaches (none once detached) and which pinned program set's program it
//! runs. A capture whose record was lost (another `/run/weir` mounted by a new
//! DaemonSet, `/run` cleaned while bpffs was not) is judged by this before anything
//! is attached, so a start never pins over, or tears down, links it did not make:
//! [`judge`] says whether the pins are a capture Weir can adopt (its record rewritten
//! from them) or must be left alone with the agent refusing to start.

use std::{
    collections::BTreeMap,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use super::{bpffs::PIN_ROOT, link, set::PROGRAMS_DIR, sys};

/// One pin under a capture's `links/`, as the kernel describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkPin {
    /// The pin's file name (the hook it was pinned for).
    pub hook: String,
    pub path: PathBuf,
    pub state: PinState,
}

/// What a link pin holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PinState {
    /// A cgroup link running `program` on the cgroup with id `cgroup_id`, or on
    /// nothing (`cgroup_id` 0: detached, or its cgroup removed).
    Cgroup { cgroup_id: u64, program: Option<SetProgram> },
    /// Any other kind of link (a TCX inbound link of a per-pod copy).
    OtherLink { link_type: u32 },
    /// Something that cannot be read as a link (a map, a program, a file).
    Unreadable(String),
}

/// A program of a pinned program set, found by its kernel id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetProgram {
    pub key: String,
    pub name: String,
}

/// Every program pinned in any program set on the node, by kernel id.
pub fn set_programs() -> BTreeMap<u32, SetProgram> {
    let mut out = BTreeMap::new();
    let Ok(sets) = std::fs::read_dir(PROGRAMS_DIR) else { return out };
    for set in sets.flatten() {
        let key = set.file_name().to_string_lossy().into_owned();
        let Ok(progs) = std::fs::read_dir(set.path().join("progs")) else { continue };
        for prog in progs.flatten() {
            let Ok(fd) = link::obj_get(&prog.path()) else { continue };
            if let Ok(id) = link::prog_id(fd.as_fd()) {
                let name = prog.file_name().to_string_lossy().into_owned();
                out.insert(id, SetProgram { key: key.clone(), name });
            }
        }
    }
    out
}

/// The link pins under `dir/links` (a capture's pin folder), sorted by hook; empty when
/// there are none.
pub fn read_links(dir: &Path, programs: &BTreeMap<u32, SetProgram>) -> Vec<LinkPin> {
    let Ok(entries) = std::fs::read_dir(dir.join("links")) else { return Vec::new() };
    let mut out: Vec<LinkPin> = entries
        .flatten()
        .map(|e| {
            let path = e.path();
            let state = match sys::obj_get(&path).and_then(|fd| sys::link_info(fd.as_fd())) {
                Ok(info) if info.link_type == sys::link_type::CGROUP => {
                    PinState::Cgroup { cgroup_id: info.target, program: programs.get(&info.prog_id).cloned() }
                }
                Ok(info) => PinState::OtherLink { link_type: info.link_type },
                Err(e) => PinState::Unreadable(e.to_string()),
            };
            LinkPin { hook: e.file_name().to_string_lossy().into_owned(), path, state }
        })
        .collect();
    out.sort_by(|a, b| a.hook.cmp(&b.hook));
    out
}

/// What to do with a capture's pins found without (or against) its record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No link pins at all: nothing is attached under this name.
    Empty,
    /// Every pin is a link of one program set (`key`), each running its own hook's
    /// program, attached to the wanted cgroup (`live`) or to nothing (`dead`: their
    /// hooks capture nothing and may be attached again).
    Adopt { key: String, live: Vec<String>, dead: Vec<String> },
    /// Pins Weir cannot take as this capture; each reason names a pin.
    Refuse(Vec<String>),
}

/// Judges `links` as the capture that should run on the cgroup with id `cgroup_id`.
/// Pure: what the kernel said is in `links`.
pub fn judge(links: &[LinkPin], cgroup_id: u64) -> Verdict {
    if links.is_empty() {
        return Verdict::Empty;
    }
    let mut keys: Vec<&str> = Vec::new();
    let (mut live, mut dead, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    for pin in links {
        let at = pin.path.display();
        match &pin.state {
            PinState::Cgroup { program: None, .. } => {
                refused.push(format!("{at} runs a program of no program set pinned under {PROGRAMS_DIR}"))
            }
            PinState::Cgroup { program: Some(p), .. } if p.name != pin.hook => {
                refused.push(format!("{at} runs {} of set {}, not the program its name says", p.name, p.key))
            }
            PinState::Cgroup { cgroup_id: 0, program: Some(p) } => {
                keys.push(&p.key);
                dead.push(pin.hook.clone());
            }
            PinState::Cgroup { cgroup_id: other, program: Some(p) } if *other != cgroup_id => refused
                .push(format!("{at} attaches {} to another cgroup (id {other}, not {cgroup_id})", p.name)),
            PinState::Cgroup { program: Some(p), .. } => {
                keys.push(&p.key);
                live.push(pin.hook.clone());
            }
            PinState::OtherLink { link_type } => {
                refused.push(format!("{at} is a link of type {link_type}, not a cgroup link"))
            }
            PinState::Unreadable(e) => refused.push(format!("{at} cannot be read as a link: {e}")),
        }
    }
    keys.sort_unstable();
    keys.dedup();
    if keys.len() > 1 {
        refused.push(format!(
            "its links run the programs of {} program sets: {}",
            keys.len(),
            keys.join(", ")
        ));
    }
    match (refused.is_empty(), keys.first()) {
        (true, Some(key)) => Verdict::Adopt { key: (*key).to_string(), live, dead },
        _ => Verdict::Refuse(refused),
    }
}

/// Other captures (pin folders under [`PIN_ROOT`] not named in `skip`) with a link
/// attached to the cgroup `cgroup_id`: a second attachment there would run every hook
/// twice. Returns each capture's name and its hooks on that cgroup.
pub fn captures_on_cgroup(
    cgroup_id: u64,
    skip: impl Fn(&str) -> bool,
    programs: &BTreeMap<u32, SetProgram>,
) -> Vec<(String, Vec<String>)> {
    let Ok(entries) = std::fs::read_dir(PIN_ROOT) else { return Vec::new() };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "programs" || skip(&name) {
            continue;
        }
        let hooks: Vec<String> = read_links(&entry.path(), programs)
            .into_iter()
            .filter(|p| matches!(p.state, PinState::Cgroup { cgroup_id: c, .. } if c == cgroup_id))
            .map(|p| p.hook)
            .collect();
        if !hooks.is_empty() {
            out.push((name, hooks));
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pin(hook: &str, cgroup_id: u64, key: Option<&str>) -> LinkPin {
        LinkPin {
            hook: hook.into(),
            path: PathBuf::from(format!("/sys/fs/bpf/weir/n/links/{hook}")),
            state: PinState::Cgroup {
                cgroup_id,
                program: key.map(|k| SetProgram { key: k.into(), name: hook.into() }),
            },
        }
    }

    #[test]
    fn links_of_one_set_on_the_wanted_cgroup_are_adopted_and_detached_ones_named_dead() {
        let v = judge(&[pin("weir_connect4", 7, Some("k1")), pin("weir_sockops", 0, Some("k1"))], 7);
        assert_eq!(
            v,
            Verdict::Adopt {
                key: "k1".into(),
                live: vec!["weir_connect4".into()],
                dead: vec!["weir_sockops".into()]
            }
        );
        assert_eq!(judge(&[], 7), Verdict::Empty);
    }

    #[test]
    fn pins_on_another_cgroup_of_unknown_programs_or_of_two_sets_are_refused_naming_each() {
        for (links, expect) in [
            (vec![pin("weir_connect4", 9, Some("k1"))], "another cgroup (id 9, not 7)"),
            (vec![pin("weir_connect4", 7, None)], "a program of no program set"),
            (
                vec![pin("weir_connect4", 7, Some("k1")), pin("weir_sockops", 7, Some("k2"))],
                "2 program sets: k1, k2",
            ),
        ] {
            let Verdict::Refuse(why) = judge(&links, 7) else { panic!("{links:?} adopted") };
            assert!(why.iter().any(|w| w.contains(expect)), "{why:?}");
        }
        let mut swapped = pin("weir_connect4", 7, Some("k1"));
        swapped.state = PinState::Cgroup {
            cgroup_id: 7,
            program: Some(SetProgram { key: "k1".into(), name: "weir_connect6".into() }),
        };
        assert!(matches!(judge(&[swapped], 7), Verdict::Refuse(_)));
        let other = LinkPin { state: PinState::OtherLink { link_type: 8 }, ..pin("inbound", 7, None) };
        assert!(matches!(judge(&[other], 7), Verdict::Refuse(_)));
    }
}
