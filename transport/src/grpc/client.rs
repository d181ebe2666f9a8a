//! The client: [`Channel`], a `tower::Service` that generated tonic clients accept.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tonic::Status;

use super::body::{IbexBody, Inbound, Inbox, InboxTx, IncomingBody, OnDrop, ReadSource, inbox};
use super::calls::{CallTable, Entry, Slot, Verdict};
use super::demux::Demux;
use super::pump::{Now, Pumped, Remainder, Side, pump, pump_now};
use super::wire::{FrameBuf, FrameWriter, GRPC_TIMEOUT, Head, Limits, Packet, Trailers};
use super::{CallShared, Encoded, Mux, RemoteBuf, parse_timeout, read_while, transport_status};
use crate::config::Config;
use crate::conn::Connection;
use crate::error::{Error, Result};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// A response head, and how the rest of the response comes.
struct RespHead {
    status: StatusCode,
    headers: HeaderMap,
    rest: Rest,
}

enum Rest {
    /// In the head's packet (a unary answer): its body frame and its trailers.
    Whole(Option<Bytes>, Option<Trailers>),
    /// Frame by frame, through this inbox.
    Stream(Arc<Inbox>),
}

type HeadResult = std::result::Result<RespHead, Status>;

/// A call's response head on its way to the caller: a one-shot slot in the call's
/// [`CallShared`], which exists anyway, instead of a channel allocated per call.
#[derive(Default)]
pub(crate) struct HeadSlot {
    value: Option<HeadResult>,
    /// The sender went away without sending: the call was dropped with its connection.
    closed: bool,
    waker: Option<Waker>,
}

fn head_slot(call: &CallShared) -> std::sync::MutexGuard<'_, HeadSlot> {
    // Plain data: a panic elsewhere while holding it leaves nothing half-done.
    call.head.lock().unwrap_or_else(|p| p.into_inner())
}

/// The sending side: sends once, or marks the slot closed when dropped unsent.
pub(crate) struct HeadTx(Option<Arc<CallShared>>);

