//! The socket load balancer stand-in from the tests' side: Cilium's kube-proxy
//! replacement in the socket hooks (`bpf/bpf_sock.c`, kernel programs in
//! `tests/lb-standin`), loaded from the object `tests/build.rs` builds, given services
//! (a ClusterIP, NodePort or hostPort frontend → backends, as Cilium's service maps
//! hold them), and attached to a test cgroup in each of the ways Cilium's
//! `pkg/socketlb` (`attachCgroup`) attaches to the cgroup root. The tests make that
//! "root" a cgroup of their own under the cgroup2 mount with the pod's cgroup beneath
//! it; [`SocketLb::attach`] refuses the mount's own root.
//!
//! Dropping a [`SocketLb`] detaches it: links close, program attachments are detached
//! with `BPF_PROG_DETACH` (they outlive their descriptors otherwise).

use std::{
    fs::File,
    net::{IpAddr, SocketAddr},
    os::fd::{AsFd as _, AsRawFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData, PerCpuArray},
    programs::CgroupSockAddr,
};
use weir_agent::capture::ebpf::link::{CgroupLink, attach_type};
use weir_lb_standin::{
    Backend4, Backend6, LbConfig, Service4Key, Service6Key, ServiceValue, counter, flags, map, node, prog,
};

/// The stand-in's object (empty when built with `WEIR_EBPF_STUB=1`).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/weir-lb-standin"));

/// Every hook Cilium attaches for its socket LB with getpeername on (`pkg/socketlb`'s
/// `Enable`: connect, sendmsg, recvmsg and, with the socket-LB peer option,
/// getpeername, for IPv4 and IPv6; its bind hooks are not modelled).
const HOOKS: &[(&str, u32)] = &[
    (prog::RECVMSG4, attach_type::UDP4_RECVMSG),
    (prog::RECVMSG6, attach_type::UDP6_RECVMSG),
    (prog::GETPEERNAME4, attach_type::INET4_GETPEERNAME),
    (prog::GETPEERNAME6, attach_type::INET6_GETPEERNAME),
    (prog::SENDMSG4, attach_type::UDP4_SENDMSG),
    (prog::SENDMSG6, attach_type::UDP6_SENDMSG),
    (prog::CONNECT4, attach_type::INET4_CONNECT),
    (prog::CONNECT6, attach_type::INET6_CONNECT),
];

const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_DETACH: libc::c_long = 9;
/// UAPI attach flags (`include/uapi/linux/bpf.h`).
pub const BPF_F_ALLOW_MULTI: u32 = 1 << 1;
/// Linux 6.15 (upstream 4b82b181a26c): this program runs before its descendants'.
pub const BPF_F_PREORDER: u32 = 1 << 6;

#[derive(Debug, thiserror::Error)]
pub enum SocketLbError {
    #[error(
        "the socket-LB stand-in's object is empty (built with WEIR_EBPF_STUB=1): build the tests without it"
    )]
    Stub,
    #[error("load the socket-LB stand-in's object: {0}")]
    Load(#[source] aya::EbpfError),
    #[error("the stand-in's object has no program {0}")]
    MissingProgram(&'static str),
    #[error("the stand-in's object has no map {0}")]
    MissingMap(&'static str),
    #[error("the verifier refused {program}: {source}")]
    Verify {
        program: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("map {map}: {source}")]
    Map {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("{path}: {why}")]
    Cgroup { path: PathBuf, why: String },
    #[error("attach {program} to {path} ({mode:?}): {source}")]
    Attach {
        program: &'static str,
        path: PathBuf,
        mode: AttachMode,
        #[source]
        source: std::io::Error,
    },
    #[error("service {frontend}: {why}")]
    Service { frontend: SocketAddr, why: &'static str },
}

/// How the stand-in is attached to its cgroup: each way Cilium has, and the one the
/// kernel added since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    /// A bpf_link (`BPF_LINK_CREATE`; links always allow multiple programs): Cilium on
    /// Linux ≥ 5.7 on a fresh install (`attachCgroup`: `link.AttachRawLink`, pinned).
    Link,
    /// `BPF_PROG_ATTACH` without flags: Cilium before Linux 5.7, or a node that an older
    /// Cilium set up so (`attachCgroup` falls back to `link.RawAttachProgram` when the
    /// link is refused with EPERM). The kernel then refuses any program below it.
    Flagless,
    /// `BPF_PROG_ATTACH` with `BPF_F_ALLOW_MULTI | BPF_F_PREORDER` (Linux 6.15): runs
    /// before the programs of the cgroups below. Cilium's `pkg/socketlb` does not use
    /// it; another socket LB, or a future Cilium, could.
    Preorder,
}

/// What a service's frontend is (Cilium's service types, as the socket hooks see them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frontend {
    /// A ClusterIP: this exact address and port.
    ClusterIp(SocketAddr),
    /// A NodePort on every node address (and, from the host's namespace, loopback).
    NodePort { port: u16, v6: bool },
    /// A hostPort; `loopback`: published on a loopback hostIP (answered only for a
    /// loopback destination).
    HostPort { port: u16, v6: bool, loopback: bool },
}

/// Which node an address belongs to (the ipcache identities the wildcard lookups ask
/// for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeAddress {
    Host,
    RemoteNode,
}

