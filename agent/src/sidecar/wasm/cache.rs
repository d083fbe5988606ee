//! The module cache under `/var/lib/istio/data` (pilot-agent's directory): modules are
//! fetched over HTTP(S) (`fetch`) or pulled from an OCI registry (`oci`), checked (`\0asm` magic, the
//! sha256 istiod gave), and kept as `<sha256>.wasm`. A module fetched without a
//! checksum is reused by URL until `WASM_MODULE_EXPIRY`; every `WASM_PURGE_INTERVAL`
//! modules unused for `WASM_MODULE_EXPIRY` are removed, and the least recently used go
//! first when the cache would outgrow its size bound.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, Instant},
};

use bytes::Bytes;
use reqwest::StatusCode;
use serde::Serialize;

use super::{
    fetch::{Client, MAX_MODULE, ProxySettings, hex},
    oci,
    rewrite::RemoteModule,
};

const WASM_MAGIC: &[u8] = b"\0asm";

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CacheOptions {
    pub dir: PathBuf,
    #[serde(serialize_with = "crate::support::text::serialize_duration")]
    pub module_expiry: Duration,
    #[serde(serialize_with = "crate::support::text::serialize_duration")]
    pub purge_interval: Duration,
    /// Registries pulled from over plain HTTP (`*` for all).
    pub insecure_registries: Vec<String>,
    /// `HTTP_PROXY`, `HTTPS_PROXY`, `NO_PROXY`.
    pub proxy: ProxySettings,
    #[serde(serialize_with = "crate::support::text::serialize_duration")]
    pub http_timeout: Duration,
    pub max_retries: u32,
    pub max_bytes: u64,
}

impl Default for CacheOptions {
    /// pilot-agent's defaults.
    fn default() -> Self {
        Self {
            dir: "/var/lib/istio/data".into(),
            module_expiry: Duration::from_secs(24 * 3600),
            purge_interval: Duration::from_secs(3600),
            insecure_registries: Vec::new(),
            proxy: ProxySettings::default(),
            http_timeout: Duration::from_secs(15),
            max_retries: 5,
            max_bytes: 1 << 30,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("the sha256 {sha256:?} given for Wasm module {uri} is not 64 lowercase hex digits")]
    BadChecksum { uri: String, sha256: String },
    #[error("cannot fetch Wasm module {uri}: {message}")]
    Fetch { uri: String, message: String },
    #[error("module downloaded from {uri} has checksum {actual}, which does not match: {expected}")]
    Checksum { uri: String, expected: String, actual: String },
    #[error("module downloaded from {uri} is not a Wasm binary (no \\0asm header)")]
    NotWasm { uri: String },
    #[error("cannot store the Wasm module in {path}")]
    Store {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Debug, Clone)]
struct ByUrl {
    sha256: String,
    fetched: Instant,
}

pub struct ModuleCache {
    options: CacheOptions,
    /// Built on the first fetch: most agents never fetch a module, and reading the
    /// system's roots has no place at start-up.
    client: std::sync::OnceLock<Result<Client, String>>,
    by_url: Mutex<HashMap<String, ByUrl>>,
    /// When each cached module was last handed out. A module leaves the cache only
    /// under this lock, and a hit is handed out only under it, so a purge or an
    /// eviction never deletes a file a hit has just returned.
    last_used: Mutex<HashMap<String, Instant>>,
    /// Held by every store and every purge (both on the blocking pool, never on the
    /// agent's thread): one at a time, as Istio's cache holds one lock for both.
    store_lock: Mutex<()>,
    metrics: std::sync::Arc<crate::sidecar::metrics::Metrics>,
}

impl ModuleCache {
    pub fn new(mut options: CacheOptions, metrics: std::sync::Arc<crate::sidecar::metrics::Metrics>) -> Self {
        // Envoy refuses relative module paths.
        if let Ok(dir) = std::path::absolute(&options.dir) {
            options.dir = dir;
        }
        Self {
            metrics,
            options,
            client: std::sync::OnceLock::new(),
            by_url: Mutex::default(),
            last_used: Mutex::default(),
            store_lock: Mutex::default(),
        }
    }

    /// `sha256` is 64 lowercase hex digits (checked by `get`, or computed here).
    fn path_of(&self, sha256: &str) -> PathBuf {
        self.options.dir.join(format!("{sha256}.wasm"))
    }

