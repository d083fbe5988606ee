//! The inbound object (`weir-inbound`): a tc ingress classifier on a pod's interface
//! that assigns new TCP connections for captured ports to Envoy's inbound listener
//! (`bpf_sk_assign`), so the accepted socket keeps the original destination as its
//! local address. Loaded once per pod interface, each copy with its own config map.

pub const OBJECT: &str = "weir-inbound";
pub const PROG: &str = "weir_inbound";
pub const CONFIG: &str = "INBOUND_CONFIG";
pub const COUNTERS: &str = "INBOUND_COUNTERS";

pub const MAX_PORTS: usize = 32;

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
    pub _reserved: u16,
    pub include_ports: [u16; MAX_PORTS],
    pub exclude_ports: [u16; MAX_PORTS],
}

const _: () = assert!(core::mem::size_of::<InboundConfig>() == 136);

impl InboundConfig {
    /// Whether a new connection to `port` goes to Envoy.
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

/// `INBOUND_COUNTERS` slots.
pub mod counter {
    pub const ASSIGNED: u32 = 0;
    pub const NO_LISTENER: u32 = 1;
    pub const COUNT: u32 = 2;
}

#[cfg(feature = "user")]
// SAFETY: plain #[repr(C)] data.
unsafe impl aya::Pod for InboundConfig {}
