//! The call framing: how gRPC calls share one Ibex connection. Every transport message is one
//! *packet* for one call:
//!
//! ```text
//! u32 call id (big endian) | u8 flags | sections, in flag order:
//!   HEAD       u32 len | head block     request: u16 path len, path, header list
//!                                       response: u16 HTTP status, header list
//!   DATA       u32 len | bytes          body bytes, inline (small frames)
//!   DATA_NEXT  u64 len                  body bytes are the message's second part
//!                                       (rendezvous, untouched: large ones go with no copy)
//!   TRAILERS   u32 len | header list    implies END
//!   WINDOW     u32 credit               flow control: the peer consumed this much
//! header list: u16 count, then per entry u16 name len, name, u32 value len, value
//! ```
//!
//! `END` ends the sender's side (client: half-close; server: response done), `RESET` aborts
//! the call, `GOAWAY` (call id 0) tells the client the server takes no new calls. A call is
//! `HEAD *DATA [TRAILERS | END]` each way, as in gRPC's in-memory transport; what is ready at
//! once travels in one packet.

use bytes::{Buf, Bytes, BytesMut};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::error::{Error, Result};

pub(crate) const HEAD: u8 = 1;
pub(crate) const DATA: u8 = 2;
pub(crate) const DATA_NEXT: u8 = 4;
pub(crate) const TRAILERS: u8 = 8;
pub(crate) const END: u8 = 16;
pub(crate) const RESET: u8 = 32;
pub(crate) const WINDOW: u8 = 64;
pub(crate) const GOAWAY: u8 = 128;

/// Room for a packet's own fields beside an inline body frame: a body frame is copied into
/// its packet while both fit the eager threshold, and goes as its own message above that.
pub(crate) const PACKET_ROOM: usize = 512;

/// Bytes a header map takes on the wire (see `put_headers_and`).
fn headers_len(h: &HeaderMap) -> usize {
    2 + h
        .iter()
        .map(|(n, v)| 2 + n.as_str().len() + 4 + v.len())
        .sum::<usize>()
}

/// Writes an inline body frame's length.
fn put_data_len(b: &mut BytesMut, len: usize) -> Result<()> {
    let len = u32::try_from(len).map_err(|_| too_big("inline body frame"))?;
    b.extend_from_slice(&len.to_be_bytes());
    Ok(())
}

/// Bytes kept in front of a [`FrameBuf`] body frame for its packet's fields: call id, flags,
/// a response or request head of the usual size, the frame's length.
const FRAME_ROOM: usize = 256;

/// Bytes kept after a [`FrameBuf`] body frame: a `grpc-status: 0` trailer block and a window.
const FRAME_TAIL: usize = 32;

/// Frames from this size up get room for their packet; smaller ones are copied into it, since
/// writing around a frame costs a shared-buffer header (an allocation and two atomic counts).
const FRAME_ROOM_MIN: usize = 2048;

/// A body frame that writes itself into the buffer it goes to: a packet's own when inline
/// ([`Packet::encode_written`]), so a small message is encoded once, with no buffer of its own.
pub(crate) trait FrameWriter {
    /// The frame's length in bytes.
    fn len(&self) -> usize;
    /// Appends exactly [`FrameWriter::len`] bytes to `b`.
    fn put(&self, b: &mut BytesMut);
}

/// A body frame written behind room for its packet's fields ([`Packet::encode_around`]), so
/// the packet need not copy it. Frames under [`FRAME_ROOM_MIN`] get no room and are copied.
#[derive(Debug)]
pub(crate) enum FrameBuf {
    /// A small frame, exactly sized.
    Plain(Bytes),
    /// `FRAME_ROOM` bytes of room, then the frame, then `FRAME_TAIL` bytes of capacity.
    Room(BytesMut),
}

impl FrameBuf {
    /// The buffer to append a frame of `len` bytes to, with room in front where that
    /// pays; [`FrameBuf::new`] with the same `len` takes it back.
    pub(crate) fn buffer(len: usize) -> BytesMut {
        if len < FRAME_ROOM_MIN {
            return BytesMut::with_capacity(len);
        }
        let mut buf = BytesMut::with_capacity(FRAME_ROOM + len + FRAME_TAIL);
        buf.resize(FRAME_ROOM, 0);
        buf
    }

    /// `frame` in a buffer of its own, for a frame sent apart or through a body; refused if it
    /// wrote another length than it announced, as [`Packet::encode_written`] refuses it.
    pub(crate) fn from_writer(frame: &dyn FrameWriter) -> Result<FrameBuf> {
        let len = frame.len();
        let mut buf = FrameBuf::buffer(len);
        frame.put(&mut buf);
        let buf = FrameBuf::new(buf, len);
        if buf.len() != len {
            return Err(wrong_frame_len(len, buf.len()));
        }
        Ok(buf)
    }

    /// The frame appended to [`FrameBuf::buffer`]`(len)`.
    pub(crate) fn new(buf: BytesMut, len: usize) -> FrameBuf {
        if len < FRAME_ROOM_MIN {
            FrameBuf::Plain(buf.freeze())
        } else {
            FrameBuf::Room(buf)
        }
    }

    /// Whether the frame has room for its packet in front (else [`Packet::encode_around`] copies).
    pub(crate) fn has_room(&self) -> bool {
        matches!(self, FrameBuf::Room(_))
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            FrameBuf::Plain(b) => b.len(),
            FrameBuf::Room(b) => b.len() - FRAME_ROOM,
        }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            FrameBuf::Plain(b) => b,
            FrameBuf::Room(b) => &b[FRAME_ROOM..],
        }
    }

    /// The frame alone, for paths that take plain bytes (no copy).
    pub(crate) fn into_bytes(self) -> Bytes {
        match self {
            FrameBuf::Plain(b) => b,
            FrameBuf::Room(mut b) => {
                b.advance(FRAME_ROOM);
                b.freeze()
            }
        }
    }

    /// Splits off empty room for `before` bytes of packet fields, ending where the frame
    /// starts, and the frame with its tail room; the frame back if `before` does not fit.
    fn split_for(self, before: usize) -> std::result::Result<(BytesMut, BytesMut), FrameBuf> {
        match self {
            FrameBuf::Room(mut room) if before <= FRAME_ROOM => {
                let frame = room.split_off(FRAME_ROOM);
                room.advance(FRAME_ROOM - before);
                room.clear();
                Ok((room, frame))
            }
            other => Err(other),
        }
    }
}

/// HTTP/2's accounting for one header entry beyond its name and value (RFC 7540 6.5.2).
const HEADER_ENTRY_OVERHEAD: usize = 32;

/// What a receiver accepts from its peer before the call framing is even decoded.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Bytes of one header list (head or trailers), counted as HTTP/2 counts them: name +
    /// value + 32 per entry. hyper's (and so stock tonic's) default is 16 KiB.
    pub max_header_list_size: usize,
}

/// The default of [`Limits::max_header_list_size`].
pub(crate) const DEFAULT_MAX_HEADER_LIST_SIZE: usize = 16 << 10;

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_header_list_size: DEFAULT_MAX_HEADER_LIST_SIZE,
        }
    }
}

/// The head block of a packet.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Head {
    /// Client to server: the method path and the request headers. A `PathAndQuery`, so
    /// the server's request URI is the connection's parsed path (see [`Seen`]) and a
    /// generated client's static path goes out without a copy.
    Request {
        path: PathAndQuery,
        headers: HeaderMap,
        /// Sending only: the headers every gRPC request carries, written after `headers` with
        /// no map made for them: `te`, `content-type` and this `user-agent` unless `headers`
        /// has one.
        standard: Option<HeaderValue>,
    },
    /// Server to client: the HTTP status and the response headers.
    Response {
        status: StatusCode,
        headers: HeaderMap,
        /// Sending only: `content-type: application/grpc` and this `date`, written after
        /// `headers` unless it has them, with no map made for them.
        standard: Option<HeaderValue>,
    },
}

/// Where a packet's body bytes are.
#[derive(Debug)]
pub(crate) enum Data {
    Inline(Bytes),
    /// The transport message's second part, of this length (`Connection::send_parts`).
    Next(u64),
}

/// A packet's trailers. Nearly every answer ends with `grpc-status: 0` and nothing else:
/// that one is written and read as a constant block, with no map made for it on either
/// side (a map costs two allocations, hashing and a drop).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Trailers {
    /// `grpc-status: 0`, alone.
    Ok,
    /// `grpc-status: 0`, alone, and already merged into the head's map, as tonic's client
    /// merges a unary answer's trailers into its metadata (received only: the whole
    /// answer of a direct unary call, see [`whole_unary`]).
    OkInHead,
    /// Any other trailers. Boxed: inline, a map would make every packet (copied several times
    /// a call) 96 bytes larger for the rare answer that has one.
    Map(Box<HeaderMap>),
}

/// Whether call `id` is a whole unary call of the direct path: the client gives those odd
/// ids ([`super::calls::CallTable::open_whole`]). Their answer's head map comes with its
/// `grpc-status: 0` trailer merged in ([`Trailers::OkInHead`]), which tonic's own path
/// must not get: a head with `grpc-status` is a trailers-only answer there.
pub(crate) fn whole_unary(id: u32) -> bool {
    id & 1 == 1
}

impl Trailers {
    pub(crate) fn map(m: HeaderMap) -> Trailers {
        Trailers::Map(Box::new(m))
    }

    /// The trailers as a map, as an `http_body` trailers frame carries them.
    pub(crate) fn into_map(self) -> HeaderMap {
        match self {
            Trailers::Map(m) => *m,
            Trailers::Ok | Trailers::OkInHead => {
                let mut m = HeaderMap::with_capacity(1);
                m.insert(GRPC_STATUS.clone(), STATUS_OK.clone());
                m
            }
        }
    }
}

/// One decoded packet.
#[derive(Debug, Default)]
pub(crate) struct Packet {
    pub call: u32,
    /// Leave a head's standard entries off when it has no entries of its own: every
    /// decoder adds them back ([`IMPLIED`]), so the connection's side sets this on every
    /// packet it sends. Never decoded: a decoded head holds them.
    pub compact: bool,
    pub head: Option<Head>,
    pub data: Option<Data>,
    pub trailers: Option<Trailers>,
    pub end: bool,
    pub reset: bool,
    pub window: Option<u32>,
    pub goaway: bool,
}

