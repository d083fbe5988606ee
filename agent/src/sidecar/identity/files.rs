//! The files behind SDS resources (`file-cert:`, `file-root:` — names istiod passes on
//! from any DestinationRule or Gateway — and mounted workload certificates): read on a
//! blocking thread, never on the runtime; regular files only (a FIFO, device, socket or
//! directory is refused by name, after an open that cannot block); at most
//! `MAX_SECRET_FILE` bytes. And the watch list: the files of the names some SDS stream
//! asks for, checked for changes by metadata (one `stat` each per poll) and re-read
//! only when that changed; a name no stream asks for any more is dropped.

use std::{
    collections::BTreeMap,
    hash::{Hash, Hasher},
    io::{self, Read as _},
    os::unix::fs::{FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
    sync::Mutex,
};

/// The largest file an SDS resource is read from: 1 MiB. A certificate chain is a few
/// KiB and the OS trust bundle (`file-root:system`) about 200 KiB; anything larger is
/// not a certificate file, and reading it would only cost the agent memory.
pub const MAX_SECRET_FILE: u64 = 1 << 20;

/// What `stat` says of a file: any write, rename over it, or symlink swap (a
/// Kubernetes `..data` update) changes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stamp {
    dev: u64,
    ino: u64,
    mode: u32,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            mode: meta.mode(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// `path`'s stamp (following symlinks); `None` when it cannot be had.
pub fn stamp(path: &Path) -> Option<Stamp> {
    std::fs::metadata(path).ok().map(|m| Stamp::of(&m))
}

fn refused(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

/// Reads `path` (symlinks followed: mounted secrets are links through `..data`) as
/// text. Opened without blocking (`O_NONBLOCK`: a FIFO with no writer does not hold
/// the thread), then checked on the open file: a regular file of at most
/// `MAX_SECRET_FILE` bytes, or an error saying what it is. Blocking: call it from a
/// blocking thread (`read_async`).
pub fn read(path: &Path) -> io::Result<(String, Stamp)> {
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(path)?;
    let meta = file.metadata()?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else if kind.is_socket() {
            "a socket"
        } else if kind.is_dir() {
            "a directory"
        } else {
            "not a file"
        };
        return Err(refused(format!("it is {what}, not a regular file")));
    }
    let too_large =
        || refused(format!("it is larger than {MAX_SECRET_FILE} bytes, the limit for a secret file"));
    if meta.len() > MAX_SECRET_FILE {
        return Err(too_large());
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    (&mut file).take(MAX_SECRET_FILE + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_SECRET_FILE {
        return Err(too_large());
    }
    let text = String::from_utf8(bytes).map_err(|_| refused("it is not UTF-8 text".into()))?;
    Ok((text, Stamp::of(&meta)))
}

/// `read` on a blocking thread.
pub async fn read_async(path: &Path) -> io::Result<(String, Stamp)> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || read(&path))
        .await
        .unwrap_or_else(|e| Err(io::Error::other(format!("the reading thread failed: {e}"))))
}

/// What a file holds, as a hash: its text, or why it cannot be read.
pub fn digest(read: &io::Result<(String, Stamp)>) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    match read {
        Ok((text, _)) => text.hash(&mut h),
        Err(e) => (e.kind() as u32, e.to_string()).hash(&mut h),
    }
    h.finish()
}

/// One watched file: its path, and its stamp and digest when last served or checked.
#[derive(Debug, Clone)]
pub struct Watched {
    pub path: PathBuf,
    pub stamp: Option<Stamp>,
    pub digest: u64,
}

impl Watched {
    /// `path` as `read` just gave it.
    pub fn new(path: &Path, read: &io::Result<(String, Stamp)>) -> Self {
        Self { path: path.into(), stamp: read.as_ref().ok().map(|r| r.1), digest: digest(read) }
    }

    /// Whether the file is no longer what was recorded: its stamp first, its content
    /// (bounded, as `read`) only when the stamp moved. Blocking.
    fn changed(&self) -> (bool, Self) {
        let now = stamp(&self.path);
        if now.is_some() && now == self.stamp {
            return (false, self.clone());
        }
        let read = read(&self.path);
        let next = Self { path: self.path.clone(), stamp: now, digest: digest(&read) };
        (next.digest != self.digest, next)
    }
}

#[derive(Debug, Default)]
struct Entry {
    /// How many SDS streams ask for the name.
    streams: usize,
    files: Vec<Watched>,
}

/// The names some SDS stream asks for and the files each was served from.
#[derive(Debug)]
pub struct WatchList<K> {
    entries: Mutex<BTreeMap<K, Entry>>,
}

impl<K> Default for WatchList<K> {
    fn default() -> Self {
        Self { entries: Mutex::default() }
    }
}

impl<K: Ord + Clone> WatchList<K> {
    /// One more stream asks for `name`.
    pub fn hold(&self, name: &K) {
        self.entries.lock().expect("watch lock").entry(name.clone()).or_default().streams += 1;
    }

    /// One stream fewer asks for `name`; true when none does any more (it is dropped).
    pub fn release(&self, name: &K) -> bool {
        let mut entries = self.entries.lock().expect("watch lock");
        let Some(entry) = entries.get_mut(name) else { return false };
        entry.streams = entry.streams.saturating_sub(1);
        if entry.streams == 0 {
            entries.remove(name);
            return true;
        }
        false
    }

    /// `name` was served from `files`: watched while a stream asks for it.
    pub fn record(&self, name: &K, files: Vec<Watched>) {
        if let Some(entry) = self.entries.lock().expect("watch lock").get_mut(name) {
            entry.files = files;
        }
    }

    /// How many names are watched.
    pub fn len(&self) -> usize {
        self.entries.lock().expect("watch lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The names whose files changed since they were recorded (checked without the
    /// lock held). With `update`, what is found becomes the record. Blocking.
    pub fn changed(&self, update: bool) -> Vec<K> {
        let snapshot: Vec<(K, Vec<Watched>)> = {
            let entries = self.entries.lock().expect("watch lock");
            entries
                .iter()
                .filter(|(_, e)| !e.files.is_empty())
                .map(|(k, e)| (k.clone(), e.files.clone()))
                .collect()
        };
        let mut changed = Vec::new();
        for (name, files) in snapshot {
            let checked: Vec<(bool, Watched)> = files.iter().map(Watched::changed).collect();
            if checked.iter().any(|(c, _)| *c) {
                changed.push(name.clone());
            }
            if update && let Some(entry) = self.entries.lock().expect("watch lock").get_mut(&name) {
                entry.files = checked.into_iter().map(|(_, w)| w).collect();
            }
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_up_to_the_limit_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("root.pem");
        std::fs::write(&ok, "pem").unwrap();
        assert_eq!(read(&ok).unwrap().0, "pem");
        let big = dir.path().join("big.pem");
        std::fs::write(&big, vec![b'a'; MAX_SECRET_FILE as usize + 1]).unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        for (path, says) in [
            (big.as_path(), "larger than 1048576 bytes"),
            (&fifo, "a FIFO"),
            (Path::new("/dev/zero"), "a device"),
            (dir.path(), "a directory"),
        ] {
            let e = read(path).unwrap_err().to_string();
            assert!(e.contains(says), "{}: {e}", path.display());
        }
    }

    #[test]
    fn names_no_stream_asks_for_are_dropped_and_changes_are_seen_by_stamp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("root.pem");
        std::fs::write(&path, "one").unwrap();
        let list = WatchList::default();
        list.record(&"a", vec![Watched::new(&path, &read(&path))]);
        assert!(list.is_empty(), "not recorded while no stream asks for it");
        list.hold(&"a");
        list.hold(&"a");
        list.record(&"a", vec![Watched::new(&path, &read(&path))]);
        assert!(list.changed(true).is_empty());
        std::fs::write(dir.path().join("next"), "two").unwrap();
        std::fs::rename(dir.path().join("next"), &path).unwrap();
        assert_eq!(list.changed(false), ["a"]);
        assert_eq!(list.changed(true), ["a"]);
        assert!(list.changed(true).is_empty(), "recorded once seen");
        assert!(!list.release(&"a"));
        assert!(list.release(&"a"));
        assert!(list.is_empty());
    }
}
