//! Crafted TCP SYNs, as a pod with CAP_NET_RAW can send them: a plain SYN, an IPv6 SYN
//! behind a Hop-by-Hop or Destination Options header, and SYNs split into IP fragments
//! (IPv4: a first fragment of 8 bytes, so the TCP flags are only in the second; IPv6:
//! two fragments behind a Fragment header), and plain SYNs behind two or four VLAN
//! priority tags (VID 0: QinQ the kernel strips one by one). Each is sent as a whole Ethernet frame on
//! an interface (AF_PACKET), and the answer is read off the same interface: a SYN-ACK
//! (something accepted the connection), a RST (nothing listens where it arrived), or
//! nothing (dropped). `weir-testkit syn-probe` runs one from inside a pod.

use std::{
    net::IpAddr,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

/// How the SYN is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Plain,
    /// IPv6 Hop-by-Hop Options header before TCP.
    HopByHop,
    /// IPv6 Destination Options header before TCP.
    DestOptions,
    /// Two IP fragments (IPv4: 8 bytes, then the rest; IPv6: behind a Fragment header).
    Fragments,
    /// A plain SYN behind an 802.1ad and an 802.1Q tag, both VID 0.
    QinQ,
    /// A plain SYN behind four VLAN tags, all VID 0 (the kernel strips the first
    /// before tc sees the frame).
    FourTags,
}

impl Shape {
    /// The VLAN tags (ethertypes, VID 0) in front of the IP header.
    fn tags(self) -> &'static [u16] {
        match self {
            Shape::QinQ => &[0x88a8, 0x8100],
            Shape::FourTags => &[0x88a8, 0x8100, 0x8100, 0x8100],
            _ => &[],
        }
    }
}

impl std::str::FromStr for Shape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "plain" => Ok(Self::Plain),
            "hbh" => Ok(Self::HopByHop),
            "dstopts" => Ok(Self::DestOptions),
            "fragments" => Ok(Self::Fragments),
            "qinq" => Ok(Self::QinQ),
            "vlan4" => Ok(Self::FourTags),
            other => Err(format!("shape {other:?}: expected plain, hbh, dstopts, fragments, qinq or vlan4")),
        }
    }
}

/// What came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    SynAck,
    Rst,
    Nothing,
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Answer::SynAck => "syn-ack",
            Answer::Rst => "rst",
            Answer::Nothing => "nothing",
        })
    }
}

/// One probe: from `src` (this interface's address) port `sport` to `dst`:`dport`,
/// whose interface has the MAC address `dst_mac`.
#[derive(Debug, Clone)]
pub struct Probe {
    pub interface: String,
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub shape: Shape,
}

fn sum16(data: &[u8], mut acc: u32) -> u32 {
    for chunk in data.chunks(2) {
        acc += u32::from(u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]));
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// A SYN with MSS, SACK-permitted and window-scale options (32 bytes), checksummed.
fn tcp_syn(src: IpAddr, dst: IpAddr, sport: u16, dport: u16) -> Vec<u8> {
    let mut tcp = vec![0u8; 32];
    tcp[0..2].copy_from_slice(&sport.to_be_bytes());
    tcp[2..4].copy_from_slice(&dport.to_be_bytes());
    tcp[4..8].copy_from_slice(&0x5745_4952u32.to_be_bytes());
    tcp[12] = 8 << 4;
    tcp[13] = 0x02;
    tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
    tcp[20..32].copy_from_slice(&[2, 4, 0x05, 0xb4, 4, 2, 1, 1, 3, 3, 7, 1]);
    let mut pseudo = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            pseudo.extend(s.octets());
            pseudo.extend(d.octets());
            pseudo.extend([0, 6, 0, 32]);
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            pseudo.extend(s.octets());
            pseudo.extend(d.octets());
            pseudo.extend(32u32.to_be_bytes());
            pseudo.extend([0, 0, 0, 6]);
        }
        _ => panic!("mixed address families"),
    }
    let sum = fold(sum16(&tcp, sum16(&pseudo, 0)));
    tcp[16..18].copy_from_slice(&sum.to_be_bytes());
    tcp
}

fn ipv4(src: [u8; 4], dst: [u8; 4], frag: u16, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&(20 + payload.len() as u16).to_be_bytes());
    h[4..6].copy_from_slice(&0x5745u16.to_be_bytes());
    h[6..8].copy_from_slice(&frag.to_be_bytes());
    h[8] = 64;
    h[9] = 6;
    h[12..16].copy_from_slice(&src);
    h[16..20].copy_from_slice(&dst);
    let sum = fold(sum16(&h, 0));
    h[10..12].copy_from_slice(&sum.to_be_bytes());
    h.extend_from_slice(payload);
    h
}

