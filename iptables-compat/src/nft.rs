//! The native nftables back end: Istio's rules as a pure plan over the tables
//! `istio-proxy-nat`, `-mangle` and `-raw` in family inet (`table`, `plan`), rendered
//! as the one `nft -f` transaction Istio's knftables would send (`render`); that text
//! compiled in process into the nf_tables batch `nft -f` would send (`wire`); and nft
//! run, or recorded for a dry run (`exec`).

pub mod exec;
mod plan;
mod render;
mod table;
pub mod wire;

pub use plan::plan;
pub use render::{render, render_cleanup, render_replace};
pub use table::{NftPlan, NftRule, NftTable};
