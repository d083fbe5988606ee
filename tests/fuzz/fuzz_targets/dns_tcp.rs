//! A TCP connection to the agent's DNS proxy carrying arbitrary bytes: 2-byte
//! length-prefixed queries in; what comes out is whole length-prefixed replies, each
//! a DNS message.
#![no_main]
use hickory_proto::op::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let proxy = weir_fuzz::dns_proxy();
    let mut stream = tokio::io::join(data, Vec::new());
    weir_fuzz::block_on(proxy.serve_tcp_connection(&mut stream));
    let (_, out) = stream.into_inner();
    let mut rest = out.as_slice();
    while !rest.is_empty() {
        assert!(rest.len() >= 2, "a reply frame without its length");
        let len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
        let body = rest.get(2..2 + len).expect("a reply frame as long as its prefix says");
        Message::from_vec(body).expect("each reply parses");
        rest = &rest[2 + len..];
    }
});
