//! `weir-bench <name> --against-bin <weir>`: one benchmark run with two builds of the
//! `weir` binary in turn, round by round, in one process. Each round runs the whole
//! benchmark once with each build, the order alternating (this/other, other/this, ...),
//! so load from elsewhere on the machine falls on both alike. The report is one table
//! per benchmark table: for every row and measure, the floor (both builds' rounds
//! pooled), each build against it, the ratio between the builds round by round, and
//! whether that difference stands out of the run-to-run spread.
//!
//! Only the `weir` binary is swapped (`weir_tests::tools::use_weir`): the harness, the
//! control plane and the floors are this checkout's on both sides.

use std::path::PathBuf;

use crate::report::{Options, Samples, Table, emit, fmt_value};

/// Benchmarks whose measured work is the `weir` binary (`--against` can swap it).
pub const SWAPPABLE: [&str; 4] = ["xds", "sidecar", "cni", "setup"];

/// One build under comparison.
pub struct Build {
    /// How the tables name it (e.g. `this checkout (7286d8e)`, `2e6a806`).
    pub label: String,
    /// Its `weir`; `None` is this checkout's (next to weir-bench).
    pub weir: Option<PathBuf>,
}

/// A benchmark: its tables from one run.
pub type Bench = fn(&Options) -> anyhow::Result<Vec<Table>>;

/// Runs `bench` `opts.runs` rounds, each once with `this` and once with `other`, and
/// renders the comparison.
pub fn compare(name: &str, bench: Bench, opts: &Options, this: &Build, other: &Build) -> String {
    let builds = [this, other];
    let once = Options { runs: 1, ab_rounds: Some(opts.runs), ..opts.clone() };
    // rounds[b][r]: build b's tables in round r (None: the run failed).
    let mut rounds: [Vec<Option<Vec<Table>>>; 2] = [Vec::new(), Vec::new()];
    let mut loads = Vec::new();
    for round in 0..opts.runs {
        loads.push(load_1min());
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for b in order {
            eprintln!("[bench {name}] round {}/{}: {}", round + 1, opts.runs, builds[b].label);
            weir_tests::tools::use_weir(builds[b].weir.clone());
            let tables = bench(&once)
                .inspect_err(|e| eprintln!("[bench {name}] {} failed: {e:#}", builds[b].label))
                .ok();
            rounds[b].push(tables);
        }
    }
    weir_tests::tools::use_weir(None);
    let Some(shape) = rounds.iter().flatten().flatten().next() else {
        return format!("{name}: every round failed with both builds\n");
    };
    let mut out = String::new();
    for table in shape {
        out.push_str(&render(table, &rounds, [&this.label, &other.label], opts));
        out.push('\n');
    }
    out.push_str(&format!("1-minute load average at each round's start: {}\n", loads.join(", ")));
    out
}

/// The 1-minute load average (a shared machine's other work shows in every figure).
fn load_1min() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(String::from))
        .unwrap_or_else(|| "?".into())
}

/// Build `b`'s value of (`title`, `row`, measure `col`) in each round (NaN when absent).
fn per_round(rounds: &[Option<Vec<Table>>], title: &str, row: &str, col: usize) -> Vec<f64> {
    rounds
        .iter()
        .map(|tables| {
            tables
                .as_ref()
                .and_then(|ts| ts.iter().find(|t| t.title == title))
                .and_then(|t| t.rows.iter().find(|r| r.name == row))
                .and_then(|r| r.metrics.get(col))
                .map(Samples::median)
                .unwrap_or(f64::NAN)
        })
        .collect()
}

fn cell(s: &Samples, unit: &str) -> String {
    let failed = s.failed();
    if !s.median().is_finite() {
        return if s.0.is_empty() { "-".into() } else { "failed".into() };
    }
    let failed = if failed > 0 { format!(" ({failed} failed)") } else { String::new() };
    format!(
        "{} [{}–{}]{failed}",
        fmt_value(s.median(), unit),
        fmt_value(s.min(), unit),
        fmt_value(s.max(), unit)
    )
}

/// `1.25× (+80 µs)`: a build against the floor, as a ratio and, for times, a difference.
fn against(value: f64, floor: f64, unit: &str) -> String {
    let ratio = value / floor;
    if !ratio.is_finite() {
        return "-".into();
    }
    let diff = value - floor;
    match unit {
        "ms" if diff.abs() < 1.0 => format!("{ratio:.2}× ({:+.0} µs)", diff * 1000.0),
        "ms" => format!("{ratio:.2}× ({diff:+.2} ms)"),
        _ => format!("{ratio:.2}×"),
    }
}

