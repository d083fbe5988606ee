//! `weir capture explain --netns` on arbitrary rule text: the first line is the
//! connection (`<dst ip> <port> <uid> <gid> <through lo: 0|1> [src ip]`), the rest the
//! rules, walked as `iptables-save` output and as an nftables table listing, from the
//! output hook and, as a connection arriving on eth0, from prerouting.
#![no_main]
use libfuzzer_sys::fuzz_target;
use weir_iptables::explain::{Connection, explain, explain_inbound, explain_nft, explain_nft_inbound};

fuzz_target!(|data: &[u8]| {
    let Some(text) = weir_fuzz::text(data) else { return };
    let (first, save) = text.split_once('\n').unwrap_or((text, ""));
    let w: Vec<&str> = first.split_whitespace().collect();
    let (Some(dst), Some(port), Some(uid), Some(gid), Some(lo)) = (
        w.first().and_then(|v| v.parse().ok()),
        w.get(1).and_then(|v| v.parse().ok()),
        w.get(2).and_then(|v| v.parse().ok()),
        w.get(3).and_then(|v| v.parse().ok()),
        w.get(4).map(|v| *v == "1"),
    ) else {
        return;
    };
    let conn = Connection {
        dst,
        dst_port: port,
        udp: false,
        uid,
        gid,
        src: w.get(5).and_then(|v| v.parse().ok()),
        through_lo: lo,
        in_iface: None,
    };
    let _ = explain(save, &conn);
    let _ = explain_nft(save, &conn);
    let arriving = Connection { in_iface: Some("eth0".into()), ..conn };
    let _ = explain_inbound(save, &arriving);
    let _ = explain_nft_inbound(save, &arriving);
});
