//! Weir's small façade over rtnetlink: the few link, address, rule and route operations
//! Weir needs (TPROXY policy routing for capture; veth, bridge and address plumbing for
//! sandbox pods; the node's `iif`/`to` rules and host routes read and set for AWS
//! branch-ENI pods). rtnetlink's API moves quickly, so it is pinned and used only here.
//!
//! A netlink socket belongs to the network namespace of the thread that opened it:
//! open a [`Netlink`] on a thread that has entered the namespace you mean to change.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::RawFd,
};

use futures::TryStreamExt as _;
use netlink_packet_route::{
    address::{AddressAttribute, AddressFlags},
    link::{InfoData, InfoVeth, LinkAttribute},
    route::{RouteAddress, RouteAttribute, RouteMessage, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute},
};
use rtnetlink::{
    Handle, IpVersion, LinkBridge, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder,
};

/// A failed netlink operation, named as `ip` would name it.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("open a netlink socket")]
    Open(#[source] std::io::Error),
    #[error("no network interface named {0:?} in this namespace")]
    NoLink(String),
    #[error("no network interface with index {0} in this namespace")]
    NoLinkIndex(u32),
    #[error("netlink: {op}")]
    Dump {
        op: String,
        #[source]
        source: std::io::Error,
    },
    #[error("netlink: {op}")]
    Op {
        op: String,
        #[source]
        source: rtnetlink::Error,
    },
}

type Result<T> = std::result::Result<T, NetlinkError>;

fn op(op: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetlinkError {
    let op = op.into();
    move |source| NetlinkError::Op { op, source }
}

/// IP family of a rule or route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn flag(self) -> &'static str {
        match self {
            Family::V4 => "-4",
            Family::V6 => "-6",
        }
    }
}

/// A netlink connection in the namespace of the thread that opened it.
pub struct Netlink {
    handle: Handle,
}

impl Netlink {
    /// Opens a socket in the calling thread's network namespace and drives it on the
    /// current Tokio runtime.
    pub fn open() -> Result<Self> {
        let (connection, handle, _) = rtnetlink::new_connection().map_err(NetlinkError::Open)?;
        tokio::spawn(connection);
        Ok(Self { handle })
    }

    /// The interface index of `name`.
    pub async fn link_index(&self, name: &str) -> Result<u32> {
        let mut links = self.handle.link().get().match_name(name.to_string()).execute();
        match links.try_next().await {
            Ok(Some(link)) => Ok(link.header.index),
            Ok(None) => Err(NetlinkError::NoLink(name.to_string())),
            // The kernel answers ENODEV for an unknown name.
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => {
                Err(NetlinkError::NoLink(name.to_string()))
            }
            Err(e) => Err(op(format!("ip link show {name}"))(e)),
        }
    }

    /// `ip link add <name> type bridge`
    pub async fn add_bridge(&self, name: &str) -> Result<()> {
        self.handle
            .link()
            .add(LinkBridge::new(name).build())
            .execute()
            .await
            .map_err(op(format!("ip link add {name} type bridge")))
    }

    /// `ip link add <name> type veth peer name <peer> netns <peer_netns>`: the peer end
    /// is created directly inside the namespace `peer_netns` (an open netns fd).
    pub async fn add_veth(&self, name: &str, peer: &str, peer_netns: RawFd) -> Result<()> {
        let peer_msg =
            LinkMessageBuilder::<LinkUnspec>::new().name(peer.to_string()).setns_by_fd(peer_netns).build();
        let msg = LinkVeth::new(name, peer).set_info_data(InfoData::Veth(InfoVeth::Peer(peer_msg))).build();
        self.handle
            .link()
            .add(msg)
            .execute()
            .await
            .map_err(op(format!("ip link add {name} type veth peer name {peer}")))
    }

    /// `ip link set <name> master <bridge>`
    pub async fn set_controller(&self, name: &str, bridge: &str) -> Result<()> {
        let index = self.link_index(name).await?;
        let bridge_index = self.link_index(bridge).await?;
        let msg = LinkUnspec::new_with_index(index).controller(bridge_index).build();
        self.handle.link().set(msg).execute().await.map_err(op(format!("ip link set {name} master {bridge}")))
    }

