//! The real ztunnel (istio/ztunnel at 62d82653, Istio's node proxy for ambient mode) as
//! a test peer of Weir's node agent: built once from its source at that commit into a
//! cache outside the checkout, and run in a test namespace in in-pod ("shared") mode,
//! with no istiod.
//!
//! **The source.** `../shared/peers/ztunnel-62d82653.tar.gz` beside the checkout (or
//! `$WEIR_ZTUNNEL_TARBALL`), checked against its sha256; when it is not there, the
//! commit's tarball from the public repository (`$WEIR_ZTUNNEL_URL`, else GitHub's),
//! fetched once into the cache. Either must unpack to the same tree ([`TREE_SHA256`]:
//! every file's path, mode and sha256, `vendor/` left out as the shared tarball leaves
//! it): GitHub does not promise the same gzip bytes for an archive, the tree is what
//! is pinned. Neither way working is an error naming both.
//!
//! **The build.** The cache is `$WEIR_CACHE_DIR` (else `$XDG_CACHE_HOME/weir`, else
//! `$HOME/.cache/weir`) + `ztunnel-<sha256 of the shared tarball>/`: the pinned source
//! is the key, so a new pin builds anew and the same one, on the same machine, is built
//! once (CI included). In it: `src/` (the unpacked tarball), `target/` (cargo's),
//! `build.log`, `bin/ztunnel` and the stamp `built`, written last. The build unpacks
//! the tarball, drops the one git dependency (`boring-rustls-provider`, used only by
//! the `tls-boring` feature; git hosts cannot be reached) from `Cargo.toml`, and runs
//! `cargo build --no-default-features --features tls-ring,testing` (`testing` is what
//! makes `FAKE_CA` work); `protoc` comes from Debian's `protobuf-compiler`
//! (scripts/bootstrap). A file lock makes concurrent tests wait for one build.
//! `scripts/test` builds it before the suite (`weir-ztunnel-peer`), so no test pays the
//! minutes. A build that cannot be done is an error naming why: a test never skips.
//!
//! **The run.** [`Ztunnel::start`] runs it as root in a "node" namespace with
//! `INPOD_UDS` on the node agent's ZDS socket, `FAKE_CA=true` (its built-in CA),
//! `XDS_ADDRESS=""` (without it ztunnel waits on istiod forever and never dials ZDS)
//! and `LOCAL_XDS_PATH` (the workloads, [`workloads_yaml`]; with services, their VIPs
//! and endpoints, [`LocalConfig`]); everything else from a cleared environment.
//! [`Ztunnel::start_with`] also gives it a `resolv.conf` of its own (its DNS proxy's
//! upstream, as a pod's `dnsPolicy: ClusterFirst` names the cluster DNS Service). [`listening_tcp_ports`] reads which ports listen inside a
//! namespace: ztunnel opens 15001, 15006, 15008 and 15053 in each pod it was given.

use std::{
    fs,
    io::Read as _,
    net::IpAddr,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use weir_agent::sandbox::{NetNs, Pod, PodChild};

/// The peer's source, as `shared/peers` holds it.
pub const TARBALL: &str = "ztunnel-62d82653.tar.gz";
/// The shared tarball's sha256: the pinned source's key.
pub const TARBALL_SHA256: &str = "c078c9e7803ab2773da32940f9c53caeb0d80e435027d61ca586bd3acdfe3491";
/// The commit the source is, in istio/ztunnel.
pub const COMMIT: &str = "62d826530e5ce85764e309170205b293efcbc80b";
/// The source tree's digest ([`tree_digest`]): the shared tarball's and the commit's.
pub const TREE_SHA256: &str = "b34ffd38484f3b6c752c592812e587b16660f436d19dec48c14c3c48e8144d26";
/// Where the public repository serves the commit's tarball.
const ARCHIVE_URL: &str = "https://codeload.github.com/istio/ztunnel/tar.gz";
/// The features: rustls over ring (no aws-lc C build), and `FAKE_CA`.
const FEATURES: &str = "tls-ring,testing";
/// The manifest's git dependency, and its mention in the `tls-boring` feature.
const GIT_DEPENDENCY: &str = "boring-rustls-provider";
const GIT_FEATURE: &str = ", \"boring-rustls-provider/fips-only\"";

/// The ports ztunnel opens in each pod's namespace: outbound capture, inbound capture,
/// HBONE, DNS.
pub const POD_PORTS: [u16; 4] = [15001, 15006, 15008, 15053];

/// The shared tarball: `$WEIR_ZTUNNEL_TARBALL`, else `shared/peers/` beside the
/// checkout; `Ok(None)` when it is not there.
pub fn shared_tarball() -> anyhow::Result<Option<PathBuf>> {
    let path = match std::env::var_os("WEIR_ZTUNNEL_TARBALL").filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/peers").join(TARBALL),
    };
    if !path.exists() {
        return Ok(None);
    }
    let sha = sha256_file(&path)?;
    if sha != TARBALL_SHA256 {
        bail!("{}: sha256 {sha}, expected {TARBALL_SHA256} (ztunnel at {COMMIT})", path.display());
    }
    Ok(Some(path))
}

