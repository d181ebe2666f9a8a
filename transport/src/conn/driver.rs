//! The connection driver: one tokio task per connection that binds a sans-IO core to a
//! provider link (quinn's `ConnectionDriver` shape).
//!
//! Application calls lock [`Shared::state`], feed the core and wake the driver; the driver
//! moves frames between core and link, carries out the core's actions and hands delivered
//! messages to the application. The lock is never held across an `.await`, and nothing that
//! may run inside it (drops of delivered views, remote buffers) takes it again: those go
//! through [`Shared::released`].

use std::any::Any;
use std::collections::VecDeque;

use crate::map::Map;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use tokio::sync::{Notify, oneshot};

use crate::error::Error;
use crate::link::{Link, LinkEvent, LinkInfo, RecvBuf, Work};
use crate::pool::Pool;
use crate::proto::{self, Action, Delivery, MsgId, RecvMode, Transmit};

/// Read ids at or above this belong to `read_remote`, below it to the core.
pub(crate) const API_READ_BIT: u64 = 1 << 63;
/// Link events handled per driver turn before frames go out again (fairness).
const EVENTS_PER_TURN: usize = 64;
/// How long a closed connection waits for its link to deliver its last frames (the core's
/// `Close` among them) before it drops the link anyway. A link may still hold sent work
/// after `close` (verbs: sends not yet acknowledged, which dropping the queue pair would
/// discard); a healthy peer takes milliseconds, and only a dead or stalled one (a verbs peer
/// that posts no receives) makes a close wait this long.
const CLOSE_LINGER: Duration = Duration::from_secs(5);

/// Something dropped outside the lock that the driver must act on.
pub(crate) enum Released {
    /// A mapped (zero-copy) message view was dropped: the sender may reuse its buffer.
    View(MsgId),
    /// A [`crate::RemoteBuf`] was dropped: withdraw its exposure.
    Exposure(u64),
}

/// State shared between the application handles and the driver task.
pub(crate) struct Shared {
    pub state: Mutex<State>,
    pub driver_waker: AtomicWaker,
    /// Woken when messages are delivered, the handshake completes or the connection closes.
    pub changed: Notify,
    /// Woken when the send queue drains.
    pub send_space: Notify,
    pub released: Mutex<Vec<Released>>,
    /// Serialises receivers: messages are ordered, so concurrent receivers make no sense,
    /// and it keeps posted `recv_into` buffers matched to the right message.
    pub recv_lock: tokio::sync::Mutex<()>,
    /// Tasks waiting in [`super::Connection::poll_recv`]: woken with `changed`'s waiters.
    pub readers: Mutex<Vec<std::task::Waker>>,
    /// `info.registrar` is set (fixed for the connection's life): lets sends skip the lock
    /// when there is nothing to stage.
    pub registers: bool,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock would be a bug in Ibex; keep serving rather than
        // cascading it into every caller.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn wake_driver(&self) {
        self.driver_waker.wake();
    }

    /// Wakes everything waiting for news: `changed`'s waiters and `poll_recv` readers.
    pub fn notify_changed(&self) {
        self.changed.notify_waiters();
        let lock = || self.readers.lock().unwrap_or_else(|e| e.into_inner());
        // Woken outside the lock (a waker may run code); the emptied list goes back for the
        // next registrations, so a round trip allocates no list.
        let mut readers = std::mem::take(&mut *lock());
        for w in readers.drain(..) {
            w.wake();
        }
        let mut now = lock();
        if now.is_empty() {
            *now = readers;
        }
    }

    pub fn release(&self, r: Released) {
        self.released
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(r);
        self.wake_driver();
    }
}

/// A message ready for the application.
pub(crate) enum ReadyMsg {
    Bytes(MsgId, Bytes),
    /// A two-part message: its head (from the RTS) and the bytes read after it.
    Parts(MsgId, Bytes, Bytes),
    /// Landed in a buffer posted by `recv_into` (identified by `token`).
    User {
        msg: MsgId,
        buf: RecvBuf,
        len: usize,
        token: u64,
    },
}

impl ReadyMsg {
    fn with_head(msg: MsgId, head: Bytes, body: Bytes) -> ReadyMsg {
        if head.is_empty() {
            ReadyMsg::Bytes(msg, body)
        } else {
            ReadyMsg::Parts(msg, head, body)
        }
    }

    /// The message as it came: its bytes, or a two-part message's head and body.
    pub fn into_parts(self) -> Parts {
        match self {
            ReadyMsg::Bytes(_, b) => (b, None),
            ReadyMsg::Parts(_, head, body) => (head, Some(body)),
            ReadyMsg::User { buf, len, .. } => (buf.into_bytes().slice(..len), None),
        }
    }

    /// Bytes of the whole message.
    pub fn len(&self) -> usize {
        match self {
            ReadyMsg::Bytes(_, b) => b.len(),
            ReadyMsg::Parts(_, head, body) => head.len() + body.len(),
            ReadyMsg::User { len, .. } => *len,
        }
    }

    pub fn msg(&self) -> MsgId {
        match self {
            ReadyMsg::Bytes(m, _) | ReadyMsg::Parts(m, ..) => *m,
            ReadyMsg::User { msg, .. } => *msg,
        }
    }
}

/// A received message as it came: its bytes and `None`, or a two-part message's head and
/// body.
pub(crate) type Parts = (Bytes, Option<Bytes>);

/// A message's bytes from its parts ([`ReadyMsg::into_parts`]): a two-part message's are
/// copied into one buffer.
pub(crate) fn join_parts((first, rest): Parts) -> Bytes {
    let Some(rest) = rest else {
        return first;
    };
    let mut b = bytes::BytesMut::with_capacity(first.len() + rest.len());
    b.extend_from_slice(&first);
    b.extend_from_slice(&rest);
    b.freeze()
}

/// A caller's buffer waiting for the next message (`recv_into`).
pub(crate) struct Posted {
    pub buf: RecvBuf,
    pub token: u64,
}

enum Dest {
    Buf(RecvBuf),
    Mapped(Bytes),
    User(RecvBuf, u64),
}

struct PendingSend {
    exposure: u64,
    done: Option<oneshot::Sender<Result<(), Error>>>,
}

pub(crate) struct ApiRead {
    dst: Option<RecvBuf>,
    /// Registered memory read into instead of `dst`, when the provider needs it.
    staging: Option<RecvBuf>,
    frags_left: usize,
    error: Option<Error>,
    tx: Option<oneshot::Sender<Result<RecvBuf, Error>>>,
}

/// One read for the link: a core fragment or a piece of a `read_remote`.
struct LinkRead {
    id: u64,
    descriptor: Bytes,
    offset: u64,
    /// Destination address; its owner is in `dests` or `api_reads` until the read is done.
    dst: usize,
    len: usize,
}

/// Everything behind the lock.
pub(crate) struct State {
    /// The link's [`crate::link::ReadyHint`], if it has one: watched by a receiver reading
    /// inline between an empty read and going back to its runtime.
    pub hint: Option<Arc<dyn crate::link::ReadyHint>>,
    pub core: proto::Connection,
    pub link: Option<Box<dyn Link>>,
    pub info: LinkInfo,
    pub pool: Option<Arc<Pool>>,
    pending_tx: Option<Transmit>,
    sends: Map<MsgId, PendingSend>,
    dests: Map<MsgId, Dest>,
    pub delivered: VecDeque<ReadyMsg>,
    /// Messages the application has taken so far (= the id of the next one it will take).
    pub consumed: u64,
    pub posted: Option<Posted>,
    pub next_token: u64,
    api_reads: Map<u64, ApiRead>,
    api_frags: Map<u64, u64>,
    next_api_id: u64,
    /// Reads the link has outstanding, the core's and `read_remote`'s together: at most
    /// `info.read_depth`.
    reads_posted: usize,
    /// Reads waiting for room under the link's read depth, oldest first.
    read_wait: VecDeque<LinkRead>,
    probe_exposure: Option<u64>,
    pub closed: Option<Error>,
    /// Destinations that reads may still target: freed only after the link is gone.
    graveyard: Vec<Box<dyn Any + Send>>,
    /// The link was told to close (its last frame went out): when the wait for it to
    /// deliver them ends ([`CLOSE_LINGER`]).
    link_linger: Option<Instant>,
    pub close_requested: bool,
    /// What the peer's `Close` says when this side asked to close (empty: nothing to say).
    pub close_reason: String,
    /// A receiver found nothing and is about to sleep: the driver busy-polls its budget
    /// first, because a reply usually arrives within microseconds.
    pub spin_requested: bool,
    /// Whether receivers may request spinning ([`super::Connection::set_busy_poll`]).
    pub busy_poll: bool,
    /// Receivers that read the link themselves ([`State::read_inline`]).
    pub inline: InlineRead,
    /// A receiver's inline read brought credits that made room in a full send queue: the
    /// senders waiting for room must be woken (the driver wakes them after its own turns;
    /// the credits read inline, with the queue then drained inline too, left them asleep
    /// for good: 1000 concurrent gRPC calls hung about one run in twenty with
    /// busy-polling).
    pub space_freed: bool,
    /// Copies a receiver reading inline took from the link to run itself, with the lock
    /// released ([`State::take`], [`super::Connection::try_take`]).
    pub inline_work: Vec<Work>,
    /// Batches of such copies running now: the link (and the destinations in the
    /// graveyard) must outlive them, so the driver does not drop it before they are done.
    pub work_out: usize,
    pub stats: super::ConnStats,
    /// For guards that report drops back to the driver.
    self_ref: std::sync::Weak<Shared>,
}

