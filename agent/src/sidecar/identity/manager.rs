//! The secret manager: owns the workload certificate and every file-backed secret, and
//! says when one changes. With a CA it issues the workload certificate at start (one
//! CSR at a time, so concurrent SDS requests share it), rotates it at
//! `lifetime × SECRET_GRACE_PERIOD_RATIO` (± jitter) and, when the CA fails, keeps the
//! still-valid certificate and retries with backoff. With mounted files, and for
//! `file-cert:`/`file-root:` resources, it reads them (bounded, off the runtime:
//! `files`) and polls the ones some SDS stream asks for (Kubernetes' `..data` symlink
//! swaps included).

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

use super::{
    caclient::{CaClient, CaClientError},
    chain::{self, ChainError, LeafInfo},
    files::{self, WatchList, Watched},
    keys::{self, KeyAndCsr, KeyError, KeyOptions, WorkloadIdentity},
    names::{self, SecretName},
};
use crate::sidecar::metrics::Metrics;

/// When to renew, as pilot-agent's `SECRET_GRACE_PERIOD_RATIO(_JITTER)`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RotationPolicy {
    /// Renew when this fraction of the lifetime is left.
    pub grace_ratio: f64,
    /// Randomise the ratio up or down by up to this much.
    pub grace_ratio_jitter: f64,
}

impl Default for RotationPolicy {
    fn default() -> Self {
        Self { grace_ratio: 0.5, grace_ratio_jitter: 0.01 }
    }
}

impl RotationPolicy {
    /// When a certificate issued at `issued` and valid until `not_after` is renewed.
    pub fn rotate_at(&self, issued: SystemTime, not_after: SystemTime) -> SystemTime {
        let lifetime = not_after.duration_since(issued).unwrap_or_default();
        let sign = if rand::random::<bool>() { 1.0 } else { -1.0 };
        let ratio =
            (self.grace_ratio + sign * rand::random::<f64>() * self.grace_ratio_jitter).clamp(0.0, 1.0);
        not_after - lifetime.mul_f64(ratio)
    }
}

/// The three files of a mounted workload certificate.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CertFiles {
    pub cert_chain: PathBuf,
    pub key: PathBuf,
    pub root: PathBuf,
}

impl CertFiles {
    /// `cert-chain.pem`, `key.pem` and `root-cert.pem` in `dir`.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            cert_chain: dir.join("cert-chain.pem"),
            key: dir.join("key.pem"),
            root: dir.join("root-cert.pem"),
        }
    }

    pub fn all_exist(&self) -> bool {
        self.cert_chain.is_file() && self.key.is_file() && self.root.is_file()
    }
}

/// Where the workload certificate comes from.
pub enum WorkloadSource {
    /// Issued by the CA for this identity.
    Ca { client: CaClient, identity: WorkloadIdentity, keys: KeyOptions },
    /// Mounted files (`FILE_MOUNTED_CERTS`, `./var/run/secrets/workload-spiffe-credentials`).
    Files(CertFiles),
    /// None: another SDS server serves `default` and `ROOTCA`; only file resources here.
    None,
}

/// A key and chain, or a root bundle: what one SDS resource carries.
#[derive(Clone, PartialEq, Eq)]
pub enum SecretData {
    KeyCert { chain_pem: String, key_pem: String },
    Root { pem: String },
}

impl std::fmt::Debug for SecretData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::KeyCert { chain_pem, .. } => {
                f.debug_struct("KeyCert").field("chain_pem", chain_pem).finish_non_exhaustive()
            }
            Self::Root { pem } => f.debug_struct("Root").field("pem", pem).finish(),
        }
    }
}

/// The workload certificate the agent holds.
#[derive(Clone)]
pub struct WorkloadSecret {
    pub chain_pem: String,
    pub key_pem: String,
    pub root_pem: String,
    pub leaf: LeafInfo,
    pub issued: SystemTime,
    pub rotate_at: SystemTime,
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(transparent)]
    Unknown(#[from] names::UnknownSecret),
    #[error("cannot read {path} for SDS resource {resource}")]
    Read {
        resource: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} for SDS resource {resource}")]
    BadFile {
        resource: String,
        path: PathBuf,
        #[source]
        source: ChainError,
    },
    #[error("{path} for SDS resource {resource} holds no PEM private key")]
    BadKey { resource: String, path: PathBuf },
    #[error("SDS resource {0} is served by the external SDS server, not by this agent")]
    External(String),
    #[error("the secret manager stopped")]
    Stopped,
}

