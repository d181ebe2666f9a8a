//! Two protocol cores driven over a deterministic simulated link.
//!
//! The simulator plays both drivers: frames cross the link with a one-way delay (plus a
//! serialisation time on a slow link, during which the sender may not transmit, which is
//! what lets small messages coalesce); each side's "exposed memory" is a map descriptor ->
//! `Bytes`; a `Read` is served by copying from the peer's map after a delay with seeded
//! jitter (so completions reorder); a virtual clock jumps from event to event.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ibex_transport::Config;
use ibex_transport::config::EnvOverrides;
use ibex_transport::error::Error;
use ibex_transport::proto::frame::{Body, Frame};
use ibex_transport::proto::{
    Action, CLOSE_DRAIN_TIMEOUT, Connection, Delivery, EAGER_OVERHEAD, MsgId, PROBE_MSG_BIT,
    Protocol, RecvMode, Transmit,
};
use proptest::prelude::*;

// ---------------------------------------------------------------- simulator

/// xorshift64*: tiny, seeded, good enough to reorder reads and fill payloads.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

/// A payload of `len` bytes whose content depends on `seed` (so mix-ups show).
fn payload(seed: u64, len: usize) -> Bytes {
    let mut rng = Rng::new(seed);
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&rng.next().to_le_bytes());
    }
    v.truncate(len);
    Bytes::from(v)
}

#[derive(Clone)]
struct SimCfg {
    /// One-way latency of the link.
    delay: Duration,
    /// Link bandwidth in bytes per µs; 0 = infinite (no serialisation time).
    link_bw: u64,
    /// Fixed cost of one read.
    read_latency: Duration,
    /// Read bandwidth in bytes per µs; 0 = infinite.
    read_bw: u64,
    /// Random extra per read, up to this (reorders completions).
    read_jitter: Duration,
    /// Reads share one pipe: each waits for the previous one to leave it, then holds it for
    /// `read_op` plus its length at `read_bw` (a NIC serving reads one after the other).
    /// Otherwise every read runs on its own at full bandwidth.
    read_pipe: bool,
    /// Per-read cost inside the pipe (work request handling, a round trip per read).
    read_op: Duration,
    /// Slow reader: the application consumes one message per interval.
    consume_every: Option<Duration>,
    /// Receivers map rendezvous buffers instead of reading them.
    mapped: bool,
    seed: u64,
}

impl Default for SimCfg {
    fn default() -> Self {
        SimCfg {
            delay: Duration::from_micros(5),
            link_bw: 0,
            read_latency: Duration::from_micros(2),
            read_bw: 0,
            read_jitter: Duration::ZERO,
            read_pipe: false,
            read_op: Duration::ZERO,
            consume_every: None,
            mapped: false,
            seed: 1,
        }
    }
}

fn ns_for(len: usize, bw: u64) -> Duration {
    Duration::from_nanos((len as u64 * 1000).checked_div(bw).unwrap_or(0))
}

struct PendingRead {
    at: Instant,
    id: u64,
    msg: MsgId,
    desc: Bytes,
    remote_offset: u64,
    local_offset: u64,
    len: usize,
}

struct Side {
    conn: Connection,
    /// Exposure id -> buffer. The descriptor is the id as 8 little-endian bytes.
    exposed: HashMap<u64, Bytes>,
    next_exposure: u64,
    /// Our rendezvous sends -> their exposure.
    send_exposure: HashMap<MsgId, u64>,
    probe_exposure: Option<u64>,
    /// Destinations of incoming rendezvous messages (read mode) or views (mapped mode).
    dest: HashMap<MsgId, Vec<u8>>,
    mapped: HashMap<MsgId, Bytes>,
    /// Receive memory we gave rendezvous messages and the application has not taken yet
    /// (what `Config::rndv_recv_budget` bounds), and the most of it at any time.
    held: HashMap<MsgId, u64>,
    max_held: u64,
    /// What the peer sent us, in order, still to be delivered.
    expected: VecDeque<(MsgId, Bytes)>,
    delivered: u64,
    to_consume: VecDeque<MsgId>,
    consume_at: Option<Instant>,
    reads: Vec<PendingRead>,
    read_issue_order: Vec<u64>,
    read_done_order: Vec<u64>,
    /// Frames in flight towards the peer: (arrival, frame).
    wire: VecDeque<(Instant, Bytes)>,
    /// The link is serialising until then; no transmit before.
    link_busy_until: Instant,
    /// Our data frames not yet credited back by the peer, and its maximum.
    outstanding: u32,
    max_outstanding: u32,
    /// Frames sent: (kind, eager message count, bytes).
    sent_frames: Vec<(u8, usize, usize)>,
    closed: Option<Error>,
    released: Vec<MsgId>,
    discarded: Vec<MsgId>,
    thresholds: Vec<usize>,
    /// Fragment sizes reported by `ProbeDone`.
    fragments: Vec<usize>,
    /// The read pipe (`SimCfg::read_pipe`) is busy until then.
    pipe_free: Instant,
    /// Actions seen after `Closed` (must only be releases, discards, a threshold).
    after_close: Vec<String>,
    dead: bool,
}

impl Side {
    fn new(cfg: &Config, now: Instant) -> Side {
        Side {
            conn: Connection::new(cfg, now),
            exposed: HashMap::new(),
            next_exposure: 1,
            send_exposure: HashMap::new(),
            probe_exposure: None,
            dest: HashMap::new(),
            mapped: HashMap::new(),
            held: HashMap::new(),
            max_held: 0,
            expected: VecDeque::new(),
            delivered: 0,
            to_consume: VecDeque::new(),
            consume_at: None,
            reads: Vec::new(),
            read_issue_order: Vec::new(),
            read_done_order: Vec::new(),
            wire: VecDeque::new(),
            link_busy_until: now,
            outstanding: 0,
            max_outstanding: 0,
            sent_frames: Vec::new(),
            closed: None,
            released: Vec::new(),
            discarded: Vec::new(),
            thresholds: Vec::new(),
            fragments: Vec::new(),
            pipe_free: now,
            after_close: Vec::new(),
            dead: false,
        }
    }

    fn expose(&mut self, buf: Bytes) -> (u64, Bytes) {
        let id = self.next_exposure;
        self.next_exposure += 1;
        self.exposed.insert(id, buf);
        (id, Bytes::copy_from_slice(&id.to_le_bytes()))
    }

    /// The application takes delivered message `msg`.
    fn consume(&mut self, msg: MsgId) {
        self.conn.consumed(msg);
        self.conn.release_recv(msg);
        self.held.remove(&msg);
    }

    fn coalesced_frames(&self) -> usize {
        self.sent_frames
            .iter()
            .filter(|f| f.0 == 2 && f.1 >= 2)
            .count()
    }

    fn data_frames(&self) -> usize {
        self.sent_frames
            .iter()
            .filter(|f| matches!(f.0, 2 | 3 | 6 | 8))
            .count()
    }
}

fn desc_id(desc: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(desc.try_into().ok()?))
}

struct Sim {
    now: Instant,
    start: Instant,
    sides: [Side; 2],
    credits: [u32; 2],
    cfg: SimCfg,
    rng: Rng,
    /// Frames each side left in two parts (one eager message and its head).
    two_part: [usize; 2],
}

impl Sim {
    fn new(a: &Config, b: &Config, cfg: SimCfg) -> Sim {
        let now = Instant::now();
        Sim {
            now,
            start: now,
            sides: [Side::new(a, now), Side::new(b, now)],
            credits: [a.credits, b.credits],
            rng: Rng::new(cfg.seed),
            cfg,
            two_part: [0; 2],
        }
    }

    /// A pair with the handshake done.
    fn pair(a: &Config, b: &Config, cfg: SimCfg) -> Sim {
        let mut s = Sim::new(a, b, cfg);
        s.run();
        assert!(s.sides[0].conn.is_established() && s.sides[1].conn.is_established());
        s
    }

    /// A pair with the handshake done, for configurations that never settle (keep-alive).
    fn pair_for(a: &Config, b: &Config, cfg: SimCfg) -> Sim {
        let mut s = Sim::new(a, b, cfg);
        s.run_for(Duration::from_millis(10));
        assert!(s.sides[0].conn.is_established() && s.sides[1].conn.is_established());
        s
    }

    fn elapsed(&self) -> Duration {
        self.now - self.start
    }

    /// Sends `data` from side `i` the way a driver would: classify, then eager or
    /// expose + RTS. The peer will expect it.
    fn send(&mut self, i: usize, data: Bytes) -> (MsgId, Protocol) {
        let now = self.now;
        let proto = self.sides[i]
            .conn
            .classify(data.len() as u64)
            .expect("classify");
        let side = &mut self.sides[i];
        let msg = match proto {
            Protocol::Eager => side.conn.send_eager(now, data.clone()).expect("send_eager"),
            Protocol::Rendezvous => {
                let (id, desc) = side.expose(data.clone());
                let msg = side
                    .conn
                    .send_rendezvous(now, data.len() as u64, desc)
                    .expect("send_rendezvous");
                side.send_exposure.insert(msg, id);
                msg
            }
        };
        self.sides[1 - i].expected.push_back((msg, data));
        (msg, proto)
    }

    /// Sends a two-part message from side `i`: `head` in its RTS, `body` exposed. The peer
    /// will expect `head` followed by `body`.
    fn send_parts(&mut self, i: usize, head: Bytes, body: Bytes) -> MsgId {
        let now = self.now;
        let side = &mut self.sides[i];
        let (id, desc) = side.expose(body.clone());
        let msg = side
            .conn
            .send_parts(now, head.clone(), body.len() as u64, desc)
            .expect("send_parts");
        side.send_exposure.insert(msg, id);
        let whole = Bytes::from([&head[..], &body[..]].concat());
        self.sides[1 - i].expected.push_back((msg, whole));
        msg
    }

    fn start_probe(&mut self, i: usize, len: usize) {
        let now = self.now;
        let side = &mut self.sides[i];
        let (id, desc) = side.expose(Bytes::from(vec![0u8; len]));
        side.probe_exposure = Some(id);
        side.conn.start_probe(now, desc, len);
    }