    /// `ip link set <name> up`
    pub async fn set_up(&self, name: &str) -> Result<()> {
        let index = self.link_index(name).await?;
        let msg = LinkUnspec::new_with_index(index).up().build();
        self.handle.link().set(msg).execute().await.map_err(op(format!("ip link set {name} up")))
    }

    /// `ip link del <name>`
    pub async fn delete_link(&self, name: &str) -> Result<()> {
        let index = self.link_index(name).await?;
        self.handle.link().del(index).execute().await.map_err(op(format!("ip link del {name}")))
    }

    /// `ip addr add <addr>/<prefix> dev <name> nodad` (no duplicate address detection,
    /// so IPv6 addresses are usable at once).
    pub async fn add_address(&self, name: &str, addr: IpAddr, prefix: u8) -> Result<()> {
        let index = self.link_index(name).await?;
        let mut req = self.handle.address().add(index, addr, prefix);
        if addr.is_ipv6() {
            req.message_mut().attributes.push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        req.execute().await.map_err(op(format!("ip addr add {addr}/{prefix} dev {name}")))
    }

    /// Whether `name` already carries `addr` (any prefix length).
    pub async fn has_address(&self, name: &str, addr: IpAddr) -> Result<bool> {
        let index = self.link_index(name).await?;
        let mut addrs = self.handle.address().get().set_link_index_filter(index).execute();
        while let Some(msg) = addrs.try_next().await.map_err(op(format!("ip addr show dev {name}")))? {
            let found = msg.attributes.iter().any(
                |a| matches!(a, AddressAttribute::Address(a) | AddressAttribute::Local(a) if *a == addr),
            );
            if found {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// `ip addr add <addr>/<prefix> dev <name>`, unless it is there already.
    pub async fn ensure_address(&self, name: &str, addr: IpAddr, prefix: u8) -> Result<()> {
        if self.has_address(name, addr).await? {
            return Ok(());
        }
        self.add_address(name, addr, prefix).await
    }

    /// `ip route add default dev <name>` (scope link): makes every destination
    /// reachable on-link through `name`; used only inside sandbox namespaces.
    pub async fn add_default_route_dev(&self, family: Family, name: &str) -> Result<()> {
        let index = self.link_index(name).await?;
        let msg = match family {
            Family::V4 => RouteMessageBuilder::<Ipv4Addr>::new().output_interface(index).build(),
            Family::V6 => RouteMessageBuilder::<Ipv6Addr>::new().output_interface(index).build(),
        };
        self.handle
            .route()
            .add(msg)
            .execute()
            .await
            .map_err(op(format!("ip {} route add default dev {name}", family.flag())))
    }

    /// Whether `ip rule` has `fwmark <mark> lookup <table>` for `family`.
    pub async fn has_fwmark_rule(&self, family: Family, mark: u32, table: u32) -> Result<bool> {
        let version = match family {
            Family::V4 => IpVersion::V4,
            Family::V6 => IpVersion::V6,
        };
        let mut rules = self.handle.rule().get(version).execute();
        while let Some(rule) =
            rules.try_next().await.map_err(op(format!("ip {} rule show", family.flag())))?
        {
            let has_mark = rule.attributes.contains(&RuleAttribute::FwMark(mark));
            let table_id = rule
                .attributes
                .iter()
                .find_map(|a| match a {
                    RuleAttribute::Table(t) => Some(*t),
                    _ => None,
                })
                .unwrap_or(u32::from(rule.header.table));
            if has_mark && table_id == table && rule.header.action == RuleAction::ToTable {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// `ip rule add fwmark <mark> lookup <table>`, unless it is already there.
    pub async fn ensure_fwmark_rule(&self, family: Family, mark: u32, table: u32) -> Result<()> {
        if self.has_fwmark_rule(family, mark, table).await? {
            return Ok(());
        }
        let req = self.handle.rule().add().fw_mark(mark).table_id(table).action(RuleAction::ToTable);
        let what = format!("ip {} rule add fwmark {mark} lookup {table}", family.flag());
        match family {
            Family::V4 => req.v4().execute().await.map_err(op(what)),
            Family::V6 => req.v6().execute().await.map_err(op(what)),
        }
    }

    /// `ip rule del fwmark <mark> lookup <table>`, for every copy present.
    pub async fn delete_fwmark_rule(&self, family: Family, mark: u32, table: u32) -> Result<()> {
        let version = match family {
            Family::V4 => IpVersion::V4,
            Family::V6 => IpVersion::V6,
        };
        let mut doomed = Vec::new();
        let mut rules = self.handle.rule().get(version).execute();
        while let Some(rule) =
            rules.try_next().await.map_err(op(format!("ip {} rule show", family.flag())))?
        {
            let has_mark = rule.attributes.contains(&RuleAttribute::FwMark(mark));
            let has_table = rule.attributes.contains(&RuleAttribute::Table(table))
                || u32::from(rule.header.table) == table;
            if has_mark && has_table {
                doomed.push(rule);
            }
        }
        for rule in doomed {
            self.handle
                .rule()
                .del(rule)
                .execute()
                .await
                .map_err(op(format!("ip {} rule del fwmark {mark} lookup {table}", family.flag())))?;
        }
        Ok(())
    }

    fn local_default_route(family: Family, table: u32, lo: u32) -> RouteMessage {
        match family {
            Family::V4 => RouteMessageBuilder::<Ipv4Addr>::new()
                .kind(RouteType::Local)
                .scope(RouteScope::Host)
                .table_id(table)
                .output_interface(lo)
                .build(),
            Family::V6 => RouteMessageBuilder::<Ipv6Addr>::new()
                .kind(RouteType::Local)
                .scope(RouteScope::Host)
                .table_id(table)
                .output_interface(lo)
                .build(),
        }
    }

    async fn routes_in_table(&self, family: Family, table: u32) -> Result<Vec<RouteMessage>> {
        let template = match family {
            Family::V4 => RouteMessageBuilder::<Ipv4Addr>::new().table_id(table).build(),
            Family::V6 => RouteMessageBuilder::<Ipv6Addr>::new().table_id(table).build(),
        };
        let routes: Vec<RouteMessage> = self
            .handle
            .route()
            .get(template)
            .execute()
            .try_collect()
            .await
            .map_err(op(format!("ip {} route show table {table}", family.flag())))?;
        Ok(routes.into_iter().filter(|r| route_table(r) == table).collect())
    }

    /// Whether table `table` holds `local default dev lo`.
    pub async fn has_local_default_route(&self, family: Family, table: u32) -> Result<bool> {
        let lo = self.link_index("lo").await?;
        let routes = self.routes_in_table(family, table).await?;
        Ok(routes.iter().any(|r| is_local_default_via(r, lo)))
    }

    /// `ip route add local default dev lo table <table>`, unless it is already there.
    pub async fn ensure_local_default_route(&self, family: Family, table: u32) -> Result<()> {
        if self.has_local_default_route(family, table).await? {
            return Ok(());
        }
        let lo = self.link_index("lo").await?;
        self.handle
            .route()
            .add(Self::local_default_route(family, table, lo))
            .execute()
            .await
            .map_err(op(format!("ip {} route add local default dev lo table {table}", family.flag())))
    }

    /// `ip route del local default dev lo table <table>`, if present.
    pub async fn delete_local_default_route(&self, family: Family, table: u32) -> Result<()> {
        let lo = self.link_index("lo").await?;
        for route in self.routes_in_table(family, table).await? {
            if is_local_default_via(&route, lo) {
                self.handle.route().del(route).execute().await.map_err(op(format!(
                    "ip {} route del local default dev lo table {table}",
                    family.flag()
                )))?;
            }
        }
        Ok(())
    }
}

/// A bpf filter on an interface's tc ingress (`tc filter show dev <name> ingress`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BpfFilter {
    pub priority: u16,
    pub handle: u32,
    /// The program's name, as the kernel reports it (`<object>:[<section>]` or the
    /// function's name).
    pub name: String,
    /// The program's kernel id (0 on kernels that do not report it).
    pub prog_id: u32,
}

/// The bpf filters on `name`'s ingress, in the order the kernel lists them
/// (`tc filter show dev <name> ingress`): one blocking dump on a socket in the calling
/// thread's namespace, no runtime (the CNI plugin registers a pod in about a
/// millisecond; a runtime and its connection task would add a fifth).
pub fn ingress_bpf_filters_blocking(name: &str) -> Result<Vec<BpfFilter>> {
    use netlink_packet_route::{
        RouteNetlinkMessage,
        tc::{TcHandle, TcMessage},
    };
    use rtnetlink::packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkMessage};
    let what = || format!("tc filter show dev {name} ingress");
    let index = nix::net::if_::if_nametoindex(name).map_err(|_| NetlinkError::NoLink(name.to_string()))?;
    let mut request = TcMessage::with_index(index as i32);
    request.header.parent = TcHandle { major: 0xffff, minor: TcHandle::MIN_INGRESS };
    let mut message = NetlinkMessage::from(RouteNetlinkMessage::GetTrafficFilter(request));
    message.header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    message.header.sequence_number = 1;
    message.finalize();
    let mut bytes = vec![0u8; message.buffer_len()];
    message.serialize(&mut bytes);
    // A dump the kernel marks interrupted (the filters changed while it was read) is
    // read again.
    for _ in 0..3 {
        if let Some(filters) = dump_once(&bytes, &what)? {
            return Ok(filters);
        }
    }
    Err(NetlinkError::Dump {
        op: what(),
        source: std::io::Error::other("the dump was interrupted three times (the filters keep changing)"),
    })
}

/// One dump: the filters, or `None` when the kernel says it was interrupted.
fn dump_once(request: &[u8], what: &dyn Fn() -> String) -> Result<Option<Vec<BpfFilter>>> {
    use netlink_packet_route::RouteNetlinkMessage;
    use rtnetlink::packet_core::{NLM_F_DUMP_INTR, NetlinkMessage, NetlinkPayload};
    use rtnetlink::sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
    let io = |source: std::io::Error| NetlinkError::Dump { op: what(), source };
    let invalid = |text: String| io(std::io::Error::new(std::io::ErrorKind::InvalidData, text));
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(NetlinkError::Open)?;
    socket.bind_auto().map_err(NetlinkError::Open)?;
    socket.connect(&SocketAddr::new(0, 0)).map_err(NetlinkError::Open)?;
    socket.send(request, 0).map_err(io)?;
    let mut out = Vec::new();
    let mut interrupted = false;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let len = socket.recv(&mut &mut buf[..], 0).map_err(io)?;
        let mut at = 0;
        while at < len {
            // Each message's length, from its header: a message this crate cannot
            // decode (a filter kind it does not know) is skipped, as the runtime-driven
            // listing skips it, never taken for the end of the dump.
            let size = buf
                .get(at..at + 4)
                .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize)
                .filter(|&n| n >= 16 && at + n <= len)
                .ok_or_else(|| invalid(format!("a truncated netlink message at byte {at} of {len}")))?;
            if let Ok(reply) = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[at..at + size]) {
                interrupted |= reply.header.flags & NLM_F_DUMP_INTR != 0;
                match reply.payload {
                    NetlinkPayload::Done(done) if done.code != 0 => {
                        return Err(io(std::io::Error::from_raw_os_error(-done.code)));
                    }
                    NetlinkPayload::Done(_) => return Ok((!interrupted).then_some(out)),
                    NetlinkPayload::Error(e) => {
                        return Err(NetlinkError::Op {
                            op: what(),
                            source: rtnetlink::Error::NetlinkError(e),
                        });
                    }
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewTrafficFilter(m)) => {
                        out.extend(bpf_filter(&m));
                    }
                    _ => {}
                }
            }
            at += (size + 3) & !3;
        }
    }
}

/// A tc filter's priority, handle and bpf program, when it is a bpf filter with one.
fn bpf_filter(m: &netlink_packet_route::tc::TcMessage) -> Option<BpfFilter> {
    use netlink_packet_route::tc::{TcAttribute, TcFilterBpfOption, TcOption};
    if !m.attributes.iter().any(|a| matches!(a, TcAttribute::Kind(k) if k == "bpf")) {
        return None;
    }
    let mut filter = BpfFilter {
        priority: (m.header.info >> 16) as u16,
        handle: m.header.handle.into(),
        name: String::new(),
        prog_id: 0,
    };
    for option in m
        .attributes
        .iter()
        .filter_map(|a| match a {
            TcAttribute::Options(o) => Some(o),
            _ => None,
        })
        .flatten()
    {
        match option {
            TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => filter.name = n.clone(),
            TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => filter.prog_id = *id,
            _ => {}
        }
    }
    // A dump lists each filter's chain head (no program) too.
    (!filter.name.is_empty() || filter.prog_id != 0).then_some(filter)
}

fn route_table(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(route.header.table))
}

