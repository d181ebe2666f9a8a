//! [`VerbsLink`]: the [`Link`] contract on one RC queue pair.
//!
//! - Eager frames: SEND into the peer's pre-posted receive slots. Receive slots are carved
//!   from the domain's shared local slabs (`domain.rs`): a few at connect, more (up to the
//!   handshake's count) when bursts drain them, and reposted as soon as the frame is copied
//!   out. Sends are copied into send slots from the same slabs, also grown on demand (or
//!   posted inline when small enough); only every Nth send asks for a completion, which on
//!   RC also retires every unsignalled send before it.
//! - Rendezvous: `expose` finds the buffer in the domain's peer-readable slabs, the user
//!   pool or the registration cache (registering it there on a miss); the peer pulls it with
//!   RDMA READ. One `post_read` is one work request: the connection schedules reads (it
//!   cuts them to `LinkInfo::max_read` and keeps at most `LinkInfo::read_depth`, the
//!   negotiated READ depth, outstanding), so the link keeps no read queue of its own.
//! - Descriptor (20 bytes, little-endian): `addr u64 | len u64 | rkey u32`.
//! - Work request ids: the top two bits say receive or send queue; the rest is the receive
//!   slot or the send-queue sequence number. Send-queue completions arrive in posting order,
//!   so one sequence number retires everything posted up to it.
//! - Frames travel as SEND-with-immediate: `IMM_FRAME` for frames, `IMM_MARKER` for the
//!   empty marker `close` posts behind the last frame (see `MARKER_WAIT`). The values read
//!   the same in either byte order.

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use rdma_mummy_sys as sys;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard, QueuePair, SetInlineData, SetScatterGatherEntry,
    WorkRequestFlags,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::domain::Domain;
use super::progress::{Progress, Wc};
use crate::error::{Error, Result};
use crate::link::{Exposure, Link, LinkEvent, LinkInfo, RecvBuf, Registrar};
use crate::pool::{Pool, PoolBufMut};
use crate::verbs_wire::BYE;

pub(crate) const WR_RECV: u64 = 0;
pub(crate) const WR_SQ: u64 = 1 << 62;
/// How long a link keeps reading its CQ after the bootstrap socket of a peer that did not
/// say goodbye ended (it crashed, or dropped its link without closing it), for completions
/// of frames it sent just before; each completion that comes meanwhile starts it again.
/// A graceful close does not rely on it: see [`MARKER_WAIT`].
const PEER_EOF_GRACE: Duration = Duration::from_secs(1);
/// How long a link waits for the close marker of a peer that said goodbye (`BYE` on the
/// bootstrap socket) before it gives up on the frames ahead of it. The peer wrote `BYE` only
/// once the marker was acknowledged, so the marker is already on this side and only its
/// completion can lag: a grace period guessed at this (250 ms, later 1 s) once lost a
/// gracefully closing server's last answers on Soft-RoCE under emulation (the two-host VM,
/// `graceful_shutdown`). Only a broken or hostile peer makes a link wait this long.
const MARKER_WAIT: Duration = Duration::from_secs(10);
const WR_KIND: u64 = 3 << 62;
pub(crate) const IMM_FRAME: u32 = 0;
pub(crate) const IMM_MARKER: u32 = u32::MAX;
/// Largest single RDMA READ work request (`LinkInfo::max_read`): the connection's fragments
/// are never longer, so one `post_read` is one work request. Ports cap the message size;
/// 1 MiB is well under every cap and long enough to keep the wire busy.
const MAX_READ: usize = 1 << 20;
const DESC_LEN: usize = 20;
/// Receive slots posted at connect: an idle connection costs this many slots, not the
/// handshake's full count (which a busy one grows to; see `grow_recvs`).
pub(crate) const INITIAL_RECV_SLOTS: usize = 8;
/// Send slots taken at connect, and how many more at a time when they run out.
pub(crate) const INITIAL_SEND_SLOTS: usize = 2;
const SEND_GROUP: usize = 8;

/// A parsed rendezvous descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Desc {
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

impl Desc {
    pub fn encode(&self) -> Bytes {
        let mut b = Vec::with_capacity(DESC_LEN);
        b.extend_from_slice(&self.addr.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        b.extend_from_slice(&self.rkey.to_le_bytes());
        Bytes::from(b)
    }

    pub fn decode(b: &[u8]) -> Result<Desc> {
        let b: &[u8; DESC_LEN] = b.try_into().map_err(|_| {
            Error::Protocol(format!(
                "malformed verbs descriptor: {} bytes, expected {DESC_LEN}",
                b.len()
            ))
        })?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[0..8]);
        let addr = u64::from_le_bytes(a);
        a.copy_from_slice(&b[8..16]);
        let len = u64::from_le_bytes(a);
        let rkey = u32::from_le_bytes([b[16], b[17], b[18], b[19]]);
        if addr.checked_add(len).is_none() {
            return Err(Error::Protocol(
                "malformed verbs descriptor: region wraps the address space".into(),
            ));
        }
        Ok(Desc { addr, len, rkey })
    }
}

