//! The node capture (`weir cni install --ebpf-cgroup`): the node program set linked to
//! the cgroup that holds the node's pods, its links pinned under `<bpffs>/weir/<node
//! capture>/links` and recorded in `/run/weir/capture/<node capture>.json`. Attaching
//! takes what bpffs holds as the truth, not the record: pins whose record was lost are
//! adopted when they check out, or refused and left attached; a record whose pins are
//! gone is attached again; another build's capture is kept, renamed for its set, while
//! its pods remain; a capture of another name on the same cgroup is refused. Nothing
//! found attached is removed here but by [`detach_node`] (`weir cni uninstall`), and a
//! failure takes back only what the failing call attached.

use std::{fs::File, path::Path};

use nix::fcntl::{Flock, FlockArg};

use super::ebpf::{CniEbpfError, io, pod_prefix, retired_name};
use crate::capture::ebpf::{
    bpffs, link, pins,
    record::{PinRecord, RECORD_DIR, pin_dir},
    set::{self, LockedSet, NodePrograms},
};

/// Serialises attaching, retiring and collecting a node's captures (a DaemonSet
/// rollout may run two agents at once).
fn node_lock(name: &str) -> Result<Flock<File>, CniEbpfError> {
    std::fs::create_dir_all(RECORD_DIR).map_err(io(format!("create {RECORD_DIR}")))?;
    let path = Path::new(RECORD_DIR).join(format!(".{name}.lock"));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io(format!("open {}", path.display())))?;
    Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, e)| io(format!("lock {}", path.display()))(std::io::Error::from(e)))
}

/// Moves a node capture's record and link pins to `to` (the links stay attached: each
/// is pinned at its new place before its old pin goes). Where `to` has a live link of
/// the same program for a hook already, ours is a second copy of it and goes; a dead
/// link there (it runs nothing) gives way to ours; anything else there is refused
/// ([`crate::capture::ebpf::EbpfError::ForeignPin`]). Nothing else of `to` is touched.
fn rename_capture(record: &PinRecord, to: &str) -> Result<PinRecord, CniEbpfError> {
    let mut moved = record.clone();
    moved.pod = to.to_string();
    let (from_links, to_links) = (record.pin_dir().join("links"), moved.pin_dir().join("links"));
    let cgroup_id = link::cgroup_id(&record.cgroup).ok();
    bpffs::create_dir(&to_links)?;
    for entry in
        std::fs::read_dir(&from_links).map_err(io(format!("read {}", from_links.display())))?.flatten()
    {
        let (from, target) = (entry.path(), to_links.join(entry.file_name()));
        let program = |pin: &Path| {
            crate::capture::ebpf::sys::obj_get(pin)
                .and_then(|fd| link::link_prog_id(std::os::fd::AsFd::as_fd(&fd)))
        };
        let live_there = cgroup_id.is_some_and(|id| link::attached_to(&target, id).unwrap_or(false));
        if live_there {
            if program(&target).ok() != program(&from).ok() {
                return Err(CniEbpfError::Ebpf(Box::new(crate::capture::ebpf::EbpfError::ForeignPin {
                    path: target,
                    what: format!("a live link of another program than {}'s", from.display()),
                })));
            }
            std::fs::remove_file(&from).map_err(io(format!("remove the second copy {}", from.display())))?;
            continue;
        }
        // Only a detached link gives way: a pin live elsewhere, or anything but a link,
        // is not this capture's to remove.
        if target.exists() {
            let detached = crate::capture::ebpf::sys::obj_get(&target)
                .and_then(|fd| crate::capture::ebpf::sys::link_info(std::os::fd::AsFd::as_fd(&fd)))
                .is_ok_and(|info| info.target == 0);
            if !detached {
                return Err(CniEbpfError::Ebpf(Box::new(crate::capture::ebpf::EbpfError::ForeignPin {
                    path: target,
                    what: format!("a pin that is not a detached link, where {} would go", from.display()),
                })));
            }
            match std::fs::remove_file(&target) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io(format!("remove the detached link {}", target.display()))(e));
                }
                _ => {}
            }
        }
        link::move_pin(&from, &target).map_err(io(format!("move the pin {}", from.display())))?;
    }
    moved.save().map_err(io("write the node capture record"))?;
    // Empty now: only the folders go (a pin left there would fail this, never be lost).
    let _ = std::fs::remove_dir(&from_links);
    std::fs::remove_dir(record.pin_dir()).map_err(io(format!("remove {}", record.pin_dir().display())))?;
    let _ = std::fs::remove_file(PinRecord::path(&record.pod));
    Ok(moved)
}

