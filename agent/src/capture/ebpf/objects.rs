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
    /// What an ELF64 little-endian object says about its code: each section's name,
    /// flags and bytes, and each relocation as `(section it applies to, type, symbol)`.
    /// Enough of ELF to tell what a program calls.
    struct Elf<'a> {
        sections: Vec<(String, u64, &'a [u8])>,
        relocations: Vec<(String, u32, String)>,
    }

    fn read(elf: &[u8]) -> Elf<'_> {
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
        let mut out = Elf { sections: Vec::new(), relocations: Vec::new() };
        for i in 0..shnum {
            let h = header(i);
            let (offset, size) = (u64_at(h + 0x18), u64_at(h + 0x20));
            const SHT_NOBITS: u32 = 8;
            let bytes = if u32_at(h + 4) == SHT_NOBITS { &elf[..0] } else { &elf[offset..offset + size] };
            out.sections.push((section_name(i), u64_at(h + 8) as u64, bytes));
            const SHT_REL: u32 = 9;
            if u32_at(h + 4) != SHT_REL {
                continue;
            }
            let (symtab, target) = (u32_at(h + 0x28) as usize, u32_at(h + 0x2c) as usize);
            let strtab = u32_at(header(symtab) + 0x28) as usize;
            for entry in (offset..offset + size).step_by(16) {
                let info = u64_at(entry + 8);
                let symbol = u64_at(header(symtab) + 0x18) + (info >> 32) * 24;
                out.relocations.push((
                    section_name(target),
                    info as u32,
                    name_in(strtab, u32_at(symbol) as usize),
                ));
            }
        }
        out
    }

    /// Every BPF-to-BPF call in `object`'s programs, each named by its section and
    /// instruction: a call instruction to a subprogram (`BPF_PSEUDO_CALL`, whether to
    /// another section through a relocation or within the same section without one), a
    /// function's address loaded for a callback (`BPF_PSEUDO_FUNC`), and any
    /// `R_BPF_64_32` relocation from a program's section.
    fn calls(object: &[u8]) -> (Vec<String>, Vec<String>) {
        let elf = read(object);
        const SHF_EXECINSTR: u64 = 0x4;
        let programs: Vec<_> = elf
            .sections
            .iter()
            .filter(|(name, flags, _)| flags & SHF_EXECINSTR != 0 && name != ".text")
            .collect();
        let mut calls = Vec::new();
        for (name, _, code) in &programs {
            for (i, insn) in code.chunks_exact(8).enumerate() {
                let (opcode, src_reg) = (insn[0], insn[1] >> 4);
                const CALL: u8 = 0x85;
                const LD_IMM64: u8 = 0x18;
                if (opcode == CALL && src_reg == 1) || (opcode == LD_IMM64 && src_reg == 4) {
                    calls.push(format!("{name} insn {i}: {insn:02x?}"));
                }
            }
        }
        const R_BPF_64_32: u32 = 10;
        for (section, kind, symbol) in &elf.relocations {
            if *kind == R_BPF_64_32 && section != ".text" {
                calls.push(format!("{section}: R_BPF_64_32 to {symbol}"));
            }
        }
        (programs.iter().map(|(name, _, _)| name.clone()).collect(), calls)
    }

    /// Weir's programs make no BPF-to-BPF calls: every function they use is inlined,
    /// and nothing is zeroed whole where LLVM would call `memset`. With `policy::dns` a
    /// called function, connect4 on Linux 6.1 skipped recording a connected UDP DNS
    /// socket's server (its replies then came from the agent's 127.0.0.1:15053, which
    /// glibc's resolver drops), though the same object works on 6.12 and 6.18; the
    /// kernel's reason was not found. ARCHITECTURE.md, "No calls between functions".
    #[test]
    fn weirs_programs_make_no_bpf_to_bpf_calls() {
        for (object, bytes, program) in [
            ("capture", super::CAPTURE, "cgroup/connect4"),
            ("inbound", super::INBOUND, "classifier"),
            ("probe", super::PROBE, "cgroup/connect4"),
        ] {
            assert!(
                !bytes.is_empty(),
                "the eBPF objects are stubs (WEIR_EBPF_STUB): build them to run this test"
            );
            let (programs, calls) = calls(bytes);
            assert!(
                programs.iter().any(|p| p == program),
                "the {object} object's programs were read: {programs:?}"
            );
            assert!(
                calls.is_empty(),
                "the {object} object's programs call functions that were not inlined: {calls:?}"
            );
        }
    }
}
