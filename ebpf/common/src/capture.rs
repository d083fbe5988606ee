//! The capture object (`weir-capture`): cgroup programs that redirect a pod's outbound
//! TCP to Envoy, answer Envoy's `SO_ORIGINAL_DST`, redirect DNS to the agent, and pass
//! data directly between local socket pairs. All per-pod state is keyed by the pod's
//! network-namespace cookie, so one loaded copy can serve one pod (sidecar mode) or
//! every pod on a node (CNI mode).
//!
//! A pod's list entries (the LPM tries) are keyed by its cookie *and* a generation that
//! its [`PodConfig`] names: registering a pod again writes the new generation's entries
//! first and then switches the config in one map update, so the programs never see a
//! pod half configured, and the old generation's entries go after the switch.

/// Object file name in the agent's embedded objects.
pub const OBJECT: &str = "weir-capture";

/// Program names (the function names in `ebpf/programs/src/capture`).
pub mod prog {
    pub const CONNECT4: &str = "weir_connect4";
    pub const CONNECT6: &str = "weir_connect6";
    pub const SENDMSG4: &str = "weir_sendmsg4";
    pub const SENDMSG6: &str = "weir_sendmsg6";
    pub const RECVMSG4: &str = "weir_recvmsg4";
    pub const RECVMSG6: &str = "weir_recvmsg6";
    pub const GETSOCKOPT: &str = "weir_getsockopt";
    pub const SOCKOPS: &str = "weir_sockops";
    pub const SK_MSG: &str = "weir_sk_msg";
    pub const SOCK_RELEASE: &str = "weir_sock_release";
    pub const INBOUND_GUARD: &str = "weir_inbound_guard";
    pub const GETPEERNAME4: &str = "weir_getpeername4";
    pub const GETPEERNAME6: &str = "weir_getpeername6";
}

/// Map names (the statics in `ebpf/programs/src/capture/maps.rs`).
pub mod map {
    pub const POD_CONFIG: &str = "POD_CONFIG";
    pub const EXCLUDE_V4: &str = "EXCLUDE_V4";
    pub const EXCLUDE_V6: &str = "EXCLUDE_V6";
    pub const INCLUDE_V4: &str = "INCLUDE_V4";
    pub const INCLUDE_V6: &str = "INCLUDE_V6";
    pub const DNS_V4: &str = "DNS_V4";
    pub const DNS_V6: &str = "DNS_V6";
    pub const ORIG_BY_COOKIE: &str = "ORIG_BY_COOKIE";
    pub const ORIG_BY_PAIR: &str = "ORIG_BY_PAIR";
    pub const PEER_BY_COOKIE: &str = "PEER_BY_COOKIE";
    pub const DNS_BY_COOKIE: &str = "DNS_BY_COOKIE";
    pub const SOCK_PAIRS: &str = "SOCK_PAIRS";
    pub const POD_COUNTERS: &str = "POD_COUNTERS";
    pub const CONTROL: &str = "CONTROL";
    pub const INBOUND_PORTS: &str = "INBOUND_PORTS";
    pub const LISTENERS: &str = "LISTENERS";
    pub const LISTENER_COUNTS: &str = "LISTENER_COUNTS";
    /// Every map, for pinning and status.
    pub const ALL: &[&str] = &[
        POD_CONFIG,
        EXCLUDE_V4,
        EXCLUDE_V6,
        INCLUDE_V4,
        INCLUDE_V6,
        DNS_V4,
        DNS_V6,
        ORIG_BY_COOKIE,
        ORIG_BY_PAIR,
        PEER_BY_COOKIE,
        DNS_BY_COOKIE,
        SOCK_PAIRS,
        POD_COUNTERS,
        CONTROL,
        INBOUND_PORTS,
        LISTENERS,
        LISTENER_COUNTS,
    ];
}

/// Map sizes. Node-wide maps are shared by every pod a program set serves, so each
/// pod's share is bounded where it is written (user space refuses a pod over
/// [`MAX_CIDRS_PER_POD`] before writing anything) and the tries hold every pod at its
/// limit twice over (a pod being registered again holds two generations for a moment):
/// no pod can fill them for another.
pub const MAX_PODS: u32 = 4096;
/// Entries one pod may have in one trie (one address family of one list).
pub const MAX_CIDRS_PER_POD: u32 = 256;
pub const MAX_CIDRS: u32 = 2 * MAX_PODS * MAX_CIDRS_PER_POD;
/// Connections being set up (connect to Envoy's accept) and UDP sockets that sent DNS
/// to the agent; entries go when their socket closes (`sock_release`), or when Envoy
/// asks for the original destination, so they count connections in flight, not
/// connections made.
pub const MAX_TRACKED_CONNECTIONS: u32 = 65536;
/// Redirected sockets whose connected-to address `getpeername()` restores, while they
/// live (established connections, not only those in flight): past it the least
/// recently used answers Envoy's loopback address again.
pub const MAX_PEER_ADDRESSES: u32 = 4 * MAX_TRACKED_CONNECTIONS;
/// Listening sockets on captured inbound ports one pod may have guarded (`LISTENERS`;
/// Envoy's own ports are not recorded): past it, a listener is counted
/// (`listeners_unguarded`) and left to the inbound classifier alone.
pub const MAX_GUARDED_LISTENERS_PER_POD: u32 = 256;
pub const MAX_LISTENERS: u32 = MAX_PODS * MAX_GUARDED_LISTENERS_PER_POD;