/// The record of node capture `name` on `cgroup` running the set `key`.
fn node_capture_record(name: &str, cgroup: &Path, key: &str) -> PinRecord {
    PinRecord {
        pod: name.into(),
        cgroup: cgroup.into(),
        netns: None,
        netns_cookie: 0,
        interface: None,
        programs: Some(key.to_string()),
        registration: None,
        k8s_pod: None,
        pod_uid: None,
        container: None,
    }
}

/// Node capture `name` as its pins say it is, its record made to agree with them:
/// `None` when nothing is pinned under the name. Pins without a record (or against
/// it) are adopted when they are a capture of `cgroup` by one pinned program set, and
/// refused otherwise, left attached. A record whose pins are gone is replaced; when it
/// named another build's set that still has pods, that set is linked again under its
/// retired name so its pods are captured again.
fn pinned_node_capture(name: &str, cgroup: &Path) -> Result<Option<PinRecord>, CniEbpfError> {
    let record = PinRecord::load(name);
    let dir = pin_dir(name);
    let programs = pins::set_programs();
    let found = pins::read_links(&dir, &programs);
    if let Some(r) = &record
        && r.cgroup != cgroup
        && !found.is_empty()
    {
        return Err(CniEbpfError::OtherCgroup {
            name: name.into(),
            existing: r.cgroup.clone(),
            wanted: cgroup.into(),
        });
    }
    let cgroup_id =
        link::cgroup_id(cgroup).map_err(io(format!("read the id of the cgroup {}", cgroup.display())))?;
    match pins::judge(&found, cgroup_id) {
        pins::Verdict::Refuse(why) => Err(CniEbpfError::PinsRefused {
            name: name.into(),
            dir,
            cgroup: cgroup.into(),
            record: if record.is_some() { "its record" } else { "no record" },
            why: why.join("; "),
        }),
        pins::Verdict::Adopt { key, live, dead } => {
            if let Some(r) = record.filter(|r| r.programs.as_deref() == Some(key.as_str())) {
                return Ok(Some(r));
            }
            let adopted = node_capture_record(name, cgroup, &key);
            adopted.save().map_err(io("write the node capture record"))?;
            tracing::warn!(
                node_capture = name,
                program_set = %key,
                live = %live.join(","),
                dead = %dead.join(","),
                record = %PinRecord::path(name).display(),
                "node capture found on bpffs without its record: adopted (its links checked: this cgroup, one program set), record written from its pins"
            );
            Ok(Some(adopted))
        }
        pins::Verdict::Empty => {
            if let Some(r) = record {
                tracing::warn!(node_capture = name, program_set = ?r.programs, "the node capture's record names pins that are gone: attaching again");
                if let Some(key) = r.programs.as_deref().filter(|k| *k != set::version_key()) {
                    relink_retired(name, cgroup, key);
                }
            }
            Ok(None)
        }
    }
}

/// Links another build's set `key` to `cgroup` again under its retired name, when its
/// node capture's pins were lost while pods are still registered in it (they are
/// uncaptured until then). Logged, never fatal: this build's capture comes next.
fn relink_retired(name: &str, cgroup: &Path, key: &str) {
    let retired = node_capture_record(&retired_name(name, key), cgroup, key);
    let relink = || -> Result<usize, CniEbpfError> {
        let pods = match LockedSet::open(key)? {
            Some(set) => set.pod_count()?,
            None => 0,
        };
        if pods == 0 {
            return Ok(0);
        }
        let Some(set) = NodePrograms::open_existing(key)? else { return Ok(0) };
        let attached = set.ensure_cgroup(cgroup, &retired.pin_dir())?;
        if let Err(e) = retired.save() {
            for hook in &attached {
                let _ = std::fs::remove_file(retired.pin_dir().join("links").join(hook));
            }
            return Err(io("write the retired node capture record")(e));
        }
        Ok(pods)
    };
    match relink() {
        Ok(0) => {}
        Ok(pods) => {
            tracing::warn!(node_capture = name, program_set = key, pods, kept_as = %retired.pod, "another build's set had lost its links: linked again for its pods")
        }
        Err(e) => {
            tracing::warn!(node_capture = name, program_set = key, error = %crate::error_chain(&e), "another build's set not linked again: its pods stay uncaptured until they are added again")
        }
    }
}

/// Refuses to attach to `cgroup` where a capture of another name has links on it
/// already: each hook would run twice.
fn no_other_capture_on(name: &str, cgroup: &Path) -> Result<(), CniEbpfError> {
    let cgroup_id =
        link::cgroup_id(cgroup).map_err(io(format!("read the id of the cgroup {}", cgroup.display())))?;
    let retired = format!("{name}-set-");
    let others = pins::captures_on_cgroup(
        cgroup_id,
        |capture| capture == name || capture.starts_with(&retired),
        &pins::set_programs(),
    );
    match others.into_iter().next() {
        None => Ok(()),
        Some((other, hooks)) => Err(CniEbpfError::OtherName {
            name: name.into(),
            other: other.clone(),
            dir: pin_dir(&other),
            cgroup: cgroup.into(),
            hooks: hooks.join(", "),
        }),
    }
}

