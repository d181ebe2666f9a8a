//! The provider contract (s2n-quic style: one small trait per concern).
//!
//! A provider (`shm`, `tcp`, later `verbs`) sets up a connection and hands the connection
//! driver a [`Link`]. The driver owns the link exclusively and calls it only from its own
//! task, so implementations need no internal locking for the link itself. A link does five
//! things: deliver an eager frame into the peer's slots ([`Link::poll_send`]), hand over
//! inbound frames and read completions ([`Link::poll_event`]), expose a local buffer for
//! one-sided reads ([`Link::expose`]), read a described remote region into local memory
//! ([`Link::post_read`]), and, where memory is shared, map a peer buffer with no copy at all
//! ([`Link::map_remote`]).
//!
//! Frames are opaque to providers: the sans-IO core in [`crate::proto`] encodes and decodes
//! them. Descriptors are opaque to the core: each provider defines and validates its own.

use std::any::Any;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;

use crate::error::Error;
use crate::pool::{Pool, PoolBufMut};

/// Something the link has for the driver.
#[derive(Debug)]
pub enum LinkEvent {
    /// A whole frame arrived from the peer, in the order the peer sent it.
    Frame(Bytes),
    /// A read posted with [`Link::post_read`] finished (successfully or not).
    ReadDone {
        /// The id given to `post_read`.
        id: u64,
        /// `Err` if the region could not be read (peer gone, descriptor refused, ...).
        result: Result<(), Error>,
    },
}

/// What a link tells the driver about itself once it is set up.
#[derive(Debug, Clone)]
pub struct LinkInfo {
    /// `"shm"`, `"tcp"` or `"verbs"`.
    pub provider: &'static str,
    /// The largest frame `poll_send` accepts (the peer's slot size).
    pub max_frame: usize,
    /// How arbitrary (non-pool) buffers move in rendezvous, for stats and logs:
    /// e.g. `"cma"`, `"bounce"`, `"tcp-stream"`, `"rdma-read"`.
    pub rendezvous_path: String,
    /// Reads are served without the peer's CPU (true for CMA and RDMA READ).
    pub one_sided: bool,
    /// A read of an exposed buffer moves its bytes from that buffer into the reader's
    /// destination with no copy of the link's own on either side: CMA, RDMA READ, and tcp,
    /// whose owner's link writes the buffer to the socket as it is and whose reader's link
    /// reads the socket straight into the destination. False where reads pass through a
    /// staging buffer (shm without CMA). Where it holds, large buffers are worth sending
    /// by descriptor rather than inside a message body (`LinkCaps::remote_min`).
    pub direct_reads: bool,
    /// Human-readable peer identity for logs (`pid 1234`, `10.0.0.2:7000`).
    pub peer: String,
    /// Reads cross a network in pipelined work requests, so the fragment size is worth
    /// probing at connect (verbs). Off where a read is one copy (shm's CMA) or a stream
    /// (tcp): there the probe's read samples cost more than any fragment size wins back.
    pub pipelined_reads: bool,
    /// Reads are done by the NIC (RDMA READ), not by a CPU copy, so a rendezvous can beat
    /// copying a frame through a slot and the eager threshold is worth probing at connect
    /// (verbs). Where a read is itself a CPU copy plus a round trip (shm's CMA, tcp's
    /// stream), eager wins at every size a slot takes, and the connection sends eagerly up
    /// to the slot without probing.
    pub dma_reads: bool,
    /// Reads the link has outstanding at once at most (verbs: the negotiated RDMA READ
    /// depth). The connection is the one place that schedules reads: it holds further ones
    /// back until one completes, over its own fragment reads and `read_remote` alike.
    /// `usize::MAX` where any number may be posted.
    pub read_depth: usize,
    /// The longest single read the link takes (verbs: one RDMA READ work request); the
    /// connection's fragments are never longer. `usize::MAX` where any length goes.
    pub max_read: usize,
    /// The longest message body the link can push behind the RTS that announces it
    /// ([`Link::expose_pushed`]; tcp towards a peer that takes pushes: `wire::MAX_PUSH`).
    /// 0 where it cannot push.
    pub max_push: usize,
    /// Exposing memory or receiving into it needs registration, which the connection does
    /// ahead of time, off the runtime and outside its lock, through this (verbs). `None`
    /// where any memory will do.
    pub registrar: Option<Arc<dyn Registrar>>,
    /// This side's socket address (tcp; verbs: its bootstrap connection).
    pub local_addr: Option<std::net::SocketAddr>,
    /// What TLS learned of the peer (tcp with [`crate::Config::tls`]); `None` without TLS.
    pub tls: Option<Arc<crate::tls::TlsPeer>>,
}