impl HeadTx {
    fn send(mut self, v: HeadResult) {
        if let Some(call) = self.0.take() {
            let waker = {
                let mut slot = head_slot(&call);
                slot.value = Some(v);
                slot.waker.take()
            };
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

impl Drop for HeadTx {
    fn drop(&mut self) {
        if let Some(call) = self.0.take() {
            let waker = {
                let mut slot = head_slot(&call);
                slot.closed = true;
                slot.waker.take()
            };
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

/// The waiting side: the head, or `Err` if the sender was dropped without one.
struct HeadRx(Arc<CallShared>);

impl Drop for HeadRx {
    fn drop(&mut self) {
        // A head nobody will take (the caller gave up) must not live on with the call's
        // other users, holding its answer.
        let late = head_slot(&self.0).value.take();
        drop(late);
    }
}

impl Future for HeadRx {
    type Output = std::result::Result<HeadResult, ()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut slot = head_slot(&self.0);
        if let Some(v) = slot.value.take() {
            return Poll::Ready(Ok(v));
        }
        if slot.closed {
            return Poll::Ready(Err(()));
        }
        match &mut slot.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

/// A gRPC client channel over one Ibex connection. Cheap to clone; all clones multiplex their
/// calls on the same connection. Hand it to any generated client:
/// `BenchClient::new(Channel::connect("shm:///run/ibex.sock").await?)`.
///
/// Once the connection is gone, calls fail `Unavailable` saying why, and the next call
/// connects again (a [`Channel::new`] channel cannot). A call runs to completion on the task
/// that makes it, which also reads its own response off the connection.
#[derive(Clone)]
pub struct Channel {
    pub(super) kind: Kind,
}

#[derive(Clone)]
pub(super) enum Kind {
    Ibex(Arc<Inner>),
    /// Stock gRPC (HTTP/2 over TCP), for `http://` addresses ([`Channel::connect_any`]).
    Http(tonic::transport::Channel),
    /// Several endpoints, each call to one of them ([`Channel::balance_list`]).
    Balanced(Arc<super::balance::Balancer>),
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Ibex(inner) => f
                .debug_struct("Channel")
                .field("conn", &inner.current().map(|s| s.mux.conn.clone()))
                .finish(),
            Kind::Http(_) => f.write_str("Channel(HTTP/2)"),
            Kind::Balanced(_) => f.write_str("Channel(balanced)"),
        }
    }
}

/// What all clones of an Ibex channel share: the connection in use, and where to connect
/// again once it is gone.
pub(crate) struct Inner {
    current: Mutex<Option<Arc<Shared>>>,
    /// `None` for [`Channel::new`] (a connection made elsewhere cannot be made again).
    target: Option<Target>,
    limits: Limits,
    /// One connection attempt at a time; calls that wait for it share its outcome.
    reconnect: tokio::sync::Mutex<Attempts>,
    /// [`Attempts::done`], readable without waiting for the attempt in progress.
    attempts: std::sync::atomic::AtomicU64,
    settings: Settings,
    pub(crate) window: Arc<Window>,
}

/// Response bytes a channel's calls hold before their callers have them whole, over all the
/// channel's calls: the client's connection window (HTTP/2 has one per connection), so a bad
/// server cannot make a client hold calls x the message limit. Its size is the transport's
/// receive budget ([`Config::rndv_recv_budget`]), the same bound one level down.
pub(crate) struct Window {
    used: std::sync::atomic::AtomicUsize,
    limit: usize,
}

impl Window {
    /// An account of nothing yet, on this window.
    pub(crate) fn account(self: &Arc<Self>) -> Held {
        Held {
            window: self.clone(),
            n: 0,
        }
    }
}

/// What one call holds on its channel's [`Window`], given back when dropped.
pub(crate) struct Held {
    window: Arc<Window>,
    n: usize,
}

impl Held {
    /// Adds `n` bytes, or fails the call if that takes the channel past its window. A
    /// message the channel holds alone always goes (up to the call's own message limit), as
    /// the transport lets one message through whatever its budget.
    pub(crate) fn add(&mut self, n: usize) -> std::result::Result<(), Status> {
        use std::sync::atomic::Ordering;
        let before = self.window.used.fetch_add(n, Ordering::AcqRel);
        self.n += n;
        if before > self.n - n && before + n > self.window.limit {
            return Err(Status::resource_exhausted(format!(
                "the channel would hold {} MiB of responses not yet taken, over its window of \
                 {} MiB (Config::rndv_recv_budget, IBEX_RNDV_RECV_BUDGET, \
                 Endpoint::initial_connection_window_size); make fewer large calls at once or \
                 raise the window",
                (before + n) >> 20,
                self.window.limit >> 20
            )));
        }
        Ok(())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.window
            .used
            .fetch_sub(self.n, std::sync::atomic::Ordering::AcqRel);
    }
}

/// What an [`Endpoint`] adds to a channel.
#[derive(Clone, Default)]
pub(super) struct Settings {
    /// Deadline of calls that set none (and a cap on those that do).
    pub(super) timeout: Option<std::time::Duration>,
    pub(super) connect_timeout: Option<std::time::Duration>,
    /// Calls in flight at once; more wait for a slot.
    pub(super) limit: Option<Arc<tokio::sync::Semaphore>>,
    /// Calls started per period; more wait for the next.
    pub(super) rate: Option<Arc<RateLimit>>,
    /// Put before the channel's own user-agent.
    pub(super) user_agent: Option<http::HeaderValue>,
}

/// At most `limit` calls start per `per`, as tower's `RateLimit` that tonic's endpoint uses.
pub(super) struct RateLimit {
    limit: u64,
    per: std::time::Duration,
    /// The current period's end, and the calls it has left.
    state: Mutex<(tokio::time::Instant, u64)>,
}

impl RateLimit {
    pub(super) fn new(limit: u64, per: std::time::Duration) -> RateLimit {
        RateLimit {
            limit,
            per,
            state: Mutex::new((tokio::time::Instant::now() + per, limit)),
        }
    }

    /// Waits until the call may start.
    async fn acquire(&self) {
        loop {
            let wait = {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                let now = tokio::time::Instant::now();
                if now >= st.0 {
                    *st = (now + self.per, self.limit);
                }
                if st.1 > 0 {
                    st.1 -= 1;
                    return;
                }
                st.0
            };
            tokio::time::sleep_until(wait).await;
        }
    }
}

/// An error with its sources, `: `-joined (tonic's transport errors say little at the top).
pub(super) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(c) = source {
        s.push_str(": ");
        s.push_str(&c.to_string());
        source = c.source();
    }
    s
}

pub(super) struct Target {
    pub(super) uri: String,
    pub(super) config: Config,
}

/// The connection attempts of a channel, one at a time.
#[derive(Default)]
struct Attempts {
    /// Attempts finished so far.
    done: u64,
    /// How the last one failed, and when; `None` once one succeeded.
    failed: Option<(Status, tokio::time::Instant)>,
}

impl Inner {
    pub(super) fn new(conn: Option<Connection>, target: Option<Target>, limits: Limits) -> Inner {
        let window = Arc::new(Window {
            used: Default::default(),
            limit: target
                .as_ref()
                .map_or(crate::config::DEFAULT_RNDV_RECV_BUDGET, |t| {
                    t.config.rndv_recv_budget
                }),
        });
        Inner {
            window,
            current: Mutex::new(conn.map(|c| Shared::new(c, limits, None))),
            target,
            limits,
            reconnect: Default::default(),
            attempts: Default::default(),
            settings: Settings::default(),
        }
    }

    /// The same, calling with `settings` (an [`Endpoint`](super::Endpoint)'s).
    pub(super) fn with_settings(self, settings: Settings) -> Inner {
        Inner { settings, ..self }
    }

    /// Connects now, if there is no live connection, or says why not as a call would.
    pub(super) async fn connect_status(&self) -> std::result::Result<(), Status> {
        self.connection().await.map(drop)
    }

    /// Connects now, if there is no live connection: what `Endpoint::connect` waits for.
    pub(super) async fn connect_now(&self) -> Result<()> {
        self.connection()
            .await
            .map(drop)
            .map_err(|s| Error::PeerGone(s.message().to_string()))
    }

    fn current(&self) -> Option<Arc<Shared>> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The connection for a new call: the current one while it lives, else a new one to
    /// the same address, made now (as tonic's channel reconnects on the call that finds the
    /// connection gone). Calls that come while an attempt is under way wait for it and
    /// share its outcome, so a dead server costs one attempt at a time, and the first call
    /// after the server is back succeeds.
    async fn connection(&self) -> std::result::Result<Arc<Shared>, Status> {
        let cur = self.current();
        if let Some(s) = &cur
            && !s.is_gone()
        {
            return Ok(s.clone());
        }
        // Boxed: the connecting future is tens of KiB, and a caller's frame would reserve
        // room for it on every call, the many that find the connection alive among them.
        Box::pin(self.reconnect(cur)).await
    }

    /// Whether the last connection attempt failed within `within`: a balanced channel
    /// passes over such an endpoint while others are fine.
    pub(super) fn failed_within(&self, within: std::time::Duration) -> bool {
        if self.current().is_some_and(|s| !s.is_gone()) {
            return false;
        }
        match self.reconnect.try_lock() {
            Ok(a) => a
                .failed
                .as_ref()
                .is_some_and(|(_, at)| at.elapsed() < within),
            // An attempt is under way: not known to fail.
            Err(_) => false,
        }
    }

    /// [`Inner::connection`] when the current connection is gone (or there is none yet):
    /// a new one, or why not.
    async fn reconnect(
        &self,
        cur: Option<Arc<Shared>>,
    ) -> std::result::Result<Arc<Shared>, Status> {
        let Some(target) = &self.target else {
            return Err(cur
                .and_then(|s| s.lock().closed().cloned())
                .unwrap_or_else(|| {
                    Status::unavailable(
                        "the Ibex connection to the gRPC server is gone, and this channel was \
                         made from a connection (Channel::new) so it cannot reconnect; use \
                         Channel::connect or connect_lazy",
                    )
                }));
        };
        let seen = self.attempts.load(std::sync::atomic::Ordering::Acquire);
        let mut a = self.reconnect.lock().await;
        // Another call may have reconnected while this one waited.
        if let Some(s) = self.current()
            && !s.is_gone()
        {
            return Ok(s);
        }
        // An attempt ended while this call waited for it: its outcome is this call's too.
        if a.done != seen
            && let Some((e, _)) = &a.failed
        {
            return Err(e.clone());
        }
        let connecting = crate::conn::connect(&target.uri, target.config.clone());
        let connected = match self.settings.connect_timeout {
            Some(t) => tokio::time::timeout(t, connecting)
                .await
                .unwrap_or_else(|_| {
                    Err(Error::Timeout(format!(
                        "connecting took longer than the endpoint's connect_timeout of {t:?}"
                    )))
                }),
            None => connecting.await,
        };
        a.done += 1;
        self.attempts
            .store(a.done, std::sync::atomic::Ordering::Release);
        match connected {
            Ok(conn) => {
                a.failed = None;
                let s = Shared::new(conn, self.limits, self.settings.user_agent.as_ref());
                *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(s.clone());
                if cur.is_some() {
                    tracing::info!(uri = %target.uri, "gRPC channel reconnected");
                }
                Ok(s)
            }
            Err(e) => {
                let status = Status::unavailable(format!(
                    "cannot connect to the gRPC server at {}: {e}",
                    target.uri
                ));
                a.failed = Some((status.clone(), tokio::time::Instant::now()));
                Err(status)
            }
        }
    }
}

/// There is no reader task: whoever waits for the server (a caller for its head, a body for
/// its next frame, a request stream for window) reads the connection and hands what it reads
/// to its calls, so a unary call completes on the task that made it.
struct Shared {
    mux: Arc<Mux>,
    calls: Mutex<CallTable<Call>>,
    /// Held while one message is taken off the connection and dispatched, so messages are
    /// demultiplexed and delivered in connection order whichever task reads them.
    demux: Mutex<Demux>,
    /// Made once per connection: calls set it unless the caller did.
    user_agent: http::HeaderValue,
}

struct Call {
    head: Option<HeadTx>,
    /// The response body's inbox, made when something comes for it: an answer that comes
    /// whole (most unary ones) needs none.
    body: Option<InboxTx>,
    /// Its receiving end, until the response head takes it to the caller.
    body_rx: Option<Arc<Inbox>>,
    shared: Arc<CallShared>,
}

impl Slot for Call {
    fn call(&self) -> &CallShared {
        &self.shared
    }
}

impl Call {
    fn body(&mut self) -> &InboxTx {
        self.body.get_or_insert_with(|| {
            let (tx, rx) = inbox(None);
            self.body_rx = Some(rx);
            tx
        })
    }

    /// The receiving end of the body's inbox, for the caller.
    fn take_body(&mut self) -> Arc<Inbox> {
        self.body();
        self.body_rx.take().unwrap_or_else(|| inbox(None).1)
    }

    /// Fails the call with `status`, wherever its caller is waiting.
    fn fail(mut self, status: Status) {
        if let Some(h) = self.head.take() {
            h.send(Err(status));
        } else if let Some(b) = &self.body {
            b.send(Inbound::Error(status));
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, CallTable<Call>> {
        // A panic while holding this lock leaves plain data behind; keep serving.
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The connection is gone: every call fails with `status`, new ones too.
    fn fail_all(&self, status: Status) {
        let mut calls = self.lock();
        for c in calls.close(status.clone()) {
            c.fail(status.clone());
        }
    }

    /// Ends one call here with `status` (its request could not be sent).
    fn fail_call(&self, id: u32, status: Status) {
        if let Some(c) = self.lock().remove(id) {
            c.fail(status);
        }
    }

    /// Dispatches one packet from the server.
    fn dispatch(&self, p: Packet, data: Option<Bytes>) {
        let mut calls = self.lock();
        let mut owned;
        let (c, ended): (&mut Call, bool) = match calls.packet(&p, data.as_ref().map(Bytes::len)) {
            Verdict::Dropped => return,
            Verdict::Overrun(c) => {
                drop(calls);
                self.overrun(p, c);
                return;
            }
            Verdict::Call(Entry::Live(c) | Entry::Cancelled(c)) => (c, false),
            Verdict::Call(Entry::Ended(c)) => {
                owned = c;
                (&mut owned, true)
            }
        };
        Shared::deliver(c, ended, p, data);
    }

    /// Hands what packet `p` brought (its body frame is `data`) to call `c`, which the
    /// packet `ended`.
    fn deliver(c: &mut Call, ended: bool, mut p: Packet, mut data: Option<Bytes>) {
        let mut went_whole = false;
        if let Some(Head::Response {
            status, headers, ..
        }) = p.head.take()
            && let Some(h) = c.head.take()
        {
            // A whole response goes to the caller in one piece, with no inbox on the way.
            went_whole = p.end && !p.reset && c.body.is_none();
            let rest = if went_whole {
                Rest::Whole(data.take(), p.trailers.take())
            } else {
                Rest::Stream(c.take_body())
            };
            h.send(Ok(RespHead {
                status,
                headers,
                rest,
            }));
        }
        if let Some(d) = data {
            c.body().send(Inbound::Data(d));
        }
        if let Some(t) = p.trailers {
            c.body().send(Inbound::Trailers(t.into_map()));
        } else if p.end && !went_whole {
            c.body().send(Inbound::End);
        }
        if p.reset {
            // Cancelled, as stock tonic reports the HTTP/2 reset of a panicked handler.
            let s = Status::cancelled("the server aborted the call (its handler panicked)");
            if let Some(h) = c.head.take() {
                h.send(Err(s));
            } else if let Some(b) = &c.body {
                b.send(Inbound::Error(s));
            }
        }
        if ended && let Some(h) = c.head.take() {
            h.send(Err(Status::internal(
                "the server ended the call without a response head",
            )));
        }
    }

    /// The server sent call `c` more than its window: the call fails here and is reset
    /// on the server.
    fn overrun(&self, mut p: Packet, mut c: Call) {
        if let Some(Head::Response {
            status, headers, ..
        }) = p.head.take()
            && let Some(h) = c.head.take()
        {
            h.send(Ok(RespHead {
                status,
                headers,
                rest: Rest::Stream(c.take_body()),
            }));
        }
        let shared = c.shared.clone();
        c.fail(Status::resource_exhausted(
            "the server overran the call's flow-control window",
        ));
        if self.lock().closed().is_none() {
            self.mux.reset_detached(p.call, shared);
        }
    }

    /// Ends a call from this side and tells the server.
    fn reset(&self, id: u32) {
        let mut calls = self.lock();
        if let Some(c) = calls.remove(id)
            && calls.closed().is_none()
        {
            drop(calls);
            self.mux.reset_detached(id, c.shared);
        }
    }
}

impl Shared {
    fn new(conn: Connection, limits: Limits, prefix: Option<&http::HeaderValue>) -> Arc<Shared> {
        Arc::new(Shared {
            user_agent: user_agent(prefix, conn.provider()),
            mux: Arc::new(Mux::new(conn, Side::Client)),
            calls: Mutex::new(CallTable::new(Side::Client, usize::MAX)),
            demux: Mutex::new(Demux::new(false, limits)),
        })
    }

    /// No new call can use this connection.
    fn is_gone(&self) -> bool {
        self.lock().refusal().is_some() || self.mux.conn.is_closed()
    }

    fn gone(&self, e: Error) -> Status {
        Status::unavailable(format!(
            "the Ibex connection to the gRPC server ({}) is gone: {e}",
            self.mux.conn.peer()
        ))
    }

    fn is_closed(&self) -> bool {
        self.lock().closed().is_some()
    }
}

impl ReadSource for Shared {
    fn poll_read(&self, cx: &mut Context<'_>) -> Poll<bool> {
        if self.is_closed() {
            return Poll::Ready(false);
        }
        let mut demux = self.demux.lock().unwrap_or_else(|p| p.into_inner());
        let msg = match self.mux.conn.poll_recv_parts(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Ok(m)) => m,
            Poll::Ready(Err(e)) => {
                drop(demux);
                self.fail_all(self.gone(e));
                return Poll::Ready(false);
            }
        };
        match demux.push(msg) {
            Ok((p, d)) => self.dispatch(p, d),
            Err(e) => {
                drop(demux);
                tracing::warn!(%e, peer = %self.mux.conn.peer(), "gRPC client: closing the connection");
                self.fail_all(self.gone(e));
                let conn = self.mux.conn.clone();
                tokio::spawn(async move { conn.close().await });
                return Poll::Ready(false);
            }
        }
        Poll::Ready(true)
    }
}

// Moved once, straight into the call's future (or dropped): boxing the large variant would
// add an allocation and save no copy.
#[allow(clippy::large_enum_variant)]
/// What a call sends after its head.
pub(crate) enum Outgoing<'a> {
    /// A body, with the gRPC request headers (`te`, `content-type`) among the head's.
    Body(tonic::body::Body),
    /// One whole prefixed message, written where it goes (into the head's packet if inline);
    /// the gRPC request headers go with it as [`Head::Request`]'s `standard`.
    Whole(&'a (dyn FrameWriter + Sync)),
}

/// What is left to send of a request that did not go out whole at once, as a future. Out of
/// line, so callers' frames do not reserve its size on every call.
#[inline(never)]
fn sending(
    shared: &Arc<Shared>,
    call: &Arc<CallShared>,
    id: u32,
    later: Later<tonic::body::Body>,
) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    let pump_shared = shared.clone();
    let pump_call = call.clone();
    Box::pin(async move {
        let mux = &pump_shared.mux;
        let pumped = match later {
            Later::Unsent(unsent) => {
                let r = unsent.send(mux).await;
                pump_call.head_sent.set();
                match r {
                    Ok(()) => Pumped::Done,
                    Err(e) => Pumped::Failed(transport_status(&e)),
                }
            }
            Later::Rest(rest) => {
                let reader: &Shared = &pump_shared;
                let side = Side::Client;
                let Remainder { first, body } = *rest;
                pump(mux, id, &pump_call, first, body, side, None, Some(reader)).await
            }
        };
        if let Pumped::Failed(s) = pumped {
            // The request body failed or was refused: the call fails with that status.
            pump_shared.fail_call(id, s);
        }
    })
}

/// What a call's start left to send.
enum Later<B> {
    Unsent(Encoded),
    Rest(Box<Remainder<B>>),
}

/// Held by a call's future and then its response body: dropping it before the call ended
/// cancels the call on the server.
struct CallGuard {
    shared: Arc<Shared>,
    id: u32,
    armed: bool,
}

impl OnDrop for CallGuard {
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if self.armed {
            self.shared.reset(self.id);
        }
    }
}

impl Channel {
    /// Connects to a gRPC server at an Ibex address (`shm:///path.sock`, `tcp://host:port`)
    /// with the default configuration (`Config::default()`).
    pub async fn connect(uri: &str) -> Result<Channel> {
        Channel::connect_with_config(uri, Config::default()).await
    }

    /// Connects with an explicit transport configuration. When the connection is gone, calls
    /// in flight fail `Unavailable` naming the cause, and the next call connects again, as
    /// tonic's channel does.
    pub async fn connect_with_config(uri: &str, config: Config) -> Result<Channel> {
        let conn = crate::conn::connect(uri, config.clone()).await?;
        let target = Target {
            uri: uri.into(),
            config,
        };
        Ok(Channel::from_inner(Inner::new(
            Some(conn),
            Some(target),
            Limits::default(),
        )))
    }

    /// A channel that connects on its first call (and again after the connection is gone),
    /// as tonic's `Endpoint::connect_lazy`: nothing is checked until then, so a client can
    /// be made before its server is up.
    pub fn connect_lazy(uri: &str, config: Config) -> Result<Channel> {
        config.validate()?;
        crate::conn::Addr::parse(uri)?;
        let target = Target {
            uri: uri.into(),
            config,
        };
        Ok(Channel::from_inner(Inner::new(
            None,
            Some(target),
            Limits::default(),
        )))
    }

    pub(super) fn from_inner(inner: Inner) -> Channel {
        Channel {
            kind: Kind::Ibex(Arc::new(inner)),
        }
    }

    /// Connects to any gRPC server: an Ibex address (`shm://`, `tcp://`, `verbs://`,
    /// `ibex://`) over Ibex, or `http://host:port` over stock HTTP/2 (tonic's own channel),
    /// so one program and one client type serve both kinds of deployment. With a client
    /// [`Config::tls`], `tcp://` runs TLS and so does `https://host:port` (HTTP/2 over the
    /// same rustls settings). Over HTTP/2 there is no one-sided access:
    /// [`Channel::expose`] fails and [`Channel::connection`] is `None`.
    pub async fn connect_any(uri: &str, config: Config) -> Result<Channel> {
        let https = uri.starts_with("https://");
        if !https && !uri.starts_with("http://") {
            return Channel::connect_with_config(uri, config).await;
        }
        let bad = |why: String| Error::Address {
            addr: uri.into(),
            why,
        };
        let failed = |e: tonic::transport::Error| Error::Io {
            context: format!("connecting to the gRPC server at {uri} over HTTP/2"),
            source: std::io::Error::new(std::io::ErrorKind::ConnectionRefused, error_chain(&e))
                .into(),
        };
        let ch = if https {
            let Some(crate::tls::Tls::Client {
                config: tls,
                server_name,
            }) = &config.tls
            else {
                return Err(Error::Config(format!(
                    "{uri}: an https:// address needs a client TLS setting: Config::tls = \
                     Some(ClientTlsConfig::new().ca_certificate(..).transport()?)"
                )));
            };
            // tonic's channel sees a plain address; the connector below makes the TLS
            // stream (so tonic's own TLS, which takes no rustls configuration, stays out).
            let plain = format!("http://{}", &uri["https://".len()..]);
            let connector = TlsConnector::new(tls, server_name.clone());
            tonic::transport::Endpoint::from_shared(plain)
                .map_err(|e| bad(format!("not an https:// URI: {e}")))?
                .tcp_nodelay(true)
                .connect_with_connector(connector)
                .await
                .map_err(failed)?
        } else {
            tonic::transport::Endpoint::from_shared(uri.to_string())
                .map_err(|e| bad(format!("not an http:// URI: {e}")))?
                .tcp_nodelay(true)
                .connect()
                .await
                .map_err(failed)?
        };
        Ok(Channel {
            kind: Kind::Http(ch),
        })
    }

    /// True for a channel over an Ibex connection (registered memory, one-sided reads);
    /// false for stock HTTP/2 ([`Channel::connect_any`] with an `http://` address).
    pub fn is_ibex(&self) -> bool {
        self.ibex().is_some()
    }

    /// The one Ibex connection's state; `None` over HTTP/2 and for a balanced channel (a
    /// call there picks its endpoint first).
    pub(crate) fn ibex(&self) -> Option<&Arc<Inner>> {
        match &self.kind {
            Kind::Ibex(inner) => Some(inner),
            Kind::Http(_) | Kind::Balanced(_) => None,
        }
    }

    /// Runs gRPC calls over an established connection (which nothing else should read).
    /// Must be called within a tokio runtime.
    pub fn new(conn: Connection) -> Channel {
        Channel::with_limits(conn, Limits::default())
    }

    /// Like [`Channel::new`], accepting response header lists of up to
    /// `max_header_list_size` bytes (name + value + 32 per entry, as HTTP/2 counts; default
    /// 16 KiB, as hyper's). A server that sends more breaks the connection.
    pub fn with_max_header_list_size(conn: Connection, max_header_list_size: usize) -> Channel {
        Channel::with_limits(
            conn,
            Limits {
                max_header_list_size,
            },
        )
    }

    fn with_limits(conn: Connection, limits: Limits) -> Channel {
        Channel::from_inner(Inner::new(Some(conn), None, limits))
    }

    /// Exposes `buf` for one-sided reads by the server until the returned [`RemoteBuf`] is
    /// dropped. Put `descriptor()` in a request; the handler pulls it with
    /// [`PeerHandle::read_remote`](super::PeerHandle::read_remote).
    pub async fn expose(&self, buf: Bytes) -> Result<RemoteBuf> {
        match self.ibex() {
            Some(inner) => {
                let shared = inner.connection().await.map_err(|s| {
                    Error::PeerGone(format!("no connection to expose on: {}", s.message()))
                })?;
                shared.mux.conn.expose(buf).await
            }
            None => Err(Error::Config(
                "this channel speaks stock HTTP/2 (an http:// address): buffers can be exposed \
                 for one-sided reads only over an Ibex address (shm://, tcp://, verbs://)"
                    .into(),
            )),
        }
    }

    /// True when the provider reads peer memory without the peer's CPU (shm CMA, RDMA).
    pub fn one_sided(&self) -> bool {
        self.connection().is_some_and(|c| c.one_sided())
    }

    /// The smallest buffer worth sending by descriptor on this channel
    /// ([`Connection::remote_min`]); `None` when the channel cannot read one-sided (tcp,
    /// HTTP/2, no connection yet).
    pub fn remote_min(&self) -> Option<usize> {
        self.connection().and_then(|c| c.remote_min())
    }

    /// The Ibex connection in use (stats, pool); `None` over HTTP/2, or while a lazy or
    /// reconnecting channel has none.
    pub fn connection(&self) -> Option<Connection> {
        self.ibex()
            .and_then(|inner| inner.current())
            .map(|s| s.mux.conn.clone())
    }

    async fn call<B>(
        inner: Arc<Inner>,
        req: http::Request<B>,
    ) -> std::result::Result<http::Response<IncomingBody>, Status>
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = req.into_parts();
        // A generated client's path is static: this clone copies nothing.
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
        // A generated client's request body is tonic's already: `Body::new` passes it through
        // (anything else is boxed once), and it can be polled unpinned.
        let answer = Self::exchange(
            inner,
            parts.headers,
            path,
            Outgoing::Body(tonic::body::Body::new(body)),
        )
        .await?;
        let body = match answer.rest {
            Reply::Whole(data, trailers) => {
                IncomingBody::complete(data, trailers.map(Trailers::into_map), None)
            }
            Reply::Stream(body) => body,
        };
        let mut resp = http::Response::new(body);
        *resp.status_mut() = answer.status;
        *resp.headers_mut() = answer.headers;
        *resp.version_mut() = http::Version::HTTP_2;
        Ok(resp)
    }

    /// One call on an Ibex channel: sends the request (head `headers` for `path`, then
    /// `out`) and returns the response head with how the rest comes.
    pub(crate) async fn exchange(
        inner: Arc<Inner>,
        mut headers: HeaderMap,
        path: http::uri::PathAndQuery,
        out: Outgoing<'_>,
    ) -> std::result::Result<Answer, Status> {
        // A concurrency-limited channel holds a slot until the response head is in, as
        // tower's ConcurrencyLimit does.
        let _slot =
            match &inner.settings.limit {
                Some(l) => Some(l.clone().acquire_owned().await.map_err(|_| {
                    Status::internal("the channel's concurrency limiter was closed")
                })?),
                None => None,
            };
        if let Some(t) = inner.settings.timeout {
            let asked = parse_timeout(&headers);
            if asked.is_none_or(|a| a > t) {
                // As tonic's endpoint timeout: the shorter one wins, and the server learns it.
                headers.insert(
                    GRPC_TIMEOUT,
                    http::HeaderValue::from_str(&format!("{}m", t.as_millis().max(1)))
                        .unwrap_or_else(|_| http::HeaderValue::from_static("1m")),
                );
            }
        }
        if let Some(rate) = &inner.settings.rate {
            rate.acquire().await;
        }
        let deadline = parse_timeout(&headers).map(|t| tokio::time::Instant::now() + t);
        let shared = match deadline {
            // A call that finds no connection waits for the attempt it starts, within its
            // deadline.
            Some(d) => tokio::time::timeout_at(d, inner.connection())
                .await
                .map_err(|_| {
                    Status::deadline_exceeded(
                        "the call's deadline passed while its channel was connecting",
                    )
                })??,
            None => inner.connection().await?,
        };
        // As tonic's channel does, plus what carries the call. A whole message's standard
        // headers, the user agent among them, are written straight onto the wire.
        let (body, standard) = match out {
            Outgoing::Body(body) => {
                headers
                    .entry(http::header::USER_AGENT)
                    .or_insert_with(|| shared.user_agent.clone());
                (Ok(body), None)
            }
            Outgoing::Whole(data) => (Err(data), Some(shared.user_agent.clone())),
        };
        let call = CallShared::new();
        let head_rx = HeadRx(call.clone());
        let call_entry = Call {
            head: Some(HeadTx(Some(call.clone()))),
            body: None,
            body_rx: None,
            shared: call.clone(),
        };
        // A whole message is a direct unary call: its id says so to the decoder.
        let id = if body.is_err() {
            shared.lock().open_whole(call_entry)?
        } else {
            shared.lock().open(call_entry)?
        };
        let mut guard = CallGuard {
            shared: shared.clone(),
            id,
            armed: true,
        };

        let mut head = Packet::new(id);
        head.head = Some(Head::Request {
            path,
            headers,
            standard,
        });
        // A unary request is complete at once: it goes out here, in one packet, with no
        // future for it. Whatever would wait goes on in the sending future below.
        let now = match body {
            Ok(body) => pump_now(&shared.mux, head, body, Side::Client),
            // A message small enough to ride in its packet needs no body to pump.
            Err(data) if data.len() <= shared.mux.inline_max() => {
                head.end = true;
                head.compact = true;
                let now = match head.encode_written(data) {
                    // The message's encoding disagrees with its length; nothing went out.
                    Err(e) => Now::Failed(Status::internal(format!(
                        "the request could not be sent: {e}"
                    ))),
                    Ok(bytes) => match shared.mux.send_encoded_now(id, bytes) {
                        Ok(None) => Now::Sent,
                        Ok(Some(unsent)) => Now::Unsent(unsent),
                        Err(e) => Now::Failed(transport_status(&e)),
                    },
                };
                // The packet (its head's map) is dropped once the bytes are on their way,
                // and is not held by the call's future.
                drop(head);
                now
            }
            Err(data) => match FrameBuf::from_writer(data) {
                Ok(frame) => {
                    let body = IncomingBody::complete(Some(frame.into_bytes()), None, None);
                    pump_now(
                        &shared.mux,
                        head,
                        tonic::body::Body::new(body),
                        Side::Client,
                    )
                }
                // Sent, the server would find a malformed frame; nothing went out.
                Err(e) => Now::Failed(Status::internal(format!(
                    "the request could not be sent: {e}"
                ))),
            },
        };
        let later = match now {
            Now::Sent => {
                call.head_sent.set();
                None
            }
            Now::Failed(s) => {
                call.head_sent.set();
                shared.fail_call(id, s);
                None
            }
            Now::Unsent(unsent) => Some(Later::Unsent(unsent)),
            Now::Rest(rest) => Some(Later::Rest(rest)),
        };
        if let Some(later) = later {
            let mut sending = sending(&shared, &call, id, later);
            // What is left usually goes out in this first poll, saving a task hop; what would
            // wait finishes in its own task, so the sending future is never dropped half-way.
            let finished =
                std::future::poll_fn(|cx| Poll::Ready(sending.as_mut().poll(cx).is_ready())).await;
            if !finished {
                tokio::spawn(sending);
            }
        }

        // Whoever waits, reads: this task takes the answer off the connection itself.
        let head_rx = read_while(&*shared, head_rx);
        let head = match deadline {
            Some(d) => tokio::select! {
                h = head_rx => h,
                _ = tokio::time::sleep_until(d) => {
                    return Err(Status::deadline_exceeded("Deadline exceeded (grpc-timeout) before the server answered"));
                }
            },
            None => head_rx.await,
        };
        let RespHead {
            status,
            headers,
            rest,
        } = match head {
            Ok(Ok(h)) => h,
            Ok(Err(s)) => {
                guard.disarm();
                return Err(s);
            }
            Err(_) => {
                guard.disarm();
                return Err(shared
                    .lock()
                    .closed()
                    .cloned()
                    .unwrap_or_else(|| Status::internal("the call ended without a response")));
            }
        };
        let rest = match rest {
            // The call is over: nothing to cancel, wait for or read.
            Rest::Whole(data, trailers) => {
                guard.disarm();
                Reply::Whole(data, trailers)
            }
            Rest::Stream(body_rx) => {
                let lost = || {
                    Status::unavailable(
                        "the Ibex connection to the gRPC server was lost during the call",
                    )
                };
                let reader: Arc<dyn ReadSource> = shared.clone();
                let body = IbexBody::new(body_rx, shared.mux.clone(), id, call, lost)
                    .with_deadline(deadline)
                    .with_guard(Box::new(guard))
                    .with_reader(reader);
                Reply::Stream(IncomingBody::from(body))
            }
        };
        Ok(Answer {
            status,
            headers,
            rest,
        })
    }
}

/// A response head from [`Channel::exchange`], and how the rest of the response comes.
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) rest: Reply,
}

pub(crate) enum Reply {
    /// The call is over: its one body frame, if any, and its trailers.
    Whole(Option<Bytes>, Option<Trailers>),
    /// The body, read as it comes (it holds the call open until it ends or is dropped).
    Stream(IncomingBody),
}

/// `tonic/<version> ibex/<version> (<provider>)`: what tonic's channel sends, plus what
/// carries the call.
fn user_agent(prefix: Option<&http::HeaderValue>, provider: &'static str) -> http::HeaderValue {
    let prefix = prefix
        .and_then(|p| p.to_str().ok())
        .map(|p| format!("{p} "))
        .unwrap_or_default();
    http::HeaderValue::from_str(&format!(
        "{prefix}tonic/0.14 ibex/{} ({provider})",
        env!("CARGO_PKG_VERSION")
    ))
    .unwrap_or_else(|_| http::HeaderValue::from_static("tonic/0.14 ibex"))
}

impl<B> tower::Service<http::Request<B>> for Channel
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<IncomingBody>;
    /// A `Status` so tonic reports transport failures with their real code.
    type Error = Status;
    type Future = Pin<Box<dyn Future<Output = std::result::Result<Self::Response, Status>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<std::result::Result<(), Status>> {
        // Calls queue in the transport (which applies backpressure per send), never here.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match &self.kind {
            Kind::Ibex(inner) => Box::pin(Channel::call(inner.clone(), req)),
            Kind::Http(ch) => Box::pin(http_call(ch.clone(), req)),
            Kind::Balanced(b) => {
                let b = b.clone();
                Box::pin(async move {
                    let deadline =
                        parse_timeout(req.headers()).map(|t| tokio::time::Instant::now() + t);
                    let (member, _load) = b.pick(deadline).await?;
                    match member.kind {
                        Kind::Ibex(inner) => Channel::call(inner, req).await,
                        Kind::Http(ch) => http_call(ch, req).await,
                        // Endpoints are plain channels.
                        Kind::Balanced(_) => Err(Status::internal(
                            "a balanced channel's endpoint is itself balanced",
                        )),
                    }
                })
            }
        }
    }
}