/// Whoever waits, reads: a receiver that finds nothing delivered polls the link itself
/// ([`State::read_inline`]) and spins on it for the spin budget, so a message that comes
/// within the budget is handled on the receiver's own task, with no hop through the
/// driver task (on 2 cores, half a microsecond each way: the driver's turn, a wake-up and
/// a task switch). Polling without arming the link's sleep leaves it unarmed; the lease
/// says until when a receiver may be back for it, and the driver arms the link once the
/// lease has run out, so a receiver that stops spinning (or is dropped) never strands a
/// message.
#[derive(Default)]
pub(crate) struct InlineRead {
    /// The receiver spinning now, and when its spin began. One at a time: it reads for
    /// everyone (the others are woken by what it delivers).
    spinner: Option<(std::task::Waker, Instant)>,
    /// The link stays unarmed until then (a receiver is spinning or just read a message
    /// and is likely back within its budget); the driver arms it after.
    pub lease: Option<Instant>,
    /// Receivers were told to wait while another spun: the spinner must not keep the
    /// link once it has its own message.
    others_wait: bool,
    /// When the driver's timer fires, if it is set for a lease.
    backstop: Option<Instant>,
    /// Whether spinning pays, counted in waits as the driver's own spin does.
    adapt: SpinAdapt,
    /// The current wait (since the last message taken) asked `adapt` already, and its
    /// answer: a receiver is polled many times per wait (every wake of a task that also
    /// waits on other things), and counting those polls used the back-off up at once.
    asked: Option<bool>,
    /// The spin budget ([`crate::Config::spin`]); under
    /// [`crate::config::INLINE_READ_MIN_SPIN`], receivers never read inline.
    pub spin: Duration,
    /// How long spins that caught their message waited, smoothed (nanoseconds).
    hit_wait_ns: u64,
    os_yield: OsYield,
}

impl InlineRead {
    /// The whole budget while spins keep catching their messages; once they have missed
    /// lately, a few times as long as answered spins have been waiting: a miss then costs
    /// a few typical replies' time, not the whole budget, which on a crowded machine is
    /// CPU the peer needs to answer at all. Never under 30 µs: with a 5-20 µs floor, a
    /// 64 B ping-pong's ordinary stragglers missed, slept on the eventfd, and its p99
    /// doubled.
    fn budget(&self) -> Duration {
        if self.hit_wait_ns == 0 || self.adapt.backoff == 0 {
            return self.spin;
        }
        Duration::from_nanos(4 * self.hit_wait_ns)
            .clamp(Duration::from_micros(30).min(self.spin), self.spin)
    }

    /// Answered spins have been waiting at most [`crate::config::INLINE_WATCH_REPLIES`].
    fn replies_are_quick(&self) -> bool {
        self.hit_wait_ns != 0
            && self.hit_wait_ns <= crate::config::INLINE_WATCH_REPLIES.as_nanos() as u64
    }

    fn learn(&mut self, waited: Duration) {
        let w = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.hit_wait_ns = if self.hit_wait_ns == 0 {
            w
        } else {
            (self.hit_wait_ns * 7 + w) / 8
        };
    }
}

/// What a receiver that found nothing delivered should do.
pub(crate) enum Take {
    /// A message as it came ([`ReadyMsg::into_parts`]), or why none will.
    Got(Result<Parts, Error>),
    /// Poll again soon (wake itself): it spins on the link. `true`: first give the thread's
    /// core to the OS ([`OsYield`]).
    Spin(bool),
    /// Sleep until woken (the driver delivers).
    Wait,
}

impl State {
    /// Pops the next delivered message, or the reason the connection closed. The second
    /// value: a full batch of credits is owed (wake the driver).
    fn pop_delivered(&mut self) -> Option<(Result<Parts, Error>, bool)> {
        if let Some(ready) = self.delivered.pop_front() {
            self.inline.asked = None;
            let credit_due = self.consume(ready.msg());
            return Some((Ok(ready.into_parts()), credit_due));
        }
        self.closed.as_ref().map(|e| (Err(e.clone()), false))
    }

    /// Takes the next message for a receiver whose task wakes with `me`, reading the link
    /// itself when the link is worth spinning on ([`InlineRead`]). Returns what the caller
    /// must do after releasing the lock: (what to do, wake the driver, wake the others).
    pub fn take(&mut self, me: &std::task::Waker) -> (Take, bool, bool) {
        let (take, driver, others) = self.take_inner(me);
        // Completions of copies a receiver ran itself raise no readiness on the link.
        // This receiver reads them at its next spin step; if it does not spin on, the
        // driver must, or their message waits for ever (seen under heavy load: the
        // driver's turn ran while the copies ran, and the receiver, told not to spin any
        // more, went to sleep with their completions unread).
        let unread = !matches!(take, Take::Spin(_))
            && self.link.as_ref().is_some_and(|l| l.has_completions());
        (take, driver || unread, others)
    }

    fn take_inner(&mut self, me: &std::task::Waker) -> (Take, bool, bool) {
        let spin = self.inline.spin;
        if let Some((r, credit_due)) = self.pop_delivered() {
            return (Take::Got(r), credit_due, false);
        }
        let inline = self.busy_poll
            && spin >= crate::config::INLINE_READ_MIN_SPIN
            && !self.core.is_closed()
            && self.link.as_ref().is_some_and(|l| l.busy_poll());
        if !inline {
            // The driver delivers; where the link is worth spinning on but inline reads
            // are off, the driver spins for this receiver.
            self.spin_requested = self.busy_poll;
            return (Take::Wait, self.busy_poll, false);
        }
        let mine = match &self.inline.spinner {
            Some((w, _)) => {
                if !w.will_wake(me) {
                    // Another receiver spins and reads for this one too.
                    self.inline.others_wait = true;
                    return (Take::Wait, false, false);
                }
                true
            }
            None => false,
        };
        if !mine
            && !*self
                .inline
                .asked
                .get_or_insert_with(|| self.inline.adapt.may_spin())
        {
            // Spinning has not been paying (more runnable work than cores, a slow peer):
            // leave the link to the driver, armed.
            let lease = self.inline.lease.take().is_some();
            return (Take::Wait, lease, false);
        }
        let now = Instant::now();
        let mut wake = Wake::default();
        let was_full = self.queue_full();
        let mut handled = self.read_inline(&mut wake, now);
        // Nothing yet: watch the link's hint for a moment and read again as soon as it shows
        // something, rather than go back to the runtime for every empty read (250-350 ns
        // through it and the layers above, here). Under the lock, as the read itself is,
        // and only while messages have been coming within a few watches: where they take
        // longer the runtime's round trip is small beside the wait, and the thread is
        // wanted by its other tasks (serve threads run several connections).
        if self.delivered.is_empty()
            && self.closed.is_none()
            && self.inline.replies_are_quick()
            && self.hint.as_ref().is_some_and(|h| watch(h.as_ref()))
        {
            handled |= self.read_inline(&mut wake, now);
        }
        if let Some((r, _)) = self.pop_delivered() {
            if r.is_ok() {
                self.stats.inline_reads += 1;
            }
            if let Some((_, since, ..)) = self.inline.spinner.take() {
                self.inline.adapt.hit_decay();
                self.inline.learn(now.duration_since(since));
            }
            // Likely back within its budget: keep the link unarmed until then. The driver
            // runs once after this task yields: it sends what the message called for
            // (credits, completions) and arms the link if the lease has run out. Unless
            // others wait for messages this one will not be back to read for them: then
            // the driver arms the link now and they are woken (one may spin next).
            let others_wait = std::mem::take(&mut self.inline.others_wait);
            self.inline.lease = (!others_wait).then(|| now + spin);
            let others = others_wait || !self.delivered.is_empty() || self.closed.is_some();
            // What the message called for (an acknowledgement, credits) goes out from here
            // too; the driver is woken only for what needs it: a link that pushed back,
            // copies to run, closing, a lease its timer does not cover, or a link left
            // unarmed with no lease (others wait: the driver must arm it now, since a
            // woken reader that may not spin leaves it to the driver).
            let driver = self.after_inline(now) || others_wait || !self.backstop_covers();
            self.space_freed |= was_full && !self.queue_full();
            return (Take::Got(r), driver, others);
        }
        // A rendezvous message read inline posted its reads; on shm the large ones are
        // copies to run without the lock. The receiver runs them itself as soon as it lets
        // go of the lock: handed to the driver, they waited for its wake-up, a futex and a
        // task switch each way (a 64 KiB raw round trip took 70 µs for 22 µs).
        if handled && self.link.as_ref().is_some_and(|l| l.has_work()) {
            self.inline_work = self
                .link
                .as_mut()
                .map(|l| l.take_work())
                .unwrap_or_default();
            self.work_out += 1;
        }
        let driver = handled && self.after_inline(now);
        self.space_freed |= was_full && !self.queue_full();
        match self.inline.spinner {
            Some((_, since)) if now.duration_since(since) < self.inline.budget() => (
                Take::Spin(self.inline.os_yield.step(now - since, now)),
                driver,
                false,
            ),
            Some((_, since)) => {
                // The budget is spent: the driver arms the link, then sleeps.
                self.inline.spinner = None;
                self.inline.lease = None;
                self.inline.adapt.miss();
                // Only a spin of the whole budget says the machine is crowded: one cut
                // short (the budget shrinks to a few typical replies after a miss) says
                // only that this reply was late.
                if now.duration_since(since) >= self.inline.spin {
                    self.inline.os_yield.missed(now);
                }
                (Take::Wait, true, false)
            }
            None => {
                self.inline.spinner = Some((me.clone(), now));
                self.inline.lease = Some(now + spin);
                // The driver's timer must be set to take the link back in time.
                (Take::Spin(false), driver || !self.backstop_covers(), false)
            }
        }
    }