impl LinkInfo {
    /// What the sans-IO core decides from: [`crate::proto::LinkCaps`].
    pub fn caps(&self) -> crate::proto::LinkCaps {
        crate::proto::LinkCaps {
            registers: self.registrar.is_some(),
            direct_reads: self.direct_reads,
            max_push: self.max_push,
            max_read: self.max_read,
            pipelined_reads: self.pipelined_reads,
            dma_reads: self.dma_reads,
        }
    }
}

/// Registration work a provider lets the connection run where it blocks nobody: on a
/// blocking thread (`spawn_blocking`), never under the connection's lock. Every method that
/// may register says so; the cheap checks never do.
pub trait Registrar: Send + Sync + std::fmt::Debug {
    /// True when exposing `buf` would register memory now (not pool memory, not cached).
    fn would_register(&self, buf: &[u8]) -> bool;
    /// Registers `buf` so that its exposure finds it ready. May block.
    fn prepare(&self, buf: &Bytes) -> Result<(), Error>;
    /// True when a receive destination of `len` bytes would need new registered memory.
    fn recv_would_register(&self, len: usize) -> bool;
    /// Makes room for a receive destination of `len` bytes. May block.
    fn reserve_recv(&self, len: usize) -> Result<(), Error>;
    /// The provider's registered pool, registered on the first call. May block then.
    fn pool(&self) -> Option<Arc<Pool>>;
    /// `len` bytes of memory that exposing registers nothing for, taken from registered
    /// memory grown on demand (bounded by `Config::pool_size`). May block to register.
    fn alloc(&self, len: usize) -> Result<PoolBufMut, Error>;
    /// As [`Registrar::alloc`] when registered memory has room now; `None` instead of
    /// registering more. Never blocks.
    fn try_alloc(&self, len: usize) -> Option<PoolBufMut>;
    /// Drops a cached registration of exactly `ptr..ptr+len` that no exposure uses, and the
    /// reference to the buffer it holds: for memory going back to its owner. May block.
    fn forget(&self, ptr: usize, len: usize);
}

/// Message bodies pushed unasked behind the RTS that announces them (tcp: docs/tcp.md,
/// "Pushed message bodies"), and what the reading side did with the ones it got.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PushStats {
    /// Bodies pushed to the peer.
    pub sent: u64,
    /// Pushes read straight into reads that were waiting for them.
    pub direct: u64,
    /// Pushes held until their reads came (the receive budget had deferred them), then
    /// copied out.
    pub held: u64,
    /// Pushes dropped because too much was held already (their reads asked the owner),
    /// or because a later region had been read first (their messages were not read).
    pub dropped: u64,
    /// Reads of pushed bodies that asked the owner all the same.
    pub asked: u64,
}

impl PushStats {
    /// Adds `other`'s counts to these.
    pub fn accumulate(&mut self, other: &PushStats) {
        self.sent += other.sent;
        self.direct += other.direct;
        self.held += other.held;
        self.dropped += other.dropped;
        self.asked += other.asked;
    }
}

