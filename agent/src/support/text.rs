//! How values are written and read as text in configuration, dumps and logs:
//! durations parsed as Go's `time.ParseDuration` parses them, and printed as protobuf
//! JSON (`45s`, `0.5s`) or as Go's `Duration.String()` (`1m0s`) prints them; serde
//! helpers that write a duration or any `Display` value as a string.

use std::time::Duration;

/// Go's `time.ParseDuration` (units ns, us, µs, ms, s, m, h; decimals; "0"), shared
/// with `istio-iptables`' flag parsing.
pub use weir_iptables::flags::parse_go_duration as parse_duration;

/// Renders a duration as Go and protobuf JSON do (`45s`, `0.5s`).
pub fn format_duration(d: Duration) -> String {
    let secs = d.as_secs_f64();
    if secs.fract() == 0.0 { format!("{}s", d.as_secs()) } else { format!("{secs}s") }
}

/// serde: a duration as protobuf JSON writes it ([`format_duration`]).
pub(crate) fn serialize_duration<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_duration(*d))
}

/// serde: any `Display` value as its text.
pub(crate) fn serialize_display<S: serde::Serializer, T: std::fmt::Display>(
    v: &T,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// Go's `time.Duration.String()`: `10s`, `1m0s`, `1.5s`, `100ms`.
pub fn go_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    let frac = |value: u128, unit: u128| -> String {
        let whole = value / unit;
        let rest = value % unit;
        if rest == 0 {
            return whole.to_string();
        }
        let digits = unit.ilog10() as usize;
        let text = format!("{rest:0digits$}");
        format!("{whole}.{}", text.trim_end_matches('0'))
    };
    if nanos < 1_000 {
        return format!("{nanos}ns");
    }
    if nanos < 1_000_000 {
        return format!("{}µs", frac(nanos, 1_000));
    }
    if nanos < 1_000_000_000 {
        return format!("{}ms", frac(nanos, 1_000_000));
    }
    let secs = frac(nanos % 60_000_000_000, 1_000_000_000);
    let minutes = nanos / 60_000_000_000;
    match (minutes / 60, minutes % 60) {
        (0, 0) => format!("{secs}s"),
        (0, m) => format!("{m}m{secs}s"),
        (h, m) => format!("{h}h{m}m{secs}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_print_as_go_prints_them() {
        let cases = [
            (Duration::from_secs(10), "10s"),
            (Duration::from_secs(60), "1m0s"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_millis(100), "100ms"),
            (Duration::from_secs(3600 + 61), "1h1m1s"),
            (Duration::from_micros(2), "2µs"),
            (Duration::ZERO, "0s"),
        ];
        for (d, want) in cases {
            assert_eq!(go_duration(d), want);
        }
    }
}