/// The commit's tarball URL: `$WEIR_ZTUNNEL_URL` (a mirror; the commit is appended
/// when it ends in `/`), else GitHub's.
fn archive_url() -> String {
    match std::env::var("WEIR_ZTUNNEL_URL").ok().filter(|u| !u.is_empty()) {
        Some(u) if u.ends_with('/') => format!("{u}{COMMIT}"),
        Some(u) => u,
        None => format!("{ARCHIVE_URL}/{COMMIT}"),
    }
}

/// The source tarball: the shared one, else the commit's fetched into `dir` (once;
/// its tree is checked when unpacked). The error names both ways.
fn source_tarball(dir: &Path) -> anyhow::Result<PathBuf> {
    source_tarball_from(shared_tarball()?, &archive_url(), dir)
}

fn source_tarball_from(shared: Option<PathBuf>, url: &str, dir: &Path) -> anyhow::Result<PathBuf> {
    if let Some(shared) = shared {
        return Ok(shared);
    }
    let fetched = dir.join(format!("ztunnel-{COMMIT}.tar.gz"));
    if fetched.is_file() {
        return Ok(fetched);
    }
    eprintln!("[ztunnel] {TARBALL} is not beside the checkout: fetching {url}");
    let partial = fetched.with_extension("partial");
    let out = Command::new("curl")
        .args(["-fsSL", "--retry", "3", "--connect-timeout", "20", "--max-time", "600", "-o"])
        .arg(&partial)
        .arg(url)
        .output();
    let why = match out {
        Ok(o) if o.status.success() => {
            fs::rename(&partial, &fetched).context("keep the fetched ztunnel tarball")?;
            return Ok(fetched);
        }
        Ok(o) => format!("curl {url}: {}", String::from_utf8_lossy(&o.stderr).trim()),
        Err(e) => format!("curl cannot be run ({e}); scripts/bootstrap installs it"),
    };
    let _ = fs::remove_file(&partial);
    bail!(
        "the ztunnel peer's source (istio/ztunnel at {COMMIT}) could not be had either way: \
         `shared/peers/{TARBALL}` is not beside the checkout (nor WEIR_ZTUNNEL_TARBALL), and fetching \
         it failed: {why}"
    )
}

/// A digest of the source tree under `top`: for each file (sorted by path; `vendor/`
/// left out), `F <path>\0<x or ->\0<sha256>\n`, or `L <path>\0<target>\n` for a
/// link; directories are not entries.
pub fn tree_digest(top: &Path) -> anyhow::Result<String> {
    fn walk(top: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) -> anyhow::Result<()> {
        for e in fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
            let e = e?;
            let path = e.path();
            let rel = path.strip_prefix(top)?.to_string_lossy().into_owned();
            if rel == "vendor" {
                continue;
            }
            if e.file_type()?.is_dir() {
                walk(top, &path, out)?;
            } else {
                out.push((rel, path));
            }
        }
        Ok(())
    }
    let mut files = Vec::new();
    walk(top, top, &mut files)?;
    files.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    for (rel, path) in files {
        let meta = fs::symlink_metadata(&path)?;
        if meta.file_type().is_symlink() {
            let target = fs::read_link(&path)?;
            digest.update(format!("L {rel}\0{}\n", target.display()).as_bytes());
        } else {
            let x = if meta.permissions().mode() & 0o100 != 0 { "x" } else { "-" };
            digest.update(format!("F {rel}\0{x}\0{}\n", sha256_file(&path)?).as_bytes());
        }
    }
    Ok(digest.finish().as_ref().iter().map(|b| format!("{b:02x}")).collect())
}

