//! A pod's spec as kubelet hands it to the runtime, without I/O: the sandbox config
//! (`kuberuntime_sandbox.go`: metadata, hostname, log folder, DNS, port mappings, the
//! QoS cgroup parent, namespaces, security context) and each container's config
//! (`kuberuntime_container.go`: image, command and args with `$(VAR)` expanded, env,
//! mounts with their propagation, log path, security context).

use std::collections::{BTreeMap, HashMap};

use weir_proto::cri::{
    self as cri, Capability, ContainerConfig, ContainerMetadata, DnsConfig, Int64Value, LinuxContainerConfig,
    LinuxContainerSecurityContext, LinuxPodSandboxConfig, LinuxSandboxSecurityContext, Mount,
    MountPropagation, NamespaceMode, NamespaceOption, PodSandboxConfig, PodSandboxMetadata, PortMapping,
    SecurityProfile, security_profile::ProfileType,
};

use crate::inject::manifest::{Container, Manifest, SeccompProfile};

/// The cluster DNS service address kubelet writes into pods' resolv.conf
/// (`--cluster-dns`), and its domain.
pub const CLUSTER_DNS: &str = "10.96.0.10";
pub const CLUSTER_DOMAIN: &str = "cluster.local";

/// The node facts a pod's configs need.
#[derive(Debug, Clone)]
pub struct NodeFacts {
    pub name: String,
    /// The node's kubepods cgroup, relative to the cgroup mounts (`/<...>-kubepods`).
    pub kubepods: String,
    /// Folder for the pods' logs (`/var/log/pods` of the node).
    pub log_root: String,
    /// The node's own resolv.conf servers and searches (for `dnsPolicy: Default`).
    pub resolv_servers: Vec<String>,
    pub resolv_searches: Vec<String>,
}

/// Kubernetes' QoS class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Qos {
    Guaranteed,
    Burstable,
    BestEffort,
}

/// The pod's QoS class (`GetPodQOS`): Guaranteed when every container sets CPU and
/// memory limits equal to its requests, BestEffort when none sets any, else Burstable.
pub fn qos(m: &Manifest) -> Qos {
    let containers: Vec<&Container> = m.spec.init_containers.iter().chain(&m.spec.containers).collect();
    let none = containers.iter().all(|c| c.resources.limits.is_empty() && c.resources.requests.is_empty());
    if none {
        return Qos::BestEffort;
    }
    let guaranteed = containers.iter().all(|c| {
        ["cpu", "memory"].iter().all(|r| {
            let limit = c.resources.limits.get(*r).map(|s| s.0.as_str());
            let request = c.resources.requests.get(*r).map(|s| s.0.as_str()).or(limit);
            limit.is_some() && limit == request
        })
    });
    if guaranteed { Qos::Guaranteed } else { Qos::Burstable }
}

/// The pod's cgroup parent (cgroupfs driver): `<kubepods>/pod<uid>` for Guaranteed,
/// else `<kubepods>/<burstable|besteffort>/pod<uid>`.
pub fn cgroup_parent(node: &NodeFacts, m: &Manifest, uid: &str) -> String {
    match qos(m) {
        Qos::Guaranteed => format!("{}/pod{uid}", node.kubepods),
        Qos::Burstable => format!("{}/burstable/pod{uid}", node.kubepods),
        Qos::BestEffort => format!("{}/besteffort/pod{uid}", node.kubepods),
    }
}

/// The pod's folder of logs, as kubelet names it.
pub fn log_directory(node: &NodeFacts, m: &Manifest, uid: &str) -> String {
    format!("{}/{}_{}_{uid}", node.log_root, m.namespace(), m.name())
}

