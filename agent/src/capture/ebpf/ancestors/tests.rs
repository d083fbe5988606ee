//! The judgement against the kernel's rules, layout by layout: each case is a tree
//! Cilium (or another agent) could leave above a pod's cgroup.

use super::*;

const CONNECT4: u32 = attach_type::INET4_CONNECT;
const RECVMSG4: u32 = attach_type::UDP4_RECVMSG;
const SOCK_OPS: u32 = attach_type::SOCK_OPS;

fn program(id: u32, name: &str, flags: u32) -> Program {
    Program { id, name: name.into(), prog_type: 18, flags }
}

/// An ancestor with `flags` and `programs` on `hook` only.
fn ancestor(path: &str, hook: u32, flags: u32, programs: Vec<Program>) -> Ancestor {
    Ancestor { cgroup: path.into(), hooks: vec![(hook, Attachment { flags, programs })] }
}

fn empty(path: &str) -> Ancestor {
    Ancestor { cgroup: path.into(), hooks: Vec::new() }
}

fn layout(ancestors: Vec<Ancestor>) -> Layout {
    Layout { capture: "/cg/kubepods/pod1".into(), ancestors }
}

fn whys(l: &Layout, hooks: &[u32]) -> Vec<(u32, u32, Why)> {
    blockers(l, hooks).into_iter().map(|b| (b.program.id, b.attach_type, b.why)).collect()
}

#[test]
fn nothing_above_or_multi_programs_above_are_safe() {
    assert_eq!(judge(&layout(vec![empty("/cg/kubepods"), empty("/cg")]), &[CONNECT4]), Ok(()));
    // Cilium with a bpf_link at the root (links are always multi), and a second agent's
    // multi program between.
    let l = layout(vec![
        ancestor("/cg/kubepods", CONNECT4, ALLOW_MULTI, vec![program(7, "other_conn4", ALLOW_MULTI)]),
        ancestor("/cg", CONNECT4, ALLOW_MULTI, vec![program(9, "cil_sock4_conn", ALLOW_MULTI)]),
    ]);
    assert_eq!(judge(&l, &[CONNECT4, RECVMSG4]), Ok(()));
    let after: Vec<u32> = effective(&l, CONNECT4, 1).iter().map(|(_, p)| p.id).collect();
    assert_eq!(after, [7, 9], "Weir's first, then its ancestors, nearest first");
}

#[test]
fn a_flagless_ancestor_forbids_the_attach_and_is_named() {
    let l = layout(vec![
        empty("/cg/kubepods"),
        ancestor("/cg", CONNECT4, 0, vec![program(9, "cil_sock4_conn", 0)]),
    ]);
    assert_eq!(whys(&l, &[SOCK_OPS, CONNECT4]), [(9, CONNECT4, Why::Flagless)]);
    let text = judge(&l, &[CONNECT4]).unwrap_err().to_string();
    for part in
        ["program 9 \"cil_sock4_conn\"", "cgroup_sock_addr", "connect4", "ancestor cgroup /cg ", "EPERM"]
    {
        assert!(text.contains(part), "{part} in {text}");
    }
    assert!(text.contains("Weir cannot attach to /cg/kubepods/pod1"), "{text}");
}

#[test]
fn a_flagless_program_above_a_multi_ancestor_neither_forbids_nor_runs() {
    // hierarchy_allows_attach stops at the first multi level; compute_effective_progs
    // skips a later level that is not multi: the root's program runs for none of these.
    let l = layout(vec![
        ancestor("/cg/kubepods", CONNECT4, ALLOW_MULTI, vec![program(7, "lb", ALLOW_MULTI)]),
        ancestor("/cg", CONNECT4, 0, vec![program(9, "cil_sock4_conn", 0)]),
    ]);
    assert_eq!(judge(&l, &[CONNECT4]), Ok(()));
    assert!(effective(&l, CONNECT4, 0).iter().all(|(_, p)| p.id != 9));
}

