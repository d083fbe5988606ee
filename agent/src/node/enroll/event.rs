//! The CNI plugin's add event, Istio's `CNIPluginAddEvent`, and how it travels: the
//! plugin POSTs it as JSON to `http://unix/cmdadd` on the node agent's
//! `<cni_agent_run_dir>/pluginevent.sock` (AF_UNIX stream, HTTP/1.1, 5 s in all); the
//! agent answers 200 (captured), 400 (the body is not an event) or 500 (capture failed,
//! the body says why). The JSON is Go's encoding of Istio's struct, so Weir's plugin
//! and agent mix with Istio's: capitalised field names, each address a Go `net.IPNet`
//! (`IP` as text, `Mask` as base64 of its raw bytes), `Gateway` `""` when absent,
//! `Interface` an index or `null`, `IPs` `null` when the plugin had no prevResult.

use std::{net::IpAddr, path::Path, time::Duration};

use base64::Engine as _;
use serde::{Deserialize, Serialize};

/// The event socket's file name in the run dir.
pub const SOCKET_NAME: &str = "pluginevent.sock";
/// The path the plugin posts to.
pub const ADD_PATH: &str = "/cmdadd";
/// The plugin's whole exchange with the agent (Istio's client timeout).
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// Go's `net.IPNet`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoIpNet {
    #[serde(rename = "IP", default)]
    pub ip: String,
    /// Base64 of the mask's bytes (4 for IPv4, 16 for IPv6).
    #[serde(rename = "Mask", default)]
    pub mask: Option<String>,
}

/// One of the pod's addresses, as the primary CNI assigned it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpConfig {
    #[serde(rename = "Interface", default)]
    pub interface: Option<i64>,
    #[serde(rename = "Address")]
    pub address: GoIpNet,
    #[serde(rename = "Gateway", default)]
    pub gateway: Option<String>,
}

/// What the plugin tells the agent about a new ambient pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddEvent {
    #[serde(rename = "Netns")]
    pub netns: String,
    #[serde(rename = "PodName")]
    pub pod_name: String,
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    #[serde(rename = "IPs", default)]
    pub ips: Option<Vec<IpConfig>>,
}

/// Why an event could not be read or delivered.
#[derive(Debug, thiserror::Error)]
pub enum EventError {
    #[error("the CNI add event is not Istio's CNIPluginAddEvent JSON: {0}")]
    Decode(String),
    #[error("connect to the node agent at {path}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("POST {ADD_PATH} to the node agent at {path}: {message}")]
    Exchange { path: String, message: String },
    #[error("POST {ADD_PATH} to the node agent at {path}: no answer within {TIMEOUT:?}")]
    Timeout { path: String },
    #[error("the node agent answered {status}: {body}")]
    Refused { status: u16, body: String },
}

impl AddEvent {
    /// The event for a pod from its CNI `prevResult` (spec 0.3+ `ips[]`: `address` as
    /// CIDR, `gateway`, `interface`); entries that do not parse are left out.
    pub fn new(netns: &str, namespace: &str, name: &str, prev_result: Option<&serde_json::Value>) -> Self {
        let ips = prev_result.map(|prev| {
            prev["ips"].as_array().into_iter().flatten().filter_map(ip_config_from_result).collect()
        });
        Self { netns: netns.into(), pod_name: name.into(), pod_namespace: namespace.into(), ips }
    }

    pub fn parse(body: &[u8]) -> Result<Self, EventError> {
        let event: Self = serde_json::from_slice(body).map_err(|e| EventError::Decode(e.to_string()))?;
        if event.pod_name.is_empty() || event.pod_namespace.is_empty() {
            return Err(EventError::Decode("PodName and PodNamespace are required".into()));
        }
        Ok(event)
    }

    /// The pod's addresses, unmapped (the masks are ignored, as Istio ignores them).
    pub fn addresses(&self) -> Vec<IpAddr> {
        self.ips.iter().flatten().filter_map(|c| c.address.ip.parse::<IpAddr>().ok()).map(unmapped).collect()
    }

