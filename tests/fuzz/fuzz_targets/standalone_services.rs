//! The standalone control plane's services file (YAML): parsed and validated, then
//! turned into the xDS snapshot for a workload and for none.
#![no_main]
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use weir_agent::sidecar::standalone::mesh::MeshFile;

fuzz_target!(|data: &[u8]| {
    let Some(text) = weir_fuzz::text(data) else { return };
    let Ok(mesh) = MeshFile::parse(Path::new("services.yaml"), text) else { return };
    let _ = mesh.snapshot(None, "1");
    for s in &mesh.services {
        for e in &s.endpoints {
            let _ = mesh.snapshot(Some(e.ip()), "1");
        }
    }
});
