//! The eBPF objects `build.rs` compiled from `ebpf/programs`, embedded in the binary.

use super::EbpfError;

/// The probe object (see `weir_ebpf_common::probe`).
pub static PROBE: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/weir-probe"));

/// The capture object (cgroup programs): `weir_ebpf_common::capture`.
pub static CAPTURE: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/weir-capture"));
pub const CAPTURE_NAME: &str = weir_ebpf_common::capture::OBJECT;

/// The inbound object (tc classifier): `weir_ebpf_common::inbound`.
pub static INBOUND: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/weir-inbound"));
pub const INBOUND_NAME: &str = weir_ebpf_common::inbound::OBJECT;

/// True when `build.rs` wrote empty stub objects instead of compiling the programs.
pub const IS_STUB: bool = matches!(env!("WEIR_EBPF_BUILD").as_bytes(), b"stub");

/// Returns the object's bytes, or a clear error if this binary carries only a stub.
pub fn bytes(object: &'static str, data: &'static [u8]) -> Result<&'static [u8], EbpfError> {
    if data.is_empty() {
        return Err(EbpfError::Stub { object });
    }
    Ok(data)
}