enum SqKind {
    /// `slot`: the send slot (group, offset) it used, `None` for inline data.
    Send {
        slot: Option<(usize, usize)>,
    },
    /// `id`: the caller's read id, reported in its `ReadDone`.
    Read {
        id: u64,
    },
    Marker,
}

struct SqEntry {
    seq: u64,
    kind: SqKind,
}

struct Exposed {
    buf: Bytes,
    /// Key into the registration cache when this exposure registered (or reused) a region.
    key: Option<(usize, usize)>,
}

/// Registered memory carved into slots: a buffer from the domain's local slabs and its key.
pub(crate) struct SlotMem {
    pub buf: PoolBufMut,
    pub lkey: u32,
}

impl SlotMem {
    fn addr(&self, off: usize) -> u64 {
        self.buf.as_ptr() as u64 + off as u64
    }
}

/// Everything `establish` hands over to build a link.
pub(crate) struct Parts {
    pub qp: ExtendedQueuePair,
    pub progress: Progress,
    pub domain: Arc<Domain>,
    /// The receive slots posted at connect, all in this one buffer.
    pub recv: SlotMem,
    pub initial_recvs: usize,
    /// Receive slots this side may grow to (what the handshake announced).
    pub n_recv: usize,
    pub slot_size: usize,
    /// The first send slots.
    pub send: SlotMem,
    pub n_send: usize,
    pub max_frame: usize,
    pub max_inline: usize,
    pub max_rd: usize,
    pub tcp: TcpStream,
    pub peer: String,
}

/// One end of a verbs connection: an RC queue pair with its slabs. See the module docs.
pub struct VerbsLink {
    // Field order is drop order: the queue pair goes first so the device stops touching
    // memory, then completion delivery, then the memory itself.
    qp: ExtendedQueuePair,
    progress: Progress,
    /// Receive slot memory (groups) and where each slot lies: (group, offset).
    recv_mem: Vec<SlotMem>,
    recv_slots: Vec<(usize, usize)>,
    /// Send slot memory (groups), the free slots, and how many slots exist.
    send_mem: Vec<SlotMem>,
    send_free: Vec<(usize, usize)>,
    send_slots: usize,
    exposures: HashMap<u64, Exposed>,
    domain: Arc<Domain>,

    n_recv: usize,
    slot_size: usize,
    n_send: usize,
    max_frame: usize,
    max_inline: usize,
    /// Send-queue work requests in flight, oldest first.
    sq: VecDeque<SqEntry>,
    sq_sends: usize,
    next_seq: u64,
    unsignaled: usize,
    signal_every: usize,

    max_rd: usize,
    /// RDMA READs posted and not completed; the connection keeps it within `max_rd`.
    reads_in_flight: usize,
    next_exposure: u64,

    wcs: Vec<Wc>,
    events: VecDeque<LinkEvent>,
    dead: Option<Error>,
    /// The bootstrap socket reported the peer gone: the error, once the peer's close marker
    /// arrives or the wait for its last frames' completions ends.
    peer_eof: Option<(Error, Pin<Box<tokio::time::Sleep>>)>,
    /// The peer's close marker came: every frame it sent is delivered.
    peer_marker: bool,
    /// The peer wrote `BYE`: its marker is acknowledged, so it will come.
    peer_bye: bool,
    closing: bool,
    /// `close` posted the marker: shutting the socket writes `BYE` first.
    bye_due: bool,
    shut: bool,
    send_waker: Option<Waker>,
    event_waker: Option<Waker>,
    tcp: TcpStream,
    peer: String,
}

impl Drop for VerbsLink {
    fn drop(&mut self) {
        // The queue pair is destroyed with the fields, after this: stop routing its events
        // first, since another queue pair may get its address.
        self.domain.unwatch_qp(self.qp_addr());
    }
}

/// The connection's handle on the domain's registration work ([`Registrar`]).
#[derive(Clone)]
pub(crate) struct DomainRegistrar(pub Arc<Domain>);

impl std::fmt::Debug for DomainRegistrar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "verbs domain {:?}", self.0.dev)
    }
}

impl Registrar for DomainRegistrar {
    fn would_register(&self, buf: &[u8]) -> bool {
        self.0.would_register(buf)
    }
    fn prepare(&self, buf: &Bytes) -> Result<()> {
        self.0.prepare(buf)
    }
    fn recv_would_register(&self, len: usize) -> bool {
        self.0.local.free_bytes() < len
    }
    fn reserve_recv(&self, len: usize) -> Result<()> {
        // Register a slab now if none has room, then hand the room back: the receive path
        // takes it again under the connection's lock, without registering.
        self.0.local_or_register(len, false).map(drop)
    }
    fn pool(&self) -> Option<Arc<Pool>> {
        self.0.user_pool()
    }
    fn alloc(&self, len: usize) -> Result<PoolBufMut> {
        self.0.alloc_exposable(len)
    }
    fn try_alloc(&self, len: usize) -> Option<PoolBufMut> {
        self.0.try_exposable(len)
    }
    fn forget(&self, ptr: usize, len: usize) {
        self.0.forget((ptr, len));
    }
}

