//! The real ztunnel (istio/ztunnel at 62d82653, Istio's node proxy for ambient mode) as
//! a test peer of Weir's node agent: built once from
//! `../shared/peers/ztunnel-62d82653.tar.gz` (beside the checkout) into a cache outside
//! the checkout, and run in a test namespace in in-pod ("shared") mode, with no istiod.
//!
//! **The build.** The cache is `$WEIR_CACHE_DIR` (else `$XDG_CACHE_HOME/weir`, else
//! `$HOME/.cache/weir`) + `ztunnel-<sha256 of the tarball>/`: the tarball's hash is the
//! key, so a new tarball builds anew and the same one, on the same machine, is built
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
//! and `LOCAL_XDS_PATH` (the workloads, [`workloads_yaml`]); everything else from a
//! cleared environment. [`listening_tcp_ports`] reads which ports listen inside a
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
/// The tarball's top folder.
const TOP_DIR: &str = "ztunnel-62d82653";
/// The features: rustls over ring (no aws-lc C build), and `FAKE_CA`.
const FEATURES: &str = "tls-ring,testing";
/// The manifest's git dependency, and its mention in the `tls-boring` feature.
const GIT_DEPENDENCY: &str = "boring-rustls-provider";
const GIT_FEATURE: &str = ", \"boring-rustls-provider/fips-only\"";

/// The ports ztunnel opens in each pod's namespace: outbound capture, inbound capture,
/// HBONE, DNS.
pub const POD_PORTS: [u16; 4] = [15001, 15006, 15008, 15053];

/// The tarball: `$WEIR_ZTUNNEL_TARBALL`, else `shared/peers/` beside the checkout.
pub fn tarball() -> anyhow::Result<PathBuf> {
    let path = match std::env::var_os("WEIR_ZTUNNEL_TARBALL") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/peers").join(TARBALL),
    };
    if !path.is_file() {
        bail!(
            "the ztunnel peer's source {} is missing: it is `shared/peers/{TARBALL}` beside the checkout \
             (or set WEIR_ZTUNNEL_TARBALL)",
            path.display()
        );
    }
    Ok(path)
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

/// The cache folder of this tarball's build.
pub fn cache_dir() -> anyhow::Result<PathBuf> {
    let sha = sha256_file(&tarball()?)?;
    Ok(cache_root()?.join(format!("ztunnel-{sha}")))
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
    let tarball = tarball()?;
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

/// Unpacks the tarball into `dir/src` (anew) and returns its top folder.
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
    let top = src.join(TOP_DIR);
    if !top.join("Cargo.toml").is_file() {
        bail!("{} did not hold {TOP_DIR}/Cargo.toml", tarball.display());
    }
    Ok(top)
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

/// ztunnel's local config for `workloads`: each on [`NODE_NAME`], HBONE, trust domain
/// `cluster.local`. ztunnel ties a ZDS Add to one of these by (namespace, service
/// account, name).
pub fn workloads_yaml(workloads: &[LocalWorkload]) -> String {
    let mut out = String::from("workloads:\n");
    for w in workloads {
        let ips: Vec<String> = w.ips.iter().map(|ip| format!("\"{ip}\"")).collect();
        out.push_str(&format!(
            "- uid: Kubernetes//Pod/{ns}/{name}\n  name: {name}\n  workloadName: {name}\n  \
             namespace: {ns}\n  serviceAccount: {sa}\n  trustDomain: cluster.local\n  \
             workloadIps: [{ips}]\n  protocol: HBONE\n  node: {NODE_NAME}\n  services: {{}}\n",
            ns = w.namespace,
            name = w.name,
            sa = w.service_account,
            ips = ips.join(", "),
        ));
    }
    out
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
        let bin = binary()?;
        let dir = tempfile::Builder::new().prefix("weir-ztunnel-").tempdir().context("ztunnel's temp dir")?;
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).context("chmod ztunnel's dir")?;
        let config = dir.path().join("workloads.yaml");
        fs::write(&config, workloads_yaml(workloads)).context("write ztunnel's local config")?;
        let log = dir.path().join("ztunnel.log");
        let out = fs::File::create(&log).context("create ztunnel's log")?;
        let mut cmd = Command::new(&bin);
        cmd.env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("RUST_LOG", "info")
            .env("FAKE_CA", "true")
            .env("XDS_ADDRESS", "")
            .env("LOCAL_XDS_PATH", &config)
            .env("INPOD_UDS", inpod_uds)
            .env("NODE_NAME", NODE_NAME)
            .env("CLUSTER_ID", "Kubernetes")
            .stdin(Stdio::null())
            .stdout(out.try_clone().context("dup ztunnel's log")?)
            .stderr(out);
        let placement = weir_agent::sandbox::Placement { user: Some((0, 0)), cgroup, ..Default::default() };
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
}
