//! `cgroup/getsockopt`: answer `SO_ORIGINAL_DST` (SOL_IP) and `IP6T_SO_ORIGINAL_DST`
//! (SOL_IPV6) on Envoy's accepted socket with the destination the app connected to,
//! so Envoy's `original_dst` listener filter works unchanged.
//!
//! The hook sits on a cgroup shared with sockets that are not the mesh's (a node's
//! `kubepods.slice`: host-network pods, kube-proxy or Calico reading their iptables
//! tables with buffers far over a page). Every other call must come back as the kernel
//! made it, on every kernel: a buffer over a page gets `optlen = 0`, which the kernel's
//! documentation prescribes for "not consumed" (the kernel's own answer is kept; before
//! Linux 6.5, leaving optlen over a page fails the call with EFAULT, and clamping it to
//! a page would cut the answer short).

use aya_ebpf::{EbpfContext as _, macros::cgroup_sockopt, programs::SockoptContext};
use weir_ebpf_common::capture::{PairKey, counter};

use crate::{
    maps::{self, ORIG_BY_PAIR, POD_CONFIG},
    net::{self, AF_INET, AF_INET6, field},
};

const SO_ORIGINAL_DST: i32 = 80;
const SOL_IP: i32 = 0;
const SOL_IPV6: i32 = 41;
const PAGE: i32 = 4096;
const SOCKADDR_IN: usize = 16;
const SOCKADDR_IN6: usize = 28;

#[cgroup_sockopt(getsockopt)]
pub fn weir_getsockopt(ctx: SockoptContext) -> i32 {
    let so = ctx.sockopt;
    unsafe {
        // Before any early return: see the module's doc.
        if (*so).optlen > PAGE {
            (*so).optlen = 0;
        }
        if (*so).optname != SO_ORIGINAL_DST {
            return 1;
        }
    }
    let netns = net::netns_cookie(ctx.as_ptr());
    let Some(cfg) = (unsafe { POD_CONFIG.get(&netns) }) else { return 1 };
    unsafe {
        let level = (*so).level;
        let sk = (*so).__bindgen_anon_1.sk;
        if sk.is_null() {
            return 1;
        }
        let family = field!(sk, family) as u16;
        let (local, remote) = match (level, family) {
            (SOL_IP, AF_INET) => ([field!(sk, src_ip4), 0, 0, 0], [field!(sk, dst_ip4), 0, 0, 0]),
            // A dual-stack socket (ztunnel's listeners) accepted an IPv4 connection:
            // SOL_IP answers for it, as netfilter's does.
            (SOL_IP | SOL_IPV6, AF_INET6) => (
                [
                    field!(sk, src_ip6[0]),
                    field!(sk, src_ip6[1]),
                    field!(sk, src_ip6[2]),
                    field!(sk, src_ip6[3]),
                ],
                [
                    field!(sk, dst_ip6[0]),
                    field!(sk, dst_ip6[1]),
                    field!(sk, dst_ip6[2]),
                    field!(sk, dst_ip6[3]),
                ],
            ),
            _ => return 1,
        };
        // The app's end of this connection: Envoy's remote is the app's local.
        let app = net::unmapped_pair(PairKey {
            netns,
            local_addr: remote,
            remote_addr: local,
            local_port: u16::from_be(field!(sk, dst_port)),
            remote_port: field!(sk, src_port) as u16,
            family: u32::from(family),
        });
        // Only the proxy's redirect ports hold redirected connections: a connection
        // accepted anywhere else (ztunnel's inbound sockets, whose local address is
        // the original destination already) gets the kernel's own answer.
        if app.remote_port != cfg.outbound_port && app.remote_port != cfg.inbound_port {
            return 1;
        }
        // IPv4 inside IPv6 is answered at SOL_IP only; real IPv6 at SOL_IPV6 only.
        let answer_v4 = app.family == u32::from(AF_INET);
        if answer_v4 != (level == SOL_IP) {
            return 1;
        }
        let Some(orig) = ORIG_BY_PAIR.get(&app) else {
            maps::count(cfg, netns, counter::ORIG_DST_MISSING);
            return 1;
        };
        let orig = *orig;
        let optval = (*so).__bindgen_anon_2.optval as *mut u8;
        let end = (*so).__bindgen_anon_3.optval_end as *mut u8;
        if answer_v4 {
            if optval.add(SOCKADDR_IN) > end {
                return 1;
            }
            let p = optval as *mut u16;
            *p = AF_INET;
            *p.add(1) = orig.port;
            *(optval.add(4) as *mut u32) = orig.addr[0];
            *(optval.add(8) as *mut u64) = 0;
            (*so).optlen = SOCKADDR_IN as i32;
        } else {
            if optval.add(SOCKADDR_IN6) > end {
                return 1;
            }
            let p = optval as *mut u16;
            *p = AF_INET6;
            *p.add(1) = orig.port;
            let w = optval.add(4) as *mut u32;
            *w = 0; // flowinfo
            *w.add(1) = orig.addr[0];
            *w.add(2) = orig.addr[1];
            *w.add(3) = orig.addr[2];
            *w.add(4) = orig.addr[3];
            *w.add(5) = 0; // scope id
            (*so).optlen = SOCKADDR_IN6 as i32;
        }
        (*so).retval = 0;
        let _ = ORIG_BY_PAIR.remove(&app);
    }
    maps::count(cfg, netns, counter::ORIG_DST_ANSWERED);
    1
}
