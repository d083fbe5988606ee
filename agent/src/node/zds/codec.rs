//! ZDS messages as bytes: the agent's `WorkloadRequest`s encoded (never over
//! [`MAX_MESSAGE_BYTES`], never a message ztunnel would exit on), and ztunnel's
//! `ZdsHello` and `WorkloadResponse` decoded. Keep and `SnapshotSent` need a
//! [`SnapshotPhase`], which only a connection's snapshot makes and which `SnapshotSent`
//! consumes: neither can be encoded outside the snapshot, nor `SnapshotSent` twice.

use prost::Message as _;
use weir_proto::istio::workload::zds as pb;

use super::{MAX_MESSAGE_BYTES, WorkloadInfo, ZdsError};

/// Proof that a connection's snapshot is being sent (see the module doc).
#[derive(Debug)]
pub(super) struct SnapshotPhase(());

impl SnapshotPhase {
    /// Begins a snapshot: called once per connection, before its updates.
    pub(super) fn begin() -> Self {
        Self(())
    }
}

fn encode(
    message: &'static str,
    uid: &str,
    payload: pb::workload_request::Payload,
) -> Result<Vec<u8>, ZdsError> {
    let bytes = pb::WorkloadRequest { payload: Some(payload) }.encode_to_vec();
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(ZdsError::MessageTooLarge {
            message,
            uid: uid.to_string(),
            size: bytes.len(),
            limit: MAX_MESSAGE_BYTES,
        });
    }
    Ok(bytes)
}

/// `AddWorkload{uid, workload_info}`: `workload_info` is always present (ztunnel exits
/// on an Add without it), even when every field is empty.
pub(super) fn add(uid: &str, info: &WorkloadInfo) -> Result<Vec<u8>, ZdsError> {
    let workload_info = pb::WorkloadInfo {
        name: info.name.clone(),
        namespace: info.namespace.clone(),
        service_account: info.service_account.clone(),
    };
    let add = pb::AddWorkload { uid: uid.to_string(), workload_info: Some(workload_info) };
    encode("Add", uid, pb::workload_request::Payload::Add(add))
}

/// `DelWorkload{uid}` (uid is field 2).
pub(super) fn del(uid: &str) -> Result<Vec<u8>, ZdsError> {
    encode("Del", uid, pb::workload_request::Payload::Del(pb::DelWorkload { uid: uid.to_string() }))
}

/// `KeepWorkload{uid}`: only within a snapshot.
pub(super) fn keep(_phase: &SnapshotPhase, uid: &str) -> Result<Vec<u8>, ZdsError> {
    encode("Keep", uid, pb::workload_request::Payload::Keep(pb::KeepWorkload { uid: uid.to_string() }))
}

/// `SnapshotSent{}`: ends the snapshot, once.
pub(super) fn snapshot_sent(_phase: SnapshotPhase) -> Vec<u8> {
    let payload = pb::workload_request::Payload::SnapshotSent(pb::SnapshotSent {});
    pb::WorkloadRequest { payload: Some(payload) }.encode_to_vec()
}

/// A datagram from ztunnel that is not what the protocol allows.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    #[error("cannot decode ztunnel's {what} ({len} bytes: {hex})")]
    Undecodable { what: &'static str, len: usize, hex: String, source: prost::DecodeError },
    #[error("ztunnel's response has no ack ({len} bytes)")]
    NoAck { len: usize },
}

fn undecodable(what: &'static str, bytes: &[u8], source: prost::DecodeError) -> DecodeError {
    let hex = bytes.iter().take(32).map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ");
    let hex = if bytes.len() > 32 { format!("{hex} ..") } else { hex };
    DecodeError::Undecodable { what, len: bytes.len(), hex, source }
}

/// ztunnel's hello: its version (logged, not checked, as Istio does).
pub(super) fn hello(bytes: &[u8]) -> Result<i32, DecodeError> {
    pb::ZdsHello::decode(bytes).map(|h| h.version).map_err(|e| undecodable("hello", bytes, e))
}

/// ztunnel's answer to one message: `Ok(None)` for an ack, `Ok(Some(error))` for a
/// nack.
pub(super) fn ack(bytes: &[u8]) -> Result<Option<String>, DecodeError> {
    let response = pb::WorkloadResponse::decode(bytes).map_err(|e| undecodable("ack", bytes, e))?;
    match response.payload {
        Some(pb::workload_response::Payload::Ack(ack)) if ack.error.is_empty() => Ok(None),
        Some(pb::workload_response::Payload::Ack(ack)) => Ok(Some(ack.error)),
        None => Err(DecodeError::NoAck { len: bytes.len() }),
    }
}

