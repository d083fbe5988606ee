//! A DNS query over UDP to the agent's DNS proxy, with an NDS table installed and no
//! upstream (unknown names get SERVFAIL): garbage is dropped, anything answered is a
//! DNS message with the query's id that fits the client's UDP size.
#![no_main]
use hickory_proto::op::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let proxy = weir_fuzz::dns_proxy();
    let Some(reply) = weir_fuzz::block_on(proxy.answer(data, false)) else { return };
    let query = Message::from_vec(data).expect("only a parsed query is answered");
    let parsed = Message::from_vec(&reply).expect("the reply parses");
    assert_eq!(parsed.metadata.id, query.metadata.id);
});
