//! `sk_msg` on registered local sockets: pass each message straight to the peer
//! socket's receive queue, skipping the TCP/IP stack. A sender whose peer was not yet
//! registered keeps using the stack for the rest of the connection, so its bytes never
//! take two paths (which could reorder them).

use aya_ebpf::{macros::sk_msg, programs::SkMsgContext};
use weir_ebpf_common::capture::{PairKey, counter};

use crate::{
    maps::{self, NO_REDIRECT, SOCK_PAIRS},
    net::{self, AF_INET, AF_INET6, field},
};

const SK_PASS: u32 = 1;
/// BPF_F_INGRESS: deliver into the peer's receive queue.
const INGRESS: u64 = 1;

#[sk_msg]
pub fn weir_sk_msg(ctx: SkMsgContext) -> u32 {
    let md = ctx.msg;
    let (family, size) = unsafe { (field!(md, family) as u16, field!(md, size)) };
    let (local, remote) = unsafe {
        match family {
            AF_INET => ([field!(md, local_ip4), 0, 0, 0], [field!(md, remote_ip4), 0, 0, 0]),
            AF_INET6 => (
                [
                    field!(md, local_ip6[0]),
                    field!(md, local_ip6[1]),
                    field!(md, local_ip6[2]),
                    field!(md, local_ip6[3]),
                ],
                [
                    field!(md, remote_ip6[0]),
                    field!(md, remote_ip6[1]),
                    field!(md, remote_ip6[2]),
                    field!(md, remote_ip6[3]),
                ],
            ),
            _ => return SK_PASS,
        }
    };
    let netns = net::netns_cookie(md.cast());
    let me = net::unmapped_pair(PairKey {
        netns,
        local_addr: local,
        remote_addr: remote,
        local_port: unsafe { field!(md, local_port) } as u16,
        remote_port: u16::from_be((unsafe { field!(md, remote_port) } >> 16) as u16),
        family: u32::from(family),
    });
    if unsafe { NO_REDIRECT.get(&me) }.is_some() {
        return SK_PASS;
    }
    let mut peer = me.peer();
    if SOCK_PAIRS.redirect_msg(&ctx, &mut peer, INGRESS) == i64::from(SK_PASS) {
        maps::add(netns, counter::SKMSG_REDIRECTED, 1);
        maps::add(netns, counter::SKMSG_BYTES, u64::from(size));
    } else {
        maps::add(netns, counter::SKMSG_PASSED, 1);
        if maps::log_enabled() {
            aya_log_ebpf::info!(
                &ctx,
                "sk_msg: no peer for {:i}:{} -> {:i}:{} ({} bytes)",
                u32::from_be(me.local_addr[0]),
                me.local_port,
                u32::from_be(me.remote_addr[0]),
                me.remote_port,
                size
            );
        }
        let _ = NO_REDIRECT.insert(&me, &1, 0);
    }
    SK_PASS
}
