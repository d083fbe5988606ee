//! One pod's registration in the capture maps, switched in one update. A pod's list
//! entries (the LPM tries) carry a generation; its [`PodConfig`] names the one the
//! programs use. Registering writes a fresh generation's entries ([`MapSet::stage`]),
//! then switches the config to it in one map update ([`MapSet::commit`]), then removes
//! what the previous registration wrote and the new one did not: the programs see the
//! old lists or the new ones, never a mix, never none. A failure before the switch
//! takes back what was written and leaves the old registration as it was.
//!
//! Generations are random: a write interrupted by a crash leaves entries no config
//! names, which a later registration (a new random generation) cannot pick up by
//! mistake, and the set's garbage collection ([`MapSet::orphans`]) removes.

use std::net::IpAddr;

use aya::maps::{HashMap, LpmTrie, lpm_trie::Key};
use weir_ebpf_common::{
    capture::{CidrV4, CidrV6, KEY_PREFIX_BITS, PodConfig, map},
    inbound::InboundConfig,
};
use weir_iptables::config::Cidr;

use super::{EXCLUDED, MapSet, OWN_ADDRESS, add_zeroed, is_not_found, map_err};
use crate::capture::ebpf::{
    EbpfError,
    config::PodCapture,
    registration::{Registration, lpm_key_bytes},
};

/// A registration written but not yet switched to.
#[derive(Debug)]
pub struct Staged {
    netns: u64,
    config: PodConfig,
    /// The config the pod had (`None`: a new pod).
    previous: Option<PodConfig>,
    /// The inbound ports the guard checks (`None`: no inbound capture), and the pod's
    /// before.
    ports: Option<InboundConfig>,
    previous_ports: Option<InboundConfig>,
    /// Everything this registration owns: config and counter keys, its list entries.
    registration: Registration,
    /// Entries written now (to take back on failure): the lists, and the counters when
    /// they were created now.
    written: Registration,
}

impl Staged {
    pub fn registration(&self) -> &Registration {
        &self.registration
    }
}

fn host(addr: IpAddr) -> Cidr {
    Cidr { addr, bits: if addr.is_ipv4() { 32 } else { 128 } }
}

impl MapSet {
    fn put(
        &mut self,
        (v4, v6): (&'static str, &'static str),
        netns: u64,
        generation: u32,
        cidr: Cidr,
        value: u8,
    ) -> Result<(&'static str, Vec<u8>), EbpfError> {
        let prefix = KEY_PREFIX_BITS + u32::from(cidr.bits);
        let (cookie, generation) = (netns.to_be_bytes(), generation.to_be_bytes());
        match cidr.addr {
            IpAddr::V4(a) => {
                let data = CidrV4 { netns: cookie, generation, addr: a.octets() };
                self.trie4(v4)?.insert(&Key::new(prefix, data), value, 0).map_err(map_err(v4))?;
                Ok((v4, lpm_key_bytes(prefix, &data)))
            }
            IpAddr::V6(a) => {
                let data = CidrV6 { netns: cookie, generation, addr: a.octets() };
                self.trie6(v6)?.insert(&Key::new(prefix, data), value, 0).map_err(map_err(v6))?;
                Ok((v6, lpm_key_bytes(prefix, &data)))
            }
        }
    }