/// A local buffer exposed to the peer for one-sided reads.
#[derive(Debug)]
pub struct Exposure {
    /// Handle to withdraw it with.
    pub id: u64,
    /// Provider-specific descriptor that travels in the RTS frame.
    pub descriptor: Bytes,
    /// True when the peer can map this buffer directly (registered pool): no copy at all.
    pub zero_copy: bool,
    /// What exposing it cost in memory registration (verbs); counted in the connection stats.
    pub registration: Registration,
}

/// How an exposed buffer became readable by the peer. Registering memory with a NIC costs
/// tens of microseconds per call plus pinning, so a cache of registrations is only worth
/// keeping if it hits: these outcomes feed its hit rate (`ConnStats::reg_cache_hit_rate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registration {
    /// The provider reads arbitrary memory without registering it (shm CMA, tcp).
    NotNeeded,
    /// The buffer lies in the pre-registered pool.
    Pool,
    /// An earlier registration of the same range was reused.
    CacheHit,
    /// The range had to be registered now.
    Registered,
}

/// Destination memory for rendezvous data. The owner keeps the memory alive; the pointer
/// stays valid and fixed for as long as the `RecvBuf` lives.
pub struct RecvBuf {
    ptr: *mut u8,
    len: usize,
    owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: `ptr` points into memory kept alive by `owner`, which is `Send + Sync`; the buffer
// is only written through `&mut self` or by reads whose lifetime the driver bounds.
unsafe impl Send for RecvBuf {}
// SAFETY: shared access only reads `ptr`/`len`; writes need `&mut self` or the driver's
// exclusive read protocol.
unsafe impl Sync for RecvBuf {}

impl std::fmt::Debug for RecvBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBuf").field("len", &self.len).finish()
    }
}

impl RecvBuf {
    /// A heap buffer. Large ones (≥ 64 KiB) are recycled through a process-wide cache:
    /// fresh pages would cost a page fault every 4 KiB on each message, which is what
    /// bounds large-message bandwidth otherwise. Contents are unspecified until written.
    /// Aborts the process if memory runs out: for a length a peer chose, use
    /// [`RecvBuf::try_heap`].
    pub fn heap(len: usize) -> RecvBuf {
        if len >= recv_cache::MIN {
            let b = recv_cache::take(len).unwrap_or_else(|| recv_cache::Cached::fresh(len));
            return RecvBuf::cached(b, len);
        }
        let mut v = bytes::BytesMut::zeroed(len);
        let ptr = v.as_mut_ptr();
        RecvBuf {
            ptr,
            len,
            owner: Box::new(v),
        }
    }

    /// [`RecvBuf::heap`], but a failed allocation is an error rather than an abort: the
    /// form for lengths that come from the wire.
    pub fn try_heap(len: usize) -> Result<RecvBuf, Error> {
        if len >= recv_cache::MIN {
            let b = recv_cache::take(len).ok_or_else(|| {
                Error::io(
                    format!("allocating a receive buffer of {len} bytes"),
                    std::io::ErrorKind::OutOfMemory.into(),
                )
            })?;
            return Ok(RecvBuf::cached(b, len));
        }
        Ok(RecvBuf::heap(len))
    }

    fn cached(mut b: recv_cache::Cached, len: usize) -> RecvBuf {
        let ptr = b.as_mut_ptr();
        RecvBuf {
            ptr,
            len,
            owner: Box::new(b),
        }
    }

    /// Wraps memory owned by `owner`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for writes, not aliased by anyone else, and stay valid
    /// and fixed while `owner` lives.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize, owner: Box<dyn Any + Send + Sync>) -> RecvBuf {
        RecvBuf { ptr, len, owner }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the memory, for posting reads.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// The bytes written so far (all of them, once every read completed).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is valid for reads while `owner` lives (constructor contract).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Mutable view for local copies (eager data, bounce fallbacks).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Gives back whatever owns the memory (a caller's own buffer, for `recv_into`).
    pub fn into_owner(self) -> Box<dyn Any + Send + Sync> {
        self.owner
    }