#[test]
fn an_override_ancestor_that_would_be_dropped_is_refused() {
    let l = layout(vec![
        empty("/cg/kubepods"),
        ancestor("/cg", CONNECT4, ALLOW_OVERRIDE, vec![program(9, "lb", 1)]),
    ]);
    assert_eq!(whys(&l, &[CONNECT4]), [(9, CONNECT4, Why::Override)]);
    let text = judge(&l, &[CONNECT4]).unwrap_err().to_string();
    assert!(text.contains("BPF_F_ALLOW_OVERRIDE") && text.contains("silently turning it off"), "{text}");
    // Any hook Weir attaches counts, not only the rewriting ones.
    let l = layout(vec![ancestor("/cg", SOCK_OPS, ALLOW_OVERRIDE, vec![program(4, "sockops", 1)])]);
    assert_eq!(whys(&l, &[SOCK_OPS]), [(4, SOCK_OPS, Why::Override)]);
}

#[test]
fn an_override_program_not_running_there_anyway_is_not_weirs_to_drop() {
    // The kubepods level (multi) is the first with programs: the root's overridable
    // one is skipped already, before Weir attaches and after.
    let l = layout(vec![
        ancestor("/cg/kubepods", CONNECT4, ALLOW_MULTI, vec![program(7, "lb", ALLOW_MULTI)]),
        ancestor("/cg", CONNECT4, ALLOW_OVERRIDE, vec![program(9, "old", 1)]),
    ]);
    assert_eq!(judge(&l, &[CONNECT4]), Ok(()));
    // Reversed, the nearest overridable one runs now and would be dropped; the multi one
    // above it keeps running.
    let l = layout(vec![
        ancestor("/cg/kubepods", CONNECT4, ALLOW_OVERRIDE, vec![program(7, "old", 1)]),
        ancestor("/cg", CONNECT4, ALLOW_MULTI, vec![program(9, "lb", ALLOW_MULTI)]),
    ]);
    assert_eq!(whys(&l, &[CONNECT4]), [(7, CONNECT4, Why::Override)]);
}

#[test]
fn a_preorder_ancestor_is_refused_on_the_hooks_that_rewrite_the_destination_only() {
    let pre = ALLOW_MULTI | PREORDER;
    let l = Layout {
        capture: "/cg/kubepods/pod1".into(),
        ancestors: vec![Ancestor {
            cgroup: "/cg".into(),
            hooks: vec![
                (
                    CONNECT4,
                    Attachment { flags: ALLOW_MULTI, programs: vec![program(9, "cil_sock4_conn", pre)] },
                ),
                (
                    RECVMSG4,
                    Attachment { flags: ALLOW_MULTI, programs: vec![program(10, "cil_sock4_recv", pre)] },
                ),
            ],
        }],
    };
    assert_eq!(whys(&l, &[RECVMSG4, CONNECT4]), [(9, CONNECT4, Why::Preorder)]);
    let text = judge(&l, &[CONNECT4]).unwrap_err().to_string();
    assert!(
        text.contains("BPF_F_PREORDER") && text.contains("rewrites the destination before Weir sees it"),
        "{text}"
    );
}

#[test]
fn several_blockers_are_all_kept_the_first_told_in_full() {
    let l = Layout {
        capture: "/cg/pod".into(),
        ancestors: vec![Ancestor {
            cgroup: "/cg".into(),
            hooks: vec![
                (CONNECT4, Attachment { flags: 0, programs: vec![program(9, "cil_sock4_conn", 0)] }),
                (
                    attach_type::INET6_CONNECT,
                    Attachment { flags: 0, programs: vec![program(11, "cil_sock6_conn", 0)] },
                ),
            ],
        }],
    };
    let e = judge(&l, &[CONNECT4, attach_type::INET6_CONNECT]).unwrap_err();
    assert_eq!(e.blockers.len(), 2);
    let text = e.to_string();
    assert!(
        text.contains("program 9 \"cil_sock4_conn\"")
            && text.contains("(and 1 more: 11 \"cil_sock6_conn\" on connect6)"),
        "{text}"
    );
}