impl Packet {
    pub(crate) fn new(call: u32) -> Packet {
        Packet {
            call,
            ..Default::default()
        }
    }

    /// Encodes the packet. `Data::Next` only records the length; the caller sends the bytes.
    pub(crate) fn encode(&self) -> Result<Bytes> {
        // Sized exactly, so encoding never grows the buffer.
        let mut b = BytesMut::with_capacity(self.encoded_len());
        let mut flags = self.put_head(&mut b)?;
        match &self.data {
            Some(Data::Inline(d)) => {
                flags |= DATA;
                put_data_len(&mut b, d.len())?;
                b.extend_from_slice(d);
            }
            Some(Data::Next(len)) => {
                flags |= DATA_NEXT;
                b.extend_from_slice(&(*len).to_be_bytes());
            }
            None => {}
        }
        flags |= self.put_tail(&mut b)?;
        b[4] = flags;
        Ok(b.freeze())
    }

    /// Encodes the packet with `frame` written in as its inline body frame (the packet's
    /// own `data` must be `None`): one buffer, the frame encoded straight into it.
    pub(crate) fn encode_written(&self, frame: &dyn FrameWriter) -> Result<Bytes> {
        debug_assert!(
            self.data.is_none(),
            "encode_written takes the body frame itself"
        );
        let len = frame.len();
        let mut b = BytesMut::with_capacity(self.encoded_len() + 4 + len);
        let flags = self.put_head(&mut b)? | DATA;
        put_data_len(&mut b, len)?;
        let at = b.len();
        frame.put(&mut b);
        if b.len() - at != len {
            // The length field is already written: a frame that wrote another length
            // would break the framing of every call on the connection.
            return Err(wrong_frame_len(len, b.len() - at));
        }
        let flags = flags | self.put_tail(&mut b)?;
        b[4] = flags;
        Ok(b.freeze())
    }

    /// Encodes the packet with `frame` as its inline body frame (own `data` must be `None`),
    /// writing the fields into the room around the frame instead of copying it; only a head
    /// too large for the room copies.
    pub(crate) fn encode_around(&self, frame: FrameBuf) -> Result<Bytes> {
        debug_assert!(
            self.data.is_none(),
            "encode_around takes the body frame itself"
        );
        let len = frame.len();
        let before = 5 + self.head_len() + 4;
        let (mut b, body) = match frame.split_for(before) {
            Ok(parts) => parts,
            Err(frame) => {
                let mut b = BytesMut::with_capacity(self.encoded_len() + 4 + len);
                let flags = self.put_head(&mut b)? | DATA;
                put_data_len(&mut b, len)?;
                b.extend_from_slice(frame.as_slice());
                let flags = flags | self.put_tail(&mut b)?;
                b[4] = flags;
                return Ok(b.freeze());
            }
        };
        let flags = self.put_head(&mut b)? | DATA;
        put_data_len(&mut b, len)?;
        // One allocation again when the fields filled the room exactly (the usual case);
        // otherwise `unsplit` copies, still correct.
        b.unsplit(body);
        let flags = flags | self.put_tail(&mut b)?;
        b[4] = flags;
        Ok(b.freeze())
    }

    /// Writes the call id, a placeholder for the flags and the HEAD section; returns the
    /// flags so far.
    #[inline(always)]
    fn put_head(&self, b: &mut BytesMut) -> Result<u8> {
        let mut flags = 0u8;
        b.extend_from_slice(&self.call.to_be_bytes());
        b.extend_from_slice(&[0]);
        if let Some(h) = &self.head {
            flags |= HEAD;
            if h.plain() {
                LAST_HEAD.with_borrow_mut(|last| {
                    if !last.is(h, self.compact) {
                        last.fill(h, self.compact)?;
                    }
                    b.extend_from_slice(&last.bytes);
                    Ok::<(), Error>(())
                })?;
            } else if let (
                Head::Response {
                    status,
                    headers,
                    standard,
                },
                Some(Trailers::OkInHead),
            ) = (h, &self.trailers)
            {
                // Only re-encoding a received packet (the fuzz harness) gets here: its merged
                // ok trailer is written apart again, so that it decodes to itself.
                let mut apart = headers.clone();
                apart.remove(GRPC_STATUS);
                let h = Head::Response {
                    status: *status,
                    headers: apart,
                    standard: standard.clone(),
                };
                put_head_section(b, &h, self.compact)?;
            } else {
                put_head_section(b, h, self.compact)?;
            }
        }
        Ok(flags)
    }

    /// Writes the TRAILERS and WINDOW sections; returns their flags and the END, RESET and
    /// GOAWAY flags.
    #[inline(always)]
    fn put_tail(&self, b: &mut BytesMut) -> Result<u8> {
        let mut flags = 0u8;
        match &self.trailers {
            Some(Trailers::Map(t)) => {
                flags |= TRAILERS;
                let at = reserve_len(b);
                put_headers(b, t)?;
                patch_len(b, at)?;
            }
            Some(Trailers::Ok | Trailers::OkInHead) => {
                flags |= TRAILERS;
                b.extend_from_slice(&STATUS_OK_BLOCK);
            }
            None => {}
        }
        if let Some(w) = self.window {
            flags |= WINDOW;
            b.extend_from_slice(&w.to_be_bytes());
        }
        if self.end {
            flags |= END;
        }
        if self.reset {
            flags |= RESET;
        }
        if self.goaway {
            flags |= GOAWAY;
        }
        Ok(flags)
    }

    /// The bytes of the HEAD section, its length field included (0 without a head).
    #[inline(always)]
    fn head_len(&self) -> usize {
        match &self.head {
            Some(Head::Request {
                path,
                headers,
                standard,
            }) => {
                let extra = standard_headers(headers, standard, true, self.compact).len();
                4 + 2 + path.as_str().len() + headers_len(headers) + extra
            }
            Some(Head::Response {
                headers, standard, ..
            }) => {
                let merged = if matches!(self.trailers, Some(Trailers::OkInHead)) {
                    // Written apart (see `put_head`).
                    headers
                        .get_all(GRPC_STATUS)
                        .iter()
                        .map(|v| 2 + GRPC_STATUS.as_str().len() + 4 + v.len())
                        .sum()
                } else {
                    0
                };
                4 + 2 + headers_len(headers) - merged
                    + standard_headers(headers, standard, false, self.compact).len()
            }
            None => 0,
        }
    }

    /// The size [`Packet::encode`] writes (fields past the wire's limits make encode fail
    /// anyway, so their size here only needs to be a sane capacity).
    fn encoded_len(&self) -> usize {
        let head = self.head_len();
        let data = match &self.data {
            Some(Data::Inline(d)) => 4 + d.len(),
            Some(Data::Next(_)) => 8,
            None => 0,
        };
        let trailers = match &self.trailers {
            Some(Trailers::Map(t)) => 4 + headers_len(t),
            Some(Trailers::Ok | Trailers::OkInHead) => STATUS_OK_BLOCK.len(),
            None => 0,
        };
        5 + head + data + trailers + if self.window.is_some() { 4 } else { 0 }
    }

    /// Decodes a packet; any malformation is a protocol error (the connection is unusable).
    /// `request` says which head the receiver expects (true on the server).
    pub(crate) fn decode(b: Bytes, request: bool, limits: &Limits) -> Result<Packet> {
        Packet::decode_with(b, request, limits, &mut Seen::default())
    }

    /// [`Packet::decode`], with the method paths the connection has seen.
    pub(crate) fn decode_with(
        mut b: Bytes,
        request: bool,
        limits: &Limits,
        seen: &mut Seen,
    ) -> Result<Packet> {
        let call = get_u32(&mut b, "call id")?;
        let flags = get_u8(&mut b, "flags")?;
        let mut p = Packet::new(call);
        let mut response_head = None;
        if flags & HEAD != 0 {
            let mut h = take(&mut b, "head block")?;
            if request {
                let len = get_u16(&mut h, "method path")? as usize;
                need(&h, len, "method path")?;
                let raw = h.split_to(len);
                if !raw.starts_with(b"/") {
                    return Err(proto_err(format!(
                        "method path {:?} does not start with '/'",
                        String::from_utf8_lossy(&raw)
                    )));
                }
                let path = seen.path(raw)?;
                p.head = Some(Head::Request {
                    path,
                    headers: seen.headers(&mut h, limits, 0, Implied::Request)?,
                    standard: None,
                });
                expect_empty(&h, "head block")?;
            } else {
                let code = get_u16(&mut h, "HTTP status")?;
                let status = StatusCode::from_u16(code)
                    .map_err(|_| proto_err(format!("invalid HTTP status {code}")))?;
                // Its map is made once the trailers are known.
                response_head = Some((status, h));
            }
        }
        if flags & DATA != 0 {
            p.data = Some(Data::Inline(take(&mut b, "body frame")?));
        }
        if flags & DATA_NEXT != 0 {
            if p.data.is_some() {
                return Err(proto_err(
                    "packet has both inline and separate body data".into(),
                ));
            }
            p.data = Some(Data::Next(get_u64(&mut b, "body length")?));
        }
        if flags & TRAILERS != 0 {
            let mut t = take(&mut b, "trailers block")?;
            p.trailers = Some(if t[..] == STATUS_OK_BLOCK[4..] {
                Trailers::Ok
            } else {
                let map = get_headers(&mut t, limits, 0, Implied::Never)?;
                expect_empty(&t, "trailers block")?;
                Trailers::map(map)
            });
        }
        if let Some((status, mut h)) = response_head {
            // Room for the trailers tonic's client merges into the headers saves growing the
            // map then; a whole direct answer's lone `grpc-status: 0` is merged here.
            let headers = if whole_unary(call) && p.trailers == Some(Trailers::Ok) {
                let (map, merged) = seen.headers_with_ok(&mut h, limits)?;
                if merged {
                    p.trailers = Some(Trailers::OkInHead);
                }
                map
            } else {
                seen.headers(&mut h, limits, TRAILER_ROOM, Implied::Response)?
            };
            expect_empty(&h, "head block")?;
            p.head = Some(Head::Response {
                status,
                headers,
                standard: None,
            });
        }
        if flags & WINDOW != 0 {
            p.window = Some(get_u32(&mut b, "window credit")?);
        }
        p.end = flags & (END | TRAILERS) != 0;
        p.reset = flags & RESET != 0;
        p.goaway = flags & GOAWAY != 0;
        expect_empty(&b, "packet")?;
        Ok(p)
    }
}

