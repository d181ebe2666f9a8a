//! The call multiplexer's state, sans IO: which calls a connection carries, which ids are
//! free, whether new calls are taken (GOAWAY, the server's limit), and what an inbound packet
//! means for its call. Client and server keep one table per connection, behind its lock, and
//! do only the IO its answers ask for, so the rules live here once and `tests` can drive both
//! tables against each other over a simulated connection, deterministically.

use std::collections::hash_map::Entry as MapEntry;

use tonic::Status;

use super::CallShared;
use super::pump::Side;
use super::wire::Packet;
use crate::map::Map;

/// What a table keeps for a call: the state both ends track, plus whatever the side's IO
/// needs (an inbox, a oneshot).
pub(crate) trait Slot {
    fn call(&self) -> &CallShared;
}

/// One connection's calls, for one side.
pub(crate) struct CallTable<T> {
    side: Side,
    map: Map<u32, T>,
    /// The client's next call id.
    next_id: u32,
    /// GOAWAY went out (server) or came in (client): calls in flight finish, no new ones.
    draining: bool,
    /// Why the connection is unusable, once it is.
    closed: Option<Status>,
    /// The server's limit on calls in flight (`Builder::max_concurrent_calls`).
    max_calls: usize,
}

/// What a request head asks of the server.
#[derive(Debug)]
pub(crate) enum Admit {
    /// Start the call, then [`CallTable::insert`] it.
    Open,
    /// Answer with this status (trailers-only) and forget the call: the server is draining
    /// or at its limit. The connection goes on.
    Refuse(Status),
}

