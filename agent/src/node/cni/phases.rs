//! Where one plugin run spends its time, for `weir-bench cni`: with `WEIR_CNI_PHASES`
//! set in its environment (a runtime never sets it) the plugin marks the end of each
//! phase on `CLOCK_MONOTONIC` and writes one line to stderr as it ends:
//!
//! `weir-cni phases: main=<ns> config=<µs> api=<µs> netns=<µs> capture=<µs> result=<µs>`
//!
//! `main` is the clock when `main` was entered (the caller, which read the same clock
//! before it spawned the plugin, gets exec and start-up from it); each later figure is
//! the time since the previous mark. Unset, a mark costs one relaxed atomic load.

use std::sync::{
    Mutex,
    atomic::{AtomicBool, Ordering},
};

/// The environment variable that turns the report on.
pub const ENV: &str = "WEIR_CNI_PHASES";
/// The report line's prefix.
pub const PREFIX: &str = "weir-cni phases:";

static ON: AtomicBool = AtomicBool::new(false);
static MARKS: Mutex<Vec<(&'static str, u64)>> = Mutex::new(Vec::new());

/// `CLOCK_MONOTONIC` in nanoseconds (the clock `std::time::Instant` reads on Linux).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// Called first thing in the plugin's `main`: turns marking on when `ENV` is set and
/// records the start.
pub fn start() {
    let at = now_ns();
    if std::env::var_os(ENV).is_some() {
        ON.store(true, Ordering::Relaxed);
        MARKS.lock().unwrap_or_else(|e| e.into_inner()).push(("main", at));
    }
}

/// Marks the end of `phase`.
pub fn mark(phase: &'static str) {
    if ON.load(Ordering::Relaxed) {
        let at = now_ns();
        MARKS.lock().unwrap_or_else(|e| e.into_inner()).push((phase, at));
    }
}

/// Writes the report line to stderr, if marking is on.
pub fn report() {
    if !ON.load(Ordering::Relaxed) {
        return;
    }
    let line = render(&MARKS.lock().unwrap_or_else(|e| e.into_inner()));
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

fn render(marks: &[(&'static str, u64)]) -> String {
    let mut line = PREFIX.to_string();
    let mut previous = None;
    for &(phase, at) in marks {
        match previous {
            None => line.push_str(&format!(" {phase}={at}")),
            Some(p) => line.push_str(&format!(" {phase}={:.1}", at.saturating_sub(p) as f64 / 1000.0)),
        }
        previous = Some(at);
    }
    line
}

/// A report line's figures: `main`'s clock in ns, then each phase and its µs.
pub fn parse(line: &str) -> Option<(u64, Vec<(String, f64)>)> {
    let mut words = line.strip_prefix(PREFIX)?.split_whitespace();
    let main = words.next()?.strip_prefix("main=")?.parse().ok()?;
    let phases = words
        .map(|w| {
            let (phase, us) = w.split_once('=')?;
            Some((phase.to_string(), us.parse().ok()?))
        })
        .collect::<Option<Vec<_>>>()?;
    Some((main, phases))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_reads_back() {
        let line = render(&[("main", 1_000_000), ("config", 1_150_000), ("api", 1_400_500)]);
        assert_eq!(line, "weir-cni phases: main=1000000 config=150.0 api=250.5");
        assert_eq!(
            parse(&line),
            Some((1_000_000, vec![("config".to_string(), 150.0), ("api".to_string(), 250.5)]))
        );
        assert_eq!(parse("something else"), None);
        assert_eq!(parse("weir-cni phases: main=x"), None);
    }
}
