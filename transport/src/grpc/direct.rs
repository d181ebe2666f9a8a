//! The direct unary path: unary calls over Ibex without tonic's per-call machinery (an
//! encoder body, a streaming decoder, compression state and status header maps per call).
//!
//! ibex-codegen registers each unary method of a server as a [`DirectRoute`] and makes its
//! client's unary calls through a [`DirectClient`]. A request or response that is one
//! uncompressed protobuf message is encoded and decoded here with prost, straight from the
//! connection's bytes, and the answer goes back as one packet. Everything else (`http://`
//! channels, compression, not exactly one message) goes through tonic unchanged, and the
//! answers are tonic's: the same statuses, metadata and trailers merged as tonic merges them.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, StatusCode};
use http_body::Body;
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};

use super::body::IncomingBody;
use super::client::{Channel, Held, Inner, Outgoing, Reply};
use super::timeout_value;
use super::wire::{
    FrameBuf, FrameWriter, GRPC_ACCEPT_ENCODING, GRPC_CONTENT_TYPE, GRPC_ENCODING, GRPC_MESSAGE,
    GRPC_STATUS, GRPC_TIMEOUT, STATUS_OK, Trailers,
};

/// tonic's default limit on a decoded message, on both sides.
const DEFAULT_MAX_DECODING: usize = 4 << 20;

/// The gRPC message prefix: a compression flag and a big-endian length.
const PREFIX: usize = 5;

/// What a direct route answers: the response headers (metadata, sanitized; the content type
/// is added where the answer is sent), the prefixed message and extensions, or the status.
pub(crate) type DirectAnswer = Result<(HeaderMap, FrameBuf, http::Extensions), Status>;

/// A direct call whose handler did not finish in its first poll.
pub(crate) type DirectFuture = Pin<Box<dyn Future<Output = DirectAnswer> + Send>>;

/// An answer ready in a direct call's first poll, while the message is still where the
/// handler left it: the sanitized response headers and the message, to be encoded straight
/// into its packet; or the call's status.
pub(crate) type ReadyAnswer<'a> = Result<(HeaderMap, &'a dyn FrameWriter), Status>;

/// Where a direct call's first poll hands a ready answer.
pub(crate) type ReplyTo<'a> = &'a mut dyn FnMut(ReadyAnswer<'_>);

/// How a direct call's first poll went.
pub(crate) enum Started {
    /// The handler finished at once (most unary handlers): its answer went to the reply,
    /// and nothing was boxed.
    Answered,
    /// The handler waits; its future runs on as the call's.
    Pending(DirectFuture),
}

type RouteFn = dyn Fn(Bytes, HeaderMap, http::Extensions, &mut Context<'_>, ReplyTo<'_>) -> Started
    + Send
    + Sync;

/// The handler future of a generated unary method, as tonic's generated routes box it.
pub type UnaryFuture<R> = Pin<Box<dyn Future<Output = Result<tonic::Response<R>, Status>> + Send>>;

/// A direct handler: a unary method of a service generated with ibex-codegen, which the
/// server calls itself, with no `http::Request`, tower service or response body: the
/// request's message (unprefixed), its headers and extensions in, the answer out.
#[derive(Clone)]
pub struct DirectRoute {
    /// The service's decoding limit: a larger message takes the service's tonic route,
    /// which refuses it in tonic's words.
    pub(crate) max_decoding: usize,
    call: Arc<RouteFn>,
}

impl std::fmt::Debug for DirectRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectRoute")
            .field("max_decoding", &self.max_decoding)
            .finish_non_exhaustive()
    }
}

