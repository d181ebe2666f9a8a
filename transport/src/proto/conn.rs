//! The protocol state machine of one connection.
//!
//! Two independent directions share one `Connection`: the send side numbers application
//! messages, queues them (eager payloads or RTS announcements) and turns the queue into
//! frames as credits allow; the receive side mirrors the numbering, pulls rendezvous data
//! with fragmented reads and delivers strictly in order. The threshold probe rides on the
//! same frames without touching message numbering. `docs/protocol.md` walks through the
//! state machines.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::map::Map;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::caps::LinkCaps;
use super::frame::{
    Body, EAGER_ONE_HEAD, FEATURE_PROBE_READ, FEATURE_RTS_HEAD, Frame, HEADER_LEN, HelloExt,
    MAX_DESC_LEN, RTS_FIXED, truncate_utf8,
};
use super::probe::{FRAGMENT_PROBE_LEN, Probe, ProbePlan, Progress, Sample, Verdict};
use super::{
    Action, Delivery, EAGER_OVERHEAD, MsgId, PROBE_MSG_BIT, ProtoStats, Protocol, RecvMode,
};
use crate::config::{Config, MAX_FRAGMENT, MIN_FRAGMENT};
use crate::error::Error;

/// Close codes on the wire.
const CLOSE_GRACEFUL: u32 = 0;
const CLOSE_PROTOCOL: u32 = 1;
const CLOSE_LOCAL_ERROR: u32 = 2;
/// Close reasons are cut to this so a `Close` fits the smallest legal slot (1 KiB).
const MAX_REASON: usize = 512;

/// How long a graceful close waits for the peer to take one more of the messages still
/// queued (or to finish reading one: a 1 GiB message takes under 9 s at 1 Gbit/s). A peer
/// that stopped granting credit (it stopped reading, or is paused by its own limits) would
/// otherwise keep the connection, and its socket, open for as long as it lives.
pub const CLOSE_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// The smallest slot a peer may announce; matches `Config::validate`.
const MIN_PEER_SLOT: usize = 1024;

/// Keep-alive pings are eager probe samples with this bit in their id: every build answers
/// those, and their answers never reach the threshold probe (whose ids stay far below).
const KEEPALIVE_PROBE_BIT: u32 = 1 << 31;

/// What the peer announced in its `Hello`.
#[derive(Debug, Clone, Copy)]
struct Peer {
    slot_size: usize,
    max_message: u64,
    /// Optional features from its `Hello` extension ([`FEATURE_PROBE_READ`]).
    features: u32,
}

/// A frame for the link ([`Connection::poll_transmit_parts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transmit {
    /// An encoded frame.
    Frame(Bytes),
    /// An eager frame of one message, as its head and the message: the frame is `head`
    /// followed by `msg`.
    Eager {
        /// [`Frame::eager_one_head`].
        head: [u8; EAGER_ONE_HEAD],
        /// The message.
        msg: Bytes,
    },
}

impl Transmit {
    /// The whole frame in one buffer.
    pub fn into_bytes(self) -> Bytes {
        match self {
            Transmit::Frame(f) => f,
            Transmit::Eager { head, msg } => {
                let mut f = bytes::BytesMut::with_capacity(head.len() + msg.len());
                f.extend_from_slice(&head);
                f.extend_from_slice(&msg);
                f.freeze()
            }
        }
    }

    /// Bytes of the whole frame.
    pub fn len(&self) -> usize {
        match self {
            Transmit::Frame(f) => f.len(),
            Transmit::Eager { head, msg } => head.len() + msg.len(),
        }
    }

    /// Never true: every frame has a header.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A queued outgoing message, in send order.
#[derive(Debug)]
enum Out {
    Eager(Bytes),
    Rts {
        seq: MsgId,
        len: u64,
        desc: Bytes,
        head: Bytes,
    },
}

/// Progress of an incoming rendezvous message (or probe sample).
#[derive(Debug, PartialEq, Eq)]
enum RndvState {
    /// Waiting for room in the receive budget (`Config::rndv_recv_budget`): no `BeginRecv` yet.
    Deferred,
    /// `BeginRecv` emitted; waiting for the driver's `accept_rendezvous`.
    Announced,
    /// Fragments being read.
    Reading,
    /// All bytes are in place (or mapped): deliverable.
    Complete,
}

#[derive(Debug)]
struct RndvIn {
    len: u64,
    desc: Bytes,
    /// The message's head, carried in its `Rts` (empty for most messages).
    head: Bytes,
    probe: bool,
    state: RndvState,
    /// Offset of the next fragment to issue.
    next_offset: u64,
    /// Bytes per read: the fragment size in force when it was announced, or the one a
    /// fragment-probe sample asks for.
    frag: u64,
    reads_out: usize,
}

/// A received message not yet delivered (or a probe sample not yet finished).
#[derive(Debug)]
enum InMsg {
    /// Payload, and the first message number of its frame if it shared the frame.
    Eager(Bytes, Option<MsgId>),
    Rndv(RndvIn),
}

/// Whose credit a delivered-but-unconsumed message holds.
#[derive(Debug, Clone, Copy)]
enum CreditTag {
    /// The message had a frame to itself.
    Single,
    /// The message shared an eager frame whose first message is this one.
    Group(MsgId),
}

/// One connection's protocol state. See the module docs of [`crate::proto`].
pub struct Connection {
    cfg: Config,
    peer: Option<Peer>,
    stats: ProtoStats,
    actions: VecDeque<Action>,

    // Send side.
    /// Control frames (`Hello`, `RndvDone`, `ProbeAck`): they take no credit and go first.
    control: VecDeque<Body>,
    /// Application messages waiting for a credit, in message order.
    data: VecDeque<Out>,
    next_send_seq: MsgId,
    /// Credits we hold: data frames we may still send.
    send_credits: u32,
    /// Data frames sent whose credit has not come back.
    data_out: u32,
    /// A data frame is waiting for credits (one stall episode counts once).
    stalled: bool,
    /// Rendezvous sends not yet released (queued or announced).
    unreleased: BTreeSet<MsgId>,
    /// Rendezvous sends announced to the peer and not yet released.
    rts_sent: BTreeSet<MsgId>,

