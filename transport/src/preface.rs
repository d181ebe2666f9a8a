//! The set-up preface: the first bytes each side of every provider sends (shm over its Unix
//! socket, tcp on its stream, verbs on its bootstrap stream), and the checks on the peer's.
//!
//! Layout, little-endian:
//!
//! ```text
//! magic [u8; 8]  "IBEXSHM\0" | "IBEXTCP\0" | "IBEXVRB\0"  (names the provider, so a peer
//!                                                          on the wrong port is told which)
//! version u16    2 (version 1 was a preface of each provider's own)
//! slot_size u32  the sender's eager slot size: the largest frame it accepts
//! features u32   optional features the sender speaks (FEATURE_*); bits a side does not
//!                know are ignored, so later ones can be added compatibly
//! token_len u16  at most MAX_TOKEN
//! ext_len u16    at most MAX_EXT: the provider's own bytes (shm: its segment sizes)
//! token, ext
//! ```
//!
//! Both sides write before reading: a preface is far smaller than any socket buffer, so
//! this cannot deadlock. Every length is checked before it is used, so a peer can make us
//! read at most `FIXED_LEN + MAX_TOKEN + MAX_EXT` bytes. The token is compared in constant
//! time and travels in clear (no provider encrypts): it keeps strangers and misrouted jobs
//! out of a trusted network, not eavesdroppers.
//!
//! The codec is sans-IO ([`Preface::encode`], [`decode_header`], [`decode_rest`],
//! [`authenticate`]); [`exchange`] runs it on a stream.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::config::Config;
use crate::error::{Error, Result};

/// Which provider a preface opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// Shared memory over a Unix socket.
    Shm,
    /// A TCP stream.
    Tcp,
    /// RDMA verbs (the TCP bootstrap stream).
    Verbs,
}

impl Provider {
    const ALL: [Provider; 3] = [Provider::Shm, Provider::Tcp, Provider::Verbs];

    /// The magic that opens this provider's preface.
    pub fn magic(self) -> &'static [u8; 8] {
        match self {
            Provider::Shm => b"IBEXSHM\0",
            Provider::Tcp => b"IBEXTCP\0",
            Provider::Verbs => b"IBEXVRB\0",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Provider::Shm => "shm",
            Provider::Tcp => "tcp",
            Provider::Verbs => "verbs",
        }
    }
}

/// tcp: the sender takes pushed regions (`tcp::wire::T_PUSH`), so its peer may send a
/// message body right behind the RTS that announces it instead of waiting to be asked.
pub const FEATURE_TCP_PUSH: u32 = 1;

/// Version of the preface (and of what each provider speaks after it).
pub const VERSION: u16 = 2;
/// Bytes before the token and the provider's bytes.
pub const FIXED_LEN: usize = 8 + 2 + 4 + 4 + 2 + 2;
/// Longest auth token either side may present.
pub const MAX_TOKEN: usize = 1024;
/// Most provider bytes a preface may carry.
pub const MAX_EXT: usize = 1024;
/// Slot sizes a peer may announce: the bounds of `Config::validate`, so no peer can make us
/// accept absurd frames.
const MIN_SLOT: u32 = crate::config::MIN_SLOT_SIZE as u32;
const MAX_SLOT: u32 = crate::config::MAX_SLOT_SIZE as u32;

/// One side's preface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preface {
    /// The sender's eager slot size.
    pub slot_size: u32,
    /// Optional features the sender speaks.
    pub features: u32,
    /// The auth token; empty means none.
    pub token: Vec<u8>,
    /// The provider's own bytes.
    pub ext: Vec<u8>,
}

/// The fixed part of a peer's preface, checked: how much follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    slot_size: u32,
    features: u32,
    token_len: usize,
    ext_len: usize,
}

impl Header {
    /// Bytes of token and provider bytes that follow the fixed part.
    pub fn rest_len(&self) -> usize {
        self.token_len + self.ext_len
    }
}