/// Where builds are cached: `$WEIR_CACHE_DIR`, `$XDG_CACHE_HOME/weir` or
/// `$HOME/.cache/weir`.
pub fn cache_root() -> anyhow::Result<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = var("WEIR_CACHE_DIR") {
        return Ok(dir);
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return Ok(dir.join("weir"));
    }
    match var("HOME") {
        Some(home) => Ok(home.join(".cache/weir")),
        None => bail!("no cache directory for the ztunnel build: set WEIR_CACHE_DIR or HOME"),
    }
}

/// The sha256 of a file, in hex.
pub fn sha256_file(path: &Path) -> anyhow::Result<String> {
    let mut file = fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0; 1 << 16];
    loop {
        let n = file.read(&mut buf).with_context(|| format!("read {}", path.display()))?;
        if n == 0 {
            break;
        }
        context.update(&buf[..n]);
    }
    Ok(context.finish().as_ref().iter().map(|b| format!("{b:02x}")).collect())
}

/// The cache folder of the pinned source's build.
pub fn cache_dir() -> anyhow::Result<PathBuf> {
    Ok(cache_root()?.join(format!("ztunnel-{TARBALL_SHA256}")))
}

/// The ztunnel binary, built first if the cache does not hold it. Fails naming why the
/// build could not be done (missing tarball or protoc, cargo's error with the end of
/// its log). `WEIR_ZTUNNEL_BIN` names another build of the same source to use instead
/// (a release build for `weir-bench ambient-datapath`; docs/benchmarks.md says how).
pub fn binary() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("WEIR_ZTUNNEL_BIN").filter(|b| !b.is_empty()) {
        let bin = PathBuf::from(bin);
        if !bin.is_file() {
            bail!("WEIR_ZTUNNEL_BIN={} is not a file", bin.display());
        }
        return Ok(bin);
    }
    let dir = cache_dir()?;
    fs::create_dir_all(&dir).with_context(|| format!("create the ztunnel cache {}", dir.display()))?;
    let lock = fs::File::create(dir.join("lock")).context("create the ztunnel cache's lock")?;
    let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .context("lock the ztunnel cache")?;
    let bin = dir.join("bin/ztunnel");
    if dir.join("built").is_file() && bin.is_file() {
        return Ok(bin);
    }
    let started = Instant::now();
    let tarball = source_tarball(&dir)?;
    let src = unpack(&tarball, &dir)?;
    drop_git_dependency(&src.join("Cargo.toml"))?;
    require_protoc()?;
    cargo_build(&src, &dir)?;
    fs::create_dir_all(dir.join("bin")).context("create the ztunnel cache's bin")?;
    fs::copy(dir.join("target/debug/ztunnel"), &bin)
        .context("copy the built ztunnel into the cache's bin")?;
    // The binary is all the cache needs: cargo's 1.5+ GB of objects would only sit on
    // the disk (a new tarball is a new folder and a build from scratch).
    fs::remove_dir_all(dir.join("target")).context("remove the ztunnel build's target folder")?;
    let took = started.elapsed();
    fs::write(dir.join("built"), format!("{} built in {} s\n", tarball.display(), took.as_secs()))
        .context("write the ztunnel cache's stamp")?;
    eprintln!("[ztunnel] built {} in {} s", bin.display(), took.as_secs());
    Ok(bin)
}

