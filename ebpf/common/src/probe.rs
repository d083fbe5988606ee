//! The probe object: the smallest program set that proves the kernel lets Weir load
//! and attach cgroup socket-address programs. The agent uses it to choose a capture
//! backend; the rig's eBPF test uses it to prove the build, load and attach path.

/// File name of the probe object in the agent's embedded objects.
pub const OBJECT: &str = "weir-probe";
/// `cgroup/connect4` program that counts every IPv4 connect in the cgroup.
pub const PROG_COUNT_CONNECT4: &str = "count_connect4";
/// Per-CPU array with one `u64` slot: connects seen, summed over CPUs by user space.
pub const MAP_CONNECT_COUNT: &str = "CONNECT_COUNT";
