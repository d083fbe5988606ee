//! Types and names shared by Weir's kernel programs (`weir-ebpf`) and the agent that
//! loads them. Everything here is `#[repr(C)]`, `no_std`, and carries a layout guard:
//! a change on one side that the other side does not see fails to compile.
#![no_std]

pub mod capture;
pub mod inbound;
pub mod policy;
pub mod probe;