    /// Reports copies a receiver ran itself ([`State::take`]): their reads complete at the
    /// next look at the link. True if the driver must run now (the connection is closing
    /// and may be waiting for them).
    pub fn inline_work_done(&mut self, done: Vec<(u64, Result<(), Error>)>) -> bool {
        self.work_out -= 1;
        self.stats.inline_copies += done.len() as u64;
        if let Some(link) = self.link.as_mut() {
            for (id, result) in done {
                link.work_done(id, result);
            }
        }
        self.core.is_closed() || self.closed.is_some()
    }

    /// Handles link events on a receiver's task, as the driver would, until one delivers a
    /// message. Polls without arming the link's sleep ([`Link::try_event`]).
    /// Returns true if it handled anything. `now` is the receiver's step's clock: a clock
    /// read costs about as much as taking a small message, and nothing here needs one
    /// fresher than this step's (the probe's samples are answers to frames sent in earlier
    /// steps, each with its own `now`).
    fn read_inline(&mut self, wake: &mut Wake, now: Instant) -> bool {
        let mut handled = false;
        for _ in 0..EVENTS_PER_TURN {
            if !self.delivered.is_empty() || self.closed.is_some() {
                break;
            }
            let Some(ev) = self.link.as_mut().and_then(|l| l.try_event()) else {
                break;
            };
            handled = true;
            let failed = ev.is_err();
            self.handle_event(ev, now, wake);
            if failed {
                break;
            }
        }
        handled
    }

    /// After events were handled inline: sends what they called for (acknowledgements,
    /// credits) and says whether the driver must run now: for a link that pushed back, for
    /// copies to run (an RTS read inline posts its reads, which on shm are link work only
    /// the driver runs; left to the lease they would wait out the whole spin budget), or
    /// to close.
    fn after_inline(&mut self, now: Instant) -> bool {
        let sent = self.transmit_inline(now);
        !sent || self.needs_driver() || self.link.as_ref().is_some_and(|l| l.has_work())
    }

    /// The driver's timer fires no later than the lease ends (it then extends itself to
    /// the lease's new end, if there is one): nothing to tell it.
    fn backstop_covers(&self) -> bool {
        match (self.inline.lease, self.inline.backstop) {
            (None, _) => true,
            (Some(lease), Some(at)) => at <= lease,
            (Some(_), None) => false,
        }
    }

    /// The driver takes the link back once the lease has run out: true if it did.
    fn lease_ran_out(&mut self, now: Instant) -> bool {
        if self.inline.lease.is_none_or(|l| l > now) {
            return false;
        }
        self.inline.lease = None;
        if self.inline.spinner.take().is_some() {
            self.inline.adapt.miss();
            self.inline.os_yield.missed(now);
        }
        true
    }
}

/// Watches `hint` for up to [`crate::config::INLINE_WATCH_PAUSES`] pauses: true as soon as
/// it shows something.
fn watch(hint: &dyn crate::link::ReadyHint) -> bool {
    for _ in 0..crate::config::INLINE_WATCH_PAUSES {
        if hint.ready() {
            return true;
        }
        std::hint::spin_loop();
    }
    hint.ready()
}

/// Wraps a zero-copy view of the peer's pool: when the application drops the last
/// reference, the sender is told it may reuse the buffer.
struct ViewGuard {
    view: Bytes,
    msg: MsgId,
    shared: std::sync::Weak<Shared>,
}

impl AsRef<[u8]> for ViewGuard {
    fn as_ref(&self) -> &[u8] {
        &self.view
    }
}

impl Drop for ViewGuard {
    fn drop(&mut self) {
        if let Some(s) = self.shared.upgrade() {
            s.release(Released::View(self.msg));
        }
    }
}

impl State {
    pub fn new(
        core: proto::Connection,
        link: Box<dyn Link>,
        self_ref: std::sync::Weak<Shared>,
    ) -> State {
        let mut link = link;
        // The driver runs the link's large copies outside the lock (`Driver::poll`).
        link.enable_work();
        let info = link.info();
        let mut core = core;
        core.set_link(info.caps());
        // The pool is asked for on first use (`Connection::pool`): on verbs that registers
        // memory, which must not happen at connect or under this lock.
        let pool = None;
        let stats = super::ConnStats {
            provider: info.provider,
            rendezvous_path: info.rendezvous_path.clone(),
            ..Default::default()
        };
        State {
            hint: link.ready_hint(),
            core,
            link: Some(link),
            info,
            pool,
            pending_tx: None,
            sends: Map::default(),
            dests: Map::default(),
            delivered: VecDeque::new(),
            consumed: 0,
            posted: None,
            next_token: 0,
            api_reads: Map::default(),
            api_frags: Map::default(),
            next_api_id: 0,
            reads_posted: 0,
            read_wait: VecDeque::new(),
            probe_exposure: None,
            closed: None,
            graveyard: Vec::new(),
            inline_work: Vec::new(),
            work_out: 0,
            link_linger: None,
            close_requested: false,
            close_reason: String::new(),
            spin_requested: false,
            busy_poll: true,
            inline: InlineRead::default(),
            space_freed: false,
            stats,
            self_ref,
        }
    }

    pub fn set_probe_exposure(&mut self, id: u64) {
        self.probe_exposure = Some(id);
    }

    /// True when the core has work only the driver does (actions, timers, closing).
    /// The application took message `msg`. True when a full batch of credits is owed:
    /// then the driver must send them now (smaller debts ride on the next frame).
    pub fn consume(&mut self, msg: MsgId) -> bool {
        self.consumed += 1;
        self.core.consumed(msg);
        self.core.credit_due()
    }

    pub fn needs_driver(&self) -> bool {
        self.core.is_closed() || self.close_requested || self.core.has_actions()
    }

    /// True while the threshold probe still holds its buffer.
    pub fn probing(&self) -> bool {
        self.probe_exposure.is_some()
    }

    /// True once the driver has finished: closed and the link released.
    pub fn is_finished(&self) -> bool {
        self.closed.is_some() && self.link.is_none()
    }

    /// Data frames' worth of messages `send` may queue beyond what credits let out:
    /// backpressure without unbounded buffering.
    pub fn send_queue_limit(&self) -> usize {
        256
    }

    /// Senders must wait for room ([`super::Connection::send`]).
    pub fn queue_full(&self) -> bool {
        self.core.queued_data_frames() >= self.send_queue_limit()
    }

    fn closed_error(&self) -> Error {
        self.closed.clone().unwrap_or(Error::LocallyClosed)
    }

    /// Queues one application message at `now`; rendezvous messages are exposed first.
    pub fn send(
        &mut self,
        now: Instant,
        msg: Bytes,
        done: Option<oneshot::Sender<Result<(), Error>>>,
    ) -> Result<(), Error> {
        self.check_sendable()?;
        match self.core.classify(msg.len() as u64)? {
            proto::Protocol::Eager => {
                self.core.send_eager(now, msg)?;
                if let Some(tx) = done {
                    let _ = tx.send(Ok(()));
                }
                Ok(())
            }
            proto::Protocol::Rendezvous => self.send_rendezvous(now, Bytes::new(), msg, done),
        }
    }

    /// Queues a two-part message: `head` in its RTS, `body` by rendezvous whatever its size
    /// ([`super::Connection::send_parts`]).
    pub fn send_parts(&mut self, now: Instant, head: Bytes, body: Bytes) -> Result<(), Error> {
        self.check_sendable()?;
        self.send_rendezvous(now, head, body, None)
    }