impl std::fmt::Debug for VerbsLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsLink")
            .field("peer", &self.peer)
            .field("qpn", &self.qp.qp_number())
            .field("max_frame", &self.max_frame)
            .field("max_inline", &self.max_inline)
            .field("max_rd", &self.max_rd)
            .finish()
    }
}

fn status_name(s: u32) -> &'static str {
    use sys::ibv_wc_status::*;
    match s {
        IBV_WC_LOC_LEN_ERR => "local length error",
        IBV_WC_LOC_QP_OP_ERR => "local QP operation error",
        IBV_WC_LOC_PROT_ERR => "local protection error",
        IBV_WC_WR_FLUSH_ERR => "flushed (queue pair in error)",
        IBV_WC_LOC_ACCESS_ERR => "local access error",
        IBV_WC_REM_INV_REQ_ERR => "remote invalid request",
        IBV_WC_REM_ACCESS_ERR => "remote access error",
        IBV_WC_REM_OP_ERR => "remote operation error",
        IBV_WC_RETRY_EXC_ERR => "transport retry counter exceeded",
        IBV_WC_RNR_RETRY_EXC_ERR => "receiver-not-ready retry counter exceeded",
        IBV_WC_FATAL_ERR => "fatal error",
        IBV_WC_RESP_TIMEOUT_ERR => "response timeout",
        _ => "error",
    }
}

impl VerbsLink {
    pub(crate) fn new(p: Parts) -> VerbsLink {
        // Signal often enough that the ring never fills with unretired sends.
        let signal_every = (p.n_send / 4).clamp(1, 16);
        let recv_slots = (0..p.initial_recvs).map(|i| (0, i * p.slot_size)).collect();
        let first_send = (p.send.buf.len() / p.max_frame.max(1)).min(p.n_send);
        let send_free = (0..first_send)
            .rev()
            .map(|i| (0, i * p.max_frame))
            .collect();
        let link = VerbsLink {
            qp: p.qp,
            progress: p.progress,
            recv_mem: vec![p.recv],
            recv_slots,
            send_mem: vec![p.send],
            send_free,
            send_slots: first_send,
            exposures: HashMap::new(),
            domain: p.domain,
            n_recv: p.n_recv,
            slot_size: p.slot_size,
            n_send: p.n_send,
            max_frame: p.max_frame,
            max_inline: p.max_inline,
            sq: VecDeque::new(),
            sq_sends: 0,
            next_seq: 0,
            unsignaled: 0,
            signal_every,
            max_rd: p.max_rd,
            reads_in_flight: 0,
            next_exposure: 1,
            wcs: Vec::with_capacity(64),
            events: VecDeque::new(),
            dead: None,
            peer_eof: None,
            peer_marker: false,
            peer_bye: false,
            bye_due: false,
            closing: false,
            shut: false,
            send_waker: None,
            event_waker: None,
            tcp: p.tcp,
            peer: p.peer,
        };
        link.domain.watch_qp(link.qp_addr());
        link
    }

    fn qp_addr(&self) -> usize {
        // SAFETY: only used as a key to match asynchronous events, never dereferenced.
        unsafe { self.qp.qp().as_ptr() as usize }
    }

    /// Receive slots posted now (grows with use up to the handshake's count).
    pub fn recv_slots(&self) -> usize {
        self.recv_slots.len()
    }

    /// Send slots this link holds now (grows with use up to `credits + 16`).
    pub fn send_slots(&self) -> usize {
        self.send_slots
    }

    /// Largest frame sent inline (0 when the device offers no inline data).
    pub fn max_inline(&self) -> usize {
        self.max_inline
    }

    /// RDMA READs this link keeps outstanding at most (the negotiated READ depth).
    pub fn read_depth(&self) -> usize {
        self.max_rd
    }

    /// The bootstrap socket, for tests that play a broken peer on it (a `BYE` with no
    /// close marker behind it, a stray byte). Not for applications: the link owns what
    /// travels on it.
    #[doc(hidden)]
    pub fn bootstrap_socket(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.tcp.as_fd()
    }

    /// True when completions come from a dedicated busy-poll thread (`IBEX_VERBS_BUSY_POLL=1`).
    pub fn busy_polling(&self) -> bool {
        matches!(self.progress, Progress::Busy { .. })
    }

    fn die(&mut self, e: Error) {
        if self.dead.is_none() {
            tracing::debug!(peer = %self.peer, error = %e, "verbs link dead");
            self.dead = Some(e);
        }
        self.wake_all();
    }

    fn wake_all(&mut self) {
        if let Some(w) = &self.send_waker {
            w.wake_by_ref();
        }
        if let Some(w) = &self.event_waker {
            w.wake_by_ref();
        }
    }