#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error(transparent)]
    Ca(#[from] CaClientError),
}

/// First and largest pause between failed issuances (the largest also bounded by a
/// quarter of the current certificate's lifetime, so several retries fit before it
/// expires).
pub const RETRY_MIN: Duration = Duration::from_millis(200);
pub const RETRY_MAX: Duration = Duration::from_secs(30);
/// How often the files of watched resources are checked (a `stat` each).
pub const FILE_POLL: Duration = Duration::from_millis(500);

struct Inner {
    source: WorkloadSource,
    policy: RotationPolicy,
    output_dir: Option<PathBuf>,
    file_debounce: Duration,
    current: watch::Sender<Option<Arc<WorkloadSecret>>>,
    updates: broadcast::Sender<SecretName>,
    watched: WatchList<SecretName>,
    metrics: Arc<Metrics>,
}

/// Shared by the SDS server and the rotation task.
#[derive(Clone)]
pub struct SecretManager {
    inner: Arc<Inner>,
}

impl SecretManager {
    pub fn new(
        source: WorkloadSource,
        policy: RotationPolicy,
        output_dir: Option<PathBuf>,
        file_debounce: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                source,
                policy,
                output_dir,
                file_debounce,
                current: watch::Sender::new(None),
                updates: broadcast::Sender::new(64),
                watched: WatchList::default(),
                metrics,
            }),
        }
    }

    /// Changed secrets, by name (a lagging receiver should re-send everything it holds).
    pub fn subscribe(&self) -> broadcast::Receiver<SecretName> {
        self.inner.updates.subscribe()
    }

    /// An SDS stream asks for `name`: its files are watched while some stream does.
    pub fn hold(&self, name: &SecretName) {
        self.inner.watched.hold(name);
    }

    /// An SDS stream no longer asks for `name`; once none does, its files are no
    /// longer watched (and a file resource's expiry no longer reported).
    pub fn release(&self, name: &SecretName) {
        if self.inner.watched.release(name)
            && matches!(name, SecretName::FileCert { .. } | SecretName::FileRoot(_))
        {
            self.inner.metrics.clear_cert_expiry(&name.to_string());
        }
    }

    /// How many resources have their files watched.
    pub fn watched(&self) -> usize {
        self.inner.watched.len()
    }

    /// The workload certificate now held, if any.
    pub fn workload(&self) -> Option<Arc<WorkloadSecret>> {
        self.inner.current.borrow().clone()
    }

    /// The secret for one SDS resource. The CA-issued workload certificate and root
    /// wait until the first issuance succeeds.
    pub async fn secret(&self, name: &SecretName) -> Result<SecretData, SecretError> {
        let resource = name.to_string();
        match (name, &self.inner.source) {
            (SecretName::Workload | SecretName::RootCa, WorkloadSource::Ca { .. }) => {
                let mut rx = self.inner.current.subscribe();
                let secret = rx.wait_for(Option::is_some).await.map_err(|_| SecretError::Stopped)?;
                let s = secret.as_ref().expect("waited for Some");
                Ok(match name {
                    SecretName::Workload => {
                        SecretData::KeyCert { chain_pem: s.chain_pem.clone(), key_pem: s.key_pem.clone() }
                    }
                    _ => SecretData::Root { pem: s.root_pem.clone() },
                })
            }
            (SecretName::Workload | SecretName::RootCa, WorkloadSource::None) => {
                Err(SecretError::External(resource))
            }
            (SecretName::Workload, WorkloadSource::Files(files)) => {
                self.key_cert_from_files(name, &files.cert_chain, &files.key).await
            }
            (SecretName::RootCa, WorkloadSource::Files(files)) => {
                self.root_from_file(name, &files.root).await
            }
            (SecretName::FileCert { cert, key }, _) => self.key_cert_from_files(name, cert, key).await,
            (SecretName::FileRoot(path), _) => self.root_from_file(name, path).await,
        }
    }

    /// A key and chain from files. Whatever was read is recorded for the watch list
    /// (a file that cannot be served is watched too: its fix is pushed).
    async fn key_cert_from_files(
        &self,
        name: &SecretName,
        cert: &Path,
        key: &Path,
    ) -> Result<SecretData, SecretError> {
        let resource = name.to_string();
        let (chain_read, key_read) = (files::read_async(cert).await, files::read_async(key).await);
        self.inner.watched.record(name, vec![Watched::new(cert, &chain_read), Watched::new(key, &key_read)]);
        let chain_pem = text(&resource, cert, chain_read)?;
        let leaf = chain::check_bundle(&cert.display().to_string(), &chain_pem, SystemTime::now()).map_err(
            |source| SecretError::BadFile { resource: resource.clone(), path: cert.into(), source },
        )?;
        let key_pem = text(&resource, key, key_read)?;
        if !key_pem.contains("PRIVATE KEY-----") {
            return Err(SecretError::BadKey { resource, path: key.into() });
        }
        self.inner.metrics.set_cert_expiry(&resource, leaf.not_after);
        Ok(SecretData::KeyCert { chain_pem, key_pem })
    }

    async fn root_from_file(&self, name: &SecretName, path: &Path) -> Result<SecretData, SecretError> {
        let resource = name.to_string();
        let read = files::read_async(path).await;
        self.inner.watched.record(name, vec![Watched::new(path, &read)]);
        let pem = text(&resource, path, read)?;
        chain::check_bundle(&path.display().to_string(), &pem, SystemTime::now())
            .map_err(|source| SecretError::BadFile { resource, path: path.into(), source })?;
        Ok(SecretData::Root { pem })
    }

    /// Runs issuance and rotation (with a CA) and the file poller until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = self.rotate_forever() => {}
            _ = self.poll_files() => {}
        }
    }

    async fn rotate_forever(&self) {
        let WorkloadSource::Ca { client, identity, keys } = &self.inner.source else {
            return std::future::pending().await;
        };
        let mut retry = RETRY_MIN;
        // A key whose CSR the CA has not signed yet is kept for the next attempt: an
        // RSA key costs hundreds of milliseconds of CPU, a retry should not.
        let mut pending: Option<KeyAndCsr> = None;
        loop {
            if let Some(current) = self.workload() {
                let wait = current.rotate_at.duration_since(SystemTime::now()).unwrap_or_default();
                tokio::time::sleep(wait).await;
            }
            match self.issue(client, identity, keys, &mut pending).await {
                Ok(secret) => {
                    retry = RETRY_MIN;
                    self.install(secret);
                }
                Err(e) => {
                    let current = self.workload();
                    let cap = current
                        .as_ref()
                        .and_then(|c| c.leaf.not_after.duration_since(c.issued).ok())
                        .map(|lifetime| (lifetime / 4).clamp(RETRY_MIN, RETRY_MAX))
                        .unwrap_or(RETRY_MAX);
                    let wait = super::jitter(retry.min(cap), 0.2);
                    tracing::error!(
                        resource = names::WORKLOAD,
                        ca = client.address(),
                        error = %crate::error_chain(&e),
                        retry_in = ?wait,
                        serving = current.as_ref().map(|c| c.leaf.serial.as_str()).unwrap_or("nothing"),
                        "cannot issue the workload certificate"
                    );
                    tokio::time::sleep(wait).await;
                    retry = (retry * 2).min(cap);
                }
            }
        }
    }

    async fn issue(
        &self,
        client: &CaClient,
        identity: &WorkloadIdentity,
        options: &KeyOptions,
        pending: &mut Option<KeyAndCsr>,
    ) -> Result<WorkloadSecret, IssueError> {
        let started = std::time::Instant::now();
        let key = match pending.take() {
            Some(key) => key,
            None => {
                let (id, opts) = (identity.clone(), *options);
                tokio::task::spawn_blocking(move || keys::generate(&id, &opts))
                    .await
                    .expect("key generation does not panic")?
            }
        };
        let issued = SystemTime::now();
        let answer = match client.sign(&key.csr_pem, &key.public_key_der).await {
            Ok(answer) => answer,
            Err(e) => {
                *pending = Some(key);
                return Err(e.into());
            }
        };
        let rotate_at = self.inner.policy.rotate_at(issued, answer.leaf.not_after);
        let secret = WorkloadSecret {
            chain_pem: chain::concat(&answer.chain),
            key_pem: key.key_pem,
            root_pem: chain::concat(&answer.chain[answer.chain.len() - 1..]),
            leaf: answer.leaf,
            issued,
            rotate_at,
        };
        // As pilot-agent: files that cannot be written are logged, and Envoy is served
        // regardless (a full disk must not cost the pod its certificate).
        // On the blocking pool: three synced writes, which slow storage makes long, would
        // hold every other task of the agent's one thread.
        if let Some(dir) = self.inner.output_dir.clone() {
            let written = secret.clone();
            match tokio::task::spawn_blocking(move || write_output(&dir, &written)).await {
                Ok(Ok(())) => {}
                Ok(Err((path, e))) => {
                    tracing::error!(path = %path.display(), error = %e, "cannot write OUTPUT_CERTS; the files keep their previous contents");
                }
                Err(e) => tracing::error!(error = %e, "cannot write OUTPUT_CERTS: the writer stopped"),
            }
        }
        tracing::info!(
            resource = names::WORKLOAD,
            identity = %identity,
            serial = %secret.leaf.serial,
            ttl = ?secret.leaf.not_after.duration_since(issued).unwrap_or_default(),
            rotate_in = ?rotate_at.duration_since(issued).unwrap_or_default(),
            latency = ?started.elapsed(),
            "generated new workload certificate"
        );
        Ok(secret)
    }

    fn install(&self, secret: WorkloadSecret) {
        let root_changed = self.workload().is_some_and(|old| old.root_pem != secret.root_pem);
        let first = self.workload().is_none();
        self.inner.metrics.set_cert_expiry(names::WORKLOAD, secret.leaf.not_after);
        self.inner.current.send_replace(Some(Arc::new(secret)));
        if !first {
            let _ = self.inner.updates.send(SecretName::Workload);
        }
        if root_changed {
            tracing::info!(resource = names::ROOT_CA, "the CA's root changed");
            let _ = self.inner.updates.send(SecretName::RootCa);
        }
    }

    /// Every `FILE_POLL`, the watched files' stamps (re-read only where one moved), on
    /// a blocking thread; a change is pushed once `FILE_DEBOUNCE_DURATION` has let a
    /// multi-file update (key and chain, a symlink swap) finish.
    async fn poll_files(&self) {
        loop {
            tokio::time::sleep(FILE_POLL).await;
            let changed = self.check_files(false).await;
            if changed.is_empty() {
                continue;
            }
            tokio::time::sleep(self.inner.file_debounce).await;
            self.check_files(true).await;
            for name in changed {
                tracing::info!(resource = %name, "certificate files changed; pushing");
                let _ = self.inner.updates.send(name);
            }
        }
    }

    async fn check_files(&self, update: bool) -> Vec<SecretName> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || inner.watched.changed(update)).await.unwrap_or_default()
    }
}