/// Makes the TLS streams an `https://` channel of [`Channel::connect_any`] runs HTTP/2 on:
/// TCP to the address, then the handshake with the transport's rustls client settings,
/// offering `h2` as HTTP/2 over TLS requires.
#[derive(Clone)]
struct TlsConnector {
    tls: tokio_rustls::TlsConnector,
    /// The name the server's certificate must hold; `None`: the host connected to.
    server_name: Option<String>,
}

impl TlsConnector {
    fn new(config: &Arc<rustls::ClientConfig>, server_name: Option<String>) -> TlsConnector {
        let mut config = (**config).clone();
        config.alpn_protocols = vec![b"h2".to_vec()];
        TlsConnector {
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
            server_name,
        }
    }
}

impl tower::Service<http::Uri> for TlsConnector {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
    type Error = BoxError;
    type Future =
        Pin<Box<dyn Future<Output = std::result::Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<std::result::Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let host = uri.host().ok_or("the address has no host")?;
            let port = uri.port_u16().unwrap_or(443);
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let name = this.server_name.clone().unwrap_or(host);
            let name = rustls::pki_types::ServerName::try_from(name)
                .map_err(|e| format!("not a server name to verify: {e}"))?;
            let stream = this.tls.connect(name, tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(stream))
        })
    }
}