    fn check_sendable(&self) -> Result<(), Error> {
        if let Some(e) = &self.closed {
            return Err(e.clone());
        }
        if self.close_requested {
            return Err(Error::LocallyClosed);
        }
        Ok(())
    }

    /// Exposes `msg` and queues its RTS, with `head` in it.
    fn send_rendezvous(
        &mut self,
        now: Instant,
        head: Bytes,
        msg: Bytes,
        done: Option<oneshot::Sender<Result<(), Error>>>,
    ) -> Result<(), Error> {
        let len = msg.len() as u64;
        // Checked before exposing: a refused head costs no registration.
        self.core.check_head(head.len())?;
        let link = self.link.as_mut().ok_or(Error::LocallyClosed)?;
        let exposure = if self.core.link().pushes(msg.len()) {
            link.expose_pushed(msg)?
        } else {
            link.expose(msg)?
        };
        self.stats.count_registration(exposure.registration);
        if exposure.zero_copy {
            self.stats.pool_bytes_sent += len;
        }
        match self.core.send_parts(now, head, len, exposure.descriptor) {
            Ok(id) => {
                self.sends.insert(
                    id,
                    PendingSend {
                        exposure: exposure.id,
                        done,
                    },
                );
                Ok(())
            }
            Err(e) => {
                link.withdraw(exposure.id);
                Err(e)
            }
        }
    }

    /// Exposes a buffer for the peer's one-sided reads outside the message flow.
    pub fn expose(&mut self, buf: Bytes) -> Result<crate::link::Exposure, Error> {
        if let Some(e) = &self.closed {
            return Err(e.clone());
        }
        let link = self.link.as_mut().ok_or(Error::LocallyClosed)?;
        let exposure = link.expose(buf)?;
        self.stats.count_registration(exposure.registration);
        Ok(exposure)
    }

    /// Starts a one-sided read of a peer buffer into `dst`, split into fragments.
    pub fn read_remote(
        &mut self,
        descriptor: &[u8],
        mut dst: RecvBuf,
        tx: oneshot::Sender<Result<RecvBuf, Error>>,
    ) {
        if let Some(e) = &self.closed {
            let _ = tx.send(Err(e.clone()));
            return;
        }
        let Some(link) = self.link.as_mut() else {
            let _ = tx.send(Err(Error::LocallyClosed));
            return;
        };
        let len = dst.len();
        // A peer buffer this side can map (shared pool) is one memcpy away.
        match link.map_remote(descriptor, len as u64) {
            Ok(Some(view)) => {
                dst.as_mut_slice().copy_from_slice(&view[..len]);
                self.stats.remote_read_bytes += len as u64;
                let _ = tx.send(Ok(dst));
                return;
            }
            Ok(None) => {}
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        }
        // Providers that need registered destinations get one of theirs; the data is
        // copied into `dst` when the read completes.
        let mut staging = None;
        if !link.readable_dst(dst.as_slice().as_ptr(), len) {
            match link.alloc_recv(len) {
                Ok(b) => staging = Some(b),
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            }
        }
        let req = API_READ_BIT | self.next_api_id;
        self.next_api_id += 1;
        // Pieces as long as the core's fragments, which the link takes whole.
        let frag = self
            .core
            .fragment_size()
            .clamp(1, self.info.max_read.max(1));
        let nfrags = len.div_ceil(frag).max(1);
        let desc = Bytes::copy_from_slice(descriptor);
        let base = match staging.as_mut() {
            Some(s) => s.as_mut_ptr(),
            None => dst.as_mut_ptr(),
        };
        let mut read = ApiRead {
            dst: None,
            staging: None,
            frags_left: nfrags,
            error: None,
            tx: Some(tx),
        };
        for i in 0..nfrags {
            let off = i * frag;
            let flen = (len - off).min(frag);
            let id = API_READ_BIT | self.next_api_id;
            self.next_api_id += 1;
            // `dst` (or `staging`) is stored in `api_reads` below and only released when
            // every fragment has completed or (on close) after the link is dropped.
            let r = self.submit_read(LinkRead {
                id,
                descriptor: desc.clone(),
                offset: off as u64,
                dst: base as usize + off,
                len: flen,
            });
            match r {
                Ok(()) => {
                    self.api_frags.insert(id, req);
                }
                Err(e) => {
                    read.error.get_or_insert(e);
                    read.frags_left -= 1;
                }
            }
        }
        read.dst = Some(dst);
        read.staging = staging;
        if read.frags_left == 0 {
            self.finish_api_read(read, len);
        } else {
            self.api_reads.insert(req, read);
        }
    }

    fn finish_api_read(&mut self, mut read: ApiRead, len: usize) {
        let Some(tx) = read.tx.take() else { return };
        if let Some(st) = read.staging.take() {
            if read.error.is_none()
                && let Some(d) = read.dst.as_mut()
            {
                d.as_mut_slice().copy_from_slice(st.as_slice());
            }
            // Every fragment has completed: nothing can still write into it.
            drop(st);
        }
        match (read.error.take(), read.dst.take()) {
            (None, Some(dst)) => {
                self.stats.remote_read_bytes += len as u64;
                let _ = tx.send(Ok(dst));
            }
            (Some(e), _) => {
                let _ = tx.send(Err(e));
            }
            (None, None) => {
                let _ = tx.send(Err(Error::LocallyClosed));
            }
        }
    }

    /// Posts `r` now if the link has room under its read depth, else queues it. The one
    /// read scheduler for both the core's fragments and `read_remote`'s pieces. An error
    /// means the read was not posted and will not complete.
    fn submit_read(&mut self, r: LinkRead) -> Result<(), Error> {
        if self.reads_posted < self.info.read_depth.max(1) && self.read_wait.is_empty() {
            self.post_link_read(r)
        } else {
            self.read_wait.push_back(r);
            Ok(())
        }
    }

    fn post_link_read(&mut self, r: LinkRead) -> Result<(), Error> {
        let link = self.link.as_mut().ok_or(Error::LocallyClosed)?;
        // SAFETY: `r.dst..+r.len` belongs to a buffer held in `dests` or `api_reads` (see
        // `submit_read`'s callers) until this read completes or the link is dropped.
        unsafe { link.post_read(r.id, &r.descriptor, r.offset, r.dst as *mut u8, r.len) }?;
        self.reads_posted += 1;
        Ok(())
    }

    /// Posts queued reads while the link has room; a read that cannot be posted completes
    /// with its error.
    fn pump_link_reads(&mut self, now: Instant, wake: &mut Wake) {
        while self.reads_posted < self.info.read_depth.max(1) {
            let Some(r) = self.read_wait.pop_front() else {
                break;
            };
            let id = r.id;
            if let Err(e) = self.post_link_read(r) {
                self.read_finished(id, Err(e), now, wake);
            }
        }
    }

    fn read_finished(&mut self, id: u64, result: Result<(), Error>, now: Instant, wake: &mut Wake) {
        if id & API_READ_BIT != 0 {
            self.api_read_done(id, result);
            wake.app = true;
        } else {
            self.core.read_completed(now, id, result);
        }
    }

    fn api_read_done(&mut self, id: u64, result: Result<(), Error>) {
        let Some(req) = self.api_frags.remove(&id) else {
            return;
        };
        let Some(read) = self.api_reads.get_mut(&req) else {
            return;
        };
        if let Err(e) = result {
            read.error.get_or_insert(e);
        }
        read.frags_left -= 1;
        if read.frags_left == 0
            && let Some(read) = self.api_reads.remove(&req)
        {
            let len = read.dst.as_ref().map_or(0, |d| d.len());
            self.finish_api_read(read, len);
        }
    }