/// Unpacks the tarball into `dir/src` (anew), checks its tree against [`TREE_SHA256`]
/// and returns its top folder (`vendor/` removed: the build does not use it).
fn unpack(tarball: &Path, dir: &Path) -> anyhow::Result<PathBuf> {
    let src = dir.join("src");
    if src.exists() {
        fs::remove_dir_all(&src).with_context(|| format!("remove the old {}", src.display()))?;
    }
    fs::create_dir_all(&src).with_context(|| format!("create {}", src.display()))?;
    let out = Command::new("tar")
        .arg("-xzf")
        .arg(tarball)
        .arg("-C")
        .arg(&src)
        .output()
        .context("run tar to unpack the ztunnel peer")?;
    if !out.status.success() {
        bail!("tar -xzf {} failed: {}", tarball.display(), String::from_utf8_lossy(&out.stderr).trim());
    }
    let tops: Vec<PathBuf> = fs::read_dir(&src)?.flatten().map(|e| e.path()).collect();
    let [top] = tops.as_slice() else {
        bail!("{} holds {} top folders, expected one", tarball.display(), tops.len());
    };
    if !top.join("Cargo.toml").is_file() {
        bail!("{} did not hold <top>/Cargo.toml", tarball.display());
    }
    if top.join("vendor").exists() {
        fs::remove_dir_all(top.join("vendor")).context("remove ztunnel's vendor/")?;
    }
    let tree = tree_digest(top)?;
    if tree != TREE_SHA256 {
        bail!(
            "{} unpacks to a tree with digest {tree}, not ztunnel at {COMMIT} ({TREE_SHA256})",
            tarball.display()
        );
    }
    Ok(top.clone())
}

/// Drops the git dependency from the manifest (its line, and its mention in the
/// `tls-boring` feature, which the build does not enable).
fn drop_git_dependency(manifest: &Path) -> anyhow::Result<()> {
    let text = fs::read_to_string(manifest).with_context(|| format!("read {}", manifest.display()))?;
    let (kept, dropped): (Vec<&str>, Vec<&str>) =
        text.lines().partition(|l| !l.trim_start().starts_with(&format!("{GIT_DEPENDENCY} ")));
    if dropped.len() != 1 {
        bail!(
            "{}: expected one `{GIT_DEPENDENCY} = {{ git = .. }}` line to drop, found {}",
            manifest.display(),
            dropped.len()
        );
    }
    let edited = kept.join("\n").replace(GIT_FEATURE, "") + "\n";
    if edited.contains(GIT_DEPENDENCY) {
        bail!("{}: `{GIT_DEPENDENCY}` is still named after dropping its line", manifest.display());
    }
    fs::write(manifest, edited).with_context(|| format!("write {}", manifest.display()))
}

/// Fails naming the package when `protoc` (needed by ztunnel's build.rs) is missing.
fn require_protoc() -> anyhow::Result<()> {
    match Command::new("protoc").arg("--version").output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => bail!("protoc --version failed ({}): ztunnel's build needs protoc", out.status),
        Err(e) => bail!(
            "protoc cannot be run ({e}): ztunnel's build needs it; install Debian's protobuf-compiler \
             (scripts/bootstrap does)"
        ),
    }
}

/// How often a build in progress says how far it is.
const PROGRESS_EVERY: Duration = Duration::from_secs(20);

