//! The edge of the ancestor check: what the kernel says each ancestor of a capture
//! cgroup has attached (`BPF_PROG_QUERY` per attach type, each program's name and type
//! by `BPF_PROG_GET_FD_BY_ID` and `BPF_OBJ_GET_INFO_BY_FD`), and which of them run
//! before a program attached at the capture cgroup (`BPF_F_PREORDER`, which no query
//! reports): told by the capture cgroup's effective order, with a pass-through probe
//! attached there for the moment of the query when it has no program of its own. A
//! failed read is an error naming the cgroup and the kernel's errno, never an empty
//! list.

use std::{
    fs::File,
    os::fd::{AsFd as _, BorrowedFd},
    path::{Path, PathBuf},
};

use super::{Ancestor, Attachment, FORWARD_HOOKS, Layout, PREORDER, Program, blockers, effective, hook_name};
use crate::capture::ebpf::{link::CgroupLink, sys};

/// Whether reading may attach a pass-through probe to the capture cgroup for a moment,
/// to tell an ancestor's `BPF_F_PREORDER` (needed only where the capture cgroup has no
/// program of its own on a hook that rewrites the destination).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// Before attaching Weir: the probe runs nothing but `return 1`, on a cgroup Weir is
    /// about to attach to, and is detached before this returns.
    Attach,
    /// Read only (status, explain): where the order cannot be told without a probe, no
    /// program is taken for `BPF_F_PREORDER`.
    Never,
    /// The capture cgroup has Weir's own links (a node capture, checked per pod): the
    /// order is read from them; a hook without one is an error, never a probe per ADD.
    Own,
}

/// Why what the cgroups above a capture cgroup run could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read what the cgroups above {} run: no cgroup v2 mount ({error})", capture.display())]
    NoMount { capture: PathBuf, error: String },
    #[error(
        "cannot read what the cgroups above {} run: it is not a directory under the cgroup v2 mount {}",
        capture.display(), mount.display()
    )]
    NotUnderMount { capture: PathBuf, mount: PathBuf },
    #[error("cannot read what the cgroups above {} run: open {}: {error}", capture.display(), cgroup.display())]
    Open { capture: PathBuf, cgroup: PathBuf, error: std::io::Error },
    #[error(
        "cannot read what the cgroups above {} run: BPF_PROG_QUERY for {hook} on {} failed: {error}",
        capture.display(), cgroup.display()
    )]
    Query { capture: PathBuf, cgroup: PathBuf, hook: String, error: std::io::Error },
    #[error(
        "cannot read what the cgroups above {} run: program {id} on {hook} of {}: {error}",
        capture.display(), cgroup.display()
    )]
    Program { capture: PathBuf, cgroup: PathBuf, hook: String, id: u32, error: std::io::Error },
    #[error(
        "cannot tell which programs above {} run before its own on {hook}: {what}: {error}",
        capture.display()
    )]
    Order { capture: PathBuf, hook: String, what: &'static str, error: std::io::Error },
    #[error(
        "cannot judge what runs for {} on {hook}: program {id} runs for it but is attached to no cgroup \
         visible from here (its ancestors above {} are hidden: a cgroup namespace without the node's \
         cgroup tree mounted?), or was attached while it was read",
        capture.display(), visible_root.display()
    )]
    Unaccounted { capture: PathBuf, hook: String, id: u32, visible_root: PathBuf },
}

/// Reads what every ancestor of `capture` (its parent up to the cgroup2 root) has
/// attached for `hooks`, and marks with [`PREORDER`] the programs that run before one
/// attached at `capture` on a hook that rewrites the destination.
pub fn read(capture: &Path, hooks: &[u32], probe: Probe) -> Result<Layout, ReadError> {
    // A program detached between the query and the look-up by id is read again.
    let mut tries = 0;
    loop {
        tries += 1;
        match read_once(capture, hooks, probe) {
            Err(ReadError::Program { error, .. })
                if error.kind() == std::io::ErrorKind::NotFound && tries < 3 => {}
            Err(ReadError::Unaccounted { .. }) if tries < 3 => {}
            done => return done,
        }
    }
}

