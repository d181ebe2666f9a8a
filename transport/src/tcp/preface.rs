//! The setup exchange: each side writes its preface, then reads and checks the peer's.
//!
//! Layout: `magic "IBEXTCP\0"`, `version u16`, `slot_size u32` (the sender's eager slot size,
//! i.e. the largest frame it accepts), `token_len u16`, `token` (little-endian). Both sides
//! write before reading; a preface is far smaller than any socket buffer, so this cannot
//! deadlock. The token travels in clear text: TCP here is unencrypted, so the token keeps
//! strangers and misrouted jobs out of a trusted network, not eavesdroppers.

use bytes::BufMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::config::Config;
use crate::error::{Error, Result};

/// First bytes on every Ibex tcp stream.
pub const MAGIC: &[u8; 8] = b"IBEXTCP\0";
/// Version of the record format spoken after the preface.
pub const VERSION: u16 = 1;
const FIXED_AFTER_MAGIC: usize = 2 + 4 + 2;
const MAX_TOKEN: usize = 1024;
/// Same bounds as `Config::validate`, so a peer cannot make us accept absurd frames.
const MIN_SLOT: u32 = 1024;
const MAX_SLOT: u32 = 16 << 20;

/// What the peer told us about itself.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PeerPreface {
    /// The largest frame the peer accepts.
    pub slot_size: usize,
}

/// Runs the exchange on a fresh stream; `peer` names the other end in errors.
pub(crate) async fn exchange(
    stream: &mut TcpStream,
    config: &Config,
    peer: &str,
) -> Result<PeerPreface> {
    let token = config.auth_token.as_deref().unwrap_or("").as_bytes();
    if token.len() > MAX_TOKEN {
        return Err(Error::Config(format!(
            "IBEX_AUTH_TOKEN is {} bytes; at most {MAX_TOKEN} are allowed",
            token.len()
        )));
    }
    let slot = u32::try_from(config.slot_size).map_err(|_| {
        Error::Config(format!(
            "slot_size {} does not fit the tcp preface",
            config.slot_size
        ))
    })?;
    let mut out = Vec::with_capacity(MAGIC.len() + FIXED_AFTER_MAGIC + token.len());
    out.put_slice(MAGIC);
    out.put_u16_le(VERSION);
    out.put_u32_le(slot);
    out.put_u16_le(token.len() as u16);
    out.put_slice(token);
    stream.write_all(&out).await.map_err(|e| io_err(peer, e))?;

    let mut magic = [0u8; 8];
    stream
        .read_exact(&mut magic)
        .await
        .map_err(|e| io_err(peer, e))?;
    if &magic != MAGIC {
        return Err(Error::Handshake(format!(
            "peer at {peer} is not an Ibex tcp endpoint (it sent {:?} instead of {:?}); check the address and port",
            magic.escape_ascii().to_string(),
            MAGIC.escape_ascii().to_string()
        )));
    }
    let mut fixed = [0u8; FIXED_AFTER_MAGIC];
    stream
        .read_exact(&mut fixed)
        .await
        .map_err(|e| io_err(peer, e))?;
    let version = u16::from_le_bytes([fixed[0], fixed[1]]);
    if version != VERSION {
        return Err(Error::Handshake(format!(
            "peer at {peer} speaks Ibex tcp version {version}, we speak {VERSION}; run the same Ibex release on both sides"
        )));
    }
    let peer_slot = u32::from_le_bytes([fixed[2], fixed[3], fixed[4], fixed[5]]);
    if !(MIN_SLOT..=MAX_SLOT).contains(&peer_slot) {
        return Err(Error::Handshake(format!(
            "peer at {peer} announced a slot size of {peer_slot} bytes, outside {MIN_SLOT}..={MAX_SLOT}"
        )));
    }
    let token_len = u16::from_le_bytes([fixed[6], fixed[7]]) as usize;
    if token_len > MAX_TOKEN {
        return Err(Error::Handshake(format!(
            "peer at {peer} sent an auth token of {token_len} bytes; at most {MAX_TOKEN} are allowed"
        )));
    }
    let mut theirs = vec![0u8; token_len];
    stream
        .read_exact(&mut theirs)
        .await
        .map_err(|e| io_err(peer, e))?;

    // An empty token counts as none, the same as IBEX_AUTH_TOKEN="" does.
    let ours_set = !token.is_empty();
    let theirs_set = token_len > 0;
    if (ours_set || theirs_set) && !(ours_set && theirs_set && ct_eq(token, &theirs)) {
        let why = match (ours_set, theirs_set) {
            (true, false) => "we require a token and the peer sent none",
            (false, true) => "the peer presented a token and we have none",
            _ => "the tokens differ",
        };
        return Err(Error::Handshake(format!(
            "authentication with peer at {peer} failed ({why}); set the same IBEX_AUTH_TOKEN on both sides"
        )));
    }
    Ok(PeerPreface {
        slot_size: peer_slot as usize,
    })
}

fn io_err(peer: &str, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::Handshake(format!(
            "peer at {peer} closed the connection during setup (it may have refused our version or auth token; see its log)"
        ))
    } else {
        Error::io(format!("tcp setup with {peer}"), e)
    }
}

/// Equality whose running time depends only on the lengths, so a remote guesser learns
/// nothing from timing about how much of a token was right.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::ct_eq;

    #[test]
    fn constant_time_compare_is_equality() {
        assert!(ct_eq(b"secret", b"secret"));
        assert!(!ct_eq(b"secret", b"secreT"));
        assert!(!ct_eq(b"secret", b"secret2"));
        assert!(ct_eq(b"", b""));
    }
}