    /// Writes `pod`'s lists under a fresh generation and gives it counters (kept, with
    /// their counts, if it has some); nothing the programs use changes yet. On failure
    /// whatever was written is taken back.
    pub fn stage(&mut self, netns: u64, pod: &PodCapture) -> Result<Staged, EbpfError> {
        let previous = self.pod_config(netns)?;
        let generation = loop {
            let g: u32 = rand::random();
            if previous.is_none_or(|p| p.generation != g) {
                break g;
            }
        };
        let mut staged = Staged {
            netns,
            config: PodConfig { generation, ..pod.config },
            previous,
            ports: pod.inbound,
            previous_ports: self.inbound_ports(netns)?,
            registration: Registration { generation, ..Registration::default() },
            written: Registration { generation, ..Registration::default() },
        };
        staged.registration.add(map::POD_CONFIG, &netns.to_ne_bytes());
        staged.registration.add(map::POD_COUNTERS, &netns.to_ne_bytes());
        if pod.inbound.is_some() {
            staged.registration.add(map::INBOUND_PORTS, &netns.to_ne_bytes());
            staged.registration.add(map::LISTENER_COUNTS, &netns.to_ne_bytes());
            match self.add_listener_count(netns) {
                Ok(true) => staged.written.add(map::LISTENER_COUNTS, &netns.to_ne_bytes()),
                Ok(false) => {}
                Err(e) => {
                    self.abort(staged);
                    return Err(e);
                }
            }
        }
        let entries = pod
            .exclude
            .iter()
            .map(|c| ((map::EXCLUDE_V4, map::EXCLUDE_V6), *c, EXCLUDED))
            .chain(
                pod.own_addresses.iter().map(|a| ((map::EXCLUDE_V4, map::EXCLUDE_V6), host(*a), OWN_ADDRESS)),
            )
            .chain(pod.include.iter().map(|c| ((map::INCLUDE_V4, map::INCLUDE_V6), *c, 1)))
            .chain(pod.dns_servers.iter().map(|a| ((map::DNS_V4, map::DNS_V6), host(*a), 1)));
        for (maps, cidr, value) in entries {
            match self.put(maps, netns, generation, cidr, value) {
                Ok((name, key)) => {
                    staged.registration.add(name, &key);
                    staged.written.add(name, &key);
                }
                Err(e) => {
                    self.abort(staged);
                    return Err(e);
                }
            }
        }
        match add_zeroed(&mut self.pod_counters_map_mut()?, map::POD_COUNTERS, netns) {
            Ok(true) => staged.written.add(map::POD_COUNTERS, &netns.to_ne_bytes()),
            Ok(false) => {}
            Err(e) => {
                self.abort(staged);
                return Err(e);
            }
        }
        Ok(staged)
    }

    /// Switches the pod to its staged registration: one update of its config (its
    /// inbound ports for the guard just before; put back if the switch fails).
    pub fn commit(&mut self, staged: &Staged) -> Result<(), EbpfError> {
        self.set_inbound_ports(staged.netns, staged.ports)?;
        let mut configs: HashMap<_, u64, PodConfig> =
            HashMap::try_from(self.get_mut(map::POD_CONFIG)?).map_err(map_err(map::POD_CONFIG))?;
        let switched = configs.insert(staged.netns, staged.config, 0).map_err(map_err(map::POD_CONFIG));
        if switched.is_err() {
            let _ = self.set_inbound_ports(staged.netns, staged.previous_ports);
        }
        switched
    }

