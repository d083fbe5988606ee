//! The inbound object (`weir-inbound`): a tc ingress classifier on a pod's interface
//! that assigns new TCP connections for captured ports to Envoy's inbound listener
//! (`bpf_sk_assign`), so the accepted socket keeps the original destination as its
//! local address. Two entry points share the decision: [`PROG`], loaded once per node
//! and attached to every pod interface, finds the pod's config in [`PODS`] by the
//! frame's destination (the pod interface's MAC address and the pod's own IP address:
//! a SYN at ingress has no socket, and tc sees no namespace, so the frame's own
//! destination is what tells pods apart); [`PROG_POD`] is a copy loaded for one
//! interface, reading its own one-slot [`CONFIG`].

pub const OBJECT: &str = "weir-inbound";
/// The per-node classifier (config by netns cookie).
pub const PROG: &str = "weir_inbound";
/// The per-pod copy (config in its own [`CONFIG`]); kernel names are 15 bytes at most.
pub const PROG_POD: &str = "weir_in_pod";
/// Every classifier name, for detaching legacy tc filters and listing.
pub const PROGS: &[&str] = &[PROG, PROG_POD];
/// `PODS[InboundKey]`: each pod's config, read by [`PROG`].
pub const PODS: &str = "INBOUND_PODS";
/// The per-pod copy's config, slot 0.
pub const CONFIG: &str = "INBOUND_CONFIG";
/// Totals by [`counter`] slot (per CPU): the program's own, over every pod it serves.
pub const COUNTERS: &str = "INBOUND_COUNTERS";
/// `POD_COUNTERS[netns cookie]`: [`InboundCounters`] for each pod [`PROG`] serves,
/// created when the pod registers and removed with it (the per-pod copy's
/// [`COUNTERS`] are its one pod's already).
pub const POD_COUNTERS: &str = "INBOUND_POD_COUNTERS";
/// Pods a classifier serves (its counters' capacity).
pub const MAX_PODS: u32 = 4096;
/// Addresses of one address family a pod may have registered (one [`PODS`] entry
/// each); user space refuses a pod with more before writing anything.
pub const MAX_ADDRESSES_PER_POD: u32 = 8;
/// Entries in [`PODS`]: every pod at its limit in both families.
pub const MAX_ADDRESS_ENTRIES: u32 = MAX_PODS * 2 * MAX_ADDRESSES_PER_POD;

pub const MAX_PORTS: usize = 32;

/// `REOPENING`: new connections whose 4-tuple a TIME_WAIT socket of the pod holds,
/// between the classifier and the kernel's reopen (see the program's docs).
pub const REOPENING: &str = "INBOUND_REOPENING";
pub const MAX_REOPENING: u32 = 4096;
/// The socket lookup hook attached to each captured pod's network namespace.
pub const PROG_REOPEN: &str = "weir_in_reopen";

/// A connection's 4-tuple as both the classifier and the socket lookup hook see it:
/// addresses and the remote port as on the wire (IPv4 in the first word), the local
/// port in host order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReopenKey {
    pub remote: [u32; 4],
    pub local: [u32; 4],
    pub remote_port: u16,
    pub local_port: u16,
    pub family: u32,
}

const _: () = assert!(core::mem::size_of::<ReopenKey>() == 40);

impl ReopenKey {
    #[inline(always)]
    pub fn v4(remote: u32, remote_port: u16, local: u32, local_port: u16) -> Self {
        Self { remote: [remote, 0, 0, 0], local: [local, 0, 0, 0], remote_port, local_port, family: 2 }
    }

    #[inline(always)]
    pub fn v6(remote: [u32; 4], remote_port: u16, local: [u32; 4], local_port: u16) -> Self {
        Self { remote, local, remote_port, local_port, family: 10 }
    }
}

/// [`InboundConfig::flags`] bits.
pub mod flags {
    /// An ambient pod, its inbound proxy ztunnel: SYNs from the host's probe source
    /// ([`super::InboundConfig::probe_src4`], `probe_src6`) reach the app (kubelet's
    /// probes, SNATed to that address on the host, are not ztunnel's), and the inbound
    /// guard marks what ztunnel delivers to the app's listeners so the app's replies
    /// route back to ztunnel ([`super::ambient`]).
    pub const AMBIENT: u16 = 1 << 0;
}

/// The marks of Istio's in-pod rules, which eBPF capture for ambient pods keeps: ztunnel
/// marks its sockets [`ZTUNNEL_MARK`]; a connection ztunnel delivered to the app is
/// marked [`REPLY_MARK`] (netfilter's connmark there, the inbound guard here) and the
/// in-pod rule `fwmark 0x111/0xfff lookup 100` sends its replies to the local stack,
/// where ztunnel's transparent socket takes them.
pub mod ambient {
    pub const ZTUNNEL_MARK: u32 = 0x539;
    pub const REPLY_MARK: u32 = 0x111;
    pub const MARK_MASK: u32 = 0xfff;
}

