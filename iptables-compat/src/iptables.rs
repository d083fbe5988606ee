//! The iptables back end: Istio's rules as a pure plan per family (`plan`), the
//! restore, check and removal text rendered from it (`render`), what a namespace
//! already holds read from `iptables-save` and compared with a plan (`state`), the
//! binaries and executors that run it (`xtables`), and the IPv4 nat restore text
//! compiled in process into the nf_tables batch iptables-nft would send (`xt_wire`).

pub mod plan;
pub mod render;
pub mod state;
pub mod xt_wire;
pub mod xtables;