    /// Runs until nothing more can happen.
    fn run(&mut self) {
        for _ in 0..10_000_000 {
            self.pump();
            let Some(next) = self.next_event() else {
                return;
            };
            self.now = self.now.max(next);
            self.fire();
        }
        panic!("simulation did not settle");
    }

    /// Runs until `d` from now, or until nothing more can happen (keep-alive pings never
    /// let a pair settle on its own).
    fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        loop {
            self.pump();
            match self.next_event() {
                Some(next) if next <= end => {
                    self.now = self.now.max(next);
                    self.fire();
                }
                _ => {
                    self.now = end;
                    return;
                }
            }
        }
    }

    /// Drains transmits and actions on both sides until neither has anything.
    fn pump(&mut self) {
        loop {
            let mut progress = false;
            for i in 0..2 {
                if self.sides[i].dead {
                    continue;
                }
                while self.sides[i].link_busy_until <= self.now {
                    let Some(t) = self.sides[i].conn.poll_transmit_parts(self.now) else {
                        break;
                    };
                    // A frame left in two parts is an eager frame of exactly that message.
                    let one = match &t {
                        Transmit::Eager { msg, .. } => Some(msg.clone()),
                        Transmit::Frame(_) => None,
                    };
                    let frame = t.into_bytes();
                    if let Some(msg) = one {
                        self.two_part[i] += 1;
                        match Frame::decode(&frame).map(|f| f.body) {
                            Ok(Body::Eager { msgs }) => assert_eq!(msgs, vec![msg]),
                            other => panic!("a two-part frame decodes as {other:?}"),
                        }
                    }
                    self.transmit(i, frame);
                    progress = true;
                }
                while let Some(a) = self.sides[i].conn.poll_action() {
                    self.act(i, a);
                    progress = true;
                }
            }
            if !progress {
                return;
            }
        }
    }

    fn transmit(&mut self, i: usize, frame: Bytes) {
        let f = Frame::decode(&frame).expect("the core sent an undecodable frame");
        let peer_credits = self.credits[1 - i];
        let (me, peer) = self.sides_mut(i);
        assert!(
            frame.len() <= 65536 || f.body.kind() == 9,
            "frame larger than any slot in these tests"
        );
        if f.body.is_data() {
            me.outstanding += 1;
            me.max_outstanding = me.max_outstanding.max(me.outstanding);
            assert!(
                me.outstanding <= peer_credits,
                "more data frames outstanding than the peer has slots"
            );
        }
        peer.outstanding = peer
            .outstanding
            .checked_sub(f.credits)
            .expect("credits returned that were never taken");
        let count = if let Body::Eager { msgs } = &f.body {
            msgs.len()
        } else {
            0
        };
        me.sent_frames.push((f.body.kind(), count, frame.len()));
        let serialise = ns_for(frame.len(), self.cfg.link_bw);
        let me = &mut self.sides[i];
        me.link_busy_until = self.now + serialise;
        let arrival = me.link_busy_until + self.cfg.delay;
        let arrival = me.wire.back().map_or(arrival, |b| b.0.max(arrival));
        me.wire.push_back((arrival, frame));
    }

    fn sides_mut(&mut self, i: usize) -> (&mut Side, &mut Side) {
        let (a, b) = self.sides.split_at_mut(1);
        if i == 0 {
            (&mut a[0], &mut b[0])
        } else {
            (&mut b[0], &mut a[0])
        }
    }

    fn act(&mut self, i: usize, a: Action) {
        let now = self.now;
        let mapped_mode = self.cfg.mapped;
        let jitter = self.rng.below(self.cfg.read_jitter.as_nanos() as u64);
        let (read_latency, read_bw, consume_every) = (
            self.cfg.read_latency,
            self.cfg.read_bw,
            self.cfg.consume_every,
        );
        let (read_pipe, read_op) = (self.cfg.read_pipe, self.cfg.read_op);
        let (me, peer) = self.sides_mut(i);
        if me.closed.is_some() {
            me.after_close
                .push(format!("{a:?}").chars().take(40).collect());
        }
        match a {
            Action::BeginRecv {
                msg,
                len,
                head_len,
                descriptor,
                probe,
            } => {
                assert_eq!(probe, msg & PROBE_MSG_BIT != 0);
                assert!(!probe || head_len == 0, "a probe sample has no head");
                if mapped_mode {
                    let id = desc_id(&descriptor).expect("descriptor");
                    let view = peer
                        .exposed
                        .get(&id)
                        .expect("mapped exposure")
                        .slice(..len as usize);
                    me.mapped.insert(msg, view);
                    me.conn.accept_rendezvous(now, msg, RecvMode::Mapped);
                } else {
                    me.dest.insert(msg, vec![0u8; len as usize]);
                    me.held.insert(msg, len);
                    me.max_held = me.max_held.max(me.held.values().sum());
                    me.conn.accept_rendezvous(now, msg, RecvMode::Read);
                }
            }
            Action::Read {
                id,
                msg,
                descriptor,
                remote_offset,
                local_offset,
                len,
            } => {
                assert!(
                    me.dest.contains_key(&msg),
                    "read for a message without destination"
                );
                let at = if read_pipe {
                    let done =
                        (now + read_latency).max(me.pipe_free) + read_op + ns_for(len, read_bw);
                    me.pipe_free = done;
                    done
                } else {
                    now + read_latency + ns_for(len, read_bw) + Duration::from_nanos(jitter)
                };
                me.read_issue_order.push(id);
                me.reads.push(PendingRead {
                    at,
                    id,
                    msg,
                    desc: descriptor,
                    remote_offset,
                    local_offset,
                    len,
                });
            }
            Action::Deliver { msg, data } => {
                let (want_msg, want) = me.expected.pop_front().expect("delivery nobody sent");
                assert_eq!(msg, want_msg, "delivered out of order");
                let got = match data {
                    Delivery::Eager(b) => b,
                    Delivery::Rendezvous { len, head } => {
                        let got = match me.mapped.remove(&msg) {
                            Some(v) => v,
                            None => Bytes::from(me.dest.remove(&msg).expect("destination")),
                        };
                        assert_eq!(got.len() as u64, len);
                        if head.is_empty() {
                            got
                        } else {
                            Bytes::from([&head[..], &got[..]].concat())
                        }
                    }
                };
                assert!(
                    got == want,
                    "message {msg} corrupted ({} bytes)",
                    want.len()
                );
                me.delivered += 1;
                match consume_every {
                    None => me.consume(msg),
                    Some(d) => {
                        me.to_consume.push_back(msg);
                        me.consume_at.get_or_insert(now + d);
                    }
                }
            }
            Action::Release { msg } => {
                let id = me
                    .send_exposure
                    .remove(&msg)
                    .expect("release of an unknown send");
                me.exposed.remove(&id);
                me.released.push(msg);
            }
            Action::Discard { msg } => {
                me.held.remove(&msg);
                me.dest.remove(&msg);
                me.mapped.remove(&msg);
                me.discarded.push(msg);
            }
            Action::ProbeDone {
                threshold,
                fragment_size,
            } => {
                if let Some(id) = me.probe_exposure.take() {
                    me.exposed.remove(&id);
                }
                me.thresholds.push(threshold);
                me.fragments.push(fragment_size);
            }
            Action::Closed { error } => {
                assert!(me.closed.is_none(), "Closed twice");
                assert!(me.conn.is_closed());
                me.closed = Some(error);
            }
        }
    }

    fn next_event(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        let mut consider = |x: Option<Instant>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        for s in &self.sides {
            consider(s.wire.front().map(|w| w.0));
            consider(s.reads.iter().map(|r| r.at).min());
            consider(s.consume_at);
            if !s.dead {
                consider(s.conn.poll_timeout());
                // A busy link that held back frames: wake when it frees up.
                if s.link_busy_until > self.now {
                    consider(Some(s.link_busy_until));
                }
            }
        }
        t
    }

    /// Everything due at `now`.
    fn fire(&mut self) {
        let now = self.now;
        for i in 0..2 {
            while self.sides[i].wire.front().is_some_and(|w| w.0 <= now) {
                let (_, frame) = self.sides[i].wire.pop_front().expect("front");
                let peer = &mut self.sides[1 - i];
                if !peer.dead {
                    peer.conn.handle_frame(now, frame);
                }
            }
        }
        for i in 0..2 {
            let due: Vec<PendingRead> = {
                let s = &mut self.sides[i];
                let (due, keep) = std::mem::take(&mut s.reads)
                    .into_iter()
                    .partition(|r| r.at <= now);
                s.reads = keep;
                due
            };
            let mut due = due;
            due.sort_by_key(|r| (r.at, r.id));
            for r in due {
                let (me, peer) = self.sides_mut(i);
                let src = desc_id(&r.desc)
                    .and_then(|id| peer.exposed.get(&id))
                    .cloned();
                let result = match src {
                    Some(src) if r.remote_offset as usize + r.len <= src.len() => {
                        let start = r.remote_offset as usize;
                        if let Some(dst) = me.dest.get_mut(&r.msg) {
                            let lo = r.local_offset as usize;
                            dst[lo..lo + r.len].copy_from_slice(&src[start..start + r.len]);
                        }
                        Ok(())
                    }
                    _ => Err(Error::PeerGone("the exposed region is gone".into())),
                };
                me.read_done_order.push(r.id);
                if !me.dead {
                    me.conn.read_completed(now, r.id, result);
                }
            }
        }
        for s in &mut self.sides {
            if s.consume_at.is_some_and(|t| t <= now) {
                if let Some(msg) = s.to_consume.pop_front() {
                    s.consume(msg);
                }
                s.consume_at = (!s.to_consume.is_empty())
                    .then(|| now + self.cfg.consume_every.unwrap_or_default());
            }
            if !s.dead && s.conn.poll_timeout().is_some_and(|t| t <= now) {
                s.conn.handle_timeout(now);
            }
        }
    }

    /// Every message sent was delivered; nothing is left anywhere.
    fn assert_all_delivered(&self) {
        for (i, s) in self.sides.iter().enumerate() {
            assert!(
                s.expected.is_empty(),
                "side {i}: {} messages never delivered",
                s.expected.len()
            );
            assert!(s.closed.is_none(), "side {i} closed: {:?}", s.closed);
            assert!(
                s.send_exposure.is_empty(),
                "side {i}: rendezvous sends never released"
            );
            assert!(
                s.dest.is_empty() && s.mapped.is_empty(),
                "side {i}: receive buffers left over"
            );
        }
    }
}