fn read_once(capture: &Path, hooks: &[u32], probe: Probe) -> Result<Layout, ReadError> {
    let mut ancestors = Vec::new();
    for cgroup in ancestors_of(capture)? {
        ancestors.push(read_cgroup(capture, &cgroup, hooks)?);
    }
    let mut layout = Layout { capture: capture.to_path_buf(), ancestors };
    account_for_effective(&layout, hooks)?;
    mark_preorder(&mut layout, hooks, probe)?;
    Ok(layout)
}

/// Every program the kernel runs for the capture cgroup (its effective list) must be
/// attached to it or to an ancestor read here: one that is not was attached above what
/// this process sees of the tree (a cgroup namespace), and nothing can be said of how
/// it was attached. An error, never "nothing there".
fn account_for_effective(layout: &Layout, hooks: &[u32]) -> Result<(), ReadError> {
    let capture = &layout.capture;
    let dir = open(capture, capture)?;
    for &hook in hooks {
        let query = |what: &'static str| {
            let capture = capture.clone();
            move |error| ReadError::Order { capture, hook: hook_name(hook), what, error }
        };
        let own = sys::query_cgroup(dir.as_fd(), hook).map_err(query("query its own programs"))?;
        let effective =
            sys::query_effective(dir.as_fd(), hook).map_err(query("query its effective programs"))?;
        let known = |id: &u32| {
            own.programs.iter().any(|(p, _)| p == id)
                || layout
                    .ancestors
                    .iter()
                    .any(|a| a.on(hook).is_some_and(|x| x.programs.iter().any(|p| p.id == *id)))
        };
        if let Some(&id) = effective.iter().find(|id| !known(id)) {
            let visible_root = layout.ancestors.last().map_or_else(|| capture.clone(), |a| a.cgroup.clone());
            return Err(ReadError::Unaccounted {
                capture: capture.clone(),
                hook: hook_name(hook),
                id,
                visible_root,
            });
        }
    }
    Ok(())
}

/// The ancestors of `capture`, its parent first, up to and with the cgroup2 mount.
fn ancestors_of(capture: &Path) -> Result<Vec<PathBuf>, ReadError> {
    let mount = crate::support::cgroup2::mount()
        .map_err(|e| ReadError::NoMount { capture: capture.into(), error: e.to_string() })?;
    let not_under = || ReadError::NotUnderMount { capture: capture.into(), mount: mount.clone() };
    let real = std::fs::canonicalize(capture).map_err(|error| ReadError::Open {
        capture: capture.into(),
        cgroup: capture.into(),
        error,
    })?;
    let root = std::fs::canonicalize(&mount).unwrap_or_else(|_| mount.clone());
    if !real.starts_with(&root) || !real.is_dir() {
        return Err(not_under());
    }
    Ok(real.ancestors().skip(1).take_while(|p| p.starts_with(&root)).map(Path::to_path_buf).collect())
}

fn open(capture: &Path, cgroup: &Path) -> Result<File, ReadError> {
    File::open(cgroup).map_err(|error| ReadError::Open {
        capture: capture.into(),
        cgroup: cgroup.into(),
        error,
    })
}

