//! Where environment variables come from: the process, or a map in tests (no
//! `set_var`). Values are read through the table in `vars.rs`, whose entries parse
//! them as Go's `strconv`/`time` do (Istio's env values are written for pilot-agent).

use std::collections::BTreeMap;

pub trait Env {
    fn var(&self, name: &str) -> Option<String>;
    /// Every variable, for prefixed families (`XDS_HEADER_*`).
    fn vars(&self) -> Vec<(String, String)>;
}

/// The process environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
    fn vars(&self) -> Vec<(String, String)> {
        std::env::vars().collect()
    }
}

/// A fixed environment (tests, or a config printed for another pod).
#[derive(Debug, Default, Clone)]
pub struct MapEnv(pub BTreeMap<String, String>);

impl<const N: usize> From<[(&str, &str); N]> for MapEnv {
    fn from(pairs: [(&str, &str); N]) -> Self {
        Self(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }
}

impl Env for MapEnv {
    fn var(&self, name: &str) -> Option<String> {
        self.0.get(name).cloned()
    }
    fn vars(&self) -> Vec<(String, String)> {
        self.0.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

/// Go's `strconv.ParseBool` (the same forms pflag takes).
pub use weir_iptables::flags::parse_bool;

pub use crate::support::text::{format_duration, parse_duration};

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn go_durations_and_bools() {
        assert_eq!(parse_duration("45s"), Some(Duration::from_secs(45)));
        assert_eq!(parse_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("100ms"), Some(Duration::from_millis(100)));
        assert_eq!(parse_duration("1.5h"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        for bad in ["", "5", "s", "5x", "-1s"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
        assert_eq!(parse_bool("True"), Some(true));
        assert_eq!(parse_bool("yes"), None);
        assert_eq!(format_duration(Duration::from_secs(45)), "45s");
        assert_eq!(format_duration(Duration::from_millis(500)), "0.5s");
    }
}