/// resolv.conf for the pod (`dnsPolicy`, `dnsConfig`).
pub fn dns(node: &NodeFacts, m: &Manifest) -> DnsConfig {
    let policy = m.spec.dns_policy.as_deref().unwrap_or("ClusterFirst");
    let cluster = || DnsConfig {
        servers: vec![CLUSTER_DNS.into()],
        searches: vec![
            format!("{}.svc.{CLUSTER_DOMAIN}", m.namespace()),
            format!("svc.{CLUSTER_DOMAIN}"),
            CLUSTER_DOMAIN.into(),
        ],
        options: vec!["ndots:5".into()],
    };
    let node_dns = || DnsConfig {
        servers: node.resolv_servers.clone(),
        searches: node.resolv_searches.clone(),
        options: vec![],
    };
    let mut out = match policy {
        // ClusterFirst on the host network is the node's resolv.conf.
        "ClusterFirst" if m.spec.host_network => node_dns(),
        "ClusterFirst" | "ClusterFirstWithHostNet" => cluster(),
        "None" => DnsConfig::default(),
        _ => node_dns(),
    };
    if let Some(c) = &m.spec.dns_config {
        out.servers.extend(c.nameservers.iter().cloned());
        out.searches.extend(c.searches.iter().cloned());
        for o in &c.options {
            out.options.retain(|existing| existing.split(':').next() != Some(o.name.as_str()));
            out.options.push(match &o.value {
                Some(v) => format!("{}:{v}", o.name),
                None => o.name.clone(),
            });
        }
    }
    out
}

fn seccomp(profile: Option<&SeccompProfile>) -> Option<SecurityProfile> {
    profile.map(|p| SecurityProfile {
        profile_type: match p.kind.as_str() {
            "Unconfined" => ProfileType::Unconfined,
            "Localhost" => ProfileType::Localhost,
            _ => ProfileType::RuntimeDefault,
        } as i32,
        localhost_ref: p.localhost_profile.clone().unwrap_or_default(),
    })
}

