//! The connect-counting probe: load it, attach it to one cgroup, read its count.
//! Detaches and unloads on drop.

use std::{fs::File, path::Path};

use aya::{
    Ebpf,
    maps::PerCpuArray,
    programs::{CgroupAttachMode, CgroupSockAddr},
};
use weir_ebpf_common::probe::{MAP_CONNECT_COUNT, OBJECT, PROG_COUNT_CONNECT4};

use super::{EbpfError, objects};

/// `count_connect4` attached to one cgroup; dropping it detaches the program.
pub struct ConnectCounter {
    ebpf: Ebpf,
}

impl ConnectCounter {
    /// Loads the probe object and attaches `count_connect4` to the cgroup v2 directory
    /// `cgroup`. Only connects made by processes in that cgroup (or below) are seen.
    pub fn attach(cgroup: &Path) -> Result<Self, EbpfError> {
        let data = objects::bytes(OBJECT, objects::PROBE)?;
        let mut ebpf = Ebpf::load(data).map_err(|source| EbpfError::Load { object: OBJECT, source })?;
        let program: &mut CgroupSockAddr = ebpf
            .program_mut(PROG_COUNT_CONNECT4)
            .ok_or(EbpfError::MissingProgram { object: OBJECT, program: PROG_COUNT_CONNECT4 })?
            .try_into()
            .map_err(|source| EbpfError::Verify { program: PROG_COUNT_CONNECT4, source })?;
        program.load().map_err(|source| EbpfError::Verify { program: PROG_COUNT_CONNECT4, source })?;
        let dir = File::open(cgroup)
            .map_err(|source| EbpfError::OpenCgroup { path: cgroup.to_path_buf(), source })?;
        program.attach(dir, CgroupAttachMode::Single).map_err(|source| EbpfError::Attach {
            program: PROG_COUNT_CONNECT4,
            path: cgroup.to_path_buf(),
            source,
        })?;
        Ok(Self { ebpf })
    }

    /// Connects counted so far, summed over CPUs.
    pub fn count(&self) -> Result<u64, EbpfError> {
        let map = self
            .ebpf
            .map(MAP_CONNECT_COUNT)
            .ok_or(EbpfError::MissingMap { object: OBJECT, map: MAP_CONNECT_COUNT })?;
        let counts: PerCpuArray<_, u64> =
            PerCpuArray::try_from(map).map_err(|source| EbpfError::Map { map: MAP_CONNECT_COUNT, source })?;
        let per_cpu =
            counts.get(&0, 0).map_err(|source| EbpfError::Map { map: MAP_CONNECT_COUNT, source })?;
        Ok(per_cpu.iter().sum())
    }
}
