//! Paths of the binaries tests drive: `weir` itself and the `weir-testkit` traffic tool.
//! Both are built by `cargo nextest run --workspace` next to the test executables.

use std::path::PathBuf;

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

fn binary(name: &str) -> PathBuf {
    let path = target_dir().join(name);
    assert!(
        path.is_file(),
        "{} not found: build the binaries first (cargo build --workspace --bins; scripts/test does)",
        path.display()
    );
    path
}

/// The `weir` binary under test.
pub fn weir() -> PathBuf {
    binary("weir")
}

/// The `weir-testkit` helper (TCP/UDP clients and servers for traffic tests).
pub fn testkit() -> PathBuf {
    binary("weir-testkit")
}
