//! The agent's resident memory after start-up. Most of the code the agent runs, it runs
//! once: parsing its configuration, rendering Envoy's bootstrap, generating the first
//! key, setting up TLS. The kernel maps executable pages in 64 KiB runs around each
//! page touched, so start-up leaves about 10 MiB of the binary resident of which the
//! idle agent touches under 1 MiB (measured in docs/benchmarks-history.md, "Agent
//! footprint at idle").
//!
//! Once the agent is up, [`release_startup_pages`] drops the read-only file pages
//! (code, read-only data) from its resident set with `MADV_DONTNEED`. For a private
//! file mapping never written, that is exactly as if the page had never been touched:
//! it stays in the page cache (clean, shared with every other process mapping the
//! file, reclaimable) and comes back on a minor fault when it runs again. Mappings
//! holding private copies (relocated data, anything writable) are never touched: on
//! those, `MADV_DONTNEED` would throw the copies away. Freed heap is returned to the
//! kernel too (`malloc_trim`).

use std::time::Duration;

/// What one release gave back, in KiB of resident memory before and after.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Read-only file pages dropped (sum of the `Rss` of the mappings released).
    pub file_kib: u64,
    /// Mappings released.
    pub mappings: usize,
}

/// A mapping from `/proc/self/smaps` that may be released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Releasable {
    pub start: usize,
    pub end: usize,
    pub rss_kib: u64,
}

/// The mappings of `smaps` whose pages can be dropped without losing anything: private,
/// backed by a file, not writable, and holding no private (anonymous) copy of any page.
pub fn releasable(smaps: &str) -> Vec<Releasable> {
    struct Current {
        start: usize,
        end: usize,
        eligible: bool,
        rss_kib: u64,
        anonymous_kib: Option<u64>,
    }
    let mut out = Vec::new();
    let mut current: Option<Current> = None;
    let finish = |c: Option<Current>, out: &mut Vec<Releasable>| {
        if let Some(c) = c
            && c.eligible
            && c.anonymous_kib == Some(0)
            && c.rss_kib > 0
        {
            out.push(Releasable { start: c.start, end: c.end, rss_kib: c.rss_kib });
        }
    };
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if let Some((start, end)) = first.split_once('-')
            && let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16))
        {
            finish(current.take(), &mut out);
            let perms = words.next().unwrap_or_default();
            // offset, device, inode, then the path.
            let inode = words.nth(2).unwrap_or("0");
            let path = words.next().unwrap_or_default();
            let eligible = matches!(perms, "r-xp" | "r--p") && inode != "0" && path.starts_with('/');
            current = Some(Current { start, end, eligible, rss_kib: 0, anonymous_kib: None });
        } else if let Some(c) = current.as_mut() {
            let kib = || words.clone().next().and_then(|v| v.parse::<u64>().ok());
            match first {
                "Rss:" => c.rss_kib = kib().unwrap_or(0),
                "Anonymous:" => c.anonymous_kib = kib(),
                _ => {}
            }
        }
    }
    finish(current.take(), &mut out);
    out
}

/// Drops the process's read-only file pages from its resident set and returns freed
/// heap to the kernel. Pages in use come back on their next touch.
pub fn release_startup_pages() -> std::io::Result<Released> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut released = Released::default();
    for m in releasable(&smaps) {
        // SAFETY: the range is a whole private, read-only file mapping with no private
        // copy of any page (checked just above from smaps); dropping its pages only
        // unmaps page-cache pages, which the next access maps again unchanged.
        let rc = unsafe { libc::madvise(m.start as *mut libc::c_void, m.end - m.start, libc::MADV_DONTNEED) };
        if rc == 0 {
            released.file_kib += m.rss_kib;
            released.mappings += 1;
        }
    }
    trim_heap();
    Ok(released)
}

#[cfg(target_env = "gnu")]
fn trim_heap() {
    // SAFETY: glibc's malloc_trim takes the allocator's own locks.
    unsafe { libc::malloc_trim(0) };
}

#[cfg(not(target_env = "gnu"))]
fn trim_heap() {}

/// Waits until `ready` first answers true (polled every `every`, for at most
/// `at_most`: a proxy that never gets ready has started up all the same), then
/// releases the start-up pages once, logging what it gave back.
pub async fn release_when_ready<F, Fut>(mut ready: F, every: Duration, at_most: Duration)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + at_most;
    while !ready().await && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(every).await;
    }
    match release_startup_pages() {
        Ok(r) => tracing::debug!(
            file_kib = r.file_kib,
            mappings = r.mappings,
            "start-up over: read-only pages released from the resident set"
        ),
        Err(e) => tracing::debug!(error = %e, "cannot read /proc/self/smaps: start-up pages kept"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55b025961000-55b025ebe000 r--p 00000000 fe:00 6056662                    /usr/local/bin/weir
Rss:                2044 kB
Anonymous:             0 kB
55b025ebe000-55b026b10000 r-xp 0055c000 fe:00 6056662                    /usr/local/bin/weir
Rss:               10236 kB
Anonymous:             0 kB
55b026b10000-55b026b9a000 r--p 011ad000 fe:00 6056662                    /usr/local/bin/weir
Rss:                 552 kB
Anonymous:           552 kB
55b026b9a000-55b026b9f000 rw-p 01236000 fe:00 6056662                    /usr/local/bin/weir
Rss:                  20 kB
Anonymous:            20 kB
55b026ba0000-55b026bc0000 rw-p 00000000 00:00 0                          [heap]
Rss:                  64 kB
Anonymous:            64 kB
7f0000000000-7f0000001000 r--p 00000000 00:00 0
Rss:                   4 kB
Anonymous:             4 kB
7f1000000000-7f1000100000 r-xp 00028000 fe:00 9 /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                 900 kB
Anonymous:             0 kB
7f1000100000-7f1000104000 r--p 00100000 fe:00 9 /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                  16 kB
Anonymous:            16 kB
7f2000000000-7f2000010000 r--p 00000000 fe:00 12 /usr/lib/locale/C.utf8/LC_CTYPE
Rss:                   0 kB
Anonymous:             0 kB
7ffc00001000-7ffc00003000 r-xp 00000000 00:00 0                          [vdso]
Rss:                   8 kB
Anonymous:             0 kB
";

    #[test]
    fn only_clean_read_only_file_pages_are_released() {
        let got = releasable(SMAPS);
        assert_eq!(
            got,
            vec![
                Releasable { start: 0x55b025961000, end: 0x55b025ebe000, rss_kib: 2044 },
                Releasable { start: 0x55b025ebe000, end: 0x55b026b10000, rss_kib: 10236 },
                Releasable { start: 0x7f1000000000, end: 0x7f1000100000, rss_kib: 900 },
            ],
            "relocated data (private copies), writable, anonymous, empty and [vdso] mappings stay"
        );
    }

    #[test]
    fn a_mapping_without_its_anonymous_line_stays() {
        let smaps =
            "55b025961000-55b025ebe000 r-xp 00000000 fe:00 6056662 /usr/local/bin/weir\nRss: 2044 kB\n";
        assert!(releasable(smaps).is_empty());
    }

    #[test]
    fn releasing_keeps_the_process_running_and_its_data_intact() {
        let data: Vec<u64> = (0..100_000).collect();
        let released = release_startup_pages().expect("smaps is readable");
        assert!(released.mappings > 0, "the test binary's own code is released: {released:?}");
        // Code, relocated data and heap still work after the release.
        assert_eq!(data.iter().sum::<u64>(), 4_999_950_000);
        assert_eq!(format!("{:?}", Some(released.mappings > 0)), "Some(true)");
    }
}
