//! [`ShmLink`]: the [`Link`] over two shared rings, the registered pools, CMA and the
//! bounce-area fallback.
//!
//! Record types in the rings:
//! - `0` frame: an opaque frame for the driver;
//! - `1` read request (bounce path): `rid u64, region u64, offset u64, len u64`;
//! - `2` read data: `rid u64, chunk_off u64, slot u32, len u32, status u8, [error text]`
//!   (status 0: `len` bytes for `chunk_off` of the read wait in the owner's bounce slot);
//! - `3` slot free: `slot u32`, from the reader once it copied a slot out.
//!
//! A clean close travels on the setup socket, not in the ring: [`Link::close`] writes one
//! byte and shuts the socket down, so the peer tells a close (`PeerClosed`) from a crash
//! (`PeerGone`, plain end of stream) once it has drained the ring.

use std::collections::VecDeque;

use crate::map::Map;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::unix::AsyncFd;
use tokio::net::UnixStream;

use super::cma;
use super::ring::{Consumer, HEADER_BYTES, Producer, RingHeader};
use super::segment::{self, MappedSlice, Mapping};
use super::share::OwnPool;
use crate::error::{Error, Result};
use crate::link::{Exposure, Link, LinkEvent, LinkInfo, Registration, Work};
use crate::pool::Pool;