/// One ancestor's attachments for `hooks`, each program named.
fn read_cgroup(capture: &Path, cgroup: &Path, hooks: &[u32]) -> Result<Ancestor, ReadError> {
    let dir = open(capture, cgroup)?;
    let mut out = Ancestor { cgroup: cgroup.to_path_buf(), hooks: Vec::new() };
    for &hook in hooks {
        let q = sys::query_cgroup(dir.as_fd(), hook).map_err(|error| ReadError::Query {
            capture: capture.into(),
            cgroup: cgroup.into(),
            hook: hook_name(hook),
            error,
        })?;
        let mut programs = Vec::new();
        for (id, flags) in q.programs {
            let named = sys::prog_fd_by_id(id).and_then(|fd| sys::prog_type_and_name(fd.as_fd()));
            let (prog_type, name) = named.map_err(|error| ReadError::Program {
                capture: capture.into(),
                cgroup: cgroup.into(),
                hook: hook_name(hook),
                id,
                error,
            })?;
            programs.push(Program { id, name, prog_type, flags });
        }
        out.hooks.push((hook, Attachment { flags: q.attach_flags, programs }));
    }
    Ok(out)
}

/// Marks the ancestor programs that run before one attached at the capture cgroup, on
/// each rewriting hook where ancestor programs would run after Weir's and nothing else
/// stands in the way (where something does, the probe would change what runs).
fn mark_preorder(layout: &mut Layout, hooks: &[u32], probe: Probe) -> Result<(), ReadError> {
    let capture = layout.capture.clone();
    let mut dir = None;
    for &hook in hooks.iter().filter(|h| FORWARD_HOOKS.contains(h)) {
        if effective(layout, hook, 1).is_empty() || !blockers(layout, &[hook]).is_empty() {
            continue;
        }
        let dir = match &dir {
            Some(d) => d,
            None => dir.insert(open(&capture, &capture)?),
        };
        let Some(first) = run_first(&capture, dir.as_fd(), hook, probe)? else { continue };
        for ancestor in &mut layout.ancestors {
            for (_, a) in ancestor.hooks.iter_mut().filter(|(t, _)| *t == hook) {
                for p in a.programs.iter_mut().filter(|p| first.contains(&p.id)) {
                    p.flags |= PREORDER;
                }
            }
        }
    }
    Ok(())
}

/// The ids of the programs that run before the capture cgroup's own on `hook` (the
/// kernel puts `BPF_F_PREORDER` programs, root first, before every other): those
/// before its last own program in its effective list. `None` when it has none and
/// `probe` forbids attaching one.
fn run_first(
    capture: &Path,
    dir: BorrowedFd<'_>,
    hook: u32,
    probe: Probe,
) -> Result<Option<Vec<u32>>, ReadError> {
    let order = |what: &'static str| {
        let capture = capture.to_path_buf();
        move |error| ReadError::Order { capture, hook: hook_name(hook), what, error }
    };
    let own =
        |d| sys::query_cgroup(d, hook).map(|q| q.programs.into_iter().map(|(id, _)| id).collect::<Vec<_>>());
    let mut mine = own(dir).map_err(order("query its own programs"))?;
    // Held until the effective list is read; dropped (detached) on return.
    let mut _probe = None;
    if mine.is_empty() {
        match probe {
            Probe::Never => return Ok(None),
            Probe::Own => {
                let missing =
                    std::io::Error::other("no program of its own there (a link of the capture is missing)");
                return Err(order("find its own program")(missing));
            }
            Probe::Attach => {}
        }
        let program = sys::load_pass_sock_addr(hook, "weir_order_prb").map_err(order("load the probe"))?;
        let link = CgroupLink::create(program.as_fd(), dir, hook).map_err(order("attach the probe"))?;
        _probe = Some((link, program));
        mine = own(dir).map_err(order("query its own programs"))?;
    }
    let effective = sys::query_effective(dir, hook).map_err(order("query its effective programs"))?;
    let Some(last) = effective.iter().rposition(|id| mine.contains(id)) else {
        // Its own program is not in its effective list: detached meanwhile, or the
        // kernel's order is not what this reads. Not "nothing runs first".
        let missing = std::io::Error::other(format!(
            "its own programs {mine:?} are not in its effective list {effective:?}"
        ));
        return Err(order("read the order")(missing));
    };
    Ok(Some(effective[..last].iter().copied().filter(|id| !mine.contains(id)).collect()))
}