    /// Carries out one core action. Returns true if the application should be woken.
    fn act(&mut self, action: Action, now: Instant) -> bool {
        match action {
            Action::BeginRecv {
                msg,
                len,
                head_len,
                descriptor,
                probe,
            } => {
                self.begin_recv(msg, len, head_len, &descriptor, probe, now);
                false
            }
            Action::Read {
                id,
                msg,
                descriptor,
                remote_offset,
                local_offset,
                len,
            } => {
                let dst = match self.dests.get_mut(&msg) {
                    Some(Dest::Buf(b)) | Some(Dest::User(b, _)) => b,
                    _ => {
                        self.core.read_completed(
                            now,
                            id,
                            Err(Error::Protocol(format!(
                                "read for message {msg} without a destination"
                            ))),
                        );
                        return false;
                    }
                };
                let end = local_offset.checked_add(len as u64);
                if end.is_none_or(|e| e > dst.len() as u64) {
                    self.core.read_completed(
                        now,
                        id,
                        Err(Error::Protocol(format!(
                            "fragment {local_offset}+{len} outside message {msg}"
                        ))),
                    );
                    return false;
                }
                let dst = dst.as_mut_ptr() as usize + local_offset as usize;
                // The destination lives in `dests` until the message is delivered (all reads
                // done) or, on close, in the graveyard until the link is dropped; the range was
                // bounds-checked above.
                let r = self.submit_read(LinkRead {
                    id,
                    descriptor,
                    offset: remote_offset,
                    dst,
                    len,
                });
                if let Err(e) = r {
                    self.core.read_completed(now, id, Err(e));
                }
                false
            }
            Action::Deliver { msg, data } => {
                let ready = match data {
                    Delivery::Eager(b) => ReadyMsg::Bytes(msg, b),
                    Delivery::Rendezvous { len, head } => match self.dests.remove(&msg) {
                        Some(Dest::Buf(b)) => {
                            self.stats.rndv_read_bytes += len;
                            ReadyMsg::with_head(msg, head, b.into_bytes())
                        }
                        Some(Dest::User(mut b, token)) => {
                            self.stats.rndv_read_bytes += len;
                            self.stats.recv_into_direct += 1;
                            let (len, h) = (len as usize, head.len());
                            // `begin_recv` chose this buffer only with room for both.
                            if h > 0 && h + len <= b.len() {
                                let s = b.as_mut_slice();
                                s.copy_within(..len, h);
                                s[..h].copy_from_slice(&head);
                            }
                            ReadyMsg::User {
                                msg,
                                buf: b,
                                len: len + h,
                                token,
                            }
                        }
                        Some(Dest::Mapped(v)) => {
                            self.stats.rndv_mapped_bytes += len;
                            self.stats.rndv_mapped_msgs += 1;
                            let guard = ViewGuard {
                                view: v,
                                msg,
                                shared: self.self_ref.clone(),
                            };
                            ReadyMsg::with_head(msg, head, Bytes::from_owner(guard))
                        }
                        None => ReadyMsg::with_head(msg, head, Bytes::new()),
                    },
                };
                self.delivered.push_back(ready);
                true
            }
            Action::Release { msg } => {
                if let Some(s) = self.sends.remove(&msg) {
                    if let Some(link) = self.link.as_mut() {
                        link.withdraw(s.exposure);
                    }
                    if let Some(tx) = s.done {
                        // The core emits `Closed` before the releases it forces on close, so a
                        // release seen before `Closed` is the peer's real `RndvDone`.
                        let r = if self.closed.is_some() {
                            Err(self.closed_error_or_core())
                        } else {
                            Ok(())
                        };
                        let _ = tx.send(r);
                    }
                }
                false
            }
            Action::Discard { msg } => {
                if let Some(d) = self.dests.remove(&msg) {
                    // Reads may still be in flight into it if the connection is closing.
                    self.graveyard.push(Box::new(d_owner(d)));
                }
                false
            }
            Action::ProbeDone {
                threshold,
                fragment_size,
            } => {
                if let (Some(id), Some(link)) = (self.probe_exposure.take(), self.link.as_mut()) {
                    link.withdraw(id);
                }
                let s = self.core.stats();
                tracing::info!(
                    threshold,
                    threshold_source = s.threshold_source,
                    fragment_size,
                    fragment_source = s.fragment_source,
                    provider = self.info.provider,
                    "connect-time probe over"
                );
                true
            }
            Action::Closed { error } => {
                tracing::debug!(%error, "connection closed");
                self.closed = Some(error);
                true
            }
        }
    }

    fn closed_error_or_core(&self) -> Error {
        self.closed.clone().unwrap_or_else(|| {
            Error::PeerGone("connection closed before the peer read the message".into())
        })
    }

    fn begin_recv(
        &mut self,
        msg: MsgId,
        len: u64,
        head_len: usize,
        descriptor: &[u8],
        probe: bool,
        now: Instant,
    ) {
        let Some(link) = self.link.as_mut() else {
            return;
        };
        match link.map_remote(descriptor, len) {
            Ok(Some(view)) if !probe => {
                self.dests.insert(msg, Dest::Mapped(view));
                self.core.accept_rendezvous(now, msg, RecvMode::Mapped);
                return;
            }
            Ok(_) => {}
            Err(e) => {
                self.core.reject_rendezvous(now, msg, e);
                return;
            }
        }
        // A caller's buffer posted for exactly this message takes the data directly (and its
        // head, moved in front of it once it is all there).
        if !probe
            && self.delivered.is_empty()
            && msg == self.consumed
            && let Some(p) = self.posted.take()
        {
            if p.buf.len() as u64 >= len.saturating_add(head_len as u64)
                && link.readable_dst(p.buf.as_slice().as_ptr(), len as usize)
            {
                self.dests.insert(msg, Dest::User(p.buf, p.token));
                self.core.accept_rendezvous(now, msg, RecvMode::Read);
                return;
            }
            self.posted = Some(p);
        }
        let len_usize = match usize::try_from(len) {
            Ok(l) => l,
            Err(_) => {
                self.core.reject_rendezvous(
                    now,
                    msg,
                    Error::TooLarge {
                        len,
                        limit: usize::MAX as u64,
                        which: "address space",
                    },
                );
                return;
            }
        };
        match link.alloc_recv(len_usize) {
            Ok(buf) => {
                self.dests.insert(msg, Dest::Buf(buf));
                self.core.accept_rendezvous(now, msg, RecvMode::Read);
            }
            Err(Error::Io { context, source }) => {
                let context = format!(
                    "{context} for rendezvous message {msg}; such buffers are bounded by Config::rndv_recv_budget (IBEX_RNDV_RECV_BUDGET) and max_message_size: lower them"
                );
                self.core
                    .reject_rendezvous(now, msg, Error::Io { context, source });
            }
            Err(e) => self.core.reject_rendezvous(now, msg, e),
        }
    }

    /// Fails every application call still waiting; called once the core has closed.
    fn fail_pending(&mut self) {
        let err = self.closed_error();
        // Their destinations are among what goes to the graveyard below.
        self.read_wait.clear();
        for (_, s) in self.sends.drain() {
            if let Some(tx) = s.done {
                let _ = tx.send(Err(err.clone()));
            }
        }
        for (_, mut r) in self.api_reads.drain() {
            if let Some(d) = r.dst.take() {
                self.graveyard.push(Box::new(d));
            }
            if let Some(s) = r.staging.take() {
                self.graveyard.push(Box::new(s));
            }
            if let Some(tx) = r.tx.take() {
                let _ = tx.send(Err(err.clone()));
            }
        }
        for (_, d) in self.dests.drain() {
            self.graveyard.push(Box::new(d_owner(d)));
        }
    }
}

fn d_owner(d: Dest) -> Box<dyn Any + Send> {
    match d {
        Dest::Buf(b) | Dest::User(b, _) => Box::new(b),
        Dest::Mapped(v) => Box::new(v),
    }
}

/// The future that runs a connection until it has closed and its link is gone.
pub(crate) struct Driver {
    pub shared: Arc<Shared>,
    pub timer: Pin<Box<tokio::time::Sleep>>,
    /// Busy-poll budget before sleeping ([`crate::Config::spin`]).
    pub spin: Duration,
    /// When the current spin began, while one is under way.
    pub spinning_since: Option<Instant>,
    /// The current spin's budget.
    budget: Duration,
    adapt: SpinAdapt,
    room: WakeRoom,
}

/// On a crowded machine a receiver spinning on the link (busy-polling, [`InlineRead`]) gives
/// its thread's core to the OS now and then, once the spin has lasted past the replies that
/// come fast. A spin is cooperative within its runtime (it returns to the runtime after
/// every poll), but the runtime gives the core to nothing else: with more runnable threads
/// than cores, the spinner held its core until the OS preempted it, while the thread that
/// would produce the reply (the peer's, another process's) waited for a time slice.
/// "Crowded" is a spin that used its whole budget in the last [`OsYield::CROWDED_FOR`]; a
/// spin cut short (the budget shrinks after a miss) does not count. Yielding on every spin
/// past 10 µs, crowded or not, would cost a ping-pong calls (the yield lets the runtime's
/// other worker thread take the spinning task). The driver's own spin (default settings)
/// does not yield: there it would make the PS tail worse.
#[derive(Debug, Default)]
pub(crate) struct OsYield {
    steps: u32,
    /// Until when the machine counts as crowded.
    crowded_until: Option<Instant>,
}

impl OsYield {
    /// Replies within this come at full spin.
    const AFTER: Duration = Duration::from_micros(10);
    /// Past it, one spin step in this many yields.
    const EVERY: u32 = 8;
    /// How long a spin that ran out of budget marks the machine crowded.
    const CROWDED_FOR: Duration = Duration::from_millis(100);

    /// A spin ran out of budget at `now`.
    fn missed(&mut self, now: Instant) {
        self.crowded_until = Some(now + Self::CROWDED_FOR);
    }