/// `cargo build` of the peer into `dir/target`, at low priority, logged to
/// `dir/build.log`; every [`PROGRESS_EVERY`] a line on stderr says how many crates are
/// compiled. A debug build with line tables only and no incremental state: a test peer
/// needs neither, and both cost CPU time and disk (measured in docs/first-minutes.md).
fn cargo_build(src: &Path, dir: &Path) -> anyhow::Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let log_path = dir.join("build.log");
    let log = fs::File::create(&log_path).with_context(|| format!("create {}", log_path.display()))?;
    let started = Instant::now();
    let mut child = Command::new("nice")
        .args(["-n", "10"])
        .arg(&cargo)
        .args(["build", "--no-default-features", "--features", FEATURES, "--bin", "ztunnel"])
        .current_dir(src)
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .env("CARGO_TERM_COLOR", "never")
        .env("CARGO_INCREMENTAL", "0")
        .env("CARGO_PROFILE_DEV_DEBUG", "line-tables-only")
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("dup the build log")?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("run {} build for the ztunnel peer", cargo.to_string_lossy()))?;
    let mut said = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().context("wait for the ztunnel peer's build")? {
            break status;
        }
        std::thread::sleep(Duration::from_millis(250));
        if said.elapsed() >= PROGRESS_EVERY {
            said = Instant::now();
            let compiled =
                fs::read_to_string(&log_path).map(|t| t.matches("   Compiling ").count()).unwrap_or_default();
            eprintln!(
                "[ztunnel] building the peer: {compiled} crates compiled, {} s (log: {})",
                started.elapsed().as_secs(),
                log_path.display()
            );
        }
    };
    if !status.success() {
        let text = fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect();
        bail!(
            "cargo build of the ztunnel peer failed ({status}); {} ends:\n{}",
            log_path.display(),
            tail.join("\n")
        );
    }
    Ok(())
}

/// One workload of ztunnel's local config (`LOCAL_XDS_PATH`).
#[derive(Debug, Clone)]
pub struct LocalWorkload {
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub ips: Vec<IpAddr>,
}

/// The node name ztunnel runs as (`NODE_NAME`), which every local workload names.
pub const NODE_NAME: &str = "weir-node";

/// One Service of ztunnel's local config: its VIPs (ClusterIPs), its ports (service
/// port → target port) and its endpoints, the local workloads (by name) behind it.
/// ztunnel resolves a connection to a VIP (its original destination) to an endpoint,
/// and answers DNS for the hostname with the VIPs.
#[derive(Debug, Clone)]
pub struct LocalService {
    pub name: String,
    pub namespace: String,
    /// The cluster-local name (`<name>.<namespace>.svc.cluster.local`).
    pub hostname: String,
    pub vips: Vec<IpAddr>,
    pub ports: Vec<(u16, u16)>,
    pub endpoints: Vec<String>,
}

/// ztunnel's local config (`LOCAL_XDS_PATH`): workloads and services.
#[derive(Debug, Clone, Default)]
pub struct LocalConfig {
    pub workloads: Vec<LocalWorkload>,
    pub services: Vec<LocalService>,
}

fn ports_yaml(ports: &[(u16, u16)]) -> String {
    let ports: Vec<String> = ports.iter().map(|(port, target)| format!("{port}: {target}")).collect();
    format!("{{{}}}", ports.join(", "))
}

impl LocalConfig {
    /// The YAML ztunnel reads: each workload on [`NODE_NAME`], HBONE, trust domain
    /// `cluster.local`, naming the services it is an endpoint of (`<namespace>/<hostname>`
    /// with their ports, as ztunnel's `LocalWorkload.services` takes them); each service
    /// with its VIPs on the default network (`/<ip>`). ztunnel ties a ZDS Add to a
    /// workload by (namespace, service account, name).
    pub fn yaml(&self) -> String {
        let mut out = String::from("workloads:\n");
        for w in &self.workloads {
            let ips: Vec<String> = w.ips.iter().map(|ip| format!("\"{ip}\"")).collect();
            let services: Vec<String> = self
                .services
                .iter()
                .filter(|s| s.endpoints.contains(&w.name))
                .map(|s| format!("\"{}/{}\": {}", s.namespace, s.hostname, ports_yaml(&s.ports)))
                .collect();
            out.push_str(&format!(
                "- uid: Kubernetes//Pod/{ns}/{name}\n  name: {name}\n  workloadName: {name}\n  \
                 namespace: {ns}\n  serviceAccount: {sa}\n  trustDomain: cluster.local\n  \
                 workloadIps: [{ips}]\n  protocol: HBONE\n  node: {NODE_NAME}\n  services: {{{services}}}\n",
                ns = w.namespace,
                name = w.name,
                sa = w.service_account,
                ips = ips.join(", "),
                services = services.join(", "),
            ));
        }
        if !self.services.is_empty() {
            out.push_str("services:\n");
        }
        for s in &self.services {
            let vips: Vec<String> = s.vips.iter().map(|ip| format!("\"/{ip}\"")).collect();
            out.push_str(&format!(
                "- name: {}\n  namespace: {}\n  hostname: {}\n  vips: [{}]\n  ports: {}\n",
                s.name,
                s.namespace,
                s.hostname,
                vips.join(", "),
                ports_yaml(&s.ports),
            ));
        }
        out
    }
}