fn is_local_default_via(route: &RouteMessage, lo: u32) -> bool {
    route.header.kind == RouteType::Local
        && route.header.destination_prefix_length == 0
        && route.attributes.contains(&RouteAttribute::Oif(lo))
}

/// A policy routing rule `fwmark <mark>/<mask> pref <priority> lookup <table>` (the
/// ambient in-pod rule; the TPROXY one above has neither mask nor priority).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MarkRule {
    pub mark: u32,
    pub mask: u32,
    pub priority: u32,
    pub table: u32,
}

impl std::fmt::Display for MarkRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fwmark {:#x}/{:#x} pref {} lookup {}", self.mark, self.mask, self.priority, self.table)
    }
}

impl Netlink {
    /// The rules of `family` that are `rule` (mark, mask, priority and table all equal).
    async fn mark_rules(
        &self,
        family: Family,
        rule: MarkRule,
    ) -> Result<Vec<netlink_packet_route::rule::RuleMessage>> {
        let version = match family {
            Family::V4 => IpVersion::V4,
            Family::V6 => IpVersion::V6,
        };
        let mut found = Vec::new();
        let mut rules = self.handle.rule().get(version).execute();
        while let Some(msg) = rules.try_next().await.map_err(op(format!("ip {} rule show", family.flag())))? {
            let attr = |want: RuleAttribute| msg.attributes.contains(&want);
            let table = msg
                .attributes
                .iter()
                .find_map(|a| match a {
                    RuleAttribute::Table(t) => Some(*t),
                    _ => None,
                })
                .unwrap_or(u32::from(msg.header.table));
            if attr(RuleAttribute::FwMark(rule.mark))
                && attr(RuleAttribute::FwMask(rule.mask))
                && attr(RuleAttribute::Priority(rule.priority))
                && table == rule.table
                && msg.header.action == RuleAction::ToTable
            {
                found.push(msg);
            }
        }
        Ok(found)
    }

