//! Benchmark plumbing: options, repeated samples summarised as median with min/max,
//! tool output parsing, and the table (plain or markdown) with ratios to the floor.

use std::fmt::Write as _;

#[derive(Debug, Clone)]
pub struct Options {
    pub runs: usize,
    pub duration_secs: u64,
    pub connections: u32,
    pub markdown: bool,
    /// Set when this run is one round of an A/B comparison of that many rounds
    /// (`ab::compare`, which summarises the rounds itself).
    pub ab_rounds: Option<usize>,
}

impl Options {
    /// How a table's figures were summarised, for its notes.
    pub fn summary(&self) -> String {
        match self.ab_rounds {
            Some(n) => format!("One run per build in each of {n} rounds."),
            None => format!("Median [min–max] of {} runs.", self.runs),
        }
    }
}

/// Runs `once` `runs` times, logging each run as `[bench <bench>] <row> run i/n`, and
/// collects its two figures; a failed run is logged and recorded as NaN in both.
pub fn repeat_pair(
    bench: &str,
    row: &str,
    runs: usize,
    mut once: impl FnMut() -> anyhow::Result<(f64, f64)>,
) -> (Samples, Samples) {
    let (mut first, mut second) = (Samples::default(), Samples::default());
    for run in 0..runs {
        eprintln!("[bench {bench}] {row} run {}/{runs}", run + 1);
        let (a, b) = once().unwrap_or_else(|e| {
            eprintln!("[bench {bench}] {row} failed: {e:#}");
            (f64::NAN, f64::NAN)
        });
        first.0.push(a);
        second.0.push(b);
    }
    (first, second)
}

/// Repeated measurements of one quantity.
#[derive(Debug, Clone, Default)]
pub struct Samples(pub Vec<f64>);

impl Samples {
    /// The median of the successful samples (NaN if none succeeded).
    pub fn median(&self) -> f64 {
        let mut v: Vec<f64> = self.0.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }
    pub fn min(&self) -> f64 {
        self.0.iter().copied().filter(|x| x.is_finite()).fold(f64::INFINITY, f64::min)
    }
    pub fn max(&self) -> f64 {
        self.0.iter().copied().filter(|x| x.is_finite()).fold(f64::NEG_INFINITY, f64::max)
    }
    /// How many samples failed.
    pub fn failed(&self) -> usize {
        self.0.iter().filter(|x| !x.is_finite()).count()
    }
}

/// One row: a name and its metrics.
pub struct Row {
    pub name: String,
    pub metrics: Vec<Samples>,
}

/// A table of rows against the first row (the floor). `higher_is_better` per column
/// picks how ratios read.
pub struct Table {
    pub title: String,
    pub columns: Vec<(&'static str, &'static str, bool)>,
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
}

pub fn fmt_value(v: f64, unit: &str) -> String {
    match unit {
        "ms" => format!("{v:.2}"),
        _ if v >= 100.0 => format!("{v:.0}"),
        _ => format!("{v:.2}"),
    }
}

impl Table {
    pub fn render(&self, markdown: bool) -> String {
        let mut out = String::new();
        let floor = self.rows.first();
        let mut header = vec!["".to_string()];
        for (name, unit, _) in &self.columns {
            header.push(format!("{name} ({unit})"));
            header.push("vs floor".into());
        }
        let mut lines = vec![header];
        for row in &self.rows {
            let mut line = vec![row.name.clone()];
            for (i, (_, unit, _)) in self.columns.iter().enumerate() {
                let s = &row.metrics[i];
                let failed = if s.failed() > 0 {
                    format!(" ({} of {} failed)", s.failed(), s.0.len())
                } else {
                    String::new()
                };
                if s.0.is_empty() {
                    line.push("-".into());
                } else if s.median().is_finite() {
                    line.push(format!(
                        "{} [{}–{}]{failed}",
                        fmt_value(s.median(), unit),
                        fmt_value(s.min(), unit),
                        fmt_value(s.max(), unit)
                    ));
                } else {
                    line.push(format!("failed{failed}"));
                }
                let base = floor.map(|f| f.metrics[i].median()).unwrap_or(f64::NAN);
                let ratio = s.median() / base;
                line.push(if ratio.is_finite() { format!("{ratio:.2}×") } else { "-".into() });
            }
            lines.push(line);
        }
        emit(&mut out, &self.title, &lines, markdown);
        let mut seen = std::collections::HashSet::new();
        for note in self.notes.iter().filter(|n| seen.insert(n.as_str())) {
            let _ = writeln!(out, "{}{note}", if markdown { "\n" } else { "  " });
        }
        out
    }
}

