//! Weir's kernel programs live in this crate's binaries (one object per program
//! family), built for the bpf target by `agent/build.rs`. The library target is empty:
//! it exists so the agent can declare a build-dependency that makes cargo rebuild the
//! objects when this crate or `weir-ebpf-common` changes.
#![no_std]