    /// Whether `ip rule` has `rule` for `family`.
    pub async fn has_mark_rule(&self, family: Family, rule: MarkRule) -> Result<bool> {
        Ok(!self.mark_rules(family, rule).await?.is_empty())
    }

    /// `ip rule add <rule>`, unless it is already there.
    pub async fn ensure_mark_rule(&self, family: Family, rule: MarkRule) -> Result<()> {
        if self.has_mark_rule(family, rule).await? {
            return Ok(());
        }
        let mut req = self
            .handle
            .rule()
            .add()
            .fw_mark(rule.mark)
            .priority(rule.priority)
            .table_id(rule.table)
            .action(RuleAction::ToTable);
        req.message_mut().attributes.push(RuleAttribute::FwMask(rule.mask));
        let what = format!("ip {} rule add {rule}", family.flag());
        match family {
            Family::V4 => req.v4().execute().await.map_err(op(what)),
            Family::V6 => req.v6().execute().await.map_err(op(what)),
        }
    }

    /// `ip rule del <rule>`, every copy present; says whether there was one.
    pub async fn delete_mark_rule(&self, family: Family, rule: MarkRule) -> Result<bool> {
        let doomed = self.mark_rules(family, rule).await?;
        self.delete_rules(family, &rule, doomed).await
    }