impl DirectRoute {
    /// The direct handler of a unary method whose handler is `handler`, with the service's
    /// message limits (`None`: tonic's defaults, 4 MiB decoding and no encoding limit).
    /// Called by the code ibex-codegen generates.
    #[doc(hidden)]
    pub fn unary<Req, Resp, F>(
        handler: F,
        max_decoding: Option<usize>,
        max_encoding: Option<usize>,
    ) -> Self
    where
        F: Fn(tonic::Request<Req>) -> UnaryFuture<Resp> + Send + Sync + 'static,
        Req: prost::Message + Default + Send + 'static,
        Resp: prost::Message + Send + 'static,
    {
        let max_encoding = max_encoding.unwrap_or(usize::MAX);
        DirectRoute {
            max_decoding: max_decoding.unwrap_or(DEFAULT_MAX_DECODING),
            call: Arc::new(move |msg, headers, extensions, cx, reply| {
                let mut handler = match call(&handler, msg, headers, extensions) {
                    Ok(h) => h,
                    Err(status) => {
                        reply(Err(status));
                        return Started::Answered;
                    }
                };
                // The handler's future (boxed, as tonic's generated routes box it) is
                // polled where it is: one ready at once answers with nothing more boxed.
                match handler.as_mut().poll(cx) {
                    Poll::Ready(r) => {
                        answer_now(r, max_encoding, reply);
                        Started::Answered
                    }
                    Poll::Pending => {
                        Started::Pending(Box::pin(
                            async move { finish(handler.await, max_encoding) },
                        ))
                    }
                }
            }),
        }
    }

    /// Starts the call and polls it once with `cx`: `msg` is the request's one message,
    /// without its prefix. An answer ready at once goes to `reply`.
    pub(crate) fn start(
        &self,
        msg: Bytes,
        headers: HeaderMap,
        extensions: http::Extensions,
        cx: &mut Context<'_>,
        reply: ReplyTo<'_>,
    ) -> Started {
        (self.call)(msg, headers, extensions, cx, reply)
    }
}

/// Decodes the request and calls the handler: its future.
fn call<Req, Resp, F>(
    handler: &F,
    msg: Bytes,
    headers: HeaderMap,
    extensions: http::Extensions,
) -> Result<UnaryFuture<Resp>, Status>
where
    F: Fn(tonic::Request<Req>) -> UnaryFuture<Resp>,
    Req: prost::Message + Default,
{
    // As tonic-prost's decoder.
    let msg = Req::decode(msg).map_err(|e| Status::internal(e.to_string()))?;
    let request = tonic::Request::from_parts(MetadataMap::from_headers(headers), extensions, msg);
    Ok(handler(request))
}

/// Hands what the handler answered at once to `reply`, its message encoded where it goes.
/// Message and extensions are dropped once the answer is out: the client works meanwhile.
fn answer_now<R: prost::Message>(
    answer: Result<tonic::Response<R>, Status>,
    max_encoding: usize,
    reply: ReplyTo<'_>,
) {
    let (headers, msg, _extensions) = match split(answer) {
        Ok(a) => a,
        Err(status) => return reply(Err(status)),
    };
    match Message::new(&msg, max_encoding) {
        Ok(frame) => reply(Ok((headers, &frame))),
        // As tonic: the response's metadata went out in its head before the message failed.
        Err(status) => reply(Err(with_metadata(status, &headers))),
    }
}

/// Encodes what the handler answered (a handler that waited, or tonic's route).
fn finish<R: prost::Message>(
    answer: Result<tonic::Response<R>, Status>,
    max_encoding: usize,
) -> DirectAnswer {
    let (headers, msg, extensions) = split(answer)?;
    match encode(&msg, max_encoding) {
        Ok(frame) => Ok((headers, frame, extensions)),
        Err(status) => Err(with_metadata(status, &headers)),
    }
}

/// A handler's response as the direct path sends it: its headers without what user metadata
/// may not set (the content type follows them on the wire), its message, its extensions.
fn split<R>(
    answer: Result<tonic::Response<R>, Status>,
) -> Result<(HeaderMap, R, http::Extensions), Status> {
    let (metadata, msg, extensions) = answer?.into_parts();
    let mut headers = metadata.into_headers();
    sanitize(&mut headers);
    Ok((headers, msg, extensions))
}

/// A direct answer as the response a handler future answers with, for a direct call whose
/// handler did not finish at once.
pub(crate) fn into_http(answer: DirectAnswer) -> http::Response<tonic::body::Body> {
    let (headers, data, extensions) = match answer {
        Ok(a) => a,
        Err(status) => return status.into_http(),
    };
    let mut trailers = HeaderMap::with_capacity(1);
    trailers.insert(GRPC_STATUS.clone(), STATUS_OK.clone());
    let body = IncomingBody::complete(Some(data.into_bytes()), Some(trailers), None);
    let mut headers = headers;
    headers.insert(http::header::CONTENT_TYPE, GRPC_CONTENT_TYPE.clone());
    let mut resp = http::Response::new(tonic::body::Body::new(body));
    *resp.version_mut() = http::Version::HTTP_2;
    *resp.headers_mut() = headers;
    *resp.extensions_mut() = extensions;
    resp
}