    fn post_recv(&mut self, slot: usize) -> Result<()> {
        let Some(&(g, off)) = self.recv_slots.get(slot) else {
            return Err(Error::Protocol(format!(
                "receive slot {slot} does not exist"
            )));
        };
        let m = &self.recv_mem[g];
        let (lkey, addr, len) = (m.lkey, m.addr(off), self.slot_size as u32);
        let mut guard = self.qp.start_post_recv();
        let wr = guard.construct_wr(WR_RECV | slot as u64);
        // SAFETY: the slot lies in registered memory this link holds (`recv_mem`), which
        // outlives the QP (field order), and is not touched by us until its completion.
        unsafe { wr.setup_sge(lkey, addr, len) };
        guard
            .post()
            .map_err(|e| Error::io("posting a receive", std::io::Error::other(e)))
    }

    /// Posts the first `n` receive slots of `recv`; called once before the queue pair
    /// leaves INIT.
    pub(crate) fn post_initial_recvs(
        qp: &mut ExtendedQueuePair,
        recv: &SlotMem,
        n: usize,
        slot_size: usize,
    ) -> Result<()> {
        let mut guard = qp.start_post_recv();
        for slot in 0..n {
            let wr = guard.construct_wr(WR_RECV | slot as u64);
            // SAFETY: as in `post_recv`: `recv` becomes the link's and outlives the QP.
            unsafe { wr.setup_sge(recv.lkey, recv.addr(slot * slot_size), slot_size as u32) };
        }
        guard
            .post()
            .map_err(|e| Error::io("posting the initial receives", std::io::Error::other(e)))
    }

    /// A burst drained at least half of the posted receives in one go: post more, up to
    /// the count the peer's credits were sized for. Memory comes from the domain's slabs
    /// without registering; if none is ready the domain thread registers more and a later
    /// burst grows again (meanwhile the peer's extra sends wait in receiver-not-ready
    /// retries, which are unlimited, so nothing is lost).
    fn grow_recvs(&mut self) {
        let have = self.recv_slots.len();
        let add = have.min(self.n_recv - have);
        if add == 0 || self.dead.is_some() {
            return;
        }
        let Some((buf, lkey)) = self.domain.try_local(add * self.slot_size) else {
            return;
        };
        let g = self.recv_mem.len();
        self.recv_mem.push(SlotMem { buf, lkey });
        for i in 0..add {
            self.recv_slots.push((g, i * self.slot_size));
            if let Err(e) = self.post_recv(have + i) {
                self.die(e);
                return;
            }
        }
        tracing::trace!(peer = %self.peer, slots = have + add, "verbs: more receive slots");
    }

    /// A free send slot, taking more from the domain's slabs when the ones held are all in
    /// flight (never registering here; the ones held always suffice to make progress).
    fn take_send_slot(&mut self) -> Option<(usize, usize)> {
        if let Some(s) = self.send_free.pop() {
            return Some(s);
        }
        let add = SEND_GROUP.min(self.n_send - self.send_slots);
        if add == 0 {
            return None;
        }
        let (buf, lkey) = self.domain.try_local(add * self.max_frame)?;
        let g = self.send_mem.len();
        self.send_mem.push(SlotMem { buf, lkey });
        self.send_slots += add;
        self.send_free
            .extend((0..add).rev().map(|i| (g, i * self.max_frame)));
        self.send_free.pop()
    }

    fn send_room(&mut self, inline: bool) -> bool {
        if self.sq_sends >= self.n_send {
            return false;
        }
        if inline || !self.send_free.is_empty() {
            return true;
        }
        match self.take_send_slot() {
            Some(s) => {
                self.send_free.push(s);
                true
            }
            None => false,
        }
    }

    /// Handles everything in `self.wcs`.
    fn process(&mut self) {
        let mut wcs = std::mem::take(&mut self.wcs);
        let had_events = self.events.len();
        let mut freed = false;
        let mut recvs = 0;
        for wc in wcs.drain(..) {
            if wc.wr_id & WR_KIND == WR_SQ {
                freed = true;
                self.sq_done(wc);
            } else {
                recvs += 1;
                self.recv_done(wc);
            }
        }
        self.wcs = wcs;
        if recvs * 2 >= self.recv_slots.len() && self.recv_slots.len() < self.n_recv {
            self.grow_recvs();
        }
        if self.closing && self.sq.is_empty() {
            self.shutdown_socket();
        }
        if freed && let Some(w) = &self.send_waker {
            w.wake_by_ref();
        }
        if self.events.len() > had_events
            && let Some(w) = &self.event_waker
        {
            w.wake_by_ref();
        }
    }

