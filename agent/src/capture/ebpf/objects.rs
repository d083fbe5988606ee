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

#[cfg(test)]
mod tests {
    /// `(section a relocation applies to, relocation type, symbol)` of every relocation
    /// in an ELF64 little-endian object: enough of ELF to read what a program calls.
    fn relocations(elf: &[u8]) -> Vec<(String, u32, String)> {
        let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
        let u32_at = |o: usize| u32::from_le_bytes(elf[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().expect("8 bytes")) as usize;
        assert_eq!(&elf[..6], b"\x7fELF\x02\x01", "an ELF64 little-endian object");
        let (shoff, shentsize, shnum, shstrndx) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c), u16_at(0x3e));
        let header = |i: usize| shoff + i * shentsize;
        let name_in = |strtab: usize, at: usize| {
            let start = u64_at(header(strtab) + 0x18) + at;
            let end = start + elf[start..].iter().position(|b| *b == 0).expect("NUL-terminated name");
            String::from_utf8_lossy(&elf[start..end]).into_owned()
        };
        let section_name = |i: usize| name_in(shstrndx, u32_at(header(i)) as usize);
        let mut out = Vec::new();
        for i in 0..shnum {
            let h = header(i);
            const SHT_REL: u32 = 9;
            if u32_at(h + 4) != SHT_REL {
                continue;
            }
            let (offset, size) = (u64_at(h + 0x18), u64_at(h + 0x20));
            let (symtab, target) = (u32_at(h + 0x28) as usize, u32_at(h + 0x2c) as usize);
            let strtab = u32_at(header(symtab) + 0x28) as usize;
            for entry in (offset..offset + size).step_by(16) {
                let info = u64_at(entry + 8);
                let symbol = u64_at(header(symtab) + 0x18) + (info >> 32) * 24;
                out.push((section_name(target), info as u32, name_in(strtab, u32_at(symbol) as usize)));
            }
        }
        out
    }

    /// The capture programs make no BPF-to-BPF calls (`R_BPF_64_32` relocations from a
    /// program's section): every function they use is inlined. With `policy::dns` a
    /// called function, Linux 6.1 ran connect4 as if every DNS socket were TCP: a
    /// connected UDP socket was sent to the agent without its server recorded, and the
    /// replies came from the agent's 127.0.0.1:15053, which glibc's resolver drops
    /// (`capture_ebpf`'s connected-socket DNS case on the kernel matrix's 6.1 row; the
    /// same object passes on 6.12, and the commit that broke it only changed the code
    /// around the call). See ARCHITECTURE.md, "eBPF programs and old verifiers".
    #[test]
    fn the_capture_programs_make_no_bpf_to_bpf_calls() {
        assert!(
            !super::CAPTURE.is_empty(),
            "the eBPF objects are stubs (WEIR_EBPF_STUB): build them to run this test"
        );
        let relocations = relocations(super::CAPTURE);
        assert!(
            relocations.iter().any(|(section, _, _)| section == "cgroup/connect4"),
            "the capture object's programs were read: {relocations:?}"
        );
        const R_BPF_64_32: u32 = 10;
        let calls: Vec<_> = relocations.iter().filter(|(_, kind, _)| *kind == R_BPF_64_32).collect();
        assert!(calls.is_empty(), "programs calling a function that was not inlined: {calls:?}");
    }
}