    /// Counts one spin step, `spun` into its spin, at `now`: whether to yield the core
    /// first.
    fn step(&mut self, spun: Duration, now: Instant) -> bool {
        if spun < Self::AFTER || self.crowded_until.is_none_or(|t| t <= now) {
            return false;
        }
        self.steps = self.steps.wrapping_add(1);
        self.steps.is_multiple_of(Self::EVERY)
    }
}

/// Spins only while spinning pays. A spin that ends without an event (the reply took longer
/// than the budget: a crowded machine, more connections than cores, a slow peer) makes the
/// next spin requests sleep at once, twice as many after each miss, up to
/// [`SpinAdapt::MAX_SKIP`]; one spin that catches its event resets that. With more
/// connections than cores, a fixed spin on every wait keeps every core busy spinning.
#[derive(Debug, Default)]
pub(crate) struct SpinAdapt {
    /// Spin requests still to refuse.
    skip: u32,
    /// How many the next miss refuses.
    backoff: u32,
}

impl SpinAdapt {
    const MAX_SKIP: u32 = 256;

    fn may_spin(&mut self) -> bool {
        if self.skip == 0 {
            return true;
        }
        self.skip -= 1;
        false
    }

    fn hit(&mut self) {
        self.backoff = 0;
    }

    /// A hit that only halves the back-off: a receiver's spin starts the moment it finds
    /// nothing, so it hits often even where it misses often too, and each miss burns the
    /// whole budget: resetting on every hit would let receivers spin through their misses.
    fn hit_decay(&mut self) {
        self.backoff /= 2;
    }

    fn miss(&mut self) {
        self.backoff = (self.backoff * 2).clamp(1, Self::MAX_SKIP);
        self.skip = self.backoff;
    }
}

/// Most a spin's budget grows for a peer that had to be woken.
const WAKE_ROOM: Duration = Duration::from_micros(100);

/// Room in a driver spin's budget for the peer's wake-up, given only to get two sides out
/// of sleeping for good.
///
/// A reply to a peer that slept comes after its wake-up, and on a loaded 2-core VM a
/// wake-up took about 60 µs, more than the 50 µs default budget. A spin can then catch
/// only a reply from a peer that was spinning too, so once both sides sleep neither
/// catches anything again, and a whole connection's calls take several times as long.
/// Spinning for the wake-up too (`spin` again, at most [`WAKE_ROOM`]) when a send had to
/// wake the peer ([`Link::take_woke_peer`]) ends that, but given on every such spin it
/// raises the tail of PS workloads (with more processes than cores, a longer spin holds a
/// core another process needs until the OS preempts it). So the room comes in a
/// streak: it starts when a spin that woke its peer misses after five misses in a row
/// ([`WakeRoom::AFTER_BACKOFF`]; both sides asleep for good look just like that), goes on
/// while its spins catch their replies, for at most [`WakeRoom::STREAK`] spins (the peer's
/// own back-off has run out by then, so it spins again), and one roomy spin that misses
/// ends it. A streak that starts only at the longest back-off (256) comes too late: the
/// two sides would fall asleep again now and then, for tens of milliseconds each time.
#[derive(Debug, Default)]
pub(crate) struct WakeRoom {
    /// Roomy spins left in the streak.
    left: u32,
    /// The current spin follows a send that woke the peer.
    woke: bool,
    /// The current spin has the room.
    roomy: bool,
}

impl WakeRoom {
    const STREAK: u32 = 2 * SpinAdapt::MAX_SKIP;
    /// A streak starts at a miss with the back-off at least this long (the sixth miss in a
    /// row).
    const AFTER_BACKOFF: u32 = 16;

    /// The budget of a spin that starts now; `woke`: a send since the last one had to wake
    /// the peer.
    fn budget(&mut self, spin: Duration, woke: bool) -> Duration {
        self.woke = woke;
        self.roomy = woke && self.left > 0;
        if !self.roomy {
            return spin;
        }
        self.left -= 1;
        spin + spin.min(WAKE_ROOM)
    }

    /// The spin ran out of budget; `adapt` has not counted the miss yet.
    fn missed(&mut self, adapt: &SpinAdapt) {
        if self.roomy {
            self.left = 0;
        } else if self.woke && adapt.backoff >= Self::AFTER_BACKOFF {
            self.left = Self::STREAK;
        }
    }
}

impl Driver {
    pub fn new(shared: Arc<Shared>, spin: Duration) -> Driver {
        Driver {
            shared,
            timer: Box::pin(tokio::time::sleep(Duration::from_secs(3600))),
            spin,
            spinning_since: None,
            budget: spin,
            adapt: SpinAdapt::default(),
            room: WakeRoom::default(),
        }
    }
}

impl Future for Driver {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        this.shared.driver_waker.register(cx.waker());
        let shared = this.shared.clone();
        let mut st = shared.lock();
        let mut wake = Wake::default();
        let was_established = st.core.is_established();
        // True while the turns leave the link unarmed: the driver must then poll again (a
        // spin) or run an arming turn before it sleeps.
        let mut spinning = this.spinning_since.is_some();
        loop {
            if st.turn(&shared, cx, &mut this.timer, &mut wake, spinning) {
                drop(st);
                shared.notify_changed();
                shared.send_space.notify_waiters();
                return Poll::Ready(());
            }
            // Large copies run with the lock released, so sends, receives and reads on this
            // connection from other tasks are not held up by them; the next turn hands
            // their completions to the core.
            let work = st.link.as_mut().map(|l| l.take_work()).unwrap_or_default();
            if !work.is_empty() {
                drop(st);
                let done: Vec<_> = work.into_iter().map(Work::run).collect();
                st = shared.lock();
                if let Some(link) = st.link.as_mut() {
                    for (id, result) in done {
                        link.work_done(id, result);
                    }
                }
                continue;
            }
            // Spin, then sleep: while a receiver waits, a reply that arrives within the budget
            // costs no syscall and no wake-up. The spin is cooperative: one poll of the link,
            // then back to the runtime (re-woken), because the task that will produce the
            // reply may be on this very thread (a gRPC handler, a call task). Blocking here
            // would make every round trip cost the whole budget. Never right after waking an
            // application task: that task runs first.
            let want = std::mem::take(&mut st.spin_requested) || this.spinning_since.is_some();
            let can = want
                && !wake.app
                && !st.core.is_closed()
                && st.link.as_ref().is_some_and(|l| l.busy_poll());
            if !can {
                this.spinning_since = None;
                if std::mem::take(&mut spinning) {
                    continue;
                }
                break;
            }
            if this.spinning_since.is_none() {
                // Asked at every spin request, spun or not, so a wake-up long past does
                // not stretch a later spin.
                let woke = st.link.as_mut().is_some_and(|l| l.take_woke_peer());
                if !this.adapt.may_spin() {
                    if std::mem::take(&mut spinning) {
                        continue;
                    }
                    break;
                }
                this.budget = this.room.budget(this.spin, woke);
            }
            let since = *this.spinning_since.get_or_insert_with(Instant::now);
            match st.link.as_mut().and_then(|l| l.try_event()) {
                Some(ev) => {
                    // Something came: handle it, run a full turn, and stop spinning until a
                    // receiver asks again.
                    this.spinning_since = None;
                    this.adapt.hit();
                    st.handle_event(ev, Instant::now(), &mut wake);
                    continue;
                }
                None if since.elapsed() < this.budget => {
                    cx.waker().wake_by_ref();
                    break;
                }
                None => {
                    // Budget spent: one more full pass re-arms the link's wake-up, then
                    // sleep. A full pass, not a bare turn: a message that arrives in that
                    // turn may post reads that are link work (shm copies), and only the
                    // loop runs those. Breaking after the turn left them unrun with nothing
                    // to wake the driver: the message hung (hostile_shm's honest client,
                    // about once in 30 k round trips under load).
                    this.spinning_since = None;
                    this.room.missed(&this.adapt);
                    this.adapt.miss();
                    spinning = false;
                    continue;
                }
            }
        }
        if st.core.is_established() != was_established {
            wake.app = true;
        }
        drop(st);
        if wake.app {
            shared.notify_changed();
        }
        if wake.send_space {
            shared.send_space.notify_waiters();
        }
        Poll::Pending
    }
}

/// What a driver turn found for the application.
#[derive(Default)]
pub(crate) struct Wake {
    app: bool,
    send_space: bool,
}

impl State {
    /// Hands queued frames to the link until it pushes back. Used by the driver and, to
    /// save a task switch, by `send` itself.
    pub fn transmit(&mut self, cx: &mut Context<'_>, now: Instant) -> bool {
        self.transmit_inner(cx, now).0
    }