    /// POSTs the event to the agent's socket `socket` and waits for its answer (at most
    /// [`TIMEOUT`]). `Ok` only for a 200.
    pub async fn post(&self, socket: &Path) -> Result<(), EventError> {
        let path = socket.display().to_string();
        let exchange = async {
            let stream = tokio::net::UnixStream::connect(socket)
                .await
                .map_err(|source| EventError::Connect { path: path.clone(), source })?;
            let body = serde_json::to_vec(self).map_err(|e| EventError::Decode(e.to_string()))?;
            let request = hyper::Request::post(ADD_PATH)
                .header(hyper::header::HOST, "unix")
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                .map_err(|e| EventError::Exchange { path: path.clone(), message: e.to_string() })?;
            let response = crate::support::http1::exchange(hyper_util::rt::TokioIo::new(stream), request)
                .await
                .map_err(|e| EventError::Exchange { path: path.clone(), message: e.to_string() })?;
            let status = response.status().as_u16();
            use http_body_util::BodyExt as _;
            let body = http_body_util::Limited::new(response.into_body(), 1 << 20)
                .collect()
                .await
                .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                .unwrap_or_default();
            if status == 200 { Ok(()) } else { Err(EventError::Refused { status, body }) }
        };
        tokio::time::timeout(TIMEOUT, exchange)
            .await
            .map_err(|_| EventError::Timeout { path: path.clone() })?
    }
}

/// An address as Istio keeps it: IPv4-mapped IPv6 becomes IPv4.
pub fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// One `prevResult.ips[]` entry as Go's `IPConfig`.
fn ip_config_from_result(entry: &serde_json::Value) -> Option<IpConfig> {
    let (addr, prefix) = entry["address"].as_str()?.split_once('/')?;
    let ip: IpAddr = addr.parse().ok()?;
    let prefix: u32 = prefix.parse().ok()?;
    let bits = if ip.is_ipv4() { 32 } else { 128 };
    if prefix > bits {
        return None;
    }
    let mask: Vec<u8> = (0..bits / 8)
        .map(|byte| {
            let ones = prefix.saturating_sub(byte * 8).min(8);
            (0xff00u16 >> ones) as u8
        })
        .collect();
    Some(IpConfig {
        interface: entry["interface"].as_i64(),
        address: GoIpNet {
            ip: ip.to_string(),
            mask: Some(base64::engine::general_purpose::STANDARD.encode(mask)),
        },
        gateway: Some(entry["gateway"].as_str().unwrap_or_default().to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The brief's example of Go's encoding.
    const GO: &str = r#"{"Netns":"/var/run/netns/cni-6c1a","PodName":"client","PodNamespace":"default","IPs":[{"Interface":0,"Address":{"IP":"10.244.1.5","Mask":"////AA=="},"Gateway":"10.244.1.1"}]}"#;

    #[test]
    fn events_are_gos_encoding_both_ways() {
        let event = AddEvent::parse(GO.as_bytes()).unwrap();
        assert_eq!(event.addresses(), ["10.244.1.5".parse::<IpAddr>().unwrap()]);
        let prev = serde_json::json!({"cniVersion": "1.0.0", "ips": [
            {"interface": 0, "address": "10.244.1.5/24", "gateway": "10.244.1.1"}]});
        let made = AddEvent::new("/var/run/netns/cni-6c1a", "default", "client", Some(&prev));
        assert_eq!(serde_json::to_string(&made).unwrap(), GO);
        let v6 = serde_json::json!({"ips": [{"address": "fd00::5/64"}]});
        let made = AddEvent::new("/n", "d", "p", Some(&v6));
        let json = serde_json::to_value(&made).unwrap();
        assert_eq!(json["IPs"][0]["Address"]["Mask"], "//////////8AAAAAAAAAAA==");
        assert_eq!(json["IPs"][0]["Interface"], serde_json::Value::Null);
        assert_eq!(json["IPs"][0]["Gateway"], "");
        let none = AddEvent::new("/n", "d", "p", None);
        assert_eq!(serde_json::to_value(&none).unwrap()["IPs"], serde_json::Value::Null);
        assert!(AddEvent::parse(br#"{"Netns":"/n","PodName":"p","PodNamespace":"d","IPs":null}"#).is_ok());
    }

    #[test]
    fn mapped_addresses_are_unmapped_and_bad_events_named() {
        let event = AddEvent::parse(
            br#"{"Netns":"","PodName":"p","PodNamespace":"d","IPs":[{"Interface":null,"Address":{"IP":"::ffff:10.0.0.1","Mask":null},"Gateway":""}]}"#,
        )
        .unwrap();
        assert_eq!(event.addresses(), ["10.0.0.1".parse::<IpAddr>().unwrap()]);
        for bad in [&b"{"[..], br#"{"Netns":"/n","PodName":"","PodNamespace":"d"}"#, b"[]"] {
            let e = AddEvent::parse(bad).unwrap_err().to_string();
            assert!(e.contains("CNIPluginAddEvent"), "{e}");
        }
    }
}
