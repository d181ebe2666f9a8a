//! The wire format, version 1. All integers are little-endian.
//!
//! Every frame is a 12-byte header followed by a kind-specific body:
//!
//! ```text
//! magic u8 = 0x49 | version u8 = 1 | kind u8 | flags u8 | credits u32 | body_len u32
//! ```
//!
//! `credits` returns receive slots to the receiver of the frame (piggy-backed on every
//! frame); `body_len` must equal the bytes after the header, because providers deliver
//! whole frames. The bodies are described on [`Body`]; `docs/protocol.md` has the full
//! picture.
//!
//! [`Frame::decode`] checks every length and bound and never panics: a peer is not trusted.
//! Eager payloads and descriptors come out as zero-copy slices of the input.

use bytes::{Bytes, BytesMut};

/// Bytes of every frame header.
pub const HEADER_LEN: usize = 12;
/// First byte of every frame ("I").
pub const MAGIC: u8 = 0x49;
/// Largest rendezvous descriptor a frame may carry.
pub const MAX_DESC_LEN: usize = 256;
/// Largest `Hello` extension block.
pub const MAX_EXT_LEN: usize = 1024;
/// Bytes before the message in an eager frame of one message: the header, the message
/// count and the message's length ([`Frame::eager_one_head`]).
pub const EAGER_ONE_HEAD: usize = HEADER_LEN + 2 + 4;
/// `RndvDone` flag: the sequence number is a probe id, not a message.
pub const FLAG_PROBE: u8 = 0x01;
/// `Hello` extension entry: a `u32` bit set of the optional features the sender speaks.
pub const EXT_FEATURES: u16 = 1;
/// Feature bit: the sender answers [`Body::ProbeRead`] (the fragment-size probe). A peer
/// sends `ProbeRead` only to a side that announced it: older peers reject unknown kinds.
pub const FEATURE_PROBE_READ: u32 = 1 << 0;
/// `Rts` flag: the frame's bytes after the descriptor are the message's head, which comes
/// before the rendezvous bytes (a two-part message).
pub const FLAG_HEAD: u8 = 0x01;
/// Feature bit: the sender takes an `Rts` with [`FLAG_HEAD`]. A peer sends one only to a
/// side that announced it: older peers reject unknown flags.
pub const FEATURE_RTS_HEAD: u32 = 1 << 1;
/// Bytes of an `Rts` body besides its descriptor and head: `seq`, `len`, the descriptor's
/// length.
pub const RTS_FIXED: usize = 8 + 8 + 2;

/// Frame kind codes (the header's `kind` byte).
pub mod kind {
    /// [`super::Body::Hello`].
    pub const HELLO: u8 = 1;
    /// [`super::Body::Eager`].
    pub const EAGER: u8 = 2;
    /// [`super::Body::Rts`].
    pub const RTS: u8 = 3;
    /// [`super::Body::RndvDone`].
    pub const RNDV_DONE: u8 = 4;
    /// [`super::Body::Credit`].
    pub const CREDIT: u8 = 5;
    /// [`super::Body::ProbeEager`].
    pub const PROBE_EAGER: u8 = 6;
    /// [`super::Body::ProbeAck`].
    pub const PROBE_ACK: u8 = 7;
    /// [`super::Body::ProbeRts`].
    pub const PROBE_RTS: u8 = 8;
    /// [`super::Body::Close`].
    pub const CLOSE: u8 = 9;
    /// [`super::Body::ProbeRead`].
    pub const PROBE_READ: u8 = 10;
}

/// One decoded (or to-be-encoded) frame: the header's credits and the kind-specific body.
///
/// The header's `credits` belong to every kind, so they live here rather than in each
/// [`Body`] variant; `kind` and `flags` are implied by the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Credits returned to the receiver of this frame.
    pub credits: u32,
    /// What the frame says.
    pub body: Body,
}

