//! The verbs bootstrap's messages after the set-up preface, sans-IO: queue pair info, the
//! ready byte and the goodbye byte. Built without the `verbs` feature, so the decoder a
//! peer reaches can be tested and fuzzed on any machine; `verbs::bootstrap` runs them on
//! the stream.
//!
//! Each message is a u32 little-endian body length and the body; all integers are
//! little-endian.

use crate::error::{Error, Result};

/// The byte each side sends once its queue pair is in RTS.
pub const READY: u8 = 0x52;
/// The one byte a gracefully closing link writes on the bootstrap socket, just before it
/// shuts the socket: its close marker (an empty SEND behind its last frame) is already
/// acknowledged, so the peer waits for that marker in its completion queue rather than
/// guessing how long its last frames may trail the socket's end. Any other byte after
/// `READY` is a protocol error.
pub const BYE: u8 = 0x42;
/// Bodies are tiny; anything larger is not an Ibex verbs peer.
pub const MAX_BODY: u32 = 4096;

/// The body length announced by a message header, checked against [`MAX_BODY`] before
/// anything is allocated for it.
pub fn body_len(header: [u8; 4]) -> Result<usize> {
    let len = u32::from_le_bytes(header);
    if len > MAX_BODY {
        return Err(Error::Handshake(format!(
            "the peer sent a {len}-byte bootstrap message (at most {MAX_BODY}): it is not an Ibex verbs endpoint (wrong port or protocol?)"
        )));
    }
    Ok(len as usize)
}

/// A message on the wire: header and body.
pub fn frame(body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(4 + body.len());
    m.extend_from_slice(&(body.len() as u32).to_le_bytes());
    m.extend_from_slice(body);
    m
}

/// What the peer needs to connect its queue pair to ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpInfo {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// Port GID.
    pub gid: [u8; 16],
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// `ibv_mtu` value of our port's active MTU.
    pub mtu: u32,
    /// Pre-posted receives on our side.
    pub recv_slots: u32,
    /// Size of each receive slot = the largest frame the peer may send us.
    pub slot_size: u32,
    /// RDMA READs we accept outstanding from the peer (our responder depth).
    pub max_rd_atom: u32,
}

impl QpInfo {
    /// Bytes of an encoded `QpInfo`.
    pub const LEN: usize = 4 + 4 + 16 + 2 + 4 + 4 + 4 + 4;

    /// The message body.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::LEN);
        b.extend_from_slice(&self.qpn.to_le_bytes());
        b.extend_from_slice(&self.psn.to_le_bytes());
        b.extend_from_slice(&self.gid);
        b.extend_from_slice(&self.lid.to_le_bytes());
        b.extend_from_slice(&self.mtu.to_le_bytes());
        b.extend_from_slice(&self.recv_slots.to_le_bytes());
        b.extend_from_slice(&self.slot_size.to_le_bytes());
        b.extend_from_slice(&self.max_rd_atom.to_le_bytes());
        b
    }

    /// Parses and checks a message body.
    pub fn decode(b: &[u8]) -> Result<QpInfo> {
        let Some(b) = b
            .first_chunk::<{ Self::LEN }>()
            .filter(|_| b.len() == Self::LEN)
        else {
            return Err(Error::Handshake(format!(
                "verbs queue pair info has {} bytes, expected {}",
                b.len(),
                Self::LEN
            )));
        };
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[8..24]);
        let info = QpInfo {
            qpn: u32_at(0),
            psn: u32_at(4),
            gid,
            lid: u16::from_le_bytes([b[24], b[25]]),
            mtu: u32_at(26),
            recv_slots: u32_at(30),
            slot_size: u32_at(34),
            max_rd_atom: u32_at(38),
        };
        if !(1..=5).contains(&info.mtu) {
            return Err(Error::Handshake(format!(
                "peer announced an invalid path MTU code {}",
                info.mtu
            )));
        }
        if info.slot_size < 64 || info.recv_slots == 0 || info.qpn == 0 || info.qpn > 0xFF_FFFF {
            return Err(Error::Handshake(format!(
                "peer announced unusable queue pair parameters {info:?}"
            )));
        }
        if info.slot_size as usize > crate::config::MAX_SLOT_SIZE {
            return Err(Error::Handshake(format!(
                "peer announced a {}-byte receive slot; at most {} MiB is supported",
                info.slot_size,
                crate::config::MAX_SLOT_SIZE >> 20
            )));
        }
        Ok(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qp_info_round_trips_and_rejects_garbage() {
        let i = QpInfo {
            qpn: 17,
            psn: 0x12345,
            gid: [7; 16],
            lid: 3,
            mtu: 3,
            recv_slots: 24,
            slot_size: 4096,
            max_rd_atom: 16,
        };
        assert_eq!(QpInfo::decode(&i.encode()).unwrap(), i);
        assert!(QpInfo::decode(&i.encode()[1..]).is_err());
        let bad = QpInfo {
            mtu: 9,
            ..i.clone()
        };
        assert!(QpInfo::decode(&bad.encode()).is_err());
        let bad = QpInfo {
            slot_size: 32 << 20,
            ..i.clone()
        };
        assert!(QpInfo::decode(&bad.encode()).is_err());
        let bad = QpInfo { recv_slots: 0, ..i };
        assert!(QpInfo::decode(&bad.encode()).is_err());
    }

    #[test]
    fn message_lengths_are_bounded_before_allocation() {
        assert_eq!(body_len(42u32.to_le_bytes()).unwrap(), 42);
        let e = body_len(u32::MAX.to_le_bytes()).unwrap_err().to_string();
        assert!(e.contains("not an Ibex verbs endpoint"), "{e}");
        assert_eq!(&frame(b"ab")[..], &[2, 0, 0, 0, b'a', b'b']);
    }
}