/// The load balancer's settings (what Cilium compiles into `bpf_sock.o`).
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// The host's network namespace cookie; `None`: the kernel's initial namespace.
    pub host_netns: Option<u64>,
    /// `socketLB.hostNamespaceOnly`.
    pub host_namespace_only: bool,
    /// The NodePort range (Cilium's default 30000-32767, `--node-port-range`).
    pub nodeport_range: (u16, u16),
}

impl Default for Settings {
    fn default() -> Self {
        Self { host_netns: None, host_namespace_only: false, nodeport_range: (30000, 32767) }
    }
}

/// One hook attached to a cgroup; detached when dropped.
enum Attachment {
    Link(#[allow(dead_code)] CgroupLink),
    Program { cgroup: File, program: OwnedFd, attach_type: u32 },
}

impl Drop for Attachment {
    fn drop(&mut self) {
        if let Attachment::Program { cgroup, program, attach_type } = self {
            let _ = prog_attach_call(BPF_PROG_DETACH, cgroup, program, *attach_type, 0);
        }
    }
}

fn prog_attach_call(
    cmd: libc::c_long,
    cgroup: &File,
    program: &OwnedFd,
    attach_type: u32,
    flags: u32,
) -> std::io::Result<()> {
    // union bpf_attr, prog_attach: target_fd, attach_bpf_fd, attach_type, attach_flags.
    let mut attr = [0u32; 32];
    attr[0] = cgroup.as_raw_fd() as u32;
    attr[1] = program.as_raw_fd() as u32;
    attr[2] = attach_type;
    attr[3] = flags;
    // SAFETY: a zero-initialised bpf_attr large enough for BPF_PROG_(DE)ATTACH.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), std::mem::size_of_val(&attr)) };
    if rc < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// The loaded stand-in: its programs, maps and attachments.
pub struct SocketLb {
    /// Before `ebpf`: detached before the programs' descriptors close.
    attachments: Vec<Attachment>,
    ebpf: Ebpf,
    next_backend: u32,
    next_rev_nat: u16,
}

fn map_err(map: &'static str) -> impl FnOnce(aya::maps::MapError) -> SocketLbError {
    move |source| SocketLbError::Map { map, source }
}

/// `ip` as a `bpf_sock_addr` holds it: network byte order in memory.
fn raw4(ip: std::net::Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

fn raw6(ip: std::net::Ipv6Addr) -> [u32; 4] {
    let o = ip.octets();
    std::array::from_fn(|i| u32::from_ne_bytes([o[i * 4], o[i * 4 + 1], o[i * 4 + 2], o[i * 4 + 3]]))
}

impl SocketLb {
    /// Loads every program (the verifier runs here) and writes `settings`; nothing is
    /// attached yet.
    pub fn load(settings: Settings) -> Result<Self, SocketLbError> {
        if OBJECT.is_empty() {
            return Err(SocketLbError::Stub);
        }
        let mut ebpf = Ebpf::load(OBJECT).map_err(SocketLbError::Load)?;
        for (name, _) in HOOKS {
            let p: &mut CgroupSockAddr = ebpf
                .program_mut(name)
                .ok_or(SocketLbError::MissingProgram(name))?
                .try_into()
                .map_err(|source| SocketLbError::Verify { program: name, source })?;
            p.load().map_err(|source| SocketLbError::Verify { program: name, source })?;
        }
        let mut lb = Self { attachments: Vec::new(), ebpf, next_backend: 1, next_rev_nat: 1 };
        let config = LbConfig {
            host_netns_cookie: settings.host_netns.unwrap_or(0),
            host_namespace_only: u32::from(settings.host_namespace_only),
            nodeport_min: settings.nodeport_range.0,
            nodeport_max: settings.nodeport_range.1,
        };
        let mut array: Array<&mut MapData, LbConfig> =
            Array::try_from(lb.map(map::CONFIG)?).map_err(map_err(map::CONFIG))?;
        array.set(0, config, 0).map_err(map_err(map::CONFIG))?;
        Ok(lb)
    }

    fn map(&mut self, name: &'static str) -> Result<&mut aya::maps::Map, SocketLbError> {
        self.ebpf.map_mut(name).ok_or(SocketLbError::MissingMap(name))
    }

    /// Attaches every hook to `cgroup` (a directory under the cgroup2 mount, never the
    /// mount itself) in `mode`.
    pub fn attach(&mut self, cgroup: &Path, mode: AttachMode) -> Result<(), SocketLbError> {
        let dir = open_test_cgroup(cgroup)?;
        for (name, kind) in HOOKS {
            let attach_err =
                |source| SocketLbError::Attach { program: name, path: cgroup.into(), mode, source };
            let program = self
                .ebpf
                .program(name)
                .ok_or(SocketLbError::MissingProgram(name))?
                .fd()
                .map_err(|source| SocketLbError::Verify { program: name, source })?
                .as_fd()
                .try_clone_to_owned()
                .map_err(attach_err)?;
            let attachment = match mode {
                AttachMode::Link => Attachment::Link(
                    CgroupLink::create(program.as_fd(), dir.as_fd(), *kind).map_err(attach_err)?,
                ),
                AttachMode::Flagless | AttachMode::Preorder => {
                    let flags =
                        if mode == AttachMode::Flagless { 0 } else { BPF_F_ALLOW_MULTI | BPF_F_PREORDER };
                    prog_attach_call(BPF_PROG_ATTACH, &dir, &program, *kind, flags).map_err(attach_err)?;
                    let cgroup = dir.try_clone().map_err(attach_err)?;
                    Attachment::Program { cgroup, program, attach_type: *kind }
                }
            };
            self.attachments.push(attachment);
        }
        Ok(())
    }

    /// Detaches every hook now (as dropping does).
    pub fn detach(&mut self) {
        self.attachments.clear();
    }

    /// Adds a service: its backends (ids), its backend slots, then the service entry
    /// itself, so a lookup never finds a service without its slots.
    pub fn add_service(&mut self, frontend: Frontend, backends: &[SocketAddr]) -> Result<(), SocketLbError> {
        let (address, port, v6, flags) = match frontend {
            Frontend::ClusterIp(a) => (a.ip(), a.port(), a.is_ipv6(), 0),
            Frontend::NodePort { port, v6 } => (unspecified(v6), port, v6, flags::NODEPORT),
            Frontend::HostPort { port, v6, loopback } => {
                (unspecified(v6), port, v6, flags::HOSTPORT | if loopback { flags::LOOPBACK } else { 0 })
            }
        };
        let shown = SocketAddr::new(address, port);
        if backends.iter().any(|b| b.is_ipv6() != v6) {
            return Err(SocketLbError::Service { frontend: shown, why: "backends of another family" });
        }
        let count = u16::try_from(backends.len())
            .map_err(|_| SocketLbError::Service { frontend: shown, why: "more than 65535 backends" })?;
        let rev_nat_index = self.next_rev_nat;
        self.next_rev_nat += 1;
        let mut entries = vec![(0u16, ServiceValue { backend_id: 0, count, rev_nat_index, flags })];
        for (slot, backend) in (1u16..).zip(backends) {
            let id = self.next_backend;
            self.next_backend += 1;
            self.add_backend(id, *backend)?;
            entries.push((slot, ServiceValue { backend_id: id, count: 0, rev_nat_index, flags }));
        }
        // The service entry (slot 0) goes in last.
        entries.rotate_left(1);
        for (slot, value) in entries {
            self.add_slot(address, port, slot, value)?;
        }
        Ok(())
    }

    fn add_backend(&mut self, id: u32, backend: SocketAddr) -> Result<(), SocketLbError> {
        let port = backend.port().to_be();
        match backend.ip() {
            IpAddr::V4(ip) => {
                let mut m: HashMap<_, u32, Backend4> =
                    HashMap::try_from(self.map(map::BACKENDS4)?).map_err(map_err(map::BACKENDS4))?;
                let value = Backend4 { address: raw4(ip), port, pad: 0 };
                m.insert(id, value, 0).map_err(map_err(map::BACKENDS4))
            }
            IpAddr::V6(ip) => {
                let mut m: HashMap<_, u32, Backend6> =
                    HashMap::try_from(self.map(map::BACKENDS6)?).map_err(map_err(map::BACKENDS6))?;
                let value = Backend6 { address: raw6(ip), port, pad: 0 };
                m.insert(id, value, 0).map_err(map_err(map::BACKENDS6))
            }
        }
    }

    fn add_slot(
        &mut self,
        address: IpAddr,
        port: u16,
        slot: u16,
        value: ServiceValue,
    ) -> Result<(), SocketLbError> {
        let dport = port.to_be();
        match address {
            IpAddr::V4(ip) => {
                let mut m: HashMap<_, Service4Key, ServiceValue> =
                    HashMap::try_from(self.map(map::SERVICES4)?).map_err(map_err(map::SERVICES4))?;
                let key = Service4Key { address: raw4(ip), dport, backend_slot: slot };
                m.insert(key, value, 0).map_err(map_err(map::SERVICES4))
            }
            IpAddr::V6(ip) => {
                let mut m: HashMap<_, Service6Key, ServiceValue> =
                    HashMap::try_from(self.map(map::SERVICES6)?).map_err(map_err(map::SERVICES6))?;
                let key = Service6Key { address: raw6(ip), dport, backend_slot: slot };
                m.insert(key, value, 0).map_err(map_err(map::SERVICES6))
            }
        }
    }

    /// Records `ip` as this node's address (or another node's): NodePorts answer on it.
    pub fn add_node_address(&mut self, ip: IpAddr, which: NodeAddress) -> Result<(), SocketLbError> {
        let identity = match which {
            NodeAddress::Host => node::HOST,
            NodeAddress::RemoteNode => node::REMOTE_NODE,
        };
        match ip {
            IpAddr::V4(ip) => {
                let mut m: HashMap<_, u32, u32> =
                    HashMap::try_from(self.map(map::NODE_ADDRS4)?).map_err(map_err(map::NODE_ADDRS4))?;
                m.insert(raw4(ip), identity, 0).map_err(map_err(map::NODE_ADDRS4))
            }
            IpAddr::V6(ip) => {
                let mut m: HashMap<_, [u32; 4], u32> =
                    HashMap::try_from(self.map(map::NODE_ADDRS6)?).map_err(map_err(map::NODE_ADDRS6))?;
                m.insert(raw6(ip), identity, 0).map_err(map_err(map::NODE_ADDRS6))
            }
        }
    }

    /// The counters, summed over CPUs, by name (`weir_lb_standin::counter::NAMES`).
    pub fn counters(&mut self) -> Result<LbCounters, SocketLbError> {
        let m: PerCpuArray<_, u64> =
            PerCpuArray::try_from(self.map(map::COUNTERS)?).map_err(map_err(map::COUNTERS))?;
        let mut out = Vec::new();
        for (slot, name) in (0u32..).zip(counter::NAMES) {
            let values = m.get(&slot, 0).map_err(map_err(map::COUNTERS))?;
            out.push((name, values.iter().sum()));
        }
        Ok(LbCounters(out))
    }
}

fn unspecified(v6: bool) -> IpAddr {
    if v6 { IpAddr::from([0u16; 8]) } else { IpAddr::from([0u8; 4]) }
}

/// Opens `path` for attaching, refusing what is not a cgroup v2 directory below the
/// cgroup2 mount (the mount itself is every process's cgroup).
fn open_test_cgroup(path: &Path) -> Result<File, SocketLbError> {
    let refuse = |why: String| SocketLbError::Cgroup { path: path.into(), why };
    let mount = weir_agent::sandbox::cgroup::cgroup2_mount().map_err(|e| refuse(e.to_string()))?;
    let canonical = path.canonicalize().map_err(|e| refuse(format!("resolve: {e}")))?;
    if canonical == mount || !canonical.starts_with(&mount) {
        return Err(refuse(format!("not a cgroup below the cgroup2 mount {}", mount.display())));
    }
    if !canonical.join("cgroup.procs").exists() {
        return Err(refuse("not a cgroup v2 directory".into()));
    }
    File::open(&canonical).map_err(|e| refuse(format!("open: {e}")))
}

/// Counter values by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LbCounters(pub Vec<(&'static str, u64)>);

impl LbCounters {
    pub fn get(&self, name: &str) -> u64 {
        self.0.iter().find(|(n, _)| *n == name).map_or(0, |(_, v)| *v)
    }
}

/// Whether a testkit client's failure says it found no route to where it connected: a
/// Service address left untranslated (the tests' pods have no route to the Service
/// range).
pub fn unreachable(said: &str) -> bool {
    said.ends_with("connect: Network is unreachable (os error 101)")
}
