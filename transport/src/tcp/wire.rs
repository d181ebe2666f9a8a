//! The byte layout of everything after the preface: records and read descriptors.
//!
//! Every record is `[type u8][len u32 LE][body: len bytes]`, all integers little-endian.
//! Keeping one uniform header for all three types means a reader can always find the next
//! record boundary, and can bound every allocation from the header alone.

use bytes::BufMut;

use crate::error::{Error, Result};

/// Record header: type + body length.
pub(crate) const RECORD_HEADER: usize = 5;

/// Body is one opaque core frame.
pub(crate) const T_FRAME: u8 = 0;
/// Body is a read request (see [`READ_REQUEST_BODY`]).
pub(crate) const T_READ_REQUEST: u8 = 1;
/// Body is a read-response head ([`READ_RESPONSE_HEAD`]) followed by its payload; the record
/// length covers both, so the stream stays uniformly framed.
pub(crate) const T_READ_RESPONSE: u8 = 2;

/// Body is a pushed region ([`PUSH_HEAD`]) followed by its bytes: a message body the owner
/// sends unasked, right behind the RTS that announces it, so that the reader does not
/// have to ask. Only towards a peer whose preface announced
/// [`crate::preface::FEATURE_TCP_PUSH`].
pub(crate) const T_PUSH: u8 = 3;

/// `read_id u64, region_id u64, offset u64, len u32`.
pub(crate) const READ_REQUEST_BODY: usize = 8 + 8 + 8 + 4;
/// `read_id u64, status u8, len u32`.
pub(crate) const READ_RESPONSE_HEAD: usize = 8 + 1 + 4;

/// `region_id u64, len u32`.
pub(crate) const PUSH_HEAD: usize = 8 + 4;
/// Largest region an owner pushes, and a reader takes pushed: a gRPC body of up to two
/// 1 MiB pieces goes as one message. Above it, the two trips a request costs are a small
/// part of the transfer, and a reader's reads of it may not all be posted at once (8
/// fragments of 512 KiB by default), which would make it hold the push.
pub const MAX_PUSH: usize = 2 << 20;
/// Bytes of pushes a reader holds for reads not posted yet. Past it, a push is read and
/// dropped, and its reads ask the owner as without pushes.
pub const MAX_HELD: usize = 2 * (MAX_PUSH + HELD_ENTRY_COST);
/// What a held push is charged against [`MAX_HELD`] besides its bytes: its buffer and map
/// entry. Without it a peer's one-byte pushes could make a reader keep millions of entries.
pub const HELD_ENTRY_COST: usize = 512;
/// Set in a descriptor's region id when the owner pushes the region.
pub(crate) const PUSHED: u64 = 1 << 63;

/// Largest read one request may ask for. Bounds what a peer can make us stream in one go
/// and what a response may claim; the default fragment (512 KiB) is far below it.
pub const MAX_READ: usize = 64 << 20;
/// Largest error text a failed read response may carry.
pub(crate) const MAX_ERROR_TEXT: usize = 4096;
/// Inbound frames may exceed the slot size by this much before we call it a violation
/// (room for framing the core adds on top of what it counts).
pub(crate) const FRAME_SLACK: usize = 256;
/// Frames up to this size are always accepted, whatever the slot sizes say.
pub(crate) const MIN_FRAME_LIMIT: usize = 64 << 10;

/// Read status: the payload is the requested data.
pub(crate) const STATUS_OK: u8 = 0;
/// Read status: the payload is an error text (unknown region, range out of bounds, ...).
pub(crate) const STATUS_REFUSED: u8 = 1;

/// Length of a descriptor: `region_id u64, len u64`.
pub(crate) const DESCRIPTOR_LEN: usize = 16;

/// A decoded read request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadRequest {
    pub read_id: u64,
    pub region_id: u64,
    pub offset: u64,
    pub len: u32,
}

/// A decoded read-response head.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ResponseHead {
    pub read_id: u64,
    pub status: u8,
    pub len: u32,
}

pub(crate) fn put_record_header(buf: &mut impl BufMut, kind: u8, len: u32) {
    buf.put_u8(kind);
    buf.put_u32_le(len);
}

pub(crate) fn put_read_request(buf: &mut impl BufMut, r: &ReadRequest) {
    put_record_header(buf, T_READ_REQUEST, READ_REQUEST_BODY as u32);
    buf.put_u64_le(r.read_id);
    buf.put_u64_le(r.region_id);
    buf.put_u64_le(r.offset);
    buf.put_u32_le(r.len);
}