/// Busy-waits up to `budget` for `ready`. Every few iterations it yields the CPU, so on
/// an oversubscribed host the peer thread we are waiting for gets to run.
fn spin_until(budget: Duration, mut ready: impl FnMut() -> bool) -> bool {
    if budget.is_zero() {
        return false;
    }
    let start = Instant::now();
    let mut i = 0u32;
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= budget {
            return false;
        }
        i = i.wrapping_add(1);
        if i.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Bytes the shm link copies frames into before it needs a new allocation. A frame of its
/// own allocation cost two (the buffer, then the shared count that the first message
/// slice cut from it adds) and their frees, about 600 instructions per frame; frames
/// split off one buffer cost neither, and the buffer is reused once the frames are
/// dropped. A message the application keeps holds at most this much memory (or its own
/// frame, if that is larger).
const RX_ARENA: usize = 16 << 10;

/// Bounce requests one peer may have queued at us; more is a protocol violation.
const MAX_SERVE_QUEUE: usize = 4096;
/// Reads at least this large are copied by the driver outside the connection lock (once
/// it asked for that, [`Link::enable_work`]); smaller ones cost less than the hand-over.
const WORK_MIN: usize = 64 << 10;

/// The destination of a copy handed to the driver as [`Work`].
struct Dst(*mut u8);

// SAFETY: only the address moves to the thread that runs the work; the memory behind it is
// kept valid and untouched by anyone else until the read completes (`Link::post_read`'s
// contract), and the work is its only user meanwhile.
unsafe impl Send for Dst {}

impl Dst {
    /// Copies `len` bytes from `src`.
    ///
    /// # Safety
    /// `src` is valid for `len` bytes and does not overlap the destination, which is
    /// valid for `len` bytes.
    unsafe fn copy_from(self, src: *const u8, len: usize) {
        // SAFETY: per this function's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, self.0, len) }
    }

    /// Reads `len` bytes at `remote` in process `pid` with CMA.
    ///
    /// # Safety
    /// The destination is valid for `len` bytes.
    unsafe fn cma_read(self, pid: i32, remote: u64, len: usize) -> Result<()> {
        // SAFETY: per this function's contract.
        unsafe { cma::read(pid, remote, self.0, len) }
    }
}

const T_FRAME: u8 = 0;
const T_READ_REQ: u8 = 1;
const T_READ_DATA: u8 = 2;
const T_SLOT_FREE: u8 = 3;

const CLOSE_BYTE: u8 = b'C';

const D_POOL: u8 = 1;
const D_REGION: u8 = 2;
const POOL_DESC_LEN: usize = 24;
const REGION_DESC_LEN: usize = 32;

/// A parsed rendezvous descriptor. Wire format (little endian):
/// `POOL: [1, 0 x7][offset u64][len u64]`,
/// `REGION: [2, 0 x3][pid u32][region u64][addr u64][len u64]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Desc {
    Pool {
        offset: u64,
        len: u64,
    },
    Region {
        pid: u32,
        region: u64,
        addr: u64,
        len: u64,
    },
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl Desc {
    fn encode(&self) -> Bytes {
        let mut b = Vec::with_capacity(REGION_DESC_LEN);
        match *self {
            Desc::Pool { offset, len } => {
                b.extend_from_slice(&[D_POOL, 0, 0, 0, 0, 0, 0, 0]);
                b.extend_from_slice(&offset.to_le_bytes());
                b.extend_from_slice(&len.to_le_bytes());
            }
            Desc::Region {
                pid,
                region,
                addr,
                len,
            } => {
                b.extend_from_slice(&[D_REGION, 0, 0, 0]);
                b.extend_from_slice(&pid.to_le_bytes());
                b.extend_from_slice(&region.to_le_bytes());
                b.extend_from_slice(&addr.to_le_bytes());
                b.extend_from_slice(&len.to_le_bytes());
            }
        }
        Bytes::from(b)
    }

    fn parse(b: &[u8]) -> Result<Desc> {
        let bad = || Error::Protocol(format!("malformed shm descriptor ({} bytes)", b.len()));
        match b.first() {
            Some(&D_POOL) if b.len() == POOL_DESC_LEN => Ok(Desc::Pool {
                offset: le64(b, 8),
                len: le64(b, 16),
            }),
            Some(&D_REGION) if b.len() == REGION_DESC_LEN => Ok(Desc::Region {
                pid: le32(b, 4),
                region: le64(b, 8),
                addr: le64(b, 16),
                len: le64(b, 24),
            }),
            _ => Err(bad()),
        }
    }

    fn len(&self) -> u64 {
        match *self {
            Desc::Pool { len, .. } | Desc::Region { len, .. } => len,
        }
    }
}

/// Everything setup hands over to build a link.
pub(crate) struct Parts {
    pub sock: UnixStream,
    /// The peer's pid in our namespace (SO_PEERCRED): what CMA reads from.
    pub peer_pid: i32,
    /// The peer's uid (SO_PEERCRED), for the connect info servers see.
    pub peer_uid: u32,
    /// The pid the peer reported (its namespace): what its REGION descriptors carry.
    pub peer_hello_pid: u32,
    /// The pid we reported: what our REGION descriptors carry. Kept rather than asked for
    /// on every rendezvous send, where `getpid` was a system call a message.
    pub own_hello_pid: u32,
    pub peer_slot_size: usize,
    pub tx_map: Mapping,
    pub tx_cap: usize,
    pub rx_map: Mapping,
    pub rx_cap: usize,
    /// Our pool, shared by every connection with this peer process (`share.rs`).
    pub pool: Arc<OwnPool>,
    /// The peer's pool, mapped once per peer process.
    pub peer_pool: Arc<Mapping>,
    pub bounce: Mapping,
    pub bounce_slot: usize,
    pub peer_bounce: Mapping,
    pub peer_bounce_slot: usize,
    pub data_efd: OwnedFd,
    pub space_efd: OwnedFd,
    pub peer_data_efd: OwnedFd,
    pub peer_space_efd: OwnedFd,
    pub cma: bool,
    pub probe: Box<u64>,
    pub spin: Duration,
}

/// A read this side posted on the bounce path, waiting for chunks.
struct BounceRead {
    id: u64,
    dst: *mut u8,
    len: u64,
    remaining: u64,
}

// SAFETY: `dst` is memory the driver lent us until the read completes or the link drops
// (`post_read` contract); it is only written from the link's own methods.
unsafe impl Send for BounceRead {}

/// A peer's read this side is serving through its bounce area.
struct Serve {
    rid: u64,
    region: u64,
    offset: u64,
    len: u64,
    done: u64,
}

/// One end of an shm connection. See the module docs of [`crate::shm`].
pub struct ShmLink {
    sock: UnixStream,
    peer_pid: i32,
    peer_hello_pid: u32,
    own_hello_pid: u32,
    info: LinkInfo,
    tx: Producer,
    rx: Consumer,
    rx_sleeping: bool,
    /// A send signalled the peer's eventfd since [`Link::take_woke_peer`] last asked.
    woke_peer: bool,
    /// Spin budget before sleeping. A side spins only once after each bit of progress
    /// (an event handed out, a frame sent), so a driver polling a quiet direction again
    /// and again is not held up, and an idle link goes straight back to sleep.
    spin: Duration,
    tx_hot: bool,
    /// Holding the `OwnPool` (not just its `Pool`) keeps it in the process-pair registry
    /// for as long as this link lives.
    pool: Arc<OwnPool>,
    peer_pool: Arc<Mapping>,
    bounce: Mapping,
    bounce_slot: usize,
    peer_bounce: Mapping,
    peer_bounce_slot: usize,
    data_efd: AsyncFd<OwnedFd>,
    space_efd: AsyncFd<OwnedFd>,
    peer_data_efd: OwnedFd,
    peer_space_efd: OwnedFd,
    cma: bool,
    /// Exposed buffers by id (pool ones too, so `withdraw` gives every buffer back).
    regions: Map<u64, Bytes>,
    next_region: u64,
    completions: VecDeque<(u64, Result<()>)>,
    /// Large copies for the driver to run outside the connection lock, when it asked.
    work: Option<Vec<Work>>,
    reads: Map<u64, BounceRead>,
    next_rid: u64,
    serving: VecDeque<Serve>,
    free_slots: Vec<u32>,
    slot_busy: Vec<bool>,
    outbox: VecDeque<(u8, Vec<u8>)>,
    /// Reused buffer for control records copied out of the ring.
    scratch: Vec<u8>,
    /// Where frames are copied out of the ring: each frame is split off it, so frames
    /// share its allocation and its reference count ([`RX_ARENA`]).
    rx_arena: BytesMut,
    peer_closing: bool,
    peer_eof: bool,
    closed: bool,
    /// Why the link is dead, once it is: reported by `poll_event` after the pending
    /// completions, and on every call after that.
    dead: Option<Error>,
    // Kept last so they are dropped after the producer/consumer that point into them.
    _tx_map: Mapping,
    /// Shared with the [`RxHint`]s handed out, which read the ring's header in it.
    rx_map: Arc<Mapping>,
    /// The word the peer read to probe CMA; it must stay at its address for the link's life.
    _probe: Box<u64>,
}

/// Whether the RX ring holds records not taken yet, read from its header without the link.
struct RxHint(Arc<Mapping>);

impl crate::link::ReadyHint for RxHint {
    fn ready(&self) -> bool {
        // SAFETY: the mapping starts with the RX ring's header (page aligned, HEADER_BYTES
        // long, checked at setup) and stays mapped while this `Arc` holds it; the header's
        // fields are atomics, which the peer and this process share by design.
        unsafe { &*self.0.ptr().cast::<RingHeader>() }.pending()
    }
}

impl std::fmt::Debug for ShmLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmLink")
            .field("info", &self.info)
            .field("exposed", &self.regions.len())
            .finish()
    }
}