/// ztunnel's local config for `workloads` (no services): see [`LocalConfig::yaml`].
pub fn workloads_yaml(workloads: &[LocalWorkload]) -> String {
    LocalConfig { workloads: workloads.to_vec(), services: Vec::new() }.yaml()
}

/// Where and how [`Ztunnel::start_with`] runs ztunnel besides its config.
#[derive(Debug, Clone, Copy, Default)]
pub struct ZtunnelPlacement<'a> {
    /// A child of the node's pods' cgroup, as ztunnel's pod is under kubepods (the
    /// node capture's programs see its sockets); `None`: the test's own cgroup.
    pub cgroup: Option<&'a weir_agent::sandbox::Cgroup>,
    /// Bound over `/etc/resolv.conf` in a mount namespace of its own: the upstream of
    /// its DNS proxy. `None`: the host's.
    pub resolv_conf: Option<&'a Path>,
}

/// A running ztunnel. Dropping it kills it.
pub struct Ztunnel {
    child: Option<PodChild>,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Ztunnel {
    /// Starts ztunnel (built if needed) as root in `node`'s namespace, dialing the ZDS
    /// server at `inpod_uds`, with `workloads` as its local config.
    pub fn start(node: &Pod, inpod_uds: &Path, workloads: &[LocalWorkload]) -> anyhow::Result<Self> {
        Self::start_in_cgroup(node, inpod_uds, workloads, None)
    }

    /// As [`Ztunnel::start`], in `cgroup` (a child of the node's pods' cgroup, as
    /// ztunnel's pod is under kubepods: the node capture's programs see its sockets).
    pub fn start_in_cgroup(
        node: &Pod,
        inpod_uds: &Path,
        workloads: &[LocalWorkload],
        cgroup: Option<&weir_agent::sandbox::Cgroup>,
    ) -> anyhow::Result<Self> {
        let config = LocalConfig { workloads: workloads.to_vec(), services: Vec::new() };
        Self::start_with(node, inpod_uds, &config, ZtunnelPlacement { cgroup, resolv_conf: None })
    }

    /// As [`Ztunnel::start`], with `config` (workloads and services) as its local config,
    /// placed as `placement` says.
    pub fn start_with(
        node: &Pod,
        inpod_uds: &Path,
        config: &LocalConfig,
        placement: ZtunnelPlacement<'_>,
    ) -> anyhow::Result<Self> {
        let bin = binary()?;
        let dir = tempfile::Builder::new().prefix("weir-ztunnel-").tempdir().context("ztunnel's temp dir")?;
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).context("chmod ztunnel's dir")?;
        let config_path = dir.path().join("workloads.yaml");
        fs::write(&config_path, config.yaml()).context("write ztunnel's local config")?;
        let log = dir.path().join("ztunnel.log");
        let out = fs::File::create(&log).context("create ztunnel's log")?;
        let mut cmd = Command::new(&bin);
        cmd.env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("RUST_LOG", "info")
            .env("FAKE_CA", "true")
            .env("XDS_ADDRESS", "")
            .env("LOCAL_XDS_PATH", &config_path)
            .env("INPOD_UDS", inpod_uds)
            .env("NODE_NAME", NODE_NAME)
            .env("CLUSTER_ID", "Kubernetes")
            .stdin(Stdio::null())
            .stdout(out.try_clone().context("dup ztunnel's log")?)
            .stderr(out);
        let placement = weir_agent::sandbox::Placement {
            user: Some((0, 0)),
            cgroup: placement.cgroup,
            resolv_conf: placement.resolv_conf,
            ..Default::default()
        };
        let child =
            node.spawn_placed(&mut cmd, placement).with_context(|| format!("start {}", bin.display()))?;
        Ok(Self { child: Some(child), log, _dir: dir })
    }

