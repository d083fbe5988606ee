//! `weir-bench sds`: what a workload certificate costs the agent. Each issuance is a
//! fresh key, a CSR, `CreateCertificate` at the CA and the chain checks, against the
//! floor of the CA round trip alone (a CSR made once, signed again and again). The CA
//! is the tests' istiod CA (signing with Weir's mesh CA) over loopback gRPC in this process, so the CA's own signing time
//! is in every row, the floor included.

use std::{sync::Arc, time::Instant};

use tokio_util::sync::CancellationToken;
use weir_agent::{
    sidecar::controlplane::{self, AdsServer, AuthPolicy, Snapshot},
    sidecar::identity::{CaClient, KeyAlgorithm, KeyOptions, WorkloadIdentity, keys},
    sidecar::metrics::Metrics,
    sidecar::xds::UpstreamConfig,
};
use weir_tests::istiod_ca::IstiodCa;

use super::report::{Options, Row, Table, repeat_pair};

/// Issuances per run.
const ISSUES: usize = 40;

fn identity() -> WorkloadIdentity {
    WorkloadIdentity {
        trust_domain: "cluster.local".into(),
        namespace: "bench".into(),
        service_account: "app".into(),
    }
}

#[derive(Clone, Copy)]
enum Kind {
    /// Only the CA round trip and chain checks (the CSR made once).
    CaOnly,
    Issue(KeyAlgorithm),
}

impl Kind {
    fn name(self) -> String {
        match self {
            Self::CaOnly => "CA round trip only (floor)".into(),
            Self::Issue(KeyAlgorithm::EcdsaP256) => "issue: ECDSA P-256 key + CSR + CA".into(),
            Self::Issue(KeyAlgorithm::Rsa(bits)) => format!("issue: RSA {bits} key + CSR + CA"),
        }
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// (p50, p99) in ms of `ISSUES` issuances.
async fn run_once(kind: Kind) -> anyhow::Result<(f64, f64)> {
    let stop = CancellationToken::new();
    let ca = IstiodCa::new("bench CA", None)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let ads = AdsServer::new(Snapshot::new(), AuthPolicy::default());
    tokio::spawn(controlplane::serve(listener, None, ads, Some(ca), stop.clone().cancelled_owned()));
    let client = CaClient::new(
        UpstreamConfig::plaintext(addr.to_string()),
        std::time::Duration::from_secs(3600),
        None,
        Arc::new(Metrics::new()),
    );
    let premade =
        keys::generate(&identity(), &KeyOptions { algorithm: KeyAlgorithm::EcdsaP256, pkcs8: false })?;
    client.sign(&premade.csr_pem, &premade.public_key_der).await?; // warm the channel
    let mut ms = Vec::with_capacity(ISSUES);
    for _ in 0..ISSUES {
        let started = Instant::now();
        match kind {
            Kind::CaOnly => {
                client.sign(&premade.csr_pem, &premade.public_key_der).await?;
            }
            Kind::Issue(algorithm) => {
                let key = tokio::task::spawn_blocking(move || {
                    keys::generate(&identity(), &KeyOptions { algorithm, pkcs8: false })
                })
                .await??;
                client.sign(&key.csr_pem, &key.public_key_der).await?;
            }
        }
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    stop.cancel();
    ms.sort_by(f64::total_cmp);
    Ok((percentile(&ms, 0.5), percentile(&ms, 0.99)))
}

pub fn tables(opts: &Options) -> anyhow::Result<Vec<Table>> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let kinds = [Kind::CaOnly, Kind::Issue(KeyAlgorithm::EcdsaP256), Kind::Issue(KeyAlgorithm::Rsa(2048))];
    let mut rows = Vec::new();
    for kind in kinds {
        let (p50, p99) = repeat_pair("sds", &kind.name(), opts.runs, || runtime.block_on(run_once(kind)));
        rows.push(Row { name: kind.name(), metrics: vec![p50, p99] });
    }
    let table = Table {
        title: "Workload certificate issuance (agent side)".into(),
        columns: vec![("p50", "ms", false), ("p99", "ms", false)],
        rows,
        notes: vec![format!(
            "{ISSUES} issuances per run, one after another; CA: Weir's test CA (ECDSA P-256 root) over loopback gRPC in \
             the same process. Median [min–max] of {} runs.",
            opts.runs
        )],
    };
    Ok(vec![table])
}