/// Links the node program set to `cgroup` and pins the links; an existing node
/// capture of this build on the same cgroup is kept (its links attached again if they
/// were detached). Another build's node capture is kept attached, renamed for its set,
/// while its pods remain. What is found on bpffs decides, not the record (see
/// [`pinned_node_capture`]); nothing found attached is ever removed here, and a
/// failure takes back only what this call attached. Returns whether anything was
/// attached now.
pub fn attach_node(name: &str, cgroup: &Path) -> Result<bool, CniEbpfError> {
    let _lock = node_lock(name)?;
    let this = set::version_key();
    if let Some(record) = pinned_node_capture(name, cgroup)? {
        if record.programs.as_deref() == Some(this.as_str()) {
            let set = NodePrograms::open_existing(&this)?
                .ok_or_else(|| CniEbpfError::NoNodeCapture { name: name.into() })?;
            let hooks = set.ensure_cgroup(cgroup, &record.pin_dir())?;
            if hooks.is_empty() {
                return Ok(false);
            }
            tracing::warn!(node_capture = name, hooks = %hooks.join(","), "the node capture's links were detached or gone: attached again");
            return Ok(true);
        }
        let key = record.programs.clone().unwrap_or_default();
        let retired = retired_name(name, &key);
        rename_capture(&record, &retired)?;
        tracing::info!(node_capture = name, program_set = %key, kept_as = %retired, "another build's node capture kept for its pods");
    }
    if let Some(retired) = PinRecord::load(&retired_name(name, &this)).filter(|r| r.pin_dir().exists()) {
        // Rolled back to a build whose set is still attached: it becomes the node
        // capture again, never attached twice.
        let record = rename_capture(&retired, name)?;
        let set = NodePrograms::open_existing(&this)?
            .ok_or_else(|| CniEbpfError::NoNodeCapture { name: name.into() })?;
        set.ensure_cgroup(cgroup, &record.pin_dir())?;
        tracing::info!(node_capture = name, program_set = %this, "this build's node capture taken up again");
        return Ok(true);
    }
    no_other_capture_on(name, cgroup)?;
    let set = NodePrograms::acquire()?;
    let record = node_capture_record(name, cgroup, set.key());
    let attached = match set.ensure_cgroup(cgroup, &record.pin_dir()) {
        Ok(attached) => attached,
        Err(e) => {
            let _ = set.release();
            return Err(e.into());
        }
    };
    if let Err(e) = record.save() {
        for hook in &attached {
            let _ = std::fs::remove_file(record.pin_dir().join("links").join(hook));
        }
        let _ = set.release();
        return Err(io("write the node capture record")(e));
    }
    Ok(true)
}

/// Removes the retired attachments of node capture `name` whose sets no pod uses any
/// more (no pod registered in their maps); returns their names.
pub fn collect_retired(name: &str) -> Result<Vec<String>, CniEbpfError> {
    let _lock = node_lock(name)?;
    let prefix = format!("{name}-set-");
    let mut removed = Vec::new();
    for record in PinRecord::load_all().into_iter().filter(|r| r.pod.starts_with(&prefix)) {
        let Some(key) = record.programs.clone() else { continue };
        // Counted and unpinned under the set's lock: a pod that another build's plugin
        // registers meanwhile waits, and then finds the set gone rather than unlinked.
        let set = LockedSet::open(&key)?;
        if set.as_ref().map(LockedSet::pod_count).transpose()?.unwrap_or(0) > 0 {
            continue;
        }
        bpffs::unpin(&record.pin_dir())?;
        let _ = std::fs::remove_file(PinRecord::path(&record.pod));
        if let Some(set) = set {
            set.release()?;
        }
        tracing::info!(node_capture = name, program_set = %key, "another build's node capture removed with its last pod");
        removed.push(record.pod);
    }
    Ok(removed)
}

/// After a DEL took a pod out of set `key`: the attachment kept for that set (another
/// build's) goes if that was its last pod.
pub fn collect_retired_after(node: &str, key: Option<&str>) -> Result<(), CniEbpfError> {
    if let Some(key) = key
        && PinRecord::load(&retired_name(node, key)).is_some()
    {
        collect_retired(node)?;
    }
    Ok(())
}