    /// The local file holding `module`, fetched if need be. The fetched module is
    /// hashed, stored and the cache's bound kept on the blocking pool: a module of up
    /// to 64 MiB would otherwise hold the agent's one thread.
    pub async fn get(self: &std::sync::Arc<Self>, module: &RemoteModule) -> Result<PathBuf, FetchError> {
        // The checksum names a file in the cache, so it is checked before any use (as
        // Istio's API checks a WasmPlugin's `sha256`).
        if !module.sha256.is_empty() && !is_sha256_hex(&module.sha256) {
            return Err(FetchError::BadChecksum { uri: module.uri.clone(), sha256: module.sha256.clone() });
        }
        let known = if module.sha256.is_empty() {
            let by_url = self.by_url.lock().expect("cache lock");
            by_url
                .get(&module.uri)
                .filter(|e| e.fetched.elapsed() < self.options.module_expiry)
                .map(|e| e.sha256.clone())
        } else {
            Some(module.sha256.clone())
        };
        if let Some(sha) = known {
            let path = self.path_of(&sha);
            let mut used = self.last_used.lock().expect("cache lock");
            if path.is_file() {
                used.insert(sha, Instant::now());
                drop(used);
                tracing::debug!(uri = %module.uri, path = %path.display(), "Wasm module cache hit");
                return Ok(path);
            }
        }
        let started = Instant::now();
        let count = |result: &'static str| {
            self.metrics
                .wasm_remote_fetches
                .get_or_create(&crate::sidecar::metrics::FetchResult { result })
                .inc();
        };
        if self.client.get().is_none() {
            // The first fetch reads the system's roots: a blocking read, done once.
            let me = self.clone();
            let _ = tokio::task::spawn_blocking(move || me.client().map(drop)).await;
        }
        let (bytes, layer) = self.fetch(module).await.inspect_err(|_| count("download_failure"))?;
        let me = self.clone();
        let checked = module.clone();
        let stored =
            tokio::task::spawn_blocking(move || me.check_and_store(&checked, &bytes, layer.as_ref()))
                .await
                .unwrap_or_else(|e| {
                    Err(FetchError::Fetch {
                        uri: module.uri.clone(),
                        message: format!("storing failed: {e}"),
                    })
                });
        let (path, actual, size) = stored.inspect_err(|e| match e {
            FetchError::Checksum { .. } => count("checksum_mismatched"),
            FetchError::Fetch { .. } => count("download_failure"),
            FetchError::NotWasm { .. } => count("fetch_failure"),
            _ => {}
        })?;
        count("success");
        tracing::info!(
            resource = %module.resource,
            uri = %module.uri,
            sha256 = %actual,
            size,
            latency = ?started.elapsed(),
            "fetched Wasm module"
        );
        Ok(path)
    }