    /// What ztunnel logged so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(PodChild::pid)
    }

    /// Whether it is still running (it exits on a ZDS protocol error).
    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.wait_timeout(Duration::ZERO), Ok(None)))
    }

    /// SIGTERM, then waits for it to exit (SIGKILL after `grace`).
    pub fn stop(&mut self, grace: Duration) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else { return Ok(()) };
        child.signal(libc::SIGTERM).context("SIGTERM ztunnel")?;
        if child.wait_timeout(grace).context("wait for ztunnel")?.is_none() {
            child.signal(libc::SIGKILL).context("SIGKILL ztunnel")?;
            child.wait_timeout(grace).context("wait for ztunnel")?;
        }
        Ok(())
    }
}

/// The TCP ports listening inside `netns` (IPv4 and IPv6), sorted.
pub fn listening_tcp_ports(netns: &NetNs) -> anyhow::Result<Vec<u16>> {
    let tables = netns.run(|| async {
        ["tcp", "tcp6"].map(|t| fs::read_to_string(format!("/proc/thread-self/net/{t}")).unwrap_or_default())
    })?;
    let mut ports: Vec<u16> = tables.iter().flat_map(|t| listening_in(t)).collect();
    ports.sort_unstable();
    ports.dedup();
    Ok(ports)
}

/// Local ports of the LISTEN (state `0A`) sockets of a `/proc/net/tcp{,6}` table.
fn listening_in(table: &str) -> Vec<u16> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, state) = (fields.get(1)?, fields.get(3)?);
            (*state == "0A").then_some(())?;
            u16::from_str_radix(local.rsplit(':').next()?, 16).ok()
        })
        .collect()
}