fn ipv6(src: [u8; 16], dst: [u8; 16], next: u8, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; 40];
    h[0] = 0x60;
    h[4..6].copy_from_slice(&(payload.len() as u16).to_be_bytes());
    h[6] = next;
    h[7] = 64;
    h[8..24].copy_from_slice(&src);
    h[24..40].copy_from_slice(&dst);
    h.extend_from_slice(payload);
    h
}

impl Probe {
    /// The Ethernet frames that carry the SYN.
    pub fn frames(&self) -> Vec<Vec<u8>> {
        let tcp = tcp_syn(self.src, self.dst, self.sport, self.dport);
        let packets: Vec<Vec<u8>> = match (self.src, self.dst, self.shape) {
            (IpAddr::V4(s), IpAddr::V4(d), Shape::Fragments) => vec![
                // More fragments (0x2000), offset 0: ports and sequence number only.
                ipv4(s.octets(), d.octets(), 0x2000, &tcp[..8]),
                ipv4(s.octets(), d.octets(), 1, &tcp[8..]),
            ],
            (IpAddr::V4(s), IpAddr::V4(d), _) => vec![ipv4(s.octets(), d.octets(), 0, &tcp)],
            (IpAddr::V6(s), IpAddr::V6(d), shape) => {
                let (s, d) = (s.octets(), d.octets());
                // Next header TCP, length 0 (8 bytes), PadN of 6.
                let options = |next: u8| [next, 0, 1, 4, 0, 0, 0, 0];
                match shape {
                    Shape::Plain | Shape::QinQ | Shape::FourTags => vec![ipv6(s, d, 6, &tcp)],
                    Shape::HopByHop => vec![ipv6(s, d, 0, &[&options(6)[..], &tcp].concat())],
                    Shape::DestOptions => vec![ipv6(s, d, 60, &[&options(6)[..], &tcp].concat())],
                    Shape::Fragments => {
                        let header = |offset_units: u16, more: bool| {
                            let field = (offset_units << 3) | u16::from(more);
                            let mut h = vec![6, 0];
                            h.extend(field.to_be_bytes());
                            h.extend(0x5745_4952u32.to_be_bytes());
                            h
                        };
                        vec![
                            ipv6(s, d, 44, &[header(0, true), tcp[..24].to_vec()].concat()),
                            ipv6(s, d, 44, &[header(3, false), tcp[24..].to_vec()].concat()),
                        ]
                    }
                }
            }
            _ => panic!("mixed address families"),
        };
        let ethertype: u16 = if self.src.is_ipv4() { 0x0800 } else { 0x86dd };
        // Each tag: its ethertype, then a TCI of 0 (priority 0, VID 0).
        let tags: Vec<u8> =
            self.shape.tags().iter().flat_map(|t| [t.to_be_bytes(), [0, 0]].concat()).collect();
        packets
            .into_iter()
            .map(|p| [&self.dst_mac[..], &self.src_mac[..], &tags, &ethertype.to_be_bytes()[..], &p].concat())
            .collect()
    }

    /// Whether `frame` answers this probe; with which flags.
    fn answer(&self, frame: &[u8]) -> Option<Answer> {
        let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
        let (ip, src, tcp_off) = match ethertype {
            0x0800 => {
                let ip = frame.get(14..)?;
                if *ip.get(9)? != 6 {
                    return None;
                }
                let src: [u8; 4] = ip.get(12..16)?.try_into().ok()?;
                (ip, IpAddr::from(src), usize::from(ip[0] & 0x0f) * 4)
            }
            0x86dd => {
                let ip = frame.get(14..)?;
                if *ip.get(6)? != 6 {
                    return None;
                }
                let src: [u8; 16] = ip.get(8..24)?.try_into().ok()?;
                (ip, IpAddr::from(src), 40)
            }
            _ => return None,
        };
        let tcp = ip.get(tcp_off..tcp_off + 14)?;
        let (sport, dport) = (u16::from_be_bytes([tcp[0], tcp[1]]), u16::from_be_bytes([tcp[2], tcp[3]]));
        if src != self.dst || sport != self.dport || dport != self.sport {
            return None;
        }
        match tcp[13] {
            f if f & 0x12 == 0x12 => Some(Answer::SynAck),
            f if f & 0x04 != 0 => Some(Answer::Rst),
            _ => None,
        }
    }

