//! The HTTP/2 `:authority` repair on the XDS socket, fed raw client bytes: it must
//! never panic, and every header block it lets through decodes on its own (literals
//! only) with an `:authority` that is a valid URI authority.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tokio::io::AsyncReadExt as _;
use weir_agent::sidecar::xds::authority::AuthorityRepair;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Checks the header blocks among the frames of `out` (after the preface); a frame
/// cut short by the end of input ends the walk.
fn check_blocks(mut out: &[u8]) {
    let mut block: Option<Vec<u8>> = None;
    while out.len() >= 9 {
        let len = (usize::from(out[0]) << 16) | (usize::from(out[1]) << 8) | usize::from(out[2]);
        let (kind, flags) = (out[3], out[4]);
        let Some(payload) = out.get(9..9 + len) else { return };
        out = &out[9 + len..];
        match kind {
            0x1 => block = Some(payload.to_vec()),
            0x9 => block.as_mut().expect("CONTINUATION follows HEADERS").extend_from_slice(payload),
            _ => continue,
        }
        if flags & 0x4 != 0 {
            let fields = loona_hpack::Decoder::new()
                .decode(&block.take().expect("a block"))
                .expect("a repaired block decodes with a fresh decoder");
            for (name, value) in fields {
                if name == b":authority" {
                    assert!(http::uri::Authority::try_from(value.as_slice()).is_ok(), "{value:?}");
                }
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut repair = AuthorityRepair::new(data);
    let mut out = Vec::new();
    let result = futures::executor::block_on(repair.read_to_end(&mut out));
    if result.is_ok() && data.starts_with(PREFACE) {
        assert!(out.starts_with(PREFACE));
        check_blocks(&out[PREFACE.len()..]);
    }
});