/// The text `files::read` gave, or the error naming the resource and the path.
fn text(
    resource: &str,
    path: &Path,
    read: std::io::Result<(String, files::Stamp)>,
) -> Result<String, SecretError> {
    read.map(|(text, _)| text).map_err(|source| SecretError::Read {
        resource: resource.into(),
        path: path.into(),
        source,
    })
}

/// `OUTPUT_CERTS`: the key (0600), chain and root. All three are written to temporary
/// files first and renamed into place only when all three were written, so a failed
/// write (a full disk) leaves the previous set whole and no partial key behind.
fn write_output(dir: &Path, s: &WorkloadSecret) -> Result<(), (PathBuf, std::io::Error)> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    std::fs::create_dir_all(dir).map_err(|e| (dir.to_path_buf(), e))?;
    let files = [
        ("key.pem", &s.key_pem, 0o600),
        ("cert-chain.pem", &s.chain_pem, 0o644),
        ("root-cert.pem", &s.root_pem, 0o644),
    ];
    let tmp = |name: &str| dir.join(format!(".{name}.tmp"));
    let write = |name: &str, text: &str, mode: u32| -> Result<(), (PathBuf, std::io::Error)> {
        let path = tmp(name);
        let _ = std::fs::remove_file(&path);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path)
            .map_err(|e| (path.clone(), e))?;
        f.write_all(text.as_bytes()).and_then(|()| f.sync_data()).map_err(|e| (path.clone(), e))
    };
    if let Err(e) = files.iter().try_for_each(|(name, text, mode)| write(name, text, *mode)) {
        for (name, ..) in &files {
            let _ = std::fs::remove_file(tmp(name));
        }
        return Err(e);
    }
    for (name, ..) in &files {
        std::fs::rename(tmp(name), dir.join(name)).map_err(|e| (dir.join(name), e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh self-signed certificate and its key (PEM).
    fn key_and_cert() -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["workload".into()]).unwrap().self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// Publishes `files` into `dir` as kubelet does a secret volume: into a new
    /// `..<timestamp>` directory, then `..data` swapped to it by a rename, the
    /// visible names (`cert-chain.pem` → `..data/cert-chain.pem`) made once, and the
    /// previous directory removed.
    fn kubelet_publish(dir: &Path, generation: u32, files: &[(&str, &str)]) {
        let stamp = format!("..2026_01_01_00_00_{generation:02}.000000001");
        std::fs::create_dir(dir.join(&stamp)).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(&stamp).join(name), text).unwrap();
        }
        let old = std::fs::read_link(dir.join("..data")).ok();
        std::os::unix::fs::symlink(&stamp, dir.join("..data_tmp")).unwrap();
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        for (name, _) in files {
            let _ = std::os::unix::fs::symlink(Path::new("..data").join(name), dir.join(name));
        }
        if let Some(old) = old {
            std::fs::remove_dir_all(dir.join(old)).unwrap();
        }
    }

    /// istio/istio#59912: a file-mounted certificate (the workload's own, and one a
    /// DestinationRule names as `file-cert:`) rotated by kubelet again and again is
    /// picked up every time — the second and later `..data` swaps too — and pushed.
    #[tokio::test]
    async fn mounted_certificates_rotated_several_times_are_each_picked_up() {
        let dir = tempfile::tempdir().unwrap();
        let files = CertFiles::in_dir(dir.path());
        let publish = |generation| {
            let (cert, key) = key_and_cert();
            kubelet_publish(
                dir.path(),
                generation,
                &[("cert-chain.pem", &cert), ("key.pem", &key), ("root-cert.pem", &cert)],
            );
            cert
        };
        let mut expected = publish(0);
        let manager = SecretManager::new(
            WorkloadSource::Files(files.clone()),
            RotationPolicy::default(),
            None,
            Duration::from_millis(10),
            Arc::new(Metrics::new()),
        );
        let names = [SecretName::Workload, SecretName::FileCert { cert: files.cert_chain, key: files.key }];
        let mut updates = manager.subscribe();
        for name in &names {
            manager.hold(name);
        }
        let shutdown = CancellationToken::new();
        tokio::spawn(manager.clone().run(shutdown.clone()));
        for generation in 1..=4 {
            for name in &names {
                let Ok(SecretData::KeyCert { chain_pem, .. }) = manager.secret(name).await else {
                    panic!("{name}: no key and certificate")
                };
                assert_eq!(chain_pem, expected, "{name} after {generation} publications");
            }
            expected = publish(generation);
            let mut pushed = std::collections::BTreeSet::new();
            while pushed.len() < names.len() {
                let name = tokio::time::timeout(Duration::from_secs(5), updates.recv())
                    .await
                    .unwrap_or_else(|_| panic!("rotation {generation} not pushed (only {pushed:?})"))
                    .unwrap();
                pushed.insert(name.to_string());
            }
        }
        shutdown.cancel();
    }

    #[test]
    fn rotation_lands_at_the_grace_ratio() {
        let issued = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let not_after = issued + Duration::from_secs(24 * 3600);
        let exact = RotationPolicy { grace_ratio: 0.5, grace_ratio_jitter: 0.0 };
        assert_eq!(exact.rotate_at(issued, not_after), issued + Duration::from_secs(12 * 3600));
        let jittered = RotationPolicy::default();
        for _ in 0..100 {
            let at = jittered.rotate_at(issued, not_after).duration_since(issued).unwrap().as_secs_f64();
            assert!((0.49 * 86400.0..=0.51 * 86400.0).contains(&at), "{at}");
        }
        let all = RotationPolicy { grace_ratio: 1.0, grace_ratio_jitter: 0.5 };
        assert!(all.rotate_at(issued, not_after) >= issued);
    }
}