/// Slots for proxy uids/gids and port lists in [`PodConfig`].
pub const MAX_IDS: usize = 4;
pub const MAX_PORTS: usize = 16;
/// An unused uid/gid slot.
pub const NO_ID: u32 = u32::MAX;

/// [`PodConfig::flags`] bits.
pub mod flags {
    /// `-i '*'`: capture every outbound destination not excluded.
    pub const CAPTURE_ALL_OUTBOUND: u32 = 1 << 0;
    /// `--redirect-dns`: DNS to the pod's resolv.conf servers goes to the agent.
    pub const REDIRECT_DNS: u32 = 1 << 1;
    /// `--capture-all-dns`: every DNS destination, not only the resolv.conf servers.
    pub const CAPTURE_ALL_DNS: u32 = 1 << 2;
    /// Register local socket pairs so sk_msg passes data socket to socket.
    pub const ACCELERATE: u32 = 1 << 3;
    // 1 << 4 was CLAMP_OPTLEN: getsockopt now leaves every large buffer alone, for
    // every socket, on every kernel.
    /// Keep no decision counters for this pod (the benchmark's measure of their cost).
    pub const NO_COUNTERS: u32 = 1 << 5;
}

/// One pod's capture settings (`POD_CONFIG[netns cookie]`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodConfig {
    /// Proxy uids whose connections are never captured; unused slots are [`NO_ID`].
    pub proxy_uids: [u32; MAX_IDS],
    pub proxy_gids: [u32; MAX_IDS],
    /// `-q`: outbound ports always captured (0 = unused slot).
    pub include_ports: [u16; MAX_PORTS],
    /// `-o`: outbound ports never captured (0 = unused slot).
    pub exclude_ports: [u16; MAX_PORTS],
    /// Envoy's outbound listener (15001).
    pub outbound_port: u16,
    /// Envoy's inbound listener (15006).
    pub inbound_port: u16,
    /// The tunnel port (15008): the proxy's connections to it through loopback are not
    /// sent to its inbound side.
    pub tunnel_port: u16,
    /// The agent's DNS listener (15053).
    pub dns_port: u16,
    pub flags: u32,
    /// Which generation of the pod's list entries (the tries) this config uses.
    pub generation: u32,
    /// A socket whose mark, under [`Self::proxy_mark_mask`], equals this is the proxy's
    /// and never captured: ztunnel marks every socket it makes in an ambient pod's
    /// namespace (0x539/0xfff). A mask of 0 (sidecar pods) matches no socket.
    pub proxy_mark: u32,
    pub proxy_mark_mask: u32,
}

const _: () = assert!(core::mem::size_of::<PodConfig>() == 120);

impl PodConfig {
    #[inline(always)]
    pub const fn has(&self, flag: u32) -> bool {
        self.flags & flag != 0
    }

    /// Whether a socket marked `mark` is the proxy's (ztunnel's, in an ambient pod).
    #[inline(always)]
    pub const fn is_proxy_mark(&self, mark: u32) -> bool {
        self.proxy_mark_mask != 0 && mark & self.proxy_mark_mask == self.proxy_mark
    }

    #[inline(always)]
    pub fn is_proxy(&self, uid: u32, gid: u32) -> bool {
        let mut i = 0;
        while i < MAX_IDS {
            if (self.proxy_uids[i] != NO_ID && self.proxy_uids[i] == uid)
                || (self.proxy_gids[i] != NO_ID && self.proxy_gids[i] == gid)
            {
                return true;
            }
            i += 1;
        }
        false
    }
}

/// A connection's original destination. Address and port in network byte order; an
/// IPv4 address is in `addr[0]` (the rest zero).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OrigDst {
    pub addr: [u32; 4],
    pub port: u16,
    /// AF_INET (2) or AF_INET6 (10).
    pub family: u16,
}

const _: () = assert!(core::mem::size_of::<OrigDst>() == 20);

/// A TCP connection seen from one end, within one network namespace. Addresses in
/// network byte order, ports in host byte order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PairKey {
    pub netns: u64,
    pub local_addr: [u32; 4],
    pub remote_addr: [u32; 4],
    pub local_port: u16,
    pub remote_port: u16,
    pub family: u32,
}

const _: () = assert!(core::mem::size_of::<PairKey>() == 48);