/// The kind-specific part of a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// Kind 1, the handshake; each side sends it first, once.
    Hello {
        /// Data frames the sender of `Hello` accepts (its slot count): the peer's initial credits.
        slots: u32,
        /// The largest frame the sender accepts.
        slot_size: u32,
        /// The largest message the sender accepts.
        max_message: u64,
        /// The sender's rendezvous fragment size (informational).
        fragment_size: u32,
        /// Extension block (at most [`MAX_EXT_LEN`] bytes): entries of `tag u16 | len u16 |
        /// value`, see [`HelloExt`]. Empty from the first version-1 builds, which ignore it.
        ext: Bytes,
    },
    /// Kind 2: one or more whole messages (more than one = coalesced), in order.
    Eager {
        /// The payloads (at least one, at most `u16::MAX`).
        msgs: Vec<Bytes>,
    },
    /// Kind 3: request-to-send of a rendezvous message.
    Rts {
        /// Message number; must be the next one the receiver expects.
        seq: u64,
        /// Bytes to read (the message less its head).
        len: u64,
        /// The provider's descriptor of the exposed buffer (at most [`MAX_DESC_LEN`] bytes).
        desc: Bytes,
        /// The message's first bytes, carried in this frame (flag [`FLAG_HEAD`], sent only
        /// to a peer that announced [`FEATURE_RTS_HEAD`]); empty for a plain rendezvous
        /// message. The message is `head` followed by the `len` bytes read.
        head: Bytes,
    },
    /// Kind 4: the receiver finished with a rendezvous message (or probe sample); the sender
    /// may release its buffer.
    RndvDone {
        /// The message number, or the probe id when `probe` is set.
        seq: u64,
        /// Flag [`FLAG_PROBE`]: `seq` names a probe sample.
        probe: bool,
    },
    /// Kind 5: nothing but the header's credits.
    Credit,
    /// Kind 6: an eager probe sample; the peer answers [`Body::ProbeAck`].
    ProbeEager {
        /// Probe sample id.
        probe_id: u32,
        /// The sample payload (content irrelevant).
        pad: Bytes,
    },
    /// Kind 7: answer to [`Body::ProbeEager`].
    ProbeAck {
        /// The sample answered.
        probe_id: u32,
    },
    /// Kind 8: a rendezvous probe sample; the peer reads it and answers
    /// `RndvDone { seq: probe_id, probe: true }`.
    ProbeRts {
        /// Probe sample id.
        probe_id: u32,
        /// Bytes to read.
        len: u64,
        /// The provider's descriptor of the probe buffer.
        desc: Bytes,
    },
    /// Kind 10: a fragment-size probe sample, sent only to a peer that announced
    /// [`FEATURE_PROBE_READ`]. The peer reads it like a [`Body::ProbeRts`] but in fragments
    /// of `fragment` bytes, and answers `RndvDone { seq: probe_id, probe: true }`.
    ProbeRead {
        /// Probe sample id (shared with the other probe samples).
        probe_id: u32,
        /// Bytes to read.
        len: u64,
        /// Fragment size the peer must read with.
        fragment: u32,
        /// The provider's descriptor of the probe buffer.
        desc: Bytes,
    },
    /// Kind 9: the sender is closing the connection.
    Close {
        /// 0 = graceful; 1 = the receiver broke the protocol; 2 = the sender failed locally.
        code: u32,
        /// Human-readable reason (UTF-8, decoded lossily).
        reason: String,
    },
}

/// Why a byte string is not a valid frame. Each variant names one distinct defect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Fewer bytes than a header.
    #[error("frame of {len} bytes is shorter than the {HEADER_LEN}-byte header")]
    ShortHeader {
        /// Bytes received.
        len: usize,
    },
    /// The first byte is not [`MAGIC`].
    #[error("bad magic byte {0:#04x} (expected {MAGIC:#04x}): not an Ibex frame")]
    BadMagic(u8),
    /// A wire version this build does not speak.
    #[error("unsupported wire version {0} (this build speaks version {v})", v = super::VERSION)]
    UnsupportedVersion(u8),
    /// An unknown kind code.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Flag bits that the kind does not define.
    #[error("frame kind {kind} carries undefined flag bits {flags:#04x}")]
    UnknownFlags {
        /// The kind code.
        kind: u8,
        /// The flags byte.
        flags: u8,
    },
    /// The header's `body_len` disagrees with the bytes that follow it.
    #[error("header says the body is {declared} bytes but {actual} bytes follow it")]
    BodyLenMismatch {
        /// `body_len` from the header.
        declared: u32,
        /// Bytes actually after the header.
        actual: usize,
    },
    /// The body ends inside a fixed-size field.
    #[error("{kind} frame truncated: body ends inside field `{field}`")]
    Truncated {
        /// Frame kind name.
        kind: &'static str,
        /// The field cut short.
        field: &'static str,
    },
    /// An `Eager` frame with no messages.
    #[error("eager frame with a message count of 0")]
    ZeroCount,
    /// A length field points past the end of the body.
    #[error(
        "{kind} frame: `{field}` of {len} bytes runs past the end of the body ({remaining} bytes left)"
    )]
    LengthPastEnd {
        /// Frame kind name.
        kind: &'static str,
        /// The length-prefixed field.
        field: &'static str,
        /// The declared length.
        len: u64,
        /// Bytes left in the body.
        remaining: usize,
    },
    /// Bytes left over after the last field.
    #[error("{kind} frame has {extra} trailing bytes after its last field")]
    TrailingBytes {
        /// Frame kind name.
        kind: &'static str,
        /// How many.
        extra: usize,
    },
    /// A rendezvous descriptor longer than [`MAX_DESC_LEN`].
    #[error("descriptor of {0} bytes exceeds the limit of {MAX_DESC_LEN}")]
    DescTooLong(usize),
    /// A `Hello` extension block longer than [`MAX_EXT_LEN`].
    #[error("hello extension of {0} bytes exceeds the limit of {MAX_EXT_LEN}")]
    ExtTooLong(usize),
}