    // Receive side.
    next_recv_seq: MsgId,
    next_deliver: MsgId,
    /// Received, not yet delivered; probe samples (keys with [`PROBE_MSG_BIT`]) until read.
    recv: BTreeMap<MsgId, InMsg>,
    /// Accepted messages with fragments still to issue; reads go out in message order.
    read_queue: BTreeSet<MsgId>,
    /// What the link can do ([`Connection::set_link`]); fragments are never longer than
    /// its longest read.
    link: LinkCaps,
    /// Reads in flight: id -> message.
    reads: Map<u64, MsgId>,
    next_read_id: u64,
    /// Delivered messages whose credit waits for `consumed`.
    unconsumed: Map<MsgId, CreditTag>,
    /// Coalesced frames not yet fully consumed: first message -> messages left.
    groups: Map<MsgId, u16>,
    /// Mapped messages whose `RndvDone` waits for `release_recv`.
    mapped_unreleased: BTreeSet<MsgId>,
    /// Rendezvous receives past the budget, in arrival order (messages and probe samples).
    deferred: VecDeque<MsgId>,
    /// The list an eager frame's messages are packed into, kept between frames: a fresh one
    /// was an allocation per data frame.
    pack_buf: Vec<Bytes>,
    /// The list a received eager frame's messages are decoded into, kept between frames
    /// the same way.
    recv_buf: Vec<Bytes>,
    /// Bytes charged to the receive budget, per message: from `BeginRecv` until the
    /// application takes the message (or a probe sample is read, or a mapping needs none).
    charged: Map<MsgId, u64>,
    /// Sum of `charged`.
    charged_bytes: u64,
    /// Credits owed to the peer (sent in the next frame's header).
    owed: u32,
    /// Data frames the peer may still send before it must wait for credits from us.
    recv_window: u32,

    // Threshold and probe.
    probe: Option<Probe>,
    /// `start_probe` before the handshake: descriptor and length.
    pending_probe: Option<(Bytes, usize)>,
    /// Probe ids issued so far (answers to higher ids are forged).
    probe_issued: u32,
    probe_verdict: Option<usize>,
    /// The fragment size the last probe picked.
    fragment_verdict: Option<usize>,

    // Keep-alive (`Config::keepalive`).
    /// When a frame last arrived from the peer (or the connection began).
    last_heard: Instant,
    /// The ping outstanding, and when it became due: any frame from the peer answers it.
    ping: Option<Instant>,
    /// A ping is due but waits for a credit to go out.
    ping_unsent: bool,
    /// Pings sent so far (their ids, under [`KEEPALIVE_PROBE_BIT`]).
    pings: u32,

    // Closing.
    /// Graceful close requested with this reason.
    closing: Option<String>,
    /// When a graceful close gives up on what is still queued ([`CLOSE_DRAIN_TIMEOUT`]),
    /// unless fewer than this many messages are queued by then.
    closing_by: Option<(Instant, usize)>,
    /// Set once `Action::Closed` was queued.
    close_error: Option<Error>,
    /// The last frame to hand out after closing (`Close`), once.
    final_frame: Option<Bytes>,
}

impl Connection {
    /// A new connection. It queues its `Hello` at once; data frames wait for the peer's.
    pub fn new(config: &Config, now: Instant) -> Self {
        let hello = Body::Hello {
            slots: config.credits,
            slot_size: u32::try_from(config.slot_size).unwrap_or(u32::MAX),
            max_message: config.max_message_size,
            fragment_size: u32::try_from(
                config.fragment_size.unwrap_or(config.default_fragment_size),
            )
            .unwrap_or(u32::MAX),
            ext: HelloExt {
                features: FEATURE_PROBE_READ | FEATURE_RTS_HEAD,
            }
            .encode(),
        };
        let mut c = Connection {
            cfg: config.clone(),
            peer: None,
            stats: ProtoStats::default(),
            actions: VecDeque::new(),
            control: VecDeque::from([hello]),
            data: VecDeque::new(),
            next_send_seq: 0,
            send_credits: 0,
            data_out: 0,
            stalled: false,
            unreleased: BTreeSet::new(),
            rts_sent: BTreeSet::new(),
            next_recv_seq: 0,
            next_deliver: 0,
            recv: BTreeMap::new(),
            read_queue: BTreeSet::new(),
            link: LinkCaps::default(),
            reads: Map::default(),
            next_read_id: 0,
            unconsumed: Map::default(),
            groups: Map::default(),
            mapped_unreleased: BTreeSet::new(),
            deferred: VecDeque::new(),
            pack_buf: Vec::new(),
            recv_buf: Vec::new(),
            charged: Map::default(),
            charged_bytes: 0,
            owed: 0,
            recv_window: config.credits,
            probe: None,
            pending_probe: None,
            probe_issued: 0,
            probe_verdict: None,
            fragment_verdict: None,
            last_heard: now,
            ping: None,
            ping_unsent: false,
            pings: 0,
            closing: None,
            closing_by: None,
            close_error: None,
            final_frame: None,
        };
        c.refresh_settings();
        c
    }