/// Waits until `check` holds, up to `limit`; the error says what was awaited.
pub fn wait_until(what: &str, limit: Duration, mut check: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while !check() {
        if Instant::now() > deadline {
            bail!("{what}: not within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_git_dependency_and_its_feature_mention_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let manifest = dir.path().join("Cargo.toml");
        fs::write(
            &manifest,
            "[features]\ntls-boring = [\"dep:boring\", \"boring-rustls-provider/fips-only\"]\n\
             [dependencies]\nboring-rustls-provider = { git = \"https://example.invalid/x\", optional = true } #\n\
             boring = { version = \"4\", optional = true }\n",
        )
        .unwrap();
        drop_git_dependency(&manifest).unwrap();
        let edited = fs::read_to_string(&manifest).unwrap();
        assert_eq!(
            edited,
            "[features]\ntls-boring = [\"dep:boring\"]\n[dependencies]\nboring = { version = \"4\", optional = true }\n"
        );
        // Run again, nothing is left to drop: the error names what was expected.
        let e = drop_git_dependency(&manifest).unwrap_err().to_string();
        assert!(e.contains("expected one `boring-rustls-provider"), "{e}");
    }

    #[test]
    fn the_tree_digest_covers_paths_modes_and_contents_but_not_vendor() {
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path();
        fs::create_dir_all(top.join("src")).unwrap();
        fs::create_dir_all(top.join("vendor/lib")).unwrap();
        fs::write(top.join("Cargo.toml"), "[package]\n").unwrap();
        fs::write(top.join("src/main.rs"), "fn main() {}\n").unwrap();
        let first = tree_digest(top).unwrap();
        // vendor/ is not part of it.
        fs::write(top.join("vendor/lib/libcrypto.a"), "prebuilt").unwrap();
        assert_eq!(tree_digest(top).unwrap(), first);
        // A mode, a content, a name each change it.
        fs::set_permissions(top.join("src/main.rs"), fs::Permissions::from_mode(0o755)).unwrap();
        let moded = tree_digest(top).unwrap();
        assert_ne!(moded, first);
        fs::write(top.join("src/main.rs"), "fn main() { }\n").unwrap();
        assert_ne!(tree_digest(top).unwrap(), moded);
        fs::rename(top.join("src/main.rs"), top.join("src/lib.rs")).unwrap();
        let renamed = tree_digest(top).unwrap();
        fs::rename(top.join("src/lib.rs"), top.join("src/main.rs")).unwrap();
        assert_ne!(renamed, tree_digest(top).unwrap());
    }

    #[test]
    fn without_the_shared_tarball_a_failed_fetch_names_both_ways() {
        let dir = tempfile::tempdir().unwrap();
        let e = source_tarball_from(None, "http://127.0.0.1:9/ztunnel.tar.gz", dir.path()).unwrap_err();
        let e = format!("{e:#}");
        assert!(e.contains(&format!("shared/peers/{TARBALL}")), "{e}");
        assert!(e.contains("curl http://127.0.0.1:9/ztunnel.tar.gz"), "{e}");
        assert!(!dir.path().join(format!("ztunnel-{COMMIT}.partial")).exists());
    }

    /// The source this machine has (the shared tarball, or the commit's fetched) is
    /// the pinned tree.
    #[test]
    fn the_source_unpacks_to_the_pinned_tree() {
        let dir = tempfile::tempdir().unwrap();
        let tarball = source_tarball(dir.path()).unwrap();
        let top = unpack(&tarball, dir.path()).unwrap();
        assert!(top.join("Cargo.toml").is_file());
    }

    #[test]
    fn listening_ports_are_read_from_proc_net_tables() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000:3A99 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n\
   1: 0100007F:3ACD 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1\n\
   2: 0200A8C0:3A99 0300A8C0:D431 01 00000000:00000000 00:00000000 00000000     0        0 3 1\n";
        assert_eq!(listening_in(table), vec![15001, 15053]);
    }

    #[test]
    fn the_workloads_yaml_names_each_pod_on_the_node() {
        let yaml = workloads_yaml(&[LocalWorkload {
            name: "client".into(),
            namespace: "default".into(),
            service_account: "sa".into(),
            ips: vec!["10.66.0.11".parse().unwrap()],
        }]);
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&yaml).unwrap();
        let w = &doc["workloads"][0];
        assert_eq!(w["name"].as_str(), Some("client"));
        assert_eq!(w["serviceAccount"].as_str(), Some("sa"));
        assert_eq!(w["node"].as_str(), Some(NODE_NAME));
        assert_eq!(w["workloadIps"][0].as_str(), Some("10.66.0.11"));
        assert!(w["services"].is_mapping());
    }

    #[test]
    fn a_service_s_vips_ports_and_endpoints_are_in_the_yaml() {
        let workload = |name: &str, ip: &str| LocalWorkload {
            name: name.into(),
            namespace: "default".into(),
            service_account: name.into(),
            ips: vec![ip.parse().unwrap()],
        };
        let config = LocalConfig {
            workloads: vec![workload("server", "10.66.0.12"), workload("client", "10.66.0.11")],
            services: vec![LocalService {
                name: "server".into(),
                namespace: "default".into(),
                hostname: "server.default.svc.cluster.local".into(),
                vips: vec!["10.96.0.20".parse().unwrap(), "fd00:96::20".parse().unwrap()],
                ports: vec![(80, 8080)],
                endpoints: vec!["server".into()],
            }],
        };
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&config.yaml()).unwrap();
        let server = &doc["workloads"][0]["services"]["default/server.default.svc.cluster.local"];
        assert_eq!(server[80].as_u64(), Some(8080), "the endpoint's ports: {doc:?}");
        assert!(doc["workloads"][1]["services"].as_mapping().is_some_and(|m| m.is_empty()), "{doc:?}");
        let svc = &doc["services"][0];
        assert_eq!(svc["hostname"].as_str(), Some("server.default.svc.cluster.local"));
        assert_eq!(svc["vips"][0].as_str(), Some("/10.96.0.20"));
        assert_eq!(svc["vips"][1].as_str(), Some("/fd00:96::20"));
        assert_eq!(svc["ports"][80].as_u64(), Some(8080));
    }
}
