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
//!
//! A message body up to [`wire::MAX_PUSH`] is pushed instead, towards a peer that takes
//! pushes (the core decides which, from `LinkInfo::max_push`): it follows the next frame written after it was exposed (normally the RTS that
//! announces it), so the reader's reads, posted when that RTS arrived, are filled straight
//! from the socket without a request. A push that finds its reads not posted yet is held
//! (up to [`wire::MAX_HELD`]) and copied out when they come, or dropped, and then read the
//! usual way.

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
use crate::link::{Exposure, Link, LinkEvent, LinkInfo, PushStats, Registration};
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

/// A read posted for a pushed region.
struct PushRead {
    dst: Dst,
    region: u64,
    offset: u64,
    /// The region's length as its descriptor gave it.
    region_len: u64,
}

/// A message body exposed for a peer that takes pushes, not written yet.
struct Push {
    region: u64,
    data: Bytes,
    /// `frames_staged` when it was exposed: it goes once a later frame is staged.
    after: u64,
}

/// A push that arrived before its reads were posted.
struct Held {
    buf: Vec<u8>,
    /// Bytes copied out to reads so far.
    served: usize,
}

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
    /// Inside a push record, before its head; `payload` bytes follow the head.
    PushHead { payload: usize },
    /// Streaming a push into the reads that tile it, in offset order; `done` bytes of
    /// the first are in.
    PushInto {
        reads: VecDeque<PushRead>,
        done: usize,
    },
    /// Reading a push of `len` bytes into a buffer of its own; `waiters`
    /// are reads of it posted meanwhile, or before but not tiling it.
    PushHold {
        region: u64,
        len: usize,
        buf: Vec<u8>,
        waiters: Vec<PushRead>,
    },
    /// Dropping `left` more bytes of a push nobody will take from here.
    PushSkip { left: usize },
}

/// One end of an Ibex connection over TCP. Made by [`super::connect`] or
/// [`super::TcpListener::accept`]; see the module docs of [`crate::tcp`].
pub struct TcpLink {
    stream: TcpStream,
    /// The rustls session where the link runs over TLS: every byte to and from `stream`
    /// passes through it.
    tls: Option<Box<TlsIo>>,
    local_addr: Option<std::net::SocketAddr>,
    tls_peer: Option<Arc<crate::tls::TlsPeer>>,
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