    /// Deletes the listed copies of `rule`; says whether there was one.
    async fn delete_rules(
        &self,
        family: Family,
        rule: &dyn std::fmt::Display,
        doomed: Vec<netlink_packet_route::rule::RuleMessage>,
    ) -> Result<bool> {
        let found = !doomed.is_empty();
        for msg in doomed {
            self.handle
                .rule()
                .del(msg)
                .execute()
                .await
                .map_err(op(format!("ip {} rule del {rule}", family.flag())))?;
        }
        Ok(found)
    }
}

/// A policy routing rule `[to <addr>/<len>] [iif <dev>] pref <priority> lookup <table>`
/// (the host-side rules Istio's node agent adds for AWS branch-ENI pods, and the `iif`
/// rules aws-vpc-cni adds for them). Listed, it shows only these selectors of a rule;
/// looked for or deleted, it matches a rule with exactly these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyRule {
    pub priority: u32,
    pub table: u32,
    /// `iif <dev>`: packets that came in on `dev`.
    pub iif: Option<String>,
    /// `to <addr>/<len>`: packets to that prefix.
    pub to: Option<(IpAddr, u8)>,
}

impl std::fmt::Display for PolicyRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some((addr, len)) = self.to {
            write!(f, "to {addr}/{len} ")?;
        }
        if let Some(dev) = &self.iif {
            write!(f, "iif {dev} ")?;
        }
        write!(f, "pref {} lookup {}", self.priority, self.table)
    }
}

