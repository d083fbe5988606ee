//! A snapshot of what the control plane serves: per type URL, a version and the named
//! resources (opaque `Any`). Types are shared between snapshots (`Arc`), so pushing a
//! change to one type does not copy the others. Pure data, no I/O.

use std::{collections::BTreeMap, sync::Arc};

use prost_types::Any;

/// The resources of one type.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TypeSnapshot {
    pub version: String,
    pub resources: BTreeMap<String, Any>,
}

impl TypeSnapshot {
    /// Delta's per-resource version: a content hash (FNV-1a), so an unchanged resource
    /// is not resent after a reconnect that reports it in `initial_resource_versions`.
    pub fn resource_version(resource: &Any) -> String {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in resource.type_url.as_bytes().iter().chain(&resource.value) {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        format!("{hash:016x}")
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    types: BTreeMap<String, Arc<TypeSnapshot>>,
}

impl Snapshot {
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces the resources of `type_url`.
    pub fn set<N: Into<String>>(
        &mut self,
        type_url: &str,
        version: impl Into<String>,
        resources: impl IntoIterator<Item = (N, Any)>,
    ) -> &mut Self {
        let resources = resources.into_iter().map(|(n, r)| (n.into(), r)).collect();
        self.types.insert(type_url.into(), Arc::new(TypeSnapshot { version: version.into(), resources }));
        self
    }

    /// Builder form of [`Snapshot::set`].
    pub fn with<N: Into<String>>(
        mut self,
        type_url: &str,
        version: impl Into<String>,
        resources: impl IntoIterator<Item = (N, Any)>,
    ) -> Self {
        self.set(type_url, version, resources);
        self
    }

    pub fn get(&self, type_url: &str) -> Option<&Arc<TypeSnapshot>> {
        self.types.get(type_url)
    }

    /// The version of `type_url` ("" when the snapshot has no such type).
    pub fn version(&self, type_url: &str) -> &str {
        self.types.get(type_url).map(|t| t.version.as_str()).unwrap_or("")
    }

    pub fn type_urls(&self) -> impl Iterator<Item = &str> {
        self.types.keys().map(String::as_str)
    }

    /// Total number of resources across types.
    pub fn len(&self) -> usize {
        self.types.values().map(|t| t.resources.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any(v: &[u8]) -> Any {
        Any { type_url: "type.googleapis.com/x".into(), value: v.to_vec() }
    }

    #[test]
    fn types_are_shared_and_versions_are_content_hashes() {
        let a = Snapshot::new().with("t1", "1", [("a", any(b"1"))]).with("t2", "1", [("b", any(b"2"))]);
        let mut b = a.clone();
        b.set("t1", "2", [("a", any(b"3"))]);
        assert!(Arc::ptr_eq(a.get("t2").unwrap(), b.get("t2").unwrap()));
        assert_eq!((a.version("t1"), b.version("t1"), b.version("none")), ("1", "2", ""));
        assert_eq!(b.len(), 2);
        let v1 = TypeSnapshot::resource_version(&any(b"1"));
        assert_eq!(v1, TypeSnapshot::resource_version(&any(b"1")));
        assert_ne!(v1, TypeSnapshot::resource_version(&any(b"3")));
    }
}