    /// A frame arrived from the peer. Protocol violations close the connection
    /// (a `Close` frame to the peer, then [`Action::Closed`]); they never panic.
    pub fn handle_frame(&mut self, now: Instant, frame: Bytes) {
        if self.is_closed() {
            return;
        }
        self.stats.frames_recv += 1;
        if frame.len() > self.cfg.slot_size {
            return self.violation(format!(
                "frame of {} bytes exceeds our slot size of {} bytes",
                frame.len(),
                self.cfg.slot_size
            ));
        }
        let Frame { credits, body } = match Frame::decode_reusing(&frame, &mut self.recv_buf) {
            Ok(f) => f,
            Err(e) => return self.violation(format!("malformed frame: {e}")),
        };
        // Any frame shows the peer alive, and answers an outstanding keep-alive ping.
        self.last_heard = now;
        self.ping = None;
        self.ping_unsent = false;
        if credits > self.data_out {
            return self.violation(format!(
                "peer returned {credits} credits but only {} of our data frames are outstanding",
                self.data_out
            ));
        }
        self.data_out -= credits;
        self.send_credits += credits;

        match (&body, self.peer) {
            (Body::Hello { .. }, Some(_)) => return self.violation("second Hello".into()),
            (
                Body::Hello {
                    slots,
                    slot_size,
                    max_message,
                    ext,
                    ..
                },
                None,
            ) => {
                let features = match HelloExt::decode(ext) {
                    Ok(e) => e.features,
                    Err(e) => return self.violation(format!("malformed Hello extension: {e}")),
                };
                let peer = Peer {
                    slot_size: *slot_size as usize,
                    max_message: *max_message,
                    features,
                };
                return self.on_hello(now, *slots, peer);
            }
            (Body::Close { code, reason }, _) => {
                let reason = if *code == CLOSE_GRACEFUL {
                    reason.clone()
                } else {
                    format!("error {code}: {reason}")
                };
                return self.shut(Error::PeerClosed(reason), None);
            }
            (_, None) => {
                return self.violation(format!(
                    "frame of kind {} arrived before the peer's Hello",
                    body.kind()
                ));
            }
            (_, Some(_)) => {}
        }
        if body.is_data() {
            if self.recv_window == 0 {
                return self.violation(format!(
                    "peer sent a data frame with no credit left (our window is {} frames)",
                    self.cfg.credits
                ));
            }
            self.recv_window -= 1;
        }
        match body {
            Body::Hello { .. } | Body::Close { .. } | Body::Credit => {}
            Body::Eager { msgs } => self.on_eager(msgs),
            Body::Rts {
                seq,
                len,
                desc,
                head,
            } => self.on_rts(seq, len, desc, head),
            Body::RndvDone { seq, probe: false } => {
                if self.rts_sent.remove(&seq) {
                    self.unreleased.remove(&seq);
                    self.actions.push_back(Action::Release { msg: seq });
                } else {
                    self.violation(format!(
                        "RndvDone for message {seq}, which is not an outstanding rendezvous"
                    ));
                }
            }
            Body::RndvDone { seq, probe: true } => match u32::try_from(seq) {
                Ok(id) => self.on_probe_answer(now, id, Protocol::Rendezvous),
                Err(_) => {
                    self.violation(format!("probe RndvDone with id {seq}, beyond any probe id"))
                }
            },
            Body::ProbeEager { probe_id, .. } => {
                // Probe frames never reach the application: their slot is free at once.
                self.owed += 1;
                self.control.push_back(Body::ProbeAck { probe_id });
            }
            // The answer to a keep-alive ping (seen above); late ones are as good.
            Body::ProbeAck { probe_id } if probe_id & KEEPALIVE_PROBE_BIT != 0 => {}
            Body::ProbeAck { probe_id } => self.on_probe_answer(now, probe_id, Protocol::Eager),
            Body::ProbeRts {
                probe_id,
                len,
                desc,
            } => {
                self.owed += 1;
                let msg = PROBE_MSG_BIT | u64::from(probe_id);
                if let Err(what) = self.check_probe_len(len) {
                    return self.violation(what);
                }
                if self.recv.contains_key(&msg) {
                    return self.violation(format!(
                        "probe id {probe_id} reused while still in progress"
                    ));
                }
                let frag = self.fragment_size() as u64;
                self.begin_recv(msg, len, desc, Bytes::new(), true, frag);
            }
            Body::ProbeRead {
                probe_id,
                len,
                fragment,
                desc,
            } => {
                self.owed += 1;
                let msg = PROBE_MSG_BIT | u64::from(probe_id);
                if let Err(what) = self.check_probe_len(len) {
                    return self.violation(what);
                }
                if !(MIN_FRAGMENT..=MAX_FRAGMENT).contains(&(fragment as usize)) {
                    return self.violation(format!(
                        "probe read asks for {fragment}-byte fragments; {MIN_FRAGMENT}..={MAX_FRAGMENT} are allowed"
                    ));
                }
                if self.recv.contains_key(&msg) {
                    return self.violation(format!(
                        "probe id {probe_id} reused while still in progress"
                    ));
                }
                self.begin_recv(msg, len, desc, Bytes::new(), true, u64::from(fragment));
            }
        }
    }

    /// A read issued as [`Action::Read`] finished.
    pub fn read_completed(&mut self, now: Instant, id: u64, result: Result<(), Error>) {
        let _ = now;
        if self.is_closed() {
            return;
        }
        let Some(msg) = self.reads.remove(&id) else {
            tracing::debug!(id, "completion of an unknown read ignored");
            return;
        };
        if let Err(e) = result {
            return self.shut(
                e.clone(),
                Some((
                    CLOSE_LOCAL_ERROR,
                    format!("reading message {msg} failed: {e}"),
                )),
            );
        }
        let done = match self.recv.get_mut(&msg) {
            Some(InMsg::Rndv(r)) => {
                r.reads_out -= 1;
                r.reads_out == 0 && r.next_offset == r.len
            }
            _ => false,
        };
        if done {
            self.complete(msg);
        }
        self.pump_reads();
    }

