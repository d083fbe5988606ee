//! The standalone mesh: a YAML file of services, and what one workload's Envoy gets
//! from it, as Istio would configure a sidecar: `virtualOutbound` (15001) sending each
//! service's address and port to its cluster, which originates Istio mutual TLS to the
//! service's endpoints and checks their SPIFFE ID (HTTP with the service's timeout and
//! retries, or TCP), anything else passed through; and, for the services this
//! workload serves, `virtualInbound` (15006) terminating mutual TLS and handing the
//! traffic to the local app. Pure: file text in, snapshot out.
//!
//! ```yaml
//! trustDomain: cluster.local
//! services:
//! - name: server
//!   namespace: default
//!   serviceAccount: server
//!   address: 10.66.0.12        # what clients call
//!   port: 8080
//!   protocol: http             # http | tcp
//!   endpoints: ["10.66.0.12:8080"]
//!   timeout: 5s
//!   retries: 2
//! mtls: strict                 # strict | permissive (plaintext accepted too)
//! ```

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Deserialize;
use weir_proto::type_url;

use crate::sidecar::controlplane::{
    Snapshot,
    resources::{self, ChainFilter, ChainSpec},
};

#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("read the services file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("services file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MeshFile {
    #[serde(default = "default_trust_domain")]
    pub trust_domain: String,
    #[serde(default)]
    pub services: Vec<Service>,
    /// Istio's PeerAuthentication mode for inbound traffic.
    #[serde(default)]
    pub mtls: MtlsMode,
}

/// Inbound mutual TLS: STRICT (only Istio mutual TLS), or PERMISSIVE (plaintext too,
/// told apart by the TLS inspector), Istio's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MtlsMode {
    #[default]
    Strict,
    Permissive,
}

fn default_trust_domain() -> String {
    "cluster.local".into()
}

/// One service.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Service {
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// The identity its workloads hold (default: the service's name).
    #[serde(default)]
    pub service_account: Option<String>,
    pub address: IpAddr,
    pub port: u16,
    #[serde(default)]
    pub protocol: Protocol,
    pub endpoints: Vec<SocketAddr>,
    #[serde(default, with = "go_duration")]
    pub timeout: Option<Duration>,
    #[serde(default)]
    pub retries: u32,
}

fn default_namespace() -> String {
    "default".into()
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    #[default]
    Http,
    Tcp,
}

mod go_duration {
    use serde::Deserialize as _;

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<std::time::Duration>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        text.map(|t| {
            crate::support::text::parse_duration(&t).ok_or_else(|| {
                serde::de::Error::custom(format!("timeout {t:?} is not a duration such as 5s"))
            })
        })
        .transpose()
    }
}

/// Requests without a timeout in the file get Istio's default (none: 0 disables).
const DEFAULT_TIMEOUT: Duration = Duration::ZERO;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
pub const PASSTHROUGH: &str = "PassthroughCluster";

impl Service {
    pub fn spiffe_id(&self, trust_domain: &str) -> String {
        let sa = self.service_account.as_deref().unwrap_or(&self.name);
        format!("spiffe://{trust_domain}/ns/{}/sa/{sa}", self.namespace)
    }

    /// Istio's outbound cluster name.
    pub fn outbound_cluster(&self) -> String {
        format!("outbound|{}||{}.{}.svc.cluster.local", self.port, self.name, self.namespace)
    }

    fn inbound_cluster(port: u16) -> String {
        format!("inbound|{port}||")
    }
}