impl Preface {
    /// This side's preface from `config`, carrying the provider's `ext` bytes.
    pub fn ours(config: &Config, ext: Vec<u8>) -> Result<Preface> {
        let token = config
            .auth_token
            .as_deref()
            .unwrap_or("")
            .as_bytes()
            .to_vec();
        if token.len() > MAX_TOKEN {
            return Err(Error::Config(format!(
                "IBEX_AUTH_TOKEN is {} bytes; at most {MAX_TOKEN} are allowed",
                token.len()
            )));
        }
        if ext.len() > MAX_EXT {
            return Err(Error::Config(format!(
                "the provider's preface bytes ({}) exceed {MAX_EXT}",
                ext.len()
            )));
        }
        let slot_size = u32::try_from(config.slot_size)
            .ok()
            .filter(|s| (MIN_SLOT..=MAX_SLOT).contains(s))
            .ok_or_else(|| {
                Error::Config(format!(
                    "slot_size {} must be within 1 KiB..=16 MiB",
                    config.slot_size
                ))
            })?;
        Ok(Preface {
            slot_size,
            features: 0,
            token,
            ext,
        })
    }

    /// The bytes on the wire.
    pub fn encode(&self, provider: Provider) -> Vec<u8> {
        let mut b = Vec::with_capacity(FIXED_LEN + self.token.len() + self.ext.len());
        b.extend_from_slice(provider.magic());
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&self.slot_size.to_le_bytes());
        b.extend_from_slice(&self.features.to_le_bytes());
        b.extend_from_slice(&(self.token.len() as u16).to_le_bytes());
        b.extend_from_slice(&(self.ext.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.token);
        b.extend_from_slice(&self.ext);
        b
    }
}

/// Checks the fixed part of the preface `peer` sent (`peer` names it in errors, e.g.
/// "peer at 10.0.0.2:7000").
pub fn decode_header(provider: Provider, b: &[u8; FIXED_LEN], peer: &str) -> Result<Header> {
    let magic: &[u8] = &b[..8];
    if crate::tls::looks_like_tls(magic) {
        return Err(Error::Handshake(format!(
            "{peer} speaks TLS (it opened with a TLS ClientHello), but this side speaks plain Ibex {}: configure this listener with tls (Config::tls = Tls::server, or Server::builder().tls_config) or the client without",
            provider.name()
        )));
    }
    if magic != provider.magic() {
        let why = match Provider::ALL.iter().find(|p| p.magic() == magic) {
            Some(other) => format!(
                "is an Ibex {} endpoint, and this side speaks {}: check the address and port",
                other.name(),
                provider.name()
            ),
            None => format!(
                "is not an Ibex {} endpoint (bad magic: it sent {:?} instead of {:?}); check the address and port",
                provider.name(),
                magic.escape_ascii().to_string(),
                provider.magic().escape_ascii().to_string()
            ),
        };
        return Err(Error::Handshake(format!("{peer} {why}")));
    }
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let version = u16_at(8);
    if version != VERSION {
        return Err(Error::Handshake(format!(
            "{peer} speaks Ibex {} version {version}, we speak {VERSION}; run the same Ibex release on both sides",
            provider.name()
        )));
    }
    let slot_size = u32_at(10);
    if !(MIN_SLOT..=MAX_SLOT).contains(&slot_size) {
        return Err(Error::Handshake(format!(
            "{peer} announced a slot size of {slot_size} bytes, outside {MIN_SLOT}..={MAX_SLOT}"
        )));
    }
    let token_len = usize::from(u16_at(18));
    if token_len > MAX_TOKEN {
        return Err(Error::Handshake(format!(
            "{peer} sent an auth token of {token_len} bytes; at most {MAX_TOKEN} are allowed"
        )));
    }
    let ext_len = usize::from(u16_at(20));
    if ext_len > MAX_EXT {
        return Err(Error::Handshake(format!(
            "{peer} announced {ext_len} bytes of {} set-up data; at most {MAX_EXT} are allowed",
            provider.name()
        )));
    }
    Ok(Header {
        slot_size,
        features: u32_at(14),
        token_len,
        ext_len,
    })
}