/// Where the parts of a *whole unary packet* lie in a message: a call's head, its one body
/// frame and its end, nothing else (nearly every packet of unary calls; their heads repeat,
/// see [`super::demux::Demux`]). A request is `HEAD | DATA | END`; an answer of a
/// [`whole_unary`] call is `HEAD | DATA | TRAILERS` with trailers `grpc-status: 0` alone.
/// Only the layout is checked here; the head's contents are the general decoder's to judge.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WholeParts {
    pub(crate) call: u32,
    /// The head block, without its length field.
    pub(crate) head: std::ops::Range<usize>,
    /// The body frame, without its length field.
    pub(crate) frame: std::ops::Range<usize>,
}

impl WholeParts {
    /// The parts of `msg` if it is a whole unary packet of the kind the receiver expects
    /// (`request`: true on the server).
    #[inline]
    pub(crate) fn of(msg: &[u8], request: bool) -> Option<WholeParts> {
        // Trailers imply the end: an answer may or may not say END as well.
        let (flags, ignored, tail) = if request {
            (HEAD | DATA | END, 0, 0)
        } else {
            (HEAD | DATA | TRAILERS, END, STATUS_OK_BLOCK.len())
        };
        if msg.len() < 9 + 4 + tail || msg[4] & !ignored != flags {
            return None;
        }
        let call = u32::from_be_bytes([msg[0], msg[1], msg[2], msg[3]]);
        if !request && !whole_unary(call) {
            return None;
        }
        let (body, trailers) = msg.split_at(msg.len() - tail);
        if trailers != &STATUS_OK_BLOCK[..tail] {
            return None;
        }
        let head_len = u32::from_be_bytes([msg[5], msg[6], msg[7], msg[8]]) as usize;
        // The head block, the frame's length field, the frame: exactly what is left.
        let frame_at = 9usize.checked_add(head_len)?.checked_add(4)?;
        if frame_at > body.len() {
            return None;
        }
        let l = &body[frame_at - 4..frame_at];
        let frame_len = u32::from_be_bytes([l[0], l[1], l[2], l[3]]) as usize;
        if body.len() - frame_at != frame_len {
            return None;
        }
        Some(WholeParts {
            call,
            head: 9..9 + head_len,
            frame: frame_at..body.len(),
        })
    }
}

/// Writes a HEAD section: its length, then the request's path or the response's status,
/// then the header list.
fn put_head_section(b: &mut BytesMut, h: &Head, compact: bool) -> Result<()> {
    let at = reserve_len(b);
    match h {
        Head::Request {
            path,
            headers,
            standard,
        } => {
            put_str16(b, path.as_str().as_bytes(), "method path")?;
            let extra = standard_headers(headers, standard, true, compact);
            put_headers_and(b, headers, &extra)?;
        }
        Head::Response {
            status,
            headers,
            standard,
        } => {
            b.extend_from_slice(&(status.as_u16()).to_be_bytes());
            let extra = standard_headers(headers, standard, false, compact);
            put_headers_and(b, headers, &extra)?;
        }
    }
    patch_len(b, at)
}

impl Head {
    /// No headers of its own: its section is made of the path or status and `standard`
    /// alone, which nearly every call repeats.
    fn plain(&self) -> bool {
        match self {
            Head::Request { headers, .. } | Head::Response { headers, .. } => headers.is_empty(),
        }
    }
}

thread_local! {
    /// The HEAD section this thread last wrote for a [`Head::plain`] head: successive calls
    /// repeat it, and copying it costs less than writing it entry by entry. Its bytes follow
    /// from the head alone, so one copy serves every connection.
    static LAST_HEAD: std::cell::RefCell<LastHead> = std::cell::RefCell::default();
}

#[derive(Default)]
struct LastHead {
    request: bool,
    /// Written for a peer that adds the standard entries back ([`Standard::implied`]).
    compact: bool,
    /// A request's path, or a response's status as its two bytes.
    what: Vec<u8>,
    standard: Option<HeaderValue>,
    /// The section, length included.
    bytes: BytesMut,
}

impl LastHead {
    fn is(&self, h: &Head, compact: bool) -> bool {
        if self.compact != compact {
            return false;
        }
        let (request, what, standard) = match h {
            Head::Request { path, standard, .. } => (true, path.as_str().as_bytes(), standard),
            Head::Response {
                status, standard, ..
            } => {
                let code = status.as_u16().to_be_bytes();
                return !self.request
                    && self.what == code
                    && same_value(&self.standard, standard)
                    && !self.bytes.is_empty();
            }
        };
        self.request == request
            && self.what == what
            && same_value(&self.standard, standard)
            && !self.bytes.is_empty()
    }

    fn fill(&mut self, h: &Head, compact: bool) -> Result<()> {
        self.bytes.clear();
        self.compact = compact;
        // Emptied first: a failed write leaves nothing that matches.
        let written = put_head_section(&mut self.bytes, h, compact);
        if written.is_err() {
            self.bytes.clear();
            return written;
        }
        let standard = match h {
            Head::Request { path, standard, .. } => {
                self.request = true;
                self.what.clear();
                self.what.extend_from_slice(path.as_str().as_bytes());
                standard
            }
            Head::Response {
                status, standard, ..
            } => {
                self.request = false;
                self.what.clear();
                self.what.extend_from_slice(&status.as_u16().to_be_bytes());
                standard
            }
        };
        self.standard.clone_from(standard);
        Ok(())
    }
}

fn same_value(a: &Option<HeaderValue>, b: &Option<HeaderValue>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => a.as_bytes() == b.as_bytes(),
        _ => false,
    }
}

fn proto_err(why: String) -> Error {
    Error::Protocol(format!("gRPC call framing: {why}"))
}

/// A body frame whose writer wrote another length than it announced (a message whose
/// encoding disagrees with its `encoded_len`): refused before anything is sent.
fn wrong_frame_len(announced: usize, wrote: usize) -> Error {
    Error::Encode(format!(
        "a body frame announced {announced} bytes and wrote {wrote}: the message's encoding disagrees with its encoded_len; fix its prost::Message impl"
    ))
}

fn too_big(what: &str) -> Error {
    Error::Protocol(format!(
        "gRPC call framing: {what} exceeds the format's 4 GiB field"
    ))
}

fn reserve_len(b: &mut BytesMut) -> usize {
    let at = b.len();
    b.extend_from_slice(&0u32.to_be_bytes());
    at
}

fn patch_len(b: &mut BytesMut, at: usize) -> Result<()> {
    let len = u32::try_from(b.len() - at - 4).map_err(|_| too_big("header block"))?;
    b[at..at + 4].copy_from_slice(&len.to_be_bytes());
    Ok(())
}

fn put_str16(b: &mut BytesMut, s: &[u8], what: &str) -> Result<()> {
    let len = u16::try_from(s.len())
        .map_err(|_| Error::Protocol(format!("gRPC call framing: {what} longer than 64 KiB")))?;
    b.extend_from_slice(&len.to_be_bytes());
    b.extend_from_slice(s);
    Ok(())
}

/// The block of [`Trailers::Ok`], as [`put_headers`] writes `grpc-status: 0` behind the
/// block's length: one entry, the name, the value.
const STATUS_OK_BLOCK: [u8; 24] = {
    let mut b = [0u8; 24];
    // Block length (20), entry count (1), name length (11).
    let head: [u8; 8] = [0, 0, 0, 20, 0, 1, 0, 11];
    let name = b"grpc-status";
    let mut i = 0;
    while i < head.len() {
        b[i] = head[i];
        i += 1;
    }
    let mut j = 0;
    while j < name.len() {
        b[8 + j] = name[j];
        j += 1;
    }
    // Value length (1) and the value.
    b[19] = 0;
    b[20] = 0;
    b[21] = 0;
    b[22] = 1;
    b[23] = b'0';
    b
};

fn put_headers(b: &mut BytesMut, h: &HeaderMap) -> Result<()> {
    put_headers_and(b, h, &Standard::NONE)
}

/// The entries [`Head::Request::standard`] stands for: constant ones, encoded at compile time
/// so they are copied rather than written entry by entry, then at most one that varies.
struct Standard<'a> {
    fixed: &'static [u8],
    fixed_count: u16,
    /// The constant entries are left off the wire and marked ([`IMPLIED`]): the peer
    /// announced that it adds them back.
    implied: bool,
    tail: Option<(&'a HeaderName, &'a HeaderValue)>,
}

impl Standard<'_> {
    const NONE: Standard<'static> = Standard {
        fixed: &[],
        fixed_count: 0,
        implied: false,
        tail: None,
    };

    fn count(&self) -> usize {
        usize::from(self.fixed_count) + usize::from(self.tail.is_some())
    }

    fn len(&self) -> usize {
        self.fixed.len()
            + self
                .tail
                .map_or(0, |(n, v)| 2 + n.as_str().len() + 4 + v.len())
    }
}

/// One header entry as the wire has it (name length, name, value length, value), at
/// compile time.
const fn wire_entry<const N: usize>(name: &[u8], value: &[u8]) -> [u8; N] {
    assert!(N == 6 + name.len() + value.len());
    let mut b = [0u8; N];
    let (nl, vl) = (name.len(), value.len());
    b[0] = (nl >> 8) as u8;
    b[1] = nl as u8;
    let mut i = 0;
    while i < nl {
        b[2 + i] = name[i];
        i += 1;
    }
    let at = 2 + nl;
    b[at] = (vl >> 24) as u8;
    b[at + 1] = (vl >> 16) as u8;
    b[at + 2] = (vl >> 8) as u8;
    b[at + 3] = vl as u8;
    let mut j = 0;
    while j < vl {
        b[at + 4 + j] = value[j];
        j += 1;
    }
    b
}

