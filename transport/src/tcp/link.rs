//! [`TcpLink`]: the [`Link`] over one TCP stream, as two non-blocking state machines.
//!
//! Write side: an ordered queue of `Bytes` chunks (read-response payloads, sent straight from
//! the exposed buffers) followed by a staging `BytesMut` (record headers, frames, requests),
//! drained with vectored writes. Chunks leave strictly in queue order, so a
//! partial write only moves the queue's head.
//!
//! Read side: a record parser over a `BytesMut`; frames are split out of it without a copy,
//! and read-response payloads go from the socket straight into the destination the driver
//! gave to `post_read` (only what was already read ahead into the buffer is copied).
//!
//! Emulated one-sided reads are served here, inside `poll_event`, without the peer's core:
//! the responder looks the region up, then queues the header and a `Bytes` slice of it.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::wire::{self, ReadRequest, ResponseHead};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::link::{Exposure, Link, LinkEvent, LinkInfo, Registration};
use crate::pool::Pool;

/// How much to read ahead into the record buffer at once. Small enough that a large read
/// response is mostly read straight into its destination rather than copied from here.
const READ_CHUNK: usize = 64 << 10;
/// `poll_send` writes at once only when this much is queued; below it, frames of one
/// burst share a `writev` at the next `poll_flush`/`poll_event`. One syscall per small
/// frame would cap the small-message rate (measured on loopback: 0.34 M vs 7.6 M 64-byte
/// frames per second).
const SEND_BATCH: usize = 64 << 10;
/// Most chunks handed to one `writev`.
const MAX_IOVECS: usize = 64;
/// Responses we queue for a peer that does not read them before calling it a violation.
/// Honest peers stay at their `max_reads_in_flight` (8 by default); this only bounds the
/// memory a hostile one can make us hold.
const MAX_SERVES_QUEUED: usize = 65_536;

/// Where a posted read lands.
struct Dst {
    id: u64,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `ptr` is memory the driver lent us through `post_read`, valid until the read's
// `ReadDone` or the link's drop; it is only written from the link's owner, whichever
// thread that runs on.
unsafe impl Send for Dst {}

/// Where the record parser stands.
enum Recv {
    /// Between records.
    Header,
    /// Inside a frame of `len` bytes.
    Frame { len: usize },
    /// Inside a read request.
    Request,
    /// Inside a read response, before its head; `payload` bytes follow the head.
    ResponseHead { payload: usize },
    /// Streaming a successful response into `dst`; `done` bytes are in.
    ResponseData { dst: Dst, done: usize },
    /// Collecting the error text of a refused read.
    ResponseError { id: u64, len: usize },
}

/// One end of an Ibex connection over TCP. Made by [`super::connect`] or
/// [`super::TcpListener::accept`]; see the module docs of [`crate::tcp`].
pub struct TcpLink {
    stream: TcpStream,
    peer: String,
    /// Largest frame the peer accepts (its slot size).
    peer_slot: usize,
    /// Largest inbound frame record we accept.
    max_in_frame: usize,
    pool_size: usize,
    pool: OnceLock<Arc<Pool>>,

    /// Write queue: `out` first, then `staging`.
    out: VecDeque<Bytes>,
    staging: BytesMut,
    /// Bytes in `out` plus `staging`.
    queued: usize,
    /// Stream positions (bytes ever queued / written) for tracking served responses.
    enqueued_total: u64,
    written_total: u64,
    /// End positions of read responses not fully written yet.
    serves: VecDeque<u64>,

    rbuf: BytesMut,
    recv: Recv,
    /// Posted reads whose response has not started, in request order.
    reads: VecDeque<Dst>,

    regions: HashMap<u64, Bytes>,
    next_region: u64,

    /// Set once the link failed; later calls report it.
    dead: Option<Error>,
    /// `close()` was called: shut the write side down once the queue drains.
    closing: bool,
    shut: bool,
}

impl std::fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLink")
            .field("peer", &self.peer)
            .field("queued", &self.queued)
            .field("reads", &self.reads.len())
            .field("regions", &self.regions.len())
            .field("dead", &self.dead)
            .finish()
    }
}

