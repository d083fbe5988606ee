//! The agent's DNS proxy (127.0.0.1:15053, UDP and TCP): names from istiod's NDS table
//! are answered locally, everything else is forwarded to the pod's resolv.conf servers.

mod forward;
pub mod server;
pub mod table;

pub use server::{DnsConfig, DnsProxy};
pub use table::LookupTable;