fn config() -> Config {
    Config {
        probe: false,
        ..Config::default()
    }
}

// ---------------------------------------------------------------- sizes

#[test]
fn boundary_sizes_arrive_intact_by_the_right_protocol() {
    let c = config();
    let t = c.default_eager_threshold;
    let mut sim = Sim::pair(&c, &c, SimCfg::default());
    assert_eq!(sim.sides[0].conn.eager_threshold(), t);
    let cases = [
        (0, Protocol::Eager),
        (1, Protocol::Eager),
        (t - 1, Protocol::Eager),
        (t, Protocol::Eager),
        (t + 1, Protocol::Rendezvous),
    ];
    for (n, (len, proto)) in cases.into_iter().enumerate() {
        let (_, got) = sim.send(0, payload(n as u64, len));
        assert_eq!(got, proto, "{len} bytes");
        sim.run();
    }
    sim.assert_all_delivered();
    // Each eager message went alone in its frame, so each left the core in two parts.
    assert_eq!(sim.two_part[0], 4);
    let st = sim.sides[0].conn.stats().clone();
    assert_eq!((st.eager_msgs_sent, st.rndv_msgs_sent), (4, 1));
    assert_eq!(st.eager_bytes_sent, (1 + t - 1 + t) as u64);
    assert_eq!(st.threshold_source, "default");
    let rs = sim.sides[1].conn.stats();
    assert_eq!(
        (rs.eager_msgs_recv, rs.rndv_msgs_recv, rs.rndv_bytes_recv),
        (4, 1, t as u64 + 1)
    );
}

#[test]
fn a_zero_length_rendezvous_completes_without_reads() {
    let c = config();
    let mut sim = Sim::pair(&c, &c, SimCfg::default());
    let now = sim.now;
    let (id, desc) = sim.sides[0].expose(Bytes::new());
    let msg = sim.sides[0]
        .conn
        .send_rendezvous(now, 0, desc)
        .expect("rts");
    sim.sides[0].send_exposure.insert(msg, id);
    sim.sides[1].expected.push_back((msg, Bytes::new()));
    sim.run();
    sim.assert_all_delivered();
    assert_eq!(sim.sides[1].conn.stats().reads_issued, 0);
    assert_eq!(sim.sides[0].released, vec![msg]);
}

#[test]
fn the_slot_exact_eager_maximum_fills_one_slot() {
    let mut c = config();
    let max = c.max_eager();
    assert_eq!(max, c.slot_size - EAGER_OVERHEAD);
    c.eager_threshold = Some(max);
    let mut sim = Sim::pair(&c, &c, SimCfg::default());
    assert_eq!(sim.sides[0].conn.stats().threshold_source, "config");
    assert_eq!(sim.send(0, payload(7, max)).1, Protocol::Eager);
    assert_eq!(sim.send(0, payload(8, max + 1)).1, Protocol::Rendezvous);
    sim.run();
    sim.assert_all_delivered();
    assert!(
        sim.sides[0]
            .sent_frames
            .iter()
            .any(|f| f.0 == 2 && f.2 == c.slot_size),
        "no frame filled the slot exactly"
    );
    // Anything larger cannot go eager at all.
    let now = sim.now;
    assert!(matches!(
        sim.sides[0].conn.send_eager(now, payload(9, max + 1)),
        Err(Error::TooLarge { .. })
    ));
}

#[test]
fn a_256_mib_message_arrives_intact() {
    let c = Config {
        max_reads_in_flight: 4,
        ..config()
    };
    let mut sim = Sim::pair(
        &c,
        &c,
        SimCfg {
            read_jitter: Duration::from_micros(30),
            seed: 99,
            ..SimCfg::default()
        },
    );
    let len = 256 << 20;
    assert_eq!(sim.send(0, payload(256, len)).1, Protocol::Rendezvous);
    sim.run();
    sim.assert_all_delivered();
    let rs = sim.sides[1].conn.stats();
    assert_eq!(rs.reads_issued, (len / c.default_fragment_size) as u64);
    assert_eq!(rs.rndv_bytes_recv, len as u64);
}

#[test]
fn message_size_limits_are_enforced_on_both_sides() {
    let a = Config {
        max_message_size: 1 << 20,
        ..config()
    };
    let b = Config {
        max_message_size: 1 << 16,
        ..config()
    };
    let sim = Sim::pair(&a, &b, SimCfg::default());
    let conn = &sim.sides[0].conn;
    assert!(matches!(
        conn.classify(2 << 20),
        Err(Error::TooLarge {
            which: "max_message_size of this side",
            ..
        })
    ));
    assert!(matches!(
        conn.classify(1 << 17),
        Err(Error::TooLarge {
            which: "max_message_size of the peer",
            limit: 65536,
            ..
        })
    ));
    assert_eq!(conn.classify(1 << 16).ok(), Some(Protocol::Rendezvous));
}

// ---------------------------------------------------------------- reads