    fn recv_done(&mut self, wc: Wc) {
        let slot = (wc.wr_id & !WR_KIND) as usize;
        if wc.status != sys::ibv_wc_status::IBV_WC_SUCCESS {
            let e = if wc.status == sys::ibv_wc_status::IBV_WC_LOC_LEN_ERR {
                Error::Protocol(format!(
                    "the peer sent a frame larger than our receive slot ({} bytes)",
                    self.slot_size
                ))
            } else {
                Error::PeerGone(format!("receive failed: {}", status_name(wc.status)))
            };
            self.die(e);
            return;
        }
        if slot >= self.recv_slots.len() || wc.byte_len as usize > self.slot_size {
            self.die(Error::Protocol(format!(
                "receive completion out of range (slot {slot}, {} bytes)",
                wc.byte_len
            )));
            return;
        }
        let frame = (wc.imm != IMM_MARKER).then(|| {
            let (g, off) = self.recv_slots[slot];
            self.recv_mem[g]
                .buf
                .get(off..off + wc.byte_len as usize)
                .map(Bytes::copy_from_slice)
        });
        if self.dead.is_none()
            && let Err(e) = self.post_recv(slot)
        {
            self.die(e);
        }
        match frame {
            Some(Some(b)) => self.events.push_back(LinkEvent::Frame(b)),
            Some(None) => self.die(Error::Protocol(
                "receive completion outside the receive slab".into(),
            )),
            None => self.peer_marker = true,
        }
    }

    fn sq_done(&mut self, wc: Wc) {
        let seq = wc.wr_id & !WR_KIND;
        while let Some(front) = self.sq.front() {
            if front.seq > seq {
                break;
            }
            let Some(e) = self.sq.pop_front() else { break };
            let this = e.seq == seq;
            match e.kind {
                SqKind::Send { slot } => {
                    self.sq_sends -= 1;
                    if let Some(s) = slot {
                        self.send_free.push(s);
                    }
                    if this && wc.status != sys::ibv_wc_status::IBV_WC_SUCCESS {
                        self.die(Error::PeerGone(format!(
                            "sending to the peer failed: {}",
                            status_name(wc.status)
                        )));
                    }
                }
                SqKind::Marker => {}
                SqKind::Read { id } => {
                    self.reads_in_flight -= 1;
                    let status = if this {
                        wc.status
                    } else {
                        sys::ibv_wc_status::IBV_WC_SUCCESS
                    };
                    self.read_done(id, status);
                }
            }
        }
    }

    fn read_done(&mut self, id: u64, status: u32) {
        use sys::ibv_wc_status::*;
        let err = match status {
            IBV_WC_SUCCESS => None,
            IBV_WC_REM_ACCESS_ERR | IBV_WC_REM_INV_REQ_ERR | IBV_WC_REM_OP_ERR => {
                Some(Error::Protocol(format!(
                    "peer refused the read: bad descriptor ({}); the queue pair is now in error",
                    status_name(status)
                )))
            }
            s => Some(Error::PeerGone(format!(
                "RDMA READ failed: {}",
                status_name(s)
            ))),
        };
        if let Some(e) = &err {
            self.die(e.clone());
        }
        let result = match err {
            Some(e) => Err(e),
            None => Ok(()),
        };
        self.events.push_back(LinkEvent::ReadDone { id, result });
    }

    /// Takes completions without waiting.
    fn reap(&mut self) {
        match self.progress.poll_now(&mut self.wcs) {
            Ok(0) => {}
            Ok(_) => self.process(),
            Err(e) => self.die(e),
        }
    }