/// Which inbound ports are captured.
pub mod mode {
    pub const NONE: u16 = 0;
    /// Every port except `exclude_ports` (`-b '*'`).
    pub const ALL: u16 = 1;
    /// Only `include_ports`.
    pub const ONLY: u16 = 2;
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboundConfig {
    /// Envoy's inbound listener (15006).
    pub capture_port: u16,
    /// Never captured (15008).
    pub tunnel_port: u16,
    pub mode: u16,
    /// [`flags`] bits.
    pub flags: u16,
    pub include_ports: [u16; MAX_PORTS],
    pub exclude_ports: [u16; MAX_PORTS],
    /// With [`flags::AMBIENT`]: the host's probe source (Istio's 169.254.7.127 and
    /// fd16:9254:7127:1337:ffff:ffff:ffff:ffff), in network order; all zero: none.
    pub probe_src4: [u8; 4],
    pub probe_src6: [u8; 16],
}

const _: () = assert!(core::mem::size_of::<InboundConfig>() == 156);

/// A destination on a pod interface: its MAC address and one of the pod's addresses
/// (IPv4 in the first four bytes, the rest zero).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboundKey {
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
    pub addr: [u8; 16],
}

const _: () = assert!(core::mem::size_of::<InboundKey>() == 24);

/// A pod's entry in [`PODS`]: its config, and its netns cookie (so it can be removed
/// without the namespace).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboundPod {
    pub netns: u64,
    pub config: InboundConfig,
}

const _: () = assert!(core::mem::size_of::<InboundPod>() == 168);

impl InboundConfig {
    /// Whether an IPv4 packet from `src` (network order) comes from the host's probe
    /// source of an ambient pod: kubelet, never captured.
    #[inline(always)]
    pub fn from_probe_source4(&self, src: [u8; 4]) -> bool {
        let probe = u32::from_ne_bytes(self.probe_src4);
        self.is_ambient() && probe != 0 && u32::from_ne_bytes(src) == probe
    }

    /// As [`Self::from_probe_source4`], for IPv6.
    #[inline(always)]
    pub fn from_probe_source6(&self, src: [u8; 16]) -> bool {
        let (a, b) = (words(&self.probe_src6), words(&src));
        self.is_ambient()
            && (a[0] | a[1] | a[2] | a[3]) != 0
            && a[0] == b[0]
            && a[1] == b[1]
            && a[2] == b[2]
            && a[3] == b[3]
    }

    /// Whether this is an ambient pod's config.
    #[inline(always)]
    pub const fn is_ambient(&self) -> bool {
        self.flags & flags::AMBIENT != 0
    }

    /// Whether a new connection to `port` goes to Envoy.
    #[inline(always)]
    pub fn captures(&self, port: u16) -> bool {
        if port == 0 || port == self.tunnel_port || port == self.capture_port {
            return false;
        }
        match self.mode {
            mode::ALL => !contains(&self.exclude_ports, port),
            mode::ONLY => contains(&self.include_ports, port),
            _ => false,
        }
    }
}

#[inline(always)]
fn words(b: &[u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
        u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
        u32::from_ne_bytes([b[8], b[9], b[10], b[11]]),
        u32::from_ne_bytes([b[12], b[13], b[14], b[15]]),
    ]
}

#[inline(always)]
fn contains(list: &[u16; MAX_PORTS], port: u16) -> bool {
    let mut i = 0;
    while i < MAX_PORTS {
        if list[i] == port {
            return true;
        }
        i += 1;
    }
    false
}

/// One pod's inbound decisions (per CPU, summed by user space), slot by [`counter`].
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InboundCounters {
    pub slots: [u64; counter::COUNT as usize],
}

/// Counter slots: what the classifier decided for each new connection (SYN) to one of
/// the pod's addresses, and for each packet to one that it could not read. Capture
/// fails closed: a connection it should hand to Envoy and cannot is refused (the SYN
/// is dropped, so the client retries it, and connects once Envoy listens), never
/// delivered around Envoy.
pub mod counter {
    /// Assigned to Envoy's inbound listener.
    pub const ASSIGNED: u32 = 0;
    /// The port is not captured (`-b`/`-d`, the tunnel port 15008, or 15006 itself):
    /// the connection reaches the port it was sent to.
    pub const NOT_CAPTURED: u32 = 1;
    /// Captured port, but nothing listens on Envoy's inbound port (Envoy starting,
    /// restarting or gone): refused.
    pub const NO_LISTENER: u32 = 2;
    /// The kernel refused the assignment (`bpf_sk_assign` failed): refused.
    pub const ASSIGN_FAILED: u32 = 3;
    /// A TCP packet (or one that may be TCP) the classifier cannot read: a fragment, an
    /// IPv6 extension header chain longer than it walks, a TCP header cut short, or
    /// IPsec it cannot see into. Dropped: the stack would reassemble or decrypt it
    /// after the classifier, where nothing would send it to Envoy.
    pub const UNPARSEABLE: u32 = 4;
    pub const COUNT: u32 = 5;
    /// Names, in slot order: status output and the `decision` label of
    /// `weir_capture_decisions_total`.
    pub const NAMES: [&str; COUNT as usize] = [
        "inbound_assigned",
        "inbound_not_captured",
        "inbound_no_listener",
        "inbound_assign_failed",
        "inbound_unparseable",
    ];
}

#[cfg(feature = "user")]
// SAFETY: plain #[repr(C)] data.
unsafe impl aya::Pod for InboundConfig {}
#[cfg(feature = "user")]
// SAFETY: plain #[repr(C)] data.
unsafe impl aya::Pod for InboundKey {}
#[cfg(feature = "user")]
// SAFETY: plain #[repr(C)] data.
unsafe impl aya::Pod for InboundPod {}
#[cfg(feature = "user")]
// SAFETY: plain #[repr(C)] data.
unsafe impl aya::Pod for InboundCounters {}
