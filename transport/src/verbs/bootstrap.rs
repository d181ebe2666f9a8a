//! The TCP bootstrap: two small messages each way before the queue pairs connect.
//!
//! 1. `Hello` (magic, version, auth token): checked before any device resource is spent on a
//!    peer that is not ours.
//! 2. `QpInfo`: queue pair number, PSN, GID, LID, MTU, receive slots and READ depth.
//! 3. One `READY` byte once the queue pair is in RTS, so neither side sends into a queue
//!    pair that cannot receive yet.
//!
//! Each message is a u32 little-endian length and a body; all integers are little-endian.
//! The socket then stays open and silent: end of file on it means the peer is gone.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"IBXV";
const VERSION: u16 = 1;
const READY: u8 = 0x52;
/// Bodies are tiny; anything larger is not an Ibex verbs peer.
const MAX_BODY: u32 = 4096;
/// Generous because the first transition to RTR can take a second under emulation.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(30);

/// What the peer needs to connect its queue pair to ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QpInfo {
    pub qpn: u32,
    pub psn: u32,
    pub gid: [u8; 16],
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
    const LEN: usize = 4 + 4 + 16 + 2 + 4 + 4 + 4 + 4;

    fn encode(&self) -> Vec<u8> {
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

    fn decode(b: &[u8]) -> Result<QpInfo> {
        if b.len() != Self::LEN {
            return Err(Error::Handshake(format!(
                "verbs queue pair info has {} bytes, expected {}",
                b.len(),
                Self::LEN
            )));
        }
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
        Ok(info)
    }
}

async fn write_msg(s: &mut TcpStream, body: &[u8]) -> Result<()> {
    let mut m = Vec::with_capacity(4 + body.len());
    m.extend_from_slice(&(body.len() as u32).to_le_bytes());
    m.extend_from_slice(body);
    s.write_all(&m)
        .await
        .map_err(|e| Error::io("verbs bootstrap: sending to the peer", e))
}

async fn read_msg(s: &mut TcpStream) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await.map_err(gone)?;
    let len = u32::from_le_bytes(len);
    if len > MAX_BODY {
        return Err(Error::Handshake(format!(
            "the peer sent a {len}-byte bootstrap message: it is not an Ibex verbs endpoint (wrong port or protocol?)"
        )));
    }
    let mut body = vec![0u8; len as usize];
    s.read_exact(&mut body).await.map_err(gone)?;
    Ok(body)
}

fn gone(e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::PeerGone("the peer closed the verbs bootstrap connection during setup (did it reject us? check its log)".into())
    } else {
        Error::io("verbs bootstrap: receiving from the peer", e)
    }
}

/// Exchanges and checks `Hello`. Both sides send first, so neither waits on the other.
pub(crate) async fn hello(s: &mut TcpStream, token: Option<&str>) -> Result<()> {
    let token = token.unwrap_or("");
    let mut b = Vec::with_capacity(8 + token.len());
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&(token.len() as u16).to_le_bytes());
    b.extend_from_slice(token.as_bytes());
    if token.len() > (MAX_BODY as usize - 8) {
        return Err(Error::Config(
            "IBEX_AUTH_TOKEN is too long (at most 4000 bytes)".into(),
        ));
    }
    write_msg(s, &b).await?;
    let p = read_msg(s).await?;
    if p.len() < 8 || &p[..4] != MAGIC {
        return Err(Error::Handshake(
            "the peer is not an Ibex verbs endpoint (bad magic in its hello)".into(),
        ));
    }
    let ver = u16::from_le_bytes([p[4], p[5]]);
    if ver != VERSION {
        return Err(Error::Handshake(format!(
            "verbs bootstrap version mismatch: peer speaks {ver}, we speak {VERSION}; run the same Ibex version on both sides"
        )));
    }
    let tlen = u16::from_le_bytes([p[6], p[7]]) as usize;
    if p.len() != 8 + tlen {
        return Err(Error::Handshake(
            "malformed hello from the peer (token length)".into(),
        ));
    }
    if &p[8..] != token.as_bytes() {
        return Err(Error::Handshake(
            "auth token mismatch: the peer presented a different (or no) token; set the same IBEX_AUTH_TOKEN on both sides".into(),
        ));
    }
    Ok(())
}

/// Sends ours, returns the peer's queue pair info.
pub(crate) async fn exchange_info(s: &mut TcpStream, ours: &QpInfo) -> Result<QpInfo> {
    write_msg(s, &ours.encode()).await?;
    QpInfo::decode(&read_msg(s).await?)
}

/// Tells the peer our queue pair is ready, waits for it to say the same.
pub(crate) async fn ready(s: &mut TcpStream) -> Result<()> {
    s.write_all(&[READY])
        .await
        .map_err(|e| Error::io("verbs bootstrap: sending ready", e))?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await.map_err(gone)?;
    if b[0] != READY {
        return Err(Error::Handshake(format!(
            "expected the peer's ready byte, got {:#x}",
            b[0]
        )));
    }
    Ok(())
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
        let bad = QpInfo { recv_slots: 0, ..i };
        assert!(QpInfo::decode(&bad.encode()).is_err());
    }
}