#[test]
fn reordered_read_completions_still_deliver_in_order() {
    let c = Config {
        fragment_size: Some(4096),
        max_reads_in_flight: 8,
        ..config()
    };
    let cfg = SimCfg {
        read_jitter: Duration::from_micros(200),
        seed: 42,
        ..SimCfg::default()
    };
    let mut sim = Sim::pair(&c, &c, cfg);
    for n in 0..20u64 {
        sim.send(0, payload(n, 20_000 + n as usize * 3_001));
        sim.send(0, payload(100 + n, 10));
    }
    sim.run();
    sim.assert_all_delivered();
    let s = &sim.sides[1];
    assert_eq!(s.read_issue_order.len(), s.read_done_order.len());
    let inversions = s.read_done_order.windows(2).filter(|w| w[0] > w[1]).count();
    assert!(
        inversions > 10,
        "reads did not complete out of order ({inversions} inversions)"
    );
    assert!(s.read_issue_order.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn reads_in_flight_never_exceed_the_limit() {
    let c = Config {
        fragment_size: Some(4096),
        max_reads_in_flight: 3,
        ..config()
    };
    let mut sim = Sim::pair(
        &c,
        &c,
        SimCfg {
            read_jitter: Duration::from_micros(50),
            ..SimCfg::default()
        },
    );
    for n in 0..5 {
        sim.send(0, payload(n, 100_000));
    }
    for _ in 0..100_000 {
        sim.pump();
        assert!(
            sim.sides[1].reads.len() <= 3,
            "{} reads in flight",
            sim.sides[1].reads.len()
        );
        let Some(t) = sim.next_event() else { break };
        sim.now = sim.now.max(t);
        sim.fire();
    }
    sim.assert_all_delivered();
}

#[test]
fn mapped_rendezvous_needs_no_reads_and_releases_on_view_drop() {
    let c = config();
    let mut sim = Sim::pair(
        &c,
        &c,
        SimCfg {
            mapped: true,
            ..SimCfg::default()
        },
    );
    let (msg, proto) = sim.send(0, payload(5, 1 << 20));
    assert_eq!(proto, Protocol::Rendezvous);
    sim.send(0, payload(6, 100));
    sim.run();
    sim.assert_all_delivered();
    assert_eq!(sim.sides[1].conn.stats().reads_issued, 0);
    assert_eq!(sim.sides[0].released, vec![msg]);
}

#[test]
fn mapped_sender_buffer_stays_held_until_the_view_is_dropped() {
    let c = config();
    let cfg = SimCfg {
        mapped: true,
        consume_every: Some(Duration::from_millis(1)),
        ..SimCfg::default()
    };
    let mut sim = Sim::pair(&c, &c, cfg);
    let (msg, _) = sim.send(0, payload(5, 1 << 20));
    // Run until delivered but not yet consumed (the reader holds the view for 1 ms).
    while sim.sides[1].delivered == 0 {
        sim.pump();
        let t = sim.next_event().expect("event");
        sim.now = sim.now.max(t);
        sim.fire();
    }
    sim.pump();
    assert!(
        sim.sides[0].released.is_empty(),
        "released while the receiver still maps it"
    );
    sim.run();
    assert_eq!(sim.sides[0].released, vec![msg]);
    sim.assert_all_delivered();
}

// ---------------------------------------------------------------- credits

#[test]
fn a_slow_reader_stalls_the_sender_without_losing_anything() {
    let a = config();
    let b = Config {
        credits: 4,
        slot_size: 4096,
        ..config()
    };
    let every = Duration::from_micros(500);
    let mut sim = Sim::pair(
        &a,
        &b,
        SimCfg {
            consume_every: Some(every),
            ..SimCfg::default()
        },
    );
    let max = b.slot_size - EAGER_OVERHEAD;
    assert_eq!(
        sim.sides[0].conn.eager_threshold(),
        max,
        "threshold clamps to the peer's slot"
    );
    for n in 0..100 {
        assert_eq!(sim.send(0, payload(n, max - n as usize)).1, Protocol::Eager);
    }
    sim.run();
    sim.assert_all_delivered();
    let s = &sim.sides[0];
    assert_eq!(s.max_outstanding, 4, "the window was not used, or overrun");
    assert!(s.conn.stats().credit_stalls >= 1);
    assert!(
        s.data_frames() >= 100,
        "messages this large cannot share a frame"
    );
    // Backpressure: the sender cannot run ahead of a reader taking one message per 500 µs.
    assert!(
        sim.elapsed() >= every * 99,
        "finished in {:?}",
        sim.elapsed()
    );
}

#[test]
fn a_graceful_close_gives_up_on_a_peer_that_stopped_reading() {
    let a = config();
    let b = Config {
        credits: 4,
        slot_size: 4096,
        ..config()
    };
    // The peer takes one message an hour: after its window, nothing more goes out.
    let mut sim = Sim::pair(
        &a,
        &b,
        SimCfg {
            consume_every: Some(Duration::from_secs(3600)),
            ..SimCfg::default()
        },
    );
    for n in 0..20 {
        sim.send(0, payload(n, 3000));
    }
    sim.run_for(Duration::from_millis(10));
    let now = sim.now;
    sim.sides[0].conn.close(now, "done");
    sim.run_for(CLOSE_DRAIN_TIMEOUT / 2);
    assert!(sim.sides[0].closed.is_none(), "gave up before the deadline");
    sim.run_for(CLOSE_DRAIN_TIMEOUT);
    match &sim.sides[0].closed {
        Some(Error::Timeout(why)) => assert!(why.contains("stopped reading"), "{why}"),
        other => panic!("the close still waits on a peer that stopped reading: {other:?}"),
    }
}

#[test]
fn credits_come_back_in_credit_frames_when_nothing_else_flows() {
    // Eager only: a rendezvous would carry its credit back on the RndvDone.
    let a = Config {
        eager_threshold: Some(config().max_eager()),
        ..config()
    };
    let b = Config {
        credits: 8,
        ..config()
    };
    let mut sim = Sim::pair(&a, &b, SimCfg::default());
    for n in 0..40 {
        sim.send(0, payload(n, 40_000));
        sim.run();
    }
    sim.assert_all_delivered();
    let credit_frames = sim.sides[1].sent_frames.iter().filter(|f| f.0 == 5).count();
    assert!(
        credit_frames >= 40 / 4 - 1,
        "only {credit_frames} Credit frames"
    );
    assert!(sim.sides[0].max_outstanding <= 8);
}

#[test]
fn five_thousand_mixed_messages_arrive_in_order() {
    let c = Config {
        credits: 16,
        fragment_size: Some(64 * 1024),
        ..config()
    };
    let cfg = SimCfg {
        read_jitter: Duration::from_micros(40),
        link_bw: 5_000,
        seed: 5,
        ..SimCfg::default()
    };
    let mut sim = Sim::pair(&c, &c, cfg);
    let mut rng = Rng::new(77);
    for n in 0..5_000u64 {
        let len = match rng.below(100) {
            0..70 => rng.below(2048),
            70..95 => 2048 + rng.below(62 * 1024),
            _ => 64 * 1024 + rng.below(448 * 1024),
        } as usize;
        let from = (n % 5 == 0) as usize; // some traffic the other way too
        sim.send(from, payload(n, len));
    }
    sim.run();
    sim.assert_all_delivered();
    assert_eq!(sim.sides[1].delivered + sim.sides[0].delivered, 5_000);
    for s in &sim.sides {
        assert!(s.max_outstanding <= 16);
    }
}

#[test]
fn small_messages_coalesce_when_the_link_is_slow() {
    let c = config();
    // 10 bytes/µs: a 1 KiB frame keeps the link busy for ~100 µs.
    let mut sim = Sim::pair(
        &c,
        &c,
        SimCfg {
            link_bw: 10,
            ..SimCfg::default()
        },
    );
    for n in 0..200 {
        sim.send(0, payload(n, 100));
        // The application produces one message every 2 µs.
        let until = sim.now + Duration::from_micros(2);
        while sim.next_event().is_some_and(|t| t <= until) {
            sim.pump();
            let t = sim.next_event().expect("event");
            sim.now = sim.now.max(t);
            sim.fire();
        }
        sim.now = until;
        sim.pump();
    }
    sim.run();
    sim.assert_all_delivered();
    let s = &sim.sides[0];
    assert!(
        s.conn.stats().coalesced_msgs > 100,
        "coalesced only {}",
        s.conn.stats().coalesced_msgs
    );
    assert!(s.coalesced_frames() >= 2);
    assert!(
        s.data_frames() < 50,
        "{} data frames for 200 small messages",
        s.data_frames()
    );
}

#[test]
fn messages_do_not_coalesce_on_an_idle_fast_link() {
    let c = config();
    let mut sim = Sim::pair(&c, &c, SimCfg::default());
    for n in 0..50 {
        sim.send(0, payload(n, 100));
        sim.run();
    }
    sim.assert_all_delivered();
    assert_eq!(sim.sides[0].conn.stats().coalesced_msgs, 0);
}

#[test]
fn rendezvous_ends_a_coalesced_pack_and_order_is_kept() {
    let c = config();
    let mut sim = Sim::new(&c, &c, SimCfg::default());
    // Queued before the handshake completes, so they all wait together.
    for n in 0..10 {
        sim.send(0, payload(n, 50));
    }
    sim.send(0, payload(10, 100_000));
    for n in 11..20 {
        sim.send(0, payload(n, 50));
    }
    sim.run();
    sim.assert_all_delivered();
    let kinds: Vec<(u8, usize)> = sim.sides[0]
        .sent_frames
        .iter()
        .filter(|f| f.0 != 1)
        .map(|f| (f.0, f.1))
        .collect();
    assert_eq!(kinds, vec![(2, 10), (3, 0), (2, 9)]);
}

// ---------------------------------------------------------------- probe

/// Runs the probe from side 0 and returns the threshold it chose.
fn probe_with(cfg: SimCfg) -> (usize, Sim) {
    let c = config();
    let mut sim = Sim::pair(&c, &c, cfg);
    let len = c.max_eager();
    sim.start_probe(0, len);
    sim.run();
    assert_eq!(sim.sides[0].thresholds.len(), 1, "exactly one ProbeDone");
    assert!(sim.sides[0].probe_exposure.is_none());
    (sim.sides[0].thresholds[0], sim)
}

#[test]
fn slow_reads_make_the_probe_pick_a_high_threshold() {
    let (t, sim) = probe_with(SimCfg {
        link_bw: 1_000,
        read_latency: Duration::from_micros(200),
        read_bw: 100,
        ..SimCfg::default()
    });
    assert_eq!(t, config().max_eager());
    let s = sim.sides[0].conn.stats();
    assert_eq!((s.threshold_source, s.eager_threshold), ("probe", t));
    assert_eq!(sim.sides[0].conn.eager_threshold(), t);
    // Probes are invisible to the application on the other side.
    assert_eq!(sim.sides[1].delivered, 0);
    assert_eq!(
        sim.sides[1].discarded.len(),
        4 * 4,
        "one discard per rendezvous sample"
    );
}

#[test]
fn fast_reads_make_the_probe_pick_a_low_threshold() {
    let (t, _) = probe_with(SimCfg {
        link_bw: 100,
        read_latency: Duration::from_micros(1),
        read_bw: 0,
        ..SimCfg::default()
    });
    assert_eq!(t, 1024);
}

#[test]
fn the_probe_finds_a_crossover_in_the_middle() {
    // Eager costs 1 µs/KB on the link; a read costs 10 µs + 0.25 µs/KB: they cross between 4 and 16 KiB.
    let (t, _) = probe_with(SimCfg {
        link_bw: 1_000,
        read_latency: Duration::from_micros(10),
        read_bw: 4_000,
        ..SimCfg::default()
    });
    assert_eq!(t, 4096);
}

#[test]
fn probes_do_not_disturb_message_numbering_or_traffic() {
    let c = config();
    let mut sim = Sim::pair(
        &c,
        &c,
        SimCfg {
            read_jitter: Duration::from_micros(3),
            ..SimCfg::default()
        },
    );
    sim.start_probe(0, c.max_eager());
    sim.start_probe(1, c.max_eager());
    for n in 0..30 {
        sim.send(n % 2, payload(n as u64, (n * 7919) % 100_000));
    }
    sim.run();
    sim.assert_all_delivered();
    assert_eq!(sim.sides[0].thresholds.len(), 1);
    assert_eq!(sim.sides[1].thresholds.len(), 1);
}

#[test]
fn a_link_whose_reads_are_copies_sends_eagerly_up_to_the_slot_without_probing() {
    // What `Connection::establish` makes of a link without DMA reads (shm, tcp).
    let c = Config {
        probe: true,
        probe_threshold: false,
        probe_fragments: false,
        ..config()
    };
    assert!(!c.wants_probe(), "nothing is left to probe");
    // Reads this fast would have made a probe pick the smallest size.
    let mut sim = Sim::pair(
        &c,
        &c,
        SimCfg {
            link_bw: 100,
            read_latency: Duration::from_micros(1),
            read_bw: 0,
            ..SimCfg::default()
        },
    );
    assert_eq!(sim.send(0, payload(1, c.max_eager())).1, Protocol::Eager);
    assert_eq!(
        sim.send(0, payload(2, c.max_eager() + 1)).1,
        Protocol::Rendezvous
    );
    sim.run();
    sim.assert_all_delivered();
    let s = sim.sides[0].conn.stats();
    assert_eq!(
        (s.threshold_source, s.eager_threshold),
        ("link", c.max_eager())
    );
    assert_eq!((s.eager_msgs_sent, s.rndv_msgs_sent), (1, 1));
    // A configured threshold still wins over the link's.
    let fixed = Config {
        eager_threshold: Some(2000),
        ..c.clone()
    };
    let sim = Sim::pair(&fixed, &fixed, SimCfg::default());
    let s = sim.sides[0].conn.stats();
    assert_eq!((s.threshold_source, s.eager_threshold), ("config", 2000));
}

#[test]
fn a_configured_threshold_is_not_overridden_by_the_probe() {
    let c = Config {
        eager_threshold: Some(2000),
        ..config()
    };
    let mut sim = Sim::pair(
        &c,
        &c,
        SimCfg {
            link_bw: 100,
            read_latency: Duration::from_micros(200),
            read_bw: 10,
            ..SimCfg::default()
        },
    );
    sim.start_probe(0, c.max_eager());
    sim.run();
    let conn = &sim.sides[0].conn;
    assert_eq!(sim.sides[0].thresholds, vec![2000]);
    assert_eq!(conn.eager_threshold(), 2000);
    assert_eq!(conn.stats().threshold_source, "config");
    assert_eq!(conn.probe_verdict(), Some(c.max_eager()));
}

#[test]
fn a_probe_started_before_the_handshake_waits_for_it() {
    let c = config();
    let mut sim = Sim::new(
        &c,
        &c,
        SimCfg {
            read_latency: Duration::from_micros(100),
            ..SimCfg::default()
        },
    );
    sim.start_probe(0, c.max_eager());
    sim.run();
    assert_eq!(sim.sides[0].thresholds, vec![c.max_eager()]);
}

#[test]
fn the_probe_time_limit_counts_from_the_handshake() {
    // Setting a provider up (registering memory) can take seconds before the peer's Hello
    // arrives; that time must not eat the probe's budget.
    let c = config();
    let t0 = Instant::now();
    let mut conn = Connection::new(&c, t0);
    conn.start_probe(t0, Bytes::from_static(b"probe"), c.max_eager());
    assert_eq!(
        conn.poll_timeout(),
        None,
        "no probe clock before the handshake"
    );
    let t1 = t0 + Duration::from_secs(5);
    conn.handle_frame(t1, hello(&c));
    assert_eq!(conn.poll_timeout(), Some(t1 + c.probe_timeout));
    conn.handle_timeout(t1 + c.probe_timeout - Duration::from_millis(1));
    assert!(
        conn.poll_action().is_none(),
        "the probe was abandoned before its time"
    );
}

/// Runs the whole probe (threshold, then fragment size) from side 0 and returns the
/// fragment size it chose.
fn probe_fragments_with(cfg: SimCfg) -> (usize, Sim) {
    let c = config();
    let mut sim = Sim::pair(&c, &c, cfg);
    sim.start_probe(0, c.probe_buffer_len());
    sim.run();
    let s = &sim.sides[0];
    assert_eq!(s.fragments.len(), 1, "exactly one ProbeDone");
    assert_eq!(s.conn.fragment_size(), s.fragments[0]);
    assert!(s.probe_exposure.is_none());
    (s.fragments[0], sim)
}

/// Reads share a 1 GB/s pipe and each costs `op_us` in it.
fn read_pipe(op_us: u64) -> SimCfg {
    SimCfg {
        read_pipe: true,
        read_op: Duration::from_micros(op_us),
        read_bw: 1_000,
        ..SimCfg::default()
    }
}

#[test]
fn a_high_cost_per_read_makes_the_probe_pick_large_fragments() {
    let (f, mut sim) = probe_fragments_with(read_pipe(200));
    assert_eq!(f, 1 << 20);
    let s = sim.sides[0].conn.stats().clone();
    assert_eq!((s.fragment_size, s.fragment_source), (1 << 20, "probe"));
    assert_eq!(s.threshold_source, "probe", "both phases ran");
    // 16 threshold samples, a warm-up and two rounds of five fragment samples; none delivered.
    assert_eq!(sim.sides[1].discarded.len(), 16 + 11);
    assert_eq!(sim.sides[1].delivered, 0);
    assert!(
        sim.sides[0].sent_frames.iter().any(|f| f.0 == 10),
        "no ProbeRead went out"
    );
    // The verdict governs this side's reads: an 8 MiB message from the peer takes 8 of them.
    assert_eq!(sim.sides[0].conn.stats().reads_issued, 0);
    sim.send(1, payload(3, 8 << 20));
    sim.run();
    sim.assert_all_delivered();
    assert_eq!(sim.sides[0].conn.stats().reads_issued, 8);
}

#[test]
fn a_pipe_limited_link_ties_and_the_probe_picks_the_smallest_fragment() {
    // No per-read cost: with reads in flight the pipe is always full, whatever the size.
    let (f, _) = probe_fragments_with(read_pipe(0));
    assert_eq!(f, 64 << 10);
}

#[test]
fn the_probe_finds_a_fragment_size_in_the_middle() {
    // 10 µs per read on 4 MiB at 1 GB/s (~4.2 ms): 128 KiB still costs 7% more than 1 MiB,
    // 256 KiB only 3%, which is within the 5% tie margin.
    let (f, _) = probe_fragments_with(read_pipe(10));
    assert_eq!(f, 256 << 10);
}

#[test]
fn the_fragment_probe_is_deterministic() {
    let cfg = SimCfg {
        read_jitter: Duration::from_micros(30),
        seed: 7,
        ..read_pipe(20)
    };
    let runs: Vec<usize> = (0..3)
        .map(|_| probe_fragments_with(cfg.clone()).0)
        .collect();
    assert!(runs.windows(2).all(|w| w[0] == w[1]), "{runs:?}");
}

#[test]
fn a_configured_fragment_size_is_not_probed_and_says_where_it_came_from() {
    let c = Config {
        fragment_size: Some(128 << 10),
        ..config()
    };
    let mut sim = Sim::pair(&c, &c, read_pipe(200));
    sim.start_probe(0, c.probe_buffer_len());
    sim.run();
    let s = &sim.sides[0];
    assert!(
        !s.sent_frames.iter().any(|f| f.0 == 10),
        "a ProbeRead went out"
    );
    assert_eq!(s.fragments, vec![128 << 10]);
    let st = s.conn.stats();
    assert_eq!(
        (st.fragment_size, st.fragment_source, st.threshold_source),
        (128 << 10, "config", "probe")
    );
    assert_eq!(s.conn.fragment_verdict(), None);
    // From the environment (Config::with_env records it), and the default otherwise.
    let env = EnvOverrides {
        eager_threshold: true,
        fragment_size: true,
    };
    let e = Config {
        eager_threshold: Some(2000),
        fragment_size: Some(1 << 20),
        env_overrides: env,
        ..config()
    };
    let conn = Connection::new(&e, Instant::now());
    assert_eq!(
        (conn.stats().threshold_source, conn.stats().fragment_source),
        ("env", "env")
    );
    assert_eq!(conn.fragment_size(), 1 << 20);
    let conn = Connection::new(&config(), Instant::now());
    assert_eq!(
        (conn.stats().fragment_size, conn.stats().fragment_source),
        (config().default_fragment_size, "default")
    );
}

#[test]
fn an_older_peer_gets_no_fragment_probe() {
    // Its Hello has no extension: it would reject a ProbeRead as an unknown kind.
    let c = config();
    let (mut conn, t0) = established(&c);
    conn.start_probe(t0, Bytes::from_static(b"probe"), c.probe_buffer_len());
    let mut kinds = Vec::new();
    let mut done = None;
    for _ in 0..1000 {
        while let Some(f) = conn.poll_transmit(t0) {
            let body = Frame::decode(&f).expect("frame").body;
            kinds.push(body.kind());
            let answer = match body {
                Body::ProbeEager { probe_id, .. } => Body::ProbeAck { probe_id },
                Body::ProbeRts { probe_id, .. } | Body::ProbeRead { probe_id, .. } => {
                    Body::RndvDone {
                        seq: u64::from(probe_id),
                        probe: true,
                    }
                }
                _ => continue,
            };
            // Return the sample's credit too, as the peer would.
            conn.handle_frame(
                t0,
                Frame {
                    credits: 1,
                    body: answer,
                }
                .to_bytes(),
            );
        }
        if let Some(a) = drain_actions(&mut conn)
            .into_iter()
            .find(|a| matches!(a, Action::ProbeDone { .. }))
        {
            done = Some(a);
            break;
        }
    }
    assert!(
        matches!(done, Some(Action::ProbeDone { fragment_size, .. }) if fragment_size == c.default_fragment_size)
    );
    assert!(
        !kinds.contains(&10),
        "ProbeRead sent to a peer that did not announce it"
    );
    assert_eq!(kinds.len(), 32, "the threshold phase ran in full");
    assert_eq!(
        (conn.stats().threshold_source, conn.stats().fragment_source),
        ("probe", "default")
    );
}

#[test]
fn probe_reads_and_hello_extensions_are_checked() {
    let c = config();
    let read = |fragment: u32| {
        Frame::new(Body::ProbeRead {
            probe_id: 0,
            len: 1 << 20,
            fragment,
            desc: Bytes::from_static(b"d"),
        })
        .to_bytes()
    };
    let (mut conn, t0) = established(&c);
    assert_rejected(&mut conn, t0, read(100), "100-byte fragments");
    let (mut conn, t0) = established(&c);
    assert_rejected(&mut conn, t0, read(128 << 20), "fragments");
    let (mut conn, t0) = established(&c);
    conn.handle_frame(t0, read(64 << 10));
    let actions = drain_actions(&mut conn);
    assert!(
        matches!(actions[..], [Action::BeginRecv { probe: true, len, .. }] if len == 1 << 20),
        "{actions:?}"
    );
    // A Hello whose extension entry runs past the block.
    let t0 = Instant::now();
    let mut conn = Connection::new(&c, t0);
    let bad = Frame::new(Body::Hello {
        slots: 4,
        slot_size: 65536,
        max_message: 1 << 30,
        fragment_size: 1 << 19,
        ext: Bytes::from_static(&[1, 0, 9, 0, 1]),
    });
    assert_rejected(&mut conn, t0, bad.to_bytes(), "malformed Hello extension");
}

#[test]
fn a_probe_read_is_read_in_the_fragments_it_asks_for() {
    let c = config();
    let mut sim = Sim::pair(&c, &c, SimCfg::default());
    let now = sim.now;
    let (_, desc) = sim.sides[0].expose(Bytes::from(vec![0u8; 1 << 20]));
    let f = Frame::new(Body::ProbeRead {
        probe_id: 0,
        len: 1 << 20,
        fragment: 128 << 10,
        desc,
    })
    .to_bytes();
    // As if side 0 had sent it: it holds one of side 1's slots until credited back.
    sim.sides[0].outstanding += 1;
    sim.sides[1].conn.handle_frame(now, f);
    sim.run();
    assert_eq!(sim.sides[1].conn.stats().reads_issued, 8);
    assert_eq!(sim.sides[1].discarded.len(), 1);
}

/// Feeds a connection the peer's Hello by hand.
fn hello(c: &Config) -> Bytes {
    Frame::new(Body::Hello {
        slots: c.credits,
        slot_size: c.slot_size as u32,
        max_message: c.max_message_size,
        fragment_size: c.default_fragment_size as u32,
        // As the first version-1 builds send it: no extension, so no fragment probe.
        ext: Bytes::new(),
    })
    .to_bytes()
}

#[test]
fn an_unanswered_probe_is_abandoned_after_two_seconds() {
    let c = config();
    let t0 = Instant::now();
    let mut conn = Connection::new(&c, t0);
    conn.handle_frame(t0, hello(&c));
    conn.start_probe(t0, Bytes::from_static(b"probe"), c.max_eager());
    let mut sent = Vec::new();
    while let Some(f) = conn.poll_transmit(t0) {
        sent.push(Frame::decode(&f).expect("frame").body.kind());
    }
    assert_eq!(sent, vec![1, 6], "Hello, then the first (eager) sample");
    assert_eq!(conn.poll_timeout(), Some(t0 + Duration::from_secs(2)));
    conn.handle_timeout(t0 + Duration::from_millis(1999));
    assert!(conn.poll_action().is_none());
    conn.handle_timeout(t0 + Duration::from_secs(2));
    assert!(
        matches!(conn.poll_action(), Some(Action::ProbeDone { threshold, .. }) if threshold == c.default_eager_threshold)
    );
    assert_eq!(conn.poll_timeout(), None);
    assert_eq!(conn.stats().threshold_source, "default");
    assert!(
        conn.poll_transmit(t0).is_none(),
        "no more samples after abandoning"
    );
    // The late answer is harmless.
    conn.handle_frame(t0, Frame::new(Body::ProbeAck { probe_id: 0 }).to_bytes());
    assert!(!conn.is_closed());
}

// ---------------------------------------------------------------- receive budget

/// Side 1 receives with a 1 MiB budget and takes one message per `every`.
fn budget_pair(every: Duration) -> Sim {
    let b = Config {
        rndv_recv_budget: 1 << 20,
        ..config()
    };
    let cfg = SimCfg {
        consume_every: Some(every),
        read_jitter: Duration::from_micros(20),
        ..SimCfg::default()
    };
    Sim::pair(&config(), &b, cfg)
}

#[test]
fn rendezvous_receives_wait_for_the_budget_and_all_arrive() {
    let mut sim = budget_pair(Duration::from_micros(200));
    for n in 0..30 {
        assert_eq!(
            sim.send(0, payload(n, 300_000 + n as usize)).1,
            Protocol::Rendezvous
        );
    }
    sim.run();
    sim.assert_all_delivered();
    let r = &sim.sides[1];
    assert_eq!(r.delivered, 30);
    assert!(
        r.max_held <= 1 << 20,
        "held {} bytes of receive memory at once, over the 1 MiB budget",
        r.max_held
    );
    assert!(
        r.max_held > 600_000,
        "the budget was not used ({} bytes at most)",
        r.max_held
    );
    assert!(r.conn.stats().rndv_recv_deferred > 0);
}

#[test]
fn a_message_over_the_budget_goes_alone_and_later_ones_wait_behind_it() {
    let mut sim = budget_pair(Duration::from_micros(100));
    sim.send(0, payload(1, 3 << 20));
    sim.send(0, payload(2, 100_000));
    sim.send(0, payload(3, 3 << 20));
    sim.run();
    sim.assert_all_delivered();
    assert_eq!(
        sim.sides[1].max_held,
        3 << 20,
        "each large message held the budget alone"
    );
}

#[test]
fn announcements_of_a_gibibyte_each_get_memory_one_at_a_time() {
    // A hostile sender: every credit spent on an RTS of max_message_size, never readable.
    let c = config();
    let (mut conn, t0) = established(&c);
    for seq in 0..c.credits as u64 {
        conn.handle_frame(
            t0,
            Frame::new(Body::Rts {
                seq,
                len: c.max_message_size,
                desc: Bytes::from_static(b"never exposed"),
                head: Bytes::new(),
            })
            .to_bytes(),
        );
    }
    let begun = drain_actions(&mut conn)
        .iter()
        .filter(|a| matches!(a, Action::BeginRecv { .. }))
        .count();
    assert_eq!(begun, 1, "only the first may hold memory");
    assert!(!conn.is_closed(), "deferring is not a violation");
    assert_eq!(conn.stats().rndv_recv_deferred, c.credits as u64 - 1);
    // Failing discards only what was given memory.
    conn.link_failed(Error::PeerGone("the test ends it".into()));
    let discards = drain_actions(&mut conn)
        .iter()
        .filter(|a| matches!(a, Action::Discard { .. }))
        .count();
    assert_eq!(discards, 1);
}

#[test]
fn probe_samples_longer_than_any_probe_are_violations() {
    let c = config();
    let (mut conn, t0) = established(&c);
    let rts = Frame::new(Body::ProbeRts {
        probe_id: 0,
        len: 1 << 30,
        desc: Bytes::from_static(b"d"),
    })
    .to_bytes();
    assert_rejected(&mut conn, t0, rts, "longer than any probe sends");
    let (mut conn, t0) = established(&c);
    let read = Frame::new(Body::ProbeRead {
        probe_id: 0,
        len: 64 << 20,
        fragment: 1 << 20,
        desc: Bytes::from_static(b"d"),
    })
    .to_bytes();
    assert_rejected(&mut conn, t0, read, "longer than any probe sends");
}

// ---------------------------------------------------------------- closing

fn drain_actions(conn: &mut Connection) -> Vec<Action> {
    std::iter::from_fn(|| conn.poll_action()).collect()
}

// ---------------------------------------------------------------- two-part messages

/// Two-part messages (a head in the RTS, the body by rendezvous) between plain eager and
/// rendezvous ones, read or mapped, with jitter: each arrives whole and in order, with its
/// head in front of its body; the longest head the room allows is taken, an empty body
/// too, and the credits come back.
#[test]
fn two_part_messages_arrive_whole_and_in_order() {
    let c = config();
    for mapped in [false, true] {
        let mut sim = Sim::pair(
            &c,
            &c,
            SimCfg {
                mapped,
                read_jitter: Duration::from_micros(30),
                seed: 7,
                ..SimCfg::default()
            },
        );
        let room = sim.sides[0].conn.head_room();
        assert!(room > 0 && room < c.slot_size, "{room}");
        let mut n = 0;
        for round in 0..6u64 {
            sim.send(0, payload(round, 100));
            sim.send_parts(0, payload(round + 10, 40), payload(round + 20, 300 << 10));
            sim.send(0, payload(round + 30, 2 << 20));
            sim.send_parts(1, payload(round + 40, room), payload(round + 50, 1));
            sim.send_parts(1, payload(round + 60, 3), Bytes::new());
            n += 3;
        }
        sim.run();
        assert_eq!(sim.sides[1].delivered, n);
        assert_eq!(sim.sides[0].delivered, 12);
        assert!(sim.sides.iter().all(|s| s.expected.is_empty()));
    }
}

/// A head longer than the room is refused before anything is queued; a peer whose build
/// announced no two-part messages has no room at all, and a head queued for it before its
/// `Hello` closes the connection with a message that says why.
#[test]
fn heads_are_bounded_by_the_room_and_need_a_peer_that_takes_them() {
    let c = config();
    let mut sim = Sim::pair(&c, &c, SimCfg::default());
    let now = sim.now;
    let room = sim.sides[0].conn.head_room();
    let e = sim.sides[0]
        .conn
        .send_parts(
            now,
            Bytes::from(vec![0; room + 1]),
            10,
            Bytes::from_static(b"d"),
        )
        .unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    // An older peer: its Hello has no extension.
    let (mut conn, t0) = established(&c);
    assert_eq!(conn.head_room(), 0);
    assert!(
        conn.send_parts(t0, Bytes::from_static(b"h"), 10, Bytes::from_static(b"d"))
            .is_err()
    );
    assert!(
        conn.send_parts(t0, Bytes::new(), 10, Bytes::from_static(b"d"))
            .is_ok()
    );
    // Queued before the handshake, then the older peer's Hello.
    let mut conn = Connection::new(&c, t0);
    conn.send_parts(t0, Bytes::from_static(b"h"), 10, Bytes::from_static(b"d"))
        .expect("room is this side's own slot until the peer's Hello");
    conn.handle_frame(t0, hello(&c));
    match drain_actions(&mut conn).first() {
        Some(Action::Closed {
            error: Error::Handshake(why),
        }) => assert!(why.contains("two-part"), "{why}"),
        other => panic!("expected a handshake error, got {other:?}"),
    }
}

/// A hostile RTS whose head and body together exceed our largest message closes the
/// connection before any memory is given to it.
#[test]
fn a_head_that_takes_a_message_over_the_limit_is_a_violation() {
    let c = config();
    let (mut conn, t0) = established(&c);
    let bad = Frame::new(Body::Rts {
        seq: 0,
        len: c.max_message_size,
        desc: Bytes::from_static(b"d"),
        head: Bytes::from_static(b"one byte too many"),
    })
    .to_bytes();
    assert_rejected(&mut conn, t0, bad, "over our max_message_size");
}

#[test]
fn graceful_close_waits_for_rendezvous_then_both_sides_close() {
    let c = config();
    let mut sim = Sim::pair(
        &c,
        &c,
        SimCfg {
            read_latency: Duration::from_micros(50),
            ..SimCfg::default()
        },
    );
    let (a_msg, _) = sim.send(0, payload(1, 1 << 20));
    sim.send(0, payload(2, 10));
    let (b_msg, _) = sim.send(1, payload(3, 64 << 20));
    sim.pump();
    let now = sim.now;
    sim.sides[0].conn.close(now, "bye");
    assert!(matches!(
        sim.sides[0].conn.send_eager(now, Bytes::new()),
        Err(Error::LocallyClosed)
    ));
    assert!(matches!(
        sim.sides[0].conn.send_rendezvous(now, 1, Bytes::new()),
        Err(Error::LocallyClosed)
    ));
    sim.run();
    let (a, b) = (&sim.sides[0], &sim.sides[1]);
    // A's rendezvous was read and released normally, before A's Close went out.
    assert_eq!(a.released, vec![a_msg]);
    assert!(b.expected.is_empty(), "B got everything A sent");
    assert!(matches!(&a.closed, Some(Error::LocallyClosed)));
    assert!(
        matches!(&b.closed, Some(Error::PeerClosed(r)) if r == "bye"),
        "{:?}",
        b.closed
    );
    // A was still reading B's 64 MiB message: discarded there, released at B.
    assert_eq!(a.discarded, vec![b_msg]);
    assert_eq!(b.released, vec![b_msg]);
    assert!(a.dest.is_empty() && b.exposed.is_empty());
    assert!(
        a.after_close.iter().all(|s| s.starts_with("Discard")),
        "{:?}",
        a.after_close
    );
    assert!(
        b.after_close.iter().all(|s| s.starts_with("Release")),
        "{:?}",
        b.after_close
    );
    let last = a.sent_frames.last().expect("frames");
    assert_eq!(last.0, 9, "the Close is A's last frame");
}

#[test]
fn a_peer_dying_mid_rendezvous_fails_everything_on_both_sides() {
    let c = config();
    let mut sim = Sim::pair(
        &c,
        &c,
        SimCfg {
            read_latency: Duration::from_micros(50),
            ..SimCfg::default()
        },
    );
    let (msg, _) = sim.send(0, payload(1, 8 << 20));
    // Let B start reading.
    while sim.sides[1].read_done_order.len() < 2 {
        sim.pump();
        let t = sim.next_event().expect("event");
        sim.now = sim.now.max(t);
        sim.fire();
    }
    // A's process dies: its link fails, its memory is gone.
    sim.sides[0]
        .conn
        .link_failed(Error::PeerGone("process exited".into()));
    sim.pump();
    sim.sides[0].dead = true;
    sim.sides[0].exposed.clear();
    sim.run();
    let (a, b) = (&sim.sides[0], &sim.sides[1]);
    assert!(matches!(&a.closed, Some(Error::PeerGone(_))));
    assert_eq!(a.released, vec![msg]);
    assert!(
        matches!(&b.closed, Some(Error::PeerGone(_))),
        "{:?}",
        b.closed
    );
    assert_eq!(b.discarded, vec![msg]);
    assert!(b.dest.is_empty());
    // B told the (dead) peer why, with the local-error code.
    let last = b.sent_frames.last().expect("frames");
    assert_eq!(last.0, 9);
}

#[test]
fn an_abortive_close_from_the_peer_fails_pending_sends() {
    let c = config();
    let mut sim = Sim::pair(&c, &c, SimCfg::default());
    let (msg, _) = sim.send(0, payload(1, 1 << 20));
    // Deliver the RTS to B by hand and have B's driver refuse it.
    sim.pump();
    let (arrive, frame) = sim.sides[0].wire.pop_front().expect("rts");
    sim.now = arrive;
    sim.sides[1].conn.handle_frame(arrive, frame);
    let actions = drain_actions(&mut sim.sides[1].conn);
    assert!(matches!(actions[0], Action::BeginRecv { msg: m, probe: false, .. } if m == msg));
    sim.sides[1].expected.clear();
    sim.sides[1]
        .conn
        .reject_rendezvous(arrive, msg, Error::Config("no memory for it".into()));
    sim.run();
    let (a, b) = (&sim.sides[0], &sim.sides[1]);
    assert!(matches!(&b.closed, Some(Error::Config(_))));
    assert_eq!(b.discarded, vec![msg]);
    assert!(
        matches!(&a.closed, Some(Error::PeerClosed(r)) if r.starts_with("error 2:") && r.contains("no memory")),
        "{:?}",
        a.closed
    );
    assert_eq!(a.released, vec![msg]);
    assert!(a.exposed.is_empty());
}

#[test]
fn close_before_the_handshake_is_immediate() {
    let c = config();
    let t0 = Instant::now();
    let mut conn = Connection::new(&c, t0);
    conn.close(t0, "never mind");
    let frames: Vec<u8> = std::iter::from_fn(|| conn.poll_transmit(t0))
        .map(|f| Frame::decode(&f).expect("f").body.kind())
        .collect();
    assert_eq!(frames, vec![9], "only the Close goes out once closed");
    assert!(matches!(
        drain_actions(&mut conn)[..],
        [Action::Closed {
            error: Error::LocallyClosed
        }]
    ));
    // Everything after is ignored.
    conn.handle_frame(t0, hello(&c));
    assert!(!conn.is_established());
    assert!(conn.poll_transmit(t0).is_none() && conn.poll_action().is_none());
}

// ---------------------------------------------------------------- malformed input

/// A connection that completed its handshake, with its own frames drained.
fn established(c: &Config) -> (Connection, Instant) {
    let t0 = Instant::now();
    let mut conn = Connection::new(c, t0);
    conn.handle_frame(t0, hello(c));
    while conn.poll_transmit(t0).is_some() {}
    assert!(conn.is_established());
    (conn, t0)
}

fn raw(kind: u8, flags: u8, credits: u32, body: &[u8]) -> Vec<u8> {
    let mut v = vec![0x49, 1, kind, flags];
    v.extend_from_slice(&credits.to_le_bytes());
    v.extend_from_slice(&(body.len() as u32).to_le_bytes());
    v.extend_from_slice(body);
    v
}

/// Feeds `bad` and checks: Closed{Protocol} naming `needle`, one Close{1} frame out.
fn assert_rejected(conn: &mut Connection, t0: Instant, bad: Bytes, needle: &str) {
    conn.handle_frame(t0, bad);
    let actions = drain_actions(conn);
    match actions.first() {
        Some(Action::Closed {
            error: Error::Protocol(what),
        }) => {
            assert!(
                what.contains(needle),
                "{what:?} does not mention {needle:?}"
            )
        }
        other => panic!("expected Closed(Protocol) mentioning {needle:?}, got {other:?}"),
    }
    let close = conn.poll_transmit(t0).expect("a Close frame");
    match Frame::decode(&close).expect("close decodes").body {
        Body::Close { code: 1, reason } => assert!(reason.contains(needle), "{reason}"),
        other => panic!("expected Close{{1}}, got {other:?}"),
    }
    assert!(conn.poll_transmit(t0).is_none(), "the Close goes out once");
    assert!(conn.is_closed());
}

#[test]
fn each_malformed_frame_closes_the_connection_with_a_protocol_error() {
    let c = config();
    let mut valid_rts = 0u64.to_le_bytes().to_vec();
    valid_rts.extend_from_slice(&10u64.to_le_bytes());
    let mut long_desc = valid_rts.clone();
    long_desc.extend_from_slice(&257u16.to_le_bytes());
    let mut long_ext = vec![0u8; 20];
    long_ext.extend_from_slice(&1025u16.to_le_bytes());
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![0x49, 1, 5], "shorter than"),
        (
            {
                let mut f = raw(5, 0, 0, &[]);
                f[0] = 0x48;
                f
            },
            "magic",
        ),
        (
            {
                let mut f = raw(5, 0, 0, &[]);
                f[1] = 9;
                f
            },
            "version 9",
        ),
        (raw(42, 0, 0, &[]), "unknown frame kind 42"),
        (raw(2, 0x80, 0, &[1, 0, 0, 0, 0, 0]), "flag"),
        (
            {
                let mut f = raw(5, 0, 0, &[]);
                f.push(1);
                f
            },
            "body is 0 bytes but 1",
        ),
        (raw(4, 0, 0, &[1, 2, 3]), "truncated"),
        (raw(2, 0, 0, &[0, 0]), "count of 0"),
        (
            raw(2, 0, 0, &[1, 0, 200, 0, 0, 0, 1, 2]),
            "runs past the end",
        ),
        (raw(7, 0, 0, &[0, 0, 0, 0, 9]), "trailing"),
        (raw(3, 0, 0, &long_desc), "descriptor of 257"),
        (raw(1, 0, 0, &long_ext), "extension of 1025"),
    ];
    for (bad, needle) in cases {
        let (mut conn, t0) = established(&c);
        assert_rejected(&mut conn, t0, Bytes::from(bad), needle);
    }
}

