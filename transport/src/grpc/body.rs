//! The body of an incoming call half (request on the server, response on the client): what
//! the reader dispatched to the call, as an `http_body::Body`, returning credit as consumed.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::Frame;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use futures_util::task::AtomicWaker;
use tonic::Status;

use super::wire::Packet;
use super::{CallShared, Mux};

/// What the reader hands a call.
#[derive(Debug)]
pub(crate) enum Inbound {
    Data(Bytes),
    Trailers(HeaderMap),
    End,
    Error(Status),
}

/// A call's inbound queue, lighter than a channel: a tokio channel allocates a 32-slot block
/// per call, and calls are many and short.
pub(crate) struct Inbox {
    queue: Mutex<VecDeque<Inbound>>,
    waker: AtomicWaker,
    /// The sending side is gone: nothing more will come.
    closed: AtomicBool,
    /// The connection's account of body bytes received and not yet taken (server side).
    held: Option<Arc<Held>>,
}

/// What all of a server's connections hold for their peers, against one budget
/// ([`Config::max_memory`](crate::Config::max_memory)): request bytes handlers have not
/// taken, calls in flight, answers waiting for send room.
#[derive(Debug)]
pub(crate) struct Budget {
    used: AtomicUsize,
    limit: usize,
    /// What a connection may hold whatever the others do: while the server is over its
    /// budget, connections holding more are paused and take no new calls, and those holding
    /// less (honest clients with a call or two in flight) are still served.
    floor: usize,
    /// Bytes the connections that ended since freed memory was last given back to the
    /// system had received.
    churn: AtomicUsize,
}

impl Budget {
    pub(crate) fn new(limit: usize) -> Arc<Budget> {
        Arc::new(Budget {
            used: AtomicUsize::new(0),
            limit,
            floor: (limit / 1024).clamp(64 << 10, 1 << 20),
            churn: AtomicUsize::new(0),
        })
    }

    /// Bytes held now, over all connections.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    fn over(&self) -> bool {
        self.used.load(Ordering::Acquire) > self.limit
    }

    /// Adds what a connection that ended had received; true, once each time, when the
    /// connections ended since then received at least `least` bytes together: the moment to
    /// give freed memory back to the system.
    pub(crate) fn ended(&self, received: usize, least: usize) -> bool {
        let churn = self.churn.fetch_add(received, Ordering::AcqRel) + received;
        churn >= least
            && self
                .churn
                .compare_exchange(churn, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }
}

/// What one server connection holds for its peer: body bytes its handlers have not taken,
/// and its calls in flight ([`Held::charge`]). Bounded per connection (HTTP/2's connection
/// window: calls whose handlers do not read cannot make the server buffer
/// `calls x window`), and, while the server is over its [`Budget`], by the budget's floor.
/// Past either the connection stops reading.
pub(crate) struct Held {
    bytes: AtomicUsize,
    limit: usize,
    budget: Arc<Budget>,
    /// Signalled (with a stored permit) when `bytes` falls back to the limit.
    below: tokio::sync::Notify,
}

impl Held {
    pub(crate) fn new(limit: usize, budget: Arc<Budget>) -> Arc<Held> {
        Arc::new(Held {
            bytes: AtomicUsize::new(0),
            limit,
            budget,
            below: tokio::sync::Notify::new(),
        })
    }

    /// True while the connection must not read more.
    pub(crate) fn over(&self) -> bool {
        let bytes = self.bytes.load(Ordering::Acquire);
        bytes > self.limit || (bytes > self.budget.floor && self.budget.over())
    }

    /// Why a new call on this connection is refused, if it is: the server is over its
    /// budget and this connection holds more than the floor.
    pub(crate) fn refusal(&self) -> Option<Status> {
        let bytes = self.bytes.load(Ordering::Acquire);
        (bytes > self.budget.floor && self.budget.over()).then(|| {
            Status::resource_exhausted(format!(
                "the server holds {} MiB for its clients, over its budget of {} MiB \
                 (Config::max_memory, IBEX_MAX_MEMORY, ibex-ps --max-memory), and this \
                 connection holds {} KiB of it; retry once your calls in flight finish",
                self.budget.used() >> 20,
                self.budget.limit >> 20,
                bytes >> 10
            ))
        })
    }

    /// Resolves once the connection may read again: at once if a release crossed its own
    /// limit since the last wait (`notify_one` keeps a permit); the server's budget is
    /// looked at again every few milliseconds, since any connection's release may free it.
    pub(crate) async fn below(&self) {
        let _ =
            tokio::time::timeout(std::time::Duration::from_millis(5), self.below.notified()).await;
    }

    /// The server's budget this connection's account is part of.
    pub(crate) fn budget(&self) -> &Budget {
        &self.budget
    }