    /// Checks a fetched module (the layer digest its OCI manifest gave, the `\0asm`
    /// magic, istiod's checksum: one SHA-256 for both), stores it under its own
    /// checksum, and keeps the cache within its bound. Blocking: hashing and file
    /// writes, on the blocking pool.
    fn check_and_store(
        &self,
        module: &RemoteModule,
        bytes: &[u8],
        layer: Option<&oci::LayerDigest>,
    ) -> Result<(PathBuf, String, usize), FetchError> {
        let actual = hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref());
        if let Some(message) = layer.and_then(|layer| layer.mismatch(&actual)) {
            return Err(FetchError::Fetch { uri: module.uri.clone(), message });
        }
        if !bytes.starts_with(WASM_MAGIC) {
            return Err(FetchError::NotWasm { uri: module.uri.clone() });
        }
        if !module.sha256.is_empty() && module.sha256 != actual {
            return Err(FetchError::Checksum {
                uri: module.uri.clone(),
                expected: module.sha256.clone(),
                actual,
            });
        }
        let _one_at_a_time = self.store_lock.lock().expect("store lock");
        let path = self.path_of(&actual);
        self.store(&path, bytes)?;
        self.by_url
            .lock()
            .expect("cache lock")
            .insert(module.uri.clone(), ByUrl { sha256: actual.clone(), fetched: Instant::now() });
        self.last_used.lock().expect("cache lock").insert(actual.clone(), Instant::now());
        self.evict_over_bound(&actual);
        Ok((path, actual, bytes.len()))
    }

    /// Writes the module whole or not at all: through a temporary file of its own
    /// (created new, never followed) that a failed write (a full disk) does not leave
    /// behind. A module already in place (named by its checksum, renamed in whole) is
    /// kept as it is.
    fn store(&self, path: &Path, bytes: &[u8]) -> Result<(), FetchError> {
        use std::{io::Write as _, os::unix::fs::PermissionsExt as _};
        let err = |source| FetchError::Store { path: path.into(), source };
        if path.is_file() {
            return Ok(());
        }
        std::fs::create_dir_all(&self.options.dir).map_err(err)?;
        let (tmp, mut file) = temp_file(path).map_err(err)?;
        let written = (|| {
            file.write_all(bytes)?;
            // Envoy may run as another user than the agent (whatever the umask).
            file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
            drop(file);
            std::fs::rename(&tmp, path)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written.map_err(err)
    }

    fn client(&self) -> Result<&Client, String> {
        self.client
            .get_or_init(|| {
                Client::new(&self.options.proxy, self.options.max_retries).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The module's bytes, and for an OCI image the digest its manifest gives the layer.
    async fn fetch(&self, module: &RemoteModule) -> Result<(Bytes, Option<oci::LayerDigest>), FetchError> {
        let fail = |message: String| FetchError::Fetch { uri: module.uri.clone(), message };
        let timeout = module.timeout.unwrap_or(self.options.http_timeout);
        if let Some(reference) = module.uri.strip_prefix("oci://") {
            let image = oci::Reference::parse(reference).map_err(fail)?;
            let plain_http =
                self.options.insecure_registries.iter().any(|r| r == "*" || *r == image.registry);
            let client = self.client().map_err(fail)?;
            return oci::Pull::new(client, &image, plain_http, timeout).module().await.map_err(fail);
        }
        let url = reqwest::Url::parse(&module.uri).map_err(|e| fail(format!("not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(fail(format!("unsupported scheme {:?} (expected http, https or oci)", url.scheme())));
        }
        let answer = self
            .client()
            .map_err(fail)?
            .get(url.as_str(), &[], timeout, MAX_MODULE)
            .await
            .map_err(|e| fail(e.to_string()))?;
        match answer.status {
            StatusCode::OK => Ok((answer.body, None)),
            status => Err(fail(format!("HTTP status {}", status.as_u16()))),
        }
    }

    /// Removes modules unused for `WASM_MODULE_EXPIRY`; returns how many.
    pub fn purge(&self) -> usize {
        let _one_at_a_time = self.store_lock.lock().expect("store lock");
        let expiry = self.options.module_expiry;
        let stale: Vec<(String, Instant)> = {
            let used = self.last_used.lock().expect("cache lock");
            used.iter().filter(|(_, t)| t.elapsed() >= expiry).map(|(s, t)| (s.clone(), *t)).collect()
        };
        stale.iter().filter(|(sha, seen)| self.remove_unless_used_since(sha, *seen)).count()
    }

    /// Removes the module `sha` unless it was handed out after `seen` (a hit since the
    /// caller looked); true if removed. The file goes under the lock a hit takes.
    fn remove_unless_used_since(&self, sha: &str, seen: Instant) -> bool {
        {
            let mut used = self.last_used.lock().expect("cache lock");
            if used.get(sha).is_some_and(|t| *t > seen) {
                return false;
            }
            used.remove(sha);
            // Out of a hit's sight under the lock (a rename); the unlink of up to
            // 64 MiB after it, not holding up a hit on the agent's thread.
            let path = self.path_of(sha);
            let doomed = temp_name(&path, "removed");
            if std::fs::rename(&path, &doomed).is_ok() {
                drop(used);
                let _ = std::fs::remove_file(&doomed);
            }
        }
        self.by_url.lock().expect("cache lock").retain(|_, e| e.sha256 != sha);
        tracing::info!(sha256 = sha, "removed Wasm module from the cache");
        true
    }

    /// Keeps the cache within its bound, least recently used first (never `keep`).
    fn evict_over_bound(&self, keep: &str) {
        let seen: Vec<(String, Instant)> = {
            let used = self.last_used.lock().expect("cache lock");
            used.iter().map(|(s, t)| (s.clone(), *t)).collect()
        };
        let mut entries: Vec<(String, Instant, u64)> = seen
            .into_iter()
            .map(|(s, t)| {
                let size = std::fs::metadata(self.path_of(&s)).map(|m| m.len()).unwrap_or(0);
                (s, t, size)
            })
            .collect();
        let mut total: u64 = entries.iter().map(|e| e.2).sum();
        entries.sort_by_key(|e| e.1);
        for (sha, seen, size) in entries {
            if total <= self.options.max_bytes {
                break;
            }
            if sha != keep && self.remove_unless_used_since(&sha, seen) {
                total -= size;
            }
        }
    }

    /// Purges every `WASM_PURGE_INTERVAL` until the task is dropped (each purge on the
    /// blocking pool: it removes files).
    pub async fn purge_forever(self: std::sync::Arc<Self>) {
        // First what an earlier agent left half done (stores take the same lock, so
        // none of this one's is in flight).
        let me = self.clone();
        let _ = tokio::task::spawn_blocking(move || {
            let _one_at_a_time = me.store_lock.lock().expect("store lock");
            sweep_temporaries(&me.options.dir);
        })
        .await;
        let mut ticker = tokio::time::interval(self.options.purge_interval);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            let me = self.clone();
            match tokio::task::spawn_blocking(move || me.purge()).await {
                Ok(0) => {}
                Ok(removed) => tracing::info!(removed, "purged expired Wasm modules"),
                Err(e) => tracing::warn!(error = %e, "purging expired Wasm modules failed"),
            }
        }
    }
}

/// A name next to `path` no other file of this process has had: `<name>.<what>.<pid>.<n>.tmp`.
fn temp_name(path: &Path, what: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{what}.{}.{n}.tmp", std::process::id()));
    path.with_file_name(name)
}

/// A new temporary file next to `path`, created (never followed, never reused: a name
/// left by an earlier process with the same pid is skipped, not removed).
fn temp_file(path: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut attempts = 0;
    loop {
        let tmp = temp_name(path, "partial");
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp);
        match opened {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempts < 16 => attempts += 1,
            Err(e) => return Err(e),
        }
    }
}

/// Removes what an earlier agent left half done in the cache (`*.tmp`: stores it did
/// not finish, removals it did not end).
fn sweep_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().ends_with(".tmp")
            && entry.file_type().is_ok_and(|t| t.is_file())
        {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// 64 lowercase hex digits: a SHA-256 as Istio's API and Envoy write it.
fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_lowercase() {
        assert_eq!(hex(&[0x00, 0xab, 0x7f]), "00ab7f");
    }

    #[tokio::test]
    async fn unsupported_schemes_and_bad_urls_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let options = CacheOptions { dir: dir.path().into(), max_retries: 0, ..Default::default() };
        let cache = std::sync::Arc::new(ModuleCache::new(options, Default::default()));
        let module = |uri: &str| RemoteModule {
            resource: "r".into(),
            uri: uri.into(),
            sha256: String::new(),
            timeout: None,
        };
        let err = cache.get(&module("ftp://host/f.wasm")).await.unwrap_err().to_string();
        assert!(err.contains("ftp://host/f.wasm") && err.contains("unsupported scheme"), "{err}");
        let err = cache.get(&module("oci://registry-without-repo")).await.unwrap_err().to_string();
        assert!(err.contains("expected oci://"), "{err}");
    }

    /// istiod's checksum names the cached file: `../x` must not load `x.wasm` from
    /// outside the cache on a "hit".
    #[tokio::test]
    async fn a_checksum_that_is_not_a_sha256_is_refused_naming_it() {
        let outside = tempfile::tempdir().unwrap();
        let dir = outside.path().join("cache");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(outside.path().join("planted.wasm"), b"\0asm-not-from-this-cache").unwrap();
        let options = CacheOptions { dir, max_retries: 0, ..Default::default() };
        let cache = std::sync::Arc::new(ModuleCache::new(options, Default::default()));
        for sha256 in ["../planted", "/etc/x", "ABCD", &"a".repeat(63), &"g".repeat(64), &"a".repeat(65)] {
            let module = RemoteModule {
                resource: "extenstions.istio.io/wasmplugin/app.plugin".into(),
                uri: "http://127.0.0.1:9/m.wasm".into(),
                sha256: sha256.to_string(),
                timeout: None,
            };
            let e = match cache.get(&module).await {
                Ok(path) => panic!("checksum {sha256:?} gave {}", path.display()),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(&format!("{sha256:?}")) && e.contains("64 lowercase hex"), "{e}");
        }
    }

    /// A purge or an eviction looks at the cache, then removes; a hit in between hands
    /// the module out, and that module must stay. Also, a store leaves a module already
    /// in place as it is, and no temporary file behind.
    #[test]
    fn a_module_handed_out_after_a_purge_looked_stays() {
        let dir = tempfile::tempdir().unwrap();
        let options =
            CacheOptions { dir: dir.path().into(), module_expiry: Duration::ZERO, ..Default::default() };
        let cache = ModuleCache::new(options, Default::default());
        let sha = "a".repeat(64);
        cache.store(&cache.path_of(&sha), b"\0asm first").unwrap();
        let looked = Instant::now() - Duration::from_secs(1);
        cache.last_used.lock().unwrap().insert(sha.clone(), looked);
        // The hit, after the purge looked.
        cache.last_used.lock().unwrap().insert(sha.clone(), Instant::now());
        assert!(!cache.remove_unless_used_since(&sha, looked));
        assert!(cache.path_of(&sha).is_file(), "a module just handed out was deleted");
        // Unused since: it goes.
        let seen = cache.last_used.lock().unwrap()[&sha];
        assert!(cache.remove_unless_used_since(&sha, seen));
        assert!(!cache.path_of(&sha).exists());
        cache.store(&cache.path_of(&sha), b"\0asm second").unwrap();
        cache.store(&cache.path_of(&sha), b"\0asm third").unwrap();
        assert_eq!(std::fs::read(cache.path_of(&sha)).unwrap(), b"\0asm second");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [std::ffi::OsString::from(format!("{sha}.wasm"))]);
        // Readable by Envoy whatever the umask.
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(cache.path_of(&sha)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
    }

    /// What an earlier agent left half done is swept at start; a leftover whose name
    /// this process would pick next is skipped, not reused or removed in the way.
    #[tokio::test]
    async fn leftovers_of_an_earlier_agent_are_swept_and_never_in_the_way() {
        let dir = tempfile::tempdir().unwrap();
        let options = CacheOptions { dir: dir.path().into(), ..Default::default() };
        let cache = std::sync::Arc::new(ModuleCache::new(options, Default::default()));
        let sha = "b".repeat(64);
        let path = cache.path_of(&sha);
        // The next names this process would pick, taken by a "crashed" agent.
        let taken: Vec<PathBuf> = (0..3).map(|_| temp_name(&path, "partial")).collect();
        let next = |p: &PathBuf| {
            let name = p.to_string_lossy().into_owned();
            let (head, n) = name.trim_end_matches(".tmp").rsplit_once('.').unwrap();
            PathBuf::from(format!("{head}.{}.tmp", n.parse::<u64>().unwrap() + 1))
        };
        for p in &taken {
            std::fs::write(next(p), b"left").unwrap();
        }
        cache.store(&path, b"\0asm whole").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"\0asm whole");
        assert!(taken.iter().all(|p| next(p).exists()), "a leftover was removed in the way");
        std::fs::write(dir.path().join("x.wasm.removed.1.2.tmp"), b"left").unwrap();
        let purger = tokio::spawn(cache.clone().purge_forever());
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_dir(dir.path()).unwrap().count() > 1 {
            assert!(Instant::now() < deadline, "leftovers not swept");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        purger.abort();
        assert!(path.is_file(), "the module itself was swept");
    }

    #[test]
    fn expired_modules_are_purged_and_the_bound_evicts_the_oldest() {
        let dir = tempfile::tempdir().unwrap();
        let options = CacheOptions {
            dir: dir.path().into(),
            module_expiry: Duration::from_secs(3600),
            max_bytes: 10,
            ..Default::default()
        };
        let cache = ModuleCache::new(options, Default::default());
        let now = Instant::now();
        for (sha, age) in [("old", 7200), ("mid", 60), ("new", 0)] {
            std::fs::write(cache.path_of(sha), b"\0asm1234").unwrap();
            cache.last_used.lock().unwrap().insert(sha.into(), now - Duration::from_secs(age));
        }
        assert_eq!(cache.purge(), 1);
        assert!(!cache.path_of("old").exists() && cache.path_of("mid").exists());
        // 16 bytes over a 10-byte bound: the older of the two goes.
        cache.evict_over_bound("new");
        assert!(!cache.path_of("mid").exists() && cache.path_of("new").exists());
    }
}