/// The request's one message, without its prefix, if a direct route may take it: no
/// compression either way and exactly one plain message within `limit`. With it, the
/// request's `grpc-timeout`, found in the same pass over its few headers.
pub(crate) fn direct_message(
    headers: &HeaderMap,
    frame: &Bytes,
    limit: usize,
) -> Option<(Bytes, Option<std::time::Duration>)> {
    let Framed::One(m) = one_message(frame, limit) else {
        return None;
    };
    Some((m, plain(headers)?))
}

/// The direct side of an ibex-codegen client: its unary calls, encoded and decoded here and
/// sent through [`Channel::exchange`], as every other call on the channel is.
#[doc(hidden)]
#[derive(Clone)]
pub struct DirectClient {
    /// `None` over stock HTTP/2 (an `http://` channel), or once compression is asked for:
    /// calls then take tonic's client.
    inner: Option<std::sync::Arc<Inner>>,
    max_decoding: usize,
    max_encoding: usize,
}

impl std::fmt::Debug for DirectClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectClient")
            .field("active", &self.active())
            .field("max_decoding", &self.max_decoding)
            .field("max_encoding", &self.max_encoding)
            .finish_non_exhaustive()
    }
}

impl DirectClient {
    /// The direct side of a generated client over `channel`.
    pub fn new(channel: &Channel) -> DirectClient {
        DirectClient {
            inner: channel.ibex().cloned(),
            max_decoding: DEFAULT_MAX_DECODING,
            max_encoding: usize::MAX,
        }
    }

    /// Whether unary calls take the direct path: the channel is an Ibex one and no
    /// compression was asked for (the direct path sends and accepts plain messages only).
    pub fn active(&self) -> bool {
        self.inner.is_some()
    }

    /// As the generated client's `send_compressed` and `accept_compressed`: from now on,
    /// tonic's client makes the calls.
    pub fn compressed(&mut self) {
        self.inner = None;
    }

    /// As the generated client's `max_decoding_message_size`.
    pub fn max_decoding_message_size(&mut self, limit: usize) {
        self.max_decoding = limit;
    }

    /// As the generated client's `max_encoding_message_size`.
    pub fn max_encoding_message_size(&mut self, limit: usize) {
        self.max_encoding = limit;
    }