const CONTENT_TYPE_ENTRY: [u8; 34] = wire_entry(b"content-type", b"application/grpc");
const TE_ENTRY: [u8; 16] = wire_entry(b"te", b"trailers");
/// `te: trailers`, then `content-type: application/grpc`.
const REQUEST_ENTRIES: [u8; 50] = {
    let mut b = [0u8; 50];
    let mut i = 0;
    while i < 50 {
        b[i] = if i < 16 {
            TE_ENTRY[i]
        } else {
            CONTENT_TYPE_ENTRY[i - 16]
        };
        i += 1;
    }
    b
};

/// The entries a head's `standard` stands for, after `headers`: on a request `te`,
/// `content-type` and the user agent unless `headers` has one; on a response `content-type`
/// and the date, each unless `headers` has it. With `compact` (the peer adds the constant
/// ones back, [`IMPLIED`]) a head with no headers of its own leaves them off the wire.
fn standard_headers<'a>(
    headers: &HeaderMap,
    standard: &'a Option<HeaderValue>,
    request: bool,
    compact: bool,
) -> Standard<'a> {
    static USER_AGENT: HeaderName = http::header::USER_AGENT;
    static DATE: HeaderName = http::header::DATE;
    let Some(v) = standard else {
        return Standard::NONE;
    };
    let mut s = if request {
        Standard {
            fixed: &REQUEST_ENTRIES,
            fixed_count: 2,
            implied: false,
            tail: (!headers.contains_key(&USER_AGENT)).then_some((&USER_AGENT, v)),
        }
    } else {
        let content_type = !headers.contains_key(http::header::CONTENT_TYPE);
        Standard {
            fixed: if content_type {
                &CONTENT_TYPE_ENTRY
            } else {
                &[]
            },
            fixed_count: u16::from(content_type),
            implied: false,
            tail: (!headers.contains_key(&DATE)).then_some((&DATE, v)),
        }
    };
    // Only with no entries of its own: the implied ones then come first on both sides, in
    // the order the written ones would have had.
    if compact && headers.is_empty() && s.fixed_count > 0 {
        s.fixed = &[];
        s.fixed_count = 0;
        s.implied = true;
    }
    s
}

/// `h`'s entries, then `extra`'s, as one header list.
fn put_headers_and(b: &mut BytesMut, h: &HeaderMap, extra: &Standard<'_>) -> Result<()> {
    let n = u16::try_from(h.len() + extra.count())
        .ok()
        .filter(|n| n & IMPLIED == 0)
        .ok_or_else(|| Error::Protocol("gRPC call framing: more than 32767 headers".into()))?;
    let n = if extra.implied { n | IMPLIED } else { n };
    b.extend_from_slice(&n.to_be_bytes());
    for (name, value) in h {
        put_entry(b, name, value)?;
    }
    b.extend_from_slice(extra.fixed);
    if let Some((name, value)) = extra.tail {
        put_entry(b, name, value)?;
    }
    Ok(())
}

fn put_entry(b: &mut BytesMut, name: &HeaderName, value: &HeaderValue) -> Result<()> {
    put_str16(b, name.as_str().as_bytes(), "header name")?;
    b.extend_from_slice(
        &(u32::try_from(value.len()).map_err(|_| too_big("header value"))?).to_be_bytes(),
    );
    b.extend_from_slice(value.as_bytes());
    Ok(())
}

fn need(b: &Bytes, n: usize, what: &str) -> Result<()> {
    if b.remaining() < n {
        return Err(proto_err(format!(
            "truncated {what}: need {n} bytes, {} left",
            b.remaining()
        )));
    }
    Ok(())
}

fn get_u8(b: &mut Bytes, what: &str) -> Result<u8> {
    need(b, 1, what)?;
    Ok(b.get_u8())
}

fn get_u16(b: &mut Bytes, what: &str) -> Result<u16> {
    need(b, 2, what)?;
    Ok(b.get_u16())
}

fn get_u32(b: &mut Bytes, what: &str) -> Result<u32> {
    need(b, 4, what)?;
    Ok(b.get_u32())
}

fn get_u64(b: &mut Bytes, what: &str) -> Result<u64> {
    need(b, 8, what)?;
    Ok(b.get_u64())
}

fn take(b: &mut Bytes, what: &str) -> Result<Bytes> {
    let len = get_u32(b, what)? as usize;
    need(b, len, what)?;
    Ok(b.split_to(len))
}

/// Entries a response head's map is made with room for beyond its own (see
/// [`Packet::decode`]): `grpc-status`, `grpc-message` and a few more.
const TRAILER_ROOM: usize = 4;

/// Bit 15 of a header list's entry count: the standard entries of its kind come first
/// without being written ([`Implied`]); the rest of the count is the entries written.
const IMPLIED: u16 = 0x8000;

/// Which header list is decoded: what [`IMPLIED`] stands for in it.
#[derive(Clone, Copy)]
enum Implied {
    /// `te: trailers`, `content-type: application/grpc`.
    Request,
    /// `content-type: application/grpc`.
    Response,
    /// Trailers: nothing; the bit is malformed there.
    Never,
}

impl Implied {
    fn entries(self) -> &'static [(&'static HeaderName, &'static HeaderValue)] {
        static TE: HeaderName = http::header::TE;
        static CONTENT_TYPE: HeaderName = http::header::CONTENT_TYPE;
        static REQUEST: [(&HeaderName, &HeaderValue); 2] =
            [(&TE, &KNOWN_VALUES[2]), (&CONTENT_TYPE, &KNOWN_VALUES[0])];
        match self {
            Implied::Request => &REQUEST,
            Implied::Response => &REQUEST[1..],
            Implied::Never => &[],
        }
    }
}

/// Decodes a header list into a map with room for `room` more entries.
fn get_headers(b: &mut Bytes, limits: &Limits, room: usize, kind: Implied) -> Result<HeaderMap> {
    let count = get_u16(b, "header count")?;
    let implied = if count & IMPLIED == 0 {
        &[][..]
    } else if matches!(kind, Implied::Never) {
        return Err(proto_err(
            "a trailers block marks standard entries as implied; only heads may".into(),
        ));
    } else {
        kind.entries()
    };
    let n = usize::from(count & !IMPLIED);
    // Checked before anything is allocated: the count sizes the map.
    let max_entries = limits.max_header_list_size / HEADER_ENTRY_OVERHEAD;
    if n + implied.len() > max_entries {
        return Err(header_limit(format!(
            "{} header entries exceed the {max_entries} that a header list of at most {} bytes can hold",
            n + implied.len(),
            limits.max_header_list_size
        )));
    }
    let mut h = HeaderMap::with_capacity(n + implied.len() + room);
    let mut size = 0usize;
    // First, as the sender would have written them before its one varying entry.
    for (name, value) in implied {
        size += name.as_str().len() + value.len() + HEADER_ENTRY_OVERHEAD;
        h.append((*name).clone(), (*value).clone());
    }
    if size > limits.max_header_list_size {
        return Err(header_limit(format!(
            "the header list exceeds {} bytes (name + value + 32 per entry)",
            limits.max_header_list_size
        )));
    }
    for _ in 0..n {
        let len = get_u16(b, "header name")? as usize;
        need(b, len, "header name")?;
        // Parsed from the slice: a name is copied (or matched to a standard one) anyway, so
        // it needs no `Bytes` of its own (two reference-count updates).
        let name = header_name(&b[..len])?;
        b.advance(len);
        let vlen = get_u32(b, "header value")? as usize;
        need(b, vlen, "header value")?;
        size = size.saturating_add(len + vlen + HEADER_ENTRY_OVERHEAD);
        if size > limits.max_header_list_size {
            return Err(header_limit(format!(
                "the header list exceeds {} bytes (name + value + 32 per entry)",
                limits.max_header_list_size
            )));
        }
        let value = match known_value(&b[..vlen]) {
            Some(known) => {
                b.advance(vlen);
                known.clone()
            }
            None => HeaderValue::from_maybe_shared(b.split_to(vlen))
                .map_err(|_| proto_err(format!("invalid value for header {name}")))?,
        };
        h.append(name, value);
    }
    Ok(h)
}

/// What one connection's decoder has seen, so that what repeats is parsed once:
/// - method paths: a connection calls a handful of methods, and parsing a path checks every
///   byte. The first [`Seen::MAX_PATHS`] distinct paths are kept; others are parsed each
///   time, so a peer sending many distinct paths gains nothing and costs no memory;
/// - the last head's header list: a list seen twice in a row is kept as its map, and the
///   next identical list is a clone of it instead of parsing, matching and hashing each
///   entry. A list that changes every call costs a copy of its bytes (up to
///   [`Seen::MAX_HEADERS`]).
#[derive(Debug, Default)]
pub(crate) struct Seen {
    paths: Vec<PathAndQuery>,
    /// The last header list's bytes, and its map once the same bytes came twice in a row.
    last_headers: Vec<u8>,
    last_map: Option<HeaderMap>,
    /// `last_map` with `grpc-status: 0` merged in ([`Seen::headers_with_ok`]).
    last_ok: Option<HeaderMap>,
}

impl Seen {
    const MAX_PATHS: usize = 16;
    /// Longer header lists are parsed every time.
    const MAX_HEADERS: usize = 512;

