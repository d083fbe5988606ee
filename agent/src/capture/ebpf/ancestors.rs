//! Whether the programs other agents attached to the cgroups above a capture cgroup
//! leave eBPF capture safe there: the pure judgement ([`blockers`]) over what the
//! kernel says is attached ([`Layout`], read by [`read`]), and [`check`], which does
//! both. eBPF capture relies on the order the kernel runs cgroup programs in
//! (`kernel/bpf/cgroup.c`, `compute_effective_progs`): a socket runs its own cgroup's
//! programs first, then those of each ancestor attached with `BPF_F_ALLOW_MULTI` (a
//! bpf_link always is), nearest first; each sees the address the one before wrote. So
//! Weir's connect program sees the app's destination before a socket load balancer
//! above it translates it. Three layouts break that, and are refused by name:
//!
//! - an ancestor program attached with no flags: `hierarchy_allows_attach` refuses any
//!   attachment below it (EPERM);
//! - one attached with `BPF_F_ALLOW_OVERRIDE`: allowed, but `compute_effective_progs`
//!   drops it for every cgroup below one that has programs of its own, so Weir's attach
//!   would silently turn it off for the pod (a socket load balancer then no longer
//!   balances the proxy's own connections; a policy program no longer applies);
//! - one attached with `BPF_F_PREORDER` (Linux 6.15) on a hook that rewrites where a
//!   socket goes (connect, sendmsg): it runs before Weir's and rewrites the destination
//!   before Weir sees it. On recvmsg and getpeername Weir is the last to write what the
//!   app sees either way.
//!
//! The kernel does not report `BPF_F_PREORDER` (`BPF_PROG_QUERY` gives each program
//! the cgroup's flags), so [`read`] finds it from the effective order: which ancestor
//! programs run before one attached at the capture cgroup.

mod read;

use std::path::{Path, PathBuf};

pub use read::{Probe, ReadError, read};

use super::link::attach_type;

/// `BPF_F_ALLOW_OVERRIDE`: a descendant's program replaces this one there.
pub const ALLOW_OVERRIDE: u32 = 1;
/// `BPF_F_ALLOW_MULTI`: descendants' programs run before this one.
pub const ALLOW_MULTI: u32 = 2;
/// `BPF_F_PREORDER`: this one runs before its descendants' programs.
pub const PREORDER: u32 = 64;

/// One program attached to a cgroup.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Program {
    pub id: u32,
    pub name: String,
    /// `enum bpf_prog_type`.
    pub prog_type: u32,
    /// Its attach flags: what the kernel reports for it, with [`PREORDER`] added where
    /// the effective order showed it.
    pub flags: u32,
}

/// What one cgroup has attached for one attach type.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attachment {
    /// The cgroup's attach flags for the type (0, [`ALLOW_OVERRIDE`] or [`ALLOW_MULTI`]).
    pub flags: u32,
    /// In the cgroup's order.
    pub programs: Vec<Program>,
}

/// One ancestor of the capture cgroup and what it has attached, per attach type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ancestor {
    pub cgroup: PathBuf,
    pub hooks: Vec<(u32, Attachment)>,
}

impl Ancestor {
    fn on(&self, hook: u32) -> Option<&Attachment> {
        self.hooks.iter().find(|(t, _)| *t == hook).map(|(_, a)| a)
    }
}

/// The capture cgroup and its ancestors, its parent first and the cgroup2 root last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub capture: PathBuf,
    pub ancestors: Vec<Ancestor>,
}

/// Why an ancestor's program makes eBPF capture unsafe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Why {
    /// Attached with no flags: nothing may attach below it.
    Flagless,
    /// Attached with `BPF_F_ALLOW_OVERRIDE`: Weir's program would replace it there.
    Override,
    /// Attached with `BPF_F_PREORDER` on a hook that rewrites the destination.
    Preorder,
}