/// The name of a version ztunnel announced, for the log.
pub(super) fn version_name(version: i32) -> String {
    pb::Version::try_from(version)
        .map(|v| v.as_str_name().to_string())
        .unwrap_or_else(|_| version.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(bytes: &[u8]) -> pb::workload_request::Payload {
        pb::WorkloadRequest::decode(bytes).unwrap().payload.unwrap()
    }

    #[test]
    fn an_add_always_carries_workload_info_even_when_empty() {
        let bytes = add("uid-1", &WorkloadInfo::default()).unwrap();
        let pb::workload_request::Payload::Add(add) = decode(&bytes) else { panic!("not an Add") };
        assert_eq!(add.uid, "uid-1");
        assert_eq!(
            add.workload_info,
            Some(pb::WorkloadInfo::default()),
            "an Add without workload_info kills ztunnel"
        );
    }

    #[test]
    fn messages_have_upstream_field_numbers() {
        // Add: field 1 (uid = field 1, info = field 2); Del: field 2 with uid in field 2;
        // Keep: field 5; SnapshotSent: field 3, empty.
        assert_eq!(del("u").unwrap(), [0x12, 0x03, 0x12, 0x01, b'u']);
        assert_eq!(keep(&SnapshotPhase::begin(), "u").unwrap(), [0x2a, 0x03, 0x0a, 0x01, b'u']);
        assert_eq!(snapshot_sent(SnapshotPhase::begin()), [0x1a, 0x00]);
        let info = WorkloadInfo { name: "n".into(), namespace: "s".into(), service_account: "a".into() };
        assert_eq!(
            add("u", &info).unwrap(),
            [0x0a, 0x0e, 0x0a, 0x01, b'u', 0x12, 0x09, 0x0a, 0x01, b'n', 0x12, 0x01, b's', 0x1a, 0x01, b'a']
        );
    }

    #[test]
    fn the_largest_kubernetes_pod_fits_in_a_datagram() {
        // A 36-character uid, a 253-character name and service account, a 63-character
        // namespace: Kubernetes' limits.
        let uid = "3f9c2b7e-1d4a-4c1b-9e2f-0123456789ab";
        let info = WorkloadInfo {
            name: "n".repeat(253),
            namespace: "s".repeat(63),
            service_account: "a".repeat(253),
        };
        let bytes = add(uid, &info).unwrap();
        assert!(bytes.len() <= MAX_MESSAGE_BYTES, "{} bytes", bytes.len());
    }

    #[test]
    fn a_message_over_1024_bytes_is_refused_naming_its_size() {
        let info = WorkloadInfo { name: "n".repeat(1100), ..WorkloadInfo::default() };
        match add("uid-big", &info) {
            Err(ZdsError::MessageTooLarge { message: "Add", uid, size, limit: 1024 }) => {
                assert_eq!(uid, "uid-big");
                assert!(size > 1100, "{size}");
            }
            other => panic!("expected MessageTooLarge, got {other:?}"),
        }
        // Exactly at the limit passes, one byte more does not.
        let fits = |n: usize| add("u", &WorkloadInfo { name: "n".repeat(n), ..WorkloadInfo::default() });
        let at_limit = (1000..1024).find(|&n| fits(n).is_ok_and(|b| b.len() == MAX_MESSAGE_BYTES)).unwrap();
        assert!(matches!(fits(at_limit + 1), Err(ZdsError::MessageTooLarge { size: 1025, .. })));
    }

    #[test]
    fn acks_nacks_and_bad_responses() {
        let ack_bytes = pb::WorkloadResponse {
            payload: Some(pb::workload_response::Payload::Ack(pb::Ack { error: String::new() })),
        }
        .encode_to_vec();
        assert_eq!(ack_bytes, [0x0a, 0x00], "ztunnel's ack, as seen on the wire");
        assert_eq!(ack(&ack_bytes), Ok(None));
        let nack = pb::WorkloadResponse {
            payload: Some(pb::workload_response::Payload::Ack(pb::Ack {
                error: "failure to start proxy".into(),
            })),
        }
        .encode_to_vec();
        assert_eq!(ack(&nack), Ok(Some("failure to start proxy".to_string())));
        assert_eq!(ack(&[]), Err(DecodeError::NoAck { len: 0 }));
        // Garbage and a message cut short do not decode; the error shows the bytes.
        let e = ack(&[0xff, 0xff, 0xff]).unwrap_err();
        assert!(e.to_string().contains("ack (3 bytes: ff ff ff)"), "{e}");
        let e = ack(&[0x0a, 0x05, 0x0a]).unwrap_err();
        assert!(matches!(e, DecodeError::Undecodable { what: "ack", len: 3, .. }), "{e}");
    }

    #[test]
    fn hello_versions() {
        assert_eq!(hello(&[0x08, 0x01]), Ok(1));
        assert_eq!(version_name(1), "V1");
        assert_eq!(hello(&[]), Ok(0), "a hello with the default version is empty");
        assert_eq!(version_name(7), "7");
        assert!(hello(&[0x08]).is_err());
    }
}
