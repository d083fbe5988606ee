//! A mesh of sandbox pods: one hub namespace with a bridge, and per pod a namespace
//! whose `eth0` is a veth into that bridge, with an IPv4 and an IPv6 address on one
//! shared subnet. The hub has no uplink, so pods reach each other and nothing else.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    process::Command,
    sync::atomic::{AtomicU8, Ordering},
};

use weir_iptables::netlink::Netlink;

use super::{
    NetNs, SandboxError, netns,
    process::{self, Placement, PodChild},
    reap, unique_name,
};

/// The subnet every mesh uses inside its own namespaces: 10.66.0.0/24.
pub const POD_SUBNET_V4: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 66, 0, 0), 24);
/// The IPv6 subnet: fd00:66::/64.
pub const POD_SUBNET_V6: (Ipv6Addr, u8) = (Ipv6Addr::new(0xfd00, 0x66, 0, 0, 0, 0, 0, 0), 64);
const BRIDGE: &str = "br0";
/// First host number handed to a pod (10.66.0.10, fd00:66::a).
const FIRST_HOST: u8 = 10;

/// A hub namespace with a bridge that pods plug into.
#[derive(Debug)]
pub struct Mesh {
    name: String,
    hub: NetNs,
    next: AtomicU8,
}

impl Mesh {
    /// Creates an empty mesh named after `tag` (a test name, "demo"). Sandboxes left by
    /// processes that died without cleaning up are removed first.
    pub fn new(tag: &str) -> Result<Self, SandboxError> {
        if let Err(e) = reap::reap() {
            tracing::warn!(error = %e, "could not reap stale sandboxes");
        }
        let name = unique_name(tag);
        let hub = NetNs::create(&format!("{name}-hub"))?;
        hub.run(|| async {
            let nl = Netlink::open()?;
            nl.set_up("lo").await?;
            nl.add_bridge(BRIDGE).await?;
            nl.set_up(BRIDGE).await?;
            Ok::<_, SandboxError>(())
        })??;
        Ok(Self { name, hub, next: AtomicU8::new(0) })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Adds a pod: a namespace with `lo` and `eth0` up and one address per family.
    pub fn pod(&self, pod_name: &str) -> Result<Pod, SandboxError> {
        let index = self.next.fetch_add(1, Ordering::Relaxed);
        let host = FIRST_HOST.checked_add(index).ok_or_else(|| SandboxError::Sys {
            what: format!("mesh {} is full", self.name),
            source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
        })?;
        let clean: String = pod_name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
            .collect();
        let netns = NetNs::create(&format!("{}-{clean}", self.name))?;
        let ipv4 = Ipv4Addr::new(10, 66, 0, host);
        let ipv6 = Ipv6Addr::new(0xfd00, 0x66, 0, 0, 0, 0, 0, u16::from(host));
        let hub_end = format!("v{index}");
        let pod_fd = netns.raw_fd();
        self.hub.run(|| async {
            let nl = Netlink::open()?;
            nl.add_veth(&hub_end, "eth0", pod_fd).await?;
            nl.set_controller(&hub_end, BRIDGE).await?;
            nl.set_up(&hub_end).await?;
            Ok::<_, SandboxError>(())
        })??;
        netns.run(|| async {
            let nl = Netlink::open()?;
            nl.set_up("lo").await?;
            nl.set_up("eth0").await?;
            nl.add_address("eth0", IpAddr::V4(ipv4), POD_SUBNET_V4.1).await?;
            nl.add_address("eth0", IpAddr::V6(ipv6), POD_SUBNET_V6.1).await?;
            Ok::<_, SandboxError>(())
        })??;
        Ok(Pod { name: pod_name.to_string(), netns, ipv4, ipv6 })
    }
}

/// One sandbox pod. Dropping it kills every process still in its namespace and
/// deletes the namespace (its veth goes with it).
#[derive(Debug)]
pub struct Pod {
    name: String,
    netns: NetNs,
    ipv4: Ipv4Addr,
    ipv6: Ipv6Addr,
}

impl Pod {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn netns(&self) -> &NetNs {
        &self.netns
    }

    pub fn ipv4(&self) -> Ipv4Addr {
        self.ipv4
    }

    pub fn ipv6(&self) -> Ipv6Addr {
        self.ipv6
    }

    /// Runs async code inside the pod on its own thread with a current-thread runtime.
    pub fn run<F, Fut, R>(&self, f: F) -> Result<R, SandboxError>
    where
        F: FnOnce() -> Fut + Send,
        Fut: std::future::Future<Output = R>,
        R: Send,
    {
        self.netns.run(f)
    }

    /// Starts `cmd` inside the pod as `uid` (gid = uid). The process dies with the
    /// spawning thread and with the pod.
    pub fn spawn(&self, cmd: &mut Command, uid: u32) -> Result<PodChild, SandboxError> {
        self.spawn_placed(cmd, Placement { user: Some((uid, uid)), ..Placement::default() })
    }

    /// Starts `cmd` inside the pod with the given cgroup and user.
    pub fn spawn_placed(
        &self,
        cmd: &mut Command,
        placement: Placement<'_>,
    ) -> Result<PodChild, SandboxError> {
        process::spawn(cmd, Placement { netns: Some(&self.netns), die_with_parent: true, ..placement })
    }

    /// Pids of every process whose network namespace is this pod's.
    pub fn processes(&self) -> Vec<u32> {
        reap::processes_in_netns(self.netns.inode())
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        reap::kill_processes_in_netns(self.netns.inode());
        if let Err(e) = netns::remove(self.netns.path()) {
            tracing::warn!(pod = %self.name, error = %e, "could not remove pod namespace");
        }
    }
}
