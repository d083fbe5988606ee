//! An NDS `NameTable` from istiod (protobuf bytes): decoded as the relay's handler
//! decodes it, built into the lookup table, and every host looked up. A host with a
//! valid address answers its own name.
#![no_main]
use hickory_proto::rr::RecordType;
use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use weir_agent::sidecar::dns::{LookupTable, table::ProxyScope};
use weir_proto::istio::networking::nds::v1::NameTable;

fuzz_target!(|data: &[u8]| {
    let Ok(table) = NameTable::decode(data) else { return };
    let scope = ProxyScope {
        namespace: "default".into(),
        domain: "default.svc.cluster.local".into(),
        search: vec!["default.svc.cluster.local".into(), "svc.cluster.local".into()],
    };
    let built = LookupTable::build(&table, &scope);
    for (host, info) in &table.table {
        let name = if host.ends_with('.') { host.clone() } else { format!("{host}.") };
        for qtype in [RecordType::A, RecordType::AAAA, RecordType::TXT] {
            let _ = built.lookup(qtype, &name);
            let _ = built.lookup(qtype, &format!("x.{name}"));
            let _ = built.lookup(qtype, &format!("{}.{}.", info.shortname, info.namespace));
        }
        let has_ip = info.ips.iter().any(|ip| ip.parse::<std::net::IpAddr>().is_ok());
        if has_ip && info.registry != "Kubernetes" {
            let answered = built.lookup(RecordType::A, &name).is_some();
            assert!(answered, "{name} has an address but is not known");
        }
    }
});