    /// One unary call to `path`, as tonic's `Grpc::unary` makes it.
    pub async fn unary<M, R>(
        &self,
        request: tonic::Request<M>,
        path: http::uri::PathAndQuery,
    ) -> Result<tonic::Response<R>, Status>
    where
        M: prost::Message,
        R: prost::Message + Default,
    {
        let (metadata, _extensions, msg) = request.into_parts();
        let data = Message::new(&msg, self.max_encoding)?;
        let mut headers = metadata.into_headers();
        // `te` and `content-type` are among these, and go on the wire after them.
        sanitize(&mut headers);
        let Some(inner) = &self.inner else {
            return Err(Status::internal(
                "the direct path was asked for a call on a channel that is not an Ibex one",
            ));
        };
        let answer =
            Channel::exchange(inner.clone(), headers, path, Outgoing::Whole(&data)).await?;
        // What the answer holds until it is decoded, on the channel's window; small whole
        // answers, decoded at once, are not worth the account.
        let mut held = inner.window.account();
        let mut headers = answer.headers;
        // The decoder merged a lone `grpc-status: 0` into the head (the usual answer).
        let ok_in_head = matches!(answer.rest, Reply::Whole(_, Some(Trailers::OkInHead)));
        if ok_in_head {
            let data = match &answer.rest {
                Reply::Whole(Some(data), _) => data.clone(),
                _ => Bytes::new(),
            };
            if data.len() > WINDOW_MIN {
                held.add(data.len())
                    .map_err(|s| with_metadata(s, &headers))?;
            }
            return match decode_one(&data, self.max_decoding) {
                Ok(msg) => Ok(tonic::Response::from_parts(
                    MetadataMap::from_headers(headers),
                    msg,
                    tonic::Extensions::new(),
                )),
                Err(s) => {
                    // As tonic: a call that fails after its head carries the head's metadata,
                    // not the trailers.
                    headers.remove(GRPC_STATUS);
                    Err(with_metadata(s, &headers))
                }
            };
        }
        // A trailers-only answer: its status is in the head. (Looked up by its parsed
        // name first: `from_header_map` parses the name on every call.)
        if headers.contains_key(GRPC_STATUS)
            && let Some(s) = Status::from_header_map(&headers)
        {
            if s.code() != Code::Ok {
                return Err(s);
            }
            return Err(Status::internal("Missing response message."));
        }
        // As tonic: a call that fails after its head carries the head's metadata too.
        let with_head = |s: Status| with_metadata(s, &headers);
        let (data, trailers) = match answer.rest {
            Reply::Whole(data, trailers) => {
                let data = data.unwrap_or_default();
                if data.len() > WINDOW_MIN {
                    held.add(data.len()).map_err(with_head)?;
                }
                (data, trailers)
            }
            Reply::Stream(body) => {
                let (data, trailers) = collect(body, self.max_decoding, &mut held)
                    .await
                    .map_err(with_head)?;
                (data, trailers.map(Trailers::map))
            }
        };
        let trailers = match trailers {
            Some(Trailers::Ok | Trailers::OkInHead) => None,
            Some(Trailers::Map(t)) if ok(&t) => Some(t),
            Some(Trailers::Map(t)) => return Err(with_head(status_of(answer.status, &t))),
            None => return Err(with_head(status_of(answer.status, &HeaderMap::new()))),
        };
        let msg = decode_one(&data, self.max_decoding).map_err(with_head)?;
        // As tonic: the response's metadata is its head, then its trailers (a trailer
        // replaces a head entry of the same name).
        match trailers {
            Some(t) => headers.extend(*t),
            None => {
                headers.insert(GRPC_STATUS.clone(), STATUS_OK.clone());
            }
        }
        Ok(tonic::Response::from_parts(
            MetadataMap::from_headers(headers),
            msg,
            tonic::Extensions::new(),
        ))
    }
}

/// Whole answers up to this size are decoded in the poll that brings them, so they are not
/// accounted on the channel's window.
const WINDOW_MIN: usize = 64 << 10;

/// The one message of a unary answer's body frame, as tonic's decoder takes it.
fn decode_one<R: prost::Message + Default>(data: &Bytes, limit: usize) -> Result<R, Status> {
    let msg = match one_message(data, limit) {
        Framed::One(m) => m,
        Framed::Bad(s) => return Err(s),
        Framed::Other if data.is_empty() => {
            return Err(Status::internal("Missing response message."));
        }
        Framed::Other => return Err(not_one_message(data.len())),
    };
    R::decode(msg).map_err(|e| Status::internal(e.to_string()))
}

/// `status` with `head`'s entries merged into its metadata, as tonic's client merges a
/// response's head into the status of a call that fails after it.
fn with_metadata(mut status: Status, head: &HeaderMap) -> Status {
    let mut md = std::mem::take(status.metadata_mut()).into_headers();
    md.extend(head.clone());
    *status.metadata_mut() = MetadataMap::from_headers(md);
    status
}

/// `Some` when no compression is asked for either way (the direct path encodes and
/// decodes plain messages only), with the request's `grpc-timeout`, if it has one.
fn plain(headers: &HeaderMap) -> Option<Option<std::time::Duration>> {
    let mut timeout = None;
    // One pass over the few entries a request has: cheaper than three hashed lookups.
    for (k, v) in headers {
        if k == GRPC_ENCODING {
            if v.as_bytes() != b"identity" {
                return None;
            }
        } else if k == GRPC_ACCEPT_ENCODING {
            return None;
        } else if k == GRPC_TIMEOUT && timeout.is_none() {
            timeout = Some(timeout_value(v));
        }
    }
    Some(timeout.flatten())
}

/// What a body frame holds.
enum Framed {
    /// Exactly one uncompressed message within the limit: the message's bytes.
    One(Bytes),
    /// Something a message decoder handles (or rejects) better: several messages, a
    /// compressed one, a truncated one, none.
    Other,
    /// A message over the limit, refused as tonic refuses it.
    Bad(Status),
}