    /// The inbound ports the guard has for a pod.
    fn inbound_ports(&self, netns: u64) -> Result<Option<InboundConfig>, EbpfError> {
        let ports: HashMap<_, u64, InboundConfig> =
            HashMap::try_from(self.get(map::INBOUND_PORTS)?).map_err(map_err(map::INBOUND_PORTS))?;
        match ports.get(&netns, 0) {
            Ok(p) => Ok(Some(p)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(source) => Err(EbpfError::Map { map: map::INBOUND_PORTS, source }),
        }
    }

    /// Writes (or, with `None`, removes) a pod's inbound ports for the guard.
    fn set_inbound_ports(&mut self, netns: u64, ports: Option<InboundConfig>) -> Result<(), EbpfError> {
        let mut map: HashMap<_, u64, InboundConfig> =
            HashMap::try_from(self.get_mut(map::INBOUND_PORTS)?).map_err(map_err(map::INBOUND_PORTS))?;
        match ports {
            Some(p) => map.insert(netns, p, 0).map_err(map_err(map::INBOUND_PORTS)),
            None => match map.remove(&netns) {
                Err(e) if !is_not_found(&e) => Err(map_err(map::INBOUND_PORTS)(e)),
                _ => Ok(()),
            },
        }
    }

    /// Gives a pod its listener count for the guard (zero) unless it has one; whether it
    /// was made now.
    fn add_listener_count(&mut self, netns: u64) -> Result<bool, EbpfError> {
        const NO_EXIST: u64 = 1;
        let mut counts: HashMap<_, u64, u64> =
            HashMap::try_from(self.get_mut(map::LISTENER_COUNTS)?).map_err(map_err(map::LISTENER_COUNTS))?;
        match counts.insert(netns, 0, NO_EXIST) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                Ok(false)
            }
            Err(e) => Err(map_err(map::LISTENER_COUNTS)(e)),
        }
    }

    /// Takes back a staged registration that was not committed.
    pub fn abort(&mut self, staged: Staged) {
        if let Err(e) = staged.written.remove(|name| self.fd(name)) {
            tracing::warn!(netns_cookie = staged.netns, error = %crate::error_chain(&e), "staged capture entries not all removed (garbage collection takes them)");
        }
    }

    /// Takes back a committed registration: the pod's previous config (or none), then
    /// the staged entries.
    pub fn revert(&mut self, staged: Staged) {
        let restored = self
            .get_mut(map::POD_CONFIG)
            .and_then(|m| HashMap::<_, u64, PodConfig>::try_from(m).map_err(map_err(map::POD_CONFIG)))
            .and_then(|mut configs| match staged.previous {
                Some(old) => configs.insert(staged.netns, old, 0).map_err(map_err(map::POD_CONFIG)),
                None => match configs.remove(&staged.netns) {
                    Err(e) if !is_not_found(&e) => Err(map_err(map::POD_CONFIG)(e)),
                    _ => Ok(()),
                },
            });
        if let Err(e) = restored {
            tracing::error!(netns_cookie = staged.netns, error = %crate::error_chain(&e), "cannot restore a pod's previous capture config");
        }
        if let Err(e) = self.set_inbound_ports(staged.netns, staged.previous_ports) {
            tracing::error!(netns_cookie = staged.netns, error = %crate::error_chain(&e), "cannot restore a pod's previous inbound ports");
        }
        self.abort(staged);
    }

    /// Registers (or replaces) one pod in one switch, then removes what `previous` (the
    /// pod's last registration, from its record) wrote that this one did not. Returns
    /// the new registration, for the record.
    pub fn register(
        &mut self,
        netns: u64,
        pod: &PodCapture,
        previous: Option<&Registration>,
    ) -> Result<Registration, EbpfError> {
        let staged = self.stage(netns, pod)?;
        if let Err(e) = self.commit(&staged) {
            self.abort(staged);
            return Err(e);
        }
        let registration = staged.registration.clone();
        self.remove_stale(previous, &registration);
        Ok(registration)
    }

    /// Removes what `previous` holds and `current` does not (after a switch); a failure
    /// leaves orphans for garbage collection, never a wrong capture.
    pub fn remove_stale(&self, previous: Option<&Registration>, current: &Registration) {
        if let Some(previous) = previous
            && let Err(e) = previous.minus(current).remove(|name| self.fd(name))
        {
            tracing::warn!(error = %crate::error_chain(&e), "a pod's previous capture entries not all removed (garbage collection takes them)");
        }
    }

    /// Removes a pod: exactly what its registration wrote (its config first: the
    /// programs stop acting at once), or, for a pod recorded without one (an older
    /// record), its config, counters and every list entry under its cookie.
    pub fn unregister(&mut self, netns: u64, registration: Option<&Registration>) -> Result<(), EbpfError> {
        if let Some(registration) = registration {
            return registration.remove(|name| self.fd(name));
        }
        let mut configs: HashMap<_, u64, PodConfig> =
            HashMap::try_from(self.get_mut(map::POD_CONFIG)?).map_err(map_err(map::POD_CONFIG))?;
        match configs.remove(&netns) {
            Err(e) if !is_not_found(&e) => return Err(map_err(map::POD_CONFIG)(e)),
            _ => {}
        }
        match self.pod_counters_map_mut()?.remove(&netns) {
            Err(e) if !is_not_found(&e) => return Err(map_err(map::POD_COUNTERS)(e)),
            _ => {}
        }
        self.set_inbound_ports(netns, None)?;
        let mut counts: HashMap<_, u64, u64> =
            HashMap::try_from(self.get_mut(map::LISTENER_COUNTS)?).map_err(map_err(map::LISTENER_COUNTS))?;
        match counts.remove(&netns) {
            Err(e) if !is_not_found(&e) => return Err(map_err(map::LISTENER_COUNTS)(e)),
            _ => {}
        }
        self.remove_entries(|cookie, _| cookie == netns)
    }

    /// List entries no registered pod's config names (a registration interrupted by a
    /// crash, a pod that went without being unregistered): `(map, raw key)`.
    pub fn orphans(&self) -> Result<Vec<(&'static str, Vec<u8>)>, EbpfError> {
        let configs: std::collections::HashMap<u64, u32> = {
            let map: HashMap<_, u64, PodConfig> =
                HashMap::try_from(self.get(map::POD_CONFIG)?).map_err(map_err(map::POD_CONFIG))?;
            map.iter().filter_map(Result::ok).map(|(k, v)| (k, v.generation)).collect()
        };
        let mut out = Vec::new();
        self.each_entry(|name, cookie, generation, raw| {
            if configs.get(&cookie) != Some(&generation) {
                out.push((name, raw));
            }
        })?;
        Ok(out)
    }

    /// Removes every list entry for which `matches(cookie, generation)`.
    fn remove_entries(&mut self, matches: impl Fn(u64, u32) -> bool) -> Result<(), EbpfError> {
        let mut doomed: Vec<(&'static str, Vec<u8>)> = Vec::new();
        self.each_entry(|name, cookie, generation, raw| {
            if matches(cookie, generation) {
                doomed.push((name, raw));
            }
        })?;
        for (name, raw) in doomed {
            if let Some(fd) = self.fd(name) {
                crate::capture::ebpf::sys::delete_raw(fd, &raw)
                    .map_err(|source| EbpfError::Io { what: "remove a capture list entry", source })?;
            }
        }
        Ok(())
    }

    /// Calls `f(map, cookie, generation, raw key)` for every list entry.
    fn each_entry(&self, mut f: impl FnMut(&'static str, u64, u32, Vec<u8>)) -> Result<(), EbpfError> {
        for name in [map::EXCLUDE_V4, map::INCLUDE_V4, map::DNS_V4] {
            let trie: LpmTrie<_, CidrV4, u8> = LpmTrie::try_from(self.get(name)?).map_err(map_err(name))?;
            for key in trie.keys().filter_map(Result::ok) {
                let d = key.data();
                f(
                    name,
                    u64::from_be_bytes(d.netns),
                    u32::from_be_bytes(d.generation),
                    lpm_key_bytes(key.prefix_len(), &d),
                );
            }
        }
        for name in [map::EXCLUDE_V6, map::INCLUDE_V6, map::DNS_V6] {
            let trie: LpmTrie<_, CidrV6, u8> = LpmTrie::try_from(self.get(name)?).map_err(map_err(name))?;
            for key in trie.keys().filter_map(Result::ok) {
                let d = key.data();
                f(
                    name,
                    u64::from_be_bytes(d.netns),
                    u32::from_be_bytes(d.generation),
                    lpm_key_bytes(key.prefix_len(), &d),
                );
            }
        }
        Ok(())
    }

    /// Removes orphaned list entries (see [`MapSet::orphans`]); returns how many.
    pub fn collect_orphans(&self) -> Result<usize, EbpfError> {
        let orphans = self.orphans()?;
        for (name, raw) in &orphans {
            if let Some(fd) = self.fd(name) {
                crate::capture::ebpf::sys::delete_raw(fd, raw).map_err(|source| EbpfError::Io {
                    what: "remove an orphaned capture list entry",
                    source,
                })?;
            }
        }
        Ok(orphans.len())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_lpm_keys_raw_bytes_are_the_prefix_then_the_data() {
        let data =
            weir_ebpf_common::capture::CidrV4 { netns: [1; 8], generation: [2; 4], addr: [10, 0, 0, 0] };
        let raw = crate::capture::ebpf::registration::lpm_key_bytes(104, &data);
        assert_eq!(raw.len(), 4 + 16);
        assert_eq!(&raw[..4], &104u32.to_ne_bytes());
        assert_eq!(&raw[4..12], &[1; 8]);
        assert_eq!(&raw[16..], &[10, 0, 0, 0]);
    }
}
