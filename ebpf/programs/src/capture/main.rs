//! The capture object: cgroup programs for one pod (sidecar mode) or every pod on a
//! node (CNI mode), all state keyed by the pod's network-namespace cookie.
//!
//! One object for the whole cgroup hook family, with a module per hook: the hooks
//! share maps (a connect records the original destination, sockops moves it to the
//! connection's 4-tuple, getsockopt answers from it), and one object shares maps
//! without pinning. The tc inbound program is a separate object (`inbound`).
#![no_std]
#![no_main]
// The kernel's atomic add (maps::atomic_add): the BPF target has no AtomicU64::fetch_add.
#![allow(internal_features)]
#![feature(core_intrinsics)]

mod connect;
mod dns;
mod getsockopt;
mod guard;
mod maps;
mod net;
mod peer;
mod release;
mod skmsg;
mod sockops;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