    /// Sends the frames and waits up to `wait` for the answer.
    pub fn run(&self, wait: Duration) -> std::io::Result<Answer> {
        const ETH_P_ALL: u16 = 0x0003;
        // SAFETY: socket(2) returns a new descriptor or -1.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(ETH_P_ALL.to_be())) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a new descriptor we own.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let name = std::ffi::CString::new(self.interface.as_str()).map_err(std::io::Error::other)?;
        // SAFETY: a NUL-terminated name.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if index == 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: sockaddr_ll is plain data.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = ETH_P_ALL.to_be();
        addr.sll_ifindex = index as i32;
        let len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: binding to a sockaddr_ll of the right size.
        if unsafe { libc::bind(sock.as_raw_fd(), (&raw const addr).cast(), len) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        for frame in self.frames() {
            // SAFETY: sending a buffer we own on a bound packet socket.
            if unsafe { libc::send(sock.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        let deadline = Instant::now() + wait;
        let mut buf = vec![0u8; 65536];
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let timeout = libc::timeval {
                tv_sec: left.as_secs() as i64,
                tv_usec: left.subsec_micros().max(1000) as i64,
            };
            // SAFETY: setting a timeval option on our socket.
            unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    (&raw const timeout).cast(),
                    std::mem::size_of::<libc::timeval>() as libc::socklen_t,
                )
            };
            // SAFETY: receiving into a buffer we own.
            let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) {
                    continue;
                }
                return Err(e);
            }
            if let Some(answer) = self.answer(&buf[..n as usize]) {
                return Ok(answer);
            }
        }
        Ok(Answer::Nothing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(src: &str, dst: &str, shape: Shape) -> Probe {
        Probe {
            interface: "eth0".into(),
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            sport: 40000,
            dport: 8080,
            shape,
        }
    }

    #[test]
    fn frames_have_the_shapes_the_attack_needs() {
        let f = probe("10.0.0.1", "10.0.0.2", Shape::Fragments).frames();
        assert_eq!(f.len(), 2);
        // The first fragment: 20 bytes of IP, 8 of TCP (no flags byte), MF set.
        assert_eq!(f[0].len(), 14 + 20 + 8);
        assert_eq!(u16::from_be_bytes([f[0][14 + 6], f[0][14 + 7]]), 0x2000);
        assert_eq!(u16::from_be_bytes([f[1][14 + 6], f[1][14 + 7]]), 1);
        let plain = probe("10.0.0.1", "10.0.0.2", Shape::Plain).frames();
        // The IPv4 header checksums to zero with its checksum in place.
        assert_eq!(fold(sum16(&plain[0][14..34], 0)), 0);
        let hbh = probe("fd00::1", "fd00::2", Shape::HopByHop).frames();
        assert_eq!((hbh[0][14 + 6], hbh[0][14 + 40]), (0, 6), "HBH, then TCP");
        let frag = probe("fd00::1", "fd00::2", Shape::Fragments).frames();
        assert_eq!(frag.len(), 2);
        assert_eq!(frag[0][14 + 6], 44);
        let qinq = probe("10.0.0.1", "10.0.0.2", Shape::QinQ).frames();
        assert_eq!(&qinq[0][12..22], &[0x88, 0xa8, 0, 0, 0x81, 0, 0, 0, 0x08, 0], "two tags, then IPv4");
        assert_eq!(probe("10.0.0.1", "10.0.0.2", Shape::FourTags).frames()[0].len(), plain[0].len() + 16);
    }

    #[test]
    fn the_tcp_checksum_verifies() {
        for (s, d) in [("10.0.0.1", "10.0.0.2"), ("fd00::1", "fd00::2")] {
            let (s, d): (IpAddr, IpAddr) = (s.parse().unwrap(), d.parse().unwrap());
            let tcp = tcp_syn(s, d, 1, 2);
            let mut pseudo = Vec::new();
            match (s, d) {
                (IpAddr::V4(s), IpAddr::V4(d)) => {
                    pseudo.extend(s.octets());
                    pseudo.extend(d.octets());
                    pseudo.extend([0, 6, 0, 32]);
                }
                (IpAddr::V6(s), IpAddr::V6(d)) => {
                    pseudo.extend(s.octets());
                    pseudo.extend(d.octets());
                    pseudo.extend(32u32.to_be_bytes());
                    pseudo.extend([0, 0, 0, 6]);
                }
                _ => unreachable!(),
            }
            assert_eq!(fold(sum16(&tcp, sum16(&pseudo, 0))), 0);
        }
    }
}