fn one_message(frame: &Bytes, limit: usize) -> Framed {
    if frame.len() < PREFIX || frame[0] != 0 {
        return Framed::Other;
    }
    let len = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]) as usize;
    if len > limit {
        return Framed::Bad(Status::out_of_range(format!(
            "Error, decoded message length too large: found {len} bytes, the limit is: {limit} bytes"
        )));
    }
    if frame.len() - PREFIX != len {
        return Framed::Other;
    }
    Framed::One(frame.slice(PREFIX..))
}

fn not_one_message(len: usize) -> Status {
    Status::internal(format!(
        "protocol error: a unary response of {len} bytes is not one uncompressed gRPC message"
    ))
}

/// A message with its gRPC prefix, refused as tonic's encoder refuses one over `limit`.
fn encode<M: prost::Message>(msg: &M, limit: usize) -> Result<FrameBuf, Status> {
    // Behind room for the packet where that pays, so the packet is written around it. A
    // frame of another length than announced would reach the peer malformed: refused, it
    // fails the one call.
    FrameBuf::from_writer(&Message::new(msg, limit)?)
        .map_err(|e| Status::internal(format!("the response could not be sent: {e}")))
}

/// One message as a gRPC body frame (prefix and message), encoded where it is put: into
/// the packet that carries it when it rides inline.
struct Message<'a, M> {
    msg: &'a M,
    /// The encoded message's length, within the limit and gRPC's 4 GiB.
    len: u32,
}

impl<'a, M: prost::Message> Message<'a, M> {
    /// Refuses a message over `limit` bytes, as tonic's encoder does.
    fn new(msg: &'a M, limit: usize) -> Result<Self, Status> {
        let len = msg.encoded_len();
        if len > limit {
            return Err(Status::out_of_range(format!(
                "Error, encoded message length too large: found {len} bytes, the limit is: {limit} bytes"
            )));
        }
        let Ok(len) = u32::try_from(len) else {
            return Err(Status::resource_exhausted(format!(
                "a {len}-byte message does not fit gRPC's 4 GiB message limit"
            )));
        };
        Ok(Message { msg, len })
    }
}

impl<M: prost::Message> FrameWriter for Message<'_, M> {
    fn len(&self) -> usize {
        PREFIX + self.len as usize
    }

    fn put(&self, b: &mut BytesMut) {
        let len = self.len();
        b.reserve(len);
        let at = b.len();
        let mut out = Exact::new(&mut b.spare_capacity_mut()[..len]);
        out.put_u8(0);
        out.put_u32(self.len);
        self.msg.encode_raw(&mut out);
        let written = out.written();
        // SAFETY: `Exact` counts only bytes it has written (or that a caller of
        // `advance_mut` vouched for, as that function's contract requires), all within the
        // `len` bytes of spare capacity reserved above; after an overrun, none.
        unsafe { b.set_len(at + written) };
        // A message whose `encode_raw` wrote more or less than its `encoded_len` leaves a
        // frame of another length, which `Packet::encode_written` refuses.
    }
}

/// The writer a message is encoded through: exactly the bytes its `encoded_len` announced, in
/// a buffer reserved beforehand, so prost's single-byte tag and length writes are stores, not
/// a capacity check and a `memcpy` call each. It never grows or panics: a faulty `Message`
/// that writes past the end leaves an empty frame, which the packet's length check refuses.
struct Exact<'a> {
    buf: &'a mut [std::mem::MaybeUninit<u8>],
    at: usize,
    /// A write did not fit: the encoding is wrong whatever follows.
    overrun: bool,
}

impl<'a> Exact<'a> {
    fn new(buf: &'a mut [std::mem::MaybeUninit<u8>]) -> Self {
        Exact {
            buf,
            at: 0,
            overrun: false,
        }
    }

    /// Bytes written from the start, all initialized; none after an overrun, so that the
    /// frame's length shows the fault.
    fn written(&self) -> usize {
        if self.overrun { 0 } else { self.at }
    }
}