#[test]
fn each_semantic_violation_closes_the_connection_with_a_protocol_error() {
    let c = Config {
        credits: 2,
        ..config()
    };
    let eager = |n: usize| {
        Frame::new(Body::Eager {
            msgs: vec![Bytes::from(vec![7u8; n])],
        })
        .to_bytes()
    };
    let rts = |seq: u64, len: u64| {
        Frame::new(Body::Rts {
            seq,
            len,
            desc: Bytes::from_static(b"d"),
            head: Bytes::new(),
        })
        .to_bytes()
    };
    let (mut conn, t0) = established(&c);
    assert_rejected(&mut conn, t0, hello(&c), "second Hello");
    let (mut conn, t0) = established(&c);
    assert_rejected(&mut conn, t0, rts(5, 10), "RTS numbered 5 where message 0");
    let (mut conn, t0) = established(&c);
    assert_rejected(
        &mut conn,
        t0,
        rts(0, 2 << 30),
        "max_message_size of 1073741824",
    );
    let (mut conn, t0) = established(&c);
    assert_rejected(
        &mut conn,
        t0,
        Frame::new(Body::RndvDone {
            seq: 3,
            probe: false,
        })
        .to_bytes(),
        "not an outstanding rendezvous",
    );
    let (mut conn, t0) = established(&c);
    assert_rejected(
        &mut conn,
        t0,
        Frame::new(Body::RndvDone {
            seq: 3,
            probe: true,
        })
        .to_bytes(),
        "never sent",
    );
    let (mut conn, t0) = established(&c);
    assert_rejected(
        &mut conn,
        t0,
        Frame {
            credits: 1,
            body: Body::Credit,
        }
        .to_bytes(),
        "returned 1 credits",
    );
    let (mut conn, t0) = established(&c);
    assert_rejected(
        &mut conn,
        t0,
        Bytes::from(vec![0x49; 70_000]),
        "exceeds our slot size",
    );
    let (mut conn, t0) = established(&c);
    conn.handle_frame(t0, eager(10));
    conn.handle_frame(t0, eager(10));
    assert_eq!(
        drain_actions(&mut conn).len(),
        2,
        "two deliveries, never consumed"
    );
    assert_rejected(&mut conn, t0, eager(10), "no credit left");
    // Data before the Hello.
    let t0 = Instant::now();
    let mut conn = Connection::new(&c, t0);
    while conn.poll_transmit(t0).is_some() {}
    assert_rejected(&mut conn, t0, eager(1), "before the peer's Hello");
}