impl Body {
    /// The header's kind code.
    pub fn kind(&self) -> u8 {
        match self {
            Body::Hello { .. } => kind::HELLO,
            Body::Eager { .. } => kind::EAGER,
            Body::Rts { .. } => kind::RTS,
            Body::RndvDone { .. } => kind::RNDV_DONE,
            Body::Credit => kind::CREDIT,
            Body::ProbeEager { .. } => kind::PROBE_EAGER,
            Body::ProbeAck { .. } => kind::PROBE_ACK,
            Body::ProbeRts { .. } => kind::PROBE_RTS,
            Body::Close { .. } => kind::CLOSE,
            Body::ProbeRead { .. } => kind::PROBE_READ,
        }
    }

    /// True for frames that take one of the peer's receive slots (a credit).
    pub fn is_data(&self) -> bool {
        matches!(
            self,
            Body::Eager { .. }
                | Body::Rts { .. }
                | Body::ProbeEager { .. }
                | Body::ProbeRts { .. }
                | Body::ProbeRead { .. }
        )
    }

    fn flags(&self) -> u8 {
        match self {
            Body::RndvDone { probe: true, .. } => FLAG_PROBE,
            Body::Rts { head, .. } if !head.is_empty() => FLAG_HEAD,
            _ => 0,
        }
    }

    /// Bytes of the encoded body.
    pub fn encoded_len(&self) -> usize {
        match self {
            Body::Hello { ext, .. } => 4 + 4 + 8 + 4 + 2 + ext.len(),
            Body::Eager { msgs } => 2 + msgs.iter().map(|m| 4 + m.len()).sum::<usize>(),
            Body::Rts { desc, head, .. } => RTS_FIXED + desc.len() + head.len(),
            Body::RndvDone { .. } => 8,
            Body::Credit => 0,
            Body::ProbeEager { pad, .. } => 4 + pad.len(),
            Body::ProbeAck { .. } => 4,
            Body::ProbeRts { desc, .. } => 4 + 8 + 2 + desc.len(),
            Body::Close { reason, .. } => 4 + 2 + reason.len(),
            Body::ProbeRead { desc, .. } => 4 + 8 + 4 + 2 + desc.len(),
        }
    }
}

fn kind_name(kind: u8) -> &'static str {
    match kind {
        kind::HELLO => "hello",
        kind::EAGER => "eager",
        kind::RTS => "rts",
        kind::RNDV_DONE => "rndv-done",
        kind::CREDIT => "credit",
        kind::PROBE_EAGER => "probe-eager",
        kind::PROBE_ACK => "probe-ack",
        kind::PROBE_RTS => "probe-rts",
        kind::CLOSE => "close",
        kind::PROBE_READ => "probe-read",
        _ => "unknown",
    }
}

/// Reads fields off a body, turning every shortfall into a [`FrameError`].
struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
    end: usize,
    kind: &'static str,
}