/// What the per-round ratios (this ÷ other) show.
pub fn verdict(ratios: &Samples, higher_is_better: bool) -> String {
    let n = ratios.0.iter().filter(|r| r.is_finite()).count();
    if n < 2 {
        return "too few rounds to compare".into();
    }
    let (lo, hi) = (ratios.min(), ratios.max());
    if lo <= 1.0 && hi >= 1.0 {
        let spread = (hi - lo) / 2.0 * 100.0;
        return if spread > 10.0 {
            format!("within the run-to-run spread (±{spread:.0} %): noise too large to conclude")
        } else {
            format!("within the run-to-run spread (±{spread:.0} %): no difference shown")
        };
    }
    let better = (lo > 1.0) == higher_is_better;
    let word = match (lo > 1.0, better) {
        (true, true) => "higher (better)",
        (true, false) => "higher (worse)",
        (false, true) => "lower (better)",
        (false, false) => "lower (worse)",
    };
    if n < 5 {
        format!("{word} in all {n} rounds; too few rounds to conclude (use --runs 5 or more)")
    } else {
        format!("{word} in every round ({n} of {n})")
    }
}

fn render(shape: &Table, rounds: &[Vec<Option<Vec<Table>>>; 2], labels: [&str; 2], opts: &Options) -> String {
    let mut lines = vec![
        [
            "row",
            "measure",
            "floor",
            labels[1],
            "vs floor",
            labels[0],
            "vs floor",
            "this ÷ other, per round",
            "verdict",
        ]
        .map(String::from)
        .to_vec(),
    ];
    let Some(floor_row) = shape.rows.first() else { return String::new() };
    for row in &shape.rows[1..] {
        for (col, (measure, unit, higher_is_better)) in shape.columns.iter().enumerate() {
            let floor = Samples(
                rounds.iter().flat_map(|r| per_round(r, &shape.title, &floor_row.name, col)).collect(),
            );
            let [this, other] = [0, 1].map(|b| per_round(&rounds[b], &shape.title, &row.name, col));
            if this.iter().chain(&other).all(|v| v.is_nan()) {
                continue;
            }
            let ratios = Samples(this.iter().zip(&other).map(|(a, b)| a / b).collect());
            let [this, other] = [Samples(this), Samples(other)];
            let ratio_cell = if ratios.median().is_finite() {
                format!("{:.3}× [{:.3}–{:.3}]", ratios.median(), ratios.min(), ratios.max())
            } else {
                "-".into()
            };
            lines.push(vec![
                row.name.clone(),
                format!("{measure} ({unit})"),
                if floor.0.iter().all(|v| v.is_nan()) { "-".into() } else { cell(&floor, unit) },
                cell(&other, unit),
                against(other.median(), floor.median(), unit),
                cell(&this, unit),
                against(this.median(), floor.median(), unit),
                ratio_cell,
                verdict(&ratios, *higher_is_better),
            ]);
        }
    }
    let mut out = String::new();
    emit(&mut out, &format!("{}: {} against {}", shape.title, labels[0], labels[1]), &lines, opts.markdown);
    let mut notes = vec![format!(
        "{} rounds; each round ran the benchmark once with each build, the order alternating. Values are median \
         [min–max] over the rounds; the floor pools both builds' rounds; \"this ÷ other\" is the ratio of the two \
         builds within each round. A difference counts only when every round shows it.",
        opts.runs
    )];
    notes.extend(shape.notes.iter().cloned());
    let sep = if opts.markdown { "\n" } else { "  " };
    for note in notes {
        out.push_str(&format!("{sep}{note}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_difference_counts_only_when_every_round_shows_it() {
        let mixed = Samples(vec![0.98, 1.04, 1.01]);
        assert!(verdict(&mixed, false).starts_with("within the run-to-run spread"));
        let noisy = Samples(vec![0.7, 1.3, 1.1]);
        assert!(verdict(&noisy, false).contains("noise too large"));
        let slower = Samples(vec![1.2, 1.3, 1.25, 1.4, 1.22]);
        assert_eq!(verdict(&slower, false), "higher (worse) in every round (5 of 5)");
        assert_eq!(verdict(&slower, true), "higher (better) in every round (5 of 5)");
        let few = Samples(vec![0.8, 0.9]);
        assert!(verdict(&few, false).contains("too few rounds to conclude"));
        assert_eq!(verdict(&Samples(vec![1.1, f64::NAN]), false), "too few rounds to compare");
    }

    #[test]
    fn times_against_the_floor_read_as_a_difference_too() {
        assert_eq!(against(0.33, 0.25, "ms"), "1.32× (+80 µs)");
        assert_eq!(against(12.0, 8.0, "ms"), "1.50× (+4.00 ms)");
        assert_eq!(against(3.0, 2.0, "MiB"), "1.50×");
        assert_eq!(against(1.0, f64::NAN, "ms"), "-");
    }
}