// SAFETY: `chunk_mut` is the unwritten rest of `buf`, and `advance_mut` never moves past
// its end, so `at` stays within `buf` and counts initialized bytes only.
unsafe impl BufMut for Exact<'_> {
    #[inline]
    fn remaining_mut(&self) -> usize {
        self.buf.len() - self.at
    }

    #[inline]
    unsafe fn advance_mut(&mut self, cnt: usize) {
        if cnt > self.remaining_mut() {
            self.overrun = true;
            return;
        }
        self.at += cnt;
    }

    #[inline]
    fn chunk_mut(&mut self) -> &mut bytes::buf::UninitSlice {
        bytes::buf::UninitSlice::uninit(&mut self.buf[self.at..])
    }

    #[inline]
    fn put_slice(&mut self, src: &[u8]) {
        // One copy of the caller's length: for prost's single bytes that is a constant,
        // and the copy a store instead of a `memcpy` call.
        if src.len() > self.remaining_mut() {
            self.overrun = true;
            return;
        }
        // SAFETY: `src.len()` bytes from `at` lie within `buf` (checked above), and `src`
        // cannot alias `buf`, which this writer borrows mutably.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.buf.as_mut_ptr().add(self.at).cast::<u8>(),
                src.len(),
            );
        }
        self.at += src.len();
    }

    #[inline]
    fn put_bytes(&mut self, val: u8, cnt: usize) {
        if cnt > self.remaining_mut() {
            self.overrun = true;
            return;
        }
        for b in &mut self.buf[self.at..self.at + cnt] {
            b.write(val);
        }
        self.at += cnt;
    }

    #[inline]
    fn put<T: Buf>(&mut self, mut src: T)
    where
        Self: Sized,
    {
        if src.remaining() > self.remaining_mut() {
            self.overrun = true;
            return;
        }
        while src.has_remaining() {
            let chunk = src.chunk();
            let n = chunk.len();
            if n == 0 {
                // A `Buf` that has bytes but shows none would loop here forever.
                self.overrun = true;
                return;
            }
            self.put_slice(chunk);
            src.advance(n);
        }
    }
}

/// tonic's `GRPC_RESERVED_HEADERS`: what user metadata may not set.
fn sanitize(headers: &mut HeaderMap) {
    static MESSAGE_TYPE: http::HeaderName = http::HeaderName::from_static("grpc-message-type");
    static RESERVED: [&http::HeaderName; 5] = [
        &http::header::TE,
        &http::header::CONTENT_TYPE,
        GRPC_MESSAGE,
        &MESSAGE_TYPE,
        GRPC_STATUS,
    ];
    // Most calls carry no metadata at all.
    if headers.is_empty() {
        return;
    }
    for name in RESERVED {
        headers.remove(name);
    }
}

/// Trailers that say the call succeeded.
fn ok(trailers: &HeaderMap) -> bool {
    trailers
        .get(GRPC_STATUS)
        .is_some_and(|s| s.as_bytes() == b"0")
}

/// The status a failed or malformed answer carries, as tonic infers it.
fn status_of(http_status: StatusCode, trailers: &HeaderMap) -> Status {
    if let Some(s) = Status::from_header_map(trailers) {
        return s;
    }
    if http_status != StatusCode::OK {
        let code = match http_status {
            StatusCode::BAD_REQUEST => Code::Internal,
            StatusCode::UNAUTHORIZED => Code::Unauthenticated,
            StatusCode::FORBIDDEN => Code::PermissionDenied,
            StatusCode::NOT_FOUND => Code::Unimplemented,
            StatusCode::TOO_MANY_REQUESTS
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT => Code::Unavailable,
            _ => Code::Unknown,
        };
        return Status::new(
            code,
            format!(
                "grpc-status header missing, mapped from HTTP status code {}",
                http_status.as_u16()
            ),
        );
    }
    Status::internal("protocol error: the response ended without a grpc-status")
}