/// Writes the record header and response head; the caller appends `h.len` payload bytes.
pub(crate) fn put_response_head(buf: &mut impl BufMut, h: &ResponseHead) {
    put_record_header(buf, T_READ_RESPONSE, READ_RESPONSE_HEAD as u32 + h.len);
    buf.put_u64_le(h.read_id);
    buf.put_u8(h.status);
    buf.put_u32_le(h.len);
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

/// Parses a record header from at least [`RECORD_HEADER`] bytes.
pub(crate) fn record_header(b: &[u8]) -> (u8, u32) {
    (b[0], u32_at(b, 1))
}

/// Parses a read-request body of exactly [`READ_REQUEST_BODY`] bytes.
pub(crate) fn read_request(b: &[u8]) -> ReadRequest {
    ReadRequest {
        read_id: u64_at(b, 0),
        region_id: u64_at(b, 8),
        offset: u64_at(b, 16),
        len: u32_at(b, 24),
    }
}

/// Writes the record header and push head; the caller appends `len` bytes.
pub(crate) fn put_push_head(buf: &mut impl BufMut, region_id: u64, len: u32) {
    put_record_header(buf, T_PUSH, PUSH_HEAD as u32 + len);
    buf.put_u64_le(region_id);
    buf.put_u32_le(len);
}

/// Parses a push head of at least [`PUSH_HEAD`] bytes into `(region_id, len)`.
pub(crate) fn push_head(b: &[u8]) -> (u64, u32) {
    (u64_at(b, 0), u32_at(b, 8))
}

/// Parses a read-response head of at least [`READ_RESPONSE_HEAD`] bytes.
pub(crate) fn response_head(b: &[u8]) -> ResponseHead {
    ResponseHead {
        read_id: u64_at(b, 0),
        status: b[8],
        len: u32_at(b, 9),
    }
}

/// Encodes the descriptor of an exposed region; `pushed` when its owner pushes it.
pub(crate) fn descriptor(region_id: u64, len: u64, pushed: bool) -> bytes::Bytes {
    let mut d = bytes::BytesMut::with_capacity(DESCRIPTOR_LEN);
    d.put_u64_le(if pushed {
        region_id | PUSHED
    } else {
        region_id
    });
    d.put_u64_le(len);
    d.freeze()
}

/// A decoded descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Descriptor {
    pub region_id: u64,
    pub len: u64,
    /// The owner pushes the region: wait for it rather than ask.
    pub pushed: bool,
}

/// Decodes a descriptor; anything but 16 bytes is refused.
pub(crate) fn parse_descriptor(d: &[u8]) -> Result<Descriptor> {
    if d.len() != DESCRIPTOR_LEN {
        return Err(Error::Protocol(format!(
            "tcp read descriptor has {} bytes, expected {DESCRIPTOR_LEN} (region id + length); \
             was it made by another provider?",
            d.len()
        )));
    }
    let id = u64_at(d, 0);
    Ok(Descriptor {
        region_id: id & !PUSHED,
        len: u64_at(d, 8),
        pushed: id & PUSHED != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips() {
        let r = ReadRequest {
            read_id: 7,
            region_id: 9,
            offset: 1 << 40,
            len: 12345,
        };
        let mut b = Vec::new();
        put_read_request(&mut b, &r);
        assert_eq!(b.len(), RECORD_HEADER + READ_REQUEST_BODY);
        assert_eq!(
            record_header(&b),
            (T_READ_REQUEST, READ_REQUEST_BODY as u32)
        );
        let p = read_request(&b[RECORD_HEADER..]);
        assert_eq!(
            (p.read_id, p.region_id, p.offset, p.len),
            (7, 9, 1 << 40, 12345)
        );
    }

    #[test]
    fn response_length_covers_payload() {
        let mut b = Vec::new();
        put_response_head(
            &mut b,
            &ResponseHead {
                read_id: 3,
                status: STATUS_OK,
                len: 100,
            },
        );
        assert_eq!(
            record_header(&b),
            (T_READ_RESPONSE, (READ_RESPONSE_HEAD + 100) as u32)
        );
        let h = response_head(&b[RECORD_HEADER..]);
        assert_eq!((h.read_id, h.status, h.len), (3, STATUS_OK, 100));
    }

    #[test]
    fn descriptors_round_trip_and_garbage_is_refused() {
        let d = descriptor(5, 1 << 33, false);
        let want = Descriptor {
            region_id: 5,
            len: 1 << 33,
            pushed: false,
        };
        assert_eq!(parse_descriptor(&d).unwrap(), want);
        let d = descriptor(5, 1 << 33, true);
        let pushed = Descriptor {
            pushed: true,
            ..want
        };
        assert_eq!(parse_descriptor(&d).unwrap(), pushed);
        let e = parse_descriptor(b"short").unwrap_err();
        assert!(e.to_string().contains("expected 16"), "{e}");
    }
}