/// One call over stock HTTP/2, through tonic's channel.
async fn http_call<B>(
    mut ch: tonic::transport::Channel,
    req: http::Request<B>,
) -> std::result::Result<http::Response<IncomingBody>, Status>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let req = req.map(tonic::body::Body::new);
    // tonic's channel is a buffer: it must say it is ready before each call.
    std::future::poll_fn(|cx| {
        tower::Service::<http::Request<tonic::body::Body>>::poll_ready(&mut ch, cx)
    })
    .await
    .map_err(|e| Status::from_error(Box::new(e)))?;
    let resp = tower::Service::call(&mut ch, req)
        .await
        .map_err(|e| Status::from_error(Box::new(e)))?;
    Ok(resp.map(IncomingBody::http))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn head() -> HeadResult {
        Ok(RespHead {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            rest: Rest::Whole(None, None),
        })
    }

    #[test]
    fn the_head_slot_is_a_oneshot() {
        let wakes = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);

        // Sent after the caller waited: the caller is woken once and gets it.
        let call = CallShared::new();
        let mut rx = std::pin::pin!(HeadRx(call.clone()));
        let tx = HeadTx(Some(call.clone()));
        assert!(rx.as_mut().poll(&mut cx).is_pending());
        tx.send(head());
        assert_eq!(wakes.0.load(Ordering::Relaxed), 1);
        assert!(matches!(rx.as_mut().poll(&mut cx), Poll::Ready(Ok(Ok(_)))));

        // Dropped unsent: the caller is woken and told, as a closed channel would.
        let call = CallShared::new();
        let mut rx = std::pin::pin!(HeadRx(call.clone()));
        assert!(rx.as_mut().poll(&mut cx).is_pending());
        drop(HeadTx(Some(call.clone())));
        assert_eq!(wakes.0.load(Ordering::Relaxed), 2);
        assert!(matches!(rx.as_mut().poll(&mut cx), Poll::Ready(Err(()))));

        // A head the caller never takes does not stay with the call once the caller is gone.
        let call = CallShared::new();
        let rx = HeadRx(call.clone());
        HeadTx(Some(call.clone())).send(head());
        drop(rx);
        assert!(head_slot(&call).value.is_none());
    }
}
