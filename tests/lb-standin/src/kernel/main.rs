//! The stand-in's kernel object: Cilium's socket load balancer (`bpf/bpf_sock.c`) as
//! cgroup `sock_addr` programs, one module per direction: `forward` translates a
//! service's frontend to a backend in connect and UDP sendmsg, `reverse` restores the
//! frontend in UDP recvmsg and getpeername; `lookup` holds the service lookups both
//! share, `maps` the maps, `sock` the context accessors.
#![no_std]
#![no_main]

mod forward;
mod lookup;
mod maps;
mod reverse;
mod sock;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