impl Reader<'_> {
    fn remaining(&self) -> usize {
        self.end - self.pos
    }

    fn fixed<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], FrameError> {
        let src = self
            .buf
            .get(self.pos..self.pos + N)
            .filter(|_| self.remaining() >= N);
        let src = src.ok_or(FrameError::Truncated {
            kind: self.kind,
            field,
        })?;
        let mut out = [0u8; N];
        out.copy_from_slice(src);
        self.pos += N;
        Ok(out)
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, FrameError> {
        self.fixed(field).map(u16::from_le_bytes)
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, FrameError> {
        self.fixed(field).map(u32::from_le_bytes)
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, FrameError> {
        self.fixed(field).map(u64::from_le_bytes)
    }

    /// `len` bytes as a zero-copy slice of the input.
    fn bytes(&mut self, field: &'static str, len: u64) -> Result<Bytes, FrameError> {
        let remaining = self.remaining();
        if len > remaining as u64 {
            return Err(FrameError::LengthPastEnd {
                kind: self.kind,
                field,
                len,
                remaining,
            });
        }
        let len = len as usize;
        let out = self.buf.slice(self.pos..self.pos + len);
        self.pos += len;
        Ok(out)
    }

    fn rest(&mut self) -> Bytes {
        let out = self.buf.slice(self.pos..self.end);
        self.pos = self.end;
        out
    }

    fn finish(&self) -> Result<(), FrameError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(FrameError::TrailingBytes {
                kind: self.kind,
                extra,
            }),
        }
    }
}

impl Frame {
    /// A frame with no credits attached.
    pub fn new(body: Body) -> Frame {
        Frame { credits: 0, body }
    }

