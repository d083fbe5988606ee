//! The cluster around an injected pod: a mesh, the test istiod in its own pod (xDS and
//! CA on TLS :15012 with a certificate for `istiod.istio-system.svc`, token and
//! `ClusterID` checks), and a node pod whose address is the pod's host IP and from
//! which the kubelet's probes come. Everything the rig reads from the test control
//! plane goes through this file, so a change of its test hooks is adapted here once.

use std::time::Duration;

use weir_agent::sidecar::controlplane::{AdsServer, AuthPolicy, Snapshot};

use crate::{
    Mesh, Pod,
    control_plane::{CLUSTER_ID, ControlPlane, TOKEN, TestCa},
    istiod_ca::IstiodCa,
};

/// The node's name (`spec.nodeName`).
pub const NODE_NAME: &str = "weir-node";

/// What istiod saw of a proxy: the node of its first request.
#[derive(Debug, Clone)]
pub struct SeenNode {
    pub id: String,
    pub cluster: String,
    pub metadata: serde_json::Value,
}

/// A certificate request istiod's CA received.
#[derive(Debug, Clone)]
pub struct SeenCsr {
    pub uri_sans: Vec<String>,
    pub authorization: Option<String>,
}

/// Fields drop in order: control plane, then the pods, then the mesh.
pub struct Cluster {
    cp: ControlPlane,
    ca: IstiodCa,
    /// Signs istiod's serving certificate; its root is the `istio-ca-root-cert`
    /// ConfigMap's `root-cert.pem`.
    pub serving_ca: TestCa,
    pub istiod: Pod,
    pub node: Pod,
    pub mesh: Mesh,
}

impl Cluster {
    /// A mesh named after `test`, istiod serving `snapshot` with a certificate from
    /// `serving_ca` (the mesh root pods trust), and the node.
    pub fn start(test: &str, snapshot: Snapshot, serving_ca: TestCa) -> anyhow::Result<Self> {
        let mesh = Mesh::new(test)?;
        let istiod = mesh.pod("istiod")?;
        let node = mesh.pod("node")?;
        let ca = IstiodCa::new("mesh workload CA", Some(TOKEN))?;
        let ads = AdsServer::new(
            snapshot,
            AuthPolicy { token: Some(TOKEN.into()), cluster_id: Some(CLUSTER_ID.into()) },
        );
        let cp = ControlPlane::istiod(&istiod, &serving_ca, ads)?.with_ca(ca.clone())?;
        Ok(Self { cp, ca, serving_ca, istiod, node, mesh })
    }

    /// The service account token the control plane accepts (the projected token).
    pub fn token(&self) -> &'static str {
        TOKEN
    }

    /// Where istiod listens.
    pub fn istiod_addr(&self) -> std::net::SocketAddr {
        self.cp.addr
    }

    /// The first node istiod saw on any stream, waiting up to `timeout`.
    pub fn first_node(&self, timeout: Duration) -> Option<SeenNode> {
        self.cp.wait_for(timeout, |requests, _| {
            requests.iter().find_map(|r| {
                Some(SeenNode {
                    id: r.node_id.clone()?,
                    cluster: r.node_cluster.clone().unwrap_or_default(),
                    metadata: r.node_metadata.clone().unwrap_or_default(),
                })
            })
        })
    }

    /// Whether a proxy ACKed a response of `type_url` (Delta or SotW).
    pub fn acked(&self, type_url: &str, timeout: Duration) -> bool {
        self.cp
            .wait_for(timeout, |requests, _| {
                requests.iter().any(|r| r.type_url == type_url && r.is_ack()).then_some(())
            })
            .is_some()
    }

    /// Streams refused, with why.
    pub fn refused_streams(&self) -> Vec<String> {
        self.cp.log.streams().into_iter().filter_map(|s| s.refused).collect()
    }

    /// Every certificate request istiod's CA answered or refused.
    pub fn csrs(&self) -> Vec<SeenCsr> {
        self.ca
            .requests()
            .into_iter()
            .map(|r| SeenCsr { uri_sans: r.uri_sans, authorization: r.authorization })
            .collect()
    }
}