impl ShmLink {
    pub(crate) fn new(p: Parts) -> Result<ShmLink> {
        // SAFETY: each segment is HEADER_BYTES + cap bytes (checked at setup), page
        // aligned, mapped read-write for the link's life (the maps are fields dropped
        // after the ends), and this link is the only producer of its TX ring and the only
        // consumer of its RX ring.
        let (tx, rx) = unsafe {
            (
                Producer::new(
                    p.tx_map.ptr().cast::<RingHeader>(),
                    p.tx_map.ptr().add(HEADER_BYTES),
                    p.tx_cap,
                ),
                Consumer::new(
                    p.rx_map.ptr().cast::<RingHeader>(),
                    p.rx_map.ptr().add(HEADER_BYTES),
                    p.rx_cap,
                ),
            )
        };
        let nslots = p.bounce.len() / p.bounce_slot;
        let wrap = |fd: OwnedFd, what: &str| {
            // SAFETY: the `AsyncFd` owns the `OwnedFd`, which stays open and unchanged until
            // the `AsyncFd` is dropped.
            unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }.map_err(
                |e| {
                    Error::io(
                        format!("registering the shm {what} eventfd with tokio"),
                        e.into(),
                    )
                },
            )
        };
        let info = LinkInfo {
            provider: "shm",
            max_frame: p.peer_slot_size,
            rendezvous_path: if p.cma { "cma" } else { "bounce" }.into(),
            one_sided: p.cma,
            direct_reads: p.cma,
            peer: format!("pid {} uid {}", p.peer_pid, p.peer_uid),
            pipelined_reads: false,
            dma_reads: false,
            read_depth: usize::MAX,
            max_read: usize::MAX,
            max_push: 0,
            registrar: None,
            local_addr: None,
            tls: None,
        };
        Ok(ShmLink {
            sock: p.sock,
            peer_pid: p.peer_pid,
            peer_hello_pid: p.peer_hello_pid,
            own_hello_pid: p.own_hello_pid,
            info,
            tx,
            rx,
            rx_sleeping: false,
            woke_peer: false,
            spin: p.spin,
            tx_hot: true,
            pool: p.pool,
            peer_pool: p.peer_pool,
            bounce: p.bounce,
            bounce_slot: p.bounce_slot,
            peer_bounce: p.peer_bounce,
            peer_bounce_slot: p.peer_bounce_slot,
            data_efd: wrap(p.data_efd, "data")?,
            space_efd: wrap(p.space_efd, "space")?,
            peer_data_efd: p.peer_data_efd,
            peer_space_efd: p.peer_space_efd,
            cma: p.cma,
            regions: Map::default(),
            next_region: 1,
            completions: VecDeque::new(),
            work: None,
            reads: Map::default(),
            next_rid: 1,
            serving: VecDeque::new(),
            free_slots: (0..nslots as u32).rev().collect(),
            slot_busy: vec![false; nslots],
            outbox: VecDeque::new(),
            scratch: Vec::new(),
            rx_arena: BytesMut::new(),
            peer_closing: false,
            peer_eof: false,
            closed: false,
            dead: None,
            _tx_map: p.tx_map,
            rx_map: Arc::new(p.rx_map),
            _probe: p.probe,
        })
    }

    /// The peer's pid (in this process's pid namespace).
    pub fn peer_pid(&self) -> i32 {
        self.peer_pid
    }

    /// Marks the link dead: pending bounce reads complete with `e` first, then
    /// `poll_event` reports `e`.
    fn fail(&mut self, e: Error) {
        if self.dead.is_some() {
            return;
        }
        let mut ids: Vec<_> = self.reads.drain().map(|(_, r)| r.id).collect();
        ids.sort_unstable();
        for id in ids {
            self.completions.push_back((id, Err(e.clone())));
        }
        self.dead = Some(e);
    }

    fn dead_error(&self) -> Option<Error> {
        self.dead.clone()
    }

    /// Pushes one record, waking the peer if it sleeps. `Ok(false)`: no room now.
    fn push(&mut self, ty: u8, payload: &[u8]) -> Result<bool> {
        self.push_parts(ty, payload, &[])
    }

    /// [`ShmLink::push`] of one record written as `a` then `b`.
    fn push_parts(&mut self, ty: u8, a: &[u8], b: &[u8]) -> Result<bool> {
        if !self.tx.try_push_parts(ty, a, b)? {
            return Ok(false);
        }
        if self.tx.consumer_needs_wake() {
            segment::signal(self.peer_data_efd.as_raw_fd());
            self.woke_peer = true;
        }
        Ok(true)
    }

    /// Pushes queued control records while there is room. True when none is left.
    fn flush_outbox(&mut self) -> Result<bool> {
        while let Some((ty, rec)) = self.outbox.pop_front() {
            if !self.push(ty, &rec)? {
                self.outbox.push_front((ty, rec));
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Reads the setup socket if it has something: the peer's close byte or end of
    /// stream. Registers `cx` for more.
    fn poll_socket(&mut self, cx: &mut Context<'_>) -> Result<()> {
        while !self.peer_eof {
            match self.sock.poll_read_ready(cx) {
                Poll::Pending => return Ok(()),
                Poll::Ready(Err(e)) => return Err(Error::io("watching the shm socket", e)),
                Poll::Ready(Ok(())) => {}
            }
            let mut buf = [0u8; 16];
            match self.sock.try_read(&mut buf) {
                Ok(0) => self.peer_eof = true,
                Ok(n) => {
                    if buf[..n].iter().any(|&b| b != CLOSE_BYTE) {
                        return Err(Error::Protocol(
                            "unexpected bytes on the shm socket after setup".into(),
                        ));
                    }
                    self.peer_closing = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => self.peer_eof = true,
                Err(e) => return Err(Error::io("reading the shm socket", e)),
            }
        }
        Ok(())
    }

    /// Waits (registers `cx`) on one of our eventfds. `Ready` means it fired and was reset:
    /// the caller re-checks its condition.
    fn poll_efd(efd: &AsyncFd<OwnedFd>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match efd.poll_read_ready(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(Error::io("waiting on an shm eventfd", e))),
            Poll::Ready(Ok(mut guard)) => {
                segment::drain(efd.get_ref().as_raw_fd());
                guard.clear_ready();
                Poll::Ready(Ok(()))
            }
        }
    }

    /// Takes records from the RX ring until a frame turns up or the ring is empty,
    /// handling control records on the way.
    fn drain_rx(&mut self) -> Result<Option<Bytes>> {
        loop {
            let Some(rec) = self.rx.peek()? else {
                return Ok(None);
            };
            let ty = rec.ty;
            if ty == T_FRAME {
                let len = rec.payload.len();
                if self.rx_arena.capacity() < len {
                    // Reuses the allocation once every frame split off it is gone.
                    self.rx_arena.reserve(len.max(RX_ARENA));
                }
                self.rx_arena.extend_from_slice(rec.payload);
                let frame = self.rx_arena.split().freeze();
                self.pop_rx();
                return Ok(Some(frame));
            }
            // Copy the (small) control record out so its ring space is released before
            // handling it, which may push into the other ring.
            let mut ctl = std::mem::take(&mut self.scratch);
            ctl.clear();
            ctl.extend_from_slice(rec.payload);
            self.pop_rx();
            let handled = match ty {
                T_READ_REQ => self.on_read_request(&ctl),
                T_READ_DATA => self.on_read_data(&ctl),
                T_SLOT_FREE => self.on_slot_free(&ctl),
                other => Err(Error::Protocol(format!("unknown shm record type {other}"))),
            };
            self.scratch = ctl;
            handled?;
        }
    }

    fn pop_rx(&mut self) {
        if self.rx.pop() {
            segment::signal(self.peer_space_efd.as_raw_fd());
        }
    }

    fn on_read_request(&mut self, b: &[u8]) -> Result<()> {
        if b.len() != 32 {
            return Err(Error::Protocol(format!(
                "bounce read request of {} bytes",
                b.len()
            )));
        }
        if self.serving.len() >= MAX_SERVE_QUEUE {
            return Err(Error::Protocol(format!(
                "peer queued more than {MAX_SERVE_QUEUE} bounce reads"
            )));
        }
        let s = Serve {
            rid: le64(b, 0),
            region: le64(b, 8),
            offset: le64(b, 16),
            len: le64(b, 24),
            done: 0,
        };
        if s.len == 0 {
            return Err(Error::Protocol("bounce read request of zero bytes".into()));
        }
        self.serving.push_back(s);
        Ok(())
    }

    fn on_read_data(&mut self, b: &[u8]) -> Result<()> {
        if b.len() < 25 {
            return Err(Error::Protocol(format!(
                "bounce read answer of {} bytes",
                b.len()
            )));
        }
        let (rid, chunk_off, slot, len, status) = (
            le64(b, 0),
            le64(b, 8),
            le32(b, 16),
            le32(b, 20) as u64,
            b[24],
        );
        if status != 0 {
            let why = String::from_utf8_lossy(&b[25..]).into_owned();
            if let Some(r) = self.reads.remove(&rid) {
                self.completions.push_back((
                    r.id,
                    Err(Error::Protocol(format!("peer refused the read: {why}"))),
                ));
            }
            return Ok(());
        }
        let nslots = self.peer_bounce.len() / self.peer_bounce_slot;
        if slot as usize >= nslots || len > self.peer_bounce_slot as u64 {
            return Err(Error::Protocol(format!(
                "bounce answer names slot {slot} with {len} bytes"
            )));
        }
        if let Some(r) = self.reads.get_mut(&rid) {
            let end = chunk_off.checked_add(len).filter(|&e| e <= r.len);
            if end.is_none() || len > r.remaining {
                return Err(Error::Protocol(format!(
                    "bounce chunk {chunk_off}+{len} outside a read of {} bytes",
                    r.len
                )));
            }
            // SAFETY: the slot lies inside the peer's bounce mapping (checked above); dst
            // +chunk_off+len is inside the destination the driver lent us (checked above),
            // which stays valid until this read's completion.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.peer_bounce
                        .ptr()
                        .add(slot as usize * self.peer_bounce_slot),
                    r.dst.add(chunk_off as usize),
                    len as usize,
                );
            }
            r.remaining -= len;
            if r.remaining == 0 {
                let id = r.id;
                self.reads.remove(&rid);
                self.completions.push_back((id, Ok(())));
            }
        }
        // Freed even for a read that already failed: the owner still holds the slot.
        self.outbox
            .push_back((T_SLOT_FREE, slot.to_le_bytes().to_vec()));
        Ok(())
    }

    fn on_slot_free(&mut self, b: &[u8]) -> Result<()> {
        if b.len() != 4 {
            return Err(Error::Protocol(format!(
                "bounce slot release of {} bytes",
                b.len()
            )));
        }
        let slot = le32(b, 0) as usize;
        if !self.slot_busy.get(slot).copied().unwrap_or(false) {
            return Err(Error::Protocol(format!(
                "peer released bounce slot {slot}, which it did not hold"
            )));
        }
        self.slot_busy[slot] = false;
        self.free_slots.push(slot as u32);
        Ok(())
    }

    /// Fills free bounce slots from the peer's queued read requests.
    fn serve_bounce(&mut self) {
        while let Some(req) = self.serving.front_mut() {
            let region = self.regions.get(&req.region);
            let refusal = match region {
                None => Some(format!("region {} is not exposed (withdrawn?)", req.region)),
                Some(buf)
                    if req
                        .offset
                        .checked_add(req.len)
                        .is_none_or(|e| e > buf.len() as u64) =>
                {
                    Some(format!(
                        "range {}+{} is outside region {} of {} bytes",
                        req.offset,
                        req.len,
                        req.region,
                        buf.len()
                    ))
                }
                Some(_) => None,
            };
            if let Some(why) = refusal {
                let mut rec = Vec::with_capacity(25 + why.len());
                rec.extend_from_slice(&req.rid.to_le_bytes());
                rec.extend_from_slice(&[0u8; 16]);
                rec.push(1);
                rec.extend_from_slice(why.as_bytes());
                self.outbox.push_back((T_READ_DATA, rec));
                self.serving.pop_front();
                continue;
            }
            let Some(slot) = self.free_slots.pop() else {
                return;
            };
            let Some(buf) = region else { return };
            let n = (req.len - req.done).min(self.bounce_slot as u64);
            let from = (req.offset + req.done) as usize;
            // SAFETY: from+n <= buf.len() (checked above); the slot lies inside our bounce
            // mapping and is free, so the peer is not reading it.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    buf.as_ptr().add(from),
                    self.bounce.ptr().add(slot as usize * self.bounce_slot),
                    n as usize,
                );
            }
            self.slot_busy[slot as usize] = true;
            let mut rec = Vec::with_capacity(25);
            rec.extend_from_slice(&req.rid.to_le_bytes());
            rec.extend_from_slice(&req.done.to_le_bytes());
            rec.extend_from_slice(&slot.to_le_bytes());
            rec.extend_from_slice(&(n as u32).to_le_bytes());
            rec.push(0);
            self.outbox.push_back((T_READ_DATA, rec));
            req.done += n;
            if req.done == req.len {
                self.serving.pop_front();
            }
        }
    }

    /// One pass of the work `poll_event` does without waiting: pending completions, the
    /// work owed to the peer (bounce serving, control records), then the ring. The peer's
    /// work comes before frames so a steady stream of frames cannot starve its reads.
    /// `Some` when there is an event for the driver.
    fn step(&mut self) -> Result<Option<LinkEvent>> {
        if let Some((id, result)) = self.completions.pop_front() {
            return Ok(Some(LinkEvent::ReadDone { id, result }));
        }
        self.serve_bounce();
        self.flush_outbox()?;
        if let Some(frame) = self.drain_rx()? {
            return Ok(Some(LinkEvent::Frame(frame)));
        }
        self.serve_bounce();
        self.flush_outbox()?;
        Ok(self
            .completions
            .pop_front()
            .map(|(id, result)| LinkEvent::ReadDone { id, result }))
    }

    fn wake_rx(&mut self) {
        if self.rx_sleeping {
            self.rx.cancel_sleep();
            self.rx_sleeping = false;
        }
    }

    fn poll_event_inner(&mut self, cx: &mut Context<'_>) -> Poll<Result<LinkEvent>> {
        self.wake_rx();
        loop {
            if self.dead.is_none() {
                match self.step() {
                    Ok(Some(ev)) => return Poll::Ready(Ok(ev)),
                    Ok(None) => {}
                    Err(e) => self.fail(e),
                }
            }
            if let Some(e) = self.dead_error() {
                if let Some((id, result)) = self.completions.pop_front() {
                    return Poll::Ready(Ok(LinkEvent::ReadDone { id, result }));
                }
                return Poll::Ready(Err(e));
            }
            // Nothing to hand out. Is the peer still there?
            if let Err(e) = self.poll_socket(cx) {
                self.fail(e);
                continue;
            }
            if self.peer_eof {
                // Everything the peer wrote before its socket closed is in the ring by now.
                if !self.rx.is_empty() {
                    continue;
                }
                let e = if self.peer_closing {
                    Error::PeerClosed(String::new())
                } else {
                    Error::PeerGone(format!(
                        "peer process {} exited or crashed without closing",
                        self.peer_pid
                    ))
                };
                self.fail(e);
                continue;
            }
            match self.rx.prepare_sleep() {
                Ok(true) => self.rx_sleeping = true,
                Ok(false) => continue,
                Err(e) => {
                    self.fail(e);
                    continue;
                }
            }
            match Self::poll_efd(&self.data_efd, cx) {
                Poll::Ready(Ok(())) => {
                    self.wake_rx();
                    continue;
                }
                Poll::Ready(Err(e)) => {
                    self.fail(e);
                    continue;
                }
                Poll::Pending => {}
            }
            if !self.outbox.is_empty() {
                match self.poll_space(cx) {
                    Poll::Ready(Ok(())) => {
                        self.wake_rx();
                        continue;
                    }
                    Poll::Ready(Err(e)) => {
                        self.fail(e);
                        continue;
                    }
                    Poll::Pending => {}
                }
            }
            return Poll::Pending;
        }
    }

    /// Sleeps until the TX ring has room for the outbox head (or `len` bytes if the
    /// outbox is empty). `Ready(Ok)` means: try again.
    fn poll_space_for(&mut self, len: usize, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.tx.set_waiting();
        match self.tx.has_room(len) {
            Ok(true) => {
                self.tx.clear_waiting();
                return Poll::Ready(Ok(()));
            }
            Ok(false) => {}
            Err(e) => return Poll::Ready(Err(e)),
        }
        Self::poll_efd(&self.space_efd, cx)
    }

    fn poll_space(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let len = self.outbox.front().map_or(0, |(_, r)| r.len());
        self.poll_space_for(len, cx)
    }

    /// Common guard of the sending side: a closed or dead link refuses work.
    fn check_usable(&self) -> Result<()> {
        if self.closed {
            return Err(Error::LocallyClosed);
        }
        match self.dead_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Before a sender sleeps for space: a peer that is gone will never make any.
    /// Registers `cx` on the socket so its death wakes the sender.
    fn check_peer(&mut self, cx: &mut Context<'_>) -> Result<()> {
        self.poll_socket(cx)?;
        if self.peer_eof {
            // Frames sent now would never be read.
            return Err(if self.peer_closing {
                Error::PeerClosed(String::new())
            } else {
                Error::PeerGone(format!(
                    "peer process {} exited or crashed without closing",
                    self.peer_pid
                ))
            });
        }
        Ok(())
    }
}