    /// Time has reached `now` (drives the probe's bookkeeping and any deadlines).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.is_closed() {
            return;
        }
        if let Some((by, queued)) = self.closing_by
            && now >= by
        {
            let left = self.queued();
            if left >= queued {
                let why = format!(
                    "closing: the peer took none of the {left} messages still queued within {} s (it stopped reading); they are dropped",
                    CLOSE_DRAIN_TIMEOUT.as_secs()
                );
                return self.shut(Error::Timeout(why.clone()), Some((CLOSE_LOCAL_ERROR, why)));
            }
            self.closing_by = Some((now + CLOSE_DRAIN_TIMEOUT, left));
        }
        if let Some(due) = self.ping
            && now >= due + self.cfg.keepalive_timeout
        {
            let why = format!(
                "the peer did not answer a keep-alive ping within {} ms (Config::keepalive_timeout, IBEX_KEEPALIVE_TIMEOUT_MS): it hangs or is unreachable",
                self.cfg.keepalive_timeout.as_millis()
            );
            return self.shut(Error::Timeout(why.clone()), Some((CLOSE_LOCAL_ERROR, why)));
        }
        if let Some(idle) = self.cfg.keepalive
            && self.ping.is_none()
            && self.peer.is_some()
            && now >= self.last_heard + idle
        {
            self.ping = Some(now);
            self.ping_unsent = true;
        }
        let expired = match &mut self.probe {
            Some(p) if !p.abandoned && now >= p.deadline => Some(p.abandon()),
            _ => None,
        };
        if let Some(progress) = expired {
            tracing::info!(
                "probe timed out; what it finished measuring stands, the rest keeps its default"
            );
            self.probe_progress(progress);
        }
    }

    /// Turns keep-alive pings on (`Some(interval)`) or off, with `timeout` for an answer,
    /// on a running connection (a server applying its own settings to accepted ones).
    pub fn set_keepalive(&mut self, now: Instant, interval: Option<Duration>, timeout: Duration) {
        self.cfg.keepalive = interval;
        self.cfg.keepalive_timeout = timeout;
        self.last_heard = now;
        self.ping = None;
        self.ping_unsent = false;
    }

    /// When the core next wants `handle_timeout`.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.is_closed() {
            return None;
        }
        let probe = match &self.probe {
            Some(p) if !p.abandoned => Some(p.deadline),
            _ => None,
        };
        let keepalive = match (self.ping, self.cfg.keepalive) {
            (Some(due), _) => Some(due + self.cfg.keepalive_timeout),
            (None, Some(idle)) if self.peer.is_some() => Some(self.last_heard + idle),
            _ => None,
        };
        let closing = self.closing_by.map(|(by, _)| by);
        [probe, keepalive, closing].into_iter().flatten().min()
    }

    /// Messages not yet taken by the peer: queued to send, or exposed for its reads.
    fn queued(&self) -> usize {
        self.data.len() + self.unreleased.len()
    }

    /// Which protocol a message of `len` bytes would use now; `Err(TooLarge)` if either
    /// side's `max_message_size` forbids it.
    pub fn classify(&self, len: u64) -> Result<Protocol, Error> {
        self.check_size(len)?;
        Ok(if len <= self.eager_threshold() as u64 {
            Protocol::Eager
        } else {
            Protocol::Rendezvous
        })
    }

    /// Queues an eager message (`data.len()` must be within the threshold / slot).
    ///
    /// Anything that fits one of the peer's slots is accepted, so a message classified
    /// eager stays valid if the probe lowers the threshold meanwhile.
    pub fn send_eager(&mut self, now: Instant, data: Bytes) -> Result<MsgId, Error> {
        let _ = now;
        self.check_open()?;
        let len = data.len() as u64;
        self.check_size(len)?;
        let cap = self.eager_cap();
        if data.len() > cap {
            return Err(Error::TooLarge {
                len,
                limit: cap as u64,
                which: "eager capacity of the peer's slot",
            });
        }
        let seq = self.next_send_seq;
        self.next_send_seq += 1;
        self.data.push_back(Out::Eager(data));
        Ok(seq)
    }

    /// Queues the RTS of a rendezvous message whose buffer the driver exposed as `descriptor`.
    pub fn send_rendezvous(
        &mut self,
        now: Instant,
        len: u64,
        descriptor: Bytes,
    ) -> Result<MsgId, Error> {
        self.send_parts(now, Bytes::new(), len, descriptor)
    }

    /// Queues a two-part message: `head` travels in the RTS itself, and the `len` bytes the
    /// driver exposed as `descriptor` follow it by rendezvous. The peer receives one message,
    /// `head` then those bytes, and is given both parts ([`Delivery::Rendezvous`]), so
    /// neither is copied to join them. `head` must fit [`Connection::head_room`].
    pub fn send_parts(
        &mut self,
        now: Instant,
        head: Bytes,
        len: u64,
        descriptor: Bytes,
    ) -> Result<MsgId, Error> {
        let _ = now;
        self.check_open()?;
        self.check_size(len.saturating_add(head.len() as u64))?;
        if descriptor.len() > MAX_DESC_LEN {
            return Err(Error::Config(format!(
                "the provider's rendezvous descriptor is {} bytes; the wire carries at most {MAX_DESC_LEN}",
                descriptor.len()
            )));
        }
        self.check_head(head.len())?;
        let seq = self.next_send_seq;
        self.next_send_seq += 1;
        self.unreleased.insert(seq);
        self.data.push_back(Out::Rts {
            seq,
            len,
            desc: descriptor,
            head,
        });
        Ok(seq)
    }

    /// The longest head a two-part message may carry ([`Connection::send_parts`]): what one
    /// of the peer's slots holds beside an RTS with the longest descriptor, or nothing when
    /// the peer's build does not take heads. Before the peer's `Hello` this side's own slot
    /// stands in, and a queued head the peer cannot take closes the connection then.
    pub fn head_room(&self) -> usize {
        match self.peer {
            Some(p) if p.features & FEATURE_RTS_HEAD == 0 => 0,
            _ => Self::head_room_in(self.peer.map_or(self.cfg.slot_size, |p| p.slot_size)),
        }
    }

    /// The optional features the peer's `Hello` announced; `None` before it came.
    pub fn peer_features(&self) -> Option<u32> {
        self.peer.map(|p| p.features)
    }

    /// Whether a head of `len` bytes fits [`Connection::head_room`].
    pub fn check_head(&self, len: usize) -> Result<(), Error> {
        let room = self.head_room();
        if len > room {
            return Err(Error::TooLarge {
                len: len as u64,
                limit: room as u64,
                which: "head room of an RTS frame (the peer's slot; 0: its build has no two-part messages)",
            });
        }
        Ok(())
    }

    fn head_room_in(slot: usize) -> usize {
        slot.saturating_sub(HEADER_LEN + RTS_FIXED + MAX_DESC_LEN)
    }

    /// The driver's answer to [`Action::BeginRecv`].
    pub fn accept_rendezvous(&mut self, now: Instant, msg: MsgId, mode: RecvMode) {
        let _ = now;
        if self.is_closed() {
            return;
        }
        let Some(InMsg::Rndv(r)) = self.recv.get_mut(&msg) else {
            tracing::debug!(msg, "accept_rendezvous for an unknown message ignored");
            return;
        };
        if r.state != RndvState::Announced {
            tracing::debug!(msg, "accept_rendezvous repeated; ignored");
            return;
        }
        match mode {
            RecvMode::Read if r.len > 0 => {
                r.state = RndvState::Reading;
                self.read_queue.insert(msg);
                self.pump_reads();
            }
            RecvMode::Read => self.complete(msg),
            RecvMode::Mapped => {
                // Nothing to read; the sender's buffer stays held until the view is dropped.
                if !r.probe {
                    self.mapped_unreleased.insert(msg);
                }
                // A view takes no memory of ours: its bytes go back to the budget at once.
                self.uncharge(msg);
                self.complete(msg);
            }
        }
    }

    /// The driver could not prepare a destination for `msg` (allocation failed, bad
    /// descriptor): the connection closes with `error`.
    pub fn reject_rendezvous(&mut self, now: Instant, msg: MsgId, error: Error) {
        let _ = now;
        if self.is_closed() {
            return;
        }
        let reason = format!("could not receive message {msg}: {error}");
        self.shut(error, Some((CLOSE_LOCAL_ERROR, reason)));
    }

    /// The application took delivered message `msg`: its credit may go back.
    pub fn consumed(&mut self, msg: MsgId) {
        if self.is_closed() {
            return;
        }
        self.uncharge(msg);
        match self.unconsumed.remove(&msg) {
            Some(CreditTag::Single) => self.owed += 1,
            Some(CreditTag::Group(first)) => {
                if let Some(left) = self.groups.get_mut(&first) {
                    *left -= 1;
                    if *left == 0 {
                        self.groups.remove(&first);
                        self.owed += 1;
                    }
                }
            }
            None => tracing::debug!(msg, "consumed() for a message not awaiting it; ignored"),
        }
    }

    /// A [`RecvMode::Mapped`] message's view was dropped: tell the sender it may release.
    pub fn release_recv(&mut self, msg: MsgId) {
        if self.is_closed() {
            return;
        }
        if self.mapped_unreleased.remove(&msg) {
            self.control.push_back(Body::RndvDone {
                seq: msg,
                probe: false,
            });
        }
    }

    /// Starts the connect-time probe, using an exposed zero-filled buffer of `len` bytes
    /// ([`Config::probe_buffer_len`]) for its rendezvous and read samples.
    ///
    /// Threshold sizes above `len` are skipped; the fragment phase runs only when
    /// `config.fragment_size` is `None`, the peer announced [`FEATURE_PROBE_READ`], and
    /// `len` and the peer's largest message cover [`FRAGMENT_PROBE_LEN`]. Its time limit
    /// (`config.probe_timeout`) runs from the handshake, or from now if the handshake is
    /// already done. With `config.eager_threshold` set, the probe still measures and logs
    /// its threshold verdict ([`Connection::probe_verdict`]) but the configured threshold
    /// stays in force. It always ends in one [`Action::ProbeDone`] (carrying the settings
    /// in force), after which the driver may withdraw the buffer.
    pub fn start_probe(&mut self, now: Instant, descriptor: Bytes, len: usize) {
        if self.is_closed() {
            return;
        }
        if self.probe.is_some() || self.pending_probe.is_some() {
            tracing::debug!("start_probe while a probe is running; ignored");
            return;
        }
        if self.closing.is_some() {
            return self.probe_done();
        }
        if self.peer.is_some() {
            self.begin_probe(descriptor, len, now);
        } else {
            self.pending_probe = Some((descriptor, len));
        }
    }

    /// Graceful close: no new sends; once queued frames are out and every rendezvous the
    /// peer is reading has been released, a `Close` goes out and [`Action::Closed`] follows.
    ///
    /// Before the handshake nothing could have been sent, so it closes at once.
    pub fn close(&mut self, now: Instant, reason: &str) {
        if self.is_closed() || self.closing.is_some() {
            return;
        }
        if self.peer.is_none() {
            return self.shut(
                Error::LocallyClosed,
                Some((CLOSE_GRACEFUL, reason.to_owned())),
            );
        }
        self.closing = Some(reason.to_owned());
        self.closing_by = Some((now + CLOSE_DRAIN_TIMEOUT, self.queued()));
        if self.pending_probe.take().is_some() {
            self.probe_done();
        }
        if let Some(p) = &mut self.probe {
            let progress = p.abandon();
            self.probe_progress(progress);
        }
    }

    /// The link died: fail everything pending with `error` at once.
    pub fn link_failed(&mut self, error: Error) {
        self.shut(error, None);
    }

    /// The next frame to hand to the link, if any (coalescing happens here).
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Bytes> {
        self.poll_transmit_parts(now).map(Transmit::into_bytes)
    }

    /// [`Connection::poll_transmit`], with a frame of one eager message left in two parts
    /// (its head and the message) for the link to copy in one pass
    /// ([`crate::link::Link::poll_send_parts`]).
    pub fn poll_transmit_parts(&mut self, now: Instant) -> Option<Transmit> {
        if self.is_closed() {
            let f = self.final_frame.take();
            if f.is_some() {
                self.stats.frames_sent += 1;
            }
            return f.map(Transmit::Frame);
        }
        if let Some(body) = self.control.pop_front() {
            return Some(Transmit::Frame(self.emit(body)));
        }
        if let Some(peer) = self.peer {
            if self.ping_unsent && self.take_credit() {
                self.ping_unsent = false;
                self.pings = self.pings.wrapping_add(1);
                let probe_id = KEEPALIVE_PROBE_BIT | (self.pings & !KEEPALIVE_PROBE_BIT);
                return Some(Transmit::Frame(self.emit(Body::ProbeEager {
                    probe_id,
                    pad: Bytes::new(),
                })));
            }
            if let Some(sample) = self.probe.as_ref().and_then(Probe::next_sample) {
                if self.take_credit() {
                    self.probe_issued += 1;
                    if let Some(p) = &mut self.probe {
                        p.sent(now);
                    }
                    return Some(Transmit::Frame(self.emit(match sample {
                        Sample::Eager { probe_id, pad } => Body::ProbeEager { probe_id, pad },
                        Sample::Rts {
                            probe_id,
                            len,
                            desc,
                        } => Body::ProbeRts {
                            probe_id,
                            len,
                            desc,
                        },
                        Sample::Read {
                            probe_id,
                            len,
                            fragment,
                            desc,
                        } => Body::ProbeRead {
                            probe_id,
                            len,
                            fragment,
                            desc,
                        },
                    })));
                }
            } else if !self.data.is_empty() && self.take_credit() {
                let body = self.pack(peer.slot_size);
                return Some(self.emit_data(body));
            }
        }
        if self.credit_due() {
            return Some(Transmit::Frame(self.emit(Body::Credit)));
        }
        if let Some(reason) = &self.closing
            && self.data.is_empty()
            && self.unreleased.is_empty()
            && self.probe.is_none()
        {
            let reason = reason.clone();
            self.shut(Error::LocallyClosed, Some((CLOSE_GRACEFUL, reason)));
            return self.poll_transmit_parts(now);
        }
        None
    }

    /// The next action, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Counters.
    pub fn stats(&self) -> &ProtoStats {
        &self.stats
    }

    /// The eager threshold in force.
    pub fn eager_threshold(&self) -> usize {
        let open = if self.cfg.threshold_by_link() {
            usize::MAX
        } else {
            self.cfg.default_eager_threshold
        };
        let base = self
            .cfg
            .eager_threshold
            .or(self.probe_verdict)
            .unwrap_or(open);
        base.min(self.eager_cap())
    }

    /// What the last completed probe measured, even where `config.eager_threshold` keeps
    /// it from taking effect. `None` before a probe finished (or if it was abandoned).
    pub fn probe_verdict(&self) -> Option<usize> {
        self.probe_verdict
    }

    /// The rendezvous fragment size in force for this side's reads: configured, else the
    /// probe's verdict, else the default.
    /// Never longer than the link's longest single read ([`LinkCaps::max_read`]).
    pub fn fragment_size(&self) -> usize {
        self.cfg
            .fragment_size
            .or(self.fragment_verdict)
            .unwrap_or(self.cfg.default_fragment_size)
            .min(self.link.max_read)
    }

    /// What the link can do (`LinkInfo::caps`): fragments are cut to its longest read, and
    /// [`Connection::link`]'s decisions follow it.
    pub fn set_link(&mut self, caps: LinkCaps) {
        self.link = LinkCaps {
            max_read: caps.max_read.max(1),
            ..caps
        };
    }

    /// The link's capabilities, and the per-message decisions made from them
    /// ([`LinkCaps::staging`], [`LinkCaps::pushes`]).
    pub fn link(&self) -> &LinkCaps {
        &self.link
    }

    /// The fragment size the probe picked; `None` before it finished, if it did not
    /// measure fragments (configured, peer without the feature) or was abandoned first.
    pub fn fragment_verdict(&self) -> Option<usize> {
        self.fragment_verdict
    }

    /// True once [`Action::Closed`] has been emitted.
    pub fn is_closed(&self) -> bool {
        self.close_error.is_some()
    }

    /// True once the peer's `Hello` arrived.
    pub fn is_established(&self) -> bool {
        self.peer.is_some()
    }

    /// True when enough credits are owed to the peer to send them in a frame of their own
    /// (half the window): fewer ride on the next data frame.
    pub fn credit_due(&self) -> bool {
        self.owed > 0 && self.owed >= (self.cfg.credits / 2).max(1)
    }

    /// True if [`Connection::poll_action`] has something.
    pub fn has_actions(&self) -> bool {
        !self.actions.is_empty()
    }

    /// Application messages queued but not yet put into a frame: the driver makes `send`
    /// wait while this is large, so a sender outpacing its credits is held back.
    pub fn queued_data_frames(&self) -> usize {
        self.data.len()
    }

    // ---- send side ----

    /// The largest eager payload: what fits one of the peer's slots (our own slot size
    /// stands in for the peer's until its `Hello`; checked again when it arrives).
    fn eager_cap(&self) -> usize {
        let slot = self.peer.map_or(self.cfg.slot_size, |p| p.slot_size);
        slot.saturating_sub(EAGER_OVERHEAD)
    }

    fn check_size(&self, len: u64) -> Result<(), Error> {
        if len > self.cfg.max_message_size {
            return Err(Error::TooLarge {
                len,
                limit: self.cfg.max_message_size,
                which: "max_message_size of this side",
            });
        }
        if let Some(p) = self.peer
            && len > p.max_message
        {
            return Err(Error::TooLarge {
                len,
                limit: p.max_message,
                which: "max_message_size of the peer",
            });
        }
        Ok(())
    }

    fn check_open(&self) -> Result<(), Error> {
        match (&self.close_error, &self.closing) {
            (Some(e), _) => Err(e.clone()),
            (None, Some(_)) => Err(Error::LocallyClosed),
            (None, None) => Ok(()),
        }
    }

    /// Takes a send credit for a data frame; counts a stall episode if there is none.
    fn take_credit(&mut self) -> bool {
        if self.send_credits == 0 {
            if !self.stalled {
                self.stalled = true;
                self.stats.credit_stalls += 1;
            }
            return false;
        }
        self.stalled = false;
        self.send_credits -= 1;
        self.data_out += 1;
        true
    }

    /// The next data frame from the queue: an RTS alone, or as many consecutive eager
    /// messages as fit one of the peer's slots.
    fn pack(&mut self, slot: usize) -> Body {
        let mut msgs = std::mem::take(&mut self.pack_buf);
        let mut size = HEADER_LEN + 2;
        while let Some(Out::Eager(m)) = self.data.front() {
            let next = size + 4 + m.len();
            if !msgs.is_empty() && (next > slot || msgs.len() == u16::MAX as usize) {
                break;
            }
            size = next;
            if let Some(Out::Eager(m)) = self.data.pop_front() {
                msgs.push(m);
            }
        }
        if msgs.is_empty()
            && let Some(Out::Rts {
                seq,
                len,
                desc,
                head,
            }) = self.data.pop_front()
        {
            self.pack_buf = msgs;
            self.stats.rndv_msgs_sent += 1;
            self.stats.rndv_bytes_sent += len + head.len() as u64;
            self.rts_sent.insert(seq);
            return Body::Rts {
                seq,
                len,
                desc,
                head,
            };
        }
        self.stats.eager_msgs_sent += msgs.len() as u64;
        self.stats.eager_bytes_sent += msgs.iter().map(|m| m.len() as u64).sum::<u64>();
        if msgs.len() >= 2 {
            self.stats.coalesced_msgs += msgs.len() as u64;
        }
        Body::Eager { msgs }
    }

    /// [`Connection::emit`] for a data frame: one eager message stays apart from its head,
    /// so that nothing copies it before the link does.
    fn emit_data(&mut self, body: Body) -> Transmit {
        let mut msgs = match body {
            Body::Eager { msgs } if msgs.len() == 1 => msgs,
            body => return Transmit::Frame(self.emit(body)),
        };
        let Some(msg) = msgs.pop() else {
            return Transmit::Frame(self.emit(Body::Eager { msgs }));
        };
        if msgs.capacity() <= 256 {
            self.pack_buf = msgs;
        }
        let head = Frame::eager_one_head(self.owed, msg.len());
        self.recv_window += self.owed;
        self.owed = 0;
        self.stats.frames_sent += 1;
        Transmit::Eager { head, msg }
    }

    /// Encodes a frame, attaching every credit owed to the peer.
    fn emit(&mut self, body: Body) -> Bytes {
        let frame = Frame {
            credits: self.owed,
            body,
        };
        self.recv_window += self.owed;
        self.owed = 0;
        self.stats.frames_sent += 1;
        let bytes = frame.to_bytes();
        // Kept unless a burst grew it (a frame may pack thousands of tiny messages).
        if let Body::Eager { mut msgs } = frame.body
            && msgs.capacity() <= 256
        {
            msgs.clear();
            self.pack_buf = msgs;
        }
        bytes
    }

    // ---- receive side ----

    fn on_hello(&mut self, now: Instant, slots: u32, peer: Peer) {
        if slots == 0 || peer.slot_size < MIN_PEER_SLOT {
            return self.violation(format!(
                "Hello announces {slots} slots of {} bytes; at least 1 slot of {MIN_PEER_SLOT} bytes is required",
                peer.slot_size
            ));
        }
        self.peer = Some(peer);
        self.send_credits = slots;
        self.refresh_settings();
        // What was queued before the handshake was checked against this side's own slot.
        let (cap, room) = (self.eager_cap(), self.head_room());
        let refused = self.data.iter().find_map(|o| match o {
            Out::Eager(m) if m.len() > cap => Some(format!(
                "an eager message of {} bytes was queued before the handshake, but the peer's slots hold at most {cap}; raise slot_size on the peer",
                m.len()
            )),
            Out::Rts { head, .. } if head.len() > room => Some(format!(
                "a two-part message with a {}-byte head was queued before the handshake, but the peer takes heads of at most {room} bytes (0: its build has no two-part messages); raise slot_size on the peer, or upgrade it",
                head.len()
            )),
            _ => None,
        });
        if let Some(msg) = refused {
            return self.shut(
                Error::Handshake(msg.clone()),
                Some((CLOSE_LOCAL_ERROR, msg)),
            );
        }
        // The time limit counts from here, not from `start_probe`: it bounds the probe, and
        // the provider's set-up before the handshake (registering memory, which takes seconds
        // under emulation) is not the probe's. The handshake has its own limit.
        if let Some((desc, len)) = self.pending_probe.take() {
            self.begin_probe(desc, len, now);
        }
    }

    fn on_eager(&mut self, mut msgs: Vec<Bytes>) {
        if let Some(m) = msgs
            .iter()
            .find(|m| m.len() as u64 > self.cfg.max_message_size)
        {
            return self.violation(format!(
                "eager message of {} bytes exceeds our max_message_size of {} bytes",
                m.len(),
                self.cfg.max_message_size
            ));
        }
        let group = (msgs.len() > 1).then_some(self.next_recv_seq);
        if let Some(first) = group {
            self.groups.insert(first, msgs.len() as u16);
        }
        // Every earlier message delivered (the usual case): these go out as they come,
        // without a stop in the reorder map.
        let in_order = self.next_deliver == self.next_recv_seq;
        let tag = group.map_or(CreditTag::Single, CreditTag::Group);
        let mut taken = msgs.drain(..);
        for m in taken.by_ref() {
            self.stats.eager_msgs_recv += 1;
            self.stats.eager_bytes_recv += m.len() as u64;
            let msg = self.next_recv_seq;
            self.next_recv_seq += 1;
            if in_order {
                self.next_deliver = self.next_recv_seq;
                self.unconsumed.insert(msg, tag);
                self.actions.push_back(Action::Deliver {
                    msg,
                    data: Delivery::Eager(m),
                });
            } else {
                self.recv.insert(msg, InMsg::Eager(m, group));
            }
        }
        drop(taken);
        // Kept for the next frame's decode, as `pack_buf` is for sending.
        if msgs.capacity() <= 256 {
            self.recv_buf = msgs;
        }
        if !in_order {
            self.deliver_ready();
        }
    }

    fn on_rts(&mut self, seq: MsgId, len: u64, desc: Bytes, head: Bytes) {
        if seq != self.next_recv_seq {
            return self.violation(format!(
                "RTS numbered {seq} where message {} was expected",
                self.next_recv_seq
            ));
        }
        let total = len.saturating_add(head.len() as u64);
        if total > self.cfg.max_message_size {
            return self.violation(format!(
                "RTS announces a message of {total} bytes, over our max_message_size of {} bytes",
                self.cfg.max_message_size
            ));
        }
        self.next_recv_seq += 1;
        let frag = self.fragment_size() as u64;
        self.begin_recv(seq, len, desc, head, false, frag);
    }

    fn begin_recv(
        &mut self,
        msg: MsgId,
        len: u64,
        desc: Bytes,
        head: Bytes,
        probe: bool,
        frag: u64,
    ) {
        let r = RndvIn {
            len,
            desc,
            head,
            probe,
            state: RndvState::Deferred,
            next_offset: 0,
            frag,
            reads_out: 0,
        };
        self.recv.insert(msg, InMsg::Rndv(r));
        self.deferred.push_back(msg);
        self.admit();
        if matches!(self.recv.get(&msg), Some(InMsg::Rndv(r)) if r.state == RndvState::Deferred) {
            self.stats.rndv_recv_deferred += 1;
        }
    }

    /// Announces deferred receives, oldest first, while the budget has room. The oldest
    /// goes alone when nothing else is charged, however large, so it never waits forever;
    /// later ones wait behind it, so a large message is not overtaken for ever either.
    fn admit(&mut self) {
        while let Some(&msg) = self.deferred.front() {
            let Some(InMsg::Rndv(r)) = self.recv.get_mut(&msg) else {
                self.deferred.pop_front();
                continue;
            };
            let budget = self.cfg.rndv_recv_budget as u64;
            if self.charged_bytes > 0 && self.charged_bytes.saturating_add(r.len) > budget {
                return;
            }
            self.deferred.pop_front();
            r.state = RndvState::Announced;
            let (len, descriptor, probe) = (r.len, r.desc.clone(), r.probe);
            let head_len = r.head.len();
            self.charged.insert(msg, len);
            self.charged_bytes += len;
            self.actions.push_back(Action::BeginRecv {
                msg,
                len,
                head_len,
                descriptor,
                probe,
            });
        }
    }

    /// Gives `msg`'s bytes back to the receive budget, and lets deferred receives in.
    fn uncharge(&mut self, msg: MsgId) {
        // Only rendezvous messages are charged: an eager one skips the lookup.
        if self.charged.is_empty() {
            return;
        }
        if let Some(len) = self.charged.remove(&msg) {
            self.charged_bytes -= len;
            self.admit();
        }
    }

    /// A probe sample is never longer than the largest eager size (its rendezvous samples
    /// stand beside eager ones) or the fragment sample; anything longer is no probe of ours,
    /// and would only make us allocate.
    fn check_probe_len(&self, len: u64) -> Result<(), String> {
        let limit = self.cfg.slot_size.max(FRAGMENT_PROBE_LEN) as u64;
        if len > limit {
            return Err(format!(
                "probe sample of {len} bytes is longer than any probe sends (at most {limit})"
            ));
        }
        Ok(())
    }

    /// Issues fragment reads, message by message, up to the in-flight limit.
    fn pump_reads(&mut self) {
        while self.reads.len() < self.cfg.max_reads_in_flight {
            let Some(&msg) = self.read_queue.first() else {
                break;
            };
            let Some(InMsg::Rndv(r)) = self.recv.get_mut(&msg) else {
                self.read_queue.remove(&msg);
                continue;
            };
            let offset = r.next_offset;
            let len = r.frag.max(1).min(r.len - offset);
            r.next_offset += len;
            r.reads_out += 1;
            if r.next_offset == r.len {
                self.read_queue.remove(&msg);
            }
            let id = self.next_read_id;
            self.next_read_id += 1;
            self.reads.insert(id, msg);
            self.stats.reads_issued += 1;
            self.actions.push_back(Action::Read {
                id,
                msg,
                descriptor: r.desc.clone(),
                remote_offset: offset,
                local_offset: offset,
                len: len as usize,
            });
        }
    }

    /// All of a rendezvous message is in place.
    fn complete(&mut self, msg: MsgId) {
        let probe = match self.recv.get_mut(&msg) {
            Some(InMsg::Rndv(r)) => {
                r.state = RndvState::Complete;
                r.probe
            }
            _ => return,
        };
        if probe {
            self.recv.remove(&msg);
            self.uncharge(msg);
            self.control.push_back(Body::RndvDone {
                seq: msg & !PROBE_MSG_BIT,
                probe: true,
            });
            self.actions.push_back(Action::Discard { msg });
            return;
        }
        if !self.mapped_unreleased.contains(&msg) {
            self.control.push_back(Body::RndvDone {
                seq: msg,
                probe: false,
            });
        }
        self.deliver_ready();
    }

    /// Delivers every message that is complete and next in order.
    fn deliver_ready(&mut self) {
        loop {
            let ready = match self.recv.get(&self.next_deliver) {
                Some(InMsg::Eager(..)) => true,
                Some(InMsg::Rndv(r)) => r.state == RndvState::Complete,
                None => false,
            };
            if !ready {
                return;
            }
            let msg = self.next_deliver;
            self.next_deliver += 1;
            let (data, tag) = match self.recv.remove(&msg) {
                Some(InMsg::Eager(b, group)) => (
                    Delivery::Eager(b),
                    group.map_or(CreditTag::Single, CreditTag::Group),
                ),
                Some(InMsg::Rndv(r)) => {
                    self.stats.rndv_msgs_recv += 1;
                    self.stats.rndv_bytes_recv += r.len + r.head.len() as u64;
                    let data = Delivery::Rendezvous {
                        len: r.len,
                        head: r.head,
                    };
                    (data, CreditTag::Single)
                }
                None => return,
            };
            self.unconsumed.insert(msg, tag);
            self.actions.push_back(Action::Deliver { msg, data });
        }
    }

    // ---- probe ----

    fn begin_probe(&mut self, desc: Bytes, len: usize, started: Instant) {
        let mut plan = ProbePlan::default_for(self.eager_cap());
        plan.sizes.retain(|&s| s <= len);
        if self.cfg.threshold_by_link() {
            plan.sizes.clear();
        }
        // Fragments are probed only when left open, with a peer that speaks `ProbeRead`
        // (older peers would reject it), and when the sample fits the buffer and the peer.
        let peer = self.peer.map_or((0, 0), |p| (p.features, p.max_message));
        let frag_len = FRAGMENT_PROBE_LEN;
        if self.cfg.probes_fragments() {
            if peer.0 & FEATURE_PROBE_READ == 0 {
                tracing::info!(
                    "peer does not take part in the fragment probe (older build); keeping the default fragment size"
                );
            } else if len < frag_len || peer.1 < frag_len as u64 {
                tracing::info!(
                    len,
                    peer_max_message = peer.1,
                    "fragment probe skipped: its {frag_len}-byte sample does not fit"
                );
            } else {
                plan = plan.with_fragments(frag_len);
            }
        }
        if plan.sizes.is_empty() && plan.fragments.is_empty() {
            tracing::info!(
                len,
                "probe buffer too small for any probe size; keeping the defaults"
            );
            return self.probe_done();
        }
        self.probe = Some(Probe::new(plan, desc, started, self.cfg.probe_timeout));
    }

    fn on_probe_answer(&mut self, now: Instant, probe_id: u32, proto: Protocol) {
        if probe_id >= self.probe_issued {
            return self.violation(format!(
                "probe answer for id {probe_id}, which was never sent"
            ));
        }
        // A late answer to an abandoned probe is legitimate and ignored.
        if let Some(p) = &mut self.probe {
            let progress = p.answered(now, probe_id, proto);
            self.probe_progress(progress);
        }
    }

    fn probe_progress(&mut self, progress: Progress) {
        let Progress::Finished(Verdict {
            threshold,
            fragment,
        }) = progress
        else {
            return;
        };
        self.probe = None;
        if let Some(t) = threshold {
            self.probe_verdict = Some(t);
            if self.cfg.eager_threshold.is_some() {
                tracing::info!(
                    measured = t,
                    "probe verdict reported only: eager_threshold is configured"
                );
            } else {
                tracing::info!(threshold = t, "probe chose the eager threshold");
            }
        }
        if let Some(f) = fragment {
            self.fragment_verdict = Some(f);
            tracing::info!(fragment = f, "probe chose the rendezvous fragment size");
        }
        self.refresh_settings();
        self.probe_done();
    }

    fn probe_done(&mut self) {
        self.actions.push_back(Action::ProbeDone {
            threshold: self.eager_threshold(),
            fragment_size: self.fragment_size(),
        });
    }

    /// Puts the threshold and fragment size in force, and where they came from, in the stats.
    fn refresh_settings(&mut self) {
        let env = self.cfg.env_overrides;
        self.stats.eager_threshold = self.eager_threshold();
        self.stats.threshold_source = if self.cfg.threshold_by_link() {
            "link"
        } else {
            source(
                self.cfg.eager_threshold.is_some(),
                env.eager_threshold,
                self.probe_verdict.is_some(),
            )
        };
        self.stats.fragment_size = self.fragment_size();
        self.stats.fragment_source = source(
            self.cfg.fragment_size.is_some(),
            env.fragment_size,
            self.fragment_verdict.is_some(),
        );
    }

    // ---- closing ----

    fn violation(&mut self, what: String) {
        tracing::warn!(%what, "closing the connection: protocol violation by peer");
        self.shut(Error::Protocol(what.clone()), Some((CLOSE_PROTOCOL, what)));
    }

    /// Ends the connection: queues the final `Close` (if any), `Closed`, then the release
    /// or discard of everything pending, and drops all state.
    fn shut(&mut self, error: Error, close: Option<(u32, String)>) {
        if self.is_closed() {
            return;
        }
        if let Some((code, reason)) = close {
            let reason = truncate_utf8(&reason, MAX_REASON).to_owned();
            let frame = Frame {
                credits: self.owed,
                body: Body::Close { code, reason },
            };
            self.owed = 0;
            self.final_frame = Some(frame.to_bytes());
        }
        self.close_error = Some(error.clone());
        self.actions.push_back(Action::Closed { error });
        // Deferred receives were never announced: the driver holds nothing for them.
        let receiving: Vec<MsgId> = self
            .recv
            .iter()
            .filter_map(|(&msg, m)| {
                matches!(m, InMsg::Rndv(r) if r.state != RndvState::Deferred).then_some(msg)
            })
            .collect();
        for msg in receiving {
            self.actions.push_back(Action::Discard { msg });
        }
        for msg in std::mem::take(&mut self.unreleased) {
            self.actions.push_back(Action::Release { msg });
        }
        if self.probe.take().is_some() || self.pending_probe.take().is_some() {
            self.probe_done();
        }
        self.control.clear();
        self.data.clear();
        self.rts_sent.clear();
        self.recv.clear();
        self.read_queue.clear();
        self.reads.clear();
        self.unconsumed.clear();
        self.groups.clear();
        self.mapped_unreleased.clear();
        self.deferred.clear();
        self.charged.clear();
        self.charged_bytes = 0;
    }
}

/// Where a setting in force came from, for the stats.
fn source(configured: bool, from_env: bool, probed: bool) -> &'static str {
    match (configured, from_env, probed) {
        (true, true, _) => "env",
        (true, false, _) => "config",
        (false, _, true) => "probe",
        (false, _, false) => "default",
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("established", &self.is_established())
            .field("closed", &self.close_error)
            .field("send_credits", &self.send_credits)
            .field("queued", &self.data.len())
            .field("next_send_seq", &self.next_send_seq)
            .field("next_recv_seq", &self.next_recv_seq)
            .field("reads_in_flight", &self.reads.len())
            .finish()
    }
}