    fn shutdown_socket(&mut self) {
        if self.shut {
            return;
        }
        self.shut = true;
        if self.bye_due {
            // Straight to the socket: tokio's write may say Pending (its readiness not yet
            // seen, the task's budget spent), and nothing would poll it again. The socket has
            // carried nothing since set-up, so one byte fits its buffer; should it not, the
            // peer sees a plain end of file and waits its shorter grace.
            let bye = [BYE];
            // SAFETY: a one-byte send from a live buffer on the socket this link owns.
            let sent = unsafe {
                libc::send(
                    self.tcp.as_raw_fd(),
                    bye.as_ptr().cast(),
                    1,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if sent != 1 {
                tracing::debug!(
                    error = %std::io::Error::last_os_error(),
                    "verbs: the close's BYE did not go out; the peer waits its shorter grace"
                );
            }
        }
        // TcpStream's shutdown is a plain syscall that never returns Pending.
        let mut cx = Context::from_waker(Waker::noop());
        let _ = Pin::new(&mut self.tcp).poll_shutdown(&mut cx);
    }

    /// `Some(err)` once the bootstrap socket reports the peer gone; notes its `BYE` on the way.
    fn poll_peer(&mut self, cx: &mut Context<'_>) -> Option<Error> {
        loop {
            let mut b = [0u8; 1];
            let mut rb = ReadBuf::new(&mut b);
            let got = match Pin::new(&mut self.tcp).poll_read(cx, &mut rb) {
                Poll::Pending => return None,
                Poll::Ready(Ok(())) => rb.filled().first().copied(),
                Poll::Ready(Err(e)) => {
                    return Some(Error::PeerGone(format!(
                        "verbs bootstrap connection to {} failed: {e}",
                        self.peer
                    )));
                }
            };
            return Some(match got {
                Some(BYE) if !self.peer_bye => {
                    self.peer_bye = true;
                    continue;
                }
                Some(byte) => Error::Protocol(format!(
                    "unexpected byte {byte:#04x} on the verbs bootstrap connection after set-up \
                     (only one BYE may come): is the peer an Ibex verbs link of this version?"
                )),
                None if self.peer_bye => {
                    Error::PeerGone(format!("{} closed its verbs link", self.peer))
                }
                None => Error::PeerGone(format!(
                    "{} closed its verbs bootstrap connection without closing the link \
                     (the process exited, or dropped the link unclosed)",
                    self.peer
                )),
            });
        }
    }

    fn lkey_for(&self, dst: *const u8, len: usize) -> Option<u32> {
        self.domain.lkey_for(dst, len)
    }
}

impl Link for VerbsLink {
    fn info(&self) -> LinkInfo {
        LinkInfo {
            provider: "verbs",
            max_frame: self.max_frame,
            rendezvous_path: "rdma-read".into(),
            one_sided: true,
            direct_reads: true,
            peer: self.peer.clone(),
            pipelined_reads: true,
            dma_reads: true,
            read_depth: self.max_rd,
            max_read: MAX_READ,
            max_push: 0,
            registrar: Some(Arc::new(DomainRegistrar(self.domain.clone()))),
            local_addr: None,
            tls: None,
        }
    }

    fn poll_send(&mut self, cx: &mut Context<'_>, frame: &[u8]) -> Poll<Result<()>> {
        self.poll_send_parts(cx, frame, &[])
    }

    /// Both parts go straight into the send slot (or the work request's inline data): no
    /// frame is assembled first.
    fn poll_send_parts(
        &mut self,
        cx: &mut Context<'_>,
        head: &[u8],
        body: &[u8],
    ) -> Poll<Result<()>> {
        let len = head.len() + body.len();
        if len > self.max_frame {
            return Poll::Ready(Err(Error::TooLarge {
                len: len as u64,
                limit: self.max_frame as u64,
                which: "the peer's eager receive slot (its Config::slot_size)",
            }));
        }
        let inline = self.max_inline > 0 && len <= self.max_inline;
        loop {
            if let Some(e) = &self.dead {
                return Poll::Ready(Err(e.clone()));
            }
            if self.closing {
                return Poll::Ready(Err(Error::LocallyClosed));
            }
            if self.send_room(inline) {
                break;
            }
            match self.progress.poll_fetch(cx, &mut self.wcs) {
                Poll::Ready(Ok(())) => self.process(),
                Poll::Ready(Err(e)) => self.die(e),
                Poll::Pending => {
                    self.send_waker = Some(cx.waker().clone());
                    return Poll::Pending;
                }
            }
        }
        let seq = self.next_seq;
        let slot = if inline { None } else { self.send_free.pop() };
        if !inline && slot.is_none() {
            // send_room said there was one.
            return Poll::Ready(Err(Error::Config("no free send slot".into())));
        }
        // Free slots after this one, counting those the link could still take: a send that
        // leaves the ring nearly full is signalled, so a completion will free it.
        let slots_free = self.send_free.len() + (self.n_send - self.send_slots);
        let room_after = (self.n_send - self.sq_sends - 1).min(slots_free);
        let signal = self.unsignaled + 1 >= self.signal_every
            || room_after < self.signal_every
            || (!inline && self.send_free.len() < self.signal_every);
        let flags = if signal {
            WorkRequestFlags::Signaled
        } else {
            WorkRequestFlags::none()
        };
        let (slot_addr, lkey) = match slot {
            Some((g, off)) => (self.send_mem[g].addr(off), self.send_mem[g].lkey),
            None => (self.send_mem[0].addr(0), self.send_mem[0].lkey),
        };
        if let Some((g, off)) = slot {
            let Some(dst) = self.send_mem[g].buf.get_mut(off..off + len) else {
                self.send_free.push((g, off));
                return Poll::Ready(Err(Error::Config("send slot outside its memory".into())));
            };
            let (h, b) = dst.split_at_mut(head.len());
            h.copy_from_slice(head);
            b.copy_from_slice(body);
        }
        let mut guard = self.qp.start_post_send();
        let wr = guard
            .construct_wr(WR_SQ | seq, flags)
            .setup_send_imm(IMM_FRAME);
        if inline && body.is_empty() {
            wr.setup_inline_data(head);
        } else if inline {
            wr.setup_inline_data_list(&[IoSlice::new(head), IoSlice::new(body)]);
        } else if len == 0 {
            // rxe rejects an empty scatter list; a zero-length entry in the slot is fine.
            // SAFETY: zero bytes of registered memory are named; nothing is read.
            unsafe { wr.setup_sge(lkey, slot_addr, 0) };
        } else {
            // SAFETY: the slot lies in registered memory this link holds, which outlives the
            // QP, and is not reused before this send's completion (or a later one) retires it.
            unsafe { wr.setup_sge(lkey, slot_addr, len as u32) };
        }
        if let Err(e) = guard.post() {
            if let Some(s) = slot {
                self.send_free.push(s);
            }
            let e = Error::io("posting a send", std::io::Error::other(e));
            self.die(e.clone());
            return Poll::Ready(Err(e));
        }
        self.next_seq += 1;
        self.sq_sends += 1;
        self.unsignaled = if signal { 0 } else { self.unsignaled + 1 };
        self.sq.push_back(SqEntry {
            seq,
            kind: SqKind::Send { slot },
        });
        Poll::Ready(Ok(()))
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        // Posted work is already the device's; only a closing link waits for it to be retired.
        loop {
            if let Some(e) = &self.dead {
                return Poll::Ready(Err(e.clone()));
            }
            if !self.closing || self.sq.is_empty() {
                if self.closing {
                    self.shutdown_socket();
                }
                return Poll::Ready(Ok(()));
            }
            match self.progress.poll_fetch(cx, &mut self.wcs) {
                Poll::Ready(Ok(())) => self.process(),
                Poll::Ready(Err(e)) => self.die(e),
                Poll::Pending => {
                    self.send_waker = Some(cx.waker().clone());
                    return Poll::Pending;
                }
            }
        }
    }

    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Result<LinkEvent>> {
        loop {
            if let Some(ev) = self.events.pop_front() {
                return Poll::Ready(Ok(ev));
            }
            if let Some(e) = &self.dead {
                return Poll::Ready(Err(e.clone()));
            }
            if let Some(e) = self.domain.poll_qp(cx, self.qp_addr()) {
                self.reap();
                self.die(e);
                continue;
            }
            match self.progress.poll_fetch(cx, &mut self.wcs) {
                Poll::Ready(Ok(())) => {
                    self.process();
                    if self.peer_marker
                        && let Some((e, _)) = self.peer_eof.take()
                    {
                        self.die(e);
                    } else if !self.peer_bye
                        && let Some((_, grace)) = &mut self.peer_eof
                    {
                        grace
                            .as_mut()
                            .reset(tokio::time::Instant::now() + PEER_EOF_GRACE);
                    }
                    continue;
                }
                Poll::Ready(Err(e)) => {
                    self.die(e);
                    continue;
                }
                Poll::Pending => {}
            }
            if self.peer_eof.is_none()
                && let Some(e) = self.poll_peer(cx)
            {
                // Frames the peer sent before leaving may still sit in the CQ, or not be
                // there yet: the acknowledgement of a send can overtake its completion on
                // this side (Soft-RoCE). A peer that said `BYE` closed behind a marker that
                // is already here: deliver everything up to it, however long its completion
                // takes. Without `BYE`, nothing says what is still coming; wait a moment.
                self.reap();
                if self.peer_marker || matches!(e, Error::Protocol(_)) {
                    self.die(e);
                } else {
                    let wait = if self.peer_bye {
                        MARKER_WAIT
                    } else {
                        PEER_EOF_GRACE
                    };
                    self.peer_eof = Some((e, Box::pin(tokio::time::sleep(wait))));
                }
                continue;
            }
            if let Some((_, grace)) = &mut self.peer_eof
                && grace.as_mut().poll(cx).is_ready()
                && let Some((e, _)) = self.peer_eof.take()
            {
                self.reap();
                if self.peer_bye && !self.peer_marker {
                    self.die(Error::PeerGone(format!(
                        "{} closed its verbs link, but its close marker did not arrive within \
                         {MARKER_WAIT:?}: frames it sent last are lost (is the RDMA device \
                         healthy on both sides?)",
                        self.peer
                    )));
                } else {
                    self.die(e);
                }
                continue;
            }
            self.event_waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
    }

    fn expose(&mut self, buf: Bytes) -> Result<Exposure> {
        if let Some(e) = &self.dead {
            return Err(e.clone());
        }
        // Usually found ready (the user pool, or the cache, which the connection fills ahead
        // of time off its lock); registers here only for direct users of the link.
        let (rkey, key, registration) = self.domain.expose(&buf)?;
        let id = self.next_exposure;
        self.next_exposure += 1;
        let descriptor = Desc {
            addr: buf.as_ptr() as u64,
            len: buf.len() as u64,
            rkey,
        }
        .encode();
        self.exposures.insert(id, Exposed { buf, key });
        Ok(Exposure {
            id,
            descriptor,
            zero_copy: false,
            registration,
        })
    }

    fn withdraw(&mut self, id: u64) -> Option<Bytes> {
        let e = self.exposures.remove(&id)?;
        if let Some(key) = e.key {
            // The registration stays cached (holding its own clone of the buffer) for the
            // next exposure of the same memory.
            self.domain.release(key);
        }
        Some(e.buf)
    }

    fn readable_dst(&self, ptr: *const u8, len: usize) -> bool {
        self.lkey_for(ptr, len).is_some()
    }

    fn map_remote(&mut self, descriptor: &[u8], len: u64) -> Result<Option<Bytes>> {
        let d = Desc::decode(descriptor)?;
        if len > d.len {
            return Err(Error::Protocol(format!(
                "message of {len} bytes does not fit its exposed region of {} bytes",
                d.len
            )));
        }
        Ok(None)
    }

    fn alloc_recv(&mut self, len: usize) -> Result<RecvBuf> {
        if len == 0 {
            return Ok(RecvBuf::heap(0));
        }
        // Shared local slabs; registering here (on the runtime, under the connection's lock)
        // is the counted fallback when the domain thread has not kept ahead.
        let (mut b, _) = match self.domain.try_local(len) {
            Some(b) => b,
            None => self.domain.local_or_register(len, true)?,
        };
        let ptr = b.as_mut_ptr();
        // SAFETY: the buffer is ours alone, stays put, and lives as long as the PoolBufMut
        // that owns it (which keeps its slab, and so the registration, alive).
        Ok(unsafe { RecvBuf::from_raw(ptr, len, Box::new(b)) })
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
        let d = Desc::decode(descriptor)?;
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|end| end > d.len) {
            return Err(Error::Protocol(format!(
                "read of {len} bytes at offset {offset} lies outside the exposed region of {} bytes",
                d.len
            )));
        }
        if len == 0 {
            self.events
                .push_back(LinkEvent::ReadDone { id, result: Ok(()) });
            if let Some(w) = &self.event_waker {
                w.wake_by_ref();
            }
            return Ok(());
        }
        let Some(lkey) = self.lkey_for(dst, len) else {
            return Err(Error::Config(
                "post_read destination is not registered memory: read into buffers from alloc_recv"
                    .into(),
            ));
        };
        if len > MAX_READ {
            return Err(Error::TooLarge {
                len: len as u64,
                limit: MAX_READ as u64,
                which: "one RDMA READ (LinkInfo::max_read): split the read",
            });
        }
        if self.reads_in_flight >= self.max_rd {
            return Err(Error::Config(format!(
                "{} RDMA READs already outstanding, the link's read depth (LinkInfo::read_depth): post the next once one completes",
                self.reads_in_flight
            )));
        }
        let seq = self.next_seq;
        let mut guard = self.qp.start_post_send();
        let wr = guard
            .construct_wr(WR_SQ | seq, WorkRequestFlags::Signaled)
            .setup_read(d.rkey, d.addr + offset);
        // SAFETY: `dst..+len` lies in registered memory (lkey_for found it) that the caller
        // keeps alive until the ReadDone, or until the link, and so the QP, is dropped.
        unsafe { wr.setup_sge(lkey, dst as u64, len as u32) };
        if let Err(e) = guard.post() {
            let e = Error::io("posting an RDMA READ", std::io::Error::other(e.to_string()));
            self.die(e.clone());
            return Err(e);
        }
        self.next_seq += 1;
        self.reads_in_flight += 1;
        self.sq.push_back(SqEntry {
            seq,
            kind: SqKind::Read { id },
        });
        Ok(())
    }

    fn pool(&self) -> Option<Arc<Pool>> {
        // One per process and device, registered on the first call (blocks then).
        self.domain.user_pool()
    }

    fn close(&mut self) {
        if self.closing {
            return;
        }
        // Completions first: once `closing` is set, an empty send queue shuts the socket,
        // which must wait for the marker below.
        self.reap();
        self.closing = true;
        if self.dead.is_some() {
            self.shutdown_socket();
            return;
        }
        // An empty signalled marker behind the last frame (the peer reposts its slot and
        // delivers nothing). Its completion retires the tail of unsignalled sends, which
        // produces none of its own; and once it is acknowledged, `BYE` tells the peer that
        // everything up to it is on its side (see `MARKER_WAIT`).
        let seq = self.next_seq;
        let (lkey, addr) = (self.send_mem[0].lkey, self.send_mem[0].addr(0));
        let mut guard = self.qp.start_post_send();
        let wr = guard
            .construct_wr(WR_SQ | seq, WorkRequestFlags::Signaled)
            .setup_send_imm(IMM_MARKER);
        // SAFETY: zero bytes of registered send memory are named; nothing is read.
        unsafe { wr.setup_sge(lkey, addr, 0) };
        match guard.post() {
            Ok(()) => {
                self.next_seq += 1;
                self.unsignaled = 0;
                self.bye_due = true;
                self.sq.push_back(SqEntry {
                    seq,
                    kind: SqKind::Marker,
                });
            }
            Err(e) => {
                tracing::debug!(error = %e, "verbs: posting the close marker failed");
                self.shutdown_socket();
            }
        }
        if self.sq.is_empty() {
            self.shutdown_socket();
        }
    }
}

#[allow(dead_code)]
fn _assert_send() {
    fn is_send<T: Send + 'static>() {}
    is_send::<VerbsLink>();
    is_send::<PoolBufMut>();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_round_trips_and_rejects_garbage() {
        let d = Desc {
            addr: 0x1000,
            len: 4096,
            rkey: 0xdead,
        };
        assert_eq!(Desc::decode(&d.encode()).unwrap(), d);
        assert!(Desc::decode(&d.encode()[..19]).is_err());
        assert!(Desc::decode(&[0u8; 21]).is_err());
        let wrap = Desc {
            addr: u64::MAX - 10,
            len: 100,
            rkey: 1,
        };
        assert!(matches!(
            Desc::decode(&wrap.encode()),
            Err(Error::Protocol(_))
        ));
    }
}