    fn take(&self, n: usize) {
        self.bytes.fetch_add(n, Ordering::AcqRel);
        self.budget.used.fetch_add(n, Ordering::AcqRel);
    }

    fn release(&self, n: usize) {
        self.budget.used.fetch_sub(n, Ordering::AcqRel);
        let before = self.bytes.fetch_sub(n, Ordering::AcqRel);
        if before > self.limit && before - n <= self.limit {
            self.below.notify_one();
        }
    }

    /// Accounts `n` bytes on this connection until the returned charge is dropped.
    pub(crate) fn charge(self: &Arc<Self>, n: usize) -> Charge {
        if n == 0 {
            return Charge(None);
        }
        self.take(n);
        Charge(Some((self.clone(), n)))
    }
}

/// Bytes a connection holds until this is dropped ([`Held::charge`]).
pub(crate) struct Charge(Option<(Arc<Held>, usize)>);

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some((held, n)) = self.0.take() {
            held.release(n);
        }
    }
}

/// The dispatching side of an [`Inbox`]; dropping it closes the inbox.
pub(crate) struct InboxTx(Arc<Inbox>);

pub(crate) fn inbox(held: Option<Arc<Held>>) -> (InboxTx, Arc<Inbox>) {
    let i = Arc::new(Inbox {
        queue: Mutex::new(VecDeque::new()),
        waker: AtomicWaker::new(),
        closed: AtomicBool::new(false),
        held,
    });
    (InboxTx(i.clone()), i)
}

impl InboxTx {
    pub(crate) fn send(&self, item: Inbound) {
        if let (Some(h), Inbound::Data(d)) = (&self.0.held, &item) {
            h.take(d.len());
        }
        self.0
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(item);
        self.0.waker.wake();
    }
}

impl Drop for InboxTx {
    fn drop(&mut self) {
        self.0.closed.store(true, Ordering::Release);
        self.0.waker.wake();
    }
}

impl Inbox {
    /// The next item; `None` once the sender is gone and the queue is empty.
    fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Option<Inbound>> {
        // Register first, so an item pushed between the look and the return still wakes us.
        self.waker.register(cx.waker());
        if let Some(x) = self.pop() {
            return Poll::Ready(Some(x));
        }
        if self.closed.load(Ordering::Acquire) {
            // Anything pushed before the close is visible now.
            return Poll::Ready(self.pop());
        }
        Poll::Pending
    }

    fn pop(&self) -> Option<Inbound> {
        let x = self
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front();
        if let (Some(h), Some(Inbound::Data(d))) = (&self.held, &x) {
            h.release(d.len());
        }
        x
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        // What no handler took leaves the connection's account with the call.
        if let Some(h) = &self.held {
            let q = self.queue.get_mut().unwrap_or_else(|p| p.into_inner());
            let n: usize = q
                .iter()
                .map(|x| match x {
                    Inbound::Data(d) => d.len(),
                    _ => 0,
                })
                .sum();
            h.release(n);
        }
    }
}

/// A connection that whoever waits on it may read (the client's: it has no reader task).
pub(crate) trait ReadSource: Send + Sync {
    /// Takes one message off the connection and dispatches it to its call. `Ready(true)`:
    /// one was dispatched (poll again for more); `Ready(false)`: the connection is closed
    /// and every call has been told; `Pending`: nothing yet, and `cx` is woken when there is.
    fn poll_read(&self, cx: &mut Context<'_>) -> Poll<bool>;
}

/// Messages one poll may take off the connection before it yields, so a reader busy with
/// other calls' traffic does not starve its own task's neighbours.
pub(crate) const READ_BUDGET: usize = 64;

/// Something to run when the body is dropped before its end (the client cancels its call).
pub(crate) trait OnDrop: Send + Sync {
    /// The call ended normally: nothing to do on drop.
    fn disarm(&mut self);
}

/// An incoming gRPC body: data frames, then (on the client) the trailers. Errors are
/// [`tonic::Status`] values, so tonic reports them with their real code. On a channel
/// connected to an `http://` address it is stock tonic's HTTP/2 body.
pub struct IncomingBody {
    kind: Kind,
}

enum Kind {
    Ibex(IbexBody),
    Complete(Complete),
    Http(tonic::body::Body),
}

impl IncomingBody {
    pub(crate) fn http(b: tonic::body::Body) -> IncomingBody {
        IncomingBody {
            kind: Kind::Http(b),
        }
    }