    /// The peer takes pushes (its preface's `FEATURE_TCP_PUSH`).
    push_to_peer: bool,
    /// Message bodies to push, in exposure order.
    pushes: VecDeque<Push>,
    /// Frames staged so far (orders pushes behind their RTS).
    frames_staged: u64,
    /// The highest region the peer has pushed; pushes come in exposure order, so a pushed
    /// region at or below it that is not held was dropped.
    last_push: u64,
    /// Reads of pushed regions whose push has not arrived.
    awaiting: HashMap<u64, Vec<PushRead>>,
    /// The highest pushed region a read was posted for. The reader reads messages in order,
    /// so a push of a lower region that is not being read will not be (its message was
    /// refused, say): it is not held, or no longer.
    marked_read_max: u64,
    /// Pushes that arrived before their reads, and their bytes.
    held: HashMap<u64, Held>,
    held_bytes: usize,
    /// Reads completed outside the parser (from held pushes), and failed reads after death.
    completions: VecDeque<LinkEvent>,
    push_stats: PushStats,

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
        session: Option<crate::tls::Session>,
        peer: String,
        config: &Config,
        peer_slot: usize,
        push_to_peer: bool,
    ) -> TcpLink {
        // Peers send us frames sized for our slots; the peer's own slot size and a 64 KiB
        // floor are accepted too so a mismatch in what "slot size" covers is never fatal.
        let max_in_frame =
            config.slot_size.max(peer_slot).max(wire::MIN_FRAME_LIMIT) + wire::FRAME_SLACK;
        let local_addr = stream.local_addr().ok();
        let (tls, tls_peer) = match session {
            Some(s) => {
                let mut conn = s.conn;
                conn.set_buffer_limit(Some(TLS_SEND_LIMIT));
                let io = TlsIo {
                    conn,
                    raw: BytesMut::new(),
                    eof: false,
                    notified: false,
                };
                (Some(Box::new(io)), Some(Arc::new(s.peer)))
            }
            None => (None, None),
        };
        TcpLink {
            stream,
            tls,
            local_addr,
            tls_peer,
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
            push_to_peer,
            pushes: VecDeque::new(),
            frames_staged: 0,
            last_push: 0,
            awaiting: HashMap::new(),
            marked_read_max: 0,
            held: HashMap::new(),
            held_bytes: 0,
            completions: VecDeque::new(),
            push_stats: PushStats::default(),
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
        let in_recv = match &self.recv {
            Recv::ResponseData { .. } | Recv::ResponseError { .. } => 1,
            Recv::PushInto { reads, .. } => reads.len(),
            Recv::PushHold { waiters, .. } => waiters.len(),
            _ => 0,
        };
        let done = self
            .completions
            .iter()
            .filter(|e| matches!(e, LinkEvent::ReadDone { .. }))
            .count();
        self.reads.len() + in_recv + self.awaiting.values().map(Vec::len).sum::<usize>() + done
    }

    /// Pushes in, complete, whose reads have not all been posted.
    pub fn pushes_held(&self) -> usize {
        self.held.len()
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
        self.pushes.clear();
        self.held.clear();
        self.held_bytes = 0;
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
        self.release_pushes();
        if self.tls.is_some() {
            return self.poll_write_out_tls(cx);
        }
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

    /// [`Self::poll_write_out`] through the TLS session: its records go out first, then
    /// the queue's plaintext goes in, as much as the session takes ([`TLS_SEND_LIMIT`]),
    /// so that neither it nor the queue holds more than its bound. Out of line, so that
    /// plain tcp's path stays as small as it was.
    #[inline(never)]
    fn poll_write_out_tls(&mut self, mut cx: Option<&mut Context<'_>>) -> Poll<Result<()>> {
        loop {
            let Some(tls) = self.tls.as_deref_mut() else {
                return Poll::Ready(Ok(()));
            };
            while tls.conn.wants_write() {
                match tls.conn.write_tls(&mut SockWriter(&self.stream)) {
                    Ok(0) => {
                        return Poll::Ready(Err(Error::PeerGone(format!(
                            "connection to {} accepts no more data",
                            self.peer
                        ))));
                    }
                    Ok(_) => {}
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
            if self.queued == 0 {
                if self.closing && !tls.notified {
                    // The peer's session sees a clean end rather than a truncation.
                    tls.notified = true;
                    tls.conn.send_close_notify();
                    continue;
                }
                break;
            }
            let mut iov = [IoSlice::new(&[]); MAX_IOVECS];
            let mut n = 0;
            for b in self.out.iter().take(MAX_IOVECS) {
                iov[n] = IoSlice::new(b);
                n += 1;
            }
            if n < MAX_IOVECS && n == self.out.len() && !self.staging.is_empty() {
                iov[n] = IoSlice::new(&self.staging);
                n += 1;
            }
            match io::Write::write_vectored(&mut tls.conn.writer(), &iov[..n]) {
                // Its records were all written above, so it has room: nothing taken means
                // a session that can no longer send.
                Ok(0) => {
                    return Poll::Ready(Err(Error::PeerGone(format!(
                        "the TLS session with {} takes no more data",
                        self.peer
                    ))));
                }
                Ok(w) => self.consume(w),
                Err(e) => {
                    return Poll::Ready(Err(Error::PeerGone(format!(
                        "TLS with {} failed: {e}",
                        self.peer
                    ))));
                }
            }
        }
        if self.closing && !self.shut {
            self.shut = true;
            let waker = std::task::Waker::noop();
            let mut ncx = Context::from_waker(waker);
            let _ = Pin::new(&mut self.stream).poll_shutdown(&mut ncx);
        }
        Poll::Ready(Ok(()))
    }

    /// Queues the pushes whose RTS may be staged by now: those exposed before the last frame
    /// staged. A push is never queued ahead of the frame that follows its exposure, so its
    /// reader has normally posted the reads before the bytes come.
    fn release_pushes(&mut self) {
        while self
            .pushes
            .front()
            .is_some_and(|p| p.after < self.frames_staged)
        {
            let Some(p) = self.pushes.pop_front() else {
                break;
            };
            let before = self.staging.len();
            wire::put_push_head(&mut self.staging, p.region, p.data.len() as u32);
            self.staged(self.staging.len() - before);
            self.queue_bytes(p.data);
            self.push_stats.sent += 1;
        }
    }

    /// Flushes without a context, recording a failure for `poll_event` to report.
    fn flush_now(&mut self) {
        if let Poll::Ready(Err(e)) = self.poll_write_out(None) {
            self.die(e);
        }
    }

    /// Makes `rbuf` hold at least `n` bytes.
    fn poll_fill(&mut self, cx: &mut Context<'_>, n: usize) -> Poll<Result<()>> {
        if self.tls.is_some() {
            return self.poll_fill_tls(cx, n);
        }
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

    /// [`Self::poll_fill`] from the TLS session's plaintext. Out of line, so that plain
    /// tcp's path stays as small as it was.
    #[inline(never)]
    fn poll_fill_tls(&mut self, cx: &mut Context<'_>, n: usize) -> Poll<Result<()>> {
        if let Some(tls) = self.tls.as_deref_mut() {
            while self.rbuf.len() < n {
                let want = (n - self.rbuf.len()).max(READ_CHUNK);
                match ready!(tls.poll_plain(&self.stream, cx)) {
                    Ok(true) => {}
                    Ok(false) => return Poll::Ready(Err(self.eof())),
                    Err(e) => return Poll::Ready(Err(self.tls_failed(e))),
                }
                let mut r = tls.conn.reader();
                let k = match io::BufRead::fill_buf(&mut r) {
                    Ok(b) => {
                        let k = b.len().min(want);
                        self.rbuf.extend_from_slice(&b[..k]);
                        k
                    }
                    Err(e) => return Poll::Ready(Err(self.tls_failed(e))),
                };
                io::BufRead::consume(&mut r, k);
            }
        }
        Poll::Ready(Ok(()))
    }

    /// A failure of the TLS session or of the socket under it.
    fn tls_failed(&self, e: io::Error) -> Error {
        match e.kind() {
            // The peer's TCP closed without a close_notify: as good as the end of stream
            // for the record parser, which knows whether a record was cut.
            io::ErrorKind::UnexpectedEof => self.eof(),
            io::ErrorKind::InvalidData => Error::Protocol(format!(
                "TLS with {} failed: {e} (a corrupted or forged record)",
                self.peer
            )),
            _ => self.gone(e),
        }
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
                    wire::T_PUSH
                        if len > wire::PUSH_HEAD && len - wire::PUSH_HEAD <= wire::MAX_PUSH =>
                    {
                        Recv::PushHead {
                            payload: len - wire::PUSH_HEAD,
                        }
                    }
                    wire::T_PUSH => {
                        return Poll::Ready(Err(Error::Protocol(format!(
                            "tcp push record of {len} bytes is outside {}..={}",
                            wire::PUSH_HEAD + 1,
                            wire::PUSH_HEAD + wire::MAX_PUSH
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
            &Recv::PushHead { payload } => {
                ready!(self.poll_fill(cx, wire::PUSH_HEAD))?;
                let (region, len) = wire::push_head(&self.rbuf[..wire::PUSH_HEAD]);
                self.rbuf.advance(wire::PUSH_HEAD);
                self.start_push(region, len as usize, payload)?;
                Poll::Ready(Ok(None))
            }
            Recv::PushInto { .. } => self.poll_push_into(cx),
            Recv::PushHold { .. } => self.poll_push_hold(cx),
            &Recv::PushSkip { left } => {
                if self.rbuf.is_empty() {
                    ready!(self.poll_fill(cx, 1))?;
                }
                let n = left.min(self.rbuf.len());
                self.rbuf.advance(n);
                self.recv = if n == left {
                    Recv::Header
                } else {
                    Recv::PushSkip { left: left - n }
                };
                Poll::Ready(Ok(None))
            }
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
        // SAFETY: `dst` is memory lent by `post_read`, valid for `dst.len` writes and ours
        // alone until this read's `ReadDone`.
        let r = unsafe {
            fill(
                &mut self.stream,
                self.tls.as_deref_mut(),
                &mut self.rbuf,
                cx,
                dst.ptr,
                dst.len,
                done,
            )
        };
        if let Err(e) = ready!(r) {
            return Poll::Ready(Err(self.cut_off(e, "a read response")));
        }
        let id = dst.id;
        self.recv = Recv::Header;
        Poll::Ready(Ok(Some(LinkEvent::ReadDone { id, result: Ok(()) })))
    }

    fn cut_off(&self, e: Option<io::Error>, what: &str) -> Error {
        match e {
            None => Error::PeerGone(format!(
                "{} closed the connection in the middle of {what}",
                self.peer
            )),
            Some(e) => self.gone(e),
        }
    }

    /// A push's head is in: stream it into the reads waiting for it if they tile it, else
    /// hold it for reads to come, else drop it and let its reads ask.
    fn start_push(&mut self, region: u64, len: usize, payload: usize) -> Result<()> {
        if len != payload {
            return Err(Error::Protocol(format!(
                "tcp push of region {region} claims {len} bytes in a record carrying {payload}"
            )));
        }
        if region <= self.last_push || region & wire::PUSHED != 0 {
            return Err(Error::Protocol(format!(
                "tcp push of region {region} after region {}: pushes must come in exposure order",
                self.last_push
            )));
        }
        self.last_push = region;
        // An owner pushes every region it marks, in order: reads of an earlier marked
        // region still waiting will not see it come, so they ask.
        let skipped: Vec<u64> = self
            .awaiting
            .keys()
            .copied()
            .filter(|&r| r < region)
            .collect();
        for r in skipped {
            for read in self.awaiting.remove(&r).unwrap_or_default() {
                self.push_stats.asked += 1;
                self.ask(read);
            }
        }
        let mut reads = self.awaiting.remove(&region).unwrap_or_default();
        reads.sort_by_key(|r| r.offset);
        let mut at = 0u64;
        let tiles = !reads.is_empty()
            && reads.iter().all(|r| {
                let ok = r.offset == at && r.region_len == len as u64;
                at += r.dst.len as u64;
                ok
            })
            && at == len as u64;
        if tiles {
            self.push_stats.direct += 1;
            self.recv = Recv::PushInto {
                reads: reads.into(),
                done: 0,
            };
            return Ok(());
        }
        // Reads of a region below one already read for will not come, or will ask.
        if region > self.marked_read_max && self.held_bytes + held_cost(len) <= wire::MAX_HELD {
            let mut buf = Vec::new();
            if buf.try_reserve_exact(len).is_ok() {
                self.held_bytes += held_cost(len);
                self.push_stats.held += 1;
                self.recv = Recv::PushHold {
                    region,
                    len,
                    buf,
                    waiters: reads,
                };
                return Ok(());
            }
        }
        self.push_stats.dropped += 1;
        for read in reads {
            self.push_stats.asked += 1;
            self.ask(read);
        }
        self.recv = Recv::PushSkip { left: len };
        Ok(())
    }

    /// Streams a push into the first of the reads that tile it; its `ReadDone` when full.
    fn poll_push_into(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<LinkEvent>>> {
        let Recv::PushInto { reads, done } = &mut self.recv else {
            return Poll::Ready(Ok(None));
        };
        let Some(front) = reads.front() else {
            self.recv = Recv::Header;
            return Poll::Ready(Ok(None));
        };
        // SAFETY: `front.dst` is memory lent by `post_read`, valid for `dst.len` writes and
        // ours alone until its `ReadDone`.
        let r = unsafe {
            fill(
                &mut self.stream,
                self.tls.as_deref_mut(),
                &mut self.rbuf,
                cx,
                front.dst.ptr,
                front.dst.len,
                done,
            )
        };
        if let Err(e) = ready!(r) {
            return Poll::Ready(Err(self.cut_off(e, "a pushed region")));
        }
        let id = front.dst.id;
        reads.pop_front();
        *done = 0;
        if reads.is_empty() {
            self.recv = Recv::Header;
        }
        Poll::Ready(Ok(Some(LinkEvent::ReadDone { id, result: Ok(()) })))
    }

    /// Reads a push into its own buffer; then serves the reads already posted for it.
    fn poll_push_hold(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<LinkEvent>>> {
        let Recv::PushHold { len, buf, .. } = &mut self.recv else {
            return Poll::Ready(Ok(None));
        };
        let mut done = buf.len();
        // SAFETY: `buf` has room for `len` bytes (reserved in `start_push`), and `fill`
        // writes only `done..len` of it.
        let r = unsafe {
            fill(
                &mut self.stream,
                self.tls.as_deref_mut(),
                &mut self.rbuf,
                cx,
                buf.as_mut_ptr(),
                *len,
                &mut done,
            )
        };
        // SAFETY: `fill` initialised the first `done <= len` bytes (the earlier ones by
        // earlier calls).
        unsafe { buf.set_len(done) };
        if let Err(e) = ready!(r) {
            return Poll::Ready(Err(self.cut_off(e, "a pushed region")));
        }
        let Recv::PushHold {
            region,
            len,
            buf,
            waiters,
        } = std::mem::replace(&mut self.recv, Recv::Header)
        else {
            return Poll::Ready(Ok(None));
        };
        let mut held = Held { buf, served: 0 };
        for w in waiters {
            serve_held(&mut held, w, &mut self.completions);
        }
        if held.served < len && region > self.marked_read_max {
            self.held.insert(region, held);
        } else {
            self.held_bytes -= held_cost(len);
        }
        Poll::Ready(Ok(None))
    }

    /// Lets go of held pushes below `region`, which a read was just posted for: the reader
    /// reads messages in order, so theirs will not come (a late one asks).
    fn let_go_held_below(&mut self, region: u64) {
        if self.held.is_empty() {
            return;
        }
        let mut freed = 0;
        self.held.retain(|&r, h| {
            let keep = r >= region;
            if !keep {
                freed += held_cost(h.buf.len());
            }
            keep
        });
        self.held_bytes -= freed;
    }

    /// Asks the owner for a read the usual way (a request record); the caller flushes.
    fn ask(&mut self, read: PushRead) {
        let req = ReadRequest {
            read_id: read.dst.id,
            region_id: read.region,
            offset: read.offset,
            len: read.dst.len as u32,
        };
        self.reads.push_back(read.dst);
        let before = self.staging.len();
        wire::put_read_request(&mut self.staging, &req);
        self.staged(self.staging.len() - before);
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

    /// After a failure: first fail every read still owed a completion (the one being
    /// received first, then in request order, then those waiting for pushes), then the link.
    fn poll_dead(&mut self, err: Error) -> Poll<Result<LinkEvent>> {
        let mut ids = Vec::new();
        match std::mem::replace(&mut self.recv, Recv::Header) {
            Recv::ResponseData { dst, .. } => ids.push(dst.id),
            Recv::ResponseError { id, .. } => ids.push(id),
            Recv::PushInto { reads, .. } => ids.extend(reads.iter().map(|r| r.dst.id)),
            Recv::PushHold { waiters, .. } => ids.extend(waiters.iter().map(|r| r.dst.id)),
            _ => {}
        }
        ids.extend(self.reads.drain(..).map(|d| d.id));
        let mut waiting: Vec<u64> = self
            .awaiting
            .drain()
            .flat_map(|(_, reads)| reads.into_iter().map(|r| r.dst.id))
            .collect();
        waiting.sort_unstable();
        ids.extend(waiting);
        for id in ids {
            self.completions.push_back(LinkEvent::ReadDone {
                id,
                result: Err(err.clone()),
            });
        }
        match self.completions.pop_front() {
            Some(event) => Poll::Ready(Ok(event)),
            None => Poll::Ready(Err(err)),
        }
    }
}

/// Fills `ptr..ptr+len` from `done` on: first with what `rbuf` read ahead, then straight
/// from the socket, or from the TLS session's plaintext where there is one. `Err(None)`
/// is end of stream.
///
/// # Safety
/// `ptr..ptr+len` must be valid for writes and touched by nobody else during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn fill(
    stream: &mut TcpStream,
    tls: Option<&mut TlsIo>,
    rbuf: &mut BytesMut,
    cx: &mut Context<'_>,
    ptr: *mut u8,
    len: usize,
    done: &mut usize,
) -> Poll<std::result::Result<(), Option<io::Error>>> {
    if *done < len && !rbuf.is_empty() {
        let n = rbuf.len().min(len - *done);
        // SAFETY: `*done + n <= len` lies inside the destination (the caller's contract),
        // and `rbuf` is our own allocation, so the ranges cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(rbuf.as_ptr(), ptr.add(*done), n) };
        rbuf.advance(n);
        *done += n;
    }
    if let Some(tls) = tls {
        // SAFETY: the caller's contract, passed on.
        return unsafe { fill_tls(tls, stream, cx, ptr, len, done) };
    }
    while *done < len {
        // SAFETY: as above; the slice covers exactly the part not yet filled, and
        // `MaybeUninit` makes no claim that it holds initialised bytes.
        let rest = unsafe {
            std::slice::from_raw_parts_mut(ptr.add(*done).cast::<MaybeUninit<u8>>(), len - *done)
        };
        let mut rb = ReadBuf::uninit(rest);
        match Pin::new(&mut *stream).poll_read(cx, &mut rb) {
            Poll::Ready(Ok(())) if rb.filled().is_empty() => return Poll::Ready(Err(None)),
            Poll::Ready(Ok(())) => *done += rb.filled().len(),
            Poll::Ready(Err(e)) => return Poll::Ready(Err(Some(e))),
            Poll::Pending => return Poll::Pending,
        }
    }
    Poll::Ready(Ok(()))
}

/// The most ciphertext the TLS session holds for sending: once its records reach it, it
/// takes no more plaintext until the socket has taken them. Large enough that one writev
/// carries many records.
const TLS_SEND_LIMIT: usize = 256 << 10;
/// The most ciphertext read from the socket at once ahead of the session.
const TLS_READ_CHUNK: usize = 256 << 10;

/// The link's TLS session and the ciphertext read ahead for it.
struct TlsIo {
    conn: rustls::Connection,
    /// Ciphertext read from the socket that the session has not taken yet.
    raw: BytesMut,
    /// The socket has reached its end.
    eof: bool,
    /// The close_notify alert is queued.
    notified: bool,
}

impl TlsIo {
    /// Makes the session hold plaintext: `Ok(true)` when it does, `Ok(false)` at the
    /// peer's clean end (its close_notify); an `UnexpectedEof` error where the socket ended
    /// without one.
    fn poll_plain(&mut self, stream: &TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        loop {
            match io::BufRead::fill_buf(&mut self.conn.reader()) {
                Ok([]) => return Poll::Ready(Ok(false)),
                Ok(_) => return Poll::Ready(Ok(true)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
            if self.raw.is_empty() && !self.eof {
                self.raw.reserve(TLS_READ_CHUNK);
                match stream.try_read_buf(&mut (&mut self.raw).limit(TLS_READ_CHUNK)) {
                    Ok(0) => self.eof = true,
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        ready!(stream.poll_read_ready(cx))?;
                        continue;
                    }
                    Err(e) => return Poll::Ready(Err(e)),
                }
            }
            let mut rest: &[u8] = &self.raw;
            let taken = self.conn.read_tls(&mut rest)?;
            self.raw.advance(taken);
            let state = self
                .conn
                .process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            if taken == 0 && state.plaintext_bytes_to_read() == 0 && !self.eof {
                // The session took nothing and gave nothing: it is full of records it
                // cannot decrypt yet, which rustls bounds; never spin on it.
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "the TLS session stalled on its input",
                )));
            }
            if self.conn.wants_write() {
                // Alerts and key updates leave from the write side, which `poll_event`
                // runs before it reads.
                cx.waker().wake_by_ref();
            }
        }
    }
}

/// Non-blocking writes to the socket, for rustls' `write_tls`.
struct SockWriter<'a>(&'a TcpStream);

impl io::Write for SockWriter<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0.try_write(b)
    }

    fn write_vectored(&mut self, b: &[IoSlice<'_>]) -> io::Result<usize> {
        self.0.try_write_vectored(b)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// [`fill`] from the TLS session's plaintext: one copy out of the session's buffer, where
/// plain tcp reads the socket straight into the destination. Out of line, so that plain
/// tcp's path stays as small as it was.
///
/// # Safety
/// As [`fill`].
#[inline(never)]
unsafe fn fill_tls(
    tls: &mut TlsIo,
    stream: &TcpStream,
    cx: &mut Context<'_>,
    ptr: *mut u8,
    len: usize,
    done: &mut usize,
) -> Poll<std::result::Result<(), Option<io::Error>>> {
    while *done < len {
        match ready!(tls.poll_plain(stream, cx)) {
            Ok(true) => {}
            Ok(false) => return Poll::Ready(Err(None)),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Poll::Ready(Err(None));
            }
            Err(e) => return Poll::Ready(Err(Some(e))),
        }
        let mut r = tls.conn.reader();
        let k = match io::BufRead::fill_buf(&mut r) {
            Ok(b) => {
                let k = b.len().min(len - *done);
                // SAFETY: `*done + k <= len` lies inside the destination (the caller's
                // contract), and `b` is the session's own buffer, so they cannot overlap.
                unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), ptr.add(*done), k) };
                k
            }
            Err(e) => return Poll::Ready(Err(Some(e))),
        };
        io::BufRead::consume(&mut r, k);
        *done += k;
    }
    Poll::Ready(Ok(()))
}

/// What a held push of `len` bytes counts against [`wire::MAX_HELD`].
fn held_cost(len: usize) -> usize {
    len + wire::HELD_ENTRY_COST
}

/// Copies a held push out to one of its reads and queues the read's completion.
fn serve_held(held: &mut Held, read: PushRead, completions: &mut VecDeque<LinkEvent>) {
    let id = read.dst.id;
    let result = if read.region_len != held.buf.len() as u64 {
        Err(Error::Protocol(format!(
            "pushed region {} carried {} bytes, but its descriptor says {}",
            read.region,
            held.buf.len(),
            read.region_len
        )))
    } else {
        let at = read.offset as usize;
        // `post_read` checked `offset + len <= region_len`, which is the buffer's length.
        let src = &held.buf[at..at + read.dst.len];
        // SAFETY: `read.dst` is memory lent by `post_read`, valid for `dst.len` writes and
        // ours alone until its `ReadDone`; `src` is our own buffer, so they cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), read.dst.ptr, src.len()) };
        held.served += src.len();
        Ok(())
    };
    completions.push_back(LinkEvent::ReadDone { id, result });
}

impl Link for TcpLink {
    fn info(&self) -> LinkInfo {
        LinkInfo {
            provider: "tcp",
            max_frame: self.peer_slot,
            rendezvous_path: "tcp-stream".into(),
            one_sided: false,
            direct_reads: true,
            peer: self.peer.clone(),
            pipelined_reads: false,
            dma_reads: false,
            read_depth: usize::MAX,
            max_read: usize::MAX,
            max_push: if self.push_to_peer { wire::MAX_PUSH } else { 0 },
            registrar: None,
            local_addr: self.local_addr,
            tls: self.tls_peer.clone(),
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
        self.frames_staged += 1;
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
            if let Some(event) = self.completions.pop_front() {
                return Poll::Ready(Ok(event));
            }
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
        let descriptor = wire::descriptor(id, buf.len() as u64, false);
        self.regions.insert(id, buf);
        Ok(Exposure {
            id,
            descriptor,
            zero_copy: false,
            registration: Registration::NotNeeded,
        })
    }

    /// Pushes a body behind the next frame (its RTS, normally); it stays exposed too, for
    /// reads that ask all the same. Which bodies are pushed is the core's decision
    /// (`LinkCaps::pushes`, from `max_push` in [`Link::info`]); this link only never
    /// writes a push its peer would refuse, nor one it can no longer write.
    fn expose_pushed(&mut self, buf: Bytes) -> Result<Exposure> {
        let takes = self.push_to_peer && !buf.is_empty() && buf.len() <= wire::MAX_PUSH;
        if !takes || self.dead.is_some() || self.closing {
            return self.expose(buf);
        }
        let id = self.next_region;
        self.next_region += 1;
        let descriptor = wire::descriptor(id, buf.len() as u64, true);
        self.regions.insert(id, buf.clone());
        self.pushes.push_back(Push {
            region: id,
            data: buf,
            after: self.frames_staged,
        });
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

    fn push_stats(&self) -> PushStats {
        self.push_stats
    }

    fn has_completions(&self) -> bool {
        !self.completions.is_empty()
    }

    fn map_remote(&mut self, descriptor: &[u8], len: u64) -> Result<Option<Bytes>> {
        let d = wire::parse_descriptor(descriptor)?;
        if len > d.len {
            return Err(Error::Protocol(format!(
                "message of {len} bytes claims region {}, which holds only {} bytes",
                d.region_id, d.len
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
        let d = wire::parse_descriptor(descriptor)?;
        let (region_id, region_len) = (d.region_id, d.len);
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
        let read = PushRead {
            dst: Dst { id, ptr: dst, len },
            region: region_id,
            offset,
            region_len,
        };
        if d.pushed {
            if region_id > self.marked_read_max {
                self.marked_read_max = region_id;
                self.let_go_held_below(region_id);
            }
            if let Some(held) = self.held.get_mut(&region_id) {
                serve_held(held, read, &mut self.completions);
                if held.served >= held.buf.len() {
                    self.held_bytes -= held_cost(held.buf.len());
                    self.held.remove(&region_id);
                }
                return Ok(());
            }
            if let Recv::PushHold {
                region, waiters, ..
            } = &mut self.recv
                && *region == region_id
            {
                waiters.push(read);
                return Ok(());
            }
            if region_id > self.last_push {
                self.awaiting.entry(region_id).or_default().push(read);
                return Ok(());
            }
            // Dropped for want of room, or read a second time: ask.
            self.push_stats.asked += 1;
        }
        self.ask(read);
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
