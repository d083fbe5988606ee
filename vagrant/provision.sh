#!/usr/bin/env bash
# Provisions a VM rig: what scripts/bootstrap needs that a cloud image lacks (a C
# toolchain, curl, git, python3, rustup), then scripts/bootstrap itself (Debian/Ubuntu
# packages, nightly rust-src, bpf-linker, the real Envoy). Idempotent.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
echo "[provision] kernel $(uname -r) (box expected ${WEIR_EXPECTED_KERNEL:-?})"
apt-get update -qq
apt-get install -y -qq --no-install-recommends build-essential ca-certificates curl git python3 python3-pip pkg-config >/dev/null
if ! command -v rustup >/dev/null && [ ! -x "$HOME/.cargo/bin/rustup" ]; then
  curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >/dev/null
fi
export PATH="$HOME/.cargo/bin:$PATH"
command -v cargo-nextest >/dev/null || cargo install --locked cargo-nextest >/dev/null
cd /weir
./scripts/bootstrap
echo "[provision] done: run the suite with: sudo /weir/scripts/test"
