//! A process's resident memory split by what holds it, from `/proc/<pid>/smaps`: its
//! own executable (text; data and relocations), shared libraries, the heap (`[heap]`
//! and malloc's arenas), thread stacks, and other anonymous memory.
//!
//! Anonymous mappings carry no name, so two shapes are told apart by their neighbours:
//! a thread stack sits right above its guard page (an inaccessible mapping of at most
//! 64 KiB ending where the stack starts); a glibc arena is readable-writable memory
//! right below the inaccessible rest of its reservation. Anything else anonymous
//! (allocator pages mapped directly, tokio's and the kernel's own) is "other".

use anyhow::Context as _;

/// Resident KiB per part.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Breakdown {
    pub total: u64,
    pub binary_text: u64,
    pub binary_data: u64,
    pub libraries: u64,
    pub heap: u64,
    pub stacks: u64,
    pub other_anon: u64,
    pub threads: u64,
}

struct Mapping {
    start: u64,
    end: u64,
    perms: String,
    path: String,
    rss_kib: u64,
}

/// The breakdown of `pid`, now.
pub fn read(pid: u32) -> anyhow::Result<Breakdown> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).context("smaps")?;
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).context("exe")?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).context("status")?;
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut b = classify(&parse(&smaps), &exe.to_string_lossy());
    b.threads = threads;
    Ok(b)
}

fn parse(smaps: &str) -> Vec<Mapping> {
    let mut out: Vec<Mapping> = Vec::new();
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if let Some((start, end)) = first.split_once('-')
            && let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
        {
            let perms = words.next().unwrap_or_default().to_string();
            // offset, device, inode, then the path (which may hold spaces).
            let path = words.skip(3).collect::<Vec<_>>().join(" ");
            out.push(Mapping { start, end, perms, path, rss_kib: 0 });
        } else if first == "Rss:"
            && let (Some(m), Some(kib)) = (out.last_mut(), words.next().and_then(|v| v.parse().ok()))
        {
            m.rss_kib = kib;
        }
    }
    out
}

fn classify(maps: &[Mapping], exe: &str) -> Breakdown {
    const GUARD_MAX: u64 = 64 * 1024;
    let mut b = Breakdown::default();
    let inaccessible = |m: &Mapping| m.path.is_empty() && m.perms.starts_with("---");
    for (i, m) in maps.iter().enumerate() {
        b.total += m.rss_kib;
        let part = if m.path == exe || m.path.starts_with(&format!("{exe} ")) {
            if m.perms.contains('x') { &mut b.binary_text } else { &mut b.binary_data }
        } else if m.path == "[heap]" {
            &mut b.heap
        } else if m.path == "[stack]" {
            &mut b.stacks
        } else if m.path.starts_with('/') {
            &mut b.libraries
        } else if m.path.is_empty() {
            let below_guard = i > 0
                && inaccessible(&maps[i - 1])
                && maps[i - 1].end == m.start
                && maps[i - 1].end - maps[i - 1].start <= GUARD_MAX;
            let below_reserve = maps.get(i + 1).is_some_and(|n| inaccessible(n) && n.start == m.end);
            if below_guard {
                &mut b.stacks
            } else if below_reserve {
                &mut b.heap
            } else {
                &mut b.other_anon
            }
        } else {
            // [vdso], [vvar] and the like.
            &mut b.other_anon
        };
        *part += m.rss_kib;
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_told_apart() {
        let smaps = "\
55550000-55560000 r--p 00000000 fd:00 12 /bin/weir
Rss:                  40 kB
55560000-55580000 r-xp 00010000 fd:00 12 /bin/weir
Rss:                 100 kB
55580000-55590000 rw-p 00030000 fd:00 12 /bin/weir
Rss:                  20 kB
55590000-555a0000 rw-p 00000000 00:00 0 [heap]
Rss:                  30 kB
7f0000000000-7f0000021000 rw-p 00000000 00:00 0
Rss:                  50 kB
7f0000021000-7f0004000000 ---p 00000000 00:00 0
Rss:                   0 kB
7f1000000000-7f1000001000 ---p 00000000 00:00 0
Rss:                   0 kB
7f1000001000-7f1000201000 rw-p 00000000 00:00 0
Rss:                  16 kB
7f2000000000-7f2000010000 rw-p 00000000 00:00 0
Rss:                   8 kB
7f3000000000-7f3000100000 r-xp 00000000 fd:00 9 /usr/lib/libc.so.6
Rss:                 300 kB
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0 [stack]
Rss:                  12 kB
";
        let b = classify(&parse(smaps), "/bin/weir");
        assert_eq!(
            b,
            Breakdown {
                total: 576,
                binary_text: 100,
                binary_data: 60,
                libraries: 300,
                heap: 80,
                stacks: 28,
                other_anon: 8,
                threads: 0,
            }
        );
    }
}