    /// Turns the buffer into `Bytes` without copying.
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

/// Recycled large receive buffers, bounded in total bytes.
mod recv_cache {
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// Smaller buffers come from the allocator, which handles them well.
    pub const MIN: usize = 64 << 10;
    /// Bytes kept for reuse across all connections of the process.
    const LIMIT: usize = 512 << 20;

    struct Cache {
        free: HashMap<usize, Vec<Box<[u8]>>>,
        bytes: usize,
    }

    static CACHE: Mutex<Option<Cache>> = Mutex::new(None);

    /// A buffer of at least `len` bytes that returns to the cache when dropped.
    pub struct Cached(Option<Box<[u8]>>);

    impl Cached {
        pub fn as_mut_ptr(&mut self) -> *mut u8 {
            self.0
                .as_mut()
                .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr())
        }
    }

    fn class(len: usize) -> Option<usize> {
        len.checked_next_power_of_two()
    }

    /// A buffer of at least `len` bytes, or `None` when the allocator refuses.
    pub fn take(len: usize) -> Option<Cached> {
        let c = class(len)?;
        let mut guard = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        let cache = guard.get_or_insert_with(|| Cache {
            free: HashMap::new(),
            bytes: 0,
        });
        if let Some(b) = cache.free.get_mut(&c).and_then(|v| v.pop()) {
            cache.bytes -= c;
            return Some(Cached(Some(b)));
        }
        drop(guard);
        try_zeroed(c).map(|b| Cached(Some(b)))
    }

    impl Cached {
        /// A fresh buffer from the infallible allocator (aborts when memory runs out).
        pub fn fresh(len: usize) -> Cached {
            let c = class(len).unwrap_or(len);
            Cached(Some(vec![0u8; c].into_boxed_slice()))
        }
    }

    /// Zeroed memory from the allocator (zero pages the kernel maps lazily, as `vec!`
    /// gets them), or `None` instead of the abort `vec!` would give.
    fn try_zeroed(len: usize) -> Option<Box<[u8]>> {
        let layout = std::alloc::Layout::array::<u8>(len).ok()?;
        if layout.size() == 0 {
            return Some(Box::default());
        }
        // SAFETY: the layout has a non-zero size, as `alloc_zeroed` requires.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return None;
        }
        // SAFETY: `p` is a live allocation of exactly `len` zeroed bytes with the alignment
        // of `u8`, made by the global allocator with the layout `Box<[u8]>` frees it with.
        Some(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, len)) })
    }

    impl Drop for Cached {
        fn drop(&mut self) {
            let Some(b) = self.0.take() else { return };
            let c = b.len();
            let mut guard = CACHE.lock().unwrap_or_else(|e| e.into_inner());
            let cache = guard.get_or_insert_with(|| Cache {
                free: HashMap::new(),
                bytes: 0,
            });
            if cache.bytes + c <= LIMIT {
                cache.bytes += c;
                cache.free.entry(c).or_default().push(b);
            }
        }
    }
}

impl AsRef<[u8]> for RecvBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

/// A read's copy that a provider hands the driver to run with the connection's lock
/// released ([`Link::take_work`]), so that application calls on the connection are not held
/// up by it. Its result goes back with [`Link::work_done`].
pub struct Work {
    id: u64,
    job: Box<dyn FnOnce() -> Result<(), Error> + Send>,
}

impl Work {
    /// Work completing read `id`.
    ///
    /// # Safety
    /// Whatever memory `job` touches must stay valid for as long as the read's own
    /// contract ([`Link::post_read`]) and the link keep it: the driver runs the job before
    /// the link's `ReadDone` for `id` and before it drops the link.
    pub unsafe fn new(id: u64, job: Box<dyn FnOnce() -> Result<(), Error> + Send>) -> Work {
        Work { id, job }
    }

    /// Runs it: the read's id and its result.
    pub fn run(self) -> (u64, Result<(), Error>) {
        (self.id, (self.job)())
    }
}

