//! Service lookups, as `bpf/bpf_sock.c` makes them: the exact frontend first
//! (`lb4_lookup_service`), then the wildcard entries NodePort and hostPort services have
//! (`sock4_wildcard_lookup_full`), and the check that keeps a hostPort from being
//! answered on an address that is not the node's (`sock4_skip_xlate`). The same for
//! IPv6 (`sock6_*`).

use weir_lb_standin::{LbConfig, Service4Key, Service6Key, ServiceValue, flags, node};

use crate::maps::{NODE_ADDRS4, NODE_ADDRS6, SERVICES4, SERVICES6};

/// A service entry and the key it was found under (address 0 for a wildcard entry):
/// its backend slots are under the same key.
pub struct Found4 {
    pub service: ServiceValue,
    pub key: Service4Key,
}

pub struct Found6 {
    pub service: ServiceValue,
    pub key: Service6Key,
}

/// Cilium's `is_v4_loopback`: 127.0.0.0/8.
#[inline(always)]
pub fn is_loopback4(addr: u32) -> bool {
    addr.to_ne_bytes()[0] == 127
}

/// Cilium's `is_v6_loopback`: `::1`.
#[inline(always)]
pub fn is_loopback6(addr: &[u32; 4]) -> bool {
    addr[0] == 0 && addr[1] == 0 && addr[2] == 0 && addr[3] == u32::from_ne_bytes([0, 0, 0, 1])
}

#[inline(always)]
fn service4(key: Service4Key) -> Option<Found4> {
    unsafe { SERVICES4.get(&key) }.map(|s| Found4 { service: *s, key })
}

#[inline(always)]
fn service6(key: Service6Key) -> Option<Found6> {
    unsafe { SERVICES6.get(&key) }.map(|s| Found6 { service: *s, key })
}

/// Whether a wildcard lookup applies to `port` at all: NodePorts inside the range,
/// hostPorts (`outside`) outside it (`sock4_wildcard_lookup`'s `inv_match`).
#[inline(always)]
fn in_wildcard_range(cfg: &LbConfig, dport: u16, outside: bool) -> bool {
    let port = u16::from_be(dport);
    let out_of_range = port < cfg.nodeport_min || port > cfg.nodeport_max;
    out_of_range == outside
}

/// Whether the ipcache names `identity` as this node (or, with `remote`, another node).
#[inline(always)]
fn node_identity(identity: Option<u32>, remote: bool) -> bool {
    matches!(identity, Some(node::HOST)) || (remote && matches!(identity, Some(node::REMOTE_NODE)))
}

/// `sock4_wildcard_lookup`: a connect to loopback (from the host's namespace only) or
/// to a node's address looks up the port's wildcard entry (address 0).
#[inline(always)]
fn wildcard4(
    cfg: &LbConfig,
    mut key: Service4Key,
    remote: bool,
    outside: bool,
    in_hostns: bool,
) -> Option<Found4> {
    if !in_wildcard_range(cfg, key.dport, outside) {
        return None;
    }
    let wildcard = (in_hostns && is_loopback4(key.address))
        || node_identity(unsafe { NODE_ADDRS4.get(&key.address) }.copied(), remote);
    if !wildcard {
        return None;
    }
    key.address = 0;
    service4(key)
}

/// `sock4_wildcard_lookup_full`: a NodePort on any node address, else a hostPort on
/// this node's (one published on loopback only for a loopback destination).
#[inline(always)]
pub fn wildcard_full4(cfg: &LbConfig, key: Service4Key, in_hostns: bool) -> Option<Found4> {
    let loopback = is_loopback4(key.address);
    if let Some(f) = wildcard4(cfg, key, true, false, in_hostns)
        && f.service.flags & flags::NODEPORT != 0
    {
        return Some(f);
    }
    let f = wildcard4(cfg, key, false, true, in_hostns)?;
    let hostport = f.service.flags & flags::HOSTPORT != 0;
    (hostport && (f.service.flags & flags::LOOPBACK == 0 || loopback)).then_some(f)
}

/// The exact frontend, else its wildcard entry.
#[inline(always)]
pub fn lookup4(cfg: &LbConfig, address: u32, dport: u16, in_hostns: bool) -> Option<Found4> {
    let key = Service4Key { address, dport, backend_slot: 0 };
    service4(key).or_else(|| wildcard_full4(cfg, key, in_hostns))
}

/// `sock4_skip_xlate`: a hostPort is translated only on loopback or this node's own
/// address (Cilium also refuses external IPs that are not the node's; not modelled).
#[inline(always)]
pub fn skip4(service: &ServiceValue, address: u32) -> bool {
    service.flags & flags::HOSTPORT != 0
        && !is_loopback4(address)
        && unsafe { NODE_ADDRS4.get(&address) }.copied() != Some(node::HOST)
}

#[inline(always)]
fn wildcard6(
    cfg: &LbConfig,
    mut key: Service6Key,
    remote: bool,
    outside: bool,
    in_hostns: bool,
) -> Option<Found6> {
    if !in_wildcard_range(cfg, key.dport, outside) {
        return None;
    }
    let wildcard = (in_hostns && is_loopback6(&key.address))
        || node_identity(unsafe { NODE_ADDRS6.get(&key.address) }.copied(), remote);
    if !wildcard {
        return None;
    }
    key.address = [0; 4];
    service6(key)
}

/// `sock6_wildcard_lookup_full`.
#[inline(always)]
fn wildcard_full6(cfg: &LbConfig, key: Service6Key, in_hostns: bool) -> Option<Found6> {
    let loopback = is_loopback6(&key.address);
    if let Some(f) = wildcard6(cfg, key, true, false, in_hostns)
        && f.service.flags & flags::NODEPORT != 0
    {
        return Some(f);
    }
    let f = wildcard6(cfg, key, false, true, in_hostns)?;
    let hostport = f.service.flags & flags::HOSTPORT != 0;
    (hostport && (f.service.flags & flags::LOOPBACK == 0 || loopback)).then_some(f)
}

#[inline(always)]
pub fn lookup6(cfg: &LbConfig, address: [u32; 4], dport: u16, in_hostns: bool) -> Option<Found6> {
    let key = Service6Key { address, dport, backend_slot: 0 };
    service6(key).or_else(|| wildcard_full6(cfg, key, in_hostns))
}

/// `sock6_skip_xlate`.
#[inline(always)]
pub fn skip6(service: &ServiceValue, address: &[u32; 4]) -> bool {
    service.flags & flags::HOSTPORT != 0
        && !is_loopback6(address)
        && unsafe { NODE_ADDRS6.get(address) }.copied() != Some(node::HOST)
}

/// A service's backend slot (`__lb4_lookup_backend_slot`).
#[inline(always)]
pub fn slot4(found: &Found4, slot: u16) -> Option<u32> {
    let key = Service4Key { backend_slot: slot, ..found.key };
    unsafe { SERVICES4.get(&key) }.map(|s| s.backend_id)
}

#[inline(always)]
pub fn slot6(found: &Found6, slot: u16) -> Option<u32> {
    let key = Service6Key { backend_slot: slot, ..found.key };
    unsafe { SERVICES6.get(&key) }.map(|s| s.backend_id)
}