impl TcpLink {
    pub(crate) fn new(
        stream: TcpStream,
        peer: String,
        config: &Config,
        peer_slot: usize,
    ) -> TcpLink {
        // Peers send us frames sized for our slots; the peer's own slot size and a 64 KiB
        // floor are accepted too so a mismatch in what "slot size" covers is never fatal.
        let max_in_frame =
            config.slot_size.max(peer_slot).max(wire::MIN_FRAME_LIMIT) + wire::FRAME_SLACK;
        TcpLink {
            stream,
            peer,
            peer_slot,
            max_in_frame,
            pool_size: config.pool_size,
            pool: OnceLock::new(),
            out: VecDeque::new(),
            staging: BytesMut::with_capacity(READ_CHUNK),
            queued: 0,
            enqueued_total: 0,
            written_total: 0,
            serves: VecDeque::new(),
            rbuf: BytesMut::with_capacity(READ_CHUNK),
            recv: Recv::Header,
            reads: VecDeque::new(),
            regions: HashMap::new(),
            next_region: 1,
            dead: None,
            closing: false,
            shut: false,
        }
    }

    /// Address of the other end.
    pub fn peer_addr(&self) -> &str {
        &self.peer
    }

    /// Reads posted and not yet completed.
    pub fn reads_outstanding(&self) -> usize {
        self.reads.len()
            + usize::from(matches!(
                self.recv,
                Recv::ResponseData { .. } | Recv::ResponseError { .. }
            ))
    }

    /// Bytes taken for sending and not yet written to the socket.
    pub fn bytes_queued(&self) -> usize {
        self.queued
    }

    fn die(&mut self, e: Error) {
        if self.dead.is_none() {
            tracing::debug!(peer = %self.peer, error = %e, "tcp link failed");
            self.dead = Some(e);
        }
        // Nothing more will be written: let go of the exposed buffers' clones now.
        self.out.clear();
        self.staging.clear();
        self.queued = 0;
        self.serves.clear();
    }

    fn gone(&self, e: io::Error) -> Error {
        Error::PeerGone(format!("connection to {} failed: {e}", self.peer))
    }

    fn room_for_frame(&self) -> bool {
        self.queued == 0 || self.queued < 2 * (self.peer_slot + wire::RECORD_HEADER)
    }

    /// Accounts for `n` bytes just appended to `staging`.
    fn staged(&mut self, n: usize) {
        self.queued += n;
        self.enqueued_total += n as u64;
    }

    /// Queues `b` after everything staged so far, without copying it.
    fn queue_bytes(&mut self, b: Bytes) {
        if b.is_empty() {
            return;
        }
        if !self.staging.is_empty() {
            let s = self.staging.split().freeze();
            self.out.push_back(s);
        }
        self.queued += b.len();
        self.enqueued_total += b.len() as u64;
        self.out.push_back(b);
    }

    /// Drops `n` written bytes from the head of the queue.
    fn consume(&mut self, mut n: usize) {
        self.queued -= n;
        self.written_total += n as u64;
        while n > 0 {
            match self.out.front_mut() {
                Some(front) if n >= front.len() => {
                    n -= front.len();
                    self.out.pop_front();
                }
                Some(front) => {
                    front.advance(n);
                    n = 0;
                }
                None => {
                    self.staging.advance(n);
                    n = 0;
                }
            }
        }
        while self
            .serves
            .front()
            .is_some_and(|&end| end <= self.written_total)
        {
            self.serves.pop_front();
        }
    }