/// A cheap sign, read without the connection's lock, that [`Link::try_event`] may have
/// something now (shared memory: the ring's two positions). A receiver spinning on the
/// link watches it between two reads instead of going back to its runtime for every
/// empty one: a round trip through the runtime and the layers above the connection takes
/// 250-350 ns on 2 cores, a look at the hint a few. A hint only: `false` when an event is there
/// costs the rest of the watch, `true` when none is costs one read.
pub trait ReadyHint: Send + Sync {
    /// True if an event may be waiting.
    fn ready(&self) -> bool;
}

/// One end of a connection, as a provider sets it up. See the module docs.
pub trait Link: Send + 'static {
    /// Facts about this link.
    fn info(&self) -> LinkInfo;

    /// Offers one encoded frame (at most `info().max_frame` bytes) for delivery into the
    /// peer's slots. `Ready(Ok)` means it was taken (copied or queued) and `frame` may be
    /// reused. `Pending` means no room now; `cx`'s waker is woken when there may be.
    fn poll_send(&mut self, cx: &mut Context<'_>, frame: &[u8]) -> Poll<Result<(), Error>>;

    /// [`Link::poll_send`] of the frame `head` followed by `body` (an eager frame of one
    /// message: its head and the application's message). A provider that copies frames
    /// anyway (into a ring, a socket buffer) copies the two parts in one pass; the default
    /// joins them first.
    fn poll_send_parts(
        &mut self,
        cx: &mut Context<'_>,
        head: &[u8],
        body: &[u8],
    ) -> Poll<Result<(), Error>> {
        let mut frame = Vec::with_capacity(head.len() + body.len());
        frame.extend_from_slice(head);
        frame.extend_from_slice(body);
        self.poll_send(cx, &frame)
    }

    /// Pushes out whatever was taken but not yet written (a socket's write buffer, pending
    /// read responses). `Ready(Ok)` when nothing is left.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>>;

    /// The next inbound frame or read completion. Also where a provider does the work it
    /// owes the peer (serving emulated reads, for instance). `Pending` registers `cx`.
    /// An `Err` is fatal: the link is dead.
    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Result<LinkEvent, Error>>;

    /// Busy-poll hook: the next inbound frame or completion if one is there right now,
    /// without sleeping, spinning or registering a waker. The driver calls it for a short
    /// budget when it has nothing else to do (spin, then sleep in `poll_event`). Providers
    /// whose readiness needs a syscall keep the default, which opts out of spinning.
    fn try_event(&mut self) -> Option<Result<LinkEvent, Error>> {
        None
    }

    /// True if [`Link::try_event`] is worth spinning on (shared memory, a CQ).
    fn busy_poll(&self) -> bool {
        false
    }

    /// A [`ReadyHint`] for this link, if it has one: asked once, when the connection
    /// starts.
    fn ready_hint(&self) -> Option<Arc<dyn ReadyHint>> {
        None
    }

    /// Whether a send since the last call found the peer asleep and had to wake it; the
    /// call clears it. A reply to such a send comes only after the peer's wake-up, so a
    /// spin that waits for it needs room for that wake-up too. Providers that cannot tell
    /// (the kernel or the NIC wakes the peer) keep the default.
    fn take_woke_peer(&mut self) -> bool {
        false
    }

    /// Exposes `buf` for one-sided reads by the peer until [`Link::withdraw`].
    fn expose(&mut self, buf: Bytes) -> Result<Exposure, Error>;

    /// Exposes a message body that the peer is about to be told of (an RTS) and will read
    /// once, whole, right away, and pushes it behind the next frame written (that RTS), so
    /// that the peer's reads need no request. The core asks for it where
    /// [`LinkInfo::max_push`] takes the body ([`crate::proto::LinkCaps::pushes`]); a link
    /// that cannot push it now (closing, dead) exposes it for reads only. Providers that
    /// never push keep the default, [`Link::expose`].
    fn expose_pushed(&mut self, buf: Bytes) -> Result<Exposure, Error> {
        self.expose(buf)
    }

    /// What pushing message bodies did on this link (see [`PushStats`]); providers that
    /// never push keep the default.
    fn push_stats(&self) -> PushStats {
        PushStats::default()
    }

    /// Withdraws an exposure (the peer's later reads of it fail) and gives the buffer back.
    fn withdraw(&mut self, id: u64) -> Option<Bytes>;

    /// If `descriptor` names memory this side can see directly (a shared pool segment),
    /// a view of those `len` bytes; `Ok(None)` if it must be read. `Err` if the
    /// descriptor is invalid (out of bounds, wrong length, unknown segment).
    fn map_remote(&mut self, descriptor: &[u8], len: u64) -> Result<Option<Bytes>, Error>;

    /// Destination memory for `len` bytes of rendezvous data (registered where needed).
    /// Fails, rather than aborting, when memory runs out.
    fn alloc_recv(&mut self, len: usize) -> Result<RecvBuf, Error> {
        RecvBuf::try_heap(len)
    }

    /// Starts reading `len` bytes at `offset` of the peer region `descriptor` into `dst`.
    /// Completion comes back as [`LinkEvent::ReadDone`] with `id`. An invalid descriptor or
    /// range may fail here or in the completion.
    ///
    /// # Safety
    /// `dst..dst+len` must stay valid and untouched by anyone else until the `ReadDone`
    /// for `id` has been returned by `poll_event`, or until the link is dropped.
    unsafe fn post_read(
        &mut self,
        id: u64,
        descriptor: &[u8],
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), Error>;

    /// True if `post_read` may target `ptr..ptr+len` directly. Providers that need
    /// registered destinations (verbs) say no for memory they did not hand out; the driver
    /// then reads into [`Link::alloc_recv`] memory and copies.
    fn readable_dst(&self, ptr: *const u8, len: usize) -> bool {
        let _ = (ptr, len);
        true
    }

    /// The registered pool for zero-copy sends, if this provider has one.
    fn pool(&self) -> Option<Arc<Pool>> {
        None
    }

    /// Starts closing: the peer sees end of stream once what was sent is delivered. Poll
    /// [`Link::poll_flush`] until it is ready before dropping the link: a provider may still
    /// hold sent frames (verbs: unacknowledged sends, which dropping the queue pair discards).
    fn close(&mut self);

    /// The connection driver calls this once, before any read: from then on the provider
    /// may hand large copies to [`Link::take_work`] rather than doing them inside
    /// [`Link::post_read`]. Other users of a link never call it, so reads complete by
    /// themselves for them.
    fn enable_work(&mut self) {}

    /// Copies waiting to run without the connection lock. The driver runs each one, then
    /// reports it with [`Link::work_done`], before it drops the link or polls it again.
    fn take_work(&mut self) -> Vec<Work> {
        Vec::new()
    }

    /// True while [`Link::take_work`] has copies waiting (for a caller other than the
    /// driver that polled the link and must hand them over).
    fn has_work(&self) -> bool {
        false
    }

    /// True while the link holds completions nobody has taken with [`Link::try_event`] or
    /// [`Link::poll_event`] yet (from [`Link::work_done`], say). They raise no readiness:
    /// a receiver that read the link inline and now stops must hand them to the driver.
    fn has_completions(&self) -> bool {
        false
    }

    /// The result of a [`Work`]: the provider reports it as the read's `ReadDone`.
    fn work_done(&mut self, id: u64, result: Result<(), Error>) {
        let _ = (id, result);
    }
}

#[cfg(test)]
mod tests {
    use super::RecvBuf;

    #[test]
    fn an_impossible_receive_buffer_is_an_error_not_an_abort() {
        for len in [usize::MAX, usize::MAX / 2 + 2, isize::MAX as usize] {
            let e = RecvBuf::try_heap(len).expect_err("no allocator gives this much");
            assert!(e.to_string().contains(&len.to_string()), "{e}");
        }
        let b = RecvBuf::try_heap(1 << 20).expect("a mebibyte");
        assert_eq!(b.len(), 1 << 20);
    }
}