    /// A call half that arrived whole in one packet (a unary request or response): its body
    /// frame, then trailers (client) or its end, with no inbox or flow control. On the server
    /// `held` keeps the bytes on the connection's account until the handler takes them.
    pub(crate) fn complete(
        data: Option<Bytes>,
        trailers: Option<HeaderMap>,
        held: Option<Arc<Held>>,
    ) -> IncomingBody {
        if let (Some(h), Some(d)) = (&held, &data) {
            h.take(d.len());
        }
        IncomingBody {
            kind: Kind::Complete(Complete {
                data,
                trailers,
                held,
            }),
        }
    }
}

/// See [`IncomingBody::complete`].
struct Complete {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
    held: Option<Arc<Held>>,
}

impl Complete {
    fn next(&mut self) -> Option<Frame<Bytes>> {
        if let Some(d) = self.data.take() {
            if let Some(h) = &self.held {
                h.release(d.len());
            }
            return Some(Frame::data(d));
        }
        self.trailers.take().map(Frame::trailers)
    }
}

impl Drop for Complete {
    fn drop(&mut self) {
        if let (Some(h), Some(d)) = (&self.held, &self.data) {
            h.release(d.len());
        }
    }
}

impl std::fmt::Debug for IncomingBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Ibex(b) => b.fmt(f),
            Kind::Complete(c) => f
                .debug_struct("IncomingBody")
                .field("complete", &true)
                .field("data", &c.data.as_ref().map(Bytes::len))
                .finish(),
            Kind::Http(_) => f.write_str("IncomingBody(HTTP/2)"),
        }
    }
}

/// An empty body, which tonic's generated `with_interceptor` clients require of a channel's
/// response body.
impl Default for IncomingBody {
    fn default() -> IncomingBody {
        IncomingBody::http(tonic::body::Body::default())
    }
}

impl From<IbexBody> for IncomingBody {
    fn from(b: IbexBody) -> IncomingBody {
        IncomingBody {
            kind: Kind::Ibex(b),
        }
    }
}

impl http_body::Body for IncomingBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        match &mut self.get_mut().kind {
            Kind::Ibex(b) => Pin::new(b).poll_frame(cx),
            Kind::Complete(c) => Poll::Ready(c.next().map(Ok)),
            Kind::Http(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Ibex(b) => b.is_end_stream(),
            Kind::Complete(c) => c.data.is_none() && c.trailers.is_none(),
            Kind::Http(b) => http_body::Body::is_end_stream(b),
        }
    }
}

/// A call half that arrives over an Ibex connection.
pub(crate) struct IbexBody {
    rx: Arc<Inbox>,
    mux: Arc<Mux>,
    call_id: u32,
    call: Arc<CallShared>,
    /// Consumed since the last window update.
    consumed: i64,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    guard: Option<Box<dyn OnDrop>>,
    /// Where to read from while waiting for a frame, when no task reads for us.
    reader: Option<Arc<dyn ReadSource>>,
    /// What the call says if its source vanished without an end (connection lost); built
    /// only then, not on every call.
    lost: fn() -> Status,
    done: bool,
}

impl std::fmt::Debug for IbexBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncomingBody")
            .field("call", &self.call_id)
            .field("done", &self.done)
            .finish()
    }
}

impl Drop for IbexBody {
    fn drop(&mut self) {
        // Forget the reader's waker, so the inbox's later close does not wake the task that
        // is done with it: on the server that is the connection's own task, and waking a
        // running task re-queues it as a yield and wakes an idle worker to steal it.
        drop(self.rx.waker.take());
    }
}

impl IbexBody {
    pub(crate) fn new(
        rx: Arc<Inbox>,
        mux: Arc<Mux>,
        call_id: u32,
        call: Arc<CallShared>,
        lost: fn() -> Status,
    ) -> IbexBody {
        IbexBody {
            rx,
            mux,
            call_id,
            call,
            consumed: 0,
            deadline: None,
            guard: None,
            reader: None,
            lost,
            done: false,
        }
    }

    pub(crate) fn with_deadline(mut self, at: Option<tokio::time::Instant>) -> Self {
        self.deadline = at.map(|d| Box::pin(tokio::time::sleep_until(d)));
        self
    }

    pub(crate) fn with_guard(mut self, g: Box<dyn OnDrop>) -> Self {
        self.guard = Some(g);
        self
    }

    pub(crate) fn with_reader(mut self, r: Arc<dyn ReadSource>) -> Self {
        self.reader = Some(r);
        self
    }

    fn end(&mut self) {
        self.done = true;
        if let Some(g) = self.guard.as_mut() {
            g.disarm();
        }
    }

    /// Gives consumed bytes back to the sender (see [`CallShared::consumed`]).
    fn consume(&mut self, len: usize) {
        if let Some(grant) = self.call.consumed(&mut self.consumed, len) {
            let mut p = Packet::new(self.call_id);
            p.window = Some(grant);
            self.mux.send_detached(p);
        }
    }
}