fn namespaces(m: &Manifest) -> NamespaceOption {
    NamespaceOption {
        network: if m.spec.host_network { NamespaceMode::Node } else { NamespaceMode::Pod } as i32,
        pid: if m.spec.host_pid { NamespaceMode::Node } else { NamespaceMode::Container } as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

/// Kubernetes' labels on every sandbox and container.
fn pod_labels(m: &Manifest, uid: &str) -> HashMap<String, String> {
    let mut labels: HashMap<String, String> =
        m.meta.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    labels.insert("io.kubernetes.pod.name".into(), m.name().into());
    labels.insert("io.kubernetes.pod.namespace".into(), m.namespace().into());
    labels.insert("io.kubernetes.pod.uid".into(), uid.into());
    labels
}

/// The sandbox config, attempt `attempt`.
pub fn sandbox(node: &NodeFacts, m: &Manifest, uid: &str, attempt: u32) -> PodSandboxConfig {
    let privileged = m
        .spec
        .init_containers
        .iter()
        .chain(&m.spec.containers)
        .any(|c| c.security_context.as_ref().and_then(|s| s.privileged).unwrap_or(false));
    let port_mappings = m
        .spec
        .containers
        .iter()
        .chain(&m.spec.init_containers)
        .flat_map(|c| &c.ports)
        .filter_map(|p| {
            Some(PortMapping {
                protocol: match p.protocol.as_deref() {
                    Some("UDP") => cri::Protocol::Udp,
                    Some("SCTP") => cri::Protocol::Sctp,
                    _ => cri::Protocol::Tcp,
                } as i32,
                container_port: i32::from(p.container_port),
                host_port: i32::from(p.host_port?),
                host_ip: String::new(),
            })
        })
        .collect();
    let psc = &m.spec.security_context;
    PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: m.name().into(),
            uid: uid.into(),
            namespace: m.namespace().into(),
            attempt,
        }),
        // A sandbox on the node's network must not set a hostname (no UTS namespace).
        hostname: if m.spec.host_network { String::new() } else { m.name().into() },
        log_directory: log_directory(node, m, uid),
        dns_config: Some(dns(node, m)),
        port_mappings,
        labels: pod_labels(m, uid),
        annotations: m.meta.annotations.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        linux: Some(LinuxPodSandboxConfig {
            cgroup_parent: cgroup_parent(node, m, uid),
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(namespaces(m)),
                run_as_user: psc.run_as_user.map(|u| Int64Value { value: i64::from(u) }),
                run_as_group: psc.run_as_group.map(|g| Int64Value { value: i64::from(g) }),
                supplemental_groups: psc
                    .fs_group
                    .into_iter()
                    .chain(psc.supplemental_groups.iter().copied())
                    .map(i64::from)
                    .collect(),
                privileged,
                seccomp: Some(SecurityProfile {
                    profile_type: ProfileType::RuntimeDefault as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One mount of a container: where a volume's folder (on the node) is bound.
#[derive(Debug, Clone)]
pub struct VolumeMountOnNode {
    pub container_path: String,
    pub host_path: String,
    pub read_only: bool,
    pub propagation: Option<String>,
}

/// A container's config, attempt `attempt`: its env and mounts already resolved.
pub fn container(
    m: &Manifest,
    c: &Container,
    uid: &str,
    attempt: u32,
    env: &BTreeMap<String, String>,
    mounts: &[VolumeMountOnNode],
) -> ContainerConfig {
    let (command, args) = crate::inject::env::command_line(c, env);
    let sc = c.security_context.as_ref();
    let psc = &m.spec.security_context;
    let privileged = sc.and_then(|s| s.privileged).unwrap_or(false);
    let (user, group) = (
        sc.and_then(|s| s.run_as_user).or(psc.run_as_user),
        sc.and_then(|s| s.run_as_group).or(psc.run_as_group),
    );
    let capabilities = sc.and_then(|s| s.capabilities.as_ref()).map(|caps| Capability {
        add_capabilities: caps.add.clone(),
        drop_capabilities: caps.drop.clone(),
        add_ambient_capabilities: Vec::new(),
    });
    let mut labels = pod_labels(m, uid);
    labels.insert("io.kubernetes.container.name".into(), c.name.clone());
    ContainerConfig {
        metadata: Some(ContainerMetadata { name: c.name.clone(), attempt }),
        image: Some(cri::ImageSpec { image: c.image.clone().unwrap_or_default(), ..Default::default() }),
        command,
        args,
        working_dir: c.working_dir.clone().unwrap_or_default(),
        envs: env.iter().map(|(k, v)| cri::KeyValue { key: k.clone(), value: v.clone().into() }).collect(),
        mounts: mounts
            .iter()
            .map(|v| Mount {
                container_path: v.container_path.clone(),
                host_path: v.host_path.clone(),
                readonly: v.read_only,
                propagation: match v.propagation.as_deref() {
                    Some("Bidirectional") => MountPropagation::PropagationBidirectional,
                    Some("HostToContainer") => MountPropagation::PropagationHostToContainer,
                    _ => MountPropagation::PropagationPrivate,
                } as i32,
                ..Default::default()
            })
            .collect(),
        labels,
        annotations: HashMap::new(),
        log_path: format!("{}/{attempt}.log", c.name),
        linux: Some(LinuxContainerConfig {
            resources: None,
            security_context: Some(LinuxContainerSecurityContext {
                capabilities,
                privileged,
                namespace_options: Some(namespaces(m)),
                run_as_user: user.map(|u| Int64Value { value: i64::from(u) }),
                run_as_group: group.map(|g| Int64Value { value: i64::from(g) }),
                readonly_rootfs: c.read_only_root(),
                supplemental_groups: psc
                    .fs_group
                    .into_iter()
                    .chain(psc.supplemental_groups.iter().copied())
                    .map(i64::from)
                    .collect(),
                // allowPrivilegeEscalation: false is no_new_privs.
                no_new_privs: sc.and_then(|s| s.allow_privilege_escalation) == Some(false),
                seccomp: seccomp(sc.and_then(|s| s.seccomp_profile.as_ref())).or(Some(SecurityProfile {
                    profile_type: ProfileType::RuntimeDefault as i32,
                    ..Default::default()
                })),
                ..Default::default()
            }),
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeFacts {
        NodeFacts {
            name: "n1".into(),
            kubepods: "/rig-n1-kubepods".into(),
            log_root: "/var/log/pods".into(),
            resolv_servers: vec!["192.168.77.1".into()],
            resolv_searches: vec![],
        }
    }

    fn pod(spec: &str) -> Manifest {
        Manifest::parse(
            "t.yaml",
            &format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: web, namespace: shop}}\nspec:\n{spec}"),
        )
        .unwrap()
    }

    #[test]
    fn a_pod_lands_in_its_qos_cgroup_with_cluster_dns() {
        let p = pod("  containers: [{name: app, image: x}]\n");
        assert_eq!(cgroup_parent(&node(), &p, "u1"), "/rig-n1-kubepods/besteffort/podu1");
        let s = sandbox(&node(), &p, "u1", 0);
        assert_eq!(s.hostname, "web");
        let dns = s.dns_config.unwrap();
        assert_eq!(dns.servers, [CLUSTER_DNS]);
        assert_eq!(dns.searches[0], "shop.svc.cluster.local");
        let ns = s.linux.unwrap().security_context.unwrap().namespace_options.unwrap();
        assert_eq!((ns.network, ns.pid), (NamespaceMode::Pod as i32, NamespaceMode::Container as i32));
        let g =
            pod("  containers: [{name: app, image: x, resources: {limits: {cpu: 100m, memory: 64Mi}}}]\n");
        assert_eq!(qos(&g), Qos::Guaranteed);
        assert_eq!(cgroup_parent(&node(), &g, "u1"), "/rig-n1-kubepods/podu1");
    }

    #[test]
    fn host_network_and_pid_share_the_nodes_namespaces_and_set_no_hostname() {
        let p = pod(
            "  hostNetwork: true\n  hostPID: true\n  containers: [{name: a, image: x, ports: [{containerPort: 15014}]}]\n",
        );
        let s = sandbox(&node(), &p, "u", 0);
        assert_eq!(s.hostname, "");
        assert_eq!(s.dns_config.unwrap().servers, ["192.168.77.1"]);
        let ns = s.linux.unwrap().security_context.unwrap().namespace_options.unwrap();
        assert_eq!((ns.network, ns.pid), (NamespaceMode::Node as i32, NamespaceMode::Node as i32));
    }

    #[test]
    fn a_containers_security_context_and_mounts_reach_the_runtime() {
        let p = pod(concat!(
            "  containers:\n  - name: a\n    image: x\n    args: [\"$(GREETING) world\"]\n",
            "    securityContext: {privileged: false, allowPrivilegeEscalation: false, readOnlyRootFilesystem: true,\n",
            "      capabilities: {drop: [ALL], add: [NET_ADMIN]}, runAsUser: 1337, seccompProfile: {type: RuntimeDefault}}\n",
        ));
        let env = BTreeMap::from([("GREETING".to_string(), "hello".to_string())]);
        let mounts = [VolumeMountOnNode {
            container_path: "/sys/fs/bpf".into(),
            host_path: "/sys/fs/bpf".into(),
            read_only: false,
            propagation: Some("HostToContainer".into()),
        }];
        let c = container(&p, &p.spec.containers[0], "u", 2, &env, &mounts);
        assert_eq!(c.args, ["hello world"]);
        assert_eq!(c.log_path, "a/2.log");
        assert_eq!(c.mounts[0].propagation, MountPropagation::PropagationHostToContainer as i32);
        let sc = c.linux.unwrap().security_context.unwrap();
        assert!(sc.no_new_privs && sc.readonly_rootfs && !sc.privileged);
        assert_eq!(sc.run_as_user.unwrap().value, 1337);
        let caps = sc.capabilities.unwrap();
        assert_eq!(
            (caps.drop_capabilities, caps.add_capabilities),
            (vec!["ALL".into()], vec!["NET_ADMIN".into()])
        );
    }
}