    /// Decodes the header list that makes up the rest of `b`.
    fn headers(
        &mut self,
        b: &mut Bytes,
        limits: &Limits,
        room: usize,
        kind: Implied,
    ) -> Result<HeaderMap> {
        if b.len() > Self::MAX_HEADERS {
            return get_headers(b, limits, room, kind);
        }
        if self.last_headers != b[..] {
            self.last_headers.clear();
            self.last_headers.extend_from_slice(b);
            self.last_map = None;
            self.last_ok = None;
            return get_headers(b, limits, room, kind);
        }
        b.advance(b.len());
        if let Some(map) = &self.last_map {
            if room == 0 {
                return Ok(map.clone());
            }
            // A clone has no spare room for the trailers tonic's client merges into the head
            // (a reallocation then): a map with room, filled from the kept one, is cheaper.
            let mut m = HeaderMap::with_capacity(map.len() + room);
            for (k, v) in map {
                m.append(k.clone(), v.clone());
            }
            return Ok(m);
        }
        // Parsed from bytes of its own: the kept map must not hold the packet's buffer.
        let mut own = Bytes::copy_from_slice(&self.last_headers);
        let map = get_headers(&mut own, limits, room, kind)?;
        expect_empty(&own, "head block")?;
        self.last_map = Some(map.clone());
        Ok(map)
    }

    /// A whole unary answer's head with its lone `grpc-status: 0` trailer merged in, and
    /// `true`; the head alone and `false` when it has a `grpc-status` of its own (a
    /// trailers-only answer, which the caller judges as such).
    fn headers_with_ok(&mut self, b: &mut Bytes, limits: &Limits) -> Result<(HeaderMap, bool)> {
        let small = b.len() <= Self::MAX_HEADERS;
        if small
            && let Some(map) = &self.last_ok
            && self.last_headers == b[..]
        {
            b.advance(b.len());
            return Ok((map.clone(), true));
        }
        let mut map = self.headers(b, limits, TRAILER_ROOM, Implied::Response)?;
        if map.contains_key(GRPC_STATUS) {
            return Ok((map, false));
        }
        map.insert(GRPC_STATUS.clone(), STATUS_OK.clone());
        // Kept once the same head came twice (`headers` keeps its map then).
        if small && self.last_map.is_some() {
            self.last_ok = Some(map.clone());
        }
        Ok((map, true))
    }

    fn path(&mut self, raw: Bytes) -> Result<PathAndQuery> {
        if let Some(p) = self
            .paths
            .iter()
            .find(|p| p.as_str().as_bytes() == raw.as_ref())
        {
            return Ok(p.clone());
        }
        // A copy of its own, so that a cached path does not keep the packet's buffer.
        let owned = if self.paths.len() < Self::MAX_PATHS {
            Bytes::copy_from_slice(&raw)
        } else {
            raw
        };
        let path = PathAndQuery::from_maybe_shared(owned.clone()).map_err(|_| {
            proto_err(format!(
                "bad method path {:?}",
                String::from_utf8_lossy(&owned)
            ))
        })?;
        if self.paths.len() < Self::MAX_PATHS {
            self.paths.push(path.clone());
        }
        Ok(path)
    }
}

/// Names that gRPC calls carry, made once: a parsed name that is not one of HTTP's standard
/// ones is otherwise copied into an allocation of its own. A `static`, not a `const`: a const
/// array is built and dropped anew at every use.
static KNOWN_NAMES: [HeaderName; 10] = [
    HeaderName::from_static("grpc-status"),
    HeaderName::from_static("grpc-message"),
    HeaderName::from_static("grpc-timeout"),
    HeaderName::from_static("grpc-encoding"),
    HeaderName::from_static("grpc-accept-encoding"),
    HeaderName::from_static("grpc-status-details-bin"),
    HeaderName::from_static("content-type"),
    HeaderName::from_static("user-agent"),
    HeaderName::from_static("te"),
    HeaderName::from_static("date"),
];

/// Values nearly every call carries (`content-type`, `grpc-status: 0`, `te`): a static one
/// is neither validated byte by byte nor holds a reference to the packet's buffer.
static KNOWN_VALUES: [HeaderValue; 3] = [
    HeaderValue::from_static("application/grpc"),
    HeaderValue::from_static("0"),
    HeaderValue::from_static("trailers"),
];

/// `grpc-timeout`, looked up once per call on each side: a lookup by `&str` parses and
/// validates the name every time.
pub(crate) static GRPC_TIMEOUT: &HeaderName = &KNOWN_NAMES[2];
pub(crate) static GRPC_STATUS: &HeaderName = &KNOWN_NAMES[0];
pub(crate) static GRPC_MESSAGE: &HeaderName = &KNOWN_NAMES[1];
pub(crate) static GRPC_ENCODING: &HeaderName = &KNOWN_NAMES[3];
pub(crate) static GRPC_ACCEPT_ENCODING: &HeaderName = &KNOWN_NAMES[4];
/// `content-type: application/grpc` and `grpc-status: 0`.
pub(crate) static GRPC_CONTENT_TYPE: &HeaderValue = &KNOWN_VALUES[0];
pub(crate) static STATUS_OK: &HeaderValue = &KNOWN_VALUES[1];

fn header_name(b: &[u8]) -> Result<HeaderName> {
    if let Some(known) = known_name(b) {
        return Ok(known.clone());
    }
    HeaderName::from_bytes(b).map_err(|_| proto_err("invalid header name".into()))
}

/// One of [`KNOWN_NAMES`], by a `match` on the bytes (branching on the length first) rather
/// than comparing each name in turn.
fn known_name(b: &[u8]) -> Option<&'static HeaderName> {
    let i = match b {
        b"grpc-status" => 0,
        b"grpc-message" => 1,
        b"grpc-timeout" => 2,
        b"grpc-encoding" => 3,
        b"grpc-accept-encoding" => 4,
        b"grpc-status-details-bin" => 5,
        b"content-type" => 6,
        b"user-agent" => 7,
        b"te" => 8,
        b"date" => 9,
        _ => return None,
    };
    Some(&KNOWN_NAMES[i])
}

/// One of [`KNOWN_VALUES`], as [`known_name`].
fn known_value(b: &[u8]) -> Option<&'static HeaderValue> {
    let i = match b {
        b"application/grpc" => 0,
        b"0" => 1,
        b"trailers" => 2,
        _ => return None,
    };
    Some(&KNOWN_VALUES[i])
}

fn header_limit(why: String) -> Error {
    proto_err(format!(
        "{why}; raise max_header_list_size on the receiving side (grpc::Builder or Channel) if this peer is trusted"
    ))
}

