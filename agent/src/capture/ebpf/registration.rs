//! What one pod's registration wrote into a program set's maps, kept as raw keys per
//! map (in the pod's record): enough to remove exactly that, and nothing else, without
//! scanning node-wide maps, and from any Weir build (a newer build removes a pod an
//! older one registered, in the older set, whose key layout it need not know).

use std::{collections::BTreeMap, os::fd::BorrowedFd};

use super::{EbpfError, sys};

/// Maps whose entries make a pod acted on: removed first, so the programs stop acting
/// on the pod before its lists go.
const FIRST: &[&str] = &[weir_ebpf_common::capture::map::POD_CONFIG, weir_ebpf_common::inbound::PODS];

/// Maps keyed by something other than the pod (an address), whose value starts with the
/// owning pod's netns cookie: another pod may own such a key by now, and then it is
/// not this registration's to remove.
const OWNED_BY_VALUE: &[&str] = &[weir_ebpf_common::inbound::PODS];

/// Maps keyed by the pod's netns cookie: any of their keys names the owner.
const KEYED_BY_COOKIE: &[&str] =
    &[weir_ebpf_common::capture::map::POD_CONFIG, weir_ebpf_common::inbound::POD_COUNTERS];

/// One pod's entries in a program set's maps.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Registration {
    /// The generation of its list entries (the one its config names).
    pub generation: u32,
    /// Raw keys (hex) by map name.
    pub keys: BTreeMap<String, Vec<String>>,
}

/// A key's raw bytes, as the record keeps them.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

/// The raw bytes of a plain `#[repr(C)]` value (a map key).
pub fn bytes_of<T: aya::Pod>(value: &T) -> Vec<u8> {
    // SAFETY: `aya::Pod` types are plain data with no padding-dependent invariants;
    // reading their bytes is what the kernel does with them.
    unsafe { std::slice::from_raw_parts((value as *const T).cast::<u8>(), std::mem::size_of::<T>()).to_vec() }
}

/// The raw key of an LPM trie entry (prefix length, then the data), as aya writes it.
pub fn lpm_key_bytes<T: aya::Pod>(prefix_len: u32, data: &T) -> Vec<u8> {
    let mut key = prefix_len.to_ne_bytes().to_vec();
    key.extend(bytes_of(data));
    key
}

impl Registration {
    pub fn add(&mut self, map: &str, key: &[u8]) {
        self.keys.entry(map.to_string()).or_default().push(hex(key));
    }

    pub fn is_empty(&self) -> bool {
        self.keys.values().all(Vec::is_empty)
    }

    /// The entries of `self` that `newer` does not have (what a re-registration leaves
    /// behind: the old generation's lists, addresses the pod no longer has).
    pub fn minus(&self, newer: &Registration) -> Registration {
        let mut out = Registration { generation: self.generation, keys: BTreeMap::new() };
        for (map, keys) in &self.keys {
            let kept = newer.keys.get(map);
            let gone: Vec<String> =
                keys.iter().filter(|k| !kept.is_some_and(|n| n.contains(k))).cloned().collect();
            if !gone.is_empty() {
                out.keys.insert(map.clone(), gone);
            }
        }
        out
    }

    /// Map names in removal order.
    fn order(&self) -> Vec<&str> {
        let mut names: Vec<&str> = FIRST.iter().copied().filter(|m| self.keys.contains_key(*m)).collect();
        names.extend(self.keys.keys().map(String::as_str).filter(|m| !FIRST.contains(m)));
        names
    }

    /// The owning pod's netns cookie (raw), from a key of a map keyed by it.
    fn owner(&self) -> Option<Vec<u8>> {
        KEYED_BY_COOKIE.iter().find_map(|m| self.keys.get(*m)?.first().and_then(|k| unhex(k)))
    }

    /// Whether the entry under `raw` in a map owned by value is another pod's now.
    fn owned_by_another(&self, fd: BorrowedFd<'_>, raw: &[u8]) -> bool {
        let Some(owner) = self.owner() else { return false };
        match sys::lookup_raw(fd, raw) {
            Ok(Some(value)) => value.get(..owner.len()).is_some_and(|v| v != owner.as_slice()),
            _ => false,
        }
    }

    /// Deletes every entry, through `map_fd` (a map's descriptor by name; `None`: the set
    /// has no such map, nothing to delete). Missing entries are fine, and so is an
    /// address entry another pod owns by now (left to it). Every entry is tried; the
    /// first failure is returned.
    pub fn remove<'a>(&self, map_fd: impl Fn(&str) -> Option<BorrowedFd<'a>>) -> Result<(), EbpfError> {
        let mut first_error = None;
        for name in self.order() {
            let Some(fd) = map_fd(name) else { continue };
            for key in &self.keys[name] {
                let Some(raw) = unhex(key) else {
                    first_error.get_or_insert(EbpfError::Io {
                        what: "read a registration's key (not hex)",
                        source: std::io::Error::other(format!("{name}: {key:?}")),
                    });
                    continue;
                };
                if OWNED_BY_VALUE.contains(&name) && self.owned_by_another(fd, &raw) {
                    tracing::info!(map = name, key = %key, "entry left alone: another pod owns it now");
                    continue;
                }
                if let Err(source) = sys::delete_raw(fd, &raw) {
                    tracing::warn!(map = name, key = %key, error = %source, "registration entry not removed");
                    first_error
                        .get_or_insert(EbpfError::Io { what: "remove a registration's map entry", source });
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_hex_and_bad_text_is_refused() {
        assert_eq!(unhex(&hex(&[0, 1, 0xab, 0xff])), Some(vec![0, 1, 0xab, 0xff]));
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
        assert_eq!(lpm_key_bytes(96, &7u32), [96u32.to_ne_bytes(), 7u32.to_ne_bytes()].concat());
    }

    #[test]
    fn what_a_newer_registration_leaves_behind_and_the_removal_order() {
        let mut old = Registration { generation: 1, ..Default::default() };
        old.add("POD_CONFIG", &[1]);
        old.add("EXCLUDE_V4", &[1, 1]);
        old.add("INBOUND_PODS", &[2]);
        old.add("INBOUND_PODS", &[3]);
        let mut new = Registration { generation: 2, ..Default::default() };
        new.add("POD_CONFIG", &[1]);
        new.add("EXCLUDE_V4", &[1, 2]);
        new.add("INBOUND_PODS", &[3]);
        let stale = old.minus(&new);
        assert_eq!(stale.keys.get("POD_CONFIG"), None, "the config key is the same: kept");
        assert_eq!(stale.keys["EXCLUDE_V4"], vec![hex(&[1, 1])]);
        assert_eq!(stale.keys["INBOUND_PODS"], vec![hex(&[2])]);
        assert_eq!(old.order(), vec!["POD_CONFIG", "INBOUND_PODS", "EXCLUDE_V4"]);
    }
}