/// Where the call a packet names stands once the packet is accounted.
pub(crate) enum Entry<'a, T> {
    /// The call goes on.
    Live(&'a mut T),
    /// The client cancelled (server): the call's state is finished so its handler stops, and
    /// it stays in the table until that future is gone, so the limit counts it.
    Cancelled(&'a mut T),
    /// This packet ends the call here (client: the server's end or reset): it is out of
    /// the table, its state finished.
    Ended(T),
}

/// What one inbound packet means.
pub(crate) enum Verdict<'a, T> {
    /// For no one: a packet of a call already over here, or a GOAWAY (now recorded).
    Dropped,
    /// For a call in progress; any window it grants is applied, any data accounted.
    Call(Entry<'a, T>),
    /// The peer sent past the call's window; the call is out of the table. As HTTP/2's
    /// FLOW_CONTROL_ERROR: no honest peer does it, and going on would buffer what follows.
    Overrun(T),
}

impl<T: Slot> CallTable<T> {
    pub(crate) fn new(side: Side, max_calls: usize) -> CallTable<T> {
        CallTable {
            side,
            map: Map::default(),
            next_id: 0,
            draining: false,
            closed: None,
            max_calls,
        }
    }

    /// Why no new call can start on this connection, if none can (client).
    pub(crate) fn refusal(&self) -> Option<Status> {
        if let Some(s) = &self.closed {
            return Some(s.clone());
        }
        self.draining.then(|| {
            Status::unavailable(
                "the gRPC server is shutting down and takes no new calls on this connection; \
                 connect again",
            )
        })
    }

    /// Starts a call (client): gives it the next free even id.
    pub(crate) fn open(&mut self, value: T) -> Result<u32, Status> {
        self.open_with_parity(value, 0)
    }

    /// Starts a whole unary call of the direct path (client): the next free odd id tells the
    /// decoder its answer may merge into one map ([`super::wire::whole_unary`]).
    pub(crate) fn open_whole(&mut self, value: T) -> Result<u32, Status> {
        self.open_with_parity(value, 1)
    }

    fn open_with_parity(&mut self, value: T, parity: u32) -> Result<u32, Status> {
        if let Some(s) = self.refusal() {
            return Err(s);
        }
        // Up to the next id of the parity, never back to the one just used.
        let mut id = self.next_id;
        if id & 1 != parity {
            id = id.wrapping_add(1);
        }
        while self.map.contains_key(&id) {
            id = id.wrapping_add(2);
        }
        self.next_id = id.wrapping_add(1);
        self.map.insert(id, value);
        Ok(id)
    }

    /// Whether the server takes call `id`, whose request head just came. An id already in
    /// use is the client breaking the framing: the connection cannot go on.
    #[inline]
    pub(crate) fn admit(&self, id: u32) -> crate::error::Result<Admit> {
        if self.draining {
            // Raced with our GOAWAY: refused, as HTTP/2 refuses streams past GOAWAY.
            return Ok(Admit::Refuse(Status::unavailable(
                "the gRPC server is shutting down; retry on a new connection",
            )));
        }
        if self.map.contains_key(&id) {
            return Err(crate::error::Error::Protocol(format!(
                "gRPC call framing: call id {id} opened twice"
            )));
        }
        if self.map.len() >= self.max_calls {
            return Ok(Admit::Refuse(Status::resource_exhausted(format!(
                "the server allows at most {} calls in flight per connection \
                 (grpc::Builder::max_concurrent_calls); wait for some to finish",
                self.max_calls
            ))));
        }
        Ok(Admit::Open)
    }

    /// Adds a call the server admitted.
    #[inline]
    pub(crate) fn insert(&mut self, id: u32, value: T) {
        self.map.insert(id, value);
    }

    /// Accounts one inbound packet of a call in progress: `data` is the length of its body
    /// frame, if it has one.
    #[inline]
    pub(crate) fn packet(&mut self, p: &Packet, data: Option<usize>) -> Verdict<'_, T> {
        if p.goaway {
            self.draining = true;
            return Verdict::Dropped;
        }
        // One lookup, whatever the packet does to the call.
        let MapEntry::Occupied(slot) = self.map.entry(p.call) else {
            return Verdict::Dropped;
        };
        let call = slot.get().call();
        if let Some(w) = p.window {
            call.grant(w);
        }
        // Counted once against the call's window.
        if let Some(len) = data
            && !call.received(len)
        {
            let c = slot.remove();
            c.call().finish();
            return Verdict::Overrun(c);
        }
        match self.side {
            // The server's end ends the call: the request half is over or no longer wanted.
            Side::Client if p.end || p.reset => {
                let c = slot.remove();
                c.call().finish();
                Verdict::Call(Entry::Ended(c))
            }
            // The client's end only half-closes; its reset cancels.
            Side::Server if p.reset => {
                call.finish();
                Verdict::Call(Entry::Cancelled(slot.into_mut()))
            }
            _ => Verdict::Call(Entry::Live(slot.into_mut())),
        }
    }

    /// The server's future of call `id` is gone: the call leaves the table, unless the id
    /// is already another call's.
    #[inline]
    pub(crate) fn end(&mut self, id: u32, call: &CallShared) {
        call.finish();
        if let MapEntry::Occupied(slot) = self.map.entry(id)
            && std::ptr::eq(slot.get().call(), call)
        {
            slot.remove();
        }
    }

    /// Takes a call out of the table (its end here) and finishes its state.
    #[inline]
    pub(crate) fn remove(&mut self, id: u32) -> Option<T> {
        let c = self.map.remove(&id)?;
        c.call().finish();
        Some(c)
    }

    /// No new calls from now on (the server sends GOAWAY).
    pub(crate) fn drain(&mut self) {
        self.draining = true;
    }

    /// The connection is gone: every call is taken out and finished, and new ones fail
    /// with `status`.
    pub(crate) fn close(&mut self, status: Status) -> impl Iterator<Item = T> + '_ {
        self.closed.get_or_insert(status);
        self.map.drain().map(|(_, c)| {
            c.call().finish();
            c
        })
    }

    pub(crate) fn closed(&self) -> Option<&Status> {
        self.closed.as_ref()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    //! A client table and a server table against each other over a simulated connection:
    //! the same packet encoder, demultiplexer and window accounting as the real sides,
    //! with a seeded scheduler choosing what happens next (who sends, who reads, which
    //! reader takes its bytes, when the server goes away). Deterministic per seed.

    use std::collections::{BTreeMap, VecDeque};
    use std::sync::Arc;

    use bytes::Bytes;
    use http::{HeaderMap, HeaderValue, StatusCode};
    use proptest::prelude::Rng as _;
    use proptest::test_runner::{RngAlgorithm, TestRng};
    use tonic::Code;

    use super::*;
    use crate::grpc::demux::Demux;
    use crate::grpc::pump::trailers_only;
    use crate::grpc::wire::{Head, Limits, Trailers};
    use crate::grpc::{CallShared, WINDOW, attach};

    /// The simulated connection's inline limit (its eager threshold less the packet's room).
    const INLINE_MAX: usize = 8 * 1024;

    /// Seeded: a seed replays its run exactly.
    struct Rng(TestRng);

    impl Rng {
        fn new(seed: u64) -> Rng {
            let mut bytes = [0u8; 32];
            bytes[..8].copy_from_slice(&seed.to_le_bytes());
            Rng(TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
        }
        fn next(&mut self) -> u64 {
            self.0.next_u64()
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
        fn chance(&mut self, percent: usize) -> bool {
            self.below(100) < percent
        }
    }

    struct Slotted(Arc<CallShared>);

    impl Slot for Slotted {
        fn call(&self) -> &CallShared {
            &self.0
        }
    }

    /// One direction of the connection: its transport messages, in order (a large body
    /// frame is a two-part message's second part).
    #[derive(Default)]
    struct Wire(VecDeque<(Bytes, Option<Bytes>)>);

    impl Wire {
        fn send(&mut self, mut p: Packet, data: Option<Bytes>) {
            let next = attach(&mut p, data, INLINE_MAX);
            self.0.push_back((p.encode().expect("encode"), next));
        }
    }

    /// What one call does: its request and response frames, and how it ends.
    struct Plan {
        req: Vec<Bytes>,
        resp: Vec<Bytes>,
        /// The client cancels after sending this many request frames.
        cancel_after: Option<usize>,
        /// The server's handler fails (a reset) once the request is in.
        server_resets: bool,
    }

    #[derive(Debug, PartialEq)]
    enum Outcome {
        Ok,
        Refused(Code),
        Cancelled,
        Reset,
    }

    /// A reader's side of a call: what it received, what it has yet to take.
    #[derive(Default)]
    struct Reader {
        got: Vec<Bytes>,
        untaken: VecDeque<usize>,
        consumed: i64,
    }

    impl Reader {
        fn take(&mut self, call: &CallShared) -> Option<u32> {
            let len = self.untaken.pop_front()?;
            call.consumed(&mut self.consumed, len)
        }
    }

    struct ClientCall {
        id: u32,
        call: Arc<CallShared>,
        sent: usize,
        req_ended: bool,
        reader: Reader,
        outcome: Option<Outcome>,
    }

    struct ServerCall {
        plan: usize,
        call: Arc<CallShared>,
        reader: Reader,
        req_ended: bool,
        sent_head: bool,
        sent: usize,
        /// The handler's future is gone (answered, failed or cancelled).
        done: bool,
    }

    fn has_window(call: &CallShared) -> bool {
        *call.send_window.lock().expect("window") > 0
    }

    fn status_of(headers: &HeaderMap) -> Option<Code> {
        let v = headers
            .get("grpc-status")?
            .to_str()
            .ok()?
            .parse::<i32>()
            .ok()?;
        Some(Code::from(v))
    }

    /// Figures the sim asserts were reached at least once over all seeds.
    #[derive(Default, Debug)]
    struct Seen {
        window_waits: usize,
        refused_at_limit: usize,
        refused_draining: usize,
        goaways: usize,
        ok: usize,
        cancelled: usize,
        reset: usize,
        whole: usize,
        requests_repeated: usize,
        answers_repeated: usize,
    }

    struct Sim {
        rng: Rng,
        plans: Vec<Plan>,
        client: CallTable<Slotted>,
        server: CallTable<Slotted>,
        c2s: Wire,
        s2c: Wire,
        client_demux: Demux,
        server_demux: Demux,
        /// By plan index; the ids are the client table's.
        calls: Vec<Option<ClientCall>>,
        by_id: BTreeMap<u32, usize>,
        served: BTreeMap<u32, ServerCall>,
        /// What the server got of each plan's request, once it got all of it.
        requests: BTreeMap<usize, Vec<Bytes>>,
        next_plan: usize,
        went_away: bool,
        seen: Seen,
    }

    const MAX_CALLS: usize = 4;

    fn payload(rng: &mut Rng, pool: &Bytes) -> Bytes {
        let len = if rng.chance(60) {
            1 + rng.below(INLINE_MAX + 64)
        } else {
            1 + rng.below(5 << 20)
        };
        let at = rng.below(pool.len() - len);
        pool.slice(at..at + len)
    }

    impl Sim {
        fn new(seed: u64, pool: &Bytes) -> Sim {
            let mut rng = Rng::new(seed);
            let n = 4 + rng.below(10);
            let small = |rng: &mut Rng| {
                let len = 1 + rng.below(INLINE_MAX - 1);
                let at = rng.below(pool.len() - len);
                pool.slice(at..at + len)
            };
            let plans = (0..n)
                .map(|_| {
                    // Often a plain unary call, one small message each way, as most
                    // traffic is: those go whole, and their heads repeat.
                    if rng.chance(40) {
                        return Plan {
                            req: vec![small(&mut rng)],
                            resp: vec![small(&mut rng)],
                            cancel_after: None,
                            server_resets: false,
                        };
                    }
                    let req: Vec<Bytes> =
                        (0..rng.below(8)).map(|_| payload(&mut rng, pool)).collect();
                    let resp = (0..rng.below(8)).map(|_| payload(&mut rng, pool)).collect();
                    let cancel_after = rng.chance(15).then(|| rng.below(req.len() + 1));
                    let server_resets = rng.chance(10);
                    Plan {
                        req,
                        resp,
                        cancel_after,
                        server_resets,
                    }
                })
                .collect::<Vec<_>>();
            Sim {
                calls: (0..plans.len()).map(|_| None).collect(),
                plans,
                rng,
                client: CallTable::new(Side::Client, usize::MAX),
                server: CallTable::new(Side::Server, MAX_CALLS),
                c2s: Wire::default(),
                s2c: Wire::default(),
                client_demux: Demux::new(false, Limits::default()),
                server_demux: Demux::new(true, Limits::default()),
                by_id: BTreeMap::new(),
                served: BTreeMap::new(),
                requests: BTreeMap::new(),
                next_plan: 0,
                went_away: false,
                seen: Seen::default(),
            }
        }

        /// The client starts the next planned call.
        fn open(&mut self) {
            let i = self.next_plan;
            self.next_plan += 1;
            let call = CallShared::new();
            // A request with nothing to wait for goes whole, in its head's packet, as a
            // whole unary call of the direct path: with the same head every time, so
            // that the demultiplexers see repeats.
            let plan = &self.plans[i];
            let whole = plan.cancel_after.is_none()
                && plan.req.len() <= 1
                && plan.req.iter().all(|d| d.len() <= INLINE_MAX);
            let opened = if whole {
                self.client.open_whole(Slotted(call.clone()))
            } else {
                self.client.open(Slotted(call.clone()))
            };
            let id = match opened {
                Ok(id) => id,
                Err(s) => {
                    assert!(self.went_away, "a call refused locally before any GOAWAY");
                    assert_eq!(s.code(), Code::Unavailable);
                    self.seen.refused_draining += 1;
                    self.calls[i] = Some(ClientCall {
                        id: u32::MAX,
                        call,
                        sent: 0,
                        req_ended: true,
                        reader: Reader::default(),
                        outcome: Some(Outcome::Refused(Code::Unavailable)),
                    });
                    return;
                }
            };
            let mut headers = HeaderMap::new();
            headers.insert("x-sim", HeaderValue::from_static("1"));
            if !whole {
                headers.insert("x-plan", HeaderValue::from(i));
            }
            let mut p = Packet::new(id);
            p.head = Some(Head::Request {
                path: http::uri::PathAndQuery::from_static("/sim.Sim/Call"),
                headers,
                standard: None,
            });
            let mut data = None;
            let mut sent = 0;
            if whole {
                p.end = true;
                data = self.plans[i].req.first().cloned();
                sent = self.plans[i].req.len();
                if let Some(d) = &data {
                    assert!(call.try_acquire(d.len()), "a new call has its window");
                }
            }
            let req_ended = p.end;
            self.c2s.send(p, data);
            call.head_sent.set();
            self.by_id.insert(id, i);
            self.calls[i] = Some(ClientCall {
                id,
                call,
                sent,
                req_ended,
                reader: Reader::default(),
                outcome: None,
            });
        }

        /// The client's next step on call `i`'s request.
        fn client_send(&mut self, i: usize) {
            let plan = &self.plans[i];
            let Some(c) = self.calls[i].as_mut() else {
                return;
            };
            if plan.cancel_after == Some(c.sent) {
                // As the call's guard does when the caller drops the call.
                c.req_ended = true;
                if self.client.remove(c.id).is_some() {
                    let mut p = Packet::new(c.id);
                    p.reset = true;
                    self.c2s.send(p, None);
                    c.outcome = Some(Outcome::Cancelled);
                    self.seen.cancelled += 1;
                }
                return;
            }
            if c.sent < plan.req.len() {
                let d = plan.req[c.sent].clone();
                if !c.call.try_acquire(d.len()) {
                    self.seen.window_waits += 1;
                    return;
                }
                c.sent += 1;
                self.c2s.send(Packet::new(c.id), Some(d));
            } else {
                c.req_ended = true;
                let mut p = Packet::new(c.id);
                p.end = true;
                self.c2s.send(p, None);
            }
        }

        /// The server's handler of call `id` takes its next step.
        fn server_send(&mut self, id: u32) {
            let Some(s) = self.served.get_mut(&id) else {
                return;
            };
            let plan = &self.plans[s.plan];
            if plan.server_resets {
                let mut p = Packet::new(id);
                p.reset = true;
                self.s2c.send(p, None);
                s.done = true;
                self.server.end(id, &s.call);
                return;
            }
            let mut p = Packet::new(id);
            if !s.sent_head {
                s.sent_head = true;
                p.head = Some(Head::Response {
                    status: StatusCode::OK,
                    headers: HeaderMap::new(),
                    standard: None,
                });
            }
            let mut data = None;
            if s.sent < plan.resp.len() {
                let d = plan.resp[s.sent].clone();
                if !s.call.try_acquire(d.len()) {
                    self.seen.window_waits += 1;
                    if p.head.is_some() {
                        self.s2c.send(p, None);
                    }
                    return;
                }
                s.sent += 1;
                data = Some(d);
            }
            // The trailers ride with the last frame when it rides inline (a whole answer).
            let last_inline = data.as_ref().is_none_or(|d| d.len() <= INLINE_MAX);
            if s.sent == plan.resp.len() && last_inline {
                // As the server's direct route ends an answer.
                p.trailers = Some(Trailers::Ok);
                if p.head.is_some() {
                    self.seen.whole += 1;
                }
                s.done = true;
                self.server.end(id, &s.call);
            }
            self.s2c.send(p, data);
        }

        /// The server takes one message off the connection.
        fn server_read(&mut self) {
            let Some(msg) = self.c2s.0.pop_front() else {
                return;
            };
            let before = self.server_demux.repeats();
            let (mut p, data) = self.server_demux.push(msg).expect("honest framing");
            self.seen.requests_repeated += (self.server_demux.repeats() - before) as usize;
            let id = p.call;
            if let Some(Head::Request { headers, .. }) = p.head.take() {
                assert!(
                    headers.contains_key("x-sim"),
                    "the request's headers arrive"
                );
                // A whole call's head is the same for every call: its plan is known by
                // its id.
                let plan = match headers.get("x-plan") {
                    Some(v) => v
                        .to_str()
                        .ok()
                        .and_then(|v| v.parse::<usize>().ok())
                        .expect("the request's plan arrives"),
                    None => self.by_id[&id],
                };
                match self.server.admit(id).expect("ids are never reused") {
                    Admit::Refuse(status) => {
                        if status.code() == Code::ResourceExhausted {
                            self.seen.refused_at_limit += 1;
                        } else {
                            assert!(self.went_away);
                            self.seen.refused_draining += 1;
                        }
                        self.s2c.send(trailers_only(id, status), None);
                        return;
                    }
                    Admit::Open => {}
                }
                let call = CallShared::new();
                self.server.insert(id, Slotted(call.clone()));
                self.served.insert(
                    id,
                    ServerCall {
                        plan,
                        call,
                        reader: Reader::default(),
                        req_ended: false,
                        sent_head: false,
                        sent: 0,
                        done: false,
                    },
                );
            }
            let len = data.as_ref().map(Bytes::len);
            let cancelled = match self.server.packet(&p, len) {
                Verdict::Dropped => return,
                Verdict::Overrun(_) => panic!("an honest client overran call {id}'s window"),
                Verdict::Call(Entry::Ended(_)) => panic!("a server's table ends no call itself"),
                Verdict::Call(Entry::Live(_)) => false,
                Verdict::Call(Entry::Cancelled(_)) => true,
            };
            let s = self
                .served
                .get_mut(&id)
                .expect("a call in the table is served");
            assert!(!s.done, "a packet reached a call whose future is gone");
            if let Some(d) = data {
                s.reader.untaken.push_back(d.len());
                s.reader.got.push(d);
            }
            if p.end {
                s.req_ended = true;
                self.requests.insert(s.plan, s.reader.got.clone());
            }
            if cancelled {
                // The handler's future is dropped, and with it the call.
                s.done = true;
                self.server.end(id, &s.call);
            }
        }

        /// The client takes one message off the connection.
        fn client_read(&mut self) {
            let Some(msg) = self.s2c.0.pop_front() else {
                return;
            };
            let before = self.client_demux.repeats();
            let (mut p, data) = self.client_demux.push(msg).expect("honest framing");
            self.seen.answers_repeated += (self.client_demux.repeats() - before) as usize;
            if p.goaway {
                assert!(!self.went_away || p.call == 0);
            }
            let len = data.as_ref().map(Bytes::len);
            let ended = match self.client.packet(&p, len) {
                Verdict::Dropped => return,
                Verdict::Overrun(_) => panic!("an honest server overran call {}'s window", p.call),
                Verdict::Call(Entry::Cancelled(_)) => panic!("only a server's table cancels"),
                Verdict::Call(Entry::Live(_)) => false,
                Verdict::Call(Entry::Ended(_)) => true,
            };
            let i = self.by_id[&p.call];
            let c = self.calls[i].as_mut().expect("an open call");
            let head_status = match p.head.take() {
                Some(Head::Response { headers, .. }) => status_of(&headers),
                _ => None,
            };
            if let Some(d) = data {
                c.reader.untaken.push_back(d.len());
                c.reader.got.push(d);
            }
            if !ended {
                return;
            }
            let code = head_status.or_else(|| {
                p.trailers.as_ref().and_then(|t| match t {
                    Trailers::Ok | Trailers::OkInHead => Some(Code::Ok),
                    Trailers::Map(m) => status_of(m),
                })
            });
            c.outcome = Some(if p.reset {
                self.seen.reset += 1;
                Outcome::Reset
            } else {
                match code {
                    Some(Code::Ok) => {
                        self.seen.ok += 1;
                        Outcome::Ok
                    }
                    Some(code) => Outcome::Refused(code),
                    None => panic!("call {} ended with no status", p.call),
                }
            });
        }

        /// One reader (client or server) takes one frame it received.
        fn take(&mut self, client: bool, key: usize) {
            if client {
                let Some(c) = self.calls[key].as_mut() else {
                    return;
                };
                if let Some(w) = c.reader.take(&c.call) {
                    let mut p = Packet::new(c.id);
                    p.window = Some(w);
                    self.c2s.send(p, None);
                }
            } else {
                let id = key as u32;
                let Some(s) = self.served.get_mut(&id) else {
                    return;
                };
                if let Some(w) = s.reader.take(&s.call) {
                    let mut p = Packet::new(id);
                    p.window = Some(w);
                    self.s2c.send(p, None);
                }
            }
        }

        /// Whether a sender has more to send and no window for it.
        fn waits_for_window(&self) -> bool {
            let client = self.calls.iter().flatten().enumerate().any(|(i, c)| {
                c.outcome.is_none() && c.sent < self.plans[i].req.len() && !has_window(&c.call)
            });
            let server = self
                .served
                .values()
                .any(|s| !s.done && s.sent < self.plans[s.plan].resp.len() && !has_window(&s.call));
            client || server
        }

        /// Everything that could happen next.
        fn choices(&self) -> Vec<Step> {
            let mut out = Vec::new();
            if self.next_plan < self.plans.len() {
                out.push(Step::Open);
            }
            if !self.c2s.0.is_empty() {
                out.push(Step::ServerRead);
            }
            if !self.s2c.0.is_empty() {
                out.push(Step::ClientRead);
            }
            if !self.went_away && self.next_plan > 0 {
                out.push(Step::GoAway);
            }
            for (i, c) in self.calls.iter().enumerate() {
                let Some(c) = c else { continue };
                let live = c.outcome.is_none();
                let cancel_now = self.plans[i].cancel_after == Some(c.sent);
                if live && !c.req_ended && (cancel_now || has_window(&c.call)) {
                    out.push(Step::ClientSend(i));
                }
                if !c.reader.untaken.is_empty() {
                    out.push(Step::Take(true, i));
                }
            }
            for (&id, s) in &self.served {
                let more = s.sent < self.plans[s.plan].resp.len();
                if !s.done && s.req_ended && (!more || !s.sent_head || has_window(&s.call)) {
                    out.push(Step::ServerSend(id));
                }
                if !s.reader.untaken.is_empty() {
                    out.push(Step::Take(false, id as usize));
                }
            }
            out
        }

        fn run(&mut self) {
            for _ in 0..1_000_000 {
                let choices = self.choices();
                if choices.is_empty() {
                    return;
                }
                self.seen.window_waits += usize::from(self.waits_for_window());
                // GOAWAY is rare: most runs should get some calls through first.
                let mut step = choices[self.rng.below(choices.len())];
                if matches!(step, Step::GoAway) && !self.rng.chance(1) {
                    step = choices[0];
                }
                match step {
                    Step::Open => self.open(),
                    Step::ClientSend(i) => self.client_send(i),
                    Step::ServerSend(id) => self.server_send(id),
                    Step::ServerRead => self.server_read(),
                    Step::ClientRead => self.client_read(),
                    Step::Take(client, key) => self.take(client, key),
                    Step::GoAway => {
                        self.went_away = true;
                        self.seen.goaways += 1;
                        self.server.drain();
                        let mut p = Packet::new(0);
                        p.goaway = true;
                        self.s2c.send(p, None);
                    }
                }
                assert!(
                    self.server.len() <= MAX_CALLS,
                    "the server holds more calls than its limit"
                );
            }
            panic!("the simulation did not settle in a million steps");
        }

        /// What must hold once nothing more can happen.
        fn check(&self, seed: u64) {
            assert_eq!(
                self.client.len(),
                0,
                "seed {seed}: calls left in the client's table"
            );
            assert_eq!(
                self.server.len(),
                0,
                "seed {seed}: calls left in the server's table"
            );
            for (i, plan) in self.plans.iter().enumerate() {
                let c = self.calls[i].as_ref().expect("every plan was started");
                let outcome = c.outcome.as_ref().unwrap_or_else(|| {
                    panic!("seed {seed}: call {i} never ended (stuck on window?)")
                });
                let refused = matches!(
                    outcome,
                    Outcome::Refused(Code::ResourceExhausted | Code::Unavailable)
                );
                match outcome {
                    Outcome::Ok => {
                        assert!(
                            plan.cancel_after.is_none() && !plan.server_resets,
                            "seed {seed}: call {i} should not have ended well"
                        );
                        assert_eq!(
                            self.requests.get(&i),
                            Some(&plan.req),
                            "seed {seed}: call {i}'s request arrived changed"
                        );
                        assert_eq!(c.reader.got, plan.resp, "seed {seed}: call {i}'s response");
                    }
                    Outcome::Cancelled => assert!(plan.cancel_after.is_some()),
                    Outcome::Reset => assert!(plan.server_resets),
                    _ => assert!(refused, "seed {seed}: call {i} ended {outcome:?}"),
                }
            }
        }
    }

    #[derive(Clone, Copy, Debug)]
    enum Step {
        Open,
        ClientSend(usize),
        ServerSend(u32),
        ServerRead,
        ClientRead,
        Take(bool, usize),
        GoAway,
    }

    fn slot() -> Slotted {
        Slotted(CallShared::new())
    }

    #[test]
    fn a_reused_id_breaks_the_framing_and_a_full_server_refuses() {
        let mut t = CallTable::new(Side::Server, 2);
        assert!(matches!(t.admit(1), Ok(Admit::Open)));
        t.insert(1, slot());
        let e = t.admit(1).expect_err("an id in use").to_string();
        assert!(e.contains("call id 1 opened twice"), "{e}");
        t.insert(2, slot());
        match t.admit(3) {
            Ok(Admit::Refuse(s)) => {
                assert_eq!(s.code(), Code::ResourceExhausted);
                assert!(
                    s.message().contains("max_concurrent_calls"),
                    "{}",
                    s.message()
                );
            }
            other => panic!("{other:?}"),
        }
        t.drain();
        match t.admit(3) {
            Ok(Admit::Refuse(s)) => assert_eq!(s.code(), Code::Unavailable),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_overrun_takes_the_call_out_on_either_side() {
        for side in [Side::Client, Side::Server] {
            let mut t = CallTable::new(side, 8);
            let id = match side {
                Side::Client => t.open(slot()).expect("open"),
                Side::Server => {
                    t.insert(5, slot());
                    5
                }
            };
            let p = Packet::new(id);
            assert!(matches!(
                t.packet(&p, Some(WINDOW as usize)),
                Verdict::Call(_)
            ));
            match t.packet(&p, Some(1)) {
                Verdict::Overrun(c) => assert!(c.0.done.is_set(), "its state is finished"),
                _ => panic!("a frame past the window is an overrun"),
            }
            assert_eq!(t.len(), 0);
            assert!(matches!(t.packet(&p, Some(1)), Verdict::Dropped));
        }
    }

    #[test]
    fn a_cancelled_server_call_stays_until_its_future_is_gone() {
        let mut t = CallTable::new(Side::Server, 8);
        let first = slot();
        let first_call = first.0.clone();
        t.insert(3, first);
        let mut reset = Packet::new(3);
        reset.reset = true;
        assert!(matches!(
            t.packet(&reset, None),
            Verdict::Call(Entry::Cancelled(_))
        ));
        assert!(first_call.done.is_set());
        assert_eq!(t.len(), 1, "it still counts against the limit");
        t.end(3, &first_call);
        assert_eq!(t.len(), 0);
        // An old future ending never takes out a newer call that has the same id.
        t.insert(3, slot());
        t.end(3, &first_call);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn whole_unary_calls_get_odd_ids_and_others_even_ones_never_reused_at_once() {
        let mut t = CallTable::new(Side::Client, usize::MAX);
        let mut last = None;
        for whole in [true, false, false, true, true, false] {
            let id = if whole {
                t.open_whole(slot())
            } else {
                t.open(slot())
            }
            .expect("open");
            assert_eq!(super::super::wire::whole_unary(id), whole, "{id}");
            assert!(last.is_none_or(|l| id > l), "{id} after {last:?}");
            // Gone at once, as a call that the client gave up on: its id is not the next.
            t.remove(id);
            last = Some(id);
        }
    }

    #[test]
    fn the_client_ends_a_call_on_the_servers_end_and_stops_opening_on_goaway() {
        let mut t = CallTable::new(Side::Client, usize::MAX);
        let a = t.open(slot()).expect("open");
        let b = t.open(slot()).expect("open");
        assert_ne!(a, b);
        let mut end = Packet::new(a);
        end.end = true;
        assert!(matches!(
            t.packet(&end, None),
            Verdict::Call(Entry::Ended(_))
        ));
        assert!(
            matches!(t.packet(&end, None), Verdict::Dropped),
            "a stale packet"
        );
        let mut goaway = Packet::new(0);
        goaway.goaway = true;
        assert!(matches!(t.packet(&goaway, None), Verdict::Dropped));
        let s = t.open(slot()).expect_err("draining");
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(t.len(), 1, "the call in flight goes on");
        let gone = tonic::Status::unavailable("connection lost");
        assert_eq!(t.close(gone).count(), 1);
        assert_eq!(
            t.open(slot()).expect_err("closed").message(),
            "connection lost"
        );
    }

    #[test]
    fn a_simulated_pair_settles_every_call_with_its_bytes_and_leaves_no_state() {
        let mut rng = Rng::new(7);
        let pool = Bytes::from((0..6 << 20).map(|_| rng.next() as u8).collect::<Vec<u8>>());
        let mut seen = Seen::default();
        for seed in 0..150 {
            let mut sim = Sim::new(seed, &pool);
            sim.run();
            sim.check(seed);
            let s = sim.seen;
            seen.window_waits += s.window_waits;
            seen.refused_at_limit += s.refused_at_limit;
            seen.refused_draining += s.refused_draining;
            seen.goaways += s.goaways;
            seen.ok += s.ok;
            seen.cancelled += s.cancelled;
            seen.reset += s.reset;
            seen.whole += s.whole;
            seen.requests_repeated += s.requests_repeated;
            seen.answers_repeated += s.answers_repeated;
        }
        // The schedule reached every rule at least once.
        assert!(seen.window_waits > 0, "{seen:?}");
        assert!(seen.refused_at_limit > 0, "{seen:?}");
        assert!(seen.refused_draining > 0, "{seen:?}");
        assert!(seen.goaways > 0, "{seen:?}");
        assert!(
            seen.ok > 0 && seen.cancelled > 0 && seen.reset > 0,
            "{seen:?}"
        );
        assert!(seen.whole > 0, "{seen:?}");
        // Whole calls' heads repeat both ways (and the demultiplexers skip decoding them).
        assert!(
            seen.requests_repeated > 0 && seen.answers_repeated > 0,
            "{seen:?}"
        );
    }
}
