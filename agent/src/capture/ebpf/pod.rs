//! One pod's capture on the node program set (init-container mode, `weir capture
//! ebpf`): the set's programs linked to the pod's cgroup, its namespace registered in
//! the set's maps, the inbound classifier on its interface, all pinned under
//! `<bpffs>/weir/<pod>/links` and recorded, so capture stays live after the command
//! exits. Nothing is loaded unless the node has no set for this Weir yet.

use std::path::PathBuf;

use super::{
    EbpfError,
    config::PodCapture,
    record::{PinRecord, pin_dir},
    set::{NodePrograms, PodInterface},
};

/// Where one pod is captured.
#[derive(Debug, Clone)]
pub struct PodTarget {
    /// The capture's name (its pins and record).
    pub name: String,
    /// The pod's cgroup v2 directory.
    pub cgroup: PathBuf,
    /// The pod's network namespace; `None`: this process's.
    pub netns: Option<PathBuf>,
    /// The pod interface inbound capture attaches to.
    pub interface: String,
}

impl PodTarget {
    fn netns_path(&self) -> PathBuf {
        self.netns.clone().unwrap_or_else(|| PathBuf::from("/proc/self/ns/net"))
    }
}

/// Captures the pod registered as `cookie` with `pod`'s settings; returns its record.
/// What is live already is kept and only what is missing is added: a capture of this
/// set found under the name (its record, or pins whose record was lost) is made whole
/// in place. On failure only what this call added goes (and a set it loaded, if
/// nothing else uses it); a pod that was captured stays captured.
pub fn capture(target: &PodTarget, cookie: u64, pod: &PodCapture) -> Result<PinRecord, EbpfError> {
    capture_in_set(&super::set::version_key(), target, cookie, pod)
}

/// As [`capture`], with the program set `key` (loaded from this binary's objects if the
/// node does not have it).
pub fn capture_in_set(
    key: &str,
    target: &PodTarget,
    cookie: u64,
    pod: &PodCapture,
) -> Result<PinRecord, EbpfError> {
    super::record::check_name(&target.name)
        .map_err(|e| EbpfError::Io { what: "name the capture", source: std::io::Error::other(e) })?;
    let mut set = NodePrograms::acquire_key(key)?;
    // This pod's registration in the set, by its record (replaced in one switch), or
    // without one (a record lost: its entries are orphans the collector takes).
    let previous = PinRecord::load(&target.name)
        .filter(|r| r.netns_cookie == cookie && r.programs.as_deref() == Some(set.key()))
        .and_then(|r| r.registration);
    let was_registered = previous.is_some() || set.maps().pod_config(cookie)?.is_some();
    let mut record = PinRecord {
        pod: target.name.clone(),
        cgroup: target.cgroup.clone(),
        netns: target.netns.clone(),
        netns_cookie: cookie,
        interface: pod.inbound.map(|_| target.interface.clone()),
        programs: Some(set.key().to_string()),
        registration: None,
        k8s_pod: None,
        pod_uid: None,
        container: None,
    };
    let dir = pin_dir(&target.name);
    let netns = target.netns_path();
    // Pins under the name that are not this set's hooks on this cgroup are refused
    // before the pod's registration is touched.
    if let Err(e) = set.check_cgroup_pins(&target.cgroup, &dir) {
        let _ = set.release();
        return Err(e);
    }
    let registration = match set.register(
        cookie,
        pod,
        Some(PodInterface { netns: &netns, name: &target.interface, mac: None }),
        previous.as_ref(),
    ) {
        Ok(r) => r,
        Err(e) => {
            let _ = set.release();
            return Err(e);
        }
    };
    record.registration = Some(registration);
    let mut attached = Vec::new();
    let mut filter_added = false;
    let done = (|| {
        attached = set.ensure_cgroup(&target.cgroup, &dir)?;
        filter_added = set.attach_inbound(&netns, cookie, &target.interface, pod, &dir)?;
        record.save().map_err(|source| EbpfError::Io { what: "write the capture record", source })
    })();
    if let Err(e) = done {
        // Exactly what this call added goes; what was live before stays.
        if !was_registered {
            let _ = set.unregister(cookie, record.registration.as_ref());
        }
        for hook in &attached {
            let _ = std::fs::remove_file(dir.join("links").join(hook));
        }
        if filter_added && let Some(interface) = &record.interface {
            super::inbound::detach_inbound(Some(&netns), interface, cookie);
        }
        let _ = set.release();
        return Err(e);
    }
    tracing::info!(
        pod = %target.name,
        cgroup = %target.cgroup.display(),
        netns_cookie = cookie,
        program_set = set.key(),
        hooks_attached = attached.len(),
        "pod captured with the node's eBPF programs"
    );
    Ok(record)
}

/// Replaces the settings of a pod captured already, in one switch (no gap in capture);
/// returns its record with the new registration (saved).
pub fn update(record: &PinRecord, pod: &PodCapture) -> Result<PinRecord, EbpfError> {
    let mut record = record.clone();
    match &record.programs {
        Some(key) => {
            let mut set = NodePrograms::open_existing(key)?.ok_or_else(|| EbpfError::Pin {
                path: super::set::set_dir(key).display().to_string(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "the pod's program set is gone"),
            })?;
            let netns = record.netns.clone().unwrap_or_else(|| PathBuf::from("/proc/self/ns/net"));
            let inbound =
                record.interface.as_deref().map(|name| PodInterface { netns: &netns, name, mac: None });
            let registration =
                set.register(record.netns_cookie, pod, inbound, record.registration.as_ref())?;
            record.registration = Some(registration);
        }
        // A capture with maps of its own (made before program sets).
        None => {
            let mut maps = super::capture::MapSet::open_pinned(&record.pin_dir())?;
            record.registration =
                Some(maps.register(record.netns_cookie, pod, record.registration.as_ref())?);
        }
    }
    record.save().map_err(|source| EbpfError::Io { what: "write the capture record", source })?;
    Ok(record)
}

/// The maps a record's capture uses: its program set's, or its own.
pub fn maps_of(record: &PinRecord) -> Result<super::capture::MapSet, EbpfError> {
    super::capture::MapSet::open_pinned(&maps_dir(record))
}

/// The folder whose `maps/` a record's capture uses.
pub fn maps_dir(record: &PinRecord) -> PathBuf {
    match &record.programs {
        Some(key) => super::set::set_dir(key),
        None => record.pin_dir(),
    }
}