/// The one table of `weir-bench all`: every row of every table against its own
/// table's floor, on that table's first measure.
pub fn headline(tables: &[Table], markdown: bool) -> String {
    let mut lines = vec![vec![
        "benchmark".to_string(),
        "row".to_string(),
        "measure".to_string(),
        "value".to_string(),
        "floor".to_string(),
        "vs floor".to_string(),
    ]];
    for t in tables {
        let Some(floor) = t.rows.first() else { continue };
        let Some((measure, unit, _)) = t.columns.first() else { continue };
        let base = floor.metrics[0].median();
        for row in &t.rows[1..] {
            let v = row.metrics[0].median();
            let ratio = v / base;
            lines.push(vec![
                t.title.clone(),
                row.name.clone(),
                format!("{measure} ({unit})"),
                if v.is_finite() {
                    format!(
                        "{} [{}–{}]",
                        fmt_value(v, unit),
                        fmt_value(row.metrics[0].min(), unit),
                        fmt_value(row.metrics[0].max(), unit)
                    )
                } else {
                    "failed".into()
                },
                if base.is_finite() { fmt_value(base, unit) } else { "-".into() },
                if ratio.is_finite() { format!("{ratio:.2}×") } else { "-".into() },
            ]);
        }
    }
    let mut out = String::new();
    emit(&mut out, "Every benchmark against its floor", &lines, markdown);
    out
}

/// A titled grid (first line the header): markdown, or columns padded for a terminal.
pub fn emit(out: &mut String, title: &str, lines: &[Vec<String>], markdown: bool) {
    let _ = writeln!(out, "{}", if markdown { format!("### {title}") } else { title.to_string() });
    let widths: Vec<usize> =
        (0..lines[0].len()).map(|c| lines.iter().map(|l| l[c].chars().count()).max().unwrap_or(0)).collect();
    for (n, line) in lines.iter().enumerate() {
        if markdown {
            let _ = writeln!(out, "| {} |", line.join(" | "));
            if n == 0 {
                let _ = writeln!(out, "|{}|", line.iter().map(|_| "---").collect::<Vec<_>>().join("|"));
            }
        } else {
            let cells: Vec<String> =
                line.iter().enumerate().map(|(c, v)| format!("{v:<w$}", w = widths[c])).collect();
            let _ = writeln!(out, "{}", cells.join("  "));
        }
    }
}

/// `wrk --latency` output: (requests/s, p50 ms, p99 ms).
pub fn parse_wrk(text: &str) -> Option<(f64, f64, f64)> {
    let rps = text.lines().find_map(|l| l.trim().strip_prefix("Requests/sec:"))?.trim().parse().ok()?;
    let pct = |p: &str| {
        text.lines().find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some(p)).then(|| w.next()).flatten().and_then(duration_ms)
        })
    };
    Some((rps, pct("50%")?, pct("99%")?))
}

/// wrk's "1.23ms" / "456.00us" / "1.02s" as milliseconds.
fn duration_ms(v: &str) -> Option<f64> {
    // Divide microseconds rather than multiply by 0.001: 412/1000 rounds to
    // the same f64 as the literal 0.412, 412*0.001 does not.
    if let Some(n) = v.strip_suffix("us") {
        return n.parse::<f64>().ok().map(|n| n / 1000.0);
    }
    let (num, scale) = if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1000.0)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|n| n * scale)
}

/// iperf3 --json: receiver throughput in Gbit/s.
pub fn parse_iperf(json: &str) -> Option<f64> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    Some(v["end"]["sum_received"]["bits_per_second"].as_f64()? / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_output_parses() {
        let text = "Running 5s test @ http://x\n  Latency Distribution\n     50%  412.00us\n     75%  1.02ms\n     90%  2.00ms\n     99%    3.50ms\n  10000 requests in 5.00s\nRequests/sec:   2000.50\n";
        assert_eq!(parse_wrk(text), Some((2000.5, 0.412, 3.5)));
    }

    #[test]
    fn medians() {
        assert_eq!(Samples(vec![3.0, 1.0, 2.0]).median(), 2.0);
        assert_eq!(Samples(vec![4.0, 1.0, 2.0, 3.0]).median(), 2.5);
    }
}
