//! Kernel access, in process: rtnetlink for links, addresses, rules and routes
//! (`netlink`) and TPROXY's policy routes over it (`routes`); netfilter netlink for
//! what tables and chains a namespace has (`nf_probe`), the nf_tables messages Weir
//! writes (`nft_encode`) and the one transaction that sends them (`nft_batch`), and
//! the kernel's ipsets (`ipset`). Every call works in the calling thread's network
//! namespace; nothing here knows a backend's rule text.

pub mod ipset;
pub mod netlink;
pub mod nf_probe;
pub mod nft_batch;
pub mod nft_encode;
pub mod routes;