impl Link for ShmLink {
    fn info(&self) -> LinkInfo {
        self.info.clone()
    }

    fn poll_send(&mut self, cx: &mut Context<'_>, frame: &[u8]) -> Poll<Result<()>> {
        self.poll_send_parts(cx, frame, &[])
    }

    /// Both parts go straight into the ring's record: no frame is assembled first.
    fn poll_send_parts(
        &mut self,
        cx: &mut Context<'_>,
        head: &[u8],
        body: &[u8],
    ) -> Poll<Result<()>> {
        let len = head.len() + body.len();
        if len > self.info.max_frame {
            return Poll::Ready(Err(Error::TooLarge {
                len: len as u64,
                limit: self.info.max_frame as u64,
                which: "the peer's slot size (Config::slot_size on the peer)",
            }));
        }
        if let Err(e) = self.check_usable() {
            return Poll::Ready(Err(e));
        }
        loop {
            match self
                .flush_outbox()
                .and_then(|_| self.push_parts(T_FRAME, head, body))
            {
                Ok(true) => {
                    self.tx_hot = true;
                    return Poll::Ready(Ok(()));
                }
                Ok(false) => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
            if self.tx_hot {
                self.tx_hot = false;
                let tx = &self.tx;
                spin_until(self.spin, || !matches!(tx.has_room(len), Ok(false)));
                continue;
            }
            if let Err(e) = self.check_peer(cx) {
                return Poll::Ready(Err(e));
            }
            match self.poll_space_for(len, cx) {
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if let Some(e) = self.dead_error() {
            return Poll::Ready(Err(e));
        }
        loop {
            match self.flush_outbox() {
                Ok(true) => return Poll::Ready(Ok(())),
                Ok(false) => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
            if let Err(e) = self.check_peer(cx) {
                return Poll::Ready(Err(e));
            }
            match self.poll_space(cx) {
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Result<LinkEvent>> {
        self.poll_event_inner(cx)
    }

    fn try_event(&mut self) -> Option<Result<LinkEvent>> {
        // A dead link is reported by `poll_event`, which the driver calls next.
        if self.dead.is_some() {
            return None;
        }
        self.wake_rx();
        match self.step() {
            Ok(ev) => ev.map(Ok),
            Err(e) => {
                self.fail(e);
                None
            }
        }
    }

    fn busy_poll(&self) -> bool {
        true
    }

    fn ready_hint(&self) -> Option<Arc<dyn crate::link::ReadyHint>> {
        Some(Arc::new(RxHint(self.rx_map.clone())))
    }

    fn take_woke_peer(&mut self) -> bool {
        std::mem::take(&mut self.woke_peer)
    }

    fn expose(&mut self, buf: Bytes) -> Result<Exposure> {
        let id = self.next_region;
        self.next_region += 1;
        let len = buf.len() as u64;
        let (desc, zero_copy) = match self.pool.pool.offset_of(buf.as_ptr(), buf.len()) {
            Some(off) => (
                Desc::Pool {
                    offset: off as u64,
                    len,
                },
                true,
            ),
            None => (
                Desc::Region {
                    pid: self.own_hello_pid,
                    region: id,
                    addr: buf.as_ptr() as u64,
                    len,
                },
                false,
            ),
        };
        self.regions.insert(id, buf);
        let registration = if zero_copy {
            Registration::Pool
        } else {
            Registration::NotNeeded
        };
        Ok(Exposure {
            id,
            descriptor: desc.encode(),
            zero_copy,
            registration,
        })
    }

    fn withdraw(&mut self, id: u64) -> Option<Bytes> {
        self.regions.remove(&id)
    }

    fn map_remote(&mut self, descriptor: &[u8], len: u64) -> Result<Option<Bytes>> {
        match Desc::parse(descriptor)? {
            Desc::Region { .. } => Ok(None),
            Desc::Pool { offset, len: dlen } => {
                if dlen != len {
                    return Err(Error::Protocol(format!(
                        "pool descriptor covers {dlen} bytes but the message is {len} bytes"
                    )));
                }
                let size = self.peer_pool.len() as u64;
                if offset.checked_add(len).is_none_or(|e| e > size) {
                    return Err(Error::Protocol(format!(
                        "pool descriptor {offset}+{len} is outside the peer's pool of {size} bytes"
                    )));
                }
                let view = MappedSlice {
                    map: self.peer_pool.clone(),
                    off: offset as usize,
                    len: len as usize,
                };
                Ok(Some(Bytes::from_owner(view)))
            }
        }
    }

    unsafe fn post_read(
        &mut self,
        id: u64,
        descriptor: &[u8],
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<()> {
        if let Some(e) = self.dead_error() {
            return Err(e);
        }
        let desc = Desc::parse(descriptor)?;
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|e| e > desc.len()) {
            return Err(Error::Protocol(format!(
                "read of {len} bytes at offset {offset} is outside the exposed region of {} bytes",
                desc.len()
            )));
        }
        if len == 0 {
            self.completions.push_back((id, Ok(())));
            return Ok(());
        }
        match desc {
            Desc::Pool {
                offset: base,
                len: dlen,
            } => {
                if base
                    .checked_add(dlen)
                    .is_none_or(|e| e > self.peer_pool.len() as u64)
                {
                    return Err(Error::Protocol(format!(
                        "pool descriptor {base}+{dlen} is outside the peer's pool of {} bytes",
                        self.peer_pool.len()
                    )));
                }
                let at = (base + offset) as usize;
                let dst = Dst(dst);
                match self.work.as_mut().filter(|_| len >= WORK_MIN) {
                    Some(work) => {
                        // The job holds the mapping itself, so the source outlives the link.
                        let pool = self.peer_pool.clone();
                        let job = move || {
                            // SAFETY: `at..at+len` lies inside the peer pool mapping (checked
                            // above), which `pool` keeps mapped; the destination is valid per
                            // this function's contract and is not the shared segment.
                            unsafe { dst.copy_from(pool.ptr().add(at), len) };
                            Ok(())
                        };
                        // SAFETY: the job touches the mapping it owns and the destination,
                        // which post_read's contract keeps valid until the read completes.
                        work.push(unsafe { Work::new(id, Box::new(job)) });
                    }
                    None => {
                        // SAFETY: as in the job above.
                        unsafe { dst.copy_from(self.peer_pool.ptr().add(at), len) };
                        self.completions.push_back((id, Ok(())));
                    }
                }
            }
            Desc::Region {
                pid, region, addr, ..
            } => {
                if pid != self.peer_hello_pid {
                    return Err(Error::Protocol(format!(
                        "descriptor names process {pid} but the peer is process {}",
                        self.peer_hello_pid
                    )));
                }
                if self.cma {
                    let (pid, remote, dst) = (self.peer_pid, addr.wrapping_add(offset), Dst(dst));
                    match self.work.as_mut().filter(|_| len >= WORK_MIN) {
                        Some(work) => {
                            // SAFETY: dst is valid for `len` bytes (function contract).
                            let job = move || unsafe { dst.cma_read(pid, remote, len) };
                            // SAFETY: the job touches only the destination, which post_read's
                            // contract keeps valid until the read completes.
                            work.push(unsafe { Work::new(id, Box::new(job)) });
                        }
                        None => {
                            // SAFETY: dst is valid for `len` bytes (function contract).
                            let r = unsafe { dst.cma_read(pid, remote, len) };
                            self.completions.push_back((id, r));
                        }
                    }
                } else {
                    let rid = self.next_rid;
                    self.next_rid += 1;
                    self.reads.insert(
                        rid,
                        BounceRead {
                            id,
                            dst,
                            len: len as u64,
                            remaining: len as u64,
                        },
                    );
                    let mut rec = Vec::with_capacity(32);
                    for w in [rid, region, offset, len as u64] {
                        rec.extend_from_slice(&w.to_le_bytes());
                    }
                    self.outbox.push_back((T_READ_REQ, rec));
                    self.flush_outbox()?;
                }
            }
        }
        Ok(())
    }

    fn pool(&self) -> Option<Arc<Pool>> {
        Some(self.pool.pool.clone())
    }

    fn enable_work(&mut self) {
        self.work.get_or_insert_with(Vec::new);
    }

    fn take_work(&mut self) -> Vec<Work> {
        self.work.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn has_work(&self) -> bool {
        self.work.as_ref().is_some_and(|w| !w.is_empty())
    }

    fn work_done(&mut self, id: u64, result: Result<()>) {
        self.completions.push_back((id, result));
    }

    fn has_completions(&self) -> bool {
        !self.completions.is_empty()
    }

    fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        // Best effort: a full socket buffer is impossible here (nothing else is written
        // after setup), and a dead peer does not need to hear it.
        let _ = self.sock.try_write(&[CLOSE_BYTE]);
        // SAFETY: plain syscall on the socket we own.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_WR) };
    }
}

#[cfg(all(test, not(ibex_loom)))]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_garbage_is_refused() {
        for d in [
            Desc::Pool {
                offset: 64,
                len: 100,
            },
            Desc::Region {
                pid: 7,
                region: 3,
                addr: 0xdead_0000,
                len: 1 << 30,
            },
        ] {
            assert_eq!(Desc::parse(&d.encode()).unwrap(), d);
        }
        assert!(Desc::parse(&[]).is_err());
        assert!(Desc::parse(&[D_POOL; 23]).is_err());
        assert!(Desc::parse(&[9u8; 40]).is_err());
    }
}