fn expect_empty(b: &Bytes, what: &str) -> Result<()> {
    if b.has_remaining() {
        return Err(proto_err(format!(
            "{} unexpected bytes after the {what}",
            b.remaining()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BufMut;

    #[test]
    fn the_known_names_and_values_are_found_by_their_bytes() {
        for n in &KNOWN_NAMES {
            assert_eq!(known_name(n.as_str().as_bytes()), Some(n), "{n}");
        }
        for v in &KNOWN_VALUES {
            assert_eq!(known_value(v.as_bytes()), Some(v), "{v:?}");
        }
        assert_eq!(known_name(b"x-te"), None);
        assert_eq!(known_name(b"Te"), None);
        assert_eq!(known_value(b"00"), None);
    }

    /// A packet's bytes as written with no [`LAST_HEAD`] copy.
    fn written_afresh(p: &Packet) -> Vec<u8> {
        let mut b = BytesMut::new();
        b.extend_from_slice(&p.call.to_be_bytes());
        b.extend_from_slice(&[HEAD | END]);
        put_head_section(&mut b, p.head.as_ref().unwrap(), p.compact).unwrap();
        b.to_vec()
    }

    #[test]
    fn a_repeated_plain_head_is_copied_and_any_change_is_written_anew() {
        let request = |path: &'static str, ua: &'static str| {
            let mut p = Packet::new(7);
            p.head = Some(Head::Request {
                path: PathAndQuery::from_static(path),
                headers: HeaderMap::new(),
                standard: Some(HeaderValue::from_static(ua)),
            });
            p.end = true;
            p
        };
        let response = |status: StatusCode, date: Option<&'static str>| {
            let mut p = Packet::new(7);
            p.head = Some(Head::Response {
                status,
                headers: HeaderMap::new(),
                standard: date.map(HeaderValue::from_static),
            });
            p.end = true;
            p
        };
        let mut with_metadata = request("/a.S/M", "ua/1");
        if let Some(Head::Request { headers, .. }) = &mut with_metadata.head {
            headers.insert("x-id", HeaderValue::from_static("1"));
        }
        // Each after the one before: hits, and misses on every part of the key.
        let packets = [
            request("/a.S/M", "ua/1"),
            request("/a.S/M", "ua/1"),
            request("/a.S/N", "ua/1"),
            request("/a.S/N", "ua/2"),
            with_metadata,
            request("/a.S/N", "ua/2"),
            response(StatusCode::OK, Some("Thu, 26 Nov 2026 16:00:00 GMT")),
            response(StatusCode::OK, Some("Thu, 26 Nov 2026 16:00:00 GMT")),
            response(StatusCode::OK, Some("Thu, 26 Nov 2026 16:00:01 GMT")),
            response(StatusCode::NOT_FOUND, Some("Thu, 26 Nov 2026 16:00:01 GMT")),
            response(StatusCode::NOT_FOUND, None),
        ];
        for p in &packets {
            let encoded = p.encode().unwrap();
            assert_eq!(encoded[..], written_afresh(p)[..], "{p:?}");
            let back = Packet::decode(
                encoded,
                p.head
                    .as_ref()
                    .is_some_and(|h| matches!(h, Head::Request { .. })),
                &Limits::default(),
            )
            .unwrap();
            assert!(back.end && back.head.is_some());
        }
        // A request and a response never stand in for each other, even with equal bytes
        // where the path would be.
        let mut odd = Packet::new(7);
        odd.head = Some(Head::Request {
            path: PathAndQuery::from_static("/"),
            headers: HeaderMap::new(),
            standard: None,
        });
        odd.end = true;
        for p in [response(StatusCode::OK, None), odd] {
            assert_eq!(p.encode().unwrap()[..], written_afresh(&p)[..]);
        }
    }

    /// A head's entries as decoded, in order.
    fn entries(p: &Packet) -> Vec<(String, Vec<u8>)> {
        let (Some(Head::Request { headers, .. }) | Some(Head::Response { headers, .. })) = &p.head
        else {
            panic!("no head");
        };
        headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn compact_heads_leave_the_standard_entries_off_and_decode_to_the_same_map() {
        let request = |headers: HeaderMap, compact: bool| {
            let mut p = Packet::new(7);
            p.head = Some(Head::Request {
                path: PathAndQuery::from_static("/a.S/M"),
                headers,
                standard: Some(HeaderValue::from_static("ua/1")),
            });
            p.end = true;
            p.compact = compact;
            p
        };
        let response = |headers: HeaderMap, compact: bool| {
            let mut p = Packet::new(7);
            p.head = Some(Head::Response {
                status: StatusCode::OK,
                headers,
                standard: Some(HeaderValue::from_static("Thu, 26 Nov 2026 16:00:00 GMT")),
            });
            p.end = true;
            p.compact = compact;
            p
        };
        let mut own = HeaderMap::new();
        own.insert("x-id", HeaderValue::from_static("1"));
        // Whole and compact, one after the other on one thread (the head cache must keep
        // the two forms apart), plain and with entries of their own.
        for (whole, compact, saved, request_side) in [
            (
                request(HeaderMap::new(), false),
                request(HeaderMap::new(), true),
                50,
                true,
            ),
            (
                response(HeaderMap::new(), false),
                response(HeaderMap::new(), true),
                34,
                false,
            ),
            (
                request(own.clone(), false),
                request(own.clone(), true),
                0,
                true,
            ),
            (
                response(own.clone(), false),
                response(own.clone(), true),
                0,
                false,
            ),
        ] {
            let w = whole.encode().unwrap();
            let c = compact.encode().unwrap();
            assert_eq!(w.len() - c.len(), saved, "{compact:?}");
            assert_eq!(c[..], written_afresh(&compact)[..]);
            assert_eq!(w[..], written_afresh(&whole)[..]);
            let lim = Limits::default();
            let (w, c) = (
                Packet::decode(w, request_side, &lim).unwrap(),
                Packet::decode(c, request_side, &lim).unwrap(),
            );
            assert_eq!(entries(&w), entries(&c));
        }
        // Only heads imply entries, and they count against the limit: 511 written and the
        // two a request implies are 513, one more than 16 KiB holds.
        let mut b = BytesMut::new();
        b.put_u32(1);
        b.put_u8(HEAD);
        let mut h = BytesMut::new();
        h.put_u16(2);
        h.put_slice(b"/a");
        h.put_u16(IMPLIED | 511);
        b.put_u32(h.len() as u32);
        b.put_slice(&h);
        let e = Packet::decode(b.freeze(), true, &Limits::default()).unwrap_err();
        assert!(e.to_string().contains("513 header entries"), "{e}");
    }

    #[test]
    fn a_whole_direct_answer_comes_with_its_ok_trailer_in_the_head() {
        let answer = |call: u32, head: HeaderMap, trailers: Trailers| {
            let mut p = Packet::new(call);
            p.head = Some(Head::Response {
                status: StatusCode::OK,
                headers: head,
                standard: None,
            });
            p.data = Some(Data::Inline(Bytes::from_static(b"\0\0\0\0\0")));
            p.trailers = Some(trailers);
            p.encode().unwrap()
        };
        let mut seen = Seen::default();
        let limits = Limits::default();
        let mut head = HeaderMap::new();
        head.insert("x-a", HeaderValue::from_static("1"));
        // Three times: parsed, parsed and kept, then the kept map.
        for _ in 0..3 {
            let p = Packet::decode_with(
                answer(5, head.clone(), Trailers::Ok),
                false,
                &limits,
                &mut seen,
            )
            .unwrap();
            assert_eq!(p.trailers, Some(Trailers::OkInHead));
            let Some(Head::Response { headers, .. }) = p.head else {
                panic!("no head")
            };
            assert_eq!(headers.len(), 2);
            assert_eq!(headers[GRPC_STATUS], "0");
            assert_eq!(headers["x-a"], "1");
        }
        assert!(seen.last_ok.is_some());
        // An ordinary call's answer (even id) keeps its trailers apart.
        let p = Packet::decode_with(
            answer(6, head.clone(), Trailers::Ok),
            false,
            &limits,
            &mut seen,
        )
        .unwrap();
        assert_eq!(p.trailers, Some(Trailers::Ok));
        assert!(matches!(p.head, Some(Head::Response { ref headers, .. }) if headers.len() == 1));
        // Other trailers are not merged.
        let mut t = HeaderMap::new();
        t.insert("grpc-status", HeaderValue::from_static("3"));
        let p = Packet::decode_with(
            answer(5, head.clone(), Trailers::map(t)),
            false,
            &limits,
            &mut seen,
        )
        .unwrap();
        assert!(matches!(p.trailers, Some(Trailers::Map(_))));
        assert!(matches!(p.head, Some(Head::Response { ref headers, .. }) if headers.len() == 1));
        // A head with a status of its own stays as it came, for the caller to judge.
        let mut own = HeaderMap::new();
        own.insert("grpc-status", HeaderValue::from_static("5"));
        for _ in 0..3 {
            let p = Packet::decode_with(
                answer(7, own.clone(), Trailers::Ok),
                false,
                &limits,
                &mut seen,
            )
            .unwrap();
            assert_eq!(p.trailers, Some(Trailers::Ok));
            assert!(
                matches!(p.head, Some(Head::Response { ref headers, .. }) if headers[GRPC_STATUS] == "5")
            );
        }
        // A different head after the kept one is parsed, not mistaken for it.
        let mut other = HeaderMap::new();
        other.insert("x-a", HeaderValue::from_static("2"));
        let p =
            Packet::decode_with(answer(9, other, Trailers::Ok), false, &limits, &mut seen).unwrap();
        assert!(
            matches!(p.head, Some(Head::Response { ref headers, .. }) if headers["x-a"] == "2")
        );
    }

    #[test]
    fn a_merged_answer_re_encodes_as_it_came() {
        let mut p = Packet::new(3);
        let mut head = HeaderMap::new();
        head.insert("content-type", HeaderValue::from_static("application/grpc"));
        p.head = Some(Head::Response {
            status: StatusCode::OK,
            headers: head,
            standard: None,
        });
        p.trailers = Some(Trailers::Ok);
        p.end = true;
        let wire = p.encode().unwrap();
        let merged = Packet::decode(wire.clone(), false, &Limits::default()).unwrap();
        assert_eq!(merged.trailers, Some(Trailers::OkInHead));
        assert_eq!(merged.encode().unwrap(), wire);
        // The same trailer spelt otherwise (a map, `grpc-Status`) decodes apart, and
        // re-encodes to the usual block, which then merges.
        let mut t = HeaderMap::new();
        t.insert("grpc-status", HeaderValue::from_static("0"));
        p.trailers = Some(Trailers::map(t));
        let again = Packet::decode(p.encode().unwrap(), false, &Limits::default()).unwrap();
        assert_eq!(again.trailers, Some(Trailers::OkInHead));
        assert_eq!(again.encode().unwrap(), wire);
    }

    struct Writes(&'static [u8], usize);

    impl FrameWriter for Writes {
        fn len(&self) -> usize {
            self.1
        }
        fn put(&self, b: &mut BytesMut) {
            b.extend_from_slice(self.0);
        }
    }

    #[test]
    fn a_written_frame_is_the_inline_frame_and_a_wrong_length_is_refused() {
        let mut p = Packet::new(3);
        p.head = Some(Head::Response {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            standard: None,
        });
        p.trailers = Some(Trailers::Ok);
        let written = p.encode_written(&Writes(b"\0\0\0\0\x02hi", 7)).unwrap();
        p.data = Some(Data::Inline(Bytes::from_static(b"\0\0\0\0\x02hi")));
        assert_eq!(written, p.encode().unwrap());
        assert_eq!(
            FrameBuf::from_writer(&Writes(b"abc", 3))
                .unwrap()
                .into_bytes(),
            Bytes::from_static(b"abc")
        );
        // This side's fault, named as such: not a protocol violation by the peer.
        let e = FrameBuf::from_writer(&Writes(b"abc", 4)).unwrap_err();
        assert!(
            matches!(e, Error::Encode(ref m) if m.contains("announced 4 bytes and wrote 3")),
            "{e}"
        );
        p.data = None;
        let e = p.encode_written(&Writes(b"abc", 4)).unwrap_err();
        assert!(
            matches!(e, Error::Encode(ref m) if m.contains("announced 4 bytes and wrote 3")),
            "{e}"
        );
    }

    fn headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/grpc"));
        h.append("x-multi", HeaderValue::from_static("a"));
        h.append("x-multi", HeaderValue::from_static("b"));
        h.insert("x-data-bin", HeaderValue::from_static("AAEC/w"));
        h
    }

    #[test]
    fn method_paths_are_parsed_once_per_connection_and_the_cache_is_bounded() {
        let mut paths = Seen::default();
        let packet = Bytes::from_static(b"..../pkg.Svc/Method....");
        let a = paths.path(packet.slice(4..19)).unwrap();
        assert_eq!(a.as_str(), "/pkg.Svc/Method");
        let b = paths
            .path(Bytes::copy_from_slice(b"/pkg.Svc/Method"))
            .unwrap();
        assert_eq!(b, a);
        assert_eq!(paths.paths.len(), 1, "a path seen again is not added again");
        for i in 0..100 {
            let p = paths.path(Bytes::from(format!("/pkg.Svc/M{i}"))).unwrap();
            assert_eq!(p.as_str(), format!("/pkg.Svc/M{i}"));
        }
        assert_eq!(
            paths.paths.len(),
            Seen::MAX_PATHS,
            "a peer's distinct paths cost no memory"
        );
        let e = paths.path(Bytes::from_static(b"/bad path")).unwrap_err();
        assert!(e.to_string().contains("bad method path"), "{e}");
    }

    /// A frame of `len` bytes written behind room, and where its bytes are.
    fn frame_buf(len: usize) -> (FrameBuf, *const u8) {
        let mut b = FrameBuf::buffer(len);
        b.extend((0..len).map(|i| i as u8));
        let f = FrameBuf::new(b, len);
        let at = f.as_slice().as_ptr();
        (f, at)
    }

    /// `encode_around` writes exactly what `encode` writes for the same packet with the
    /// frame inline; `in_place` says whether the frame's bytes stayed where they were.
    fn check_around(packet: &dyn Fn() -> Packet, len: usize, in_place: bool) {
        let (f, at) = frame_buf(len);
        let mut inline = packet();
        inline.data = Some(Data::Inline(Bytes::copy_from_slice(f.as_slice())));
        let want = inline.encode().unwrap();
        let got = packet().encode_around(f).unwrap();
        assert_eq!(got, want);
        let kept = got.as_ptr_range().contains(&at);
        assert_eq!(kept, in_place, "the frame stayed in place: {kept}");
    }

    fn request(extra: usize) -> Packet {
        let mut req = Packet::new(7);
        let mut h = headers();
        if extra > 0 {
            h.insert("x-big", HeaderValue::from_str(&"v".repeat(extra)).unwrap());
        }
        req.head = Some(Head::Request {
            path: PathAndQuery::from_static("/pkg.Svc/Method"),
            headers: h,
            standard: Some(HeaderValue::from_static("ibex-test")),
        });
        req.end = true;
        req
    }

    fn response() -> Packet {
        // Even: an ordinary call's answer (see `whole_unary`).
        let mut resp = Packet::new(8);
        resp.head = Some(Head::Response {
            status: StatusCode::OK,
            headers: headers(),
            standard: Some(HeaderValue::from_static("Thu, 26 Nov 2026 07:00:00 GMT")),
        });
        resp.trailers = Some(Trailers::Ok);
        resp.end = true;
        resp
    }

    #[test]
    fn a_packet_is_written_around_its_frame_without_copying_it() {
        for len in [FRAME_ROOM_MIN, 16 << 10] {
            check_around(&|| request(0), len, true);
        }
        // Small frames have no room: copied, and the same bytes.
        for len in [0, 5, 69, FRAME_ROOM_MIN - 1] {
            check_around(&|| request(0), len, false);
        }
        check_around(&response, 4096, true);
        // Trailers and a window after the frame, no head before it.
        let tail = || {
            let mut p = Packet::new(3);
            let mut t = HeaderMap::new();
            t.insert("grpc-status", HeaderValue::from_static("0"));
            p.trailers = Some(Trailers::map(t));
            p.window = Some(1 << 20);
            p
        };
        check_around(&tail, 3000, true);
        // A head larger than the room: the frame is copied, the bytes are the same.
        check_around(&|| request(1000), 4096, false);
        // What comes out decodes as the packet with its frame.
        let (f, _) = frame_buf(3000);
        let wire = response().encode_around(f).unwrap();
        let d = Packet::decode(wire, false, &Limits::default()).unwrap();
        assert!(
            matches!(d.data, Some(Data::Inline(ref b)) if b.len() == 3000 && b[2999] == 2999u32 as u8)
        );
        assert!(d.end && matches!(d.trailers, Some(Trailers::Ok)));
    }

    #[test]
    fn a_frame_buf_gives_up_its_frame_alone() {
        for len in [100, 5000] {
            let (f, at) = frame_buf(len);
            assert_eq!((f.len(), f.has_room()), (len, len >= FRAME_ROOM_MIN));
            let b = f.into_bytes();
            assert_eq!((b.len(), b.as_ptr(), b[99]), (len, at, 99));
        }
    }

    #[test]
    fn request_packet_round_trips() {
        let mut p = Packet::new(7);
        p.head = Some(Head::Request {
            path: PathAndQuery::from_static("/pkg.Svc/Method"),
            headers: headers(),
            standard: None,
        });
        p.data = Some(Data::Inline(Bytes::from_static(b"\0\0\0\0\x03abc")));
        p.end = true;
        let wire = p.encode().unwrap();
        let d = Packet::decode(wire.clone(), true, &Limits::default()).unwrap();
        assert_eq!(d.call, 7);
        match d.head {
            Some(Head::Request {
                path, headers: h, ..
            }) => {
                assert_eq!(path, "/pkg.Svc/Method");
                // The path is the connection's cached copy: it does not keep the packet.
                assert!(!wire.as_ptr_range().contains(&path.as_str().as_ptr()));
                assert_eq!(h, headers());
                assert_eq!(h.get_all("x-multi").iter().collect::<Vec<_>>(), ["a", "b"]);
            }
            other => panic!("wrong head {other:?}"),
        }
        assert!(matches!(d.data, Some(Data::Inline(ref b)) if b.as_ref() == b"\0\0\0\0\x03abc"));
        assert!(d.end && !d.reset && !d.goaway && d.trailers.is_none());
    }

    /// The request headers of a packet with `extra` added, and the packet's bytes.
    fn request_with(extra: Option<&'static str>) -> (HeaderMap, Bytes) {
        let mut h = headers();
        if let Some(v) = extra {
            h.insert("x-request-id", HeaderValue::from_static(v));
        }
        let mut p = Packet::new(1);
        p.head = Some(Head::Request {
            path: PathAndQuery::from_static("/pkg.Svc/Method"),
            headers: h.clone(),
            standard: Some(HeaderValue::from_static("ibex-test/1")),
        });
        // From a `Vec`, so that whether anything still holds it can be told.
        (h, Bytes::from(p.encode().unwrap().to_vec()))
    }

    fn decoded_headers(wire: Bytes, seen: &mut Seen) -> HeaderMap {
        match Packet::decode_with(wire, true, &Limits::default(), seen)
            .unwrap()
            .head
        {
            Some(Head::Request { headers, .. }) => headers,
            other => panic!("wrong head {other:?}"),
        }
    }

    #[test]
    fn a_repeated_header_list_is_decoded_once_and_keeps_no_packet() {
        let mut seen = Seen::default();
        let (want, _) = request_with(None);
        let mut maps = Vec::new();
        for round in 0..4 {
            let (_, wire) = request_with(None);
            let h = decoded_headers(wire.clone(), &mut seen);
            assert_eq!(h.get_all("x-multi").iter().collect::<Vec<_>>(), ["a", "b"]);
            assert_eq!(h["user-agent"], "ibex-test/1");
            assert_eq!(h["te"], "trailers");
            for (k, v) in &want {
                assert!(h.get_all(k).iter().any(|x| x == v), "{k} in round {round}");
            }
            assert_eq!(
                seen.last_map.is_some(),
                round >= 1,
                "kept from the second time on"
            );
            maps.push(h);
            if round >= 1 {
                // Neither the kept map nor the clone handed out holds the packet's buffer.
                assert!(wire.try_into_mut().is_ok(), "round {round} kept the packet");
            }
        }
        assert!(maps.windows(2).all(|w| w[0] == w[1]));
        // A list that changes is decoded afresh, and the kept map is let go.
        let (_, wire) = request_with(Some("42"));
        let h = decoded_headers(wire, &mut seen);
        assert_eq!(h["x-request-id"], "42");
        assert!(seen.last_map.is_none());
        let (_, wire) = request_with(None);
        assert_eq!(decoded_headers(wire, &mut seen), maps[0]);
        // Too long a list is not kept at all.
        let mut long = Seen::default();
        let big: &'static str = Box::leak("v".repeat(Seen::MAX_HEADERS).into_boxed_str());
        for _ in 0..3 {
            let (_, wire) = request_with(Some(big));
            assert_eq!(decoded_headers(wire, &mut long)["x-request-id"], big);
        }
        assert!(long.last_headers.is_empty() && long.last_map.is_none());
        // A response's head, from the kept map too (filled into a map with room for the
        // trailers that are merged into it).
        let mut client = Seen::default();
        for round in 0..3 {
            let mut p = Packet::new(1);
            p.head = Some(Head::Response {
                status: StatusCode::OK,
                headers: HeaderMap::new(),
                standard: Some(HeaderValue::from_static("Thu, 26 Nov 2026 10:00:00 GMT")),
            });
            let d =
                Packet::decode_with(p.encode().unwrap(), false, &Limits::default(), &mut client);
            match d.unwrap().head {
                Some(Head::Response { headers: h, .. }) => {
                    assert_eq!(h["content-type"], "application/grpc");
                    assert_eq!(h["date"], "Thu, 26 Nov 2026 10:00:00 GMT");
                    assert_eq!(h.len(), 2, "round {round}");
                }
                other => panic!("wrong head {other:?}"),
            }
        }
        assert!(client.last_map.is_some());
    }

    #[test]
    fn response_packet_round_trips() {
        let mut p = Packet::new(u32::MAX - 1);
        p.head = Some(Head::Response {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            standard: None,
        });
        p.data = Some(Data::Next(1 << 40));
        let mut t = HeaderMap::new();
        t.insert("grpc-status", HeaderValue::from_static("0"));
        p.trailers = Some(Trailers::map(t.clone()));
        p.window = Some(12345);
        let d = Packet::decode(p.encode().unwrap(), false, &Limits::default()).unwrap();
        assert!(
            matches!(d.head, Some(Head::Response { status: StatusCode::OK, ref headers, .. }) if headers.is_empty())
        );
        assert!(matches!(d.data, Some(Data::Next(n)) if n == 1 << 40));
        assert_eq!(
            d.trailers,
            Some(Trailers::Ok),
            "a lone grpc-status: 0 reads back as the constant"
        );
        assert_eq!(d.window, Some(12345));
        assert!(d.end, "trailers end the call");
    }

    #[test]
    fn standard_request_headers_follow_the_map_on_the_wire() {
        let ua = HeaderValue::from_static("ibex-test/1");
        let mut base = HeaderMap::new();
        base.insert("x-a", HeaderValue::from_static("1"));
        let mut p = Packet::new(3);
        p.head = Some(Head::Request {
            path: PathAndQuery::from_static("/a/b"),
            headers: base.clone(),
            standard: Some(ua.clone()),
        });
        let wire = p.encode().unwrap();
        assert_eq!(wire.len(), p.encoded_len());
        let Some(Head::Request {
            headers: h,
            standard,
            ..
        }) = Packet::decode(wire, true, &Limits::default()).unwrap().head
        else {
            panic!("no request head")
        };
        assert!(
            standard.is_none(),
            "a decoded head has everything in its map"
        );
        assert_eq!(
            h.iter()
                .map(|(k, v)| (k.as_str(), v.to_str().unwrap()))
                .collect::<Vec<_>>(),
            [
                ("x-a", "1"),
                ("te", "trailers"),
                ("content-type", "application/grpc"),
                ("user-agent", "ibex-test/1")
            ],
            "after the map's own entries, in this order"
        );
        // A user agent of the caller's own is kept, and not sent twice.
        base.insert("user-agent", HeaderValue::from_static("mine"));
        p.head = Some(Head::Request {
            path: PathAndQuery::from_static("/a/b"),
            headers: base,
            standard: Some(ua),
        });
        let wire = p.encode().unwrap();
        assert_eq!(wire.len(), p.encoded_len());
        let Some(Head::Request { headers: h, .. }) =
            Packet::decode(wire, true, &Limits::default()).unwrap().head
        else {
            panic!("no request head")
        };
        assert_eq!(h.get_all("user-agent").iter().collect::<Vec<_>>(), ["mine"]);
        assert_eq!(h.len(), 4);
    }

    #[test]
    fn standard_response_headers_fill_in_what_the_map_lacks() {
        let date = HeaderValue::from_static("Thu, 26 Nov 2026 00:00:00 GMT");
        let decoded = |headers: HeaderMap| {
            let mut p = Packet::new(4);
            p.head = Some(Head::Response {
                status: StatusCode::OK,
                headers,
                standard: Some(date.clone()),
            });
            let wire = p.encode().unwrap();
            assert_eq!(wire.len(), p.encoded_len());
            match Packet::decode(wire, false, &Limits::default())
                .unwrap()
                .head
            {
                Some(Head::Response { headers, .. }) => headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_string()))
                    .collect::<Vec<_>>(),
                other => panic!("{other:?}"),
            }
        };
        let pair = |k: &str, v: &str| (k.to_string(), v.to_string());
        assert_eq!(
            decoded(HeaderMap::new()),
            [
                pair("content-type", "application/grpc"),
                pair("date", "Thu, 26 Nov 2026 00:00:00 GMT")
            ]
        );
        let mut own = HeaderMap::new();
        own.insert(
            "content-type",
            HeaderValue::from_static("application/grpc+proto"),
        );
        own.insert("date", HeaderValue::from_static("then"));
        assert_eq!(
            decoded(own),
            [
                pair("content-type", "application/grpc+proto"),
                pair("date", "then")
            ]
        );
    }

    #[test]
    fn a_lone_grpc_status_0_is_the_constant_block_both_ways() {
        let mut by_map = Packet::new(5);
        by_map.data = Some(Data::Inline(Bytes::from_static(b"\0\0\0\0\x01x")));
        let mut t = HeaderMap::new();
        t.insert("grpc-status", HeaderValue::from_static("0"));
        by_map.trailers = Some(Trailers::map(t.clone()));
        let mut by_const = Packet::new(5);
        by_const.data = Some(Data::Inline(Bytes::from_static(b"\0\0\0\0\x01x")));
        by_const.trailers = Some(Trailers::Ok);
        let wire = by_const.encode().unwrap();
        assert_eq!(wire, by_map.encode().unwrap());
        assert_eq!(wire.len(), by_const.encoded_len());
        let d = Packet::decode(wire, false, &Limits::default()).unwrap();
        assert_eq!(d.trailers, Some(Trailers::Ok));
        assert!(d.end);
        assert_eq!(Trailers::Ok.into_map(), t);
        // Anything else, even one more entry or another value, is a map.
        for (k, v) in [("grpc-status", "1"), ("x-more", "0")] {
            let mut m = t.clone();
            m.insert(k, HeaderValue::from_static(v));
            let mut p = Packet::new(5);
            p.trailers = Some(Trailers::map(m.clone()));
            let d = Packet::decode(p.encode().unwrap(), false, &Limits::default()).unwrap();
            assert_eq!(d.trailers, Some(Trailers::map(m)));
        }
    }

    #[test]
    fn control_flags_round_trip() {
        let mut p = Packet::new(0);
        p.goaway = true;
        let d = Packet::decode(p.encode().unwrap(), false, &Limits::default()).unwrap();
        assert!(d.goaway && !d.reset && !d.end);
        let mut p = Packet::new(3);
        p.reset = true;
        let d = Packet::decode(p.encode().unwrap(), true, &Limits::default()).unwrap();
        assert!(d.reset && !d.goaway && d.head.is_none() && d.data.is_none());
    }

    #[test]
    fn encode_allocates_exactly_what_it_writes() {
        let mut req = Packet::new(7);
        req.head = Some(Head::Request {
            path: PathAndQuery::from_static("/pkg.Svc/Method"),
            headers: headers(),
            standard: None,
        });
        req.data = Some(Data::Inline(Bytes::from_static(b"\0\0\0\0\x03abc")));
        req.window = Some(9);
        let mut resp = Packet::new(8);
        resp.head = Some(Head::Response {
            status: StatusCode::OK,
            headers: headers(),
            standard: None,
        });
        resp.data = Some(Data::Next(1 << 30));
        resp.trailers = Some(Trailers::map(headers()));
        let mut bare = Packet::new(9);
        bare.reset = true;
        for p in [req, resp, bare] {
            assert_eq!(p.encode().unwrap().len(), p.encoded_len(), "{p:?}");
        }
    }

    /// A hand-built packet with `n` empty-valued headers named `h`.
    fn with_header_count(n: u16) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u32(1);
        b.put_u8(TRAILERS);
        let mut t = BytesMut::new();
        t.put_u16(n);
        for _ in 0..n {
            t.put_u16(1);
            t.put_u8(b'h');
            t.put_u32(0);
        }
        b.put_u32(t.len() as u32);
        b.put_slice(&t);
        b.freeze()
    }

    #[test]
    fn header_counts_and_sizes_are_bounded_before_allocation() {
        let lim = Limits::default();
        // Refused before `HeaderMap::with_capacity`, which panics on huge counts; counts of
        // 32768 and up carry the implied-entries mark, which trailers may not.
        let e = Packet::decode(with_header_count(30000), false, &lim).unwrap_err();
        assert!(
            e.to_string()
                .contains("30000 header entries exceed the 512")
                && e.to_string().contains("max_header_list_size"),
            "{e}"
        );
        let e = Packet::decode(with_header_count(40000), false, &lim).unwrap_err();
        assert!(e.to_string().contains("trailers block marks"), "{e}");
        assert!(Packet::decode(with_header_count(u16::MAX), true, &lim).is_err());
        // 500 entries of 33 bytes each pass the count check but not the size.
        let e = Packet::decode(with_header_count(500), false, &lim).unwrap_err();
        assert!(e.to_string().contains("exceeds 16384 bytes"), "{e}");
        assert!(Packet::decode(with_header_count(400), false, &lim).is_ok());
        // A receiver that raised its limit takes more.
        let big = Limits {
            max_header_list_size: 1 << 20,
        };
        assert!(Packet::decode(with_header_count(20000), false, &big).is_ok());
        // One large value alone is bounded too.
        let mut p = Packet::new(2);
        let mut h = HeaderMap::new();
        h.insert(
            "x-big",
            HeaderValue::from_str(&"v".repeat(20 << 10)).unwrap(),
        );
        p.trailers = Some(Trailers::map(h));
        let e = Packet::decode(p.encode().unwrap(), false, &lim).unwrap_err();
        assert!(e.to_string().contains("exceeds 16384 bytes"), "{e}");
    }

    #[test]
    fn malformed_packets_are_protocol_errors() {
        let mut p = Packet::new(1);
        p.head = Some(Head::Request {
            path: PathAndQuery::from_static("/a/b"),
            headers: headers(),
            standard: None,
        });
        p.data = Some(Data::Inline(Bytes::from_static(b"xyz")));
        let good = p.encode().unwrap();
        // Every truncation fails cleanly.
        for cut in 0..good.len() {
            let e = Packet::decode(good.slice(..cut), true, &Limits::default()).unwrap_err();
            assert!(
                matches!(e, Error::Protocol(ref m) if m.contains("gRPC call framing")),
                "cut {cut}: {e}"
            );
        }
        // Trailing garbage.
        let mut long = good.to_vec();
        long.push(0);
        assert!(
            Packet::decode(long.into(), true, &Limits::default())
                .unwrap_err()
                .to_string()
                .contains("unexpected bytes")
        );
        // A path without the leading slash, and one that is no URI path (the path's first
        // byte is at 11: call id, flags, head length, path length).
        let mut bad = Packet::new(1);
        bad.head = Some(Head::Request {
            path: PathAndQuery::from_static("/a/b"),
            headers: HeaderMap::new(),
            standard: None,
        });
        let bad = bad.encode().unwrap().to_vec();
        assert_eq!(&bad[11..15], b"/a/b");
        for (at, byte, why) in [
            (11, b'a', "does not start with '/'"),
            (13, b' ', "bad method path"),
        ] {
            let mut b = bad.clone();
            b[at] = byte;
            let e = Packet::decode(b.into(), true, &Limits::default()).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
        }
        // An invalid HTTP status, a bad header name.
        let raw = [0, 0, 0, 1, HEAD, 0, 0, 0, 4, 0, 5, 0, 0];
        assert!(
            Packet::decode(Bytes::copy_from_slice(&raw), false, &Limits::default())
                .unwrap_err()
                .to_string()
                .contains("invalid HTTP status 5")
        );
        let raw = [
            0, 0, 0, 1, TRAILERS, 0, 0, 0, 9, 0, 1, 0, 1, b' ', 0, 0, 0, 0,
        ];
        assert!(
            Packet::decode(Bytes::copy_from_slice(&raw), false, &Limits::default())
                .unwrap_err()
                .to_string()
                .contains("invalid header name")
        );
        // Both kinds of data at once.
        let raw = [
            0,
            0,
            0,
            1,
            DATA | DATA_NEXT,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
        ];
        assert!(
            Packet::decode(Bytes::copy_from_slice(&raw), true, &Limits::default())
                .unwrap_err()
                .to_string()
                .contains("both inline and separate")
        );
    }
}