impl MeshFile {
    pub fn load(path: &Path) -> Result<Self, MeshError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| MeshError::Read { path: path.into(), source })?;
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Self, MeshError> {
        let invalid = |message: String| MeshError::Invalid { path: path.into(), message };
        let file: MeshFile = serde_yaml_ng::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let mut seen = std::collections::BTreeSet::new();
        for s in &file.services {
            if s.endpoints.is_empty() {
                return Err(invalid(format!("service {}: no endpoints", s.name)));
            }
            if s.port == 0 {
                return Err(invalid(format!("service {}: port 0", s.name)));
            }
            if !seen.insert((s.address, s.port)) {
                return Err(invalid(format!(
                    "service {}: {}:{} is already another service's",
                    s.name, s.address, s.port
                )));
            }
        }
        Ok(file)
    }

    /// What `workload` (its pod IP) gets, as snapshot `version`.
    pub fn snapshot(&self, workload: Option<IpAddr>, version: &str) -> Snapshot {
        self.snapshot_serving(|ip| Some(ip) == workload, version)
    }

    /// One snapshot for every workload of the file: inbound for each port any service's
    /// endpoint serves (what a control plane serving one config to all proxies sends;
    /// the inbound chains match ports only, so a proxy serving none of them gets
    /// chains it never uses).
    pub fn snapshot_for_all(&self, version: &str) -> Snapshot {
        self.snapshot_serving(|_| true, version)
    }

    fn snapshot_serving(&self, serves: impl Fn(IpAddr) -> bool, version: &str) -> Snapshot {
        let mut clusters =
            vec![(PASSTHROUGH.to_string(), resources::passthrough_cluster(PASSTHROUGH, CONNECT_TIMEOUT))];
        let mut outbound = Vec::new();
        let mut inbound = Vec::new();
        for s in &self.services {
            let cluster = s.outbound_cluster();
            let sans = [s.spiffe_id(&self.trust_domain)];
            let sans: Vec<&str> = sans.iter().map(String::as_str).collect();
            clusters.push((
                cluster.clone(),
                resources::mtls_static_cluster(&cluster, &s.endpoints, CONNECT_TIMEOUT, &sans),
            ));
            let filter = |cluster: String| match s.protocol {
                Protocol::Http => ChainFilter::Http {
                    cluster,
                    timeout: s.timeout.unwrap_or(DEFAULT_TIMEOUT),
                    retries: s.retries,
                },
                Protocol::Tcp => ChainFilter::Tcp { cluster },
            };
            outbound.push(ChainSpec {
                name: cluster.clone(),
                destination_ip: Some(s.address),
                destination_port: Some(s.port),
                filter: filter(cluster.clone()),
                mtls: None,
                transport_protocol: None,
            });
            // This workload serves the service: inbound for each of its endpoint ports here.
            for e in s.endpoints.iter().filter(|e| serves(e.ip())) {
                let local = Service::inbound_cluster(e.port());
                if !clusters.iter().any(|(n, _)| *n == local) {
                    let app = SocketAddr::from(([127, 0, 0, 1], e.port()));
                    clusters
                        .push((local.clone(), resources::static_cluster(&local, &[app], CONNECT_TIMEOUT)));
                    let permissive = self.mtls == MtlsMode::Permissive;
                    inbound.push(ChainSpec {
                        name: local.clone(),
                        destination_ip: None,
                        destination_port: Some(e.port()),
                        filter: filter(local.clone()),
                        mtls: Some(Vec::new()),
                        transport_protocol: permissive.then_some("tls"),
                    });
                    if permissive {
                        inbound.push(ChainSpec {
                            name: format!("{local}-plaintext"),
                            destination_ip: None,
                            destination_port: Some(e.port()),
                            filter: filter(local.clone()),
                            mtls: None,
                            transport_protocol: Some("raw_buffer"),
                        });
                    }
                }
            }
        }
        let mut listeners = vec![(
            "virtualOutbound".to_string(),
            resources::virtual_listener("virtualOutbound", 15001, false, &outbound, Some(PASSTHROUGH)),
        )];
        if !inbound.is_empty() {
            listeners.push((
                "virtualInbound".to_string(),
                resources::virtual_listener("virtualInbound", 15006, true, &inbound, None),
            ));
        }
        let mut snapshot = Snapshot::new();
        snapshot.set(type_url::CLUSTER, version, clusters);
        snapshot.set(type_url::LISTENER, version, listeners);
        snapshot
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;
    use weir_proto::envoy::config::listener::v3::Listener;

    use super::*;

    const FILE: &str = r#"
services:
- name: server
  serviceAccount: server-sa
  address: 10.66.0.12
  port: 8080
  endpoints: ["10.66.0.12:8080"]
  timeout: 5s
  retries: 2
- name: db
  namespace: data
  address: 10.96.0.7
  port: 5432
  protocol: tcp
  endpoints: ["10.66.0.20:5432", "10.66.0.21:5432"]
"#;

    fn listeners(s: &Snapshot) -> Vec<Listener> {
        s.get(type_url::LISTENER)
            .unwrap()
            .resources
            .values()
            .map(|any| Listener::decode(any.value.as_slice()).unwrap())
            .collect()
    }

    #[test]
    fn a_client_gets_outbound_only_and_a_server_gets_inbound_too() {
        let file = MeshFile::parse(Path::new("mesh.yaml"), FILE).unwrap();
        assert_eq!(
            file.services[0].spiffe_id(&file.trust_domain),
            "spiffe://cluster.local/ns/default/sa/server-sa"
        );
        assert_eq!(file.services[1].outbound_cluster(), "outbound|5432||db.data.svc.cluster.local");

        let client = file.snapshot(Some("10.66.0.11".parse().unwrap()), "1");
        let names: Vec<String> = listeners(&client).into_iter().map(|l| l.name).collect();
        assert_eq!(names, ["virtualOutbound"]);
        let out = &listeners(&client)[0];
        assert_eq!(out.filter_chains.len(), 2);
        assert_eq!(out.use_original_dst, Some(true));
        let m = out.filter_chains[0].filter_chain_match.as_ref().unwrap();
        assert_eq!(
            (m.destination_port, m.prefix_ranges[0].address_prefix.as_str()),
            (Some(8080), "10.66.0.12")
        );
        assert!(out.default_filter_chain.is_some(), "unknown destinations pass through");

        let server = file.snapshot(Some("10.66.0.12".parse().unwrap()), "1");
        let inbound = listeners(&server).into_iter().find(|l| l.name == "virtualInbound").unwrap();
        assert_eq!(inbound.filter_chains.len(), 1);
        assert!(inbound.filter_chains[0].transport_socket.is_some(), "mutual TLS terminated inbound");
        let clusters: Vec<String> =
            server.get(type_url::CLUSTER).unwrap().resources.keys().cloned().collect();
        assert!(clusters.contains(&"inbound|8080||".to_string()), "{clusters:?}");
    }

    /// PERMISSIVE (Istio's default): each inbound port takes Istio mutual TLS and
    /// plaintext, told apart by the TLS inspector; one snapshot can serve every workload.
    #[test]
    fn permissive_inbound_takes_mutual_tls_and_plaintext() {
        let file = MeshFile::parse(Path::new("mesh.yaml"), &format!("{FILE}mtls: permissive\n")).unwrap();
        let all = file.snapshot_for_all("1");
        let inbound = listeners(&all).into_iter().find(|l| l.name == "virtualInbound").unwrap();
        let kinds: Vec<(String, bool)> = inbound
            .filter_chains
            .iter()
            .map(|c| {
                (
                    c.filter_chain_match.as_ref().unwrap().transport_protocol.clone(),
                    c.transport_socket.is_some(),
                )
            })
            .collect();
        assert!(
            kinds.contains(&("tls".into(), true)) && kinds.contains(&("raw_buffer".into(), false)),
            "{kinds:?}"
        );
        assert!(inbound.listener_filters.iter().any(|f| f.name == "envoy.filters.listener.tls_inspector"));
        let ports: Vec<Option<u32>> = inbound
            .filter_chains
            .iter()
            .map(|c| c.filter_chain_match.as_ref().unwrap().destination_port)
            .collect();
        assert!(
            ports.contains(&Some(8080)) && ports.contains(&Some(5432)),
            "every endpoint's port: {ports:?}"
        );
    }

    #[test]
    fn bad_files_are_named() {
        let path = Path::new("/etc/weir/mesh.yaml");
        for (text, needle) in [
            ("services: [{name: a, address: 10.0.0.1, port: 80, endpoints: []}]", "no endpoints"),
            (
                "services: [{name: a, address: nope, port: 80, endpoints: ['10.0.0.1:80']}]",
                "services[0].address",
            ),
            (
                "services: [{name: a, address: 10.0.0.1, port: 80, endpoints: ['10.0.0.1:80'], timeout: soon}]",
                "soon",
            ),
            (
                "services: [{name: a, address: 10.0.0.1, port: 80, endpoints: ['10.0.0.1:80'], colour: red}]",
                "colour",
            ),
            (
                "services: [{name: a, address: 10.0.0.1, port: 80, endpoints: ['10.0.0.1:80']}, {name: b, address: 10.0.0.1, port: 80, endpoints: ['10.0.0.2:80']}]",
                "already another service's",
            ),
        ] {
            let e = MeshFile::parse(path, text).unwrap_err().to_string();
            assert!(e.contains("/etc/weir/mesh.yaml") && e.contains(needle), "{text}: {e}");
        }
    }
}
