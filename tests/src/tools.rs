//! The binaries and tool paths tests drive: `weir` itself, the `weir-testkit` traffic
//! tool (both built by `cargo nextest run --workspace` next to the test executables),
//! and paths under `.tools/` that children running as other users must reach.
//!
//! Tests run processes as 1000 and 1337 from a checkout that may sit under a 0700
//! directory (`/root/<clone>`), so nothing here hands a child a path it would have to
//! walk: commands run through a descriptor opened by the test
//! ([`weir_agent::support::executable::Executable`]), and paths given to children by name are
//! the test's own inherited descriptors ([`for_children`]).
//!
//! A benchmark comparing two builds (`weir-bench --against`) switches which `weir`
//! binary later calls run with [`use_weir`]; tests never do.

use std::{
    collections::HashMap,
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, OnceLock},
};

use weir_agent::support::executable::Executable;

/// `target/<profile>/`, found from the running test executable (`.../deps/<test>`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("test exe has a parent");
    if dir.ends_with("deps") {
        dir.parent().expect("deps has a parent").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

pub fn binary(name: &str) -> PathBuf {
    let path = target_dir().join(name);
    assert!(
        path.is_file(),
        "{} not found: build the binaries first (cargo build --workspace --bins; scripts/test does)",
        path.display()
    );
    path
}

/// The workspace root of the checkout under test.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ is inside the workspace").to_path_buf()
}

/// Another build's `weir` that [`weir`] and [`weir_command`] give from now on (`None`:
/// this checkout's, next to the running executable).
static WEIR_UNDER_TEST: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Makes `path` the `weir` binary under test from now on (`None`: this checkout's).
/// For `weir-bench --against`, which runs the same benchmark with two builds in turn.
pub fn use_weir(path: Option<PathBuf>) {
    *WEIR_UNDER_TEST.lock().unwrap_or_else(|e| e.into_inner()) = path;
}

/// The `weir` binary under test (its path: for root-only uses such as copying it).
pub fn weir() -> PathBuf {
    WEIR_UNDER_TEST.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_else(|| binary("weir"))
}

/// The CNI plugin binary under test: `weir-cni` beside the `weir` under test; for an
/// older build that has none, that `weir` (the plugin too when named weir-cni).
pub fn weir_cni() -> PathBuf {
    companion("weir-cni").unwrap_or_else(weir)
}

/// The `weir-init` binary under test (pilot-agent as the weir-init image has it), if
/// the build under test has one.
pub fn weir_init() -> Option<PathBuf> {
    companion("weir-init")
}

/// `name` built with the `weir` under test: beside it.
fn companion(name: &str) -> Option<PathBuf> {
    match WEIR_UNDER_TEST.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        Some(other) => Some(other.with_file_name(name)).filter(|p| p.is_file()),
        None => Some(binary(name)),
    }
}

/// The `weir-testkit` helper's path (TCP/UDP clients and servers for traffic tests).
pub fn testkit() -> PathBuf {
    binary("weir-testkit")
}

fn opened(cell: &'static OnceLock<Executable>, name: &str) -> &'static Executable {
    cell.get_or_init(|| Executable::open(binary(name)).unwrap_or_else(|e| panic!("open {name}: {e}")))
}

/// A command running `weir`, as any user.
pub fn weir_command() -> Command {
    static WEIR: OnceLock<Executable> = OnceLock::new();
    let Some(path) = WEIR_UNDER_TEST.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
        return opened(&WEIR, "weir").command();
    };
    other_build_command(&path)
}

/// A command running a binary of another build (`--against`), opened once and held:
/// the command runs it through the held descriptor, which must outlive the spawn.
fn other_build_command(path: &Path) -> Command {
    static OTHERS: OnceLock<Mutex<HashMap<PathBuf, Executable>>> = OnceLock::new();
    let mut others = OTHERS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    others
        .entry(path.to_path_buf())
        .or_insert_with(|| Executable::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display())))
        .command()
}

/// A command running `weir` under the name `pilot-agent` (the istio-proxy container's).
pub fn pilot_agent_command() -> Command {
    let mut cmd = weir_command();
    cmd.arg0("pilot-agent");
    cmd
}

/// A command running pilot-agent as the istio-init container of the weir-init image
/// does, as any user: `weir-init` under test, named `pilot-agent`; for a build without
/// it, `weir` as `pilot-agent` (what that build's image ran).
pub fn init_command() -> Command {
    static INIT: OnceLock<Executable> = OnceLock::new();
    let other_build = WEIR_UNDER_TEST.lock().unwrap_or_else(|e| e.into_inner()).is_some();
    let mut cmd = match (other_build, weir_init()) {
        (false, Some(_)) => opened(&INIT, "weir-init").command(),
        // Held: a descriptor dropped here would be gone when the command runs.
        (true, Some(other)) => other_build_command(&other),
        (_, None) => return pilot_agent_command(),
    };
    cmd.arg0("pilot-agent");
    cmd
}

/// A command running `weir-testkit`, as any user.
pub fn testkit_command() -> Command {
    static TESTKIT: OnceLock<Executable> = OnceLock::new();
    opened(&TESTKIT, "weir-testkit").command()
}

/// A path to `path` that this test process and every child it starts can use whatever
/// its uid (Envoy's `binaryPath` for an agent running as 1337, grpcio's `PYTHONPATH`
/// for an app running as 1000): `/proc/self/fd/<n>` of a descriptor opened here, once,
/// and inherited by children (not close-on-exec). A child that itself starts programs
/// opens the path again through its own copy of the descriptor.
pub fn for_children(path: &Path) -> PathBuf {
    static HELD: OnceLock<Mutex<HashMap<PathBuf, std::fs::File>>> = OnceLock::new();
    let mut held = HELD.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let file = held.entry(path.to_path_buf()).or_insert_with(|| {
        let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        // Kept open for the life of the test process, and across exec.
        nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()))
            .unwrap_or_else(|e| panic!("clear close-on-exec on {}: {e}", path.display()));
        file
    });
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}