#[test]
fn a_protocol_violation_releases_and_discards_everything_pending() {
    let c = config();
    let mut sim = Sim::pair(
        &c,
        &c,
        SimCfg {
            read_latency: Duration::from_millis(1),
            ..SimCfg::default()
        },
    );
    let (a_msg, _) = sim.send(0, payload(1, 1 << 20));
    let (b_msg, _) = sim.send(1, payload(2, 1 << 20));
    sim.pump();
    while sim.sides[0].dest.is_empty() {
        let t = sim.next_event().expect("event");
        sim.now = sim.now.max(t);
        sim.fire();
        sim.pump();
    }
    let now = sim.now;
    sim.sides[0]
        .conn
        .handle_frame(now, Bytes::from_static(b"garbage!garbage!"));
    sim.run();
    let (a, b) = (&sim.sides[0], &sim.sides[1]);
    assert!(matches!(&a.closed, Some(Error::Protocol(m)) if m.contains("magic")));
    assert_eq!(a.released, vec![a_msg]);
    assert_eq!(a.discarded, vec![b_msg]);
    assert!(
        matches!(&b.closed, Some(Error::PeerClosed(r)) if r.starts_with("error 1:")),
        "{:?}",
        b.closed
    );
    assert_eq!(b.released, vec![b_msg]);
    assert_eq!(b.discarded, vec![a_msg]);
}

