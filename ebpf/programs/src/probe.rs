//! Probe object: a `cgroup/connect4` program that counts connects in its cgroup and
//! never changes them. Loading and attaching it proves the kernel offers what the
//! capture programs need at the most basic level (BPF_PROG_TYPE_CGROUP_SOCK_ADDR,
//! cgroup v2 attach); the agent's backend detection and the rig's tests use it.
#![no_std]
#![no_main]

use aya_ebpf::{
    macros::{cgroup_sock_addr, map},
    maps::PerCpuArray,
    programs::SockAddrContext,
};

/// Verdict that lets the connect proceed unchanged.
const ALLOW: i32 = 1;

#[map(name = "CONNECT_COUNT")]
static CONNECT_COUNT: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

#[cgroup_sock_addr(connect4)]
pub fn count_connect4(_ctx: SockAddrContext) -> i32 {
    if let Some(slot) = CONNECT_COUNT.get_ptr_mut(0) {
        // Per-CPU slot: no other CPU writes it, so a plain increment is race-free.
        unsafe { *slot += 1 };
    }
    ALLOW
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