impl PairKey {
    /// The same connection seen from the other end.
    #[inline(always)]
    pub const fn peer(&self) -> Self {
        Self {
            netns: self.netns,
            local_addr: self.remote_addr,
            remote_addr: self.local_addr,
            local_port: self.remote_port,
            remote_port: self.local_port,
            family: self.family,
        }
    }
}

/// LPM-trie data for IPv4 entries: the pod's netns cookie and the generation of its
/// entries (both big-endian), then the address; the prefix length covers the 96 bits
/// of cookie and generation plus the CIDR's bits.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CidrV4 {
    pub netns: [u8; 8],
    pub generation: [u8; 4],
    pub addr: [u8; 4],
}

const _: () = assert!(core::mem::size_of::<CidrV4>() == 16);

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CidrV6 {
    pub netns: [u8; 8],
    pub generation: [u8; 4],
    pub addr: [u8; 16],
}

const _: () = assert!(core::mem::size_of::<CidrV6>() == 28);

/// Bits of an LPM prefix taken by the netns cookie and the generation.
pub const KEY_PREFIX_BITS: u32 = 96;

/// One pod's decision counters (`POD_COUNTERS[netns cookie]`, per CPU, summed by user
/// space): what the programs decided for its connections, slot by [`counter`].
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PodCounters {
    pub slots: [u64; counter::COUNT as usize],
}

/// [`PodCounters`] slots: one per decision a program makes. `redirected` and the
/// `bypass_*` slots partition the pod's outbound TCP connects (by the reason of
/// [`crate::policy::Reason`]); the others count events.
pub mod counter {
    /// Outbound connect rewritten to Envoy's outbound listener.
    pub const REDIRECTED: u32 = 0;
    /// The proxy reaching its own pod through loopback: to Envoy's inbound listener.
    pub const REDIRECTED_INBOUND: u32 = 1;
    pub const BYPASS_PROXY: u32 = 2;
    pub const BYPASS_INBOUND_PASSTHROUGH: u32 = 3;
    pub const BYPASS_EXCLUDED_PORT: u32 = 4;
    pub const BYPASS_EXCLUDED_CIDR: u32 = 5;
    pub const BYPASS_OWN_ADDRESS: u32 = 6;
    pub const BYPASS_LOOPBACK: u32 = 7;
    pub const NOT_INCLUDED: u32 = 8;
    pub const ORIG_DST_ANSWERED: u32 = 9;
    pub const ORIG_DST_MISSING: u32 = 10;
    pub const DNS_REDIRECTED: u32 = 11;
    pub const DNS_RESTORED: u32 = 12;
    pub const PAIRS_REGISTERED: u32 = 13;
    pub const SKMSG_REDIRECTED: u32 = 14;
    pub const SKMSG_BYTES: u32 = 15;
    /// sk_msg found no registered peer: the sender stays on the stack.
    pub const SKMSG_PASSED: u32 = 16;
    /// A packet for one of the app's listeners on a captured port that came in from
    /// outside the pod, not through Envoy: dropped by the inbound guard.
    pub const INBOUND_BYPASS_REFUSED: u32 = 17;
    /// A listener the guard does not watch (the pod has
    /// [`super::MAX_GUARDED_LISTENERS_PER_POD`] already).
    pub const LISTENERS_UNGUARDED: u32 = 18;
    /// A connect capture should redirect whose original destination could not be
    /// recorded: refused (EPERM), never let through around Envoy.
    pub const REDIRECT_FAILED: u32 = 19;
    pub const COUNT: u32 = 20;
    /// Names, in slot order: status output and the `decision` label of
    /// `weir_capture_decisions_total`.
    pub const NAMES: [&str; COUNT as usize] = [
        "redirected",
        "redirected_inbound",
        "bypass_proxy",
        "bypass_inbound_passthrough",
        "bypass_excluded_port",
        "bypass_excluded_cidr",
        "bypass_own_address",
        "bypass_loopback",
        "not_included",
        "orig_dst_answered",
        "orig_dst_missing",
        "dns_redirected",
        "dns_restored",
        "pairs_registered",
        "skmsg_redirected",
        "skmsg_bytes",
        "skmsg_passed",
        "inbound_bypass_refused",
        "listeners_unguarded",
        "redirect_failed",
    ];
}

/// `CONTROL` slots (u32).
pub mod control {
    /// Non-zero: programs emit aya-log records.
    pub const LOG: u32 = 0;
    pub const COUNT: u32 = 4;
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: plain #[repr(C)] data with no padding-sensitive invariants.
    unsafe impl aya::Pod for super::PodConfig {}
    unsafe impl aya::Pod for super::OrigDst {}
    unsafe impl aya::Pod for super::PairKey {}
    unsafe impl aya::Pod for super::CidrV4 {}
    unsafe impl aya::Pod for super::CidrV6 {}
    unsafe impl aya::Pod for super::PodCounters {}
}