/// The whole preface from its checked header and the [`Header::rest_len`] bytes after it.
pub fn decode_rest(h: &Header, rest: &[u8]) -> Result<Preface> {
    if rest.len() != h.rest_len() {
        return Err(Error::Handshake(format!(
            "a preface announcing {} bytes of token and set-up data came with {}",
            h.rest_len(),
            rest.len()
        )));
    }
    let (token, ext) = rest.split_at(h.token_len);
    Ok(Preface {
        slot_size: h.slot_size,
        features: h.features,
        token: token.to_vec(),
        ext: ext.to_vec(),
    })
}

/// A whole preface in `b` (exactly), as [`exchange`] would take it off a stream.
pub fn decode(provider: Provider, b: &[u8], peer: &str) -> Result<Preface> {
    let Some((fixed, rest)) = b.split_first_chunk::<FIXED_LEN>() else {
        return Err(Error::Handshake(format!(
            "{peer} sent a preface of {} bytes; it has at least {FIXED_LEN}",
            b.len()
        )));
    };
    decode_rest(&decode_header(provider, fixed, peer)?, rest)
}

/// Checks the peer's token against ours. An empty token counts as none, as
/// `IBEX_AUTH_TOKEN=""` does; the comparison takes the same time wherever they differ.
pub fn authenticate(ours: &[u8], theirs: &[u8], peer: &str) -> Result<()> {
    let (ours_set, theirs_set) = (!ours.is_empty(), !theirs.is_empty());
    if !ours_set && !theirs_set || ours_set && theirs_set && ct_eq(ours, theirs) {
        return Ok(());
    }
    let why = match (ours_set, theirs_set) {
        (true, false) => "we require a token and the peer sent none",
        (false, true) => "the peer presented a token and we have none",
        _ => "the tokens differ",
    };
    Err(Error::Handshake(format!(
        "authentication with {peer} failed ({why}); set the same IBEX_AUTH_TOKEN on both sides"
    )))
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

/// The error for a peer that hung up part-way through set-up.
pub(crate) fn closed_during_setup(peer: &str) -> Error {
    Error::Handshake(format!(
        "{peer} closed the connection during setup (it may have refused our version or auth token; see its log)"
    ))
}

fn read_err(peer: &str, e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        closed_during_setup(peer)
    } else {
        Error::io(format!("reading the set-up preface of {peer}"), e)
    }
}