/// One ancestor program that makes eBPF capture of `capture` unsafe, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Blocker {
    pub program: Program,
    pub attach_type: u32,
    pub ancestor: PathBuf,
    pub capture: PathBuf,
    pub why: Why,
}

impl std::fmt::Display for Blocker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Blocker { program: p, ancestor, capture, .. } = self;
        let hook = hook_name(self.attach_type);
        write!(
            f,
            "program {} \"{}\" ({}) on {hook} of the ancestor cgroup {} ",
            p.id,
            p.name,
            prog_type_name(p.prog_type),
            ancestor.display()
        )?;
        let capture = capture.display();
        match self.why {
            Why::Flagless => write!(
                f,
                "is attached without BPF_F_ALLOW_MULTI or BPF_F_ALLOW_OVERRIDE: the kernel refuses any {hook} \
                 program below it (EPERM), so Weir cannot attach to {capture}"
            ),
            Why::Override => write!(
                f,
                "is attached with BPF_F_ALLOW_OVERRIDE: Weir's {hook} program on {capture} would take its place \
                 there (the kernel drops an overridable ancestor's program below a cgroup with programs of its \
                 own), silently turning it off for the pod, the proxy's own connections included"
            ),
            Why::Preorder => write!(
                f,
                "is attached with BPF_F_PREORDER: it runs before Weir's {hook} program on {capture} and rewrites \
                 the destination before Weir sees it (the app's original destination would be lost)"
            ),
        }
    }
}

/// Every reason eBPF capture of a layout is unsafe: the first named in full, the count
/// and programs of the others after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsafe {
    /// Never empty.
    pub blockers: Vec<Blocker>,
}

impl std::fmt::Display for Unsafe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Some((first, rest)) = self.blockers.split_first() else {
            return f.write_str("no cgroup program stands in the way");
        };
        write!(f, "{first}")?;
        if !rest.is_empty() {
            let others: Vec<String> = rest
                .iter()
                .map(|b| format!("{} \"{}\" on {}", b.program.id, b.program.name, hook_name(b.attach_type)))
                .collect();
            write!(f, " (and {} more: {})", rest.len(), others.join(", "))?;
        }
        Ok(())
    }
}

impl std::error::Error for Unsafe {}