    /// Like [`State::transmit`] from outside the driver, with a no-op waker: returns false
    /// if the link pushed back (then its wake-up registration is not the driver's, and the
    /// driver must be woken to retry). `now` is the caller's: the one it queued with.
    pub fn transmit_inline(&mut self, now: Instant) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        !self.transmit_inner(&mut cx, now).1
    }

    /// (something was sent, the link pushed back)
    fn transmit_inner(&mut self, cx: &mut Context<'_>, now: Instant) -> (bool, bool) {
        let mut sent = false;
        let mut blocked = false;
        loop {
            let frame = match self.pending_tx.take() {
                Some(f) => f,
                None => match self.core.poll_transmit_parts(now) {
                    Some(f) => f,
                    None => break,
                },
            };
            let Some(link) = self.link.as_mut() else {
                break;
            };
            let sent_now = match &frame {
                Transmit::Frame(f) => link.poll_send(cx, f),
                Transmit::Eager { head, msg } => link.poll_send_parts(cx, head, msg),
            };
            match sent_now {
                Poll::Ready(Ok(())) => sent = true,
                Poll::Ready(Err(e)) => {
                    self.core.link_failed(e);
                    sent = true;
                    break;
                }
                Poll::Pending => {
                    self.pending_tx = Some(frame);
                    blocked = true;
                    break;
                }
            }
        }
        if let Some(link) = self.link.as_mut() {
            match link.poll_flush(cx) {
                Poll::Ready(Err(e)) => {
                    self.core.link_failed(e);
                    sent = true;
                }
                Poll::Pending => blocked = true,
                Poll::Ready(Ok(())) => {}
            }
        }
        (sent, blocked)
    }

    fn handle_event(&mut self, ev: Result<LinkEvent, Error>, now: Instant, wake: &mut Wake) {
        match ev {
            Ok(LinkEvent::Frame(f)) => self.core.handle_frame(now, f),
            Ok(LinkEvent::ReadDone { id, result }) => {
                self.reads_posted = self.reads_posted.saturating_sub(1);
                self.read_finished(id, result, now, wake);
                self.pump_link_reads(now, wake);
            }
            Err(e) => self.core.link_failed(e),
        }
        while let Some(a) = self.core.poll_action() {
            wake.app |= self.act(a, now);
        }
    }

    /// One pass of the driver until nothing moves. Returns true once the connection is over
    /// and the link released. `spinning`: the driver is busy-polling and will poll again at
    /// once, so the link is asked with `try_event`, which does not arm its sleep (on shm,
    /// an armed sleep makes the peer signal an eventfd, a syscall on each side, for a
    /// message the spin would have caught). A turn that may end in sleep must not spin.
    fn turn(
        &mut self,
        shared: &Shared,
        cx: &mut Context<'_>,
        timer: &mut Pin<Box<tokio::time::Sleep>>,
        wake: &mut Wake,
        spinning: bool,
    ) -> bool {
        loop {
            let now = Instant::now();
            let mut progress = false;
            // While a receiver holds the lease, it polls the link: arming it now would make
            // the peer signal us for messages the receiver is about to take.
            let spinning = spinning || self.inline.lease.is_some();

            let released =
                std::mem::take(&mut *shared.released.lock().unwrap_or_else(|e| e.into_inner()));
            for r in released {
                progress = true;
                match r {
                    Released::View(msg) => self.core.release_recv(msg),
                    Released::Exposure(id) => {
                        if let Some(l) = self.link.as_mut() {
                            l.withdraw(id);
                        }
                    }
                }
            }
            if self.close_requested && !self.core.is_closed() {
                self.core.close(now, &self.close_reason);
            }

            // Outbound first: a reply waiting to go out must not wait behind inbound polling.
            if self.transmit(cx, now) {
                progress = true;
                wake.send_space = true;
            }

            // Inbound: frames and completions.
            for _ in 0..EVENTS_PER_TURN {
                let Some(link) = self.link.as_mut() else {
                    break;
                };
                let polled = if spinning {
                    link.try_event().map_or(Poll::Pending, Poll::Ready)
                } else {
                    link.poll_event(cx)
                };
                match polled {
                    Poll::Ready(ev) => {
                        let failed = ev.is_err();
                        // A fresh clock per event: the probe times its samples from the
                        // turn's `now` at transmit, and an answer in the same turn would
                        // otherwise measure zero.
                        self.handle_event(ev, Instant::now(), wake);
                        progress = true;
                        if failed {
                            break;
                        }
                    }
                    Poll::Pending => break,
                }
            }

            // What the core wants done.
            while let Some(a) = self.core.poll_action() {
                progress = true;
                wake.app |= self.act(a, now);
            }

            // Closing: once the core has said its last word, the link is told to close and
            // goes once it has delivered that word (or the linger ends); only then go the
            // buffers reads might have targeted.
            if self.core.is_closed() && self.pending_tx.is_none() {
                self.transmit(cx, now);
                self.fail_pending();
                let flushed = match self.link.as_mut() {
                    Some(_) if self.pending_tx.is_some() => false,
                    Some(link) => {
                        let linger = *self.link_linger.get_or_insert_with(|| {
                            link.close();
                            now + CLOSE_LINGER
                        });
                        !matches!(link.poll_flush(cx), Poll::Pending) || now >= linger
                    }
                    None => true,
                };
                // A receiver may be running copies of the link's reads: the link goes
                // after them. Nothing else is left to do; that receiver wakes the driver
                // when it is done (a closed link would keep the turn busy meanwhile).
                if flushed && self.work_out > 0 {
                    return false;
                }
                if flushed {
                    drop(self.link.take());
                    self.graveyard.clear();
                    self.posted = None;
                    if self.closed.is_none() {
                        self.closed = Some(Error::LocallyClosed);
                    }
                    return true;
                }
            }

            // Timers: the core's, and the end of a receiver's lease on the link.
            if self.lease_ran_out(now) {
                progress = true;
            }
            let core_deadline = self.core.poll_timeout();
            // A lease moves on with every message read inline; the timer is not moved with
            // it (a timer reset per message costs more than the read saves). It fires at
            // the lease's first end and is then set again for the current one.
            let lease = self.inline.lease.map(|l| match self.inline.backstop {
                Some(at) if at > now && at <= l => at,
                _ => l,
            });
            self.inline.backstop = lease;
            let deadline = [core_deadline, lease, self.link_linger]
                .into_iter()
                .flatten()
                .min();
            if let Some(deadline) = deadline {
                if deadline <= now {
                    if core_deadline.is_some_and(|d| d <= now) {
                        self.core.handle_timeout(now);
                    }
                    progress = true;
                } else {
                    let d = tokio::time::Instant::from_std(deadline);
                    if timer.deadline() != d {
                        timer.as_mut().reset(d);
                    }
                    if timer.as_mut().poll(cx).is_ready() {
                        progress = true;
                    }
                }
            }

            if !progress {
                return false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{InlineRead, OsYield, SpinAdapt, State, Take, WakeRoom};
    use std::time::{Duration, Instant};

    /// A link whose only state is whether completions wait in it, unread.
    struct Unread(bool);

    impl crate::link::Link for Unread {
        fn info(&self) -> crate::link::LinkInfo {
            crate::link::LinkInfo {
                provider: "unread",
                max_frame: 4096,
                rendezvous_path: String::new(),
                one_sided: false,
                direct_reads: false,
                peer: String::new(),
                pipelined_reads: false,
                dma_reads: false,
                read_depth: 1,
                max_read: usize::MAX,
                max_push: 0,
                registrar: None,
                local_addr: None,
                tls: None,
            }
        }
        fn poll_send(
            &mut self,
            _: &mut std::task::Context<'_>,
            _: &[u8],
        ) -> std::task::Poll<Result<(), crate::Error>> {
            std::task::Poll::Pending
        }
        fn poll_flush(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), crate::Error>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_event(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<crate::link::LinkEvent, crate::Error>> {
            std::task::Poll::Pending
        }
        fn expose(&mut self, _: bytes::Bytes) -> Result<crate::link::Exposure, crate::Error> {
            Err(crate::Error::LocallyClosed)
        }
        fn withdraw(&mut self, _: u64) -> Option<bytes::Bytes> {
            None
        }
        fn map_remote(&mut self, _: &[u8], _: u64) -> Result<Option<bytes::Bytes>, crate::Error> {
            Ok(None)
        }
        unsafe fn post_read(
            &mut self,
            _: u64,
            _: &[u8],
            _: u64,
            _: *mut u8,
            _: usize,
        ) -> Result<(), crate::Error> {
            Err(crate::Error::LocallyClosed)
        }
        fn close(&mut self) {}
        fn busy_poll(&self) -> bool {
            true
        }
        fn has_completions(&self) -> bool {
            self.0
        }
    }

    /// A receiver that ran a message's copies, was then told spinning no longer pays, and
    /// goes to sleep: the copies' completions wait in the link, which raises no readiness
    /// for them, so it must wake the driver to read them (under load the message hung).
    #[test]
    fn a_receiver_that_stops_with_completions_unread_wakes_the_driver() {
        for unread in [true, false] {
            let config = crate::Config::default();
            let core = crate::proto::Connection::new(&config, Instant::now());
            let mut st = State::new(core, Box::new(Unread(unread)), std::sync::Weak::new());
            st.busy_poll = true;
            st.inline.spin = Duration::from_millis(5);
            st.inline.asked = Some(false);
            let (take, driver, _) = st.take(std::task::Waker::noop());
            assert!(matches!(take, Take::Wait));
            assert_eq!(driver, unread, "unread completions: {unread}");
        }
    }

    /// One process of [`ping_pong`]: its driver's spin policy.
    #[derive(Default)]
    struct Side {
        adapt: SpinAdapt,
        room: WakeRoom,
        /// When its current spin ends; `None`: it sleeps until woken.
        spin_end: Option<u64>,
    }

    /// A deterministic model of two processes ping-ponging one message back and forth over
    /// shm, each waiting as the driver does: it spins if its [`SpinAdapt`] lets it, from
    /// when it sent, for the budget [`WakeRoom`] gives (or the plain `spin` µs without
    /// `room`), then sleeps. A message to a sleeper waits `wake` µs for it; each side works
    /// `work` µs before it answers. Both start asleep. Returns (messages caught by a spin,
    /// spins), over the last half of `n`.
    fn ping_pong(room: bool, spin: u64, wake: u64, work: u64, n: usize) -> (usize, usize) {
        let mut sides = [Side::default(), Side::default()];
        let (mut t, mut caught, mut spins) = (0u64, 0, 0);
        for i in 0..n {
            let (s, r) = (i % 2, 1 - i % 2);
            let rx = &mut sides[r];
            let in_spin = rx.spin_end.is_some_and(|end| t <= end);
            match rx.spin_end {
                Some(_) if in_spin => rx.adapt.hit(),
                Some(_) => {
                    rx.room.missed(&rx.adapt);
                    rx.adapt.miss();
                }
                None => {}
            }
            // The sender starts its wait as it sends, knowing whether it had to wake.
            let tx = &mut sides[s];
            tx.spin_end = tx.adapt.may_spin().then(|| {
                let plain = Duration::from_micros(spin);
                let b = if room {
                    tx.room.budget(plain, !in_spin)
                } else {
                    plain
                };
                t + u64::try_from(b.as_micros()).unwrap_or(u64::MAX)
            });
            if i >= n / 2 {
                caught += usize::from(in_spin);
                spins += usize::from(tx.spin_end.is_some());
            }
            t += if in_spin { work } else { wake + work };
        }
        (caught, spins)
    }

    #[test]
    fn two_sides_asleep_for_good_are_woken_by_a_streak_of_longer_spins() {
        let n = 20_000;
        let half = n / 2;
        // A 60 KB ping-pong on a loaded 2-core VM: a wake-up (60 µs) plus the work (20 µs)
        // is longer than the 50 µs default. With the plain budget a spin only catches a
        // peer that spun too, so once both sleep no spin ever catches anything again.
        assert_eq!(ping_pong(false, 50, 60, 20, n).0, 0, "stuck asleep");
        let (caught, _) = ping_pong(true, 50, 60, 20, n);
        assert!(caught >= half - 2, "with the room: {caught} of {half}");
        // Wake-ups that fit the plain budget: both spin through, and no room is given.
        assert!(ping_pong(false, 50, 10, 20, n).0 >= half - 2);
        assert!(ping_pong(true, 50, 10, 20, n).0 >= half - 2);
        // Wake-ups past even the longer budget: the streaks end at once, and the back-off
        // keeps the spins rare.
        let (caught, spins) = ping_pong(true, 50, 200, 20, n);
        assert_eq!(caught, 0);
        assert!(spins <= half / 100, "{spins} spins in {half} waits");
    }

    #[test]
    fn the_wake_up_room_is_a_bounded_streak_that_a_miss_ends() {
        let spin = Duration::from_micros(50);
        let long = Duration::from_micros(100);
        let mut a = SpinAdapt::default();
        let mut r = WakeRoom::default();
        assert_eq!(r.budget(spin, true), spin, "no streak yet");
        r.missed(&a);
        assert_eq!(
            r.budget(spin, true),
            spin,
            "one miss is not asleep for good"
        );
        while a.backoff < SpinAdapt::MAX_SKIP {
            a.miss();
        }
        assert_eq!(r.budget(spin, false), spin);
        r.missed(&a);
        assert_eq!(
            r.budget(spin, true),
            spin,
            "a miss that woke no one starts nothing"
        );
        r.missed(&a);
        assert_eq!(r.budget(spin, false), spin, "room only for a woken peer");
        let roomy = (0..WakeRoom::STREAK * 2)
            .filter(|_| r.budget(spin, true) == long)
            .count();
        assert_eq!(roomy, WakeRoom::STREAK as usize, "the streak is bounded");
        r.missed(&a);
        assert_eq!(
            r.budget(spin, true),
            long,
            "asleep for good again: a new streak"
        );
        r.missed(&a);
        assert_eq!(r.budget(spin, true), spin, "its first miss ends a streak");
        r.left = 5;
        assert_eq!(
            r.budget(Duration::from_millis(1), true),
            Duration::from_micros(1100),
            "the room is capped: a long budget already has it"
        );
    }

    #[test]
    fn a_spin_gives_its_core_back_only_when_crowded_past_the_fast_replies() {
        let mut y = OsYield::default();
        let now = Instant::now();
        let long = Duration::from_micros(40);
        let calm = (0..100).filter(|_| y.step(long, now)).count();
        assert_eq!(calm, 0, "no spin has missed: the machine is not crowded");
        y.missed(now);
        let early = (0..100)
            .filter(|_| y.step(Duration::from_micros(9), now))
            .count();
        assert_eq!(
            early,
            0,
            "a reply within {:?} comes at full spin",
            OsYield::AFTER
        );
        let late = (0..800).filter(|_| y.step(long, now)).count();
        assert_eq!(late, 800 / OsYield::EVERY as usize);
        let later = now + OsYield::CROWDED_FOR;
        assert!(
            !(0..100).any(|_| y.step(long, later)),
            "crowded only for a while"
        );
    }

    /// How many of the next `n` spin requests may spin.
    fn allowed(a: &mut SpinAdapt, n: usize) -> usize {
        (0..n).filter(|_| a.may_spin()).count()
    }

    #[test]
    fn inline_spin_budget_follows_the_answered_spins() {
        let mut r = InlineRead {
            spin: Duration::from_micros(50),
            ..Default::default()
        };
        assert_eq!(r.budget(), r.spin, "nothing learnt yet: the whole budget");
        for _ in 0..50 {
            r.learn(Duration::from_micros(2));
        }
        assert_eq!(
            r.budget(),
            r.spin,
            "no spin missed lately: the whole budget"
        );
        r.adapt.miss();
        assert_eq!(
            r.budget(),
            Duration::from_micros(30),
            "fast answers after a miss: the floor"
        );
        for _ in 0..50 {
            r.learn(Duration::from_micros(100));
        }
        assert_eq!(r.budget(), r.spin, "never past the configured budget");
        let mut tiny = InlineRead {
            spin: Duration::from_micros(10),
            hit_wait_ns: 1,
            ..Default::default()
        };
        tiny.adapt.miss();
        assert_eq!(tiny.budget(), tiny.spin, "a budget under the floor is kept");
    }

    #[test]
    fn only_quick_replies_are_watched_for() {
        let mut r = InlineRead::default();
        assert!(!r.replies_are_quick(), "nothing learnt yet");
        for _ in 0..8 {
            r.learn(Duration::from_micros(2));
        }
        assert!(r.replies_are_quick(), "a ping-pong's replies");
        for _ in 0..8 {
            r.learn(Duration::from_micros(50));
        }
        assert!(!r.replies_are_quick(), "a crowded machine's replies");
    }

    #[test]
    fn a_hit_halves_the_inline_back_off() {
        let mut a = SpinAdapt::default();
        for _ in 0..3 {
            a.miss();
        }
        assert_eq!(a.backoff, 4);
        a.hit_decay();
        assert_eq!(a.backoff, 2, "one hit after misses does not undo them all");
        a.hit_decay();
        a.hit_decay();
        assert_eq!(a.backoff, 0);
    }

    #[test]
    fn spinning_backs_off_after_misses_and_resumes_after_a_hit() {
        let mut a = SpinAdapt::default();
        assert_eq!(allowed(&mut a, 10), 10, "spins freely until one misses");
        a.miss();
        assert!(!a.may_spin(), "the request right after a miss sleeps");
        assert!(a.may_spin());
        a.miss();
        assert_eq!(
            allowed(&mut a, 3),
            1,
            "two misses in a row: the next two sleep"
        );
        for _ in 0..20 {
            a.miss();
        }
        assert_eq!(
            allowed(&mut a, SpinAdapt::MAX_SKIP as usize + 1),
            1,
            "the back-off is capped, so a spin is retried now and then"
        );
        a.hit();
        a.miss();
        assert_eq!(allowed(&mut a, 2), 1, "a hit resets the back-off");
    }
}