/// Detaches the node capture, every attachment it kept for other builds' sets, and
/// every pod record made against them: capture is taken away from the node's pods.
pub fn detach_node(name: &str) -> Result<(), CniEbpfError> {
    let _lock = node_lock(name)?;
    let (pods, retired) = (pod_prefix(name), format!("{name}-set-"));
    let sets = sets_of(name, &PinRecord::load_all());
    for record in PinRecord::load_all().into_iter().filter(|r| r.pod.starts_with(&pods)) {
        record.remove()?;
        // An ambient pod keeps running uncaptured by eBPF: its accepted sockets must not
        // take ztunnel's mark any more (a later capture by rules relies on that).
        // Only a path in a runtime's form that still names the recorded namespace.
        let recorded = |p: &&Path| {
            crate::node::enroll::netns_path::NetnsPath::parse(&p.to_string_lossy()).is_ok()
                && crate::capture::ebpf::netns::netns_cookie(Some(p)).is_ok_and(|c| c == record.netns_cookie)
        };
        if record.pod.starts_with(&format!("{pods}ambient-"))
            && let Some(netns) = record.netns.as_deref().filter(recorded)
            && let Err(e) = weir_iptables::ambient::clear_inpod_ebpf(netns)
        {
            tracing::warn!(capture = %record.pod, error = %crate::error_chain(&e), "tcp_fwmark_accept not reset in a detached ambient pod");
        }
    }
    for record in PinRecord::load_all().into_iter().filter(|r| r.pod.starts_with(&retired)) {
        record.remove()?;
    }
    // Pods registered through it whose records were lost: taken out by cookie (those
    // another capture records are not its pods).
    for key in sets {
        if let Some(mut set) = NodePrograms::open_existing(&key)? {
            // Read under the set's lock: a registration and its record are made under it.
            let recorded: std::collections::BTreeSet<u64> =
                PinRecord::load_all().into_iter().map(|r| r.netns_cookie).collect();
            for cookie in set.maps().pods()?.into_iter().filter(|c| !recorded.contains(c)) {
                set.unregister(cookie, None)?;
            }
        }
    }
    match PinRecord::load(name) {
        Some(record) => record.remove()?,
        None => bpffs::unpin(&pin_dir(name))?,
    }
    Ok(())
}

/// The program sets node capture `name` runs, its own and those it keeps for other
/// builds: from their records and from what their pins run (records can be lost).
fn sets_of(name: &str, records: &[PinRecord]) -> Vec<String> {
    let programs = pins::set_programs();
    let retired = format!("{name}-set-");
    let mut keys: Vec<String> = records
        .iter()
        .filter(|r| r.pod == name || r.pod.starts_with(&retired))
        .filter_map(|r| r.programs.clone())
        .collect();
    if let Ok(entries) = std::fs::read_dir(crate::capture::ebpf::bpffs::PIN_ROOT) {
        for entry in entries.flatten() {
            let capture = entry.file_name().to_string_lossy().into_owned();
            if capture != name && !capture.starts_with(&retired) {
                continue;
            }
            for pin in pins::read_links(&entry.path(), &programs) {
                if let pins::PinState::Cgroup { program: Some(p), .. } = pin.state {
                    keys.push(p.key);
                }
            }
        }
    }
    keys.sort();
    keys.dedup();
    keys
}

/// How many pods the sets node capture `name` runs (its own and those it keeps for
/// other builds) have registered, counted in their maps rather than by records, which
/// can be lost: what an uninstall without `--detach-running-pods` must leave captured.
/// A pod is left out when the node's view shows its namespace gone (`cgroup` holds the
/// node's pods).
/// Namespaces recorded as another capture's (an init-container pod, another node
/// capture sharing the set) are not this capture's pods.
pub fn pods_registered(name: &str, cgroup: &Path) -> Result<usize, CniEbpfError> {
    let records = PinRecord::load_all();
    let keys = sets_of(name, &records);
    let ours = format!("{name}-");
    let others: std::collections::BTreeSet<u64> =
        records.iter().filter(|r| !r.pod.starts_with(&ours)).map(|r| r.netns_cookie).collect();
    // The registrations first, then the node's namespaces: a pod registered after its
    // namespace was looked for would otherwise count as gone.
    let mut cookies = Vec::new();
    for key in keys {
        if let Some(set) = LockedSet::open(&key)? {
            cookies.extend(set.pod_cookies()?.into_iter().filter(|c| !others.contains(c)));
        }
    }
    // A pod shown gone (the node's whole view: hostPID) is not kept captured.
    let view = crate::capture::ebpf::gc::node_view(Path::new("/proc"));
    Ok(cookies.into_iter().filter(|c| !crate::capture::ebpf::gc::cookie_gone(&view, *c, cgroup)).count())
}