impl http_body::Body for IbexBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        // What already arrived is delivered before a deadline is looked at.
        let mut budget = READ_BUDGET;
        // Set once this task found nothing more to read: the inbox's registration made by the
        // next look is then the one the task sleeps on.
        let mut read_all = false;
        loop {
            return match this.rx.poll_recv(cx) {
                Poll::Ready(Some(Inbound::Data(d))) => {
                    this.consume(d.len());
                    Poll::Ready(Some(Ok(Frame::data(d))))
                }
                Poll::Ready(Some(Inbound::Trailers(t))) => {
                    this.end();
                    Poll::Ready(Some(Ok(Frame::trailers(t))))
                }
                Poll::Ready(Some(Inbound::End)) => {
                    this.end();
                    Poll::Ready(None)
                }
                Poll::Ready(Some(Inbound::Error(s))) => {
                    this.end();
                    Poll::Ready(Some(Err(s)))
                }
                Poll::Ready(None) => {
                    this.end();
                    Poll::Ready(Some(Err((this.lost)())))
                }
                Poll::Pending => {
                    // Nothing for us yet: read the connection ourselves (whoever waits, reads).
                    if let Some(r) = &this.reader
                        && budget > 0
                        && !read_all
                    {
                        // Unregistered while reading: a frame read for our own inbox must
                        // not wake this running task (a yield, and an idle worker woken).
                        drop(this.rx.waker.take());
                        match r.poll_read(cx) {
                            Poll::Ready(true) => budget -= 1,
                            // Closed: our channel has been told.
                            Poll::Ready(false) => this.reader = None,
                            Poll::Pending => read_all = true,
                        }
                        continue;
                    } else if budget == 0 {
                        cx.waker().wake_by_ref();
                    }
                    if let Some(d) = this.deadline.as_mut()
                        && d.as_mut().poll(cx).is_ready()
                    {
                        // Leave the guard armed: dropping it resets the call on the server.
                        this.done = true;
                        this.guard = None;
                        return Poll::Ready(Some(Err(Status::deadline_exceeded(
                            "Deadline exceeded (grpc-timeout) while receiving the response",
                        ))));
                    }
                    Poll::Pending
                }
            };
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_whole_body_stays_on_the_connections_account_until_taken() {
        let budget = Budget::new(1 << 30);
        let held = Held::new(1 << 20, budget.clone());
        let data = Bytes::from_static(&[7u8; 100]);
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));

        let body = IncomingBody::complete(Some(data.clone()), Some(trailers), Some(held.clone()));
        assert_eq!(held.bytes.load(Ordering::Acquire), 100);
        assert_eq!(budget.used(), 100);
        let got = body.collect().await.ok().map(|c| {
            let t = c.trailers().cloned();
            (c.to_bytes(), t)
        });
        let (bytes, t) = got.unwrap_or_default();
        assert_eq!(bytes, data);
        assert_eq!(
            t.map(|t| t["grpc-status"].clone()),
            Some(http::HeaderValue::from_static("0"))
        );
        assert_eq!(held.bytes.load(Ordering::Acquire), 0);

        // A handler that never reads it gives the bytes back when it drops it.
        let body = IncomingBody::complete(Some(data), None, Some(held.clone()));
        assert_eq!(held.bytes.load(Ordering::Acquire), 100);
        drop(body);
        assert_eq!(held.bytes.load(Ordering::Acquire), 0);
    }

    #[test]
    fn past_the_budget_only_connections_above_the_floor_pause_and_refuse() {
        let budget = Budget::new(64 << 20);
        let floor = budget.floor;
        let heavy = Held::new(usize::MAX, budget.clone());
        let light = Held::new(usize::MAX, budget.clone());
        let small = light.charge(floor / 2);
        let calls: Vec<Charge> = (0..80).map(|_| heavy.charge(1 << 20)).collect();
        assert!(budget.used() > budget.limit());
        assert!(heavy.over(), "the heaviest connection must stop reading");
        let why = heavy
            .refusal()
            .expect("its new calls are refused")
            .message()
            .to_string();
        assert!(
            why.contains("max_memory") && why.contains("budget"),
            "{why}"
        );
        assert!(
            !light.over() && light.refusal().is_none(),
            "a light connection is served"
        );
        // Dropping the charges gives everything back, and the heavy connection goes on.
        drop(calls);
        assert!(!heavy.over() && heavy.refusal().is_none());
        assert!(!budget.ended(40 << 20, 64 << 20));
        assert!(budget.ended(40 << 20, 64 << 20), "time to give memory back");
        assert!(!budget.ended(0, 64 << 20), "once");
        drop(small);
        assert_eq!(budget.used(), 0);
    }
}