/// A response body that came in pieces, gathered up to one message of `limit` bytes.
async fn collect(
    mut body: IncomingBody,
    limit: usize,
    held: &mut Held,
) -> Result<(Bytes, Option<HeaderMap>), Status> {
    // One frame is kept as it came; only a message in several is copied together.
    let mut parts: Vec<Bytes> = Vec::new();
    let mut have = 0usize;
    let mut prefix = [0u8; PREFIX];
    let mut trailers = None;
    while let Some(frame) =
        std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await
    {
        match frame?.into_data() {
            Ok(d) => {
                // A message whose prefix announces more than the limit is refused as soon
                // as the prefix is in, as tonic's decoder refuses it, before anything more
                // is buffered or waited for.
                if have < PREFIX {
                    let n = (PREFIX - have).min(d.len());
                    prefix[have..have + n].copy_from_slice(&d[..n]);
                    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]);
                    if have + n == PREFIX && len as usize > limit {
                        return Err(Status::out_of_range(format!(
                            "Error, decoded message length too large: found {len} bytes, the limit is: {limit} bytes"
                        )));
                    }
                }
                have += d.len();
                if have > PREFIX.saturating_add(limit) {
                    return Err(Status::out_of_range(format!(
                        "Error, decoded message length too large: found more than {limit} bytes, the limit is: {limit} bytes"
                    )));
                }
                held.add(d.len())?;
                parts.push(d);
            }
            Err(f) => {
                if let Ok(t) = f.into_trailers() {
                    trailers = Some(t);
                }
            }
        }
    }
    let data = match parts.len() {
        0 => Bytes::new(),
        1 => parts.swap_remove(0),
        _ => {
            let mut m = BytesMut::with_capacity(have);
            for p in &parts {
                m.extend_from_slice(p);
            }
            m.freeze()
        }
    };
    Ok((data, trailers))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Tensors {
        #[prost(bytes = "bytes", repeated, tag = "1")]
        buffers: Vec<Bytes>,
        #[prost(uint64, tag = "2")]
        step: u64,
        #[prost(string, tag = "3")]
        name: String,
    }

    /// A `Message` whose `encoded_len` says `said` bytes and whose encoding writes
    /// `wrote`: what a hand-written impl with a bug does.
    #[derive(Debug, Default)]
    struct Lies {
        said: usize,
        wrote: usize,
    }

    impl prost::Message for Lies {
        fn encode_raw(&self, buf: &mut impl BufMut) {
            buf.put_bytes(7, self.wrote);
        }
        fn merge_field(
            &mut self,
            tag: u32,
            wire_type: prost::encoding::WireType,
            buf: &mut impl Buf,
            ctx: prost::encoding::DecodeContext,
        ) -> Result<(), prost::DecodeError> {
            prost::encoding::skip_field(wire_type, tag, buf, ctx)
        }
        fn encoded_len(&self) -> usize {
            self.said
        }
        fn clear(&mut self) {}
    }

    #[test]
    fn a_message_is_encoded_in_place_as_prost_encodes_it() {
        let m = Tensors {
            buffers: (0..10u8)
                .map(|i| Bytes::from(vec![i; 10 + i as usize]))
                .collect(),
            step: 300,
            name: "layer1/kernel".into(),
        };
        let mut want = vec![0u8];
        want.extend_from_slice(&(m.encoded_len() as u32).to_be_bytes());
        want.extend_from_slice(&m.encode_to_vec());
        let frame = Message::new(&m, usize::MAX).unwrap();
        assert_eq!(frame.len(), want.len());
        // Behind what is already in the buffer, as a packet's fields are.
        let mut b = BytesMut::from(&b"head"[..]);
        frame.put(&mut b);
        assert_eq!(&b[..4], b"head");
        assert_eq!(&b[4..], &want[..]);
    }

    #[test]
    fn a_message_that_writes_more_or_less_than_it_announced_leaves_a_frame_of_another_length() {
        for (said, wrote) in [(3, 40), (3, 4), (40, 3)] {
            let m = Lies { said, wrote };
            let frame = Message::new(&m, usize::MAX).unwrap();
            let mut b = BytesMut::new();
            // No panic and no growth past the announced length...
            frame.put(&mut b);
            assert_ne!(b.len(), frame.len(), "said {said}, wrote {wrote}");
            assert!(b.len() <= frame.len());
            // ...and the packet refuses the frame rather than sending a broken stream.
            let mut p = super::super::wire::Packet::new(1);
            p.trailers = Some(Trailers::Ok);
            let e = p.encode_written(&frame).unwrap_err();
            assert!(e.to_string().contains("announced"), "{e}");
            // A frame of its own (a response that does not ride in its packet) fails its
            // call with a status that names the fault.
            let s = encode(&m, usize::MAX).unwrap_err();
            assert_eq!(s.code(), Code::Internal);
            assert!(s.message().contains("encoded_len"), "{s:?}");
        }
    }
}