    /// Bytes of the encoded frame.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.body.encoded_len()
    }

    /// Appends the encoded frame to `out`.
    ///
    /// Fields wider than the wire allows (over `u16::MAX` eager messages, descriptors over
    /// [`MAX_DESC_LEN`], an extension over [`MAX_EXT_LEN`], a reason over 64 KiB) are the
    /// caller's bug; the core never builds such frames. They are cut to what the wire can
    /// carry rather than panicking, so the result still decodes.
    pub fn encode(&self, out: &mut BytesMut) {
        let body = &self.body;
        out.reserve(self.encoded_len());
        out.extend_from_slice(&[MAGIC]);
        out.extend_from_slice(&[super::VERSION]);
        out.extend_from_slice(&[body.kind()]);
        out.extend_from_slice(&[body.flags()]);
        out.extend_from_slice(&self.credits.to_le_bytes());
        let len_at = out.len();
        out.extend_from_slice(&0u32.to_le_bytes());
        let body_start = out.len();
        match body {
            Body::Hello {
                slots,
                slot_size,
                max_message,
                fragment_size,
                ext,
            } => {
                out.extend_from_slice(&(*slots).to_le_bytes());
                out.extend_from_slice(&(*slot_size).to_le_bytes());
                out.extend_from_slice(&(*max_message).to_le_bytes());
                out.extend_from_slice(&(*fragment_size).to_le_bytes());
                put_prefixed(out, ext, MAX_EXT_LEN);
            }
            Body::Eager { msgs } => {
                let msgs = &msgs[..msgs.len().min(u16::MAX as usize)];
                out.extend_from_slice(&(msgs.len() as u16).to_le_bytes());
                for m in msgs {
                    let m = &m[..m.len().min(u32::MAX as usize)];
                    out.extend_from_slice(&(m.len() as u32).to_le_bytes());
                    out.extend_from_slice(m);
                }
            }
            Body::Rts {
                seq,
                len,
                desc,
                head,
            } => {
                out.extend_from_slice(&(*seq).to_le_bytes());
                out.extend_from_slice(&(*len).to_le_bytes());
                put_prefixed(out, desc, MAX_DESC_LEN);
                out.extend_from_slice(head);
            }
            Body::RndvDone { seq, .. } => out.extend_from_slice(&(*seq).to_le_bytes()),
            Body::Credit => {}
            Body::ProbeEager { probe_id, pad } => {
                out.extend_from_slice(&(*probe_id).to_le_bytes());
                out.extend_from_slice(pad);
            }
            Body::ProbeAck { probe_id } => out.extend_from_slice(&(*probe_id).to_le_bytes()),
            Body::ProbeRts {
                probe_id,
                len,
                desc,
            } => {
                out.extend_from_slice(&(*probe_id).to_le_bytes());
                out.extend_from_slice(&(*len).to_le_bytes());
                put_prefixed(out, desc, MAX_DESC_LEN);
            }
            Body::Close { code, reason } => {
                out.extend_from_slice(&(*code).to_le_bytes());
                put_prefixed(
                    out,
                    truncate_utf8(reason, u16::MAX as usize).as_bytes(),
                    u16::MAX as usize,
                );
            }
            Body::ProbeRead {
                probe_id,
                len,
                fragment,
                desc,
            } => {
                out.extend_from_slice(&(*probe_id).to_le_bytes());
                out.extend_from_slice(&(*len).to_le_bytes());
                out.extend_from_slice(&(*fragment).to_le_bytes());
                put_prefixed(out, desc, MAX_DESC_LEN);
            }
        }
        let body_len = (out.len() - body_start) as u32;
        out[len_at..len_at + 4].copy_from_slice(&body_len.to_le_bytes());
    }

    /// Everything of an eager frame of one message of `len` bytes that precedes the
    /// message: byte for byte what [`Frame::encode`] writes before it. With it a link
    /// copies the message once, straight from the application's buffer.
    pub fn eager_one_head(credits: u32, len: usize) -> [u8; EAGER_ONE_HEAD] {
        let len = len.min(u32::MAX as usize - 6) as u32;
        let mut h = [0u8; EAGER_ONE_HEAD];
        h[0] = MAGIC;
        h[1] = super::VERSION;
        h[2] = kind::EAGER;
        h[3] = 0;
        h[4..8].copy_from_slice(&credits.to_le_bytes());
        h[8..12].copy_from_slice(&(len + 6).to_le_bytes());
        h[12..14].copy_from_slice(&1u16.to_le_bytes());
        h[14..18].copy_from_slice(&len.to_le_bytes());
        h
    }

    /// The encoded frame as `Bytes`.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.encoded_len());
        self.encode(&mut out);
        out.freeze()
    }

    /// Decodes one whole frame. Never panics; every defect is a distinct [`FrameError`].
    pub fn decode(buf: &Bytes) -> Result<Frame, FrameError> {
        Self::decode_reusing(buf, &mut Vec::new())
    }

    /// [`Frame::decode`] that fills `spare`'s allocation (taken, cleared) with an eager
    /// frame's messages, so a receiver that hands the vector back decodes without
    /// allocating. Other kinds leave `spare` as it is.
    pub fn decode_reusing(buf: &Bytes, spare: &mut Vec<Bytes>) -> Result<Frame, FrameError> {
        if buf.len() < HEADER_LEN {
            return Err(FrameError::ShortHeader { len: buf.len() });
        }
        let h = &buf[..HEADER_LEN];
        if h[0] != MAGIC {
            return Err(FrameError::BadMagic(h[0]));
        }
        if h[1] != super::VERSION {
            return Err(FrameError::UnsupportedVersion(h[1]));
        }
        let (kind, flags) = (h[2], h[3]);
        let name = kind_name(kind);
        if name == "unknown" {
            return Err(FrameError::UnknownKind(kind));
        }
        let allowed = match kind {
            kind::RNDV_DONE => FLAG_PROBE,
            kind::RTS => FLAG_HEAD,
            _ => 0,
        };
        if flags & !allowed != 0 {
            return Err(FrameError::UnknownFlags { kind, flags });
        }
        let credits = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let declared = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        let actual = buf.len() - HEADER_LEN;
        if declared as u64 != actual as u64 {
            return Err(FrameError::BodyLenMismatch { declared, actual });
        }
        let mut r = Reader {
            buf,
            pos: HEADER_LEN,
            end: buf.len(),
            kind: name,
        };
        let body = match kind {
            kind::HELLO => {
                let slots = r.u32("slots")?;
                let slot_size = r.u32("slot_size")?;
                let max_message = r.u64("max_message")?;
                let fragment_size = r.u32("fragment_size")?;
                let ext_len = r.u16("ext_len")? as usize;
                if ext_len > MAX_EXT_LEN {
                    return Err(FrameError::ExtTooLong(ext_len));
                }
                let ext = r.bytes("ext", ext_len as u64)?;
                Body::Hello {
                    slots,
                    slot_size,
                    max_message,
                    fragment_size,
                    ext,
                }
            }
            kind::EAGER => {
                let count = r.u16("count")?;
                if count == 0 {
                    return Err(FrameError::ZeroCount);
                }
                // Each message needs at least its 4-byte length, so a hostile count cannot
                // make this allocation larger than the frame itself.
                let mut msgs = std::mem::take(spare);
                msgs.clear();
                msgs.reserve((count as usize).min(r.remaining() / 4 + 1));
                for _ in 0..count {
                    let len = r.u32("message len")?;
                    msgs.push(r.bytes("message", len as u64)?);
                }
                Body::Eager { msgs }
            }
            kind::RTS => {
                let seq = r.u64("seq")?;
                let len = r.u64("len")?;
                let desc = read_desc(&mut r)?;
                // A flagged head is never empty, so every frame has one encoding.
                let head = if flags & FLAG_HEAD != 0 {
                    let head = r.rest();
                    if head.is_empty() {
                        return Err(FrameError::Truncated {
                            kind: "rts",
                            field: "head",
                        });
                    }
                    head
                } else {
                    Bytes::new()
                };
                Body::Rts {
                    seq,
                    len,
                    desc,
                    head,
                }
            }
            kind::RNDV_DONE => Body::RndvDone {
                seq: r.u64("seq")?,
                probe: flags & FLAG_PROBE != 0,
            },
            kind::CREDIT => Body::Credit,
            kind::PROBE_EAGER => {
                let probe_id = r.u32("probe_id")?;
                Body::ProbeEager {
                    probe_id,
                    pad: r.rest(),
                }
            }
            kind::PROBE_ACK => Body::ProbeAck {
                probe_id: r.u32("probe_id")?,
            },
            kind::PROBE_RTS => {
                let probe_id = r.u32("probe_id")?;
                let len = r.u64("len")?;
                let desc = read_desc(&mut r)?;
                Body::ProbeRts {
                    probe_id,
                    len,
                    desc,
                }
            }
            kind::CLOSE => {
                let code = r.u32("code")?;
                let reason_len = r.u16("reason_len")?;
                let reason = r.bytes("reason", reason_len as u64)?;
                Body::Close {
                    code,
                    reason: String::from_utf8_lossy(&reason).into_owned(),
                }
            }
            kind::PROBE_READ => {
                let probe_id = r.u32("probe_id")?;
                let len = r.u64("len")?;
                let fragment = r.u32("fragment")?;
                let desc = read_desc(&mut r)?;
                Body::ProbeRead {
                    probe_id,
                    len,
                    fragment,
                    desc,
                }
            }
            other => return Err(FrameError::UnknownKind(other)),
        };
        r.finish()?;
        Ok(Frame { credits, body })
    }
}

