//! Go's `time.Duration` text (`300ms`, `1m30s`), as istio-iptables' flags and
//! Istio's environment carry it, read exactly as Go reads it.

use std::time::Duration;

/// A Go `time.Duration` string (`300ms`, `5s`, `1m30s`, `1.5h`, `2h45m`), parsed as Go's
/// `time.ParseDuration` parses it: integer nanoseconds, fractions truncated, and `None`
/// for anything Go refuses, including a negative duration and one past Go's limit
/// (2562047h47m16.854775807s), so no input can overflow.
pub fn parse_go_duration(v: &str) -> Option<Duration> {
    const MAX_NANOS: u64 = i64::MAX as u64;
    let v = v.trim();
    let mut rest = v.strip_prefix('+').unwrap_or(v);
    if rest == "0" {
        return Some(Duration::ZERO);
    }
    if rest.is_empty() {
        return None;
    }
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let int_len = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        let (int, after) = rest.split_at(int_len);
        let (frac, after) = match after.strip_prefix('.') {
            Some(f) => f.split_at(f.find(|c: char| !c.is_ascii_digit()).unwrap_or(f.len())),
            None => ("", after),
        };
        if int.is_empty() && frac.is_empty() {
            return None;
        }
        let unit_len = after.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(after.len());
        let unit: u64 = match &after[..unit_len] {
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return None,
        };
        // The integer part, refused past the limit as Go's leadingInt does.
        let mut whole: u64 = 0;
        for digit in int.bytes() {
            whole = whole.checked_mul(10)?.checked_add(u64::from(digit - b'0'))?;
            if whole > MAX_NANOS {
                return None;
            }
        }
        let mut nanos = whole.checked_mul(unit).filter(|n| *n <= MAX_NANOS)?;
        // The fraction, truncated to the nanosecond (Go keeps the digits it can scale).
        let mut scale: u128 = 1;
        let mut fraction: u128 = 0;
        for digit in frac.bytes() {
            if scale > u128::from(MAX_NANOS) {
                break;
            }
            fraction = fraction * 10 + u128::from(digit - b'0');
            scale *= 10;
        }
        let fraction_nanos = u64::try_from(fraction * u128::from(unit) / scale).ok()?;
        nanos = nanos.checked_add(fraction_nanos).filter(|n| *n <= MAX_NANOS)?;
        total = total.checked_add(nanos).filter(|n| *n <= MAX_NANOS)?;
        rest = &after[unit_len..];
    }
    Some(Duration::from_nanos(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse_go_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_go_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_go_duration("5"), None);
        assert_eq!(parse_go_duration("1.5h"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_go_duration(".5s"), Some(Duration::from_millis(500)));
        assert_eq!(parse_go_duration("+2h45m"), Some(Duration::from_secs(9900)));
        assert_eq!(parse_go_duration("1\u{b5}s"), Some(Duration::from_micros(1)));
        assert_eq!(parse_go_duration("1.0000000019s"), Some(Duration::from_nanos(1_000_000_001)));
        assert_eq!(parse_go_duration("0"), Some(Duration::ZERO));
        for refused in ["", "s", ".s", "-5s", "5x", "1..5s", "5s3"] {
            assert_eq!(parse_go_duration(refused), None, "{refused:?}");
        }
    }

    #[test]
    fn go_durations_past_gos_limit_are_refused_not_a_panic() {
        // Go's largest Duration, exactly, and one nanosecond more.
        assert_eq!(
            parse_go_duration("2562047h47m16.854775807s"),
            Some(Duration::from_nanos(i64::MAX as u64))
        );
        assert_eq!(parse_go_duration("2562047h47m16.854775808s"), None);
        for huge in ["6000000000000000h", "9223372036854775808ns", "99999999999999999999999s", "2562048h"] {
            assert_eq!(parse_go_duration(huge), None, "{huge}");
        }
    }
}