#[test]
fn a_failed_read_closes_with_that_error() {
    let c = config();
    let mut sim = Sim::pair(&c, &c, SimCfg::default());
    let (msg, _) = sim.send(0, payload(1, 1 << 20));
    // A withdraws the buffer early (a buggy provider): B's reads fail.
    sim.sides[0].exposed.clear();
    sim.run();
    let (a, b) = (&sim.sides[0], &sim.sides[1]);
    assert!(matches!(&b.closed, Some(Error::PeerGone(_))));
    assert_eq!(b.discarded, vec![msg]);
    assert!(
        matches!(&a.closed, Some(Error::PeerClosed(r)) if r.starts_with("error 2:")),
        "{:?}",
        a.closed
    );
}

// ---------------------------------------------------------------- properties

fn bytes_up_to(n: usize) -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..n).prop_map(Bytes::from)
}

fn any_body() -> impl Strategy<Value = Body> {
    prop_oneof![
        (
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            bytes_up_to(1025)
        )
            .prop_map(
                |(slots, slot_size, max_message, fragment_size, ext)| Body::Hello {
                    slots,
                    slot_size,
                    max_message,
                    fragment_size,
                    ext
                }
            ),
        proptest::collection::vec(bytes_up_to(300), 1..20).prop_map(|msgs| Body::Eager { msgs }),
        (
            any::<u64>(),
            any::<u64>(),
            bytes_up_to(257),
            bytes_up_to(300)
        )
            .prop_map(|(seq, len, desc, head)| Body::Rts {
                seq,
                len,
                desc,
                head
            }),
        (any::<u64>(), any::<bool>()).prop_map(|(seq, probe)| Body::RndvDone { seq, probe }),
        Just(Body::Credit),
        (any::<u32>(), bytes_up_to(500))
            .prop_map(|(probe_id, pad)| Body::ProbeEager { probe_id, pad }),
        any::<u32>().prop_map(|probe_id| Body::ProbeAck { probe_id }),
        (any::<u32>(), any::<u64>(), bytes_up_to(257)).prop_map(|(probe_id, len, desc)| {
            Body::ProbeRts {
                probe_id,
                len,
                desc,
            }
        }),
        (any::<u32>(), ".{0,100}").prop_map(|(code, reason)| Body::Close { code, reason }),
        (any::<u32>(), any::<u64>(), any::<u32>(), bytes_up_to(257)).prop_map(
            |(probe_id, len, fragment, desc)| Body::ProbeRead {
                probe_id,
                len,
                fragment,
                desc
            }
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn every_frame_kind_round_trips(credits in any::<u32>(), body in any_body()) {
        let f = Frame { credits, body };
        let bytes = f.to_bytes();
        prop_assert_eq!(bytes.len(), f.encoded_len());
        prop_assert_eq!(Frame::decode(&bytes), Ok(f));
    }

    #[test]
    fn decode_never_panics_on_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = Frame::decode(&Bytes::from(data));
    }

    #[test]
    fn decode_never_panics_on_mutated_frames(body in any_body(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6), cut in any::<usize>()) {
        let mut v = Frame::new(body).to_bytes().to_vec();
        for (at, x) in flips {
            let n = v.len();
            v[at % n] ^= x;
        }
        let n = v.len();
        v.truncate(n - cut % (n / 4 + 1));
        let _ = Frame::decode(&Bytes::from(v));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn random_size_sequences_arrive_in_order_and_intact(
        sizes in proptest::collection::vec(prop_oneof![0usize..100, 0usize..70_000, 0usize..600_000], 1..40),
        seed in any::<u64>(),
        slow in any::<bool>(),
    ) {
        let c = Config { credits: 4, fragment_size: Some(64 * 1024), ..config() };
        let cfg = SimCfg {
            read_jitter: Duration::from_micros(20),
            link_bw: if slow { 50 } else { 0 },
            consume_every: slow.then(|| Duration::from_micros(30)),
            seed,
            ..SimCfg::default()
        };
        let mut sim = Sim::pair(&c, &c, cfg);
        for (n, len) in sizes.iter().enumerate() {
            sim.send(n % 3 / 2, payload(seed ^ n as u64, *len));
        }
        sim.run();
        sim.assert_all_delivered();
        prop_assert_eq!((sim.sides[0].delivered + sim.sides[1].delivered) as usize, sizes.len());
    }
}

// ---------------------------------------------------------------- keep-alive

fn keepalive() -> Config {
    Config {
        keepalive: Some(Duration::from_secs(1)),
        keepalive_timeout: Duration::from_secs(2),
        ..config()
    }
}

#[test]
fn keepalive_pings_an_idle_peer_and_stays_up_while_it_answers() {
    // The peer has no keep-alive of its own (an older or default build): it answers anyway.
    let mut s = Sim::pair_for(&keepalive(), &config(), SimCfg::default());
    let sent0 = s.sides[0].conn.stats().frames_sent;
    s.run_for(Duration::from_secs(30));
    assert!(s.sides[0].closed.is_none(), "{:?}", s.sides[0].closed);
    assert!(s.sides[1].closed.is_none(), "{:?}", s.sides[1].closed);
    let pings = s.sides[0].conn.stats().frames_sent - sent0;
    assert!(
        (25..=31).contains(&pings),
        "about one ping per idle second: {pings} in 30 s"
    );
    // The connection still carries data, and the pings cost the application nothing.
    s.send(0, payload(1, 1000));
    s.send(1, payload(2, 1000));
    s.run_for(Duration::from_secs(1));
    s.assert_all_delivered();
}

#[test]
fn keepalive_sends_no_ping_while_the_peer_is_heard() {
    let mut s = Sim::pair_for(&keepalive(), &config(), SimCfg::default());
    for i in 0..20 {
        s.send(1, payload(i, 100));
        s.run_for(Duration::from_millis(500));
    }
    let pings = s.sides[0]
        .sent_frames
        .iter()
        .filter(|(kind, _, _)| *kind == ibex_transport::proto::frame::kind::PROBE_EAGER)
        .count();
    assert_eq!(pings, 0, "a peer heard every 500 ms is never pinged");
    s.assert_all_delivered();
}

#[test]
fn keepalive_closes_a_peer_that_stops_answering_within_interval_plus_timeout() {
    let mut s = Sim::pair_for(&keepalive(), &config(), SimCfg::default());
    let t0 = s.now;
    // The peer hangs: it reads nothing and answers nothing from now on.
    s.sides[1].dead = true;
    let mut closed_at = None;
    for _ in 0..100 {
        s.run_for(Duration::from_millis(100));
        if s.sides[0].closed.is_some() {
            closed_at = Some(s.now - t0);
            break;
        }
    }
    let at = closed_at.expect("the silent peer's connection was never closed");
    assert!(
        at >= Duration::from_secs(3) && at <= Duration::from_millis(3200),
        "closed after {at:?}: expected the 1 s interval plus the 2 s timeout"
    );
    let why = s.sides[0]
        .closed
        .as_ref()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        why.contains("keep-alive") && why.contains("IBEX_KEEPALIVE_TIMEOUT_MS"),
        "{why}"
    );
    // The peer is told, should it wake up: the last frame sent is a Close naming the cause.
    let last = s.sides[0].sent_frames.last().map(|f| f.0);
    assert_eq!(last, Some(ibex_transport::proto::frame::kind::CLOSE));
}

#[test]
fn keepalive_settings_must_be_positive_and_name_their_variables() {
    for c in [
        Config {
            keepalive: Some(Duration::ZERO),
            ..config()
        },
        Config {
            keepalive_timeout: Duration::ZERO,
            ..config()
        },
    ] {
        let e = c.validate().expect_err("zero is refused").to_string();
        assert!(e.contains("IBEX_KEEPALIVE_MS"), "{e}");
    }
}