/// Writes `ours`, then reads, checks and authenticates the peer's. `Ok(None)`: the peer
/// hung up before sending a byte (a port scanner, or another listener's liveness check),
/// which callers may skip quietly. No deadline of its own: callers bound it.
pub(crate) async fn exchange<S>(
    s: &mut S,
    provider: Provider,
    ours: &Preface,
    peer: &str,
) -> Result<Option<Preface>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    // A peer that hung up at once makes this write fail; what it sent, if anything, says
    // more, so the read comes first.
    let sent = s.write_all(&ours.encode(provider)).await;
    let mut fixed = [0u8; FIXED_LEN];
    let mut got = 0;
    while got < FIXED_LEN {
        match s.read(&mut fixed[got..]).await {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) if crate::tls::looks_like_alert(&fixed[..got]) => {
                return Err(Error::Handshake(format!(
                    "{peer} answered with a TLS alert: it requires TLS, and this side speaks plain Ibex {}; configure this side with tls (Config::tls = Tls::client, or Endpoint::tls_config)",
                    provider.name()
                )));
            }
            Ok(0) => return Err(closed_during_setup(peer)),
            Ok(n) => got += n,
            Err(e) if got == 0 && e.kind() == io::ErrorKind::ConnectionReset => return Ok(None),
            Err(e) => return Err(read_err(peer, e)),
        }
    }
    let header = decode_header(provider, &fixed, peer)?;
    sent.map_err(|e| Error::io(format!("sending the set-up preface to {peer}"), e))?;
    let mut rest = vec![0u8; header.rest_len()];
    s.read_exact(&mut rest)
        .await
        .map_err(|e| read_err(peer, e))?;
    let theirs = decode_rest(&header, &rest)?;
    authenticate(&ours.token, &theirs.token, peer)?;
    Ok(Some(theirs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preface() -> Preface {
        Preface {
            slot_size: 65536,
            features: 0x8000_0001,
            token: b"secret".to_vec(),
            ext: vec![1, 2, 3],
        }
    }

    #[test]
    fn a_preface_round_trips_for_every_provider() {
        for p in Provider::ALL {
            let b = preface().encode(p);
            assert_eq!(decode(p, &b, "peer").unwrap(), preface());
        }
    }

    #[test]
    fn bad_prefaces_name_the_problem() {
        let b = preface().encode(Provider::Tcp);
        let e = decode(Provider::Shm, &b, "peer at x")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("Ibex tcp endpoint, and this side speaks shm"),
            "{e}"
        );
        let e = decode(
            Provider::Tcp,
            b"GET / HTTP/1.1\r\n\r\n\r\n\r\n",
            "peer at x",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not an Ibex tcp endpoint"), "{e}");
        let mut v = b.clone();
        v[8] = 9;
        let e = decode(Provider::Tcp, &v, "p").unwrap_err().to_string();
        assert!(e.contains("version 9, we speak 2"), "{e}");
        let mut v = b.clone();
        v[10..14].copy_from_slice(&(1u32 << 30).to_le_bytes());
        let e = decode(Provider::Tcp, &v, "p").unwrap_err().to_string();
        assert!(e.contains("slot size"), "{e}");
        let mut v = b.clone();
        v[18..20].copy_from_slice(&5000u16.to_le_bytes());
        let e = decode(Provider::Tcp, &v, "p").unwrap_err().to_string();
        assert!(e.contains("auth token of 5000 bytes"), "{e}");
        let mut v = b.clone();
        v[20..22].copy_from_slice(&5000u16.to_le_bytes());
        let e = decode(Provider::Tcp, &v, "p").unwrap_err().to_string();
        assert!(e.contains("5000 bytes of tcp set-up data"), "{e}");
        let e = decode(Provider::Tcp, &b[..b.len() - 1], "p")
            .unwrap_err()
            .to_string();
        assert!(e.contains("came with"), "{e}");
        let e = decode(Provider::Tcp, &b[..10], "p")
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 22"), "{e}");
    }

    #[test]
    fn tokens_must_match_or_both_be_absent() {
        assert!(authenticate(b"", b"", "p").is_ok());
        assert!(authenticate(b"a", b"a", "p").is_ok());
        for (a, b) in [
            (&b"a"[..], &b"b"[..]),
            (b"a", b""),
            (b"", b"b"),
            (b"ab", b"a"),
        ] {
            let e = authenticate(a, b, "p").unwrap_err().to_string();
            assert!(e.contains("IBEX_AUTH_TOKEN"), "{e}");
        }
    }

    #[test]
    fn constant_time_compare_is_equality() {
        assert!(ct_eq(b"secret", b"secret"));
        assert!(!ct_eq(b"secret", b"secreT"));
        assert!(!ct_eq(b"secret", b"secret2"));
        assert!(ct_eq(b"", b""));
    }

    #[test]
    fn our_preface_checks_the_configuration() {
        let c = Config {
            auth_token: Some("x".repeat(MAX_TOKEN + 1)),
            ..Config::default()
        };
        assert!(Preface::ours(&c, vec![]).is_err());
        assert!(Preface::ours(&Config::default(), vec![0; MAX_EXT + 1]).is_err());
        let p = Preface::ours(&Config::default(), vec![7]).unwrap();
        assert_eq!(p.slot_size, 64 << 10);
        assert!(p.token.is_empty());
    }
}