    /// Writes as much of the queue as the socket takes. With `cx`, `Pending` means the
    /// writer's waker is registered; without one (from `post_read`, `close`) nothing is
    /// registered, so an earlier registration by the driver stays in place.
    fn poll_write_out(&mut self, mut cx: Option<&mut Context<'_>>) -> Poll<Result<()>> {
        while self.queued > 0 {
            let mut iov = [IoSlice::new(&[]); MAX_IOVECS];
            let mut n = 0;
            for b in self.out.iter().take(MAX_IOVECS) {
                iov[n] = IoSlice::new(b);
                n += 1;
            }
            // `staging` follows every chunk of `out`, so it may only join when all did.
            if n < MAX_IOVECS && n == self.out.len() && !self.staging.is_empty() {
                iov[n] = IoSlice::new(&self.staging);
                n += 1;
            }
            match self.stream.try_write_vectored(&iov[..n]) {
                Ok(0) => {
                    return Poll::Ready(Err(Error::PeerGone(format!(
                        "connection to {} accepts no more data",
                        self.peer
                    ))));
                }
                Ok(w) => self.consume(w),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => match cx.as_deref_mut() {
                    Some(cx) => match self.stream.poll_write_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(self.gone(e))),
                        Poll::Pending => return Poll::Pending,
                    },
                    None => return Poll::Pending,
                },
                Err(e) => return Poll::Ready(Err(self.gone(e))),
            }
        }
        if self.closing && !self.shut {
            self.shut = true;
            // The peer sees end of stream right after our last record.
            let waker = std::task::Waker::noop();
            let mut ncx = Context::from_waker(waker);
            let _ = Pin::new(&mut self.stream).poll_shutdown(&mut ncx);
        }
        Poll::Ready(Ok(()))
    }

    /// Flushes without a context, recording a failure for `poll_event` to report.
    fn flush_now(&mut self) {
        if let Poll::Ready(Err(e)) = self.poll_write_out(None) {
            self.die(e);
        }
    }

    /// Makes `rbuf` hold at least `n` bytes.
    fn poll_fill(&mut self, cx: &mut Context<'_>, n: usize) -> Poll<Result<()>> {
        while self.rbuf.len() < n {
            let want = (n - self.rbuf.len()).max(READ_CHUNK);
            self.rbuf.reserve(want);
            if let Err(e) = ready!(self.stream.poll_read_ready(cx)) {
                return Poll::Ready(Err(self.gone(e)));
            }
            match self.stream.try_read_buf(&mut (&mut self.rbuf).limit(want)) {
                Ok(0) => return Poll::Ready(Err(self.eof())),
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Poll::Ready(Err(self.gone(e))),
            }
        }
        Poll::Ready(Ok(()))
    }

    fn eof(&self) -> Error {
        if matches!(self.recv, Recv::Header) && self.rbuf.is_empty() {
            Error::PeerGone(format!("{} closed the connection", self.peer))
        } else {
            Error::PeerGone(format!(
                "{} closed the connection in the middle of a record",
                self.peer
            ))
        }
    }

    /// One step of the record parser: `Some` event, or `None` when it consumed something
    /// that is not an event for the driver (a record header, a served request).
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<LinkEvent>>> {
        match &self.recv {
            Recv::Header => {
                ready!(self.poll_fill(cx, wire::RECORD_HEADER))?;
                let (kind, len) = wire::record_header(&self.rbuf);
                let len = len as usize;
                self.recv = match kind {
                    wire::T_FRAME if len <= self.max_in_frame => Recv::Frame { len },
                    wire::T_FRAME => {
                        return Poll::Ready(Err(Error::Protocol(format!(
                            "tcp frame record of {len} bytes exceeds the limit of {} bytes",
                            self.max_in_frame
                        ))));
                    }
                    wire::T_READ_REQUEST if len == wire::READ_REQUEST_BODY => Recv::Request,
                    wire::T_READ_REQUEST => {
                        return Poll::Ready(Err(Error::Protocol(format!(
                            "tcp read request of {len} bytes, expected {}",
                            wire::READ_REQUEST_BODY
                        ))));
                    }
                    wire::T_READ_RESPONSE
                        if len >= wire::READ_RESPONSE_HEAD
                            && len - wire::READ_RESPONSE_HEAD <= wire::MAX_READ =>
                    {
                        Recv::ResponseHead {
                            payload: len - wire::READ_RESPONSE_HEAD,
                        }
                    }
                    wire::T_READ_RESPONSE => {
                        return Poll::Ready(Err(Error::Protocol(format!(
                            "tcp read response record of {len} bytes is outside {}..={}",
                            wire::READ_RESPONSE_HEAD,
                            wire::READ_RESPONSE_HEAD + wire::MAX_READ
                        ))));
                    }
                    other => {
                        return Poll::Ready(Err(Error::Protocol(format!(
                            "unknown tcp record type {other}; is the peer a different Ibex release?"
                        ))));
                    }
                };
                self.rbuf.advance(wire::RECORD_HEADER);
                Poll::Ready(Ok(None))
            }
            &Recv::Frame { len } => {
                ready!(self.poll_fill(cx, len))?;
                let frame = self.rbuf.split_to(len).freeze();
                self.recv = Recv::Header;
                Poll::Ready(Ok(Some(LinkEvent::Frame(frame))))
            }
            Recv::Request => {
                ready!(self.poll_fill(cx, wire::READ_REQUEST_BODY))?;
                let req = wire::read_request(&self.rbuf[..wire::READ_REQUEST_BODY]);
                self.rbuf.advance(wire::READ_REQUEST_BODY);
                self.recv = Recv::Header;
                self.serve(req)?;
                Poll::Ready(Ok(None))
            }
            &Recv::ResponseHead { payload } => {
                ready!(self.poll_fill(cx, wire::READ_RESPONSE_HEAD))?;
                let head = wire::response_head(&self.rbuf[..wire::READ_RESPONSE_HEAD]);
                self.start_response(head, payload)?;
                self.rbuf.advance(wire::READ_RESPONSE_HEAD);
                Poll::Ready(Ok(None))
            }
            Recv::ResponseData { .. } => self.poll_payload(cx),
            &Recv::ResponseError { id, len } => {
                ready!(self.poll_fill(cx, len))?;
                let text = String::from_utf8_lossy(&self.rbuf[..len]).into_owned();
                self.rbuf.advance(len);
                self.recv = Recv::Header;
                let result = Err(Error::Protocol(format!(
                    "{} refused a read: {text}",
                    self.peer
                )));
                Poll::Ready(Ok(Some(LinkEvent::ReadDone { id, result })))
            }
        }
    }

    /// Matches a response head with the oldest posted read.
    fn start_response(&mut self, head: ResponseHead, payload: usize) -> Result<()> {
        if head.len as usize != payload {
            return Err(Error::Protocol(format!(
                "tcp read response claims {} payload bytes in a record carrying {payload}",
                head.len
            )));
        }
        let Some(front) = self.reads.front() else {
            return Err(Error::Protocol(format!(
                "tcp read response for read {} but no read is outstanding",
                head.read_id
            )));
        };
        if front.id != head.read_id {
            return Err(Error::Protocol(format!(
                "tcp read response for read {} but read {} was requested first (responses must keep request order)",
                head.read_id, front.id
            )));
        }
        if head.status == wire::STATUS_OK && payload != front.len {
            return Err(Error::Protocol(format!(
                "tcp read response for read {} carries {payload} bytes, {} were requested",
                head.read_id, front.len
            )));
        }
        if head.status != wire::STATUS_OK && payload > wire::MAX_ERROR_TEXT {
            return Err(Error::Protocol(format!(
                "tcp read error text of {payload} bytes exceeds {} bytes",
                wire::MAX_ERROR_TEXT
            )));
        }
        let Some(dst) = self.reads.pop_front() else {
            return Err(Error::Protocol(
                "tcp read queue emptied unexpectedly".into(),
            ));
        };
        self.recv = if head.status == wire::STATUS_OK {
            Recv::ResponseData { dst, done: 0 }
        } else {
            Recv::ResponseError {
                id: dst.id,
                len: payload,
            }
        };
        Ok(())
    }

    /// Moves a response payload into its destination: what is buffered by copy, the rest
    /// by reading the socket straight into the destination.
    fn poll_payload(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<LinkEvent>>> {
        let Recv::ResponseData { dst, done } = &mut self.recv else {
            return Poll::Ready(Ok(None));
        };
        if *done < dst.len && !self.rbuf.is_empty() {
            let n = self.rbuf.len().min(dst.len - *done);
            // SAFETY: `dst.ptr..+dst.len` is valid for writes and ours alone until this
            // read's `ReadDone` (post_read's contract); `*done + n <= dst.len`, and `rbuf`
            // is our own allocation, so the ranges cannot overlap.
            unsafe { std::ptr::copy_nonoverlapping(self.rbuf.as_ptr(), dst.ptr.add(*done), n) };
            self.rbuf.advance(n);
            *done += n;
        }
        while *done < dst.len {
            // SAFETY: as above; the slice covers exactly the part not yet filled, and
            // `MaybeUninit` makes no claim that it holds initialised bytes.
            let rest = unsafe {
                std::slice::from_raw_parts_mut(
                    dst.ptr.add(*done).cast::<MaybeUninit<u8>>(),
                    dst.len - *done,
                )
            };
            let mut rb = ReadBuf::uninit(rest);
            match Pin::new(&mut self.stream).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                    return Poll::Ready(Err(Error::PeerGone(format!(
                        "{} closed the connection in the middle of a read response",
                        self.peer
                    ))));
                }
                Poll::Ready(Ok(())) => *done += rb.filled().len(),
                Poll::Ready(Err(e)) => {
                    return Poll::Ready(Err(Error::PeerGone(format!(
                        "connection to {} failed: {e}",
                        self.peer
                    ))));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        let id = dst.id;
        self.recv = Recv::Header;
        Poll::Ready(Ok(Some(LinkEvent::ReadDone { id, result: Ok(()) })))
    }

    /// Answers a peer's read request: the data as a slice of the exposed buffer, or an
    /// error text. A bad request is the peer's mistake about one region, not a broken
    /// stream, so it fails only that read.
    fn serve(&mut self, req: ReadRequest) -> Result<()> {
        if self.closing {
            // Our write side is (about to be) shut: the peer learns from end of stream that
            // this read will never be answered, and fails it then.
            return Ok(());
        }
        if self.serves.len() >= MAX_SERVES_QUEUED {
            return Err(Error::Protocol(format!(
                "{} keeps more than {MAX_SERVES_QUEUED} tcp reads outstanding without reading the responses",
                self.peer
            )));
        }
        let answer = match self.regions.get(&req.region_id) {
            None => Err(format!(
                "unknown region {} (never exposed, or already withdrawn)",
                req.region_id
            )),
            Some(region) => match req.offset.checked_add(u64::from(req.len)) {
                Some(end) if end <= region.len() as u64 && (req.len as usize) <= wire::MAX_READ => {
                    Ok(region.slice(req.offset as usize..end as usize))
                }
                _ if req.len as usize > wire::MAX_READ => Err(format!(
                    "read of {} bytes exceeds the tcp limit of {} bytes per request",
                    req.len,
                    wire::MAX_READ
                )),
                _ => Err(format!(
                    "range of {} bytes at offset {} is outside region {} of {} bytes",
                    req.len,
                    req.offset,
                    req.region_id,
                    region.len()
                )),
            },
        };
        let before = self.staging.len();
        match answer {
            Ok(data) => {
                let head = ResponseHead {
                    read_id: req.read_id,
                    status: wire::STATUS_OK,
                    len: req.len,
                };
                wire::put_response_head(&mut self.staging, &head);
                self.staged(self.staging.len() - before);
                self.queue_bytes(data);
            }
            Err(text) => {
                tracing::debug!(peer = %self.peer, read = req.read_id, %text, "refusing tcp read");
                let mut text = text.into_bytes();
                text.truncate(wire::MAX_ERROR_TEXT);
                let head = ResponseHead {
                    read_id: req.read_id,
                    status: wire::STATUS_REFUSED,
                    len: text.len() as u32,
                };
                wire::put_response_head(&mut self.staging, &head);
                self.staging.put_slice(&text);
                self.staged(self.staging.len() - before);
            }
        }
        self.serves.push_back(self.enqueued_total);
        Ok(())
    }

    /// After a failure: first fail every read still owed a completion, then the link.
    fn poll_dead(&mut self, err: Error) -> Poll<Result<LinkEvent>> {
        let in_flight = match std::mem::replace(&mut self.recv, Recv::Header) {
            Recv::ResponseData { dst, .. } => Some(dst.id),
            Recv::ResponseError { id, .. } => Some(id),
            _ => None,
        };
        match in_flight.or_else(|| self.reads.pop_front().map(|d| d.id)) {
            Some(id) => Poll::Ready(Ok(LinkEvent::ReadDone {
                id,
                result: Err(err),
            })),
            None => Poll::Ready(Err(err)),
        }
    }
}

impl Link for TcpLink {
    fn info(&self) -> LinkInfo {
        LinkInfo {
            provider: "tcp",
            max_frame: self.peer_slot,
            rendezvous_path: "tcp-stream".into(),
            one_sided: false,
            peer: self.peer.clone(),
            pipelined_reads: false,
            dma_reads: false,
            read_depth: usize::MAX,
            max_read: usize::MAX,
            registrar: None,
        }
    }

    fn poll_send(&mut self, cx: &mut Context<'_>, frame: &[u8]) -> Poll<Result<()>> {
        self.poll_send_parts(cx, frame, &[])
    }

    /// Both parts go straight into the staging buffer: no frame is assembled first.
    fn poll_send_parts(
        &mut self,
        cx: &mut Context<'_>,
        head: &[u8],
        body: &[u8],
    ) -> Poll<Result<()>> {
        let len = head.len() + body.len();
        if let Some(e) = &self.dead {
            return Poll::Ready(Err(e.clone()));
        }
        if self.closing {
            return Poll::Ready(Err(Error::LocallyClosed));
        }
        if len > self.peer_slot {
            return Poll::Ready(Err(Error::TooLarge {
                len: len as u64,
                limit: self.peer_slot as u64,
                which: "slot size of the peer (its Config::slot_size)",
            }));
        }
        if !self.room_for_frame() {
            if let Poll::Ready(Err(e)) = self.poll_write_out(Some(cx)) {
                self.die(e.clone());
                return Poll::Ready(Err(e));
            }
            if !self.room_for_frame() {
                return Poll::Pending;
            }
        }
        wire::put_record_header(&mut self.staging, wire::T_FRAME, len as u32);
        self.staging.put_slice(head);
        self.staging.put_slice(body);
        self.staged(wire::RECORD_HEADER + len);
        if self.queued < SEND_BATCH {
            // Leave it for `poll_flush`/`poll_event`, which the driver's task reaches before
            // it sleeps: this wake makes sure it does even if it calls neither right away.
            cx.waker().wake_by_ref();
            return Poll::Ready(Ok(()));
        }
        if let Poll::Ready(Err(e)) = self.poll_write_out(Some(cx)) {
            self.die(e.clone());
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(()))
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if let Some(e) = &self.dead {
            return Poll::Ready(Err(e.clone()));
        }
        match self.poll_write_out(Some(cx)) {
            Poll::Ready(Err(e)) => {
                self.die(e.clone());
                Poll::Ready(Err(e))
            }
            other => other,
        }
    }

    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Result<LinkEvent>> {
        loop {
            if let Some(e) = &self.dead {
                let e = e.clone();
                return self.poll_dead(e);
            }
            // Responses owed to the peer go out even while nothing arrives for us.
            if let Poll::Ready(Err(e)) = self.poll_write_out(Some(cx)) {
                self.die(e);
                continue;
            }
            match self.poll_recv(cx) {
                Poll::Ready(Ok(Some(event))) => return Poll::Ready(Ok(event)),
                Poll::Ready(Ok(None)) => {}
                Poll::Ready(Err(e)) => self.die(e),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn expose(&mut self, buf: Bytes) -> Result<Exposure> {
        let id = self.next_region;
        self.next_region += 1;
        let descriptor = wire::descriptor(id, buf.len() as u64);
        self.regions.insert(id, buf);
        Ok(Exposure {
            id,
            descriptor,
            zero_copy: false,
            registration: Registration::NotNeeded,
        })
    }

    fn withdraw(&mut self, id: u64) -> Option<Bytes> {
        self.regions.remove(&id)
    }

    fn map_remote(&mut self, descriptor: &[u8], len: u64) -> Result<Option<Bytes>> {
        let (region, region_len) = wire::parse_descriptor(descriptor)?;
        if len > region_len {
            return Err(Error::Protocol(format!(
                "message of {len} bytes claims region {region}, which holds only {region_len} bytes"
            )));
        }
        Ok(None)
    }

    unsafe fn post_read(
        &mut self,
        id: u64,
        descriptor: &[u8],
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<()> {
        if let Some(e) = &self.dead {
            return Err(e.clone());
        }
        if self.closing {
            return Err(Error::LocallyClosed);
        }
        let (region_id, region_len) = wire::parse_descriptor(descriptor)?;
        if len > wire::MAX_READ {
            return Err(Error::TooLarge {
                len: len as u64,
                limit: wire::MAX_READ as u64,
                which: "largest single tcp read; lower Config::fragment_size",
            });
        }
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > region_len)
        {
            return Err(Error::Protocol(format!(
                "read of {len} bytes at offset {offset} is outside region {region_id} of {region_len} bytes"
            )));
        }
        self.reads.push_back(Dst { id, ptr: dst, len });
        let before = self.staging.len();
        let req = ReadRequest {
            read_id: id,
            region_id,
            offset,
            len: len as u32,
        };
        wire::put_read_request(&mut self.staging, &req);
        self.staged(self.staging.len() - before);
        self.flush_now();
        Ok(())
    }

    fn pool(&self) -> Option<Arc<Pool>> {
        Some(self.pool.get_or_init(|| Pool::heap(self.pool_size)).clone())
    }

    fn close(&mut self) {
        self.closing = true;
        if self.dead.is_none() {
            self.flush_now();
        }
    }
}