/// A route to one address (`/32` or `/128`) in any table, and the interface it leaves
/// by (`None`: a multipath route, or one without a device).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRoute {
    pub table: u32,
    pub destination: IpAddr,
    pub oif: Option<u32>,
}

/// `msg` as a [`PolicyRule`] when it is a `lookup` rule, and whether it has selectors
/// a [`PolicyRule`] does not show (`from`, `fwmark`, `oif`, ports, ...).
fn policy_rule(msg: &netlink_packet_route::rule::RuleMessage) -> Option<(PolicyRule, bool)> {
    if msg.header.action != RuleAction::ToTable {
        return None;
    }
    let mut rule = PolicyRule { priority: 0, table: u32::from(msg.header.table), iif: None, to: None };
    let mut other = msg.header.src_len != 0 || msg.header.tos != 0;
    for attr in &msg.attributes {
        match attr {
            RuleAttribute::Priority(p) => rule.priority = *p,
            RuleAttribute::Table(t) => rule.table = *t,
            RuleAttribute::Iifname(dev) => rule.iif = Some(dev.clone()),
            RuleAttribute::Destination(addr) => rule.to = Some((*addr, msg.header.dst_len)),
            // The kernel lists these on every rule; only a value set is a selector.
            RuleAttribute::FwMark(0) | RuleAttribute::FwMask(0) | RuleAttribute::TunId(0) => {}
            RuleAttribute::SuppressPrefixLen(u32::MAX) | RuleAttribute::SuppressIfGroup(u32::MAX) => {}
            RuleAttribute::Source(_)
            | RuleAttribute::FwMark(_)
            | RuleAttribute::FwMask(_)
            | RuleAttribute::TunId(_)
            | RuleAttribute::SuppressPrefixLen(_)
            | RuleAttribute::SuppressIfGroup(_)
            | RuleAttribute::Oifname(_)
            | RuleAttribute::Goto(_)
            | RuleAttribute::Realm(_)
            | RuleAttribute::UidRange(_)
            | RuleAttribute::IpProtocol(_)
            | RuleAttribute::SourcePortRange(_)
            | RuleAttribute::DestinationPortRange(_) => other = true,
            // Who added it (protocol), and what this crate cannot read.
            _ => {}
        }
    }
    Some((rule, other))
}

impl Netlink {
    /// `ip rule show` for `family`: its `lookup` rules, in the kernel's order.
    pub async fn policy_rules(&self, family: Family) -> Result<Vec<PolicyRule>> {
        Ok(self.rule_messages(family).await?.iter().filter_map(policy_rule).map(|(r, _)| r).collect())
    }

    async fn rule_messages(&self, family: Family) -> Result<Vec<netlink_packet_route::rule::RuleMessage>> {
        let version = match family {
            Family::V4 => IpVersion::V4,
            Family::V6 => IpVersion::V6,
        };
        self.handle
            .rule()
            .get(version)
            .execute()
            .try_collect()
            .await
            .map_err(op(format!("ip {} rule show", family.flag())))
    }

    /// The rules of `family` that are exactly `rule`.
    async fn exact_rules(
        &self,
        family: Family,
        rule: &PolicyRule,
    ) -> Result<Vec<netlink_packet_route::rule::RuleMessage>> {
        let mut found = self.rule_messages(family).await?;
        found.retain(|msg| policy_rule(msg).is_some_and(|(r, other)| !other && r == *rule));
        Ok(found)
    }