/// What a `Hello` extension block says. The block is a sequence of entries
/// `tag u16 | len u16 | value` (little-endian); entries with unknown tags are skipped, so
/// later builds can add some without a new wire version. Known entries:
/// - [`EXT_FEATURES`]: a `u32` bit set ([`FEATURE_PROBE_READ`]); bytes beyond the first
///   four are reserved for more bits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HelloExt {
    /// Optional features the sender speaks.
    pub features: u32,
}

impl HelloExt {
    /// The extension block announcing `self`.
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(8);
        out.extend_from_slice(&EXT_FEATURES.to_le_bytes());
        out.extend_from_slice(&4u16.to_le_bytes());
        out.extend_from_slice(&self.features.to_le_bytes());
        out.freeze()
    }

    /// Parses an extension block; an empty one (older peers) announces nothing.
    pub fn decode(ext: &Bytes) -> Result<HelloExt, FrameError> {
        let mut r = Reader {
            buf: ext,
            pos: 0,
            end: ext.len(),
            kind: "hello",
        };
        let mut out = HelloExt::default();
        while r.remaining() > 0 {
            let tag = r.u16("ext tag")?;
            let len = r.u16("ext len")?;
            let value = r.bytes("ext value", u64::from(len))?;
            if tag == EXT_FEATURES {
                let bits: [u8; 4] = value.get(..4).and_then(|b| b.try_into().ok()).ok_or(
                    FrameError::Truncated {
                        kind: "hello",
                        field: "ext features",
                    },
                )?;
                out.features = u32::from_le_bytes(bits);
            }
        }
        Ok(out)
    }
}

fn read_desc(r: &mut Reader<'_>) -> Result<Bytes, FrameError> {
    let desc_len = r.u16("desc_len")? as usize;
    if desc_len > MAX_DESC_LEN {
        return Err(FrameError::DescTooLong(desc_len));
    }
    r.bytes("desc", desc_len as u64)
}