/// Why eBPF capture of a cgroup cannot go ahead: its ancestors' programs, or they
/// could not be read (never taken as "nothing there").
#[derive(Debug, thiserror::Error)]
pub enum AncestorError {
    #[error("{0}")]
    Unsafe(Unsafe),
    #[error(transparent)]
    Unreadable(#[from] ReadError),
}

/// The hooks that rewrite where a socket goes: an ancestor running first there
/// translates the destination before Weir sees it.
pub const FORWARD_HOOKS: [u32; 4] = [
    attach_type::INET4_CONNECT,
    attach_type::INET6_CONNECT,
    attach_type::UDP4_SENDMSG,
    attach_type::UDP6_SENDMSG,
];

/// The name `bpftool cgroup` gives an attach type Weir uses.
pub fn hook_name(attach_type: u32) -> String {
    match attach_type {
        attach_type::INET_INGRESS => "ingress".into(),
        attach_type::SOCK_OPS => "sock_ops".into(),
        attach_type::INET4_CONNECT => "connect4".into(),
        attach_type::INET6_CONNECT => "connect6".into(),
        attach_type::UDP4_SENDMSG => "sendmsg4".into(),
        attach_type::UDP6_SENDMSG => "sendmsg6".into(),
        attach_type::UDP4_RECVMSG => "recvmsg4".into(),
        attach_type::UDP6_RECVMSG => "recvmsg6".into(),
        attach_type::GETSOCKOPT => "getsockopt".into(),
        attach_type::INET4_GETPEERNAME => "getpeername4".into(),
        attach_type::INET6_GETPEERNAME => "getpeername6".into(),
        attach_type::SOCK_RELEASE => "sock_release".into(),
        other => format!("attach type {other}"),
    }
}

fn prog_type_name(prog_type: u32) -> String {
    match prog_type {
        8 => "cgroup_skb".into(),
        9 => "cgroup_sock".into(),
        13 => "sock_ops".into(),
        18 => "cgroup_sock_addr".into(),
        25 => "cgroup_sockopt".into(),
        other => format!("program type {other}"),
    }
}

/// The ancestor programs that run for a socket in the capture cgroup on `hook`, with
/// the ancestor holding each, when the capture cgroup has `own` programs of its own
/// there: `compute_effective_progs`, which takes the first level that has programs
/// whatever its flags, and after that only `BPF_F_ALLOW_MULTI` levels.
pub fn effective(layout: &Layout, hook: u32, own: usize) -> Vec<(&Ancestor, &Program)> {
    let mut count = own;
    let mut out = Vec::new();
    for ancestor in &layout.ancestors {
        let Some(a) = ancestor.on(hook) else { continue };
        if count == 0 || a.flags & ALLOW_MULTI != 0 {
            out.extend(a.programs.iter().map(|p| (ancestor, p)));
            count += a.programs.len();
        }
    }
    out
}

/// The program that forbids attaching to the capture cgroup on `hook`, with its
/// cgroup: `hierarchy_allows_attach`, which stops at the nearest ancestor that is
/// `BPF_F_ALLOW_MULTI` or has a program, and allows the attach unless that program was
/// attached with no flags.
fn forbidding(layout: &Layout, hook: u32) -> Option<(&Ancestor, &Program)> {
    for ancestor in &layout.ancestors {
        let Some(a) = ancestor.on(hook) else { continue };
        if a.flags & ALLOW_MULTI != 0 {
            return None;
        }
        if let Some(p) = a.programs.first() {
            return (a.flags & ALLOW_OVERRIDE == 0).then_some((ancestor, p));
        }
    }
    None
}

/// Every ancestor program that makes attaching Weir's programs for `hooks` to the
/// capture cgroup unsafe, hook by hook in `hooks`' order, nearest ancestor first.
pub fn blockers(layout: &Layout, hooks: &[u32]) -> Vec<Blocker> {
    let mut out = Vec::new();
    for &hook in hooks {
        let blocker = |(ancestor, program): (&Ancestor, &Program), why| Blocker {
            program: program.clone(),
            attach_type: hook,
            ancestor: ancestor.cgroup.clone(),
            capture: layout.capture.clone(),
            why,
        };
        if let Some(found) = forbidding(layout, hook) {
            out.push(blocker(found, Why::Flagless));
            continue;
        }
        // What runs there now (the capture cgroup has no program of Weir's yet) and
        // what would once Weir's is attached: what is no longer there is dropped.
        let (before, after) = (effective(layout, hook, 0), effective(layout, hook, 1));
        for dropped in before.iter().filter(|(_, p)| !after.iter().any(|(_, q)| q.id == p.id)) {
            out.push(blocker(*dropped, Why::Override));
        }
        if FORWARD_HOOKS.contains(&hook) {
            for first in after.iter().filter(|(_, p)| p.flags & PREORDER != 0) {
                out.push(blocker(*first, Why::Preorder));
            }
        }
    }
    out
}

/// `Ok` when eBPF capture of the layout's cgroup with `hooks` is safe, else every
/// reason it is not.
pub fn judge(layout: &Layout, hooks: &[u32]) -> Result<(), Unsafe> {
    let blockers = blockers(layout, hooks);
    if blockers.is_empty() { Ok(()) } else { Err(Unsafe { blockers }) }
}

/// Reads the ancestors of `capture` and judges them for `hooks` (Weir's:
/// `capture::cgroup_hook_types`; see [`read`] for `probe`).
pub fn check(capture: &Path, hooks: &[u32], probe: Probe) -> Result<(), AncestorError> {
    let layout = read(capture, hooks, probe)?;
    judge(&layout, hooks).map_err(AncestorError::Unsafe)
}

#[cfg(test)]
mod tests;