    /// `ip rule add <rule>`, unless it is already there; says whether it was added.
    pub async fn ensure_policy_rule(&self, family: Family, rule: &PolicyRule) -> Result<bool> {
        if !self.exact_rules(family, rule).await?.is_empty() {
            return Ok(false);
        }
        let mut req =
            self.handle.rule().add().priority(rule.priority).table_id(rule.table).action(RuleAction::ToTable);
        if let Some(dev) = &rule.iif {
            req = req.input_interface(dev.clone());
        }
        if let Some((addr, len)) = rule.to {
            req.message_mut().header.dst_len = len;
            req.message_mut().attributes.push(RuleAttribute::Destination(addr));
        }
        let added = match family {
            Family::V4 => req.v4().execute().await,
            Family::V6 => req.v6().execute().await,
        };
        match added {
            Ok(()) => Ok(true),
            // Added meanwhile (the kernel compares every selector, as the check above).
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::EEXIST => Ok(false),
            Err(e) => Err(op(format!("ip {} rule add {rule}", family.flag()))(e)),
        }
    }

    /// `ip rule del <rule>`, every copy present; says whether there was one.
    pub async fn delete_policy_rule(&self, family: Family, rule: &PolicyRule) -> Result<bool> {
        let doomed = self.exact_rules(family, rule).await?;
        self.delete_rules(family, rule, doomed).await
    }

    /// `ip route show table all` for `family`, routes to one address only.
    pub async fn host_routes(&self, family: Family) -> Result<Vec<HostRoute>> {
        let (template, full) = match family {
            Family::V4 => (RouteMessageBuilder::<Ipv4Addr>::new().table_id(0).build(), 32),
            Family::V6 => (RouteMessageBuilder::<Ipv6Addr>::new().table_id(0).build(), 128),
        };
        let routes: Vec<RouteMessage> = self
            .handle
            .route()
            .get(template)
            .execute()
            .try_collect()
            .await
            .map_err(op(format!("ip {} route show table all", family.flag())))?;
        Ok(routes
            .iter()
            .filter(|r| r.header.destination_prefix_length == full)
            .filter_map(|r| {
                let destination = r.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Destination(RouteAddress::Inet(a)) => Some(IpAddr::V4(*a)),
                    RouteAttribute::Destination(RouteAddress::Inet6(a)) => Some(IpAddr::V6(*a)),
                    _ => None,
                })?;
                let oif = r.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Oif(i) => Some(*i),
                    _ => None,
                });
                Some(HostRoute { table: route_table(r), destination, oif })
            })
            .collect())
    }

    /// The name of the interface with index `index`.
    pub async fn link_name(&self, index: u32) -> Result<String> {
        let mut links = self.handle.link().get().match_index(index).execute();
        let gone = || NetlinkError::NoLinkIndex(index);
        match links.try_next().await {
            Ok(Some(link)) => link
                .attributes
                .into_iter()
                .find_map(|a| match a {
                    LinkAttribute::IfName(name) => Some(name),
                    _ => None,
                })
                .ok_or_else(gone),
            Ok(None) => Err(gone()),
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Err(gone()),
            Err(e) => Err(op(format!("ip link show index {index}"))(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use netlink_packet_route::rule::RuleMessage;

    use super::*;

    fn listed(attributes: Vec<RuleAttribute>) -> RuleMessage {
        let mut msg = RuleMessage::default();
        msg.header.action = RuleAction::ToTable;
        msg.header.dst_len = 32;
        msg.attributes = attributes;
        msg
    }

    #[test]
    fn a_listed_rule_with_the_kernels_default_attributes_is_exactly_its_selectors() {
        let pod: IpAddr = "10.0.1.7".parse().unwrap();
        // What the kernel lists for `ip rule add to 10.0.1.7 lookup 101 pref 512`.
        let kernel = listed(vec![
            RuleAttribute::Table(101),
            RuleAttribute::SuppressPrefixLen(u32::MAX),
            RuleAttribute::Priority(512),
            RuleAttribute::Destination(pod),
        ]);
        let want = PolicyRule { priority: 512, table: 101, iif: None, to: Some((pod, 32)) };
        assert_eq!(policy_rule(&kernel), Some((want.clone(), false)));
        assert_eq!(want.to_string(), "to 10.0.1.7/32 pref 512 lookup 101");
        let marked = listed(vec![
            RuleAttribute::Priority(512),
            RuleAttribute::Destination(pod),
            RuleAttribute::FwMark(1),
        ]);
        assert_eq!(policy_rule(&marked).map(|(_, other)| other), Some(true), "fwmark is another selector");
    }
}