fn put_prefixed(out: &mut BytesMut, data: &[u8], max: usize) {
    let data = &data[..data.len().min(max)];
    out.extend_from_slice(&(data.len() as u16).to_le_bytes());
    out.extend_from_slice(data);
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub(crate) fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(f: &Frame) -> Bytes {
        f.to_bytes()
    }

    #[test]
    fn the_head_of_a_one_message_eager_frame_is_what_encode_writes() {
        for len in [0, 1, 100, 5000] {
            for credits in [0, 7, u32::MAX] {
                let msg = Bytes::from(vec![0xA5; len]);
                let whole = Frame {
                    credits,
                    body: Body::Eager {
                        msgs: vec![msg.clone()],
                    },
                }
                .to_bytes();
                let mut parts = Frame::eager_one_head(credits, len).to_vec();
                parts.extend_from_slice(&msg);
                assert_eq!(parts, whole, "{len} B, {credits} credits");
            }
        }
    }

    fn all_kinds() -> Vec<Frame> {
        let desc = Bytes::from_static(b"descriptor");
        vec![
            Frame {
                credits: 7,
                body: Body::Hello {
                    slots: 64,
                    slot_size: 65536,
                    max_message: 1 << 30,
                    fragment_size: 1 << 19,
                    ext: Bytes::from_static(b"x"),
                },
            },
            Frame::new(Body::Eager {
                msgs: vec![Bytes::from_static(b"hello"), Bytes::new()],
            }),
            Frame::new(Body::Rts {
                seq: 3,
                len: 1 << 40,
                desc: desc.clone(),
                head: Bytes::new(),
            }),
            Frame::new(Body::Rts {
                seq: 4,
                len: 0,
                desc: desc.clone(),
                head: Bytes::from_static(b"packet"),
            }),
            Frame::new(Body::RndvDone {
                seq: 9,
                probe: true,
            }),
            Frame {
                credits: u32::MAX,
                body: Body::Credit,
            },
            Frame::new(Body::ProbeEager {
                probe_id: 1,
                pad: Bytes::from(vec![0u8; 100]),
            }),
            Frame::new(Body::ProbeAck { probe_id: 1 }),
            Frame::new(Body::ProbeRts {
                probe_id: 2,
                len: 4096,
                desc,
            }),
            Frame::new(Body::Close {
                code: 1,
                reason: "bad ünïcode ok".into(),
            }),
            Frame::new(Body::ProbeRead {
                probe_id: 3,
                len: 4 << 20,
                fragment: 1 << 16,
                desc: Bytes::from_static(b"d"),
            }),
        ]
    }

    #[test]
    fn every_kind_round_trips_and_reports_its_length() {
        for f in all_kinds() {
            let b = enc(&f);
            assert_eq!(b.len(), f.encoded_len(), "{f:?}");
            assert_eq!(Frame::decode(&b).as_ref(), Ok(&f));
        }
    }

    #[test]
    fn an_eager_frame_decodes_into_the_spare_list() {
        let mut spare: Vec<Bytes> = Vec::with_capacity(4);
        spare.push(Bytes::from_static(b"stale"));
        let ptr = spare.as_ptr();
        for f in all_kinds() {
            let b = enc(&f);
            let before = spare.capacity();
            let got = Frame::decode_reusing(&b, &mut spare).expect("decodes");
            assert_eq!(got, f);
            match got.body {
                Body::Eager { msgs } => {
                    assert_eq!(msgs.as_ptr(), ptr, "the spare allocation is reused");
                    spare = msgs;
                }
                _ => assert_eq!(spare.capacity(), before, "other kinds leave it alone"),
            }
        }
    }

    #[test]
    fn eager_overhead_matches_the_encoding() {
        let f = Frame::new(Body::Eager {
            msgs: vec![Bytes::from(vec![1u8; 1000])],
        });
        assert_eq!(f.encoded_len(), 1000 + crate::proto::EAGER_OVERHEAD);
    }

    #[test]
    fn eager_payloads_are_zero_copy() {
        let b = enc(&Frame::new(Body::Eager {
            msgs: vec![Bytes::from_static(b"abcdef")],
        }));
        let Ok(Frame {
            body: Body::Eager { msgs },
            ..
        }) = Frame::decode(&b)
        else {
            panic!("decode")
        };
        assert_eq!(msgs[0].as_ptr(), b[HEADER_LEN + 6..].as_ptr());
    }

    fn with_body(kind: u8, flags: u8, body: &[u8]) -> Bytes {
        let mut v = vec![MAGIC, 1, kind, flags, 0, 0, 0, 0];
        v.extend_from_slice(&(body.len() as u32).to_le_bytes());
        v.extend_from_slice(body);
        Bytes::from(v)
    }

    #[test]
    fn each_defect_has_its_own_error() {
        let ok = enc(&Frame::new(Body::Credit));
        let d = |b: &Bytes| Frame::decode(b).unwrap_err();
        assert_eq!(d(&ok.slice(..5)), FrameError::ShortHeader { len: 5 });
        let mut m = ok.to_vec();
        m[0] = 0x50;
        assert_eq!(d(&Bytes::from(m)), FrameError::BadMagic(0x50));
        let mut m = ok.to_vec();
        m[1] = 2;
        assert_eq!(d(&Bytes::from(m)), FrameError::UnsupportedVersion(2));
        assert_eq!(d(&with_body(11, 0, &[])), FrameError::UnknownKind(11));
        assert_eq!(
            d(&with_body(kind::CREDIT, 1, &[])),
            FrameError::UnknownFlags { kind: 5, flags: 1 }
        );
        let mut m = ok.to_vec();
        m.push(0);
        assert_eq!(
            d(&Bytes::from(m)),
            FrameError::BodyLenMismatch {
                declared: 0,
                actual: 1
            }
        );
        assert_eq!(
            d(&with_body(kind::RNDV_DONE, 0, &[1, 2, 3])),
            FrameError::Truncated {
                kind: "rndv-done",
                field: "seq"
            }
        );
        assert_eq!(
            d(&with_body(kind::EAGER, 0, &[0, 0])),
            FrameError::ZeroCount
        );
        assert!(matches!(
            d(&with_body(kind::EAGER, 0, &[1, 0, 9, 0, 0, 0, 1])),
            FrameError::LengthPastEnd {
                field: "message",
                len: 9,
                remaining: 1,
                ..
            }
        ));
        assert_eq!(
            d(&with_body(kind::CREDIT, 0, &[0])),
            FrameError::TrailingBytes {
                kind: "credit",
                extra: 1
            }
        );
        let mut rts = vec![0u8; 16];
        rts.extend_from_slice(&300u16.to_le_bytes());
        assert_eq!(
            d(&with_body(kind::RTS, 0, &rts)),
            FrameError::DescTooLong(300)
        );
        let mut hello = vec![0u8; 20];
        hello.extend_from_slice(&2000u16.to_le_bytes());
        assert_eq!(
            d(&with_body(kind::HELLO, 0, &hello)),
            FrameError::ExtTooLong(2000)
        );
    }

    #[test]
    fn hello_extensions_round_trip_and_skip_unknown_entries() {
        let ext = HelloExt {
            features: FEATURE_PROBE_READ,
        };
        assert_eq!(HelloExt::decode(&ext.encode()), Ok(ext));
        assert_eq!(
            HelloExt::decode(&Bytes::new()),
            Ok(HelloExt::default()),
            "older peers send nothing"
        );
        // An unknown entry first, and a features entry longer than today's four bytes.
        let mut v = vec![0x34, 0x12, 2, 0, 0xaa, 0xbb];
        v.extend_from_slice(&[1, 0, 6, 0, 1, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(
            HelloExt::decode(&Bytes::from(v)),
            Ok(HelloExt { features: 1 })
        );
        assert!(matches!(
            HelloExt::decode(&Bytes::from_static(&[1, 0, 9, 0, 1])),
            Err(FrameError::LengthPastEnd { .. })
        ));
        assert!(matches!(
            HelloExt::decode(&Bytes::from_static(&[1, 0, 2, 0, 1, 0])),
            Err(FrameError::Truncated { .. })
        ));
        assert!(matches!(
            HelloExt::decode(&Bytes::from_static(&[1])),
            Err(FrameError::Truncated { .. })
        ));
    }

    #[test]
    fn close_reason_decodes_lossily() {
        let mut body = 1u32.to_le_bytes().to_vec();
        body.extend_from_slice(&2u16.to_le_bytes());
        body.extend_from_slice(&[0xff, b'a']);
        let f = Frame::decode(&with_body(kind::CLOSE, 0, &body));
        assert_eq!(
            f,
            Ok(Frame::new(Body::Close {
                code: 1,
                reason: "\u{fffd}a".into()
            }))
        );
    }

    #[test]
    fn truncation_respects_char_boundaries() {
        assert_eq!(truncate_utf8("aé", 2), "a");
        assert_eq!(truncate_utf8("abc", 5), "abc");
    }
}
